"""Tensor and pipeline parallelism on this machine: 1 rank against 2, tokens/s and the communication share.

    .venv/bin/python benchmarks/parallel.py [--limit 10] [--methods confidence,psd] [--layouts 1,tp2,pp2] [--model PATH]

vLLM's CPU build, eager (so the collectives can be timed), float32, greedy, block 8, max_tokens 32, the
held-out prompts (``--limit`` per task) submitted at once, after a warm-up. With 2 ranks each rank gets one
of the 2 cores (``VLLM_CPU_OMP_THREADS_BIND='0|1'``); with 1 rank it has both (``'0-1'``), so the comparison
is the same machine split two ways: no speedup is expected at this size. Per run: TPF, NFE per sample,
tokens/s, and, per rank 0, the seconds inside the tensor-parallel collectives (all-reduce after the
attention output and MLP projections, the logits' all-gather, the plugin's per-step layout check), as a
share of the runner's forward-to-logits time. ``pp2``: two pipeline stages (vLLM's layer ranges; only the last
decodes), each on one core; their hand-over of hidden states is not timed. Writes ``parallel.md`` / ``.json``
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _time_collectives(worker) -> None:
    """Runs in each worker: wrap its tensor-parallel group's collectives with a timer."""
    import time as _t

    from vllm.distributed import get_tp_group

    group = get_tp_group()
    stats = worker.__dict__.setdefault("_psd_comm", {"seconds": 0.0, "calls": 0})
    for name in ("all_reduce", "all_gather"):
        fn = getattr(group, name)

        def timed(*a, _fn=fn, **k):
            t0 = _t.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                stats["seconds"] += _t.perf_counter() - t0
                stats["calls"] += 1
        setattr(group, name, timed)
    check = type(worker.model_runner)._check_ranks

    def timed_check(self, batch, _check=check):
        t0 = _t.perf_counter()
        try:
            return _check(self, batch)
        finally:
            stats["seconds"] += _t.perf_counter() - t0
            stats["calls"] += 1
    type(worker.model_runner)._check_ranks = timed_check


def _read(worker) -> dict:
    stats = worker.__dict__.setdefault("_psd_comm", {"seconds": 0.0, "calls": 0})
    out = {**stats, "step_time": dict(worker.model_runner.step_time)}
    stats.update(seconds=0.0, calls=0)  # in place: the timers hold this dict
    worker.model_runner.step_time.update(steps=0, forward_seconds=0.0)
    return out


def run(tp: int, method: str, model: Path, prompts: list[list[int]], pp: int = 1) -> dict:
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp * pp == 2 else "0-1"
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=64,
              speculative_config={"method": "psd", "decoding": method})
    try:
        params = SamplingParams(max_tokens=32, temperature=0)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        if tp > 1:
            llm.collective_rpc(_time_collectives)
        llm.collective_rpc(_read)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        rank0 = llm.collective_rpc(_read)[0]
        stats = compat.psd_stats(llm)
    finally:
        del llm
    ids = {o.request_id: o for o in outs}
    nfe = sum(stats["requests"][k]["nfe"] for k in stats["requests"] if compat.external_request_id(k) in ids)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    fwd = rank0["step_time"]["forward_seconds"]
    return {"tp": tp, "pp": pp, "layout": f"TP {tp}" if tp > 1 else f"PP {pp}" if pp > 1 else "1", "method": method, "tokens": tokens, "tpf": tokens / max(1, nfe), "nfe_per_sample": nfe / len(prompts),
            "tokens_per_s": tokens / dt, "seconds": dt, "comm_seconds": rank0.get("seconds", 0.0),
            "comm_calls": rank0.get("calls", 0), "forward_seconds": fwd,
            "comm_share_of_forward": rank0.get("seconds", 0.0) / fwd if fwd else 0.0,
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def main() -> None:
    from psd_plugin import DEFAULT_DLLM
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import TASKS, load_heldout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--limit", type=int, default=10, help="held-out items per task")
    ap.add_argument("--methods", default="confidence,psd")
    ap.add_argument("--layouts", default="1,tp2,pp2", help="1 (one rank), tp2 (tensor-parallel 2), pp2 (2 stages)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the timers are functions sent to the workers
    _, tok = load(args.model)
    prompts = [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[: args.limit]]
    rows = []
    layouts = {"1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
    for method in args.methods.split(","):
        first = None
        for name in args.layouts.split(","):
            tp, pp = layouts[name]
            r = run(tp, method, args.model, prompts, pp)
            rows.append(r)
            if first is None:
                first = r
            else:
                r["identical_to_tp1"] = sum(a == b for a, b in zip(first["outputs"], r["outputs"])) / len(prompts)
            print(f"{method:<11} {r['layout']:<5} TPF {r['tpf']:.2f}  NFE/sample {r['nfe_per_sample']:.2f}  "
                  f"{r['tokens_per_s']:7.1f} tok/s  collectives {r['comm_seconds']:.2f} s in {r['comm_calls']} calls "
                  f"({100 * r['comm_share_of_forward']:.0f}% of forward)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parallel.json").write_text(json.dumps(
        {"prompts": len(prompts), "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, indent=1))
    lines = ["| method | ranks | TPF | NFE/sample | tokens/s | collectives (rank 0) | share of forward | "
             "identical to 1 rank |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ident = f"{100 * r['identical_to_tp1']:.0f}%" if "identical_to_tp1" in r else ""
        comm = f"{r['comm_seconds']:.2f} s / {r['comm_calls']} calls" if r["tp"] > 1 else ""
        share = f"{100 * r['comm_share_of_forward']:.0f}%" if r["tp"] > 1 else ""
        lines.append(f"| {r['method']} | {r['layout']} | {r['tpf']:.2f} | {r['nfe_per_sample']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {comm} | {share} | {ident} |")
    (args.out / "parallel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
