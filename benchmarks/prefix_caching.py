"""Prefix caching for the block-causal families: shared system prompts and multi-turn chats, cache off and on.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefix_caching.py [--system 1000] [--requests 64] \
        [--chats 8] [--turns 8] [--families sdar,llada2] [--repeats 2] [--out benchmarks/results]

Two workloads through vLLM in one process (``LLM.generate``), on random SDAR and LLaDA2 checkpoints of the
embedded tiny shapes (built here with 2,048 positions; random weights: the answers are noise, the timings and
hit rates are what this measures) and on the AR ``ar-tiny`` beside them (vLLM's own prefix caching; a copy
whose config allows 2,048 positions, its trained weights past their 512: timings, not answers):

- *shared*: ``--requests`` requests of a ``--system``-token system prompt and an 8-token question each, sent in
  one call; 32 tokens each;
- *chat*: ``--chats`` conversations of ``--turns`` turns: each turn's prompt is the last turn's prompt, its
  answer and 8 new tokens (a 200-token opening); a turn of every chat per call; 32 tokens a turn.

Per engine, workload and ``enable_prefix_caching``: generated tokens per second over the wall time, time to
first token (vLLM's per-request ``first_token_latency``; a dLLM's first token arrives with its first block)
p50 / p99, and the prefix-cache hit rate (hit tokens / looked-up tokens, vLLM's counters). Off and on alternate
``--repeats`` times (min-max). dLLM decoding: PSD (``decoding: psd``, the block cache). Writes
``prefix_caching.md`` / ``.json`` into ``--out``. Times are this CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

MAX_LEN = 2048


def _counters(llm) -> tuple[float, float]:
    m = {x.name: x.value for x in llm.get_metrics() if x.name in ("vllm:prefix_cache_hits",
                                                                   "vllm:prefix_cache_queries")}
    return m.get("vllm:prefix_cache_hits", 0.0), m.get("vllm:prefix_cache_queries", 0.0)


def _calls(llm, first: list[list[int]], turns: int) -> dict:
    """``turns`` calls: the prompts ``first``, then each turn every prompt extended by its answer and 8 new
    tokens (``turns`` 1: one call); tokens/s, TTFT percentiles and the hit rate over them."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    h0, q0 = _counters(llm)
    ttft, tokens, t0 = [], 0, time.perf_counter()
    prompts = first
    for turn in range(turns):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers = [list(o.outputs[0].token_ids) for o in outs]
        tokens += sum(len(a) for a in answers)
        ttft += [o.metrics.first_token_latency for o in outs if o.metrics is not None]
        prompts = [p + a + [(37 * turn + k) % 480 + 20 for k in range(8)] for p, a in zip(prompts, answers)]
    wall = time.perf_counter() - t0
    h1, q1 = _counters(llm)
    ttft.sort()
    return {"tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttft) if ttft else None,
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0}


def main() -> None:
    from vllm import LLM

    from model_executor.models.tiny import make_tiny_checkpoint
    from psd_plugin import DEFAULT_AR, DEFAULT_DLLM
    from psd_plugin.vllm import compat

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--families", default="sdar,llada2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    def workloads(salt: int) -> dict:
        """Each repeat its own system prompt and chat openings (``salt``): every repeat starts from a cold cache."""
        system = [(13 * j + salt) % 480 + 20 for j in range(args.system)]
        shared = [system + [(7 * i + k + salt) % 480 + 20 for k in range(8)] for i in range(args.requests)]
        chats = [[(11 * c + 5 * j + salt) % 480 + 20 for j in range(200)] for c in range(args.chats)]
        return {"shared": (shared, 1), "chat": (chats, args.turns)}

    tmp = Path(tempfile.mkdtemp(prefix="psd_prefix_"))
    models = {f: make_tiny_checkpoint(f, tmp / f, DEFAULT_DLLM, seed=0, max_positions=MAX_LEN)
              for f in args.families.split(",")}
    # ar-tiny with 2,048 positions (its rotary tables are sized by the config; the weights as trained)
    ar = tmp / "ar-tiny"
    shutil.copytree(DEFAULT_AR, ar)
    cfg = json.loads((ar / "config.json").read_text())
    cfg["max_position_embeddings"] = MAX_LEN
    (ar / "config.json").write_text(json.dumps(cfg, indent=1))
    models["AR"] = ar
    rows = []
    for name, path in models.items():
        spec = {} if name == "AR" else {"speculative_config": {"method": "psd", "decoding": "psd"}}
        engines = {on: LLM(model=str(path), dtype="float32", seed=0, max_model_len=MAX_LEN, block_size=32,
                           enable_prefix_caching=on, disable_log_stats=False, **spec) for on in (False, True)}
        try:
            for llm in engines.values():  # warm-up, outside the figures (a prompt no workload shares)
                _calls(llm, [[400 + j % 50 for j in range(64)]], 1)
            runs = {(wl, on): [] for wl in ("shared", "chat") for on in engines}
            for rep in range(args.repeats):
                for wl, (first, turns) in workloads(1000 * (rep + 1)).items():
                    for on, llm in engines.items():
                        runs[wl, on].append(_calls(llm, first, turns))
            for (wl, on), got in runs.items():
                rows.append({"model": name, "workload": wl, "prefix_caching": on, "runs": got})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            for llm in engines.values():
                compat.shutdown(llm)
            del engines

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(args, k) for k in ("system", "requests", "chats", "turns", "repeats")}
    (args.out / "prefix_caching.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def span(v, fmt):
        return f"{fmt.format(min(v))}-{fmt.format(max(v))}" if len(v) > 1 else fmt.format(v[0])
    lines = [f"shared: {args.requests} requests of a {args.system}-token system prompt + 8 tokens, one call; chat: "
             f"{args.chats} chats x {args.turns} turns (200-token opening, each turn the last prompt + its answer + "
             f"8 tokens); 32 tokens each (ignore_eos), float32, pages of 32 tokens, this CPU, {args.repeats} "
             "alternating repeats (min-max); dLLMs: random SDAR / LLaDA2 of the tiny shapes, PSD with the block "
             "cache; AR: ar-tiny.", "",
             "| model | workload | prefix caching | tokens/s | TTFT p50 s | TTFT p99 s | hit rate |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["runs"]
        lines.append(f"| {r['model']} | {r['workload']} | {'on' if r['prefix_caching'] else 'off'} | "
                     f"{span([x['tokens_per_s'] for x in g], '{:.0f}')} | "
                     f"{span([x['ttft_p50'] for x in g], '{:.3f}')} | {span([x['ttft_p99'] for x in g], '{:.3f}')} | "
                     f"{span([x['hit_rate'] for x in g], '{:.2f}')} |")
    (args.out / "prefix_caching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
