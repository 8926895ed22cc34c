"""psd-plugin's vLLM adapter: both modes of ``speculative_config={"method": "psd", ...}``.

A request's path, top-down:

- front end: :mod:`.config` translates the speculative config into vLLM's (the mode's scheduler, worker and
  resolved knobs), :mod:`.validation` answers a request the mode cannot serve with a 400;
- engine core: :mod:`.scheduler` schedules each step's drafts and rewinds to where the next forward starts;
- worker: :mod:`.worker` builds the mode's runner; :mod:`.runner` is what both share (the hooks, the step
  layout handed to the attention backend), :mod:`.dllm_runner` and :mod:`.presto_runner` are the modes;
- model and attention: the project's model classes (:mod:`model_executor.models.vllm_models`) on its
  attention backend (:mod:`attention_backends.vllm_backend`).

Every vLLM internal the adapter touches is named in :mod:`.compat`. :mod:`.engine` (``psd generate --engine
vllm``) and :mod:`.server` (starting vLLM's OpenAI server) are the adapter's clients.
"""

from __future__ import annotations

from . import compat


def install() -> None:
    """The front-end hooks (idempotent; called from ``psd_plugin.register`` in every vLLM process)."""
    from .config import enable_async_scheduling, keeping_async_scheduling, translate
    from .validation import install as install_validation

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config, *args, **kwargs):
            translate(self, target_model_config, target_parallel_config)
            return original(self, target_model_config, target_parallel_config, *args, **kwargs)

        return create_speculative_config

    def make_engine_config(original):
        def create_engine_config(self, *args, **kwargs):
            config = original(self, *args, **kwargs)
            enable_async_scheduling(config)
            return config

        return create_engine_config

    compat.wrap("vllm.engine.arg_utils", "EngineArgs", "create_speculative_config", make)
    compat.wrap("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", make_engine_config)
    compat.wrap("vllm.config.vllm", "VllmConfig", "__post_init__", keeping_async_scheduling)
    install_validation()
    _log_through_vllm()


def _log_through_vllm() -> None:
    """The project's log lines through vLLM's ``vllm`` logger (its handler, level and format, as vLLM configures
    them, later reconfigurations too): vLLM configures that logger only, so the plugin's INFO lines (its periodic
    TPF report, async scheduling on) would go to an unconfigured root logger and be lost. The project's loggers
    become its children. Left alone where the application configured the root logger (its handlers receive
    them as they propagate)."""
    import logging

    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logging.getLogger().handlers:
        return
    for name in ("psd_plugin", "model_executor", "attention_backends"):
        logging.getLogger(name).parent = vllm_logger
