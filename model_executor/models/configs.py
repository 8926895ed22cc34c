"""Hugging Face config classes for the dLLM checkpoint formats, and their normalised architecture spec.

The classes read the real ``config.json`` files of LLaDA (``model_type "llada"``), Dream (``"Dream"``),
SDAR (``"sdar"``) and LLaDA2 (``"llada2_moe"``, a mixture-of-experts block-diffusion model) and are registered with ``transformers.AutoConfig`` by :func:`register_configs`,
so neither vLLM nor transformers needs ``trust_remote_code`` for them.

:class:`ArchSpec` is the one place where the four formats are reduced to the handful of facts the
reference model, the vLLM model classes and the decoders need (sizes, q/k/v bias, q/k norm, whether
logits are shifted, the attention pattern, the mask token, the experts).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# SDAR's published block size, and the name of its mask token in the SDAR tokenizers (id 151669 in the 4B/8B
# chat models): what a config without ``block_size`` / ``mask_token_id`` means (:func:`sdar_defaults`).
SDAR_BLOCK_SIZE = 4
SDAR_MASK_TOKEN = "<|MASK|>"
# LLaDA2's published config.json has no mask, EOS or block size: its generate() (and SGLang's DLLM_PARAMS, dInfer)
# use mask id 156895, EOS 156892 (= pad) and blocks of 32, the block size it was trained with.
LLADA2_DEFAULTS = {"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32}


class LLaDAConfig(PretrainedConfig):
    """LLaDA-8B's OLMo-style config (``d_model``, ``n_layers``, ``mlp_hidden_size`` ...)."""

    model_type = "llada"
    # vLLM and transformers read the generic names; LLaDA's own names stay the stored ones.
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
                     "num_key_value_heads": "n_kv_heads", "intermediate_size": "mlp_hidden_size",
                     "max_position_embeddings": "max_sequence_length"}

    def __init__(self, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=None, mlp_hidden_size=12288,
                 vocab_size=126464, embedding_size=None, rope_theta=500000.0, rms_norm_eps=1e-5,
                 max_sequence_length=4096, mask_token_id=126336, eos_token_id=126081, pad_token_id=126081,
                 bos_token_id=126080, weight_tying=False, include_bias=False, include_qkv_bias=False,
                 rope=True, layer_norm_type="rms", block_type="llama", activation_type="silu", mlp_ratio=4,
                 **kwargs):
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.n_kv_heads = n_kv_heads if n_kv_heads is not None else n_heads
        # LLaDA's own code: the MLP width is mlp_hidden_size, or mlp_ratio * d_model when that is null
        self.mlp_ratio = mlp_ratio
        self.mlp_hidden_size = mlp_hidden_size if mlp_hidden_size is not None else mlp_ratio * d_model
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size if embedding_size is not None else vocab_size
        self.rope_theta, self.rms_norm_eps = rope_theta, rms_norm_eps
        self.max_sequence_length, self.mask_token_id = max_sequence_length, mask_token_id
        self.weight_tying, self.include_bias, self.include_qkv_bias = weight_tying, include_bias, include_qkv_bias
        self.rope, self.layer_norm_type, self.block_type = rope, layer_norm_type, block_type
        self.activation_type = activation_type
        kwargs.setdefault("tie_word_embeddings", weight_tying)
        super().__init__(eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                         **kwargs)


class _QwenStyleConfig(PretrainedConfig):
    def __init__(self, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=None, head_dim=None, rope_theta=1e6,
                 rms_norm_eps=1e-6, max_position_embeddings=32768, mask_token_id=None,
                 tie_word_embeddings=False, hidden_act="silu", **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads if num_key_value_heads is not None else num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.rope_theta, self.rms_norm_eps = rope_theta, rms_norm_eps
        self.max_position_embeddings, self.mask_token_id = max_position_embeddings, mask_token_id
        self.hidden_act = hidden_act
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class DreamConfig(_QwenStyleConfig):
    """Dream-v0 (Qwen2 layout with q/k/v bias; logits shifted like an AR model)."""

    model_type = "Dream"


class SDARConfig(_QwenStyleConfig):
    """SDAR (Qwen3 layout with per-head q/k RMSNorm; block-causal attention of ``block_size``)."""

    model_type = "sdar"

    def __init__(self, block_size=None, **kwargs):
        self.block_size = block_size  # None: SDAR's published 4, logged when read (ArchSpec.from_hf_config)
        super().__init__(**kwargs)


class LLaDA2MoeConfig(PretrainedConfig):
    """LLaDA2.0 / 2.1 (``LLaDA2MoeModelLM``): a Ling/Bailing mixture-of-experts transformer trained for block
    diffusion. Defaults are those of the model card's config class (so a field a published config leaves out,
    like ``use_qk_norm``, means what it means there); ``mask_token_id``, ``eos_token_id`` and ``block_size`` are
    not in the published file (:data:`LLADA2_DEFAULTS`)."""

    model_type = "llada2_moe"

    def __init__(self, vocab_size=30592, hidden_size=1024, intermediate_size=None, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=0, hidden_act="silu", use_qkv_bias=False,
                 use_qk_norm=True, use_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 max_position_embeddings=16384, rope_theta=10000.0, rope_scaling=None, pad_token_id=None,
                 num_experts=16, num_shared_experts=0, num_experts_per_tok=2, n_group=8, topk_group=4,
                 routed_scaling_factor=2.5, moe_intermediate_size=None, first_k_dense_replace=0, head_dim=None,
                 partial_rotary_factor=0.5, mask_token_id=None, block_size=None, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act, self.use_qkv_bias, self.use_qk_norm, self.use_bias = (hidden_act, use_qkv_bias,
                                                                             use_qk_norm, use_bias)
        self.rms_norm_eps, self.max_position_embeddings = rms_norm_eps, max_position_embeddings
        self.rope_theta, self.rope_scaling, self.partial_rotary_factor = rope_theta, rope_scaling, partial_rotary_factor
        self.num_experts, self.num_shared_experts, self.num_experts_per_tok = (num_experts, num_shared_experts,
                                                                               num_experts_per_tok)
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.moe_intermediate_size, self.first_k_dense_replace = moe_intermediate_size, first_k_dense_replace
        self.mask_token_id, self.block_size = mask_token_id, block_size
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)


CONFIG_CLASSES = {c.model_type: c for c in (LLaDAConfig, DreamConfig, SDARConfig, LLaDA2MoeConfig)}
def register_configs() -> None:
    """Register the config classes with ``transformers.AutoConfig`` (idempotent)."""
    from transformers import AutoConfig

    for model_type, cls in CONFIG_CLASSES.items():
        AutoConfig.register(model_type, cls, exist_ok=True)


AttentionKind = Literal["bidirectional", "block_causal", "causal"]

# Config fields whose other values change the computation in ways the model classes do not implement: a
# checkpoint that sets one is refused (naming the field and what is supported), never decoded wrongly. An
# absent field means its default, the supported value.
SUPPORTED_VALUES = {
    "llada": {"scale_logits": (False,), "input_emb_norm": (False,), "alibi": (False,), "rope": (True,),
              "activation_type": ("silu",), "layer_norm_type": ("rms",), "rope_full_precision": (True,),
              "block_type": ("llama",), "attention_layer_norm": (False,), "clip_qkv": (None,)},
    "Dream": {"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,)},
    "sdar": {"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,)},
    # LLaDA2's own code reads none of score_function, norm_topk_prob, router_dtype: it always scores with a
    # sigmoid, renormalises the top-k weights and routes in float32, and so do these classes.
    "llada2_moe": {"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,),
                   "use_bias": (False,), "norm_head": (False,), "moe_router_enable_expert_bias": (True,)},
}


def _check_supported(model_type: str, get) -> None:
    """Refuse a config field set to a value the model classes do not implement (:data:`SUPPORTED_VALUES`)."""
    missing = object()
    for field, allowed in SUPPORTED_VALUES.get(model_type, {}).items():
        value = get(field, missing)
        if value is missing:
            continue
        if field == "rope_scaling" and isinstance(value, dict) and \
                (value.get("rope_type") or value.get("type")) == "default" and \
                set(value) <= {"rope_type", "type", "rope_theta", "partial_rotary_factor"}:
            continue  # transformers' spelling of "no scaling"
        if value not in allowed:
            shown = ", ".join("null" if a is None else json.dumps(a) for a in allowed)
            raise ValueError(f"config.json: {field} {json.dumps(value)} is not implemented by psd-plugin's "
                             f"{model_type} model classes; supported: {shown}")


@dataclass(frozen=True)
class MoESpec:
    """LLaDA2's experts: layers from ``first_dense`` on replace the MLP by ``num_experts`` SwiGLU experts of width
    ``intermediate_size`` plus ``num_shared`` always-on ones. Routing (per token): sigmoid scores of float32 router
    logits; the expert bias is added for *selection only*; the ``topk_group`` of ``n_group`` expert groups with
    the largest sum of their two best biased scores are kept, and the ``top_k`` best experts in them chosen;
    their weights are the unbiased scores renormalised to sum 1, times ``scale``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared: int
    first_dense: int
    n_group: int
    topk_group: int
    scale: float

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense


@dataclass(frozen=True)
class ArchSpec:
    """The facts about a dLLM checkpoint that the model code and the decoders depend on."""

    family: Literal["llada", "dream", "sdar", "llada2", "llama"]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    mask_token_id: int  # -1 for autoregressive models
    eos_token_id: int
    qkv_bias: bool
    qk_norm: bool
    shift_logits: bool  # Dream: the prediction for position i is read from the output at i - 1
    attention: AttentionKind
    attention_block: int | None  # SDAR's / LLaDA2's attention block (their config's block_size); None: bidirectional
    tie_embeddings: bool
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of a head (LLaDA2: half); None = all
    fused_qkv: bool = False  # one query_key_value tensor (LLaDA2) instead of q/k/v
    moe: MoESpec | None = None

    @property
    def rope_in_float32(self) -> bool:
        """Whether RoPE rotates in float32 whatever the activation dtype: LLaDA (``rope_full_precision``, the
        only value it supports). Dream's, SDAR's and Llama's own code casts cos/sin to the activation dtype
        and rotates there, so bfloat16 serving rotates in bfloat16 as they do."""
        return self.family == "llada"

    @classmethod
    def from_ar_config(cls, config: dict) -> "ArchSpec":
        """A Llama-format autoregressive model (PRESTO's target), causal attention; errors name the field."""
        if config.get("model_type") != "llama":
            raise ValueError(f"config.json: model_type {config.get('model_type')!r}; an autoregressive target "
                             "must be model_type 'llama'")
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        if eos is None:
            raise ValueError("config.json: eos_token_id is missing")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ValueError("config.json: attention_bias / mlp_bias are not supported for Llama targets")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))
        return cls("llama", hidden, config["num_hidden_layers"], heads, config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or hidden // heads, config["intermediate_size"], config["vocab_size"],
                   float(theta), float(config.get("rms_norm_eps", 1e-6)),
                   int(config.get("max_position_embeddings", 2048)), -1, int(eos), False, False, True, "causal",
                   None, bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def from_hf_config(cls, config) -> "ArchSpec":
        """Normalise a LLaDA / Dream / SDAR / LLaDA2 config (object or dict); errors name the bad field."""
        if isinstance(config, dict) and config.get("model_type") == "llada2_moe":
            # fields a published LLaDA2 config leaves out mean the config class's defaults (use_qk_norm ...)
            config = LLaDA2MoeConfig(**{k: v for k, v in config.items() if k != "model_type"})
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (
            lambda k, d=None: getattr(config, k, d))
        model_type = get("model_type")
        if model_type not in CONFIG_CLASSES:
            raise ValueError(f"config.json: unknown model_type {model_type!r}; a dLLM checkpoint must have "
                             f"model_type one of {sorted(CONFIG_CLASSES)}")
        mask = get("mask_token_id")
        if mask is None and model_type == "sdar":
            mask = sdar_mask_from_tokenizer(get("_name_or_path"))
        if model_type == "llada2_moe":
            defaulted = {k: _published_default(str(get("_name_or_path") or "?"), k, v, "LLaDA2's published")
                         for k, v in LLADA2_DEFAULTS.items() if get(k) is None}
            get = _with_defaults(get, defaulted)
            mask = get("mask_token_id")
        if mask is None:
            where = f" and its tokenizer has no {SDAR_MASK_TOKEN}" if model_type == "sdar" else ""
            raise ValueError(f"config.json: model_type {model_type!r} has no mask_token_id{where}; dLLM decoding "
                             "needs the id of the mask token (e.g. <|mdm_mask|>): set mask_token_id in config.json "
                             "or with --hf-overrides '{\"mask_token_id\": N}'")
        eos = get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        if eos is None:
            raise ValueError("config.json: eos_token_id is missing")
        _check_supported(model_type, get)
        if model_type == "llada":
            hidden, heads = get("d_model"), get("n_heads")
            kv = get("n_kv_heads") or heads
            mlp = get("mlp_hidden_size")
            mlp = mlp if mlp is not None else int(get("mlp_ratio", 4) or 4) * hidden  # as LLaDA's own code
            return cls("llada", hidden, get("n_layers"), heads, kv, hidden // heads, mlp,
                       get("embedding_size") or get("vocab_size"), float(get("rope_theta", 10000.0)),
                       float(get("rms_norm_eps", 1e-5)), int(get("max_sequence_length", 4096)), int(mask),
                       int(eos), bool(get("include_qkv_bias", False) or get("include_bias", False)), False,
                       False, "bidirectional", None, bool(get("weight_tying", False)))
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        kv = get("num_key_value_heads") or heads
        if not 0 <= int(mask) < int(get("vocab_size")):
            raise ValueError(f"config.json: mask_token_id {mask} is outside the vocabulary (vocab_size "
                             f"{get('vocab_size')})")
        head_dim = get("head_dim") or hidden // heads
        common = dict(hidden_size=hidden, num_layers=get("num_hidden_layers"), num_heads=heads, num_kv_heads=kv,
                      head_dim=head_dim, intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                      rope_theta=float(get("rope_theta", 1e6)), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                      max_position=int(get("max_position_embeddings", 32768)), mask_token_id=int(mask),
                      eos_token_id=int(eos), tie_embeddings=bool(get("tie_word_embeddings", False)))
        if model_type == "Dream":
            return cls("dream", **common, qkv_bias=True, qk_norm=False, shift_logits=True,
                       attention="bidirectional", attention_block=None)
        if model_type == "llada2_moe":
            return cls._llada2(common, get)
        block = get("block_size")
        if block is None:
            block = _published_default(str(get("_name_or_path") or "?"), "block_size", SDAR_BLOCK_SIZE,
                                       "SDAR's published block size")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"config.json: block_size {json.dumps(block)}; an SDAR block size is a positive integer")
        return cls("sdar", **common, qkv_bias=False, qk_norm=True, shift_logits=False,
                   attention="block_causal", attention_block=block)

    @classmethod
    def _llada2(cls, common: dict, get) -> "ArchSpec":
        """LLaDA2 (``llada2_moe``): fused query_key_value, per-head q/k RMSNorm, RoPE on part of each head, a
        dense MLP in the first ``first_k_dense_replace`` layers and experts after, block-causal attention."""
        def need(field):
            value = get(field)
            if value is None:
                raise ValueError(f"config.json: {field} is missing; a LLaDA2 (llada2_moe) config needs it")
            return value

        head_dim = common["head_dim"]
        factor = get("partial_rotary_factor")
        factor = 1.0 if factor is None else float(factor)
        rotary = int(head_dim * factor)
        if get("rotary_dim") is not None and int(get("rotary_dim")) != rotary:
            raise ValueError(f"config.json: rotary_dim {get('rotary_dim')} disagrees with partial_rotary_factor "
                             f"{factor} x head_dim {head_dim} = {rotary} (LLaDA2's code reads partial_rotary_factor)")
        if rotary < 2 or rotary % 2 or rotary > head_dim:
            raise ValueError(f"config.json: partial_rotary_factor {factor} gives {rotary} rotary dims of a "
                             f"{head_dim}-dim head; it must be an even number from 2 to head_dim")
        experts, top_k = int(need("num_experts")), int(need("num_experts_per_tok"))
        n_group = int(get("n_group") or 1)
        topk_group = int(get("topk_group") or n_group)
        if experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group:
            raise ValueError(f"config.json: n_group {n_group} / topk_group {topk_group} for num_experts {experts}; "
                             "n_group must divide num_experts into groups of at least 2 (a group scores by its two "
                             "best experts) and 1 <= topk_group <= n_group")
        if not 1 <= top_k <= topk_group * (experts // n_group):
            raise ValueError(f"config.json: num_experts_per_tok {top_k}; allowed: 1 to {topk_group * (experts // n_group)}"
                             " (the experts in topk_group groups)")
        first_dense = int(get("first_k_dense_replace") or 0)
        moe = MoESpec(experts, top_k, int(need("moe_intermediate_size")), int(get("num_shared_experts") or 0),
                      first_dense, n_group, topk_group, float(get("routed_scaling_factor", 1.0)))
        dense = get("intermediate_size")
        if first_dense > 0 and dense is None:
            raise ValueError("config.json: intermediate_size is missing; the first first_k_dense_replace layers of a "
                             "LLaDA2 model are dense MLPs of that width")
        block = get("block_size")
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise ValueError(f"config.json: block_size {json.dumps(block)}; a LLaDA2 block size is a positive integer")
        common = {**common, "intermediate_size": int(dense or 0)}
        return cls("llada2", **common, qkv_bias=bool(get("use_qkv_bias", False)),
                   qk_norm=bool(get("use_qk_norm", True)), shift_logits=False, attention="block_causal",
                   attention_block=block, rotary_dim=rotary, fused_qkv=True, moe=moe)


@functools.lru_cache(maxsize=None)
def _published_default(model: str, field: str, value, label: str):
    """``value`` for a ``field`` a config lacks, logged once per model and field."""
    logger.warning("%s: config.json has no %s; using %s %s (set it with --hf-overrides '{\"%s\": N}')",
                   model, field, label, value, field)
    return value


@functools.lru_cache(maxsize=None)
def sdar_mask_from_tokenizer(model_dir: str | None) -> int | None:
    """The id of SDAR's mask token ``<|MASK|>`` in the tokenizer next to a config without ``mask_token_id``
    (SDAR's published configs may lack it; its generator takes it as an argument). Logged once per model; None
    when there is no such tokenizer or token (the caller then refuses the config, naming the field)."""
    if not model_dir:
        return None
    mask = None
    tj = Path(model_dir) / "tokenizer.json"
    try:
        if tj.exists():
            from tokenizers import Tokenizer

            mask = Tokenizer.from_file(str(tj)).token_to_id(SDAR_MASK_TOKEN)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(os.fspath(model_dir))
            ids = tok.convert_tokens_to_ids([SDAR_MASK_TOKEN])
            mask = ids[0] if ids and ids[0] != tok.unk_token_id else None
    except Exception as e:  # an unreadable tokenizer: the caller's error names the missing field
        logger.warning("%s: could not read the tokenizer for the mask token: %s", model_dir, e)
        return None
    if mask is not None:
        logger.warning("%s: config.json has no mask_token_id; using the tokenizer's %s, id %d (set it with "
                       "--hf-overrides '{\"mask_token_id\": N}')", model_dir, SDAR_MASK_TOKEN, mask)
    return mask


def _with_defaults(get, defaults: dict):
    return lambda k, d=None: defaults[k] if k in defaults else get(k, d)
