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

from .base import (BlockDecoder, Prediction, canvas_predictions, commit, onehot_first_max, pad_rows, predict,
                   stacked_predictions)


def topk_jump(state: torch.Tensor, pred: Prediction, k: int) -> torch.Tensor:
    """``state`` with the ``k`` most confident masked positions of ``pred`` filled (static scheduler, k steps;
    ties: the lower position first, as the static policy's argmax)."""
    k = min(k, int(torch.isfinite(pred.conf).sum()))
    pos = torch.zeros_like(state, dtype=torch.bool)
    if k > 0:
        pos[torch.sort(pred.conf, descending=True, stable=True).indices[:k]] = True
    return commit(state, pred, pos)


class FreeDaveDecoder(BlockDecoder):
    def __init__(self, block, mask_id, steps: int = 4):
        super().__init__(block, mask_id)
        self.steps = steps
        self.pred: Prediction | None = None
        self.drafts: list[torch.Tensor] = []
        self.accepted = self.iterations = 0
        self._batch: tuple[torch.Tensor, int] | None = None  # (d drafts [d, L], how many are forwarded)

    def propose(self):
        if self.pred is None:
            return [self.state]
        n = int(self.masked.sum())
        self.drafts = [topk_jump(self.state, self.pred, k) for k in range(1, min(self.steps, n - 1) + 1)]
        unused = [self.state] * (self.steps - len(self.drafts))  # never forwarded (update_batch's layout)
        self._batch = (torch.stack(self.drafts + unused), len(self.drafts))
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

    # ------------------------------------------------------------------ every request of a step at once
    def batch_key(self):
        return ("first" if self.pred is None else "verify"), self.mask_id, self.steps

    @classmethod
    def propose_batch(cls, decoders):
        """L5-13 for every decoder: draft ``k`` fills the masked positions of confidence rank < ``k``."""
        if decoders[0].pred is None:  # the block's first step forwards the state
            return super().propose_batch(decoders)
        mask, steps = decoders[0].mask_id, decoders[0].steps
        S, T, C = stacked_predictions(decoders)
        R, L = S.shape
        order = torch.sort(C, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(L, device=S.device).expand(R, L))
        fill = (rank[:, None, :] < torch.arange(1, steps + 1, device=S.device)[:, None]) & torch.isfinite(C)[:, None]
        D = torch.where(fill, T[:, None], S[:, None])  # [R, d, L]
        n_fwd = ((S == mask).sum(-1) - 1).clamp(0, steps).tolist()
        for d, drafts, nf in zip(decoders, D, n_fwd):
            L_d = d.state.numel()
            d._batch = (drafts[:, :L_d], nf)
            d._proposed = list(drafts[:nf, :L_d])

    @classmethod
    def update_batch(cls, decoders, preds, rows):
        """L18-37 for every decoder: the longest run of drafts each equal to one static step of the one
        before (``m``), the jump to draft ``m`` with its prediction, and L14-17."""
        mask = decoders[0].mask_id
        R, ar = len(decoders), torch.arange(len(decoders))
        if decoders[0].pred is None:
            D = pad_rows([d.state for d in decoders], -1)[:, None]  # [R, 1, L]
            n_fwd = torch.ones(R, dtype=torch.long)
        else:
            D = pad_rows([d._batch[0].T for d in decoders], -1).transpose(1, 2)  # [R, d, L]
            n_fwd = torch.tensor([d._batch[1] for d in decoders])
        K = D.shape[1]
        rows = torch.cat([rows, rows.new_full((R, K - rows.shape[1], rows.shape[2]), -1)], 1)[:, :K]
        tok, conf = canvas_predictions(preds, rows, D, mask)
        jump = torch.where(onehot_first_max(conf), tok, D)  # one static step from each draft's own prediction
        same = (jump[:, :-1] == D[:, 1:]).all(-1) & (torch.arange(1, K) < n_fwd[:, None])
        m = same.long().cumprod(-1).sum(-1)  # the accepted run: drafts 1..m each equal the step before
        state, tok_m, conf_m = D[ar, m], tok[ar, m], conf[ar, m]
        state = torch.where(((state == mask).sum(-1) == 1)[:, None], jump[ar, m], state)  # L14-17
        first = decoders[0].pred is None
        for d, s, t, c, mm in zip(decoders, state, tok_m, conf_m, m.tolist()):
            L_d = d.state.numel()
            d.state, d.pred, d._batch = s[:L_d], Prediction(t[:L_d], c[:L_d]), None
            if not first:
                d.accepted += mm
                d.iterations += 1
