"""LoPA: lookahead parallel decoding (branch exploration over token-filling orders).

LoPA Alg. 1, per iteration, from the current state and its prediction (reused from the last forward):

- anchor branch B0 = the spatial policy's commit (Eq. 1: positions above τ, else the top-1);
- lookahead branches B_j = B0 plus one more position p_j, the j-th most confident position still masked
  in B0 (by the same prediction), filled with its predicted token, j = 1..k;
- one batched forward over {B0..Bk}; branch confidence Eq. 2: C(B) = mean confidence over B's remaining
  masked positions (of the current block), each branch scored by its own forward;
- keep B* = argmax C and reuse its prediction for the next iteration (logits reuse).

Choices the paper leaves open (docs/paper-notes-psd-lopa.md, O7-O10), made here: confidence = max
softmax probability; the token at p_j is the prediction's argmax (no fresh sample, greedy); Eq. 2 is
averaged over the current block only; ties prefer the anchor, then the lower j; if B0 completes the
block no forward is run, and a branch that completes the block (no masks left, Eq. 2 undefined) is
taken at once without a forward. With k = 0 LoPA is its spatial policy, forward for forward.
"""

from __future__ import annotations

import torch

from .base import BlockDecoder, Prediction, canvas_predictions, commit, pad_rows, predict
from .policies import Policy, policy_key


class LoPADecoder(BlockDecoder):
    def __init__(self, block, mask_id, policy: Policy, branches: int = 3):
        super().__init__(block, mask_id)
        self.policy, self.k = policy, branches
        self.pred: Prediction | None = None
        self.branches: list[torch.Tensor] = []
        self.chosen = [0] * (branches + 1)
        self._batch: tuple[torch.Tensor, int] | None = None  # (all k + 1 branches [k + 1, L], how many exist)

    def _explore(self, pred: Prediction) -> None:
        """Build B0..Bk from the prediction of the current state; commit at once when one is complete."""
        b0 = commit(self.state, pred, self.policy(pred.conf) & self.masked)
        rest = torch.where(b0 == self.mask_id, pred.conf, torch.full_like(pred.conf, float("-inf")))
        n = int(torch.isfinite(rest).sum())
        self.branches = [b0]
        if n:
            for p in torch.sort(rest, descending=True, stable=True).indices[: min(self.k, n)]:
                b = b0.clone()
                b[p] = pred.tokens[p]
                self.branches.append(b)
        complete = [b for b in self.branches if not (b == self.mask_id).any()]
        if complete:
            self.state, self.branches = complete[0], []
        else:  # update_batch's layout: k + 1 rows, B0 where a branch does not exist
            self._batch = (torch.stack(self.branches + [b0] * (self.k + 1 - len(self.branches))), len(self.branches))

    def propose(self):
        return [self.state] if self.pred is None else self.branches

    def update(self, logits):
        if self.pred is None:
            self.pred = predict(logits[0], self.state, self.mask_id)
        else:
            preds = [predict(lg, b, self.mask_id) for lg, b in zip(logits, self.branches)]
            # Eq. 2: each branch's mean confidence over its masked positions, all branches in one reduction;
            # the first best branch on ties (argmax)
            conf = torch.stack([p.conf for p in preds])
            masked = torch.stack(self.branches).to(conf.device) == self.mask_id
            scores = torch.where(masked, conf, torch.zeros_like(conf)).sum(-1) / masked.sum(-1)
            j = int(scores.argmax())
            self.chosen[j] += 1
            self.state, self.pred = self.branches[j], preds[j]
        self._explore(self.pred)

    def stats(self):
        return {"branch_chosen": self.chosen}

    # ------------------------------------------------------------------ every request of a step at once
    def batch_key(self):
        return ("first" if self.pred is None else "verify"), policy_key(self.policy), self.mask_id, self.k

    @classmethod
    def update_batch(cls, decoders, preds, rows):
        """Eq. 2 over every branch of every decoder, B* per decoder, and the next B0..Bk from B*'s prediction
        for all of them (:meth:`_explore`, batched)."""
        first = decoders[0]
        mask, policy, k, verify = first.mask_id, first.policy, first.k, first.pred is not None
        R, ar = len(decoders), torch.arange(len(decoders))
        if verify:
            B = pad_rows([d._batch[0].T for d in decoders], -1).transpose(1, 2)  # [R, k + 1, L]
            exists = torch.arange(k + 1) < torch.tensor([d._batch[1] for d in decoders])[:, None]
        else:
            B = pad_rows([d.state for d in decoders], -1)[:, None]
            exists = torch.ones(R, 1, dtype=torch.bool)
        K = B.shape[1]
        rows = torch.cat([rows, rows.new_full((R, K - rows.shape[1], rows.shape[2]), -1)], 1)[:, :K]
        tok, conf = canvas_predictions(preds, rows, B, mask)
        masked = B == mask
        scores = torch.where(masked, conf, torch.zeros_like(conf)).sum(-1) / masked.sum(-1)  # Eq. 2
        j = scores.masked_fill(~exists, float("-inf")).argmax(-1)
        S, T, C = B[ar, j], tok[ar, j], conf[ar, j]  # B* and its prediction
        # _explore for every decoder: B0 = π's commit; B_i = B0 plus the i-th most confident position left
        masked = S == mask
        b0 = torch.where(policy(C) & masked, T, S)
        rest = C.masked_fill(b0 != mask, float("-inf"))
        order = torch.sort(rest, dim=-1, descending=True, stable=True).indices
        L = S.shape[1]
        i = torch.arange(1, k + 1)
        valid = i <= torch.isfinite(rest).sum(-1, keepdim=True)  # [R, k]
        pos = torch.zeros(R, k, L, dtype=torch.bool)
        if k and L:
            pos.scatter_(2, order[:, (i - 1).clamp(max=L - 1), None], valid[..., None])
        branches = torch.cat([b0[:, None], torch.where(pos, T[:, None], b0[:, None])], 1)  # [R, k + 1, L]
        n_br = 1 + valid.sum(-1)
        complete = ~(branches == mask).any(-1) & (torch.arange(k + 1) < n_br[:, None])
        done = complete.any(-1)
        state = torch.where(done[:, None], branches[ar, complete.long().argmax(-1)], S)
        for r, (d, s, t, c, jj, nb, dn) in enumerate(zip(decoders, state, T, C, j.tolist(), n_br.tolist(),
                                                           done.tolist())):
            L_d = d.state.numel()
            d.pred = Prediction(t[:L_d], c[:L_d])
            if verify:
                d.chosen[jj] += 1
            if dn:
                d.state, d.branches, d._batch = s[:L_d], [], None
            else:
                br = branches[r, :, :L_d]
                d.state, d.branches, d._batch = s[:L_d], list(br[:nb]), (br, nb)
