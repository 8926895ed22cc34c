"""Quantized checkpoints through vLLM: held-out accuracy, TPF and tokens/s of W8A8 and W4A16 against the float weights.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/quantized.py [--models llada-tiny,dream-tiny] [--limit 20] \
        [--methods confidence,psd] [--repeats 2] [--out benchmarks/results]

Each embedded model is quantized here by compressed-tensors (:func:`model_executor.models.quantization.
quantize_checkpoint`): W8A8 (int8 weights per output channel, int8 activations per token, dynamic) and W4A16
(int4 weights, symmetric, groups of 32 and of 128). Every variant decodes ``--limit`` held-out items of every task
through vLLM (``LLM.generate``, PSD's speculative config, the dual cache, greedy) in bfloat16, the activations vLLM's
CPU int8/int4 kernels take; the float weights run in bfloat16 and in float32 beside them. Per variant and
method: mean accuracy over the tasks, TPF (tokens per decoding forward), and generated tokens per second over the
wall time of the whole batch, after a warm-up batch on the same engine (this 2-core CPU: compare within the table; the variants alternate ``--repeats``
times, min-max). Accuracy and TPF are counts and do not depend on the machine; they come from the first repeat
(greedy decoding: every repeat gives the same tokens). Writes ``quantized.md`` / ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from model_executor.models.quantization import quantize_checkpoint  # noqa: E402
from psd_plugin.evaluate import evaluate, load  # noqa: E402
from psd_plugin.train.tasks import TASKS, load_heldout  # noqa: E402

CHECKPOINTS = ROOT / "psd_plugin" / "checkpoints"
# name -> (scheme, group size, dtype vLLM runs it in)
VARIANTS = {"float32": (None, None, "float32"), "bfloat16": (None, None, "bfloat16"),
            "W8A8": ("W8A8", None, "bfloat16"), "W4A16 g128": ("W4A16", 128, "bfloat16"),
            "W4A16 g32": ("W4A16", 32, "bfloat16")}
METHODS = {"confidence": {"method": "confidence", "threshold": 0.9},
           "psd": {"method": "psd", "policy": "confidence", "depth": 3}}


def _variant(model: Path, name: str, tmp: Path) -> tuple[Path, str]:
    scheme, group, dtype = VARIANTS[name]
    if scheme is None:
        return model, dtype
    out = tmp / f"{model.name}-{name.replace(' ', '-')}"
    if not out.exists():
        quantize_checkpoint(model, out, scheme, group_size=group)
    return out, dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llada-tiny,dream-tiny")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--limit", type=int, default=20, help="held-out items per task")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from psd_plugin.vllm.engine import VLLMEngine

    rows = [r for t in TASKS for r in load_heldout(t)[: args.limit]]
    results: dict = {}
    with tempfile.TemporaryDirectory() as d:
        for model_name in args.models.split(","):
            model = CHECKPOINTS / model_name
            _, tok = load(model)
            from psd_plugin.evaluate import encode

            warm = [encode(tok, r["prompt"]) for r in rows[:2]]
            for rep in range(args.repeats):
                for variant in args.variants.split(","):
                    path, dtype = _variant(model, variant, Path(d))
                    engine = VLLMEngine(path, dtype=dtype, enforce_eager=False)
                    try:
                        for m in args.methods.split(","):
                            # the engine for this method started and compiled, outside the timed batch
                            engine.generate(warm, max_tokens=8, block_size=8, cache="dual", **METHODS[m])
                            g = evaluate(engine, tok, rows, max_tokens=args.max_tokens, block_size=8, cache="dual",
                                         **METHODS[m])
                            tokens = g["tokens_per_sample"] * g["samples"]
                            key = f"{model_name}|{variant}|{m}"
                            r = results.setdefault(key, {"model": model_name, "variant": variant, "method": m,
                                                         "accuracy": g["mean_accuracy"], "tpf": g["tpf"],
                                                         "tokens_per_s": []})
                            r["tokens_per_s"].append(round(tokens / g["seconds"], 1))
                            print(json.dumps({**r, "repeat": rep}), flush=True)
                    finally:
                        engine.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantized.json").write_text(json.dumps(list(results.values()), indent=1) + "\n")
    lines = [f"Held-out tasks, {args.limit} items each ({len(rows)} prompts), through vLLM (PSD's speculative config, "
             f"dual cache, greedy, {args.max_tokens} tokens), this 2-core CPU; tokens/s: min-max of {args.repeats} "
             "alternated runs.", "",
             "| model | weights | vLLM dtype | method | accuracy | TPF | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in results.values():
        t = r["tokens_per_s"]
        lines.append(f"| {r['model']} | {r['variant']} | {VARIANTS[r['variant']][2]} | {r['method']} | "
                     f"{r['accuracy']:.3f} | {r['tpf']:.2f} | {min(t):.0f}–{max(t):.0f} |")
    (out / "quantized.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
