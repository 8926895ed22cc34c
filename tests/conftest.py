import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from psd_plugin import DEFAULT_DLLM  # noqa: E402

FAMILIES = ("llada", "dream", "sdar", "llada2")


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The embedded models' tokenizer (shipped with the package)."""
    assert (DEFAULT_DLLM / "tokenizer.json").exists(), f"embedded checkpoint missing at {DEFAULT_DLLM}"
    return DEFAULT_DLLM


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """A small random checkpoint in each real format, written by the real save path."""
    from model_executor.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_tiny_checkpoint(f, root / f, tokenizer_dir, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def in_process_vllm():
    """Run vLLM's engine core in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): faster start, and
    ``collective_rpc`` reaches the worker directly."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@pytest.fixture(scope="session")
def engine64():
    """The embedded dLLM on the reference engine in float64 (the exactness path)."""
    import torch

    from model_executor.engine import ReferenceEngine

    return ReferenceEngine.from_pretrained(DEFAULT_DLLM, dtype=torch.float64)


@pytest.fixture(scope="session")
def mixed_prompts(tokenizer_dir):
    """Two held-out prompts per task: a batch of mixed lengths."""
    from transformers import AutoTokenizer

    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[:2]]
