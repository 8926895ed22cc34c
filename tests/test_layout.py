"""Dependencies run one way (docs/architecture.md): the vLLM adapter imports neither reference engine nor the command
line; model classes import no engine; decoding and attention import no engine and no vLLM (but the vLLM attention
backend); nothing on the serving path imports the training package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved)."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


RULES = [  # (files, forbidden module prefixes)
    ("psd_plugin/vllm/*.py", ("model_executor.engine", "model_executor.presto_engine", "model_executor.ar_engine",
                              "psd_plugin.config", "psd_plugin.cli", "psd_plugin.train")),
    ("model_executor/models/*.py", ("model_executor.engine", "model_executor.presto_engine",
                                    "model_executor.dllm_request", "model_executor.presto_round")),
    ("model_executor/decoding/*.py", ("vllm", "model_executor.engine", "model_executor.presto_engine",
                                      "model_executor.models", "attention_backends")),
    ("model_executor/dllm_request.py", ("vllm", "model_executor.engine", "attention_backends")),
    ("model_executor/presto_round.py", ("vllm", "model_executor.engine", "model_executor.presto_engine")),
    ("attention_backends/[!v]*.py", ("vllm", "model_executor", "psd_plugin")),
    ("attention_backends/vllm_backend.py", ("model_executor", "psd_plugin")),
]


@pytest.mark.parametrize("pattern, forbidden", RULES)
def test_dependencies_run_one_way(pattern, forbidden):
    files = sorted(ROOT.glob(pattern))
    assert files, pattern
    bad = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m.startswith(forbidden)) for f in files}
    assert not {k: v for k, v in bad.items() if v}
