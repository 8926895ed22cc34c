"""Structured outputs through vLLM with the server's defaults: valid JSON objects, greedy and sampled.

    .venv/bin/python benchmarks/structured_served.py [--model PATH] [--limit 10] [--max-tokens 48,128]

The dLLM path as a user gets it (``speculative_config={"method": "psd"}``: PSD decoding, vLLM's default
structured-outputs settings) on held-out prompts (``--limit`` per task), each asked for the JSON schema of
``benchmarks/structured.py`` (``{"answer": string of at most 48 characters}``), at each ``--max-tokens``, greedy
and at temperature 1 (seeded), with ``json_whitespace`` ``compact`` (the default) and ``any`` (vLLM's default
JSON grammar). Counts the outputs that parse and validate (a JSON object cut by ``max_tokens`` does not).
Writes ``structured_served.md`` / ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from benchmarks.structured import SCHEMA  # noqa: E402


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from psd_plugin import DEFAULT_DLLM
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import TASKS, load_heldout
    from psd_plugin.vllm import compat

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--limit", type=int, default=10, help="held-out items per task")
    ap.add_argument("--max-tokens", default="48,128")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    _, tok = load(args.model)
    prompts = [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[: args.limit]]
    rows = []
    for ws in ("compact", "any"):
        llm = LLM(model=str(args.model), dtype="float32", seed=0, max_model_len=512,
                  speculative_config={"method": "psd", "json_whitespace": ws})
        try:
            for m in (int(x) for x in args.max_tokens.split(",")):
                for temp in (0.0, 1.0):
                    params = [SamplingParams(max_tokens=m, temperature=temp, seed=i if temp else None,
                                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
                              for i in range(len(prompts))]
                    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                    ok = sum(_valid(o.outputs[0].text) for o in outs)
                    rows.append({"json_whitespace": ws, "max_tokens": m, "temperature": temp, "valid": ok,
                                 "requests": len(outs)})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            compat.shutdown(llm)
            del llm
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured_served.json").write_text(json.dumps({"model": args.model.name, "rows": rows}, indent=1))
    lines = [f"{args.model.name}, PSD decoding, vLLM's default structured-outputs settings, {len(prompts)} held-out "
             "prompts, JSON schema {\"answer\": string <= 48 chars}; T 1: seeded.", "",
             "| json_whitespace | max_tokens | temperature | valid objects |", "|---|---|---|---|"]
    lines += [f"| {r['json_whitespace']} | {r['max_tokens']} | {r['temperature']:g} | {r['valid']}/{r['requests']} |"
              for r in rows]
    (args.out / "structured_served.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
