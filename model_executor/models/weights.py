"""Checkpoint tensor names of the dLLM formats, and strict safetensors loading.

Both the plain-PyTorch reference model and the vLLM model classes use *canonical* parameter names
(``layers.3.q``, ``lm_head``, ``layers.3.experts.7.gate`` ...). :func:`checkpoint_names` maps them to the
real names a family stores (``model.transformer.blocks.3.q_proj.weight`` for LLaDA,
``model.layers.3.self_attn.q_proj.weight`` for Dream/SDAR, ``model.layers.3.attention.query_key_value.weight``
and ``model.layers.3.mlp.experts.7.gate_proj.weight`` for LLaDA2), so there is one table per format and
nowhere else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .configs import ArchSpec

_LLADA_LAYER = {"attn_norm": "attn_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
                "mlp_norm": "ff_norm", "gate": "ff_proj", "up": "up_proj", "down": "ff_out"}
_QWEN_LAYER = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
               "v": "self_attn.v_proj", "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
               "k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj",
               "up": "mlp.up_proj", "down": "mlp.down_proj"}


_LLADA2_LAYER = {"attn_norm": "input_layernorm", "qkv": "attention.query_key_value", "o": "attention.dense",
                 "q_norm": "attention.query_layernorm", "k_norm": "attention.key_layernorm",
                 "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                 "down": "mlp.down_proj", "router": "mlp.gate"}
_LLADA2_EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _swiglu(prefix: str, h: int, m: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate": (m, h), prefix + "up": (m, h), prefix + "down": (h, m)}


def canonical_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model under its canonical name, with its shape."""
    h, d, v, m = spec.hidden_size, spec.head_dim, spec.vocab_size, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    out = {"embed": (v, h), "norm": (h,)}
    if not spec.tie_embeddings:
        out["lm_head"] = (v, h)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm": (h,), p + "o": (h, q), p + "mlp_norm": (h,)})
        if spec.fused_qkv:
            out[p + "qkv"] = (q + 2 * kv, h)
            if spec.qkv_bias:
                out[p + "qkv.bias"] = (q + 2 * kv,)
        else:
            out.update({p + "q": (q, h), p + "k": (kv, h), p + "v": (kv, h)})
            if spec.qkv_bias:
                out.update({p + "q.bias": (q,), p + "k.bias": (kv,), p + "v.bias": (kv,)})
        if spec.qk_norm:
            out.update({p + "q_norm": (d,), p + "k_norm": (d,)})
        moe = spec.moe
        if moe is None or not moe.is_moe_layer(i):
            out.update(_swiglu(p, h, m))
            continue
        out.update({p + "router": (moe.num_experts, h), p + "router.bias": (moe.num_experts,)})
        for e in range(moe.num_experts):
            out.update(_swiglu(f"{p}experts.{e}.", h, moe.intermediate_size))
        if moe.num_shared:
            out.update(_swiglu(p + "shared.", h, moe.intermediate_size * moe.num_shared))
    return out


def checkpoint_name(spec: ArchSpec, canonical: str) -> str:
    """The real tensor name of a canonical parameter in ``spec.family``'s checkpoint format."""
    is_bias = canonical.endswith(".bias")
    base = canonical[: -len(".bias")] if is_bias else canonical
    suffix = ".bias" if is_bias else ".weight"
    if spec.family == "llada":
        top = {"embed": "model.transformer.wte", "norm": "model.transformer.ln_f",
               "lm_head": "model.transformer.ff_out"}
        if base in top:
            return top[base] + suffix
        _, i, part = base.split(".")
        return f"model.transformer.blocks.{i}.{_LLADA_LAYER[part]}{suffix}"
    top = {"embed": "model.word_embeddings" if spec.family == "llada2" else "model.embed_tokens",
           "norm": "model.norm", "lm_head": "lm_head"}
    if base in top:
        return top[base] + suffix
    if spec.family == "llada2":
        _, i, part, *rest = base.split(".")
        if part == "router" and is_bias:  # the router's expert bias: used to pick experts, never to weight them
            return f"model.layers.{i}.mlp.gate.expert_bias"
        if part == "experts":  # experts.<e>.<gate|up|down>
            return f"model.layers.{i}.mlp.experts.{rest[0]}.{_LLADA2_EXPERT[rest[1]]}{suffix}"
        if part == "shared":
            return f"model.layers.{i}.mlp.shared_experts.{_LLADA2_EXPERT[rest[0]]}{suffix}"
        return f"model.layers.{i}.{_LLADA2_LAYER[part]}{suffix}"
    _, i, part = base.split(".")
    return f"model.layers.{i}.{_QWEN_LAYER[part]}{suffix}"


def checkpoint_names(spec: ArchSpec) -> dict[str, str]:
    """``{checkpoint name: canonical name}`` for every tensor the format stores."""
    return {checkpoint_name(spec, c): c for c in canonical_shapes(spec)}


class CheckpointError(ValueError):
    """A checkpoint does not match its config; the message names the offending tensor."""


def check_tensors(spec: ArchSpec, shapes: dict[str, tuple[int, ...]], where: str = "checkpoint") -> None:
    """Fail on a missing, unexpected or misshaped tensor, naming it and the expected shape."""
    expected = {checkpoint_name(spec, c): s for c, s in canonical_shapes(spec).items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing tensor {missing[0]!r} (shape {list(expected[missing[0]])})"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor {unexpected[0]!r} not used by a {spec.family} model "
                              "with this config" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, shape in sorted(shapes.items()):
        if tuple(shape) != tuple(expected[name]):
            raise CheckpointError(f"{where}: tensor {name!r} has shape {list(shape)}, expected {list(expected[name])}")


def _weight_file(path: Path, index: Path, name) -> Path:
    """``path / name`` for a file name of ``index``'s ``weight_map``, refused (naming the file and the index) when
    it could reach outside the checkpoint directory: an absolute name, a ``..`` part, or a name that resolves
    elsewhere (symlinks followed), so a crafted index cannot make the loader open any file on the machine.
    One symlink layout is allowed: the Hugging Face cache's, a ``snapshots/<revision>`` directory whose files
    link to the same repository's ``blobs``."""
    where = f"{index}: weight file {name!r}"
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where} is not a file name")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{where} is not a plain name inside the checkpoint directory {path}")
    root = path.resolve()
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    target = (path / name).resolve()
    if not any(target.is_relative_to(a) for a in allowed):
        raise CheckpointError(f"{where} resolves to {target}, outside the checkpoint directory {root}")
    return path / name


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint directory: those its ``model.safetensors.index.json`` names (each one
    checked to lie inside the directory, ``_weight_file``), else every ``*.safetensors`` in it."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text())["weight_map"].values()
        return [_weight_file(path, index, n) for n in sorted(set(names), key=str)]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return files


def load_checkpoint(spec: ArchSpec, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint directory, checked against ``spec``; keys are canonical names. A quantized
    checkpoint (``quantization_config`` in its ``config.json``) gives the float weights it stands for
    (:func:`.quantization.dequantize`)."""
    from safetensors import safe_open

    from .quantization import dequantize, quantization_config

    names = checkpoint_names(spec)
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    if (qconfig := quantization_config(path)) is not None:
        tensors = dequantize(spec, tensors, qconfig, str(path))
    check_tensors(spec, {k: tuple(t.shape) for k, t in tensors.items()}, where=str(path))
    return {names[k]: t for k, t in tensors.items()}


def save_checkpoint(spec: ArchSpec, state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write canonical-named tensors under the family's real names (``model.safetensors``)."""
    from safetensors.torch import save_file

    out = {checkpoint_name(spec, k): v.detach().contiguous().cpu() for k, v in state.items()}
    check_tensors(spec, {k: tuple(t.shape) for k, t in out.items()}, where=str(path))
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
