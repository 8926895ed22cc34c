"""Spiffy Alg. 2 (§4.4.3): a draft graph calibrated from recorded trajectories of the base policy.

``psd calibrate`` (:mod:`psd_plugin.calibrate`) decodes prompts with the base policy, records every block's
steps ``(state, prediction with full probabilities, next state)`` and hands them to :func:`calibrate`; the
nodes it returns make a :class:`~.spiffy_graph.DraftGraph`.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Iterable

import torch

from .base import Prediction
from .spiffy_graph import GraphNode

def formula_of(positions: Iterable[int], tokens: torch.Tensor, order: torch.Tensor,
               full_order: torch.Tensor) -> list[tuple[int, int]]:
    """(i, j) ranks of the tokens written at ``positions`` w.r.t. a prediction's ranking (Eqs. 10-11)."""
    rank_of = {int(p): r + 1 for r, p in enumerate(order.tolist())}
    out = []
    for p in positions:
        j = int((full_order[p] == tokens[p]).nonzero()[0]) + 1
        out.append((rank_of[int(p)], j))
    return sorted(out)


def calibrate(trajectories: list[list[tuple[torch.Tensor, Prediction, torch.Tensor]]], lookahead: int,
              budget: int, top_nodes: int = 3) -> list[GraphNode]:
    """Spiffy Alg. 2 on recorded vanilla trajectories; returns the chosen ``budget`` nodes.

    Each trajectory is a list of steps ``(state, prediction of state, next state)`` of one block decoded by
    the base policy (predictions with full ``probs``). For every window start t and lookahead level
    k = 1..L, the node is the union of (i, j) pairs (ranks w.r.t. the prediction at t) of all tokens
    committed in steps t..t+k, i.e. the state k steps after the next one (Part 1); per level the
    ``top_nodes`` most frequent nodes and their most frequent level-(k-1) predecessors are kept, and
    subset edges added (Part 2); the connected subgraph of ``budget`` nodes with the highest total count is
    chosen by exhaustive search, levels 1-2 being roots (Part 3, Eqs. 24-27).
    """
    counts: list[Counter] = [Counter() for _ in range(lookahead + 1)]
    edges: list[Counter] = [Counter() for _ in range(lookahead + 1)]
    for steps in trajectories:
        for t in range(len(steps)):
            y, q, _ = steps[t]
            masked = torch.isfinite(q.conf)
            order = torch.sort(q.conf, descending=True, stable=True).indices[: int(masked.sum())]
            full_order = q.probs.argsort(dim=-1, descending=True, stable=True)
            nodes: list[tuple] = []
            union: set = set()
            for k in range(0, lookahead + 1):
                if t + k >= len(steps):
                    break
                before, _, after = steps[t + k]
                written = (before != after).nonzero()[:, 0].tolist()
                union |= set(formula_of(written, after, order, full_order))
                nodes.append(tuple(sorted(union)))
            for k in range(1, len(nodes)):
                counts[k][nodes[k]] += 1
                edges[k][(nodes[k - 1], nodes[k])] += 1
    cand: list[tuple[int, tuple, int]] = []  # (level, formula, count)
    for k in range(1, lookahead + 1):
        for f, c in counts[k].most_common(top_nodes):
            cand.append((k, f, c))
        for (p, _), _ in edges[k].most_common(top_nodes):  # frequent in-edges: keep their sources too
            if k - 1 >= 1 and all(f != p for _, f, _ in cand):
                cand.append((k - 1, p, counts[k - 1][p]))
    index = {f: n for n, (_, f, _) in enumerate(cand)}
    parents = [[index[g] for _, g, _ in cand if set(g) < set(f)] for _, f, _ in cand]  # subset edges
    budget = min(budget, len(cand))
    root = [cand[n][0] <= 2 for n in range(len(cand))]
    best, best_total = None, -1
    if math.comb(len(cand), budget) <= 200_000:  # Eqs. 24-27 by exhaustive search
        for combo in itertools.combinations(range(len(cand)), budget):
            chosen = set(combo)
            if all(root[n] or any(p in chosen for p in parents[n]) for n in combo):
                total = sum(cand[n][2] for n in combo)
                if total > best_total:
                    best, best_total = combo, total
    else:  # too many subsets: grow greedily by count, keeping the subgraph connected
        chosen: list[int] = []
        while len(chosen) < budget:
            ok = [n for n in range(len(cand)) if n not in chosen and (root[n] or any(p in chosen for p in parents[n]))]
            if not ok:
                break
            chosen.append(max(ok, key=lambda n: (cand[n][2], -n)))
        best = tuple(sorted(chosen)) or None
    if best is None:
        return []
    remap = {n: m for m, n in enumerate(best)}
    return [GraphNode(formula=[tuple(x) for x in cand[n][1]], level=cand[n][0],
                      parents=[remap[p] for p in parents[n] if p in remap], count=cand[n][2]) for n in best]
