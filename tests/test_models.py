"""Reference models in the three real formats: loading, strict checks, attention patterns, shifts."""

import json
import re

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
    "llada2": ["model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight",
               "model.layers.0.attention.dense.weight", "model.layers.0.attention.query_layernorm.weight",
               "model.layers.1.attention.key_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
               "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
               "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight",
               "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.norm.weight", "lm_head.weight"],
}
ARCH = {"llada": "LLaDAModelLM", "dream": "DreamModel", "sdar": "SDARForCausalLM", "llada2": "LLaDA2MoeModelLM"}


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2"])
def test_checkpoint_uses_real_names_and_reloads(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    stored = load_file(str(path / "model.safetensors"))
    for name in EXPECTED_NAMES[family]:
        assert name in stored
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [ARCH[family]]
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
                                         ("dream", "model.layers.0.self_attn.k_proj.bias"),
                                         ("llada2", "model.layers.1.mlp.experts.3.up_proj.weight"),
                                         ("llada2", "model.layers.1.mlp.gate.expert_bias")])
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
    """LLaDA/Dream are bidirectional; SDAR and LLaDA2 are block-causal (a change in a later block never reaches
    earlier ones)."""
    x = _ids(12)
    y = x.clone()
    y[0, 10] = 7  # a token in SDAR's third block (block size 4), LLaDA2's second (block size 8)
    for family in ("llada", "dream", "sdar", "llada2"):
        m = ReferenceDLLM.from_pretrained(tiny_checkpoints[family], dtype=torch.float64)
        with torch.no_grad():
            a, b = m(x), m(y)
        early = (a[0, :8] - b[0, :8]).abs().max().item()
        if m.spec.attention == "block_causal":
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


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2"])
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
                             kind=s.attention, seg_indptr=torch.tensor(segs), positions=pos, block_size=s.attention_block)
        return m.forward_paged(ids, pos, plan, cache, attn, write=write)

    with torch.no_grad():
        full = m(x[None])[0]
        # exact K/V of the first 8 positions: SDAR's earlier blocks never see later ones; a bidirectional
        # model's cached prefix must come from a forward that saw the whole sequence
        ctx = x[:8] if s.attention == "block_causal" else x
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
    assert want.attention_block == 4
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


# LLaDA2.0-mini's published config.json (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini): no mask, EOS, block size
# or use_qk_norm; partial RoPE; 256 experts in 8 groups.
LLADA2_MINI = {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "vocab_size": 157184,
               "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512, "num_hidden_layers": 20,
               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 256,
               "num_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 8,
               "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "score_function": "sigmoid",
               "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "norm_head": False,
               "partial_rotary_factor": 0.5, "rotary_dim": 64, "rope_theta": 600000, "rope_scaling": None,
               "rms_norm_eps": 1e-06, "max_position_embeddings": 32768, "tie_word_embeddings": False,
               "hidden_act": "silu", "pad_token_id": 156892, "use_bias": False, "use_qkv_bias": False,
               "use_cache": False, "output_router_logits": False, "embedding_dropout": 0.0}


def test_published_llada2_config_reads_as_its_code(caplog, tmp_path):
    """The published LLaDA2-mini config, as a dict and through AutoConfig (what vLLM reads): q/k norm on (its
    config class's default), RoPE on 64 of 128 dims, the expert layout, and the mask id, EOS and block size of
    its generate(), each logged once as a default; --hf-overrides-style fields win."""
    import logging

    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(LLADA2_MINI))
    register_configs()
    with caplog.at_level(logging.WARNING, logger="model_executor.models.configs"):
        spec = ArchSpec.from_hf_config(read_config(tmp_path))
        assert ArchSpec.from_hf_config(AutoConfig.from_pretrained(str(tmp_path))) == spec
    assert (spec.family, spec.mask_token_id, spec.eos_token_id, spec.attention_block) == ("llada2", 156895, 156892, 32)
    assert spec.qk_norm and spec.fused_qkv and not spec.qkv_bias and not spec.shift_logits
    assert (spec.head_dim, spec.rotary_dim, spec.num_kv_heads, spec.rope_theta) == (128, 64, 4, 600000.0)
    assert spec.attention == "block_causal" and not spec.rope_in_float32
    m = spec.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.num_shared, m.first_dense, m.n_group, m.topk_group,
            m.scale) == (256, 8, 512, 1, 1, 8, 4, 2.5)
    logs = [r.getMessage() for r in caplog.records]
    for field, value in (("mask_token_id", 156895), ("eos_token_id", 156892), ("block_size", 32)):
        assert sum(f"no {field}; using LLaDA2's published {value}" in x for x in logs) == 1, logs
    hf = AutoConfig.from_pretrained(str(tmp_path))
    hf.update({"block_size": 16, "mask_token_id": 156894})  # what vLLM does with --hf-overrides
    assert (ArchSpec.from_hf_config(hf).attention_block, ArchSpec.from_hf_config(hf).mask_token_id) == (16, 156894)


@pytest.mark.parametrize("edit,message", [
    ({"rotary_dim": 32}, "rotary_dim 32 disagrees with partial_rotary_factor 0.5 x head_dim 128 = 64"),
    ({"n_group": 7}, "n_group 7 / topk_group 4 for num_experts 256"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok 200; allowed: 1 to 128"),
    ({"use_bias": True}, "use_bias true is not implemented .*; supported: false"),
    ({"moe_router_enable_expert_bias": False}, "moe_router_enable_expert_bias false is not implemented"),
    ({"mask_token_id": 200000}, "mask_token_id 200000 is outside the vocabulary"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
])
def test_bad_llada2_configs_name_the_field(edit, message):
    with pytest.raises(ValueError, match=message):
        ArchSpec.from_hf_config({**LLADA2_MINI, **edit})
    ArchSpec.from_hf_config(LLADA2_MINI)


def test_llada2_routing_is_the_published_rule():
    """``route`` against the rule written out token by token: sigmoid scores; the bias for selection only; the
    best topk_group groups by the sum of their two best biased scores; top_k experts there; weights are the
    unbiased scores renormalised times the scale. Bias and groups both change the choice for some tokens."""
    from model_executor.models.configs import MoESpec
    from model_executor.models.reference import route

    moe = MoESpec(num_experts=16, top_k=3, intermediate_size=8, num_shared=1, first_dense=0, n_group=4,
                  topk_group=2, scale=2.5)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(16, generator=g, dtype=torch.float64) * 0.3
    experts, w = route(moe, logits, bias)
    by_bias = by_group = 0
    for t in range(200):
        s = logits[t].sigmoid()
        b = s + bias
        groups = sorted(range(4), key=lambda j: -sorted(b[4 * j: 4 * j + 4].tolist())[-2:][0] -
                        sorted(b[4 * j: 4 * j + 4].tolist())[-1])[:2]
        allowed = [e for e in range(16) if e // 4 in groups]
        want = sorted(allowed, key=lambda e: -b[e].item())[:3]
        assert sorted(experts[t].tolist()) == sorted(want)
        ws = s[want] / s[want].sum() * 2.5
        got = dict(zip(experts[t].tolist(), w[t].tolist()))
        assert all(abs(got[e] - ws[i].item()) < 1e-12 for i, e in enumerate(want))
        by_bias += set(want) != set(s.topk(3).indices.tolist())
        by_group += set(want) != set(b.topk(3).indices.tolist())
    assert by_bias > 0 and by_group > 0


def test_llada2_routing_edge_layouts():
    """One expert per token is weighted sigmoid x scale, not renormalised (LLaDA2's code renormalises only
    several); one group; groups of one expert are refused (a group scores by its two best)."""
    from model_executor.models.configs import MoESpec
    from model_executor.models.reference import route

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(50, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.3
    one = MoESpec(8, 1, 4, 0, 0, n_group=1, topk_group=1, scale=2.5)
    experts, w = route(one, logits, bias)
    assert torch.equal(experts[:, 0], (logits.sigmoid() + bias).argmax(-1))
    assert torch.allclose(w[:, 0], logits.sigmoid().gather(1, experts)[:, 0] * 2.5)
    with pytest.raises(ValueError, match="groups of at least 2"):
        ArchSpec.from_hf_config({**LLADA2_MINI, "n_group": 256, "topk_group": 4})


def test_read_config_ignores_a_stale_name_or_path(tiny_checkpoints, tmp_path):
    dst = _sdar_without(tiny_checkpoints["sdar"], tmp_path / "sdar", ("mask_token_id",), mask_name="<|MASK|>")
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "/mnt/train/run-7/checkpoint-900"}))
    assert read_config(dst)["_name_or_path"] == str(dst)
    assert ReferenceDLLM.from_pretrained(dst).spec.mask_token_id == 2


def _shard(src, dst, names):
    """``src``'s checkpoint split in two shards under ``dst``, with a ``model.safetensors.index.json`` naming the
    shards ``names`` (relative to ``dst``); the second shard is written where its name points."""
    import shutil

    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    keys = sorted(sd)
    halves = (keys[: len(keys) // 2], keys[len(keys) // 2:])
    for name, part in zip(names, halves):
        save_file({k: sd[k] for k in part}, str(dst / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in zip(names, halves) for k in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_a_sharded_index_loads_and_names_only_files_inside_its_directory(tiny_checkpoints, tmp_path):
    """A sharded checkpoint loads; an index naming a file outside its directory (``..``, an absolute path, a
    symlink out) is refused, naming the file and the index, though the file outside is a valid shard."""
    src = tiny_checkpoints["llada"]
    spec = ArchSpec.from_hf_config(read_config(src))
    want = load_checkpoint(spec, src)
    ok = _shard(src, tmp_path / "ok", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    got = load_checkpoint(spec, ok)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    (tmp_path / "up").mkdir()
    up = _shard(src, tmp_path / "up" / "ckpt", ["model-00001-of-00002.safetensors", "../x.safetensors"])
    index = up / "model.safetensors.index.json"
    with pytest.raises(ValueError, match=re.escape(f"{index}: weight file '../x.safetensors' is not a plain name")):
        load_checkpoint(spec, up)

    ckpt = _shard(src, tmp_path / "abs", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    index = ckpt / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    outside = tmp_path / "outside.safetensors"
    (ckpt / "model-00002-of-00002.safetensors").rename(outside)

    def second_shard(name):
        """The index with the second shard's tensors in ``name``."""
        index.write_text(json.dumps({"weight_map": {k: name if v.startswith("model-00002") else v
                                                    for k, v in weight_map.items()}}))

    for name in ("/etc/passwd", str(outside)):
        second_shard(name)
        with pytest.raises(ValueError, match=re.escape(f"{index}: weight file '{name}' is not a plain name")):
            load_checkpoint(spec, ckpt)
    (ckpt / "link.safetensors").symlink_to(outside)
    second_shard("link.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"{index}: weight file 'link.safetensors' resolves to {outside}")):
        load_checkpoint(spec, ckpt)

    # the Hugging Face cache: a snapshot's files link to the repository's blobs, outside the snapshot directory
    blobs, snapshot = tmp_path / "models--x" / "blobs", tmp_path / "models--x" / "snapshots" / "abc"
    blobs.mkdir(parents=True), snapshot.mkdir(parents=True)
    for f in ok.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(f"../../blobs/{f.name}")
    got = load_checkpoint(spec, snapshot)
    assert all(torch.equal(got[k], want[k]) for k in want)
