"""PRESTO tree drafting vs linear drafting on the held-out tasks: acceptance length τ and drafting overhead.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/presto.py [--limit 10] [--budgets 16,64,128,256]
        [--lams 0,0.1,0.2,0.5] [--temperatures 0,1] [--out benchmarks/results]

The embedded AR model (ar-tiny) is the target, the embedded block-diffusion drafter (drafter-tiny, block 16)
drafts, the n-gram file shipped with it is ρ. For every temperature: linear drafting (the drafter's top-1
chain of k = 16, as DFlash drafts) and, for every budget B and λ, beam search (Alg. 1, W = b = 10) and
best-first search (Alg. 2, b = 10). Reports τ (tokens per target forward, bonus included, up to EOS),
target forwards per generated token (1/τ), the share of a round's time spent building trees next to the
target's verification forward, accuracy, and τ over linear's τ at the same temperature. Greedy runs are
also checked token for token against plain AR decoding. Writes ``presto.csv``, ``presto.md``, ``presto.png``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model_executor.presto_engine import PrestoEngine  # noqa: E402
from psd_plugin import DEFAULT_AR, DEFAULT_DRAFTER, default_ngram  # noqa: E402
from psd_plugin.evaluate import decode_answer, encode  # noqa: E402
from psd_plugin.train.tasks import TASKS, grade, load_heldout  # noqa: E402


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=10, help="held-out items per task")
    ap.add_argument("--budgets", default="16,64,128,256")
    ap.add_argument("--lams", default="0,0.1,0.2,0.5")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    engine = PrestoEngine.from_pretrained(DEFAULT_AR, DEFAULT_DRAFTER, default_ngram(DEFAULT_DRAFTER))
    rows = [r for t in TASKS for r in load_heldout(t)[: args.limit]]
    prompts = [encode(tok, r["prompt"]) for r in rows]
    ar = {}
    table = []
    for temp in map(float, args.temperatures.split(",")):
        runs = [("ar", 1, 0.0), ("linear", 16, 0.0)]
        runs += [(s, b, lam) for s in ("beam", "best_first") for b in map(int, args.budgets.split(","))
                 for lam in map(float, args.lams.split(","))]
        base_tau = None
        for search, budget, lam in runs:
            for key in engine.timing:
                engine.timing[key] = 0.0
            t0 = time.perf_counter()
            res = engine.generate(prompts, search=search, tree_budget=budget, lam=lam, max_tokens=32,
                                  temperature=temp, seed=1)
            dt = time.perf_counter() - t0
            tokens, nfe = sum(len(r.token_ids) for r in res), sum(r.nfe for r in res)
            tau = tokens / nfe
            if search == "ar":
                ar[temp] = [r.token_ids for r in res]
            if search == "linear":
                base_tau = tau
            acc = sum(grade(row, decode_answer(tok, r.token_ids)) for row, r in zip(rows, res)) / len(rows)
            tm = engine.timing
            row = {"temperature": temp, "search": search, "budget": budget if search not in ("ar",) else 0,
                   "lam": lam, "tau": round(tau, 3), "forwards_per_token": round(nfe / tokens, 3),
                   "tau_over_linear": round(tau / base_tau, 3) if base_tau else None,
                   "tree_share": round(tm["tree_s"] / max(1e-9, tm["verify_forward_s"]), 4),
                   "accuracy": round(100 * acc, 1),
                   "identical_to_ar": (sum(r.token_ids == a for r, a in zip(res, ar[temp])) if temp == 0 else None),
                   "samples": len(res), "seconds": round(dt, 1)}
            table.append(row)
            print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "presto.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    lines = [f"ar-tiny target, drafter-tiny (block 16, k = 16), 3-gram ρ; {len(prompts)} held-out prompts "
             f"({args.limit} per task), max_tokens 32, one thread; τ = tokens per target forward (bonus included)",
             "", "| T | search | B | λ | τ | τ / linear | target forwards per token | tree time / verify time | "
             "accuracy % | identical to AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        ident = "-" if r["identical_to_ar"] is None else f"{r['identical_to_ar']}/{r['samples']}"
        lines.append(f"| {r['temperature']:g} | {r['search']} | {r['budget'] or '-'} | {r['lam']:g} | {r['tau']:.2f} | "
                     f"{r['tau_over_linear'] if r['tau_over_linear'] is not None else '-'} | {r['forwards_per_token']:.3f} | "
                     f"{100 * r['tree_share']:.1f}% | {r['accuracy']} | {ident} |")
    (args.out / "presto.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(table, args.out / "presto.png")


def _plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in table})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        rows = [r for r in table if r["temperature"] == temp]
        for search, marker in (("beam", "o"), ("best_first", "s")):
            for lam in sorted({r["lam"] for r in rows if r["search"] == search}):
                pts = sorted((r["budget"], r["tau"]) for r in rows if r["search"] == search and r["lam"] == lam)
                ax.plot(*zip(*pts), marker=marker, label=f"{search} λ={lam:g}")
        lin = next(r["tau"] for r in rows if r["search"] == "linear")
        ax.axhline(lin, color="k", ls="--", label="linear")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget B (nodes)")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.set_title(f"temperature {temp:g}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
