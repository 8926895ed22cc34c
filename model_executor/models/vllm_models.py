"""vLLM model classes for LLaDA, Dream, SDAR and LLaDA2 checkpoints and PRESTO's Llama target (vLLM layers,
paged KV cache, ``load_weights``).

One implementation, five registered architectures (``LLaDAModelLM``, ``DreamModel``, ``SDARForCausalLM``,
``LLaDA2MoeModelLM`` and ``PSDLlamaForCausalLM``), as vLLM does for its Llama-family models. LLaDA2's experts
are vLLM's own fused MoE layer (``FusedMoEFactory``, the one vLLM's Bailing-MoE uses) with its grouped
sigmoid router and expert-score bias; the router itself runs in float32, as LLaDA2's code routes. The numerics match
:mod:`model_executor.models.reference`; the differences between the formats come from
:class:`~model_executor.models.configs.ArchSpec`.

Every attention layer runs the project's backend (:mod:`attention_backends.vllm_backend`), handed to vLLM's
``Attention`` per layer (``attn_backend=``), so the same classes serve dLLM canvases, SDAR's block-causal
blocks and PRESTO's token trees on any platform. A forward may carry more rows than vLLM scheduled (the
step's extra draft canvases): the runner writes their token ids and every row's position into vLLM's own
persistent ``input_ids`` / ``positions`` buffers (:class:`psd_plugin.vllm.runner.PSDRunnerMixin`), so the
model's inputs are always views of those buffers, as for vLLM's own models.

vLLM compiles the embedding, the decoder layers and the final norm (:class:`DLLMDecoder`,
``@support_torch_compile``) as it compiles its own models (``LlamaModel``): on CPU by default one Dynamo
trace with Inductor and no guards, the attention an opaque op that reads the step's metadata at run time;
``enforce_eager=True`` turns it off. The compiled module reads only its inputs (token ids, positions: the
persistent buffers, the addresses a CUDA graph captures), so the traced graph has no branch that depends on
the step: any number of rows, any canvases, trees or kept suffix run through the same compiled code. The LM
head stays eager.

Why PRESTO's target is a class of the project rather than vLLM's ``LlamaForCausalLM``: tree verification
needs ancestor masks and node positions in the attention metadata, and vLLM's Llama takes its backend
from the platform (on CPU always its own kernel, which has no masks). The PRESTO config selects this class
for a Llama checkpoint (``architectures``), so serving Llama without PRESTO is untouched.

``compute_logits`` returns each position's raw output, like an AR model in vLLM: for Dream that row is
the prediction for the *next* position (shifted logits), for LLaDA and SDAR the prediction for the same
position. The decoding path owns that alignment.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                               RowParallelLinear)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (PPMissingLayer, make_empty_intermediate_tensors_factory, make_layers,
                                              maybe_prefix)
from vllm.sequence import IntermediateTensors

from attention_backends.vllm_backend import PSDAttention
from psd_plugin.vllm import compat

from .configs import ArchSpec
from .quantization import QUANT_SUFFIXES, linear_modules, vllm_layer_names, vllm_layers
from .weights import CheckpointError, canonical_shapes, checkpoint_names


class DLLMDecoderLayer(nn.Module):
    def __init__(self, spec: ArchSpec, vllm_config: VllmConfig, index: int, prefix: str):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        quant = vllm_config.quant_config  # the projections and experts; never the router, embedding or LM head
        self.head_dim, self.qk_norm = d, spec.qk_norm
        self.attn_norm = RMSNorm(h, eps=spec.rms_norm_eps)
        self.qkv = QKVParallelLinear(h, d, spec.num_heads, spec.num_kv_heads, bias=spec.qkv_bias,
                                     quant_config=quant, prefix=f"{prefix}.qkv")
        # this rank's share under tensor parallelism: its query heads, and its KV heads (replicated where the
        # ranks outnumber them), as QKVParallelLinear splits them and vLLM's Llama passes them on
        heads, kv_heads = self.qkv.num_heads, self.qkv.num_kv_heads
        self.q_size, self.kv_size = heads * d, kv_heads * d
        self.o = RowParallelLinear(spec.num_heads * d, h, bias=False, quant_config=quant, prefix=f"{prefix}.o")
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, eps=spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=spec.rms_norm_eps)
        # LLaDA rotates in float32 (rope_full_precision); the others in the activation dtype, as their code does
        self.rope_fp32 = spec.rope_in_float32
        rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
        if spec.rotary_dim:
            rope["rope_dim"] = spec.rotary_dim  # LLaDA2: the first rotary_dim dims of each head
        self.rotary_emb = get_rope(d, max_position=spec.max_position, is_neox_style=True, rope_parameters=rope,
                                   dtype=torch.float32 if self.rope_fp32 else None)
        self.attn = PSDAttention(heads, d, d**-0.5, num_kv_heads=kv_heads,
                                 pattern=spec.attention, block_size=spec.attention_block or 0,
                                 cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")
        self.mlp_norm = RMSNorm(h, eps=spec.rms_norm_eps)
        moe = spec.moe
        self.is_moe = moe is not None and moe.is_moe_layer(index)
        if not self.is_moe:
            self.gate_up = MergedColumnParallelLinear(h, [spec.intermediate_size] * 2, bias=False,
                                                      quant_config=quant, prefix=f"{prefix}.gate_up")
            self.down = RowParallelLinear(spec.intermediate_size, h, bias=False, quant_config=quant,
                                          prefix=f"{prefix}.down")
            self.act = SiluAndMul()
            return
        # LLaDA2: router logits in float32 (its code upcasts both sides), the bias steers selection only
        self.router = ReplicatedLinear(h, moe.num_experts, bias=False, params_dtype=torch.float32,
                                       prefix=f"{prefix}.router")
        self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False)
        self.shared = (SwiGLU(h, moe.intermediate_size * moe.num_shared, reduce_results=False, quant_config=quant,
                              prefix=f"{prefix}.shared") if moe.num_shared else None)
        self.experts = FusedMoEFactory(
            num_experts=moe.num_experts, top_k=moe.top_k, hidden_size=h, intermediate_size=moe.intermediate_size,
            renormalize=moe.top_k > 1,  # LLaDA2's code renormalises the weights of several experts only
            use_grouped_topk=True, num_expert_group=moe.n_group, topk_group=moe.topk_group,
            scoring_func="sigmoid", e_score_correction_bias=self.expert_bias, routed_scaling_factor=moe.scale,
            router_logits_dtype=torch.float32, shared_experts=self.shared, quant_config=quant,
            prefix=f"{prefix}.experts")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(self.attn_norm(x))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(k.shape)
        if self.rope_fp32 and q.dtype != torch.float32:
            dt = q.dtype
            q, k = self.rotary_emb(positions, q.float(), k.float())
            q, k = q.to(dt), k.to(dt)
        else:
            q, k = self.rotary_emb(positions, q, k)
        a, _ = self.o(self.attn(q, k, v))
        x = x + a
        h = self.mlp_norm(x)
        if self.is_moe:
            logits, _ = self.router(h.float())
            return x + self.experts(hidden_states=h, router_logits=logits)  # routed + shared experts
        m, _ = self.down(self.act(self.gate_up(h)[0]))
        return x + m


class SwiGLU(nn.Module):
    """LLaDA2's shared experts (``down(silu(gate(x)) * up(x))``), run by vLLM's MoE layer beside the routed ones."""

    def __init__(self, hidden: int, width: int, reduce_results: bool, quant_config, prefix: str):
        super().__init__()
        self.gate_up = MergedColumnParallelLinear(hidden, [width] * 2, bias=False, quant_config=quant_config,
                                                  prefix=f"{prefix}.gate_up")
        self.down = RowParallelLinear(width, hidden, bias=False, reduce_results=reduce_results,
                                      quant_config=quant_config, prefix=f"{prefix}.down")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)[0]))[0]


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class DLLMDecoder(nn.Module):
    """The embedding, the decoder layers and the final norm: the part vLLM compiles (its CPU default: one
    Dynamo trace, Inductor, guards dropped), with the attention an opaque op. Its inputs are every row of the
    step, extra draft rows included, in vLLM's persistent buffers (module docstring).

    Under pipeline parallelism each stage holds vLLM's share of the layers (``make_layers``: the others are
    placeholders), the embedding on the first stage and the norm on the last; a stage hands the next one its
    hidden states of every row (``IntermediateTensors``, one tensor: the layers add their residual
    themselves)."""

    def __init__(self, *, vllm_config: VllmConfig, spec: ArchSpec, prefix: str = ""):
        super().__init__()
        pp = get_pp_group()
        self.embed = (VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, prefix=maybe_prefix(prefix, "embed"))
                      if pp.is_first_rank else PPMissingLayer())
        self.start_layer, self.end_layer, self.layers = make_layers(
            spec.num_layers, lambda prefix: DLLMDecoderLayer(spec, vllm_config, int(prefix.rsplit(".", 1)[1]), prefix),
            prefix=maybe_prefix(prefix, "layers"))
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(["hidden_states"],
                                                                                      spec.hidden_size)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        pp = get_pp_group()
        if pp.is_first_rank:
            x = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
        else:
            x = intermediate_tensors["hidden_states"]
        for layer in self.layers[self.start_layer: self.end_layer]:
            x = layer(positions, x)
        if not pp.is_last_rank:
            return IntermediateTensors({"hidden_states": x})
        return self.norm(x)


class DLLMForVLLM(nn.Module, SupportsPP):
    """A dLLM in vLLM: embedding, decoder layers over the paged KV cache, final norm, LM head (the LM head on the
    last pipeline stage only; tied to the embedding, that stage loads it from the embedding's tensor)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.spec = spec = self.arch_spec(vllm_config.model_config.hf_config)
        self.config = vllm_config.model_config.hf_config
        # a quantized checkpoint's config names its layers by checkpoint names: the layers here are named canonically
        compat.rename_quantized_layers(vllm_config.quant_config,
                                       lambda entries, field: vllm_layer_names(spec, entries, field))
        self.model = DLLMDecoder(vllm_config=vllm_config, spec=spec, prefix=maybe_prefix(prefix, "model"))
        pp = get_pp_group()
        if not pp.is_last_rank:
            self.lm_head = PPMissingLayer()
        elif spec.tie_embeddings and pp.is_first_rank:
            self.lm_head = self.model.embed
        else:
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(spec.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    @staticmethod
    def arch_spec(hf_config) -> ArchSpec:
        return ArchSpec.from_hf_config(hf_config)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | IntermediateTensors:
        """Hidden states of every row of the step (module docstring); a stage before the last returns them as
        ``IntermediateTensors`` for the next stage."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # canonical "layers.i.q" -> (vLLM parameter, shard id)
    _STACKED = {"q": ("qkv", "q"), "k": ("qkv", "k"), "v": ("qkv", "v"), "gate": ("gate_up", 0), "up": ("gate_up", 1)}
    _EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # names vLLM's MoE layer loads

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load real checkpoint tensors; a missing, unexpected or misshaped tensor raises, naming it. A quantized
        layer's tensors (``weight_scale``, ``weight_packed``, ...: :data:`.quantization.QUANT_SUFFIXES`) go to the
        parameters of the same names that vLLM's quantization method made for the layer."""
        names = checkpoint_names(self.spec)
        shapes = canonical_shapes(self.spec)
        params = dict(self.named_parameters())
        seen: set[str] = set()
        loaded: set[str] = set()
        stored: dict[str, set[str]] = {}  # checkpoint module -> the tensors it stores (weight, weight_scale, ...)
        for name, tensor in weights:
            module, _, qleaf = name.rpartition(".")
            quantized = qleaf in QUANT_SUFFIXES
            key = module + ".weight" if quantized else name  # the float weight it stands for
            if key not in names:
                raise CheckpointError(f"checkpoint: unexpected tensor {name!r} not used by a {self.spec.family} "
                                      "model with this config")
            canon = names[key]
            if not quantized and tuple(tensor.shape) != shapes[canon]:
                raise CheckpointError(f"checkpoint: tensor {name!r} has shape {list(tensor.shape)}, "
                                      f"expected {list(shapes[canon])}")
            if not quantized or qleaf == "weight_packed":  # a packed weight replaces the weight
                seen.add(key)
            stored.setdefault(module, set()).add(qleaf)
            is_bias = canon.endswith(".bias")
            base = canon.removesuffix(".bias")
            leaf = base.rsplit(".", 1)[-1]
            suffix = ".bias" if is_bias else f".{qleaf}" if quantized else ".weight"
            owner = "model." if base.startswith("layers.") or base in ("norm", "embed") else ""  # in the compiled module
            layer, _, rest = base.removeprefix("layers.").partition(".")
            if not self._on_this_stage(base, layer):  # another pipeline stage's tensor
                if base == "embed" and self.spec.tie_embeddings and isinstance(self.lm_head, ParallelLMHead):
                    getattr(self.lm_head.weight, "weight_loader", default_weight_loader)(self.lm_head.weight, tensor)
                    loaded.add("lm_head.weight")  # the last stage's LM head, tied to the first stage's embedding
                continue
            if rest.startswith("experts."):  # LLaDA2 expert e's gate/up/down -> vLLM's stacked expert weights
                _, e, part = rest.split(".")
                runner = self.model.layers[int(layer)].experts
                for p in runner.load_weights([(f"{e}.{self._EXPERT[part]}{suffix}", tensor)]):
                    loaded.add(f"model.layers.{layer}.experts.{p}")
                continue
            if rest == "router" and is_bias:  # LLaDA2's expert bias (selection only)
                pname = f"model.layers.{layer}.expert_bias"
                default_weight_loader(params[pname], tensor)
                loaded.add(pname)
                continue
            stacked = base.startswith("layers.") and leaf in self._STACKED
            target, shard = self._STACKED[leaf] if stacked else (leaf, None)
            pname = owner + base[: -len(leaf)] + target + suffix
            param = params.get(pname)
            if param is None:  # a quantized tensor the layer's quantization method does not store
                raise CheckpointError(f"checkpoint: tensor {name!r}: vLLM's quantization method for layer "
                                      f"{pname.rsplit('.', 1)[0]} has no parameter {qleaf!r} (does the checkpoint's "
                                      "quantization_config describe this layer?)")
            if stacked:
                param.weight_loader(param, tensor, shard)
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(pname)
        self._check_quantized(stored, params, loaded)
        missing = sorted(set(names) - seen)
        if missing:
            raise CheckpointError(f"checkpoint: missing tensor {missing[0]!r} (shape {list(shapes[names[missing[0]]])})"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        return loaded

    def _on_this_stage(self, base: str, layer: str) -> bool:
        """Whether the canonical module ``base`` (``layer``: its layer index, for a decoder layer's) lives on this
        pipeline stage: its layers (vLLM's ``get_pp_indices``), the embedding on the first, norm and LM head on
        the last."""
        if base.startswith("layers."):
            return self.model.start_layer <= int(layer) < self.model.end_layer
        module = {"embed": self.model.embed, "norm": self.model.norm, "lm_head": self.lm_head}.get(base)
        return not isinstance(module, PPMissingLayer)

    def _check_quantized(self, stored: dict[str, set[str]], params: dict, loaded: set[str]) -> None:
        """A quantized layer's tensors are all there: the modules one vLLM layer holds store the same tensors (a
        scale missing from ``k_proj`` alone would leave its share of the fused layer's scale unset), and every
        quantization parameter vLLM made was loaded."""
        by_canon = {c: m for m, c in linear_modules(self.spec).items()}
        for layer, parts in vllm_layers(self.spec).items():
            sets = {by_canon[p]: stored.get(by_canon[p], set()) for p in parts}
            first = next(iter(sets))
            for module, have in sets.items():
                if have != sets[first]:
                    gap = sorted(sets[first] ^ have)[0]
                    where = module if gap in sets[first] else first
                    raise CheckpointError(f"checkpoint: missing tensor '{where}.{gap}' (the other modules of "
                                          f"{layer} store it)")
        unset = sorted(p for p in params if p not in loaded and p.endswith(QUANT_SUFFIXES))
        if unset:
            raise CheckpointError(f"checkpoint: nothing loaded into {unset[0]!r}, a parameter of vLLM's quantization "
                                  f"method (the checkpoint lacks that layer's {unset[0].rsplit('.', 1)[-1]!r})")


class LLaDAModelLM(DLLMForVLLM):
    """LLaDA-8B-Instruct / LLaDA-1.5 format (``model_type "llada"``)."""


class DreamModel(DLLMForVLLM):
    """Dream-v0 format (``model_type "Dream"``)."""


class SDARForCausalLM(DLLMForVLLM):
    """SDAR format (``model_type "sdar"``)."""


class LLaDA2MoeModelLM(DLLMForVLLM):
    """LLaDA2.0 / 2.1 format (``model_type "llada2_moe"``): Ling/Bailing mixture of experts, block diffusion."""


class PSDLlamaForCausalLM(DLLMForVLLM):
    """A Llama-format AR checkpoint as PRESTO's target (causal attention through the project's backend, which
    also verifies token trees). Selected by ``speculative_config={"method": "psd", "mode": "presto"}``."""

    @staticmethod
    def arch_spec(hf_config) -> ArchSpec:
        return ArchSpec.from_ar_config(hf_config.to_dict())
