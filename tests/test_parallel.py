"""Several devices through vLLM's own parallelism, run on this CPU (slow: each test starts engines).

vLLM's CPU build runs tensor parallelism with gloo and a shared-memory all-reduce, one OpenMP thread list per
rank (``VLLM_CPU_OMP_THREADS_BIND='0|1'``: its ``auto`` setting wants a NUMA node per rank). Each rank holds
its share of the heads (KV heads replicated where the ranks outnumber them, as in the random Dream / SDAR /
LLaDA2 checkpoints: 2 heads, 1 KV head) and of LLaDA2's experts, and runs the decoders on the gathered logits.

- Tensor parallelism (2 ranks) gives the reference engine's tokens and forwards (the reference engine equals
  one rank in ``test_vllm_decoding.py``): methods on LLaDA with the prefix cache and the dual cache, on the
  random Dream, SDAR and LLaDA2 checkpoints, and PRESTO (= the AR target's greedy decoding). CI runs the
  decoders and layouts that differ (each extra-canvas method on some family); ``PSD_TP_MATRIX=1`` runs every
  method on every family and cache.
- A seeded sampled request is the same on 1 and 2 ranks; an unseeded one runs (its seed comes from its id,
  so the ranks' draws agree; the per-step layout check would fail the step otherwise).
- Served: 32 concurrent streaming clients on a 2-rank server, each output equal to its solo run; a dense
  model with 2 data-parallel ranks answers as 1 does; killing a worker fails the in-flight request and the
  server exits, within a bound.
"""

import asyncio
import os
import signal
import time

import pytest

from psd_plugin import DEFAULT_AR, DEFAULT_DLLM

vllm = pytest.importorskip("vllm")

from test_vllm_decoding import METHODS, _check_parity, _llm  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("in_process_vllm", "two_ranks")]

TP = {"tensor_parallel_size": 2}
RANKS_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def two_ranks():
    """One OpenMP thread list per rank, read afresh: an in-process engine core caches vLLM's environment
    (``enable_envs_cache``) for the rest of the process."""
    from vllm import envs

    old = {k: os.environ.get(k) for k in RANKS_ENV}
    os.environ.update(RANKS_ENV)
    envs.disable_envs_cache()
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    envs.disable_envs_cache()


# CI: the decoders whose rank-sensitive paths no other test here runs on two ranks (PSD on the default model and
# cache, joint_threshold's edits; the confidence policy runs in the sampling and structured-output tests, LoPA and
# Spiffy on the random checkpoints below); PSD_TP_MATRIX=1 runs every method
@pytest.mark.parametrize("method", METHODS if os.environ.get("PSD_TP_MATRIX") else ("psd",))
def test_two_ranks_equal_the_reference_every_method(heldout_prompts, method):
    _check_parity(DEFAULT_DLLM, heldout_prompts, method, cache="prefix", llm_kw=TP)


@pytest.mark.parametrize("method", METHODS if os.environ.get("PSD_TP_MATRIX") else ("psd",))
# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; the prefix cache on 2 ranks runs in CI
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_two_ranks_dual_cache(heldout_prompts, method):
    _check_parity(DEFAULT_DLLM, heldout_prompts, method, cache="dual", llm_kw=TP)


@pytest.mark.parametrize("method, cache", [("psd", "dual"), ("confidence", "prefix")] if os.environ.get("PSD_TP_MATRIX")
                         else [("psd", "dual")])
def test_two_ranks_with_async_scheduling(heldout_prompts, method, cache):
    """Async scheduling on two ranks (vLLM's multiprocess executor): the output rank's step output is asked for
    from vLLM's output thread while the next step may begin, the other rank decodes it when the next step begins;
    both decode alike (the per-step layout check), and the answers are the reference engine's, in its forwards."""
    from test_vllm_decoding import _psd_stats

    def deferred(llm):
        stats = _psd_stats(llm)  # the output rank's
        assert stats["step_time"]["deferred"] > 0, stats["step_time"]

    _check_parity(DEFAULT_DLLM, heldout_prompts, method, cache=cache, merged=False, llm_kw=TP, inspect=deferred,
                  spec={"async_scheduling": True})


def test_two_ranks_lay_steps_out_ahead_alike(heldout_prompts):
    """Steps laid out ahead of the last one's host decode on two ranks (PSD's drafts made where the decisions
    are): vLLM's output thread on the output rank waits for the next step to begin instead of decoding the last
    one at once, so both ranks lay every step out the same way (the per-step layout check), steps do go ahead, and
    the answers are the reference engine's, in its forwards. After an answer a step of guesses is left in flight;
    vLLM's engine core sends a step after it (the one reporting the request finished) before it waits for its
    output, so the engine drains at once. Then the engine is stepped by hand with pauses longer than that wait
    (``AHEAD_WAIT_S``) while requests decode: the output thread decodes the step in flight itself, the other rank
    has not, and the ranks' vote lays the next step out as ever on both (without the vote they disagree and the
    layout check fails the step); the answers are still the reference engine's."""
    import time

    from vllm import SamplingParams

    from model_executor.engine import ReferenceEngine
    from psd_plugin.vllm.dllm_runner import AHEAD_WAIT_S
    from test_vllm_decoding import _psd_stats

    params = SamplingParams(max_tokens=32, temperature=0)

    def ahead(llm):
        core = llm.llm_engine.engine_core.engine_core  # (the engine core in this process)
        left = []
        for p in heldout_prompts[:3]:  # one answer at a time, then the engine's steps until nothing is in flight
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            left.append(len(core.batch_queue))
            t0 = time.perf_counter()
            while core.batch_queue:
                core.step_fn()
            assert time.perf_counter() - t0 < 5, "the engine waited for the output thread to give up"
        assert any(left), "no step was in flight after an answer: the drain checks nothing"
        st = _psd_stats(llm)["step_time"]  # the output rank's
        assert st["ahead"] > 0 and st["ahead_mismatch"] == 0, st
        engine, prompts, got = llm.llm_engine, heldout_prompts[:4], {}
        for i, p in enumerate(prompts):
            engine.add_request(f"paused-{i}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
            time.sleep(2 * AHEAD_WAIT_S)  # (the output rank's output thread decodes the step in flight)
        ref = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
        want = ref.generate(prompts, max_tokens=32, method="psd", cache="dual", block_size=8)
        assert [got[f"paused-{i}"] for i in range(len(prompts))] == [w.token_ids for w in want]
        ranks = [r["step_time"] for r in llm.collective_rpc("psd_stats")]
        assert ranks[0]["ahead_wait_expired"] > 0 and ranks[1]["ahead_wait_expired"] == 0, ranks
        assert ranks[1]["ahead_vetoed"] > 0, "the pauses never fell where the other rank could lay a step out ahead"

    _check_parity(DEFAULT_DLLM, heldout_prompts, "psd", cache="dual", merged=False, llm_kw=TP, inspect=ahead,
                  spec={"async_scheduling": True, "decide_ahead": "on"})


# CI runs LLaDA2 (block-causal attention, sharded experts, Spiffy's drafts); PSD_TP_MATRIX=1 runs every method on
# every random family and cache (Dream's shifted logits with the dual cache and PSD, SDAR with LoPA ran in CI until
# 2026-12-06, when CI reached 45 minutes)
_CACHES = {"dream": (None, "dual"), "sdar": (None,), "llada2": (None,)}  # None: the family's default
RANDOM_CASES = ([(f, m, c) for f, caches in _CACHES.items() for c in caches for m in METHODS]
                if os.environ.get("PSD_TP_MATRIX") else
                [("llada2", "spiffy", None)])


@pytest.mark.parametrize("family, method, cache", RANDOM_CASES)
def test_two_ranks_with_replicated_kv_heads_and_experts(tiny_checkpoints, random_prompts, family, method, cache):
    """The random checkpoints have 2 query heads and 1 KV head: each rank holds one query head and a replica
    of the KV head; LLaDA2's experts are sharded. The layouts: Dream's shifted logits (with its dual cache),
    SDAR's and LLaDA2's block-causal attention with the exact block cache, extra canvases (PSD, LoPA,
    FreeDave, Spiffy). SDAR and LLaDA2 run with vLLM's prefix cache on pages of 16 tokens (whole attention
    blocks), two prompts sharing three of them: the second hits the pages the first writes, on both ranks."""
    if family not in ("sdar", "llada2"):
        return _check_parity(tiny_checkpoints[family], random_prompts, method, cache=cache, llm_kw=TP)
    shared = [(11 * j) % 400 + 20 for j in range(48)]

    def hit(llm):
        assert sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits") > 0

    _check_parity(tiny_checkpoints[family], random_prompts + [shared + [7], shared + [8, 9]], method, cache=cache,
                  llm_kw={**TP, "block_size": 16, "enable_prefix_caching": True, "disable_log_stats": False},
                  inspect=hit)  # the hit's prefill of the rest of its prompt carries its first canvas


# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; LLaDA2's sharded experts on 2 ranks run in CI
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_llada2_with_expert_parallelism_equals_the_reference(tiny_checkpoints, random_prompts):
    """LLaDA2 with vLLM's expert parallelism over two ranks (each rank two of the four experts, whole; vLLM's
    all-reduce sums the ranks' shares): the reference engine's tokens and forwards, with drafts (PSD). On a CPU
    the experts' global ids are mapped to each rank's own first (``compat.cpu_experts_map_ids``): without it
    vLLM 0.32's CPU kernel reads past the rank's weights and the worker dies."""
    _check_parity(tiny_checkpoints["llada2"], random_prompts, "psd", llm_kw={**TP, "enable_expert_parallel": True})


# W4A16 on two ranks (its groups split with the row-parallel inputs): opt-in with PSD_TP_MATRIX=1
@pytest.mark.parametrize("scheme", ("W8A8", "W4A16") if os.environ.get("PSD_TP_MATRIX") else ("W8A8",))
# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; quantized checkpoints on one rank run in CI (test_quantization)
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_quantized_checkpoint_on_two_ranks(tmp_path, scheme):
    """A quantized dream-tiny sharded over two ranks (each its share of the int8 / int4 weights and their scales,
    the groups of 32 split with the inputs of the row-parallel layers) decodes as one rank does against the
    reference engine on the dequantized weights (the criterion of tests/test_quantization.py)."""
    from test_quantization import quantized_dream_decodes_as_the_reference_engine

    quantized_dream_decodes_as_the_reference_engine(tmp_path, scheme, llm_kw=TP)


# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; PRESTO on one rank runs in CI
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_presto_on_two_ranks_is_the_targets_greedy_decoding(heldout_prompts):
    """PRESTO: the AR target sharded over the ranks; the drafter is placed once per rank (each rank drafts
    the same trees from the same tokens, so no tree is sent between ranks)."""
    from vllm import LLM, SamplingParams

    from model_executor.ar_engine import AREngine

    want = [r.token_ids for r in AREngine.from_pretrained(DEFAULT_AR).generate(heldout_prompts, max_tokens=32)]
    llm = LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              speculative_config={"method": "psd", "mode": "presto"}, **TP)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in heldout_prompts],
                            SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
        stats = llm.collective_rpc("presto_stats")
    finally:
        del llm
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert len(stats) == 2 and stats[0]["steps"] == stats[1]["steps"] > 0  # both ranks verified every tree


def _sampled(llm_kw, prompts):
    """Seeded samples of every prompt, then unseeded samples and the greedy answers of every prompt."""
    from vllm import SamplingParams

    n = len(prompts)
    llm = _llm(DEFAULT_DLLM, llm_kw=llm_kw, decoding="psd")  # drafts and the confidence policy, sampled
    try:
        seeded = [SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=7 + i) for i in range(n)]
        # unseeded: a seed from each request's id, so a fresh draw each run; hot enough that 14 prompts all
        # drawing their greedy answers is out of reach (at 0.9 on four prompts it happened once in CI)
        unseeded = SamplingParams(max_tokens=24, temperature=1.5)
        greedy = SamplingParams(max_tokens=24, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 3],
                            seeded + [unseeded] * n + [greedy] * n, use_tqdm=False)
    finally:
        del llm
    return [list(o.outputs[0].token_ids) for o in outs]


# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; the ranks' shared seeds are checked every step by the layout digest
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_sampling_is_the_same_on_one_and_two_ranks(heldout_prompts):
    one, two = _sampled(None, heldout_prompts), _sampled(TP, heldout_prompts)
    n = len(heldout_prompts)
    seeded, unseeded, greedy = two[:n], two[n: 2 * n], two[2 * n:]
    assert seeded == one[:n]  # seeded: the same tokens
    assert greedy == one[2 * n:]
    assert all(unseeded)  # unseeded: decoded (the ranks' draws agreed, or the layout check fails the step)
    # sampled, not greedy: an engine that decoded greedily on both rank counts would pass the checks above (most
    # seeded samples are their greedy answers: this model is that confident)
    assert sum(u != g for u, g in zip(unseeded, greedy)) >= 2, "unseeded samples on two ranks are the greedy answers"


# ----------------------------------------------------------------------------------------------- served
def _serve(*args):
    from psd_plugin.vllm.server import start

    return start(["--max-model-len", "512", "--dtype", "float32", "--enforce-eager", *args], env=RANKS_ENV)


async def _streams(url, prompts, max_tokens=32, model="llada-tiny"):
    import aiohttp

    from test_reliability import _stream

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        return await asyncio.gather(*(_stream(s, url, model, p, max_tokens) for p in prompts),
                                    return_exceptions=True)


def _served_as_alone(prompts, srv=None, *server_args, model=None):
    """Every prompt streamed at once to ``srv`` (else a server of ``model``, default the embedded dLLM, started
    with ``server_args``, then stopped): each output equals the prompt decoded alone by the reference engine,
    none lost, and a server started here stops cleanly."""
    from model_executor.engine import ReferenceEngine

    engine = ReferenceEngine.from_pretrained(model or DEFAULT_DLLM)
    block = engine.spec.attention_block or 8
    alone = [engine.generate([p], max_tokens=32, method="psd", block_size=block)[0].token_ids for p in prompts]
    own = srv is None
    if own and model is not None:
        server_args = ("--model", str(model), "--served-model-name", "dllm", *server_args)
    srv = _serve(*server_args) if own else srv
    try:
        got = asyncio.run(_streams(srv.url, prompts, model="dllm" if model is not None else "llada-tiny"))
    finally:
        if own:
            assert srv.stop() == 0, f"SIGTERM did not shut the server down cleanly; log: {srv.log}"
    assert len(got) == len(prompts)
    for i, (g, a) in enumerate(zip(got, alone)):
        assert g == a, f"request {i}: served {g} != alone {a}"


@pytest.fixture(scope="module")
def tp_server():
    """A 2-rank server shared by the tests below (one start instead of one each); a test that finds it exited
    (the killed-worker test ends it) gets a new one."""
    servers = []

    def get():
        if not servers or servers[-1].proc.poll() is not None:
            servers.append(_serve("--tensor-parallel-size", "2", "--max-num-seqs", "32"))
        return servers[-1]

    yield get
    for srv in servers:
        srv.stop(timeout=30)


# CI's time: opt-in with PSD_TP_MATRIX=1 (47 s in CI on 2026-12-05); the 2-rank engine's parity tests above and the
# 64 streams on one rank (test_reliability) run in CI
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_two_rank_server_under_32_concurrent_streams(heldout_prompts, tp_server):
    _served_as_alone((heldout_prompts * 3)[:32], tp_server())


# CI's time: opt-in with PSD_TP_MATRIX=1 (86 s in CI on 2026-12-05); LLaDA2's data parallelism (its experts in
# lockstep across the ranks, the harder case) runs in CI below
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_two_data_parallel_ranks_answer_as_one(heldout_prompts):
    _served_as_alone(heldout_prompts, None, "--data-parallel-size", "2", "--max-num-seqs", "8")


# CI's time: opt-in with PSD_TP_MATRIX=1 (77 s here); each rank runs the one-engine async path CI covers
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_two_data_parallel_ranks_with_async_scheduling_answer_as_one(heldout_prompts):
    """A dense model's data-parallel ranks are engines of their own (vLLM's ``EngineCoreProc`` each, no lockstep,
    each with vLLM's multiprocess executor): each schedules a step while its last one runs (vLLM's
    ``--async-scheduling``), and every stream equals its prompt decoded alone by the reference engine."""
    srv = _serve("--data-parallel-size", "2", "--max-num-seqs", "8", "--async-scheduling")
    try:
        _served_as_alone(heldout_prompts, srv)
    finally:
        assert srv.stop() == 0, f"SIGTERM did not shut the server down cleanly; log: {srv.log}"
    log = open(srv.log).read()
    assert log.count("psd-plugin: async scheduling on") >= 2, "a rank's runner did not run async scheduling"


# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; 58 s
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_llada2_with_two_data_parallel_ranks_answers_as_one(tiny_checkpoints, random_prompts):
    """LLaDA2 with vLLM's MoE data parallelism: two engine ranks, each its own requests, in lockstep through the
    expert layers (the ranks agree on each forward's rows, the plugin's extra canvas rows included: the runner
    sizes vLLM's cross-rank padding on every row); every request equal to the reference engine alone."""
    _served_as_alone(random_prompts * 2, None, "--data-parallel-size", "2", "--max-num-seqs", "4",
                     model=tiny_checkpoints["llada2"])


# ------------------------------------------------------------------------------------ pipeline stages
PP = {"pipeline_parallel_size": 2}
# CI: a bidirectional model with a drafting method and the prefix cache; PSD_TP_MATRIX=1 runs every method on every
# family and cache (Dream with FreeDave and the dual cache, SDAR with LoPA, LLaDA2 with Spiffy ran in CI until
# 2026-12-06)
PP_CASES = ([(f, m, c) for f in ("llada", "dream") for c in ("prefix", "dual") for m in METHODS]
            + [(f, m, None) for f in ("sdar", "llada2") for m in METHODS]
            if os.environ.get("PSD_TP_MATRIX") else [("llada", "psd", "prefix")])


@pytest.mark.parametrize("family, method, cache", PP_CASES)
def test_two_pipeline_stages_equal_the_reference(tiny_checkpoints, random_prompts, family, method, cache):
    """Two pipeline stages (vLLM's layer ranges: 3 + 3 of the random checkpoints' layers, the embedding on the
    first, norm and LM head on the last): the reference engine's tokens and forwards. Only the last stage has
    logits, decodes and plans; the first lays out each step from the plan the scheduler ships with the schedule
    (the first canvas from the prompt, as the last plans it), and the last checks the shipped plan is its own.
    vLLM keeps two steps in flight (its batch queue): a request's next step waits for its last one's output.
    SDAR and LLaDA2 with vLLM's prefix cache on pages of 16 tokens, two prompts sharing three of them."""
    prompts, kw = random_prompts, dict(PP)
    if family in ("sdar", "llada2"):
        shared = [(11 * j) % 400 + 20 for j in range(48)]
        prompts = random_prompts + [shared + [7], shared + [8, 9]]
        kw.update(block_size=16, enable_prefix_caching=True)
    _check_parity(tiny_checkpoints[family], prompts, method, cache=cache, llm_kw=kw)


# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; preemption on one stage runs in CI
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_preemption_under_two_pipeline_stages_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts,
                                                            random_prompts):
    """vLLM preempts and resumes requests (a KV cache of 8 usable pages) while another step is in flight: a
    preempted request's drafts from its last step are dropped, it re-prefills, its blocks' first steps are
    replayed (dual cache) and its next step is planned again; outputs stay the reference engine's, greedy and
    seeded sampled alike."""
    from test_vllm_decoding import preemption_keeps_outputs

    preemption_keeps_outputs(monkeypatch, tiny_checkpoints, heldout_prompts, random_prompts, "llada", "dual", PP)


# CI's time (40 minutes on this 2-core machine): opt-in with PSD_TP_MATRIX=1 (verified 2026-11-29, 42 s)
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_two_tensor_ranks_by_two_pipeline_stages_equal_the_reference(monkeypatch, tiny_checkpoints, random_prompts):
    """Four ranks (TP 2 x PP 2; on this 2-core machine two ranks share each core): each stage's two ranks hold
    their share of its layers' heads, compare their step's layout every step, and lay out the plans the last
    stage's ranks decode on the gathered logits; tokens and forwards are the reference engine's."""
    from vllm import envs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0|1")
    envs.disable_envs_cache()
    try:
        _check_parity(tiny_checkpoints["llada"], random_prompts, "psd", cache="prefix", llm_kw={**TP, **PP})
    finally:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", RANKS_ENV["VLLM_CPU_OMP_THREADS_BIND"])
        envs.disable_envs_cache()  # the next engine reads the two-rank binding again


# opt-in with PSD_TP_MATRIX=1 (verified 2026-11-29, 44 s): the parity and preemption tests above already run
# several requests through both steps in flight
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_two_pipeline_stages_serve_concurrent_streams_as_alone(heldout_prompts):
    """A 2-stage server under 14 concurrent streams: vLLM keeps two steps in flight (its batch queue), so the
    requests run as two alternating groups, each request's next step scheduled once its last one's output is
    back; each output equals the prompt decoded alone by the reference engine."""
    _served_as_alone(heldout_prompts, None, "--pipeline-parallel-size", "2", "--max-num-seqs", "8")


KILLED_WORKER_EXIT_S = 60  # the bound docs/configuration.md states


def test_a_killed_worker_fails_the_requests_and_the_server_exits(heldout_prompts, tp_server):
    """A worker process dies (SIGKILL) while requests run: they fail with an error (not a hang) and the server
    exits within :data:`KILLED_WORKER_EXIT_S` seconds."""
    _killed_worker_ends_the_server(tp_server(), heldout_prompts, -1)


# CI's time: opt-in with PSD_TP_MATRIX=1 (47 s in CI on 2026-12-05); the killed tensor-parallel worker above runs
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_a_killed_pipeline_stage_fails_the_requests_and_the_server_exits(heldout_prompts):
    """The same with two pipeline stages, the first stage's worker killed (the last stage then waits on hidden
    states that never come): the requests fail and the server exits within the bound."""
    _killed_worker_ends_the_server(_serve("--pipeline-parallel-size", "2", "--max-num-seqs", "16"), heldout_prompts,
                                   0)


def _killed_worker_ends_the_server(srv, prompts, victim: int) -> None:
    import psutil

    try:
        workers = [p for p in psutil.Process(srv.proc.pid).children(recursive=True)
                   if "VllmWorker" in " ".join(p.cmdline()) or "Worker" in p.name()]
        assert workers, [(p.pid, p.name(), p.cmdline()[:3]) for p in psutil.Process(srv.proc.pid).children(True)]
        workers.sort(key=lambda p: " ".join(p.cmdline()))  # by title: Worker_PP0 / Worker_TP0 before ..._1

        async def run():
            pending = asyncio.ensure_future(_streams(srv.url, prompts * 4, max_tokens=256))
            await asyncio.sleep(2)
            os.kill(workers[victim].pid, signal.SIGKILL)
            return await pending
        t0 = time.monotonic()
        got = asyncio.run(run())
        srv.proc.wait(timeout=KILLED_WORKER_EXIT_S)
        elapsed = time.monotonic() - t0
    finally:
        srv.stop(timeout=5)
    assert any(isinstance(g, BaseException) for g in got), "no request saw the failure"
    # exited by itself (vLLM's API server shuts down on a dead engine, with code 0), within the bound
    assert srv.proc.returncode is not None and elapsed < KILLED_WORKER_EXIT_S, (srv.proc.returncode, elapsed)
    assert "died unexpectedly" in open(srv.log).read()


# ------------------------------------------------------------------------------------- ranks in step
def _check_on_rank(rank: int, init: str, rows: list[int], out) -> None:
    import torch.distributed as dist

    from attention_backends.step_batch import Rows, build_step_batch
    from psd_plugin.vllm.runner import PSDRunnerMixin

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    runner = PSDRunnerMixin.__new__(PSDRunnerMixin)
    runner._tp_group = dist.group.WORLD
    try:
        runner._check_ranks(build_step_batch([Rows(rows[rank], 5)]))
        out.put((rank, "ok"))
    except RuntimeError as e:
        out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rows, agree", [((3, 3), True), ((3, 4), False)])
def test_ranks_that_lay_out_different_steps_fail_the_step(tmp_path, rows, agree):
    """The per-step layout check (``PSDRunnerMixin._check_ranks``, one gloo all-reduce): two ranks with the
    same step go on; two whose steps differ both raise, naming the disagreement."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_check_on_rank, args=(r, f"file://{tmp_path}/rdv", list(rows), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    if agree:
        assert got == {0: "ok", 1: "ok"}
    else:
        assert all("ranks disagree on the step's layout" in m for m in got.values()), got


# CI's time (45 min on 2026-12-06): opt-in with PSD_TP_MATRIX=1; structured outputs on one rank run in CI
@pytest.mark.skipif(not os.environ.get("PSD_TP_MATRIX"), reason="opt-in: PSD_TP_MATRIX=1")
def test_structured_outputs_on_two_ranks(heldout_prompts):
    """Each rank compiles the request's grammar and applies the frontier rule on the gathered logits: JSON,
    regex, choice and free requests in one batch, tokens and forwards equal to the reference engine's."""
    import json

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    from model_executor.engine import ReferenceEngine
    from psd_plugin.vllm import compat
    from test_structured_outputs import CHOICE, MAX_TOKENS, REGEX, SCHEMA, _compiled

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    cons = [("json", SCHEMA), ("regex", REGEX), ("choice", CHOICE), (None, None)] * 2
    prompts = heldout_prompts[: len(cons)]
    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    ref = eng.generate(prompts, max_tokens=MAX_TOKENS, method="psd",
                       grammar=[None if k is None else _compiled(tok, eng.spec.vocab_size, k, v) for k, v in cons])
    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
              speculative_config={"method": "psd", "decoding": "psd"}, **TP)
    try:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                 structured_outputs=None if k is None else SO(**{k: v})) for k, v in cons]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        compat.shutdown(llm)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert list(o.outputs[0].token_ids) == r.token_ids, f"prompt {i} ({cons[i][0]})"
    json.loads(outs[0].outputs[0].text)
