"""The vLLM decoding path (``speculative_config={"method": "psd", ...}``) equals the reference engine.

For every decoding method and model family: a batch of mixed-length prompts through ``LLM.generate``
gives the reference engine's tokens (float32) and the same number of forwards per request. The embedded
llada-tiny decodes the held-out tasks (confident, so drafts get accepted and blocks end in EOS); the
random Dream, SDAR and LLaDA2 checkpoints exercise Dream's shifted logits, SDAR's block-causal attention with
its exact block cache, and LLaDA2's experts. Also: requests joining and leaving between steps, per-request ``max_tokens``,
sampling determinism, and the errors users get for bad configs and unsupported requests.
"""


import os
import re

import pytest
import torch

from model_executor.engine import ReferenceEngine
from psd_plugin import DEFAULT_DLLM, DEMO_DLLM

vllm = pytest.importorskip("vllm")
from vllm.exceptions import VLLMValidationError  # noqa: E402

METHODS = ("static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd", "joint_threshold")


pytestmark = pytest.mark.usefixtures("in_process_vllm")


def _dynamo_graphs() -> int:
    """Graphs Dynamo has captured in this process (the engine core runs in it: ``in_process_vllm``)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _llm(path, eager=True, llm_kw=None, **spec):
    from vllm import LLM

    return LLM(model=str(path), dtype="float32", enforce_eager=eager, seed=0, max_model_len=512,
               speculative_config={"method": "psd", **spec}, **(llm_kw or {}))


def _psd_stats(llm) -> dict:
    """The runner's figures (of the rank that decodes)."""
    from psd_plugin.vllm import compat

    return compat.psd_stats(llm)


def _request_stats(llm) -> dict:
    """The runner's figures per request, keyed by the request id."""
    from psd_plugin.vllm import compat

    return compat.request_stats(llm)


def _generate(llm, prompts, max_tokens=32, merged=True, **kw):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = _request_stats(llm)
    calls = [stats[o.request_id]["model_calls"] for o in outs]
    nfe = [stats[o.request_id]["nfe"] for o in outs]
    if merged and not kw.get("prompt_logprobs"):  # the first canvas rode with the prompt: only decoding forwards
        assert calls == nfe, f"model calls {calls} != decoding forwards {nfe}"
    return [list(o.outputs[0].token_ids) for o in outs], nfe


def _knobs(path, method):
    if method != "spiffy":
        return {}
    return {"policy": "static", "graph": str(_graph(path))}


_GRAPHS: dict = {}


def _graph(path):
    """A Spiffy graph for ``path``: the shipped one for the embedded model, else calibrated here."""
    from model_executor.decoding import save_graph
    from psd_plugin import default_graph
    from psd_plugin.calibrate import calibrate_graph, model_name

    shipped = default_graph(path, "static")
    if shipped.exists():
        return shipped
    if path not in _GRAPHS:
        g = torch.Generator().manual_seed(1)
        prompts = [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in range(4, 20)]
        spec = ReferenceEngine.from_pretrained(path).spec
        block = spec.attention_block or 8
        graph = calibrate_graph(ReferenceEngine.from_pretrained(path), prompts, model_name=model_name(path),
                                lookahead=3, budget=6, block_size=block, progress=False)
        out = path.parent / f"{path.name}.static.json"
        save_graph(graph, out)
        _GRAPHS[path] = out
    return _GRAPHS[path]


def _check_parity(path, prompts, method, max_tokens=32, cache=None, eager=True, merged=True, llm_kw=None, inspect=None,
                  spec=None, **more):
    """vLLM's tokens and decoding forwards equal the reference engine's; ``more``: knobs of both, ``spec``: of
    vLLM's speculative config alone (``async_scheduling``)."""
    knobs = {**_knobs(path, method), **more}
    if cache is not None:
        knobs["cache"] = cache
    ref_engine = ReferenceEngine.from_pretrained(path)
    block = ref_engine.spec.attention_block or 8
    ref_knobs = dict(knobs)
    if method == "spiffy":
        from model_executor.decoding import load_graph

        ref_knobs["graph"] = load_graph(knobs["graph"])
    ref = ref_engine.generate(prompts, max_tokens=max_tokens, block_size=block, method=method, **ref_knobs)
    llm = _llm(path, eager=eager, llm_kw=llm_kw, decoding=method, **knobs, **(spec or {}))
    try:
        tokens, nfe = _generate(llm, prompts, max_tokens, merged=merged)
        if inspect is not None:  # the caller's checks of the engine (its metrics...)
            inspect(llm)
    finally:
        del llm
    for i, (t, n, r) in enumerate(zip(tokens, nfe, ref)):
        assert t == r.token_ids, f"{method} prompt {i}: vLLM {t} != reference {r.token_ids}"
        assert n == r.nfe, f"{method} prompt {i}: vLLM took {n} forwards, the reference {r.nfe}"
    return tokens


@pytest.mark.engine
# CI: every method, the prefix and the dual cache alternately; PSD_FULL_MATRIX=1: every method with both
@pytest.mark.parametrize("method, cache", [(m, c) for m in METHODS for c in ("prefix", "dual")]
                         if os.environ.get("PSD_FULL_MATRIX") else
                         [(m, ("prefix", "dual")[i % 2]) for i, m in enumerate(METHODS)])
def test_embedded_llada_matches_reference(heldout_prompts, method, cache):
    _check_parity(DEFAULT_DLLM, heldout_prompts, method, cache=cache)


@pytest.mark.engine
def test_a_blocks_later_steps_run_on_its_attention_plan(heldout_prompts):
    """Under the dual cache every step of a block after its second forwards the same rows over the same pages as
    the one before: the attention builder reuses that plan (``plans_reused``) instead of planning again. One
    request, static decoding (one token a step: 8 steps per 8-token block), so exactly ``NFE - 2 * blocks``
    steps reuse a plan; the tokens and NFE are the reference engine's."""
    from vllm import SamplingParams

    prompt = heldout_prompts[0]
    llm = _llm(DEFAULT_DLLM, decoding="static", cache="dual", block_size=8)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=32, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)[0]
        nfe = _request_stats(llm)[out.request_id]["nfe"]
        reused = _psd_stats(llm)["step_time"]["plans_reused"]
    finally:
        del llm
    ref = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    req = ref.generate([prompt], max_tokens=32, method="static", cache="dual", block_size=8)[0]
    assert nfe == 32
    # per layer group one builder: every builder reuses the same steps
    assert reused % (nfe - 2 * 4) == 0 and reused > 0, f"{reused} reuses for NFE {nfe} over 4 blocks"
    assert list(out.outputs[0].token_ids)[: len(req.token_ids)] == req.token_ids


@pytest.mark.engine
@pytest.mark.parametrize("cache", ("prefix", "dual"))
@pytest.mark.parametrize("method", ("confidence", "lopa", "psd"))
def test_embedded_dream_matches_reference(heldout_prompts, method, cache):
    """dream-tiny, the demo's and the serving benchmark's dLLM (trained weights, shifted logits; the same
    tokenizer as llada-tiny): tokens and forwards equal the reference engine's."""
    _check_parity(DEMO_DLLM, heldout_prompts, method, cache=cache)


@pytest.mark.engine
@pytest.mark.parametrize("path, cache", [(DEFAULT_DLLM, "prefix"), (DEMO_DLLM, "dual")])
def test_psd_skip_dag_matches_reference(heldout_prompts, path, cache):
    """PSD with ``dag_shape: skip`` (multi-parent DAG, 6 drafts at depth 3) through vLLM."""
    _check_parity(path, heldout_prompts, "psd", cache=cache, depth=3, dag_shape="skip")


@pytest.mark.engine
@pytest.mark.parametrize("method, cache, narrow", [("lopa", "prefix", {"suffix": 4, "refresh": "last"}),
                                                   ("spiffy", "dual", {"suffix": 0, "refresh": "answer"}),
                                                   ("psd", "dual", {"suffix": 9})])
def test_narrow_steps_match_reference(heldout_prompts, method, cache, narrow):
    """The approximate schedules (``suffix``: masks forwarded after the block; ``refresh``: what a block's first
    step recomputes) through vLLM: its windows, rewinds and kept suffixes are the reference engine's."""
    _check_parity(DEMO_DLLM, heldout_prompts, method, cache=cache, **narrow)


@pytest.mark.engine
@pytest.mark.parametrize("model, method, cache, narrow", [
    ("dream-tiny-v2", "confidence", "prefix", {}), ("dream-tiny-v2", "psd", "dual", {}),
    ("dream-tiny-v2", "spiffy", "dual", {}), ("dream-tiny-v2", "confidence", "prefix", {"refresh": "last"}),
    # dream-tiny-v3 (trained on canvases that stop short): the served setting of docs/benchmarks.md, and Spiffy
    # with its shipped graph under the same narrow steps
    ("dream-tiny-v3", "confidence", "prefix", {"suffix": 32, "refresh": "last", "threshold": 0.98}),
    ("dream-tiny-v3", "spiffy", "dual", {"suffix": 32, "refresh": "last"})])
def test_long_answers_match_reference(model, method, cache, narrow):
    """Answers of several blocks from a model that writes them (``count_lines``, 2-5 labelled lines of ten
    numbers, 256-token budget): through vLLM, tokens and forwards equal the reference engine's, and the answers
    are the task's (so the blocks, the cache refreshes and the drafts after the first block ran)."""
    from psd_plugin import CHECKPOINTS
    from psd_plugin.evaluate import decode_answer, encode, load
    from psd_plugin.train.tasks import grade, load_heldout

    path = CHECKPOINTS / model
    _, tok = load(path)
    rows = load_heldout("count_lines")[:4]
    tokens = _check_parity(path, [encode(tok, r["prompt"]) for r in rows], method, max_tokens=256, cache=cache,
                           **narrow)
    assert min(len(t) for t in tokens) > 64
    assert sum(grade(r, decode_answer(tok, t)) for r, t in zip(rows, tokens)) >= 2


@pytest.mark.engine
@pytest.mark.parametrize("method, cache", [(m, c) for m in ("lopa", "freedave", "spiffy", "psd") for c in ("prefix", "dual")]
                         if os.environ.get("PSD_FULL_MATRIX") else
                         [("lopa", "dual"), ("freedave", "prefix"), ("spiffy", "dual"), ("psd", "prefix")])
def test_draft_canvases_through_vllms_cpu_kernel_match_reference(monkeypatch, heldout_prompts, method, cache):
    """Every draft canvas as its own call of vLLM's CPU kernel (a step this small would stay on PyTorch: the
    threshold is lowered to 0), the canvas's K/V at the scheduled rows' slots and theirs written last: tokens
    and forwards still the reference engine's."""
    from attention_backends import vllm_cpu_attention

    monkeypatch.setattr(vllm_cpu_attention, "PASSES_MIN_WORK", 0)
    calls = []
    run_passes = vllm_cpu_attention.CPUPagedKernel.run_passes
    monkeypatch.setattr(vllm_cpu_attention.CPUPagedKernel, "run_passes",
                        lambda self, *a: (calls.append(len(self.passes)), run_passes(self, *a)))
    _check_parity(DEFAULT_DLLM, heldout_prompts, method, cache=cache)
    assert calls and max(calls) >= 1  # draft steps went through the kernel


@pytest.mark.engine
def test_compiled_model_matches_reference(heldout_prompts):
    """vLLM's default on CPU compiles the model's decoder layers (one Dynamo trace, Inductor, guards dropped):
    PSD's extra draft rows and the dual cache's kept suffix go through that one traced graph, and the outputs
    are still the reference engine's, forward for forward."""
    from vllm.compilation.counter import compilation_counter

    before, graphs = compilation_counter.clone(), _dynamo_graphs()
    _check_parity(DEFAULT_DLLM, heldout_prompts, "psd", cache="dual", eager=False)
    assert compilation_counter.num_models_seen > before.num_models_seen  # the decoder was set up to compile
    # and ran compiled: an AOT compile or load, or (vLLM's other compile cache, the plugin's choice on the CPU:
    # compat.AOT_COMPILE_ENV) a graph Dynamo captured
    assert (compilation_counter.num_aot_compiles + compilation_counter.num_aot_artifacts_loaded
            > before.num_aot_compiles + before.num_aot_artifacts_loaded) or _dynamo_graphs() > graphs


@pytest.mark.engine
def test_model_inputs_are_vllms_persistent_buffers(monkeypatch, heldout_prompts):
    """Every row of a step, extra draft rows included, reaches the compiled module through vLLM's persistent
    ``input_ids`` / ``positions`` buffers (what a CUDA graph captures): the same addresses every step, with
    and without extra rows, the extra rows' ids and positions in them, and the outputs still the reference
    engine's."""
    from attention_backends.step_batch import current_step
    from model_executor.models.vllm_models import DLLMDecoder

    seen = []
    forward = DLLMDecoder.forward

    def spy(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        batch = current_step()
        if batch is not None:
            n, T = batch.num_rows, batch.num_scheduled
            assert input_ids.shape[0] >= n and torch.equal(positions[:n].cpu(), batch.positions)
            if batch.extra_ids is not None:
                assert torch.equal(input_ids[T:n].long().cpu(), batch.extra_ids)
            seen.append((input_ids.data_ptr(), positions.data_ptr(), batch.num_extra > 0))
        return forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)

    monkeypatch.setattr(DLLMDecoder, "forward", spy)
    _check_parity(DEFAULT_DLLM, heldout_prompts[:6], "psd", cache="prefix")
    assert {extra for *_, extra in seen} == {True, False}  # steps with and without extra rows
    assert len({ids for ids, _, _ in seen}) == 1 and len({pos for _, pos, _ in seen}) == 1


@pytest.mark.engine
@pytest.mark.parametrize("method", ("confidence", "psd", "lopa", "freedave", "spiffy"))
@pytest.mark.parametrize("family", ("dream", "sdar"))
def test_random_dream_and_sdar_match_reference(tiny_checkpoints, random_prompts, family, method):
    _check_parity(tiny_checkpoints[family], random_prompts, method, max_tokens=20)


@pytest.mark.engine
@pytest.mark.parametrize("method", METHODS)
def test_random_llada2_matches_reference(tiny_checkpoints, random_prompts, method):
    """LLaDA2 (mixture of experts through vLLM's fused MoE layer, block-causal blocks of 8 with the exact block
    cache, partial RoPE): every method, vLLM equal to the reference engine in tokens and forwards."""
    _check_parity(tiny_checkpoints["llada2"], random_prompts, method, max_tokens=20)


@pytest.mark.engine
@pytest.mark.parametrize("method", ("psd", "spiffy"))
def test_random_dream_with_the_dual_cache_matches_reference(tiny_checkpoints, random_prompts, method):
    """Dream's shifted logits: the block's later steps forward from b0 - 1 against the kept suffix."""
    _check_parity(tiny_checkpoints["dream"], random_prompts, method, max_tokens=20, cache="dual")


@pytest.mark.engine
@pytest.mark.parametrize("cache", ("prefix", "dual"))
def test_plain_prefill_where_the_first_canvas_cannot_ride_with_it(heldout_prompts, cache):
    """The scheduler keeps vLLM's prompt-only prefill for a request asking for prompt logprobs, and for one whose
    first canvas does not fit what the step's token budget has left; that canvas then follows in its own step.
    Tokens and NFE are the reference engine's either way."""
    from vllm import LLM, SamplingParams

    ref = ReferenceEngine.from_pretrained(DEFAULT_DLLM).generate(heldout_prompts, max_tokens=32,
                                                                 method="confidence", cache=cache)
    # two requests a step in a budget of 100 rows (102 less one per running request): two prompts of 18 and 20
    # tokens leave room for the first one's 32 masks only
    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_batched_tokens=102, max_num_seqs=2,
              speculative_config={"method": "psd", "decoding": "confidence", "cache": cache})
    try:
        params = [SamplingParams(max_tokens=32, temperature=0, prompt_logprobs=0 if i % 3 == 2 else None)
                  for i in range(len(heldout_prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts], params, use_tqdm=False)
        stats = _request_stats(llm)
    finally:
        del llm
    kinds = set()
    for i, (p, o, r) in enumerate(zip(heldout_prompts, outs, ref)):
        st = stats[o.request_id]
        assert list(o.outputs[0].token_ids) == r.token_ids and st["nfe"] == r.nfe, f"prompt {i}"
        if i % 3 == 2:
            assert st["model_calls"] == st["nfe"] + 1, f"prompt {i}: prompt logprobs need the plain prefill"
            assert len(o.prompt_logprobs) == len(p)
        else:
            assert st["model_calls"] - st["nfe"] in (0, 1)
            kinds.add(st["model_calls"] - st["nfe"])
    assert kinds == {0, 1}  # some first canvases rode with their prompt, some had no room


@pytest.mark.engine
@pytest.mark.parametrize("method", ("lopa", "freedave", "spiffy", "psd"))
def test_requests_waiting_for_room_keep_their_drafts(heldout_prompts, method):
    """Every request at once in a token budget that holds a few of their steps: requests proposed together
    step in different forwards (a request waits, whole, for room), so a drafting decoder proposed in a group
    is updated in a smaller one or alone; tokens and NFE stay the reference engine's."""
    _check_parity(DEFAULT_DLLM, heldout_prompts, method, cache="dual", merged=False,  # some prefills find no room
                  llm_kw=dict(max_num_batched_tokens=200, max_num_seqs=len(heldout_prompts)))


def _ignoring_eos(monkeypatch) -> None:
    """The reference engine's requests decode past EOS, as vLLM's do under ``ignore_eos`` (the runner's
    ``DLLMRequest(..., ignore_eos=True)``): the answer runs to ``max_tokens``, block after block."""
    import functools
    import sys

    from model_executor.dllm_request import DLLMRequest

    monkeypatch.setattr(sys.modules[ReferenceEngine.__module__], "DLLMRequest",
                        functools.partial(DLLMRequest, ignore_eos=True))


@pytest.mark.engine
@pytest.mark.parametrize("max_num_seqs, overlap", [(1, False), (3, False), (3, True)])
def test_continuous_batching_and_per_request_max_tokens(monkeypatch, heldout_prompts, max_num_seqs, overlap):
    """max_num_seqs 1 (batch size 1) and 3 (requests join and leave between steps); per-request max_tokens,
    across EOS (``ignore_eos``): the reference engine's tokens and forwards, decoding past EOS too; with async
    scheduling (``overlap``: requests join while a step is in flight) too."""
    from vllm import LLM, SamplingParams

    ref_engine = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    lengths = [8 + 5 * (i % 5) for i in range(len(heldout_prompts))]
    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_num_seqs=max_num_seqs,
              speculative_config={"method": "psd", "decoding": "psd", "depth": 3,
                                  **({"async_scheduling": True, "decide_ahead": "on"} if overlap else {})})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths],
                            use_tqdm=False)
        stats = _request_stats(llm)
    finally:
        del llm
    _ignoring_eos(monkeypatch)
    assert len(outs) == len(heldout_prompts)
    for i, (p, m, o) in enumerate(zip(heldout_prompts, lengths, outs)):
        ref = ref_engine.generate([p], max_tokens=m, method="psd", depth=3)[0]
        got = list(o.outputs[0].token_ids)
        assert len(got) == m  # ignore_eos: the full length, across EOS
        assert got == ref.token_ids, f"prompt {i}: vLLM {got} != reference {ref.token_ids}"
        assert stats[o.request_id]["nfe"] == ref.nfe, f"prompt {i}: vLLM took {stats[o.request_id]['nfe']} " \
                                                      f"forwards, the reference {ref.nfe}"
    eos = ref_engine.spec.eos_token_id
    assert any(eos in list(o.outputs[0].token_ids)[:-1] for o in outs)  # some decoded across an EOS


@pytest.mark.engine
@pytest.mark.parametrize("overlap", (False, True))
def test_sampling_options(heldout_prompts, overlap):
    """seeded sampling, n, stop strings; unsupported options rejected; the engine keeps serving (with async
    scheduling too: a stop string ends a request whose next step is in flight)."""
    from vllm import SamplingParams

    llm = _llm(DEFAULT_DLLM, decoding="confidence", **({"async_scheduling": True, "decide_ahead": "on"} if overlap else {}))
    try:
        prompts = [{"prompt_token_ids": p} for p in heldout_prompts[:4]]
        a = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=7), use_tqdm=False)
        b = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=7), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        other = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in other]
        greedy = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in greedy]
        eight = llm.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=1.0, n=8), use_tqdm=False)
        assert len(eight[0].outputs) == 8 and len({tuple(c.token_ids) for c in eight[0].outputs}) > 1
        two = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=3), use_tqdm=False)
        # vLLM gives sample j of a seeded request the seed + j: each is that seed's single sample
        singles = [llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=3 + j), use_tqdm=False)
                   for j in range(2)]
        for i, t in enumerate(two):
            got = sorted((c.index, list(c.token_ids)) for c in t.outputs)
            assert got == [(j, list(singles[j][i].outputs[0].token_ids)) for j in range(2)]
        assert any(t.outputs[0].token_ids != t.outputs[1].token_ids for t in two)
        text = greedy[1].outputs[0].text
        cut = text[len(text) // 2:][:2]
        stopped = llm.generate(prompts[1:2], SamplingParams(max_tokens=16, temperature=0, stop=[cut]), use_tqdm=False)
        assert stopped[0].outputs[0].text == text[: text.index(cut)]
        assert stopped[0].outputs[0].finish_reason == "stop"
        with pytest.raises(VLLMValidationError, match="maximum context length is 512"):  # vLLM's own check
            llm.generate([{"prompt_token_ids": heldout_prompts[0] * 30}], SamplingParams(max_tokens=8),
                         use_tqdm=False)
        # the engine still serves after rejected requests
        ok = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert ok[0].outputs[0].token_ids
    finally:
        del llm


@pytest.mark.engine
def test_psd_samples_as_the_reference_engine(heldout_prompts):
    """The default method under sampling: seeded requests (temperature, top_p) give the reference engine's tokens
    and forwards (the draws are a function of the seed, position and step, the same in both engines), a request
    that leaves ``temperature`` at its default (1.0) is answered, and an answer region past the context is
    refused."""
    from vllm import SamplingParams

    n = len(heldout_prompts)
    want = ReferenceEngine.from_pretrained(DEFAULT_DLLM).generate(heldout_prompts, max_tokens=24, method="psd",
                                                                    temperature=0.8, top_p=0.9, seed=0)
    llm = _llm(DEFAULT_DLLM, decoding="psd")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                            [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i) for i in range(n)],
                            use_tqdm=False)
        stats = _request_stats(llm)
        assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in want]
        assert [stats[o.request_id]["nfe"] for o in outs] == [r.nfe for r in want]
        greedy = ReferenceEngine.from_pretrained(DEFAULT_DLLM).generate(heldout_prompts, max_tokens=24, method="psd")
        assert [r.token_ids for r in want] != [r.token_ids for r in greedy]  # it sampled
        plain = llm.generate([{"prompt_token_ids": heldout_prompts[0]}], SamplingParams(max_tokens=8), use_tqdm=False)
        assert plain[0].outputs[0].token_ids
        # the answer region must fit the context (draft canvases need none of it: the same prompt with
        # max_tokens 100 was refused before canvases became extra rows)
        long = (heldout_prompts[0] * 20)[:300]
        with pytest.raises(VLLMValidationError, match=r"\+ max_tokens \(300\) is 600; max_model_len is 512"):
            llm.generate([{"prompt_token_ids": long}], SamplingParams(max_tokens=300, temperature=0), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": long}], SamplingParams(max_tokens=100, temperature=0),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids
    finally:
        del llm


@pytest.mark.parametrize("spec, match", [
    ({"decoding": "beam"}, "decoding.*allowed: static, confidence, localleap, lopa, freedave, spiffy, psd, "
                           "joint_threshold"),
    ({"decoding": "joint_threshold", "edit_threshold": 1.5}, r"<= 1.*edit_threshold"),
    ({"decoding": "joint_threshold", "max_post_edit_steps": -1}, r">= 0.*max_post_edit_steps"),
    ({"policy": "greedy"}, "policy.*allowed: static, confidence, localleap"),
    ({"threshold": 1.5}, r"<= 1.*threshold"),
    ({"blocksize": 8}, "unknown field.*allowed fields"),
    ({"cache": "block"}, "cache 'block'.*allows: none, prefix, dual"),
    ({"cache": "suffix"}, "cache.*allowed: none, prefix, dual, block"),
    ({"decoding": "spiffy", "graph": "/nonexistent/graph.json"}, "no such file"),
])
def test_bad_speculative_config_fails_before_engine_start(spec, match):
    with pytest.raises(ValueError, match=match):
        _llm(DEFAULT_DLLM, **spec)


def test_a_logprobs_mode_other_than_raw_fails_before_engine_start():
    """The dLLM path reports ``raw_logprobs`` (vLLM's default); another ``logprobs_mode`` is refused, named."""
    with pytest.raises(ValueError, match="logprobs_mode 'processed_logprobs': .*allowed: raw_logprobs"):
        _llm(DEFAULT_DLLM, llm_kw={"logprobs_mode": "processed_logprobs"})


def test_corrupt_graph_file(tmp_path):
    bad = tmp_path / "g.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a valid draft graph file"):
        _llm(DEFAULT_DLLM, decoding="spiffy", graph=str(bad))


def test_ar_model_with_psd_and_dllm_with_other_method():
    from vllm import LLM

    from psd_plugin import DEFAULT_AR

    with pytest.raises(ValueError, match="decodes diffusion LLMs"):
        LLM(model=str(DEFAULT_AR), dtype="float32", speculative_config={"method": "psd"})
    with pytest.raises(ValueError, match="is a diffusion LLM"):
        LLM(model=str(DEFAULT_DLLM), dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


def test_sdar_block_size_must_be_the_models(tiny_checkpoints):
    with pytest.raises(ValueError, match="block_size 8.*allowed: 4"):
        _llm(tiny_checkpoints["sdar"], block_size=8)
    with pytest.raises(ValueError, match="cache 'dual' is for bidirectional models; a block-causal sdar model allows: none, block"):
        _llm(tiny_checkpoints["sdar"], cache="dual")


@pytest.mark.engine
@pytest.mark.parametrize("family,cache", [("llada", "prefix"), ("llada", "dual"), ("sdar", "block")])
def test_preemption_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts, random_prompts, family, cache):
    """A KV cache of 8 usable pages of 16 tokens forces vLLM to preempt and resume requests; outputs stay the
    reference's, greedy and seeded sampled requests alike (under the dual cache the resumed block's first step
    restores the kept suffix too; a draw is a function of seed, position and step, so a resumed request draws
    what it would have)."""
    preemption_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts, random_prompts, family, cache)


def preemption_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts, random_prompts, family, cache,
                             llm_kw=None, spec=None):
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm.scheduler import DLLMScheduler

    preempted = []
    original = DLLMScheduler._preempt_request
    monkeypatch.setattr(DLLMScheduler, "_preempt_request",
                        lambda self, *a, **k: (preempted.append(1), original(self, *a, **k))[1])
    path, prompts = (DEFAULT_DLLM, heldout_prompts) if family == "llada" else (tiny_checkpoints["sdar"],
                                                                                random_prompts * 3)
    engine = ReferenceEngine.from_pretrained(path)
    kw = dict(max_tokens=32, method="psd", block_size=engine.spec.attention_block or 8, cache=cache)
    greedy, sampled = engine.generate(prompts[::2], **kw), engine.generate(prompts[1::2], **kw, temperature=0.8, seed=0)
    ref = [r for pair in zip(greedy, sampled) for r in pair] + greedy[len(sampled):]
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
              num_gpu_blocks_override=9, **(llm_kw or {}),
              speculative_config={"method": "psd", "decoding": "psd", "cache": cache, **(spec or {})})
    try:
        params = [SamplingParams(max_tokens=32, temperature=0) if i % 2 == 0 else
                  SamplingParams(max_tokens=32, temperature=0.8, seed=i // 2) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del llm
    assert preempted, "the test did not force a preemption"
    assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in ref]


@pytest.mark.engine
@pytest.mark.parametrize("family,cache,knobs,max_tokens,wait,budget", [
    ("llada", "prefix", {}, 32, 3, None), ("llada", "dual", {}, 32, 3, None),
    ("llada", "prefix", {"refresh": "last", "suffix": 8}, 64, 12, 128),
    ("llada", "dual", {"refresh": "answer", "suffix": 8}, 64, 12, None), ("llada", "dual", {"refresh": "last"}, 48, 8, None),
    ("dream", "prefix", {"refresh": "last", "suffix": 8}, 64, 12, None)])
def test_preemption_in_a_blocks_later_steps_keeps_outputs(monkeypatch, tiny_checkpoints, family, cache, knobs,
                                                          max_tokens, wait, budget):
    """Under the prefix and dual caches a request takes all its KV pages at its first block step, so FCFS
    preempts only requests at that step. With priority scheduling, requests that arrive later with a higher
    priority preempt running ones in the middle of a block: those resume after the first steps of blocks
    are replayed (``refresh: full``: the current block's; ``answer``: block 0's and the current block's;
    ``last``: every block's so far), each over the tokens of its time (masks where vLLM holds committed tokens,
    a tail segment where a ``suffix`` window ends before them), restoring the prefix K/V and the kept suffix:
    every output stays the reference's. No planned step is cut, a replay without drafts included, even with a
    token budget of one context (``budget``)."""
    from vllm import LLM, SamplingParams

    from model_executor.dllm_request import DLLMRequest

    replays = []  # (block replayed, current block, tail rows, rewritten rows) of every replay step
    plan = DLLMRequest.plan_rebuild

    def spy(self):
        st = plan(self)
        replays.append((self.blocks.index((st.b0, st.b1)), self.blk, st.tail_len, st.rewrites[1] - st.rewrites[0]))
        return st

    monkeypatch.setattr(DLLMRequest, "plan_rebuild", spy)
    path = tiny_checkpoints[family]  # a random model: its decisions follow small changes of the K/V it reads
    g = torch.Generator().manual_seed(2)
    prompts = [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in (20, 27, 9, 14, 31, 22, 17, 25)]
    low, high = prompts[:2], prompts[2:]
    ref = ReferenceEngine.from_pretrained(path).generate(low + high, max_tokens=max_tokens, method="psd", cache=cache,
                                                         **knobs)
    tight = {"max_num_batched_tokens": budget, "max_num_seqs": 8} if budget else {}
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
              num_gpu_blocks_override=11 if max_tokens == 32 else 14, scheduling_policy="priority", **tight,
              speculative_config={"method": "psd", "decoding": "psd", "cache": cache, **knobs})
    engine, params, outs = llm.llm_engine, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), {}

    def step():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)

    try:
        for i, p in enumerate(low):
            engine.add_request(f"low{i}", {"prompt_token_ids": p}, params, priority=1)
        for _ in range(wait):  # the prefill, then decoding steps: in the middle of a block
            step()
        for i, p in enumerate(high):
            engine.add_request(f"high{i}", {"prompt_token_ids": p}, params, priority=0)
        while engine.has_unfinished_requests():
            step()
        counts = _psd_stats(llm)["step_time"]
    finally:
        llm = engine = None  # a failed assertion keeps this frame: release the engine now
    assert replays, "no request was preempted in the middle of a block"
    assert counts["cut_steps"] == 0, f"{counts['cut_steps']} planned steps were cut"
    assert counts["resumed"] > 0 and 0 < counts["replays"] <= len(replays)  # psd_stats counts what ran
    refresh = knobs.get("refresh", "full")
    if refresh == "full":
        assert all(j == k for j, k, _, _ in replays)
    else:  # earlier blocks replayed over committed tokens; with a suffix window, some with a tail
        assert any(j < k and rw > 0 for j, k, _, rw in replays)
        assert ("suffix" in knobs) == any(tail > 0 for *_, tail, _ in replays)
    ids = [f"low{i}" for i in range(len(low))] + [f"high{i}" for i in range(len(high))]
    assert [outs[i] for i in ids] == [r.token_ids for r in ref]


@pytest.mark.engine
@pytest.mark.parametrize("method, cache", [(m, c) for m in METHODS for c in ("prefix", "dual")]
                         if os.environ.get("PSD_FULL_MATRIX") else
                         [("confidence", "prefix"), ("psd", "prefix"), ("psd", "dual"), ("lopa", "dual"),
                          ("freedave", "prefix"), ("spiffy", "dual")])
def test_every_method_serves_a_request_that_fills_the_context(tiny_checkpoints, method, cache):
    """prompt + max_tokens = max_model_len: draft canvases take no context (they are extra rows of a step, not
    sequence positions), so every method serves it, equal to the reference engine, and runs to the last
    position with ignore_eos. CI runs one single-canvas method and each drafting method on some cache (their
    canvases and windows are what could run past the context); ``PSD_FULL_MATRIX=1`` every method on both."""
    from vllm import LLM, SamplingParams

    path = tiny_checkpoints["llada"]
    g = torch.Generator().manual_seed(5)
    prompts = [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in (93, 61)]
    max_tokens = [128 - len(p) for p in prompts]
    knobs = {**_knobs(path, method), "cache": cache}
    ref_knobs = dict(knobs)
    if method == "spiffy":
        from model_executor.decoding import load_graph

        ref_knobs["graph"] = load_graph(knobs["graph"])
    engine = ReferenceEngine.from_pretrained(path)
    ref = [engine.generate([p], max_tokens=m, method=method, **ref_knobs)[0].token_ids for p, m in zip(prompts, max_tokens)]
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, seed=0, max_model_len=128,
              speculative_config={"method": "psd", "decoding": method, **knobs})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens], use_tqdm=False)
        full = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens],
                            use_tqdm=False)
    finally:
        del llm
    assert [list(o.outputs[0].token_ids) for o in outs] == ref
    assert [len(o.outputs[0].token_ids) for o in full] == max_tokens


@pytest.mark.engine
@pytest.mark.parametrize("method, overlap", (("confidence", False), ("psd", False), ("psd", True), ("confidence", True)))
def test_request_options_match_reference(heldout_prompts, method, overlap):
    """logit_bias, allowed_token_ids, bad_words (one token), min_tokens and (confidence) the penalties in vLLM
    give the reference engine's tokens under the same rules, and do what they say; top_k 1 with temperature is
    greedy. Multi-token bad_words, an allowed set of only the mask token and penalties with a drafting method are
    400s naming the field."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from model_executor.decoding import LogitsRules

    prompts = heldout_prompts[:8]
    ref = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    eos, mask = ref.spec.eos_token_id, ref.spec.mask_token_id
    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    plain = ref.generate(prompts, max_tokens=24, block_size=8, method=method)
    words = {t: tok.decode([t]) for r in plain for t in r.token_ids if t != eos}
    words = {t: w for t, w in words.items() if w.strip() == w and w and tok.encode(w, add_special_tokens=False) == [t]}
    common = max(words, key=lambda t: sum(r.token_ids.count(t) for r in plain))  # a one-token word it writes
    word = words[common]
    cases = [(dict(logit_bias={77: 100.0}), LogitsRules(logit_bias={77: 100.0})),
             (dict(allowed_token_ids=[eos, 70, 71, 72]), LogitsRules(allowed_token_ids=(eos, 70, 71, 72))),
             (dict(bad_words=[word]), LogitsRules(banned_token_ids=(common,))),
             (dict(min_tokens=20), LogitsRules(min_tokens=20, stop_token_ids=(eos,)))]
    if method == "confidence":  # penalties: the spatial policies only (they count the tokens committed so far)
        cases += [(dict(repetition_penalty=2.5), LogitsRules(repetition_penalty=2.5)),
                  (dict(presence_penalty=1.5, frequency_penalty=0.5),
                   LogitsRules(presence_penalty=1.5, frequency_penalty=0.5))]
    llm = _llm(DEFAULT_DLLM, decoding=method,
               **({"async_scheduling": True, "decide_ahead": "on"} if overlap else {}))
    try:
        for options, rules in cases:
            want = ref.generate(prompts, max_tokens=24, block_size=8, method=method, rules=rules)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=24, temperature=0, **options), use_tqdm=False)
            got = [list(o.outputs[0].token_ids) for o in outs]
            assert got == [r.token_ids for r in want], options
            assert got != [r.token_ids for r in plain], options
        assert all(common not in r.token_ids for r in ref.generate(prompts, max_tokens=24, block_size=8,
                                                                   method=method, rules=cases[2][1]))
        with pytest.raises(VLLMValidationError, match="bad_words .*several tokens"):
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0,
                                                         bad_words=["hello world answer"]), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="allowed_token_ids .*mask token"):
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0,
                                                         allowed_token_ids=[mask]), use_tqdm=False)
        if method == "psd":
            with pytest.raises(VLLMValidationError, match="presence_penalty=1.0: .*decoding 'psd'.*out of date"):
                llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.0),
                             use_tqdm=False)
        if method == "confidence":  # a sampling policy: top_k 1 samples the argmax
            k1 = llm.generate([{"prompt_token_ids": p} for p in prompts],
                              SamplingParams(max_tokens=24, temperature=2.0, top_k=1, seed=5), use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in k1] == [r.token_ids for r in plain]
        ok = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert ok[0].outputs[0].token_ids
    finally:
        del llm


@pytest.mark.engine
@pytest.mark.parametrize("method, overlap", (("confidence", False), ("psd", False), ("confidence", True)))
def test_logprobs_equal_the_reference_engine(heldout_prompts, method, overlap):
    """logprobs=k: each returned token's log-probability under the state canvas's distribution of the forward
    that committed it, and the k most likely tokens', as the reference engine gives them; all <= 0, the
    token's own entry always there, ranks consistent; greedy tokens are their forward's most likely (rank 1)
    for the spatial policy."""
    from vllm import SamplingParams

    prompts = heldout_prompts[:8]
    want = ReferenceEngine.from_pretrained(DEFAULT_DLLM).generate(prompts, max_tokens=24, block_size=8,
                                                                  method=method, logprobs=2)
    llm = _llm(DEFAULT_DLLM, decoding=method,
               **({"async_scheduling": True, "decide_ahead": "on"} if overlap else {}))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=24, temperature=0, logprobs=2), use_tqdm=False)
    finally:
        del llm
    assert len(outs) == len(want) == len(prompts)
    for o, r in zip(outs, want):
        c = o.outputs[0]
        # the reference's logprobs are there, one per token: a zip over an empty list would compare nothing
        assert r.token_ids and r.logprobs and len(r.logprobs) == len(r.token_ids), r.logprobs
        assert list(c.token_ids) == r.token_ids and len(c.logprobs) == len(r.token_ids)
        for tok, got, ref in zip(c.token_ids, c.logprobs, r.logprobs):
            assert tok in got and set(got) == set(ref)
            assert all(lp.logprob <= 0 for lp in got.values())
            assert all(abs(got[t].logprob - ref[t]) < 1e-4 for t in ref)
            if method == "confidence":
                assert got[tok].rank == 1


@pytest.mark.engine
def test_lossless_methods_sample_their_base_policys_tokens_in_vllm(heldout_prompts):
    """FreeDave and Spiffy under sampling in vLLM, on a batch mixing seeded sampled requests (with filters) and
    greedy ones: every request's tokens are the static policy's for the same options, token for token, in fewer
    forwards."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in heldout_prompts]
    params = [SamplingParams(max_tokens=24, temperature=0) if i % 3 == 2 else
              SamplingParams(max_tokens=24, temperature=0.9, top_k=20 if i % 2 else 0, top_p=1.0 if i % 2 else 0.9,
                             seed=100 + i) for i in range(len(prompts))]
    runs = {}
    for method, knobs in (("static", {}), ("freedave", {"steps": 4}), ("spiffy", _knobs(DEFAULT_DLLM, "spiffy"))):
        llm = _llm(DEFAULT_DLLM, decoding=method, **knobs)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = _request_stats(llm)
            runs[method] = ([list(o.outputs[0].token_ids) for o in outs], sum(stats[o.request_id]["nfe"] for o in outs))
        finally:
            del llm
    for method in ("freedave", "spiffy"):
        assert runs[method][0] == runs["static"][0], method
        assert runs[method][1] < runs["static"][1], method


@pytest.mark.engine
def test_max_logits_rows_bounds_every_step(monkeypatch, heldout_prompts):
    """``max_logits_rows``: no step computes more logits rows than the budget (requests whose canvases do not
    fit wait, whole), outputs and forwards stay the reference engine's; a budget below one request's step is
    refused, naming the field and the least allowed; vLLM's memory profile computes the budget's rows."""
    from psd_plugin.vllm import dllm_runner

    with pytest.raises(ValueError, match=r"max_logits_rows 1: one step of a request computes up to (\d+) logits rows"
                                         r".*allowed: \1 or more") as err:
        _llm(DEFAULT_DLLM, decoding="psd", max_logits_rows=1)
    one_step = int(re.search(r"computes up to (\d+)", str(err.value)).group(1))
    rows, sample = [], dllm_runner.DLLMRunnerMixin._sample

    def spy(self, logits, meta):
        rows.append(logits.shape[0])
        return sample(self, logits, meta)

    monkeypatch.setattr(dllm_runner.DLLMRunnerMixin, "_sample", spy)
    ref = ReferenceEngine.from_pretrained(DEFAULT_DLLM).generate(heldout_prompts, max_tokens=32, method="psd")
    llm = _llm(DEFAULT_DLLM, decoding="psd", max_logits_rows=one_step, llm_kw={"max_num_seqs": 4})
    try:
        tokens, nfe = _generate(llm, heldout_prompts, merged=False)  # a first canvas may wait for its own step
        profiled = []

        def profile(worker):
            model = worker.model_runner.model
            logits = model.compute_logits
            model.compute_logits = lambda h: profiled.append(h.shape[0]) or logits(h)
            try:
                worker.model_runner._dummy_sampler_run(torch.zeros(3, model.config.hidden_size))
            finally:
                del model.compute_logits
        llm.collective_rpc(profile)
    finally:
        del llm
    assert tokens == [r.token_ids for r in ref] and nfe == [r.nfe for r in ref]
    assert max(rows) <= one_step < 4 * one_step  # four requests running, one decoding step's rows at a time
    assert profiled[0] == one_step  # the profile's logits: the budget's rows (then vLLM's own, a row a request)


@pytest.mark.engine
def test_vllm_computes_logits_only_for_the_rows_a_decoder_reads(monkeypatch, heldout_prompts):
    """vLLM's logits indices are the canvas rows the decoders read: the positions each canvas leaves masked (PSD's
    drafts, sampled: a draw is keyed by its position, so the masked rows' draws are the block's); a step whose
    rows decode nothing computes vLLM's one row."""
    method, temperature = "psd", 0.9
    from vllm import SamplingParams

    from psd_plugin.vllm import dllm_runner

    seen, sample = [], dllm_runner.DLLMRunnerMixin._sample

    def spy(self, logits, meta):
        mask = self.spec.mask_token_id
        steps = [s.req.step for s in self.inflight.stepping.values() if not s.req.step.rebuild]
        blocks = [st.tokens[:, st.b0 - st.w0: st.b1 - st.w0] for st in steps]
        seen.append((logits.shape[0], sum(int((b == mask).sum()) for b in blocks), sum(b.numel() for b in blocks)))
        return sample(self, logits, meta)

    monkeypatch.setattr(dllm_runner.DLLMRunnerMixin, "_sample", spy)
    llm = _llm(DEFAULT_DLLM, decoding=method)
    try:
        llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                     SamplingParams(max_tokens=32, temperature=temperature, seed=3), use_tqdm=False)
    finally:
        del llm
    assert seen
    for computed, masked, rows in seen:
        assert computed == max(1, masked), seen
    assert sum(m for _, m, _ in seen) < sum(r for _, _, r in seen)


def test_room_checks_name_the_limit_they_hit():
    """The front end's room checks, without an engine: the answer region must fit ``max_model_len``, and a step's
    canvases the step's token budget, which is ``max_num_batched_tokens`` less the row the scheduler keeps free
    per request (the message gives both numbers)."""
    from types import SimpleNamespace

    from transformers import AutoConfig
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from model_executor.decode_config import DecodeKnobs, resolve
    from model_executor.models.configs import ArchSpec, register_configs
    from psd_plugin.vllm.validation import check

    register_configs()
    hf = AutoConfig.from_pretrained(str(DEFAULT_DLLM))
    cfg = resolve("psd", DecodeKnobs(), ArchSpec.from_hf_config(hf))
    vc = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512, get_vocab_size=lambda: 512, hf_config=hf),
                         scheduler_config=SimpleNamespace(max_num_batched_tokens=300, max_num_seqs=16))
    check(vc, cfg, SamplingParams(max_tokens=32, temperature=0), prompt_len=10)
    rows = cfg.step_rows(10, 200)
    assert 284 < rows, "the case below must not fit 300 - 16 rows"
    with pytest.raises(VLLMValidationError, match=rf"forwards up to {rows} tokens in one step with decoding 'psd'; "
                       r"a step holds 284 \(max_num_batched_tokens 300 less a row per request, max_num_seqs 16\)"):
        check(vc, cfg, SamplingParams(max_tokens=200, temperature=0), prompt_len=10)
    with pytest.raises(VLLMValidationError, match=r"\+ max_tokens \(200\) is 600; max_model_len is 512"):
        check(vc, cfg, SamplingParams(max_tokens=200, temperature=0), prompt_len=400)


def test_logprobs_are_refused_where_the_method_has_no_distribution_for_its_commits():
    """``logprobs`` with LoPA or FreeDave is a 400 naming the field and the methods that give them (their step's
    canvases all hold tokens committed from the last forward, which the step has no logits for: such a request
    used to fail in its first verifying step, failing every request of the step that asked for logprobs); the
    other methods take it, but not ``logprobs=-1`` (every token: it came back as the emitted token's alone), and
    penalties are still named as before. ``thinking_token_budget`` is refused (nothing would keep it)."""
    from types import SimpleNamespace

    from transformers import AutoConfig
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from model_executor.decode_config import DecodeKnobs, resolve
    from model_executor.decoding import METHODS, load_graph
    from model_executor.models.configs import ArchSpec, register_configs
    from psd_plugin import default_graph
    from psd_plugin.vllm.validation import check, refuse_thinking_budget

    register_configs()
    hf = AutoConfig.from_pretrained(str(DEFAULT_DLLM))
    vc = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512, get_vocab_size=lambda: 512, hf_config=hf),
                         scheduler_config=SimpleNamespace(max_num_batched_tokens=300, max_num_seqs=16))
    graph = load_graph(default_graph(DEFAULT_DLLM, "static"))
    for method in METHODS:
        cfg = resolve(method, DecodeKnobs(), ArchSpec.from_hf_config(hf), graph=graph if method == "spiffy" else None)
        params = SamplingParams(max_tokens=32, temperature=0, logprobs=2)
        if method in ("lopa", "freedave"):
            with pytest.raises(VLLMValidationError, match=rf"logprobs=2: logprobs with decoding '{method}': .*use "
                               r"decoding static \| confidence \| localleap \| spiffy \| psd \| joint_threshold"):
                check(vc, cfg, params, prompt_len=10)
            with pytest.raises(VLLMValidationError, match=r"presence_penalty=0.5: penalties"):
                check(vc, cfg, SamplingParams(max_tokens=32, temperature=0, presence_penalty=0.5), prompt_len=10)
        else:
            check(vc, cfg, params, prompt_len=10)
            with pytest.raises(VLLMValidationError, match=r"logprobs=-1 \(every token of the vocabulary\)"):
                check(vc, cfg, SamplingParams(max_tokens=32, temperature=0, logprobs=-1), prompt_len=10)
    # both modes: a reasoning budget no step keeps (vLLM's sampler keeps it)
    refuse_thinking_budget(SamplingParams(max_tokens=32))
    with pytest.raises(VLLMValidationError, match=r"thinking_token_budget=16: psd-plugin does not bound"):
        refuse_thinking_budget(SamplingParams(max_tokens=32, thinking_token_budget=16))
