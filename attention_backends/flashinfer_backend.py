"""The FlashInfer prefix attention backend (CUDA, float16/bfloat16): the fast GPU implementation.

Same contract as :class:`attention_backends.torch_backend.TorchPrefixAttention` and the same decomposition,
on FlashInfer kernels (written against flashinfer-python 0.7.0.post1, the version vLLM 0.32 pins; read from
its source, not yet run on a GPU):

1. *cached keys*: ``BatchPrefillWithPagedKVCacheWrapper`` (``NHD``, no mask) over the rows of the requests
   that have cached keys (requests without any are left out: their rows keep the new-token part alone, and
   no zero-length paged entry reaches the kernels or ``merge_state``). A plan with a kept
   suffix (DualCache) is not a run of whole pages, so it goes as one-token pages (``page_size=1``, an index
   per cache slot, as SGLang drives FlashInfer). The K and V pages may be strided views: vLLM's pages keep K
   and V side by side per head (``stride_h = 2 * head_dim``, V at offset ``head_dim``); FlashInfer 0.7 reads
   the page, token and head strides of each tensor (``paged_kv_t`` with ``kv_strides``; the FA2 kernel needs
   K and V to have equal strides, the FA3 kernel equal page and token strides, which both views have) and
   needs only the head dimension contiguous;
2. *new tokens*: ``BatchPrefillWithRaggedKVCacheWrapper`` with one batch entry per *segment* (queries and
   keys are the segment's own rows): ``causal=True`` for causal segments, nothing for bidirectional ones,
   and a packed custom mask for block-causal and custom (tree / DAG) segments. Masked and unmasked plans
   use two wrappers: an ``auto`` wrapper fixes its kernel at its first plan (FA3 on Hopper when that plan
   has no mask, and FA3 takes no custom mask), and in 0.7.0.post1 an unmasked ``plan`` does not clear the
   mask a previous one left (``_custom_mask_buf``), so its run would still apply it;
3. ``flashinfer.merge_state`` of the two (FlashInfer's log-sum-exps are base 2; merging its own outputs
   keeps them consistent).

Everything is planned on the host, and ``plan`` gets host (CPU) int32 indptrs, page indices, last-page
lengths and kv lengths, as vLLM's own FlashInfer backend passes them: FlashInfer reads its host copies of the
indptrs without a device round trip and copies what the kernels read with ``non_blocking`` copies (from
pinned memory here, on CUDA). The backend's own device tensors (the row maps, the mask's byte offsets) go in
one copy.

The custom mask is packed on the host and its byte offsets are set after ``plan``: in flashinfer 0.7.0.post1
(as in 0.6.5), a ``plan`` given ``packed_custom_mask`` derives ``mask_indptr`` in *bits*
(``_compute_mask_indptr``: the cumulative ``qo_len * kv_len``) while the kernel adds it to a byte pointer
(``variants.cuh``: ``maybe_custom_mask + maybe_mask_indptr[batch_idx]``), which is only right for a single
segment; its ``custom_mask`` route packs per segment with byte offsets that agree, but packs on the device
with ``segment_packbits``, which reads the packed length back (``indptr_new[-1].item()``): a device sync
every forward. So the plan hands FlashInfer the packed bits and replaces its ``_mask_indptr_buf`` with the byte
offsets (checked: the attribute must exist after ``plan``).
"""

from __future__ import annotations

import torch

from .prefix_attention import AttentionPlan, check_run_inputs, to_device


class FlashInferPrefixAttention:
    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda", workspace_bytes: int = 128 << 20):
        import flashinfer

        self.fi = flashinfer
        self.device = torch.device(device)
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device), kv_layout="NHD")
        self._ragged_workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._ragged = {}  # masked -> wrapper; one plan per forward, so the two share a workspace

    def ragged(self, masked: bool):
        """The new-token wrapper with (``masked``) or without a custom mask (module docstring)."""
        if masked not in self._ragged:
            self._ragged[masked] = self.fi.BatchPrefillWithRaggedKVCacheWrapper(self._ragged_workspace,
                                                                                kv_layout="NHD")
        return self._ragged[masked]

    def plan(self, plan: AttentionPlan, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             scale: float | None = None, device=None, cached: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> None:
        """``rows``: where the plan's rows are in the tensors ``run`` gets (plan row ``i`` is input row
        ``rows[i]``); ``cached`` (which rows' K/V the caller wrote to the cache) is not needed: new rows come
        from ``k, v``. Host tensors all."""
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention backend 'flashinfer' runs float16/bfloat16, got {dtype}; allowed: torch")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        i32 = torch.int32
        self.geom = (num_heads, num_kv_heads, head_dim)
        T = self.T = plan.num_tokens
        heads = dict(num_qo_heads=num_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_vo=head_dim,
                     sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
        # new tokens: one ragged batch entry per segment
        seg = self._host(plan.seg_indptr.to(i32))
        self.masked = plan.kind in ("block_causal", "custom")
        self.ragged_run = self.ragged(self.masked)
        byte_indptr = None
        if self.masked:
            packed, byte_indptr = plan.packed_segment_masks()
            self.ragged_run.plan(seg, seg, packed_custom_mask=self._host(packed), **heads)
        else:
            self.ragged_run.plan(seg, seg, causal=plan.kind == "causal", **heads)
        # cached keys: the rows of requests that have some, over their pages; a plan with a kept suffix (not a
        # run of whole pages) goes as one-token pages, each index a cache slot
        C = plan.cached_lens
        has = C > 0
        self.flat = plan.suffix_lens is not None and bool((plan.suffix_lens > 0).any())
        paged_rows = None
        if bool(has.any()):
            qo = plan.qo_indptr
            lens = qo.diff()
            req_of_row = torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=T)
            paged_rows = has[req_of_row].nonzero().flatten()  # plan rows of requests with cached keys
            if self.flat:
                page, kv_lens = 1, C[has]
                slots = plan.cached_slots()[has]
                indices = slots[torch.arange(slots.shape[1]) < kv_lens[:, None]]
                n_pages = kv_lens
            else:
                page, kv_lens = plan.page_size, plan.prefix_lens[has]
                n_pages = (kv_lens + page - 1) // page
                table = plan.block_table[has]
                indices = table[torch.arange(table.shape[1]) < n_pages[:, None]]
            zero = torch.zeros(1, dtype=torch.long)
            self.paged.plan(self._host(torch.cat([zero, lens[has].cumsum(0)]).to(i32)),
                            self._host(torch.cat([zero, n_pages.cumsum(0)]).to(i32)),
                            self._host(indices.to(i32)), self._host((kv_lens - (n_pages - 1) * page).to(i32)),
                            page_size=page, causal=False, seq_lens=self._host(kv_lens.to(i32)), **heads)
        perm = inv = None
        if rows is not None:
            perm = rows.long()
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel())
        d = to_device({"rows": paged_rows, "perm": perm, "inv": inv,
                       "mask_indptr": None if byte_indptr is None else byte_indptr.to(i32)}, self.device)
        self.rows, self.perm, self.inv = d["rows"], d["perm"], d["inv"]
        if self.masked:
            if not isinstance(getattr(self.ragged_run, "_mask_indptr_buf", None), torch.Tensor):
                raise RuntimeError("flashinfer: BatchPrefillWithRaggedKVCacheWrapper has no _mask_indptr_buf after "
                                   "plan; the packed-mask workaround is written against flashinfer-python 0.7.0.post1")
            self.ragged_run._mask_indptr_buf = d["mask_indptr"]

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor FlashInfer copies to the device with ``non_blocking``: pinned on CUDA, so the copy is
        asynchronous."""
        t = t.contiguous()
        return t.pin_memory() if self.device.type == "cuda" else t

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> torch.Tensor:
        check_run_inputs(self.T, self.geom, q, k, v, k_cache, v_cache)
        if self.perm is not None:  # plan order
            q, k, v = q.index_select(0, self.perm), k.index_select(0, self.perm), v.index_select(0, self.perm)
        out, lse = self.ragged_run.run(q, k, v, return_lse=True)
        if self.rows is not None:
            qp = q.index_select(0, self.rows)
            if self.flat:  # one-token pages: [slots, 1, Hkv, D] views
                k_cache, v_cache = k_cache.flatten(0, 1)[:, None], v_cache.flatten(0, 1)[:, None]
            o_p, lse_p = self.paged.run(qp, (k_cache, v_cache), return_lse=True)
            merged, _ = self.fi.merge_state(o_p, lse_p, out.index_select(0, self.rows),
                                            lse.index_select(0, self.rows))
            out.index_copy_(0, self.rows, merged)
        return out if self.inv is None else out.index_select(0, self.inv)
