"""LoPA: lookahead parallel decoding (branch exploration over token-filling orders).

LoPA Alg. 1, per iteration, from the current state and its prediction (reused from the last forward):

- anchor branch B0 = the spatial policy's commit (Eq. 1: positions above τ, else the top-1);
- lookahead branches B_j = B0 plus one more position p_j, the j-th most confident position still masked
  in B0 (by the same prediction), filled with its predicted token, j = 1..k;
- one batched forward over {B0..Bk}; branch confidence Eq. 2: C(B) = mean confidence over B's remaining
  masked positions (of the current block), each branch scored by its own forward;
- keep B* = argmax C and reuse its prediction for the next iteration (logits reuse).

Choices the paper leaves open (docs/paper-notes-psd-lopa.md, O7-O10), made here: confidence = max
softmax probability; the token at p_j is the prediction's token (greedy, or the step's draw when sampling:
every branch is drawn as the state one step ahead, :mod:`.sampling`); Eq. 2 is
averaged over the current block only; ties prefer the anchor, then the lower j; if B0 completes the
block no forward is run, and a branch that completes the block (no masks left, Eq. 2 undefined) is
taken at once without a forward. With k = 0 LoPA is its spatial policy, forward for forward.

One step of all requests at once (:meth:`LoPADecoder.propose_batch`, :meth:`LoPADecoder.update_batch`, decoders
of one policy and k together): Eq. 2 for every branch of every request in one reduction, B* per request, and
the next B0..Bk from B*'s prediction by one sort; the branches wait on the decoder (its state for the next
step) and travel in the proposal (its data: all k + 1 branches and how many exist).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import (BlockDecoder, DeviceRowPredictions, Prediction, Proposal, canvas_predictions, canvas_row_index,
                   groups, launch_key, update_in_groups)
from .policies import Policy, policy_key


def branch_scores(conf: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Eq. 2, ``[..., L] -> [...]``: each branch's mean confidence over its masked positions, in float64. Greedy, a
    block's top-1 confidences are each at least 1 / V, so their float32 (or bfloat16) values sum exactly in float64
    for any vocabulary under 2^22, in any order: the host's reduction and an accelerator's give the same scores,
    and the same branch wins (a drawn token's confidence may be smaller, and float64 confidences, from a float64
    model, carry more bits than float64 sums exactly: then only float64's rounding could tell two orders apart).
    NaN for a branch without masks (the caller never ranks one)."""
    return torch.where(masked, conf.double(), 0.0).sum(-1) / masked.sum(-1)


class LoPADecoder(BlockDecoder):
    def __init__(self, block, mask_id, policy: Policy, branches: int = 3):
        super().__init__(block, mask_id)
        self.policy, self.k = policy, branches
        self.pred: Prediction | None = None  # the prediction of the current state (reused from its branch)
        self.branches: tuple[np.ndarray, int] | None = None  # B0..Bk [k + 1, L] (B0 where none) and how many
        self.chosen = [0] * (branches + 1)

    device_update = True  # :meth:`_decide_on_device`

    def stats(self):
        return {"branch_chosen": self.chosen}

    @classmethod
    def propose_batch(cls, decoders):
        """The block's first step forwards the state; later ones the branches the last update explored."""
        return [Proposal([d.state]) if d.pred is None else
                Proposal(list(torch.from_numpy(d.branches[0][: d.branches[1]])), d.branches, [d.t + 1] * d.branches[1])
                for d in decoders]

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """Eq. 2 over every branch of every decoder, B* per decoder, and the next B0..Bk from B*'s prediction
        for all of them (Eq. 1 and the lookahead branches), decoders of one policy and ``k`` at a time. Host data:
        numpy arrays (a step's few small arrays cost microseconds an op in numpy, tens as torch ops); Eq. 2's
        sums in torch, in float64 as the oracle's. Where the predictions are on an accelerator the same rule runs
        there (:meth:`_decide_on_device`)."""
        update_in_groups(cls._update, lambda d, p: (policy_key(d.policy), d.k), decoders,
                         proposals, preds, canvas_rows)

    def canvases_ahead(self, proposal: Proposal) -> int:
        """The next step's branches are at most this one's: B0 has fewer masks each step (B* has at most B0's, and
        the policy commits one at least), and a lookahead branch is one of B0's masks. After a block's first
        forward (the state alone) they are at most one more than the state's masks less one, and ``k + 1``."""
        if proposal.data is not None:
            return len(proposal.canvases)
        m = int(np.count_nonzero(proposal.canvases[0].numpy() == self.mask_id)) - 1
        return 1 + max(0, min(self.k, m))

    @classmethod
    def launch_batch(cls, decoders, proposals, preds, canvas_rows):
        """:meth:`update_batch`'s decisions taken ahead (:func:`~.base.launch_all`), a policy and ``k`` at a time
        as it groups them, their copy queued for it; the next step's canvases are the next branches, made there
        by the same decisions: per decoder ``[K, L]``, ``K`` what :meth:`canvases_ahead` bounds them by (past a
        block's own count, B0 again: rows that decode nothing)."""
        out = [None] * len(decoders)
        for idx in groups(decoders, lambda d: (policy_key(d.policy), d.k)):
            group, props = [decoders[i] for i in idx], [proposals[i] for i in idx]
            rows = [canvas_rows[i] for i in idx]
            first = group[0]
            B, exists, at_rows = cls._inputs(group, props, rows)
            # (each group's upload a buffer of its own: none is waited for before the next group's)
            cols, at = cls._device_decisions(first.mask_id, first.policy, first.k, preds, B, exists, at_rows,
                                             f"lopa-ahead/{len(preds.launched)}")
            preds.launched[launch_key(group, rows)] = preds.read_back_later(cols, at)
            branches = cols[3]
            for r, (i, d, p) in enumerate(zip(idx, group, props)):
                out[i] = branches[r, : d.canvases_ahead(p), : d.state.numel()]
        return out

    @staticmethod
    def _inputs(decoders, proposals, canvas_rows):
        """What a step's decisions read of its decoders' proposals (host arrays): ``(B [R, k + 1, L], which
        branches exist [R, k + 1], their prediction rows)``; a block on its first forward takes part as a
        verification of one branch (its state)."""
        k, R = decoders[0].k, len(decoders)
        B = np.full((R, k + 1, max(d.state.numel() for d in decoders)), -1, dtype=np.int64)  # [R, k + 1, L]
        n = np.ones(R, dtype=np.int64)
        for r, (d, p) in enumerate(zip(decoders, proposals)):
            if p.data is not None:
                B[r, :, : p.data[0].shape[1]] = p.data[0]
                n[r] = p.data[1]
            else:
                B[r, 0, : d.state.numel()] = d.state.numpy()
        exists = np.arange(k + 1) < n[:, None]
        return B, exists, canvas_row_index(decoders, canvas_rows, B.shape[1]).numpy()

    @classmethod
    def _update(cls, decoders, proposals, preds, canvas_rows):
        """One group's step: a block on its first forward takes part as a verification of one branch (its state),
        so that a step of mixed blocks makes one update (on an accelerator, one copy back)."""
        first = decoders[0]
        mask, policy, k = first.mask_id, first.policy, first.k
        verify = [p.data is not None for p in proposals]
        B, exists, rows = cls._inputs(decoders, proposals, canvas_rows)
        if isinstance(preds, DeviceRowPredictions):
            pending = (preds.launched or {}).pop(launch_key(decoders, canvas_rows), None)
            j, state, T, C, branches, n_br, done = cls._decide_on_device(mask, policy, k, preds, B, exists, rows,
                                                                         pending)
        else:
            free = np.array([d.grammar is None for d in decoders])
            j, state, T, C, branches, n_br, done = cls._decide(mask, policy, k, preds, B, exists, rows, free)
        for r, (d, jj, nb, dn) in enumerate(zip(decoders, j.tolist(), n_br.tolist(), done.tolist())):
            L_d = d.state.numel()
            d.pred = Prediction(T[r, :L_d], C[r, :L_d])
            if verify[r]:  # B* is one step past the last state (every branch is: B0 plus lookahead positions)
                d.chosen[jj] += 1
                d.t += 1
            d.state = state[r, :L_d]
            d.branches = None if dn else (branches[r, :, :L_d], nb)

    @staticmethod
    def _decide(mask, policy, k, preds, B, exists, rows, free):
        """Eq. 2 over the branches ``B [R, k + 1, L]`` (``exists``: which are real; ``rows``: their prediction
        rows), B* per block, and the next B0..Bk from B*'s prediction, on host data (numpy; ``free``: the blocks
        without a grammar). Returns ``(j [R], next states, B*'s prediction tokens and confidences [R, L] (torch),
        the next branches [R, k + 1, L], how many exist [R], whether a complete one was taken [R])``."""
        R, ar = B.shape[0], np.arange(B.shape[0])
        tok, conf = canvas_predictions(preds, rows, B, mask)
        masked = B == mask
        scores = branch_scores(torch.from_numpy(conf), torch.from_numpy(masked)).numpy()
        j = np.where(exists, scores, -np.inf).argmax(-1)  # the first best branch on ties
        S, T, C = B[ar, j], tok[ar, j], conf[ar, j]  # B* and its prediction
        # B0 = π's commit; B_i = B0 plus the i-th most confident position left, filled with its prediction
        masked = S == mask
        b0 = np.where(policy(torch.from_numpy(C)).numpy() & masked, T, S)
        rest = np.where(b0 != mask, -np.inf, C)
        order = np.argsort(-rest, axis=-1, kind="stable")  # descending; ties: the lower position first
        L = S.shape[1]
        i = np.arange(1, k + 1)
        valid = i <= np.isfinite(rest).sum(-1, keepdims=True)  # [R, k]
        # under a grammar only B_1 extends B0's run from the frontier (a later branch leaves a gap: never valid)
        valid &= free[:, None] | (i == 1)
        pos = np.zeros((R, k, L), dtype=bool)
        if k and L:
            np.put_along_axis(pos, order[:, np.minimum(i - 1, L - 1), None], valid[..., None], axis=2)
        branches = np.concatenate([b0[:, None], np.where(pos, T[:, None], b0[:, None])], 1)  # [R, k + 1, L]
        n_br = 1 + valid.sum(-1)
        complete = ~(branches == mask).any(-1) & (np.arange(k + 1) < n_br[:, None])
        done = complete.any(-1)  # a complete branch is taken at once, without a forward
        state = torch.from_numpy(np.where(done[:, None], branches[ar, complete.argmax(-1)], S))
        return j, state, torch.from_numpy(T), torch.from_numpy(C), branches, n_br, done

    @classmethod
    def _decide_on_device(cls, mask, policy, k, preds: DeviceRowPredictions, B, exists, rows, pending=None):
        """:meth:`_decide` where the predictions are (tensor ops, no host read, no data-dependent shape; no grammar:
        :func:`~.base.decide_on_device`), decision for decision: the branches, which exist and their rows go up in
        one copy, the decisions (with each block's count of non-finite predictions: one raises, nothing is
        stepped) come back in one; ``pending``: that copy, queued when they were taken ahead
        (:meth:`launch_batch`). Eq. 2 sums exactly in float64 here as on the host, so its order (the device's
        reduction) decides nothing; sorts are stable, argmaxes take the first maximum, as numpy's."""
        if pending is not None:
            cols = pending.columns()
        else:
            dev, at = cls._device_decisions(mask, policy, k, preds, B, exists, rows)
            cols = preds.read_back_columns(dev, at)  # the step's one copy back
        state, T, C, branches, j, n_br, done = cols
        return (j.astype(np.int64), torch.from_numpy(state.astype(np.int64)), torch.from_numpy(T.astype(np.int64)),
                torch.from_numpy(C).to(preds.conf.dtype), branches.astype(np.int64), n_br.astype(np.int64), done > 0)

    @staticmethod
    def _device_decisions(mask, policy, k, preds: DeviceRowPredictions, B, exists, rows, key: str = "lopa"):
        """:meth:`_decide_on_device`'s decisions, left where they are: ``([next states, B*'s prediction tokens and
        confidences [R, L], the next branches [R, k + 1, L], j, how many branches, done [R]], the branches'
        logits rows)``; the host arrays go up through the engine's staging buffer ``key``."""
        R, _, L = B.shape
        Bd, at, ex = preds.upload(key, [B, preds.logits_rows(rows), exists])
        tok, conf = preds.gather(at, Bd, mask)
        scores = branch_scores(conf, Bd == mask)
        j = torch.where(ex.bool(), scores, float("-inf")).argmax(-1)
        ar = torch.arange(R, device=Bd.device)
        S, T, C = Bd[ar, j], tok[ar, j], conf[ar, j]
        b0 = torch.where(policy(C) & (S == mask), T, S)
        rest = torch.where(b0 != mask, torch.full_like(C, float("-inf")), C)
        order = torch.sort(-rest, dim=-1, stable=True).indices  # descending; ties: the lower position first
        i = torch.arange(1, k + 1, device=Bd.device)
        valid = i <= torch.isfinite(rest).sum(-1, keepdim=True)  # [R, k]
        pos = torch.zeros(R, k, L, dtype=torch.bool, device=Bd.device)
        if k and L:
            pos.scatter_(2, order[:, (i - 1).clamp(max=L - 1), None], valid[..., None])
        branches = torch.cat([b0[:, None], torch.where(pos, T[:, None], b0[:, None])], 1)  # [R, k + 1, L]
        n_br = 1 + valid.sum(-1)
        complete = ~(branches == mask).any(-1) & (torch.arange(k + 1, device=Bd.device) < n_br[:, None])
        done = complete.any(-1)
        state = torch.where(done[:, None], branches[ar, complete.int().argmax(-1)], S)
        return [state, T, C, branches, j, n_br, done], at
