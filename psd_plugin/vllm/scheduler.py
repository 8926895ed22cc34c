"""vLLM V1 schedulers of both modes: drafts from the runner, and the rewind to where the next forward starts.

Both modes report, per request, the draft tokens vLLM schedules next (a dLLM's first canvas from its window
onwards; PRESTO's tree nodes) and ``recompute_from``: where the next forward starts. :func:`apply_draft_updates`
sets the drafts and rolls ``num_computed_tokens`` back to it (the K/V before it stays in the paged cache;
everything from there is recomputed in the forward that reads it, so no stale draft K/V is ever read).

:class:`DLLMScheduler` differs from vLLM's ``Scheduler`` further:

- no bonus token: ``num_sampled_tokens_per_step = 0``, so a step that commits nothing rolls all its drafts
  back, and a step that completes a block reports the block's tokens as accepted;
- a step's extra draft canvases are rows the model adds to the request's scheduled tokens
  (:mod:`attention_backends.vllm_backend`): they take no KV slots and no context, but they are compute, so
  they count against the step's token budget (``max_num_batched_tokens``);
- a step computes at most ``logits_budget`` rows of logits (``speculative_config.max_logits_rows``; default
  the token budget): each canvas's block rows count against it;
- all or nothing: a running request whose canvases do not fit the step's budgets waits for the next step
  instead of being cut (a cut canvas would waste a forward); the runner marks every planned step, so a
  preempted request's replay that has no drafts (:class:`~model_executor.dllm_request.DLLMStep`) is never cut
  either;
- a request's first canvas rides with its prompt: when vLLM admits a request and prefills its whole prompt
  in this step, the masks of its first window (``[P, w1)``, :meth:`~model_executor.block_schedule.CacheSchedule.first_window_end`)
  are appended to it as draft tokens, with KV slots, when the step's budget has room. The prompt prefill is
  then the request's first decoding forward (a first window starts at position 0, so a prompt-only prefill
  would be recomputed by it anyway; under the block cache of SDAR / LLaDA2 it starts where a prefix-cache hit
  of whole attention blocks ends, so a hit's prefill of the rest of its prompt carries the first canvas too).
  A request asking for prompt logprobs (of the prompt alone), one whose prompt is chunked, one whose hit the
  first window would recompute, or one that does not fit keeps vLLM's plain prefill; its first canvas follows;
- spec-decode metrics in dLLM terms (as vLLM's own diffusion logging reads them): one *draft* = one decoding
  forward of a request, its *draft tokens* = the block's positions, *accepted tokens* = the tokens it
  committed; so ``vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts`` is TPF.

:class:`PrestoScheduler` is vLLM's scheduler (one bonus token per step) plus the rewind.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.metrics import SpecDecodingStats

from model_executor.models.configs import ArchSpec

from vllm.logger import init_logger

from . import compat
from .config import causal_blocks, decode_config, from_vllm_config, logits_budget
from .grammars import GrammarCompiles
from .next_step import NextStep, PSDDraftTokenIds
from .validation import GRAMMAR_ARG

logger = init_logger(__name__)

UNPLANNED = NextStep(0)  # a request the runner has planned nothing for yet


def apply_draft_updates(scheduler: Scheduler, draft_token_ids: PSDDraftTokenIds, deferred: dict | None = None
                        ) -> None:
    """Set each running request's drafts and roll ``num_computed_tokens`` back to its
    :attr:`~.runner.NextStep.recompute_from` (module docstring); then finish the requests the runner failed:
    they are scheduled no more (``scheduler.failing``) and vLLM finishes them with an error at the next step's
    output (finish reason ``error``: the client gets vLLM's error response), freeing their KV pages; the other
    requests are not touched.

    ``deferred`` (request id -> its update): a request whose step is still in flight (its output not yet turned
    into engine outputs: vLLM's batch queue under pipeline parallelism asks for the drafts first) gets its
    update there instead, applied after that output (:meth:`DLLMScheduler.update_from_output`)."""
    if not isinstance(draft_token_ids, PSDDraftTokenIds):
        raise TypeError(f"psd-plugin: the runner handed the scheduler a {type(draft_token_ids).__name__}, not "
                        "PSDDraftTokenIds (a worker without the plugin's runner?)")
    for req_id, drafts, nxt in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids,
                                   draft_token_ids.next_steps):
        r = scheduler.requests.get(req_id)
        if r is None or r.is_finished():
            continue
        if deferred is not None and scheduler.in_flight.get(req_id):
            deferred[req_id] = (drafts, nxt)
            continue
        set_next(r, drafts, nxt)
    for req_id in draft_token_ids.failed:
        r = scheduler.requests.get(req_id)
        if r is not None and not r.is_finished():
            scheduler.failing.add(req_id)
            compat.finish_with_error(scheduler, req_id)


def set_next(r, drafts: list[int], nxt: NextStep) -> None:
    """Request ``r``'s next drafts, and ``num_computed_tokens`` rolled back to where its next forward starts."""
    r.spec_token_ids = list(drafts)
    r.num_computed_tokens = min(r.num_computed_tokens, nxt.recompute_from)


class DLLMScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failing: set[str] = set()  # requests the runner failed; vLLM finishes them with an error
        self.num_sampled_tokens_per_step = 0
        # the runner's spec-decode bookkeeping counts drafts + 1 rows per request; a dLLM step may schedule
        # drafts only (no recomputed token), so keep one row per request free in its buffers
        self.max_num_scheduled_tokens = max(1, self.max_num_scheduled_tokens - self.max_num_running_reqs)
        # per request: its next step's rows beyond its scheduled tokens, logits rows, and whether it is planned
        self.next_steps: dict[str, NextStep] = {}
        self.logits_budget = logits_budget(self.vllm_config)
        self.cfg = decode_config(self.vllm_config)
        # structured-output requests wait (held in vLLM's queue) while their grammar compiles off the step
        self.grammars = GrammarCompiles(self.vllm_config.model_config,
                                        from_vllm_config(self.vllm_config).grammar_compile_timeout)
        self.mask_id = ArchSpec.from_hf_config(self.vllm_config.model_config.hf_config).mask_token_id
        # block-causal pages of whole attention blocks: a prompt chunk restarts at its attention block's start
        self.attention_block = causal_blocks(self.vllm_config)
        # pipeline parallelism: the steps the last stage plans travel to the other stages with the schedule;
        # vLLM keeps several steps in flight, so a request's next step waits for its last one's output
        self.pipeline = self.vllm_config.parallel_config.pipeline_parallel_size > 1
        self.in_flight: dict[str, int] = {}  # request -> its scheduled steps whose output is not processed yet
        self.deferred: dict[str, tuple] = {}  # request -> its drafts and NextStep, applied after that output
        # async scheduling (vLLM's batch queue of two steps): each request's next step is scheduled while its last
        # one runs, from that step's plan (NextStep.then); the ticket arrives with the step's output
        self.overlap = compat.async_scheduling(self.vllm_config)
        self.scheduled_rows: dict[str, tuple[int, int]] = {}  # request -> (w0, rows) of its latest scheduled step
        self.cut: set[str] = set()  # requests whose step in flight is a cut one (a guess that missed)

    def add_request(self, request) -> None:
        text = (request.sampling_params.extra_args or {}).get(GRAMMAR_ARG) if request.sampling_params else None
        if text is not None and request.request_id not in self.requests:
            self.grammars.hold(request, text)
        super().add_request(request)

    def shutdown(self) -> None:
        self.grammars.shutdown()
        super().shutdown()

    def schedule(self, throttle_prefills: bool = False):
        self.next_steps = {k: v for k, v in self.next_steps.items() if k in self.requests}
        self.cut &= self.requests.keys()
        if self.pipeline or self.overlap:
            self.in_flight = {k: v for k, v in self.in_flight.items() if k in self.requests}
            self.deferred = {k: v for k, v in self.deferred.items() if k in self.requests}
            self.scheduled_rows = {k: v for k, v in self.scheduled_rows.items() if k in self.requests}
        guessed = self._guess() if self.overlap else {}
        self.failing &= self.requests.keys()
        for rid, why in self.grammars.poll(self.requests):
            logger.error("psd-plugin: request %s fails: %s", rid, why)
            self.failing.add(rid)
            compat.finish_with_error(self, rid)
        budget, logits = self.max_num_scheduled_tokens, self.logits_budget
        kept, extra = [], 0
        B = self.attention_block
        for r in self.running:
            if B and r.num_computed_tokens < r.num_tokens and r.num_computed_tokens % B:
                # a chunk of a (re-)prefill ended inside an attention block: that block's K/V was computed without
                # the rest of it; the next chunk starts at the block's start and computes it whole (every step a
                # runner plans starts at an attention block's start: this never moves one)
                r.num_computed_tokens -= r.num_computed_tokens % B
            if r.request_id in self.failing:
                continue  # finished with an error at this step's output (update_draft_token_ids)
            need = r.num_tokens_with_spec - r.num_computed_tokens
            if need <= 0:  # nothing to forward (its step is in flight): vLLM passes it by, it takes no budget
                kept.append(r)
                continue
            nxt = guessed.get(r.request_id) or self.next_steps.get(r.request_id, UNPLANNED)
            more = nxt.extra_rows
            if nxt.planned and (need + more > budget or nxt.logits_rows > logits):
                continue  # waits for the next step, whole
            kept.append(r)
            budget -= max(0, need) + more
            logits -= nxt.logits_rows
            extra += more
        if len(kept) == len(self.running) and not extra:
            out = super().schedule(throttle_prefills)
        else:
            with compat.scheduling_only(self, kept, max(1, self.max_num_scheduled_tokens - extra)):
                out = super().schedule(throttle_prefills)
        self._first_canvases(out, self.max_num_scheduled_tokens - extra - out.total_num_scheduled_tokens, logits)
        if self.overlap:
            self._after_guess(out, guessed)
        if self.pipeline or self.overlap:  # (one step at a time otherwise: its output comes before its drafts)
            scheduled = compat.scheduled_req_ids(out)
            for rid in scheduled:
                self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        if self.pipeline:
            # the planned steps, for the stages that lay them out without decoding
            compat.ship_plans(out, {rid: nxt.plan for rid in scheduled
                                    if (nxt := self.next_steps.get(rid)) is not None and nxt.plan is not None})
        if not out.total_num_scheduled_tokens and not self.in_flight:  # nothing to run (and no step in flight
            self.grammars.wait(0.01)  # whose output is due): rather than an empty step, wait for a grammar
        return out

    def _guess(self) -> dict:
        """Async scheduling: each running request whose step N is in flight gets step N + 1 now, before N's
        outcome: the ticket of its last processed step planned N (``next_steps``); if N was scheduled as planned,
        N + 1 is the step after it as its block goes on (``NextStep.then``), else N is cut and N + 1 is the planned
        one. Its drafts are placeholders (the runner writes the ids it plans); ``num_computed_tokens`` goes back
        to the step's start. Returns request id -> the step scheduled for it (its budget's rows); a request with
        no guess (a replay, a plain prefill in flight) passes this step by. What these set is put back for the
        requests the step does not take (:meth:`_after_guess`)."""
        guessed = {}
        self._saved = {}
        for r in self.running:
            rid = r.request_id
            nxt = self.next_steps.get(rid)
            if not self.in_flight.get(rid) or rid in self.failing or nxt is None or not nxt.planned:
                continue
            if r.num_computed_tokens < r.num_tokens:  # a prefill's chunk in flight (a re-prefill's too, whose
                continue  # planned step is kept): its next chunk follows it, not the plan
            if nxt.same_rows(*self.scheduled_rows.get(rid, (-1, -1))):
                step = nxt.then
            else:  # the step in flight is not the planned one: the runner cuts it, and the planned one comes now
                step = nxt
                self.cut.add(rid)
            drafts = -1 if step is None else step.recompute_from + step.num_scheduled - r.num_tokens
            # the step in flight may complete a block: vLLM's runner then holds that block's tokens before these
            # placeholders, in rows of max_model_len (a guess that would not fit then waits a step)
            if drafts < 0 or step.recompute_from + step.num_scheduled + self.cfg.block_size > self.max_model_len:
                continue
            self._saved[rid] = (r.num_computed_tokens, list(r.spec_token_ids))
            r.spec_token_ids = [self.mask_id] * drafts
            r.num_computed_tokens = step.recompute_from
            guessed[rid] = step
        return guessed

    def _after_guess(self, out, guessed: dict) -> None:
        """Record what this step scheduled (each request's first row and rows); put back what :meth:`_guess` set
        on the requests it did not take."""
        rows = out.num_scheduled_tokens
        for rid in compat.scheduled_req_ids(out):
            r = self.requests[rid]
            self.scheduled_rows[rid] = (r.num_computed_tokens - rows[rid], rows[rid])
        for rid, (computed, drafts) in self._saved.items():
            if rid not in rows and (r := self.requests.get(rid)) is not None and compat.is_running(r):
                r.num_computed_tokens, r.spec_token_ids = computed, drafts
        self._saved = {}
        for rid in compat.preempted_req_ids(out):  # its runner plans again from the re-prefill
            self.next_steps.pop(rid, None)
            self.scheduled_rows.pop(rid, None)

    def _first_canvases(self, out, room: int, logits: int) -> None:
        """Append each newly admitted request's first canvas to its prompt prefill (module docstring), while the
        step's token budget has ``room`` and its logits budget ``logits`` rows (a block's)."""
        cfg = self.cfg
        for new in compat.new_requests(out):
            r = self.requests[new.req_id]
            sp = r.sampling_params
            # a prefix-cache hit the first window starts after (the block cache's whole attention blocks: the rest
            # of the prompt and the first canvas are one forward); another cache's first window starts at 0
            hit = new.num_computed_tokens
            if (hit and cfg.schedule.written_prefix(hit) != hit) or r.num_computed_tokens != r.num_tokens \
                    or sp is None or sp.prompt_logprobs is not None:
                continue  # a hit another window recomputes, a chunked prompt, prompt logprobs: vLLM's plain prefill
            P = r.num_tokens
            n = cfg.schedule.first_window_end(P, sp.max_tokens, cfg.block_size, cfg.aligned) - P
            if 0 < n <= room and cfg.block_size <= logits \
                    and compat.schedule_drafts_with_prefill(self, out, new, [self.mask_id] * n):
                room -= n
                logits -= cfg.block_size

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        if request_id in self.cut:  # a cut step (async scheduling) is no decoding forward
            self.cut.discard(request_id)
            return spec_decoding_stats
        if not self.log_stats or not num_draft_tokens:
            return None
        if spec_decoding_stats is None:
            spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens)
        spec_decoding_stats.observe_draft(num_draft_tokens=self.num_spec_tokens,
                                          num_accepted_tokens=min(num_accepted_tokens, self.num_spec_tokens))
        return spec_decoding_stats

    def update_from_output(self, scheduler_output, model_runner_output):
        if self.overlap:
            return self._update_overlapped(scheduler_output, model_runner_output)
        out = super().update_from_output(scheduler_output, model_runner_output)
        if not self.in_flight:
            return out
        for rid in compat.scheduled_req_ids(scheduler_output):
            left = self.in_flight.get(rid, 0) - 1
            if left > 0:
                self.in_flight[rid] = left
                continue
            self.in_flight.pop(rid, None)
            # (a request preempted meanwhile re-prefills first; its runner plans its next step again)
            if (update := self.deferred.pop(rid, None)) is not None and (r := self.requests.get(rid)) is not None \
                    and compat.is_running(r):
                set_next(r, *update)
        return out

    def _preempt_request(self, request, timestamp, drop_stale_output: bool = False) -> None:
        """vLLM drops a preempted request's in-flight output when asked to (``reset_prefix_cache`` of running
        requests, a KV connector's pending hand-off); under async scheduling the runner has already decoded that
        step, so its tokens are delivered (the runner's request state holds them)."""
        if self.overlap and self.in_flight.get(request.request_id):
            drop_stale_output = False
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _update_overlapped(self, scheduler_output, model_runner_output):
        """Async scheduling: step N's output, while N + 1 is in flight. vLLM's rollback of N's rejected drafts is
        undone for the requests N + 1 already rescheduled (their ``num_computed_tokens`` is N + 1's); the ticket
        on the output (:func:`.compat.ticket_of`) plans each request's next step, applied at once to a request
        with nothing in flight and read by :meth:`_guess` for the others."""
        sched = compat.scheduled_req_ids(scheduler_output)
        again = {rid: r.num_computed_tokens for rid in sched
                 if self.in_flight.get(rid, 0) > 1 and (r := self.requests.get(rid)) is not None}
        out = super().update_from_output(scheduler_output, model_runner_output)
        for rid, computed in again.items():
            if (r := self.requests.get(rid)) is not None and compat.is_running(r):
                r.num_computed_tokens = computed
        for rid in sched:
            if (left := self.in_flight.get(rid, 0) - 1) > 0:
                self.in_flight[rid] = left
            else:
                self.in_flight.pop(rid, None)
        ticket = compat.ticket_of(model_runner_output)
        if ticket is not None:
            self._take_ticket(ticket)
        return out

    def _take_ticket(self, ticket: PSDDraftTokenIds) -> None:
        """A step's ticket under async scheduling: each running request's next step is planned; one with nothing
        in flight gets its drafts now (as a synchronous engine), the others at the next :meth:`_guess`. A request
        preempted meanwhile forgets it (its runner plans again from the re-prefill). Failures as ever."""
        for rid, drafts, nxt in zip(ticket.req_ids, ticket.draft_token_ids, ticket.next_steps):
            r = self.requests.get(rid)
            if r is None or r.is_finished():
                continue
            if not compat.is_running(r):
                self.next_steps.pop(rid, None)
                continue
            self.next_steps[rid] = nxt
            if not self.in_flight.get(rid):
                set_next(r, drafts, nxt)
        apply_draft_updates(self, PSDDraftTokenIds([], [], [], ticket.failed))

    def update_draft_token_ids(self, draft_token_ids: PSDDraftTokenIds) -> None:
        apply_draft_updates(self, draft_token_ids, self.deferred)
        self.next_steps.update((rid, nxt) for rid, nxt in zip(draft_token_ids.req_ids, draft_token_ids.next_steps)
                               if rid in self.requests)


class PrestoScheduler(Scheduler):
    """vLLM's scheduler (one bonus token per step) plus the runner's ``recompute_from`` rewind."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failing: set[str] = set()

    def schedule(self, throttle_prefills: bool = False):
        self.failing &= self.requests.keys()
        live = [r for r in self.running if r.request_id not in self.failing]
        if len(live) == len(self.running):
            return super().schedule(throttle_prefills)
        with compat.scheduling_only(self, live, self.max_num_scheduled_tokens):
            return super().schedule(throttle_prefills)

    def update_draft_token_ids(self, draft_token_ids: PSDDraftTokenIds) -> None:
        apply_draft_updates(self, draft_token_ids)
