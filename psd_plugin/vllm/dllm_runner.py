"""The dLLM decoding path in vLLM: one scheduled step = one forward = one decoder step of every running request.

Each request is a :class:`model_executor.dllm_request.DLLMRequest` (the state machine the reference engine
drives too); this runner only decides how a step's rows reach vLLM (:mod:`.runner` gives the hooks):

- The request's first canvas travels as vLLM tokens: ``num_computed_tokens`` is rolled back to the window's
  start ``w0`` (``recompute_from``), the committed tokens ``[w0, b0)`` are re-forwarded, and the block's
  current state plus the masks after it ``[b0, w1)`` are its draft tokens. So what vLLM schedules never goes
  past ``prompt + max_tokens`` (it fits ``max_model_len`` and the request's own KV pages).
- Further canvases (PSD, LoPA, FreeDave, Spiffy drafts) are extra rows of the same step, at the same
  positions ``[w0, w1)``: they follow the scheduled rows in vLLM's input buffers (:class:`.runner.PSDRunnerMixin`), the
  attention backend gives each canvas its own segment over the shared paged prefix, and their K/V is never
  written, so they take no KV pages.
- Under ``cache: "dual"`` a block's first step forwards the whole answer region, so vLLM writes the K/V of
  the masks after the block into the request's pages; the block's later steps forward the block only, and
  the layout names that kept suffix, which every row of the request then reads from those pages.
- Every draft is reported rejected until a block is complete; then the block's tokens are reported as
  sampled tokens (so streaming emits a block when it commits, and vLLM's stop checks truncate at EOS /
  ``max_tokens`` / stop strings).

Choices: a request's first canvas is scheduled with its prompt (:class:`~.scheduler.DLLMScheduler`), so its
prompt prefill is its first decoding forward. Where the scheduler keeps vLLM's plain prefill (prompt logprobs,
a chunked prompt, no room in the step) that prefill has no canvas (counted in ``model_calls``, not in NFE, as
the PSD paper counts decoding forwards); for block-causal models (SDAR) its K/V of the prompt's finished
attention blocks is exact and reused. After a preemption vLLM re-prefills the prompt and
committed tokens and the block's decoder continues where it was; with the prefix (or dual) cache the first
forwards of the blocks whose K/V the next step reads are replayed first, each over the tokens of its time
(:meth:`~model_executor.dllm_request.DLLMRequest.preempted`; they restore the kept suffix too), so the outputs
stay those of an uninterrupted run under every ``refresh`` and ``suffix``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.outputs import AsyncModelRunnerOutput, SamplerOutput

from attention_backends.step_batch import Rows, StepBatch, build_step_batch
from model_executor.decoding import LogitsRules, logits_map, merge_stats, predict_rows, propose_all
from model_executor.decoding.base import PendingCopy, decides_ahead
from model_executor.dllm_request import DLLMRequest, decode_step, engine_fault, launch_step, update_step
from model_executor.grammar import GrammarFrontier
from model_executor.models.configs import ArchSpec

from . import compat
from .config import decode_config, from_vllm_config, logits_budget
from .grammars import compiled, served_compiler
from .next_step import NextStep
from .runner import PSDRunnerMixin, request_seed
from .validation import GRAMMAR_ARG

logger = init_logger(__name__)

NO_REWIND = 1 << 62  # recompute_from of a request with nothing more to forward
# steps in a row a request's planned step may be scheduled otherwise (a cut step decodes nothing; the scheduler
# is all-or-nothing, so a cut is rare and never repeats): past this the plan and vLLM's schedule disagree for good,
# and the request fails rather than spin the engine
MAX_CUTS = 8


def _logprobs_tensors(lps: dict[int, list], want: dict[int, int], width: int, rows: int):
    """vLLM's :class:`LogprobsTensors` for a step's sampled tokens ``[rows, width]`` (row-major, as vLLM's
    spec-decode path flattens them): per emitted token its id and logprob, then the ``k`` most likely tokens and
    theirs, and its rank; None when no request asked for logprobs."""
    if not want:
        return None
    from vllm.v1.outputs import LogprobsTensors

    k = max(max(want.values()), 0)
    ids = torch.zeros(rows * width, k + 1, dtype=torch.int32)
    vals = torch.full((rows * width, k + 1), float("-inf"), dtype=torch.float32)
    ranks = torch.zeros(rows * width, dtype=torch.int32)
    for i, entries in lps.items():
        for j, (tok, lp, alts, rank) in enumerate(entries):
            r = i * width + j
            ids[r, 0], vals[r, 0], ranks[r] = tok, lp, rank
            top = list(alts.items())[:k]
            if top:
                ids[r, 1: 1 + len(top)] = torch.tensor([t for t, _ in top], dtype=torch.int32)
                vals[r, 1: 1 + len(top)] = torch.tensor([v for _, v in top], dtype=torch.float32)
    return LogprobsTensors(logprob_token_ids=ids, logprobs=vals, selected_token_ranks=ranks)


def same_step(a, b) -> bool:
    """Whether two planned steps lay out the same forward (geometry, every canvas's ids, the logits rows)."""
    return a.geometry == b.geometry and all(_same(getattr(a, f), getattr(b, f)) for f in ("tokens", "kept", "tail"))


def _same(x, y) -> bool:
    return x is None and y is None or x is not None and y is not None and torch.equal(x, y)


def _describe(st) -> str:
    return "nothing" if st is None else f"rows [{st.w0}, {st.w1}) x {st.num_canvases} for block [{st.b0}, {st.b1})"


def request_rules(sp) -> LogitsRules | None:
    """The :class:`LogitsRules` of a request's sampling params (None when it asks for none): ``logit_bias``,
    ``allowed_token_ids``, ``bad_words`` (one token each; the front end refuses longer ones) and
    ``min_tokens`` against the request's stop tokens, and the penalties."""
    bad = tuple(ids[0] for ids in (sp.bad_words_token_ids or []) if len(ids) == 1)
    rules = LogitsRules(logit_bias={int(k): float(v) for k, v in (sp.logit_bias or {}).items()},
                        allowed_token_ids=tuple(sp.allowed_token_ids) if sp.allowed_token_ids else None,
                        banned_token_ids=bad, min_tokens=sp.min_tokens,
                        stop_token_ids=tuple(sorted(sp.all_stop_token_ids)),
                        repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                        frequency_penalty=sp.frequency_penalty)
    return rules if rules.active else None


class DeferredOutput(AsyncModelRunnerOutput):
    """A step's output under async scheduling: the step's decode runs when the next step begins
    (:meth:`DLLMRunnerMixin.execute_model`), or when vLLM's engine core asks for this output first.

    Under vLLM's multiprocess executor (tensor parallelism, data parallelism) the worker on the output rank asks
    for it from its output thread as soon as the step is sampled, while the other ranks decode it when the next
    step begins. Where steps are laid out ahead (:meth:`DLLMRunnerMixin._plan_ahead`), the next step must find it
    undecoded (and every rank must take the same path there), so the output thread waits for that start, and the
    next step's ``execute_model`` decodes it (after laying itself out ahead, or before, as ever). A serving
    engine sends the next step (an empty one if nothing fits) within its scheduling time of this one
    (``EngineCore.step_with_batch_queue``, while its scheduler has requests: through a request's end too, the
    schedule reporting it finished). It does not while the scheduler is paused with its requests kept, around
    worker calls between steps (a profile, ``collective_rpc``: ``psd_stats`` decodes the step itself and releases
    the wait), or when an offline ``LLM.generate`` returned with a step in flight: so the output thread waits at
    most :data:`AHEAD_WAIT_S`, then decodes the step itself, and at the next step's start the ranks vote (one host
    all-reduce) to lay nothing out ahead there."""

    def __init__(self, runner, grammar_output):
        self.runner, self.grammar_output, self.output = runner, grammar_output, None
        self.error: BaseException | None = None  # the decode raised (an engine fault): raised again when asked
        # the stream the step's forward ran on (vLLM's own, per thread): a decode on vLLM's output thread (tensor
        # parallelism) runs there too, after the forward, and before the next step's forward
        dev = runner.device
        self.stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        # set once the runner's thread took this output's decode over (the next step's execute_model, or a call of
        # the engine's between steps that decodes it: psd_stats)
        self.released = threading.Event()

    def get_output(self):
        if self.output is None and self.error is None and self.runner.waits_for_next_step \
                and not self.released.wait(AHEAD_WAIT_S):
            self.runner.step_time["ahead_wait_expired"] += 1  # (the next step is laid out as ever, on every rank)
        if self.output is None:
            self.runner._finish_deferred(self)
        return self.output


# how long vLLM's output thread waits for the next step to begin before it decodes a deferred step itself
# (DeferredOutput): a serving engine sends the next step within its scheduling time (milliseconds); this bounds
# the wait where it sends none (a kept-requests pause, worker calls between steps, an offline generate() that
# returned), at the price of the step after not being laid out ahead
AHEAD_WAIT_S = 0.25


@dataclass
class _Served:
    """A request in this runner: its decoding state machine (phase, planned step, drafts: all in ``req``), its
    logits rules, and serving counters."""

    req: DLLMRequest
    rules: LogitsRules | None = None  # the request's logit bias, allowed / banned tokens, min_tokens, penalties
    model_calls: int = 0
    recorded: bool = False
    prefilling: bool = False  # vLLM prefills its prompt in chunks and has not finished: no canvas planned yet
    cuts: int = 0  # consecutive steps vLLM scheduled it otherwise than planned (more than MAX_CUTS: it fails)
    fit_cuts: int = 0  # consecutive steps cut to fit the step's rows (async scheduling: ``_fit``)
    t0: float = field(default_factory=time.perf_counter)


@dataclass
class InFlight:
    """What the runner holds of one step between its ``_prepare_inputs`` and its decode (``_sample``): one object
    a step, made by :meth:`DLLMRunnerMixin._prepare_inputs`. Under a step laid out ahead
    (:meth:`DLLMRunnerMixin._execute_ahead`) step N's is set aside while N + 1's is built, and put back for N's
    decode on the host."""

    rows: tuple  # the step's request ids (vLLM's batch order), query_start_loc, num_computed_tokens
    batch: StepBatch | None = None  # its layout
    stepping: dict[int, _Served] = field(default_factory=dict)  # batch row -> request whose step runs in it
    wasted: set[int] = field(default_factory=set)  # batch rows whose forward nothing reads
    kept: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))  # prediction rows with
    num_kept: int = 0  # logits (DLLMStep.kept), and how many
    want_lp: dict[int, int] = field(default_factory=dict)  # batch row -> logprobs asked (requests decoding)
    asked: tuple | None = None  # (decoding request ids, the logprobs each asks for) (DLLMRunnerMixin._asked)
    decoded_rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # batch row -> (first, count) of the
    # prediction rows its decoder read
    skip_forward: bool = False  # every row wasted: no forward (DLLMRunnerMixin._model_forward)
    forward_t0: float | None = None  # when its input preparation ended (the forward's wall time)
    # under a step laid out ahead: the request ids of vLLM's batch after the next step's update where they differ
    # from this step's (requests joined or left; this step's bookkeeping runs on it), and what requests of this
    # step no longer in it emitted (recorded apart: DLLMRunnerMixin._sample_tokens)
    live: list[str] | None = None
    elsewhere: dict[str, list[int]] = field(default_factory=dict)

    def canvas_rows(self, i: int, step) -> list[int]:
        """The first prediction row of each canvas of batch row ``i``'s ``step``: a step laid out ahead may have
        more canvases in the layout than its plan decodes (:meth:`~model_executor.dllm_request.DLLMRequest.settle`),
        whose rows then decode nothing."""
        return self.batch.canvas_rows[i][: step.num_canvases]


class DLLMRunnerMixin(PSDRunnerMixin):
    """Decodes dLLM requests with :mod:`model_executor.decoding` (module docstring)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.cfg = decode_config(vllm_config)
        # pipeline parallelism: only the last stage has logits, decodes and plans; the others lay out the steps
        # it plans, which reach them with the schedule (NextStep.plan, shipped by the scheduler)
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.decodes = self.pp_size == 1 or compat.last_pipeline_stage()
        self.logits_budget = logits_budget(vllm_config)  # the scheduler keeps every step within it
        self.spec = ArchSpec.from_hf_config(vllm_config.model_config.hf_config)
        self.served: dict[str, _Served] = {}
        self.inflight: InFlight | None = None  # the step in flight (its decode not yet run)
        self._held_prompt_logprobs: dict = {}
        self.totals = {"requests": 0, "tokens": 0, "nfe": 0, "model_calls": 0}
        self.finished: dict[str, dict] = {}  # recent per-request figures, for psd_stats()
        self._last_log, self._logged = time.monotonic(), dict(self.totals)
        # wall time from the end of input preparation to the logits reaching the decoders: the model forward
        # with its attention metadata (synchronous on CPU; on a GPU this would count launches only)
        # cut_steps: a request's planned step that vLLM did not schedule as planned (its rows decoded nothing);
        # resumed: requests back from a preemption; replays: the forwards that rebuilt their K/V (no NFE)
        self.step_time = {"steps": 0, "forward_seconds": 0.0, "cut_steps": 0, "resumed": 0, "replays": 0}
        self._no_indices: torch.Tensor | None = None  # _calc_spec_decode_metadata's empty index fields
        # async scheduling (vLLM's batch queue): a step's decode waits for the next step's start; vLLM's own
        # bookkeeping stays synchronous (it sees every step decoded before the next begins)
        self.overlap = compat.async_scheduling(vllm_config)
        if self.overlap:
            compat.keep_runner_synchronous(self)
            logger.info("psd-plugin: async scheduling on: each step is scheduled while the last one runs")
        self._deferred: DeferredOutput | None = None
        # under tensor parallelism vLLM's worker asks for a step's output from its own thread (WorkerProc's async
        # output thread, on the output rank) while the next step may begin on the worker's: one decode at a time
        self._deferred_lock = threading.Lock()
        self.step_time["deferred"] = 0  # steps whose decode ran while vLLM scheduled the next one
        # forwards: the model's forwards run; skipped_forwards: steps whose every row was wasted (guesses that
        # missed, finished or failed requests), which ran none (:meth:`_model_forward`)
        self.step_time["forwards"] = self.step_time["skipped_forwards"] = 0
        # a step decided ahead (docs/architecture.md "Overlap"): the steps laid out for step N + 1 before N's
        # decisions reached the host (request id -> its DLLMStep), their next block states where N's logits are
        # (request id -> ids), N's predictions and failures until its host decode, N + 1's ids write, and the
        # steps laid out ahead that the plans of N's decode settle (id of the request's _Served -> its step)
        self._ahead: dict | None = None
        self._ahead_ids: dict | None = None
        self._launched: tuple | None = None
        self._ahead_write: tuple | None = None
        self._settling: dict = {}
        # the laid-out ids' copy to the host, queued before N + 1's forward, and each request's place in it
        # (request id -> (offset, canvases, block length)): N's plans are checked against it before they settle
        self._ahead_copy: tuple | None = None
        self._settle_copy: PendingCopy | None = None
        # speculative_config.decide_ahead (auto: where the logits are on an accelerator, with a one-process
        # executor); not under pipeline parallelism. Under vLLM's multiprocess executor (tensor or data
        # parallelism) its output thread asks for the output rank's step N as soon as N is sampled, and the other
        # ranks decode N at N + 1's start: that thread waits for N + 1 to begin (DeferredOutput), and the ranks vote
        # at each step's start (one host all-reduce) whether it is laid out ahead, so that a wait that expired costs
        # that step's overlap, not an agreement. ``auto`` leaves it off there until a GPU run (NCCL, the vote's cost)
        ahead = from_vllm_config(vllm_config).decide_ahead
        output_thread = self.overlap and (compat.executor_backend(vllm_config) == "mp"
                                          or vllm_config.parallel_config.tensor_parallel_size > 1)
        self.decides_ahead = self.overlap and self.pp_size == 1 and (
            ahead == "on" or (ahead == "auto" and torch.device(device).type != "cpu" and not output_thread))
        self.waits_for_next_step = self.decides_ahead and output_thread
        # steps this rank could lay out ahead and did not: the vote found a rank where N was decoded already
        self.step_time["ahead_vetoed"] = 0
        self.step_time["ahead_wait_expired"] = 0  # outputs the output thread decoded before the next step began
        self.step_time["ahead"] = 0  # steps laid out and forwarded before the last step's decode on the host
        # requests of those steps laid out from a plan made on the host before (a cut step's, a first canvas)
        self.step_time["ahead_planned"] = 0
        self.step_time["ahead_rebatched"] = 0  # of those steps, the ones where requests joined or left vLLM's batch
        self.step_time["ahead_left"] = 0  # requests that stepped in N and were not in N + 1's batch (alive)
        # canvases laid out ahead past the plan's (PSD: a draft past the block's masks is not forwarded)
        self.step_time["ahead_idle_canvases"] = 0
        # requests whose laid-out ids (taken where the logits are) were not their plan's canvases (taken on the
        # host): their rows decode nothing. 0 in every engine test but the one that lays wrong ids out on purpose
        # (the two sides decide bit for bit alike by construction; not yet run on a GPU): counted and warned
        # about so that a device that rounds otherwise costs a step, not a lossless answer
        self.step_time["ahead_mismatch"] = 0

    # ------------------------------------------------------------------ per-request decoding state
    def _served(self, req_id: str) -> _Served:
        s = self.served.get(req_id)
        if s is None:
            sp = compat.sampling_params(self, req_id)
            prompt, _ = compat.request_tokens(self, req_id)
            # an unseeded request's draws from its id: every tensor-parallel rank draws the same tokens
            sampling = self.cfg.sampling(sp.temperature, sp.seed if sp.seed is not None else request_seed(req_id),
                                         sp.top_k, sp.top_p, sp.min_p)
            mask = self.spec.mask_token_id
            make = self.cfg.decoder_factory(mask, sampling)
            # decode past the model's EOS exactly when vLLM will not stop there (ignore_eos, or a tokenizer /
            # generation config whose EOS differs): the request then ends where vLLM ends it
            eos = self.spec.eos_token_id
            ignore_eos = sp.ignore_eos or eos not in sp.all_stop_token_ids
            grammar = self._grammar(sp) if self.decodes else None  # a stage that does not decode needs none
            req = DLLMRequest(prompt, sp.max_tokens, self.cfg.block_size, make, mask, eos, aligned=self.cfg.aligned,
                              ignore_eos=ignore_eos, grammar=grammar, schedule=self.cfg.schedule)
            s = self.served[req_id] = _Served(req, rules=request_rules(sp))
        return s

    def _grammar(self, sp) -> GrammarFrontier | None:
        """The request's structured-output grammar (built by the front end: :func:`.validation.take_structured_outputs`,
        compiled off the step by the scheduler: :mod:`.grammars`), or None."""
        text = (sp.extra_args or {}).get(GRAMMAR_ARG)
        if text is None:
            return None
        mc = self.vllm_config.model_config
        info, _ = served_compiler(mc)
        return GrammarFrontier(compiled(mc, text), info.vocab_size, self.spec.eos_token_id, self.spec.mask_token_id)

    def _plan(self, s: _Served, proposal) -> None:
        s.req.plan(proposal)

    def _on_request_state_removed(self, req_id, req_state) -> None:
        s = self.served.pop(req_id, None)
        self._held_prompt_logprobs.pop(req_id, None)
        if s is not None and not s.recorded and req_id not in self.failed:  # aborted, or stopped by a stop string
            self._record(req_id, s)
        self._forget_failure(req_id)
        super()._on_request_state_removed(req_id, req_state)

    def _record(self, req_id: str, s: _Served) -> None:
        s.recorded = True
        r, t = s.req, self.totals
        t["requests"] += 1
        t["tokens"] += r.emitted
        t["nfe"] += r.nfe
        t["model_calls"] += s.model_calls
        self.totals = merge_stats([t, {f"stat_{k}": v for k, v in r.stats.items() if not isinstance(v, list)}])
        self.finished[req_id] = {"nfe": r.nfe, "model_calls": s.model_calls, "emitted": r.emitted,
                                 "seconds": time.perf_counter() - s.t0, **r.stats}
        while len(self.finished) > 10_000:
            self.finished.pop(next(iter(self.finished)))
        logger.debug("psd: request %s: %d tokens, NFE %d, TPF %.2f, %s", req_id, r.emitted, r.nfe,
                     r.emitted / max(1, r.nfe), r.stats)
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            n, tok, nfe = (t[k] - self._logged[k] for k in ("requests", "tokens", "nfe"))
            logger.info("psd %s: %d requests finished, %d tokens in %d decoding forwards (TPF %.2f) since the "
                        "last report; totals: %d requests, TPF %.2f", self.cfg.method, n, tok, nfe,
                        tok / max(1, nfe), t["requests"], t["tokens"] / max(1, t["nfe"]))
            self._last_log, self._logged = now, dict(t)

    # ------------------------------------------------------------------------------ the step
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self._parity ^= 1  # (the staging buffers of this step's uploads: PSDRunnerMixin._upload)
        logits_indices, spec_meta, max_sampled = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        f = self.inflight = InFlight(compat.batch_rows(self))
        req_ids, qsl, computed = f.rows
        resumed = compat.resumed_req_ids(scheduler_output)
        for rid in resumed:  # back from a preemption: vLLM re-prefills it in this forward
            if (s := self.served.get(rid)) is not None and rid not in self.failed:
                try:
                    s.req.preempted()
                except Exception as e:
                    self._fail(rid, "resuming after a preemption", e)
                self.step_time["resumed"] += 1
        entries = []
        plans = compat.shipped_plans(scheduler_output)
        for i, rid in enumerate(req_ids):
            n, start = int(qsl[i + 1]) - int(qsl[i]), int(computed[i])
            entry = Rows(n, start)  # rows that decode nothing (a failed request's too)
            if rid not in self.failed:
                try:
                    entry = self._entry(i, rid, n, start, scheduler_output, rid in resumed, plans.get(rid))
                except Exception as e:
                    self._fail(rid, "planning its step", e)
            if rid in self.failed:
                f.wasted.add(i)
            entries.append(entry)
        if self.overlap:
            self._fit(entries, req_ids)
        # async scheduling: a step scheduled on guesses that all missed (a lone request that finished, blocks that
        # completed) forwards nothing anyone reads: its rows' K/V lies at or after the next real step's window
        # start, which rewrites it (Rows), so the forward is skipped (tensor-parallel ranks check that they agree
        # with the layout: PSDRunnerMixin._check_ranks; async scheduling refuses pipeline parallelism)
        f.batch = self._build(entries, req_ids)
        f.skip_forward = self.overlap and self.pp_size == 1 and len(f.wasted) == len(entries) > 0
        if self._ahead_ids:
            self._ahead_write = self._ids_ahead(entries, req_ids)
        self._publish(f.batch)
        # logits only for the rows the decoders read (a rebuild's: none); vLLM computes at least one row
        kept = [e.kept.numpy() for e in entries if not isinstance(e, Rows)]
        kept = np.concatenate(kept) if kept else np.zeros(0, dtype=bool)
        f.kept = torch.from_numpy(kept)
        idx = f.batch.logits_rows.numpy()[kept]  # host arrays: numpy's boolean take costs a fraction of torch's
        f.num_kept = idx.size
        idx = torch.from_numpy(idx if idx.size else np.zeros(1, dtype=np.int64))
        f.forward_t0 = time.perf_counter()
        idx = self._upload("logits_rows", idx.to(logits_indices.dtype), logits_indices.device)
        return idx, spec_meta, max_sampled

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        """The model's forward, or, for a step whose every row is wasted (:meth:`_prepare_inputs`), zero hidden
        states of its rows' shape: that step decodes nothing and its logits are read by no one."""
        f = self.inflight
        if f is None or not f.skip_forward:
            self.step_time["forwards"] += 1
            return super()._model_forward(input_ids=input_ids, positions=positions,
                                          intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                                          **model_kwargs)
        f.skip_forward = False
        self.step_time["skipped_forwards"] += 1
        return compat.zero_hidden_states(self, (input_ids if input_ids is not None else inputs_embeds).shape[0])

    def _skips_forward(self) -> bool:
        return self.inflight is not None and self.inflight.skip_forward

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
        """vLLM's rejection-sampling metadata of the step's drafts. This runner reads none of its indices (the
        logits rows are the step's own, :meth:`_prepare_inputs`; the decisions are the decoders', :meth:`_sample`),
        so it gets the draft counts alone: not vLLM's index arithmetic, five host-to-device copies and two gathers
        of the input ids every step."""
        if self._no_indices is None:
            self._no_indices = torch.zeros(0, dtype=torch.int32, device=self.device)
        return compat.draft_counts_only(num_draft_tokens, self._no_indices)

    def _entry(self, i: int, rid: str, n: int, start: int, scheduler_output, resumed: bool, shipped=None):
        """Batch row ``i``'s entry of the step: the request's planned step when vLLM scheduled it as planned
        (then it is stepping in this forward), else plain rows. ``shipped``: under pipeline parallelism, the step
        the last stage planned for it (:meth:`_stage_step`)."""
        s, f = self._served(rid), self.inflight
        s.model_calls += 1
        ahead = self._ahead.get(rid) if self._ahead else None
        if ahead is not None and (start, n) == (ahead.w0, ahead.num_scheduled):  # laid out ahead: its ids come
            f.stepping[i] = s  # from the last step's decisions where they were taken (_ids_ahead)
            s.cuts = 0
            return ahead
        drafts = compat.scheduled_drafts(scheduler_output, rid)
        first = s.req.phase == "first" and s.req.step is None and drafts
        if first:
            s.req.prefix_written(start)  # a prefix-cache hit: the block cache reads its whole attention blocks
            self._plan(s, propose_all([s.req.dec])[0])  # the first canvas, with the prompt (DLLMScheduler)
        st = s.req.step if self.decodes else self._stage_step(s, shipped)
        if st is not None and start == st.w0 and n == st.num_scheduled and drafts == st.drafts:
            if self.decodes and self.pp_size > 1 and not (same_step(st, shipped) if shipped is not None else first):
                # the stages before this one lay out the shipped plan (or, for a first canvas, plan it as here)
                raise RuntimeError("pipeline stages disagree on the request's step: the last stage planned "
                                   f"{_describe(st)}, the schedule carries {_describe(shipped)}")
            f.stepping[i] = s
            s.cuts = 0
            return st
        # a prefill (a re-prefill after a preemption too), or a step vLLM cut short: its rows decode nothing;
        # wasted (nothing reads their K/V) where they are a guess, scheduled with drafts (a prefill's chunk, the
        # rows of a re-prefill too, has none: its K/V is read)
        if drafts and (s.req.done or (st is not None and not resumed)):
            f.wasted.add(i)
        if st is not None and not resumed:
            self.step_time["cut_steps"] += 1
            s.cuts += 1
            if s.cuts > MAX_CUTS:  # the plan and vLLM's schedule disagree for good: the request would spin
                raise RuntimeError(
                    f"vLLM scheduled {n} rows from position {start} with {len(drafts)} drafts, {s.cuts} steps in a "
                    f"row, where the request planned {st.num_scheduled} rows from {st.w0} with {len(st.drafts)}")
        return Rows(n, start)

    def _fit(self, entries: list, req_ids: list[str]) -> None:
        """Under async scheduling the scheduler budgeted each step's extra canvases and logits rows on a guess
        (the request's last step's); where the planned drafts outgrew it past vLLM's input buffers or the logits
        budget, steps are cut: those cut fewest times in a row first (no request starves), then those with the most
        extra rows (counted; the plan stays, and the next step scheduled for it forwards it)."""
        cap, budget, f = compat.input_capacity(self), self.logits_budget, self.inflight
        steps = [i for i, e in enumerate(entries) if not isinstance(e, Rows) and e.num_canvases > 1]
        rows = sum(e.n if isinstance(e, Rows) else e.num_scheduled + (e.num_canvases - 1) * e.seg_len for e in entries)
        logits = sum(0 if isinstance(e, Rows) else e.num_logits_rows for e in entries)
        order = sorted(steps, key=lambda i: (f.stepping[i].fit_cuts if i in f.stepping else 0,
                                             -(entries[i].num_canvases - 1) * entries[i].seg_len))
        for i in order:
            if rows <= cap and logits <= budget:
                break
            e = entries[i]
            rows -= (e.num_canvases - 1) * e.seg_len
            logits -= e.num_logits_rows
            entries[i] = Rows(e.num_scheduled, e.w0)
            f.wasted.add(i)
            if (s := f.stepping.pop(i, None)) is not None:
                s.fit_cuts += 1
            self.step_time["cut_steps"] += 1
        for s in f.stepping.values():
            s.fit_cuts = 0

    def _stage_step(self, s: _Served, shipped):
        """A stage before the last decodes nothing: a request's step is what the last stage planned and the
        schedule carries (``shipped``), or its first canvas, which every stage plans alike from the prompt
        (:meth:`_entry`)."""
        if shipped is not None:
            return shipped
        return s.req.step if s.req.phase == "first" else None

    def _build(self, entries: list, req_ids: list[str]) -> StepBatch:
        """The step's layout; where it cannot be built, the entries that cannot be laid out even alone are
        failed (:meth:`_fail`) and become plain rows."""
        try:
            return build_step_batch(entries)
        except Exception as e:
            if engine_fault(e):
                raise
        for i, e in enumerate(entries):
            if not isinstance(e, Rows):
                try:
                    build_step_batch([e])
                except Exception as err:
                    self._fail(req_ids[i], "laying out its step", err)
                    entries[i] = Rows(e.num_scheduled, e.w0)
                    self.inflight.stepping.pop(i, None)
                    self.inflight.wasted.add(i)
        return build_step_batch(entries)

    def _dummy_sampler_run(self, hidden_states):
        """vLLM's memory profile runs this after its largest forward and sizes the KV cache from the peak: a
        step's logits are its canvas rows, up to :attr:`logits_budget` of them (not one row per request, as vLLM
        profiles), with the predictions' work buffer, so the profile computes those too."""
        if hidden_states.shape[0]:
            rows = torch.rand_like(hidden_states[:1]).expand(self.logits_budget, -1).contiguous()
            predict_rows(self.model.compute_logits(rows), mask_id=self.spec.mask_token_id)
        return super()._dummy_sampler_run(hidden_states)

    def _sample(self, logits, spec_decode_metadata):
        """Decoder updates from this step's logits; a completed block is this step's sampled tokens. What raises
        for one request fails that request alone (:meth:`~.runner.PSDRunnerMixin._fail`)."""
        f = self.inflight
        if f.forward_t0 is not None:
            self.step_time["steps"] += 1
            self.step_time["forward_seconds"] += time.perf_counter() - f.forward_t0
            f.forward_t0 = None
        self._publish(None)
        req_ids, qsl, computed = f.rows
        steps = {i: s.req.step for i, s in f.stepping.items()}
        canvas_rows = {i: f.canvas_rows(i, st) for i, st in steps.items()}
        # each decoding entry's prediction rows: its plan's canvases (under a step laid out ahead, not the idle ones)
        f.decoded_rows = {i: (c[0], len(c) * steps[i].block_len) for i, c in canvas_rows.items() if c}
        logits = logits[: f.num_kept]  # past them: vLLM's one row when the step keeps none
        decoding = [i for i, st in steps.items() if not st.rebuild]  # a rebuild's logits are not for the decoder
        self._decode(logits, decoding, steps, canvas_rows, req_ids)
        outs: list[list[int]] = []
        lps: dict[int, list] = {}  # batch row -> (token, logprob, top, rank) of each emitted token
        f.elsewhere = {}
        for i, rid in enumerate(req_ids):
            emit: list[int] = []
            if rid not in self.failed and not self._gone(rid):
                try:
                    emit = self._stepped(i, rid, steps.get(i), lps, int(computed[i]) + int(qsl[i + 1] - qsl[i]))
                except Exception as e:
                    self._fail(rid, "committing its step", e)
            outs.append([] if rid in self.failed else emit)
        lps = {i: v for i, v in lps.items() if req_ids[i] not in self.failed}
        want = f.want_lp
        if f.live is not None:  # vLLM's batch is N + 1's now (_execute_ahead): its bookkeeping takes this order
            live = set(f.live)  # (what a request that left it alive emits is recorded apart: _sample_tokens)
            f.elsewhere = {rid: o for rid, o in zip(req_ids, outs) if o and rid not in live}
            at = {rid: i for i, rid in enumerate(req_ids)}
            order = [at.get(rid) for rid in f.live]
            outs = [outs[i] if i is not None else [] for i in order]
            lps = {j: lps[i] for j, i in enumerate(order) if i in lps}
            want = {j: want[i] for j, i in enumerate(order) if i in want}
        width = max(2, max((len(o) for o in outs), default=0))
        sampled = torch.tensor([o + [-1] * (width - len(o)) for o in outs], dtype=torch.int32).view(len(outs), width)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=_logprobs_tensors(lps, want, width,
                                                                                           len(outs)))

    def _get_nans_in_logits(self, logits) -> dict[str, int]:
        """vLLM's per-request count of NaN logits (``VLLM_COMPUTE_NANS_IN_LOGITS``: opt-in diagnostics, read on
        the host), over each request's own rows: a dLLM step's logits are its canvases' kept rows, in the step's
        order, where vLLM reads row ``i`` as batch row ``i``'s and so credits one request's NaNs to another. Keyed
        by the batch vLLM's bookkeeping runs on (under a step laid out ahead, the next step's:
        :attr:`InFlight.live`). ``VLLM_RAISE_ON_LOGIT_NANS`` raises on them, as in vLLM."""
        f = self.inflight
        if logits is None or f is None or f.batch is None:
            return {}
        nans = torch.isnan(logits[: f.num_kept]).sum(-1).cpu().numpy()
        at = logits_map(f.kept).numpy()  # prediction row -> its logits row (-1: none computed)
        firsts = [(i, c[0]) for i, c in enumerate(f.batch.canvas_rows) if c]
        out = dict.fromkeys(f.live if f.live is not None else f.rows[0], 0)
        for (i, a), (_, b) in zip(firsts, firsts[1:] + [(None, at.size)]):
            if i in f.decoded_rows:  # (a step laid out ahead: the canvases past its plan's decode nothing)
                a, n = f.decoded_rows[i]
                b = a + n
            rows = at[a:b]  # the entry's prediction rows: contiguous, in order
            rid = f.rows[0][i]
            if rid in out:
                out[rid] = int(nans[rows[rows >= 0]].sum())
        return compat.nan_counts_checked(out)

    def _gone(self, rid: str) -> bool:
        """Whether a request of the step being decoded has left vLLM's batch since (finished or aborted: under a
        step laid out ahead, the next step's update ran first); it did not step in it (:meth:`_plan_ahead`)."""
        return self.inflight.live is not None and rid not in self.served and rid not in self.failed

    def _decode(self, logits, decoding: list[int], steps: dict, canvas_rows: dict, req_ids: list[str]) -> None:
        """The decoders of the batch rows ``decoding`` take this step's predictions, and logprobs are recorded for
        the requests that ask (:func:`~model_executor.dllm_request.decode_step`, the reference engine's step
        too). A request whose rules, grammar, logits (non-finite), update or logprobs raise is failed; the others'
        decoding is that of a step without it; what no one request caused fails the step's requests."""
        f = self.inflight
        served = f.stepping
        rids = [req_ids[i] for i in decoding]
        asked = self._asked(f, rids)
        f.want_lp = {i: k for i, k in zip(decoding, asked) if k is not None}
        failed: dict[int, Exception] = {}
        reqs, sts = [served[i].req for i in decoding], [steps[i] for i in decoding]
        rows = [canvas_rows[i] for i in decoding]
        if self._launched is not None:  # its decisions were taken ahead (_launch_ahead): their copy is waited for
            preds, failed = self._launched
            if preds is not None:
                self._contain("decoding its step", rids, update_step, preds, reqs, sts, rows, asked, failed)
        else:
            self._contain("decoding its step", rids, decode_step, logits, f.kept, self.spec.mask_token_id, reqs,
                          sts, rows, [served[i].rules for i in decoding], asked, failed, self._staging)
        for n, e in failed.items():
            self._fail(rids[n], "decoding its step", e)

    def _stepped(self, i: int, rid: str, step, lps: dict, end: int) -> list[int]:
        """Batch row ``i``'s bookkeeping after the step (its decoder took the predictions; ``end``: where the K/V
        it forwarded ends); returns the tokens it emits (a completed block)."""
        s, f = self._served(rid), self.inflight
        if i in f.stepping and step.rebuild:  # the K/V is as that block's first step left it
            s.req.rebuilt()
            self.step_time["replays"] += 1
        elif i in f.stepping:
            emit = s.req.stepped(step)
            if emit and i in f.want_lp:
                lps[i] = s.req.logprobs_of(step.b0 - s.req.prompt_len, len(emit))
            if s.req.done:
                self._record(rid, s)
            return emit
        elif s.req.step is None and self.spec.attention == "block_causal" and s.req.nfe == 0:
            # vLLM's prefill (after a prefix-cache hit, or in chunks) wrote exact K/V for the prompt's finished
            # attention blocks once it reached the prompt's end; before that the request plans no canvas
            s.prefilling = end < s.req.prompt_len
            if not s.prefilling:
                s.req.prefix_written(s.req.prompt_len)
        return []

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        """Each running request's next canvas (module docstring)."""
        req_ids = [rid for rid in self.inflight.rows[0] if not self._gone(rid)]
        drafts, nexts = [], []
        ready = [(rid, s) for rid in req_ids if rid not in self.failed and (s := self._served(rid)).req.needs_proposal
                 and not s.prefilling]
        # the canvases of every request about to step, a method at a time
        proposals = dict(zip((id(s) for _, s in ready), self._propose(ready)))
        for rid in req_ids:
            st = None
            if rid not in self.failed:
                try:
                    st = self._next(self._served(rid), proposals)
                except Exception as e:
                    self._fail(rid, "planning its next step", e)
            st = None if rid in self.failed else st
            drafts.append(list(st.drafts) if st else [])
            # planned: a replay past a narrow window has rows but no drafts; under pipeline parallelism the step
            # itself travels to the other stages (without its proposal, which only this stage's decoder reads)
            plan = dataclasses.replace(st, proposal=None) if st and self.pp_size > 1 else None
            nexts.append(self._ticket(self._served(rid), st, plan) if st else NextStep(NO_REWIND))
        self.set_next_drafts(req_ids, drafts, nexts)
        return drafts

    def _ticket(self, s: _Served, st, plan) -> NextStep:
        """The scheduler's view of a request's planned step ``st``; under async scheduling with the step after
        it as guessed (:meth:`~model_executor.dllm_request.DLLMRequest.step_after`)."""
        then = None
        if self.overlap and (after := s.req.step_after(st)) is not None:
            w0, rows, extra, logits = after
            then = NextStep(w0, extra, logits, True, num_scheduled=rows)
        return NextStep(st.w0, (st.num_canvases - 1) * st.seg_len, st.num_logits_rows, True, plan,
                        num_scheduled=st.num_scheduled, then=then)

    def _next(self, s: _Served, proposals: dict):
        """The request's next step, planned from its proposal (or its next replay); None when it is done."""
        r = s.req
        if r.phase == "rebuild" and r.step is None:
            r.plan_rebuild()
        elif id(s) in proposals:
            if proposals[id(s)] is None:  # its proposal failed (_propose)
                return None
            self._plan(s, proposals[id(s)])
            if (got := self._settling.get(id(s))) is not None:  # its next step is laid out and forwarded already
                ahead, at = got  # (where the plan is that step, it is the step; else those rows decode nothing)
                if at is not None and self._laid_out_as_planned(r.step, ahead, at):  # (None: no ids written for
                    r.settle(ahead)  # it, its layout cut: its plan stays the step)
        return None if r.done else r.step

    def _propose(self, ready: list[tuple[str, _Served]]) -> list:
        """:func:`propose_all` of the requests ``ready`` (a proposal reads its decoder and changes nothing); where
        it raises, each is proposed alone, and one that raises alone is failed (its proposal None)."""
        decs = [s.req.dec for _, s in ready]
        try:
            return propose_all(decs)
        except Exception as e:
            if engine_fault(e):
                raise
        out = []
        for (rid, _), d in zip(ready, decs):
            try:
                out.append(propose_all([d])[0])
            except Exception as e:
                self._fail(rid, "proposing its canvases", e)
                out.append(None)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        """Under async scheduling the last step is decoded first (its commits, then each request's next step),
        and the scheduled placeholder drafts of a step planned as scheduled become its canvas ids; then vLLM's
        step as ever. Where the last step's decisions can be taken ahead (:meth:`_plan_ahead`), this step is
        laid out and forwarded first, and the last one decoded on the host after (:meth:`_execute_ahead`)."""
        if self.overlap:
            with self._deferred_lock:  # (vLLM's output thread may be decoding the last step now)
                d = self._deferred
                if d is not None:
                    d.released.set()  # (the output thread then waits on this lock: N is decoded here)
                ahead = fault = None
                if d is not None and d.output is None and d.error is None:
                    try:
                        ahead = self._plan_ahead(scheduler_output, d)
                    except BaseException as e:  # (raised after the vote, which every rank joins every step)
                        fault = e
                if self.waits_for_next_step and not self._every_rank(ahead is not None):
                    self.step_time["ahead_vetoed"] += ahead is not None  # (another rank's output thread decoded)
                    ahead = None
                if fault is not None:
                    raise fault
                if ahead is not None:
                    return self._execute_ahead(d, ahead, scheduler_output, *args, **kwargs)
                self._decode_deferred()
            self._adopt_plans(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    # ------------------------------------------------------------------ a step decided ahead
    def _plan_ahead(self, scheduler_output, d: DeferredOutput) -> dict | None:
        """The steps to lay out for this schedule before the last step (in flight, not decoded) reaches the host,
        or None, where it cannot be done: request id -> its step
        (:meth:`~model_executor.dllm_request.DLLMRequest.continuation`).
        Only where every request that stepped in the last step is scheduled now as its block going on, or not at
        all (it leaves vLLM's batch alive: what it emits is recorded apart; not with logprobs), none of them
        finished and no one preempted or resumed (:func:`.compat.carries_over`), and every such decoder decides
        ahead (:func:`~model_executor.decoding.base.decides_ahead`: every method, no grammar). A request
        that did not step in it (its rows were cut: a block completed before, a guess missed; or it failed) is laid
        out as ever, from the step planned for it before, which the last step's decode does not touch; one that
        the decode would plan (no step planned yet) keeps the whole step from being laid out ahead. Requests may
        join and leave vLLM's batch (the last step's output is put in the batch's new order for vLLM's bookkeeping
        and back: :meth:`_sample`, :meth:`_sample_tokens`); not where vLLM applies a grammar bitmask (by its rows)."""
        f = self.inflight
        if not self.decides_ahead or f is None or not f.stepping \
                or not compat.scheduled_req_ids(scheduler_output):  # (nothing to lay out: N decodes as ever)
            return None
        rows = f.rows
        stepped = [rows[0][i] for i in f.stepping]
        if not compat.carries_over(scheduler_output, stepped) or d.grammar_output is not None \
                or compat.prompt_logprobs_pending(self):  # (vLLM's bookkeeping of N reads them from N + 1's state)
            return None
        if not decides_ahead([s.req.dec for s in f.stepping.values() if s.req.dec is not None]) \
                or compat.kv_connector():
            return None
        sched = compat.scheduled_rows(scheduler_output)
        ahead = {}
        for i, rid in enumerate(rows[0]):
            s = f.stepping.get(i)
            if s is None:  # it did not step in N (its rows were cut; it failed, or is done): N's decode leaves it
                t = self.served.get(rid)  # as it is, and its next step, planned already, is laid out as ever (_entry)
                if rid not in self.failed and (t is None or not t.req.done and t.req.step is None):
                    return None  # (N's decode would plan it: a proposal, a prefill's end, a replay)
                continue
            st = s.req.step
            if rid in self.failed or st is None or st.rebuild or s.req.dec is None:
                return None
            if rid not in sched:  # it leaves vLLM's batch alive (a certain completion
                if compat.sampling_params(self, rid).logprobs is not None:  # of its block waits for its outcome;
                    return None  # no room in the step): what N emits is recorded for it (_sample_tokens)
                continue
            nxt = s.req.continuation(st)
            if nxt is None or sched.get(rid) != (nxt.w0, nxt.num_scheduled):
                return None
            ahead[rid] = nxt
        return ahead

    def _execute_ahead(self, d: DeferredOutput, ahead: dict, scheduler_output, *args, **kwargs):
        """Step N + 1 before step N's host decode (the deferred ``d``), under its lock: N's decisions are taken
        where its logits are and their copy to the host queued (:meth:`_launch_ahead`); N + 1 is laid out from
        ``ahead`` (geometry only), its canvases' ids written on the device from those decisions (:meth:`_preprocess`),
        and forwarded; then N is decoded on the host as ever (vLLM's ``sample_tokens`` of N: the decoders take
        the queued copy, vLLM's bookkeeping, the proposal), while N + 1 runs. N's plans settle the steps laid out
        ahead; the rows of a request whose plan is another step (N completed its block, or it failed) decode
        nothing (a cut step, as when the scheduler's guess misses). vLLM's per-step state of N (its
        ``execute_model`` outputs) and the runner's are set aside around N + 1's ``execute_model``."""
        outputs_n, step_n = compat.take_step_outputs(self), self.inflight
        stream = torch.cuda.stream(d.stream) if d.stream is not None else contextlib.nullcontext()
        try:
            with torch.inference_mode(), stream:
                preds, failed, ids = self._launch_ahead(compat.step_logits(outputs_n))
            self._ahead, self._ahead_ids = ahead, ids
            self._adopt_plans(scheduler_output, ahead)  # (the others' steps are planned: their ids are known)
            out = super().execute_model(scheduler_output, *args, **kwargs)
            if self.inflight is step_n:  # (_plan_ahead asks for a schedule whose inputs vLLM prepares)
                raise RuntimeError("psd-plugin: vLLM ran a step laid out ahead without preparing its inputs")
        except BaseException as e:  # (an engine fault: N is not decoded, and asking for its output raises this)
            d.error, self._deferred, self._ahead_copy = e, None, None
            raise
        finally:
            self._ahead = self._ahead_ids = self._ahead_write = None
        outputs_next, step_next = compat.take_step_outputs(self), self.inflight
        compat.put_step_outputs(self, outputs_n)
        self.inflight = step_n
        copy, where = self._ahead_copy or (None, {})
        self._ahead_copy, self._settle_copy = None, copy
        self._settling = {id(s): (ahead[rid], where.get(rid)) for rid in ahead
                          if (s := self.served.get(rid)) is not None}
        self._launched = preds, failed
        # vLLM's batch as N + 1 left it (requests joined or left): N's bookkeeping runs on it
        live = compat.batch_req_ids(self)
        step_n.live = live if live != step_n.rows[0] else None
        self.step_time["ahead_rebatched"] += step_n.live is not None
        self.step_time["ahead_left"] += sum(step_n.rows[0][i] not in live for i in step_n.stepping)
        try:
            self._decode_deferred(d)
        finally:
            self._launched, self._settling, self._settle_copy = None, {}, None
            self.inflight = step_next
            compat.put_step_outputs(self, outputs_next)
        req_ids = step_next.rows[0]
        for i, s in list(step_next.stepping.items()):
            if req_ids[i] not in ahead:  # laid out from its plan, made before (N's decode left it as it was)
                self.step_time["ahead_planned"] += 1
            elif s.req.step is ahead[req_ids[i]]:  # settled; canvases laid out past its plan's decode nothing
                self.step_time["ahead_idle_canvases"] += len(step_next.batch.canvas_rows[i]) - s.req.step.num_canvases
            elif s.req.step is not ahead[req_ids[i]]:  # its plan is another step: these rows decode nothing
                del step_next.stepping[i]
                step_next.wasted.add(i)
                if s.req.step is not None:  # (a request done at N: wasted rows, not a cut step, as in _entry)
                    self.step_time["cut_steps"] += 1
                    s.cuts += 1
        self.step_time["ahead"] += 1
        return out

    def _asked(self, f: InFlight, rids: list[str]) -> list[int | None]:
        """The logprobs each of the step's decoding requests asks for (None: none), read once a step: a step laid
        out ahead reads them when its decisions launch and again when it is decoded."""
        if f.asked is None or f.asked[0] != rids:
            f.asked = rids, [compat.sampling_params(self, rid).logprobs for rid in rids]
        return f.asked[1]

    def _launch_ahead(self, logits) -> tuple:
        """Step N's decisions (:meth:`_execute_ahead`) taken where its ``logits`` are
        (:func:`~model_executor.dllm_request.launch_step`), the host waiting for nothing: ``(predictions,
        failures by index into the decoding rows, request id -> its next block state there)``; the failures are
        failed by N's host decode (:meth:`_decode`)."""
        f = self.inflight
        req_ids = f.rows[0]
        steps = {i: s.req.step for i, s in f.stepping.items()}
        decoding = [i for i, st in steps.items() if not st.rebuild]
        rids = [req_ids[i] for i in decoding]
        failed: dict[int, Exception] = {}
        if logits is None:
            return None, failed, {}
        got = self._contain("decoding its step", rids, launch_step, logits[: f.num_kept], f.kept,
                            self.spec.mask_token_id, [f.stepping[i].req for i in decoding],
                            [steps[i] for i in decoding], [f.canvas_rows(i, steps[i]) for i in decoding],
                            [f.stepping[i].rules for i in decoding], failed, self._staging, self._asked(f, rids))
        if got is None:  # (what no one request caused: every one failed already)
            return None, failed, {}
        preds, nexts = got
        return preds, failed, {rid: t for rid, t in zip(rids, nexts) if t is not None}

    def _ids_ahead(self, entries: list, req_ids: list[str]) -> tuple | None:
        """The block ids of the steps laid out ahead, every canvas's: ``(rows of vLLM's input buffer, their ids
        where the last step's logits are, request id -> (offset, canvases, block length) in them)``, which
        :meth:`_preprocess` writes after vLLM's own copy of the placeholders (the first canvas's rows) and of the
        runner's extra rows (the further canvases')."""
        dst, src, where, at = [], [], {}, 0
        batch = self.inflight.batch
        logits_rows = batch.logits_rows.numpy()
        for i, rid in enumerate(req_ids):
            e, ids = entries[i], self._ahead_ids.get(rid)
            if ids is None or e is not self._ahead.get(rid):
                continue
            if ids.shape[0] != e.num_canvases:
                raise RuntimeError(f"psd-plugin: a step laid out ahead with {e.num_canvases} canvases got "
                                   f"{ids.shape[0]} from the last step's decisions")
            for a in batch.canvas_rows[i]:  # the row predicting the block's first position, then that position
                b = int(logits_rows[a]) + e.shift
                dst.append(np.arange(b, b + e.block_len))
            src.append(ids.reshape(-1))
            where[rid] = (at, ids.shape[0], ids.shape[1])
            at += ids.numel()
        if not dst:
            return None
        return torch.from_numpy(np.concatenate(dst)), torch.cat(src), where

    def _laid_out_as_planned(self, st, ahead, at: tuple) -> bool:
        """Whether the step ``ahead``, laid out for a request before its last step's decisions reached the host,
        forwarded the canvases of ``st``, the plan the host made after the update: the ids written where those
        decisions were taken (copied back, ``at`` their place in that copy) against the plan's. The methods make
        both bit for bit alike (their ``launch_batch``); where they are not, the step's rows decode nothing (the
        plan is forwarded as a step of its own: a wasted forward, the answer unchanged),
        ``step_time["ahead_mismatch"]`` counts it, and a warning says so. True where there is nothing to compare
        (no plan, or another step than ``ahead``'s: ``settle`` decides). What is compared is what the forward read:
        the rows of vLLM's input buffer the ids were written to (:meth:`_preprocess`)."""
        if st is None or st.proposal is None or self._settle_copy is None or st.geometry != ahead.geometry:
            return True
        off, K, L = at
        plan = st.proposal.canvases
        if len(plan) > K or any(c.numel() != L for c in plan):
            return True
        launched = self._settle_copy.wait().numpy()[off: off + K * L].reshape(K, L)
        if np.array_equal(launched[: len(plan)], np.stack([c.numpy() for c in plan])):
            return True
        self.step_time["ahead_mismatch"] += 1
        if self.step_time["ahead_mismatch"] == 1:
            logger.warning("psd-plugin: a step laid out ahead forwarded other canvases than its request's plan (the "
                           "decisions taken where the logits are and on the host differ); its rows decode "
                           "nothing and the plan runs as a step of its own. Answers are unaffected; please report "
                           "it with the device and method (step_time['ahead_mismatch'] counts them)")
        return False

    def _preprocess(self, scheduler_output, num_input_tokens, intermediate_tensors=None):
        out = super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        if self._ahead_write is not None:
            rows, ids, where = self._ahead_write
            self._ahead_write = None
            buf, _ = compat.input_buffers(self)
            at = self._upload("ahead_rows", rows, buf.device)
            buf.index_copy_(0, at, ids.to(buf.dtype))
            # what the forward will read there, copied to the host behind the write and before the forward
            # (waiting for it waits for the decisions, not for the forward): each request's plan is checked
            # against it before it settles the step (_laid_out_as_planned)
            self._ahead_copy = PendingCopy(buf.index_select(0, at)), where
        return out

    def _adopt_plans(self, scheduler_output, ahead: dict | None = None) -> None:
        """The scheduler scheduled each continuing request's step before this runner planned it (async
        scheduling), with placeholder drafts; where the planned step is the scheduled one (its rows and draft
        count), its drafts replace them, so vLLM lays out its ids. Another schedule is a cut step (:meth:`_entry`).
        ``ahead``: the requests whose step is laid out ahead (:meth:`_execute_ahead`; their ids come from the last
        step's decisions), left as they are."""
        compat.align_output_counts(self, scheduler_output)
        for rid, (start, n) in compat.scheduled_rows(scheduler_output).items():
            if ahead and rid in ahead:
                continue
            s = self.served.get(rid)
            st = None if s is None or rid in self.failed else s.req.step
            if st is None or start != st.w0 or n != st.num_scheduled:
                continue
            drafts = compat.scheduled_drafts(scheduler_output, rid)
            if drafts and len(drafts) == len(st.drafts) and drafts != st.drafts:
                compat.replace_scheduled_drafts(scheduler_output, rid, st.drafts)

    def _finish_deferred(self, d: DeferredOutput | None = None) -> None:
        """The deferred step's decode (:meth:`sample_tokens`), its ticket on its output; ``d``: the output asked
        for (vLLM's output thread; a step's is always the one deferred: the next step decodes it first), else
        the one deferred, if any."""
        with self._deferred_lock:
            self._decode_deferred(d)

    def _decode_deferred(self, d: DeferredOutput | None = None) -> None:
        """:meth:`_finish_deferred`, its lock held."""
        d = self._deferred if d is None else d
        if d is not None and d.error is not None:
            raise d.error
        if d is None or d.output is not None:
            return
        assert d is self._deferred, "a deferred step's output asked for after the next step began"
        try:
            with torch.inference_mode(), (torch.cuda.stream(d.stream) if d.stream is not None
                                          else contextlib.nullcontext()):
                out = self._sample_tokens(d.grammar_output)
            d.output = compat.attach_ticket(out, self.take_draft_token_ids())
            self.step_time["deferred"] += 1
        except BaseException as e:
            d.error = e
            raise
        finally:  # (cleared only now: the next step waits on the lock, not on this)
            self._deferred = None
            d.released.set()

    def sample_tokens(self, grammar_output):
        """The step's decode (:meth:`_sample`) and next canvases (:meth:`propose_draft_token_ids`); under async
        scheduling deferred to the next step's start (:class:`DeferredOutput`), so vLLM schedules that step and
        processes the previous one's output while the device runs this one."""
        if self.overlap:
            self._deferred = DeferredOutput(self, grammar_output)
            return self._deferred
        return self._sample_tokens(grammar_output)

    def _sample_tokens(self, grammar_output):
        out = super().sample_tokens(grammar_output)
        f = self.inflight
        if f is not None and f.live is not None:  # (vLLM's bookkeeping ran on N + 1's batch: back to this order)
            for rid, tokens in f.elsewhere.items():
                compat.record_output_tokens(self, rid, tokens)
            out = compat.reorder_output(out, f.rows[0], f.elsewhere)
        # prompt logprobs (computed in the prefill forward) travel with the request's first emitted block:
        # the scheduler sends nothing for a step that emits no token
        plp = getattr(out, "prompt_logprobs_dict", None)
        if plp is None:
            return out
        for rid, i in out.req_id_to_index.items():
            emitted = bool(out.sampled_token_ids[i]) if i < len(out.sampled_token_ids) else False
            if rid in plp and not emitted:
                self._held_prompt_logprobs[rid] = plp.pop(rid)
            elif emitted and rid in self._held_prompt_logprobs:
                plp[rid] = self._held_prompt_logprobs.pop(rid)
        return out

    def psd_stats(self) -> dict:
        # the last step's decode is deferred until the next step; on a tensor-parallel rank whose output vLLM does
        # not read, nothing else runs it: these counters include it
        self._finish_deferred()
        t = dict(self.totals)
        t["tpf"] = t["tokens"] / max(1, t["nfe"])
        t["failed"] = self.failures
        # decodes: this rank runs the decoders (under pipeline parallelism the last stage's ranks alone do)
        # plans_reused: steps whose attention ran on the previous step's plan (the same layout over the same pages)
        reused = sum(getattr(b, "reused", 0) for b in compat.metadata_builders(self))
        return {"totals": t, "requests": dict(self.finished), "step_time": {**self.step_time, "plans_reused": reused},
                "decodes": self.decodes}
