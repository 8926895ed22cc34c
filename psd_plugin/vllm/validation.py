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

from model_executor.decode_config import ConfigError, DecodeConfig

from . import compat
from .config import chunks_prompts, decode_config, from_vllm_config

_UNSUPPORTED = (  # (field, default, why): refused by PRESTO (the dLLM path takes them: take_structured_outputs)
    ("structured_outputs", None, "structured outputs are not supported by dLLM decoding"),
)
_RULES = (  # what the dLLM path applies to its logits (model_executor/decoding/logits_rules.py) and PRESTO not
    ("logprobs", None, "logprobs are not produced by dLLM decoding"),
    ("min_tokens", 0, "min_tokens is not supported by dLLM decoding"),
    ("logit_bias", None, "logit_bias is not supported by dLLM decoding"),
    ("allowed_token_ids", None, "allowed_token_ids is not supported by dLLM decoding"),
    ("bad_words", None, "bad_words is not supported by dLLM decoding"),
    ("presence_penalty", 0.0, "penalties are not applied by dLLM decoding"),
    ("frequency_penalty", 0.0, "penalties are not applied by dLLM decoding"),
    ("repetition_penalty", 1.0, "penalties are not applied by dLLM decoding"),
)
_PENALTIES = _RULES[-3:]
assert [n for n, _, _ in _PENALTIES] == ["presence_penalty", "frequency_penalty", "repetition_penalty"]


def _check_supported(params, what: str, table=_UNSUPPORTED) -> None:
    for name, default, why in table:
        value = getattr(params, name, default)
        if value is None or value == default or (isinstance(value, (list, dict, tuple)) and not value):
            continue
        raise VLLMValidationError(f"{name}={value!r}: {why.replace('dLLM decoding', what)}", parameter=name,
                                  value=value)


def check_presto(params) -> None:
    """Raise :class:`VLLMValidationError` for a request PRESTO's tree verification cannot serve: it samples
    from the target's full (temperature-scaled) distribution and produces no logprobs."""
    _check_supported(params, "PRESTO tree verification")
    _check_supported(params, "PRESTO tree verification", _RULES)
    if params.temperature > 0 and (params.top_p < 1.0 or params.top_k not in (0, -1) or params.min_p > 0):
        raise VLLMValidationError("top_p/top_k/min_p: PRESTO's lossless tree sampling draws from the target's full "
                                  "distribution; leave them at their defaults", parameter="top_p")


GRAMMAR_ARG = "psd_grammar"  # SamplingParams.extra_args key: the request's grammar (xgrammar's serialized JSON)
# The plugin's own ``SamplingParams.extra_args`` keys begin with this: only the plugin writes them (after the
# checks below), the workers trust them. vLLM copies a client's ``vllm_xargs`` into ``extra_args``, so a client
# key with this prefix is refused.
RESERVED_PREFIX = "psd_"


def refuse_logprob_token_ids(params) -> None:
    """Raise :class:`VLLMValidationError` for ``logprob_token_ids`` (the logprobs of given tokens at each emitted
    position): the plugin's steps return the emitted tokens' logprobs and their top alternatives (dLLM) or none
    (PRESTO), and vLLM's scheduler would still attach logprobs for them (an empty or wrong entry, and a 500 in the
    chat API's formatting)."""
    ids = getattr(params, "logprob_token_ids", None)
    if ids:
        raise VLLMValidationError(f"logprob_token_ids={ids!r}: psd-plugin does not score given tokens; use logprobs "
                                  "(the emitted token's and its top alternatives', dLLM decoding)",
                                  parameter="logprob_token_ids", value=ids)


def refuse_thinking_budget(params) -> None:
    """Raise :class:`VLLMValidationError` for ``thinking_token_budget`` (vLLM ends a reasoning section after that
    many tokens in its sampler and rejection sampler, which neither the dLLM steps nor PRESTO's tree verification
    run): a budget the plugin would silently not keep."""
    budget = getattr(params, "thinking_token_budget", None)
    if budget is not None:
        raise VLLMValidationError(f"thinking_token_budget={budget!r}: psd-plugin does not bound a reasoning section "
                                  "(vLLM's sampler keeps that budget, and its steps do not run it); leave it unset",
                                  parameter="thinking_token_budget", value=budget)


def refuse_reserved_args(params) -> None:
    """Raise :class:`VLLMValidationError` (a 400) when a request's ``extra_args`` (a client's ``vllm_xargs``)
    holds a key of the plugin's (:data:`RESERVED_PREFIX`)."""
    keys = sorted(k for k in (params.extra_args or {}) if isinstance(k, str) and k.startswith(RESERVED_PREFIX))
    if keys:
        raise VLLMValidationError(
            f"vllm_xargs / extra_args key(s) {keys}: keys beginning with {RESERVED_PREFIX!r} are psd-plugin's own "
            "(what its front end passes to its workers); a request may not set them. Use another name",
            parameter="vllm_xargs", value=keys)


def constraint_bytes(value) -> int:
    """The size of a structured-output constraint as a client sent it: UTF-8 bytes of its text (a JSON schema or
    a choice list as JSON)."""
    import json

    text = value if isinstance(value, str) else json.dumps(value)
    return len(text.encode("utf-8", "surrogatepass"))


def take_structured_outputs(vllm_config, cfg: DecodeConfig, params, max_bytes: int | None = None,
                            json_whitespace: str = "compact") -> None:
    """Structured outputs on the dLLM path (:mod:`model_executor.grammar`): the request's constraint, already
    validated by vLLM (``SamplingParams.verify``), is built into an xgrammar grammar here, so a constraint
    xgrammar cannot build is a 400, and travels to the workers in ``extra_args[GRAMMAR_ARG]``; the
    ``structured_outputs`` field is cleared, so vLLM's engine core, whose grammar advances one token per step
    left to right, never sees it. The workers compile it for the tokenizer and decode under the frontier rule.
    JSON is compact unless ``json_whitespace`` is ``any`` (speculative_config) and vLLM's
    ``disable_any_whitespace`` is off."""
    so = params.structured_outputs
    if so is None or so.all_constraints_none():
        return
    from model_executor.grammar import build_grammar

    if cfg.method == "joint_threshold":
        raise VLLMValidationError("structured_outputs: decoding 'joint_threshold' edits tokens it committed, which "
                                  "a grammar cannot check; serve structured outputs with another method (e.g. "
                                  "'confidence' or 'psd')", parameter="structured_outputs")
    if so.structural_tag is not None:
        raise VLLMValidationError("structured_outputs.structural_tag is not supported by dLLM decoding; use json, "
                                  "regex, choice, grammar or json_object", parameter="structured_outputs.structural_tag")
    for name, on in (("allowed_token_ids", params.allowed_token_ids is not None), ("bad_words", bool(params.bad_words)),
                     ("min_tokens", params.min_tokens > 0)):
        if on:  # the decoders' rule would set the logits of tokens the grammar may need to -inf
            raise VLLMValidationError(f"{name} with structured outputs: it can ban the only tokens the grammar "
                                      "allows at a position; use one or the other", parameter=name,
                                      value=getattr(params, name))
    backend = compat.structured_outputs_backend(so)
    if backend not in (None, "auto", "xgrammar"):
        raise VLLMValidationError(
            f"structured_outputs: vLLM chose the {backend!r} backend for this constraint; dLLM decoding applies "
            "its grammar with xgrammar only (this constraint uses a feature xgrammar does not support)",
            parameter="structured_outputs")
    kind = next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, k) is not None)
    size = constraint_bytes(getattr(so, kind))
    if max_bytes is not None and size > max_bytes:
        raise VLLMValidationError(
            f"structured_outputs.{kind}: {size} bytes; a constraint may have at most {max_bytes} "
            "(speculative_config.max_grammar_bytes): its grammar compiles for the tokenizer before the request "
            "decodes", parameter=f"structured_outputs.{kind}", value=size)
    try:
        any_ws = json_whitespace == "any" and not vllm_config.structured_outputs_config.disable_any_whitespace
        grammar = build_grammar(kind, getattr(so, kind), any_whitespace=any_ws)
    except ValueError as e:
        raise VLLMValidationError(str(e), parameter=f"structured_outputs.{kind}") from None
    params.extra_args = {**(params.extra_args or {}), GRAMMAR_ARG: grammar.serialize_json()}
    params.structured_outputs = None


def check(vllm_config, cfg: DecodeConfig, params, prompt_len: int, chunked: bool | None = None) -> None:
    """Raise :class:`VLLMValidationError` for a request the dLLM path (decoding with ``cfg``) cannot serve.
    ``chunked``: whether vLLM chunks this model's prefills (:func:`.config.chunks_prompts`; None: found here)."""
    penalized = next((name for name, default, _ in _PENALTIES if getattr(params, name, default) != default), None)
    for name, args in ((penalized, (penalized is not None,)), ("logprobs", (False, params.logprobs is not None))):
        try:
            cfg.check_request(*args)
        except ConfigError as e:
            value = getattr(params, name)
            raise VLLMValidationError(f"{name}={value!r}: {e}", parameter=name, value=value) from None
    if params.logprobs == -1:
        raise VLLMValidationError(
            "logprobs=-1 (every token of the vocabulary): dLLM decoding returns the emitted token's logprob and those "
            "of the most likely tokens, as many as asked; ask for a number (up to --max-logprobs)",
            parameter="logprobs", value=-1)
    if params.bad_words and any(len(ids) > 1 for ids in (params.bad_words_token_ids or [])):
        raise VLLMValidationError(
            f"bad_words {params.bad_words!r}: a word of several tokens cannot be kept out of an answer whose "
            "positions are decoded in any order; dLLM decoding bans bad_words of one token each (with and "
            "without a leading space)", parameter="bad_words", value=params.bad_words)
    vocab = vllm_config.model_config.get_vocab_size()
    bad = [t for t in (params.logit_bias or {}) if not 0 <= int(t) < vocab]
    if bad:
        raise VLLMValidationError(f"logit_bias token ids {bad} are outside the vocabulary (size {vocab})",
                                  parameter="logit_bias", value=bad)
    if params.allowed_token_ids is not None:
        from model_executor.models.configs import ArchSpec

        mask_id = ArchSpec.from_hf_config(vllm_config.model_config.hf_config).mask_token_id
        if not set(params.allowed_token_ids) - {mask_id}:
            raise VLLMValidationError(f"allowed_token_ids {params.allowed_token_ids}: the mask token ({mask_id}) is "
                                      "never a prediction; allow at least one other token",
                                      parameter="allowed_token_ids", value=params.allowed_token_ids)
    limit = vllm_config.model_config.max_model_len
    if prompt_len + params.max_tokens > limit:
        raise VLLMValidationError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) is {prompt_len + params.max_tokens}; "
            f"max_model_len is {limit}: a dLLM decodes its whole answer region in context. Lower max_tokens, or "
            "raise max_model_len", parameter="max_tokens", value=params.max_tokens)
    tokens = cfg.step_rows(prompt_len, params.max_tokens,
                           chunks_prompts(vllm_config) if chunked is None else chunked)
    sched = vllm_config.scheduler_config
    budget = sched.max_num_batched_tokens - sched.max_num_seqs  # the scheduler keeps a row per request free
    if tokens > budget:
        raise VLLMValidationError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) forwards up to {tokens} tokens in one "
            f"step with decoding {cfg.method!r}; a step holds {budget} (max_num_batched_tokens "
            f"{sched.max_num_batched_tokens} less a row per request, max_num_seqs {sched.max_num_seqs}): lower "
            "max_tokens or raise max_num_batched_tokens", parameter="max_tokens", value=params.max_tokens)


def _hold_from_spec_decode_check(params):
    """vLLM refuses ``logit_bias`` and ``min_p`` for every speculative method (``SamplingParams.verify``): its
    own sampler cannot apply them to draft tokens. The dLLM path is selected through a speculative config but
    applies both itself (``logit_bias`` as a logits rule, ``min_p`` when sampling), so they are taken off the
    params while vLLM checks them and put back after; :func:`check` validates them instead."""
    if not params.logit_bias and not params.min_p:
        return None
    held = (params.logit_bias, params.min_p)
    params.logit_bias, params.min_p = None, 0.0
    return held


def install() -> None:
    """Wrap ``InputProcessor.process_inputs`` (idempotent; called from ``psd_plugin.register``)."""
    from vllm.sampling_params import SamplingParams

    def make(original):
        def process_inputs(self, *args, **kwargs):
            extra = self.vllm_config.additional_config or {}
            params = kwargs.get("params", args[2] if len(args) > 2 else None)
            held = _hold_from_spec_decode_check(params) if "psd" in extra and isinstance(params, SamplingParams) \
                else None
            try:
                request = original(self, *args, **kwargs)
            finally:
                if held:
                    params.logit_bias, params.min_p = held
            if held:
                request.sampling_params.logit_bias, request.sampling_params.min_p = held
            if isinstance(request.sampling_params, SamplingParams) and ("psd" in extra or "presto" in extra):
                refuse_reserved_args(request.sampling_params)
                refuse_logprob_token_ids(request.sampling_params)
                refuse_thinking_budget(request.sampling_params)
                if compat.prompt_embeds(request) is not None or request.prompt_token_ids is None:
                    raise VLLMValidationError(
                        "prompt_embeds: psd-plugin decodes from the prompt's token ids (a dLLM's canvases and "
                        "PRESTO's drafter read them); send the prompt as text or token ids",
                        parameter="prompt_embeds")
                if "psd" in extra:
                    got = self.__dict__.get("_psd_configs")
                    if got is None:  # resolved once per front end
                        got = self.__dict__["_psd_configs"] = (decode_config(self.vllm_config),
                                                               from_vllm_config(self.vllm_config),
                                                               chunks_prompts(self.vllm_config))
                    cfg, spec, chunked = got
                    check(self.vllm_config, cfg, request.sampling_params, len(request.prompt_token_ids or ()),
                          chunked)
                    take_structured_outputs(self.vllm_config, cfg, request.sampling_params, spec.max_grammar_bytes,
                                            spec.json_whitespace)
                elif "presto" in extra:
                    check_presto(request.sampling_params)
            return request

        return process_inputs

    compat.wrap("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs", make)
    compat.wrap(*compat.RESPONSES_STREAM, _responses_stream_refusals)


def _responses_stream_refusals(original):
    """vLLM's streamed Responses API adds the request to the engine (where :func:`install`'s checks run) after
    the 200 and its first events are sent, and turns only a ``GenerationError`` into an event: a refusal there
    (a ``VLLMValidationError``: any of this module's 400s) escaped the stream and the server cut the connection
    mid-response. Here it ends the stream with the Responses API's ``error`` event, carrying the message and
    the parameter, as a non-streamed request gets them in its 400."""

    async def responses_stream_generator(self, *args, **kwargs):
        seq = -1
        try:
            async for event in original(self, *args, **kwargs):
                seq = getattr(event, "sequence_number", seq)
                yield event
        except VLLMValidationError as e:
            from openai.types.responses import ResponseErrorEvent

            yield ResponseErrorEvent(type="error", code="invalid_request_error", message=str(e),
                                     param=e.parameter, sequence_number=seq + 1)

    return responses_stream_generator
