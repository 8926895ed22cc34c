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

from .base import BlockDecoder, Prediction, commit, predict
from .policies import Policy


class LoPADecoder(BlockDecoder):
    def __init__(self, block, mask_id, policy: Policy, branches: int = 3):
        super().__init__(block, mask_id)
        self.policy, self.k = policy, branches
        self.pred: Prediction | None = None
        self.branches: list[torch.Tensor] = []
        self.chosen = [0] * (branches + 1)

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

    def canvases(self):
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
