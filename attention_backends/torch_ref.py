"""The PyTorch prefix attention backend: runs on any device and dtype, and is what CI tests.

Per layer it computes two attentions and merges them by their log-sum-exp (FlashInfer's ``merge_state``):

1. *prefix*: the new rows of each request over its cached prefix, gathered from the pages once per request
   (one gather per layer for the whole batch: ``[R, max_prefix]`` slots), however many canvases it has;
2. *new tokens*: each segment's rows over the segment's own rows, under the plan's mask kind, padded to
   ``[S, max_seg_len]``; a DAG of canvases costs ``sum n_s^2`` scores, not ``(sum n_s)^2``.

Scores accumulate in float32 (float64 for float64 inputs: the exactness path). A row with no visible key
(a padded row) contributes nothing rather than NaN, and cache slots beyond each prefix are never read into the
result, so caches may be allocated uninitialised. All index tensors and masks are built in ``plan`` so
``run`` is a handful of batched tensor ops per layer.
"""

from __future__ import annotations

import torch

from .prefix_attention import AttentionPlan, check_run_inputs


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, L, H, D]`` over ``k, v [B, S, Hkv, D]`` with ``mask [B, L, S]`` (True = attend) or None.

    Returns the output ``[B, L, H, D]`` and log-sum-exp ``[B, L, H]`` (natural log; -inf for a row that sees no
    key, whose output is 0), in the accumulation dtype (float32, or float64 for float64 inputs). Grouped-query
    attention: head ``h`` reads KV head ``h // (H // Hkv)``; the ``G`` query heads of a KV head are batched as
    ``G * L`` query rows. On CPU this is PyTorch's fused flash-attention kernel (which returns the log-sum-exp),
    elsewhere plain matmuls with a max-shifted softmax.
    """
    B, L, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(B, L, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * L, D)
    kt, vt = k.to(acc).transpose(1, 2), v.to(acc).transpose(1, 2)  # [B, Hkv, S, D]
    if mask is None:
        mask = torch.ones(B, L, S, dtype=torch.bool, device=q.device)
    seen = mask.any(-1)  # [B, L]
    if q.device.type == "cpu":
        bias = torch.zeros(B, 1, G, L, S, dtype=acc).masked_fill(~mask[:, None, None], float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, kt, vt, 0.0, False, attn_mask=bias.view(B, 1, G * L, S), scale=scale)
    else:
        s = (qg @ kt.transpose(2, 3)).view(B, Hkv, G, L, S) * scale
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        z = e.sum(-1, keepdim=True)
        o = (e.view(B, Hkv, G * L, S) @ vt) / z.view(B, Hkv, G * L, 1).clamp_min(1e-30)
        lse = (m + torch.log(z)).view(B, Hkv, G * L)
    o = o.view(B, Hkv, G, L, D).permute(0, 3, 1, 2, 4).reshape(B, L, H, D)
    lse = lse.to(acc).view(B, Hkv, G, L).permute(0, 3, 1, 2).reshape(B, L, H)
    lse = lse.masked_fill(~seen[..., None], float("-inf"))
    return o.masked_fill(~seen[..., None, None], 0.0), lse


def merge_state(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the parts' outputs ``[..., H, D]`` and
    log-sum-exps ``[..., H]``."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0)[..., None]
    return o1 * w1 + o2 * w2


def _padded_index(indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, max_len]`` row ids of each group's rows (0 where padded) and the validity mask."""
    lens = indptr[1:] - indptr[:-1]
    n = int(lens.max()) if lens.numel() else 0
    j = torch.arange(n)
    valid = j < lens[:, None]
    return torch.where(valid, indptr[:-1, None] + j, torch.zeros_like(j)), valid


class TorchPrefixAttention:
    name = "torch"

    def plan(self, plan: AttentionPlan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             scale: float | None = None, device: torch.device | str | None = None,
             rows: torch.Tensor | None = None) -> None:
        """``rows``: where the plan's rows are in the tensors ``run`` gets (plan row ``i`` is input row
        ``rows[i]``, a permutation), so a caller whose rows are not request by request needs no gather."""
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        dev = torch.device(device) if device is not None else plan.block_table.device
        self.geom = (num_heads, num_kv_heads, head_dim)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.T = plan.num_tokens
        # prefix part: request rows padded [R, Lq]; prefix slots [R, P]
        has = plan.prefix_lens > 0
        self.req = has.nonzero().flatten()
        q_idx, q_ok = _padded_index(plan.qo_indptr)
        remap = (lambda idx: idx) if rows is None else (lambda idx: rows.long().cpu()[idx])
        self.pq_idx = remap(q_idx[self.req]).to(dev)
        self.pq_ok = q_ok[self.req].to(dev)
        self.pq_rows = self.pq_idx[self.pq_ok]
        slots = plan.prefix_slots()[self.req]
        self.p_slots = slots.to(dev)
        P = slots.shape[1]
        self.p_mask = (torch.arange(P) < plan.prefix_lens[self.req, None]).to(dev)[:, None, :]  # [R', 1, P]
        # new-token part: segment rows padded [S, Ls] and their [S, Ls, Ls] visibility
        s_idx, s_ok = _padded_index(plan.seg_indptr)
        self.s_idx, self.s_ok = remap(s_idx).to(dev), s_ok.to(dev)
        self.s_rows = self.s_idx[self.s_ok]
        Ls = s_idx.shape[1]
        m = s_ok[:, None, :].expand(-1, Ls, -1).clone()  # keys: the segment's own rows
        if plan.kind == "causal":
            m &= torch.ones(Ls, Ls, dtype=torch.bool).tril()
        elif plan.kind == "block_causal":
            blk = plan.positions.cpu()[s_idx] // plan.block_size
            m &= blk[:, None, :] <= blk[:, :, None]
        elif plan.kind == "custom":
            for s, cm in enumerate(plan.custom_masks):
                m[s, : cm.shape[0], : cm.shape[0]] &= cm.cpu()
        self.s_mask = m.to(dev)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        """``q [T, H, D]``, ``k, v [T, Hkv, D]`` (the new rows); caches ``[pages, page, Hkv, D]`` -> ``[T, H, D]``."""
        H, Hkv, D = self.geom
        check_run_inputs(self.T, self.geom, q, k, v, k_cache, v_cache)
        o_new, lse_new = attend(q[self.s_idx], k[self.s_idx], v[self.s_idx], self.scale, self.s_mask)
        acc = o_new.dtype
        out = torch.empty(self.T, H, D, dtype=acc, device=q.device)
        out[self.s_rows] = o_new[self.s_ok]
        if self.req.numel():
            lse = torch.empty(self.T, H, dtype=acc, device=q.device)
            lse[self.s_rows] = lse_new[self.s_ok]
            # [R', P, Hkv, D]: the prefix, gathered once per request. Slots past a prefix's end are padding
            # (slot 0): zero them, so unwritten (uninitialised) cache memory there cannot leak NaN into a score or
            # through a zero attention weight
            pad = ~self.p_mask[:, 0, :, None, None]
            # flat slots: a view for the reference engine's caches and for vLLM's NHD K|V pages alike
            kp = k_cache.flatten(0, 1)[self.p_slots].masked_fill(pad, 0)
            vp = v_cache.flatten(0, 1)[self.p_slots].masked_fill(pad, 0)
            o_p, lse_p = attend(q[self.pq_idx], kp, vp, self.scale, self.p_mask)
            rows = self.pq_rows
            out[rows] = merge_state(o_p[self.pq_ok], lse_p[self.pq_ok], out[rows], lse[rows])
        return out.to(q.dtype)
