"""``speculative_config={"method": "psd", ...}``: the schema, its validation, and how vLLM is told about it.

vLLM's ``SpeculativeConfig.method`` is a closed ``Literal`` and the config forbids unknown keys, so the
plugin translates in the front end, before vLLM validates anything: :func:`install` wraps
``EngineArgs.create_speculative_config``. For a dLLM it

1. decodes the user's dict into :class:`PSDSpeculativeConfig` (msgspec; errors name the field and the
   allowed values) and checks it against the model (block size, cache mode, Spiffy graph);
2. hands vLLM a ``custom_class`` speculative config whose proposer is :class:`CanvasProposer` (drafts
   are the dLLM's canvases, produced by the runner) with ``num_speculative_tokens = block_size``;
3. stores the validated config in ``additional_config["psd"]`` (it travels to the engine core and the
   workers with ``VllmConfig``) and selects the plugin's scheduler and worker classes.

A dLLM without a speculative config gets the default (``decoding = "confidence"``, as SGLang's default
dLLM algorithm); a dLLM with another speculative method, or an autoregressive model with ``"psd"``, is
refused with a message that says what to do.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from model_executor.decoding import METHODS

from .config import ConfigError, DecodeKnobs, parse_config

SCHEDULER_CLS = "psd_plugin.scheduler.DLLMScheduler"
WORKER_CLS = "psd_plugin.worker.DLLMWorker"
PROPOSER_CLS = "psd_plugin.speculative.CanvasProposer"

Decoding = Literal["static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd"]
assert set(Decoding.__args__) == set(METHODS)


class PSDSpeculativeConfig(DecodeKnobs, forbid_unknown_fields=True, kw_only=True):
    """The dLLM decoding path in vLLM (README: "Speculative config").

    - ``method``: ``"psd"`` (the key vLLM routes on).
    - ``decoding``: the algorithm, one of static | confidence | localleap | lopa | freedave | spiffy | psd.
    - ``block_size``: tokens per semi-autoregressive block (default 8; SDAR: the model's attention block).
    - every knob of :class:`~psd_plugin.config.DecodeKnobs` (``threshold``, ``policy``, ``depth``,
      ``branches``, ``steps``, ``graph``, ``budget``, ``cache`` ...).

    Temperature and seed come from each request's ``SamplingParams``.
    """

    method: Literal["psd"] = "psd"
    decoding: Decoding = "psd"
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None

    def max_canvases(self) -> int:
        """The most canvases one step of a request forwards (root + drafts)."""
        return {"psd": self.depth + 1, "lopa": self.branches + 1, "freedave": self.steps,
                "spiffy": self.budget + 1}.get(self.decoding, 1)


def resolve(config: PSDSpeculativeConfig, hf_config, model_dir: str) -> PSDSpeculativeConfig:
    """Fill the model-dependent defaults (block size, cache mode) and check the config fits the model."""
    from model_executor.models.configs import ArchSpec

    spec = ArchSpec.from_hf_config(hf_config)
    where = "speculative_config"
    if spec.attention == "block_causal":
        if config.block_size not in (None, spec.block_size):
            raise ConfigError(f"{where}.block_size {config.block_size}: an SDAR model decodes in its attention "
                              f"block; allowed: {spec.block_size}")
        if config.cache not in (None, "none", "block"):
            raise ConfigError(f"{where}.cache {config.cache!r} for a block-causal (SDAR) model; allowed: none, block")
        cfg = msgspec.structs.replace(config, block_size=spec.block_size, cache=config.cache or "block")
    else:
        if config.cache == "block":
            raise ConfigError(f"{where}.cache 'block' is exact only for block-causal models (SDAR); "
                              f"{spec.family} allows: none, prefix")
        cfg = msgspec.structs.replace(config, block_size=config.block_size or 8, cache=config.cache or "prefix")
    if cfg.decoding == "spiffy":
        from .config import spiffy_graph

        spiffy_graph(cfg, model_dir, cfg.block_size, where=f"{where}.graph")
    return cfg


def parse(raw: dict) -> PSDSpeculativeConfig:
    """Decode a user dict (``-`` in keys allowed, as vLLM's CLI does) into the typed config."""
    raw = {k.replace("-", "_"): v for k, v in raw.items()}
    return parse_config(msgspec.json.encode(raw), PSDSpeculativeConfig, where="speculative_config")


def stored_config(vllm_config, key: str, cls, selected_by: str):
    """The resolved config a ``translate`` stored in ``additional_config[key]`` (the engine core and the
    workers read it from there), as ``cls``."""
    raw = (vllm_config.additional_config or {}).get(key)
    if raw is None:
        raise RuntimeError(f"psd-plugin's scheduler/worker need additional_config[{key!r}]; they are selected by "
                           f"speculative_config={selected_by}, not by hand")
    return msgspec.convert(raw, cls)


def from_vllm_config(vllm_config) -> PSDSpeculativeConfig:
    return stored_config(vllm_config, "psd", PSDSpeculativeConfig, "{'method': 'psd', ...}")


def is_dllm_config(hf_config) -> bool:
    from model_executor.models.configs import CONFIG_CLASSES

    return getattr(hf_config, "model_type", None) in CONFIG_CLASSES


def translate(engine_args, target_model_config, target_parallel_config) -> None:
    """Rewrite ``engine_args`` in place for the dLLM path (see the module docstring)."""
    raw = engine_args.speculative_config
    dllm = is_dllm_config(target_model_config.hf_config)
    is_psd = isinstance(raw, dict) and raw.get("method") == "psd"
    if not dllm:
        if is_psd and raw.get("mode") == "presto":
            from .presto import translate as translate_presto

            return translate_presto(engine_args, target_model_config, target_parallel_config, raw)
        if is_psd:
            raise ConfigError(f"speculative_config method 'psd' decodes diffusion LLMs (LLaDA, Dream, SDAR); "
                              f"{target_model_config.model} is model_type "
                              f"{getattr(target_model_config.hf_config, 'model_type', '?')!r}. For an autoregressive "
                              "target use {\"method\": \"psd\", \"mode\": \"presto\"} (tree drafting with a "
                              "diffusion drafter), another speculative method, or none")
        return
    if raw is not None and not is_psd:
        method = raw.get("method") if isinstance(raw, dict) else raw
        raise ConfigError(f"{target_model_config.model} is a diffusion LLM: vLLM's autoregressive decoding and "
                          f"speculative method {method!r} cannot decode it. Use speculative_config "
                          "{\"method\": \"psd\", ...} (or none, for the default confidence decoding)")
    cfg = resolve(parse(raw if is_psd else {"decoding": "confidence"}), target_model_config.hf_config,
                  target_model_config.model)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ConfigError("psd-plugin's dLLM decoding path runs on vLLM's V1 CPU runner so far; on GPUs decode with "
                          "the reference engine (`psd generate --engine reference`, model_executor.engine) until "
                          "the GPU runner lands")
    engine_args.additional_config = {**dict(engine_args.additional_config or {}),
                                     "psd": msgspec.to_builtins(cfg)}
    engine_args.speculative_config = {"method": "custom_class", "model": PROPOSER_CLS,
                                      "num_speculative_tokens": cfg.block_size}
    if engine_args.scheduler_cls not in (None, SCHEDULER_CLS):
        raise ConfigError(f"scheduler_cls {engine_args.scheduler_cls!r}: a dLLM needs psd-plugin's scheduler; "
                          "leave scheduler_cls unset")
    engine_args.scheduler_cls = SCHEDULER_CLS
    if target_parallel_config.worker_cls not in ("auto", WORKER_CLS):
        raise ConfigError(f"worker_cls {target_parallel_config.worker_cls!r}: a dLLM needs psd-plugin's worker; "
                          "leave worker_cls unset")
    target_parallel_config.worker_cls = WORKER_CLS
    engine_args.worker_cls = WORKER_CLS


class CanvasProposer:
    """The ``custom_class`` proposer vLLM instantiates: a placeholder, because a dLLM's drafts (its
    canvases) are produced by the plugin's model runner, which overrides ``sample_tokens``."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def load_model(self, target_model) -> None:  # the CPU runner always calls it
        pass

    def propose(self, *args, **kwargs):
        raise RuntimeError("psd-plugin drafts come from its model runner; the proposer is never called")


KV_PAGE = 32  # default KV-cache page (vLLM block) size for dLLMs: the CPU kernel's smallest


def _local_dllm(model) -> bool:
    import json
    from pathlib import Path

    from model_executor.models.configs import CONFIG_CLASSES

    try:
        return json.loads((Path(model) / "config.json").read_text()).get("model_type") in CONFIG_CLASSES
    except (OSError, ValueError, TypeError):
        return False


_installed = False


def install() -> None:
    """Wrap ``EngineArgs.create_speculative_config`` (idempotent; called from ``psd_plugin.register``)."""
    global _installed
    if _installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    original_engine_config = EngineArgs.create_engine_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        translate(self, target_model_config, target_parallel_config)
        return original(self, target_model_config, target_parallel_config)

    def create_engine_config(self, *args, **kwargs):
        if self.block_size is None and _local_dllm(self.model):
            self.block_size = KV_PAGE  # small pages: draft canvases take private pages (attention_backends.segments)
        return original_engine_config(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config
    EngineArgs.create_engine_config = create_engine_config
    _installed = True
