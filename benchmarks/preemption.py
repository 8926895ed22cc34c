"""Preemption under KV-cache pressure: served outputs against an unpressured run, and what the replays cost.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/preemption.py [--model dream-tiny-v3] [--requests 16]
        [--pages 40] [--max-tokens 128]

Held-out prompts of the model's long task (``count_lines``), greedy, float32, eager, all submitted at once, in
vLLM. Per configuration two engines: one whose KV cache holds every request at once, and one with ``--pages``
pages of 16 tokens, where vLLM preempts running requests when a step needs pages it has not got (recompute
preemption: the request's pages are freed, and it is re-prefilled when it is scheduled again). A preempted
request's next step reads K/V that earlier first steps of its blocks wrote, so the runner replays them
(``DLLMRequest.preempted``) before it decodes on.

Reported per configuration: requests resumed after a preemption and replay forwards (``psd_stats``), the share
of outputs token-identical to the unpressured run, NFE per request equal, and tokens/s of both runs (one run
each, after a warm-up, on this machine: the ratio is the figure). Writes ``preemption.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # psd_stats reaches the worker directly
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

CONFIGS = [("confidence", {"decoding": "confidence"}),
           ("confidence suffix32-last t0.98", {"decoding": "confidence", "suffix": 32, "refresh": "last",
                                               "threshold": 0.98}),
           ("confidence suffix32-answer t0.98", {"decoding": "confidence", "suffix": 32, "refresh": "answer",
                                                 "threshold": 0.98}),
           ("PSD dual", {"decoding": "psd", "cache": "dual"})]


def run(model: Path, spec: dict, prompts: list[list[int]], max_tokens: int, pages: int | None) -> dict:
    from vllm import LLM, SamplingParams

    from psd_plugin.vllm import compat

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, block_size=16,
              max_num_seqs=len(prompts), seed=0, speculative_config={"method": "psd", **spec},
              **({"num_gpu_blocks_override": pages} if pages else {}))
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
        before = dict(compat.psd_stats(llm)["step_time"])
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = compat.psd_stats(llm)["step_time"]
        stats = compat.request_stats(llm)
    finally:
        compat.shutdown(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens": tokens, "nfe": [stats[o.request_id]["nfe"] for o in outs], "wall_s": round(wall, 3),
            "tok_s": round(sum(map(len, tokens)) / wall, 1),
            **{k: after[k] - before[k] for k in ("steps", "resumed", "replays", "cut_steps")}}


def main() -> None:
    from psd_plugin import CHECKPOINTS
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dream-tiny-v3", help="a checkpoint name or folder")
    ap.add_argument("--task", default="count_lines")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--pages", type=int, default=40, help="KV pages of 16 tokens in the pressured run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", help="names (prefixes) of the configurations to run, comma-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    model = Path(a.model) if Path(a.model).is_dir() else CHECKPOINTS / a.model
    _, tok = load(model)
    prompts = [encode(tok, r["prompt"]) for r in load_heldout(a.task)[: a.requests]]
    rows = []
    for name, spec in CONFIGS:
        if a.configs and not any(name.startswith(c) for c in a.configs.split(",")):
            continue
        ample = run(model, spec, prompts, a.max_tokens, None)
        tight = run(model, spec, prompts, a.max_tokens, a.pages)
        row = {"config": name, "requests": len(prompts), "pages": a.pages, "resumed": tight["resumed"],
               "replays": tight["replays"], "cut_steps": tight["cut_steps"],
               "same_tokens": sum(x == y for x, y in zip(ample["tokens"], tight["tokens"])),
               "same_nfe": sum(x == y for x, y in zip(ample["nfe"], tight["nfe"])),
               "steps_ample": ample["steps"], "steps_tight": tight["steps"],
               "tok_s_ample": ample["tok_s"], "tok_s_tight": tight["tok_s"],
               "tok_s_ratio": round(tight["tok_s"] / ample["tok_s"], 2)}
        rows.append(row)
        print(row, flush=True)
    head = ["config", "requests", "pages", "resumed", "replays", "cut_steps", "same_tokens", "same_nfe",
            "steps_ample", "steps_tight", "tok_s_ample", "tok_s_tight", "tok_s_ratio"]
    md = [f"Preemption under KV pressure: {model.name}, {a.task} held-out prompts, max_tokens {a.max_tokens}, "
          f"float32, eager, vLLM on this CPU; one run each after a warm-up.", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "preemption.md").write_text("\n".join(md) + "\n")
    (a.out / "preemption.json").write_text(json.dumps({"model": model.name, "task": a.task, "rows": rows}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
