"""Reference models in the three real formats: loading, strict checks, attention patterns, shifts."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_executor.models.configs import ArchSpec, register_configs
from model_executor.models.reference import ReferenceDLLM, read_config
from model_executor.models.weights import CheckpointError, checkpoint_names, load_checkpoint

EXPECTED_NAMES = {
    "llada": ["model.transformer.wte.weight", "model.transformer.ff_out.weight", "model.transformer.ln_f.weight",
              "model.transformer.blocks.0.attn_out.weight", "model.transformer.blocks.1.ff_proj.weight",
              "model.transformer.blocks.0.up_proj.weight", "model.transformer.blocks.0.q_proj.weight"],
    "dream": ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias",
              "model.layers.1.mlp.gate_proj.weight", "model.layers.0.post_attention_layernorm.weight"],
    "sdar": ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight", "model.norm.weight"],
}


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_checkpoint_uses_real_names_and_reloads(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    stored = load_file(str(path / "model.safetensors"))
    for name in EXPECTED_NAMES[family]:
        assert name in stored
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [{"llada": "LLaDAModelLM", "dream": "DreamModel", "sdar": "SDARForCausalLM"}[family]]
    model = ReferenceDLLM.from_pretrained(path)
    for ck, canon in checkpoint_names(model.spec).items():
        assert torch.equal(model.canonical_state()[canon], stored[ck])
    assert "q_proj.bias" in " ".join(stored) if family == "dream" else "q_proj.bias" not in " ".join(stored)


def test_autoconfig_knows_the_formats(tiny_checkpoints):
    from transformers import AutoConfig

    register_configs()
    assert AutoConfig.from_pretrained(str(tiny_checkpoints["llada"])).hidden_size == 128
    assert AutoConfig.from_pretrained(str(tiny_checkpoints["sdar"])).block_size == 4


def _rewrite(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("family,name", [("llada", "model.transformer.blocks.1.up_proj.weight"),
                                         ("dream", "model.layers.0.self_attn.k_proj.bias")])
def test_missing_unexpected_misshaped_tensors_are_named(tiny_checkpoints, tmp_path, family, name):
    src = tiny_checkpoints[family]
    spec = ArchSpec.from_hf_config(read_config(src))
    p = _rewrite(src, tmp_path / "missing", lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_checkpoint(spec, p)
    p = _rewrite(src, tmp_path / "extra", lambda sd: sd.__setitem__("model.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.extra.weight'"):
        load_checkpoint(spec, p)
    p = _rewrite(src, tmp_path / "shape", lambda sd: sd.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[3, 3\], expected"):
        load_checkpoint(spec, p)


def test_bad_configs_fail_clearly():
    with pytest.raises(ValueError, match="unknown model_type 'llama'.*one of"):
        ArchSpec.from_hf_config({"model_type": "llama", "mask_token_id": 3})
    with pytest.raises(ValueError, match="no mask_token_id"):
        ArchSpec.from_hf_config({"model_type": "Dream", "eos_token_id": 0})


@pytest.mark.parametrize("family,field,value", [
    ("llada", "scale_logits", True), ("llada", "input_emb_norm", True), ("llada", "alibi", True),
    ("llada", "rope", False), ("llada", "activation_type", "swiglu"), ("llada", "layer_norm_type", "default"),
    ("llada", "rope_full_precision", False), ("llada", "block_type", "sequential"),
    ("dream", "rope_scaling", {"rope_type": "linear", "factor": 2.0}), ("dream", "hidden_act", "gelu"),
    ("sdar", "rope_scaling", {"rope_type": "dynamic", "factor": 4.0}), ("sdar", "use_sliding_window", True),
])
def test_unimplemented_config_values_are_refused(tiny_checkpoints, tmp_path, family, field, value):
    """A field the model classes read only at its default is refused at another value, naming the field and the
    supported value, by the reference model and by the config vLLM reads; the default itself loads."""
    import shutil

    from transformers import AutoConfig

    src = tiny_checkpoints[family]
    cfg = json.loads((src / "config.json").read_text())
    dst = shutil.copytree(src, tmp_path / "ckpt")
    (dst / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"config.json: {field} .* is not implemented .*; supported: "):
        ReferenceDLLM.from_pretrained(dst)
    register_configs()
    with pytest.raises(ValueError, match=f"config.json: {field} "):
        ArchSpec.from_hf_config(AutoConfig.from_pretrained(str(dst)))
    default = {"rope_scaling": None, "scale_logits": False, "input_emb_norm": False, "alibi": False, "rope": True,
               "activation_type": "silu", "layer_norm_type": "rms", "rope_full_precision": True,
               "block_type": "llama", "hidden_act": "silu", "use_sliding_window": False}[field]
    (dst / "config.json").write_text(json.dumps({**cfg, field: default}))
    ReferenceDLLM.from_pretrained(dst)


def test_llada_mlp_width_from_mlp_ratio(tiny_checkpoints, tmp_path):
    """``mlp_hidden_size: null`` means ``mlp_ratio * d_model``, as in LLaDA's own code."""
    import shutil

    from transformers import AutoConfig

    src = tiny_checkpoints["llada"]
    cfg = json.loads((src / "config.json").read_text())
    ratio = cfg["mlp_hidden_size"] // cfg["d_model"]
    assert ratio * cfg["d_model"] == cfg["mlp_hidden_size"]
    dst = shutil.copytree(src, tmp_path / "ckpt")
    (dst / "config.json").write_text(json.dumps({**cfg, "mlp_hidden_size": None, "mlp_ratio": ratio}))
    ids = _ids(9)
    assert torch.equal(ReferenceDLLM.from_pretrained(dst)(ids), ReferenceDLLM.from_pretrained(src)(ids))
    register_configs()
    assert AutoConfig.from_pretrained(str(dst)).intermediate_size == cfg["mlp_hidden_size"]  # what vLLM reads


def test_read_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_config(tmp_path)


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (1, n), generator=g)


def test_attention_patterns(tiny_checkpoints):
    """LLaDA/Dream are bidirectional; SDAR is block-causal (a change in a later block never reaches earlier ones)."""
    x = _ids(12)
    y = x.clone()
    y[0, 10] = 7  # a token in SDAR's third block (block size 4)
    for family in ("llada", "dream", "sdar"):
        m = ReferenceDLLM.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
        with torch.no_grad():
            a, b = m(x), m(y)
        early = (a[0, :8] - b[0, :8]).abs().max().item()
        if family == "sdar":
            assert early == 0.0
            assert (a[0, 8:] - b[0, 8:]).abs().max().item() > 1e-6
        else:
            assert early > 1e-6


def test_dream_logits_are_shifted(tiny_checkpoints):
    m = ReferenceDLLM.from_pretrained(tiny_checkpoints["dream"])
    x = _ids(9)
    with torch.no_grad():
        raw, tok = m(x), m.token_logits(x)
    assert torch.equal(tok[0, 1:], raw[0, :-1])
    llada = ReferenceDLLM.from_pretrained(tiny_checkpoints["llada"])
    with torch.no_grad():
        assert torch.equal(llada.token_logits(x), llada(x))


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_paged_forward_matches_full_forward(tiny_checkpoints, family):
    """Forwarding a suffix against paged cached K/V equals the full forward where the pattern makes it exact,
    and two canvases of the suffix in one call (segments sharing the prefix) do not see each other."""
    from attention_backends.prefix_attention import AttentionPlan, make_backend
    from attention_backends.paged_kv_cache import PagedKVCache

    m = ReferenceDLLM.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
    s = m.spec
    x = _ids(12, seed=1)[0]
    other = x.clone()
    other[8:] = x[8:].flip(0)
    attn = make_backend("torch")
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, [12], page_size=3, dtype=torch.float64)

    def paged(ids, pos, prefix, segs, write=None):
        plan = AttentionPlan(torch.tensor([0, ids.numel()]), torch.tensor([prefix]), cache.block_table[:1], 3,
                             kind=s.attention, seg_indptr=torch.tensor(segs), positions=pos, block_size=s.block_size)
        return m.forward_paged(ids, pos, plan, cache, attn, write=write)

    with torch.no_grad():
        full = m(x[None])[0]
        # exact K/V of the first 8 positions: SDAR's earlier blocks never see later ones; a bidirectional
        # model's cached prefix must come from a forward that saw the whole sequence
        ctx = x[:8] if family == "sdar" else x
        first = paged(ctx, torch.arange(ctx.numel()), 0, [0, ctx.numel()],
                      write=(cache.slots(torch.zeros(8, dtype=torch.long), torch.arange(8)), torch.arange(8)))
        assert torch.allclose(first, full[: ctx.numel()], atol=1e-10)
        two = paged(torch.cat([x[8:], other[8:]]), torch.arange(8, 12).repeat(2), 8, [0, 4, 8])
        alone = paged(other[8:], torch.arange(8, 12), 8, [0, 4])
    assert torch.allclose(two[:4], full[8:], atol=1e-10)
    assert torch.allclose(two[4:], alone, atol=1e-10)


def _sdar_without(src, dst, fields, mask_name=None):
    """A copy of an SDAR checkpoint whose config.json lacks ``fields``; ``mask_name`` renames the tokenizer's
    mask token (SDAR's tokenizers call it ``<|MASK|>``)."""
    import shutil

    dst = shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in fields}))
    if mask_name:
        for f in dst.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                f.write_text(f.read_text().replace("<|mdm_mask|>", mask_name))
    return dst


def test_sdar_config_without_mask_and_block_reads_tokenizer_and_published_default(tiny_checkpoints, tmp_path,
                                                                                   caplog):
    """SDAR's published configs may lack mask_token_id and block_size: the mask id comes from the tokenizer's
    <|MASK|>, the block size is SDAR's published 4, each choice logged once; the logits are the same model's."""
    import logging

    from transformers import AutoConfig

    src = tiny_checkpoints["sdar"]
    want = ArchSpec.from_hf_config(read_config(src))
    assert want.block_size == 4
    dst = _sdar_without(src, tmp_path / "sdar", ("mask_token_id", "block_size"), mask_name="<|MASK|>")
    with caplog.at_level(logging.WARNING, logger="model_executor.models.configs"):
        got = ReferenceDLLM.from_pretrained(dst)
        ReferenceDLLM.from_pretrained(dst)
        register_configs()
        hf = AutoConfig.from_pretrained(str(dst))
        assert getattr(hf, "mask_token_id", None) is None and hf.block_size is None
        assert ArchSpec.from_hf_config(hf) == got.spec  # what vLLM's model class and runner read
    assert got.spec == want and got.spec.mask_token_id == 2
    logs = [r.getMessage() for r in caplog.records]
    assert sum("no mask_token_id; using the tokenizer's <|MASK|>, id 2" in m for m in logs) == 1, logs
    assert sum("no block_size; using SDAR's published block size 4" in m for m in logs) == 1, logs
    ids = _ids(11)
    with torch.no_grad():
        assert torch.equal(got(ids), ReferenceDLLM.from_pretrained(src)(ids))


def test_sdar_config_without_mask_and_no_mask_token_is_refused(tiny_checkpoints, tmp_path):
    dst = _sdar_without(tiny_checkpoints["sdar"], tmp_path / "sdar", ("mask_token_id",))
    with pytest.raises(ValueError, match=r"no mask_token_id and its tokenizer has no <\|MASK\|>.*--hf-overrides"):
        ReferenceDLLM.from_pretrained(dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "block_size": 0, "mask_token_id": 2}))
    with pytest.raises(ValueError, match="config.json: block_size 0; an SDAR block size is a positive integer"):
        ReferenceDLLM.from_pretrained(dst)


@pytest.mark.parametrize("family", ["dream", "sdar"])
def test_bf16_logits_equal_the_authors_architecture(tiny_checkpoints, family):
    """Dream is Qwen2's architecture and SDAR Qwen3's (q/k norm) under their own attention masks; their code,
    like transformers' Qwen2/Qwen3, casts RoPE's cos/sin to the activation dtype before rotating. In bfloat16
    the reference model gives the same logits bit for bit as transformers' classes on the same tensors (it
    differed by ~1e-2 while it rotated in float32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    path = tiny_checkpoints[family]
    cfg = json.loads((path / "config.json").read_text())
    C, M = {"dream": (Qwen2Config, Qwen2ForCausalLM), "sdar": (Qwen3Config, Qwen3ForCausalLM)}[family]
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rope_theta", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    config = C(**{k: cfg[k] for k in fields if k in cfg}, head_dim=cfg["hidden_size"] // cfg["num_attention_heads"])
    hf = M.from_pretrained(str(path), config=config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    assert set(hf.state_dict()) == set(load_file(str(path / "model.safetensors")))  # every tensor, by its name
    ref = ReferenceDLLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = _ids(23)
    pos = torch.arange(23)[None]
    from model_executor.models.reference import attention_mask

    mask = attention_mask(ref.spec, pos, pos)
    mask = torch.ones(1, 1, 23, 23, dtype=torch.bool) if mask is None else mask
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got = ref(ids)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
