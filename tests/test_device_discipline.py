"""Device discipline, checked on this CPU: the decoding path with its logits on a (stand-in) accelerator and its
decoder state on the host mixes no devices, and reads the device once per step (``tests/device_proxy.py``)."""

from __future__ import annotations

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


def _on_device(engine, monkeypatch, proxy):
    """The engine's logits come back "on the device"; everything after runs under ``proxy``."""
    forward = type(engine)._forward

    def device_forward(self, seqs, batch, kept):
        out = forward(self, seqs, batch, kept)
        proxy.__enter__()
        return mark(out)

    step = type(engine)._step

    def proxied_step(self, *a, **k):
        try:
            return step(self, *a, **k)
        finally:
            if proxy in torch.overrides._get_current_function_mode_stack():
                proxy.__exit__(None, None, None)

    monkeypatch.setattr(type(engine), "_forward", device_forward)
    monkeypatch.setattr(type(engine), "_step", proxied_step)


CASES = [(m, "plain") for m in METHODS] + [("confidence", "logprobs"), ("spiffy", "logprobs"), ("confidence", "rules")]


@pytest.mark.parametrize("method, case", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_decoding_with_device_logits_and_host_state(engine, prompts, monkeypatch, method, case):
    """Every method, from logits on the device: the same tokens and NFE as on the host, no operation mixes a
    device tensor with a host one, and the device is read once per step (the predictions' one copy), plus once
    per step for what needs the logits themselves (Spiffy's top tokens, logprobs)."""
    options = {"plain": {}, "logprobs": {"logprobs": 2},
               "rules": {"rules": LogitsRules(logit_bias={5: 2.0, 9: -3.0}, min_tokens=3,
                                              stop_token_ids=(engine.spec.eos_token_id,))}}[case]
    if method == "spiffy":
        from model_executor.decoding import load_graph
        from psd_plugin import default_graph

        options = {**options, "policy": "confidence", "graph": load_graph(default_graph(DEFAULT_DLLM, "confidence"))}
    want = engine.generate(prompts, method=method, max_tokens=24, **options)
    steps0 = engine.step_time["steps"]
    proxy = DeviceProxy()
    _on_device(engine, monkeypatch, proxy)
    got = engine.generate(prompts, method=method, max_tokens=24, **options)
    steps = engine.step_time["steps"] - steps0
    assert [(r.token_ids, r.nfe) for r in got] == [(r.token_ids, r.nfe) for r in want]
    assert not proxy.reads, sorted(set(proxy.reads))
    per_step = {site: proxy.copies.count(site) / steps for site in set(proxy.copies)}
    assert per_step.pop("model_executor/decoding/base.py:predict_rows") == 1.0
    extra = set()
    if method == "spiffy":
        extra.add("model_executor/decoding/base.py:top_tokens")
    if options.get("logprobs"):
        extra.add("model_executor/dllm_request.py:record_logprobs")
    assert set(per_step) <= extra and all(v <= 1.0 for v in per_step.values()), per_step


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
