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
    predictions' one copy), plus at most once for what needs the logits themselves (Spiffy's top tokens,
    logprobs)."""
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
    for n, copies in enumerate(steps):  # the most per step, not the mean: a step may not make up for another
        assert copies.pop("model_executor/decoding/base.py:predict_rows", 0) == 1, (n, copies)
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
