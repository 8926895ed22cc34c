"""How far a checkpoint has learned a long family: on the held-out items of ``count`` (or another long family:
``sort_lines``, ``count_lines``), the share of answer words (numbers, labels) right before the first wrong one, and
exact answers.

    .venv/bin/python benchmarks/long_progress.py MODEL [--task count] [--limit 50] [--method confidence]

A training stage's progress measure (docs/models.md, "Task corpus and graders"): the exact grader says 0 until
a model counts to the end and stops, this says how far it gets. Greedy; a dLLM decodes with ``--method`` (block
8, prefix cache), an AR model token by token. One CPU thread.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from psd_plugin.evaluate import decode_answer, encode, load
    from psd_plugin.train.tasks import LONG_TASKS, answer_budget, grade, load_heldout

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--task", default="count", choices=LONG_TASKS)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--method", default="confidence", help="dLLM decoding method (an AR model ignores it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine, tok = load(args.model)
    rows = load_heldout(args.task)[: args.limit]
    out = engine.generate([encode(tok, r["prompt"]) for r in rows], max_tokens=answer_budget(args.task),
                          method=args.method, block_size=8, cache="prefix")
    right = total = exact = tokens = nfe = 0
    for row, res in zip(rows, out):
        text = decode_answer(tok, res.token_ids)
        want, got = row["answer"].split(), text.split()
        k = 0
        while k < min(len(want), len(got)) and want[k] == got[k]:
            k += 1
        right, total, exact = right + k, total + len(want), exact + grade(row, text)
        tokens, nfe = tokens + len(res.token_ids), nfe + res.nfe
    print(f"{args.model} {args.task}: {right}/{total} words right before the first error ({right / total:.1%}), "
          f"{exact}/{len(rows)} exact, TPF {tokens / max(nfe, 1):.2f}")


if __name__ == "__main__":
    main()
