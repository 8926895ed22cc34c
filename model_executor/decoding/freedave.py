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
- Sampling: draft ``k`` is drawn as the state ``k`` steps ahead will be (:mod:`.sampling`: the draw is a
  function of the request's seed, the position and the step), so each accepted draft's prediction is the one
  sampled static decoding draws there: lossless under sampling too, token for token for the same seed.

One step of all requests at once (:meth:`FreeDaveDecoder.propose_batch`, :meth:`FreeDaveDecoder.update_batch`):
L5-13 by one sort (draft ``k`` fills the positions of confidence rank < ``k``), L19-35 for every draft of every
request by one static step each; the block's first step (L2) is the same update with one canvas and m = 0.
"""

from __future__ import annotations

import torch

from .base import (BlockDecoder, Prediction, Proposal, canvas_predictions, canvas_row_index, commit,
                   onehot_first_max, stacked_predictions)


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
        self.pred: Prediction | None = None  # the estimate of the current state (reused from its draft)
        self.accepted = self.iterations = 0

    def stats(self):
        return {"accepted_drafts": self.accepted, "verify_iterations": self.iterations}

    @classmethod
    def propose_batch(cls, decoders):
        """L5-13 for every decoder: draft ``k`` fills the masked positions of confidence rank < ``k``,
        ``k = 1..d_i``; the block's first step forwards the state (L2). ``Proposal.data``: drafted or not."""
        out: list = [Proposal([d.state], False) for d in decoders]
        idx = [i for i, d in enumerate(decoders) if d.pred is not None]
        if idx:
            group = [decoders[i] for i in idx]
            mask = group[0].mask_id
            S, T, C = stacked_predictions(group)
            R, L = S.shape
            order = torch.sort(C, dim=-1, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(1, order, torch.arange(L, device=S.device).expand(R, L))
            steps = max(d.steps for d in group)
            fill = (rank[:, None, :] < torch.arange(1, steps + 1, device=S.device)[:, None]) & \
                torch.isfinite(C)[:, None]
            D = torch.where(fill, T[:, None], S[:, None])  # [R, steps, L]
            # a draft that completes the block needs no forward; under a grammar no draft goes past the positions
            # the frontier rule leaves committable (finite confidence)
            n, fin = (S == mask).sum(-1), torch.isfinite(C).sum(-1)
            n_fwd = torch.minimum(torch.where(fin < n, fin, n - 1), torch.tensor([d.steps for d in group])).clamp(min=0)
            for i, d, drafts, nf in zip(idx, group, D, n_fwd.tolist()):
                out[i] = Proposal(list(drafts[:nf, : d.state.numel()]), True, list(range(d.t + 1, d.t + 1 + nf)))
        return out

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """L18-37 for every decoder: the longest run of drafts each equal to one static step of the one
        before (``m``), the jump to draft ``m`` with its prediction, and L14-17 (the first step: L2, m = 0)."""
        mask = decoders[0].mask_id
        R, ar = len(decoders), torch.arange(len(decoders))
        K = max(len(p.canvases) for p in proposals)
        L = max(d.state.numel() for d in decoders)
        D = torch.full((R, K, L), -1, dtype=decoders[0].state.dtype)  # the forwarded drafts, -1 past them
        for r, p in enumerate(proposals):
            c = torch.stack(p.canvases)
            D[r, : c.shape[0], : c.shape[1]] = c
        n_fwd = torch.tensor([len(p.canvases) for p in proposals])
        tok, conf = canvas_predictions(preds, canvas_row_index(decoders, canvas_rows, K), D, mask)
        jump = torch.where(onehot_first_max(conf), tok, D)  # one static step from each draft's own prediction
        same = (jump[:, :-1] == D[:, 1:]).all(-1) & (torch.arange(1, K) < n_fwd[:, None])
        m = same.long().cumprod(-1).sum(-1)  # the accepted run: drafts 1..m each equal the step before
        state, tok_m, conf_m = D[ar, m], tok[ar, m], conf[ar, m]
        state = torch.where(((state == mask).sum(-1) == 1)[:, None], jump[ar, m], state)  # L14-17
        for d, p, s, t, c, mm in zip(decoders, proposals, state, tok_m, conf_m, m.tolist()):
            L_d = d.state.numel()
            d.state, d.pred = s[:L_d], Prediction(t[:L_d], c[:L_d])
            d.t = p.canvas_steps(d.t)[mm]  # the accepted draft's step
            if p.data:
                d.accepted += mm
                d.iterations += 1
