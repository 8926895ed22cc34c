"""RL rollouts and sampled serving speed: a dLLM method against the AR model through vLLM, in one process.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/rollouts.py [--model PATH] [--prompts 16] [--n 8]
        [--temperatures 1.0] [--concurrency 0] [--methods psd,confidence] [--repeats 2] [--name rollouts]

What an RL trainer asks of a server: ``--prompts`` held-out prompts (spread over the tasks), each sampled ``--n``
times (vLLM's ``n``, unseeded: every sample draws from its own request id), at each of ``--temperatures``
(0: greedy), max_tokens 32. ``--concurrency c`` sends the prompts in waves of ``c`` (``LLM.generate`` per wave,
one wave after another; 0: all prompts in one call). Per engine, temperature and concurrency: generated tokens
per second over the wall time (tokens up to and including EOS; each engine warmed up first, outside the timed
region), the distinct-sample rate (distinct answers among a prompt's ``n``, divided by ``n``, averaged over
prompts; with ``n = 1`` it is 1), and for the dLLM its TPF. The engines alternate ``--repeats`` times (this
machine's speed drifts: compare within a repeat, give the spread). Writes ``<name>.md`` / ``.json`` into
``--out``. On this CPU a step's time grows with the rows it forwards (AR: one per sequence; a dLLM: its block's
canvases) and a tiny model's step is largely host work: the ratios are this CPU's, not a GPU projection.
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
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _run(llm, prompts, n, temperature, concurrency=0, stats=None):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=temperature, n=n)
    waves = [prompts[i: i + concurrency] for i in range(0, len(prompts), concurrency)] if concurrency else [prompts]
    t0 = time.perf_counter()
    outs = [o for w in waves for o in llm.generate([{"prompt_token_ids": p} for p in w], params, use_tqdm=False)]
    dt = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    distinct = sum(len({tuple(c.token_ids) for c in o.outputs}) / n for o in outs) / len(outs)
    row = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "distinct": distinct}
    if stats is not None:
        got = stats(llm)
        nfe = sum(got[c]["nfe"] for o in outs for c in _child_ids(o, got))
        emitted = sum(got[c]["emitted"] for o in outs for c in _child_ids(o, got))
        row["tpf"] = emitted / max(1, nfe)
    return row


def _child_ids(out, stats):
    """The runner's request ids of a parent request's ``n`` samples (vLLM names them ``<index>_<parent id>``)."""
    return [k for k in stats if k.endswith("_" + out.request_id) or k == out.request_id]


def main() -> None:
    from vllm import LLM

    from benchmarks.engines import method_knobs
    from psd_plugin import DEFAULT_AR, DEFAULT_DLLM
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import TASKS, load_heldout
    from psd_plugin.vllm import compat

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--ar", type=Path, default=DEFAULT_AR)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--temperatures", default="1.0", help="comma-separated; 0 is greedy")
    ap.add_argument("--concurrency", default="0", help="comma-separated wave sizes; 0: every prompt at once")
    ap.add_argument("--methods", default="psd,confidence")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="rollouts")
    args = ap.parse_args()

    _, tok = load(args.model)
    rows = [r for t in TASKS for r in load_heldout(t)[:8]]
    rows = rows[:: max(1, len(rows) // args.prompts)][: args.prompts]
    prompts = [encode(tok, r["prompt"]) for r in rows]
    common = dict(dtype="float32", seed=0, max_model_len=512, max_num_seqs=256)
    engines = {"AR": LLM(model=str(args.ar), **common)}
    for m in args.methods.split(","):
        knobs = {"method": "psd", "decoding": m, **method_knobs(m, args.model, "vllm")}
        engines[m] = LLM(model=str(args.model), speculative_config=knobs, **common)
    temps = [float(t) for t in args.temperatures.split(",")]
    concs = [int(c) for c in args.concurrency.split(",")]
    cases = [(t, c) for t in temps for c in concs]
    results: dict[str, dict] = {k: {f"{t:g}/{c}": [] for t, c in cases} for k in engines}
    for name, llm in engines.items():  # warm-up
        _run(llm, prompts[:2], 2, max(temps))
    for rep in range(args.repeats):
        for t, c in cases:
            for name, llm in engines.items():
                row = _run(llm, prompts, args.n, t, c, None if name == "AR" else compat.request_stats)
                results[name][f"{t:g}/{c}"].append(row)
                print(f"repeat {rep} T {t:g} c {c or len(prompts)} {name:<15} {row['tokens_per_s']:7.1f} tok/s  "
                      f"distinct {row['distinct']:.3f}" + (f"  TPF {row['tpf']:.2f}" if "tpf" in row else ""),
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model.name, "ar": args.ar.name, "prompts": len(prompts), "n": args.n,
            "temperatures": temps, "concurrency": concs, "repeats": args.repeats}
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"{len(prompts)} held-out prompts x n = {args.n}, max_tokens 32, unseeded, float32, vLLM in one "
             f"process on this CPU ({args.repeats} alternating repeats: min-max); dLLM {meta['model']}, AR "
             f"{meta['ar']}; c: prompts per `generate` call (waves). This CPU's step time grows with the rows a "
             "step forwards and a tiny model's step is largely host work: ratios on this CPU, not a GPU projection.",
             "", "| T | c | engine | tokens/s | vs AR (same repeat) | distinct samples | TPF |",
             "|---|---|---|---|---|---|---|"]
    for t, c in cases:
        key = f"{t:g}/{c}"
        for name in engines:
            runs, ar = results[name][key], results["AR"][key]
            tps = [r["tokens_per_s"] for r in runs]
            ratio = [r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(runs, ar)]
            tpf = [r["tpf"] for r in runs if "tpf" in r]
            lines.append(f"| {t:g} | {c or len(prompts)} | {name} | {min(tps):.0f}-{max(tps):.0f} | "
                         f"{min(ratio):.2f}-{max(ratio):.2f}x | {sum(r['distinct'] for r in runs) / len(runs):.3f} | "
                         f"{(f'{min(tpf):.2f}-{max(tpf):.2f}' if tpf else '-')} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
