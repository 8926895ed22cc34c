"""Spatial policies: which masked positions of the current block one forward commits.

Engine-agnostic functions over one request's per-position confidences. ``conf`` holds the confidence of
the predicted token at every position of the current block and ``-inf`` where the position is already
decoded, so ``isfinite(conf)`` is the set of masked positions. Each returns a boolean mask of the
positions to commit; it is never empty while a masked position remains (the top-1 always commits), so
every forward makes progress.
"""

from __future__ import annotations

import torch


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


POLICIES = {"static": static_policy, "confidence": confidence_policy}
