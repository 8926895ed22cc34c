"""The vLLM model classes, run through vLLM's engine, reproduce the reference model's logits.

vLLM reports, for every prompt position ``i >= 1``, the log-softmax of the row the model computed at
position ``i - 1`` (``prompt_logprobs``). With the full vocabulary requested that is every row of the
model's output but the last, computed by vLLM's own scheduler, paged KV cache and attention backend
(bidirectional for LLaDA and Dream, block-causal for SDAR over a prompt that spans several blocks), in
the prompt's prefill forward of the plugin's dLLM runner.
"""

import dataclasses
import os
import shutil

import pytest
import torch

from model_executor.models.reference import ReferenceDLLM

vllm = pytest.importorskip("vllm")

PROMPTS = [[1, 3, 17, 45, 99, 120, 7, 8, 9, 300, 301, 2, 2, 5, 60, 61, 62],  # spans 5 SDAR blocks
           [1, 3, 50, 60], [1, 4, 200, 201, 202, 203, 204, 205, 206, 207]]


pytestmark = pytest.mark.usefixtures("in_process_vllm")


def _engine_rows(path, prompts, dtype="float32", eager=True, **llm_kw):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(path), dtype=dtype, max_logprobs=-1, max_model_len=256, enforce_eager=eager,
              gpu_memory_utilization=0.5, seed=0, **llm_kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, prompt_logprobs=-1, temperature=0),
                            use_tqdm=False)
        V = llm.llm_engine.model_config.get_vocab_size()
        rows = []
        for p, o in zip(prompts, outs):
            got = torch.full((len(p) - 1, V), float("nan"))
            for i in range(1, len(p)):
                for t, lp in o.prompt_logprobs[i].items():
                    got[i - 1, t] = lp.logprob
            rows.append(got)
        return rows
    finally:
        del llm


@pytest.mark.engine
@pytest.mark.parametrize("family,dtype", [("llada", "float32"), ("dream", "float32"), ("sdar", "float32"),
                                          ("llada2", "float32"), ("llada", "bfloat16"), ("sdar", "bfloat16")])
def test_vllm_class_matches_reference(tiny_checkpoints, family, dtype):
    """float32: equal to 1e-4. bfloat16 (LLaDA rotating in float32, SDAR in bfloat16, as their code does):
    within bfloat16 rounding of the reference in bfloat16; vLLM's oneDNN linears accumulate differently."""
    path = tiny_checkpoints[family]
    ref = ReferenceDLLM.from_pretrained(path, dtype=getattr(torch, dtype))
    rows = _engine_rows(path, PROMPTS, dtype=dtype)
    for p, got in zip(PROMPTS, rows):
        assert not torch.isnan(got).any()
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([p])).float()[0, :-1], -1)
        err = (got - want).abs().max().item()
        assert err < (1e-4 if dtype == "float32" else 0.06), f"{family} {dtype}: max |logprob diff| {err}"


@pytest.mark.engine
# CI's time (about 35 s each when CI reached 45 minutes, 2026-12-06): opt-in with PSD_FULL_MATRIX=1; the compiled
# LLaDA class (test_vllm_decoding) and the compiled server (test_server) run in CI
@pytest.mark.skipif(not os.environ.get("PSD_FULL_MATRIX"), reason="opt-in: PSD_FULL_MATRIX=1")
@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_compiled_class_matches_reference(tiny_checkpoints, family):
    """Without ``enforce_eager`` vLLM compiles the decoder layers (its CPU default: one Dynamo trace, Inductor,
    the attention an opaque op): the same logits, for block-causal and expert layers (bidirectional LLaDA:
    ``test_compiled_model_matches_reference`` in the decoding tests)."""
    from test_vllm_decoding import _dynamo_graphs
    from vllm.compilation.counter import compilation_counter

    before, graphs = compilation_counter.clone(), _dynamo_graphs()
    path = tiny_checkpoints[family]
    ref = ReferenceDLLM.from_pretrained(path)
    rows = _engine_rows(path, PROMPTS, eager=False)
    assert compilation_counter.num_models_seen > before.num_models_seen
    # and ran compiled: an AOT compile or load, or (vLLM's other compile cache, the plugin's choice on the CPU:
    # compat.AOT_COMPILE_ENV) a graph Dynamo captured
    assert (compilation_counter.num_aot_compiles + compilation_counter.num_aot_artifacts_loaded
            > before.num_aot_compiles + before.num_aot_artifacts_loaded) or _dynamo_graphs() > graphs
    for p, got in zip(PROMPTS, rows):
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([p])).float()[0, :-1], -1)
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{family} compiled: max |logprob diff| {err}"


@pytest.mark.engine
def test_sdar_config_fields_from_hf_overrides(tiny_checkpoints, tmp_path):
    """An SDAR config without mask_token_id and block_size, and a tokenizer without <|MASK|>: vLLM refuses it
    naming the field; ``hf_overrides`` (``--hf-overrides``) supplies both, and the block size set there is the
    one the model attends with (block 2 gives block-2 logits, not the published 4's)."""
    import json

    src = tiny_checkpoints["sdar"]
    dst = shutil.copytree(src, tmp_path / "sdar")
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                 if k not in ("mask_token_id", "block_size")}))
    with pytest.raises(Exception, match="no mask_token_id and its tokenizer has no <\\|MASK\\|>"):
        _engine_rows(dst, PROMPTS[:1])
    rows = _engine_rows(dst, PROMPTS[:1], hf_overrides={"mask_token_id": cfg["mask_token_id"], "block_size": 2})
    ref = ReferenceDLLM.from_pretrained(src)
    p = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref.spec = dataclasses.replace(ref.spec, attention_block=2)
        want2 = torch.log_softmax(ref(p).float()[0, :-1], -1)
        ref.spec = dataclasses.replace(ref.spec, attention_block=4)
        want4 = torch.log_softmax(ref(p).float()[0, :-1], -1)
    assert (rows[0] - want2).abs().max().item() < 1e-4
    assert (rows[0] - want4).abs().max().item() > 1e-3


@pytest.mark.engine
@pytest.mark.parametrize("family,name", [("llada", "model.transformer.blocks.1.attn_out.weight"),
                                         ("llada2", "model.layers.1.mlp.experts.5.down_proj.weight")])
def test_vllm_names_a_missing_tensor(tiny_checkpoints, tmp_path, capfd, family, name):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoints[family], bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd.pop(name)
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(Exception) as e:
        _engine_rows(bad, PROMPTS[:1])
    out = str(e.value) + capfd.readouterr().err
    assert f"missing tensor '{name}'" in out


def test_plugin_entry_point_registers_models():
    from importlib.metadata import entry_points

    import psd_plugin

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "psd"]
    assert eps and eps[0].value == "psd_plugin:register"
    psd_plugin.register()
    psd_plugin.register()  # idempotent
    from vllm import ModelRegistry

    assert {"LLaDAModelLM", "DreamModel", "SDARForCausalLM", "LLaDA2MoeModelLM"} <= set(ModelRegistry.get_supported_archs())


@pytest.mark.engine
def test_embedded_ar_model_in_vllm_matches_transformers_greedy(tokenizer_dir):
    """The embedded AR baseline (Llama format) runs in vLLM as is, with the reference's greedy outputs."""
    from vllm import LLM, SamplingParams

    from model_executor.ar_engine import AREngine
    from psd_plugin import DEFAULT_AR
    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    prompts = [encode(tok, load_heldout(t)[0]["prompt"]) for t in TASKS]
    want = [r.token_ids for r in AREngine.from_pretrained(DEFAULT_AR).generate(prompts, max_tokens=32)]
    llm = LLM(model=str(DEFAULT_AR), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=32, temperature=0),
                        use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want
