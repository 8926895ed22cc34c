"""The CPU workers of both modes: vLLM's ``CPUWorker`` building the mode's runner over ``CPUModelRunner``.

vLLM's CPU worker builds ``CPUModelRunner`` by its module-level name, so these workers build theirs inside
:func:`psd_plugin.vllm.compat.cpu_worker_builds`. Only CPU engines import this module: importing vLLM's CPU
worker (``vllm.v1.worker.cpu_worker``) imports ``vllm.v1.worker.cpu.shm``, which replaces
``torch.cuda.Event``/``Stream`` and ``Tensor.pin_memory`` process-wide. GPU engines use :mod:`.gpu_worker`.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from . import compat
from .dllm_runner import DLLMRunnerMixin
from .presto_runner import PrestoRunnerMixin
from .worker import DLLMWorkerMixin, PrestoWorkerMixin, PSDWorkerMixin, runner_class

DLLMModelRunner = runner_class(DLLMRunnerMixin, CPUModelRunner)
PrestoModelRunner = runner_class(PrestoRunnerMixin, CPUModelRunner)


class _PSDCPUWorker(PSDWorkerMixin, CPUWorker):
    runner_cls: type = CPUModelRunner

    def init_device(self):
        if self.parallel_config.enable_expert_parallel:
            compat.cpu_experts_map_ids()  # vLLM 0.32's CPU experts ignore the expert map (compat.CPU_MOE_EXPERTS)
        if self.parallel_config.data_parallel_size > 1:
            compat.cpu_variable_collectives()  # MoE data parallelism's gathers (compat.CPU_COMMUNICATOR)
        with compat.cpu_worker_builds(self.runner_cls):
            super().init_device()
        self.check_runner()  # e.g. Model Runner V2, which the swap misses


class DLLMWorker(DLLMWorkerMixin, _PSDCPUWorker):
    """Builds the dLLM runner on CPU platforms (``worker_cls`` set by the ``psd`` method on a dLLM)."""

    runner_cls = DLLMModelRunner


class PrestoWorker(PrestoWorkerMixin, _PSDCPUWorker):
    """Builds the PRESTO runner on CPU platforms (``worker_cls`` set by PRESTO mode)."""

    runner_cls = PrestoModelRunner
