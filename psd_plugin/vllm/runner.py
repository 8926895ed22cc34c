"""What both vLLM modes add to vLLM's V1 model runner, written against the GPU model runner's API (which the
CPU runner inherits); the device lives in the attention backend (:mod:`attention_backends.vllm_backend`).

A step of either mode goes through the same hooks (their vLLM names are in :mod:`.compat`):

1. ``_prepare_inputs``: vLLM lays out the scheduled tokens; the mode describes the whole forward in a
   :class:`~attention_backends.step_batch.StepBatch` (one entry per request: segments, masks, positions,
   extra rows, the rows whose logits it needs), built by
   :func:`~attention_backends.step_batch.build_step_batch` as the reference engine builds its own, and
   publishes it for the forward (:func:`~attention_backends.step_batch.set_step`); the attention metadata
   builders and the model read it from there.
2. ``_sample``: the mode turns those logits into tokens (a dLLM's committed block, or PRESTO's accepted path
   plus bonus token); vLLM's bookkeeping records them.
3. ``propose_draft_token_ids``: the mode's next drafts (a dLLM's next canvas, or PRESTO's next tree), and
   per request ``recompute_from``; ``take_draft_token_ids`` hands them to the scheduler as
   :class:`PSDDraftTokenIds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.v1.outputs import DraftTokenIds

from attention_backends.step_batch import StepBatch, current_step, set_step
from attention_backends.vllm_backend import PSDMetadataBuilder

from . import compat


@dataclass
class PSDDraftTokenIds(DraftTokenIds):
    """Draft tokens plus, per request, where its next forward starts and how many rows its next step adds
    beyond its scheduled tokens (a dLLM's extra canvases)."""

    recompute_from: list[int] = field(default_factory=list)
    extra_rows: list[int] = field(default_factory=list)


class PSDRunnerMixin:
    """Shared by :class:`~.dllm_runner.DLLMRunnerMixin` and :class:`~.presto_runner.PrestoRunnerMixin`; mixed
    in before vLLM's runner class (:func:`psd_plugin.vllm.worker.runner_class`)."""

    _next_drafts: PSDDraftTokenIds | None = None
    _staging: torch.Tensor | None = None  # pinned host rows for the input buffers (on a GPU)

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        if not any(isinstance(b, PSDMetadataBuilder) for b in compat.metadata_builders(self)):
            raise RuntimeError("psd-plugin: the model has no layer on psd-plugin's attention backend; the psd "
                               "speculative method serves the project's model classes only")

    def _publish(self, batch: StepBatch | None) -> None:
        """The forward about to run is ``batch`` (None: the forward is over)."""
        set_step(batch)

    # ------------------------------------------------------------------ every row in vLLM's input buffers
    def _extra_rows(self) -> int:
        """Rows the forward about to run has beyond vLLM's scheduled tokens (its extra canvases)."""
        batch = current_step()
        return 0 if batch is None else batch.num_extra

    def _determine_batch_execution_and_padding(self, num_tokens: int, *args, **kwargs):
        """vLLM sizes the forward (padding, CUDA-graph dispatch, data-parallel token counts) on its scheduled
        tokens; a step's extra rows are rows of the forward too, so it is sized on all of them."""
        return super()._determine_batch_execution_and_padding(num_tokens + self._extra_rows(), *args, **kwargs)

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        """vLLM's inputs for the forward are views of its persistent ``input_ids`` and ``positions`` buffers
        (the addresses a CUDA graph captured). The step's rows go there too: the extra rows' token ids after
        the scheduled ones, and every row's position (a tree node's is its depth; an extra canvas repeats its
        window's), so the model reads nothing but those buffers. Rows past them (padding) keep position 0 and
        are inert: no K/V write (no slot), no logits row, a zero attention output."""
        out = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        batch = current_step()
        if batch is not None:
            T, n = batch.num_scheduled, batch.num_rows
            if n > num_input_tokens:
                raise RuntimeError(f"psd-plugin: the forward has {n} rows but vLLM sized it for {num_input_tokens}")
            ids, pos = compat.input_buffers(self)
            rows = batch.host_inputs()  # [2, T + E]: extra ids (after T), positions
            if pos.device.type != "cpu":  # one copy, from pinned memory, without waiting for it
                if self._staging is None:
                    self._staging = torch.zeros(2, pos.numel(), dtype=torch.long, pin_memory=True)
                self._staging[:, :n].copy_(rows)
                rows = self._staging[:, :n].to(pos.device, non_blocking=True)
            if n > T:
                ids[T:n].copy_(rows[0, T:n])
            pos[:n].copy_(rows[1])
        return out

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return True  # drafts are sized by the modes themselves, to the room each request has left

    def set_next_drafts(self, req_ids: list[str], drafts: list[list[int]], recompute_from: list[int],
                        extra_rows: list[int] | None = None) -> None:
        self._next_drafts = PSDDraftTokenIds(list(req_ids), drafts, recompute_from,
                                             extra_rows or [0] * len(req_ids))

    def take_draft_token_ids(self):
        out, self._next_drafts = self._next_drafts, None
        return out
