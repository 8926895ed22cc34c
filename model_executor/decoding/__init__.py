"""Decoding algorithms for dLLMs, engine-agnostic (tensors in, tensors out; no engine imports).

``make_decoder(method, block, mask_id, **knobs)`` builds the :class:`~.base.BlockDecoder` of one block.
"""

from __future__ import annotations

import torch

from .base import BlockDecoder, merge_stats
from .freedave import FreeDaveDecoder
from .lopa import LoPADecoder
from .policies import SPATIAL_POLICIES, PolicyDecoder, make_policy
from .psd import DraftDAG, PSDDecoder

METHODS = ("static", "confidence", "localleap", "lopa", "freedave", "psd")
GREEDY_ONLY = ("lopa", "freedave", "psd")


def make_decoder(method: str, block: torch.Tensor, mask_id: int, *, threshold: float = 0.9,
                 relaxed_threshold: float = 0.75, radius: int = 4, policy: str = "confidence", depth: int = 3,
                 branches: int = 3, steps: int = 4, dag: DraftDAG | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> BlockDecoder:
    """The decoder for ``method`` over one block (``block`` holds the mask id where undecoded)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}; allowed: {', '.join(METHODS)}")
    if temperature > 0 and method in GREEDY_ONLY:
        raise ValueError(f"method {method!r} decodes greedily; temperature must be 0 (got {temperature})")
    knobs = dict(threshold=threshold, relaxed_threshold=relaxed_threshold, radius=radius)
    if method in SPATIAL_POLICIES:
        return PolicyDecoder(block, mask_id, make_policy(method, **knobs), temperature, generator)
    if method == "freedave":
        return FreeDaveDecoder(block, mask_id, steps=steps)
    if method == "lopa":
        return LoPADecoder(block, mask_id, make_policy(policy, **knobs), branches=branches)
    return PSDDecoder(block, mask_id, make_policy(policy, **knobs), dag or DraftDAG.nested(depth))


__all__ = ["METHODS", "BlockDecoder", "DraftDAG", "make_decoder", "merge_stats"]
