"""The PyTorch prefix attention backend: runs on any device and dtype, and is what CI tests.

One attention per batch entry and layer. An entry is a request (its new rows: every canvas or tree node of
it) or, where that pads less, one segment of a request; its rows (``[R, Lq]`` padded) attend over its keys
``[cached | new rows]`` (``[R, Lk]`` padded; cached = the prefix, and the kept suffix when the plan has one)
under one visibility mask that ``plan`` builds once per forward, on the host: every cached key for every row,
and among the new rows the plan's segments under its mask kind. Everything ``run`` needs reaches the device in
one copy per forward (none on the CPU). Per layer ``run`` is a handful of tensor ops: the cached slots
gathered from the pages, one index that lays out every request's keys, the query gather, one fused attention
call, one output gather. The attention call (``kernel``):

- ``cpu_flash`` (the default on the CPU): PyTorch's fused CPU flash-attention kernel, grouped-query heads
  native, the mask as an additive float32 bias, inputs in float32 (float64 on the exactness path);
- ``sdpa`` (the default elsewhere, CUDA included): ``torch.nn.functional.scaled_dot_product_attention`` with
  the boolean mask, in the inputs' dtype (its kernels accumulate in float32). Grouped-query heads are folded
  into the query rows (``[R, Hkv, G * Lq, D]`` against ``[R, Hkv, Lk, D]``) rather than passed as
  ``enable_gqa=True``: PyTorch runs ``enable_gqa`` only in its flash kernel (which takes no mask) and its
  math kernel (which materialises float32 scores for every query head), so with a mask the fold is what lets
  the memory-efficient kernel run, with no K/V repeated per query head.

A row with no visible key gets 0. Padded key positions point at a real row's key (never at an unwritten
cache slot), so caches may be allocated uninitialised: nothing outside the cached keys is read.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .prefix_attention import AttentionPlan, check_run_inputs, to_device

KERNELS = ("cpu_flash", "sdpa")


class TorchPrefixAttention:
    name = "torch"

    def __init__(self, kernel: str | None = None):
        """``kernel``: ``cpu_flash`` or ``sdpa`` (module docstring); None: ``cpu_flash`` on the CPU, else ``sdpa``."""
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"attention kernel {kernel!r}; allowed: {', '.join(KERNELS)}")
        self.kernel_choice = kernel

    def plan(self, plan: AttentionPlan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             scale: float | None = None, device: torch.device | str | None = None,
             rows: torch.Tensor | None = None, cached: torch.Tensor | None = None, entries: str = "auto") -> None:
        """``rows``: where the plan's rows are in the tensors ``run`` gets (plan row ``i`` is input row
        ``rows[i]``, a permutation), so a caller whose rows are not request by request needs no gather.
        ``cached``: ``[T]`` flat cache slots where the caller has written each input row's K/V before ``run``
        (-1: not written); when every row is there, ``run`` reads all keys from the cache in one gather.
        ``entries``: one batch entry per ``request`` or per ``segment``; ``auto`` picks the one that pads less.
        Host tensors all (the plan's and these); the device gets what ``run`` needs in one copy."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.geom = (num_heads, num_kv_heads, head_dim)
        self.kernel = self.kernel_choice or ("cpu_flash" if dev.type == "cpu" else "sdpa")
        self.scale = head_dim ** -0.5 if scale is None else scale
        # cpu_flash computes in float32 (float64 stays); sdpa in the inputs' dtype, accumulating in float32
        self.acc = torch.promote_types(dtype, torch.float32) if self.kernel == "cpu_flash" else dtype
        # the plan's index arithmetic and masks in numpy on views of its host tensors (a few microseconds an op
        # where torch's small ops take tens: this runs once per forward, on the step's critical path); the
        # results become tensors once, for the one copy to the device
        T = self.T = plan.num_tokens
        P = plan.cached_lens.numpy()  # cached keys per request: its prefix (and its kept suffix)
        model_row = np.arange(T) if rows is None else rows.numpy().astype(np.int64)  # plan row -> input row
        qo, sp = plan.qo_indptr.numpy(), plan.seg_indptr.numpy()
        # a batch entry per request (keys: its prefix and all its rows) or per segment (its prefix and the
        # segment's rows), whichever pads less; both read the prefix once per entry
        req_lens, seg_lens = np.diff(qo), np.diff(sp)
        seg_req = np.minimum(np.searchsorted(qo, sp[:-1], side="right") - 1, req_lens.size - 1) if T \
            else np.zeros(seg_lens.size, dtype=np.int64)  # the request of each segment (of its first row)
        req_cost = _padded_cost(req_lens, P, num_heads, num_kv_heads)
        seg_cost = _padded_cost(seg_lens, P[seg_req], num_heads, num_kv_heads)
        if entries not in ("auto", "request", "segment"):
            raise ValueError(f"entries {entries!r}; allowed: auto, request, segment")
        if entries == "segment" or (entries == "auto" and seg_cost < req_cost):
            ptr, ent_req = sp, seg_req
        else:
            ptr, ent_req = qo, np.arange(req_lens.size)
        n = np.diff(ptr)
        Pe = P[ent_req]
        R = n.size
        Lq = int(n.max()) if R else 0
        Lk = int((Pe + n).max()) if R else 0
        last = max(T - 1, 0)
        # queries [R, Lq]: entry r's plan rows ptr[r] + i
        i = np.arange(Lq)
        q_ok = i < n[:, None]
        q_plan = np.where(q_ok, ptr[:-1, None] + i, 0)
        q_idx = np.where(q_ok, model_row[np.minimum(q_plan, last)] if T else q_plan, 0).ravel()
        self.shape = (R, Lq, Lk)
        # keys [R, Lk] index the run's source rows: the T new rows, then every prefix slot request by request
        slots = plan.cached_slots_array()
        p_slots = slots[np.arange(slots.shape[1]) < P[:, None]]
        j = np.arange(Lk)
        in_prefix = j < Pe[:, None]
        local = j - Pe[:, None]  # key j of entry r is its new row `local` when 0 <= local < n_r
        is_new = (local >= 0) & (local < n[:, None])
        key_plan = np.minimum(ptr[:-1, None] + np.maximum(local, 0), last)  # the plan row of each new key
        new_row = model_row[key_plan] if T else local
        k_idx = np.where(in_prefix, T + (np.cumsum(P) - P)[ent_req, None] + j, 0)
        k_idx = np.where(is_new, new_row, k_idx)  # padding: source row 0, a real key
        k_slots = None
        if cached is not None and T:
            c = cached.numpy().astype(np.int64)
            if (c >= 0).all():  # source rows as cache slots
                k_slots = np.concatenate([c, p_slots])[k_idx].ravel()
        # visibility [R, Lq, Lk]: the prefix, and the new rows of the row's own segment under the mask kind
        seg_of = np.repeat(np.arange(seg_lens.size), seg_lens)  # plan row -> segment
        if plan.kind == "custom":  # each segment's mask at its entry's rows, segments of a length at once
            seg = seg_of[q_plan] if T else q_plan
            new = (seg[:, :, None] == seg[:, None, :]) & q_ok[:, :, None] & q_ok[:, None, :]  # [R, Lq, Lq]
            ent_of = np.repeat(np.arange(R), n)  # plan row -> entry
            m = np.zeros((R, Lq, Lq), dtype=bool)
            for segs, blocks in plan.segment_blocks():
                if not segs.numel() or not blocks.shape[-1]:
                    continue
                first = sp[segs.numpy()]
                e = ent_of[first]
                at = (first - ptr[e])[:, None] + np.arange(blocks.shape[-1])  # [k, n] rows in the entry
                m[e[:, None, None], at[:, :, None], at[:, None, :]] = blocks.numpy()
            new &= m
            vis = np.take_along_axis(new, np.broadcast_to(np.clip(local, 0, max(Lq - 1, 0))[:, None, :],
                                                          (R, Lq, Lk)), 2) & is_new[:, None, :] \
                if Lq else np.zeros((R, Lq, Lk), dtype=bool)
        elif T:  # query row q sees new key k when both are real rows of one segment (and the mask kind allows):
            # one comparison of segment ids, -1 for a padded query and -2 for a key that is not a new row (small
            # ints: the comparison runs over every [R, Lq, Lk] element)
            ids = seg_of.astype(np.int16 if seg_lens.size < 2 ** 15 else np.int32)
            sq = np.where(q_ok, ids[q_plan], -1).astype(ids.dtype)
            sk = np.where(is_new, ids[key_plan], -2).astype(ids.dtype)
            vis = sq[:, :, None] == sk[:, None, :]
            if plan.kind == "causal":
                vis &= local[:, None, :] <= i[None, :, None]
            elif plan.kind == "block_causal":
                blk = plan.positions.numpy().astype(np.int64) // plan.block_size
                vis &= blk[key_plan][:, None, :] <= blk[q_plan][:, :, None]
        else:
            vis = np.zeros((R, Lq, Lk), dtype=bool)
        vis |= in_prefix[:, None, :] & q_ok[:, :, None]
        seen = vis.any(-1)  # [R, Lq]
        unseen = None if seen[q_ok].all() else torch.from_numpy(~seen[:, None, :, None])  # rows seeing no key: 0
        if self.kernel == "cpu_flash":
            # 0 where visible, -inf elsewhere, written as the floats' bit patterns (one integer pass: a float
            # select or masked fill over every element costs ten times more)
            bits, neg_inf = _NEG_INF_BITS[self.acc]
            mask = torch.from_numpy(np.multiply(~vis, neg_inf, dtype=bits).view(_NUMPY_FLOAT[self.acc])[:, None])
        else:  # padded query rows see key 0 (a real key): no row of the kernel's is fully masked
            if Lk:
                vis[:, :, 0] |= ~q_ok
            mask = torch.from_numpy(vis[:, None])
        # output: input row t is entry o_ent[t]'s query o_pos[t]
        ent_of_row = np.repeat(np.arange(R), n)
        o_ent, o_pos = np.empty(T, dtype=np.int64), np.empty(T, dtype=np.int64)
        o_ent[model_row] = ent_of_row
        o_pos[model_row] = np.arange(T) - ptr[ent_of_row]
        t = torch.from_numpy
        d = to_device({"q_idx": t(q_idx), "k_idx": t(k_idx.ravel()), "p_slots": t(p_slots),
                       "k_slots": None if k_slots is None else t(k_slots), "mask": mask, "unseen": unseen,
                       "o_idx": t(o_ent * Lq + o_pos)}, dev)
        self.q_idx, self.k_idx, self.p_slots, self.k_slots = d["q_idx"], d["k_idx"], d["p_slots"], d["k_slots"]
        self.o_idx, self.unseen = d["o_idx"], d["unseen"]  # o_idx: into the output's [R * Lq] query rows
        G = num_heads // num_kv_heads
        # sdpa folds the G query heads of a KV head into its rows: the mask repeats per group (on the device)
        self.mask = d["mask"] if self.kernel == "cpu_flash" or G == 1 else d["mask"].repeat(1, 1, G, 1)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` (the new rows); caches ``[pages, page, Hkv, D]`` -> ``[T, H, D]``."""
        H, Hkv, D = self.geom
        check_run_inputs(self.T, self.geom, q, k, v, k_cache, v_cache)
        if self.T == 0:
            return q.new_empty(0, H, D)
        acc = self.acc
        R, Lq, Lk = self.shape
        # [R, Lk, Hkv, D]: each entry's keys, its prefix read once (flat slots: views of the reference engine's
        # caches and of vLLM's NHD K|V pages alike); flat index_select gathers, the cheapest on CPU
        joint = _joint_pages(k_cache, v_cache)
        if self.k_slots is not None:  # every key is in the cache
            if joint is not None:  # K and V side by side: one gather
                kvs = joint.index_select(0, self.k_slots).view(R, Lk, Hkv, 2 * D).to(acc)
                ks, vs = kvs[..., :D], kvs[..., D:]
            else:
                ks = slot_rows(k_cache, self.k_slots).view(R, Lk, Hkv, D).to(acc)
                vs = slot_rows(v_cache, self.k_slots).view(R, Lk, Hkv, D).to(acc)
        elif joint is not None:  # the new rows' K|V, then the cached prefix's: one source, one gather
            src = torch.cat([torch.cat([k, v], -1).to(acc), joint.index_select(0, self.p_slots).to(acc)])
            kvs = src.index_select(0, self.k_idx).view(R, Lk, Hkv, 2 * D)
            ks, vs = kvs[..., :D], kvs[..., D:]
        else:
            ks = torch.cat([k.to(acc), slot_rows(k_cache, self.p_slots).to(acc)]) \
                .index_select(0, self.k_idx).view(R, Lk, Hkv, D)
            vs = torch.cat([v.to(acc), slot_rows(v_cache, self.p_slots).to(acc)]) \
                .index_select(0, self.k_idx).view(R, Lk, Hkv, D)
        qs = q.to(acc).index_select(0, self.q_idx).view(R, Lq, H, D)
        kh, vh = ks.transpose(1, 2), vs.transpose(1, 2)
        if self.kernel == "cpu_flash":
            o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qs.transpose(1, 2), kh, vh, 0.0, False, attn_mask=self.mask, scale=self.scale)
        else:  # [R, Hkv, G * Lq, D]: query head h = kv head h // G, group h % G
            G = H // Hkv
            qf = qs.view(R, Lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * Lq, D)
            o = F.scaled_dot_product_attention(qf, kh, vh, attn_mask=self.mask, scale=self.scale)
            o = o.view(R, Hkv, G, Lq, D).reshape(R, H, Lq, D)
        if self.unseen is not None:
            o = o.masked_fill(self.unseen, 0.0)
        # [T, H, D] in input row order
        return o.transpose(1, 2).reshape(R * Lq, H, D).index_select(0, self.o_idx).to(q.dtype)


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[n, Hkv, D]``: the rows of a ``[pages, page, Hkv, D]`` cache view at flat ``slots`` (``page * page_size +
    offset``). Token-major pages (NHD) are one flat gather; a view of head-major pages (vLLM's CPU layout, where a
    page's tokens are not contiguous across heads) is gathered by page and offset, never by flattening (which would
    copy the whole cache)."""
    if cache.stride(0) == cache.shape[1] * cache.stride(1):
        return cache.flatten(0, 1).index_select(0, slots)
    page = cache.shape[1]
    return cache[slots // page, slots % page]


def _joint_pages(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """``[slots, Hkv, 2 * D]`` view of K and V when they are the two halves of one page tensor (vLLM's pages
    in this backend's layout), else None."""
    D = k_cache.shape[-1]
    if (k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or k_cache.stride(-2) != 2 * D
            or v_cache.data_ptr() != k_cache.data_ptr() + D * k_cache.element_size()
            or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1)):
        return None
    return k_cache.as_strided((k_cache.shape[0] * k_cache.shape[1], k_cache.shape[2], 2 * D),
                              (k_cache.stride(1), 2 * D, 1))


def _padded_cost(lens: np.ndarray, prefix: np.ndarray, num_heads: int, num_kv_heads: int) -> int:
    """Work of one padded batch of entries with ``lens`` rows over ``prefix + lens`` keys: the scores
    (``entries * Lq * Lk`` per query head) plus the keys and values gathered (``entries * Lk`` per KV head,
    weighted as a few score columns)."""
    if not lens.size:
        return 0
    Lq, Lk = int(lens.max()), int((prefix + lens).max())
    return lens.size * Lk * (Lq * num_heads + 8 * num_kv_heads)


# cpu_flash's float mask dtypes (float32, or float64 on the exactness path): numpy's, and -inf's bit pattern
_NUMPY_FLOAT = {torch.float32: np.float32, torch.float64: np.float64}
_NEG_INF_BITS = {torch.float32: (np.uint32, np.uint32(0xFF800000)),
                 torch.float64: (np.uint64, np.uint64(0xFFF0000000000000))}
