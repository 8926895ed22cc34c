"""psd-plugin's attention backend inside vLLM: the :class:`~.prefix_attention.AttentionPlan` as vLLM metadata.

One mechanism serves every decoding path of the project in vLLM: dLLM canvases (bidirectional or SDAR
block-causal segments that share a request's paged prefix), PRESTO token trees (``custom`` ancestor masks)
and plain prefills. The model classes of the project hand this backend to their ``Attention`` layers
(:class:`PSDAttention`: ``Attention(..., attn_backend=psd_attention_backend(pattern, block_size))``, vLLM's
public per-layer route, which works on every platform), so vLLM allocates the KV cache in the backend's layout and builds the
backend's metadata once per forward:

- **KV cache**: vLLM's logical per-layer page ``[blocks, kv_heads, page, K|V]`` in the ``LBNHC`` physical
  order, i.e. FlashInfer's ``NHD`` pages with K and V side by side; the backend reads ``[blocks, page,
  kv_heads, head_dim]`` views of K and V without copying.
- **Metadata** (:class:`PSDMetadataBuilder`): a plan per forward, from the step's
  :class:`~.step_batch.StepBatch`, which a model runner of the project publishes for the forward
  (:func:`~.step_batch.set_step`); without one (a prefill of vLLM's own, a profiling run), one segment per
  scheduled request over its cached prefix ``seq_len - query_len``, under the layer's pattern. The builder
  turns it into the plan and the planned backend (``CPUPrefixAttention`` on CPU, ``FlashInferPrefixAttention``
  on CUDA with fp16/bf16), which every layer then runs.
- **Extra rows**: draft canvases beyond a request's first are not vLLM tokens. They are rows after the
  scheduled ones (the runner writes them into vLLM's input buffers) at the positions of the canvas they draft; their K/V is
  never written to the cache (they see the shared prefix and themselves only), so they take no KV pages and
  do not count against ``max_model_len``. Rows vLLM scheduled write their K/V through vLLM's slot mapping,
  inside ``forward`` (``forward_includes_kv_cache_update``), before attending; a row reads only the prefix
  ``[0, prefix_len)`` from the cache (and a kept suffix the step names, past every row of the step), so
  what a draft row writes past the prefix is never read before it is rewritten.
- **Kept suffix** (DualCache): a step may give each request a range of cached positions after its rows
  (``suffix_starts``/``suffix_lens``), K/V an earlier step wrote there and vLLM keeps in the request's pages
  (rolling ``num_computed_tokens`` back frees no page); every row of the request sees them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.model_executor.layers.attention import Attention
from vllm.config import get_layers_from_vllm_config
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

from .prefix_attention import AttentionPlan, make_backend
from .step_batch import Rows, build_step_batch, current_step
from .torch_backend import TorchPrefixAttention as CPUPrefixAttention

PATTERNS = ("bidirectional", "causal", "block_causal")


@dataclass
class PSDAttentionMetadata:
    plan: AttentionPlan
    attn: object  # the planned PrefixAttention backend
    write_rows: torch.Tensor | None  # rows of vLLM's whose K/V is written at ``write_slots`` (None: all ``T``)
    write_slots: torch.Tensor
    num_tokens: int  # T: the rows vLLM scheduled
    order: torch.Tensor | None = None  # plan order -> model rows (None: identity, or the backend remaps)


class PSDMetadataBuilder(AttentionMetadataBuilder[PSDAttentionMetadata]):
    """Builds the step's plan (module docstring). ``pattern`` / ``block_size`` come from the backend class."""

    pattern: ClassVar[str] = "bidirectional"
    block_size: ClassVar[int] = 0

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        mc = vllm_config.model_config
        self.num_heads = mc.get_num_attention_heads(vllm_config.parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        self.page_size = kv_cache_spec.block_size
        self.dtype = mc.dtype
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        scales = {layer.impl.scale for layer in layers.values()}
        if len(scales) > 1:
            raise ValueError(f"psd attention backend: layers {layer_names} use different scales {sorted(scales)}")
        self.scale = scales.pop() if scales else None
        self.attn = make_backend("auto", device, self.dtype)  # one per builder: planned anew every forward

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PSDAttentionMetadata:
        cam = common_attn_metadata
        R = cam.num_reqs
        qsl = cam.query_start_loc_cpu[: R + 1].long()
        T = int(qsl[-1])
        prefix = cam.seq_lens[:R].long().cpu() - qsl.diff()
        batch = current_step()
        if batch is None:  # vLLM's own layout (a prefill, a profiling run): one segment per request
            batch = build_step_batch([Rows(int(n), int(p)) for n, p in zip(qsl.diff(), prefix)])
        elif batch.num_requests != R or batch.num_scheduled != T or not torch.equal(batch.prefix_lens, prefix):
            raise RuntimeError(f"psd attention backend: the runner's step ({batch.num_requests} requests, "
                               f"{batch.num_scheduled} scheduled rows, prefixes {batch.prefix_lens.tolist()}) is not "
                               f"the batch vLLM scheduled ({R} requests, {T} rows, prefixes {prefix.tolist()})")
        E = batch.num_extra
        plan = batch.plan(cam.block_table_tensor[:R].long(), self.page_size, self.pattern, self.block_size)
        slots = cam.slot_mapping[:T].long()
        remap = batch.order is not None and isinstance(self.attn, CPUPrefixAttention)
        # rows vLLM scheduled have their K/V written (``forward``) before attending; extra rows do not
        cached = torch.cat([slots.cpu(), torch.full((E,), -1, dtype=torch.long)])
        self.attn.plan(plan, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, scale=self.scale,
                       device=self.device, cached=cached, **({"rows": batch.order} if remap else {}))
        ok = slots >= 0
        rows = None if bool(ok.all()) else ok.nonzero().flatten()
        return PSDAttentionMetadata(
            plan, self.attn, rows, slots if rows is None else slots[rows], T,
            order=batch.order.to(self.device) if batch.order is not None and not remap else None)


class PSDAttentionImpl(AttentionImpl[PSDAttentionMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, **unsupported):
        for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                            ("logits_soft_cap", logits_soft_cap), ("kv_sharing_target_layer_name",
                                                                   kv_sharing_target_layer_name)):
            if value:
                raise ValueError(f"psd attention backend: {name} is not supported (got {value!r})")
        if unsupported:
            raise ValueError(f"psd attention backend: unsupported options {sorted(unsupported)}")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"psd attention backend: attn_type {attn_type!r}; allowed: decoder")
        if kv_cache_dtype != "auto":
            raise ValueError(f"psd attention backend: kv_cache_dtype {kv_cache_dtype!r}; allowed: auto (the "
                             "model's dtype)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("psd attention backend: fused output quantization is not supported")
        md: PSDAttentionMetadata | None = attn_metadata
        if md is None:  # profiling / warm-up run without metadata
            return output.zero_()
        kc, vc = kv_views(kv_cache, self.head_size)
        if md.write_slots.numel():  # flat views of the NHD pages
            T = md.num_tokens
            k_new = key[:T] if md.write_rows is None else key[md.write_rows]
            v_new = value[:T] if md.write_rows is None else value[md.write_rows]
            kc.flatten(0, 1).index_copy_(0, md.write_slots, k_new.to(kc.dtype))
            vc.flatten(0, 1).index_copy_(0, md.write_slots, v_new.to(vc.dtype))
        if md.order is not None:
            o = md.attn.run(query[md.order], key[md.order], value[md.order], kc, vc)
            output[md.order] = o.to(output.dtype)
        else:  # the plan's rows are the model's (or the backend reads them through its row map)
            T = md.plan.num_tokens
            output[:T] = md.attn.run(query[:T], key[:T], value[:T], kc, vc).to(output.dtype)
        return output


def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[blocks, page, kv_heads, head_dim]`` views of vLLM's logical ``[blocks, kv_heads, page, K|V]``
    per-layer cache (no copy)."""
    nhd = kv_cache.transpose(1, 2)
    return nhd[..., :head_size], nhd[..., head_size:]


class PSDAttentionBackend(AttentionBackend):
    """The project's backend (module docstring); :func:`psd_attention_backend` makes one per pattern."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]
    pattern: ClassVar[str] = "bidirectional"

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return PSDAttentionImpl

    @staticmethod
    def get_builder_cls():
        return PSDMetadataBuilder

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)  # FlashInfer's NHD pages


@functools.lru_cache
def psd_attention_backend(pattern: str, block_size: int = 0) -> type[PSDAttentionBackend]:
    """The backend class for a layer's pattern: ``bidirectional`` (LLaDA, Dream), ``block_causal`` with the
    model's ``block_size`` (SDAR) or ``causal`` (PRESTO's AR target)."""
    if pattern not in PATTERNS:
        raise ValueError(f"attention pattern {pattern!r}; allowed: {', '.join(PATTERNS)}")
    if pattern == "block_causal" and block_size <= 0:
        raise ValueError("block_causal attention needs block_size > 0")
    builder = type(f"PSDMetadataBuilder_{pattern}{block_size or ''}", (PSDMetadataBuilder,),
                   {"pattern": pattern, "block_size": block_size})
    return type(f"PSDAttentionBackend_{pattern}{block_size or ''}", (PSDAttentionBackend,),
                {"pattern": pattern, "get_builder_cls": staticmethod(lambda: builder),
                 "__module__": __name__})


class PSDAttention(Attention):
    """vLLM's ``Attention`` layer on the project's backend for ``pattern``. A non-causal pattern marks the
    layer's KV-cache spec ``non_causal``, so the engine turns off chunked prefill and prefix caching, which
    assume a token's K/V depends only on the tokens before it."""

    def __init__(self, num_heads: int, head_size: int, scale: float, *, pattern: str, block_size: int = 0,
                 **kwargs):
        super().__init__(num_heads, head_size, scale, attn_backend=psd_attention_backend(pattern, block_size),
                         **kwargs)
        self.pattern = pattern

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if self.pattern != "causal" and isinstance(spec, FullAttentionSpec):
            spec = replace(spec, non_causal=True)
        return spec
