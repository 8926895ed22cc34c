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
# every method decides where the logits are (its one copy brings the decisions back; Spiffy's the top tokens at the
# positions its next drafts read too); a step with a grammar decides on the host, after the predictions' one copy
ONE_COPY = {m: "model_executor/decoding/base.py:read_back"
            for m in ("static", "confidence", "localleap", "psd", "lopa", "freedave", "spiffy", "joint_threshold")}
CASES = [(m, "plain") for m in METHODS] + [("confidence", "logprobs"), ("spiffy", "logprobs"), ("confidence", "rules"),
                                           ("confidence", "penalties"), ("confidence", "sampled"), ("psd", "sampled"),
                                           ("freedave", "sampled"), ("lopa", "sampled"), ("lopa", "rules"),
                                           ("spiffy", "sampled")]


@pytest.mark.parametrize("method, case", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_decoding_with_device_logits_and_host_state(engine, prompts, monkeypatch, method, case):
    """Every method, from logits on the device: the same tokens and NFE as on the host, no operation mixes a
    device tensor with a host one (proposals included), and every step reads the device exactly once (the
    predictions' one copy; for the spatial policies and PSD, which decide on the device, the decisions' one copy),
    plus at most once for what needs the logits themselves (logprobs)."""
    options = {"plain": {}, "logprobs": {"logprobs": 2}, "penalties": {"rules": PENALTIES},
               "sampled": {"temperature": 0.8, "seed": 3},
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
    if options.get("logprobs"):
        extra.add("model_executor/dllm_request.py:record_logprobs")
    one = ONE_COPY.get(method, "model_executor/decoding/base.py:predict_rows")
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


def _graph(first_ranks_only: bool = False):
    """A small Spiffy draft graph: level-1 and level-2 roots, a second token rank, deeper nodes with parents
    (``first_ranks_only``: no formula reads a token past the first rank)."""
    from model_executor.decoding import DraftGraph, GraphNode

    formulas = [[(1, 1)], [(1, 1), (2, 1)], [(1, 2)], [(2, 1)], [(1, 1), (2, 1), (3, 1)], [(1, 1), (2, 2)]]
    parents = [[], [0, 3], [], [], [1], [0]]
    if first_ranks_only:
        formulas, parents = [formulas[i] for i in (0, 1, 3, 4)], [[], [0, 2], [], [1]]
    return DraftGraph(format_version=1, model="toy", block_size=4, base_policy="confidence", threshold=0.9,
                      lookahead=3, nodes=[GraphNode(formula=f, level=len(f), parents=p)
                                          for f, p in zip(formulas, parents)])


DEVICE_CASES = [("confidence", {"threshold": 0.3}), ("localleap", {"threshold": 0.5, "relaxed_threshold": 0.2}),
                ("psd", {"threshold": 0.3, "depth": 3}), ("psd", {"threshold": 0.5, "depth": 3, "dag_shape": "skip"}),
                ("freedave", {"steps": 3}), ("joint_threshold", {"threshold": 0.5, "edit_threshold": 0.6}),
                ("lopa", {"threshold": 0.3, "branches": 3}),
                ("lopa", {"policy": "localleap", "threshold": 0.6, "relaxed_threshold": 0.2, "branches": 5}),
                ("lopa", {"policy": "static", "branches": 2}),
                ("spiffy", {"policy": "confidence", "threshold": 0.3, "graph": _graph(), "budget": 3}),
                ("spiffy", {"policy": "static", "graph": _graph(), "budget": 2}),
                ("spiffy", {"policy": "confidence", "threshold": 0.3, "graph": _graph(True), "budget": 3})]


@pytest.mark.parametrize("method, knobs", DEVICE_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(DEVICE_CASES)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_methods_decide_on_the_device_and_a_nonfinite_block_fails_alone(method, knobs, temperature):
    """Steps whose logits are on the device decide there (one copy back, from the method's update), step after
    step as the host decides from the same logits, greedy or sampled, with requests on their block's first
    forward beside verifying ones (PSD); a request whose logits hold a NaN fails alone (the serving engine's
    ``failed``) and the others step as on the host; without ``failed`` (the reference engine) the step raises."""
    from attention_backends.step_batch import build_step_batch
    from model_executor.decoding import Sampling, logits_map, make_decoder, merge_stats, propose_all
    from model_executor.dllm_request import DLLMRequest, decode_step

    M, V, EOS = 30, 40, 29
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(96, V, generator=g) * 3 for _ in range(6)]
    sampling = Sampling(temperature, seed=7) if temperature else None

    def run(on_device: bool, poison_at: int | None, failed):
        reqs = [DLLMRequest(list(range(1, 4 + i)), 12 + 4 * i, 4,
                            lambda b: make_decoder(method, b, M, sampling=sampling, **knobs), M, EOS)
                for i in range(4)]
        trace, copies = [], []
        for n, x in enumerate(logits):
            live = [i for i, r in enumerate(reqs) if not r.done and (failed is None or i not in failed)]
            if not live:
                break
            steps = [reqs[i].plan(p) for i, p in zip(live, propose_all([reqs[i].dec for i in live]))]
            kept = torch.cat([st.kept for st in steps])
            firsts = build_step_batch(steps).canvas_rows
            x = x[: int(kept.sum())].clone()
            if n == poison_at and 1 in live:  # a logits row of the second request's first canvas
                j = live.index(1)
                at = logits_map(kept)[firsts[j][0]: firsts[j][0] + steps[j].block_len]
                x[int(at[at >= 0][0]), 5] = float("nan")
            step_failed = None if failed is None else {}
            with DeviceProxy() as proxy:
                decode_step(mark(x) if on_device else x, kept, M, [reqs[i] for i in live], steps, firsts,
                            failed=step_failed)
            copies.append(list(proxy.copies))
            for j, (i, st) in enumerate(zip(live, steps)):
                if step_failed and j in step_failed:
                    failed[i] = step_failed[j]
                    continue
                reqs[i].stepped(st)
            trace.append([reqs[i].tokens.tolist() for i in live])
        # the methods' counters too (the blocks done, and the current one's decoder)
        trace.append([merge_stats([r.stats] + ([r.dec.stats()] if r.dec is not None else [])) for r in reqs])
        return trace, copies

    host, _ = run(False, None, {})
    dev, copies = run(True, None, {})
    assert dev == host and all(len(c) == 1 for c in copies), copies
    assert len(dev) > 2  # several steps: PSD verifies beside first forwards
    failed_host, failed_dev = {}, {}
    host, _ = run(False, 2, failed_host)
    dev, _ = run(True, 2, failed_dev)
    assert set(failed_dev) == set(failed_host) == {1} and "non-finite" in str(failed_dev[1])
    assert dev == host
    with pytest.raises(RuntimeError, match="non-finite"):
        run(True, 2, None)


def test_uploads_go_through_one_pinned_buffer_per_key(monkeypatch):
    """:class:`~model_executor.staging.Staging`: on a GPU each key's upload is copied into one pinned buffer,
    reused while it is large enough and grown when not (the copy to the device leaves from it); on the host no
    copy at all. (A CPU build cannot pin memory: the allocation is checked for ``pin_memory`` and made plain.)"""
    from model_executor.staging import Staging

    pinned = []
    empty = torch.empty

    def empty_pinned(*shape, pin_memory=False, **kw):
        pinned.append(pin_memory)
        return empty(*shape, **kw)

    st = Staging()
    host = torch.arange(6).view(2, 3)
    assert st.upload("a", host, torch.device("cpu")) is host and not pinned
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty_pinned)
    with DeviceProxy():
        dev = torch.device("cuda", 0)
        first = st.upload("a", host, dev)
        again = st.upload("a", host + 1, dev)
        big = st.upload("a", torch.arange(5000), dev)
        other = st.upload("b", host.double(), dev)
        assert first.device.type == "cuda" and other.dtype == torch.float64
    assert pinned == [True, True, True]  # "a" once, grown once; "b" once
    assert torch.equal(again.as_subclass(torch.Tensor), host + 1) and torch.equal(big.as_subclass(torch.Tensor),
                                                                                 torch.arange(5000))
    bufs = st._buffers
    assert bufs[("a", torch.long)].numel() == 5000 and bufs[("b", torch.float64)].numel() == 1 << 12
