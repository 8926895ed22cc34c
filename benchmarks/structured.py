"""Tokens per forward with and without a grammar (structured outputs, the frontier rule).

    .venv/bin/python benchmarks/structured.py [--model PATH] [--limit N] [--out benchmarks/results]

The reference engine on the held-out prompts (``--limit`` per task), greedy, each method twice in one process:
free; under a grammar the model's answers already follow (``text``: a regex of printable ASCII, at most 48
characters: the rule's own cost, where the grammar rarely rejects a prediction); and under a JSON schema
(``{"answer": string of at most 48 characters}``, compact: no free whitespace), a format the embedded model
never saw in training.
Reports per method TPF (emitted tokens / decoding forwards), NFE per request, answer tokens, how many outputs
parse and validate, and the grammar's counters (predicted tokens replaced by the one token the grammar allows;
predictions the grammar rejected, which end a step's run). Writes ``structured.json`` and ``structured.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model_executor.engine import ReferenceEngine  # noqa: E402
from model_executor.grammar import build_grammar, compile_grammar, tokenizer_info  # noqa: E402
from psd_plugin import DEFAULT_DLLM, default_graph  # noqa: E402
from psd_plugin.evaluate import encode, load  # noqa: E402
from psd_plugin.train.tasks import TASKS, load_heldout  # noqa: E402

TEXT = r"[ -~]{1,48}"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"type": "string", "maxLength": 48}}}


def methods(model):
    from model_executor.decoding import load_graph

    yield "static", {}
    yield "confidence", {}
    yield "freedave", {}
    yield "spiffy", {"policy": "static", "graph": load_graph(default_graph(model, "static"))}
    yield "lopa", {}
    yield "psd", {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_DLLM))
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    _, tok = load(a.model)
    engine = ReferenceEngine.from_pretrained(a.model)
    prompts = [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[: a.limit]]
    info = tokenizer_info(tok, engine.spec.vocab_size)
    g = compile_grammar(build_grammar("json", SCHEMA, any_whitespace=False), info)
    text = compile_grammar(build_grammar("regex", TEXT), info)
    rows = []
    for name, knobs in methods(a.model):
        row = {"method": name, "prompts": len(prompts)}
        for label, grammar in (("free", None), ("text", text), ("json", g)):
            res = engine.generate(prompts, max_tokens=a.max_tokens, method=name, grammar=grammar, **knobs)
            tokens, nfe = sum(len(r.token_ids) for r in res), sum(r.nfe for r in res)
            row[f"{label}_tpf"] = round(tokens / nfe, 3)
            row[f"{label}_nfe"] = round(nfe / len(res), 2)
            row[f"{label}_tokens"] = round(tokens / len(res), 2)
            if label == "text":
                row["text_same"] = sum(r.token_ids == f.token_ids for r, f in zip(res, free))
            if label == "free":
                free = res
            if grammar is g:
                ok = 0
                for r in res:
                    try:
                        v = json.loads(tok.decode(r.token_ids, skip_special_tokens=True))
                        ok += r.finish_reason == "stop" and set(v) == {"answer"} and len(v["answer"]) <= 48
                    except ValueError:
                        pass
                row["json_valid"] = f"{ok}/{len(res)}"
                for k in ("forced", "rejected"):  # the grammar's counters (request stats)
                    row[k] = sum(r.stats.get(f"grammar_{k}", 0) for r in res)
        rows.append(row)
        print(row, flush=True)
    out = Path(a.out)
    (out / "structured.json").write_text(json.dumps(rows, indent=1))
    lines = ["| method | TPF free | TPF text | TPF json | NFE/request free / text / json | tokens/request free / text / "
             "json | text = free | valid JSON | JSON: forced tokens | JSON: rejected predictions |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['method']} | {r['free_tpf']:.2f} | {r['text_tpf']:.2f} | {r['json_tpf']:.2f} | {r['free_nfe']} / "
                     f"{r['text_nfe']} / {r['json_nfe']} | {r['free_tokens']} / {r['text_tokens']} / {r['json_tokens']} | "
                     f"{r['text_same']}/{r['prompts']} | {r['json_valid']} | {r['forced']} | {r['rejected']} |")
    (out / "structured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
