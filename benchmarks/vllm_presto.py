"""PRESTO through vLLM against plain autoregressive vLLM and the reference PRESTO engine, on the embedded models.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_presto.py [--limit 20] [--budget 128]

The same held-out prompts (``--limit`` per task), greedy, max_tokens 32, float32, all submitted at once:

- vLLM serving ar-tiny with no speculation (the AR baseline);
- vLLM with ``{"method": "psd", "mode": "presto", "search": "linear"}`` (the drafter's top-1 chain) and with
  beam search at ``--budget`` nodes;
- the reference engine (:class:`model_executor.presto_engine.PrestoEngine`) with the same settings.

Per row: target forwards per request (every forward a request takes part in, its prefill included; the
reference engine verifies its first tree in the prefill forward, vLLM drafts only after it), tokens per
target forward, tokens/s over
the whole batch's wall time, and whether every output equals the AR baseline's token for token. Writes
``vllm_presto.md`` / ``.json`` into ``--out``.
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

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # presto_stats reaches the worker directly


def main() -> None:
    import psd_plugin  # noqa: F401  (claims the model_executor package name before vLLM loads)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from model_executor.presto_engine import PrestoEngine
    from psd_plugin import DEFAULT_AR, DEFAULT_DRAFTER, default_ngram
    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=20, help="held-out items per task")
    ap.add_argument("--budget", type=int, default=128, help="tree budget B of the beam rows")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    prompts = [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[: args.limit]]
    params = SamplingParams(max_tokens=32, temperature=0)
    runs = [("ar", None, 0), ("linear", "linear", 16), ("presto beam", "beam", args.budget)]
    table, base = [], None
    ref_engine = PrestoEngine.from_pretrained(DEFAULT_AR, DEFAULT_DRAFTER, default_ngram(DEFAULT_DRAFTER))
    for name, search, budget in runs:
        spec = {"method": "psd", "mode": "presto", "search": search, "tree_budget": budget} if search else None
        llm = LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=64,
                  speculative_config=spec)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm up
        fw0 = llm.collective_rpc("presto_stats")[0]["forwards"] if spec else 0
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        n_tok = sum(map(len, tokens))
        forwards = (llm.collective_rpc("presto_stats")[0]["forwards"] - fw0) if spec else n_tok
        del llm
        base = base or tokens
        table.append({"run": name, "engine": "vLLM", "forwards_per_request": forwards / len(prompts),
                      "tokens_per_forward": n_tok / forwards, "tokens_per_s": n_tok / dt,
                      "identical_to_ar": sum(a == b for a, b in zip(tokens, base))})
        kw = {"search": search or "ar", "tree_budget": max(1, budget), "max_tokens": 32}
        t0 = time.perf_counter()
        res = ref_engine.generate(prompts, **kw)
        dt = time.perf_counter() - t0
        n_tok, nfe = sum(len(r.token_ids) for r in res), sum(r.nfe for r in res)
        table.append({"run": name, "engine": "reference", "forwards_per_request": nfe / len(prompts),
                      "tokens_per_forward": n_tok / nfe, "tokens_per_s": n_tok / dt,
                      "identical_to_ar": sum(r.token_ids == b for r, b in zip(res, base))})
        for row in table[-2:]:
            print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_presto.json").write_text(json.dumps({"prompts": len(prompts), "rows": table}, indent=1))
    lines = [f"ar-tiny target, drafter-tiny, {len(prompts)} held-out prompts, greedy, max_tokens 32, float32, "
             f"one thread; beam B = {args.budget}", "",
             "| run | engine | target forwards / request | tokens / forward | tokens/s | identical to AR |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['engine']} | {r['forwards_per_request']:.2f} | {r['tokens_per_forward']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['identical_to_ar']}/{len(prompts)} |" for r in table]
    (args.out / "vllm_presto.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
