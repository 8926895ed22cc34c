"""Serving under load: the dLLM with static / confidence / PSD decoding against the AR baseline (plain and PRESTO).

    .venv/bin/python benchmarks/serving.py [--requests 64] [--concurrency 1,4,16,64] [--out benchmarks/results]

For each configuration, vLLM's OpenAI-compatible server starts on loopback (``psd_plugin.vllm.server``), a
load generator (asyncio + aiohttp, streaming completions with token-id prompts) keeps ``c`` requests in
flight until ``--requests`` fixed held-out prompts (the same for every configuration, every task
represented) are done, for each concurrency ``c``; then the server is stopped by its PID. Greedy,
max_tokens 32. Per configuration and concurrency: requests/s, output tokens/s, time to first token, time
between streamed chunks (inter-token latency per token: a chunk's gap divided by the tokens it carries, as a
dLLM streams a block at once), end-to-end latency (p50/p90/p99), and the task accuracy of the responses.
Ratios are against the AR baseline at the same concurrency, measured in the same run. Writes
``serving.json``, ``serving.md`` and ``serving.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [  # name, model, speculative config (None: plain vLLM), KV page size
    ("AR", "ar-tiny", None),
    ("AR + PRESTO", "ar-tiny", {"method": "psd", "mode": "presto", "tree_budget": 64}),
    ("dLLM static", "llada-tiny", {"method": "psd", "decoding": "static"}),
    ("dLLM confidence", "llada-tiny", {"method": "psd", "decoding": "confidence"}),
    ("dLLM PSD", "llada-tiny", {"method": "psd", "decoding": "psd"}),
]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


async def one(session, url, model, prompt, max_tokens):
    """Stream one completion; returns (ttft, [(gap, tokens)...], e2e, token ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, last, gaps, ids = None, None, [], []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            toks = choice.get("token_ids") or []
            if not toks:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(((now - last) / len(toks), len(toks)))
            last = now
            ids += toks
    return ttft if ttft is not None else time.perf_counter() - t0, gaps, time.perf_counter() - t0, ids


async def drive(url, model, prompts, concurrency, max_tokens):
    import aiohttp

    queue = list(enumerate(prompts))
    results = [None] * len(prompts)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker():
            while queue:
                i, p = queue.pop(0)
                results[i] = await one(session, url, model, p, max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def main() -> None:
    from transformers import AutoTokenizer

    from psd_plugin import CHECKPOINTS
    from psd_plugin.evaluate import encode
    from psd_plugin.vllm.server import start
    from psd_plugin.train.tasks import TASKS, grade, load_heldout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(str(CHECKPOINTS / "ar-tiny"))  # one tokenizer for all embedded models
    per_task = -(-args.requests // len(TASKS))
    rows = [r for t in TASKS for r in load_heldout(t)[:per_task]][: args.requests]
    prompts = [encode(tok, r["prompt"]) for r in rows]
    levels = [int(c) for c in args.concurrency.split(",")]
    wanted = args.configs.split(",")
    table = []
    for name, model, spec in [c for c in CONFIGS if c[0] in wanted]:
        path = CHECKPOINTS / model
        opts = ["--model", str(path), "--served-model-name", model, "--max-model-len", "512", "--dtype", "float32",
                "--max-num-seqs", str(max(levels))]
        if spec is not None:
            opts += ["--speculative-config", json.dumps(spec)]
        server = start(opts, plain=spec is None)
        try:
            asyncio.run(drive(server.url, model, prompts[:2], 2, args.max_tokens))  # warm up
            for c in levels:
                res, wall = asyncio.run(drive(server.url, model, prompts, c, args.max_tokens))
                ttft = [r[0] for r in res]
                itl = [g for r in res for g, n in r[1] for _ in range(n)]
                e2e = [r[2] for r in res]
                tokens = sum(len(r[3]) for r in res)
                acc = sum(grade(row, tok.decode(r[3], skip_special_tokens=True)) for row, r in zip(rows, res))
                row = {"config": name, "concurrency": c, "requests": len(res), "req_per_s": len(res) / wall,
                       "tokens_per_s": tokens / wall, "accuracy": 100 * acc / len(res),
                       **{f"ttft_p{q}": 1e3 * pct(ttft, q) for q in (50, 90, 99)},
                       **{f"itl_p{q}": 1e3 * pct(itl, q) for q in (50, 90, 99)},
                       **{f"e2e_p{q}": 1e3 * pct(e2e, q) for q in (50, 90, 99)}}
                table.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        finally:
            server.stop()
    base = {r["concurrency"]: r for r in table if r["config"] == "AR"}
    for r in table:
        b = base.get(r["concurrency"])
        r["tokens_per_s_vs_ar"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        r["e2e_p50_vs_ar"] = r["e2e_p50"] / b["e2e_p50"] if b else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps({"requests": args.requests, "rows": table}, indent=1))
    lines = [f"{args.requests} held-out prompts per run, greedy, max_tokens {args.max_tokens}, float32, one "
             "server per configuration on this 2-core CPU; latencies in ms (ITL: per token, a streamed chunk's "
             "gap divided by its tokens)", ""]
    for c in levels:
        lines += [f"**concurrency {c}**", "",
                  "| config | req/s | tok/s | tok/s vs AR | TTFT p50/p90/p99 | ITL p50/p90/p99 | E2E p50/p90/p99 | "
                  "E2E p50 vs AR | accuracy % |", "|---|---|---|---|---|---|---|---|---|"]
        for r in [r for r in table if r["concurrency"] == c]:
            ratio = f"{r['tokens_per_s_vs_ar']:.2f}" if r["tokens_per_s_vs_ar"] else "-"
            e_ratio = f"{r['e2e_p50_vs_ar']:.2f}" if r["e2e_p50_vs_ar"] else "-"
            lines.append(f"| {r['config']} | {r['req_per_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | "
                         f"{r['ttft_p50']:.0f}/{r['ttft_p90']:.0f}/{r['ttft_p99']:.0f} | "
                         f"{r['itl_p50']:.1f}/{r['itl_p90']:.1f}/{r['itl_p99']:.1f} | "
                         f"{r['e2e_p50']:.0f}/{r['e2e_p90']:.0f}/{r['e2e_p99']:.0f} | {e_ratio} | {r['accuracy']:.1f} |")
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
        pts = sorted((r["e2e_p50"], r["tokens_per_s"], r["concurrency"]) for r in table if r["config"] == name)
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
