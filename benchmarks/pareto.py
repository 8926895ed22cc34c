"""Accuracy vs tokens-per-forward of every decoding method on the held-out tasks (the PSD paper's grid).

    .venv/bin/python benchmarks/pareto.py [--model PATH] [--limit N] [--out benchmarks/results]
    .venv/bin/python benchmarks/pareto.py --tasks count_lines --limit 30 --name pareto_long   # long answers

Runs, with the reference engine on one model and one process (ratios side by side): greedy (static),
confidence τ=0.9, LocalLeap, LoPA k ∈ {1,3,5,7}, Spiffy d ∈ {1,3,5,7} (a graph calibrated per lookahead d,
D* = 3, static base), PSD(confidence) and PSD(LocalLeap) d ∈ {1,3,5,7}, FreeDave d ∈ {2,4,8}; plus the
lossless oracle bound: the fewest forwards that any draft-and-verify method reproducing static decoding
could take on the same outputs (FreeDave's optimal feasible path, Def. 2 / Eq. 7, found by a shortest
path over each block's recorded static trajectory); and, where confidence and PSD rows ran, PSD(confidence)'s
bound: confidence's blocks each cut to at most two forwards (a block's first forward has no drafts to
verify). Writes ``pareto.csv``, ``pareto.png`` and
``pareto.md`` (the table in docs/benchmarks.md) into ``--out`` (``--name`` renames them). ``--tasks`` picks the
held-out tasks (default: the seven short ones); a long family runs with its own budget (256 tokens).
``--knobs`` adds knobs to every configuration (``'{"cache": "dual"}'``, ``'{"refresh": "last"}'``); the
``seconds`` column is the reference engine's time for the configuration on this machine, a proxy for the rows
it forwards.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model_executor.decoding import merge_stats  # noqa: E402
from model_executor.decoding.freedave import topk_jump  # noqa: E402
from psd_plugin import DEFAULT_DLLM  # noqa: E402
from psd_plugin.calibrate import TrajectoryRecorder, calibrate_graph, default_calibration_prompts, model_name  # noqa: E402
from psd_plugin.evaluate import encode, evaluate, load  # noqa: E402
from psd_plugin.train.tasks import TASKS, answer_budget, load_heldout, parse_tasks  # noqa: E402


def grid(graphs):
    yield "greedy", "static", {}
    yield "confidence", "confidence", {"threshold": 0.9}
    yield "localleap", "localleap", {}
    for k in (1, 3, 5, 7):
        yield f"lopa k={k}", "lopa", {"branches": k, "policy": "confidence"}
    for d in (1, 3, 5, 7):
        yield f"spiffy d={d}", "spiffy", {"policy": "static", "graph": graphs.get(d), "budget": 3}
    for pol in ("confidence", "localleap"):
        for d in (1, 3, 5, 7):
            yield f"psd({pol}) d={d}", "psd", {"policy": pol, "depth": d}
    for d in (3, 5):  # the skip DAG: d(d+1)/2 drafts
        yield f"psd(confidence) skip d={d}", "psd", {"policy": "confidence", "depth": d, "dag_shape": "skip"}
    for d in (2, 4, 8):
        yield f"freedave d={d}", "freedave", {"steps": d}


def oracle_nfe(engine, prompts, block_size, max_tokens, **knobs) -> int:
    """Fewest forwards of any lossless draft-and-verify decoder on static decoding's own trajectories (``knobs``:
    the cache schedule static ran with)."""
    mask = engine.spec.mask_token_id
    from model_executor.decoding.policies import static_policy

    blocks: list = []
    engine.generate(prompts, max_tokens=max_tokens, block_size=block_size, method="static", **knobs,
                    decoder_factory=lambda blk: TrajectoryRecorder(blk, mask, static_policy, blocks))
    total = 0
    for steps in blocks:
        states = [s for s, _, _ in steps] + [steps[-1][2]]
        n = len(steps)
        best = [0] + [n + 1] * n  # forwards to reach state j
        for i in range(n):
            _, pred, _ = steps[i]
            for j in range(i + 1, n + 1):
                if torch.equal(topk_jump(states[i], pred, j - i), states[j]):
                    best[j] = min(best[j], best[i] + 1)
        total += best[n]
    return total


def draft_bound_steps(engine, prompts, block_size, max_tokens, threshold=0.9, **knobs) -> tuple[int, int]:
    """Confidence decoding's steps summed over its blocks, and the fewest a PSD(confidence) decoder could take on
    the same blocks: a block's first forward sees no drafts (it is confidence's own first step), so a block that
    confidence does not finish in one forward takes PSD at least two (``Σ min(n_b, 2)``)."""
    from model_executor.decoding.policies import make_policy

    mask, rule, blocks = engine.spec.mask_token_id, make_policy("confidence", threshold=threshold), []
    engine.generate(prompts, max_tokens=max_tokens, block_size=block_size, method="confidence", **knobs,
                    decoder_factory=lambda blk: TrajectoryRecorder(blk, mask, rule, blocks))
    steps = [len(b) for b in blocks if b]
    return sum(steps), sum(min(n, 2) for n in steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--limit", type=int, default=None, help="first N held-out items per task (default: all 300)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--only", default=None, help="comma-separated labels to run (default: the whole grid)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated held-out tasks (default: the short ones)")
    ap.add_argument("--name", default="pareto", help="output file stem")
    ap.add_argument("--knobs", default="{}", help='knobs added to every configuration, as JSON, e.g. '
                    '\'{"cache": "dual"}\' or \'{"refresh": "last"}\' (model_executor.decode_config.DecodeKnobs)')
    args = ap.parse_args()
    try:
        extra = json.loads(args.knobs)
        assert isinstance(extra, dict)
    except (ValueError, AssertionError):
        ap.error(f"--knobs {args.knobs!r}: a JSON object of DecodeKnobs fields")
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        ap.error(f"--tasks: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    engine, tok = load(args.model, args.dtype)
    rows = [r for t in tasks for r in load_heldout(t)[: args.limit]]
    common = dict(max_tokens=args.max_tokens, block_size=args.block_size)

    only = set(args.only.split(",")) if args.only else None
    graphs = {}
    if only is None or any(label.startswith("spiffy") for label in only):  # Spiffy's graphs, calibrated here
        calib = [encode(tok, p) for p in default_calibration_prompts(60)]
        graphs = {d: calibrate_graph(engine, calib, model_name=model_name(args.model), policy="static", lookahead=d,
                                     budget=min(10, 3 * d), progress=False, **common) for d in (1, 3, 5, 7)}
    results = []
    for label, method, kw in grid(graphs):
        if only and label not in only:
            continue
        t0 = time.perf_counter()
        kw = {**kw, **extra}
        per_task = {t: evaluate(engine, tok, [r for r in rows if r["task"] == t], method=method, **common, **kw)
                    for t in tasks}
        tokens = sum(r["tokens_per_sample"] * r["samples"] for r in per_task.values())
        nfe = sum(r["nfe_per_sample"] * r["samples"] for r in per_task.values())
        res = {"label": label, "method": method, "params": json.dumps({k: v for k, v in kw.items() if k != "graph"}),
               "accuracy": sum(r["mean_accuracy"] for r in per_task.values()) / len(tasks),
               "tpf": tokens / nfe, "nfe_per_sample": nfe / len(rows), "seconds": time.perf_counter() - t0,
               **{f"acc_{t}": r["mean_accuracy"] for t, r in per_task.items()},
               **{f"tpf_{t}": r["tpf"] for t, r in per_task.items()}}
        res["stats"] = json.dumps(merge_stats(r.get("stats", {}) for r in per_task.values()))
        results.append(res)
        print(f"{label:<22} acc {100 * res['accuracy']:5.1f}  TPF {res['tpf']:5.2f}  NFE/sample "
              f"{res['nfe_per_sample']:6.2f}  ({res['seconds']:.0f} s)", flush=True)
    prompts = [encode(tok, r["prompt"]) for r in rows]
    static = next((r for r in results if r["label"] == "greedy"), None)
    if static is not None:
        onfe = sum(oracle_nfe(engine, [p for p, r in zip(prompts, rows) if r["task"] == t], args.block_size,
                              max(args.max_tokens, answer_budget(t)), **extra) for t in tasks)
        # the oracle decodes whole blocks; its tokens are static's (up to EOS), its forwards the shortest path
        tokens = static["tpf"] * static["nfe_per_sample"] * len(rows)
        results.append({"label": "oracle (lossless bound)", "method": "oracle", "params": "{}",
                        "accuracy": static["accuracy"], "tpf": tokens / onfe, "nfe_per_sample": onfe / len(rows),
                        "seconds": 0.0, "stats": "{}"})
        print(f"oracle bound: NFE/sample {onfe / len(rows):.2f}, TPF {tokens / onfe:.2f}")
    conf = next((r for r in results if r["label"] == "confidence"), None)
    if conf is not None and any(r["method"] == "psd" for r in results):
        n, floor = (sum(x) for x in zip(*(
            draft_bound_steps(engine, [p for p, r in zip(prompts, rows) if r["task"] == t], args.block_size,
                              max(args.max_tokens, answer_budget(t)), **extra) for t in tasks)))
        # PSD's tokens are confidence's here (same accuracy); its forwards at best confidence's with every block
        # that took more than two steps cut to two
        results.append({"label": "psd bound (2 steps a block)", "method": "psd_bound", "params": "{}",
                        "accuracy": conf["accuracy"], "tpf": conf["tpf"] * n / floor,
                        "nfe_per_sample": conf["nfe_per_sample"] * floor / n, "seconds": 0.0, "stats": "{}"})
        print(f"psd bound: confidence {n} block steps, at least {floor} with drafts: TPF at most "
              f"{conf['tpf'] * n / floor:.2f} ({n / floor:.2f}x confidence)")
    write(results, args, tasks)


def write(results, args, tasks=TASKS):
    keys = sorted({k for r in results for k in r}, key=lambda k: (k not in ("label", "method", "params"), k))
    with open(args.out / f"{args.name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(results)
    base = next((r for r in results if r["label"] == "greedy"), results[0])
    lines = ["| method | accuracy % | TPF | NFE/sample | TPF vs greedy | seconds |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} | {100 * r['accuracy']:.1f} | {r['tpf']:.2f} | {r['nfe_per_sample']:.2f} | "
                     f"{r['tpf'] / base['tpf']:.2f}× | {r['seconds']:.1f} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fam = {}
    for r in results:
        fam.setdefault(r["label"].split(" ")[0], []).append(r)
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, rs in fam.items():
        ax.plot([r["tpf"] for r in rs], [100 * r["accuracy"] for r in rs], "o-" if len(rs) > 1 else "s", label=name)
    ax.set_xlabel("tokens per forward (TPF, up to EOS)")
    ax.set_ylabel(f"held-out accuracy, mean over {', '.join(tasks) if len(tasks) < 3 else 'tasks'} (%)")
    ax.set_title(f"{Path(args.model).name}: accuracy vs TPF ({args.dtype}, block {args.block_size})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
