"""psd-plugin: fast diffusion-LLM decoding for vLLM.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in the front-end, engine-core and
worker processes, so it is idempotent and cheap: it registers the dLLM config classes with transformers'
``AutoConfig`` and the model classes with vLLM's ``ModelRegistry`` (lazily, by qualified name).
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

MODEL_CLASSES = {
    "LLaDAModelLM": "model_executor.models.vllm_models:LLaDAModelLM",
    "DreamModel": "model_executor.models.vllm_models:DreamModel",
    "SDARForCausalLM": "model_executor.models.vllm_models:SDARForCausalLM",
}

CHECKPOINTS = Path(__file__).parent / "checkpoints"
DEFAULT_DLLM = CHECKPOINTS / "llada-tiny"
DEFAULT_AR = CHECKPOINTS / "ar-tiny"
DEFAULT_DRAFTER = CHECKPOINTS / "drafter-tiny"
GRAPHS = Path(__file__).parent / "graphs"


def default_ngram(drafter_dir: str | Path) -> Path | None:
    """The n-gram file shipped next to a drafter (``ngram.json``), or None."""
    p = Path(drafter_dir) / "ngram.json"
    return p if p.exists() else None


def default_graph(model_dir: str | Path, policy: str) -> Path:
    """The shipped Spiffy graph of an embedded model for a base policy (may not exist for other models)."""
    return GRAPHS / f"{Path(model_dir).resolve().name}.{policy}.json"

_registered = False


def register() -> None:
    """Register psd-plugin's configs and model classes with transformers and vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from model_executor.models.configs import register_configs

    register_configs()
    try:
        from vllm import ModelRegistry
    except ImportError:  # the reference engine works without vLLM
        _registered = True
        return
    from .speculative import install
    from .validation import install as install_validation

    install()
    install_validation()
    supported = set(ModelRegistry.get_supported_archs())
    for arch, qualname in MODEL_CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, qualname)
    _registered = True
