"""Where a threshold policy's decision costs least: on the host after the predictions' copy (what the engines do
now), or where the logits are (:func:`~model_executor.decoding.policies.commit_rows`), eagerly or captured in a
CUDA graph with the predictions' reduction.

    .venv/bin/python benchmarks/device_commit.py [--device cuda] [--vocab 126464] [--block 32] \
        [--requests 1,16,64] [--policy confidence] [--dtype bfloat16] [--out benchmarks/results]

Needs only PyTorch and this repository (it runs on the GPU image as it is, no vLLM). Per request count ``R``:
``R`` blocks of ``--block`` positions, about half of them still masked, one canvas each (confidence decoding
with the dual cache); random logits ``[R * block, vocab]`` in ``--dtype``, scaled so the confidences spread
around the threshold. Three ways to take one step's decision, timed from logits ready on the device to the next
states ready on the host (median of ``--iters`` after warm-up; the device synchronised before each):

- ``host``: what the engines do: :func:`~model_executor.decoding.predict_rows` (the top-1 and its probability of
  every row where the logits are, one copy to the host) then :meth:`PolicyDecoder.update_batch` (numpy);
- ``device``: the same reduction, then :func:`commit_rows` with the policy's tensor form
  (:func:`device_policy`, on the CPU too) where the logits are, then one copy of the next
  states to the host;
- ``graph`` (CUDA only): the ``device`` path captured once in a CUDA graph (reduction and commit; fixed shapes),
  replayed, then the same copy.

The device paths' next states are checked equal to the numpy commit of the same predictions (``equal``: the
decisions are the same bit for bit), and whether those predictions are bit for bit :func:`predict_rows`'
(``predictions_equal``: a reduction over another number of rows may sum in another order); the ``host``
path's decision alone (``host_decide_ms``: the numpy commit after the copy) is given beside them. On a CPU the logits
are on the host: the figures are host-bound and say what a torch op costs there against numpy's, not what a GPU
would do.

Then the engines' own step, per method of ``--methods`` (confidence, PSD, LoPA, FreeDave, Spiffy by default) and request count:
:func:`~model_executor.dllm_request.decode_step` over requests in mid-decode (PSD verifying its drafts), once
decided on the host and once where the logits are, from the same state and logits (``equal``: the same next
states). This is the trade the engines make on a GPU now (docs/architecture.md); on a CPU its device path runs on
the tests' stand-in device, a dry run whose times are not a device's. Writes ``device_commit_<device>.json`` /
``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model_executor.decoding import PolicyDecoder, predict_rows, propose_all, update_all  # noqa: E402
from model_executor.decoding.base import RowPredictions  # noqa: E402
from model_executor.decoding.base import confidence_dtype  # noqa: E402
from model_executor.decoding.policies import commit_rows, device_policy, make_policy  # noqa: E402
from benchmarks.verify_cost import captured  # noqa: E402

MASK = 0  # the mask token of the benchmark's vocabulary (excluded from predictions, as the engines do)


def reduce_rows(logits: torch.Tensor, tokens: torch.Tensor, conf: torch.Tensor) -> None:
    """The top-1 and its probability of every row, into ``tokens``/``conf`` where the logits are, as
    :func:`predict_rows` computes them for a step that fits one chunk (mask token excluded first)."""
    logits[:, MASK] = float("-inf")
    best, idx = logits.max(-1)
    cdt = conf.dtype
    z = (logits.to(cdt) - best[:, None].to(cdt)).exp_().sum(-1)
    tokens.copy_(idx)
    conf.copy_(z.reciprocal_())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int) -> tuple[float, object]:
    out = None
    for _ in range(3):
        out = fn()
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, out


def case(R: int, args, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(R)
    L, V = args.block, args.vocab
    dtype = getattr(torch, args.dtype)
    states = torch.randint(1, 1000, (R, L), generator=g)
    states[torch.rand(R, L, generator=g) < 0.5] = MASK
    # logits whose top-1 probability spreads around the threshold: a peak of random height over a flat floor
    logits = torch.randn(R * L, V, generator=g) * 0.5
    logits[torch.arange(R * L), torch.randint(1, V, (R * L,), generator=g)] += torch.rand(R * L, generator=g) * 16
    logits = logits.to(dtype).to(device)
    policy = make_policy(args.policy, threshold=args.threshold)
    # the tensor form itself (a policy takes it for confidences on a device; here on the CPU too)
    tensor_policy = partial(device_policy, name=args.policy, threshold=args.threshold)
    rows_h = torch.arange(R * L).view(R, L)
    out: dict = {"requests": R, "rows": R * L}

    def host():
        decs = [PolicyDecoder(s, MASK, policy) for s in states]  # (not timed: the engines keep theirs)
        props = propose_all(decs)
        sync(device)
        t0 = time.perf_counter()
        preds = predict_rows(logits.clone(), mask_id=MASK)  # (a clone: predict_rows writes the mask column)
        t1 = time.perf_counter()
        update_all(decs, props, preds, [[r * L] for r in range(R)])
        t2 = time.perf_counter()
        host.times = (t2 - t0, t2 - t1)
        return torch.stack([d.state for d in decs])

    cdt = confidence_dtype(dtype)
    tok = torch.empty(R * L, dtype=torch.long, device=device)
    conf = torch.empty(R * L, dtype=cdt, device=device)
    rows_d, states_d = rows_h.to(device), states.to(device)
    work = torch.empty_like(logits)
    pinned = torch.empty((R, L), dtype=torch.long, pin_memory=device.type == "cuda")

    def device_step():
        work.copy_(logits)
        reduce_rows(work, tok, conf)
        return commit_rows(tensor_policy, tok, conf, rows_d, states_d, MASK)

    def device_path():
        pinned.copy_(device_step(), non_blocking=device.type == "cuda")
        sync(device)
        return pinned.clone()

    whole, decide = [], []
    for i in range(args.iters + 3):
        want = host()
        if i >= 3:  # after warm-up
            whole.append(host.times[0])
            decide.append(host.times[1])
    out["host_ms"] = statistics.median(whole) * 1e3
    out["host_decide_ms"] = statistics.median(decide) * 1e3
    out["device_ms"], got = timed(device_path, device, args.iters)
    # the decision checked on the device path's own predictions (a reduction's summation order may depend on how
    # many rows it runs over, so predict_rows' chunks could round a confidence differently: counted apart)
    out["predictions_equal"] = bool(torch.equal(tok.cpu(), predict_rows(logits.clone(), mask_id=MASK).tokens)
                                    and torch.equal(conf.cpu(), predict_rows(logits.clone(), mask_id=MASK).conf))
    decs = [PolicyDecoder(s, MASK, policy) for s in states]
    update_all(decs, propose_all(decs), RowPredictions(work, tok.cpu(), conf.cpu()), [[r * L] for r in range(R)])
    want = torch.stack([d.state for d in decs])
    out["equal"] = bool(torch.equal(got, want))
    if device.type == "cuda":
        replay, states_out = captured(device_step)  # (three warm-up runs on a side stream, then the capture)

        def graph_path():
            replay()
            pinned.copy_(states_out, non_blocking=True)
            sync(device)
            return pinned.clone()

        out["graph_ms"], got = timed(graph_path, device, args.iters)
        out["equal"] = out["equal"] and bool(torch.equal(got, want))
    out["committed"] = int((want != states).sum())
    return out


def engine_case(method: str, R: int, args, device: torch.device) -> dict:
    """The engines' own step (:func:`~model_executor.dllm_request.decode_step`: predictions, the methods' update,
    the copies) of ``R`` requests in mid-decode, decided on the host (the predictions' copy, then numpy) and where
    the logits are (:func:`~model_executor.decoding.base.decide_on_device`), from the same state and logits: ms
    from logits ready to the decoders stepped, and whether the two left the same states. On a CPU the device
    path runs on the stand-in device of ``tests/device_proxy.py`` (a dry run: its times are not a device's)."""
    import copy

    import model_executor.dllm_request as dllm
    from attention_backends.step_batch import build_step_batch
    from model_executor.decoding import make_decoder
    from model_executor.dllm_request import DLLMRequest, decode_step

    sys.path.insert(0, str(ROOT / "tests"))
    from device_proxy import DeviceProxy, mark

    L, V = args.block, args.vocab
    dtype = getattr(torch, args.dtype)
    knobs = {"threshold": args.threshold, **({"depth": 3} if method == "psd" else {})}
    if method == "spiffy":  # the embedded model's draft graph (its formulas apply to any block)
        from model_executor.decoding import load_graph
        from psd_plugin import DEFAULT_DLLM, default_graph

        knobs = {**knobs, "policy": "confidence", "graph": load_graph(default_graph(DEFAULT_DLLM, "confidence"))}
    g = torch.Generator().manual_seed(R)

    def make(block):
        return make_decoder(method, block, MASK, **knobs)

    def plan(reqs):
        from model_executor.decoding import propose_all

        steps = [r.plan(p) for r, p in zip(reqs, propose_all([r.dec for r in reqs]))]
        kept = torch.cat([st.kept for st in steps])
        return steps, kept, build_step_batch(steps).canvas_rows

    def logits_for(n: int) -> torch.Tensor:
        x = torch.randn(n, V, generator=g) * 0.5
        x[torch.arange(n), torch.randint(2, V, (n,), generator=g)] += torch.rand(n, generator=g) * 16
        return x.to(dtype).to(device)

    def step(reqs, x, on_device: bool):
        steps, kept, firsts = plan(reqs)
        x = x.clone()
        stand_in = device.type == "cpu" and on_device
        sync(device)
        t = time.perf_counter()
        with DeviceProxy() if stand_in else contextlib.nullcontext():
            decode_step(mark(x) if stand_in else x, kept, MASK, reqs, steps, firsts, failed={})
        sync(device)
        dt = time.perf_counter() - t
        for r, st in zip(reqs, steps):
            r.stepped(st)
        return dt

    reqs = [DLLMRequest([2 + (i + j) % 97 for j in range(16)], 4 * L, L, make, MASK, 1, ignore_eos=True)
            for i in range(R)]
    def rows_of(reqs) -> int:  # the next step's logits rows (planned on a copy: planning marks a request)
        return int(plan(copy.deepcopy(reqs))[1].sum())

    for _ in range(2):  # into mid-decode: PSD verifies drafts from here
        step(reqs, logits_for(rows_of(reqs)), on_device=False)
    x = logits_for(rows_of(reqs))
    out: dict = {"method": method, "requests": R, "rows": x.shape[0]}
    original = dllm.decide_on_device
    results = {}
    for mode in ("host", "device"):
        dllm.decide_on_device = original if mode == "device" else (lambda decoders: False)
        times = []
        try:
            for i in range(args.iters + 3):
                trial = copy.deepcopy(reqs)
                dt = step(trial, x, on_device=mode == "device")
                if i >= 3:
                    times.append(dt)
        finally:
            dllm.decide_on_device = original
        out[f"{mode}_ms"] = statistics.median(times) * 1e3
        results[mode] = [r.tokens.tolist() for r in trial]
    out["equal"] = results["host"] == results["device"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=126464, help="LLaDA-8B's vocabulary by default")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--requests", default="1,16,64")
    ap.add_argument("--policy", default="confidence", choices=("static", "confidence", "localleap"))
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--methods", default="confidence,psd,lopa,freedave,spiffy",
                    help="the engines' step of these methods, host- against device-decided (empty: none)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # (the capture's side stream is the current device's)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    rows = [case(int(r), args, device) for r in args.requests.split(",")]
    engine = [engine_case(m, int(r), args, device) for m in filter(None, args.methods.split(","))
              for r in args.requests.split(",")]
    for r in rows + engine:
        print(json.dumps(r), flush=True)
    if not all(r["equal"] for r in rows + engine):
        raise SystemExit("device_commit: the paths decided differently")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"device_commit_{device.type}"
    meta = {"device": name, "vocab": args.vocab, "block": args.block, "policy": args.policy,
            "threshold": args.threshold, "dtype": args.dtype, "torch": torch.__version__}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "engine": engine}, indent=1) + "\n")
    cols = ["requests", "rows", "committed", "host_ms", "host_decide_ms", "device_ms"] + \
           (["graph_ms"] if device.type == "cuda" else []) + ["equal", "predictions_equal"]
    lines = [f"Deciding a {args.policy} step (threshold {args.threshold}), {args.dtype} logits of {args.vocab} "
             f"tokens, block {args.block}, on {name} (torch {torch.__version__}); ms from logits ready to next "
             "states on the host, median" + ("; host-bound: the logits are on the host" if device.type == "cpu" else ""),
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    if engine:
        cols = ["method", "requests", "rows", "host_ms", "device_ms", "equal"]
        lines += ["", "The engines' step (`decode_step`: predictions, update, copies) of requests in mid-decode, decided "
                  "on the host and where the logits are; ms from logits ready to the decoders stepped, median" +
                  ("; on this CPU the device path runs on the tests' stand-in device: a dry run, its times are not "
                   "a device's" if device.type == "cpu" else ""),
                  "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in engine:
            lines.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
                         + " |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
