"""The workers both modes select (``worker_cls``): vLLM's worker building the mode's model runner.

The runners are mixins over vLLM's runner API (:mod:`.runner`), combined here with the platform's runner
class. vLLM's CPU worker builds ``CPUModelRunner`` by its module-level name, so the CPU workers build theirs
inside :func:`psd_plugin.vllm.compat.cpu_worker_builds`. GPU platforms are refused at configuration time
(:func:`psd_plugin.vllm.config._require_cpu`) until the GPU runner has run on one; nothing in the runners
depends on the CPU (the KV layout and the attention kernels are the attention backend's).
"""

from __future__ import annotations

import functools

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from . import compat
from .dllm_runner import DLLMRunnerMixin
from .presto_runner import PrestoRunnerMixin


@functools.lru_cache
def runner_class(mixin: type, base: type) -> type:
    """``mixin`` over vLLM's runner ``base`` (``CPUModelRunner``, or ``GPUModelRunner`` on GPUs)."""
    return type(f"{mixin.__name__.removesuffix('Mixin')}On{base.__name__}", (mixin, base), {})


DLLMModelRunner = runner_class(DLLMRunnerMixin, CPUModelRunner)
PrestoModelRunner = runner_class(PrestoRunnerMixin, CPUModelRunner)


class _PSDCPUWorker(CPUWorker):
    runner_cls: type = CPUModelRunner

    def init_device(self):
        with compat.cpu_worker_builds(self.runner_cls):
            super().init_device()
        if not isinstance(self.model_runner, self.runner_cls):  # e.g. Model Runner V2, which the swap misses
            raise RuntimeError(f"psd-plugin needs vLLM's V1 model runner; the worker built "
                               f"{type(self.model_runner).__name__} (unset VLLM_USE_V2_MODEL_RUNNER)")


class DLLMWorker(_PSDCPUWorker):
    """Builds the dLLM runner (``worker_cls`` set by the ``psd`` method on a dLLM)."""

    runner_cls = DLLMModelRunner

    def psd_stats(self) -> dict:
        """Decoding figures (``LLM.collective_rpc("psd_stats")``): totals and recent finished requests."""
        return self.model_runner.psd_stats()


class PrestoWorker(_PSDCPUWorker):
    """Builds the PRESTO runner (``worker_cls`` set by PRESTO mode)."""

    runner_cls = PrestoModelRunner

    def presto_stats(self) -> dict:
        """Verification figures (``LLM.collective_rpc("presto_stats")``): forwards, tree steps, nodes."""
        return self.model_runner.presto_stats()
