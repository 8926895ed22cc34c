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

The engines step the greedy Spiffy decoders of one graph and knob set together
(:meth:`SpiffyDecoder.propose_batch`, :meth:`SpiffyDecoder.update_batch`): formulas instantiated for all
requests by gathers, scores and the connected top-D* a graph node at a time, Alg. 1 one accepted draft at a
time for all requests. Only the ``max_i`` most confident positions of the last commit's prediction get their
top tokens (:func:`~.base.top_tokens`: no formula reads further), not every row of the step. The logarithms
and exponentials of the scores are Python's, so both ways rank the drafts identically, bit for bit.

Choices the paper leaves open, made here: a draft must extend the current state (agree on every decoded
position, decode more); drafts that fill the whole block are kept for acceptance but need no forward;
invalid instantiations (rank beyond the masked count, two pairs on one position) are dropped; the first
forward of a block carries no drafts; greedy only.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import msgspec
import torch

from ..typed_files import read_typed
from .base import BlockDecoder, Prediction, canvas_predictions, commit, pad_rows, predict, top_tokens
from .policies import policy_key

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
@dataclass
class Ranked:
    """What the drafts of the next step are built from: the state ``Y_q`` of the last commit and, from its
    prediction ``q``, the masked positions by confidence and the likeliest tokens at the first few of them."""

    state: torch.Tensor  # [L] Y_q
    order: torch.Tensor  # [n] masked positions of Y_q, most confident first (ties: lower position)
    top_tok: torch.Tensor  # [min(n, max_i), max_j] token of rank j at the position of rank i
    logp: torch.Tensor  # [min(n, max_i), max_j] float64: log of its probability (floored at 1e-300)


def _log(p: float) -> float:
    return math.log(max(p, 1e-300))


def _elementwise(fn: Callable[[float], float], t: torch.Tensor) -> torch.Tensor:
    """``fn`` (Python's libm) on every element of a float64 tensor: the same result for the same input wherever
    it sits in a batch, so the batched step ranks drafts exactly as the one-block step does."""
    return torch.tensor([fn(x) for x in t.flatten().tolist()], dtype=torch.float64).view(t.shape)


def ranks(state_q: torch.Tensor, pred: Prediction, max_i: int, max_j: int) -> Ranked:
    """Eqs. 8-9 for ``pred`` (the prediction of ``state_q``): the masked positions by confidence, and the
    top-``max_j`` tokens with their probabilities at the ``max_i`` most confident (no formula reads further)."""
    masked = torch.isfinite(pred.conf)
    order = torch.sort(pred.conf, descending=True, stable=True).indices[: int(masked.sum())]
    at = order[:max_i]
    if pred.top_ids is not None:  # a sampled prediction ranks its own distribution
        top_tok, top_p = pred.top_ids[at, :max_j].cpu(), pred.top_probs[at, :max_j].double().cpu()
    else:
        top_tok, top_p = top_tokens(pred.logits, at, pred.tokens[at], pred.conf[at], max_j)
    return Ranked(state_q, order.cpu(), top_tok, _elementwise(_log, top_p))


def instantiate(formula, q: Ranked) -> tuple[torch.Tensor, float] | None:
    """The draft of ``formula`` on ``Y_q`` and its localScore (Eq. 12), or None if it does not apply."""
    if any(i > q.order.numel() for i, _ in formula):
        return None
    pos = [int(q.order[i - 1]) for i, _ in formula]
    if len(set(pos)) != len(pos):
        return None
    draft = q.state.clone()
    logp = 0.0
    for (i, j), p in zip(formula, pos):
        draft[p] = q.top_tok[i - 1, j - 1]
        logp += float(q.logp[i - 1, j - 1])
    return draft, math.exp(logp / len(formula))


def _extends(draft: torch.Tensor, state: torch.Tensor, mask_id: int) -> bool:
    known = state != mask_id
    return bool((draft[known] == state[known]).all()) and int((draft != mask_id).sum()) > int(known.sum())


class BaseStep:
    """A base policy as a state transition ``Next(state, prediction)``: Spiffy's lossless reference. ``rule``
    is the spatial policy (:mod:`.policies`), which the batched step applies to all requests at once."""

    def __init__(self, rule: Callable[[torch.Tensor], torch.Tensor]):
        self.rule = rule

    def __call__(self, state: torch.Tensor, pred: Prediction) -> torch.Tensor:
        return commit(state, pred, self.rule(pred.conf) & torch.isfinite(pred.conf))


class SpiffyDecoder(BlockDecoder):
    def __init__(self, block, mask_id, next_state: BaseStep, graph: DraftGraph, budget: int = 3,
                 max_commit: int | None = None, temperature: float = 0.0, generator: torch.Generator | None = None,
                 sample_filter: tuple[int, float, float] = (0, 1.0, 0.0)):
        super().__init__(block, mask_id)
        # sampling (Alg. 1 is lossless under it, appendix A.1): each Next draws from the request's generator in
        # the order the base policy would, the state's prediction first and an accepted draft's only when it is
        # accepted, so the decoded tokens are the base policy's sample for the same seed, token for token
        self.sampling = dict(temperature=temperature, generator=generator, sample_filter=sample_filter)
        self.next_state, self.graph, self.budget = next_state, graph, budget
        self.max_commit = max_commit  # most positions one base step commits (static: 1; None: unbounded)
        self.kids = graph.children()
        self.max_i = max(i for n in graph.nodes for i, _ in n.formula)  # the deepest position rank a formula reads
        self.max_j = max(j for n in graph.nodes for _, j in n.formula)  # the deepest token rank
        self.q: Ranked | None = None  # from the last commit's state and prediction
        self.drafts: list[torch.Tensor] = []
        self.accepted = self.iterations = 0
        self.node_tried = [0] * len(graph.nodes)
        self.node_accepted = [0] * len(graph.nodes)
        self.draft_nodes: list[int] = []

    def _draft_candidates(self) -> list[tuple[int, torch.Tensor, float]]:
        inst: dict[int, tuple[torch.Tensor, float]] = {}
        for k, node in enumerate(self.graph.nodes):
            got = instantiate(node.formula, self.q)
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
        pred = predict(rows[0], self.state, self.mask_id, topk=self.max_j, **self.sampling)
        pending = set(range(len(self.drafts)))
        while True:  # Alg. 1: commit from the state's exact prediction, then reuse an equal draft's
            new = self.next_state(self.state, pred)
            y_q, q = self.state, pred
            self.state = new
            if self.done:
                break
            hit = next((n for n in pending if torch.equal(self.drafts[n], new)), None)
            if hit is None:
                break
            pending.discard(hit)
            self.accepted += 1
            self.node_accepted[self.draft_nodes[hit]] += 1
            pred = predict(rows[1 + hit], self.drafts[hit], self.mask_id, topk=self.max_j, **self.sampling)
        self.q = None if self.done else ranks(y_q, q, self.max_i, self.max_j)
        self.iterations += 1

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations,
                "node_tried": self.node_tried, "node_accepted": self.node_accepted}

    # ------------------------------------------------------------------ every request of a step at once
    def batch_key(self):
        if self.sampling["temperature"] > 0:  # each request draws from its own generator, in its own order
            return None
        return (id(self.graph), self.budget, self.max_commit, policy_key(self.next_state.rule), self.mask_id,
                self.q is None)

    @classmethod
    def propose_batch(cls, decoders):
        """§4.4 for every decoder: each graph node instantiated on each request's ``Y_q`` (one gather per
        formula pair), the drafts that extend the state kept and deduplicated, Eqs. 12-14 scored, and the
        top-D* taken in score order keeping the pruned graph connected, a graph node at a time."""
        d0 = decoders[0]
        if d0.q is None:  # the block's first forward carries no drafts
            return super().propose_batch(decoders)
        mask, nodes, R = d0.mask_id, d0.graph.nodes, len(decoders)
        N, F = len(nodes), max(len(n.formula) for n in nodes)
        fi = torch.tensor([[i for i, _ in n.formula] + [1] * (F - len(n.formula)) for n in nodes]) - 1  # [N, F]
        fj = torch.tensor([[j for _, j in n.formula] + [1] * (F - len(n.formula)) for n in nodes]) - 1
        flen = torch.tensor([len(n.formula) for n in nodes])
        pair = torch.arange(F) < flen[:, None]  # [N, F]
        distinct = torch.tensor([len({i for i, _ in n.formula}) == len(n.formula) for n in nodes])
        S = pad_rows([d.state for d in decoders], -1)  # [R, L]
        Y = pad_rows([d.q.state for d in decoders], -1)
        order = pad_rows([d.q.order for d in decoders], 0)  # [R, n_max]
        n_q = torch.tensor([d.q.order.numel() for d in decoders])
        top = torch.zeros(R, d0.max_i, d0.max_j, dtype=torch.long)
        logp = torch.zeros(R, d0.max_i, d0.max_j, dtype=torch.float64)
        for r, d in enumerate(decoders):
            top[r, : d.q.top_tok.shape[0]], logp[r, : d.q.logp.shape[0]] = d.q.top_tok, d.q.logp
        ar = torch.arange(R)[:, None, None]
        order = torch.cat([order, order.new_zeros(R, max(0, d0.max_i - order.shape[1]))], 1)
        pos = order[ar, fi]  # [R, N, F]
        tok = top[ar, fi, fj]
        lp = torch.zeros(R, N, dtype=torch.float64)
        for m in range(F):  # in formula order, as instantiate sums (exact IEEE additions)
            lp = lp + torch.where(pair[:, m], logp[ar[:, :, 0], fi[:, m], fj[:, m]], 0.0)
        applies = (fi < n_q[:, None, None]).logical_or(~pair).all(-1) & distinct  # [R, N]
        D = Y[:, None].repeat(1, N, 1)
        D.scatter_(2, torch.where(pair, pos, pos[..., :1]), torch.where(pair, tok, tok[..., :1]))
        known = S != mask
        extends = ((D == S[:, None]) | ~known[:, None]).all(-1) & ((D != mask).sum(-1) > known.sum(-1)[:, None])
        ok = applies & extends & (D == mask).any(-1)  # instantiated (inst in _draft_candidates)
        local = _elementwise(math.exp, lp / flen)  # Eq. 12
        same = (D[:, :, None] == D[:, None, :]).all(-1) & ok[:, None, :]  # [R, N, N]
        dup = (same & (torch.arange(N)[None, :] < torch.arange(N)[:, None])).any(-1)  # equals an earlier draft
        log_local = _elementwise(math.log, torch.where(ok, local, 1.0))
        score = torch.full((R, N), float("-inf"), dtype=torch.float64)
        for k in range(N):  # Eqs. 13-14, children in graph order as _draft_candidates sums them
            acc, cnt = torch.zeros(R, dtype=torch.float64), torch.zeros(R, dtype=torch.long)
            for c in d0.kids[k]:
                acc = acc + torch.where(ok[:, c], log_local[:, c], 0.0)
                cnt = cnt + ok[:, c]
            child = torch.where(cnt > 0, _elementwise(math.exp, acc / cnt.clamp(min=1)), local[:, k])
            score[:, k] = torch.where(ok[:, k] & ~dup[:, k], torch.sqrt(local[:, k] * child), float("-inf"))
        rank = torch.sort(score, dim=1, descending=True, stable=True).indices  # ties: the lower node first
        added = (D != mask).sum(-1) - known.sum(-1)[:, None]
        direct = torch.ones(R, N, dtype=torch.bool) if d0.max_commit is None else added <= d0.max_commit
        parents = torch.zeros(N, N, dtype=torch.bool)
        for k, n in enumerate(nodes):
            parents[k, n.parents] = True
        admitted = torch.zeros(R, N, dtype=torch.bool)
        taken = torch.zeros(R, dtype=torch.long)
        picks = torch.full((R, N), -1, dtype=torch.long)  # the chosen nodes, in score order
        rr = torch.arange(R)
        for t in range(N):  # top-D* by score, a draft only with a parent in when it cannot be the next state
            k = rank[:, t]
            take = torch.isfinite(score[rr, k]) & (taken < d0.budget) & \
                (direct[rr, k] | (admitted & parents[k]).any(-1))
            picks[rr, taken.clamp(max=N - 1)] = torch.where(take, k, picks[rr, taken.clamp(max=N - 1)])
            admitted[rr, k] |= take
            taken += take
        for d, row, drafts in zip(decoders, picks.tolist(), D):
            L_d = d.state.numel()
            d.draft_nodes = [k for k in row if k >= 0]
            d.drafts = [drafts[k, :L_d] for k in d.draft_nodes]
            for k in d.draft_nodes:
                d.node_tried[k] += 1
            d._proposed = [d.state] + d.drafts

    @classmethod
    def update_batch(cls, decoders, preds, rows):
        """Alg. 1 for every decoder: commit one base step from the state's prediction; while the new state
        equals a forwarded draft, reuse that draft's prediction for the next step (one pass per accepted
        draft, all requests at once); then Eqs. 8-9 at the last commit for the next proposal."""
        d0 = decoders[0]
        mask, R, rr = d0.mask_id, len(decoders), torch.arange(len(decoders))
        S = pad_rows([d.state for d in decoders], -1)  # [R, L]
        L = S.shape[1]
        K = max(len(d.drafts) for d in decoders)
        D = torch.full((R, max(K, 1), L), -2, dtype=S.dtype)  # -2: no draft (never equals a state)
        for r, d in enumerate(decoders):
            for n, x in enumerate(d.drafts):
                D[r, n, : x.numel()], D[r, n, x.numel():] = x, -1
        rows = rows.to(S.device)
        cur = torch.zeros(R, dtype=torch.long)  # the canvas whose prediction commits next (0: the state)
        live = torch.ones(R, dtype=torch.bool)
        Yq, q_rows = S.clone(), rows[:, 0].clone()
        for _ in range(K + 1):
            r_cur = rows[rr, cur]  # [R, L]
            tok, conf = canvas_predictions(preds, r_cur, S, mask)
            new = torch.where(d0.next_state.rule(conf) & torch.isfinite(conf), tok, S)
            Yq = torch.where(live[:, None], S, Yq)
            q_rows = torch.where(live[:, None], r_cur, q_rows)
            S = torch.where(live[:, None], new, S)
            eq = (D == S[:, None]).all(-1)  # [R, K]
            hit = live & (S == mask).any(-1) & eq.any(-1)
            n_hit = eq.long().argmax(-1)
            for r in hit.nonzero().flatten().tolist():
                decoders[r].accepted += 1
                decoders[r].node_accepted[decoders[r].draft_nodes[int(n_hit[r])]] += 1
            cur = torch.where(hit, n_hit + 1, cur)
            live = hit
            if not bool(live.any()):
                break
        # Eqs. 8-9 at each request's last commit: positions by confidence, top tokens at the first few
        tok_q, conf_q = canvas_predictions(preds, q_rows, Yq, mask)
        n_q = torch.isfinite(conf_q).sum(-1)
        order = torch.sort(conf_q, dim=-1, descending=True, stable=True).indices
        need = order[:, : d0.max_i]
        ok = torch.arange(need.shape[1]) < n_q[:, None]
        sel_rows = q_rows[rr[:, None], need][ok]
        top_tok, top_p = top_tokens(preds.logits, sel_rows, tok_q.gather(1, need)[ok], conf_q.gather(1, need)[ok],
                                    d0.max_j)
        logp = _elementwise(_log, top_p)
        counts = ok.sum(-1).tolist()
        at = 0
        for d, s, y, o, n, c in zip(decoders, S, Yq, order, n_q.tolist(), counts):
            L_d = d.state.numel()
            d.state = s[:L_d]
            d.q = None if d.done else Ranked(y[:L_d], o[:n], top_tok[at: at + c], logp[at: at + c])
            at += c
            d.iterations += 1
            d.drafts, d.draft_nodes = [], []


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
