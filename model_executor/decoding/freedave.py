"""FreeDave (Wu & Zhang): free draft-and-verification, lossless with respect to static decoding.

Alg. 2, per iteration, from the current state ``x`` and its prediction ``x0_est`` (reused, not recomputed):

- L5-13  drafts: draft ``k`` = ``x`` with the ``k`` most confident masked positions of ``x0_est`` filled
  (the static scheduler's k-step jump from one estimate), ``k = 1..d_i``; draft 1 is exactly the next
  static state.
- L18    one batched forward over the drafts gives each draft's own prediction.
- L19-35 target ``k`` = draft ``k`` plus one static step from its own prediction; accept the longest run
  ``m`` with ``draft[k+1] == target[k]``.
- L36-37 jump to draft ``m+1`` and reuse its prediction.

Theorem 1: each accepted draft equals the state static decoding reaches, and its prediction is the one
static decoding would compute there, so the output is token-identical (given batch-invariant numerics;
the tests use float64).

Choices the paper leaves open, made here:
- ``d_i = min(d, n - 1)`` with ``n`` masked positions left: a draft that completes the block needs no
  forward, and with one mask left the last token is committed from the reused prediction with no forward
  (Alg. 2 L14-17). The NFE of a block is therefore ``1 + iterations``.
- Drafts never cross the block boundary (semi-autoregressive decoding finishes a block first).
- Greedy only: lossless sampling needs the sample coupled across drafts; ``temperature > 0`` is refused.
"""

from __future__ import annotations

import torch

from .base import BlockDecoder, Prediction, commit, predict


def topk_jump(state: torch.Tensor, pred: Prediction, k: int) -> torch.Tensor:
    """``state`` with the ``k`` most confident masked positions of ``pred`` filled (static scheduler, k steps)."""
    k = min(k, int(torch.isfinite(pred.conf).sum()))
    pos = torch.zeros_like(state, dtype=torch.bool)
    if k > 0:
        pos[pred.conf.topk(k).indices] = True
    return commit(state, pred, pos)


class FreeDaveDecoder(BlockDecoder):
    def __init__(self, block, mask_id, steps: int = 4):
        super().__init__(block, mask_id)
        self.steps = steps
        self.pred: Prediction | None = None
        self.drafts: list[torch.Tensor] = []
        self.accepted = self.iterations = 0

    def canvases(self):
        if self.pred is None:
            return [self.state]
        n = int(self.masked.sum())
        self.drafts = [topk_jump(self.state, self.pred, k) for k in range(1, min(self.steps, n - 1) + 1)]
        return self.drafts

    def update(self, logits):
        if self.pred is None:  # Alg. 2 L2: the first estimate of the block
            self.pred = predict(logits[0], self.state, self.mask_id)
        else:
            preds = [predict(lg, d, self.mask_id) for lg, d in zip(logits, self.drafts)]
            m = 0
            while m + 1 < len(self.drafts) and torch.equal(self.drafts[m + 1], topk_jump(self.drafts[m], preds[m], 1)):
                m += 1
            self.state, self.pred = self.drafts[m], preds[m]
            self.accepted += m
            self.iterations += 1
        if int(self.masked.sum()) == 1:  # L14-17: the last step needs no forward
            self.state = topk_jump(self.state, self.pred, 1)

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations}
