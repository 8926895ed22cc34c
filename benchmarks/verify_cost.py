"""Cost of one draft-verification forward against the number of draft canvases: shared vs expanded prefix.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verify_cost.py [--backend torch] [--device cpu] [--dtype float32]
    python benchmarks/verify_cost.py --shape llada-8b --device cuda --dtype bfloat16 --backend flashinfer \
        --prefixes 512 --window 32        # the GPU issue's setting (random weights, no checkpoint needed)

One forward of the embedded model (``--model``, llada-tiny by default) for ``--batches`` requests, each with a
cached prefix of ``P`` tokens and a window of ``--window`` new tokens (a block of 8 plus the masks after it, as
the reference engine forwards with max_tokens 32), carrying the state canvas plus ``K`` draft canvases,
K in 0, 1, 3, 7, 15. Two layouts of the same work through the same attention backend:

- ``shared``: one request per sequence, its ``K + 1`` canvases as segments over one prefix (what both engines do);
- ``expanded``: every canvas its own request with its own copy of the prefix (what a batch of independent
  sequences costs: the prefix is read ``K + 1`` times).

Reports the median wall time of a forward (``--reps`` timed after warm-up) and its ratio to K = 0 in the same
layout, for each prefix length; writes ``verify_cost.md`` / ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_backends.prefix_attention import AttentionPlan, make_backend  # noqa: E402
from attention_backends.paged_kv_cache import PagedKVCache  # noqa: E402
from model_executor.models.reference import ReferenceDLLM  # noqa: E402

DRAFTS = (0, 1, 3, 7, 15)


def verify_inputs(model: ReferenceDLLM, batch: int, prefix: int, window: int, canvases: int, shared: bool,
                  page: int = 16, seed: int = 0, cache: PagedKVCache | None = None):
    """Token ids, positions, plan and a filled cache for one verification forward (module docstring); ``cache``:
    one made for the same ``batch``, ``prefix`` and ``window`` to reuse (filling a large one costs more than
    the forwards)."""
    s = model.spec
    p = next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    if cache is None:
        cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, [prefix + window] * batch, page, p.dtype,
                             p.device)
        fill = torch.Generator(device=p.device).manual_seed(seed)
        for kc, vc in cache.layers:  # a random prefix, drawn where the cache is: only its layout matters
            kc.normal_(generator=fill)
            vc.normal_(generator=fill)
    n = batch * canvases * window
    ids = torch.randint(3, s.vocab_size, (n,), generator=g, device="cpu").to(p.device)
    pos = torch.arange(prefix, prefix + window).repeat(batch * canvases).to(p.device)
    seg = torch.arange(0, n + 1, window)
    if shared:
        qo = torch.arange(0, n + 1, canvases * window)
        table = cache.block_table
    else:  # each canvas a request of its own, reading its sequence's prefix pages
        qo = seg
        table = cache.block_table.repeat_interleave(canvases, 0)
    plan = AttentionPlan(qo, torch.full((qo.numel() - 1,), prefix), table, cache.page_size, kind=s.attention,
                         seg_indptr=seg,
                         positions=pos.cpu(), block_size=s.attention_block)
    return ids, pos, plan, cache


def llada_8b_spec():
    """LLaDA-8B's shape (32 layers, hidden 4096, 32 heads, MLP 12288, vocabulary 126464)."""
    from model_executor.models.configs import ArchSpec

    return ArchSpec("llada", 4096, 32, 32, 32, 128, 12288, 126464, 500000.0, 1e-5, 4096, 126336, 126081,
                    False, False, False, "bidirectional", None, False)


def random_model(spec, dtype: torch.dtype, device) -> ReferenceDLLM:
    """A model of ``spec`` with random weights, made directly in ``dtype`` on ``device``."""
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return ReferenceDLLM(spec).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def captured(fn):
    """``fn`` captured in a CUDA graph after three warm-up runs on a side stream: returns ``(replay, output)``. On
    the CPU (dry runs) ``fn`` itself is the replay."""
    if not torch.cuda.is_available():
        return fn, None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def forward_ms(model: ReferenceDLLM, ids, pos, plan, cache, attn, reps: int, sync, graph: bool = False) -> float:
    """Median milliseconds of one forward: eager (plan included, as the reference engines run it) or, with
    ``graph``, the replay of a CUDA graph captured for this step with FlashInfer in CUDA-graph mode (the GPU's time
    without the host's launch overhead, as a served step with CUDA graphs)."""
    if not graph:
        return median_ms(lambda: model.forward_paged(ids, pos, plan, cache, attn), reps, sync)
    from attention_backends.flashinfer_backend import FlashInferPrefixAttention, GraphShape

    s = model.spec
    p = next(model.parameters())
    for workspace in (512 << 20, 2 << 30, 8 << 30):  # FlashInfer says when its split-KV buffers need more
        g_attn = FlashInferPrefixAttention(p.device, workspace_bytes=workspace, graph=GraphShape.of(plan))
        try:
            g_attn.plan(plan, s.num_heads, s.num_kv_heads, s.head_dim, p.dtype)
            break
        except RuntimeError as e:
            if "workspace" not in str(e) or workspace == 8 << 30:
                raise
            print(f"FlashInfer workspace {workspace >> 20} MB too small for {plan.num_tokens} rows: {e}", flush=True)
    with torch.no_grad():
        replay, _ = captured(lambda: model.forward_planned(ids, pos, cache, g_attn))
        return median_ms(replay, reps, sync)


def median_ms(forward, reps: int, sync) -> float:
    """The median wall time of ``forward()`` in milliseconds over ``reps`` runs after 3 warm-up runs, the device
    synchronised around each."""
    times = []
    with torch.no_grad():
        for i in range(reps + 3):
            sync()
            t0 = time.perf_counter()
            forward()
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    from psd_plugin import DEFAULT_DLLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--shape", choices=["checkpoint", "llada-8b"], default="checkpoint",
                    help="llada-8b: LLaDA-8B's shape (32 layers, hidden 4096, 32 heads, MLP 12288) with random "
                         "weights, for GPU figures (needs about 16 GB in bfloat16)")
    ap.add_argument("--backend", default="torch", help="auto, torch or flashinfer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", default="1,8", help="requests per forward")
    ap.add_argument("--prefixes", default="64,448")
    ap.add_argument("--window", default="32", help="new rows per canvas, a comma list: the block alone (the dual "
                    "cache's forward) or the block plus the masks after it (the prefix cache's)")
    ap.add_argument("--max-rows", type=int, default=1 << 30, help="skip forwards of more rows (reported as skipped)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (FlashInfer in CUDA-graph mode) "
                    "instead of eager forwards")
    ap.add_argument("--ar", action="store_true", help="also time the AR baseline (Llama-8B shape with --shape "
                    "llada-8b) and print predicted tokens/s per method")
    ap.add_argument("--tpf", default="confidence:1.98:1,psd:2.77:4",
                    help="method:TPF:canvases for the predicted tokens/s (TPF: benchmarks/results/vllm_engine.md)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    if args.shape == "llada-8b":
        model = random_model(llada_8b_spec(), dtype, args.device)
    else:
        model = ReferenceDLLM.from_pretrained(args.model, dtype=dtype, device=args.device)
    attn = make_backend(args.backend, args.device, dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows, skipped = [], []
    windows = [int(w) for w in str(args.window).split(",")]
    for window in windows:
        for batch, prefix in [(b, p) for b in map(int, args.batches.split(",")) for p in map(int, args.prefixes.split(","))]:
            base, cache = {}, None
            for k in DRAFTS:
                if batch * (k + 1) * window > args.max_rows:
                    skipped.append({"window": window, "batch": batch, "prefix": prefix, "drafts": k})
                    continue
                row = {"window": window, "batch": batch, "prefix": prefix, "drafts": k,
                       "rows": batch * (k + 1) * window}
                for layout in ("shared", "expanded"):
                    ids, pos, plan, cache = verify_inputs(model, batch, prefix, window, k + 1, layout == "shared",
                                                          cache=cache)
                    ms = forward_ms(model, ids, pos, plan, cache, attn, args.reps, sync, args.graph)
                    base.setdefault(layout, ms)
                    row[f"{layout}_ms"] = round(ms, 3)
                    row[f"{layout}_vs_k0"] = round(ms / base[layout], 2)
                row["expanded_over_shared"] = round(row["expanded_ms"] / row["shared_ms"], 2)
                rows.append(row)
                print(row, flush=True)
            del cache
    ar_rows = ar_cost(args, dtype, sync) if args.ar else []
    meta = {"model": Path(args.model).name if args.shape == "checkpoint" else "LLaDA-8B shape, random",
            "backend": attn.name, "device": args.device, "dtype": args.dtype, "window": args.window, "reps": args.reps,
            "threads": torch.get_num_threads(), "timing": "CUDA-graph replay" if args.graph else "eager, plan included"}
    if args.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    name = "verify_cost" if args.device == "cpu" else f"verify_cost_{args.device.split(':')[0]}_{args.shape}"
    name += "_graph" if args.graph else ""
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "ar": ar_rows,
                                                       "skipped": skipped}, indent=1))
    text = render(meta, rows) + bends(rows) + (render_ar([r for r in rows if r["window"] == windows[0]], ar_rows,
                                                         args.tpf) if ar_rows else "")
    if skipped:
        text += f"\nSkipped (over --max-rows {args.max_rows} rows): {skipped}\n"
    (args.out / f"{name}.md").write_text(text)
    print(text)


def ar_cost(args, dtype, sync) -> list[dict]:
    """The AR baseline in the same run: one decoding step of a Llama-format model (``--shape llada-8b``:
    Llama-3-8B's shape, random weights; else the embedded AR checkpoint) for the same batches and prefixes,
    one new token per request over its cached prefix, causal."""
    from model_executor.models.configs import ArchSpec
    from psd_plugin import DEFAULT_AR

    if args.shape == "llada-8b":
        spec = ArchSpec.from_ar_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                        "num_attention_heads": 32, "num_key_value_heads": 8,
                                        "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0,
                                        "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "eos_token_id": 2})
        model = random_model(spec, dtype, args.device)
    else:
        model = ReferenceDLLM.from_pretrained(DEFAULT_AR, dtype=dtype, device=args.device)
    attn = make_backend(args.backend, args.device, dtype)
    out = []
    for batch, prefix in [(b, p) for b in map(int, args.batches.split(",")) for p in map(int, args.prefixes.split(","))]:
        ids, pos, plan, cache = verify_inputs(model, batch, prefix, 1, 1, True)
        ms = forward_ms(model, ids, pos, plan, cache, attn, args.reps, sync, args.graph)
        out.append({"batch": batch, "prefix": prefix, "ar_ms": round(ms, 3)})
        print(out[-1], flush=True)
    del model
    return out


def render_ar(rows: list[dict], ar_rows: list[dict], tpf: str) -> str:
    """A cost model, not a served figure: per method, tokens/s = batch x TPF (measured on the embedded models,
    ``--tpf method:value:canvases``) / the time of a forward with that many canvases (shared layout), beside
    AR's batch / its per-token step time."""
    methods = [(m, float(t), int(c)) for m, t, c in (x.split(":") for x in tpf.split(","))]
    head = " | ".join(f"{m} (TPF {t:g}, {c} canvas{'es' if c > 1 else ''})" for m, t, c in methods)
    lines = ["", "AR baseline in the same run, and predicted tokens/s (a cost model: TPF measured on the embedded "
             "models / step time here; not a served figure):", "",
             f"| batch | prefix | AR ms/token | AR tokens/s | {head} |", "|---|---|---|---|" + "---|" * len(methods)]
    for a in ar_rows:
        by_k = {r["drafts"]: r["shared_ms"] for r in rows if r["batch"] == a["batch"] and r["prefix"] == a["prefix"]}
        cells = [f"{a['batch'] * t / (by_k[c - 1] / 1e3):.0f}" if c - 1 in by_k else "" for _, t, c in methods]
        lines.append(f"| {a['batch']} | {a['prefix']} | {a['ar_ms']:.2f} | {a['batch'] / (a['ar_ms'] / 1e3):.0f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(meta: dict, rows: list[dict]) -> str:
    gpu = f" ({meta['gpu']})" if meta.get("gpu") else ""
    lines = [f"{meta['model']}, {meta['backend']} backend, {meta['device']}{gpu}, {meta['dtype']}, window "
             f"{meta['window']} tokens per canvas, {meta['threads']} thread(s), median of {meta['reps']} forwards "
             f"({meta.get('timing', 'eager, plan included')})",
             "", "| window | batch | prefix | drafts K | rows | shared ms | shared vs K=0 | expanded ms | expanded vs K=0 | "
             "expanded / shared |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['window']} | {r['batch']} | {r['prefix']} | {r['drafts']} | {r['rows']} | {r['shared_ms']:.2f} | "
              f"{r['shared_vs_k0']:.2f}x | {r['expanded_ms']:.2f} | {r['expanded_vs_k0']:.2f}x | "
              f"{r['expanded_over_shared']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def bends(rows: list[dict]) -> str:
    """Where the cost curve bends, per window, batch and prefix (shared layout): the most drafts that cost at most
    10% over one canvas (memory-bound: rows nearly free), the first K that costs 1.5x or more, and the time per
    row at the largest K against K = 0 (compute-bound: time grows with rows)."""
    lines = ["", "Where the curve bends (shared layout; free = at most +10% over K = 0):", "",
             "| window | batch | prefix | K=3 vs K=0 | most drafts within +10% | first K at >= 1.5x | rows there |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["window"], r["batch"], r["prefix"]) for r in rows})
    for w, b, p in keys:
        rs = sorted((r for r in rows if (r["window"], r["batch"], r["prefix"]) == (w, b, p)), key=lambda r: r["drafts"])
        free = 0
        for r in rs:  # the drafts up to which every K stays within +10%
            if r["shared_vs_k0"] > 1.10:
                break
            free = r["drafts"]
        steep = next((r for r in rs if r["shared_vs_k0"] >= 1.5), None)
        k3 = next((f"{r['shared_vs_k0']:.2f}x" for r in rs if r["drafts"] == 3), "")
        lines.append(f"| {w} | {b} | {p} | {k3} | {free} | {steep['drafts'] if steep else '-'} | "
                     f"{steep['rows'] if steep else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
