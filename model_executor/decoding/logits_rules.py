"""What a request asks of the distributions its tokens are chosen from: the usual request options of an
OpenAI-style server, applied to a dLLM step's logits before any confidence is computed.

:class:`LogitsRules` holds one request's ``logit_bias``, ``allowed_token_ids``, banned tokens (``bad_words``
that are one token) and ``min_tokens`` (the stop tokens are suppressed at answer positions before it: in a
dLLM every position of the block is predicted at once, so "no EOS before ``min_tokens``" is a rule per
position, not per step) and vLLM's repetition / presence / frequency penalties over the tokens committed so
far (for the decoders that forward their state alone: :attr:`LogitsRules.penalized`). :func:`apply_rules` applies the rules of every request of a step to its rows, in
place, in both engines, so every decoding method (the lossless ones included: their base policy and their
drafts see the same processed logits) decodes the processed distribution.

``top_k`` / ``top_p`` / ``min_p`` restrict sampled draws (:func:`~.sampling.filter_rows`, after temperature, as
vLLM's sampler orders them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LogitsRules:
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    banned_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # suppressed at answer positions < min_tokens
    repetition_penalty: float = 1.0  # vLLM's: on tokens of the prompt and the answer so far
    presence_penalty: float = 0.0  # on tokens of the answer so far
    frequency_penalty: float = 0.0  # times each one's count in the answer so far

    @property
    def penalized(self) -> bool:
        """Whether the rules depend on the tokens committed so far (penalties): only decoders that forward their
        state alone (the spatial policies) see them as they are; a draft canvas would see them out of date."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def bans(self) -> str | None:
        """The first option that sets logits to -inf (what a grammar may need: then no allowed token is left), or
        None. Structured outputs refuse these (:mod:`model_executor.grammar`)."""
        if self.allowed_token_ids is not None:
            return "allowed_token_ids"
        if self.banned_token_ids:
            return "bad_words"
        if self.min_tokens > 0 and self.stop_token_ids:
            return "min_tokens"
        return None

    @property
    def active(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.banned_token_ids
                    or (self.min_tokens > 0 and self.stop_token_ids) or self.penalized)

    def on(self, device: torch.device, V: int) -> dict[str, torch.Tensor]:
        """The rules' constant tensors on ``device`` for a ``V``-token vocabulary: built and uploaded once per
        request (the rules are immutable), not once per step. On a GPU an upload from a Python list is a
        blocking copy; a step then only moves what changed (the committed answer, for the penalties)."""
        cache = self.__dict__.setdefault("_device_tensors", {})  # frozen dataclass: a private cache slot
        key = (str(device), V)
        if key not in cache:
            host: dict[str, torch.Tensor] = {}
            if self.allowed_token_ids is not None:
                host["keep"] = torch.zeros(V, dtype=torch.bool)
                host["keep"][list(self.allowed_token_ids)] = True
            if self.banned_token_ids:
                host["banned"] = torch.tensor(self.banned_token_ids, dtype=torch.long)
            if self.logit_bias:
                host["bias_ids"] = torch.tensor(list(self.logit_bias), dtype=torch.long)
                host["bias"] = torch.tensor(list(self.logit_bias.values()), dtype=torch.float64)
            if self.min_tokens > 0 and self.stop_token_ids:
                host["stop"] = torch.tensor(self.stop_token_ids, dtype=torch.long)
            cache[key] = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        return cache[key]

    def apply(self, logits: torch.Tensor, answer_offsets: torch.Tensor,
              history: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``logits [n, V]``: rows of a request's canvases, row ``j`` predicting the answer's token
        ``answer_offsets[j]`` (0 = the first answer token; host). ``history = (prompt ids, answer ids committed so
        far)`` for the penalties. In place, in vLLM's order (its sampler's ``apply_logits_processors``): allowed
        tokens, banned words, ``min_tokens``' stop tokens and the bias, then the penalties on what they left."""
        V = logits.shape[-1]
        const = self.on(logits.device, V)
        if "keep" in const:
            logits.masked_fill_(~const["keep"], float("-inf"))
        if "banned" in const:
            logits.index_fill_(-1, const["banned"], float("-inf"))
        if "bias_ids" in const:
            logits[..., const["bias_ids"]] += const["bias"].to(logits.dtype)
        if "stop" in const:
            early = torch.from_numpy((answer_offsets < self.min_tokens).numpy().nonzero()[0])  # host offsets
            if early.numel():
                logits[early.to(logits.device, non_blocking=True)[:, None], const["stop"]] = float("-inf")
        if self.penalized:
            prompt, output = history
            # the answer so far goes up as ids (a few, without waiting) and is counted there (index_add_: a
            # bincount's output size is its data's maximum, which the host would wait for)
            counts = _counts(output, V, logits.device).to(logits.dtype)
            if self.repetition_penalty != 1.0:
                # the prompt's tokens, once per prompt (keyed by its ids: rules may be shared between requests)
                prompt_seen = self.__dict__.setdefault("_prompt_seen", {})
                key = (str(logits.device), V, prompt.numpy().tobytes())
                if key not in prompt_seen:
                    if len(prompt_seen) >= 8:
                        prompt_seen.pop(next(iter(prompt_seen)))
                    prompt_seen[key] = _counts(prompt, V, logits.device) > 0
                seen = (counts > 0) | prompt_seen[key]
                p = self.repetition_penalty
                logits.copy_(torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits))
            if self.frequency_penalty or self.presence_penalty:
                logits -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0).to(logits.dtype)


def _counts(ids: torch.Tensor, V: int, device: torch.device) -> torch.Tensor:
    """``[V]`` float32 occurrences of the host ``ids`` (tokens below ``V``), counted on ``device``."""
    ids = ids.to(device, non_blocking=True)
    return torch.zeros(V, dtype=torch.float32, device=device).index_add_(
        0, ids, torch.ones(ids.numel(), dtype=torch.float32, device=device))


def apply_rules(logits: torch.Tensor, items: list[tuple], at: torch.Tensor | None = None,
                failed: dict[int, Exception] | None = None) -> None:
    """Apply each request's rules to its rows of a step's ``logits``, in place. ``items``: per request
    ``(rules, first prediction row, canvases K, block length L, answer offset of the block's first position,
    history)`` (``history``: see :meth:`LogitsRules.apply`; a callable, called only when the rules need it); the
    request's prediction rows are ``[first, first + K * L)``, canvas after canvas. ``at [N]`` (host): the logits
    row of each prediction row, -1 where none was computed (:class:`~.base.RowPredictions`); None: the same
    row. ``failed``: where an item's rules raise, the exception is recorded under the item's index instead of
    raised (each item writes its own rows only, so the others' are unaffected)."""
    for n, (rules, first, K, L, offset, history) in enumerate(items):
        if rules is None or not rules.active:
            continue
        try:
            _apply_one(logits, rules, first, K, L, offset, history, at)
        except Exception as e:
            if failed is None:
                raise
            failed[n] = e


def _apply_one(logits, rules, first, K, L, offset, history, at) -> None:
    offsets = offset + torch.arange(K * L) % L
    rows = torch.arange(first, first + K * L) if at is None else at[first: first + K * L]
    kept = rows >= 0
    if not bool(kept.any()):  # host data
        return
    rows, offsets = rows[kept], offsets[kept]
    a = int(rows[0])  # a request's kept rows are contiguous, in order
    rules.apply(logits[a: a + rows.numel()], offsets, history() if rules.penalized else None)
