"""What both vLLM modes add to vLLM's V1 model runner, written against the GPU model runner's API (which the
CPU runner inherits); the device lives in the attention backend (:mod:`attention_backends.vllm_backend`).

A step of either mode goes through the same hooks (their vLLM names are in :mod:`.compat`):

1. ``_prepare_inputs``: vLLM lays out the scheduled tokens; the mode describes the whole forward in a
   :class:`~attention_backends.step_batch.StepBatch` (one entry per request: segments, masks, positions,
   extra rows, the rows whose logits it needs), built by
   :func:`~attention_backends.step_batch.build_step_batch` as the reference engine builds its own, and
   publishes it for the forward (:func:`~attention_backends.step_batch.set_step`) with the host copies of
   the block tables; the attention metadata builders and the model read it from there.
2. ``_sample``: the mode turns those logits into tokens (a dLLM's committed block, or PRESTO's accepted path
   plus bonus token); vLLM's bookkeeping records them.
3. ``propose_draft_token_ids``: the mode's next drafts (a dLLM's next canvas, or PRESTO's next tree), and
   per request ``recompute_from``; ``take_draft_token_ids`` hands them to the scheduler as
   :class:`PSDDraftTokenIds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.outputs import DraftTokenIds

from attention_backends.step_batch import StepBatch, set_step
from attention_backends.vllm_backend import PSDMetadataBuilder

from . import compat


@dataclass
class PSDDraftTokenIds(DraftTokenIds):
    """Draft tokens plus, per request, where its next forward starts and how many rows its next step adds
    beyond its scheduled tokens (a dLLM's extra canvases)."""

    recompute_from: list[int] = field(default_factory=list)
    extra_rows: list[int] = field(default_factory=list)


class PSDRunnerMixin:
    """Shared by :class:`~.dllm_runner.DLLMModelRunner` and :class:`~.presto_runner.PrestoModelRunner`; mixed
    in before vLLM's runner class (:func:`psd_plugin.vllm.worker.runner_class`)."""

    _next_drafts: PSDDraftTokenIds | None = None

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        if not any(isinstance(b, PSDMetadataBuilder) for b in compat.metadata_builders(self)):
            raise RuntimeError("psd-plugin: the model has no layer on psd-plugin's attention backend; the psd "
                               "speculative method serves the project's model classes only")

    def _publish(self, batch: StepBatch | None) -> None:
        """The forward about to run is ``batch`` (None: the forward is over), with the host copies of vLLM's
        block tables for its requests (:func:`.compat.host_pages`): the attention builders plan from them and
        read no device tensor."""
        if batch is not None:
            batch.pages = compat.host_pages(self, batch.num_requests)
        set_step(batch)

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return True  # drafts are sized by the modes themselves, to the room each request has left

    def set_next_drafts(self, req_ids: list[str], drafts: list[list[int]], recompute_from: list[int],
                        extra_rows: list[int] | None = None) -> None:
        self._next_drafts = PSDDraftTokenIds(list(req_ids), drafts, recompute_from,
                                             extra_rows or [0] * len(req_ids))

    def take_draft_token_ids(self):
        out, self._next_drafts = self._next_drafts, None
        return out
