"""What an engine returns per request (every engine of the project, reference and vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids up to and including the first EOS
    nfe: int
    seconds: float = 0.0
    finish_reason: str = "length"  # "stop" when an EOS ended the answer
    stats: dict = field(default_factory=dict)  # method-specific counters (accepted drafts ...)
    # with logprobs=k: per token, {token: logprob, and the k most likely: their logprobs} under the state
    # canvas's distribution of the forward that committed it (the model's, before the request's rules)
    logprobs: list[dict[int, float]] | None = None

    @property
    def tpf(self) -> float:
        return len(self.token_ids) / max(1, self.nfe)
