"""The dLLM decoding path on vLLM's V1 CPU runner: canvases as draft tokens over the paged KV cache.

Protocol (vLLM's DiffusionGemma idea, on the V1 runner): a request's current *canvas* (its block, with
mask tokens where undecoded, plus the mask tokens after the block) travels as its draft tokens. One
scheduled step = one forward = one decoder step of every running request. Every draft is reported
rejected until a block is complete; then the block's tokens are reported as sampled tokens (so streaming
emits a block when it commits, and vLLM's stop checks truncate at EOS / ``max_tokens`` / stop strings).
After each step the runner tells the scheduler where the next forward starts (``recompute_from``): the
K/V before it is final and stays in the paged cache; everything from there on is recomputed in the same
forward that reads it, so no stale draft K/V is ever read (:mod:`model_executor.block_schedule` gives the
window; it is the reference engine's, so both engines forward the same tokens at the same positions).

Several canvases per step (PSD, LoPA, FreeDave, Spiffy drafts): canvas ``k >= 1`` is appended to the
drafts as ``[recomputed tokens | canvas | trailing masks]``, forwarded at the *same* positions as canvas 0
(positions rewritten for RoPE), with its K/V written to private pages of the request and its own
block-table row (``attention_backends.segments``): it sees the shared paged prefix and itself, never
another canvas. The scheduler reserves the private pages per request (``extra_slots``).

What runs where: this runner subclasses the V1 ``CPUModelRunner`` (CPU, and what CI tests). Model Runner V2
(GPUs) would carry the same per-request state in a ``ModelState`` as DiffusionGemma does; not built yet.

Choices: the first forward of a request is vLLM's prompt prefill (no canvas yet; counted in
``model_calls``, not in NFE, as the PSD paper counts decoding forwards). For block-causal models (SDAR) its
K/V of the prompt's finished attention blocks is exact and reused. After a preemption vLLM re-prefills the
prompt and committed tokens and the block's decoder continues where it was; with the prefix cache the
block's first forward is run once more first (:meth:`DLLMModelRunner._rebuild_step`), so the outputs stay
those of an uninterrupted run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.logger import init_logger
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput, SamplerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from attention_backends.segments import PrivatePages, Segment, set_step_segments
from model_executor.block_schedule import cached_after_step, plan_blocks, window
from model_executor.decoding import BlockDecoder, make_decoder, merge_stats
from model_executor.models.configs import ArchSpec

from .speculative import from_vllm_config

logger = init_logger(__name__)


@dataclass
class DLLMDraftTokenIds(DraftTokenIds):
    """Draft tokens (the canvases) plus, per request, where the next forward starts and the KV slots to
    reserve beyond the scheduled tokens (private pages of extra canvases)."""

    recompute_from: list[int] = field(default_factory=list)
    extra_slots: list[int] = field(default_factory=list)


@dataclass
class _Step:
    """What one request forwards next: ``n_canvases`` segments of ``seg_len`` tokens from ``rf``."""

    rf: int
    seg_len: int
    n_canvases: int
    drafts: list[int]
    first_row: int  # row of the block's first prediction inside a segment
    block_len: int
    extra_slots: int
    rebuild: bool = False  # re-forwards the block's first step only to restore the prefix K/V (after preemption)


@dataclass
class _Request:
    prompt_len: int
    total: int
    blocks: list[tuple[int, int]]
    make: object
    blk: int = 0
    dec: BlockDecoder | None = None
    fresh: bool = True
    cached: int = 0
    nfe: int = 0
    model_calls: int = 0
    emitted: int = 0
    stats: dict = field(default_factory=dict)
    step: _Step | None = None
    recorded: bool = False
    ignore_eos: bool = False
    pending: _Step | None = None  # the step to resume with once a rebuild step has run
    t0: float = field(default_factory=time.perf_counter)


class DLLMModelRunner(CPUModelRunner):
    """``CPUModelRunner`` that decodes dLLM requests with :mod:`model_executor.decoding` (module docstring)."""

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        self.psd = from_vllm_config(vllm_config)
        self.spec = ArchSpec.from_hf_config(vllm_config.model_config.hf_config)
        self.shift = int(self.spec.shift_logits)
        self.graph = None
        if self.psd.decoding == "spiffy":
            from .config import spiffy_graph

            self.graph = spiffy_graph(self.psd, vllm_config.model_config.model, self.psd.block_size)
        self.dllm: dict[str, _Request] = {}
        self._plan: dict[int, list[int]] = {}
        self._held_prompt_logprobs: dict = {}
        self.totals = {"requests": 0, "tokens": 0, "nfe": 0, "model_calls": 0}
        self.finished: dict[str, dict] = {}  # recent per-request figures, for psd_stats()
        self._last_log, self._logged = time.monotonic(), dict(self.totals)

    # ------------------------------------------------------------------ per-request decoding state
    def _knobs(self) -> dict:
        p = self.psd
        return dict(threshold=p.threshold, relaxed_threshold=p.relaxed_threshold, radius=p.radius, policy=p.policy,
                    depth=p.depth, branches=p.branches, steps=p.steps, graph=self.graph, budget=p.budget)

    def _request(self, req_id: str) -> _Request:
        r = self.dllm.get(req_id)
        if r is None:
            rs = self.requests[req_id]
            sp = rs.sampling_params
            P = len(rs.prompt_token_ids)
            gen = None
            if sp.temperature > 0:
                gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else
                                                    int(torch.randint(0, 2**62, (1,))))
            knobs = self._knobs()
            mask = self.spec.mask_token_id

            def make(blk, gen=gen, temperature=sp.temperature):
                return make_decoder(self.psd.decoding, blk, mask, temperature=temperature, generator=gen, **knobs)

            aligned = self.spec.attention == "block_causal"
            r = _Request(P, P + sp.max_tokens, plan_blocks(P, sp.max_tokens, self.psd.block_size, aligned), make,
                         ignore_eos=sp.ignore_eos)
            self._start_block(r)
            self.dllm[req_id] = r
        return r

    def _start_block(self, r: _Request) -> None:
        b0, b1 = r.blocks[r.blk]
        r.dec = r.make(torch.full((b1 - b0,), self.spec.mask_token_id, dtype=torch.long))
        r.fresh = True

    def _propose(self, r: _Request, committed: list[int]) -> _Step:
        """The next step's drafts: canvas 0 (+ trailing masks), then ``[R | canvas k | masks]`` per extra canvas."""
        b0, b1 = r.blocks[r.blk]
        w0, w1 = window(self.psd.cache, (b0, b1), r.total, fresh=r.fresh, cached=r.cached, shift=self.shift)
        canvases = r.dec.canvases()
        if r.fresh and self.psd.cache == "prefix" and len(canvases) != 1:
            raise RuntimeError("a decoder must forward only its state on the first step of a block")
        trailing = [self.spec.mask_token_id] * (w1 - b1)
        recomputed = committed[w0:b0]
        drafts = canvases[0].tolist() + trailing
        for c in canvases[1:]:
            drafts += recomputed + c.tolist() + trailing
        S, K = w1 - w0, len(canvases)
        extra = PrivatePages.plan(w0, S, K, self.input_batch.block_table[0].block_size).extra_slots
        return _Step(w0, S, K, drafts, b0 - self.shift - w0, b1 - b0, extra)

    def _rebuild_step(self, r: _Request) -> _Step:
        """The block's first forward again (all of it masked): its prefix K/V is what the later steps of the
        block were computed against (prefix cache), so forwarding it restores exactness after a preemption.
        Its logits are not used and it is not counted in NFE."""
        b0, b1 = r.blocks[r.blk]
        return _Step(0, r.total, 1, [self.spec.mask_token_id] * (r.total - b0), b0 - self.shift, b1 - b0, 0,
                     rebuild=True)

    def _on_request_state_removed(self, req_id, req_state) -> None:
        r = self.dllm.pop(req_id, None)
        self._held_prompt_logprobs.pop(req_id, None)
        if r is not None and not r.recorded:  # aborted, or stopped by a stop string
            self._record(req_id, r)
        super()._on_request_state_removed(req_id, req_state)

    def _record(self, req_id: str, r: _Request) -> None:
        r.recorded = True
        t = self.totals
        t["requests"] += 1
        t["tokens"] += r.emitted
        t["nfe"] += r.nfe
        t["model_calls"] += r.model_calls
        self.totals = merge_stats([t, {f"stat_{k}": v for k, v in r.stats.items() if not isinstance(v, list)}])
        self.finished[req_id] = {"nfe": r.nfe, "model_calls": r.model_calls, "emitted": r.emitted,
                                 "seconds": time.perf_counter() - r.t0, **r.stats}
        while len(self.finished) > 10_000:
            self.finished.pop(next(iter(self.finished)))
        logger.debug("psd: request %s: %d tokens, NFE %d, TPF %.2f, %s", req_id, r.emitted, r.nfe,
                     r.emitted / max(1, r.nfe), r.stats)
        now = time.monotonic()
        if now - self._last_log >= 10.0:
            n, tok, nfe = (t[k] - self._logged[k] for k in ("requests", "tokens", "nfe"))
            logger.info("psd %s: %d requests finished, %d tokens in %d decoding forwards (TPF %.2f) since the "
                        "last report; totals: %d requests, TPF %.2f", self.psd.decoding, n, tok, nfe,
                        tok / max(1, nfe), t["requests"], t["tokens"] / max(1, t["nfe"]))
            self._last_log, self._logged = now, dict(t)

    # ------------------------------------------------------------------------------ the step
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_meta, max_sampled = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        qsl = self.query_start_loc.np
        bt = self.input_batch.block_table[0]
        page = bt.block_size
        segments, rows, plan, detached = [], [], {}, False
        for rid in scheduler_output.scheduled_cached_reqs.resumed_req_ids:  # back from a preemption
            r = self.dllm.get(rid)
            if r is not None and r.dec is not None and self.psd.cache == "prefix" and not r.fresh and r.pending is None:
                r.pending, r.step = r.step, None  # vLLM re-prefilled without the masks: rebuild the prefix first
        for i, rid in enumerate(self.input_batch.req_ids):
            q0, q1 = int(qsl[i]), int(qsl[i + 1])
            nc = int(self.input_batch.num_computed_tokens_cpu[i])
            r = self._request(rid)
            r.model_calls += 1
            st = r.step
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid) or []
            if st is None or nc != st.rf or len(drafts) != len(st.drafts) or q1 - q0 != st.n_canvases * st.seg_len:
                segments.append(Segment(i, q0, q1, nc + q1 - q0))  # prefill, or a step cut short: no decoding
                continue
            S = st.seg_len
            segments.append(Segment(i, q0, q0 + S, st.rf + S))
            starts = [q0]
            if st.n_canvases > 1:
                detached = True
                row = [int(p) for p in bt.block_table.np[i, : int(bt.num_blocks_per_row[i])]]
                f = st.rf // page
                lay = PrivatePages.plan(st.rf, S, st.n_canvases, page)
                if lay.first + (st.n_canvases - 1) * lay.per_canvas > len(row):
                    raise RuntimeError(f"request {rid}: {st.n_canvases} canvases need more KV pages than reserved")
                pos = torch.arange(st.rf, st.rf + S)
                for k in range(1, st.n_canvases):
                    private = row[lay.first + (k - 1) * lay.per_canvas: lay.first + k * lay.per_canvas]
                    if st.rf % page:  # the prefix's last partial page, continued by this canvas
                        self._copy_page(row[f], private[0])
                    pages = row[:f] + private
                    qk = q0 + k * S
                    self.positions[qk: qk + S] = pos
                    slots = torch.tensor(pages)[pos // page] * page + pos % page
                    for buf in {id(b): b for b in (bt.slot_mapping.gpu, bt.slot_mapping.cpu)}.values():
                        buf[qk: qk + S] = slots.to(buf.dtype)
                    segments.append(Segment(i, qk, qk + S, st.rf + S, tuple(pages)))
                    starts.append(qk)
            plan[i] = []
            for s in starts:
                plan[i].append(len(rows))
                rows.extend(range(s + st.first_row, s + st.first_row + st.block_len))
        set_step_segments(segments if detached else None)
        self._plan = plan
        idx = torch.tensor(rows or [0], dtype=logits_indices.dtype, device=logits_indices.device)
        return idx, spec_meta, max_sampled

    def _copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page in every layer (CPU layout: ``[num_pages, kv_heads, page, 2 * head_dim]``)."""
        for kv in self.kv_caches:
            kv[dst].copy_(kv[src])

    def sample_tokens(self, grammar_output):
        if self.execute_model_state is None:
            return super().sample_tokens(grammar_output)
        state = self.execute_model_state
        self.execute_model_state = None
        so, logits = state.scheduler_output, state.logits
        outs, drafts, rfs, extras = [], [], [], []
        for i, rid in enumerate(self.input_batch.req_ids):
            r = self._request(rid)
            emit: list[int] = []
            if i in self._plan and r.step.rebuild:  # the prefix K/V is as the block's first step left it
                b0, _ = r.blocks[r.blk]
                r.cached = b0 - self.shift
                r.step, r.pending = r.pending, None
            elif i in self._plan:
                st = r.step
                L = st.block_len
                r.dec.update([logits[j: j + L] for j in self._plan[i]])
                r.nfe += 1
                r.cached = cached_after_step(self.psd.cache, r.blocks[r.blk], st.rf, fresh=r.fresh, cached=r.cached,
                                             shift=self.shift, model_block=self.spec.block_size or 1)
                r.fresh = False
                r.step = None
                if r.dec.done:
                    emit = r.dec.state.tolist()
                    r.stats = merge_stats([r.stats, r.dec.stats()])
                    eos = self.spec.eos_token_id
                    r.emitted += emit.index(eos) + 1 if eos in emit else len(emit)  # TPF counts up to EOS
                    if r.blk + 1 < len(r.blocks) and (r.ignore_eos or eos not in emit):
                        r.blk += 1
                        self._start_block(r)
                    else:  # finished: EOS or max_tokens
                        r.dec = None
                        self._record(rid, r)
            elif r.step is None and self.spec.attention == "block_causal" and r.nfe == 0:
                # vLLM's prefill wrote exact K/V for the prompt's finished attention blocks
                r.cached = r.prompt_len // self.spec.block_size * self.spec.block_size
            if r.dec is not None and r.step is None:
                if r.pending is not None:
                    r.step = self._rebuild_step(r)
                else:
                    rs = self.requests[rid]
                    r.step = self._propose(r, list(rs.prompt_token_ids) + list(rs.output_token_ids) + emit)
            outs.append(emit)
            drafts.append(list(r.step.drafts) if r.dec is not None else [])
            rfs.append(r.step.rf if r.dec is not None else 0)
            extras.append(r.step.extra_slots if r.dec is not None else 0)
        width = max(2, max((len(o) for o in outs), default=0))
        sampled = torch.full((len(outs), width), -1, dtype=torch.int32)
        for i, o in enumerate(outs):
            if o:
                sampled[i, : len(o)] = torch.tensor(o, dtype=torch.int32)
        (_, _, _, valid, prompt_logprobs, req_ids, req_id_to_index, _) = self._bookkeeping_sync(
            so, SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None), logits, state.hidden_states,
            so.total_num_scheduled_tokens)
        # prompt logprobs (computed in the prefill forward) travel with the request's first emitted block:
        # the scheduler sends nothing for a step that emits no token
        for i, rid in enumerate(self.input_batch.req_ids):
            if rid in prompt_logprobs and not outs[i]:
                self._held_prompt_logprobs[rid] = prompt_logprobs.pop(rid)
            elif outs[i] and rid in self._held_prompt_logprobs:
                prompt_logprobs[rid] = self._held_prompt_logprobs.pop(rid)
        self._draft_token_ids = drafts
        self._draft_token_req_ids = list(self.input_batch.req_ids)
        self._psd_next = (rfs, extras)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=req_id_to_index, sampled_token_ids=valid,
                                 logprobs=None, prompt_logprobs_dict=prompt_logprobs, kv_connector_output=None)

    def take_draft_token_ids(self):
        if not self._draft_token_req_ids:
            return None
        rfs, extras = self._psd_next
        out = DLLMDraftTokenIds(list(self._draft_token_req_ids), self._draft_token_ids, rfs, extras)
        self._draft_token_req_ids = None
        return out

    def psd_stats(self) -> dict:
        t = dict(self.totals)
        t["tpf"] = t["tokens"] / max(1, t["nfe"])
        return {"totals": t, "requests": dict(self.finished)}


class RunnerSwapWorker(CPUWorker):
    """``CPUWorker`` that builds ``runner_cls`` instead of ``CPUModelRunner`` (the worker reads that name from
    its module when it sets up the device)."""

    runner_cls: type = CPUModelRunner

    def init_device(self):
        import vllm.v1.worker.cpu_worker as cpu_worker

        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = self.runner_cls
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original


class DLLMWorker(RunnerSwapWorker):
    """Builds :class:`DLLMModelRunner` (``worker_cls`` set by the ``psd`` method)."""

    runner_cls = DLLMModelRunner

    def psd_stats(self) -> dict:
        """Decoding figures (``LLM.collective_rpc("psd_stats")``): totals and recent finished requests."""
        return self.model_runner.psd_stats()
