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

import numpy as np
import torch

from .base import (BlockDecoder, DeviceRowPredictions, Prediction, Proposal, canvas_predictions,
                   canvas_row_index, commit, first_max, first_max_tensor, host_rows, launch_key)


def topk_jump(state: torch.Tensor, pred: Prediction, k: int) -> torch.Tensor:
    """``state`` with the ``k`` most confident masked positions of ``pred`` filled (static scheduler, k steps;
    ties: the lower position first, as the static policy's argmax)."""
    k = min(k, int(torch.isfinite(pred.conf).sum()))
    pos = torch.zeros_like(state, dtype=torch.bool)
    if k > 0:
        pos[torch.sort(pred.conf, descending=True, stable=True).indices[:k]] = True
    return commit(state, pred, pos)


class FreeDaveDecoder(BlockDecoder):
    device_update = True  # :meth:`_decide_on_device`

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
        ``k = 1..d_i``; the block's first step forwards the state (L2). ``Proposal.data``: drafted or not. Host
        data in numpy (a step's few small arrays cost microseconds an op in numpy, tens as torch ops)."""
        out: list = [Proposal([d.state], False) for d in decoders]
        idx = [i for i, d in enumerate(decoders) if d.pred is not None]
        if idx:
            group = [decoders[i] for i in idx]
            mask = group[0].mask_id
            S, T, C = host_rows([(d.state, d.pred.tokens, d.pred.conf) for d in group])
            C[S != mask] = -np.inf
            R, L = S.shape
            order = np.argsort(-C, axis=-1, kind="stable")  # descending; ties: the lower position first
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.broadcast_to(np.arange(L), (R, L)), axis=1)
            steps = max(d.steps for d in group)
            finite = np.isfinite(C)
            fill = (rank[:, None, :] < np.arange(1, steps + 1)[:, None]) & finite[:, None]
            D = torch.from_numpy(np.where(fill, T[:, None], S[:, None]))  # [R, steps, L]
            # a draft that completes the block needs no forward; under a grammar no draft goes past the positions
            # the frontier rule leaves committable (finite confidence)
            n, fin = (S == mask).sum(-1), finite.sum(-1)
            n_fwd = np.maximum(np.minimum(np.where(fin < n, fin, n - 1), [d.steps for d in group]), 0)
            for r, (i, d, nf) in enumerate(zip(idx, group, n_fwd.tolist())):
                out[i] = Proposal(list(D[r, :nf, : d.state.numel()]), True, list(range(d.t + 1, d.t + 1 + nf)))
        return out

    @staticmethod
    def _decide(mask, preds, D, rows, n_fwd):
        """L19-37's decisions on host data (numpy): ``(m [R], next states, the accepted draft's prediction
        tokens and confidences [R, L])``."""
        ar, K = np.arange(D.shape[0]), D.shape[1]
        tok, conf = canvas_predictions(preds, rows, D, mask)
        jump = np.where(first_max(conf), tok, D)  # one static step from each draft's own prediction
        same = (jump[:, :-1] == D[:, 1:]).all(-1) & (np.arange(1, K) < n_fwd[:, None])
        m = same.cumprod(-1).sum(-1)  # the accepted run: drafts 1..m each equal the step before
        state = D[ar, m]
        state = np.where(((state == mask).sum(-1) == 1)[:, None], jump[ar, m], state)  # L14-17
        return m, torch.from_numpy(state), torch.from_numpy(tok[ar, m]), torch.from_numpy(conf[ar, m])

    @classmethod
    def _decide_on_device(cls, mask, preds: DeviceRowPredictions, D, rows, n_fwd, pending=None):
        """:meth:`_decide` where the predictions are (tensor ops), decision for decision: the drafts and their
        rows go up in one copy, the decisions (with each block's count of non-finite predictions: one raises,
        nothing is stepped) come back in one; ``pending``: that copy, queued when they were taken ahead
        (:meth:`launch_batch`)."""
        if pending is not None:
            cols = pending.columns()
        else:
            dev, at = cls._device_decisions(mask, preds, D, rows, n_fwd)
            cols = preds.read_back_columns(dev, at)
        state, tok_m, conf_m, m = cols
        return (m.astype(np.int64), torch.from_numpy(state.astype(np.int64)), torch.from_numpy(tok_m.astype(np.int64)),
                torch.from_numpy(conf_m).to(preds.conf.dtype))

    @staticmethod
    def _device_decisions(mask, preds: DeviceRowPredictions, D, rows, n_fwd, key: str = "freedave"):
        """:meth:`_decide_on_device`'s decisions, left where they are: ``([next states, the accepted draft's
        prediction tokens and confidences [R, L], m [R]], the drafts' logits rows)``; the host arrays go up
        through the engine's staging buffer ``key``."""
        R, K, L = D.shape
        Dd, at, nf = preds.upload(key, [D, preds.logits_rows(rows), n_fwd])
        tok, conf = preds.gather(at, Dd, mask)
        jump = torch.where(first_max_tensor(conf), tok, Dd)
        order = torch.arange(1, K, device=Dd.device)
        same = (jump[:, :-1] == Dd[:, 1:]).all(-1) & (order < nf[:, None])
        m = same.long().cumprod(-1).sum(-1)
        ar = torch.arange(R, device=Dd.device)
        state = Dd[ar, m]
        state = torch.where(((state == mask).sum(-1) == 1)[:, None], jump[ar, m], state)
        return [state, tok[ar, m], conf[ar, m], m], at

    @staticmethod
    def _next_drafts(S, T, C, K: int, mask: int) -> torch.Tensor:
        """:meth:`propose_batch` of the next states ``S [R, L]`` and the accepted draft's prediction (tokens
        ``T``, confidences ``C``) where they are: drafts 1..K ``[R, K, L]`` (past a block's own count, drafts
        that are not forwarded: rows that decode nothing). Decision for decision the host's: ranks by a stable
        sort (ties: the lower position first), draft ``k`` the positions of rank < ``k`` with a finite
        confidence."""
        C = torch.where(S == mask, C, torch.full_like(C, float("-inf")))
        order = torch.sort(-C, dim=-1, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(S.shape[1], device=S.device).expand_as(order))
        fill = (rank[:, None, :] < torch.arange(1, K + 1, device=S.device)[:, None]) & torch.isfinite(C)[:, None]
        return torch.where(fill, T[:, None], S[:, None])

    def canvases_ahead(self, proposal: Proposal) -> int:
        """The next step's drafts are at most this one's: ``min(masks left - 1, steps)`` each step, and every step
        after a block's first fills one mask at least. After the first (the state alone, which that step keeps)
        they are at most ``min(masks - 1, steps)``, and one at least (a canvas to lay out)."""
        if proposal.data:
            return max(1, len(proposal.canvases))
        n = int(np.count_nonzero(proposal.canvases[0].numpy() == self.mask_id))
        return max(1, min(n - 1, self.steps))

    @classmethod
    def launch_batch(cls, decoders, proposals, preds, canvas_rows):
        """:meth:`update_batch`'s decisions taken ahead (:func:`~.base.launch_all`), their copy queued for it, and
        the next step's drafts made where they are (:meth:`_next_drafts`): per decoder ``[K, L]``, ``K`` what
        :meth:`canvases_ahead` bounds them by."""
        mask = decoders[0].mask_id
        D, rows, n_fwd = cls._inputs(decoders, proposals, canvas_rows)
        cols, at = cls._device_decisions(mask, preds, D, rows, n_fwd, f"freedave-ahead/{len(preds.launched)}")
        preds.launched[launch_key(decoders, canvas_rows)] = preds.read_back_later(cols, at)
        K = [d.canvases_ahead(p) for d, p in zip(decoders, proposals)]
        drafts = cls._next_drafts(cols[0], cols[1], cols[2], max(K), mask)
        return [drafts[r, :k, : d.state.numel()] for r, (d, k) in enumerate(zip(decoders, K))]

    @staticmethod
    def _inputs(decoders, proposals, canvas_rows):
        """What a step's decisions read of its decoders' proposals (host arrays): ``(the forwarded drafts
        [R, K, L] (-1 past them), their prediction rows, how many each forwards [R])``."""
        R = len(decoders)
        K = max(len(p.canvases) for p in proposals)
        L = max(d.state.numel() for d in decoders)
        D = np.full((R, K, L), -1, dtype=np.int64)  # the forwarded drafts, -1 past them
        for r, p in enumerate(proposals):
            for k, c in enumerate(p.canvases):
                D[r, k, : c.numel()] = c.numpy()
        n_fwd = np.array([len(p.canvases) for p in proposals])
        return D, canvas_row_index(decoders, canvas_rows, K).numpy(), n_fwd

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """L18-37 for every decoder: the longest run of drafts each equal to one static step of the one
        before (``m``), the jump to draft ``m`` with its prediction, and L14-17 (the first step: L2, m = 0)."""
        mask = decoders[0].mask_id
        D, rows, n_fwd = cls._inputs(decoders, proposals, canvas_rows)
        if isinstance(preds, DeviceRowPredictions):
            pending = (preds.launched or {}).pop(launch_key(decoders, canvas_rows), None)
            m, state, tok_m, conf_m = cls._decide_on_device(mask, preds, D, rows, n_fwd, pending)
        else:
            m, state, tok_m, conf_m = cls._decide(mask, preds, D, rows, n_fwd)
        for r, (d, p, mm) in enumerate(zip(decoders, proposals, m.tolist())):
            L_d = d.state.numel()
            d.state, d.pred = state[r, :L_d], Prediction(tok_m[r, :L_d], conf_m[r, :L_d])
            d.t = p.canvas_steps(d.t)[mm]  # the accepted draft's step
            if p.data:
                d.accepted += mm
                d.iterations += 1
