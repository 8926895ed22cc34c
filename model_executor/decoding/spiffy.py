"""Spiffy: lossless speculative decoding for dLLMs with calibrated draft graphs.

Spiffy §4 (docs/paper-notes-spiffy-freedave.md):

- Draft formulas (§4.4.2, Eqs. 8-11): a formula is a set of (i, j) pairs: "the j-th most likely token at
  the i-th most confident masked position" of the prediction ``q`` of the state ``Y_q`` that produced the
  current state (both ranks 1-based, ranks over masked positions only, ties by position). A formula of
  level k speculates the state k base-policy steps after the current one.
- Draft graph (§4.4.1, Eqs. 4-7): formulas are nodes; an edge p -> c when c extends p (several parents
  allowed). Calibrated offline by :func:`calibrate` (Alg. 2) and stored as a :class:`DraftGraph` file.
- Verification (Alg. 1): the current state is always forwarded with the drafts; the base policy's next
  state is committed from the state's own prediction; a draft *equal* to the committed state is accepted
  and its prediction (computed on exactly that state) commits one more step with no new forward,
  recursively. Acceptance is by content equality against every forwarded draft (not only the children of
  the last accepted one): equality is what makes a prediction reusable, so this stays lossless and lets
  the level-2 roots of Eq. 24 fire (the paper's Alg. 1 never checks them; notes V8).
- Dynamic pruning (§4.4.4, Eqs. 12-14): every instantiated draft gets
  score = GM(localScore, childScore), localScore = geometric mean of its tokens' probabilities p_ij under
  ``q``, childScore = GM of its (instantiated) children's localScores (a leaf: its localScore); the top D*
  are forwarded, taken in score order but skipping drafts that cannot be reached: a draft that adds more
  positions than one base step can commit (static: 1) can only be reused after a shallower draft on its
  chain was accepted, so it enters only if one of its parents is already in (Eq. 24's connectivity,
  applied to pruning). A choice: §4.4.4 says "top-D*" only; without it the first Pareto run's d=3 graph
  (9 nodes, static base) often forwarded deep drafts without their parents (TPF 0.96 instead of 1.41).
  For the confidence base any draft may be the very next state, so nothing is skipped.

Choices the paper leaves open, made here: a draft must extend the current state (agree on every decoded
position, decode more); drafts that fill the whole block are kept for acceptance but need no forward;
invalid instantiations (rank beyond the masked count, two pairs on one position) are dropped; the first
forward of a block carries no drafts; greedy only.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import msgspec
import torch

from ..typed_files import read_typed
from .base import BlockDecoder, Prediction, predict

GRAPH_FORMAT_VERSION = 1


class GraphNode(msgspec.Struct, forbid_unknown_fields=True):
    formula: list[tuple[int, int]]  # (position rank i, vocabulary rank j), 1-based
    level: int
    parents: list[int]  # indices into DraftGraph.nodes
    count: int = 0  # calibration frequency


class DraftGraph(msgspec.Struct, forbid_unknown_fields=True):
    """A calibrated Spiffy draft graph, as stored on disk (JSON)."""

    format_version: int
    model: str  # the checkpoint it was calibrated on (directory name)
    block_size: int
    base_policy: str  # static | confidence
    threshold: float
    lookahead: int
    nodes: list[GraphNode]

    def validate(self, where: str = "draft graph") -> "DraftGraph":
        if self.format_version != GRAPH_FORMAT_VERSION:
            raise ValueError(f"{where}: format_version {self.format_version}; this psd-plugin reads "
                             f"{GRAPH_FORMAT_VERSION}")
        if self.base_policy not in ("static", "confidence"):
            raise ValueError(f"{where}: base_policy {self.base_policy!r}; allowed: static, confidence")
        for k, n in enumerate(self.nodes):
            if not n.formula or any(i < 1 or j < 1 for i, j in n.formula):
                raise ValueError(f"{where}: node {k} has an empty formula or a rank below 1")
            if any(p < 0 or p >= len(self.nodes) or p == k for p in n.parents):
                raise ValueError(f"{where}: node {k} has a parent index out of range")
        return self

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for k, n in enumerate(self.nodes):
            for p in n.parents:
                out[p].append(k)
        return out


def load_graph(path: str | Path) -> DraftGraph:
    """Read and validate a graph file; a missing or corrupt file is a one-line error naming the path."""
    return read_typed(path, DraftGraph, "draft graph").validate(f"draft graph {path}")


def save_graph(graph: DraftGraph, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(graph), indent=1))


# ------------------------------------------------------------------------------------- formulas
def ranks(pred: Prediction, max_j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eqs. 8-9: masked positions by confidence (descending, stable) and their top-``max_j`` tokens/probs."""
    masked = torch.isfinite(pred.conf)
    order = torch.sort(pred.conf, descending=True, stable=True).indices[: int(masked.sum())]
    if pred.top_ids is not None and pred.top_ids.shape[-1] >= max_j:
        return order, pred.top_ids[order, :max_j], pred.top_probs[order, :max_j]
    top = pred.probs[order].topk(max_j, dim=-1)
    return order, top.indices, top.values


def instantiate(state_q: torch.Tensor, formula, order, top_tok, top_p) -> tuple[torch.Tensor, float] | None:
    """The draft of ``formula`` on ``state_q`` and its localScore (Eq. 12), or None if it does not apply."""
    if any(i > order.numel() or j > top_tok.shape[1] for i, j in formula):
        return None
    pos = [int(order[i - 1]) for i, _ in formula]
    if len(set(pos)) != len(pos):
        return None
    draft = state_q.clone()
    logp = 0.0
    for (i, j), p in zip(formula, pos):
        draft[p] = top_tok[i - 1, j - 1]
        logp += math.log(max(float(top_p[i - 1, j - 1]), 1e-300))
    return draft, math.exp(logp / len(formula))


def _extends(draft: torch.Tensor, state: torch.Tensor, mask_id: int) -> bool:
    known = state != mask_id
    return bool((draft[known] == state[known]).all()) and int((draft != mask_id).sum()) > int(known.sum())


class SpiffyDecoder(BlockDecoder):
    def __init__(self, block, mask_id, next_state: Callable[[torch.Tensor, Prediction], torch.Tensor],
                 graph: DraftGraph, budget: int = 3, max_commit: int | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None, sample_filter: tuple[int, float, float] = (0, 1.0, 0.0)):
        super().__init__(block, mask_id)
        # sampling (Alg. 1 is lossless under it, appendix A.1): each Next draws from the request's generator in
        # the order the base policy would, the state's prediction first and an accepted draft's only when it is
        # accepted, so the decoded tokens are the base policy's sample for the same seed, token for token
        self.sampling = dict(temperature=temperature, generator=generator, sample_filter=sample_filter)
        self.next_state, self.graph, self.budget = next_state, graph, budget
        self.max_commit = max_commit  # most positions one base step commits (static: 1; None: unbounded)
        self.kids = graph.children()
        self.topk = max(j for n in graph.nodes for _, j in n.formula)  # the deepest token rank a formula reads
        self.q: tuple[torch.Tensor, Prediction] | None = None  # (Y_q, q): the last commit's state and prediction
        self.drafts: list[torch.Tensor] = []
        self.accepted = self.iterations = 0
        self.node_tried = [0] * len(graph.nodes)
        self.node_accepted = [0] * len(graph.nodes)
        self.draft_nodes: list[int] = []

    def _draft_candidates(self) -> list[tuple[int, torch.Tensor, float]]:
        y_q, q = self.q
        order, top_tok, top_p = ranks(q, self.topk)
        inst: dict[int, tuple[torch.Tensor, float]] = {}
        for k, node in enumerate(self.graph.nodes):
            got = instantiate(y_q, node.formula, order, top_tok, top_p)
            # a draft must extend the state and keep a mask: a complete next state ends the block anyway
            if got is not None and _extends(got[0], self.state, self.mask_id) and (got[0] == self.mask_id).any():
                inst[k] = got
        scored = []
        seen: list[torch.Tensor] = []
        for k, (draft, local) in inst.items():
            if any(torch.equal(draft, s) for s in seen):
                continue
            seen.append(draft)
            child = [inst[c][1] for c in self.kids[k] if c in inst]
            child_score = math.exp(sum(map(math.log, child)) / len(child)) if child else local  # Eq. 13
            scored.append((math.sqrt(local * child_score), k, draft))  # Eq. 14
        scored.sort(key=lambda t: (-t[0], t[1]))
        chosen: list[tuple[int, torch.Tensor, float]] = []
        admitted: set[int] = set()
        for s, k, d in scored:  # top-D* by score, keeping the pruned graph connected (see the docstring)
            if len(chosen) == self.budget:
                break
            node = self.graph.nodes[k]
            added = int((d != self.mask_id).sum()) - int((self.state != self.mask_id).sum())
            direct = self.max_commit is None or added <= self.max_commit
            if direct or admitted.intersection(node.parents):
                chosen.append((k, d, s))
                admitted.add(k)
        return chosen

    def propose(self):
        self.drafts, self.draft_nodes = [], []
        if self.q is not None:
            for k, d, _ in self._draft_candidates():
                self.draft_nodes.append(k)
                self.drafts.append(d)
                self.node_tried[k] += 1
        return [self.state] + self.drafts

    def update(self, logits):
        rows = list(logits)
        pred = predict(rows[0], self.state, self.mask_id, topk=self.topk, **self.sampling)
        pending = set(range(len(self.drafts)))
        while True:  # Alg. 1: commit from the state's exact prediction, then reuse an equal draft's
            new = self.next_state(self.state, pred)
            self.q = (self.state, pred)
            self.state = new
            if self.done:
                break
            hit = next((n for n in pending if torch.equal(self.drafts[n], new)), None)
            if hit is None:
                break
            pending.discard(hit)
            self.accepted += 1
            self.node_accepted[self.draft_nodes[hit]] += 1
            pred = predict(rows[1 + hit], self.drafts[hit], self.mask_id, topk=self.topk, **self.sampling)
        self.iterations += 1

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations,
                "node_tried": self.node_tried, "node_accepted": self.node_accepted}


# ---------------------------------------------------------------------------------- calibration
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
