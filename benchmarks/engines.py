"""What the engine benchmarks share (``vllm_engine.py``, ``step_overhead.py``): the held-out prompts, both
engines on one dLLM, and each method's knobs per engine."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engines_and_prompts(model: Path, limit: int):
    """``(reference engine, tokenizer, held-out rows, their prompts, vLLM engine)``: ``limit`` items per task."""
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import TASKS, load_heldout
    from psd_plugin.vllm.engine import VLLMEngine

    ref, tok = load(model)
    rows = [r for t in TASKS for r in load_heldout(t)[:limit]]
    return ref, tok, rows, [encode(tok, r["prompt"]) for r in rows], VLLMEngine(model, max_num_seqs=256)


def method_knobs(method: str, model: Path, engine: str) -> dict:
    """Knobs beyond the defaults: Spiffy gets the graph shipped for the model (confidence base policy), as a
    loaded graph for the reference engine and as a path for vLLM."""
    if method != "spiffy":
        return {}
    from model_executor.decoding import load_graph
    from psd_plugin import default_graph

    path = default_graph(model, "confidence")
    return {"policy": "confidence", "graph": load_graph(path) if engine == "reference" else str(path)}
