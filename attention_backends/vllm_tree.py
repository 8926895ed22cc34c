"""Tree-masked attention inside vLLM's CPU attention backend: how PRESTO's target verifies a token tree.

vLLM 0.32 has no tree attention, and its CPU kernel knows only causal / non-causal rows over
``[0, seq_len)``. A request verifying a tree schedules its pending tokens and its tree nodes (depth-first
prefixes, as draft tokens) at once; the kernel computes every row causally in scheduling order, which is
wrong for the nodes. :class:`TreeCPUAttentionImpl` keeps the kernel for everything and then recomputes the
rows of tree requests with :class:`~attention_backends.torch_ref.TorchPrefixAttention` under the step's
:class:`~attention_backends.prefix_attention.AttentionPlan` (``custom`` mask: pending rows causal, a node sees
the pending rows, its ancestors and itself; every row sees the request's cached prefix on its KV pages).

The kernel's paged cache is ISA-packed (a page's K is stored transposed or tiled, undocumented), so the impl
mirrors every K/V write into a plain ``[pages, page_size, kv_heads, head_dim]`` cache (FlashInfer's NHD, what
the backends read) with the same slot mapping. A choice: it costs a second copy of the KV cache (the CPU
path's KV budget is small and explicit, ``VLLM_CPU_KVCACHE_SPACE``) and depends on no undocumented layout.

The runner publishes a step's :class:`TreeStep` with :func:`set_tree_step` before the forward (the same
process-local pattern as :mod:`attention_backends.segments`); ``None`` means no tree this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from .prefix_attention import AttentionPlan
from .torch_ref import TorchPrefixAttention


@dataclass
class TreeStep:
    """The rows of a step's tree requests (``rows``, in plan order) and their plan."""

    rows: torch.Tensor
    plan: AttentionPlan
    _backends: dict = field(default_factory=dict)

    def backend(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> TorchPrefixAttention:
        key = (num_heads, num_kv_heads, head_dim, dtype)
        be = self._backends.get(key)
        if be is None:
            be = self._backends[key] = TorchPrefixAttention()
            be.plan(self.plan, num_heads, num_kv_heads, head_dim, dtype)
        return be


_STEP: TreeStep | None = None


def set_tree_step(step: TreeStep | None) -> None:
    global _STEP
    _STEP = step


def tree_step() -> TreeStep | None:
    return _STEP


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus tree rows recomputed in torch (module docstring). Installed on a loaded
    model's decoder layers by :func:`install_tree_attention`; adds no state beyond the mirror cache."""

    def _mirror(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
        m = getattr(self, "_psd_mirror", None)
        if m is None or m[0].shape[0] != num_blocks:
            shape = (num_blocks, block_size, num_kv_heads, two_d // 2)
            m = (torch.zeros(shape, dtype=kv_cache.dtype), torch.zeros(shape, dtype=kv_cache.dtype))
            self._psd_mirror = m
        return m

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        mk, mv = self._mirror(kv_cache)
        n = slot_mapping.numel()
        ok = slot_mapping >= 0
        slots = slot_mapping[ok].long()
        mk.view(-1, *mk.shape[2:]).index_copy_(0, slots, key[:n][ok].to(mk.dtype))
        mv.view(-1, *mv.shape[2:]).index_copy_(0, slots, value[:n][ok].to(mv.dtype))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                              output_block_scale)
        step = tree_step()
        if step is None or attn_metadata is None:
            return out
        mk, mv = self._mirror(kv_cache)
        H, D = query.shape[-2], query.shape[-1]
        be = step.backend(H, key.shape[-2], D, query.dtype)
        rows = step.rows
        o = be.run(query[rows], key[rows], value[rows], mk, mv)
        out.view(out.shape[0], H, D)[rows] = o.to(out.dtype)
        return out


def install_tree_attention(vllm_config) -> int:
    """Swap the impl of every decoder attention layer of the loaded model for :class:`TreeCPUAttentionImpl`;
    returns how many layers were switched."""
    from vllm.model_executor.layers.attention import Attention

    n = 0
    for layer in vllm_config.compilation_config.static_forward_context.values():
        if isinstance(layer, Attention) and type(layer.impl) is CPUAttentionBackendImpl:
            layer.impl.__class__ = TreeCPUAttentionImpl
            n += 1
    return n
