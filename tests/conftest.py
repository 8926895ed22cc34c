import functools
import os
import re
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM's compile cache for every engine the tests start, the AR ones too (the plugin sets it for its own on the
# CPU: compat.AOT_COMPILE_ENV): vLLM-CPU 0.32's AOT cache never loads, so each compiled start would compile again
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

from psd_plugin import DEFAULT_DLLM  # noqa: E402

FAMILIES = ("llada", "dream", "sdar", "llada2")
SERVER_LOG_DIR_ENV = "PSD_SERVER_LOG_DIR"  # psd_plugin.vllm.server.LOG_DIR_ENV (tests/test_server.py checks)


@pytest.fixture(scope="session", autouse=True)
def _server_logs(tmp_path_factory):
    """The servers the tests start (``psd_plugin.vllm.server``) log into this run's temporary directory, which
    pytest prunes (it keeps the last three runs), not into the system's ``/tmp``, where they piled up. (The name,
    not an import: importing the module loads vLLM, which the default suite's engine guard keys on.)"""
    os.environ.setdefault(SERVER_LOG_DIR_ENV, str(tmp_path_factory.mktemp("server-logs")))
    yield


# Markers that may start a vLLM engine (pyproject.toml's markers say what each holds): the default suite,
# which leaves them out, starts none, and the guard below holds every other test to that.
ENGINE_MARKERS = frozenset({"engine", "slow", "gpu"})


@functools.cache
def _names_vllm(path: Path) -> bool:
    return "vllm" in path.read_text().lower()


def _engine_guard(item):
    """While an unmarked test sets up (its fixtures, module-scoped ones included) and runs, starting a vLLM engine
    (``LLM``, ``AsyncLLM``, an engine core in this process) raises: the default suite stays quick because nothing
    in it starts one. vLLM is imported for this only where it is loaded already or the test's module names it."""
    import sys

    if ENGINE_MARKERS & {m.name for m in item.iter_markers()} or "pytester" in getattr(item, "fixturenames", ()) or (
            "vllm" not in sys.modules and not _names_vllm(item.path)):
        return None  # marked; or a session of its own (pytester), which has its own guard
    from vllm.v1.engine import async_llm, core, llm_engine

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{item.nodeid} starts a vLLM engine: mark it `engine` (or `slow`); the default suite "
                           "(`pytest -q`) starts none")

    mp = pytest.MonkeyPatch()
    for cls in (llm_engine.LLMEngine, async_llm.AsyncLLM, core.EngineCore):
        mp.setattr(cls, "__init__", refuse)
    return mp


def _guarded(item):
    mp = _engine_guard(item)
    try:
        return (yield)
    finally:
        if mp is not None:
            mp.undo()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # fixtures, module-scoped ones included
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


# ``pytest.importorskip``'s skip reasons: a module it could not import, or one older than asked for
_MISSING = re.compile(r"(?:Skipped: )?(could not import '[^']+'|module '[^']+' has __version__ .*, required is)")


def _missing_dependency(report) -> str | None:
    """Under CI (``CI=true``), the reason of ``report``'s skip when ``pytest.importorskip`` raised it, else None."""
    if os.environ.get("CI") != "true" or not report.skipped or not isinstance(report.longrepr, tuple):
        return None
    reason = str(report.longrepr[2])
    return reason if _MISSING.match(reason) else None


def _fail_missing(report) -> None:
    """A test dependency CI lacks fails the run: on a developer's machine a module of tests that skips for an
    absent package (vLLM, jsonschema, the OpenAI client ...) is a choice; in CI, which installs every test
    dependency (``install.sh``), it is a broken install that would pass with the module's tests unrun."""
    reason = _missing_dependency(report)
    if reason is not None:
        path, line, _ = report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"{path}:{line}: {reason.removeprefix('Skipped: ')}\nCI=true: a missing test dependency "
                           "fails the run instead of skipping its tests (tests/conftest.py)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):  # a module-level importorskip
    report = yield
    _fail_missing(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # one in a test or a fixture
    report = yield
    _fail_missing(report)
    return report


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


@pytest.fixture(scope="session")
def _imported_heap_frozen():
    """Each in-process engine's life runs six full garbage collections (vLLM freezes the heap after start-up and
    unfreezes it at shutdown, collecting around both), each walking every object the test process holds, ~650k
    from torch, vLLM and transformers alone: 0.5-0.8 s each, 3-4 s of an engine's ~5 s life here. The modules
    are imported and frozen once, and vLLM's own freeze and unfreeze left out for the session: its collections
    then walk what was made since (an engine, a test), and everything an engine holds is still collected (it is
    never frozen; its KV cache and runner are gone after ``del`` and a collection, as before)."""
    import gc

    import importlib

    for module in ("vllm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu_worker",
                   "psd_plugin.vllm.runner", "psd_plugin.vllm.scheduler"):
        try:  # (what is imported before the freeze is only walked no more; one that fails here fails in its test)
            importlib.import_module(module)
        except ImportError:
            pass
    freeze, unfreeze = gc.freeze, gc.unfreeze
    gc.collect()
    freeze()
    gc.freeze = gc.unfreeze = lambda: None
    yield
    gc.freeze, gc.unfreeze = freeze, unfreeze
    unfreeze()


@pytest.fixture(scope="module")
def in_process_vllm(_imported_heap_frozen):
    """Run vLLM's engine core in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): faster start, and
    ``collective_rpc`` reaches the worker directly."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@pytest.fixture(autouse=True)
def _a_failed_in_process_engine_ends_with_its_test(request):
    """A test whose in-process vLLM engine raised leaves that engine alive in its traceback (pytest keeps the last
    failure's in ``sys.last_traceback`` for post-mortem debugging); whenever the garbage collector later finalizes
    it, vLLM's ``InprocClient`` finalizer tears down the process's distributed state (``cleanup_dist_env_and_memory``),
    by then the next test's engine's: that engine then fails with "pipeline model parallel group is not
    initialized", one failure becoming many. The failed test's frames are cleared and the engine finalized here,
    before the next test starts."""
    yield
    if "in_process_vllm" not in request.fixturenames or getattr(sys, "last_traceback", None) is None:
        return
    import gc
    import traceback

    traceback.clear_frames(sys.last_traceback)
    sys.last_type = sys.last_value = sys.last_traceback = None
    gc.collect()


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


@pytest.fixture(scope="session")
def heldout_prompts():
    """Fourteen held-out prompts of the embedded dLLM's tasks, every task, mixed lengths."""
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout

    _, tok = load(DEFAULT_DLLM)
    return [encode(tok, r["prompt"]) for r in load_heldout()[::151][:14]]


@pytest.fixture(scope="session")
def random_prompts():
    """Five random prompts of 5-45 tokens (for the random checkpoints)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in (3, 9, 17, 30, 41)]
