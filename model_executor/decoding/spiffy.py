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
  applied to pruning). A choice: §4.4.4 says "top-D*" only; without it a static-base graph often forwarded deep
  drafts without their parents, drafts that could never be reused.
  For the confidence base any draft may be the very next state, so nothing is skipped.

One step of all requests at once (:meth:`SpiffyDecoder.propose_batch`, :meth:`SpiffyDecoder.update_batch`,
decoders of one graph and base step together): formulas instantiated for all requests by gathers (Eqs. 8-11),
scores (Eqs. 12-14) for every node at once and the connected top-D* a score rank at a time, Alg. 1 one
accepted draft at a time for all requests. A proposal's data are the graph nodes of its drafts. Only the ``max_i`` most confident positions
of the last commit's prediction get their top tokens (:func:`~.base.top_tokens`: no formula reads further),
not every row of the step. The logarithms and exponentials of the scores are Python's, so a request's drafts
rank the same whichever requests share its step, bit for bit (``tests/oracles/decoders.py`` holds the
one-block reading of §4, which the tests compare against).

Choices the paper leaves open, made here: a draft must extend the current state (agree on every decoded
position, decode more); drafts that fill the whole block are kept for acceptance but need no forward;
invalid instantiations (rank beyond the masked count, two pairs on one position) are dropped; the first
forward of a block carries no drafts. Under sampling (:mod:`.sampling`) a level-k draft is drawn as the state k
base steps ahead will be, and is accepted only as that state (its level equal to the commits so far in the
step): its prediction is then the base policy's own draw there, so sampled Spiffy is the sampled base policy,
token for token for the same seed (appendix A.1's losslessness); a draft equal to another step's state is not
reused (its draw would be another step's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .base import (BlockDecoder, Prediction, Proposal, canvas_predictions, canvas_row_index, commit, groups, pad_rows,
                   top_tokens, update_in_groups)
from .policies import policy_key
from .spiffy_graph import DraftGraph


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


_TABLES: dict = {}


def _tables(graph: DraftGraph) -> tuple[torch.Tensor, ...]:
    """The graph's formulas as tensors, made once per graph: position ranks ``fi`` and token ranks ``fj``
    ``[N, F]`` (0-based, padded with rank 1), formula lengths ``[N]``, which pairs exist ``[N, F]``, which formulas
    name distinct positions ``[N]``, the parent matrix ``[N, N]``, and each node's children ``[N, K]`` (in graph
    order, padded) with which exist ``[N, K]``."""
    got = _TABLES.get(id(graph))
    if got is None or got[0] is not graph:
        nodes = graph.nodes
        N, F = len(nodes), max(len(n.formula) for n in nodes)
        fi = torch.tensor([[i for i, _ in n.formula] + [1] * (F - len(n.formula)) for n in nodes]) - 1
        fj = torch.tensor([[j for _, j in n.formula] + [1] * (F - len(n.formula)) for n in nodes]) - 1
        flen = torch.tensor([len(n.formula) for n in nodes])
        distinct = torch.tensor([len({i for i, _ in n.formula}) == len(n.formula) for n in nodes])
        parents = torch.zeros(N, N, dtype=torch.bool)
        for k, n in enumerate(nodes):
            parents[k, n.parents] = True
        kids = graph.children()
        K = max(1, max(map(len, kids)))
        kid = torch.tensor([c + [0] * (K - len(c)) for c in kids])
        kid_ok = torch.tensor([[True] * len(c) + [False] * (K - len(c)) for c in kids])
        if len(_TABLES) > 16:
            _TABLES.clear()
        got = _TABLES[id(graph)] = (graph, (fi, fj, flen, torch.arange(F) < flen[:, None], distinct, parents, kid,
                                            kid_ok))
    return got[1]


class BaseStep:
    """A base policy as a state transition ``Next(state, prediction)``: Spiffy's lossless reference. ``rule``
    is the spatial policy (:mod:`.policies`), which the batched step applies to all requests at once."""

    def __init__(self, rule: Callable[[torch.Tensor], torch.Tensor]):
        self.rule = rule

    def __call__(self, state: torch.Tensor, pred: Prediction) -> torch.Tensor:
        return commit(state, pred, self.rule(pred.conf) & torch.isfinite(pred.conf))


class SpiffyDecoder(BlockDecoder):
    def __init__(self, block, mask_id, next_state: BaseStep, graph: DraftGraph, budget: int = 3,
                 max_commit: int | None = None):
        super().__init__(block, mask_id)
        self.next_state, self.graph, self.budget = next_state, graph, budget
        self.max_commit = max_commit  # most positions one base step commits (static: 1; None: unbounded)
        self.max_i = max(i for n in graph.nodes for i, _ in n.formula)  # the deepest position rank a formula reads
        self.max_j = max(j for n in graph.nodes for _, j in n.formula)  # the deepest token rank
        self.q: Ranked | None = None  # from the last commit's state and prediction
        self.accepted = self.iterations = 0
        self.node_tried = [0] * len(graph.nodes)
        self.node_accepted = [0] * len(graph.nodes)

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations,
                "node_tried": self.node_tried, "node_accepted": self.node_accepted}

    @classmethod
    def propose_batch(cls, decoders):
        """The state and the top-D* drafts of every decoder (the block's first forward: the state alone);
        ``Proposal.data``: the graph node of each draft."""
        out: list = [Proposal([d.state], []) for d in decoders]
        live = [i for i, d in enumerate(decoders) if d.q is not None]
        for idx in groups(live, lambda i: (id(decoders[i].graph), decoders[i].budget, decoders[i].max_commit)):
            idx = [live[i] for i in idx]
            levels = [n.level for n in decoders[idx[0]].graph.nodes]
            for i, nodes, drafts in zip(idx, *cls._drafts([decoders[i] for i in idx])):
                t = decoders[i].t
                out[i] = Proposal([decoders[i].state] + drafts, nodes, [t] + [t + levels[k] for k in nodes])
        return out

    @staticmethod
    def _drafts(decoders):
        """§4.4 for decoders of one graph, budget and base step: each graph node instantiated on each request's
        ``Y_q`` (Eqs. 8-11, one gather per formula pair), the drafts that extend the state kept and deduplicated,
        Eqs. 12-14 scored, and the top-D* taken in score order keeping the pruned graph connected, a score rank
        at a time. Returns each decoder's chosen nodes and their drafts, in score order."""
        d0 = decoders[0]
        mask, R = d0.mask_id, len(decoders)
        fi, fj, flen, pair, distinct, parents, kid, kid_ok = _tables(d0.graph)
        N, F = fi.shape
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
        for m in range(F):  # in formula order, pair by pair (the same IEEE additions for every request)
            lp = lp + torch.where(pair[:, m], logp[ar[:, :, 0], fi[:, m], fj[:, m]], 0.0)
        applies = (fi < n_q[:, None, None]).logical_or(~pair).all(-1) & distinct  # [R, N]
        D = Y[:, None].repeat(1, N, 1)
        D.scatter_(2, torch.where(pair, pos, pos[..., :1]), torch.where(pair, tok, tok[..., :1]))
        known = S != mask
        extends = ((D == S[:, None]) | ~known[:, None]).all(-1) & ((D != mask).sum(-1) > known.sum(-1)[:, None])
        ok = applies & extends & (D == mask).any(-1)  # a draft: extends the state and keeps a mask
        local = _elementwise(math.exp, lp / flen)  # Eq. 12
        same = (D[:, :, None] == D[:, None, :]).all(-1) & ok[:, None, :]  # [R, N, N]
        dup = (same & (torch.arange(N)[None, :] < torch.arange(N)[:, None])).any(-1)  # equals an earlier draft
        log_local = _elementwise(math.log, torch.where(ok, local, 1.0))
        acc, cnt = torch.zeros(R, N, dtype=torch.float64), torch.zeros(R, N, dtype=torch.long)
        for j in range(kid.shape[1]):  # Eq. 13 for every node at once: its j-th child, children in graph order
            c = kid[:, j]
            v = kid_ok[:, j] & ok[:, c]  # [R, N]
            acc = acc + torch.where(v, log_local[:, c], 0.0)
            cnt = cnt + v
        child = torch.where(cnt > 0, _elementwise(math.exp, acc / cnt.clamp(min=1)), local)
        score = torch.where(ok & ~dup, torch.sqrt(local * child), float("-inf"))  # Eq. 14
        rank = torch.sort(score, dim=1, descending=True, stable=True).indices  # ties: the lower node first
        added = (D != mask).sum(-1) - known.sum(-1)[:, None]
        direct = torch.ones(R, N, dtype=torch.bool) if d0.max_commit is None else added <= d0.max_commit
        admitted = torch.zeros(R, N, dtype=torch.bool)
        taken = torch.zeros(R, dtype=torch.long)
        picks = torch.full((R, N), -1, dtype=torch.long)  # the chosen nodes, in score order
        rr = torch.arange(R)
        for t in range(int(torch.isfinite(score).sum(-1).max())):  # top-D* by score, a draft only with a parent in
            # when it cannot be the next state (past the drafts of the most: nothing more to take)
            k = rank[:, t]
            take = torch.isfinite(score[rr, k]) & (taken < d0.budget) & \
                (direct[rr, k] | (admitted & parents[k]).any(-1))
            picks[rr, taken.clamp(max=N - 1)] = torch.where(take, k, picks[rr, taken.clamp(max=N - 1)])
            admitted[rr, k] |= take
            taken += take
            if bool((taken == d0.budget).all()):
                break
        chosen = [[k for k in row if k >= 0] for row in picks.tolist()]
        return chosen, [[drafts[k, : d.state.numel()] for k in row] for d, row, drafts in zip(decoders, chosen, D)]

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """Alg. 1 for every decoder, a graph and base step at a time (greedy and sampling decoders apart)."""
        update_in_groups(cls._update, lambda d, p: (id(d.graph), policy_key(d.next_state.rule),
                                                    d.sampling is not None), decoders, proposals, preds, canvas_rows)

    @classmethod
    def _update(cls, decoders, proposals, preds, canvas_rows):
        """Commit one base step from the state's prediction; while the new state equals a forwarded draft, reuse
        that draft's prediction for the next step (one pass per accepted draft, all requests at once; sampling:
        a draft of the level the commits have reached); then Eqs. 8-9 at the last commit for the next proposal."""
        d0 = decoders[0]
        mask, R, rr = d0.mask_id, len(decoders), torch.arange(len(decoders))
        sampled = d0.sampling is not None
        for d, p in zip(decoders, proposals):
            for k in p.data:
                d.node_tried[k] += 1
        S = pad_rows([d.state for d in decoders], -1)  # [R, L]
        L = S.shape[1]
        K = max(len(p.canvases) for p in proposals) - 1
        D = torch.full((R, max(K, 1), L), -2, dtype=S.dtype)  # -2: no draft (never equals a state)
        level = torch.zeros(R, max(K, 1), dtype=torch.long)  # each draft's steps past the state
        for r, (d, p) in enumerate(zip(decoders, proposals)):
            for n, (x, st) in enumerate(zip(p.canvases[1:], p.canvas_steps(d.t)[1:])):
                D[r, n, : x.numel()], D[r, n, x.numel():] = x, -1
                level[r, n] = st - d.t
        rows = canvas_row_index(decoders, canvas_rows).to(S.device)
        cur = torch.zeros(R, dtype=torch.long)  # the canvas whose prediction commits next (0: the state)
        live = torch.ones(R, dtype=torch.bool)
        taken = torch.zeros(R, dtype=torch.long)  # base steps committed in this update
        Yq, q_rows = S.clone(), rows[:, 0].clone()
        for n in range(K + 1):
            r_cur = rows[rr, cur]  # [R, L]
            tok, conf = canvas_predictions(preds, r_cur, S, mask)
            new = torch.where(d0.next_state.rule(conf) & torch.isfinite(conf), tok, S)
            Yq = torch.where(live[:, None], S, Yq)
            q_rows = torch.where(live[:, None], r_cur, q_rows)
            S = torch.where(live[:, None], new, S)
            taken += live
            eq = (D == S[:, None]).all(-1)  # [R, K]
            if sampled:  # reused only as the state it was drawn for
                eq &= level == n + 1
            hit = live & (S == mask).any(-1) & eq.any(-1)
            n_hit = eq.long().argmax(-1)
            for r in hit.nonzero().flatten().tolist():
                decoders[r].accepted += 1
                decoders[r].node_accepted[proposals[r].data[int(n_hit[r])]] += 1
            cur = torch.where(hit, n_hit + 1, cur)
            live = hit
            if not bool(live.any()):
                break
        for d, k in zip(decoders, taken.tolist()):
            d.t += k
        # Eqs. 8-9 at each request's last commit: positions by confidence, top tokens at the first few
        tok_q, conf_q = canvas_predictions(preds, q_rows, Yq, mask)
        n_q = torch.isfinite(conf_q).sum(-1)
        order = torch.sort(conf_q, dim=-1, descending=True, stable=True).indices
        need = order[:, : d0.max_i]
        ok = (torch.arange(need.shape[1]) < n_q[:, None]) & (S == mask).any(-1, keepdim=True)  # done: no drafts
        sel_rows = q_rows[rr[:, None], need][ok]
        top_tok, top_p = top_tokens(preds.logits, preds.logits_of(sel_rows), tok_q.gather(1, need)[ok], conf_q.gather(1, need)[ok],
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
