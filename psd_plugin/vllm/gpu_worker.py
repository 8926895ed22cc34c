"""The GPU workers of both modes: vLLM's GPU ``Worker`` building the mode's runner over vLLM's **V1**
``GPUModelRunner``.

vLLM's GPU worker builds its runner in ``Worker._make_model_runner`` (its documented override point: "subclasses
override this"); these workers return the mode's mixin over the V1 runner there, and check after
``init_device`` that the worker holds it. Model Runner V2 has none of the hooks the mixins override, so a worker
vLLM configured for V2 is refused (:func:`psd_plugin.vllm.config.translate` pins V1 before the engine starts).

This module never imports vLLM's CPU worker or CPU runner (``vllm.v1.worker.cpu_worker`` imports
``vllm.v1.worker.cpu.shm``, which replaces ``torch.cuda.Event``/``Stream`` and ``Tensor.pin_memory``
process-wide; ``tests/test_vllm_gpu_worker.py`` checks). Selected on CUDA platforms by :mod:`.config`.

Status: run on one H100 (eager, prefix cache: every dLLM method equal to the reference engine in float32, PSD
in bfloat16; docs/gpu.md); CUDA graphs, the dual cache, PRESTO and tensor parallelism not yet run on a GPU.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from .dllm_runner import DLLMRunnerMixin
from .presto_runner import PrestoRunnerMixin
from .worker import DLLMWorkerMixin, PrestoWorkerMixin, PSDWorkerMixin, runner_class

DLLMGPUModelRunner = runner_class(DLLMRunnerMixin, GPUModelRunner)
PrestoGPUModelRunner = runner_class(PrestoRunnerMixin, GPUModelRunner)


class _PSDGPUWorker(PSDWorkerMixin, Worker):
    runner_cls: type = GPUModelRunner

    def _make_model_runner(self) -> GPUModelRunner:
        """The mode's runner over vLLM's V1 ``GPUModelRunner`` (``Worker._make_model_runner``, which builds V1
        or V2 by ``use_v2_model_runner``)."""
        if self.use_v2_model_runner:
            raise RuntimeError("psd-plugin's runners are built on vLLM's V1 model runner, and vLLM configured this "
                               "worker for Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, or a feature that forces "
                               "V2 such as HiSparse or watermarking). Leave VLLM_USE_V2_MODEL_RUNNER unset (or 0) "
                               "and those features off")
        return self.runner_cls(self.vllm_config, self.device)

    def init_device(self):
        super().init_device()
        self.check_runner()


class DLLMGPUWorker(DLLMWorkerMixin, _PSDGPUWorker):
    """Builds the dLLM runner on CUDA platforms (``worker_cls`` set by the ``psd`` method on a dLLM)."""

    runner_cls = DLLMGPUModelRunner


class PrestoGPUWorker(PrestoWorkerMixin, _PSDGPUWorker):
    """Builds the PRESTO runner on CUDA platforms (``worker_cls`` set by PRESTO mode)."""

    runner_cls = PrestoGPUModelRunner
