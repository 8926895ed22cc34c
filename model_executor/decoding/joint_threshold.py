"""LLaDA2.1's editing decoder: threshold unmasking plus token-to-token edits (SGLang calls it JointThreshold).

LLaDA2.1 is trained to revise tokens it has already written, and its authors decode it so (their
``generate`` in the LLaDA2.1 checkpoints' modeling code, read, not run here; SGLang's
``srt/dllm/algorithm/joint_threshold.py`` implements the same rule). Per forward of one block, from the
prediction ``x`` and its probability ``p`` at every position:

1. *Unmask*: every masked position with ``p > threshold`` takes ``x``; when none passes, the masked
   position of highest ``p`` does (first on ties), so each forward makes progress while masks remain.
2. *Edit*: every position this block filled before the step (never one the block started with) whose
   ``x`` differs from its token takes ``x`` when ``p > edit_threshold``. Both from the same forward: a
   position filled in a step can be edited from the next one on.
3. *Finish*: a forward that starts with no mask left is a post-edit step. The block is final when it has no
   mask and either its last post-edit step changed nothing or it has taken ``max_post_edit_steps`` of them
   (0: final as soon as the last mask is filled: plain threshold decoding). Only then is it emitted.

``edit_threshold`` 0 edits wherever the prediction changed (SGLang's "full editing"); 1 never edits. The
confidences are the engines' (float32 at least from bfloat16 logits); under sampling ``x`` is the step's draw
at every position (:mod:`.sampling`), filled ones too. Each position's edits are
counted in :meth:`JointThresholdDecoder.stats`.

All requests of a step at once (:meth:`JointThresholdDecoder.update_batch`): states ``[R, L]``, predictions of
every position of each state canvas (the decoder reads filled positions too: :attr:`reads_all_rows`), one
unmask and one edit mask for the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import (BlockDecoder, DeviceRowPredictions, Proposal, canvas_row_index, finite_decisions, launch_key,
                   onehot_first_max, pad_rows)


class JointThresholdDecoder(BlockDecoder):
    rewrites_tokens = True
    device_update = True  # :meth:`update_batch` runs where the predictions are

    def __init__(self, block, mask_id, threshold: float = 0.9, edit_threshold: float = 0.9,
                 max_post_edit_steps: int = 16):
        super().__init__(block, mask_id)
        self.threshold, self.edit_threshold, self.max_post_edit_steps = threshold, edit_threshold, max_post_edit_steps
        self.editable = block == mask_id  # the positions this block fills (and may edit once filled)
        self.post_steps = 0  # forwards that started with no mask left
        self.settled = False  # the last post-edit step changed nothing
        self.edits = 0

    @property
    def reads_all_rows(self) -> bool:
        return True  # edits read the predictions of filled positions

    @property
    def done(self) -> bool:
        return not self.has_masks and (self.settled or self.post_steps >= self.max_post_edit_steps)

    def stats(self) -> dict:
        return {"edits": self.edits, "post_edit_steps": self.post_steps}

    @classmethod
    def propose_batch(cls, decoders):
        return [Proposal([d.state]) for d in decoders]

    @classmethod
    def update_batch(cls, decoders, proposals, preds, canvas_rows):
        """Every decoder's step at once: its masked positions above ``threshold`` (or the top-1) filled, its
        filled editable positions whose prediction differs above ``edit_threshold`` rewritten. Where the
        predictions are on the device (:class:`~.base.DeviceRowPredictions`) the same tensor ops run there: the
        states, thresholds and editable positions go up in one copy, the next states (with the edit counts and
        each block's count of non-finite predictions: one raises, nothing is stepped) come back in one."""
        on_device = isinstance(preds, DeviceRowPredictions)
        pending = (preds.launched or {}).pop(launch_key(decoders, canvas_rows), None) if on_device else None
        if pending is not None:  # decided ahead (launch_batch): its copy
            out = finite_decisions(pending.wait()).long()
        else:
            new, n_edits, full, rows = cls._decisions(decoders, preds, canvas_rows)
            if on_device:  # the step's one copy back
                out = preds.read_back([new, n_edits, full], rows).long()
        if on_device:
            new, n_edits, full = out[:, :-2], out[:, -2], out[:, -1].bool()
        for d, row, f, e in zip(decoders, new, full.tolist(), n_edits.tolist()):
            d.state = row[: d.state.numel()]
            d.t += 1
            d.edits += e
            if f:
                d.post_steps += 1
                d.settled = e == 0

    @classmethod
    def launch_batch(cls, decoders, proposals, preds, canvas_rows):
        """:meth:`update_batch`'s decisions taken ahead (:func:`~.base.launch_all`), their copy queued for it: per
        decoder its next state, the next step's one canvas ``[1, L]``."""
        new, n_edits, full, rows = cls._decisions(decoders, preds, canvas_rows,
                                                  f"joint_threshold-ahead/{len(preds.launched)}")
        preds.launched[launch_key(decoders, canvas_rows)] = preds.read_back_later([new, n_edits, full], rows)
        return [new[r: r + 1, : d.state.numel()] for r, d in enumerate(decoders)]

    @staticmethod
    def _decisions(decoders, preds, canvas_rows, key: str = "joint_threshold"):
        """The step's rule where the predictions are: ``(next states [R, L], edits [R], post-edit step [R], the
        prediction rows)``; on a device the host arrays go up through the engine's staging buffer ``key``."""
        mask = decoders[0].mask_id
        rows = canvas_row_index(decoders, canvas_rows, 1)[:, 0]  # [R, L] prediction rows, -1 past a block's end
        S = pad_rows([d.state for d in decoders], -1)  # [R, L], never the mask past a block's end
        editable = pad_rows([d.editable for d in decoders], False)
        thr = torch.tensor([[d.threshold, d.edit_threshold] for d in decoders], dtype=torch.float64)
        if isinstance(preds, DeviceRowPredictions):  # logits rows, and the host arrays up in one copy (thresholds as
            S, rows, editable, thr = preds.upload(key, [  # their float64 bits)
                S.numpy(), preds.logits_rows(rows.numpy()), editable.numpy(), thr.numpy().view(np.int64)])
            editable, thr = editable.bool(), thr.view(torch.float64)
        at = rows.clamp(min=0)
        T = torch.where(rows >= 0, preds.tokens[at], -1)
        C = torch.where(rows >= 0, preds.conf[at].double(), float("-inf"))
        masked = S == mask
        full = ~masked.any(-1)  # [R]: a post-edit step
        conf_masked = C.masked_fill(~masked, float("-inf"))
        unmask = masked & (conf_masked > thr[:, :1])
        unmask |= onehot_first_max(conf_masked) & ~unmask.any(-1, keepdim=True)
        edit = editable & ~masked & (T != S) & (T >= 0) & (C > thr[:, 1:])
        new = torch.where(unmask | edit, T, S)
        return new, edit.sum(-1), full, rows
