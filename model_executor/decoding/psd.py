"""PSD: parallel speculative decoding (spatial policy + multi-depth draft DAG + hierarchical acceptance).

PSD paper §3.2, Alg. 1 (App. C). One loop iteration, from the current state and its prediction
``(x̂, c)``:

- Stage 1 (L6-8): the spatial policy π commits T(t) = π(c): ``x(t+1)``.
- Stage 2 (L13-15): σ = the still-masked positions sorted by the step-t confidences; each DAG node k
  owns a set S_k of σ-ranks and its draft is assembled by index (Eq. 2, no model call):
  ``x̃_k[i] = x̂[i] if i ∈ S_k else x(t+1)[i]``; the root (S = ∅) is ``x(t+1)`` itself.
- Stage 3 (L18): one batched forward verifies every draft (each draft canvas sees the shared prefix
  and itself only).
- Hierarchical acceptance (L19-22): the root is accepted; in topological order a node k is accepted when
  some accepted parent p satisfies π's own acceptance criterion on every newly speculated position
  i ∈ S_k \\ S_p: π applied to p's verification output commits i, and with the drafted token.
- L25-26: advance to the deepest accepted draft k* (most revealed positions) and commit the verifier's
  predictions at k* that pass π.

Choices the paper leaves open (see docs/paper-notes-psd-lopa.md, O1-O6), made here:
- A_π (O2): "position i would be committed by π from the parent's output, with the drafted token". For
  ``confidence`` that is "argmax equals the draft and confidence ≥ τ (or i is the parent's top-1)";
  for ``static`` "i is the parent's top-1 and the token agrees"; for ``localleap`` its anchor/window rule.
- L26 and the next iteration's L6 (O3): L26 commits π on k*'s verification output, which is exactly
  Stage 1 of the next iteration on the same state, so the verification output of k* *is* the next L6
  forward (same canvas, same context): one model call per iteration, identical tokens to the literal
  two-call reading. With an empty DAG (depth 0) PSD is therefore its spatial policy, forward for forward.
- Default DAG (O1): nested prefixes of σ, S_j = {σ_1..σ_j}, j = 1..depth (a chain); ``dag_shape: skip`` adds
  each prefix with one earlier rank left out (:meth:`DraftDAG.skip`, multi-parent). A calibrated graph can be
  given instead. Nodes asking for more ranks than
  there are masked positions are dropped; a draft that fills the whole block needs no forward.
- Ties in σ follow ``torch.sort(stable=True)`` (lower position first); ties in L25 prefer the earlier node.

One step of all requests at once (:meth:`PSDDecoder.propose_batch`, :meth:`PSDDecoder.update_batch`, decoders of
one policy and DAG together): σ by one sort, each node's draft for every request by index assembly (L13-15, Eq. 2), and
L20-22 node by node in topological order for all requests; a proposal's data are every node's draft and σ.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .base import (BlockDecoder, DeviceRowPredictions, Prediction, Proposal, canvas_predictions,
                   canvas_row_index, groups, host_rows, launch_key, update_in_groups)
from .policies import Policy, policy_key


@dataclass(frozen=True)
class DraftDAG:
    """Nodes as sets of σ-ranks (0-based), with parent indices; node 0 is the root (empty set)."""

    sets: tuple[frozenset[int], ...]
    parents: tuple[tuple[int, ...], ...]

    @classmethod
    def nested(cls, depth: int) -> "DraftDAG":
        sets = tuple(frozenset(range(j)) for j in range(depth + 1))
        return cls(sets, ((),) + tuple((j - 1,) for j in range(1, depth + 1)))

    @classmethod
    def skip(cls, depth: int) -> "DraftDAG":
        """The chain plus, at every depth j, the prefix {σ_1..σ_j} with one earlier rank left out: a rank that
        fails acceptance no longer stops the ranks after it (the node without it can still be accepted).
        ``depth * (depth + 1) / 2`` nodes besides the root; each node's parents are the nodes one rank smaller."""
        sets, parents, index = [frozenset()], [()], {frozenset(): 0}
        for j in range(1, depth + 1):
            full = frozenset(range(j))
            for s in [full - {r} for r in range(j - 1)] + [full]:  # the full prefix last: all below are parents
                index[s] = len(sets)
                sets.append(s)
                parents.append(tuple(sorted(index[s - {x}] for x in s if s - {x} in index)))
        return cls(tuple(sets), tuple(parents))

    @staticmethod
    def shaped(shape: str, depth: int) -> "DraftDAG":
        """The built-in DAG ``shape`` (:data:`DAG_SHAPES`) of ``depth``, built once (the DAG is immutable and
        every block of every request with these knobs shares it)."""
        if shape not in DAG_SHAPES:
            raise ValueError(f"PSD dag_shape {shape!r}; allowed: {', '.join(DAG_SHAPES)}")
        return _shaped(shape, depth)

    @staticmethod
    def size(shape: str, depth: int) -> int:
        """Nodes of the ``shape`` DAG of ``depth``, the root included."""
        return len(DraftDAG.shaped(shape, depth).sets)

    def __post_init__(self):
        if not self.sets or self.sets[0]:
            raise ValueError("draft DAG: node 0 must be the root with an empty set")
        for k, ps in enumerate(self.parents):
            for p in ps:
                if not (p < k and self.sets[p] < self.sets[k]):
                    raise ValueError(f"draft DAG: edge {p}->{k} must go from an earlier node to a strict superset")
            if k > 0 and not ps:
                raise ValueError(f"draft DAG: node {k} has no parent")

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth: the root 0, a node one more than its deepest parent (the chain's node j: j). A node
        is drawn as the state that many policy steps after the root (:mod:`.sampling`)."""
        out: list[int] = []
        for ps in self.parents:
            out.append(1 + max(out[p] for p in ps) if ps else 0)
        return tuple(out)


DAG_SHAPES = ("chain", "skip")  # the built-in draft DAGs: DraftDAG.nested, DraftDAG.skip


@functools.lru_cache(maxsize=None)
def _shaped(shape: str, depth: int) -> DraftDAG:
    return DraftDAG.nested(depth) if shape == "chain" else DraftDAG.skip(depth)


class PSDDecoder(BlockDecoder):
    device_update = True  # :meth:`_decide_on_device`

    def __init__(self, block, mask_id, policy: Policy, dag: DraftDAG):
        super().__init__(block, mask_id)
        self.policy, self.dag = policy, dag
        self.pred: Prediction | None = None  # the prediction the next drafts are assembled from
        self.accepted_depth = self.iterations = 0
        self.node_tried = [0] * len(dag.sets)
        self.node_accepted = [0] * len(dag.sets)
        # the last update's best node, each node's accepting parent, which nodes were forwarded, and σ (None: the
        # block's first forward, whose one canvas is the state)
        self.accepted_via: tuple | None = None

    def commit_canvases(self) -> np.ndarray | None:
        """Per block position, the canvas of the last step whose prediction row the token committed there was
        taken from: L26's commits from k*'s verification output, and an accepted draft's position from the
        canvas of the parent that accepted it (π on that parent's output committed the drafted token there),
        walking back from k* to the root along the accepting parents."""
        if self.accepted_via is None:
            return None
        best, via, F, sigma = self.accepted_via
        canvas = np.maximum(np.cumsum(F) - 1, 0)  # forwarded node -> its canvas
        out = np.full(self.state.numel(), canvas[best], dtype=np.int64)
        k = best
        while k > 0:
            p = int(via[k])
            out[sigma[sorted(self.dag.sets[k] - self.dag.sets[p])]] = canvas[p]
            k = p
        return out

    def stats(self):
        return {"accepted_positions": self.accepted_depth, "verify_iterations": self.iterations,
                "node_tried": self.node_tried, "node_accepted": self.node_accepted}

    @classmethod
    def propose_batch(cls, decoders):
        """L13-15 for every decoder, a DAG at a time: σ from one sort, each node's draft for all requests at
        once; the block's first step forwards the state. ``Proposal.data``: every node's draft ``[N, L]`` (the
        state where none), which exist ``[N]``, which are forwarded ``[N]`` (a draft that fills the block is
        not) and σ ``[L]`` (the masked positions first). Host data: numpy arrays (a step's few small arrays cost
        microseconds an op in numpy, tens as torch ops), the canvases tensors viewing them."""
        out: list = [Proposal([d.state]) for d in decoders]
        verify = [i for i, d in enumerate(decoders) if d.pred is not None]
        for idx in groups(verify, lambda i: decoders[i].dag):
            idx = [verify[i] for i in idx]
            group = [decoders[i] for i in idx]
            mask, dag = group[0].mask_id, group[0].dag
            S, T, C = host_rows([(d.state, d.pred.tokens, d.pred.conf) for d in group])
            C[S != mask] = -np.inf
            R, L = S.shape
            order = np.argsort(-C, axis=-1, kind="stable")  # L13: σ (descending; ties: the lower position first)
            n = np.isfinite(C).sum(-1)  # the masked positions a policy may commit (a grammar trims past its frontier)
            D = np.repeat(S[:, None], len(dag.sets), axis=1)  # [R, N, L]: every node's draft, the state where none
            E = np.zeros((R, len(dag.sets)), dtype=bool)
            for k, s in enumerate(dag.sets):  # L14-15: index assembly, Eq. 2
                ranks = sorted(s)
                if not ranks:
                    E[:, k] = True
                elif ranks[-1] < L:  # (else it asks for more ranks than any block of the group has)
                    pos = np.zeros((R, L), dtype=bool)
                    np.put_along_axis(pos, order[:, ranks], True, axis=1)
                    D[:, k] = np.where(pos, T, S)
                    E[:, k] = n > ranks[-1]  # nodes asking for more ranks than there are masks are dropped
            F = E & (D == mask).any(-1)  # a draft that fills the block needs no forward
            Dt = torch.from_numpy(D)
            for i, d, r, fl in zip(idx, group, range(R), F.tolist()):
                L_d = d.state.numel()
                out[i] = Proposal([Dt[r, k, :L_d] for k, fwd in enumerate(fl) if fwd],
                                  (D[r, :, :L_d], E[r], F[r], order[r, :L_d]),
                                  [d.t + dag.depths[k] for k, fwd in enumerate(fl) if fwd])
        return out

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """L18-26 for every decoder, a policy and DAG at a time: each node's verification under π,
        hierarchical acceptance node by node in topological order (all requests at once), the deepest accepted
        draft and Stage 1 on it (the block's first step: Stage 1 on the state's prediction, as a verification
        whose only node is the root; decoders on their block's first step and verifying ones update together)."""
        update_in_groups(cls._update, lambda d, p: (policy_key(d.policy), d.dag), decoders, proposals, preds,
                         canvas_rows)

    @staticmethod
    def _decide(first, preds, D, E, F, sigma, node_rows):
        """L19-26's decisions on host data (numpy): ``(best [R], via [R, N], next states [R, L], the best node's
        prediction tokens and confidences [R, L])``; ``via``: per node the parent that accepted it (the first in
        the DAG's order; the root itself, 0), -1 where not accepted; ``sigma`` None on the block's first forward."""
        mask, R, ar = first.mask_id, D.shape[0], np.arange(D.shape[0])
        tok, conf = canvas_predictions(preds, node_rows, D, mask)
        commits = first.policy(torch.from_numpy(conf)).numpy()  # what π commits from each node's verification output
        N = D.shape[1]
        via = np.full((R, N), -1, dtype=np.int64)
        via[:, 0] = 0
        if sigma is not None:
            dag = first.dag
            for k in range(1, N):  # L20-22: a parent accepted, verified, and π agreeing on every new position
                for p in dag.parents[k]:
                    new = sorted(dag.sets[k] - dag.sets[p])
                    if new[-1] >= sigma.shape[1]:  # node k exists in no block of the step
                        continue
                    pos = np.zeros(commits[:, p].shape, dtype=bool)
                    np.put_along_axis(pos, sigma[:, new], True, axis=1)
                    agree = commits[:, p] & (tok[:, p] == D[:, k])
                    ok = (via[:, p] >= 0) & F[:, p] & ~(pos & ~agree).any(-1) & E[:, k]
                    via[:, k] = np.where((via[:, k] < 0) & ok, p, via[:, k])
            size = np.array([len(s) for s in dag.sets])
            best = np.where(via >= 0, size * (N + 1) + N - np.arange(N), -1).argmax(-1)  # L25: deepest, earliest
        else:
            best = np.zeros(R, dtype=np.int64)
        fb = F[ar, best]
        state = torch.from_numpy(np.where(commits[ar, best] & fb[:, None], tok[ar, best], D[ar, best]))  # L26
        return best, via, state, torch.from_numpy(tok[ar, best]), torch.from_numpy(conf[ar, best])

    @classmethod
    def _decide_on_device(cls, first, preds: DeviceRowPredictions, D, E, F, sigma, node_rows, pending=None):
        """:meth:`_decide` where the predictions are (tensor ops; the policy's tensor form), decision for
        decision: the drafts, the nodes' rows, σ and the DAG's index lists go up in one copy, and the decisions
        (with each block's count of non-finite predictions: one raises, nothing is stepped) come back in one;
        ``pending``: that copy, queued when they were taken ahead (:meth:`launch_batch`)."""
        if pending is not None:
            cols = pending.columns()
        else:
            dev, at = cls._device_decisions(first, preds, D, E, F, sigma, node_rows)
            cols = preds.read_back_columns(dev, at)
        state, tok_b, conf_b, best, via = cols
        return (best.astype(np.int64), via.astype(np.int64), torch.from_numpy(state.astype(np.int64)),
                torch.from_numpy(tok_b.astype(np.int64)), torch.from_numpy(conf_b).to(preds.conf.dtype))

    @staticmethod
    def _device_decisions(first, preds: DeviceRowPredictions, D, E, F, sigma, node_rows, key: str = "psd"):
        """:meth:`_decide_on_device`'s decisions, left where they are: ``([next states, the best node's tokens
        and confidences [R, L], best [R], via [R, N]], the nodes' logits rows)``; the host arrays go up through
        the engine's staging buffer ``key``."""
        mask, (R, N, L), dag = first.mask_id, D.shape, first.dag
        # the DAG's rank lists, each (k, p) edge's new ranks σ-indexed; with the node sizes, one index array
        edges, flat = [], []
        if sigma is not None:
            for k in range(1, N):
                for p in dag.parents[k]:
                    new = sorted(dag.sets[k] - dag.sets[p])
                    if new[-1] < L:  # (else node k exists in no block of the step)
                        edges.append((k, p, len(flat), len(new)))
                        flat.extend(new)
        size = np.array([len(s) for s in dag.sets]) if sigma is not None else np.zeros(N, dtype=np.int64)
        Dd, at, Ed, Fd, size, ranks, sig = preds.upload(key, [
            D, preds.logits_rows(node_rows), E, F, size, np.array(flat, dtype=np.int64),
            sigma if sigma is not None else np.zeros(0, dtype=np.int64)])
        Ed, Fd = Ed.bool(), Fd.bool()
        tok, conf = preds.gather(at, Dd, mask)
        commits = first.policy(conf)  # on the device: the policy's tensor form
        via = torch.full((R, N), -1, dtype=torch.long, device=Dd.device)
        via[:, 0] = 0
        if sigma is not None:
            for k, p, a, n in edges:  # (in order of k, then of k's parents: the host's loop)
                pos = torch.zeros((R, L), dtype=torch.bool, device=Dd.device)
                pos.scatter_(1, sig.index_select(1, ranks[a: a + n]), True)
                agree = commits[:, p] & (tok[:, p] == Dd[:, k])
                ok = (via[:, p] >= 0) & Fd[:, p] & ~(pos & ~agree).any(-1) & Ed[:, k]
                via[:, k] = torch.where((via[:, k] < 0) & ok, p, via[:, k])
            order = torch.arange(N, device=Dd.device)
            best = torch.where(via >= 0, size * (N + 1) + N - order, torch.full_like(size, -1)).argmax(-1)
        else:
            best = torch.zeros(R, dtype=torch.long, device=Dd.device)
        ar = torch.arange(R, device=Dd.device)
        state = torch.where(commits[ar, best] & Fd[ar, best][:, None], tok[ar, best], Dd[ar, best])
        return [state, tok[ar, best], conf[ar, best], best, via], at

    @staticmethod
    def _inputs(decoders, proposals, canvas_rows):
        """What a step's decisions read of its decoders' proposals (host arrays): ``(verify, D [R, N, L], E, F
        [R, N], σ [R, L], the nodes' prediction rows [R, N, L])``; ``verify`` False where every block takes its
        first forward (then one node, the root: the state)."""
        verify, first = any(p.data is not None for p in proposals), decoders[0]
        R = len(decoders)
        rows = canvas_row_index(decoders, canvas_rows).numpy()  # [R, K, L]
        if not verify:  # every block's first forward: Stage 1 on the state's prediction
            D = host_rows([(d.state,) for d in decoders])[0][:, None]  # [R, 1, L]
            E = F = np.ones((R, 1), dtype=bool)
            node_rows = rows[:, :1]
        else:
            N, L = len(first.dag.sets), rows.shape[-1]
            D = np.full((R, N, L), -1, dtype=np.int64)
            sigma = np.zeros((R, L), dtype=np.int64)
            E, F = np.zeros((R, N), dtype=bool), np.zeros((R, N), dtype=bool)
            for r, (p, d) in enumerate(zip(proposals, decoders)):
                if p.data is None:  # its block's first forward: the root alone, the state's prediction
                    D[r, 0, : d.state.numel()] = d.state.numpy()
                    E[r, 0] = F[r, 0] = True
                    continue
                D[r, :, : p.data[0].shape[1]] = p.data[0]
                sigma[r, : p.data[3].size] = p.data[3]
                E[r], F[r] = p.data[1], p.data[2]
            # forwarded node k of request r is its canvas (number of forwarded nodes before k)
            canvas = np.maximum(F.cumsum(-1) - 1, 0)
            node_rows = np.take_along_axis(rows, canvas[..., None], axis=1)
            node_rows = np.where(F[..., None], node_rows, -1)
        return verify, D, E, F, sigma if verify else None, node_rows

    @classmethod
    def launch_batch(cls, decoders, proposals, preds, canvas_rows):
        """:meth:`update_batch`'s decisions taken ahead (:func:`~.base.launch_all`), a policy and DAG at a time as
        it groups them, their copy queued for it; and from them, where they are, the next step's canvases
        (:meth:`_next_canvases`): per decoder ``[K, L]``, ``K`` what :meth:`canvases_ahead` bounds them by."""
        out = [None] * len(decoders)
        for idx in groups(decoders, lambda d: (policy_key(d.policy), d.dag)):
            group, props = [decoders[i] for i in idx], [proposals[i] for i in idx]
            rows = [canvas_rows[i] for i in idx]
            verify, D, E, F, sigma, node_rows = cls._inputs(group, props, rows)
            # (each group's upload a buffer of its own: none is waited for before the next group's)
            cols, at = cls._device_decisions(group[0], preds, D, E, F, sigma, node_rows,
                                             f"psd-ahead/{len(preds.launched)}")
            preds.launched[launch_key(group, rows)] = preds.read_back_later(cols, at)
            state, tok_b, conf_b = cols[:3]
            K = [d.canvases_ahead(p) for d, p in zip(group, props)]
            canv = cls._next_canvases(group[0], state, tok_b, conf_b, max(K))
            for r, (i, k) in enumerate(zip(idx, K)):
                out[i] = canv[r, :k, : decoders[i].state.numel()]
        return out

    @staticmethod
    def _next_canvases(first, S, T, C, K: int) -> torch.Tensor:
        """:meth:`propose_batch` of the next states ``S [R, L]`` and the best node's prediction (tokens ``T``,
        confidences ``C``) where they are, its first ``K`` forwarded canvases ``[R, K, L]`` (the state, then the
        drafts, in node order; past a block's own count, the state again: rows that decode nothing). Decision for
        decision the host's: σ by a stable sort (ties: the lower position first; numpy's stable argsort of the
        negation orders them alike), each node's draft by index, dropped where it asks for
        more ranks than there are masks, forwarded where a mask is left. A block the step completes has no
        next step (its canvases are the state: whatever they are, no one reads them)."""
        mask, dag, (R, L) = first.mask_id, first.dag, S.shape
        C = torch.where(S == mask, C, torch.full_like(C, float("-inf")))
        order = torch.sort(-C, dim=-1, stable=True).indices  # L13: σ
        n = torch.isfinite(C).sum(-1)
        D = S[:, None].repeat(1, len(dag.sets), 1)  # [R, N, L]
        E = torch.zeros((R, len(dag.sets)), dtype=torch.bool, device=S.device)
        for k, s in enumerate(dag.sets):  # L14-15: index assembly, Eq. 2
            ranks = sorted(s)
            if not ranks:
                E[:, k] = True
            elif ranks[-1] < L:
                pos = torch.zeros((R, L), dtype=torch.bool, device=S.device)
                pos.scatter_(1, order[:, ranks], True)
                D[:, k] = torch.where(pos, T, S)
                E[:, k] = n > ranks[-1]
        F = E & (D == mask).any(-1)
        D = torch.where(F[..., None], D, S[:, None])  # (a dropped node's draft may hold -1: no forward reads it)
        forwarded = torch.sort((~F).to(torch.int8), dim=-1, stable=True).indices[:, :K]  # in node order
        return D.gather(1, forwarded[..., None].expand(R, forwarded.shape[1], L))

    def canvases_ahead(self, proposal: Proposal) -> int:
        """The next step's canvases are at most this one's: a node is forwarded while its ranks are within the
        masks and fewer than them (:meth:`propose_batch`), and masks only shrink. After a block's first forward
        (the state alone) they are at most the nodes forwarded with one mask fewer than the state has (the policy
        commits one at least)."""
        if proposal.data is not None:
            return len(proposal.canvases)
        m = int(np.count_nonzero(proposal.canvases[0].numpy() == self.mask_id)) - 1
        return sum(1 for s in self.dag.sets if not s or (max(s) < m and len(s) < m))

    @classmethod
    def _update(cls, decoders, proposals, preds, canvas_rows):
        first = decoders[0]
        verifies = [p.data is not None for p in proposals]
        ar = np.arange(len(decoders))
        verify, D, E, F, sigma, node_rows = cls._inputs(decoders, proposals, canvas_rows)
        if isinstance(preds, DeviceRowPredictions):
            pending = (preds.launched or {}).pop(launch_key(decoders, canvas_rows), None)
            best, via, state, tok_b, conf_b = cls._decide_on_device(first, preds, D, E, F, sigma, node_rows, pending)
        else:
            best, via, state, tok_b, conf_b = cls._decide(first, preds, D, E, F, sigma, node_rows)
        acc = via >= 0
        N = D.shape[1]
        size = np.array([len(s) for s in first.dag.sets]) if verify else np.zeros(1, dtype=np.int64)
        past = np.array(first.dag.depths if verify else (0,))[best].tolist()  # k*'s steps past the root
        fb = F[ar, best]
        tried, accepted = (E & (np.arange(N) > 0)).tolist(), (acc & (np.arange(N) > 0)).tolist()
        for r, (d, f, depth) in enumerate(zip(decoders, fb.tolist(), size[best].tolist())):
            L_d = d.state.numel()
            d.state = state[r, :L_d]
            d.t += past[r] + 1  # k*'s steps, then L26's commit
            if f:
                d.pred = Prediction(tok_b[r, :L_d], conf_b[r, :L_d])
            # what commit_canvases reads (views of the step's arrays: nothing computed unless logprobs ask)
            d.accepted_via = (int(best[r]), via[r], F[r], sigma[r]) if verifies[r] else None
            if verifies[r]:
                d.accepted_depth += depth
                d.iterations += 1
                d.node_tried = [a + b for a, b in zip(d.node_tried, tried[r])]
                d.node_accepted = [a + b for a, b in zip(d.node_accepted, accepted[r])]
