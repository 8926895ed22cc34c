"""One attention layer of a dLLM step on the CPU: vLLM's paged CPU kernel (the default) against the project's
PyTorch path (``PSD_CPU_ATTENTION=torch``), as the vLLM backend runs it: K/V written into vLLM's CPU pages at
the step's slots, then attention of the step's rows.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/cpu_attention.py [--out benchmarks/results]

Shapes: the embedded models' (4 heads of 64) and LLaDA-8B's (32 heads of 128), float32; one request or 16; a
DualCache step (the block of 8 plus the shift row, prefix 40 or 400, a kept suffix of 24), a prefix-cache first
step (prompt 30 plus 32 masks) and a long answer's first step (prompt 180 plus 256 masks); with 0 or 3 draft
canvases. Per layer: the plan (``build``, once per forward for all layers, reported beside) and the layer's
``forward`` (K/V write and attention), the median of repeated runs. Writes ``cpu_attention.md`` / ``.json``.
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

PAGE = 128  # vLLM's CPU page
SHAPES = {"embedded": (4, 4, 64), "llada-8b": (32, 32, 128)}
STEPS = {  # name: (rows of the first canvas, cached prefix, kept suffix, fresh: the prompt prefill's rows too)
    "dual later step": (9, 40, 24),
    "dual later step, long prefix": (9, 400, 24),
    "first step (prompt 30 + 32 masks)": (62, 0, 0),
    "long answer's first step (180 + 256)": (436, 0, 0),
}


def _case(requests: int, rows: int, prefix: int, suffix: int, drafts: int):
    from model_executor.dllm_request import DLLMStep

    from attention_backends.step_batch import build_step_batch

    g = torch.Generator().manual_seed(0)
    entries = []
    for _ in range(requests):
        w0 = prefix
        entries.append(DLLMStep(w0=w0, w1=w0 + rows, b0=w0 + rows - 8 if rows > 8 else w0, b1=w0 + rows,
                                tokens=torch.randint(3, 90, (1 + drafts, rows), generator=g), keep=w0, shift=0,
                                suffix=(w0 + rows, w0 + rows + suffix) if suffix else (0, 0)))
    return build_step_batch(entries)


def _metadata(batch, pages_per_request: int):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from attention_backends.step_batch import HostPages, set_step

    R, T = batch.num_requests, batch.num_scheduled
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), batch.scheduled_lens.cumsum(0)]).to(torch.int32)
    seq = (batch.prefix_lens + batch.scheduled_lens).to(torch.int32)
    table = (torch.arange(R * pages_per_request) + 1).view(R, pages_per_request).to(torch.int32)
    req = torch.repeat_interleave(torch.arange(R), batch.scheduled_lens)
    pos = batch.positions[:T]
    slots = table[req, pos // PAGE].long() * PAGE + pos % PAGE
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=R, num_actual_tokens=T,
        max_query_len=int(batch.scheduled_lens.max()), max_seq_len=int(seq.max()), block_table_tensor=table,
        slot_mapping=slots, positions=pos, seq_lens_cpu_upper_bound=seq)
    batch.pages = HostPages((frozenset({"layer"}),), (PAGE,), (table,))
    set_step(batch)
    return cam, int(table.max()) + 1


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def measure(shape: str, step: str, requests: int, drafts: int, kernel: str, reps: int) -> dict:
    import os

    from attention_backends.step_batch import set_step
    from attention_backends.vllm_backend import PSDAttentionImpl, psd_attention_backend

    os.environ["PSD_CPU_ATTENTION"] = kernel
    H, Hkv, D = SHAPES[shape]
    rows, prefix, suffix = STEPS[step]
    batch = _case(requests, rows, prefix, suffix, drafts)
    cam, pages = _metadata(batch, (prefix + rows + suffix) // PAGE + 1)
    builder = psd_attention_backend("bidirectional").get_builder_cls().for_geometry(
        H, Hkv, D, PAGE, torch.float32, "cpu", layer_names=("layer",), head_major=True)
    N = batch.num_rows
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(N, h, D, generator=g) for h in (H, Hkv, Hkv))
    cache = torch.randn(pages, Hkv, PAGE, 2 * D, generator=g)
    impl = PSDAttentionImpl(H, D, D ** -0.5, num_kv_heads=Hkv)
    out = torch.empty(N, H, D)
    md = builder.build(0, cam)
    row = {"shape": shape, "step": step, "requests": requests, "drafts": drafts, "kernel": kernel, "rows": N,
           "kernel_rows": batch.num_scheduled if md.kernel is not None else 0,
           "build_us": _time(lambda: builder.build(0, cam), reps),
           "layer_us": _time(lambda: impl.forward(None, q, k, v, cache, md, out), reps)}
    set_step(None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    table = []
    for shape in SHAPES:
        for step in STEPS:
            for requests in (1, 16):
                for drafts in (0, 3):
                    if requests * (1 + drafts) * STEPS[step][0] > 4096:
                        continue
                    pair = [measure(shape, step, requests, drafts, k, args.reps) for k in ("torch", "vllm")]
                    table += pair
                    t, v = pair
                    print(f"{shape:9s} {step:38s} R={requests:2d} drafts={drafts}: layer {t['layer_us']:8.1f} -> "
                          f"{v['layer_us']:8.1f} us ({t['layer_us'] / v['layer_us']:.2f}x), build "
                          f"{t['build_us']:6.0f} -> {v['build_us']:6.0f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_attention.json").write_text(json.dumps(table, indent=1))
    lines = ["One attention layer on this CPU (float32, `OMP_NUM_THREADS=2`, median of "
             f"{args.reps}): the project's PyTorch path (`PSD_CPU_ATTENTION=torch`) against vLLM's paged CPU kernel "
             "(the default: the scheduled rows, and each draft canvas as one more kernel call). *layer*: the "
             "layer's forward (K/V writes and attention); *build*: the plan, once per forward for every layer.", "",
             "| shape | step | requests | drafts | rows | layer µs, PyTorch | layer µs, vLLM kernel | speed-up | "
             "build µs, PyTorch | build µs, vLLM kernel |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t, v in zip(table[::2], table[1::2]):
        lines.append(f"| {t['shape']} | {t['step']} | {t['requests']} | {t['drafts']} | {t['rows']} | "
                     f"{t['layer_us']:.0f} | {v['layer_us']:.0f} | {t['layer_us'] / v['layer_us']:.2f}x | "
                     f"{t['build_us']:.0f} | {v['build_us']:.0f} |")
    (args.out / "cpu_attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
