"""The reference engine on one device and dtype: tokens and NFE of every method, compared with another run.

    .venv/bin/python benchmarks/reference_devices.py --device cuda --dtype float32 \
        --compare benchmarks/results/reference_cpu_float32.json --out OUT

Every method of the dLLM path, greedy, on the embedded LLaDA-format checkpoint's held-out prompts (``--limit``
per task) with the prefix cache, block 8, max_tokens 32, plus PRESTO on the embedded AR pair. TF32 is off, so
float32 on CUDA should give the CPU's tokens and NFE exactly; for bfloat16 the agreement is the figure. Writes
``reference_<device>_<dtype>.json`` (per method: tokens and NFE per prompt, seconds) into ``--out`` and, with
``--compare``, prints and stores the share of prompts with identical tokens and the NFE totals of both runs.
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
    from model_executor.decoding import METHODS, load_graph
    from model_executor.engine import ReferenceEngine
    from model_executor.presto_engine import PrestoEngine
    from psd_plugin import DEFAULT_AR, DEFAULT_DLLM, DEFAULT_DRAFTER, default_graph, default_ngram
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import TASKS, load_heldout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    ap.add_argument("--limit", type=int, default=5, help="held-out items per task")
    ap.add_argument("--methods", default=",".join(METHODS + ("presto",)))
    ap.add_argument("--backend", default="auto", help="attention backend: auto, torch or flashinfer")
    ap.add_argument("--compare", type=Path, help="a JSON of another run of this script")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    methods = args.methods.split(",")
    dllm_methods = [m for m in methods if m != "presto"]
    _, tok = load(DEFAULT_DLLM if dllm_methods else DEFAULT_AR)  # one tokenizer for the embedded models
    prompts = [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[: args.limit]]
    dllm = eng = None
    if dllm_methods:
        dllm = ReferenceEngine.from_pretrained(DEFAULT_DLLM, dtype=dtype, device=args.device,
                                               attention_backend=args.backend)
    runs = {}
    for method in methods:
        t0 = time.perf_counter()
        if method == "presto":
            eng = PrestoEngine.from_pretrained(DEFAULT_AR, DEFAULT_DRAFTER, default_ngram(DEFAULT_DRAFTER), dtype=dtype,
                                               device=args.device, attention_backend=args.backend)
            res = eng.generate(prompts, max_tokens=32)
        else:
            knobs = {"cache": "prefix"}
            if method == "spiffy":
                knobs.update(policy="static", graph=load_graph(default_graph(DEFAULT_DLLM, "static")))
            res = dllm.generate(prompts, max_tokens=32, block_size=8, method=method, **knobs)
        dt = time.perf_counter() - t0
        runs[method] = {"tokens": [r.token_ids for r in res], "nfe": [r.nfe for r in res], "seconds": dt}
        print(f"{method:<16} NFE {sum(runs[method]['nfe']):5d}  {dt:6.2f} s", flush=True)
    report = {"device": args.device, "dtype": args.dtype, "backend": (dllm or eng).attn.name,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "prompts": len(prompts), "runs": runs}
    if args.compare:
        other = json.loads(args.compare.read_text())
        if other["prompts"] != len(prompts):
            raise SystemExit(f"--compare {args.compare}: {other['prompts']} prompts, this run {len(prompts)} "
                             "(use the same --limit)")
        agree = {}
        for method, run in runs.items():
            if method not in other["runs"]:
                continue
            o = other["runs"][method]
            same = sum(a == b for a, b in zip(run["tokens"], o["tokens"])) / len(prompts)
            agree[method] = {"identical_tokens": same, "nfe": sum(run["nfe"]), "nfe_other": sum(o["nfe"])}
            print(f"{method:<16} identical to {other['device']} {other['dtype']}: {100 * same:5.1f}%  "
                  f"NFE {sum(run['nfe'])} vs {sum(o['nfe'])}", flush=True)
        report["compared_with"] = {"device": other["device"], "dtype": other["dtype"], "methods": agree}
    args.out.mkdir(parents=True, exist_ok=True)
    backend = "" if args.backend == "auto" else f"_{args.backend}"
    out = args.out / f"reference_{args.device.split(':')[0]}_{args.dtype}{backend}.json"
    out.write_text(json.dumps(report))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
