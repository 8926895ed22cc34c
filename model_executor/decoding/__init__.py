"""Decoding algorithms for dLLMs, engine-agnostic (tensors in, tensors out; no engine imports).

``make_decoder(method, block, mask_id, **knobs)`` builds the :class:`~.base.BlockDecoder` of one block.
"""

from __future__ import annotations

import torch

from .base import (BlockDecoder, Proposal, RowPredictions, logits_map, merge_stats, predict_rows, propose_all,
                   update_all)
from .logits_rules import LogitsRules, apply_rules
from .freedave import FreeDaveDecoder
from .joint_threshold import JointThresholdDecoder
from .lopa import LoPADecoder
from .policies import SPATIAL_POLICIES, PolicyDecoder, make_policy
from .psd import DraftDAG, PSDDecoder
from .spiffy import BaseStep, SpiffyDecoder
from .spiffy_calibration import calibrate, formula_of
from .spiffy_graph import GRAPH_FORMAT_VERSION, DraftGraph, GraphNode, load_graph, save_graph

METHODS = ("static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd", "joint_threshold")
GREEDY_ONLY = ("lopa", "freedave", "psd", "joint_threshold")  # acceptance / edits compare argmax tokens


def base_step(policy: str, threshold: float = 0.9):
    """The base policy as a state transition ``Next(state, prediction)`` (Spiffy's lossless reference)."""
    if policy not in ("static", "confidence"):
        raise ValueError(f"spiffy base policy {policy!r}; allowed: static, confidence")
    return BaseStep(make_policy(policy, threshold=threshold))


def make_decoder(method: str, block: torch.Tensor, mask_id: int, *, threshold: float = 0.9,
                 relaxed_threshold: float = 0.75, radius: int = 4, policy: str = "confidence", depth: int = 3,
                 branches: int = 3, steps: int = 4, dag: DraftDAG | None = None, dag_shape: str = "chain",
                 graph: DraftGraph | None = None,
                 budget: int = 3, temperature: float = 0.0, generator: torch.Generator | None = None,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, edit_threshold: float = 0.9,
                 max_post_edit_steps: int = 16) -> BlockDecoder:
    """The decoder for ``method`` over one block (``block`` holds the mask id where undecoded).
    ``temperature`` > 0 samples (the spatial policies); ``top_k``/``top_p``/``min_p`` restrict that sampling."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}; allowed: {', '.join(METHODS)}")
    if temperature > 0 and method in GREEDY_ONLY:
        raise ValueError(f"method {method!r} decodes greedily; temperature must be 0 (got {temperature})")
    knobs = dict(threshold=threshold, relaxed_threshold=relaxed_threshold, radius=radius)
    if method in SPATIAL_POLICIES:
        return PolicyDecoder(block, mask_id, make_policy(method, **knobs), temperature, generator,
                             sample_filter=(top_k if top_k > 0 else 0, top_p, min_p))
    if method == "freedave":
        return FreeDaveDecoder(block, mask_id, steps=steps)
    if method == "joint_threshold":
        return JointThresholdDecoder(block, mask_id, threshold=threshold, edit_threshold=edit_threshold,
                                     max_post_edit_steps=max_post_edit_steps)
    if method == "spiffy":
        if graph is None:
            raise ValueError("method 'spiffy' needs a draft graph (config field 'graph': a path from psd calibrate)")
        return SpiffyDecoder(block, mask_id, base_step(policy, threshold), graph, budget=budget,
                             max_commit=1 if policy == "static" else None, temperature=temperature,
                             generator=generator, sample_filter=(top_k if top_k > 0 else 0, top_p, min_p))
    if method == "lopa":
        return LoPADecoder(block, mask_id, make_policy(policy, **knobs), branches=branches)
    return PSDDecoder(block, mask_id, make_policy(policy, **knobs), dag or DraftDAG.shaped(dag_shape, depth))


__all__ = ["GRAPH_FORMAT_VERSION", "METHODS", "BlockDecoder", "DraftDAG", "DraftGraph", "GraphNode", "JointThresholdDecoder",
           "LogitsRules", "PolicyDecoder", "Proposal", "RowPredictions", "apply_rules", "base_step", "calibrate", "formula_of",
           "load_graph", "logits_map", "make_decoder", "merge_stats", "predict_rows", "propose_all", "save_graph",
           "update_all"]
