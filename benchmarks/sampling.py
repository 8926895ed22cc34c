"""Accuracy and tokens-per-forward under sampling: the two commit-confidence rules at T = 0.3, 0.7, 1.0.

    .venv/bin/python benchmarks/sampling.py [--model PATH] [--limit N] [--seeds 3] [--out benchmarks/results]
        [--methods confidence,psd] [--rules drawn,tempered] [--name sampling]

A sampled position's commit confidence decides how many positions a forward commits and so accuracy and TPF
(:mod:`model_executor.decoding.sampling`): ``drawn`` is the model's untempered probability of the drawn token
(LLaDA, Fast-dLLM), ``tempered`` is ``min(p_max, exp((z_drawn - z_max) / T))`` (SGLang's dLLM sampler). For
confidence decoding (tau 0.9) and PSD (confidence policy, chain depth 3), on the held-out tasks with the
reference engine (float32, one process); ``--methods`` adds any other method at its defaults (static,
localleap, lopa, freedave, spiffy with the model's shipped graph, joint_threshold); every (T, rule) over
``--seeds`` seeds: mean accuracy and TPF with their spread over the seeds, beside greedy decoding. Writes
``<name>.json`` and ``<name>.md`` into ``--out``. TPF and accuracy are counts, not times: they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import method_knobs  # noqa: E402
from psd_plugin import DEFAULT_DLLM  # noqa: E402
from psd_plugin.evaluate import evaluate, load  # noqa: E402
from psd_plugin.train.tasks import TASKS, load_heldout  # noqa: E402

METHODS = {"confidence": {"method": "confidence", "threshold": 0.9},
           "psd": {"method": "psd", "policy": "confidence", "depth": 3}}
OTHERS = ("static", "localleap", "lopa", "freedave", "spiffy", "joint_threshold")  # their defaults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_DLLM))
    ap.add_argument("--limit", type=int, default=40, help="held-out items per task")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--temperatures", default="0.3,0.7,1.0")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join((*METHODS, *OTHERS))}")
    ap.add_argument("--rules", default="drawn,tempered", help="commit-confidence rules: drawn, tempered")
    ap.add_argument("--name", default="sampling", help="output file stem")
    args = ap.parse_args()
    engine, tok = load(args.model)
    rows = [r for t in TASKS for r in load_heldout(t)[: args.limit]]
    base = dict(max_tokens=args.max_tokens, block_size=8)
    out = []
    for name in args.methods.split(","):
        knobs = METHODS.get(name) or {"method": name, **method_knobs(name, Path(args.model), "reference")}
        g = evaluate(engine, tok, rows, **base, **knobs)
        out.append({"method": name, "temperature": 0.0, "rule": "greedy", "accuracy": [g["mean_accuracy"]],
                    "tpf": [g["tpf"]]})
        print(json.dumps(out[-1]), flush=True)
        for T in (float(x) for x in args.temperatures.split(",")):
            for rule in args.rules.split(","):
                acc, tpf = [], []
                for seed in range(args.seeds):
                    r = evaluate(engine, tok, rows, **base, **knobs, temperature=T, seed=seed,
                                 sample_confidence=rule)
                    acc.append(r["mean_accuracy"])
                    tpf.append(r["tpf"])
                out.append({"method": name, "temperature": T, "rule": rule, "accuracy": acc, "tpf": tpf})
                print(json.dumps(out[-1]), flush=True)
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    meta = {"model": Path(args.model).name, "items": len(rows), "seeds": args.seeds, "max_tokens": args.max_tokens}
    (dest / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": out}, indent=1))

    def span(v, scale=1.0):
        m = sum(v) / len(v)
        return f"{m * scale:.1f} ({min(v) * scale:.1f}-{max(v) * scale:.1f})" if len(v) > 1 else f"{m * scale:.1f}"

    def span2(v):
        m = sum(v) / len(v)
        return f"{m:.2f} ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else f"{m:.2f}"
    lines = [f"Model {meta['model']}, {meta['items']} held-out items, {meta['max_tokens']} tokens, block 8, "
             f"reference engine float32; sampled rows: mean (min-max) over {meta['seeds']} seeds.", "",
             "| method | T | confidence rule | accuracy % | TPF |", "|---|---|---|---|---|"]
    for r in out:
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['rule']} | {span(r['accuracy'], 100)} | "
                     f"{span2(r['tpf'])} |")
    (dest / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
