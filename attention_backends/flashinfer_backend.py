"""The FlashInfer prefix attention backend (CUDA, float16/bfloat16): the fast GPU implementation.

Same contract as :class:`attention_backends.torch_backend.TorchPrefixAttention` and the same decomposition,
on FlashInfer kernels (written against flashinfer-python 0.5-0.6):

1. *cached keys*: ``BatchPrefillWithPagedKVCacheWrapper`` (``NHD``, no mask) over the rows of the requests
   that have a prefix (FlashInfer cannot express an empty paged sequence, so requests without one are left
   out and their rows keep the new-token part alone). A plan with a kept suffix (DualCache) is not a run of
   whole pages, so it goes as one-token pages (``page_size=1``, an index per cache slot, as SGLang drives
   FlashInfer);
2. *new tokens*: ``BatchPrefillWithRaggedKVCacheWrapper`` with one batch entry per *segment* (queries and
   keys are the segment's own rows): ``causal=True`` for causal segments, nothing for bidirectional ones,
   and a ``custom_mask`` for block-causal and custom (tree / DAG) segments;
3. ``flashinfer.merge_state`` of the two (FlashInfer's log-sum-exps are base 2; merging its own outputs
   keeps them consistent).

The custom mask is handed over as booleans, not pre-packed: with ``packed_custom_mask`` the ragged
``plan`` of flashinfer 0.6.5 derives ``mask_indptr`` in bits while its kernel reads it in bytes, which is
only right for a single segment; with ``custom_mask`` FlashInfer packs per segment and both agree.
"""

from __future__ import annotations

import torch

from .prefix_attention import AttentionPlan, check_run_inputs


class FlashInferPrefixAttention:
    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda", workspace_bytes: int = 128 << 20):
        import flashinfer

        self.fi = flashinfer
        self.device = torch.device(device)
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device), kv_layout="NHD")
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device), kv_layout="NHD")

    def plan(self, plan: AttentionPlan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             scale: float | None = None, device=None, cached: torch.Tensor | None = None) -> None:
        """``cached`` (which rows' K/V the caller wrote to the cache) is not needed: new rows come from ``k, v``."""
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention backend 'flashinfer' runs float16/bfloat16, got {dtype}; allowed: torch")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        dev, i32 = self.device, torch.int32
        self.geom = (num_heads, num_kv_heads, head_dim)
        self.T = plan.num_tokens
        heads = dict(num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim, sm_scale=scale,
                     q_data_type=dtype, kv_data_type=dtype)
        # new tokens: one ragged batch entry per segment
        seg = plan.seg_indptr.to(dev, i32)
        kw = {}
        if plan.kind == "causal":
            kw["causal"] = True
        elif plan.kind in ("block_causal", "custom"):
            kw["custom_mask"] = torch.cat([plan.segment_mask(s).flatten() for s in range(seg.numel() - 1)]).to(dev)
        self.ragged.plan(seg, seg, **heads, **kw)
        # cached keys: the rows of requests that have some, over their pages; a plan with a kept suffix (not a
        # run of whole pages) goes as one-token pages, each index a cache slot
        C = plan.cached_lens
        has = (C > 0).nonzero().flatten()
        self.rows, self.flat = None, plan.suffix_lens is not None and bool((plan.suffix_lens > 0).any())
        if has.numel():
            qo = plan.qo_indptr
            lens = (qo[1:] - qo[:-1])[has]
            self.rows = torch.cat([torch.arange(int(qo[r]), int(qo[r + 1])) for r in has.tolist()]).to(dev)
            if self.flat:
                page, P = 1, C[has]
                slots = plan.cached_slots()[has]
                indices, n_pages = slots[torch.arange(slots.shape[1]) < P[:, None]], P
            else:
                page, P = plan.page_size, plan.prefix_lens[has]
                n_pages = (P + page - 1) // page
                indices = torch.cat([plan.block_table[r, :n].long().cpu()
                                     for r, n in zip(has.tolist(), n_pages.tolist())])
            self.paged.plan(torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(dev, i32),
                            torch.cat([torch.zeros(1, dtype=torch.long), n_pages.cumsum(0)]).to(dev, i32),
                            indices.to(dev, i32), (P - (n_pages - 1) * page).to(dev, i32),
                            page_size=page, causal=False, **heads)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        check_run_inputs(self.T, self.geom, q, k, v, k_cache, v_cache)
        out, lse = self.ragged.run(q, k, v, return_lse=True)
        if self.rows is not None:
            qp = q[self.rows]
            if self.flat:  # one-token pages: [slots, 1, Hkv, D] views
                k_cache, v_cache = k_cache.flatten(0, 1)[:, None], v_cache.flatten(0, 1)[:, None]
            o_p, lse_p = self.paged.run(qp, (k_cache, v_cache), return_lse=True)
            merged, _ = self.fi.merge_state(o_p, lse_p, out[self.rows], lse[self.rows])
            out[self.rows] = merged
        return out
