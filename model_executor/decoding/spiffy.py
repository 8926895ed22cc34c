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
of the last commit's prediction get their top tokens (:func:`~.base.top_token_gaps`: no formula reads further),
not every row of the step. The scores are computed in logarithms (a geometric mean is the exponential of a mean
of logarithms, and ranks as that mean does): the tokens' log-probabilities ``log(conf) + logit gap``
(:func:`top_logprobs`, the logarithm :mod:`.portable_math`'s, IEEE basic operations only), then sums, means and
halves, so a request's drafts rank the same whichever requests share its step and wherever they are ranked, bit
for bit (``tests/oracles/decoders.py`` holds the one-block reading of §4, which the tests compare against). Where the predictions are on an accelerator, Alg. 1 and the top tokens'
selection run there (:meth:`SpiffyDecoder._decide_on_device`: one copy back); under async scheduling the next
step's drafts are made there too, before the host has read anything (:meth:`SpiffyDecoder.launch_batch`: the
graph instantiated, scored and pruned by :meth:`SpiffyDecoder._choose_on_device`, the host's
:meth:`SpiffyDecoder._choose` decision for decision).

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

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import portable_math
from .base import (BlockDecoder, DeviceRowPredictions, Prediction, Proposal, canvas_predictions, canvas_row_index,
                   commit, groups, host_rows, launch_key, top_token_gaps, update_in_groups)
from .policies import policy_key
from .spiffy_graph import DraftGraph


@dataclass
class Ranked:
    """What the drafts of the next step are built from: the state ``Y_q`` of the last commit and, from its
    prediction ``q``, the masked positions by confidence and the likeliest tokens at the first few of them."""

    state: torch.Tensor  # [L] Y_q
    order: torch.Tensor  # [n] masked positions of Y_q, most confident first (ties: lower position)
    top_tok: torch.Tensor  # [min(n, max_i), max_j] token of rank j at the position of rank i
    logp: torch.Tensor  # [min(n, max_i), max_j] float64: log of its probability (top_logprobs)


LOG_FLOOR = portable_math.log_float(1e-300)  # the least log-probability a formula pair counts with


def top_logprobs(conf, gaps):
    """The log-probabilities ``[n, max_j]`` of the likeliest tokens at ``n`` positions, from the predictions'
    confidences ``conf [n]`` (the probability of rank 1) and the logit gaps of ranks 2..max_j to it ``gaps
    [n, max_j - 1]`` (:func:`~.base.top_token_gaps`): ``log(conf) + gap`` (rank 1: ``log(conf)``), floored at
    :data:`LOG_FLOOR` (a banned token's -inf counts as a probability of 1e-300). A numpy array or a tensor on any
    device: the logarithm is :mod:`.portable_math`'s and the rest IEEE additions, so the host's and the device's
    drafts rank alike (:meth:`SpiffyDecoder.launch_batch`), and a position's values are the same whichever
    requests share its step."""
    if isinstance(conf, torch.Tensor):
        lc = portable_math.log(conf.double().clamp(min=1e-300))[:, None]
        return torch.cat([lc, lc + gaps.double()], 1).clamp(min=LOG_FLOOR)
    lc = portable_math.log(np.maximum(np.asarray(conf, dtype=np.float64), 1e-300))[:, None]
    return np.maximum(np.concatenate([lc, lc + np.asarray(gaps, dtype=np.float64)], 1), LOG_FLOOR)


_TABLES: dict = {}


def _tables(graph: DraftGraph) -> tuple[np.ndarray, ...]:
    """The graph's formulas as (numpy) arrays, made once per graph: position ranks ``fi`` and token ranks ``fj``
    ``[N, F]`` (0-based, padded with rank 1), formula lengths ``[N]``, which pairs exist ``[N, F]``, which formulas
    name distinct positions ``[N]``, the parent matrix ``[N, N]``, and each node's children ``[N, K]`` (in graph
    order, padded) with which exist ``[N, K]``."""
    got = _TABLES.get(id(graph))
    if got is None or got[0] is not graph:
        nodes = graph.nodes
        N, F = len(nodes), max(len(n.formula) for n in nodes)
        fi = np.array([[i for i, _ in n.formula] + [1] * (F - len(n.formula)) for n in nodes]) - 1
        fj = np.array([[j for _, j in n.formula] + [1] * (F - len(n.formula)) for n in nodes]) - 1
        flen = np.array([len(n.formula) for n in nodes])
        distinct = np.array([len({i for i, _ in n.formula}) == len(n.formula) for n in nodes])
        parents = np.zeros((N, N), dtype=bool)
        for k, n in enumerate(nodes):
            parents[k, list(n.parents)] = True
        kids = graph.children()
        K = max(1, max(map(len, kids)))
        kid = np.array([c + [0] * (K - len(c)) for c in kids])
        kid_ok = np.array([[True] * len(c) + [False] * (K - len(c)) for c in kids])
        if len(_TABLES) > 16:
            _TABLES.clear()
        got = _TABLES[id(graph)] = (graph, (fi, fj, flen, np.arange(F) < flen[:, None], distinct, parents, kid,
                                            kid_ok))
    return got[1]


_DEVICE_TABLES: dict = {}


def _device_tables(graph: DraftGraph, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:func:`_tables` on ``device``, uploaded once per graph and device."""
    key = (id(graph), str(device))
    got = _DEVICE_TABLES.get(key)
    if got is None or got[0] is not graph:
        if len(_DEVICE_TABLES) > 16:
            _DEVICE_TABLES.clear()
        pin = torch.device(device).type == "cuda"  # (from pinned memory: the host does not wait for the stream)
        got = _DEVICE_TABLES[key] = (graph, tuple((torch.from_numpy(a).pin_memory() if pin else torch.from_numpy(a))
                                                  .to(device, non_blocking=True) for a in _tables(graph)))
    return got[1]


def _top(tok, conf, ids, gaps) -> tuple[torch.Tensor, torch.Tensor]:
    """The top tokens ``[n, max_j]`` (the predictions ``tok [n]`` first, then ``ids``) and their log-probabilities
    (:func:`top_logprobs` of the confidences ``conf`` and the logit gaps ``gaps``), host arrays in, tensors out."""
    top = np.concatenate([np.asarray(tok).reshape(-1, 1), np.asarray(ids)], 1).astype(np.int64)
    return torch.from_numpy(top), torch.from_numpy(top_logprobs(conf, gaps))


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
        # the last update's passes (which accepted a draft, and which) and its proposal's canvases: what
        # commit_canvases reads (nothing computed unless logprobs ask)
        self.accepted_chain: tuple | None = None

    device_update = True  # :meth:`_decide_on_device`

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
        d0, R = decoders[0], len(decoders)
        # host data in numpy (a step's few small arrays cost microseconds an op in numpy, tens as torch ops); every
        # float op is an element-wise IEEE one or portable_math's, so the results are those of the one-block step
        # and of the device's form (_choose_on_device)
        S, Y = host_rows([(d.state, d.q.state) for d in decoders])  # [R, L]
        n_q = np.array([d.q.order.numel() for d in decoders])
        order = np.zeros((R, max(int(n_q.max()), d0.max_i)), dtype=np.int64)  # [R, n]
        top = np.zeros((R, d0.max_i, d0.max_j), dtype=np.int64)
        logp = np.zeros((R, d0.max_i, d0.max_j), dtype=np.float64)
        for r, d in enumerate(decoders):
            order[r, : n_q[r]] = d.q.order.numpy()
            top[r, : d.q.top_tok.shape[0]], logp[r, : d.q.logp.shape[0]] = d.q.top_tok.numpy(), d.q.logp.numpy()
        picks, D = SpiffyDecoder._choose(d0, S, Y, order, n_q, top, logp)
        chosen = [[k for k in row if k >= 0] for row in picks.tolist()]
        Dt = torch.from_numpy(D)
        return chosen, [[Dt[r, k, : d.state.numel()] for k in row] for r, (d, row) in enumerate(zip(decoders, chosen))]

    @staticmethod
    def _choose(d0, S, Y, order, n_q, top, logp):
        """:meth:`_drafts` on the decoders' host arrays: the states ``S`` and ``Y_q`` ``[R, L]``, the masked positions
        of ``Y_q`` by confidence ``order [R, >= max_i]`` (0 past their count ``n_q [R]``), the top tokens at the first
        ``max_i`` of them and the logarithms of their probabilities ``[R, max_i, max_j]`` (0 past them). Returns the
        chosen nodes ``[R, N]`` in score order (-1 after them) and every node's draft ``[R, N, L]``."""
        mask, R = d0.mask_id, S.shape[0]
        fi, fj, flen, pair, distinct, parents, kid, kid_ok = _tables(d0.graph)
        N, F = fi.shape
        ar = np.arange(R)[:, None, None]
        pos = order[ar, fi]  # [R, N, F]
        tok = top[ar, fi, fj]
        lp = np.zeros((R, N), dtype=np.float64)
        for m in range(F):  # in formula order, pair by pair (the same IEEE additions for every request)
            lp = lp + np.where(pair[:, m], logp[ar[:, :, 0], fi[:, m], fj[:, m]], 0.0)
        applies = ((fi < n_q[:, None, None]) | ~pair).all(-1) & distinct  # [R, N]
        D = np.repeat(Y[:, None], N, axis=1)
        np.put_along_axis(D, np.where(pair, pos, pos[..., :1]), np.where(pair, tok, tok[..., :1]), axis=2)
        known = S != mask
        extends = ((D == S[:, None]) | ~known[:, None]).all(-1) & ((D != mask).sum(-1) > known.sum(-1)[:, None])
        ok = applies & extends & (D == mask).any(-1)  # a draft: extends the state and keeps a mask
        # Eqs. 12-14 in logarithms (a geometric mean is the exponential of a mean of logarithms, and the
        # exponential orders as its argument does): no exponential or logarithm here, IEEE operations alone
        local = lp / flen  # Eq. 12: log localScore
        same = (D[:, :, None] == D[:, None, :]).all(-1) & ok[:, None, :]  # [R, N, N]
        dup = (same & (np.arange(N)[None, :] < np.arange(N)[:, None])).any(-1)  # equals an earlier draft
        acc, cnt = np.zeros((R, N), dtype=np.float64), np.zeros((R, N), dtype=np.int64)
        for j in range(kid.shape[1]):  # Eq. 13 for every node at once: its j-th child, children in graph order
            c = kid[:, j]
            v = kid_ok[:, j] & ok[:, c]  # [R, N]
            acc = acc + np.where(v, local[:, c], 0.0)
            cnt = cnt + v
        child = np.where(cnt > 0, acc / np.maximum(cnt, 1), local)  # log childScore (a leaf: its localScore)
        score = np.where(ok & ~dup, (local + child) * 0.5, -np.inf)  # Eq. 14: log score
        rank = np.argsort(-score, axis=1, kind="stable")  # descending; ties: the lower node first
        added = (D != mask).sum(-1) - known.sum(-1)[:, None]
        direct = np.ones((R, N), dtype=bool) if d0.max_commit is None else added <= d0.max_commit
        admitted = np.zeros((R, N), dtype=bool)
        taken = np.zeros(R, dtype=np.int64)
        picks = np.full((R, N), -1, dtype=np.int64)  # the chosen nodes, in score order
        rr = np.arange(R)
        for t in range(int(np.isfinite(score).sum(-1).max())):  # top-D* by score, a draft only with a parent in
            # when it cannot be the next state (past the drafts of the most: nothing more to take)
            k = rank[:, t]
            take = np.isfinite(score[rr, k]) & (taken < d0.budget) & \
                (direct[rr, k] | (admitted & parents[k]).any(-1))
            slot = np.minimum(taken, N - 1)
            picks[rr, slot] = np.where(take, k, picks[rr, slot])
            admitted[rr, k] |= take
            taken += take
            if bool((taken == d0.budget).all()):
                break
        return picks, D

    @staticmethod
    def _choose_on_device(d0, S, Y, order, n_q, top, logp):
        """:meth:`_choose` where its inputs are (tensor ops, no host read, no data-dependent shape), decision for
        decision: the same IEEE operations in the same order (sums, tensor-by-tensor divisions, halves), a stable
        sort for numpy's stable argsort, and every score rank walked (the host stops once
        every request has its drafts; the ranks after that take nothing). With a base step that commits any number
        of positions (confidence) every draft can be the next state, so the top-D* are the first ``budget`` ranks
        with a score, taken at once."""
        mask, R, dev = d0.mask_id, S.shape[0], S.device
        fi, fj, flen, pair, distinct, parents, kid, kid_ok = _device_tables(d0.graph, dev)
        N, F = fi.shape
        ar = torch.arange(R, device=dev)[:, None, None]
        pos = order[ar, fi]  # [R, N, F]
        tok = top[ar, fi, fj]
        lp = torch.zeros((R, N), dtype=torch.float64, device=dev)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        for m in range(F):
            lp = lp + torch.where(pair[:, m], logp[ar[:, :, 0], fi[:, m], fj[:, m]], zero)
        applies = ((fi < n_q[:, None, None]) | ~pair).all(-1) & distinct
        D = Y[:, None].repeat(1, N, 1)
        D.scatter_(2, torch.where(pair, pos, pos[..., :1]), torch.where(pair, tok, tok[..., :1]))
        known = S != mask
        extends = ((D == S[:, None]) | ~known[:, None]).all(-1) & ((D != mask).sum(-1) > known.sum(-1)[:, None])
        ok = applies & extends & (D == mask).any(-1)
        local = lp / flen  # (tensor / tensor divisions only: a CUDA tensor divided by a Python float is a
        # multiplication by its reciprocal, which numpy's division is not)
        same = (D[:, :, None] == D[:, None, :]).all(-1) & ok[:, None, :]
        nodes = torch.arange(N, device=dev)
        dup = (same & (nodes[None, :] < nodes[:, None])).any(-1)
        acc = torch.zeros((R, N), dtype=torch.float64, device=dev)
        cnt = torch.zeros((R, N), dtype=torch.int64, device=dev)
        for j in range(kid.shape[1]):
            c = kid[:, j]
            v = kid_ok[:, j] & ok[:, c]
            acc = acc + torch.where(v, local[:, c], zero)
            cnt = cnt + v
        child = torch.where(cnt > 0, acc / cnt.clamp(min=1), local)
        score = torch.where(ok & ~dup, (local + child) * 0.5, torch.full_like(local, float("-inf")))
        rank = torch.sort(-score, dim=1, stable=True).indices
        finite = torch.isfinite(score.gather(1, rank))  # [R, N] in rank order
        if d0.max_commit is None:  # every draft direct: the first `budget` ranks with a score
            take = finite & (finite.long().cumsum(-1) <= d0.budget)
            slot = torch.where(take, take.long().cumsum(-1) - 1, torch.full_like(rank, N))
            picks = torch.full((R, N + 1), -1, dtype=torch.int64, device=dev)
            picks.scatter_(1, slot, torch.where(take, rank, torch.full_like(rank, -1)))
            return picks[:, :N], D
        added = (D != mask).sum(-1) - known.sum(-1)[:, None]
        direct = added <= d0.max_commit
        admitted = torch.zeros((R, N), dtype=torch.bool, device=dev)
        taken = torch.zeros(R, dtype=torch.int64, device=dev)
        picks = torch.full((R, N), -1, dtype=torch.int64, device=dev)
        rr = torch.arange(R, device=dev)
        for t in range(N):
            k = rank[:, t]
            take = finite[:, t] & (taken < d0.budget) & (direct[rr, k] | (admitted & parents[k]).any(-1))
            slot = taken.clamp(max=N - 1)
            picks[rr, slot] = torch.where(take, k, picks[rr, slot])
            admitted[rr, k] = admitted[rr, k] | take
            taken = taken + take
        return picks, D

    def commit_canvases(self) -> np.ndarray | None:
        """Per block position, the canvas of the last step whose prediction committed it (Alg. 1's passes): the
        first pass commits from the state's prediction; where its result equals a forwarded draft, the next pass
        commits from that draft's, and so on. A position committed by pass ``p`` was masked in that pass's canvas
        (so its logits were computed) and is filled in the next pass's."""
        if self.accepted_chain is None:
            return None
        hits, n_hits, canvases = self.accepted_chain
        chain = [0]
        for hit, n in zip(hits.tolist(), n_hits.tolist()):
            if not hit:
                break
            chain.append(n + 1)
        out = np.full(self.state.numel(), chain[-1], dtype=np.int64)  # the last pass: its canvas to the state
        for a, b in zip(chain, chain[1:]):
            out[(canvases[a].numpy() == self.mask_id) & (canvases[b].numpy() != self.mask_id)] = a
        return out

    @staticmethod
    def _group_key(d, p):
        """What one batched update cannot mix: the graph, the base step, greedy and sampling decoders."""
        return id(d.graph), policy_key(d.next_state.rule), d.sampling is not None

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """Alg. 1 for every decoder, a graph and base step at a time (greedy and sampling decoders apart)."""
        update_in_groups(cls._update, cls._group_key, decoders, proposals, preds, canvas_rows)

    @staticmethod
    def _inputs(decoders, proposals, canvas_rows):
        """What a step's decisions read of its decoders' proposals (host arrays): ``(the states [R, L], the
        forwarded drafts [R, K, L] (-2: none, never equal to a state; -1 past a shorter block), each draft's base
        steps past the state [R, K], the canvases' prediction rows [R, K + 1, L], K)``."""
        R = len(decoders)
        S = host_rows([(d.state,) for d in decoders])[0]  # [R, L] (host data in numpy, as in _drafts)
        L = S.shape[1]
        K = max(len(p.canvases) for p in proposals) - 1
        D = np.full((R, max(K, 1), L), -2, dtype=np.int64)
        level = np.zeros((R, max(K, 1)), dtype=np.int64)
        for r, (d, p) in enumerate(zip(decoders, proposals)):
            for n, (x, st) in enumerate(zip(p.canvases[1:], p.canvas_steps(d.t)[1:])):
                D[r, n, : x.numel()], D[r, n, x.numel():] = x.numpy(), -1
                level[r, n] = st - d.t
        return S, D, level, canvas_row_index(decoders, canvas_rows).numpy(), K

    @classmethod
    def launch_batch(cls, decoders, proposals, preds, canvas_rows):
        """:meth:`update_batch`'s decisions taken ahead (:func:`~.base.launch_all`), a group at a time as it makes
        them, their copy queued for it; and from them, where they are, the next step's canvases
        (:meth:`_next_canvases`: the draft graph instantiated, scored and pruned there): per decoder ``[K, L]``,
        ``K`` what :meth:`canvases_ahead` bounds them by."""
        out = [None] * len(decoders)
        for idx in groups(range(len(decoders)), lambda i: cls._group_key(decoders[i], proposals[i])):
            group, props, rows = [decoders[i] for i in idx], [proposals[i] for i in idx], [canvas_rows[i] for i in idx]
            S, D, level, rix, K = cls._inputs(group, props, rows)
            cols, at = cls._device_decisions(group[0], preds, S, D, level, rix, K,
                                             f"spiffy-ahead/{len(preds.launched)}")
            preds.launched[launch_key(group, rows)] = preds.read_back_later(cols, at)
            # the drafts a budget and base step at a time, as propose_batch makes them: each made for every row of
            # the group (a row's drafts are its own) and the sub-group's rows taken (no index to upload)
            for sub in groups(range(len(group)), lambda r: (group[r].budget, group[r].max_commit)):
                canv = cls._next_canvases(group[sub[0]], *cols)
                for r in sub:
                    d = group[r]
                    out[idx[r]] = canv[r, : d.canvases_ahead(props[r]), : d.state.numel()]
        return out

    @staticmethod
    def _next_canvases(d0, S, Yq, order, n_q, taken, hits, n_hits, ok, tok_sel, conf_sel, ids, gaps) -> torch.Tensor:
        """:meth:`propose_batch` of the decisions where they are (:meth:`_device_decisions`' columns), with the graph,
        budget and base step of the decoder ``d0``: ``[R, 1 + min(budget, nodes), L]``, the next state then its
        drafts in score order (past a block's own drafts, the state again: rows that decode nothing). Decision for
        decision the host's: the top tokens' log-probabilities (:func:`top_logprobs`), zero past each block's first
        ``max_i`` masked positions as :meth:`_drafts` pads them, then :meth:`_choose_on_device`."""
        (R, L), dev = S.shape, S.device
        w = ok.shape[1]
        ok = ok[..., None]
        top = torch.where(ok, torch.cat([tok_sel[..., None], ids], -1), torch.zeros((), dtype=ids.dtype, device=dev))
        logp = torch.where(ok, top_logprobs(conf_sel.reshape(-1), gaps.reshape(R * w, gaps.shape[-1])).view(R, w, -1),
                           torch.zeros((), dtype=torch.float64, device=dev))
        if w < d0.max_i:  # (a block shorter than the graph's deepest position rank)
            top = torch.nn.functional.pad(top, (0, 0, 0, d0.max_i - w))
            logp = torch.nn.functional.pad(logp, (0, 0, 0, d0.max_i - w))
        order = torch.where(torch.arange(L, device=dev) < n_q[:, None], order, torch.zeros_like(order))
        if L < d0.max_i:
            order = torch.nn.functional.pad(order, (0, d0.max_i - L))
        picks, D = SpiffyDecoder._choose_on_device(d0, S, Yq, order, n_q, top, logp)
        sel = picks[:, : d0.budget]
        drafts = D.gather(1, sel.clamp(min=0)[..., None].expand(R, sel.shape[1], L))
        drafts = torch.where(sel[..., None] >= 0, drafts, S[:, None])
        return torch.cat([S[:, None], drafts], 1)

    def canvases_ahead(self, proposal: Proposal) -> int:
        """The next step forwards the state and at most ``budget`` drafts (one per graph node at most); a draft
        decodes more than the state and keeps a mask, and the base step commits one mask at least, so a state
        with fewer than three masks now has none after it."""
        m = int(np.count_nonzero(proposal.canvases[0].numpy() == self.mask_id))
        return 1 + min(self.budget, len(self.graph.nodes)) if m >= 3 else 1

    @classmethod
    def _update(cls, decoders, proposals, preds, canvas_rows):
        """Commit one base step from the state's prediction; while the new state equals a forwarded draft, reuse
        that draft's prediction for the next step (one pass per accepted draft, all requests at once; sampling:
        a draft of the level the commits have reached); then Eqs. 8-9 at the last commit for the next proposal."""
        d0 = decoders[0]
        S, D, level, rows, K = cls._inputs(decoders, proposals, canvas_rows)
        if isinstance(preds, DeviceRowPredictions):
            pending = (preds.launched or {}).pop(launch_key(decoders, canvas_rows), None)
            decided = cls._decide_on_device(d0, preds, S, D, level, rows, K, pending)
        else:
            decided = cls._decide(d0, preds, S, D, level, rows, K)
        S, Yq, order, n_q, taken, hits, n_hits, top_tok, logp, counts = decided
        # (counted once the step's decisions stand: a decide that raises, a block's NaN, is retried block by block)
        for d, p in zip(decoders, proposals):
            for k in p.data:
                d.node_tried[k] += 1
        for n in range(hits.shape[1]):
            for r in np.flatnonzero(hits[:, n]).tolist():
                decoders[r].accepted += 1
                decoders[r].node_accepted[proposals[r].data[int(n_hits[r, n])]] += 1
        for r, (d, k, p) in enumerate(zip(decoders, taken.tolist(), proposals)):
            d.t += k
            d.accepted_chain = (hits[r], n_hits[r], p.canvases)
        at = 0
        S, Yq, order = torch.from_numpy(S), torch.from_numpy(Yq), torch.from_numpy(order)
        for d, s, y, o, n, c in zip(decoders, S, Yq, order, n_q.tolist(), counts.tolist()):
            L_d = d.state.numel()
            d.state = s[:L_d]
            d.q = None if d.done else Ranked(y[:L_d], o[:n], top_tok[at: at + c], logp[at: at + c])
            at += c
            d.iterations += 1

    @staticmethod
    def _decide(d0, preds, S, D, level, rows, K):
        """Alg. 1 on host data (numpy): commit one base step from the state's prediction, and while the new state
        equals a forwarded draft, one more from that draft's prediction (all requests at once; sampling: a draft of
        the level the commits have reached); then Eqs. 8-9 at each request's last commit. Returns the states, the
        last commits' states ``Y_q`` and their masked positions by confidence ``[R, L]``, how many ``[R]``, the
        base steps taken ``[R]``, which blocks accepted a draft at each pass and which ``[R, passes]``, and the top
        tokens at each block's first few positions with their log-probabilities (:func:`top_logprobs`: ``[n, max_j]``
        for the ``n`` positions the next drafts may read, block by block) and how many are each block's ``[R]``."""
        mask, R, rr = d0.mask_id, S.shape[0], np.arange(S.shape[0])
        sampled = d0.sampling is not None
        cur = np.zeros(R, dtype=np.int64)  # the canvas whose prediction commits next (0: the state)
        live = np.ones(R, dtype=bool)
        taken = np.zeros(R, dtype=np.int64)  # base steps committed in this update
        hits, n_hits = np.zeros((R, K + 1), dtype=bool), np.zeros((R, K + 1), dtype=np.int64)
        Yq, q_rows = S.copy(), rows[:, 0].copy()
        for n in range(K + 1):
            r_cur = rows[rr, cur]  # [R, L]
            tok, conf = canvas_predictions(preds, r_cur, S, mask)
            new = np.where(d0.next_state.rule(torch.from_numpy(conf)).numpy() & np.isfinite(conf), tok, S)
            Yq = np.where(live[:, None], S, Yq)
            q_rows = np.where(live[:, None], r_cur, q_rows)
            S = np.where(live[:, None], new, S)
            taken += live
            eq = (D == S[:, None]).all(-1)  # [R, K]
            if sampled:  # reused only as the state it was drawn for
                eq &= level == n + 1
            hit = live & (S == mask).any(-1) & eq.any(-1)
            hits[:, n], n_hits[:, n] = hit, eq.argmax(-1)
            cur = np.where(hit, n_hits[:, n] + 1, cur)
            live = hit
            if not live.any():
                break
        # Eqs. 8-9 at each request's last commit: positions by confidence, top tokens at the first few
        tok_q, conf_q = canvas_predictions(preds, q_rows, Yq, mask)
        n_q = np.isfinite(conf_q).sum(-1)
        order = np.argsort(-conf_q, axis=-1, kind="stable")  # descending; ties: the lower position first
        need = order[:, : d0.max_i]
        ok = (np.arange(need.shape[1]) < n_q[:, None]) & (S == mask).any(-1, keepdims=True)  # done: no drafts
        sel_rows = torch.from_numpy(q_rows[rr[:, None], need][ok])
        tok_sel = np.take_along_axis(tok_q, need, 1)[ok]
        ids, gaps = top_token_gaps(preds.logits, preds.logits_of(sel_rows), torch.from_numpy(tok_sel), d0.max_j)
        both = torch.cat([ids.double(), gaps], 1).cpu().numpy()  # (one copy where the logits are elsewhere)
        top_tok, logp = _top(tok_sel, np.take_along_axis(conf_q, need, 1)[ok], both[:, : d0.max_j - 1],
                             both[:, d0.max_j - 1:])
        return S, Yq, order, n_q, taken, hits, n_hits, top_tok, logp, ok.sum(-1)

    @classmethod
    def _decide_on_device(cls, d0, preds: DeviceRowPredictions, S, D, level, rows, K, pending=None):
        """:meth:`_decide` where the predictions are (:meth:`_device_decisions`), decision for decision, in the step's
        one copy back (``pending``: that copy, queued when they were taken ahead, :meth:`launch_batch`). The top
        tokens' log-probabilities are computed on the host from what it brings (:func:`top_logprobs`), as in the
        host's form and the device's proposal."""
        if pending is not None:
            cols = pending.columns()
        else:
            cols = preds.read_back_columns(*cls._device_decisions(d0, preds, S, D, level, rows, K))
        S, Yq, order, n_q, taken, hits, n_hits, ok, tok_sel, conf_sel, ids, gaps = cols
        ok = ok > 0
        top_tok, logp = _top(tok_sel[ok], conf_sel[ok], ids[ok], gaps[ok])
        return (S.astype(np.int64), Yq.astype(np.int64), order.astype(np.int64), n_q.astype(np.int64),
                taken.astype(np.int64), hits > 0, n_hits.astype(np.int64), top_tok, logp, ok.sum(-1))

    @staticmethod
    def _device_decisions(d0, preds: DeviceRowPredictions, S, D, level, rows, K, key: str = "spiffy"):
        """:meth:`_decide`'s decisions where the predictions are (tensor ops, no host read, no data-dependent shape;
        no grammar: :func:`~.base.decide_on_device`), left there: every pass of Alg. 1 runs (a block that accepted
        nothing keeps its state through the rest), the top tokens are taken at every block's first ``max_i``
        positions (:func:`~.base.top_token_gaps`; those past a block's masks are dropped). Returns ``([states,
        Y_q, their masked positions by confidence [R, L], how many [R], base steps [R], hits and which [R, K + 1],
        which of the first max_i positions are masked [R, w], their tokens and confidences [R, w], the top
        tokens' ids and logit gaps [R, w, max_j - 1]], the canvases' logits rows)``; the host arrays go up through
        the engine's staging buffer ``key``."""
        mask, R = d0.mask_id, S.shape[0]
        sampled = d0.sampling is not None
        Sd, Dd, lev, at = preds.upload(key, [S, D, level, preds.logits_rows(rows)])
        dev = Sd.device
        ar = torch.arange(R, device=dev)
        cur = torch.zeros(R, dtype=torch.long, device=dev)
        live = torch.ones(R, dtype=torch.bool, device=dev)
        taken = torch.zeros(R, dtype=torch.long, device=dev)
        hits, n_hits = [], []
        Yq, q_at = Sd.clone(), at[:, 0].clone()
        for n in range(K + 1):
            r_cur = at[ar, cur]  # [R, L] logits rows
            tok, conf = preds.gather(r_cur, Sd, mask)
            new = torch.where(d0.next_state.rule(conf) & torch.isfinite(conf), tok, Sd)
            Yq = torch.where(live[:, None], Sd, Yq)
            q_at = torch.where(live[:, None], r_cur, q_at)
            Sd = torch.where(live[:, None], new, Sd)
            taken += live
            eq = (Dd == Sd[:, None]).all(-1)  # [R, K]
            if sampled:
                eq &= lev == n + 1
            hit = live & (Sd == mask).any(-1) & eq.any(-1)
            n_hit = eq.int().argmax(-1)
            hits.append(hit)
            n_hits.append(n_hit)
            cur = torch.where(hit, n_hit + 1, cur)
            live = hit
        tok_q, conf_q = preds.gather(q_at, Yq, mask)
        n_q = torch.isfinite(conf_q).sum(-1)
        order = torch.sort(-conf_q, dim=-1, stable=True).indices  # descending; ties: the lower position first
        need = order[:, : d0.max_i]
        w = need.shape[1]
        ok = (torch.arange(w, device=dev) < n_q[:, None]) & (Sd == mask).any(-1, keepdim=True)
        sel = q_at.gather(1, need)
        tok_sel, conf_sel = tok_q.gather(1, need), conf_q.gather(1, need)
        j = d0.max_j - 1
        if preds.logits.shape[0]:  # (positions without a logits row read row 0, and are dropped on the host)
            ids, gaps = top_token_gaps(preds.logits, sel.clamp(min=0).reshape(-1), tok_sel.clamp(min=0).reshape(-1),
                                       d0.max_j)
        else:  # no logits rows at all: nothing to select (an index into none would fault the device)
            ids = torch.zeros(R * w, j, dtype=torch.long, device=dev)
            gaps = torch.zeros(R * w, j, dtype=torch.float64, device=dev)
        return [Sd, Yq, order, n_q, taken, torch.stack(hits, 1), torch.stack(n_hits, 1), ok, tok_sel, conf_sel,
                ids.reshape(R, w, j), gaps.reshape(R, w, j)], at
