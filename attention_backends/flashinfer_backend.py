"""The FlashInfer prefix attention backend (CUDA, float16/bfloat16): the fast GPU implementation.

Same contract as :class:`attention_backends.torch_backend.TorchPrefixAttention` and the same decomposition,
on FlashInfer kernels (written against flashinfer-python 0.7.0.post1, the version vLLM 0.32 pins; read from
its source; equal to the dense oracle on an H200 in bf16/fp16 for every mask kind, CUDA-graph mode included,
``-m gpu`` tests):

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

Kernels: FA2 by default (``kernel``): one kernel family for every mask kind (FlashInfer's FA3 takes no custom
mask, and ``auto`` would fix a wrapper's kernel at its first plan) and one JIT module per dtype and head size.

CUDA graphs (``graph``: a :class:`GraphShape`): FlashInfer's wrappers are built in CUDA-graph mode with persistent
index buffers (indptrs, page indices, last-page lengths, the packed mask and its offsets), which each ``plan``
overwrites in place, and the backend's own device tensors (row maps, mask byte offsets) are copied into
persistent buffers too, so a ``run`` captured on one step reads the next step's plan when replayed. FlashInfer
fixes the batch size (segments, requests with cached keys) of such a wrapper, and the captured run fixes its
branches and sizes (masked or not, one-token pages or not, rows, paged rows): a plan that differs in any of these
raises instead of replaying a stale layout. ``benchmarks/cuda_graph_step.py`` captures a whole model step this way.

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

from dataclasses import dataclass

import torch

from .prefix_attention import AttentionPlan, check_run_inputs, to_device


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape of the steps a CUDA graph is captured for (FlashInfer's CUDA-graph wrappers take fixed batch
    sizes and persistent index buffers). ``segments``: ragged batch entries (new-token segments); ``paged``:
    requests with cached keys; ``page_indices``: room for their page indices (one per cached slot for a plan with
    a kept suffix); ``mask_bytes``: room for the packed custom masks (0: the shape has none)."""

    segments: int
    paged: int
    page_indices: int
    mask_bytes: int = 0

    @classmethod
    def of(cls, plan: AttentionPlan, page_indices: int | None = None, mask_bytes: int | None = None) -> "GraphShape":
        """The shape of ``plan``, with room for ``page_indices`` / ``mask_bytes`` (default: what it needs)."""
        has = plan.cached_lens > 0
        flat = plan.suffix_lens is not None and bool((plan.suffix_lens > 0).any())
        need = int(plan.cached_lens[has].sum()) if flat else int(
            ((plan.prefix_lens[has] + plan.page_size - 1) // plan.page_size).sum())
        masked = 0
        if plan.kind in ("block_causal", "custom"):
            masked = int(plan.packed_segment_masks()[1][-1])
        return cls(plan.seg_indptr.numel() - 1, int(has.sum()), max(need, page_indices or 0),
                   max(masked, mask_bytes or 0))


class FlashInferPrefixAttention:
    """``kernel``: FlashInfer's prefill backend, ``fa2`` (default) or ``auto`` (FA3 on Hopper where a plan has no
    custom mask). ``fa2`` serves every mask kind with one kernel family and one JIT module per dtype and head
    size (``auto`` adds an FA3 module: minutes of compilation more on first use). ``graph``: CUDA-graph mode for
    steps of that :class:`GraphShape` (module docstring, "CUDA graphs")."""

    name = "flashinfer"
    KERNELS = ("fa2", "auto", "fa3")

    def __init__(self, device: torch.device | str = "cuda", workspace_bytes: int | None = None, kernel: str = "fa2",
                 graph: GraphShape | None = None):
        """``workspace_bytes``: each wrapper's float workspace; default 128 MB, 512 MB in graph mode, where
        FlashInfer plans every step for its largest grid and splits the keys (its partial outputs alone took
        158 MB for 32 heads of 128 on an H200)."""
        import flashinfer

        if workspace_bytes is None:
            workspace_bytes = (512 if graph is not None else 128) << 20

        if kernel not in self.KERNELS:
            raise ValueError(f"flashinfer kernel {kernel!r}; allowed: {', '.join(self.KERNELS)}")
        self.fi = flashinfer
        self.device = torch.device(device)
        self.kernel, self.graph = kernel, graph
        i32 = dict(dtype=torch.int32, device=self.device)
        bufs = {}
        if graph is not None:  # persistent index buffers: FlashInfer's plan copies into them, the graph reads them
            bufs = dict(use_cuda_graph=True, qo_indptr_buf=torch.zeros(graph.paged + 1, **i32),
                        paged_kv_indptr_buf=torch.zeros(graph.paged + 1, **i32),
                        paged_kv_indices_buf=torch.zeros(max(graph.page_indices, 1), **i32),
                        paged_kv_last_page_len_buf=torch.zeros(max(graph.paged, 1), **i32))
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device), kv_layout="NHD", backend=kernel,
            **bufs)
        self._ragged_workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._ragged = {}  # masked -> wrapper; one plan per forward, so the two share a workspace
        self._maps: dict[str, torch.Tensor] = {}  # graph mode: the backend's own device tensors, persistent
        self._graph_key = None  # graph mode: the branches the captured run takes (fixed by the first plan)

    def ragged(self, masked: bool):
        """The new-token wrapper with (``masked``) or without a custom mask (module docstring)."""
        if masked not in self._ragged:
            bufs = {}
            if self.graph is not None:
                i32 = dict(dtype=torch.int32, device=self.device)
                n = self.graph.segments + 1
                bufs = dict(use_cuda_graph=True, qo_indptr_buf=torch.zeros(n, **i32),
                            kv_indptr_buf=torch.zeros(n, **i32))
                if masked:
                    bufs.update(custom_mask_buf=torch.zeros(max(self.graph.mask_bytes, 1), dtype=torch.uint8,
                                                            device=self.device),
                                mask_indptr_buf=torch.zeros(n, **i32))
            self._ragged[masked] = self.fi.BatchPrefillWithRaggedKVCacheWrapper(
                self._ragged_workspace, kv_layout="NHD", backend=self.kernel, **bufs)
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
        maps = {"rows": paged_rows, "perm": perm, "inv": inv,
                "mask_indptr": None if byte_indptr is None else byte_indptr.to(i32)}
        if self.graph is not None:
            self._check_graph_key((self.masked, self.flat, T, *(None if t is None else t.numel()
                                                                for t in maps.values())))
        d = self._to_device(maps)
        self.rows, self.perm, self.inv = d["rows"], d["perm"], d["inv"]
        if self.masked:
            if not isinstance(getattr(self.ragged_run, "_mask_indptr_buf", None), torch.Tensor):
                raise RuntimeError("flashinfer: BatchPrefillWithRaggedKVCacheWrapper has no _mask_indptr_buf after "
                                   "plan; the packed-mask workaround is written against flashinfer-python 0.7.0.post1")
            if self.graph is not None:  # the captured kernels read this buffer: overwrite it in place
                self.ragged_run._mask_indptr_buf.copy_(d["mask_indptr"], non_blocking=True)
            else:
                self.ragged_run._mask_indptr_buf = d["mask_indptr"]

    def _check_graph_key(self, key: tuple) -> None:
        """Graph mode: a captured run replays the branches and tensor sizes of the plan it was captured with, so
        every later plan must take the same (else a replay would read a stale layout)."""
        if self._graph_key is None:
            self._graph_key = key
        elif key != self._graph_key:
            raise ValueError(f"flashinfer CUDA-graph mode: this plan's layout {key} differs from the captured one "
                             f"{self._graph_key} (masked, one-token pages, rows, paged rows, row maps, mask "
                             "offsets); plan a step of the graph's shape or use a backend without graph")

    def _to_device(self, maps: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """The backend's own device tensors in one copy; in graph mode copied into persistent buffers (the
        addresses a captured graph reads) instead of fresh ones."""
        d = to_device(maps, self.device)
        if self.graph is None:
            return d
        for name, t in d.items():
            if t is None:
                continue
            if name not in self._maps:
                self._maps[name] = torch.empty_like(t)
            self._maps[name].copy_(t, non_blocking=True)
            d[name] = self._maps[name]
        return d

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
