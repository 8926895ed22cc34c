"""psd-plugin's attention backend inside vLLM: the :class:`~.prefix_attention.AttentionPlan` as vLLM metadata.

One mechanism serves every decoding path of the project in vLLM: dLLM canvases (bidirectional or SDAR
block-causal segments that share a request's paged prefix), PRESTO token trees (``custom`` ancestor masks)
and plain prefills. The model classes of the project hand this backend to their ``Attention`` layers
(:class:`PSDAttention`: ``Attention(..., attn_backend=psd_attention_backend(pattern, block_size))``, vLLM's
public per-layer route, which works on every platform), so vLLM allocates the KV cache in the backend's layout and builds the
backend's metadata once per forward:

- **KV cache**: vLLM's logical per-layer page ``[blocks, kv_heads, page, K|V]``. On CUDA in the ``LBNHC``
  physical order, i.e. FlashInfer's ``NHD`` pages with K and V side by side; the backend reads ``[blocks, page,
  kv_heads, head_dim]`` views of K and V without copying. On the CPU in vLLM's CPU attention layout (``LBHNC``,
  each page's keys then its values per KV head), so that vLLM's own paged CPU kernel attends the scheduled rows
  in place (:mod:`.vllm_cpu_attention`; ``PSD_CPU_ATTENTION=torch`` turns it off).
- **Metadata** (:class:`PSDMetadataBuilder`): a plan per forward, from the step's
  :class:`~.step_batch.StepBatch`, which a model runner of the project publishes for the forward
  (:func:`~.step_batch.set_step`) with the host copies of vLLM's block tables
  (:class:`~.step_batch.HostPages`). The builder turns it into the plan and the planned backend
  (``TorchPrefixAttention`` on CPU, ``FlashInferPrefixAttention`` on CUDA with fp16/bf16), which every layer
  then runs; on the CPU, vLLM's kernel takes every row wherever the scheduled rows see exactly their pages
  (:func:`~.vllm_cpu_attention.kernel_rows`), the draft canvases one kernel call per canvas index
  (:func:`~.vllm_cpu_attention.canvas_passes`). It plans on the host and reads no device tensor: the request
  layout from
  ``query_start_loc_cpu``, the prefixes from ``seq_lens_cpu_upper_bound`` (exact outside async scheduling,
  which vLLM turns off for the plugin's ``custom_class`` method), the pages from the published block tables,
  the new rows' slots from those (vLLM's slot formula; on CUDA vLLM 0.32 computes its slot mapping on the
  device only), and the K/V writes use vLLM's device slot mapping as it is. Without a published batch (a
  forward no runner of the project prepared: vLLM's own runner, a dummy run) it lays out one segment per
  scheduled request over its cached prefix ``seq_len - query_len``, under the layer's pattern, and reads the
  block table and slot mapping back from the device (:meth:`PSDMetadataBuilder.device_pages`, the builder's
  only device reads).
- **Extra rows**: draft canvases beyond a request's first are not vLLM tokens. They are rows after the
  scheduled ones (the runner writes them into vLLM's input buffers) at the positions of the canvas they draft;
  their K/V is not kept in the cache (they see the shared prefix and themselves only), so they take no KV
  pages and do not count against ``max_model_len``. (vLLM's CPU kernel reads a draft canvas's K/V at the
  scheduled rows' slots, written there just before the canvas attends; the scheduled rows' own K/V is written
  after every draft canvas.) Rows vLLM scheduled write their K/V through vLLM's slot mapping, inside
  ``forward`` (``forward_includes_kv_cache_update``), before attending; a row reads only the prefix
  ``[0, prefix_len)`` from the cache (and a kept suffix the step names, past every row of the step), so what a
  draft row writes past the prefix is never read before it is rewritten.
- **Kept suffix** (DualCache): a step may give each request a range of cached positions after its rows
  (``suffix_starts``/``suffix_lens``), K/V an earlier step wrote there and vLLM keeps in the request's pages
  (rolling ``num_computed_tokens`` back frees no page); every row of the request sees them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from vllm.model_executor.layers.attention import Attention
from vllm.config import get_layers_from_vllm_config
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

from .prefix_attention import AttentionPlan, make_backend, to_device
from .step_batch import Rows, StepBatch, build_step_batch, current_step
from .vllm_cpu_attention import (CPUPagedKernel, canvas_passes, kernel_rows, kernel_supports, page_views, passes_pay,
                                 write_pages)

PATTERNS = ("bidirectional", "causal", "block_causal")
CPU_KERNELS = ("vllm", "torch")
CPU_KERNEL_ENV = "PSD_CPU_ATTENTION"  # vllm (default): vLLM's paged kernel where it applies; torch: the project's


def cpu_kernel_choice() -> str:
    """``PSD_CPU_ATTENTION``: which kernel attends the scheduled rows on the CPU (module docstring)."""
    import os

    choice = os.environ.get(CPU_KERNEL_ENV, "vllm")
    if choice not in CPU_KERNELS:
        raise ValueError(f"{CPU_KERNEL_ENV}={choice!r}; allowed: {', '.join(CPU_KERNELS)}")
    return choice


@dataclass
class PSDAttentionMetadata:
    plan: AttentionPlan | None  # what ``attn`` runs: every row (None with ``kernel``)
    attn: object | None  # the planned PrefixAttention backend (planned with its rows' order); None with ``kernel``
    write_rows: torch.Tensor | None  # rows of vLLM's whose K/V is written at ``write_slots`` (None: all ``T``)
    write_slots: torch.Tensor
    num_tokens: int  # T: the rows vLLM scheduled
    head_major: bool = False  # the pages are in vLLM's CPU layout (``LBHNC``)
    kernel: CPUPagedKernel | None = None  # planned: vLLM's CPU kernel attends every row
    # vLLM's CPU op writes the new K/V into head-major pages whenever its geometry runs, PyTorch's attention too
    # (an indexed write through PyTorch into those pages, dimension-major keys, costs several times more)
    writer: CPUPagedKernel | None = None


class PSDMetadataBuilder(AttentionMetadataBuilder[PSDAttentionMetadata]):
    """Builds the step's plan (module docstring). ``pattern`` / ``block_size`` come from the backend class."""

    pattern: ClassVar[str] = "bidirectional"
    block_size: ClassVar[int] = 0

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        pc = vllm_config.parallel_config
        if pc.decode_context_parallel_size > 1 or pc.prefill_context_parallel_size > 1:
            raise ValueError("psd attention backend: context parallelism is not supported (the plan derives each "
                             "new row's cache slot from the block table, one rank owning every page)")
        mc = vllm_config.model_config
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        # this rank's geometry, from its layers (under tensor parallelism each holds its share of the heads;
        # the KV-cache spec has the same share of KV heads)
        geometry = {(layer.impl.num_heads, layer.impl.num_kv_heads, layer.impl.scale) for layer in layers.values()}
        if len(geometry) > 1:
            raise ValueError(f"psd attention backend: layers {layer_names} differ in (heads, KV heads, scale): "
                             f"{sorted(geometry)}")
        heads, kv_heads, scale = geometry.pop() if geometry else (mc.get_num_attention_heads(pc),
                                                                   kv_cache_spec.num_kv_heads, None)
        if kv_heads != kv_cache_spec.num_kv_heads:
            raise ValueError(f"psd attention backend: the layers have {kv_heads} KV heads on this rank, the KV "
                             f"cache {kv_cache_spec.num_kv_heads}")
        # the page layout vLLM resolved for the KV cache (from this backend's ``supported_kv_cache_layouts``)
        layout = vllm_config.cache_config.kv_cache_layout
        head_major = layout == "LBHNC" if layout is not None else self.device.type == "cpu"
        self._geometry(heads, kv_heads, kv_cache_spec.head_size, kv_cache_spec.block_size, mc.dtype, scale,
                       head_major)

    @classmethod
    def for_geometry(cls, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                     device, scale: float | None = None, layer_names: tuple[str, ...] = ("layer",),
                     head_major: bool = False):
        """A builder outside a vLLM config (tests, benchmarks): the same ``build``; ``head_major``: the pages are
        in vLLM's CPU layout (else FlashInfer's NHD)."""
        self = cls.__new__(cls)
        AttentionMetadataBuilder.__init__(self, None, list(layer_names), None, torch.device(device))
        self._geometry(num_heads, num_kv_heads, head_dim, page_size, dtype, scale, head_major)
        return self

    def _geometry(self, num_heads, num_kv_heads, head_dim, page_size, dtype, scale, head_major) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.scale = page_size, dtype, scale
        # one per builder, planned anew every forward
        self.attn = make_backend("auto", self.device, self.dtype, head_dim)
        self._group: int | None = None  # this builder's KV-cache group in the published pages
        # head-major pages (vLLM's CPU layout, ``supported_kv_cache_layouts``): vLLM's kernel reads them in place
        self.head_major = head_major
        self.kernel = None
        # the last published step's plan: (layout key, its block table rows, (plan, attn, kernel)); a step of the
        # same layout over the same pages runs on it (a block's later steps, :meth:`build`)
        self._planned: tuple | None = None
        self.reused = 0  # steps that ran on the previous step's plan
        choice = cpu_kernel_choice()  # checked on every platform: a bad value fails at start-up, not later
        if self.head_major and choice == "vllm" and kernel_supports(head_dim, page_size, dtype):
            self.kernel = CPUPagedKernel(num_heads, num_kv_heads, head_dim, page_size, dtype,
                                         head_dim ** -0.5 if scale is None else scale)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PSDAttentionMetadata:
        cam = common_attn_metadata
        R = cam.num_reqs
        qsl = cam.query_start_loc_cpu[: R + 1].long()
        T = int(qsl[-1])
        batch = current_step()
        if batch is None:  # a forward no runner of the project prepared
            batch = self.vllm_layout(cam, R, qsl)
            table, slots = self.device_pages(cam, R, T)
        else:
            prefix = _host_seq_lens(cam, R) - qsl.diff()
            if batch.num_requests != R or batch.num_scheduled != T or not torch.equal(batch.prefix_lens, prefix):
                raise RuntimeError(f"psd attention backend: the runner's step ({batch.num_requests} requests, "
                                   f"{batch.num_scheduled} scheduled rows, prefixes {batch.prefix_lens.tolist()}) "
                                   f"is not the batch vLLM scheduled ({R} requests, {T} rows, prefixes "
                                   f"{prefix.tolist()})")
            if batch.pages is None:  # published without the host block tables
                table, slots = self.device_pages(cam, R, T)
            else:
                table = self._published_table(batch, R)
                last = self._planned
                if last is not None and batch.layout_key is not None and last[0] == batch.layout_key \
                        and last[1].shape == table.shape and torch.equal(last[1], table):
                    # the previous step's layout over the same pages: the same slots, rows and plan (the kernel's
                    # and the backend's plan state are theirs: nothing planned since)
                    self.reused += 1
                    plan, attn, kernel = last[2]
                    return PSDAttentionMetadata(plan, attn, None, cam.slot_mapping[:T], T, self.head_major, kernel,
                                                self.kernel)
                # the slots from the host block table (the plan needs them on the host; reading the device's
                # mapping would sync)
                slots = vllm_slots(table, prefix, qsl, self.page_size)
                if self.device.type == "cpu" and not torch.equal(slots, cam.slot_mapping[:T].long()):
                    # on the CPU vLLM's slot mapping is a host tensor: the host slots are checked against it
                    raise RuntimeError("psd attention backend: the slots derived from the host block table differ "
                                       "from vLLM's slot mapping")
        # rows vLLM scheduled have their K/V written (``forward``) before attending; extra rows do not. On the CPU
        # vLLM's kernel takes every row where the scheduled rows see exactly their pages and the further canvases
        # stand on them (one kernel call per canvas index) and, with drafts, where that pays; else PyTorch
        E = batch.num_extra
        kernel = None
        rows = passes = None
        if self.kernel is not None and (E == 0 or passes_pay(batch, self.num_heads, self.head_dim)):
            rows = kernel_rows(batch, self.pattern)
            passes = canvas_passes(batch) if rows is not None and bool((slots >= 0).all()) else None
        if passes is not None:
            kernel = self.kernel
            kernel.plan(rows, table, passes, slots)
            plan = attn = None
        else:
            plan = batch.plan(table, self.page_size, self.pattern, self.block_size)
            self.attn.plan(plan, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, scale=self.scale,
                           device=self.device, cached=torch.cat([slots, torch.full((E,), -1, dtype=torch.long)]),
                           rows=batch.order)
            attn = self.attn
        ok = slots >= 0
        self._planned = None  # the kernel's and the backend's plan state are this step's now
        if bool(ok.all()):  # vLLM's own slot mapping, where it is (every published step)
            if batch.layout_key is not None and batch.pages is not None:
                self._planned = (batch.layout_key, table.clone(), (plan, attn, kernel))
            return PSDAttentionMetadata(plan, attn, None, cam.slot_mapping[:T], T, self.head_major, kernel,
                                        self.kernel)
        rows = ok.nonzero().flatten()  # a dummy run's -1 slots: nothing written there
        d = to_device({"rows": rows, "slots": slots[rows]}, self.device)
        return PSDAttentionMetadata(plan, attn, d["rows"], d["slots"], T, self.head_major, kernel, self.kernel)

    def _published_table(self, batch: StepBatch, R: int) -> torch.Tensor:
        """This builder's host block table rows of the published step."""
        pages = batch.pages
        if self._group is None:
            self._group = pages.group(self.layer_names[0])
        g = self._group
        if pages.page_sizes[g] != self.page_size:
            raise RuntimeError(f"psd attention backend: KV-cache group {g} has {pages.page_sizes[g]}-token pages "
                               f"and the layers {self.page_size}-token ones (vLLM's kernel blocks are not supported)")
        table = pages.block_tables[g]
        if table.shape[0] < R:
            raise RuntimeError(f"psd attention backend: the published block table has {table.shape[0]} rows for "
                               f"{R} requests")
        return table[:R]

    @staticmethod
    def vllm_layout(cam: CommonAttentionMetadata, R: int, qsl: torch.Tensor) -> StepBatch:
        """The step of a forward no runner of the project published (vLLM's own runner; a dummy or profiling
        run): one segment per scheduled request over its cached prefix."""
        prefix = _host_seq_lens(cam, R) - qsl.diff()
        return build_step_batch([Rows(n, p) for n, p in zip(qsl.diff().tolist(), prefix.tolist())])

    @staticmethod
    def device_pages(cam: CommonAttentionMetadata, R: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table and slot mapping (-1: a row not to write, as in dummy runs) read back from the device,
        for a forward whose runner published no host block tables: the builder's only device reads (a sync),
        off the project's runners' steps."""
        return cam.block_table_tensor[:R].cpu(), cam.slot_mapping[:T].long().cpu()


def _host_seq_lens(cam: CommonAttentionMetadata, R: int) -> torch.Tensor:
    """``[R]`` sequence lengths (cached + scheduled) on the host: vLLM's ``seq_lens_cpu_upper_bound``, exact
    outside async scheduling (off for the plugin's method; the consistency check in ``build`` would fail
    otherwise). vLLM 0.32's runner always sets it; without it, the device's seq lens are read back."""
    if cam.seq_lens_cpu_upper_bound is not None:
        return cam.seq_lens_cpu_upper_bound[:R].long()
    return cam.seq_lens[:R].long().cpu()


def vllm_slots(block_table: torch.Tensor, prefix_lens: torch.Tensor, query_start_loc: torch.Tensor,
               page_size: int) -> torch.Tensor:
    """``[T]`` flat cache slots of the rows vLLM scheduled, on the host: request ``r``'s rows are at positions
    ``prefix_lens[r] + i``, and slot = ``block_table[r, pos // page_size] * page_size + pos % page_size``
    (vLLM's slot mapping without context parallelism, ``vllm/v1/worker/block_table.py``)."""
    qsl = query_start_loc.numpy()
    T = int(qsl[-1])
    req = np.repeat(np.arange(qsl.size - 1), np.diff(qsl))  # numpy: a few microseconds where torch's small ops
    pos = prefix_lens.numpy()[req] + np.arange(T) - qsl[:-1][req]  # take tens
    table = block_table.numpy()
    return torch.from_numpy(table[req, pos // page_size].astype(np.int64) * page_size + pos % page_size)


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
        T = md.num_tokens
        if md.write_slots.numel():
            k_new = key[:T] if md.write_rows is None else key[md.write_rows]
            v_new = value[:T] if md.write_rows is None else value[md.write_rows]
        if md.kernel is not None and md.kernel.passes:  # each further canvas in turn at the scheduled rows' slots,
            # before those rows' own K/V, which the cache keeps
            md.kernel.run_passes(query, key, value, kv_cache, output)
        if md.head_major:  # vLLM's CPU pages: [blocks, kv_heads, page, D] K and V
            kp, vp = page_views(kv_cache, self.head_size)
            kc, vc = kp.transpose(1, 2), vp.transpose(1, 2)  # the [blocks, page, kv_heads, D] views PyTorch reads
            if md.write_slots.numel():
                if md.writer is not None:
                    md.writer.write(k_new, v_new, kv_cache, md.write_slots)
                else:
                    write_pages(k_new, v_new, kp, vp, md.write_slots)
        else:
            kc, vc = kv_views(kv_cache, self.head_size)
            if md.write_slots.numel():  # flat views of the NHD pages
                kc.flatten(0, 1).index_copy_(0, md.write_slots, k_new.to(kc.dtype))
                vc.flatten(0, 1).index_copy_(0, md.write_slots, v_new.to(vc.dtype))
        if md.kernel is not None:  # the scheduled rows read the pages in place (the further canvases did above)
            md.kernel.run(query[:T], kv_cache, output[:T])
            n = T + md.kernel.num_extra
        else:
            n = md.plan.num_tokens  # the backend reads the rows in the model's order (planned with the row map)
            output[:n] = md.attn.run(query[:n], key[:n], value[:n], kc, vc).to(output.dtype)
        if output.shape[0] > n:  # padding rows (vLLM sizes a forward up, for CUDA graphs): inert
            output[n:].zero_()
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
        from vllm.platforms import current_platform  # listed in psd_plugin.vllm.compat.OBJECTS

        # the CPU: vLLM's CPU attention layout, which its kernels read in place; elsewhere FlashInfer's NHD pages
        return (KVCacheLayout.LBHNC,) if current_platform.is_cpu() else (KVCacheLayout.LBNHC,)


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
    """vLLM's ``Attention`` layer on the project's backend for ``pattern``.

    The KV-cache spec tells vLLM's engine whether a token's K/V depends only on the tokens before it (what prefix
    caching and chunked prefill assume):

    - ``bidirectional`` (LLaDA, Dream): a prompt's K/V depends on the canvas after it: marked ``non_causal``, so
      the engine turns both off;
    - ``block_causal`` (SDAR, LLaDA2): a position sees its own attention block and the ones before it, so the K/V
      of a *complete* attention block depends only on the tokens up to its end. When the KV page holds whole
      attention blocks (``page % block_size == 0``, vLLM's ``--block-size``) a full page of committed tokens is
      exact whatever follows it, and vLLM may cache it and match it in later requests; a prompt chunk that ends
      inside an attention block is recomputed from the block's start by the next chunk
      (:class:`psd_plugin.vllm.scheduler.DLLMScheduler`). Otherwise the spec is ``non_causal``, with a warning;
    - ``causal`` (PRESTO's AR target): vLLM's own rules."""

    def __init__(self, num_heads: int, head_size: int, scale: float, *, pattern: str, block_size: int = 0,
                 **kwargs):
        super().__init__(num_heads, head_size, scale, attn_backend=psd_attention_backend(pattern, block_size),
                         **kwargs)
        self.pattern = pattern
        self.attention_block = block_size

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if not isinstance(spec, FullAttentionSpec) or self.pattern == "causal":
            return spec
        if self.pattern == "block_causal" and spec.block_size % self.attention_block == 0:
            return spec
        if self.pattern == "block_causal":
            _warn_unaligned_pages(spec.block_size, self.attention_block)
        return replace(spec, non_causal=True)


@functools.lru_cache
def _warn_unaligned_pages(page: int, block: int) -> None:
    from vllm.logger import init_logger

    init_logger(__name__).warning(
        "psd attention backend: KV pages of %d tokens cut the model's %d-token attention blocks, so a page's K/V "
        "is not final when the page fills: prefix caching and chunked prefill are off. Serve with --block-size a "
        "multiple of %d to have them", page, block, block)
