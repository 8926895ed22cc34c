"""What the workers of both modes share on every platform (``worker_cls``: vLLM's worker building the mode's
model runner).

The runners are mixins over vLLM's runner API (:mod:`.runner`), combined with the platform's runner class by
:func:`runner_class`. The workers themselves are per platform, each in its own module, because vLLM's CPU and
GPU workers cannot share a process:

- :mod:`.cpu_worker`: over vLLM's ``CPUWorker`` and ``CPUModelRunner`` (importing vLLM's CPU worker patches
  ``torch.cuda.Event``/``Stream`` and ``Tensor.pin_memory`` process-wide, and it calls a CPU-only op);
- :mod:`.gpu_worker`: over vLLM's GPU ``Worker`` and V1 ``GPUModelRunner``; it never imports the CPU worker.

:mod:`.config` picks the platform's worker (``config.WORKER_CLS``). This module imports neither platform's
worker. The names ``worker.DLLMWorker``, ``worker.PrestoWorker``, ``worker.DLLMModelRunner`` and
``worker.PrestoModelRunner`` still resolve (to the CPU classes), lazily, so importing this module stays
platform-neutral.
"""

from __future__ import annotations

import functools
import importlib


@functools.lru_cache
def runner_class(mixin: type, base: type) -> type:
    """``mixin`` over vLLM's runner ``base`` (``CPUModelRunner``, or the V1 ``GPUModelRunner`` on GPUs)."""
    return type(f"{mixin.__name__.removesuffix('Mixin')}On{base.__name__}", (mixin, base), {})


class PSDWorkerMixin:
    """Mixed in before vLLM's worker class: the runner class the worker must build (``runner_cls``, set per
    mode and platform) and the check that it did."""

    runner_cls: type

    def check_runner(self) -> None:
        """Raise unless the worker built :attr:`runner_cls` (e.g. vLLM chose Model Runner V2, which the plugin's
        V1 runner hooks cannot drive)."""
        runner = getattr(self, "model_runner", None)
        if not isinstance(runner, self.runner_cls):
            raise RuntimeError(f"psd-plugin needs its {self.runner_cls.__name__} (vLLM's V1 model runner with the "
                               f"plugin's hooks); the worker built {type(runner).__name__}. Leave "
                               "VLLM_USE_V2_MODEL_RUNNER unset (or 0) and worker_cls unset")


class DLLMWorkerMixin(PSDWorkerMixin):
    """The dLLM mode's worker RPCs (``worker_cls`` set by the ``psd`` method on a dLLM)."""

    def psd_stats(self) -> dict:
        """Decoding figures (``LLM.collective_rpc("psd_stats")``): totals and recent finished requests."""
        return self.model_runner.psd_stats()


class PrestoWorkerMixin(PSDWorkerMixin):
    """The PRESTO mode's worker RPCs (``worker_cls`` set by PRESTO mode)."""

    def presto_stats(self) -> dict:
        """Verification figures (``LLM.collective_rpc("presto_stats")``): forwards, tree steps, nodes."""
        return self.model_runner.presto_stats()


# Names this module had when it held the CPU workers; they now live in :mod:`.cpu_worker`.
_CPU_NAMES = ("DLLMWorker", "PrestoWorker", "DLLMModelRunner", "PrestoModelRunner")


def __getattr__(name: str):
    if name in _CPU_NAMES:  # imported only when asked for: importing vLLM's CPU worker patches torch.cuda
        return getattr(importlib.import_module(".cpu_worker", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
