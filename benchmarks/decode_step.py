"""Decoder time per step at a real dLLM vocabulary, on synthetic logits: the batched step against one softmax per canvas.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_step.py [--mode batched|canvas] [--vocab 126464] [--out DIR]
        [--requests 64] [--block 32] [--steps 4] [--methods static,confidence,psd]

Every request decodes one block of ``--block`` masks with each method's defaults (PSD depth 3, LoPA 3
branches, FreeDave 4 steps, Spiffy the shipped confidence-base graph, D* 3: up to 4 canvases). Per step the
script builds the logits of every canvas of every request (``[rows, vocab]`` float32, outside the timed
region): Gaussian noise plus one peaked token per block position whose height, fixed per position, gives
confidences from ~0.1 to ~0.99, so policies commit several positions and drafts get accepted. Timed: the
decoders' proposals and their updates for all requests; in ``batched`` mode as the engines do it: one
:func:`~model_executor.decoding.base.predict_rows` pass over the rows of masked canvas positions and
:func:`~model_executor.decoding.base.propose_all` and :func:`~model_executor.decoding.base.update_all` (the
decoders of a method stepped together); ``canvas`` mode runs the methods written for one block (the tests'
oracles, ``tests/oracles/decoders.py``: ``canvases()`` and ``update``), handing each its canvases' bare logits,
one block at a time. Per step
the time of the predictions (``predict_rows``) and of the decoders' own work (canvases, acceptance, commits:
``decoder_ms_per_step``) are reported apart. Writes ``decode_step_<mode>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from model_executor.decoding import load_graph, make_decoder
    from psd_plugin import DEFAULT_DLLM, default_graph

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("batched", "canvas"), default="batched")
    ap.add_argument("--vocab", type=int, default=126_464)  # LLaDA-8B
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method (the block may finish sooner)")
    ap.add_argument("--methods", default="static,confidence,localleap,lopa,freedave,spiffy,psd")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.mode == "batched":
        from model_executor.decoding import predict_rows, propose_all, update_all
    else:  # the one-block oracles
        sys.path.insert(0, str(ROOT / "tests"))
        from oracles.decoders import make_oracle as make_decoder

    R, L, V, mask = args.requests, args.block, args.vocab, args.vocab - 1
    g = torch.Generator().manual_seed(0)
    rows_max = R * 4 * L
    base = torch.randn(rows_max, V, generator=g)  # reused every step (only read)
    true_tok = torch.randint(0, V - 1, (R, L), generator=g)
    height = 8.0 + 9.0 * torch.rand(R, L, generator=g)  # lse of the noise ~ log(V) + 0.5: conf 0.03 .. 0.99
    rows_of = torch.arange(rows_max).view(R, 4, L)
    for c in range(4):  # every canvas slot of request r predicts the same token at a position
        base[rows_of[:, c].flatten(), true_tok.flatten()] = height.flatten()
    graph = load_graph(default_graph(DEFAULT_DLLM, "confidence"))
    results = []
    for method in args.methods.split(","):
        kw = {"graph": graph} if method == "spiffy" else {}
        decs = [make_decoder(method, torch.full((L,), mask), mask, **kw) for _ in range(R)]
        times, rules, canvases_per_step = [], [], []
        for _ in range(args.steps):
            live = [d for d in decs if not d.done]
            if not live:
                break
            t0 = time.perf_counter()
            if args.mode == "batched":  # as the engines do: every decoder's canvases, a method at a time
                props = propose_all(live)
                cans = [p.canvases for p in props]
            else:
                cans = [d.canvases() for d in live]
            t_canvas = time.perf_counter() - t0
            idx = torch.cat([rows_of[r, : len(c)].flatten() for r, c in enumerate(cans)])
            kept = torch.cat([(torch.stack(c) == mask).flatten() for c in cans])  # masked canvas rows
            # the step's logits (not timed): the batched engines compute the kept rows only
            logits = base[idx[kept]] if args.mode == "batched" else base[idx]
            t0 = time.perf_counter()
            if args.mode == "batched":
                preds = predict_rows(logits, mask_id=mask, kept=kept)
            else:
                preds = logits
            t_pred = time.perf_counter() - t0
            if args.mode == "batched":  # as the engines do: the decoders of a method in one batched update
                firsts, i = [], 0
                for c in cans:
                    firsts.append([i + k * L for k in range(len(c))])
                    i += len(c) * L
                update_all(live, props, preds, firsts)
            else:
                i = 0
                for d, c in zip(live, cans):
                    d.update([preds[i + k * L: i + (k + 1) * L] for k in range(len(c))])
                    i += len(c) * L
            times.append(t_canvas + time.perf_counter() - t0)
            rules.append(times[-1] - t_pred)  # the decoders' own work: canvases, acceptance, commits
            canvases_per_step.append(sum(len(c) for c in cans))
            del logits
        ms = 1e3 * sorted(times)[len(times) // 2]  # median: this machine's memory bandwidth is shared and noisy
        rule_ms = 1e3 * sorted(rules)[len(rules) // 2]
        results.append({"method": method, "ms_per_step": ms, "decoder_ms_per_step": rule_ms, "steps": len(times),
                        "canvases_per_step": sum(canvases_per_step) / len(canvases_per_step)})
        print(f"{method:<11} {args.mode:<8} {ms:9.1f} ms/step, decoders {rule_ms:6.1f} ms  ({len(times)} steps, "
              f"{results[-1]['canvases_per_step']:.0f} canvases/step)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"mode": args.mode, "vocab": V, "requests": R, "block": L, "threads": torch.get_num_threads()}
    (args.out / f"decode_step_{args.mode}.json").write_text(json.dumps({**meta, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
