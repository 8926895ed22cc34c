"""Spatial policies: which masked positions of the current block one prediction commits.

Engine-agnostic functions over one block's confidences. ``conf`` holds the confidence of the predicted
token at every position of the block and ``-inf`` where the position is already decoded, so
``isfinite(conf)`` is the set of masked positions. Each returns a boolean mask of the positions to
commit; it is never empty while a masked position remains (the top-1 always commits), so every forward
makes progress.

:class:`PolicyDecoder` runs a policy alone: one forward, one commit, repeat.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from .base import BlockDecoder, commit, predict

Policy = Callable[[torch.Tensor], torch.Tensor]


def _top1(conf: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(conf, dtype=torch.bool)
    if torch.isfinite(conf).any():
        out[conf.argmax()] = True
    return out


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
    idx = torch.arange(conf.numel(), device=conf.device)
    near = ((idx[:, None] - idx[None, :]).abs() <= radius) & anchors[None, :]
    return _top1(conf) | anchors | (near.any(-1) & masked & (conf >= relaxed_threshold))


SPATIAL_POLICIES = ("static", "confidence", "localleap")


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
                 generator: torch.Generator | None = None):
        super().__init__(block, mask_id)
        self.policy, self.temperature, self.generator = policy, temperature, generator

    def canvases(self):
        return [self.state]

    def update(self, logits):
        pred = predict(logits[0], self.state, self.mask_id, temperature=self.temperature, generator=self.generator)
        self.state = commit(self.state, pred, self.policy(pred.conf) & self.masked)
