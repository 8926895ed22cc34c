"""``model_executor.decoding.portable_math.log``: the same bits in numpy and torch (whatever the layout), within a
few ulp of libm, and monotone where Spiffy's rankings read it."""

import math

import numpy as np
import pytest
import torch

from model_executor.decoding import portable_math as pm


def _values():
    rng = np.random.default_rng(0)
    return np.concatenate([np.exp(rng.uniform(-690, 690, 20000)), rng.uniform(0.5, 2.0, 20000),
                           rng.uniform(0, 1, 20000).astype(np.float32).astype(np.float64),  # float32 confidences
                           [1e-300, 1.0, 2.0, 0.5, np.nextafter(1.0, 2.0), np.nextafter(1.0, 0.0), math.sqrt(2.0),
                            np.nextafter(math.sqrt(2.0), 2.0), np.finfo(np.float64).max]])


def test_log_is_the_same_in_numpy_and_torch_and_close_to_libm():
    x = _values()
    x = x[x > 0]
    a, b = pm.log(x), pm.log(torch.from_numpy(x)).numpy()
    assert a.dtype == np.float64 and np.array_equal(a.view(np.int64), b.view(np.int64))
    # a strided view, a 2-D tensor, one element: the same bits (no value depends on where it sits)
    assert np.array_equal(pm.log(torch.from_numpy(x)[::7]).numpy().view(np.int64), a[::7].view(np.int64))
    n = x.size // 4 * 4
    assert np.array_equal(pm.log(torch.from_numpy(x[:n]).view(-1, 4).t()).t().reshape(-1).numpy(), a[:n])
    assert pm.log_float(float(x[12345])) == a[12345]
    want = np.log(x)
    nz = want != 0
    assert (np.abs(a[nz] - want[nz]) / np.spacing(np.abs(want[nz]))).max() <= 4 and (a[~nz] == 0).all()
    assert pm.log_float(1.0) == 0.0


def test_log_widens_other_float_tensors_and_keeps_nan():
    c = torch.rand(1000, generator=torch.Generator().manual_seed(1)) + 1e-6  # float32, as a step's confidences
    assert torch.equal(pm.log(c), pm.log(c.double())) and pm.log(c).dtype == torch.float64
    assert math.isnan(pm.log_float(math.nan)) and bool(pm.log(torch.tensor([math.nan])).isnan().all())


def test_monotone_where_a_ranking_reads_it():
    """Spiffy ranks drafts by sums of these: over a dense grid the order never inverts."""
    x = np.sort(np.concatenate([np.linspace(1e-6, 5, 40001), np.exp(np.linspace(-690, 3, 40001))]))
    assert (np.diff(pm.log(x)) >= 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_log_on_cuda_is_the_hosts():
    """What a step laid out ahead relies on: the GPU's result is the host's, bit for bit."""
    x = _values()
    x = x[x > 0]
    got = pm.log(torch.from_numpy(x).cuda()).cpu().numpy()
    assert np.array_equal(got.view(np.int64), pm.log(x).view(np.int64))
