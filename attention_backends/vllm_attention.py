"""A vLLM ``Attention`` layer for dLLMs: bidirectional or block-causal attention over the paged KV cache.

vLLM's V1 runner builds every decoder layer's metadata with ``causal=True``. dLLMs need

- ``bidirectional`` (LLaDA, Dream): a request's scheduled tokens attend to each other in both
  directions and to the request's cached prefix;
- ``block_causal`` (SDAR): as above, but a token only sees keys whose attention block
  (``position // block_size``) is not later than its own.

Both are done at metadata-build time, so any backend that honours ``causal=False`` and per-request
``query_start_loc`` / ``seq_lens`` / block-table rows (the CPU backend, FlashAttention, FlashInfer) runs
them unchanged: every request becomes one or more non-causal *segments* (:mod:`.segments`). Bidirectional
is one segment per request (as vLLM's ``PrefillPrefixLMAttention``), plus one detached segment per extra
draft canvas when the dLLM runner verifies drafts; block-causal additionally splits each segment at
block boundaries, sub-segment ``j`` ending at the last key of its block. K/V writes go through
``slot_mapping``, one entry per token, so splitting the queries changes nothing about where K/V land.
Design choice: segments instead of a dense mask, because the CPU kernel has no arbitrary masks and
segments keep every kernel's paged fast path.

How this relates to :mod:`.prefix_attention` (the issue's "vLLM path as a registered backend or through the
model classes" choice): the vLLM path keeps vLLM's own kernels and expresses an
:class:`~.prefix_attention.AttentionPlan` with ``bidirectional`` / ``block_causal`` segments as kernel
segments over block-table rows (a detached canvas's row lists the shared prefix pages plus private pages,
:class:`.segments.PrivatePages`), so the prefix is read in place, never copied. The reference engine calls
the :mod:`.prefix_attention` backends directly; ``custom`` (tree) masks, which vLLM's kernels cannot express
as segments, are served by those backends only.

The KV-cache spec is marked ``non_causal`` (as ``PrefillPrefixLMAttention`` does) so the engine turns
off chunked prefill and prefix caching, which assume causal attention.
"""

from __future__ import annotations

import functools
from copy import copy
from dataclasses import replace

import numpy as np
import torch

from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionBackend, AttentionType, CommonAttentionMetadata, \
    subclass_attention_backend
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

from .segments import Segment, split_block_causal, step_segments


def segments_metadata(meta: CommonAttentionMetadata, segments: list[Segment]) -> CommonAttentionMetadata:
    """``meta`` re-expressed as one non-causal virtual request per segment (see :mod:`.segments`).

    Per-request fields are re-indexed by each segment's request; a segment with its own ``pages`` gets
    that block-table row. K/V writes go through ``slot_mapping`` (one entry per token) and are untouched.
    """
    starts = [0] + [s.q_end for s in segments]
    lens = [s.seq_len for s in segments]
    rows = torch.tensor([s.req for s in segments], dtype=torch.long)
    dev = meta.query_start_loc.device
    new = copy(meta)
    qsl_cpu = torch.tensor(starts, dtype=meta.query_start_loc_cpu.dtype)
    new.query_start_loc_cpu = qsl_cpu
    new.query_start_loc = qsl_cpu.to(dev)
    new.seq_lens = torch.tensor(lens, dtype=meta.seq_lens.dtype, device=meta.seq_lens.device)
    new.num_reqs = len(segments)
    new.max_query_len = int(np.diff(starts).max()) if segments else 0
    new.max_seq_len = max(lens) if lens else 0
    table = meta.block_table_tensor.index_select(0, rows.to(meta.block_table_tensor.device))
    for j, s in enumerate(segments):
        if s.pages is not None:
            table[j, : len(s.pages)] = torch.tensor(s.pages, dtype=table.dtype)
    new.block_table_tensor = table
    new.causal = False
    if getattr(meta, "is_prefilling", None) is not None:
        new.is_prefilling = meta.is_prefilling.index_select(0, rows.to(meta.is_prefilling.device))
    if getattr(meta, "seq_lens_cpu_upper_bound", None) is not None:
        new.seq_lens_cpu_upper_bound = new.seq_lens.cpu()
    return new


def request_segments(meta: CommonAttentionMetadata) -> list[Segment]:
    """One segment per request: vLLM's own layout."""
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens.cpu().tolist()
    return [Segment(r, qsl[r], qsl[r + 1], seq_lens[r]) for r in range(meta.num_reqs)]


@functools.lru_cache
def dllm_attention_backend(base: type[AttentionBackend], pattern: str, block_size: int) -> type[AttentionBackend]:
    """``base`` with its metadata builder wrapped to build ``pattern`` attention."""
    base_builder = base.get_builder_cls()

    class DLLMAttentionBuilder(base_builder):  # type: ignore[misc,valid-type]
        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False):
            segs = step_segments() or request_segments(common_attn_metadata)
            if pattern == "block_causal":
                segs = split_block_causal(segs, block_size)
            return super().build(0, segments_metadata(common_attn_metadata, segs), fast_build)

    return subclass_attention_backend(f"DLLM{pattern.title().replace('_', '')}{block_size}_", base,
                                      DLLMAttentionBuilder)


class DLLMAttention(Attention):
    """Decoder attention (with a paged KV cache) in a dLLM's pattern: ``bidirectional`` or ``block_causal``."""

    def __init__(self, num_heads: int, head_size: int, scale: float, *, pattern: str, block_size: int = 0,
                 cache_config: CacheConfig | None = None, **kwargs):
        if pattern not in ("bidirectional", "block_causal"):
            raise ValueError(f"attention pattern {pattern!r}; allowed: bidirectional, block_causal")
        if pattern == "block_causal" and block_size <= 0:
            raise ValueError("block_causal attention needs block_size > 0")
        kv_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        base = get_attn_backend(head_size, torch.get_default_dtype(), kv_dtype, attn_type=AttentionType.DECODER)
        super().__init__(num_heads=num_heads, head_size=head_size, scale=scale, cache_config=cache_config,
                         attn_backend=dllm_attention_backend(base, pattern, block_size),
                         attn_type=AttentionType.DECODER, **kwargs)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        spec = super().get_kv_cache_spec(vllm_config)
        return replace(spec, non_causal=True) if isinstance(spec, FullAttentionSpec) else spec
