"""Aborts at the awkward moments of a dLLM request (issue 49): before its first token (its first block still
decoding), and while it replays the first steps of earlier blocks after a preemption. The other requests decode
what they decode without it (the reference engine's tokens), the runner and the scheduler keep nothing of the
aborted request, and the engine serves on."""

import pytest
import torch

from model_executor.engine import ReferenceEngine

pytest.importorskip("vllm")

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("in_process_vllm")]


def _state(llm, settle: bool = False) -> dict:
    """What the runner holds (in process): the requests it serves (caller's ids) with their phases, its failures.
    ``settle``: first let the engine tell the runner of the requests that finished (vLLM does at its next step)."""
    from psd_plugin.vllm.compat import external_request_id

    for _ in range(3 if settle else 0):
        llm.llm_engine.step()

    def look(worker):
        r = worker.model_runner
        return {"served": {external_request_id(rid): s.req.phase for rid, s in r.served.items()},
                "failed": dict(r.failed)}

    return llm.collective_rpc(look)[0]


def _prompts(n_tokens, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in n_tokens]


def test_abort_before_the_first_token(tiny_checkpoints):
    from vllm import LLM, SamplingParams

    path = tiny_checkpoints["llada"]
    prompts = _prompts((20, 27, 9, 14))
    ref = ReferenceEngine.from_pretrained(path).generate(prompts[1:], max_tokens=32, method="psd")
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=128,
              speculative_config={"method": "psd", "decoding": "psd"})
    engine, params, outs = llm.llm_engine, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), {}
    try:
        engine.add_request("gone", {"prompt_token_ids": prompts[0]}, params)
        for _ in range(2):  # its prefill and first block step: nothing emitted yet (a block of 8 takes more)
            assert not [o for o in engine.step() if o.outputs[0].token_ids]
        assert _state(llm)["served"] == {"gone": "decode"}
        engine.abort_request(["gone"])
        for i, p in enumerate(prompts[1:]):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.request_id != "gone"
                if o.finished:
                    outs[o.request_id] = list(o.outputs[0].token_ids)
        state = _state(llm, settle=True)
    finally:
        llm = engine = None
    assert [outs[f"r{i}"] for i in range(3)] == [r.token_ids for r in ref]
    assert state == {"served": {}, "failed": {}}


def test_abort_during_a_preemption_replay(monkeypatch, tiny_checkpoints):
    """As test_vllm_decoding's preemption test (priority scheduling preempts low-priority requests in the middle of
    a block; with ``refresh: last`` they replay every earlier block's first step): a preempted request is aborted
    while its replays run."""
    from vllm import LLM, SamplingParams

    from model_executor.dllm_request import DLLMRequest

    path = tiny_checkpoints["llada"]
    prompts = _prompts((20, 27, 9, 14, 31, 22, 17, 25))
    low, high = prompts[:2], prompts[2:]
    knobs = {"cache": "dual", "refresh": "last"}
    ref = ReferenceEngine.from_pretrained(path).generate(low + high, max_tokens=48, method="psd", **knobs)
    replaying = []
    plan = DLLMRequest.plan_rebuild

    def spy(self):
        replaying.append(self.prompt)
        return plan(self)

    monkeypatch.setattr(DLLMRequest, "plan_rebuild", spy)
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=128, block_size=16,
              num_gpu_blocks_override=14, scheduling_policy="priority",
              speculative_config={"method": "psd", "decoding": "psd", **knobs})
    engine, params, outs = llm.llm_engine, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), {}
    aborted = None
    try:
        for i, p in enumerate(low):
            engine.add_request(f"low{i}", {"prompt_token_ids": p}, params, priority=1)
        for _ in range(8):
            engine.step()
        for i, p in enumerate(high):
            engine.add_request(f"high{i}", {"prompt_token_ids": p}, params, priority=0)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = (o.outputs[0].finish_reason, list(o.outputs[0].token_ids))
            if aborted is None and replaying:  # a replay was planned: abort that request now, mid-chain
                phases = _state(llm)["served"]
                rebuilding = [rid for rid, ph in phases.items() if ph == "rebuild"]
                if rebuilding:
                    aborted = rebuilding[0]
                    engine.abort_request([aborted])
        state = _state(llm, settle=True)
    finally:
        llm = engine = None
    assert aborted is not None, "no request was aborted while replaying"
    names = [f"low{i}" for i in range(2)] + [f"high{i}" for i in range(6)]
    for name, r in zip(names, ref):
        if name != aborted:
            assert outs[name] == ("length", r.token_ids), name
    assert aborted not in outs or outs[aborted][0] == "abort"
    assert state == {"served": {}, "failed": {}}
