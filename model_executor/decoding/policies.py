"""Spatial policies: which masked positions of the current block one prediction commits.

Engine-agnostic functions over blocks' confidences, ``conf [..., L]`` (one block, or a batch of blocks one
per row): the confidence of the predicted token at every position and ``-inf`` where the position is
already decoded (or past a shorter block's end), so ``isfinite(conf)`` is the set of masked positions. Each
returns a boolean mask of the positions to commit; it is never empty while a row has a masked position (the
top-1 always commits), so every forward makes progress.

:class:`PolicyDecoder` runs a policy alone: one forward, one commit, repeat. Greedy policy decoders of a step
update together (:meth:`PolicyDecoder.update_batch`): a handful of tensor ops for all requests.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from .base import BlockDecoder, commit, onehot_first_max, pad_rows, predict

Policy = Callable[[torch.Tensor], torch.Tensor]


def _top1(conf: torch.Tensor) -> torch.Tensor:
    """The most confident masked position of each row (first on ties); none in a row without one."""
    return onehot_first_max(conf)


def static_policy(conf: torch.Tensor) -> torch.Tensor:
    """One token per forward: the most confident masked position (LLaDA ``generate.py``, steps = length)."""
    return _top1(conf)


def confidence_policy(conf: torch.Tensor, threshold: float = 0.9) -> torch.Tensor:
    """Fast-dLLM threshold decoding: the top-1 plus every masked position with confidence >= ``threshold``."""
    return _top1(conf) | (torch.isfinite(conf) & (conf >= threshold))


def localleap_policy(conf: torch.Tensor, threshold: float = 0.9, relaxed_threshold: float = 0.75,
                     radius: int = 4) -> torch.Tensor:
    """LocalLeap: anchors are masked positions with confidence >= ``threshold``; masked positions within
    ``radius`` (block positions, either side) of an anchor commit when their confidence >=
    ``relaxed_threshold``; the top-1 always commits. (Parameters as in the issue and the shared notes;
    the PSD paper only cites LocalLeap's defaults.)"""
    masked = torch.isfinite(conf)
    anchors = masked & (conf >= threshold)
    idx = torch.arange(conf.shape[-1], device=conf.device)
    window = (idx[:, None] - idx[None, :]).abs() <= radius  # [L, L]
    near = (window & anchors[..., None, :]).any(-1)
    return _top1(conf) | anchors | (near & masked & (conf >= relaxed_threshold))


SPATIAL_POLICIES = ("static", "confidence", "localleap")


def policy_key(policy: Policy) -> tuple:
    """What makes two bound policies the same rule (their function and knobs): part of a batch key."""
    return getattr(policy, "func", policy), tuple(sorted(getattr(policy, "keywords", {}).items()))


def make_policy(name: str, threshold: float = 0.9, relaxed_threshold: float = 0.75, radius: int = 4) -> Policy:
    """The named spatial policy with its knobs bound."""
    if name == "static":
        return static_policy
    if name == "confidence":
        return partial(confidence_policy, threshold=threshold)
    if name == "localleap":
        return partial(localleap_policy, threshold=threshold, relaxed_threshold=relaxed_threshold, radius=radius)
    raise ValueError(f"policy {name!r}; allowed: {', '.join(SPATIAL_POLICIES)}")


class PolicyDecoder(BlockDecoder):
    """A spatial policy alone: each forward predicts the block and the policy commits positions."""

    def __init__(self, block, mask_id, policy: Policy, temperature: float = 0.0,
                 generator: torch.Generator | None = None, sample_filter: tuple[int, float, float] = (0, 1.0, 0.0)):
        super().__init__(block, mask_id)
        self.policy, self.temperature, self.generator = policy, temperature, generator
        self.sample_filter = sample_filter  # (top_k, top_p, min_p) when sampling

    def propose(self):
        return [self.state]

    def update(self, logits):
        pred = predict(logits[0], self.state, self.mask_id, temperature=self.temperature, generator=self.generator,
                       sample_filter=self.sample_filter)
        self.state = commit(self.state, pred, self.policy(pred.conf) & self.masked)

    def batch_key(self):
        # sampling draws from each request's own generator; a subclass may do more in update (calibration)
        if self.temperature > 0 or type(self).update is not PolicyDecoder.update:
            return None
        return policy_key(self.policy), self.mask_id

    @classmethod
    def update_batch(cls, decoders, preds, rows):
        """Every decoder's step at once: states ``[R, L]`` (padded with -1, never the mask), the predictions at
        ``rows[:, 0]`` (the state is the only canvas), the policy over all rows, one commit; each decoder keeps
        a view of its row."""
        lens = [d.state.numel() for d in decoders]
        state = pad_rows([d.state for d in decoders], -1)
        r = rows[:, 0].clamp(min=0).to(preds.tokens.device)
        masked = state == decoders[0].mask_id
        conf = preds.conf[r].masked_fill_(~masked, float("-inf"))  # the gather is a copy: fill in place
        new = torch.where(decoders[0].policy(conf) & masked, preds.tokens[r], state)
        for d, row, n in zip(decoders, new, lens):
            d.state = row[:n]
