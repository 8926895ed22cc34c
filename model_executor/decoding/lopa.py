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

from .base import BlockDecoder, Prediction, Proposal, canvas_predictions, canvas_row_index, host_rows, update_in_groups
from .policies import Policy, policy_key


class LoPADecoder(BlockDecoder):
    def __init__(self, block, mask_id, policy: Policy, branches: int = 3):
        super().__init__(block, mask_id)
        self.policy, self.k = policy, branches
        self.pred: Prediction | None = None  # the prediction of the current state (reused from its branch)
        self.branches: tuple[np.ndarray, int] | None = None  # B0..Bk [k + 1, L] (B0 where none) and how many
        self.chosen = [0] * (branches + 1)

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
        sums in torch, as the oracle's."""
        update_in_groups(cls._update, lambda d, p: (policy_key(d.policy), d.k, p.data is None), decoders,
                         proposals, preds, canvas_rows)

    @classmethod
    def _update(cls, decoders, proposals, preds, canvas_rows):
        first = decoders[0]
        mask, policy, k, verify = first.mask_id, first.policy, first.k, proposals[0].data is not None
        R, ar = len(decoders), np.arange(len(decoders))
        if verify:
            B = np.full((R, k + 1, max(p.data[0].shape[1] for p in proposals)), -1, dtype=np.int64)  # [R, k + 1, L]
            for r, p in enumerate(proposals):
                B[r, :, : p.data[0].shape[1]] = p.data[0]
            exists = np.arange(k + 1) < np.array([p.data[1] for p in proposals])[:, None]
        else:
            B = host_rows([(d.state,) for d in decoders])[0][:, None]
            exists = np.ones((R, 1), dtype=bool)
        rows = canvas_row_index(decoders, canvas_rows, B.shape[1]).numpy()
        tok, conf = canvas_predictions(preds, rows, B, mask)
        masked = B == mask
        scores = (torch.from_numpy(np.where(masked, conf, 0)).sum(-1)
                  / torch.from_numpy(masked.sum(-1))).numpy()  # Eq. 2
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
        valid &= np.array([d.grammar is None for d in decoders])[:, None] | (i == 1)
        pos = np.zeros((R, k, L), dtype=bool)
        if k and L:
            np.put_along_axis(pos, order[:, np.minimum(i - 1, L - 1), None], valid[..., None], axis=2)
        branches = np.concatenate([b0[:, None], np.where(pos, T[:, None], b0[:, None])], 1)  # [R, k + 1, L]
        n_br = 1 + valid.sum(-1)
        complete = ~(branches == mask).any(-1) & (np.arange(k + 1) < n_br[:, None])
        done = complete.any(-1)  # a complete branch is taken at once, without a forward
        state = torch.from_numpy(np.where(done[:, None], branches[ar, complete.argmax(-1)], S))
        Tt, Ct = torch.from_numpy(T), torch.from_numpy(C)
        for r, (d, jj, nb, dn) in enumerate(zip(decoders, j.tolist(), n_br.tolist(), done.tolist())):
            L_d = d.state.numel()
            d.pred = Prediction(Tt[r, :L_d], Ct[r, :L_d])
            if verify:  # B* is one step past the last state (every branch is: B0 plus lookahead positions)
                d.chosen[jj] += 1
                d.t += 1
            d.state = state[r, :L_d]
            d.branches = None if dn else (branches[r, :, :L_d], nb)
