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
from .sampling import SAMPLE_CONFIDENCE, Sampling
from .spiffy import BaseStep, SpiffyDecoder
from .spiffy_calibration import calibrate, formula_of
from .spiffy_graph import GRAPH_FORMAT_VERSION, DraftGraph, GraphNode, load_graph, save_graph

METHODS = ("static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd", "joint_threshold")


def base_step(policy: str, threshold: float = 0.9):
    """The base policy as a state transition ``Next(state, prediction)`` (Spiffy's lossless reference)."""
    if policy not in ("static", "confidence"):
        raise ValueError(f"spiffy base policy {policy!r}; allowed: static, confidence")
    return BaseStep(make_policy(policy, threshold=threshold))


def make_decoder(method: str, block: torch.Tensor, mask_id: int, *, threshold: float = 0.9,
                 relaxed_threshold: float = 0.75, radius: int = 4, policy: str = "confidence", depth: int = 3,
                 branches: int = 3, steps: int = 4, dag: DraftDAG | None = None, dag_shape: str = "chain",
                 graph: DraftGraph | None = None, budget: int = 3, sampling: Sampling | None = None,
                 edit_threshold: float = 0.9, max_post_edit_steps: int = 16) -> BlockDecoder:
    """The decoder for ``method`` over one block (``block`` holds the mask id where undecoded). ``sampling``: the
    request's :class:`~.sampling.Sampling` (None: greedy); every method decodes under it, the engines drawing the
    step's predictions (:mod:`.sampling`)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}; allowed: {', '.join(METHODS)}")
    knobs = dict(threshold=threshold, relaxed_threshold=relaxed_threshold, radius=radius)
    if method in SPATIAL_POLICIES:
        dec: BlockDecoder = PolicyDecoder(block, mask_id, make_policy(method, **knobs))
    elif method == "freedave":
        dec = FreeDaveDecoder(block, mask_id, steps=steps)
    elif method == "joint_threshold":
        dec = JointThresholdDecoder(block, mask_id, threshold=threshold, edit_threshold=edit_threshold,
                                    max_post_edit_steps=max_post_edit_steps)
    elif method == "spiffy":
        if graph is None:
            raise ValueError("method 'spiffy' needs a draft graph (config field 'graph': a path from psd calibrate)")
        dec = SpiffyDecoder(block, mask_id, base_step(policy, threshold), graph, budget=budget,
                            max_commit=1 if policy == "static" else None)
    elif method == "lopa":
        dec = LoPADecoder(block, mask_id, make_policy(policy, **knobs), branches=branches)
    else:
        dec = PSDDecoder(block, mask_id, make_policy(policy, **knobs), dag or DraftDAG.shaped(dag_shape, depth))
    dec.sampling = sampling
    return dec


__all__ = ["GRAPH_FORMAT_VERSION", "METHODS", "SAMPLE_CONFIDENCE", "Sampling", "BlockDecoder", "DraftDAG", "DraftGraph", "GraphNode", "JointThresholdDecoder",
           "LogitsRules", "PolicyDecoder", "Proposal", "RowPredictions", "apply_rules", "base_step", "calibrate", "formula_of",
           "load_graph", "logits_map", "make_decoder", "merge_stats", "predict_rows", "propose_all", "save_graph",
           "update_all"]
