"""attention_backends.torch_ref: paged prefix + new tokens under each mask kind equals dense masked attention."""

import numpy as np
import pytest
import torch

from attention_backends.torch_ref import PagedKV, merge_state, pack_mask, prefix_attention, unpack_mask


def _dense(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)


def _case(seed, kind, H=4, Hkv=2, D=16, page=4):
    g = torch.Generator().manual_seed(seed)
    prefix_lens = [0, 5, 9, 12]
    n_new = [3, 6, 8, 7]
    num_pages = 40
    k_cache = torch.randn(num_pages, page, Hkv, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_pages, page, Hkv, D, generator=g, dtype=torch.float64)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(prefix_lens), 8, dtype=torch.int32)
    used = 0
    for r, n in enumerate(prefix_lens):
        m = (n + page - 1) // page
        table[r, :m] = perm[used: used + m].int()
        used += m
    T = sum(n_new)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kn = torch.randn(T, Hkv, D, generator=g, dtype=torch.float64)
    vn = torch.randn(T, Hkv, D, generator=g, dtype=torch.float64)
    qo = torch.tensor(np.cumsum([0] + n_new))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, n_new)])
    masks = []
    for r, n in enumerate(n_new):
        if kind == "custom":  # canvases of 2-3 tokens, each sees only itself (a DAG of drafts), plus a tree edge
            seg = torch.arange(n) // 3
            m = seg[:, None] == seg[None, :]
            m[-1, 0] = True
            masks.append(m)
    packed, indptr = pack_mask(masks) if masks else (None, None)
    kv = PagedKV(k_cache, v_cache, table, torch.tensor(prefix_lens))
    return q, kn, vn, kv, qo, positions, masks, packed, indptr, prefix_lens, n_new


@pytest.mark.parametrize("kind", ["bidirectional", "causal", "block_causal", "custom"])
def test_matches_dense_attention(kind):
    q, kn, vn, kv, qo, positions, masks, packed, indptr, prefix_lens, n_new = _case(0, kind)
    scale = 0.3
    out = prefix_attention(q, kn, vn, kv, qo, kind=kind, scale=scale, positions=positions, block_size=4,
                           packed_mask=packed, mask_indptr=indptr)
    for r, (P, n) in enumerate(zip(prefix_lens, n_new)):
        a, b = int(qo[r]), int(qo[r + 1])
        pk, pv = kv.gather(r)
        k = torch.cat([pk, kn[a:b]])
        v = torch.cat([pv, vn[a:b]])
        pos = positions[a:b]
        if kind == "bidirectional":
            new = torch.ones(n, n, dtype=torch.bool)
        elif kind == "causal":
            new = torch.ones(n, n, dtype=torch.bool).tril()
        elif kind == "block_causal":
            new = (pos[None] // 4) <= (pos[:, None] // 4)
        else:
            new = masks[r]
        mask = torch.cat([torch.ones(n, P, dtype=torch.bool), new], 1)
        want = _dense(q[a:b], k, v, mask, scale)
        assert torch.allclose(out[a:b], want, atol=1e-12), (kind, r)


def test_gather_reads_the_right_pages():
    _, _, _, kv, *_ = _case(1, "bidirectional")
    k, v = kv.gather(2)
    page = kv.k_cache.shape[1]
    for i in range(int(kv.prefix_lens[2])):
        assert torch.equal(k[i], kv.k_cache[kv.block_table[2, i // page], i % page])


def test_pack_mask_round_trip_and_bit_order():
    g = torch.Generator().manual_seed(3)
    masks = [torch.rand(n, n, generator=g) > 0.5 for n in (1, 3, 5, 9)]
    packed, indptr = pack_mask(masks)
    for r, m in enumerate(masks):
        assert torch.equal(unpack_mask(packed, indptr, r, m.shape[0]), m)
    # little-endian bits within a byte, as numpy.packbits(bitorder="little") and FlashInfer's packbits
    flat = masks[3].flatten().numpy()
    assert packed[int(indptr[3]): int(indptr[4])].tolist() == np.packbits(flat, bitorder="little").tolist()


def test_merge_state_equals_joint_softmax():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(11, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(11, 2, 8, generator=g, dtype=torch.float64)
    from attention_backends.torch_ref import _attend

    o1, l1 = _attend(q, k[:4], v[:4], 0.5, None)
    o2, l2 = _attend(q, k[4:], v[4:], 0.5, None)
    o, _ = _attend(q, k, v, 0.5, None)
    assert torch.allclose(merge_state(o1, l1, o2, l2), o, atol=1e-12)
