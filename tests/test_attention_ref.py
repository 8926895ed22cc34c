"""attention_backends: a paged prefix + segmented new tokens under every mask kind equals dense masked attention.

The oracle builds, per request, the full key set ``[prefix | new tokens]`` and one dense boolean mask, and runs a
plain softmax. Cases vary page sizes, head counts and GQA ratios, prefix lengths (0 included), segment counts
and mask kinds, in float64, float32 and bfloat16, for both kernels of the PyTorch backend. The FlashInfer backend
is checked against the same oracle on CUDA (``gpu`` marker), and its planning on the CPU against a stand-in for
flashinfer 0.7.0.post1 written from its source (``tests/oracles/fake_flashinfer.py``).
"""

import sys

import numpy as np
import pytest
import torch

from attention_backends import prefix_attention
from attention_backends.prefix_attention import AttentionPlan, make_backend, pack_mask, to_device, unpack_mask
from attention_backends.torch_backend import KERNELS, TorchPrefixAttention

KINDS = ["bidirectional", "causal", "block_causal", "custom"]


def _case(seed, kind, H=4, Hkv=2, D=16, page=4, dtype=torch.float64, device="cpu", suffix=False, fixed=False):
    """A random batch: requests with prefixes on shuffled pages, each request's rows cut into segments;
    ``suffix``: each request also has a cached suffix (0 to 9 positions) after its rows' positions. ``fixed``:
    one step shape for every seed (3 requests, all with a prefix, segments of 3, 5 | 4 | 2, 6, 1 rows, suffixes
    of 1 to 9 positions) whose prefix lengths, pages, masks and values change with the seed (CUDA-graph mode)."""
    g = torch.Generator().manual_seed(seed)
    if fixed:
        R, segs_per_req, seg_lens = 3, [2, 1, 3], [3, 5, 4, 2, 6, 1]
        prefix_lens = torch.randint(1, 20, (R,), generator=g)
    else:
        R = int(torch.randint(1, 6, (1,), generator=g))
        prefix_lens = torch.randint(0, 20, (R,), generator=g)
        prefix_lens[0] = 0  # always a request without a prefix
        segs_per_req = [int(torch.randint(1, 5, (1,), generator=g)) for _ in range(R)]
        seg_lens = [int(torch.randint(1, 9, (1,), generator=g)) for _ in range(sum(segs_per_req))]
    seg_indptr = torch.tensor(np.cumsum([0] + seg_lens))
    qo, i = [0], 0
    for n in segs_per_req:
        qo.append(int(seg_indptr[i + n]))
        i += n
    suffix_starts = suffix_lens = None
    end = prefix_lens
    if suffix:
        suffix_lens = torch.randint(1 if fixed else 0, 10, (R,), generator=g)
        suffix_starts = prefix_lens + torch.tensor(qo).diff() + torch.randint(0, 3, (R,), generator=g)
        end = suffix_starts + suffix_lens
    num_pages = int(((end + page - 1) // page).sum()) + 3
    k_cache = torch.randn(num_pages, page, Hkv, D, generator=g, dtype=dtype)
    v_cache = torch.randn(num_pages, page, Hkv, D, generator=g, dtype=dtype)
    perm, used = torch.randperm(num_pages, generator=g), 0
    width = max(1, int((end.max() + page - 1) // page))
    table = torch.zeros(R, width, dtype=torch.int32)
    for r, n in enumerate(end.tolist()):
        m = (n + page - 1) // page
        table[r, :m] = perm[used: used + m].int()
        used += m
    T = int(seg_indptr[-1])
    q = torch.randn(T, H, D, generator=g, dtype=dtype)
    k = torch.randn(T, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(T, Hkv, D, generator=g, dtype=dtype)
    positions = torch.cat([torch.arange(int(prefix_lens[r]), int(prefix_lens[r]) + qo[r + 1] - qo[r])
                           for r in range(R)])
    custom = None
    if kind == "custom":  # a random tree per segment: each token sees its ancestors and itself
        custom = []
        for n in seg_lens:
            m = torch.eye(n, dtype=torch.bool)
            for j in range(1, n):
                parent = int(torch.randint(0, j, (1,), generator=g))
                m[j] |= m[parent]
            custom.append(m)
    plan = AttentionPlan(torch.tensor(qo), prefix_lens, table, page, kind=kind, seg_indptr=seg_indptr,
                         positions=positions, block_size=3, custom_masks=custom, suffix_starts=suffix_starts,
                         suffix_lens=suffix_lens)
    to = lambda t: t.to(device)  # noqa: E731
    return plan, to(q), to(k), to(v), to(k_cache), to(v_cache)


def _oracle(plan: AttentionPlan, q, k, v, k_cache, v_cache, scale):
    """Dense attention per request over [gathered prefix and suffix | its new rows] with one explicit mask
    (float64)."""
    q, k, v, k_cache, v_cache = (t.double().cpu() for t in (q, k, v, k_cache, v_cache))
    page = plan.page_size
    out = torch.zeros_like(q)
    for r in range(plan.qo_indptr.numel() - 1):
        a, b = int(plan.qo_indptr[r]), int(plan.qo_indptr[r + 1])
        at = list(range(int(plan.prefix_lens[r])))
        if plan.suffix_lens is not None:
            s0 = int(plan.suffix_starts[r])
            at += list(range(s0, s0 + int(plan.suffix_lens[r])))
        P = len(at)
        idx = torch.tensor([int(plan.block_table[r, i // page]) * page + i % page for i in at], dtype=torch.long)
        keys = torch.cat([k_cache.flatten(0, 1)[idx], k[a:b]])
        vals = torch.cat([v_cache.flatten(0, 1)[idx], v[a:b]])
        new = torch.zeros(b - a, b - a, dtype=torch.bool)
        for s in range(plan.seg_indptr.numel() - 1):
            s0, s1 = int(plan.seg_indptr[s]), int(plan.seg_indptr[s + 1])
            if a <= s0 < b:
                sm = plan.segment_mask(s)
                new[s0 - a: s1 - a, s0 - a: s1 - a] = True if sm is None else sm
        mask = torch.cat([torch.ones(b - a, P, dtype=torch.bool), new], 1)
        group = q.shape[1] // k.shape[1]
        kk, vv = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        sc = torch.einsum("thd,shd->hts", q[a:b], kk) * scale
        sc = sc.masked_fill(~mask[None], float("-inf"))
        out[a:b] = torch.einsum("hts,shd->thd", torch.softmax(sc, -1), vv)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geom", [(4, 4, 16, 1), (4, 2, 16, 4), (8, 1, 32, 16), (6, 3, 8, 5)])
@pytest.mark.parametrize("suffix", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_torch_backend_matches_dense_oracle(kind, geom, suffix, kernel):
    """Both kernels (the CPU's fused kernel, the SDPA path other devices take, run here on the CPU)."""
    H, Hkv, D, page = geom
    for seed in range(4):
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
            plan, q, k, v, kc, vc = _case(seed, kind, H, Hkv, D, page, dtype, suffix=suffix)
            want = _oracle(plan, q, k, v, kc, vc, 0.3)
            be = TorchPrefixAttention(kernel)
            be.plan(plan, H, Hkv, D, dtype, scale=0.3)
            assert be.kernel == kernel
            out = be.run(q, k, v, kc, vc)
            assert out.dtype == dtype and out.shape == q.shape
            assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (kind, geom, seed, dtype, kernel)
    if suffix:  # the suffix is read: without it the output differs
        plan, q, k, v, kc, vc = _case(1, kind, H, Hkv, D, page, suffix=True)
        assert int(plan.suffix_lens.sum()) > 0
        plan.suffix_lens = torch.zeros_like(plan.suffix_lens)
        be = TorchPrefixAttention(kernel)
        be.plan(plan, H, Hkv, D, torch.float64, scale=0.3)
        plan2, *_ = _case(1, kind, H, Hkv, D, page, suffix=True)
        assert not torch.allclose(be.run(q, k, v, kc, vc), _oracle(plan2, q, k, v, kc, vc, 0.3))


def test_kernel_follows_the_device():
    plan, *_ = _case(0, "causal")
    be = TorchPrefixAttention()
    be.plan(plan, 4, 2, 16, torch.float32)
    assert be.kernel == "cpu_flash"
    be.plan(plan, 4, 2, 16, torch.float32, device="meta")  # any other device: SDPA
    assert be.kernel == "sdpa" and be.mask.device.type == "meta" and be.q_idx.device.type == "meta"
    with pytest.raises(ValueError, match="attention kernel 'matmul'; allowed: cpu_flash, sdpa"):
        TorchPrefixAttention("matmul")


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_that_sees_no_key_gets_zero(kernel):
    """A custom mask may leave a row without any key (no prefix, not even itself): its output is 0, the others'
    are the oracle's."""
    plan, q, k, v, kc, vc = _case(4, "custom")
    masks = [m.clone() for m in plan.custom_masks]
    masks[0][0] = False  # the first request has no prefix: segment 0's first row sees nothing
    plan.custom_masks = masks
    be = TorchPrefixAttention(kernel)
    be.plan(plan, 4, 2, 16, torch.float64, scale=0.3)
    assert be.unseen is not None
    got = be.run(q, k, v, kc, vc)
    want = _oracle(plan, q, k, v, kc, vc, 0.3)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.isnan(want[0]).all()
    assert torch.allclose(got[1:], want[1:], atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", [False, True])
def test_keys_read_from_the_cache_and_either_batching_equal_the_oracle(kind, suffix):
    """When the caller has written the new rows' K/V to the cache (``cached``; vLLM's layout keeps K and V side
    by side in one page tensor), all keys come from the cache; requests or segments as batch entries give the
    same result."""
    for seed in range(4):
        plan, q, k, v, kc, vc = _case(seed, kind, suffix=suffix)
        want = _oracle(plan, q, k, v, kc, vc, 0.3)
        T, page = q.shape[0], plan.page_size
        n_pages = kc.shape[0]
        kv = torch.full((n_pages + (T + page - 1) // page, page, 2, 32), float("nan"), dtype=q.dtype)
        kv[:n_pages, :, :, :16], kv[:n_pages, :, :, 16:] = kc, vc
        joint_k, joint_v = kv[..., :16], kv[..., 16:]
        slots = n_pages * page + torch.randperm(T)  # new rows at free slots past the prefixes' pages
        joint_k.flatten(0, 1)[slots], joint_v.flatten(0, 1)[slots] = k, v
        for entries in ("request", "segment"):
            be = TorchPrefixAttention()
            be.plan(plan, 4, 2, 16, q.dtype, scale=0.3, cached=slots, entries=entries)
            assert be.k_slots is not None
            got = be.run(q, k.clone().fill_(float("nan")), v.clone().fill_(float("nan")), joint_k, joint_v)
            assert torch.allclose(got, want, atol=1e-12), (kind, seed, entries)
            be.plan(plan, 4, 2, 16, q.dtype, scale=0.3, entries=entries)  # new rows from k, v
            assert torch.allclose(be.run(q, k, v, kc, vc), want, atol=1e-12), (kind, seed, entries)


def test_a_canvas_ignores_the_other_canvases():
    """Segments of one request share its prefix but not each other: changing one leaves the other alone."""
    plan, q, k, v, kc, vc = _case(7, "bidirectional")
    be = TorchPrefixAttention()
    be.plan(plan, 4, 2, 16, torch.float64)
    out = be.run(q, k, v, kc, vc)
    s0, s1 = int(plan.seg_indptr[0]), int(plan.seg_indptr[1])
    k2, v2 = k.clone(), v.clone()
    k2[s1:] += 1.0
    v2[s1:] -= 1.0
    assert torch.equal(be.run(q, k2, v2, kc, vc)[s0:s1], out[s0:s1])


@pytest.mark.parametrize("suffix", [False, True])
def test_unwritten_cache_slots_never_reach_the_output(suffix):
    """Caches may be uninitialised: NaN in every slot outside the cached keys changes nothing (slot 0, which
    padded key positions point at, included)."""
    plan, q, k, v, kc, vc = _case(2, "custom", suffix=suffix)
    be = TorchPrefixAttention()
    be.plan(plan, 4, 2, 16, torch.float64)
    want = be.run(q, k, v, kc, vc)
    used = set()
    pos = plan.cached_positions()
    for r, n in enumerate(plan.cached_lens.tolist()):
        used |= {int(plan.block_table[r, int(i) // 4]) * 4 + int(i) % 4 for i in pos[r, :n]}
    kn, vn = kc.clone().flatten(0, 1), vc.clone().flatten(0, 1)
    free = torch.tensor(sorted(set(range(kn.shape[0])) - used))
    assert 0 in free.tolist()
    kn[free], vn[free] = float("nan"), float("nan")
    got = be.run(q, k, v, kn.view_as(kc), vn.view_as(vc))
    assert torch.equal(got, want)


def test_bad_plans_and_shapes_raise_clear_errors():
    plan, q, k, v, kc, vc = _case(0, "bidirectional")
    qo, pl, bt = plan.qo_indptr, plan.prefix_lens, plan.block_table
    with pytest.raises(ValueError, match="mask kind 'tree'; allowed: bidirectional, causal, block_causal, custom"):
        AttentionPlan(qo, pl, bt, 4, kind="tree")
    with pytest.raises(ValueError, match="prefix_lens must have one entry per request"):
        AttentionPlan(qo, pl[:-1] if pl.numel() > 1 else torch.zeros(2, dtype=torch.long), bt, 4)
    with pytest.raises(ValueError, match="block_table has .* pages per request"):
        AttentionPlan(qo, pl + 100, bt, 4)
    with pytest.raises(ValueError, match="block_table has .* pages per request"):
        AttentionPlan(qo, pl, bt, 4, suffix_starts=pl + 100, suffix_lens=torch.ones_like(pl))
    with pytest.raises(ValueError, match="suffix_starts and suffix_lens go together"):
        AttentionPlan(qo, pl, bt, 4, suffix_starts=pl)
    with pytest.raises(ValueError, match="at or after its request's prefix end"):
        AttentionPlan(qo, pl + 1, bt, 4, suffix_starts=pl, suffix_lens=torch.ones_like(pl))
    with pytest.raises(ValueError, match="block_causal needs positions"):
        AttentionPlan(qo, pl, bt, 4, kind="block_causal")
    with pytest.raises(ValueError, match="custom needs one mask per segment"):
        AttentionPlan(qo, pl, bt, 4, kind="custom", custom_masks=[])
    n = int(qo[-1])
    with pytest.raises(ValueError, match="must be bool"):
        AttentionPlan(qo, pl, bt, 4, kind="custom", seg_indptr=torch.tensor([0, n]) if qo.numel() == 2 else None,
                      custom_masks=[torch.ones(1, 1)] * (qo.numel() - 1))
    two = torch.tensor([0, 3, 6])
    with pytest.raises(ValueError, match="must not span two requests"):
        AttentionPlan(two, torch.zeros(2, dtype=torch.long), torch.zeros(2, 1), 4, seg_indptr=torch.tensor([0, 4, 6]))
    be = TorchPrefixAttention()
    be.plan(plan, 4, 2, 16, torch.float64)
    with pytest.raises(ValueError, match="planned for q"):
        be.run(q[:, :2], k, v, kc, vc)
    with pytest.raises(ValueError, match="caches must be"):
        be.run(q, k, v, kc[..., :8], vc[..., :8])
    with pytest.raises(ValueError, match="num_heads 4 must be a multiple of num_kv_heads 3"):
        be.plan(plan, 4, 3, 16, torch.float64)


def test_segment_pairs_and_packed_masks_follow_the_segments():
    """The vectorised per-segment masks (FlashInfer's flattened order) are the segments' masks, and their packing
    is :func:`pack_mask` of them."""
    for kind in KINDS:
        for seed in range(4):
            plan, *_ = _case(seed, kind)
            i, j, vis = plan.segment_pairs()
            masks, at = [], 0
            for s in range(plan.seg_indptr.numel() - 1):
                a, b = int(plan.seg_indptr[s]), int(plan.seg_indptr[s + 1])
                n = b - a
                rows = torch.arange(a, b)
                assert torch.equal(i[at: at + n * n], rows.repeat_interleave(n))
                assert torch.equal(j[at: at + n * n], rows.repeat(n))
                m = plan.segment_mask(s)
                m = torch.ones(n, n, dtype=torch.bool) if m is None else m
                if kind == "causal":
                    assert torch.equal(m, torch.ones(n, n, dtype=torch.bool).tril())
                if kind == "block_causal":
                    blk = plan.positions[a:b] // plan.block_size
                    assert torch.equal(m, blk[None, :] <= blk[:, None])
                assert torch.equal(vis[at: at + n * n].view(n, n), m)
                masks.append(m)
                at += n * n
            packed, indptr = plan.packed_segment_masks()
            want, want_indptr = pack_mask(masks)
            assert torch.equal(packed, want) and torch.equal(indptr, want_indptr)


def test_plans_take_host_tensors_only():
    plan, *_ = _case(0, "bidirectional")
    with pytest.raises(ValueError, match="block_table is on meta: a plan is built on the host"):
        AttentionPlan(plan.qo_indptr, plan.prefix_lens, plan.block_table.to("meta"), 4)


def test_to_device_is_one_copy_elsewhere_and_none_on_the_cpu():
    t = {"a": torch.arange(5), "b": torch.ones(2, 3, dtype=torch.bool), "c": None, "d": torch.rand(3, 1, 2)}
    same = to_device(t, "cpu")
    assert all(same[k] is t[k] for k in t)
    moved = to_device(t, "meta")
    assert moved["c"] is None
    for k in ("a", "b", "d"):
        assert moved[k].device.type == "meta" and moved[k].dtype == t[k].dtype and moved[k].shape == t[k].shape
    # views of one buffer (one transfer), each at its own aligned offset
    assert {moved[k].untyped_storage().nbytes() for k in ("a", "b", "d")} == {48 + 16 + 32}
    assert [moved[k].storage_offset() * moved[k].element_size() for k in ("a", "b", "d")] == [0, 48, 64]


def test_backend_choice(monkeypatch):
    assert make_backend("auto", "cpu").name == "torch"
    assert make_backend("torch").name == "torch"
    with pytest.raises(ValueError, match="attention backend 'triton'; allowed: auto, torch, flashinfer"):
        make_backend("triton")
    with pytest.raises(ValueError, match="needs a CUDA device and float16/bfloat16"):
        make_backend("flashinfer", "cpu", torch.float32)
    with pytest.raises(ValueError, match="head size 16 is not one of its kernels' \\(64, 128, 256\\)"):
        make_backend("flashinfer", "cuda", torch.bfloat16, head_dim=16)
    monkeypatch.setattr(prefix_attention, "flashinfer_available", lambda: True)  # auto: FlashInfer only where it runs
    assert make_backend("auto", "cuda", torch.bfloat16, head_dim=16).name == "torch"
    assert make_backend("auto", "cuda", torch.float32, head_dim=64).name == "torch"


def test_pack_mask_round_trip_and_bit_order():
    g = torch.Generator().manual_seed(3)
    masks = [torch.rand(n, n, generator=g) > 0.5 for n in (1, 3, 5, 9)]
    packed, indptr = pack_mask(masks)
    for r, m in enumerate(masks):
        assert torch.equal(unpack_mask(packed, indptr, r, m.shape[0]), m)
    # little-endian bits within a byte, as numpy.packbits(bitorder="little") and FlashInfer's segment_packbits
    flat = masks[3].flatten().numpy()
    assert packed[int(indptr[3]): int(indptr[4])].tolist() == np.packbits(flat, bitorder="little").tolist()


@pytest.fixture
def fake_flashinfer(monkeypatch):
    from oracles import fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    fake_flashinfer.PLANNED.clear()
    return fake_flashinfer


FLASHINFER_GEOMS = [(4, 4, 64, 1), (8, 2, 128, 16), (32, 8, 128, 32)]  # page sizes 1, 16, 32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", [False, True])
def test_flashinfer_planning_against_its_cpu_stand_in(fake_flashinfer, kind, suffix):
    """The FlashInfer backend's plan (host int32 indptrs, pages or one-token pages, the packed mask and its byte
    offsets, the row map) over a CPU stand-in of flashinfer 0.7.0.post1's wrappers equals the oracle, for
    contiguous caches and vLLM's strided K|V pages."""
    from attention_backends.flashinfer_backend import FlashInferPrefixAttention

    fi = FlashInferPrefixAttention("cpu", workspace_bytes=16)
    for H, Hkv, D, page in FLASHINFER_GEOMS:
        for seed in range(4):
            plan, q, k, v, kc, vc = _case(seed, kind, H, Hkv, D, page, torch.bfloat16, suffix=suffix)
            T = q.shape[0]
            rows = torch.randperm(T, generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
            fake_flashinfer.PLANNED.clear()
            fi.plan(plan, H, Hkv, D, torch.bfloat16, rows=rows)
            assert fi.flat == bool(suffix and int(plan.suffix_lens.sum()))  # one-token pages only for a suffix
            for call in fake_flashinfer.PLANNED:  # host int32 index tensors, as vLLM passes them
                tensors = {name: got for name, got in call.items() if name != "wrapper"}
                assert all(dev == "cpu" for dev, _ in tensors.values()), call
                assert all(dt == torch.int32 for name, (_, dt) in tensors.items() if name != "packed_custom_mask"), call
            want = _oracle(plan, q, k, v, kc, vc, D ** -0.5)
            joint = torch.cat([kc, vc], -1)
            for k_cache, v_cache in ((kc, vc), (joint[..., :D], joint[..., D:])):
                if rows is None:
                    got = fi.run(q, k, v, k_cache, v_cache)
                else:  # the model's rows: plan row i is input row rows[i]
                    inp = lambda t: torch.empty_like(t).index_copy_(0, rows, t)  # noqa: E731
                    got = fi.run(inp(q), inp(k), inp(v), k_cache, v_cache)[rows]
                assert torch.allclose(got.double(), want, atol=2e-2, rtol=2e-2), (kind, (H, Hkv, D, page), seed)


def test_flashinfer_kernel_choice(fake_flashinfer):
    """FA2 by default for every wrapper (one kernel family for every mask kind: FA3 takes no custom mask); a
    kernel FlashInfer's prefill does not have here is refused naming the allowed ones."""
    from attention_backends.flashinfer_backend import FlashInferPrefixAttention

    fi = FlashInferPrefixAttention("cpu", workspace_bytes=16)
    assert fi.paged._backend == fi.ragged(True)._backend == fi.ragged(False)._backend == "fa2"
    assert FlashInferPrefixAttention("cpu", workspace_bytes=16, kernel="auto").ragged(False)._backend == "auto"
    with pytest.raises(ValueError, match="flashinfer kernel 'cudnn'; allowed: fa2, auto, fa3"):
        FlashInferPrefixAttention("cpu", kernel="cudnn")


def _graph_steps(kind, suffix, device, dtype, geom, seeds=range(4)):
    """Steps of one fixed shape (``_case(fixed=True)``) with the :class:`GraphShape` that holds them all."""
    from attention_backends.flashinfer_backend import GraphShape

    H, Hkv, D, page = geom
    steps = [_case(seed, kind, H, Hkv, D, page, dtype, device, suffix=suffix, fixed=True) for seed in seeds]
    shapes = [GraphShape.of(s[0]) for s in steps]
    assert len({(s.segments, s.paged) for s in shapes}) == 1
    shape = GraphShape(shapes[0].segments, shapes[0].paged, max(s.page_indices for s in shapes),
                       max(s.mask_bytes for s in shapes))
    return steps, shape


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", [False, True])
def test_flashinfer_graph_mode_plans_into_persistent_buffers(fake_flashinfer, kind, suffix):
    """CUDA-graph mode over the CPU stand-in: steps of one shape planned one after another land in the same
    buffers (FlashInfer's index buffers, the mask offsets, the row maps: the addresses a captured graph reads),
    each run equals the oracle, and a step of another layout is refused instead of replaying a stale one."""
    from attention_backends.flashinfer_backend import FlashInferPrefixAttention

    H, Hkv, D, page = geom = (8, 2, 16, 4)
    steps, shape = _graph_steps(kind, suffix, "cpu", torch.bfloat16, geom)
    fi = FlashInferPrefixAttention("cpu", workspace_bytes=16, graph=shape)
    addresses = None
    for i, (plan, q, k, v, kc, vc) in enumerate(steps):
        rows = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(i))
        fi.plan(plan, H, Hkv, D, torch.bfloat16, rows=rows)
        ragged = fi.ragged_run
        bufs = [ragged._qo_indptr_buf, ragged._kv_indptr_buf, fi.paged._qo_indptr_buf, fi.paged._paged_kv_indices_buf,
                fi.rows, fi.perm, fi.inv] + ([ragged._mask_indptr_buf, ragged._custom_mask_buf] if fi.masked else [])
        now = [t.data_ptr() for t in bufs]
        assert addresses is None or now == addresses, "a graph-mode plan must reuse the captured buffers"
        addresses = now
        inp = lambda t: torch.empty_like(t).index_copy_(0, rows, t)  # noqa: E731
        got = fi.run(inp(q), inp(k), inp(v), kc, vc)[rows]
        want = _oracle(plan, q, k, v, kc, vc, D ** -0.5)
        assert torch.allclose(got.double(), want, atol=2e-2, rtol=2e-2), (kind, i)
    other = _case(9, kind, H, Hkv, D, page, torch.bfloat16, suffix=suffix)[0]  # another shape
    with pytest.raises(ValueError, match="CUDA-graph mode|batch size should be fixed"):
        fi.plan(other, H, Hkv, D, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", [False, True])
def test_flashinfer_graph_mode_replays_later_steps(kind, suffix):
    """FlashInfer in CUDA-graph mode: ``run`` captured on one step and replayed on later steps of the same shape
    (other prefix lengths, pages, masks, row order and values; only the plan and the inputs' contents change)
    equals the oracle each time, and equals the same plan run without capture bit for bit."""
    pytest.importorskip("flashinfer")
    from attention_backends.flashinfer_backend import FlashInferPrefixAttention

    dtype = torch.bfloat16
    H, Hkv, D, page = geom = (8, 2, 128, 16)
    steps, shape = _graph_steps(kind, suffix, "cuda", dtype, geom)
    fi = FlashInferPrefixAttention("cuda", graph=shape)
    T = steps[0][1].shape[0]
    pages = max(s[4].shape[0] for s in steps)
    q, k, v = (torch.zeros(T, h, D, dtype=dtype, device="cuda") for h in (H, Hkv, Hkv))
    kc, vc = (torch.zeros(pages, page, Hkv, D, dtype=dtype, device="cuda") for _ in range(2))

    def load(i):
        plan, q_i, k_i, v_i, kc_i, vc_i = steps[i]
        rows = torch.randperm(T, generator=torch.Generator().manual_seed(i))
        fi.plan(plan, H, Hkv, D, dtype, rows=rows)
        r = rows.cuda()
        for dst, src in ((q, q_i), (k, k_i), (v, v_i)):
            dst.index_copy_(0, r, src)
        kc[: kc_i.shape[0]].copy_(kc_i)
        vc[: vc_i.shape[0]].copy_(vc_i)
        return plan, r

    load(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fi.run(q, k, v, kc, vc)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.run(q, k, v, kc, vc)
    for i in range(len(steps)):
        plan, r = load(i)
        graph.replay()
        got = out.clone()
        assert torch.equal(got, fi.run(q, k, v, kc, vc)), (kind, i)
        _, q_i, k_i, v_i, kc_i, vc_i = steps[i]
        want = _oracle(plan, q_i, k_i, v_i, kc_i, vc_i, D ** -0.5)
        assert torch.allclose(got[r].double().cpu(), want, atol=2e-2, rtol=2e-2), (kind, i)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("suffix", [False, True])
def test_flashinfer_matches_torch_backend(kind, dtype, suffix):
    pytest.importorskip("flashinfer")
    fi = make_backend("flashinfer", "cuda", dtype)
    for geom in [(4, 4, 64, 1), (8, 2, 128, 16), (32, 8, 128, 32)]:
        H, Hkv, D, page = geom
        for seed in range(4):
            plan, q, k, v, kc, vc = _case(seed, kind, H, Hkv, D, page, dtype, "cuda", suffix=suffix)
            fi.plan(plan, H, Hkv, D, dtype)
            assert fi.flat == bool(suffix and int(plan.suffix_lens.sum()))  # one-token pages only for a suffix
            want = _oracle(plan, q, k, v, kc, vc, D ** -0.5)
            # contiguous caches, and vLLM's layout: K and V side by side in one page tensor
            joint = torch.cat([kc, vc], -1)
            for k_cache, v_cache in ((kc, vc), (joint[..., :D], joint[..., D:])):
                got = fi.run(q, k, v, k_cache, v_cache)
                assert torch.allclose(got.double().cpu(), want, atol=2e-2, rtol=2e-2), (kind, geom, seed, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_reads_the_models_row_order(kind, dtype):
    """Planned with a row map (vLLM's extra canvases after its scheduled rows), FlashInfer reads and writes the
    rows in the model's order."""
    pytest.importorskip("flashinfer")
    fi = make_backend("flashinfer", "cuda", dtype)
    for H, Hkv, D, page in FLASHINFER_GEOMS:
        for seed in range(4):
            plan, q, k, v, kc, vc = _case(seed, kind, H, Hkv, D, page, dtype, "cuda", suffix=seed % 2 == 1)
            rows = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(seed))
            fi.plan(plan, H, Hkv, D, dtype, rows=rows)
            want = _oracle(plan, q, k, v, kc, vc, D ** -0.5)
            r = rows.cuda()
            inp = lambda t: torch.empty_like(t).index_copy_(0, r, t)  # noqa: E731
            joint = torch.cat([kc, vc], -1)
            got = fi.run(inp(q), inp(k), inp(v), joint[..., :D], joint[..., D:])[r]
            assert torch.allclose(got.double().cpu(), want, atol=2e-2, rtol=2e-2), (kind, (H, Hkv, D, page), seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", [False, True])
def test_torch_backends_sdpa_kernel_on_cuda(kind, suffix):
    """The PyTorch backend on CUDA (SDPA, grouped-query heads folded into the rows) equals the oracle, with the
    new rows read from vLLM's strided K|V pages or from ``k, v``."""
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)):
        for H, Hkv, D, page in [(4, 4, 64, 1), (8, 2, 128, 16), (32, 8, 128, 32)]:
            for seed in range(2):
                plan, q, k, v, kc, vc = _case(seed, kind, H, Hkv, D, page, dtype, "cuda", suffix=suffix)
                be = TorchPrefixAttention()
                be.plan(plan, H, Hkv, D, dtype, scale=0.3, device="cuda")
                assert be.kernel == "sdpa"
                want = _oracle(plan, q, k, v, kc, vc, 0.3)
                joint = torch.cat([kc, vc], -1)
                got = be.run(q, k, v, joint[..., :D], joint[..., D:])
                assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol), (kind, dtype, (H, Hkv, D, page))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_mask_equals_flashinfer_segment_packbits():
    fi = pytest.importorskip("flashinfer")
    g = torch.Generator().manual_seed(5)
    masks = [torch.rand(n, n, generator=g) > 0.5 for n in (2, 3, 7)]
    packed, indptr = pack_mask(masks)
    flat = torch.cat([m.flatten() for m in masks]).cuda()
    lens = torch.tensor([0] + [m.numel() for m in masks]).cumsum(0).cuda()
    fp, fi_indptr = fi.segment_packbits(flat, lens, bitorder="little")
    assert fp.cpu().tolist() == packed.tolist() and fi_indptr.cpu().tolist() == indptr.tolist()
