"""``log`` of float64 arrays built from IEEE-754 basic operations alone, so that numpy on the host and torch on any
device give the same bits for the same input, wherever it sits in a batch.

Why: Spiffy ranks its drafts by the log-probabilities of the likeliest tokens (Eqs. 12-14, which it scores in
logarithms: :func:`~.spiffy.top_logprobs`), and a step laid out ahead of its update
(:meth:`~.spiffy.SpiffyDecoder.launch_batch`) ranks them where the logits are, before the host has seen anything,
while the host ranks them again after the update; both must choose the same drafts, bit for bit. A library's
``log`` (libm, numpy's and torch's SIMD loops, a GPU's) is accurate to an ulp or so, not correctly rounded, differs
between implementations, and on a CPU may round a vector's tail (a scalar loop) otherwise than its body, so the
two sides, or one request alone and the same request in a batch, could order two near-equal drafts differently.
Here every step is an addition, subtraction, multiplication or division (correctly rounded in IEEE arithmetic on
every platform; numpy and torch run each operator as a kernel of its own, so nothing is fused into an FMA; no
division by a Python scalar, which a CUDA kernel turns into a multiplication by its reciprocal), or exact bit
manipulation of the exponent; the result is within a few ulp of the true value, which is all a ranking needs.

Domain: positive normal float64 (the callers floor probabilities at 1e-300); a torch tensor of another floating
dtype is widened to float64 first (exactly); NaN gives NaN. Subnormals, zero, infinities and negative numbers
are outside it (their results are meaningless)."""

from __future__ import annotations

import math

import numpy as np
import torch

# fdlibm's split of ln 2: LN2_HI has 32 significant bits, so e * LN2_HI is exact for |e| < 2**21
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
SQRT2 = 1.41421356237309514547e+00
# log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716 for m in (sqrt(2) / 2, sqrt(2)]: the odd series in
# z = s * s up to s**21 (truncation below 1e-17), highest degree first
_LOG = [1.0 / (2 * n + 1) for n in range(10, -1, -1)]
_MANTISSA = (1 << 52) - 1
_BIAS = 1023


def log(x):
    """The natural logarithm of a float64 numpy array, or of a torch tensor on any device (module docstring): the
    same bits either way."""
    if isinstance(x, torch.Tensor):
        x = x.to(torch.float64)
        b = x.view(torch.int64)
        m = ((b & _MANTISSA) | (_BIAS << 52)).view(torch.float64)  # x = m * 2 ** e, m in [1, 2)
        e = (b >> 52) - _BIAS
        where, double = torch.where, (lambda t: t.to(torch.float64))
    else:
        x = np.asarray(x, dtype=np.float64)
        b = x.view(np.int64)
        m = ((b & _MANTISSA) | (_BIAS << 52)).view(np.float64)
        e = (b >> 52) - _BIAS
        where, double = np.where, (lambda a: a.astype(np.float64))
    big = m > SQRT2
    m = where(big, m * 0.5, m)  # m in (sqrt(2) / 2, sqrt(2)]
    e = double(where(big, e + 1, e))
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    q = z * 0.0 + _LOG[0]
    for c in _LOG[1:]:
        q = q * z + c
    out = e * LN2_HI + ((s * q) * 2.0 + e * LN2_LO)
    return where(x != x, math.nan, out)


def log_float(x: float) -> float:
    """:func:`log` of one Python float."""
    return float(log(np.array([x], dtype=np.float64))[0])
