"""Load a checkpoint with the right reference engine, run prompts, and score the held-out tasks."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from model_executor.decoding import merge_stats

from .train.tasks import answer_budget, grade
from .tokenizer import render_prompt

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def is_dllm(path: str | Path) -> bool:
    from model_executor.models.configs import CONFIG_CLASSES

    return json.loads((Path(path) / "config.json").read_text()).get("model_type") in CONFIG_CLASSES


def load(path: str | Path, dtype: str = "float32", device: str = "cpu", attention_backend: str = "auto"):
    """(engine, tokenizer) for a dLLM (:class:`ReferenceEngine`) or an AR model (:class:`AREngine`) on ``device``."""
    from transformers import AutoTokenizer

    from model_executor.models.configs import register_configs
    from model_executor.models.reference import read_config

    register_configs()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {path}: no such model directory")
    cfg = read_config(path) if is_dllm(path) else None
    if cfg is not None:
        from model_executor.engine import ReferenceEngine

        engine = ReferenceEngine.from_pretrained(path, dtype=DTYPES[dtype], device=device,
                                                 attention_backend=attention_backend)
    else:
        from model_executor.ar_engine import AREngine

        engine = AREngine.from_pretrained(path, dtype=DTYPES[dtype], device=device)
    tok = AutoTokenizer.from_pretrained(str(path))
    return engine, tok


def encode(tok, text: str, chat: bool = True) -> list[int]:
    """Token ids the model sees: the chat template around ``text`` (default) or the raw text."""
    if chat:
        if tok.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
        text = render_prompt(text)
    return tok(text, add_special_tokens=False).input_ids


def decode_answer(tok, token_ids: list[int]) -> str:
    return tok.decode(token_ids, skip_special_tokens=True)


def generate_by_budget(engine, prompts: list[list[int]], budgets: list[int], **gen_kwargs) -> list:
    """``engine.generate`` once per answer budget, results in prompt order: a prompt runs with its budget, or with
    ``max_tokens`` from ``gen_kwargs`` where that is larger."""
    results: list = [None] * len(prompts)
    for budget in sorted(set(budgets)):
        idx = [i for i, b in enumerate(budgets) if b == budget]
        kw = {**gen_kwargs, "max_tokens": max(gen_kwargs.get("max_tokens", budget), budget)}
        for i, res in zip(idx, engine.generate([prompts[i] for i in idx], **kw)):
            results[i] = res
    return results


def evaluate(engine, tok, rows: list[dict], **gen_kwargs) -> dict:
    """Accuracy per task, mean TPF and NFE (PSD appendix B.1 counting) over ``rows`` of the held-out split.

    ``max_tokens`` in ``gen_kwargs`` is the short tasks' budget; a long task runs with at least its own
    (:func:`~psd_plugin.train.tasks.answer_budget`)."""
    prompts = [encode(tok, r["prompt"]) for r in rows]
    t0 = time.perf_counter()
    results = generate_by_budget(engine, prompts, [answer_budget(r["task"]) for r in rows], **gen_kwargs)
    seconds = time.perf_counter() - t0
    per_task: dict[str, list[bool]] = defaultdict(list)
    task_tokens: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # task: [tokens, nfe]
    for row, res in zip(rows, results):
        per_task[row["task"]].append(grade(row, decode_answer(tok, res.token_ids)))
        task_tokens[row["task"]][0] += len(res.token_ids)
        task_tokens[row["task"]][1] += res.nfe
    tokens, nfe = sum(t for t, _ in task_tokens.values()), sum(n for _, n in task_tokens.values())
    acc = {t: sum(v) / len(v) for t, v in per_task.items()}
    stats = merge_stats(r.stats for r in results)
    return {
        "accuracy": {t: round(a, 4) for t, a in acc.items()},
        "mean_accuracy": round(sum(acc.values()) / max(1, len(acc)), 4),
        "tpf": round(tokens / max(1, nfe), 4),
        "tpf_by_task": {t: round(k / max(1, n), 4) for t, (k, n) in task_tokens.items()},
        "nfe_per_sample": round(nfe / max(1, len(rows)), 3),
        "tokens_per_sample": round(tokens / max(1, len(rows)), 3),
        "samples": len(rows),
        "seconds": round(seconds, 2),
        **({"stats": stats} if stats else {}),
    }

