"""Request validation for the dLLM and PRESTO paths, in vLLM's front end (a bad request is a 400, never an
engine crash).

:func:`install` wraps ``InputProcessor.process_inputs``: after vLLM's own checks (which also fill in
``max_tokens``), a request to a dLLM served with the ``psd`` method is checked for

- sampling options the decoders do not implement (named, with what to do instead);
- room: the prompt and the answer region must fit ``max_model_len`` (draft canvases take no context: they
  are extra rows of a step, :mod:`attention_backends.vllm_backend`), and a step's canvases must fit the
  step's token budget (``max_num_batched_tokens``), else the request could never be scheduled.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from model_executor.decoding import GREEDY_ONLY

from . import compat
from .config import PSDSpeculativeConfig, from_vllm_config

_UNSUPPORTED = (  # (field, default, why)
    ("logprobs", None, "logprobs are not produced by dLLM decoding"),
    ("presence_penalty", 0.0, "penalties are not applied by dLLM decoding"),
    ("frequency_penalty", 0.0, "penalties are not applied by dLLM decoding"),
    ("repetition_penalty", 1.0, "penalties are not applied by dLLM decoding"),
    ("min_tokens", 0, "min_tokens is not supported by dLLM decoding"),
    ("logit_bias", None, "logit_bias is not supported by dLLM decoding"),
    ("allowed_token_ids", None, "allowed_token_ids is not supported by dLLM decoding"),
    ("bad_words", None, "bad_words is not supported by dLLM decoding"),
    ("structured_outputs", None, "structured outputs are not supported by dLLM decoding"),
)


def step_tokens(cfg: PSDSpeculativeConfig, prompt_len: int, max_tokens: int) -> int:
    """Upper bound of the rows one step of such a request forwards (every canvas of its window)."""
    K = cfg.max_canvases()
    M, P = max_tokens, prompt_len
    if cfg.cache == "none":
        S, fresh = P + M, P + M
    elif cfg.cache == "prefix":
        S, fresh = M + 1, P + M
    elif cfg.cache == "dual":
        S, fresh = min(M, cfg.block_size) + 1, P + M
    else:  # block: uncached finished tokens + the current block
        S, fresh = 2 * cfg.block_size + P % cfg.block_size, 0
    return max(fresh, K * S)


def _check_supported(params, what: str) -> None:
    for name, default, why in _UNSUPPORTED:
        value = getattr(params, name, default)
        if value is None or value == default or (isinstance(value, (list, dict, tuple)) and not value):
            continue
        raise VLLMValidationError(f"{name}={value!r}: {why.replace('dLLM decoding', what)}", parameter=name,
                                  value=value)


def check_presto(params) -> None:
    """Raise :class:`VLLMValidationError` for a request PRESTO's tree verification cannot serve: it samples
    from the target's full (temperature-scaled) distribution and produces no logprobs."""
    _check_supported(params, "PRESTO tree verification")
    if params.temperature > 0 and (params.top_p < 1.0 or params.top_k not in (0, -1) or params.min_p > 0):
        raise VLLMValidationError("top_p/top_k/min_p: PRESTO's lossless tree sampling draws from the target's full "
                                  "distribution; leave them at their defaults", parameter="top_p")


def check(vllm_config, params, prompt_len: int) -> None:
    """Raise :class:`VLLMValidationError` for a request the dLLM path cannot serve."""
    cfg = from_vllm_config(vllm_config)
    _check_supported(params, "dLLM decoding")
    if params.temperature > 0:
        if cfg.decoding in GREEDY_ONLY:
            raise VLLMValidationError(
                f"temperature={params.temperature}: decoding {cfg.decoding!r} is greedy (its acceptance tests "
                "compare argmax tokens); use temperature 0, or decoding static | confidence | localleap",
                parameter="temperature", value=params.temperature)
        if params.top_p < 1.0 or params.top_k not in (0, -1) or params.min_p > 0:
            raise VLLMValidationError("top_p/top_k/min_p: dLLM sampling draws from the full distribution "
                                      "(Gumbel-max, LLaDA generate.py); leave them at their defaults",
                                      parameter="top_p")
    limit = vllm_config.model_config.max_model_len
    if prompt_len + params.max_tokens > limit:
        raise VLLMValidationError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) is {prompt_len + params.max_tokens}; "
            f"max_model_len is {limit}: a dLLM decodes its whole answer region in context. Lower max_tokens, or "
            "raise max_model_len", parameter="max_tokens", value=params.max_tokens)
    tokens = step_tokens(cfg, prompt_len, params.max_tokens)
    budget = vllm_config.scheduler_config.max_num_batched_tokens - vllm_config.scheduler_config.max_num_seqs
    if tokens > budget:
        raise VLLMValidationError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) forwards up to {tokens} tokens in one "
            f"step with decoding {cfg.decoding!r}; max_num_batched_tokens is {budget}: lower max_tokens or raise "
            "max_num_batched_tokens", parameter="max_tokens", value=params.max_tokens)


def install() -> None:
    """Wrap ``InputProcessor.process_inputs`` (idempotent; called from ``psd_plugin.register``)."""
    from vllm.sampling_params import SamplingParams

    def make(original):
        def process_inputs(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            extra = self.vllm_config.additional_config or {}
            if isinstance(request.sampling_params, SamplingParams):
                if "psd" in extra:
                    check(self.vllm_config, request.sampling_params, len(request.prompt_token_ids or ()))
                elif "presto" in extra:
                    check_presto(request.sampling_params)
            return request

        return process_inputs

    compat.wrap("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs", make)
