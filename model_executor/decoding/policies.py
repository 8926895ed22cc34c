"""Spatial policies: which masked positions of the current block one prediction commits.

Engine-agnostic functions over blocks' confidences, ``conf [..., L]`` (one block, or a batch of blocks one
per row): the confidence of the predicted token at every position and ``-inf`` where the position is
already decoded (or past a shorter block's end), so ``isfinite(conf)`` is the set of masked positions. Each
returns a boolean mask of the positions to commit; it is never empty while a row has a masked position (the
top-1 always commits), so every forward makes progress.

:class:`PolicyDecoder` runs a policy alone: one forward, one commit, repeat; the decoders of a step update
together (:meth:`PolicyDecoder.update_batch`): a handful of array ops for all requests of a policy.

Where the rule runs is where the confidences are: the policies take and return tensors; on host data (the
decoders' state and a step's predictions, as the engines hold them now) they compute in numpy
(:func:`~.base.host_array`: a few microseconds an op where a small torch op costs tens); on a device tensor
they are tensor ops there (:func:`device_policy`), with no host read and every shape fixed by the input's, so
they can run inside a captured step and a step's decisions need not travel to the host before the next step's
ids are written. Both forms decide bit for bit alike: the comparisons are in the confidences' dtype (a Python
threshold cast to it as NumPy 2 casts it; bfloat16 is compared in float32 in both), ties go to the first
position, and :func:`commit_rows` is :meth:`PolicyDecoder.update_batch`'s commit in that form
(``tests/test_decoding.py``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import numpy as np
import torch

from .base import (BlockDecoder, DeviceRowPredictions, Proposal, canvas_predictions, canvas_row_index, finite_decisions,
                   first_max, first_max_tensor, groups, host_array, host_rows, launch_key, onehot_first_max, pad_rows,
                   predict_each)

Policy = Callable[[torch.Tensor], torch.Tensor]


def _on_host(conf: torch.Tensor) -> bool:
    return conf.device.type == "cpu"


def _top1(conf: torch.Tensor) -> torch.Tensor:
    """The most confident masked position of each row (first on ties); none in a row without one."""
    return onehot_first_max(conf)  # (numpy on host data, tensor ops where a device tensor is)


def static_policy(conf: torch.Tensor) -> torch.Tensor:
    """One token per forward: the most confident masked position (LLaDA ``generate.py``, steps = length)."""
    return _top1(conf)


def confidence_policy(conf: torch.Tensor, threshold: float = 0.9) -> torch.Tensor:
    """Fast-dLLM threshold decoding: the top-1 plus every masked position with confidence >= ``threshold``."""
    if not _on_host(conf):
        return device_policy(conf, "confidence", threshold)
    c = host_array(conf)
    return torch.from_numpy(first_max(c) | (np.isfinite(c) & (c >= threshold))).to(conf.device)


def localleap_policy(conf: torch.Tensor, threshold: float = 0.9, relaxed_threshold: float = 0.75,
                     radius: int = 4) -> torch.Tensor:
    """LocalLeap: anchors are masked positions with confidence >= ``threshold``; masked positions within
    ``radius`` (block positions, either side) of an anchor commit when their confidence >=
    ``relaxed_threshold``; the top-1 always commits. (Parameters as in the issue and the shared notes;
    the PSD paper only cites LocalLeap's defaults.)"""
    if not _on_host(conf):
        return device_policy(conf, "localleap", threshold, relaxed_threshold, radius)
    c = host_array(conf)
    masked = np.isfinite(c)
    anchors = masked & (c >= threshold)
    idx = np.arange(c.shape[-1])
    window = np.abs(idx[:, None] - idx[None, :]) <= radius  # [L, L]
    near = (window & anchors[..., None, :]).any(-1)
    out = first_max(c) | anchors | (near & masked & (c >= relaxed_threshold))
    return torch.from_numpy(out).to(conf.device)


SPATIAL_POLICIES = ("static", "confidence", "localleap")


_NUMPY_FLOAT = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def device_policy(conf: torch.Tensor, name: str, threshold: float = 0.9, relaxed_threshold: float = 0.75,
                  radius: int = 4) -> torch.Tensor:
    """The policy ``name`` over confidences ``conf [..., L]`` as tensor ops where they are: the numpy rules above,
    decision for decision, with no host read and no shape that depends on the data (module docstring). The
    policies call it for a tensor that is not on the host; it runs on host tensors too (the tests compare it
    with the numpy form there)."""
    c = conf.float() if conf.dtype == torch.bfloat16 else conf  # as host_array: numpy has no bfloat16
    out = first_max_tensor(c)
    if name == "static":
        return out
    # a Python threshold as numpy casts it to the confidences' dtype (straight to float16, where PyTorch would
    # round through float32): then both compare the same two values
    threshold, relaxed_threshold = (float(np.asarray(t, dtype=_NUMPY_FLOAT.get(c.dtype, np.float64)))
                                    for t in (threshold, relaxed_threshold))
    masked = torch.isfinite(c)
    anchors = masked & (c >= threshold)
    if name == "confidence":
        return out | anchors
    if name != "localleap":
        raise ValueError(f"policy {name!r}; allowed: {', '.join(SPATIAL_POLICIES)}")
    L = c.shape[-1]
    r = min(math.floor(radius), L)  # (integer distances: a radius of the row's length or more reaches every one)
    if r < 0 or L == 0:
        near = torch.zeros_like(masked)
    else:  # a position within ``radius`` of an anchor: the anchors' running max over the window (one pass)
        a = anchors.reshape(-1, 1, L).to(torch.float32)
        near = torch.nn.functional.max_pool1d(a, 2 * r + 1, stride=1, padding=r).reshape(c.shape) > 0
    return out | anchors | (near & masked & (c >= relaxed_threshold))


def commit_rows(policy: "Policy", tokens: torch.Tensor, conf: torch.Tensor, rows: torch.Tensor,
                states: torch.Tensor, mask_id: int) -> torch.Tensor:
    """One policy step of a batch of blocks as tensor ops where the predictions are: ``tokens``/``conf [N]`` a
    step's prediction rows, ``rows [R, L]`` the row of each block position (-1: none, past a shorter block),
    ``states [R, L]`` the blocks (-1 past a shorter one); returns the next states ``[R, L]``. The commit of
    :meth:`PolicyDecoder.update_batch`, decision for decision, without a host read: a step's decisions can stay
    on the device with the logits, and the host learn them by one copy of the states (or their changes)."""
    at = rows.clamp(min=0)
    tok, c = tokens[at], conf[at]
    c = torch.where((states != mask_id) | (rows < 0), torch.full_like(c, float("-inf")), c)
    commit = policy(c) & (states == mask_id)
    return torch.where(commit, tok, states)


def policy_key(policy: Policy) -> tuple:
    """What makes two bound policies the same rule (their function and knobs): decoders of one rule
    commit together."""
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
    """A spatial policy alone: each forward predicts the block and the policy commits positions (greedy, or
    sampled: the engines draw the step's rows, :mod:`.sampling`; the policy reads them alike).

    ``record``: a list that receives ``(state, prediction with full probabilities, next state)`` per step
    (calibration, :mod:`psd_plugin.calibrate`; greedy)."""

    def __init__(self, block, mask_id, policy: Policy, record: list | None = None):
        super().__init__(block, mask_id)
        self.policy = policy
        self.record = record

    @classmethod
    def propose_batch(cls, decoders):
        return [Proposal([d.state]) for d in decoders]

    @property
    def reads_all_rows(self) -> bool:
        return self.record is not None

    @property
    def device_update(self) -> bool:  # :meth:`_update_on_device`; a recording decoder reads full distributions
        return self.record is None

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """Every decoder's step at once, a policy at a time: states ``[R, L]`` (padded with -1, never the mask),
        the predictions of each state (its only canvas), the policy over all rows, one commit. A decoder that
        records predicts its own block with full distributions, decoders in order."""
        for idx in groups(decoders, lambda d: (policy_key(d.policy), d.reads_all_rows)):
            group = [decoders[i] for i in idx]
            if group[0].reads_all_rows:  # calibration: the full distributions
                S = pad_rows([d.state for d in group], -1)
                mine = predict_each([(preds[a: a + d.state.numel()], d.state, dict(keep_probs=True, grammar=d.grammar))
                                     for d, a in ((d, canvas_rows[i][0]) for d, i in zip(group, idx))],
                                    group[0].mask_id)
                T = pad_rows([p.tokens.to(S.device) for p in mine], -1)
                C = pad_rows([p.conf.to(S.device) for p in mine], float("-inf"))
                new = torch.where(group[0].policy(C) & (S == group[0].mask_id), T, S)
                for r, (d, row) in enumerate(zip(group, new)):
                    row = row[: d.state.numel()]
                    d.record.append((d.state, mine[r], row))
                    d.state = row
                    d.t += 1
                continue
            if isinstance(preds, DeviceRowPredictions):  # the predictions are where the logits are: decide there
                cls._update_on_device(group, [canvas_rows[i] for i in idx], preds)
                continue
            # host arrays (the states and the step's predictions are on the host), in numpy
            mask = group[0].mask_id
            S = host_rows([(d.state,) for d in group])[0]
            rows = canvas_row_index(group, [canvas_rows[i] for i in idx], 1).numpy()[:, 0]
            T, C = canvas_predictions(preds, rows, S, mask)
            commit = group[0].policy(torch.from_numpy(C)).numpy() & (S == mask)
            new = torch.from_numpy(np.where(commit, T, S))
            for r, d in enumerate(group):
                d.state = new[r, : d.state.numel()]
                d.t += 1

    @classmethod
    def launch_batch(cls, decoders, proposals, preds, canvas_rows):
        """:meth:`update_batch`'s decisions ahead (:func:`~.base.launch_all`), group by group as it makes them."""
        out = [None] * len(decoders)
        for idx in groups(decoders, lambda d: (policy_key(d.policy), d.reads_all_rows)):
            group = [decoders[i] for i in idx]
            rows = [canvas_rows[i] for i in idx]
            # (each group's upload a buffer of its own: none is waited for before the next group's)
            new, at = cls._commit_on_device(group, rows, preds, f"policies-ahead/{len(preds.launched)}")
            preds.launched[launch_key(group, rows)] = preds.read_back_later([new], at)
            for r, i in enumerate(idx):
                out[i] = new[r: r + 1, : decoders[i].state.numel()]  # (the next step's one canvas)
        return out

    @staticmethod
    def _commit_on_device(group: list["PolicyDecoder"], canvas_rows: list[list[int]], preds: DeviceRowPredictions,
                          key: str = "policies") -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`commit_rows` of one policy's decoders where the predictions are: their states and the logits row
        of every block position go up in one copy (the engine's staging buffer ``key``); returns the next states
        ``[R, L]`` and those rows there."""
        mask = group[0].mask_id
        S = host_rows([(d.state,) for d in group])[0]
        rows = preds.logits_rows(canvas_row_index(group, canvas_rows, 1).numpy()[:, 0])
        states, at = preds.upload(key, [S, rows])
        return commit_rows(group[0].policy, preds.tokens, preds.conf, at, states, mask), at

    @classmethod
    def _update_on_device(cls, group: list["PolicyDecoder"], canvas_rows: list[list[int]],
                          preds: DeviceRowPredictions) -> None:
        """One policy's decoders stepped where the predictions are (:meth:`_commit_on_device`): the next states
        and each block's count of non-finite predictions come back in one copy (the one :meth:`launch_batch`
        queued, where it did). A block with a non-finite prediction (NaN or inf in the model's output) raises, and
        no decoder of the group is stepped (the engines then step each alone:
        :func:`~model_executor.dllm_request.decode_step`)."""
        pending = (preds.launched or {}).pop(launch_key(group, canvas_rows), None)
        if pending is not None:
            out = finite_decisions(pending.wait()).long()
        else:
            new, at = cls._commit_on_device(group, canvas_rows, preds)
            out = preds.read_back([new], at).long()
        for r, d in enumerate(group):
            d.state = out[r, : d.state.numel()]
            d.t += 1
