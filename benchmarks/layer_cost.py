"""Where extra rows stop being nearly free on this CPU: one decoder layer at LLaDA-8B's shape, time against rows.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/layer_cost.py [--dtypes float32,bfloat16] [--prefixes 512,2048]

A real 8B model is memory-bound at small batch (its weights stream from memory once per forward whatever the
rows), where the 5M embedded model, which fits in cache, is compute-bound (every row costs). One LLaDA-8B
decoder layer (hidden 4096, 32 heads of 128, SwiGLU 12288; random weights: 218M parameters, the same count as
a Llama-3-8B layer, whose GQA and wider MLP balance out) runs one forward of ``R`` new rows (one canvas over a
cached prefix of ``P`` tokens, the project's PyTorch attention backend) for R = 1 .. 512; the LM head (4096 x
126464) is timed apart for the rows whose logits a step computes. An 8B forward is then modelled as 32 layers
+ the LM head.

From it, a **cost model** (not a served figure): AR decoding at batch 1 takes one row per token; a dLLM step
forwards ``rows`` rows and commits ``TPF`` tokens (``--tpf method:TPF:rows:logit_rows``, TPFs measured on the
embedded model, rows of its step at the dual cache's block of 32 or the prefix cache's block plus masks), so
predicted dLLM / AR tokens/s = TPF x t_AR / t_step. Writes ``layer_cost.json`` and ``layer_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_backends.prefix_attention import make_backend  # noqa: E402
from benchmarks.verify_cost import median_ms, verify_inputs  # noqa: E402
from model_executor.models.configs import ArchSpec  # noqa: E402
from model_executor.models.reference import ReferenceDLLM  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LAYERS, VOCAB, HIDDEN = 32, 126464, 4096


def layer_model(dtype):
    """One LLaDA-8B layer (a 512-token vocabulary: its embedding and head are negligible; the real head is timed
    apart)."""
    spec = ArchSpec("llada", HIDDEN, 1, 32, 32, 128, 12288, 512, 500000.0, 1e-5, 4096, 511, 0,
                    False, False, False, "bidirectional", None, False)
    torch.set_default_dtype(dtype)
    model = ReferenceDLLM(spec).eval()
    torch.set_default_dtype(torch.float32)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prefixes", default="512,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tpf", default="confidence dual:1.98:32:32,psd dual:2.77:128:32,lopa dual:3.29:128:32",
                    help="method:TPF:rows per step:logit rows per step")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    rows_out, meta = [], {"threads": torch.get_num_threads(), "reps": a.reps, "device": "cpu"}
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        model = layer_model(dtype)
        attn = make_backend("torch", "cpu", dtype)
        head = torch.randn(VOCAB, HIDDEN, dtype=dtype)
        for prefix in map(int, a.prefixes.split(",")):
            base = None
            for R in ROWS:
                ids, pos, plan, cache = verify_inputs(model, 1, prefix, R, 1, True)
                ms = median_ms(lambda: model.forward_paged(ids, pos, plan, cache, attn,
                                                           logits_rows=torch.zeros(0, dtype=torch.long)), a.reps,
                               lambda: None)
                x = torch.randn(R, HIDDEN, dtype=dtype)
                head_ms = median_ms(lambda: x @ head.T, a.reps, lambda: None)
                base = base or ms
                row = {"dtype": dname, "prefix": prefix, "rows": R, "layer_ms": round(ms, 3),
                       "vs_1_row": round(ms / base, 2), "per_row_ms": round(ms / R, 4), "head_ms": round(head_ms, 3)}
                rows_out.append(row)
                print(row, flush=True)
        del model, head
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "layer_cost.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1))
    text = render(meta, rows_out, a.tpf)
    (a.out / "layer_cost.md").write_text(text)
    print(text)


def render(meta, rows, tpf) -> str:
    lines = [f"One LLaDA-8B decoder layer on this CPU ({meta['threads']} threads, PyTorch attention backend, median of "
             f"{meta['reps']}); an 8B forward modelled as {LAYERS} layers + the LM head", "",
             "| dtype | prefix | rows | layer ms | vs 1 row | ms per row | LM head ms (these rows) | "
             "modelled 8B forward ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['prefix']} | {r['rows']} | {r['layer_ms']:.2f} | {r['vs_1_row']:.2f}x | "
                     f"{r['per_row_ms']:.3f} | {r['head_ms']:.2f} | {LAYERS * r['layer_ms'] + r['head_ms']:.0f} |")
    methods = [(m, float(t), int(n), int(k)) for m, t, n, k in (x.split(":") for x in tpf.split(","))]
    lines += ["", "Cost model (not a served figure): predicted tokens/s of an 8B model at batch 1 on this CPU, AR (one row "
              "per token) against dLLM steps (TPF measured on the embedded model; rows and logit rows of its step)", "",
              "| dtype | prefix | AR tokens/s | " + " | ".join(f"{m} (TPF {t:g}, {n} rows)" for m, t, n, _ in methods)
              + " |", "|---|---|---|" + "---|" * len(methods)]
    by = {(r["dtype"], r["prefix"], r["rows"]): r for r in rows}
    for d, p in dict.fromkeys((r["dtype"], r["prefix"]) for r in rows):
        t = lambda n, k: LAYERS * by[(d, p, n)]["layer_ms"] + by[(d, p, k)]["head_ms"]  # noqa: E731
        ar = 1e3 / t(1, 1)
        cells = [f"{1e3 * tp / t(n, k):.2f} ({1e3 * tp / t(n, k) / ar:.2f}x)" if (d, p, n) in by and (d, p, k) in by
                 else "" for _, tp, n, k in methods]
        lines.append(f"| {d} | {p} | {ar:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
