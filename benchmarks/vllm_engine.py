"""The vLLM decoding path against the reference engine on the embedded model: TPF, NFE, tokens/s, agreement.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/vllm_engine.py [--limit 20] [--methods static,confidence,psd]
        [--caches prefix,dual]

Both engines decode the same held-out prompts (``--limit`` per task), all submitted at once (vLLM batches
them continuously; the reference engine in batches of 64), greedy, float32, block 8, max_tokens 32,
under each KV-cache mode of ``--caches`` (``prefix``: Fast-dLLM's prefix cache; ``dual``: its DualCache).
Per method, cache and engine: accuracy, TPF (tokens up to and including EOS per forward), NFE per sample, tokens/s
(tokens up to EOS over the wall time of the whole batch), and the share of prompts whose tokens are
identical between the engines. Writes ``vllm_engine.md`` / ``.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engines import engines_and_prompts, method_knobs  # noqa: E402  (sets vLLM's environment)


def main() -> None:
    from psd_plugin import DEFAULT_DLLM
    from psd_plugin.train.tasks import grade

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_DLLM)
    ap.add_argument("--limit", type=int, default=20, help="held-out items per task")
    ap.add_argument("--methods", default="static,confidence,psd")
    ap.add_argument("--caches", default="prefix", help="comma-separated: none, prefix, dual")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()

    ref, tok, rows, prompts, vllm = engines_and_prompts(args.model, args.limit)
    table = []
    for method in args.methods.split(","):
        for cache in args.caches.split(","):
            outs = {}
            for name, engine in (("reference", ref), ("vLLM", vllm)):
                kw = {**method_knobs(method, args.model, name), "cache": cache}
                if name == "vLLM":  # start the engine (and warm it up) outside the timed region
                    engine.generate(prompts[:2], method=method, max_tokens=32, **kw)
                t0 = time.perf_counter()
                res = engine.generate(prompts, method=method, max_tokens=32, block_size=8, **kw)
                dt = time.perf_counter() - t0
                tokens = sum(len(r.token_ids) for r in res)
                nfe = sum(r.nfe for r in res)
                acc = sum(grade(row, tok.decode(r.token_ids, skip_special_tokens=True)) for row, r in zip(rows, res))
                outs[name] = res
                table.append({"method": method, "cache": cache, "engine": name, "accuracy": acc / len(rows),
                              "tpf": tokens / nfe, "nfe_per_sample": nfe / len(rows), "tokens_per_s": tokens / dt,
                              "seconds": dt})
                print(f"{method:<11} {cache:<6} {name:<9} acc {100 * acc / len(rows):5.1f}  TPF {tokens / nfe:5.2f}  "
                      f"NFE/sample {nfe / len(rows):6.2f}  {tokens / dt:7.1f} tok/s  ({dt:.1f} s)", flush=True)
            same = sum(a.token_ids == b.token_ids for a, b in zip(outs["reference"], outs["vLLM"]))
            table[-1]["identical_to_reference"] = same / len(rows)
            print(f"{method:<11} {cache:<6} identical tokens: {same}/{len(rows)}", flush=True)
    vllm.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_engine.json").write_text(json.dumps({"prompts": len(rows), "rows": table}, indent=1))
    lines = ["| method | cache | engine | accuracy % | TPF | NFE/sample | tokens/s | identical to reference |",
             "|---|---|---|---|---|---|---|---|"]
    for t in table:
        ident = f"{100 * t['identical_to_reference']:.1f}%" if "identical_to_reference" in t else ""
        lines.append(f"| {t['method']} | {t['cache']} | {t['engine']} | {100 * t['accuracy']:.1f} | {t['tpf']:.2f} | "
                     f"{t['nfe_per_sample']:.2f} | {t['tokens_per_s']:.0f} | {ident} |")
    (args.out / "vllm_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
