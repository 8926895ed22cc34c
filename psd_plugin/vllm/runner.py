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

import hashlib

import torch

from vllm.logger import init_logger

from attention_backends.step_batch import StepBatch, current_step, set_step
from attention_backends.vllm_backend import PSDMetadataBuilder
from model_executor.dllm_request import engine_fault
from model_executor.staging import Staging

from . import compat
from .config import RunnerProposer
from .next_step import NextStep, PSDDraftTokenIds

logger = init_logger(__name__)


def request_seed(req_id: str) -> int:
    """The sampling seed of a request that gives none: derived from its id, so every rank of a tensor-parallel
    engine draws the same tokens (each rank decodes the gathered logits itself; a rank whose draws differed
    would lay out another step, and the all-reduce would hang or mix masks)."""
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little") >> 2


class PSDRunnerMixin:
    """Shared by :class:`~.dllm_runner.DLLMRunnerMixin` and :class:`~.presto_runner.PrestoRunnerMixin`; mixed
    in before vLLM's runner class (:func:`psd_plugin.vllm.worker.runner_class`)."""

    _next_drafts: PSDDraftTokenIds | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # a pipeline stage before the last has no drafter (vLLM reads it on every stage): the same placeholder
        compat.ensure_drafter(self, lambda: RunnerProposer(getattr(self, "vllm_config", None)))
        self._staging = Staging()  # pinned host buffers of ``_upload`` (on a GPU)
        self._parity = 0  # which of two buffers per key a step's uploads use (``_upload``)
        self._tp_group = False  # the tensor-parallel host group (None: one rank); looked up at the first step
        # requests that failed here (request id -> why), until vLLM removes them: they forward nothing more, and
        # are reported to the scheduler, which finishes them with an error (finish reason "error": a 500 for
        # that client alone)
        self.failed: dict[str, str] = {}
        self._failures_reported: set[str] = set()
        self.failures = 0  # requests failed since start (psd_stats)

    # ------------------------------------------------------------------ per-request failures
    def _fail(self, req_id: str, stage: str, exc: BaseException) -> None:
        """``req_id`` failed in ``stage`` with ``exc``: it decodes nothing more and finishes with an error (its
        client gets vLLM's error response; its KV pages are freed); an engine fault (:func:`engine_fault`) is
        raised again, for vLLM to handle. Logged with the traceback, once per request."""
        if engine_fault(exc):
            raise exc
        if req_id in self.failed:
            return
        self.failed[req_id] = f"{stage}: {type(exc).__name__}: {exc}"
        self.failures += 1
        logger.error("psd-plugin: request %s failed in %s; it finishes with an error, the engine goes on",
                     req_id, stage, exc_info=exc)

    def _contain(self, stage: str, req_ids: list[str], fn, *args):
        """``fn(*args)`` for the requests ``req_ids``, or, where it raises something no one request caused, every
        one of them failed (:meth:`_fail`) and None returned: a failure the plugin cannot place costs the step's
        requests, never the engine."""
        try:
            return fn(*args)
        except Exception as e:
            if engine_fault(e):
                raise
            for rid in req_ids:
                self._fail(rid, stage, e)
            return None

    def _forget_failure(self, req_id: str) -> None:
        self.failed.pop(req_id, None)
        self._failures_reported.discard(req_id)

    def _new_failures(self) -> list[str]:
        """Failed requests the scheduler has not been told of yet."""
        new = [r for r in self.failed if r not in self._failures_reported]
        self._failures_reported.update(new)
        return new

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
            self._check_ranks(batch)
        set_step(batch)

    def _bookkeeping_sync(self, *args, **kwargs):
        """vLLM's bookkeeping of a step, without its rewind of the generators of the rows it discards (prompt
        chunks short of the prompt's end): the plugin's steps leave those generators as they were before the step
        (:func:`.compat.generators_left_alone`; the generators are read nowhere else there)."""
        with compat.generators_left_alone(self):
            return super()._bookkeeping_sync(*args, **kwargs)

    def _skips_forward(self) -> bool:
        """Whether the step being laid out runs no forward (the dLLM runner's steps of wasted rows alone)."""
        return False

    def _tensor_parallel_group(self):
        """This rank's tensor-parallel group on the host (gloo), or None with one rank."""
        if self._tp_group is False:
            self._tp_group = compat.tensor_parallel_cpu_group()
        return self._tp_group

    def _every_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every tensor-parallel rank (one host all-reduce; ``flag`` itself with one
        rank). Every rank must ask at the same point of the same step."""
        group = self._tensor_parallel_group()
        if group is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.long)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(t[0])

    def _check_ranks(self, batch: StepBatch) -> None:
        """Under tensor parallelism every rank lays out the step itself, from the decoders it runs on the gathered
        logits; ranks that disagreed would compute their heads of different attention for one all-reduce (wrong
        outputs) or different row counts (a hang). One host all-reduce of the layout's digest per step (gloo)
        fails the step loudly instead."""
        if self._tensor_parallel_group() is None:
            return
        fp = batch.fingerprint() ^ int(self._skips_forward())  # and whether the forward runs
        both = torch.tensor([fp, -fp], dtype=torch.long)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self._tp_group)
        if int(both[0]) != fp or int(both[1]) != -fp:
            raise RuntimeError(f"psd-plugin: tensor-parallel ranks disagree on the step's layout (this rank's "
                               f"digest {fp}, another's up to {int(both[0])}): a decision differed between ranks")

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
        the scheduled ones (and a replayed step's masks where vLLM holds committed tokens,
        :class:`~model_executor.dllm_request.DLLMStep`), and every row's position (a tree node's is its depth;
        an extra canvas repeats its window's), so the model reads nothing but those buffers. Rows past them
        (padding) keep position 0 and are inert: no K/V write (no slot), no logits row, a zero attention output."""
        if intermediate_tensors is not None:  # a pipeline stage after the first
            compat.ensure_intermediate_buffers(self)
        out = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        batch = current_step()
        if batch is not None:
            T, n = batch.num_scheduled, batch.num_rows
            if n > num_input_tokens:
                raise RuntimeError(f"psd-plugin: the forward has {n} rows but vLLM sized it for {num_input_tokens}")
            ids, pos = compat.input_buffers(self)
            rows = self._upload("inputs", batch.host_inputs(), pos.device)  # [2, T + E]: extra ids, positions
            if n > T:
                ids[T:n].copy_(rows[0, T:n])
            if batch.rewrite_ids is not None:  # a replay's masks over committed tokens (row 2)
                ids[:T].copy_(torch.where(rows[2, :T] >= 0, rows[2, :T], ids[:T]))
            pos[:n].copy_(rows[1])
        return out

    def _upload(self, key: str, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``host`` on ``device`` without the host waiting (:class:`~model_executor.staging.Staging`; ``key`` names
        the buffer, one of two by the step's parity). Reuse is safe: a step's uploads are read by its forward, and
        the host waits for every step's decisions (taken after its forward) before the step after the next one
        writes the same buffer (a step laid out ahead, :mod:`.dllm_runner`, uploads before the last step's
        decisions are waited for: hence two)."""
        return self._staging.upload(f"{key}/{self._parity}", host, device)

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        return True  # drafts are sized by the modes themselves, to the room each request has left

    def set_next_drafts(self, req_ids: list[str], drafts: list[list[int]], next_steps: list[NextStep]) -> None:
        """What :meth:`take_draft_token_ids` hands the scheduler after this step: per request of ``req_ids`` its
        draft tokens and :class:`NextStep`, and the failures it has not been told of yet; merged with what an
        earlier step left untaken (under pipeline parallelism vLLM keeps several steps in flight)."""
        new = PSDDraftTokenIds(list(req_ids), list(drafts), list(next_steps), self._new_failures())
        old = self._next_drafts
        if old is not None:  # not taken yet (vLLM's batch queue): the other requests' latest plans stay
            mine = set(new.req_ids)
            keep = [i for i, r in enumerate(old.req_ids) if r not in mine]
            new = PSDDraftTokenIds([old.req_ids[i] for i in keep] + new.req_ids,
                                   [old.draft_token_ids[i] for i in keep] + new.draft_token_ids,
                                   [old.next_steps[i] for i in keep] + new.next_steps, old.failed + new.failed)
        self._next_drafts = new

    def take_draft_token_ids(self):
        out, self._next_drafts = self._next_drafts, None
        return out
