"""Token-for-token match of the lossless methods (FreeDave, Spiffy) with their base policy, float32 and float64.

    .venv/bin/python benchmarks/exactness.py [--limit N] [--dtypes float64,float32] [--caches prefix,dual]
        [--tasks sort,...,count_lines]   # default: the short tasks; a long family decodes with its 256 budget
        [--temperature 0.9 --top-k 20]  # sampled: the same seeds for the base policy and the method

float64 must match on every prompt (the tests check that too). In float32 a draft canvas is computed in a
batch of a different shape than plain decoding's forward, so the last bits of a logit may differ; when
two candidates are nearly tied that flips a decision. For every float32 mismatch this prints the
smallest decision margin on the base policy's own trajectory for that prompt: the confidence gap
between the committed position and the runner-up, and the logit gap between the committed token and
the runner-up token at that position.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model_executor.decoding import load_graph  # noqa: E402
from model_executor.decoding.policies import make_policy  # noqa: E402
from psd_plugin import DEFAULT_DLLM, default_graph  # noqa: E402
from psd_plugin.calibrate import TrajectoryRecorder  # noqa: E402
from psd_plugin.evaluate import encode, generate_by_budget, load  # noqa: E402
from psd_plugin.train.tasks import TASKS, answer_budget, load_heldout, parse_tasks  # noqa: E402


def min_margin(engine, prompt, policy: str, cache: str, max_tokens: int) -> dict:
    """Smallest confidence / logit gap of any commit decision on ``policy``'s trajectory for ``prompt``."""
    blocks: list = []
    rule = make_policy(policy)
    mask = engine.spec.mask_token_id
    engine.generate([prompt], max_tokens=max_tokens, method=policy, cache=cache, decoder_factory=lambda b: TrajectoryRecorder(b, mask, rule, blocks))
    best = {"conf_gap": float("inf"), "logit_gap": float("inf")}
    for steps in blocks:
        for _, pred, _ in steps:
            c = pred.conf[torch.isfinite(pred.conf)].sort(descending=True).values
            if c.numel() > 1:
                best["conf_gap"] = min(best["conf_gap"], float(c[0] - c[1]))
            p = pred.probs[pred.conf.argmax()].log().sort(descending=True).values
            best["logit_gap"] = min(best["logit_gap"], float(p[0] - p[1]))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--limit", type=int, default=50, help="held-out items per task")
    ap.add_argument("--dtypes", default="float64,float32", help="comma-separated: float64, float32")
    ap.add_argument("--caches", default="prefix", help="comma-separated KV-cache modes: prefix, dual")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated held-out tasks (default: the short ones)")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeds 0 .. (prompt i: seed i)")
    ap.add_argument("--top-k", type=int, default=0)
    args = ap.parse_args()
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        ap.error(f"--tasks: {e}")
    rows = [r for t in tasks for r in load_heldout(t)[: args.limit]]
    budgets = [answer_budget(r["task"]) for r in rows]
    report = {}
    dtypes = args.dtypes.split(",")
    if not dtypes or any(d not in ("float64", "float32") for d in dtypes):
        ap.error(f"--dtypes {args.dtypes!r}; allowed: float64, float32 (comma-separated)")
    caches = args.caches.split(",")
    if not caches or any(c not in ("prefix", "dual") for c in caches):
        ap.error(f"--caches {args.caches!r}; allowed: prefix, dual (comma-separated)")
    for dtype in dtypes:
        engine, tok = load(args.model, dtype)
        prompts = [encode(tok, r["prompt"]) for r in rows]
        runs = {"freedave d=4 vs static": ("static", dict(method="freedave", steps=4))}
        for pol in ("static", "confidence"):
            g = load_graph(default_graph(args.model, pol))
            runs[f"spiffy D*=3 vs {pol}"] = (pol, dict(method="spiffy", policy=pol, graph=g, budget=3))
        sample = dict(temperature=args.temperature, top_k=args.top_k, seed=0) if args.temperature > 0 else {}
        for cache in caches:
            base_cache = {}
            for name, (pol, kw) in runs.items():
                if pol not in base_cache:
                    base_cache[pol] = generate_by_budget(engine, prompts, budgets, method=pol, cache=cache, **sample)
                base = base_cache[pol]
                out = generate_by_budget(engine, prompts, budgets, cache=cache, **kw, **sample)
                bad = [i for i, (a, b) in enumerate(zip(base, out)) if a.token_ids != b.token_ids]
                entry = {"prompts": len(prompts), "identical": len(prompts) - len(bad),
                         "match_rate": round(1 - len(bad) / len(prompts), 4),
                         "nfe_ratio": round(sum(r.nfe for r in out) / sum(r.nfe for r in base), 4),
                         "mismatches": [{"prompt": rows[i]["prompt"],
                                         **({} if sample else min_margin(engine, prompts[i], pol, cache, budgets[i]))}
                                        for i in bad]}
                key = f"{name} ({dtype})" if cache == "prefix" else f"{name} ({dtype}, dual cache)"
                if tasks != TASKS:
                    key += f" [{','.join(tasks)}]"
                if sample:
                    key += f" T={args.temperature:g} top_k={args.top_k}"
                report[key] = entry
                print(f"{name:<26} {dtype} {cache}: {entry['identical']}/{len(prompts)} identical, NFE ratio "
                      f"{entry['nfe_ratio']:.3f}", flush=True)
                for m in entry["mismatches"] if not sample else ():
                    print(f"    mismatch: {m['prompt']!r}: smallest conf gap {m['conf_gap']:.2e}, "
                          f"logit gap {m['logit_gap']:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "exactness.json"  # rows of dtypes not run this time are kept
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(report)
    path.write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main()
