"""A vLLM ``Attention`` layer for dLLMs: bidirectional or block-causal attention over the paged KV cache.

vLLM's V1 runner builds every decoder layer's metadata with ``causal=True``. dLLMs need

- ``bidirectional`` (LLaDA, Dream): a request's scheduled tokens attend to each other in both
  directions and to the request's cached prefix;
- ``block_causal`` (SDAR): as above, but a token only sees keys whose attention block
  (``position // block_size``) is not later than its own.

Both are done at metadata-build time, so any backend that honours ``causal=False`` and per-request
``query_start_loc`` / ``seq_lens`` (the CPU backend, FlashAttention, FlashInfer) runs them unchanged:
bidirectional sets ``causal=False`` (as vLLM's ``PrefillPrefixLMAttention``); block-causal additionally
splits each request's query range at block boundaries into *segments* that share the request's block
table, segment ``j`` ending at the last key of its block (``seq_len_j = last position in segment + 1``).
K/V writes go through ``slot_mapping``, one entry per token, so splitting the queries changes nothing
about where K/V land. Design choice: segments instead of a dense mask, because the CPU kernel has no
arbitrary masks and segments keep every kernel's paged fast path.

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


def split_block_causal(meta: CommonAttentionMetadata, block_size: int) -> CommonAttentionMetadata:
    """Re-express block-causal attention as non-causal attention over per-block query segments."""
    qsl = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens.cpu().tolist()
    starts, lens, rows = [0], [], []
    for r in range(meta.num_reqs):
        q0, q1 = qsl[r], qsl[r + 1]
        n = q1 - q0
        first = seq_lens[r] - n  # position of the request's first scheduled token
        pos = first
        while pos < first + n:
            end = min(first + n, (pos // block_size + 1) * block_size)
            starts.append(starts[-1] + end - pos)
            lens.append(end)
            rows.append(r)
            pos = end
        if n == 0:  # padded request slot: keep it as an empty segment
            starts.append(starts[-1])
            lens.append(seq_lens[r])
            rows.append(r)
    dev = meta.query_start_loc.device
    new = copy(meta)
    qsl_cpu = torch.tensor(starts, dtype=meta.query_start_loc_cpu.dtype)
    new.query_start_loc_cpu = qsl_cpu
    new.query_start_loc = qsl_cpu.to(dev)
    new.seq_lens = torch.tensor(lens, dtype=meta.seq_lens.dtype, device=meta.seq_lens.device)
    new.num_reqs = len(lens)
    new.max_query_len = int(np.diff(starts).max()) if len(starts) > 1 else 0
    new.max_seq_len = max(lens) if lens else 0
    idx = torch.tensor(rows, dtype=torch.long, device=meta.block_table_tensor.device)
    new.block_table_tensor = meta.block_table_tensor.index_select(0, idx)
    new.causal = False
    if getattr(meta, "seq_lens_cpu_upper_bound", None) is not None:
        new.seq_lens_cpu_upper_bound = new.seq_lens.cpu()
    return new


@functools.lru_cache
def dllm_attention_backend(base: type[AttentionBackend], pattern: str, block_size: int) -> type[AttentionBackend]:
    """``base`` with its metadata builder wrapped to build ``pattern`` attention."""
    base_builder = base.get_builder_cls()

    class DLLMAttentionBuilder(base_builder):  # type: ignore[misc,valid-type]
        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False):
            if pattern == "block_causal":
                meta = split_block_causal(common_attn_metadata, block_size)
            else:
                meta = copy(common_attn_metadata)
                meta.causal = False
            return super().build(0, meta, fast_build)

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
