"""Attention of new tokens over a paged prefix plus themselves, under a per-request mask: plain PyTorch.

The operation draft verification needs (issue "attention_backends"): request ``r`` has a cached prefix of
``prefix_lens[r]`` tokens in a paged KV cache and ``n_r`` new tokens (one or more draft canvases, a token
tree, an SDAR block...). Every new token sees the whole prefix; among the new tokens a mask decides:

- ``bidirectional``: all of them (one canvas);
- ``causal``: earlier ones (by row order);
- ``block_causal``: those whose attention block ``position // block_size`` is not later (SDAR);
- ``custom``: a boolean ``[n_r, n_r]`` matrix per request (DAG of draft canvases: each canvas sees itself;
  token trees: each token sees its ancestors), given packed as FlashInfer packs ``custom_mask``.

The prefix is gathered once per request (not once per canvas) and the two parts are merged by their
log-sum-exp (FlashInfer's ``merge_state``), so a request with K canvases costs one prefix gather. Layout
of the cache: ``[num_pages, page_size, num_kv_heads, head_dim]`` for K and V (FlashInfer's ``NHD``).
Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

This is the reference that runs anywhere (CPU CI, GPUs); a FlashInfer path with the same signature is the
fast GPU implementation (not built yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

MaskKind = Literal["bidirectional", "causal", "block_causal", "custom"]


@dataclass
class PagedKV:
    """A paged KV cache and, per request, its pages (``block_table``) and cached length (``prefix_lens``)."""

    k_cache: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [num_requests, max_pages] int
    prefix_lens: torch.Tensor  # [num_requests] int

    def gather(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of request ``r``'s prefix: ``[prefix_len, num_kv_heads, head_dim]`` each."""
        n = int(self.prefix_lens[r])
        page = self.k_cache.shape[1]
        pages = self.block_table[r, : (n + page - 1) // page].long()
        k = self.k_cache[pages].flatten(0, 1)[:n]
        v = self.v_cache[pages].flatten(0, 1)[:n]
        return k, v


def pack_mask(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-request boolean masks as FlashInfer does: row-major bits, little-endian within a byte.

    Returns ``(packed uint8, mask_indptr)``; request ``r``'s bits start at byte ``mask_indptr[r]``.
    """
    chunks, indptr = [], [0]
    for m in masks:
        bits = m.flatten().to(torch.uint8)
        pad = (-bits.numel()) % 8
        bits = torch.cat([bits, bits.new_zeros(pad)]).view(-1, 8)
        chunks.append((bits << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8))
        indptr.append(indptr[-1] + chunks[-1].numel())
    return torch.cat(chunks), torch.tensor(indptr)


def unpack_mask(packed: torch.Tensor, indptr: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """Request ``r``'s ``[n, n]`` boolean mask from :func:`pack_mask`'s output."""
    b = packed[int(indptr[r]): int(indptr[r + 1])]
    bits = (b[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.flatten()[: n * n].view(n, n).bool()


def merge_state(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Combine two attention outputs over disjoint key sets from their log-sum-exps (``[T, H]``)."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """Output and log-sum-exp of ``q [T, H, D]`` over ``k, v [S, Hkv, D]`` (``mask [T, S]`` bool or None)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # accumulate in at least float32
    s = torch.einsum("thd,shd->hts", q.to(acc), k.to(acc)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, T]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no visible key contributes nothing
    o = torch.einsum("hts,shd->thd", p, v.to(acc))
    return o, lse.transpose(0, 1)


def new_token_mask(kind: MaskKind, n: int, positions: torch.Tensor | None = None, block_size: int = 0,
                   custom: torch.Tensor | None = None) -> torch.Tensor | None:
    """The ``[n, n]`` visibility among one request's new tokens (None = all visible)."""
    if kind == "bidirectional":
        return None
    if kind == "causal":
        return torch.ones(n, n, dtype=torch.bool).tril()
    if kind == "block_causal":
        if positions is None or block_size <= 0:
            raise ValueError("block_causal needs positions and block_size > 0")
        blk = positions // block_size
        return blk[None, :] <= blk[:, None]
    if kind == "custom":
        if custom is None or custom.shape != (n, n):
            raise ValueError(f"custom mask must be [{n}, {n}] bool")
        return custom.bool()
    raise ValueError(f"mask kind {kind!r}; allowed: bidirectional, causal, block_causal, custom")


def prefix_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv: PagedKV,
                     qo_indptr: torch.Tensor, *, kind: MaskKind = "bidirectional", scale: float | None = None,
                     positions: torch.Tensor | None = None, block_size: int = 0,
                     packed_mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every request's new tokens over its paged prefix and its new tokens (module docstring).

    ``q [T, H, D]``, ``k_new, v_new [T, Hkv, D]`` are the new tokens of all requests, request ``r`` owning
    rows ``qo_indptr[r]:qo_indptr[r + 1]``; ``positions [T]`` (block_causal); ``packed_mask, mask_indptr``
    (custom, from :func:`pack_mask`). Returns ``[T, H, D]`` in ``q``'s dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for r in range(qo_indptr.numel() - 1):
        a, b = int(qo_indptr[r]), int(qo_indptr[r + 1])
        if a == b:
            continue
        custom = unpack_mask(packed_mask, mask_indptr, r, b - a) if kind == "custom" else None
        m = new_token_mask(kind, b - a, positions[a:b] if positions is not None else None, block_size, custom)
        o, lse = _attend(q[a:b], k_new[a:b], v_new[a:b], scale, m)
        if int(kv.prefix_lens[r]) > 0:
            pk, pv = kv.gather(r)
            o_p, lse_p = _attend(q[a:b], pk, pv, scale, None)
            o = merge_state(o_p, lse_p, o, lse)
        out[a:b] = o.to(q.dtype)
    return out
