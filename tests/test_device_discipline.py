"""Device discipline, checked on this CPU: the decoding path (the decoders' proposals, the step's rules,
predictions and updates) with its logits on a (stand-in) accelerator and its decoder state on the host mixes no
devices, and reads the device once in every step (``tests/device_proxy.py``)."""

from __future__ import annotations

import collections

import pytest
import torch

from model_executor.decoding import LogitsRules
from psd_plugin import DEFAULT_DLLM

from device_proxy import DeviceMixing, DeviceProxy, mark

METHODS = ("static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd")


@pytest.fixture(scope="module")
def engine():
    from model_executor.engine import ReferenceEngine

    return ReferenceEngine.from_pretrained(DEFAULT_DLLM)


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts[::3]


def _on_device(engine, monkeypatch, proxy, steps):
    """The engine's logits come back "on the device"; the rest of every step runs under ``proxy``: the decoders'
    proposals (``propose_all``), which read what earlier steps left them, the plan and batch, and everything
    after the forward. ``steps`` gets each step's device-to-host copies (a Counter by site)."""
    forward = type(engine)._forward

    def device_forward(self, seqs, batch, kept):
        proxy.__exit__(None, None, None)  # the model itself runs on the host
        try:
            out = forward(self, seqs, batch, kept)
        finally:
            proxy.__enter__()
        return mark(out)

    step = type(engine)._step

    def proxied_step(self, *a, **k):
        first = len(proxy.copies)
        with proxy:
            out = step(self, *a, **k)
        steps.append(collections.Counter(proxy.copies[first:]))
        return out

    monkeypatch.setattr(type(engine), "_forward", device_forward)
    monkeypatch.setattr(type(engine), "_step", proxied_step)


PENALTIES = LogitsRules(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
CASES = [(m, "plain") for m in METHODS] + [("confidence", "logprobs"), ("spiffy", "logprobs"), ("confidence", "rules"),
                                           ("confidence", "penalties")]


@pytest.mark.parametrize("method, case", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_decoding_with_device_logits_and_host_state(engine, prompts, monkeypatch, method, case):
    """Every method, from logits on the device: the same tokens and NFE as on the host, no operation mixes a
    device tensor with a host one (proposals included), and every step reads the device exactly once (the
    predictions' one copy; for the spatial policies, which decide on the device, the next states' one copy),
    plus at most once for what needs the logits themselves (Spiffy's top tokens, logprobs)."""
    options = {"plain": {}, "logprobs": {"logprobs": 2}, "penalties": {"rules": PENALTIES},
               "rules": {"rules": LogitsRules(logit_bias={5: 2.0, 9: -3.0}, min_tokens=3,
                                              stop_token_ids=(engine.spec.eos_token_id,))}}[case]
    if method == "spiffy":
        from model_executor.decoding import load_graph
        from psd_plugin import default_graph

        options = {**options, "policy": "confidence", "graph": load_graph(default_graph(DEFAULT_DLLM, "confidence"))}
    want = engine.generate(prompts, method=method, max_tokens=24, **options)
    steps0 = engine.step_time["steps"]
    proxy, steps = DeviceProxy(), []
    _on_device(engine, monkeypatch, proxy, steps)
    got = engine.generate(prompts, method=method, max_tokens=24, **options)
    assert [(r.token_ids, r.nfe) for r in got] == [(r.token_ids, r.nfe) for r in want]
    assert len(steps) == engine.step_time["steps"] - steps0 > 0
    assert not proxy.reads, sorted(set(proxy.reads))
    extra = set()
    if method == "spiffy":
        extra.add("model_executor/decoding/base.py:top_tokens")
    if options.get("logprobs"):
        extra.add("model_executor/dllm_request.py:record_logprobs")
    # the spatial policies decide where the logits are (their one copy brings the next states back); the other
    # methods decide on the host, after the predictions' one copy
    one = ("model_executor/decoding/policies.py:_update_on_device" if method in ("static", "confidence", "localleap")
           else "model_executor/decoding/base.py:predict_rows")
    for n, copies in enumerate(steps):  # the most per step, not the mean: a step may not make up for another
        assert copies.pop(one, 0) == 1, (n, copies)
        assert set(copies) <= extra and max(copies.values(), default=0) <= 1, (n, copies)


def test_the_proxy_catches_mixing_and_reads():
    """The stand-in device raises where CUDA would, and counts what would sync."""
    with DeviceProxy() as proxy:
        d, h = mark(torch.arange(4.0)), torch.ones(4)
        with pytest.raises(DeviceMixing):
            d + h
        with pytest.raises(DeviceMixing):
            h[d.long() % 4]
        assert (d + 1).device.type == "cuda" and (d * torch.tensor(2.0)).device.type == "cuda"  # host scalars: fine
        assert h.to(d.device).device.type == "cuda"
        assert d.cpu().device.type == "cpu" and len(proxy.copies) == 1
        bool(d.any())
        d.tolist()
        assert len(proxy.reads) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_policies_decide_on_the_device_and_a_nonfinite_block_fails_alone(temperature):
    """A step of confidence decoders whose logits are on the device decides there (one copy back, from the policy
    update), as the host decides from the same logits, greedy or sampled; a request whose logits hold a NaN fails
    alone (the serving engine's ``failed``), the others step as on the host; without ``failed`` (the reference
    engine) the step raises."""
    from attention_backends.step_batch import build_step_batch
    from model_executor.decoding import PolicyDecoder, Sampling, make_policy, propose_all
    from model_executor.dllm_request import DLLMRequest, decode_step

    M, V, EOS = 30, 40, 29
    g = torch.Generator().manual_seed(3)

    def requests():
        sampling = Sampling(temperature, seed=7) if temperature else None

        def make(block):
            d = PolicyDecoder(block, M, make_policy("confidence", threshold=0.3))
            d.sampling = sampling
            return d

        return [DLLMRequest(list(range(1, 4 + i)), 12, 4, make, M, EOS) for i in range(3)]

    def run(on_device: bool, logits, failed):
        reqs = requests()
        steps = [r.plan(p) for r, p in zip(reqs, propose_all([r.dec for r in reqs]))]
        kept = torch.cat([st.kept for st in steps])
        firsts = build_step_batch(steps).canvas_rows
        x = logits[: int(kept.sum())].clone()
        with DeviceProxy() as proxy:
            decode_step(mark(x) if on_device else x, kept, M, reqs, steps, firsts, failed=failed)
        return [r.dec.state.tolist() for r in reqs], proxy

    logits = torch.randn(64, V, generator=g) * 3
    host, _ = run(False, logits, {})
    dev, proxy = run(True, logits, {})
    assert dev == host and len(proxy.copies) == 1 and not proxy.reads, (proxy.copies, proxy.reads)
    assert proxy.copies[0] == "model_executor/decoding/policies.py:_update_on_device"
    poisoned = logits.clone()
    poisoned[4 + 1, 5] = float("nan")  # a row of the second request's block (each block: 4 rows)
    failed_host, failed_dev = {}, {}
    host, _ = run(False, poisoned, failed_host)
    dev, _ = run(True, poisoned, failed_dev)
    assert set(failed_dev) == set(failed_host) == {1} and "non-finite" in str(failed_dev[1])
    assert [s for i, s in enumerate(dev) if i != 1] == [s for i, s in enumerate(host) if i != 1]
    with pytest.raises(RuntimeError, match="non-finite"):
        run(True, poisoned, None)
