"""One dLLM step captured in a CUDA graph and replayed on later steps: outputs against eager, step time.

    python benchmarks/cuda_graph_step.py --device cuda --dtype bfloat16 --out OUT      # on a GPU (FlashInfer)
    .venv/bin/python benchmarks/cuda_graph_step.py --dry-run --out /tmp/dry             # CPU: FlashInfer's stand-in

A step: ``--batches`` requests (1 and 8), each one canvas of ``--window`` new rows over a cached prefix of about
``--prefix`` tokens (the prefix cache's forward), through the model and the project's attention. The FlashInfer
backend runs in CUDA-graph mode (:class:`~attention_backends.flashinfer_backend.GraphShape`: FlashInfer's
wrappers with persistent index buffers, the backend's row maps in persistent buffers); the token ids and
positions live in persistent device buffers. The graph is captured on step 0 and replayed on steps 1..n, each
with other tokens, other prefix lengths (up to 15 fewer) and other pages (the block table's rows shuffled):
the host plans the step (FlashInfer copies it into its buffers), the ids and positions are copied in, the
graph replays. Checked per step: the replay equals the same backend run eagerly on that step, bit for bit
(``identical``), and its largest difference from the backend without graph mode (another FlashInfer schedule).

Times (median of ``--reps``, device synchronised): ``eager`` = plan + forward with the backend as the engines use
it; ``replay`` = plan + input copies + replay; ``forward`` / ``replay only`` = the same without the plan.
``--dry-run`` runs the same plumbing on the CPU against the FlashInfer stand-in of ``tests/oracles`` (no capture:
the captured function is called directly), so everything but the capture is tried before GPU time is spent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_backends.paged_kv_cache import PagedKVCache  # noqa: E402
from attention_backends.prefix_attention import AttentionPlan  # noqa: E402
from benchmarks.verify_cost import captured, llada_8b_spec, median_ms, random_model  # noqa: E402
from model_executor.models.reference import ReferenceDLLM  # noqa: E402


def make_step(model, cache: PagedKVCache, batch: int, prefix: int, window: int, seed: int):
    """Host inputs of one step of the fixed shape: ids, positions and the plan."""
    s = model.spec
    g = torch.Generator().manual_seed(seed)
    lens = prefix - (torch.randint(0, 16, (batch,), generator=g) if seed else torch.zeros(batch, dtype=torch.long))
    table = cache.block_table[torch.randperm(batch, generator=g) if seed else torch.arange(batch)]
    ids = torch.randint(3, s.vocab_size, (batch * window,), generator=g)
    pos = torch.cat([torch.arange(int(n), int(n) + window) for n in lens])
    qo = torch.arange(0, batch * window + 1, window)
    plan = AttentionPlan(qo, lens, table, cache.page_size, kind=s.attention, positions=pos,
                         block_size=s.attention_block)
    return ids, pos, plan


def run_batch(model, args, batch: int, dtype, device, sync) -> dict:
    from attention_backends.flashinfer_backend import FlashInferPrefixAttention, GraphShape

    s = model.spec
    page = 16
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, [args.prefix + args.window] * batch, page,
                         dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    for kc, vc in cache.layers:  # a random prefix, drawn on the device
        kc.normal_(generator=gen)
        vc.normal_(generator=gen)
    steps = [make_step(model, cache, batch, args.prefix, args.window, seed) for seed in range(args.steps + 1)]
    shapes = [GraphShape.of(p) for _, _, p in steps]
    shape = GraphShape(shapes[0].segments, shapes[0].paged, max(x.page_indices for x in shapes), 0)
    graph_attn = FlashInferPrefixAttention(device, graph=shape)
    eager_attn = FlashInferPrefixAttention(device)
    geom = (s.num_heads, s.num_kv_heads, s.head_dim)
    T = batch * args.window
    ids_buf = torch.zeros(T, dtype=torch.long, device=device)
    pos_buf = torch.zeros(T, dtype=torch.long, device=device)
    pin = device.type == "cuda"

    def load(step) -> None:  # the step's plan and inputs into the persistent buffers
        ids, pos, plan = step
        graph_attn.plan(plan, *geom, dtype)
        ids_buf.copy_(ids.pin_memory() if pin else ids, non_blocking=True)
        pos_buf.copy_(pos.pin_memory() if pin else pos, non_blocking=True)

    def captured_step() -> torch.Tensor:
        return model.forward_planned(ids_buf, pos_buf, cache, graph_attn)

    with torch.no_grad():
        load(steps[0])
        replay, out = captured(captured_step) if not args.dry_run else (None, None)

        def replayed() -> torch.Tensor:
            if replay is None:  # dry run: the captured function itself
                return captured_step()
            replay()
            return out

        checks = []
        for i, step in enumerate(steps):
            load(step)
            got = replayed().clone()
            eager_same = captured_step().clone()  # the same backend and plan, not captured
            ids, pos, plan = step
            other = model.forward_paged(ids.to(device), pos.to(device), plan, cache, eager_attn)
            checks.append({"step": i, "prefix_lens": plan.prefix_lens.tolist(),
                           "identical": bool(torch.equal(got, eager_same)),
                           "max_abs_diff_vs_no_graph_backend": float((got.float() - other.float()).abs().max())})
        ids, pos, plan = steps[-1]
        idsd, posd = ids.to(device), pos.to(device)
        t = {"eager_ms": median_ms(lambda: model.forward_paged(idsd, posd, plan, cache, eager_attn), args.reps, sync),
             "forward_ms": median_ms(lambda: model.forward_planned(idsd, posd, cache, eager_attn), args.reps, sync),
             "replay_ms": median_ms(lambda: (load(steps[-1]), replayed()), args.reps, sync),
             "replay_only_ms": median_ms(replayed, args.reps, sync)}
    row = {"batch": batch, "rows": T, **{k: round(v, 3) for k, v in t.items()},
           "all_identical": all(c["identical"] for c in checks), "checks": checks}
    print({k: v for k, v in row.items() if k != "checks"}, flush=True)
    return row


def main() -> None:
    from psd_plugin import DEFAULT_DLLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["checkpoint", "llada-8b"], default="checkpoint")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="steps replayed after the captured one")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true", help="CPU, FlashInfer's stand-in, no capture")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.dry_run:
        sys.path.insert(0, str(ROOT / "tests"))
        from oracles import fake_flashinfer

        sys.modules["flashinfer"] = fake_flashinfer
        args.device, args.reps = "cpu", 2
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if args.shape == "llada-8b":
        model = random_model(llada_8b_spec(), dtype, device)
    else:
        model = ReferenceDLLM.from_pretrained(DEFAULT_DLLM, dtype=dtype, device=device)
    rows = [run_batch(model, args, b, dtype, device, sync) for b in map(int, args.batches.split(","))]
    meta = {"model": "LLaDA-8B shape, random" if args.shape == "llada-8b" else Path(DEFAULT_DLLM).name,
            "device": str(device), "dtype": args.dtype, "prefix": args.prefix, "window": args.window,
            "steps": args.steps, "reps": args.reps, "dry_run": args.dry_run,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"cuda_graph_step_{args.shape}"
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta['model']}, {meta['gpu'] or meta['device']}, {args.dtype}, FlashInfer (fa2) in CUDA-graph mode, "
             f"prefix ~{args.prefix}, window {args.window}, captured on step 0 and replayed on {args.steps} more "
             f"steps (other tokens, prefix lengths, pages); median of {args.reps}", "",
             "| batch | rows | replays = eager, bitwise | max diff vs backend without graph mode | eager ms (plan + "
             "forward) | replay ms (plan + copy + replay) | speed-up | forward ms | replay only ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = max(c["max_abs_diff_vs_no_graph_backend"] for c in r["checks"])
        lines.append(f"| {r['batch']} | {r['rows']} | {sum(c['identical'] for c in r['checks'])}/{len(r['checks'])} "
                     f"| {diff:.3g} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | "
                     f"{r['eager_ms'] / r['replay_ms']:.2f}x | {r['forward_ms']:.3f} | {r['replay_only_ms']:.3f} |")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not all(r["all_identical"] for r in rows):
        raise SystemExit("a replayed step differs from the same step run eagerly")


if __name__ == "__main__":
    main()
