"""Where a decoding step's time goes: the model forward against everything else, per method, both engines.

    OMP_NUM_THREADS=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python benchmarks/step_overhead.py \
        [--limit 5] [--concurrency 1,16] [--methods static,confidence,psd] [--cache prefix|dual]

The same held-out prompts (``--limit`` per task), greedy, block 8, max_tokens 32, float32, decoded in waves of
``--concurrency`` requests (a wave finishes before the next starts). Per method, engine and concurrency:
steps, wall time per step, model-forward time per step and the non-model share ``1 - forward / wall``; TPF
and tokens/s. Then the cost model of PSD against confidence at each concurrency: tokens/s ratio = (tokens
per step ratio) / (time per step ratio), every factor measured (a request's prompt prefill is its first
decoding forward in both engines, so a step count is NFE's, summed over a wave's requests per step).

- vLLM path (in-process engine): *forward* is the runner's wall time from the end of input preparation to
  the logits reaching the decoders (the model with its attention metadata); *wall* is the time of the
  ``generate`` calls, so scheduling, input preparation, decoding, bookkeeping and vLLM's front end are the
  rest.
- reference engine: *forward* is ``_forward`` (plan, model, logits); *wall* the ``generate`` calls.

Wall-clock on this CPU (synchronous); a GPU would need the forward timed with a device synchronisation.
Writes ``step_overhead.md`` / ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import engines_and_prompts, method_knobs  # noqa: E402  (sets vLLM's environment)


def main() -> None:
    from psd_plugin import DEFAULT_DLLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--limit", type=int, default=5, help="held-out items per task")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--methods", default="static,confidence,localleap,lopa,freedave,spiffy,psd")
    ap.add_argument("--cache", default="prefix", choices=("none", "prefix", "dual"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    ref, _, _, prompts, vllm = engines_and_prompts(args.model, args.limit)
    table = []
    for method in args.methods.split(","):
        for name, engine in (("reference", ref), ("vLLM", vllm)):
            run = dict(method=method, max_tokens=32, block_size=8, cache=args.cache,
                       **method_knobs(method, args.model, name))
            if name == "vLLM":
                engine.generate(prompts[:2], **run)  # start and warm up outside the timed region
            for c in (int(x) for x in args.concurrency.split(",")):
                before = dict(engine.step_time() if name == "vLLM" else engine.step_time)
                wall, tokens, nfe = 0.0, 0, 0
                for a in range(0, len(prompts), c):
                    t0 = time.perf_counter()
                    res = engine.generate(prompts[a: a + c], **run, **({"batch_size": c} if name == "reference" else {}))
                    wall += time.perf_counter() - t0
                    tokens += sum(len(r.token_ids) for r in res)
                    nfe += sum(r.nfe for r in res)
                after = engine.step_time() if name == "vLLM" else engine.step_time
                steps = after["steps"] - before["steps"]
                fwd = after["forward_seconds"] - before["forward_seconds"]
                row = {"method": method, "cache": args.cache, "engine": name, "concurrency": c, "steps": steps,
                       "ms_per_step": 1e3 * wall / steps, "forward_ms_per_step": 1e3 * fwd / steps,
                       "non_model_share": 1 - fwd / wall, "tokens": tokens, "tpf": tokens / nfe,
                       "tokens_per_s": tokens / wall}
                table.append(row)
                print(f"{method:<11} {name:<9} c={c:<3} {steps:4d} steps  {row['ms_per_step']:7.1f} ms/step  "
                      f"forward {row['forward_ms_per_step']:7.1f} ms  non-model {100 * row['non_model_share']:4.1f}%  "
                      f"TPF {row['tpf']:.2f}  {row['tokens_per_s']:.0f} tok/s", flush=True)
    vllm.close()
    args.out.mkdir(parents=True, exist_ok=True)
    model = cost_model(table)
    suffix = "" if args.cache == "prefix" else f"_{args.cache}"
    (args.out / f"step_overhead{suffix}.json").write_text(
        json.dumps({"prompts": len(prompts), "cache": args.cache, "rows": table, "psd_vs_confidence": model}, indent=1))
    lines = ["| method | engine | concurrency | steps | ms / step | forward ms / step | non-model share | TPF | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['method']} | {t['engine']} | {t['concurrency']} | {t['steps']} | {t['ms_per_step']:.1f} | "
                     f"{t['forward_ms_per_step']:.1f} | {100 * t['non_model_share']:.0f}% | {t['tpf']:.2f} | "
                     f"{t['tokens_per_s']:.0f} |")
    if model:
        lines += ["", "| PSD / confidence | concurrency | TPF ratio | tokens per step ratio | time per step ratio | "
                  "predicted tokens/s ratio | measured tokens/s ratio |", "|---|---|---|---|---|---|---|"]
        for m in model:
            lines.append(f"| {m['engine']} | {m['concurrency']} | {m['tpf_ratio']:.2f} | {m['tokens_per_step_ratio']:.2f} | "
                         f"{m['step_time_ratio']:.2f} | {m['predicted']:.2f} | {m['measured']:.2f} |")
    (args.out / f"step_overhead{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cost_model(table: list[dict]) -> list[dict]:
    """PSD's tokens/s over confidence's per engine and concurrency, as (tokens per step ratio) / (time per step
    ratio), beside the TPF ratio and the measured tokens/s ratio."""
    rows = {(t["method"], t["engine"], t["concurrency"]): t for t in table}
    out = []
    for (method, engine, c), p in rows.items():
        q = rows.get(("confidence", engine, c))
        if method != "psd" or q is None:
            continue
        per_step = (p["tokens"] / p["steps"]) / (q["tokens"] / q["steps"])
        cost = p["ms_per_step"] / q["ms_per_step"]
        out.append({"engine": engine, "concurrency": c, "tpf_ratio": p["tpf"] / q["tpf"],
                    "tokens_per_step_ratio": per_step, "step_time_ratio": cost, "predicted": per_step / cost,
                    "measured": p["tokens_per_s"] / q["tokens_per_s"]})
    return out


if __name__ == "__main__":
    main()
