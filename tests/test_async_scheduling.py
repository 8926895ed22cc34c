"""Async scheduling on the dLLM path (``speculative_config`` ``async_scheduling``, or vLLM's
``--async-scheduling``): vLLM's engine core keeps two steps in its batch queue, so step N + 1 is scheduled while
step N runs and step N's output is processed while N + 1 runs. The scheduler schedules each request's next rows
from its planned step (:meth:`~model_executor.dllm_request.DLLMRequest.step_after`), the runner decodes step N
when N + 1 begins and writes N + 1's canvas ids into the rows scheduled for them; a request whose block completed
at N gets a cut step at N + 1 (its rows decode nothing). Every output equals the reference engine's in tokens and
decoding forwards: every method, each cache, every family, greedy and sampled, under preemption; a step of missed
guesses alone runs no forward. Two tensor-parallel ranks: ``tests/test_parallel.py``. Configurations it does not run
with yet are refused, naming the field."""

import os

import pytest

from model_executor.engine import ReferenceEngine
from psd_plugin import DEFAULT_DLLM

vllm = pytest.importorskip("vllm")

from test_vllm_decoding import METHODS, _generate, _knobs, _psd_stats, preemption_keeps_outputs  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("in_process_vllm")]
FULL = os.environ.get("PSD_FULL_MATRIX") == "1"


def _async_llm(path, method, cache=None, llm_kw=None, **spec):
    """An engine with async scheduling; a step of the spatial policies is laid out ahead of the last one's host
    decode (``decide_ahead``, on an accelerator by default: on here, unless ``spec`` says otherwise)."""
    from vllm import LLM

    knobs = {**_knobs(path, method), **({"cache": cache} if cache else {})}
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, seed=0, max_model_len=512, **(llm_kw or {}),
              speculative_config={"method": "psd", "decoding": method, "async_scheduling": True,
                                  "decide_ahead": "on", **knobs, **spec})
    assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    return llm, knobs


def _reference(path, prompts, method, knobs, **kw):
    engine = ReferenceEngine.from_pretrained(path)
    if method == "spiffy":
        from model_executor.decoding import load_graph

        knobs = {**knobs, "graph": load_graph(knobs["graph"])}
    return engine.generate(prompts, max_tokens=32, block_size=engine.spec.attention_block or 8, method=method,
                           **knobs, **kw)


def _check(llm, prompts, ref, block=8, **kw):
    tokens, nfe = _generate(llm, prompts, 32, merged=False, **kw)  # (model calls: NFE + cut steps)
    for i, (t, n, r) in enumerate(zip(tokens, nfe, ref)):
        assert t == r.token_ids and n == r.nfe, f"prompt {i}: vLLM {t} in {n} forwards, reference {r.token_ids} in {r.nfe}"
    st = _psd_stats(llm)["step_time"]
    assert st["deferred"] > 0, st  # the engine ran with its batch queue: steps decoded when the next began
    # a missed guess (a completed block) costs one cut step; never more than one per block
    blocks = sum(-(-len(r.token_ids) // block) for r in ref)
    assert st["cut_steps"] <= blocks, (st, blocks)
    return st


# CI: a one-canvas policy, a drafting method, a lossless one with its draft graph, the editing decoder (the
# async path is the same for every method but for its canvases: the policies share PolicyDecoder's code);
# PSD_FULL_MATRIX=1: every method with both caches (all passed 2026-12-06)
CI_CASES = [("confidence", "dual"), ("psd", "prefix"), ("spiffy", "dual"), ("joint_threshold", "prefix")]


@pytest.mark.parametrize("method, cache", [(m, c) for m in METHODS for c in ("prefix", "dual")] if FULL else
                         CI_CASES)
def test_every_method_equals_the_reference_engine(heldout_prompts, method, cache):
    llm, knobs = _async_llm(DEFAULT_DLLM, method, cache)
    try:
        _check(llm, heldout_prompts, _reference(DEFAULT_DLLM, heldout_prompts, method, knobs))
    finally:
        del llm


@pytest.mark.parametrize("family, cache, method", [("dream", "dual", "psd"), ("sdar", "block", "confidence"),
                                                   ("llada2", "block", "lopa")])
def test_every_family_equals_the_reference_engine(tiny_checkpoints, random_prompts, family, cache, method):
    path = tiny_checkpoints[family]
    llm, knobs = _async_llm(path, method, cache)
    try:
        block = ReferenceEngine.from_pretrained(path).spec.attention_block or 8
        _check(llm, random_prompts, _reference(path, random_prompts, method, knobs), block)
    finally:
        del llm


def test_a_step_of_missed_guesses_alone_runs_no_forward(heldout_prompts):
    """One request at a time: the step scheduled after a request's last one (and after each block it completed,
    where that was not certain) is a guess that missed, the only rows of its step; that step runs no forward, and
    the outputs stay the reference engine's."""
    prompts = heldout_prompts
    # a low threshold: a block's last step commits several masks, so its completion is not certain
    ref = _reference(DEFAULT_DLLM, prompts, "confidence", {"threshold": 0.5}, cache="dual")
    llm, _ = _async_llm(DEFAULT_DLLM, "confidence", "dual", threshold=0.5, decide_ahead="off")
    try:
        for p, r in zip(prompts, ref):
            tokens, nfe = _generate(llm, [p], 32, merged=False)
            assert (tokens[0], nfe[0]) == (r.token_ids, r.nfe)
        st = _psd_stats(llm)["step_time"]
        # a request's step after its last, or after a block it completed under a guess, is wasted: none runs
        assert st["skipped_forwards"] >= max(1, st["cut_steps"]), st
        assert st["forwards"] == sum(r.nfe for r in ref), st  # the forwards that ran: the decoding ones
    finally:
        del llm


def test_a_certain_block_completion_is_not_guessed(heldout_prompts):
    """Static decoding commits one position a step, so every block's last step certainly completes it: the
    scheduler guesses no step after it (it waits for the outcome), so no step is cut and none is wasted, and the
    outputs stay the reference engine's."""
    ref = _reference(DEFAULT_DLLM, heldout_prompts, "static", {}, cache="dual")
    llm, _ = _async_llm(DEFAULT_DLLM, "static", "dual")
    try:
        _check(llm, heldout_prompts, ref)  # a batch
        for p, r in zip(heldout_prompts[:3], ref):  # one at a time: every forward run is a decoding one
            before = _psd_stats(llm)["step_time"]["forwards"]
            tokens, nfe = _generate(llm, [p], 32, merged=False)
            assert (tokens[0], nfe[0]) == (r.token_ids, r.nfe)
            assert _psd_stats(llm)["step_time"]["forwards"] - before == r.nfe
        st = _psd_stats(llm)["step_time"]
        assert st["cut_steps"] == 0 and st["skipped_forwards"] == 0, st
    finally:
        del llm


def test_the_next_step_waits_for_a_decode_on_vllms_output_thread():
    """Under tensor parallelism vLLM's output thread asks for step N's output (and so decodes it) while the
    worker's thread may begin step N + 1: N + 1 starts only once N is decoded, N is decoded once, and a decode
    that raised raises again when asked (no second decode)."""
    import threading
    import time
    from types import SimpleNamespace

    import torch

    from psd_plugin.vllm.dllm_runner import DeferredOutput, DLLMRunnerMixin

    class Base:
        def execute_model(self, scheduler_output, *args, **kwargs):
            return "N + 1 ran"

    class Runner(DLLMRunnerMixin, Base):
        def __init__(self, fail=False):  # the state the deferred decode touches
            self.overlap, self.device, self.fail = True, torch.device("cpu"), fail
            self._deferred_lock, self._deferred, self.step_time = threading.Lock(), None, {"deferred": 0}
            self.decides_ahead = self.waits_for_next_step = False
            self.decodes, self.seen = 0, None

        def _sample_tokens(self, grammar_output):
            time.sleep(0.3)  # a long decode
            self.decodes += 1
            if self.fail:
                raise RuntimeError("an engine fault")
            return SimpleNamespace()

        def take_draft_token_ids(self):
            return None

        def _adopt_plans(self, scheduler_output):  # N + 1's first use of the runner's state
            self.seen = self._deferred is None and d.output is not None

    runner = Runner()
    d = runner._deferred = DeferredOutput(runner, None)
    out_thread = threading.Thread(target=d.get_output)
    out_thread.start()
    time.sleep(0.05)  # the output thread is decoding N
    assert runner.execute_model(None) == "N + 1 ran"
    out_thread.join()
    assert runner.seen and runner.decodes == 1 and runner.step_time["deferred"] == 1

    runner = Runner(fail=True)
    d = runner._deferred = DeferredOutput(runner, None)
    with pytest.raises(RuntimeError, match="an engine fault"):
        d.get_output()
    with pytest.raises(RuntimeError, match="an engine fault"):
        d.get_output()
    assert runner.decodes == 1


def test_the_output_thread_leaves_a_step_laid_out_ahead_to_the_next_one(monkeypatch):
    """Under vLLM's multiprocess executor with steps laid out ahead, its output thread asks for step N's output at
    once, but N + 1 must find N undecoded, on every rank alike: the thread waits until N + 1 begins, and N + 1 (here
    laid out ahead, as on the ranks that have no output thread) decodes N, once; the ranks vote on it at every
    step. Where N + 1 does not begin within ``AHEAD_WAIT_S`` the thread decodes N itself (counted), and then N + 1
    is not laid out ahead: the vote says so for every rank."""
    import threading
    import time
    from types import SimpleNamespace

    import torch

    from psd_plugin.vllm import dllm_runner
    from psd_plugin.vllm.dllm_runner import DeferredOutput, DLLMRunnerMixin

    class Base:
        def execute_model(self, scheduler_output, *args, **kwargs):
            return "N + 1 after N's decode"

    class Runner(DLLMRunnerMixin, Base):
        def __init__(self):
            self.overlap, self.device = True, torch.device("cpu")
            self._deferred_lock, self._deferred = threading.Lock(), None
            self.step_time = {"deferred": 0, "ahead_wait_expired": 0, "ahead_vetoed": 0}
            self.decides_ahead = self.waits_for_next_step = True
            self.decodes, self.votes, self.decoded_by = 0, [], []

        def _sample_tokens(self, grammar_output):
            self.decodes += 1
            self.decoded_by.append(threading.current_thread().name)
            return SimpleNamespace()

        def take_draft_token_ids(self):
            return None

        def _plan_ahead(self, scheduler_output, d):
            return {"a request": "its step"}

        def _every_rank(self, flag):  # (one host all-reduce over the tensor-parallel ranks)
            self.votes.append(flag)
            return flag

        def _execute_ahead(self, d, ahead, scheduler_output, *args, **kwargs):
            self._decode_deferred(d)  # (after N + 1's launch)
            return "N + 1 laid out ahead"

        def _adopt_plans(self, scheduler_output):
            pass

    monkeypatch.setattr(dllm_runner, "AHEAD_WAIT_S", 10.0)
    runner = Runner()
    d = runner._deferred = DeferredOutput(runner, None)
    out_thread = threading.Thread(target=d.get_output, name="output thread")
    out_thread.start()
    time.sleep(0.2)  # the output thread asked for N's output and waits
    assert runner.decodes == 0 and out_thread.is_alive()
    assert runner.execute_model(None) == "N + 1 laid out ahead"
    out_thread.join(5)
    assert not out_thread.is_alive() and d.output is not None
    assert runner.decodes == 1 and runner.decoded_by == [threading.current_thread().name] and runner.votes == [True]
    assert runner.step_time["ahead_wait_expired"] == 0

    monkeypatch.setattr(dllm_runner, "AHEAD_WAIT_S", 0.1)  # N + 1 is late: the output thread decodes N
    runner = Runner()
    d = runner._deferred = DeferredOutput(runner, None)
    out_thread = threading.Thread(target=d.get_output, name="output thread")
    out_thread.start()
    out_thread.join(5)
    assert runner.decoded_by == ["output thread"] and runner.step_time["ahead_wait_expired"] == 1
    assert runner.execute_model(None) == "N + 1 after N's decode" and runner.votes == [False]
    assert runner.decodes == 1 and runner.step_time["ahead_vetoed"] == 0  # (this rank could not go ahead)


@pytest.mark.parametrize("method, cache, kw", [("confidence", "dual", {}), ("static", "prefix", {}),
                                               ("confidence", "prefix", {"temperature": 0.8, "seed": 0}),
                                               ("psd", "dual", {}), ("psd", "prefix", {"temperature": 0.8, "seed": 0}),
                                               ("lopa", "dual", {}), ("freedave", "prefix", {}),
                                               ("joint_threshold", "prefix", {}), ("spiffy", "dual", {}),
                                               ("spiffy", "prefix", {"temperature": 0.8, "seed": 0})])
def test_steps_laid_out_ahead_equal_the_reference_engine(monkeypatch, heldout_prompts, method, cache, kw):
    """Every method decides ahead: while the batch stays the same, step N + 1 is laid out and
    forwarded before step N's decisions reach the host (its canvases' ids written from them where they were
    taken: PSD's drafts, LoPA's branches, FreeDave's jumps, Spiffy's graph drafts made there), and N is decoded on the host after that forward; the answers and
    decoding forwards are the reference engine's (greedy and sampled), and a block completed at N costs its N + 1
    rows only. The order is checked on the runner's calls: every step decided ahead launches N's decisions, then
    runs N + 1's forward, then updates N's decoders."""
    from psd_plugin.vllm import dllm_runner

    events = []

    def spy(name, fn):
        def wrapped(*a, **k):
            events.append(name)
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(dllm_runner, "launch_step", spy("launch", dllm_runner.launch_step))
    monkeypatch.setattr(dllm_runner, "update_step", spy("update", dllm_runner.update_step))
    monkeypatch.setattr(dllm_runner, "decode_step", spy("decode", dllm_runner.decode_step))
    forward = dllm_runner.DLLMRunnerMixin._model_forward
    monkeypatch.setattr(dllm_runner.DLLMRunnerMixin, "_model_forward",
                        lambda self, *a, **k: events.append("forward") or forward(self, *a, **k))
    threshold = {"threshold": 0.5} if method == "confidence" else {}  # blocks in several steps, with misses
    ref = _reference(DEFAULT_DLLM, heldout_prompts, method, {**_knobs(DEFAULT_DLLM, method), **threshold}, cache=cache,
                     **kw)
    llm, _ = _async_llm(DEFAULT_DLLM, method, cache, **threshold)
    try:
        if kw:  # the reference's request i draws with seed + i
            from vllm import SamplingParams

            outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                                [SamplingParams(max_tokens=32, temperature=kw["temperature"], seed=kw["seed"] + i)
                                 for i in range(len(heldout_prompts))], use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in ref]
        else:
            _check(llm, heldout_prompts, ref)
            for p, r in zip(heldout_prompts[:2], ref):  # one at a time: the batch stays the same within a request
                tokens, nfe = _generate(llm, [p], 32, merged=False)
                assert (tokens[0], nfe[0]) == (r.token_ids, r.nfe)
        st = _psd_stats(llm)["step_time"]
    finally:
        del llm
    assert st["ahead"] > 0 and st["ahead_mismatch"] == 0, st  # (every laid-out canvas was its plan's)
    if method in ("psd", "lopa", "freedave", "spiffy"):  # drafts laid out ahead: some past the plan's
        assert st["ahead_idle_canvases"] > 0, st
    # every step decided ahead: N's decisions launched, N + 1's forward, then N's decoders updated from them
    text = "".join({"launch": "L", "forward": "F", "update": "U", "decode": "D"}[e] for e in events)
    assert text.count("L") == text.count("U") == st["ahead"], (text, st)
    assert text.count("LFU") == st["ahead"], text


@pytest.mark.parametrize("method", ["psd", "spiffy"])
def test_canvases_laid_out_otherwise_than_planned_cost_a_step_not_the_answer(monkeypatch, heldout_prompts, method):
    """Where the canvases a method lays out ahead (made where the logits are) are not its plan's (made on the host
    after the update), which their bit-for-bit agreement rules out by construction, the runner sees it in the
    laid-out ids' copy: those rows decode nothing and the plan runs as a step of its own, so the answers and the
    decoding forwards stay the reference engine's, and ``ahead_mismatch`` counts it. Here the drafts laid out are
    made wrong on purpose (the state in every canvas)."""
    from model_executor.decoding.psd import PSDDecoder
    from model_executor.decoding.spiffy import SpiffyDecoder

    def states_only(original):
        def wrong(*a, **k):
            canvases = original(*a, **k)
            return canvases[:, :1].expand_as(canvases).clone()
        return wrong

    cls = {"psd": PSDDecoder, "spiffy": SpiffyDecoder}[method]
    monkeypatch.setattr(cls, "_next_canvases", staticmethod(states_only(cls._next_canvases)))
    ref = _reference(DEFAULT_DLLM, heldout_prompts, method, _knobs(DEFAULT_DLLM, method), cache="dual")
    llm, _ = _async_llm(DEFAULT_DLLM, method, "dual")
    try:
        tokens, nfe = _generate(llm, heldout_prompts, 32, merged=False)  # (each mismatch: one cut step more)
        assert tokens == [r.token_ids for r in ref] and nfe == [r.nfe for r in ref]
        for p, r in zip(heldout_prompts[:2], ref):
            tokens, nfe = _generate(llm, [p], 32, merged=False)
            assert (tokens[0], nfe[0]) == (r.token_ids, r.nfe)
        st = _psd_stats(llm)["step_time"]
    finally:
        del llm
    assert st["ahead"] > 0 and st["ahead_mismatch"] > 0, st


@pytest.mark.parametrize("method, budget", [("confidence", None), ("confidence", 96), ("static", 96), ("psd", 96),
                                            ("lopa", 96)])
def test_steps_are_laid_out_ahead_while_requests_join_leave_and_get_cut(monkeypatch, heldout_prompts, method,
                                                                        budget):
    """Answers of four blocks each (``ignore_eos``), whose blocks complete at different steps, requests admitted
    over several steps and finishing at different ones: where a request's rows at step N were cut (its block
    completed at N - 1, or a guess missed), its step N + 1 was planned before N and N's decode leaves it as it is,
    so N + 1 is still laid out ahead for the others, with that request's rows from its plan (its ids written from
    the host, as without a step laid out ahead); where requests joined or left vLLM's batch between N and N + 1,
    N's output reaches vLLM's bookkeeping in the batch's new order and the scheduler in N's; a request that
    stepped in N and is not scheduled in N + 1 (a certain completion of its block waits for its outcome; with a
    tight token ``budget``, no room) leaves vLLM's batch alive, and what it emitted at N is recorded for it apart
    (static decoding: every block's last step). Tokens and decoding forwards are the reference engine's."""
    from vllm import SamplingParams

    from test_vllm_decoding import _ignoring_eos, _request_stats

    knobs = {"threshold": 0.5} if method == "confidence" else {}
    llm, _ = _async_llm(DEFAULT_DLLM, method, "dual", **knobs,
                        llm_kw={"max_num_batched_tokens": budget, "max_num_seqs": 8} if budget else None)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                            SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
        stats = _request_stats(llm)
        st = _psd_stats(llm)["step_time"]
    finally:
        del llm
    _ignoring_eos(monkeypatch)
    ref = _reference(DEFAULT_DLLM, heldout_prompts, method, knobs, cache="dual")
    for i, (o, r) in enumerate(zip(outs, ref)):
        got = (list(o.outputs[0].token_ids), stats[o.request_id]["nfe"])
        assert got == (r.token_ids, r.nfe), f"prompt {i}: vLLM {got}, reference {(r.token_ids, r.nfe)}"
    assert st["ahead_planned"] > 0 and st["ahead_rebatched"] > 0 and st["ahead_left"] > 0, st


def test_sampled_requests_draw_the_reference_engines_tokens(heldout_prompts):
    """Seeded sampled requests beside greedy ones: a draw is a function of the seed, position and step, whatever
    step vLLM scheduled it in."""
    from vllm import SamplingParams

    n = len(heldout_prompts)
    ref = _reference(DEFAULT_DLLM, heldout_prompts, "psd", {}, temperature=0.8, top_p=0.9, seed=0)
    llm, _ = _async_llm(DEFAULT_DLLM, "psd")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                            [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i) for i in range(n)],
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in ref]
    finally:
        del llm


@pytest.mark.parametrize("family, cache", [("llada", "dual"), ("sdar", "block")] if FULL else [("llada", "dual")])
def test_preemption_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts, random_prompts, family, cache):
    """A KV cache too small for the batch: vLLM preempts requests while their next step is already scheduled;
    they resume and every output stays the reference's (greedy and sampled)."""
    preemption_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts, random_prompts, family, cache,
                             spec={"async_scheduling": True})


def test_vllms_flag_turns_it_on_and_what_it_cannot_run_with_is_refused(heldout_prompts, tiny_checkpoints):
    from vllm import LLM

    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_model_len=256, async_scheduling=True,
              disable_log_stats=False, speculative_config={"method": "psd", "decoding": "confidence"})
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        assert (llm.llm_engine.vllm_config.additional_config or {})["psd"]["async_scheduling"]
        ref = _reference(DEFAULT_DLLM, heldout_prompts, "confidence", {})
        _check(llm, heldout_prompts, ref)
        # vLLM's spec-decode metrics in dLLM terms (one draft = one decoding forward): cut steps are none
        drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
        assert drafts == sum(r.nfe for r in ref), (drafts, sum(r.nfe for r in ref))
    finally:
        del llm
    with pytest.raises(ValueError, match=r"speculative_config.async_scheduling with pipeline_parallel_size 2: "
                                         r".*allowed: "):
        LLM(model=str(DEFAULT_DLLM), dtype="float32", pipeline_parallel_size=2,
            speculative_config={"method": "psd", "async_scheduling": True})
    # data parallelism (the server's: vLLM's offline LLM refuses it): a dense model's ranks are engines of their own
    # (tests/test_parallel.py); a mixture-of-experts model's run in lockstep, with dummy batches between a step and
    # its deferred decode
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=r"speculative_config.async_scheduling with data_parallel_size 2: this "
                                         r"mixture-of-experts .*allowed: data_parallel_size 1"):
        EngineArgs(model=str(tiny_checkpoints["llada2"]), dtype="float32", data_parallel_size=2,
                   speculative_config={"method": "psd", "async_scheduling": True}).create_engine_config()
    # a step laid out ahead of the last one's decode: only with async scheduling (on two ranks:
    # tests/test_parallel.py)
    with pytest.raises(ValueError, match=r"speculative_config.decide_ahead 'on' .*needs async_scheduling true; "
                                         r"allowed without it: 'auto', 'off'"):
        LLM(model=str(DEFAULT_DLLM), dtype="float32", speculative_config={"method": "psd", "decide_ahead": "on"})
    with pytest.raises(ValueError, match=r"decide_ahead"):
        LLM(model=str(DEFAULT_DLLM), dtype="float32", speculative_config={"method": "psd", "decide_ahead": "yes"})
    # (tensor parallelism runs: tests/test_parallel.py) an executor other than vLLM's one-process and multiprocess
    from types import SimpleNamespace

    from psd_plugin.vllm.config import enable_async_scheduling

    ray = SimpleNamespace(additional_config={"psd": {"async_scheduling": True}},
                          parallel_config=SimpleNamespace(distributed_executor_backend="ray"))
    with pytest.raises(ValueError, match=r"distributed_executor_backend 'ray': .*allowed: uni, mp"):
        enable_async_scheduling(ray)


def test_drafts_that_outgrow_the_guessed_budget_are_cut_not_overflowed(monkeypatch, heldout_prompts):
    """The scheduler budgets a step it schedules on a guess with the request's last canvases; PSD's drafts then
    vary, and with a step budget this tight the planned rows exceed vLLM's buffers or the logits budget in some
    steps: the runner cuts the steps with the most extra rows (they run at the next step, budgeted exactly) and
    every output stays the reference's."""
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat
    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin, Rows

    fitted = []
    fit = DLLMRunnerMixin._fit

    def spy(self, entries, req_ids):
        before = sum(not isinstance(e, Rows) for e in entries)
        fit(self, entries, req_ids)
        fitted.append(before - sum(not isinstance(e, Rows) for e in entries))

    monkeypatch.setattr(DLLMRunnerMixin, "_fit", spy)
    ref = _reference(DEFAULT_DLLM, heldout_prompts, "psd", {"cache": "prefix"})
    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_model_len=128,
              max_num_batched_tokens=150, max_num_seqs=8,
              speculative_config={"method": "psd", "decoding": "psd", "cache": "prefix", "async_scheduling": True})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                            SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
        stats = compat.request_stats(llm)
        assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in ref]
        assert [stats[o.request_id]["nfe"] for o in outs] == [r.nfe for r in ref]
    finally:
        del llm
    assert any(fitted), "no step outgrew its guessed budget: the test does not exercise the fit"


@pytest.mark.parametrize("method, cache", [("confidence", "prefix"), ("psd", "dual")])
def test_answers_that_fill_the_context(random_prompts, tiny_checkpoints, method, cache):
    """Prompt + max_tokens = max_model_len (what the OpenAI server gives a request without max_tokens): a step
    guessed while the last one completes a block would hold that block's tokens before its placeholders, past
    the context; such a request waits a step instead, and every output is the reference's."""
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat

    path, L = tiny_checkpoints["llada"], 96
    ref = ReferenceEngine.from_pretrained(path)
    want = [ref.generate([p], max_tokens=L - len(p), method=method, cache=cache, block_size=8)[0]
            for p in random_prompts]
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=L,
              speculative_config={"method": "psd", "decoding": method, "cache": cache, "async_scheduling": True,
                                  "decide_ahead": "on"})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts],
                            [SamplingParams(max_tokens=L - len(p), temperature=0) for p in random_prompts],
                            use_tqdm=False)
        stats = compat.request_stats(llm)
        assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in want]
        assert [stats[o.request_id]["nfe"] for o in outs] == [r.nfe for r in want]
    finally:
        del llm
