"""One request never takes the engine down (issue 49).

- A client cannot reach the plugin's internals: ``extra_args`` keys the plugin reserves (a client's
  ``vllm_xargs``) are refused with a 400-class error naming them, in both modes; ``prompt_embeds`` too.
- A failure that belongs to one request (its decoder's update or proposal raises, its logits are not finite,
  its grammar or its bookkeeping raises, or its planned steps are never scheduled as planned, which would spin
  the engine) finishes that request with finish reason ``error`` (the OpenAI server
  answers that client with an error); every other request of the same batch decodes exactly what it decodes
  alone, and the engine serves the failed prompt correctly afterwards.
- PRESTO: a drafting failure costs no request (they step without a tree: the target's own tokens); a tree walk
  that raises for one request fails that one alone.

The failures are injected into a real in-process engine (llada-tiny, ar-tiny) for one request, picked by its
prompt; the batched code then raises for the whole batch, and the runner must find the culprit.
"""

import sys

import pytest

from psd_plugin import DEFAULT_DLLM

vllm = pytest.importorskip("vllm")
from vllm.exceptions import VLLMValidationError  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("in_process_vllm")]

POISON = 2  # the index of the request that fails, in a batch of six


@pytest.fixture(scope="module")
def prompts():
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout

    _, tok = load(DEFAULT_DLLM)
    return [encode(tok, r["prompt"]) for r in load_heldout()[::311][:6]]


def _llm(model=DEFAULT_DLLM, **spec):
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True, seed=0, max_model_len=512, max_num_seqs=8,
               speculative_config={"method": "psd", "grammar_compile_timeout": 3.0, **spec})


def _run(llm, prompts, **kw):
    """Per prompt: (finish reason, tokens, the runner's figures: NFE and the method's counters; {} for a failed
    request, which is not counted)."""
    from vllm import SamplingParams

    from psd_plugin.vllm import compat

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(**{"max_tokens": 32, "temperature": 0, **kw}), use_tqdm=False)
    stats = compat.request_stats(llm)
    return [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids),
             {k: v for k, v in stats.get(o.request_id, {}).items() if k != "seconds"}) for o in outs]


@pytest.fixture(scope="module")
def psd_llm():
    from psd_plugin.vllm import compat

    llm = _llm(decoding="psd")
    yield llm
    compat.shutdown(llm)


@pytest.fixture(scope="module")
def solo(psd_llm, prompts):
    """Each prompt decoded alone (PSD, greedy): what the batch must reproduce around a failed request."""
    return [_run(psd_llm, [p])[0] for p in prompts]


def _poison_by_prompt(monkeypatch, prompt):
    """Mark the decoder (and grammar) of the request whose prompt is ``prompt``: ``dec.poison``."""
    from model_executor.dllm_request import DLLMRequest

    start = DLLMRequest._start_block

    def marked(self):
        start(self)
        self.dec.poison = self.prompt == list(prompt)
        if self.grammar is not None:
            self.grammar.poison = self.dec.poison

    monkeypatch.setattr(DLLMRequest, "_start_block", marked)


def _raise_for_poisoned(monkeypatch, cls, name):
    """``cls.name`` (a batched classmethod over decoders) raises when a poisoned decoder is in its batch."""
    original = getattr(cls, name).__func__

    def batched(klass, decoders, *args):
        if any(getattr(d, "poison", False) for d in decoders):
            raise RuntimeError(f"injected failure in {name}")
        return original(klass, decoders, *args)

    monkeypatch.setattr(cls, name, classmethod(batched))


def _raise_after_writing_the_others(monkeypatch, cls):
    """``cls.update_batch`` steps the batch's other decoders, then raises for the poisoned one (a batched update
    that failed part-way: the runner must not step the others twice)."""
    original = cls.update_batch.__func__

    def batched(klass, decoders, proposals, preds, rows):
        bad = [getattr(d, "poison", False) for d in decoders]
        if not any(bad):
            return original(klass, decoders, proposals, preds, rows)
        ok = [i for i, b in enumerate(bad) if not b]
        if ok:
            original(klass, [decoders[i] for i in ok], [proposals[i] for i in ok], preds, [rows[i] for i in ok])
        raise RuntimeError("injected failure after the others' updates")

    monkeypatch.setattr(cls, "update_batch", classmethod(batched))


def _nan_for_poisoned(monkeypatch):
    """One logits row of the poisoned request's canvas is NaN (as a model overflow would leave it)."""
    from model_executor.decoding import logits_map
    from model_executor.dllm_request import step_predictions as original

    module = sys.modules[original.__module__]  # (the name model_executor is vLLM's too: by module object)

    def nan_row(logits, kept, mask_id, requests, steps, firsts, *args, **kwargs):
        at = logits_map(kept)
        for r, st, f in zip(requests, steps, firsts):
            if getattr(r.dec, "poison", False):
                rows = at[f[0]: f[0] + st.block_len]
                logits[int(rows[rows >= 0][0]), 7] = float("nan")
        return original(logits, kept, mask_id, requests, steps, firsts, *args, **kwargs)

    monkeypatch.setattr(module, "step_predictions", nan_row)


def _stepped_raises(monkeypatch):
    from model_executor.dllm_request import DLLMRequest

    original = DLLMRequest.stepped

    def stepped(self, step):
        if getattr(self.dec, "poison", False) and self.nfe >= 1:  # after a step: its first block under way
            raise RuntimeError("injected failure in stepped")
        return original(self, step)

    monkeypatch.setattr(DLLMRequest, "stepped", stepped)


def _plan_never_scheduled(monkeypatch):
    """The poisoned request's steps after its first claim one row more than vLLM schedules for them: the plan and
    vLLM's schedule disagree for good (a plugin bug), so each step is cut and the request would spin forever."""
    from model_executor.dllm_request import DLLMRequest, DLLMStep

    class OffByOne(DLLMStep):
        @property
        def num_scheduled(self) -> int:
            return super().num_scheduled + 1

    original = DLLMRequest.plan

    def plan(self, proposal):
        st = original(self, proposal)
        if getattr(self.dec, "poison", False) and self.nfe >= 1:
            st.__class__ = OffByOne
        return st

    monkeypatch.setattr(DLLMRequest, "plan", plan)


def _stats(llm) -> dict:
    from psd_plugin.vllm import compat

    return compat.psd_stats(llm)


@pytest.mark.parametrize("where", ["update", "update_part_way", "propose", "nan_logits", "stepped", "never_scheduled"])
def test_a_failing_request_fails_alone(monkeypatch, psd_llm, prompts, solo, where):
    from model_executor.decoding import PSDDecoder

    before = _stats(psd_llm)["totals"]["failed"]
    with monkeypatch.context() as m:
        _poison_by_prompt(m, prompts[POISON])
        if where == "update":
            _raise_for_poisoned(m, PSDDecoder, "update_batch")
        elif where == "update_part_way":
            _raise_after_writing_the_others(m, PSDDecoder)
        elif where == "propose":
            _raise_for_poisoned(m, PSDDecoder, "propose_batch")
        elif where == "nan_logits":
            _nan_for_poisoned(m)
        elif where == "never_scheduled":
            _plan_never_scheduled(m)
        else:
            _stepped_raises(m)
        got = _run(psd_llm, prompts)
    for i, (g, alone) in enumerate(zip(got, solo)):
        if i == POISON:
            assert g[0] == "error", f"the poisoned request finished with {g}"
        else:
            assert g == alone, f"{where}: request {i} beside a failing one: {g} != alone {alone}"
    assert _stats(psd_llm)["totals"]["failed"] == before + 1
    # the engine lives, and the failed prompt decodes normally once the failure is gone
    assert _run(psd_llm, [prompts[POISON]]) == [solo[POISON]]


def test_a_failing_grammar_fails_alone(monkeypatch, psd_llm, prompts):
    """A request whose grammar raises mid-decode (structured outputs on every request) fails alone."""
    from vllm.sampling_params import StructuredOutputsParams

    from model_executor.grammar import GrammarFrontier

    so = StructuredOutputsParams(regex="[a-z0-9 ]{1,20}")
    alone = [_run(psd_llm, [p], structured_outputs=so)[0] for p in prompts]
    original = GrammarFrontier.constrain

    def constrain(self, *args):
        if getattr(self, "poison", False):
            raise RuntimeError("injected failure in the grammar")
        return original(self, *args)

    with monkeypatch.context() as m:
        _poison_by_prompt(m, prompts[POISON])
        m.setattr(GrammarFrontier, "constrain", constrain)
        got = _run(psd_llm, prompts, structured_outputs=so)
    assert got[POISON][0] == "error"
    assert [g for i, g in enumerate(got) if i != POISON] == [a for i, a in enumerate(alone) if i != POISON]


def test_client_cannot_set_the_plugins_keys(psd_llm, prompts, solo):
    """A client's ``vllm_xargs`` land in ``SamplingParams.extra_args``; the plugin's own keys there are refused
    before the engine sees them (a junk grammar there used to end the engine)."""
    for key in ("psd_grammar", "psd_anything"):
        with pytest.raises(VLLMValidationError, match=key):
            _run(psd_llm, prompts[:1], extra_args={key: "junk"})
    assert _run(psd_llm, prompts[:1], extra_args={"my_key": 1})[0][:2] == solo[0][:2]  # other keys: the client's
    # scoring given tokens: vLLM's scheduler would attach logprobs the step never made (a 500 in the chat API)
    with pytest.raises(VLLMValidationError, match="logprob_token_ids=\\[5, 6\\]: psd-plugin does not score"):
        _run(psd_llm, prompts[:1], logprobs=2, logprob_token_ids=[5, 6])


# ------------------------------------------------------------------ grammars compile off the step
def _step_until(engine, done, limit=2000) -> dict:
    """Step ``engine`` (vLLM's LLMEngine) until ``done(finished)`` holds; ``finished``: request id -> output."""
    finished = {}
    for _ in range(limit):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        if done(finished):
            return finished
    raise AssertionError(f"not done after {limit} steps: {sorted(finished)}")


def test_a_grammar_compiles_off_the_step(monkeypatch, psd_llm, prompts, solo):
    """While a request's grammar compiles (held here until the test lets it go), plain requests are scheduled,
    decode and finish; then the structured request is released and decodes its constrained answer."""
    import threading

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from psd_plugin.vllm import grammars

    gate, started = threading.Event(), threading.Event()
    original = grammars.compiled

    def slow(model_config, text):
        started.set()
        assert gate.wait(60), "the test never released the compile"
        return original(model_config, text)

    engine = psd_llm.llm_engine
    so = StructuredOutputsParams(regex="[a-z]{3}-[0-9]{2}")
    with monkeypatch.context() as m:
        m.setattr(grammars, "compiled", slow)
        engine.add_request("structured", {"prompt_token_ids": prompts[0]},
                           SamplingParams(max_tokens=32, temperature=0, structured_outputs=so))
        for i in (1, 2):
            engine.add_request(f"plain{i}", {"prompt_token_ids": prompts[i]}, SamplingParams(max_tokens=32, temperature=0))
        plain = _step_until(engine, lambda f: {"plain1", "plain2"} <= f.keys())
        assert started.is_set() and "structured" not in plain  # held while compiling; the others went on
        assert [list(plain[f"plain{i}"].token_ids) for i in (1, 2)] == [solo[1][1], solo[2][1]]
        gate.set()
        out = _step_until(engine, lambda f: "structured" in f)["structured"]
    import re

    assert out.finish_reason in ("stop", "length") and re.fullmatch(r"[a-z]{3}-[0-9]{2}", out.text), out


@pytest.mark.parametrize("how", ["raises", "times_out"])
def test_a_grammar_that_does_not_compile_fails_its_request(monkeypatch, psd_llm, prompts, solo, how):
    """A compile that raises, or runs past grammar_compile_timeout (3 s here), finishes its request with an
    error; requests beside it are untouched, and the engine goes on."""
    import time

    from vllm.sampling_params import StructuredOutputsParams

    from psd_plugin.vllm import grammars

    def broken(model_config, text):
        if how == "raises":
            raise RuntimeError("injected compile failure")
        time.sleep(6)

    with monkeypatch.context() as m:
        m.setattr(grammars, "compiled", broken)
        from vllm import SamplingParams

        so = SamplingParams(max_tokens=32, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
        outs = psd_llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                                [so, SamplingParams(max_tokens=32, temperature=0)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert list(outs[1].outputs[0].token_ids) == solo[1][1]


def test_a_constraint_past_the_size_limit_is_refused(psd_llm, prompts):
    from vllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(VLLMValidationError, match="max_grammar_bytes"):
        _run(psd_llm, prompts[:1], structured_outputs=StructuredOutputsParams(json=schema))


def test_the_compiled_grammar_cache_is_bounded(psd_llm, prompts):
    """The scheduler and the worker (one process here) share one compiler, bounded by VLLM_XGRAMMAR_CACHE_MB."""
    import vllm.envs as envs
    from vllm.sampling_params import StructuredOutputsParams

    from psd_plugin.vllm.grammars import _SERVED

    _run(psd_llm, prompts[:1], structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    (info, compiler), = _SERVED.values()
    assert compiler.cache_limit_bytes == envs.VLLM_XGRAMMAR_CACHE_MB * 2 ** 20 > 0
    assert 0 < compiler.get_cache_size_bytes() <= compiler.cache_limit_bytes


def test_prompt_embeds_are_refused():
    """The dLLM path decodes from token ids: an engine with prompt embeddings on is refused at start-up (before
    the engine exists), naming the option (the front end refuses a request carrying them too)."""
    from vllm import LLM

    with pytest.raises(Exception, match="enable_prompt_embeds"):
        LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_model_len=512, enable_prompt_embeds=True,
            speculative_config={"method": "psd"})
