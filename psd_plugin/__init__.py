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
    "LLaDA2MoeModelLM": "model_executor.models.vllm_models:LLaDA2MoeModelLM",
    "PSDLlamaForCausalLM": "model_executor.models.vllm_models:PSDLlamaForCausalLM",  # PRESTO's target
}

CHECKPOINTS = Path(__file__).parent / "checkpoints"
DEFAULT_DLLM = CHECKPOINTS / "llada-tiny"  # the LLaDA-format dLLM: psd generate/eval/serve and the tests
DEMO_DLLM = CHECKPOINTS / "dream-tiny"  # the most accurate embedded dLLM: psd demo and the serving benchmark
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


def claim_model_executor() -> None:
    """Make ``model_executor`` name this project's package again, with every submodule loaded.

    vLLM 0.32's ``LazyLoader("model_executor", ..., "vllm.model_executor.layers.quantization")``
    (``vllm/config/model.py``, ``vllm/config/speculative.py``) stores the module it loads as
    ``sys.modules["model_executor"]`` when first touched, which shadows our top-level package: a later
    ``import model_executor.x`` would then look inside vLLM's quantization package. Removing that alias is
    harmless to vLLM (it keeps its module in the loader object); loading our submodules eagerly keeps them
    importable if the alias comes back later. Modules that need an absent optional dependency are skipped.
    """
    import importlib
    import pkgutil
    import sys

    ours = Path(__file__).resolve().parents[1] / "model_executor"

    def reclaim():
        mod = sys.modules.get("model_executor")
        if mod is not None and Path(getattr(mod, "__file__", None) or "/").resolve().parent != ours:
            del sys.modules["model_executor"]
        import model_executor

        return model_executor

    # A submodule's own imports can touch vLLM's loader and bring the alias back mid-walk (on CUDA platforms,
    # loading model_executor.models.vllm_models does): take the name back before every import.
    for info in pkgutil.walk_packages(reclaim().__path__, "model_executor."):
        reclaim()
        try:
            importlib.import_module(info.name)
        except ImportError:
            pass
    reclaim()


claim_model_executor()

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
    from .vllm import install

    install()
    supported = set(ModelRegistry.get_supported_archs())
    for arch, qualname in MODEL_CLASSES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, qualname)
    _registered = True
