"""vLLM's own CPU paged-attention kernel for the rows vLLM scheduled: prefix and canvas read in place.

On the CPU the project's backend keeps vLLM's KV pages in the layout of vLLM's CPU attention backend
(``LBHNC``: per page and KV head, the page's keys, then its values) so that vLLM's kernels can read and write
them: ``cpu_attn_reshape_and_cache`` writes the new rows' K/V at their slots, and ``cpu_attention_with_kv_cache``
attends each request's query rows over the keys ``[0, seq_len)`` of its pages, bidirectionally or causally, with
no gather, no padding and no mask tensor.

That covers a request's *scheduled* rows (its first canvas, a prefill, a plain causal step) whenever the keys
they see are exactly ``[0, seq_len)``: the cached prefix, the rows themselves (written before attending) and,
under DualCache, the kept suffix when it starts right after the rows (:func:`kernel_rows` decides per
forward). A request's further canvases (drafts) stand on the same positions and see the same keys with their
own K/V in the window: :func:`canvas_passes` makes each canvas index one more kernel call, with that canvas's
K/V written at the scheduled rows' slots before it attends, and the scheduled rows' own K/V written last, so
the cache keeps theirs. Per layer that measured 1.3-4.8x faster than PyTorch for every row where the step's
attention work is large (16 requests, long prefixes, LLaDA-8B's heads) and slower for one request at the
embedded shape (0.60-0.94x: several kernel calls against one), so :func:`passes_pay` keeps small steps with
drafts on PyTorch (``benchmarks/cpu_attention.py``). SDAR's
block-causal layers and PRESTO's tree masks go through :class:`~.torch_backend.TorchPrefixAttention`, which
reads the same pages (:func:`~.torch_backend.slot_rows`).

The kernel sums in another order than PyTorch's CPU flash attention (outputs agree to float32 rounding, about
1e-7), so a vLLM engine on the CPU is token-equal to the reference engine wherever no decision sits within that
distance of a tie; the tests compare them on the embedded models.

The vLLM names used here (``vllm._custom_ops``' three CPU attention ops, the CPU backend's ISA choice and head
sizes) are private and listed in :mod:`psd_plugin.vllm.compat`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .step_batch import StepBatch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_ISAS = ("vec", "vec16")  # the kernels whose page interiors ``page_views`` reads (not AMX's or NEON's)


def kernel_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V page tensors vLLM's CPU ops take: one layer's ``[blocks, kv_heads, page, 2 * head_dim]`` cache
    (contiguous) split per page and head into its keys' and its values' halves, as vLLM's CPU backend does."""
    blocks, kv_heads, page, _ = kv_cache.shape
    return kv_cache.view(blocks, kv_heads, 2 * page, head_size).chunk(2, dim=2)


def page_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[blocks, kv_heads, page, head_dim]`` views of the same cache, element ``[b, h, token, d]``: what
    PyTorch reads and writes. The kernels (``vec``/``vec16``) keep a page's keys dimension-major (``[head_dim,
    page]``, so a key dimension of consecutive tokens is one vector) and its values token-major (``[page,
    head_dim]``); the views follow that, with no copy."""
    blocks, kv_heads, page, _ = kv_cache.shape
    half = page * head_size
    s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
    k = kv_cache.as_strided((blocks, kv_heads, page, head_size), (s0, s1, 1, page))
    v = kv_cache.as_strided((blocks, kv_heads, page, head_size), (s0, s1, head_size, 1), kv_cache.storage_offset() + half)
    return k, v


def kernel_supports(head_dim: int, page_size: int, dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU kernel runs this geometry: its head sizes, dtypes and pages of a multiple of 32 tokens
    (vLLM's CPU pages are 128), on an instruction set whose page interiors
    :func:`page_views` knows."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return (dtype in KERNEL_DTYPES and head_dim in CPUAttentionBackend.get_supported_head_sizes()
            and page_size % 32 == 0 and kernel_isa(dtype, page_size, head_dim) in KERNEL_ISAS)


def kernel_isa(dtype: torch.dtype, page_size: int, head_dim: int) -> str:
    """The instruction set vLLM's CPU backend picks for these pages (``vec``, ``vec16``, ``amx``, ``neon``, ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, page_size, head_dim)


@dataclass
class KernelRows:
    """The scheduled rows as the kernel takes them: ``[R + 1]`` query offsets, ``[R]`` key counts (int32)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool


def kernel_rows(batch: StepBatch, pattern: str) -> KernelRows | None:
    """The kernel's view of ``batch``'s scheduled rows under a layer ``pattern``, or None when some request's
    scheduled rows do not see exactly the keys ``[0, seq_len)``: a mask other than bidirectional or causal, a
    request whose first segment is not all its scheduled rows, or a kept suffix that does not start right
    after the rows (or under a causal mask)."""
    kind = batch.kind or pattern
    if kind not in ("bidirectional", "causal"):
        return None
    # host arrays in numpy: a few microseconds where a dozen small torch ops take tens
    n = batch.scheduled_lens.numpy()
    R = n.size
    starts = batch.qo_indptr.numpy()[:-1]
    # the first segment of each request (plan order) is its scheduled rows
    seg = batch.seg_indptr.numpy()
    first_end = seg[np.minimum(np.searchsorted(seg, starts, side="right"), seg.size - 1)]
    if R and not (first_end - starts == n).all():
        return None
    seq = batch.prefix_lens.numpy() + n
    if batch.suffix_lens is not None:
        suf = batch.suffix_lens.numpy()
        has = suf > 0
        if has.any() and (kind == "causal" or not (batch.suffix_starts.numpy()[has] == seq[has]).all()):
            return None
        seq = seq + suf
    qsl = np.zeros(R + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(n)
    return KernelRows(torch.from_numpy(qsl), torch.from_numpy(seq.astype(np.int32)), kind == "causal")


@dataclass
class CanvasPass:
    """One further canvas of each request that has it, as one kernel call: ``rows`` are its model rows (plan
    order within the pass: request by request), ``write`` the index of the scheduled row each one stands on (its
    position's slot), ``reqs`` the requests in the pass."""

    rows: torch.Tensor
    write: torch.Tensor
    reqs: torch.Tensor


def canvas_passes(batch: StepBatch) -> list[CanvasPass] | None:
    """The extra rows of ``batch`` as kernel passes, one per canvas index (the second canvas of every request
    that has two or more, then the third, ...), or None when a request's canvases do not all stand on its
    scheduled rows (a segment of another length: the kernel reads a canvas's own K/V from the pages, at the
    scheduled rows' slots)."""
    qo, seg, n = batch.qo_indptr, batch.seg_indptr, batch.scheduled_lens
    R = n.numel()
    if not R or batch.num_extra == 0:
        return []
    canvases = qo.diff() // n.clamp(min=1)
    if bool((canvases * n != qo.diff()).any()) or seg.numel() - 1 != int(canvases.sum()) \
            or bool((seg.diff() != torch.repeat_interleave(n, canvases)).any()):
        return None  # (more segments than canvases: a replay's tail, DLLMStep)
    model_row = batch.order if batch.order is not None else torch.arange(int(qo[-1]))
    sched0 = torch.zeros(R, dtype=torch.long)
    torch.cumsum(n[:-1], 0, out=sched0[1:])
    passes = []
    for k in range(1, int(canvases.max())):
        reqs = (canvases > k).nonzero().flatten()
        lens = n[reqs]
        N = int(lens.sum())
        req = torch.repeat_interleave(reqs, lens, output_size=N)
        first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=N)
        i = torch.arange(N) - first  # row within its canvas
        passes.append(CanvasPass(model_row[qo[req] + k * n[req] + i], sched0[req] + i, reqs))
    return passes


PASSES_MIN_WORK = 1 << 23  # query rows x keys x heads x head_dim (benchmarks/results/cpu_attention.md)


def passes_pay(batch: StepBatch, num_heads: int, head_dim: int) -> bool:
    """Whether a step with draft canvases goes through the kernel (a call per canvas index) rather than PyTorch
    for every row: when its attention work (every row against its request's keys) is at least
    ``PASSES_MIN_WORK``. Below that, on this project's 2-thread CPU, PyTorch's one call beat the kernel's
    several (one request at the embedded shape, three drafts: 0.60-0.94x), above it the kernel won (1.3-4.8x).
    Checked before anything else is planned: a step it declines costs the builder nothing more."""
    keys = batch.prefix_lens + batch.scheduled_lens
    if batch.suffix_lens is not None:
        keys = keys + batch.suffix_lens
    return int((batch.qo_indptr.diff() * keys).sum()) * num_heads * head_dim >= PASSES_MIN_WORK


class CPUPagedKernel:
    """vLLM's CPU attention over the scheduled rows of one forward: ``plan`` once (the kernel's work split),
    ``run`` per layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                 scale: float):
        self.geom = (num_heads, num_kv_heads, head_dim)
        self.page_size, self.dtype, self.scale = page_size, dtype, scale
        self.isa = kernel_isa(dtype, page_size, head_dim)
        self.rows: KernelRows | None = None
        self.passes: list = []
        self.num_extra = 0

    def plan(self, rows: KernelRows, block_table: torch.Tensor, passes: list[CanvasPass] | None = None,
             slots: torch.Tensor | None = None) -> None:
        """Plan the scheduled rows and, with ``passes``, each further canvas as its own call (a pass over every
        request shares the scheduled rows' plan: the same query and key counts) writing its K/V at the scheduled
        rows' ``slots`` it stands on."""
        self.rows, self.block_table = rows, block_table.to(torch.int32)
        self.metadata = self._metadata(rows)
        self.passes = []
        self.num_extra = sum(p.rows.numel() for p in passes or ())
        R = rows.seq_lens.numel()
        for p in passes or ():
            at = slots[p.write].to(torch.long)
            if p.reqs.numel() == R:
                self.passes.append((p, at, rows, self.block_table, self.metadata))
                continue
            lens = rows.query_start_loc.diff()[p.reqs]
            qsl = torch.zeros(lens.numel() + 1, dtype=torch.int32)
            torch.cumsum(lens, 0, out=qsl[1:])
            sub = KernelRows(qsl, rows.seq_lens[p.reqs], rows.causal)
            self.passes.append((p, at, sub, self.block_table[p.reqs], self._metadata(sub)))

    def _metadata(self, rows: KernelRows):
        from vllm import _custom_ops as ops

        H, Hkv, D = self.geom
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows.seq_lens.numel(), num_heads=H, num_kv_heads=Hkv, head_dim=D, seq_lens=rows.seq_lens,
            dtype=self.dtype, query_start_loc=rows.query_start_loc, causal=rows.causal, sliding_window_size=-1,
            isa=self.isa, enable_kv_split=False)

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """The new rows' K/V at their flat ``slots`` of one layer's cache (vLLM's op)."""
        from vllm import _custom_ops as ops

        ops.cpu_attn_reshape_and_cache(key, value, *kernel_views(kv_cache, self.geom[2]), slots, self.isa)

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of the scheduled rows ``query [T, H, D]`` over one layer's cache into ``out [T, H, D]``."""
        self._attend(query, kv_cache, out, self.rows, self.block_table, self.metadata)

    def run_passes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   out: torch.Tensor) -> None:
        """The further canvases (``query``/``key``/``value``/``out``: every row of the forward, model order), one
        pass each: the canvas's K/V written at the slots of the scheduled rows it stands on (planned), then its
        rows attend. The scheduled rows' own K/V must be written after this (``write`` then ``run``)."""
        for p, at, rows, table, metadata in self.passes:
            self.write(key[p.rows], value[p.rows], kv_cache, at)
            res = torch.empty(p.rows.numel(), *out.shape[1:], dtype=out.dtype)
            self._attend(query[p.rows], kv_cache, res, rows, table, metadata)
            out[p.rows] = res

    def _attend(self, query, kv_cache, out, rows: KernelRows, table, metadata) -> None:
        from vllm import _custom_ops as ops

        k_pages, v_pages = kernel_views(kv_cache, self.geom[2])
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=k_pages, value_cache=v_pages, output=out, query_start_loc=rows.query_start_loc,
            seq_lens=rows.seq_lens, scale=self.scale, causal=rows.causal, alibi_slopes=None, sliding_window=-1,
            block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=None)


def write_pages(key: torch.Tensor, value: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                slots: torch.Tensor) -> None:
    """The new rows' K/V at their flat ``slots`` of the :func:`page_views`, in PyTorch (a geometry vLLM's kernel
    does not run)."""
    page = k_pages.shape[2]
    blk, off = slots // page, slots % page
    k_pages[blk, :, off] = key.to(k_pages.dtype)
    v_pages[blk, :, off] = value.to(v_pages.dtype)
