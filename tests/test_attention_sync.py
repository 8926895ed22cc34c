"""The vLLM attention builder plans on the host: for the step batches the project's runners publish (prompt
prefills, prefix and DualCache steps with extra canvases, SDAR's block-causal layers, PRESTO's token trees) it
reads no tensor that lives on the device in a GPU run, and its metadata attends as the dense oracle does.

The device tensors vLLM hands the builder (``CommonAttentionMetadata``'s ``query_start_loc``, ``seq_lens``,
``block_table_tensor``, ``slot_mapping``, ``positions``) are stand-ins here (``sync_audit.on_device``): the
audit records every host read of them, and every blocking copy to a device.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from sync_audit import SyncAudit, on_device  # noqa: E402
from test_attention_ref import _oracle  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from attention_backends.prefix_attention import flashinfer_available  # noqa: E402
from attention_backends.step_batch import HostPages, Rows, build_step_batch, current_step, set_step  # noqa: E402
from attention_backends.vllm_backend import PSDAttentionImpl, kv_views, psd_attention_backend, vllm_slots  # noqa: E402
from model_executor.dllm_request import DLLMStep  # noqa: E402

H, HKV, D, PAGE, WIDTH = 4, 2, 16, 4, 16
LAYER = "model.layers.0.self_attn.attn"


def _dllm_entries(g):
    """A prompt prefill, a DualCache later step (the block's window, three canvases, reading the kept suffix
    after it) and a prefix-cache step (block plus the masks after it, two canvases)."""
    return [Rows(12, 0),
            DLLMStep(w0=40, w1=48, b0=40, b1=48, tokens=torch.randint(3, 90, (3, 8), generator=g), keep=40, shift=0,
                     suffix=(48, 56)),
            DLLMStep(w0=17, w1=33, b0=17, b1=25, tokens=torch.randint(3, 90, (2, 16), generator=g), keep=17, shift=0)]


def _presto_entries(g):
    """PRESTO's verification: a causal prompt prefill and two token trees (each node sees its ancestors)."""
    out = [Rows(7, 0, positions=torch.arange(7), mask=torch.ones(7, 7, dtype=torch.bool).tril())]
    for c, n in ((30, 9), (11, 6)):
        m = torch.eye(n, dtype=torch.bool)
        depth = [0] * n
        for j in range(1, n):
            parent = int(torch.randint(0, j, (1,), generator=g))
            m[j] |= m[parent]
            depth[j] = depth[parent] + 1
        out.append(Rows(n, c, positions=c + torch.tensor(depth), mask=m))
    return out


CASES = {  # layer pattern, attention block, entries
    "llada": ("bidirectional", 0, _dllm_entries),
    "sdar": ("block_causal", 4, _dllm_entries),
    "presto": ("causal", 0, _presto_entries),
}


def _step(case: str, seed: int = 0, page: int = PAGE):
    """The batch, vLLM's ``CommonAttentionMetadata`` for it (device tensors as stand-ins), the runner's host
    block table (all its rows: ``max_num_reqs`` of them) and a builder."""
    pattern, block, entries = CASES[case]
    g = torch.Generator().manual_seed(seed)
    batch = build_step_batch(entries(g))
    R, T = batch.num_requests, batch.num_scheduled
    qsl = batch.scheduled_lens.cumsum(0)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qsl]).to(torch.int32)
    seq = (batch.prefix_lens + batch.scheduled_lens).to(torch.int32)
    host_table = torch.zeros(R + 2, WIDTH, dtype=torch.int32)  # the runner's buffer has spare rows
    host_table[:R] = torch.randperm(R * WIDTH, generator=g)[: R * WIDTH].view(R, WIDTH).to(torch.int32) + 1
    slots = []
    for r in range(R):  # vLLM's slot mapping, token by token
        for i in range(int(qsl[r + 1] - qsl[r])):
            pos = int(batch.prefix_lens[r]) + i
            slots.append(int(host_table[r, pos // page]) * page + pos % page)
    cam = CommonAttentionMetadata(
        query_start_loc=on_device(qsl.clone()), query_start_loc_cpu=qsl, seq_lens=on_device(seq.clone()),
        num_reqs=R, num_actual_tokens=T, max_query_len=int(batch.scheduled_lens.max()), max_seq_len=int(seq.max()),
        block_table_tensor=on_device(host_table[:R].clone()), slot_mapping=on_device(torch.tensor(slots)),
        positions=on_device(batch.positions[:T].clone()), seq_lens_cpu_upper_bound=seq.clone())
    return batch, cam, host_table, pattern, block


def _builder(pattern: str, block: int, device, dtype=torch.float64, head_dim: int = D):
    cls = psd_attention_backend(pattern, block).get_builder_cls()
    return cls.for_geometry(H, HKV, head_dim, PAGE, dtype, device, scale=0.3, layer_names=(LAYER,))


def _publish(batch, host_table, page: int = PAGE):
    """What ``PSDRunnerMixin._publish`` publishes (``compat.host_pages``: the rows of the step's requests)."""
    batch.pages = HostPages((frozenset({LAYER, "model.layers.1.self_attn.attn"}),), (page,),
                            (host_table[: batch.num_requests],))
    set_step(batch)


@pytest.fixture(autouse=True)
def _no_step_left():
    yield
    set_step(None)


def test_the_audit_sees_every_op():
    t, s = torch.tensor([1, 0, 3]), torch.tensor(2)
    with SyncAudit(packages=("tests",)) as audit:
        s.item(), t.tolist(), bool(s), int(s), [0, 1, 2][s], float(s), t.nonzero(), torch.nonzero(t), t.cpu()
        t.to("cpu"), t.numpy(), torch.equal(t, t), t[t > 0], torch.repeat_interleave(t, t), t.masked_select(t > 0)
        torch.unique(t), torch.where(t > 0), torch.bincount(t), t.clone().copy_(t)
        t.to(torch.float32), torch.where(t > 0, t, 0)  # a dtype conversion, a three-argument where: not recorded
    where = "tests/test_attention_sync.py:test_the_audit_sees_every_op"
    assert audit.sites == {f"{where} {op}" for op in (
        "item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero", "cpu", "to(cpu)", "numpy",
        "equal", "mask indexing", "repeat_interleave", "masked_select", "unique", "where", "bincount", "copy_")}
    d = on_device(t)
    with SyncAudit(device_only=True, packages=("tests",)) as audit:
        s.item(), t.cpu(), t.nonzero(), t.to("meta", non_blocking=True)  # host reads and an async copy: nothing
        torch.where(t > 0), torch.bincount(t), t.clone().copy_(t)  # of host tensors: nothing
        e = (d + 1)[1:]  # a device tensor's results are device tensors
        e.sum().item()
        h = e.cpu()
        h.tolist()  # on the host now
        t[d > 1], torch.repeat_interleave(t, d), t.to("meta")  # a device mask and repeats; a blocking copy
        torch.where(d > 1), torch.bincount(d), t.clone().copy_(d), d.clone().copy_(d)  # the last: on the device
    assert audit.sites == {f"{where} {op}" for op in ("item", "cpu", "mask indexing", "repeat_interleave",
                                                      "to(device) blocking", "where", "bincount", "copy_")}
    assert "test_attention_sync.py" in audit.report()


def test_the_audit_sees_uploads_under_the_device_proxy():
    """Where the device is the host (an ``on_device`` stand-in reports the CPU), an upload to a stand-in's device
    is no copy at all, so the audit cannot tell it from host work; under a ``DeviceProxy`` the device is
    ``cuda:0``, and every blocking upload to it is recorded (``non_blocking`` ones, and copies within the
    device, are not)."""
    from device_proxy import DeviceProxy, mark

    t = torch.tensor([1, 0, 3])
    site = "tests/test_attention_sync.py:uploads"

    def uploads(x):
        t.to(x.device), torch.tensor([1, 2], device=x.device), x.copy_(t)  # blocking uploads
        t.to(x.device, non_blocking=True), x.copy_(t, non_blocking=True)  # asynchronous ones
        x.to(x.device), x.copy_(x + 1)  # within the device
        t.clone().copy_(x), torch.bincount(torch.tensor([1, 1]).to(x.device, non_blocking=True))  # two reads

    with SyncAudit(device_only=True, packages=("tests",)) as audit:
        uploads(on_device(t.clone()))
    # the uploads stayed on the host, unseen; and the stand-in's own device is the host: .to it reads as a move there
    assert audit.sites == {f"{site} copy_", f"{site} to(cpu)"}, audit.report()
    with DeviceProxy(), SyncAudit(device_only=True, packages=("tests",)) as audit:
        uploads(mark(t.clone()))
    assert audit.sites == {f"{site} {op}" for op in ("to(device) blocking", "tensor(device=...)",
                                                    "copy_(device) blocking", "copy_", "bincount")}, audit.report()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_builder_reads_no_device_tensor(case, device):
    """``meta`` stands in for CUDA: the backend copies its plan there, and any host read of it would raise."""
    batch, cam, host_table, pattern, block = _step(case)
    assert batch.num_extra > 0 or case == "presto"
    assert batch.suffix_lens is not None or case == "presto"
    builder = _builder(pattern, block, device)
    _publish(batch, host_table)
    with SyncAudit(device_only=True) as audit:
        md = builder.build(0, cam)
    allowed = {
        # on a CPU device only: vLLM's slot mapping is a host tensor there, and the builder checks the slots it
        # derives from the host block table against it
        "attention_backends/vllm_backend.py:build equal",
    } if device == "cpu" else set()
    assert audit.sites == allowed, audit.report()
    assert md.write_rows is None and md.write_slots is not None  # vLLM's own slot mapping writes K/V


def test_a_forward_no_runner_published_reads_the_device_once():
    """vLLM's own layout (no published step; a dummy run's -1 slots): the block table and the slot mapping are
    read back, in one place, and nothing else."""
    batch, cam, host_table, pattern, block = _step("llada")
    cam.slot_mapping = on_device(torch.cat([cam.slot_mapping[:5].as_subclass(torch.Tensor),
                                            torch.full((cam.num_actual_tokens - 5,), -1)]))
    builder = _builder(pattern, block, "cpu")
    with SyncAudit(device_only=True) as audit:
        md = builder.build(0, cam)
    assert audit.sites == {"attention_backends/vllm_backend.py:device_pages cpu"}, audit.report()
    assert md.write_rows.tolist() == [0, 1, 2, 3, 4]
    assert md.plan.num_tokens == cam.num_actual_tokens  # one segment per request, no extra rows


def test_a_step_published_without_host_pages_keeps_its_layout():
    """A step set without the host block tables keeps its rows (extra canvases included) and reads the pages
    back from the device, in the same one place."""
    batch, cam, host_table, pattern, block = _step("llada")
    builder = _builder(pattern, block, "cpu")
    set_step(batch)
    with SyncAudit(device_only=True) as audit:
        md = builder.build(0, cam)
    assert audit.sites == {"attention_backends/vllm_backend.py:device_pages cpu"}, audit.report()
    assert md.plan.num_tokens == batch.num_rows > cam.num_actual_tokens and md.write_rows is None


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kernel", ["cpu_flash", "sdpa"])
def test_the_builders_metadata_attends_as_the_oracle(case, kernel):
    """``build`` then the layer's ``forward`` (K/V written at vLLM's slots into its K|V pages, then attention,
    rows in the model's order) equal the dense oracle over the published batch."""
    batch, cam, host_table, pattern, block = _step(case, seed=1)
    builder = _builder(pattern, block, "cpu")
    builder.attn.kernel_choice = kernel
    _publish(batch, host_table)
    md = builder.build(0, cam)
    N = batch.num_rows
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(N, h, D, generator=g, dtype=torch.float64) for h in (H, HKV, HKV))
    pages = int(host_table.max()) + 1
    kv_cache = torch.randn(pages, PAGE, HKV, 2 * D, generator=g, dtype=torch.float64).transpose(1, 2)  # vLLM's
    impl = PSDAttentionImpl(H, D, 0.3, num_kv_heads=HKV)
    P = 5  # padding rows after the step's (vLLM sizes a forward up, for CUDA graphs): inert, zero output
    q, k, v = (torch.cat([t, torch.randn(P, *t.shape[1:], generator=g, dtype=t.dtype)]) for t in (q, k, v))
    out = impl.forward(None, q, k, v, kv_cache, md, torch.full((N + P, H, D), float("nan"), dtype=torch.float64))
    assert torch.equal(out[N:], torch.zeros(P, H, D, dtype=torch.float64))
    out = out[:N]
    kc, vc = kv_views(kv_cache, D)
    order = batch.order if batch.order is not None else torch.arange(N)
    plan = batch.plan(host_table[: batch.num_requests], PAGE, pattern, block)
    want = _oracle(plan, q[order], k[order], v[order], kc, vc, 0.3)
    assert torch.allclose(out[order], want, atol=1e-10), case
    set_step(None)


def test_the_builder_checks_the_step_against_vllms_batch_on_the_host():
    batch, cam, host_table, pattern, block = _step("llada")
    builder = _builder(pattern, block, "cpu")
    _publish(batch, host_table)
    cam.seq_lens_cpu_upper_bound = cam.seq_lens_cpu_upper_bound + torch.tensor([0, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="is not the batch vLLM scheduled"):
        builder.build(0, cam)
    batch, cam, host_table, pattern, block = _step("llada")
    _publish(batch, host_table)
    cam.slot_mapping = on_device(cam.slot_mapping.as_subclass(torch.Tensor) + 1)
    with pytest.raises(RuntimeError, match="differ from vLLM's slot mapping"):
        builder.build(0, cam)


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_slots_are_vllms_slot_mapping(case):
    """Off the CPU the builder derives the scheduled rows' cache slots from the host block table (vLLM's slot
    mapping is on the device): the same slots, token by token, as vLLM's."""
    batch, cam, host_table, _, _ = _step(case)
    R = cam.num_reqs
    qsl = cam.query_start_loc_cpu[: R + 1].long()
    prefix = cam.seq_lens_cpu_upper_bound[:R].long() - qsl.diff()
    assert torch.equal(vllm_slots(host_table[:R], prefix, qsl, PAGE), cam.slot_mapping.as_subclass(torch.Tensor))


def test_publish_attaches_the_runners_host_block_tables():
    """``PSDRunnerMixin._publish`` hands the builder views of vLLM's host block tables (no copy), per KV-cache
    group with its layers and page size; ``_publish(None)`` clears the step."""
    from psd_plugin.vllm.runner import PSDRunnerMixin

    buffers = [torch.arange(6 * WIDTH, dtype=torch.int32).view(6, WIDTH), torch.zeros(6, 8, dtype=torch.int32)]
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(block_table=SimpleNamespace(block_tables=[
            SimpleNamespace(block_size=PAGE, block_table=SimpleNamespace(cpu=buffers[0])),
            SimpleNamespace(block_size=32, block_table=SimpleNamespace(cpu=buffers[1]))])),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[LAYER]),
                                                         SimpleNamespace(layer_names=["other"])]),
        _tp_group=None)  # one rank: the layout check has nothing to compare with
    runner._check_ranks = lambda b: PSDRunnerMixin._check_ranks(runner, b)
    runner._tensor_parallel_group = lambda: PSDRunnerMixin._tensor_parallel_group(runner)
    batch = build_step_batch(_dllm_entries(torch.Generator().manual_seed(0)))
    PSDRunnerMixin._publish(runner, batch)
    assert current_step() is batch
    pages = batch.pages
    assert pages.group(LAYER) == 0 and pages.group("other") == 1 and pages.page_sizes == (PAGE, 32)
    assert pages.block_tables[0].shape == (3, WIDTH) and pages.block_tables[0].data_ptr() == buffers[0].data_ptr()
    PSDRunnerMixin._publish(runner, None)
    assert current_step() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_builder_does_not_synchronise_on_cuda(case, dtype):
    """On CUDA (FlashInfer in bfloat16 where it is installed, else the PyTorch backend's SDPA kernel) no PyTorch op
    of ``build`` synchronises with the device (``torch.cuda.set_sync_debug_mode("error")``), and the layer's
    output equals the oracle. Head size 64: FlashInfer has no kernel for this file's 16 (``auto`` then takes
    PyTorch: ``test_attention_ref.py::test_backend_choice``)."""
    d = 64
    batch, cam, host_table, pattern, block = _step(case, seed=1)
    for name in ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions"):
        setattr(cam, name, getattr(cam, name).as_subclass(torch.Tensor).cuda())
    builder = _builder(pattern, block, "cuda", dtype, head_dim=d)
    _publish(batch, host_table)
    builder.build(0, cam)  # first plans may compile or load kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = builder.build(0, cam)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    N = batch.num_rows
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(N, h, d, generator=g) for h in (H, HKV, HKV))
    pages = int(host_table.max()) + 1
    phys = torch.randn(pages, PAGE, HKV, 2 * d, generator=g)
    kv_cache = phys.to("cuda", dtype).transpose(1, 2)
    impl = PSDAttentionImpl(H, d, 0.3, num_kv_heads=HKV)
    out = impl.forward(None, *(t.to("cuda", dtype) for t in (q, k, v)), kv_cache, md,
                       torch.empty(N, H, d, device="cuda", dtype=dtype))
    kc, vc = kv_views(kv_cache, d)
    order = batch.order if batch.order is not None else torch.arange(N)
    plan = batch.plan(host_table[: batch.num_requests], PAGE, pattern, block)
    want = _oracle(plan, q[order], k[order], v[order], kc, vc, 0.3)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert builder.attn.name == ("flashinfer" if dtype == torch.bfloat16 and flashinfer_available() else "torch")
    assert torch.allclose(out[order.cuda()].double().cpu(), want, atol=tol, rtol=tol), case


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kernel", ["vllm", "torch"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_head_major_pages_attend_as_the_oracle(monkeypatch, case, kernel, dtype, tol):
    """vLLM's CPU page layout (``LBHNC``, what the backend declares on the CPU): K/V written at vLLM's slots, then
    vLLM's own paged kernel for every row where it applies (``kernel_rows``: the prompt prefill, the DualCache
    step with its kept suffix and the prefix-cache step, their draft canvases one kernel call per canvas index;
    not SDAR's block-causal layers or PRESTO's trees, which PyTorch takes); ``PSD_CPU_ATTENTION=torch`` runs
    PyTorch for every row. Equal to the dense oracle, and the cache keeps the scheduled rows' K/V."""
    from attention_backends import vllm_cpu_attention
    from attention_backends.vllm_cpu_attention import kernel_rows, page_views

    monkeypatch.setenv("PSD_CPU_ATTENTION", kernel)
    monkeypatch.setattr(vllm_cpu_attention, "PASSES_MIN_WORK", 0)  # this small step's drafts through the kernel
    Dk, page = 64, 32  # a head size and a page vLLM's CPU kernel runs
    from attention_backends.vllm_cpu_attention import kernel_isa, kernel_supports

    if kernel == "vllm" and not kernel_supports(Dk, page, dtype):  # e.g. AMX for bfloat16: PyTorch attends instead
        pytest.skip(f"vLLM's CPU kernel for {dtype} here is {kernel_isa(dtype, page, Dk)!r}, whose page interior "
                    "the backend does not read")
    batch, cam, host_table, pattern, block = _step(case, seed=1, page=page)
    cls = psd_attention_backend(pattern, block).get_builder_cls()
    builder = cls.for_geometry(H, HKV, Dk, page, dtype, "cpu", scale=0.3, layer_names=(LAYER,), head_major=True)
    assert (builder.kernel is not None) == (kernel == "vllm")
    _publish(batch, host_table, page)
    md = builder.build(0, cam)
    assert (md.kernel is not None) == (kernel == "vllm" and kernel_rows(batch, pattern) is not None)
    # vLLM's op writes the new K/V wherever its geometry runs, PyTorch's attention too (the cache check below)
    assert (md.writer is not None) == (kernel == "vllm")
    N = batch.num_rows
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(N, h, Dk, generator=g).to(dtype) for h in (H, HKV, HKV))
    pages = int(host_table.max()) + 1
    kv_cache = torch.randn(pages, HKV, page, 2 * Dk, generator=g).to(dtype)  # vLLM's CPU layout: contiguous
    impl = PSDAttentionImpl(H, Dk, 0.3, num_kv_heads=HKV)
    out = impl.forward(None, q, k, v, kv_cache, md, torch.full((N + 3, H, Dk), float("nan"), dtype=dtype))
    assert torch.equal(out[N:], torch.zeros(3, H, Dk, dtype=dtype))
    kp, vp = page_views(kv_cache, Dk)
    order = batch.order if batch.order is not None else torch.arange(N)
    plan = batch.plan(host_table[: batch.num_requests], page, pattern, block)
    want = _oracle(plan, q[order], k[order], v[order], kp.transpose(1, 2), vp.transpose(1, 2), 0.3)
    assert torch.allclose(out[:N][order].double(), want, atol=tol), (out[:N][order].double() - want).abs().max()
    # the cache keeps the scheduled rows' K/V, whatever the draft canvases wrote at the same slots on the way
    slots = cam.slot_mapping.cpu().long()
    T = batch.num_scheduled
    assert torch.equal(kp[slots // page, :, slots % page], k[:T]) and torch.equal(vp[slots // page, :, slots % page],
                                                                                  v[:T])
    set_step(None)


def test_a_large_batch_lays_out_as_its_entries_do_alone():
    """Many entries (the layout's index pieces then go through numpy): every row's position, id, plan order and
    logits row in the batch are those of its entry laid out alone, shifted to where the batch puts it (the
    scheduled rows of every entry first, then every entry's further canvases)."""
    g = torch.Generator().manual_seed(3)
    entries = [e for _ in range(7) for e in _dllm_entries(g)]  # 21 entries, 14 of them with further canvases
    batch = build_step_batch(entries)
    alone = [build_step_batch([e]) for e in entries]
    T, E = batch.num_scheduled, batch.num_extra
    assert T == sum(b.num_scheduled for b in alone) and E == sum(b.num_extra for b in alone)
    sched = torch.cat([b.positions[: b.num_scheduled] for b in alone])
    extra = torch.cat([b.positions[b.num_scheduled:] for b in alone])
    assert torch.equal(batch.positions, torch.cat([sched, extra]))
    assert torch.equal(batch.extra_ids, torch.cat([b.extra_ids for b in alone if b.extra_ids is not None]))
    # plan order: entry by entry, its scheduled rows (where the batch put them) then its further canvases
    order, logits, t, x = [], [], 0, T
    for b in alone:
        local = torch.arange(b.num_rows) if b.order is None else b.order
        moved = torch.where(local < b.num_scheduled, local + t, local - b.num_scheduled + x)
        order.append(moved)
        logits.append(torch.where(b.logits_rows < b.num_scheduled, b.logits_rows + t,
                                  b.logits_rows - b.num_scheduled + x))
        t, x = t + b.num_scheduled, x + b.num_extra
    assert torch.equal(batch.order, torch.cat(order))
    assert torch.equal(batch.logits_rows, torch.cat(logits))


def _layout(b) -> dict:
    """Every field of a batch that its layout sets (the published pages aside)."""
    out = {f: getattr(b, f) for f in ("num_scheduled", "canvas_rows", "layout_key", "kind", "custom_masks")}
    for f in ("scheduled_lens", "positions", "input_ids", "extra_ids", "order", "qo_indptr", "seg_indptr",
              "prefix_lens", "suffix_starts", "suffix_lens", "logits_rows", "rewrite_ids"):
        t = getattr(b, f)
        out[f] = None if t is None else (t.dtype, t.tolist())
    return out


@pytest.mark.parametrize("seed", range(4))
def test_a_batch_of_steps_laid_out_by_arrays_is_the_entry_by_entry_layout(seed):
    """A batch of plain dLLM steps (from :data:`ARRAY_LAYOUT_MIN` entries) is laid out from one array of their
    geometry: every field equals the entry-by-entry layout's, for steps with one to four canvases, with and
    without a kept suffix, windows before their block (the prefix cache's masks after it) and blocks shifted in
    their window; a batch with a prefill or a replay's tail is left to the entry-by-entry layout."""
    from attention_backends import step_batch

    g = torch.Generator().manual_seed(seed)
    entries = []
    for _ in range(int(torch.randint(step_batch.ARRAY_LAYOUT_MIN, 30, (1,), generator=g))):
        w0, L, K, after, pre, shift = (int(torch.randint(lo, hi, (1,), generator=g))
                                       for lo, hi in ((0, 200), (1, 9), (1, 5), (0, 3), (1, 4), (0, 2)))
        S = pre + L + after * L  # committed positions before the block in the window, the block, masks after it
        suffix = (w0 + S, w0 + S + 8) if after == 0 and bool(torch.randint(0, 2, (1,), generator=g)) else (0, 0)
        entries.append(DLLMStep(w0=w0, w1=w0 + S, b0=w0 + pre, b1=w0 + pre + L, shift=shift, keep=w0,
                                tokens=torch.randint(3, 90, (K, S), generator=g), suffix=suffix))
    # tokens as a step may hold them too: int32, a strided (non-contiguous) view
    e = entries[0]
    entries[0] = dataclasses.replace(e, tokens=e.tokens.to(torch.int32))
    e = entries[-1]
    entries[-1] = dataclasses.replace(e, tokens=e.tokens.repeat_interleave(2, dim=1)[:, ::2])
    assert not entries[-1].tokens.is_contiguous()
    fast = step_batch._build_steps(entries)
    assert fast is not None
    assert _layout(fast) == _layout(step_batch._build_entries(entries))
    assert fast.order is not None and fast.suffix_starts is not None  # the seeds draw both
    assert len({e.first_row for e in entries}) > 1
    one = [DLLMStep(w0=10 * i, w1=10 * i + 6, b0=10 * i + 1, b1=10 * i + 5, shift=1, keep=10 * i,
                    tokens=torch.randint(3, 90, (1, 6), generator=g)) for i in range(8)]  # no further canvas
    assert _layout(step_batch._build_steps(one)) == _layout(step_batch._build_entries(one))
    assert step_batch._build_steps(one).order is None and step_batch._build_steps(one).extra_ids is None
    # further canvases on the last entry alone: its extra rows follow the scheduled ones in plan order too
    last = one[:-1] + [dataclasses.replace(one[-1], tokens=torch.randint(3, 90, (3, 6), generator=g))]
    assert _layout(step_batch._build_steps(last)) == _layout(step_batch._build_entries(last))
    assert step_batch._build_steps(last).order is None and step_batch._build_steps(last).extra_ids is not None
    # a dual-cache block's first step covers its kept suffix (stores it) beside later steps that read one
    covers = [dataclasses.replace(x, w1=x.w1 + 8, tokens=torch.randint(3, 90, (1, 14), generator=g),
                                  suffix=(x.w1, x.w1 + 8)) for x in one[:4]]
    reads = [dataclasses.replace(x, suffix=(x.w1, x.w1 + 8)) for x in one[4:]]
    mixed = covers + reads
    assert {x.reads_suffix for x in covers} == {0} and {x.reads_suffix for x in reads} == {8}
    assert _layout(step_batch._build_steps(mixed)) == _layout(step_batch._build_entries(mixed))
    assert step_batch._build_steps(entries + [Rows(4, 0)]) is None
    tail = DLLMStep(w0=0, w1=4, b0=0, b1=4, shift=0, keep=0, tokens=torch.full((1, 4), 5), committed=6,
                    tail=torch.tensor([7, 8]))
    assert step_batch._build_steps(entries + [tail]) is None


def test_the_array_layout_takes_batches_from_its_threshold(monkeypatch):
    """:func:`build_step_batch` lays out a batch of plain steps by arrays from ``ARRAY_LAYOUT_MIN`` entries, entry
    by entry below it."""
    from attention_backends import step_batch

    calls = []
    real = step_batch._build_steps
    monkeypatch.setattr(step_batch, "_build_steps", lambda entries: calls.append(len(entries)) or real(entries))
    n = step_batch.ARRAY_LAYOUT_MIN
    steps = [DLLMStep(w0=9 * i, w1=9 * i + 8, b0=9 * i, b1=9 * i + 8, shift=0, keep=9 * i,
                      tokens=torch.full((2, 8), 5)) for i in range(n)]
    small, large = build_step_batch(steps[:-1]), build_step_batch(steps)
    assert calls == [n] and small.num_requests == n - 1 and large.num_requests == n


def test_draft_canvases_are_kernel_passes_over_the_scheduled_rows_slots():
    """``canvas_passes``: the second canvas of every request that has one, then the third, each row naming the
    scheduled row whose slot it stands on; a batch whose further canvases are not its scheduled rows' length has
    none."""
    from attention_backends.vllm_cpu_attention import canvas_passes

    g = torch.Generator().manual_seed(0)
    prefill, dual, prefix = _dllm_entries(g)  # 12 rows; 3 canvases of 8; 2 canvases of 16
    batch = build_step_batch([prefill, dual, prefix])
    T = batch.num_scheduled
    assert T == 36 and batch.num_extra == 32
    first, second = canvas_passes(batch)
    assert first.reqs.tolist() == [1, 2] and second.reqs.tolist() == [1]
    # extra rows in model order: the dual step's canvases 2 and 3 (rows 36-51), then the prefix step's second
    assert first.rows.tolist() == list(range(36, 44)) + list(range(52, 68))
    assert first.write.tolist() == list(range(12, 20)) + list(range(20, 36))
    assert second.rows.tolist() == list(range(44, 52)) and second.write.tolist() == list(range(12, 20))
    assert canvas_passes(build_step_batch([prefill])) == []
    assert canvas_passes(build_step_batch(_presto_entries(g))) == []


def test_draft_canvases_go_through_the_kernel_where_the_step_is_large():
    """``passes_pay``: a step with drafts whose attention work is small (one request, a short prefix, the embedded
    heads) stays on PyTorch; 16 requests over long prefixes, or LLaDA-8B's heads, take the kernel."""
    from attention_backends.vllm_cpu_attention import passes_pay

    def step(requests, prefix):
        g = torch.Generator().manual_seed(0)
        batch = build_step_batch([DLLMStep(w0=prefix, w1=prefix + 9, b0=prefix + 1, b1=prefix + 9,
                                           tokens=torch.randint(3, 90, (4, 9), generator=g), keep=prefix, shift=0,
                                           suffix=(prefix + 9, prefix + 33)) for _ in range(requests)])
        return batch

    assert not passes_pay(step(1, 40), 4, 64)
    assert passes_pay(step(16, 400), 4, 64)
    assert passes_pay(step(1, 40), 32, 128)


def test_the_kernel_takes_the_scheduled_rows_that_see_exactly_their_pages():
    """``kernel_rows``: a prefill and a DualCache first canvas (its kept suffix right after it) qualify, with
    their key counts; a prefix-cache step whose first canvas is not all its scheduled rows, a suffix elsewhere,
    block-causal and custom masks do not."""
    from attention_backends.vllm_cpu_attention import kernel_rows

    g = torch.Generator().manual_seed(0)
    prefill, dual, prefix = _dllm_entries(g)
    rows = kernel_rows(build_step_batch([prefill, dual]), "bidirectional")
    assert rows.query_start_loc.tolist() == [0, 12, 20] and rows.seq_lens.tolist() == [12, 56] and not rows.causal
    assert kernel_rows(build_step_batch([prefill, dual]), "block_causal") is None
    assert kernel_rows(build_step_batch([prefill, prefix]), "bidirectional") is not None  # window [17, 33): 16 rows
    away = DLLMStep(w0=40, w1=48, b0=40, b1=48, tokens=torch.zeros(1, 8, dtype=torch.long), keep=40, shift=0,
                    suffix=(50, 56))
    assert kernel_rows(build_step_batch([away]), "bidirectional") is None
    assert kernel_rows(build_step_batch(_presto_entries(g)), "causal") is None  # custom tree masks


def test_the_cpu_kernel_switch_names_its_values(monkeypatch):
    from attention_backends.vllm_backend import cpu_kernel_choice

    monkeypatch.setenv("PSD_CPU_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"PSD_CPU_ATTENTION='flash'; allowed: vllm, torch"):
        _builder("bidirectional", 0, "cpu")
    monkeypatch.delenv("PSD_CPU_ATTENTION")
    assert cpu_kernel_choice() == "vllm"
