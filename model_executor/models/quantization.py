"""Quantized checkpoints in compressed-tensors' format (the one llm-compressor writes and vLLM loads).

A quantized checkpoint keeps its family's tensor names (:mod:`.weights`): each quantized linear layer
``<module>.weight`` becomes the tensors its scheme stores (``<module>.weight`` int8 and ``<module>.weight_scale``
for W8A8; ``<module>.weight_packed``, ``weight_scale``, ``weight_shape`` for W4A16), and ``config.json`` carries a
``quantization_config`` (``quant_method: compressed-tensors``). Three uses:

- :func:`quantize_checkpoint` makes one from a float checkpoint with compressed-tensors' own quantization
  (its schemes, its quantization parameters from each weight's min and max: round-to-nearest, as llm-compressor's
  data-free ``QuantizationModifier`` does) and its compressors. For the project's tiny checkpoints and
  tests; real checkpoints come from llm-compressor (GPTQ, AWQ, ...), in the same format.
- :func:`dequantize` gives the float weights a quantized checkpoint stands for (compressed-tensors'
  decompressors), so the reference engine runs the same weights vLLM's kernels run quantized.
- :func:`vllm_layer_names` translates the checkpoint's module names in ``ignore`` and in name targets into the
  model classes' layer names (``model.layers.3.qkv`` for ``q_proj``, ``k_proj``, ``v_proj``), for vLLM's
  quantization config to find them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from .configs import ArchSpec
from .weights import CheckpointError, canonical_shapes, checkpoint_name

# the schemes made here: compressed-tensors' preset name -> its storage format
SCHEMES = {"W8A8": "int-quantized", "W4A16": "pack-quantized", "W4A16_ASYM": "pack-quantized",
           "FP8_DYNAMIC": "float-quantized"}
# the tensors compressed-tensors stores for a quantized weight (and its activations), beside or instead of .weight
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale")
_LINEAR_LEAVES = {"q", "k", "v", "qkv", "o", "gate", "up", "down"}


def quantization_config(path: str | Path) -> dict | None:
    """The ``quantization_config`` of a checkpoint directory's ``config.json``, or None."""
    f = Path(path) / "config.json"
    return json.loads(f.read_text()).get("quantization_config") if f.exists() else None


def linear_modules(spec: ArchSpec) -> dict[str, str]:
    """``{checkpoint module name: canonical name}`` of every linear layer a quantization scheme may target: the
    attention and MLP projections, LLaDA2's experts and shared experts. Not the embedding, the LM head or LLaDA2's
    router (quantized by no published dLLM checkpoint; the model classes keep them in float)."""
    out = {}
    for canon, shape in canonical_shapes(spec).items():
        if len(shape) == 2 and canon.startswith("layers.") and canon.rsplit(".", 1)[-1] in _LINEAR_LEAVES:
            out[checkpoint_name(spec, canon).removesuffix(".weight")] = canon
    return out


def vllm_layers(spec: ArchSpec) -> dict[str, list[str]]:
    """``{layer name in the vLLM model classes: canonical names of the checkpoint modules it holds}``: the fused
    ``qkv`` and ``gate_up`` layers hold several. vLLM's MoE layer asks for its experts' schemes by their
    projections' names under its own (``model.layers.1.experts.0.gate_proj``), each a layer here."""
    groups: dict[str, list[str]] = {}
    fuse = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"}
    proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    for canon in linear_modules(spec).values():
        base, leaf = canon.rsplit(".", 1)
        layer = f"{base}.{proj[leaf]}" if ".experts." in canon else f"{base}.{fuse.get(leaf, leaf)}"
        groups.setdefault("model." + layer, []).append(canon)
    return groups


def _matches(name: str, entry: str) -> bool:
    return bool(re.match(entry[3:], name)) if entry.startswith("re:") else name == entry


def vllm_layer_names(spec: ArchSpec, entries: list[str], field: str) -> list[str]:
    """The entries of a quantization config's ``field`` (``ignore``, or a target) in the vLLM model classes'
    layer names: the checkpoint modules the entries name (exactly, or ``re:`` a regex) become the layers holding
    them, in the model's order; a fused layer must have all its modules named or none (vLLM quantizes a layer
    with one scheme); an entry naming no linear module (a module class such as ``Linear``, ``lm_head``) stays
    as it is, after them."""
    modules = linear_modules(spec)
    by_canon = {c: m for m, c in modules.items()}
    named: dict[str, str] = {}  # canonical name -> the entry that names it
    kept: list[str] = []
    for entry in entries:
        hit = [c for m, c in modules.items() if _matches(m, entry)]
        if not hit:
            kept.append(entry)
        for c in hit:
            named.setdefault(c, entry)
    out: list[str] = []
    for layer, parts in vllm_layers(spec).items():
        inside = [p for p in parts if p in named]
        if inside and len(inside) != len(parts):
            missing = next(p for p in parts if p not in named)
            raise CheckpointError(
                f"quantization_config.{field}: {named[inside[0]]!r} names {by_canon[inside[0]]!r} but not "
                f"{by_canon[missing]!r}; psd-plugin's vLLM model runs them as one layer ({layer}), which takes one "
                "scheme: name all of its modules or none")
        if inside:
            out.append(layer)
    return out + kept


# ---------------------------------------------------------------------------------------------- making one
class _Modules(nn.Module):
    """A bare module tree: the checkpoint's linear layers under their checkpoint names (what compressed-tensors
    quantizes and compresses; nothing here runs a forward)."""


def _linear_tree(shapes: dict[str, tuple[int, int]], dtype: torch.dtype) -> nn.Module:
    root = _Modules()
    for name, (out_f, in_f) in shapes.items():
        *path, leaf = name.split(".")
        m = root
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, _Modules())
            m = getattr(m, p)
        m.add_module(leaf, nn.Linear(in_f, out_f, bias=False, dtype=dtype, device="meta"))
    return root


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str = "W8A8", group_size: int | None = None,
                        ignore: list[str] | None = None) -> Path:
    """Write ``dst``: the float checkpoint ``src`` with its linear layers quantized by compressed-tensors' preset
    ``scheme`` (``W8A8``: int8 weights per output channel, int8 activations per token, dynamic; ``W4A16``: int4
    weights in groups of ``group_size`` (preset 128), symmetric; ``W4A16_ASYM``: with zero points;
    ``FP8_DYNAMIC``: float8 e4m3 weights per output channel, float8 activations per token, dynamic), except the
    modules ``ignore`` names (checkpoint names or ``re:`` regexes). The weights' scales are
    compressed-tensors' quantization parameters of each channel's or group's min and max (round-to-nearest);
    config files, tokenizer and every other tensor are copied. Returns ``dst``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStrategy, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .reference import read_config
    from .weights import check_tensors, safetensors_files

    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    src, dst = Path(src), Path(dst)
    cfg = read_config(src)
    if cfg.get("quantization_config"):
        raise CheckpointError(f"{src} is quantized already")
    spec = ArchSpec.from_hf_config(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(src):
        with safe_open(str(f), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    check_tensors(spec, {k: tuple(t.shape) for k, t in tensors.items()}, where=str(src))
    ignore = list(ignore or [])
    vllm_layer_names(spec, ignore, "ignore")  # refuses an ignore list that splits a fused layer
    targets = {m: tuple(tensors[m + ".weight"].shape) for m in linear_modules(spec)
               if not any(_matches(m, e) for e in ignore)}
    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None:
        if qscheme.weights.strategy != QuantizationStrategy.GROUP:
            raise ValueError(f"group_size: scheme {scheme} quantizes weights per channel, not in groups")
        qscheme.weights.group_size = group_size
    g = qscheme.weights.group_size if qscheme.weights.strategy == QuantizationStrategy.GROUP else None
    if g:
        bad = next((m for m, (_, k) in targets.items() if k % g), None)
        if bad is not None:
            raise ValueError(f"group_size {g}: {bad} has {targets[bad][1]} input features, not a multiple of it")
    dtype = next(iter(tensors.values())).dtype
    tree = _linear_tree(targets, dtype)
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": qscheme}, format=SCHEMES[scheme],
                                                       ignore=["lm_head", *ignore]))
    for name, mod in tree.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        w = tensors[name + ".weight"]
        mod.weight = nn.Parameter(w.clone(), requires_grad=False)
        args = mod.quantization_scheme.weights
        v = w.float() if g is None else w.float().view(w.shape[0], -1, g)
        lo, hi = v.amin(-1), v.amax(-1)
        scale, zp = calculate_qparams(lo.view(mod.weight_scale.shape), hi.view(mod.weight_scale.shape), args)
        mod.weight_scale = nn.Parameter(scale.to(mod.weight_scale.dtype), requires_grad=False)
        mod.weight_zero_point = nn.Parameter(zp.to(mod.weight_zero_point.dtype), requires_grad=False)
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format=SCHEMES[scheme])
    compressor.compress_model(tree)
    out = {k: v for k, v in tensors.items() if k.removesuffix(".weight") not in targets}
    out.update({k: v.contiguous() for k, v in tree.state_dict().items()})
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(dst))  # config.json's quantization_config
    # its ignore list, as llm-compressor writes it (the compressor lists only modules of the tree it was given)
    f = dst / "config.json"
    cfg = json.loads(f.read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", *ignore]
    f.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst


# -------------------------------------------------------------------------------------------- reading one
def dequantize(spec: ArchSpec, tensors: dict[str, torch.Tensor], qconfig: dict, where: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors ``tensors`` (checkpoint names) with every quantized layer decompressed to its float
    ``.weight`` (compressed-tensors' decompressors; the dtype of its scales), as the float checkpoint it stands
    for; the other tensors as they are. A quantized layer's tensors must be complete."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    if qconfig.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}: quantization_config.quant_method {qconfig.get('quant_method')!r}; the "
                              "reference engine reads allowed: compressed-tensors")
    modules = linear_modules(spec)
    quantized = sorted({k.rsplit(".", 1)[0] for k in tensors if k.rsplit(".", 1)[-1] in QUANT_SUFFIXES})
    unknown = [m for m in quantized if m not in modules]
    if unknown:
        raise CheckpointError(f"{where}: quantized tensors of {unknown[0]!r}, not a linear layer of a "
                              f"{spec.family} model")
    if not quantized:
        return dict(tensors)
    shapes = canonical_shapes(spec)
    tree = _linear_tree({m: shapes[modules[m]] for m in quantized}, torch.float32)
    config = QuantizationConfig.model_validate(qconfig)
    apply_quantization_config(tree, config)
    compressor = ModelCompressor(quantization_config=config)
    # the tree as a compressed checkpoint holds it: its layers take the stored tensors
    def stored(k: str) -> bool:  # a quantized layer's weight as stored (its bias stays as it is)
        module, leaf = k.rsplit(".", 1)
        return module in quantized and (leaf == "weight" or leaf in QUANT_SUFFIXES)

    state = {k: v for k, v in tensors.items() if stored(k)}
    for name, mod in tree.named_modules():
        if isinstance(mod, nn.Linear):
            if not hasattr(mod, "quantization_scheme"):
                raise CheckpointError(f"{where}: {name} has quantized tensors but quantization_config does not "
                                      "quantize it (its targets / ignore)")
            for p, _ in list(mod.named_parameters(recurse=False)):
                delattr(mod, p)
            for k in [k for k in state if k.rsplit(".", 1)[0] == name]:
                mod.register_parameter(k.rsplit(".", 1)[1], nn.Parameter(state[k], requires_grad=False))
    compressor.decompress_model(tree)
    out = {k: v for k, v in tensors.items() if not stored(k)}
    for name, mod in tree.named_modules():
        if isinstance(mod, nn.Linear):
            out[name + ".weight"] = mod.weight.detach().clone()
    return out
