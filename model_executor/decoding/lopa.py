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

import torch

from .base import BlockDecoder, Prediction, Proposal, canvas_predictions, canvas_row_index, pad_rows, update_in_groups
from .policies import Policy, policy_key


class LoPADecoder(BlockDecoder):
    def __init__(self, block, mask_id, policy: Policy, branches: int = 3):
        super().__init__(block, mask_id)
        self.policy, self.k = policy, branches
        self.pred: Prediction | None = None  # the prediction of the current state (reused from its branch)
        self.branches: tuple[torch.Tensor, int] | None = None  # B0..Bk [k + 1, L] (B0 where none) and how many
        self.chosen = [0] * (branches + 1)

    def stats(self):
        return {"branch_chosen": self.chosen}

    @classmethod
    def propose_batch(cls, decoders):
        """The block's first step forwards the state; later ones the branches the last update explored."""
        return [Proposal([d.state]) if d.pred is None else
                Proposal(list(d.branches[0][: d.branches[1]]), d.branches, [d.t + 1] * d.branches[1])
                for d in decoders]

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """Eq. 2 over every branch of every decoder, B* per decoder, and the next B0..Bk from B*'s prediction
        for all of them (Eq. 1 and the lookahead branches), decoders of one policy and ``k`` at a time."""
        update_in_groups(cls._update, lambda d, p: (policy_key(d.policy), d.k, p.data is None), decoders,
                         proposals, preds, canvas_rows)

    @classmethod
    def _update(cls, decoders, proposals, preds, canvas_rows):
        first = decoders[0]
        mask, policy, k, verify = first.mask_id, first.policy, first.k, proposals[0].data is not None
        R, ar = len(decoders), torch.arange(len(decoders))
        if verify:
            B = pad_rows([p.data[0].T for p in proposals], -1).transpose(1, 2)  # [R, k + 1, L]
            exists = torch.arange(k + 1) < torch.tensor([p.data[1] for p in proposals])[:, None]
        else:
            B = pad_rows([d.state for d in decoders], -1)[:, None]
            exists = torch.ones(R, 1, dtype=torch.bool)
        rows = canvas_row_index(decoders, canvas_rows, B.shape[1])
        tok, conf = canvas_predictions(preds, rows, B, mask)
        masked = B == mask
        scores = torch.where(masked, conf, torch.zeros_like(conf)).sum(-1) / masked.sum(-1)  # Eq. 2
        j = scores.masked_fill(~exists, float("-inf")).argmax(-1)  # the first best branch on ties
        S, T, C = B[ar, j], tok[ar, j], conf[ar, j]  # B* and its prediction
        # B0 = π's commit; B_i = B0 plus the i-th most confident position left, filled with its prediction
        masked = S == mask
        b0 = torch.where(policy(C) & masked, T, S)
        rest = C.masked_fill(b0 != mask, float("-inf"))
        order = torch.sort(rest, dim=-1, descending=True, stable=True).indices
        L = S.shape[1]
        i = torch.arange(1, k + 1)
        valid = i <= torch.isfinite(rest).sum(-1, keepdim=True)  # [R, k]
        # under a grammar only B_1 extends B0's run from the frontier (a later branch leaves a gap: never valid)
        valid &= torch.tensor([d.grammar is None for d in decoders])[:, None] | (i == 1)
        pos = torch.zeros(R, k, L, dtype=torch.bool)
        if k and L:
            pos.scatter_(2, order[:, (i - 1).clamp(max=L - 1), None], valid[..., None])
        branches = torch.cat([b0[:, None], torch.where(pos, T[:, None], b0[:, None])], 1)  # [R, k + 1, L]
        n_br = 1 + valid.sum(-1)
        complete = ~(branches == mask).any(-1) & (torch.arange(k + 1) < n_br[:, None])
        done = complete.any(-1)  # a complete branch is taken at once, without a forward
        state = torch.where(done[:, None], branches[ar, complete.long().argmax(-1)], S)
        for r, (d, s, t, c, jj, nb, dn) in enumerate(zip(decoders, state, T, C, j.tolist(), n_br.tolist(),
                                                           done.tolist())):
            L_d = d.state.numel()
            d.pred = Prediction(t[:L_d], c[:L_d])
            if verify:  # B* is one step past the last state (every branch is: B0 plus lookahead positions)
                d.chosen[jj] += 1
                d.t += 1
            d.state = s[:L_d]
            d.branches = None if dn else (branches[r, :, :L_d], nb)
