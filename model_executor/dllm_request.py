"""One dLLM request decoding block by block: the state machine both engines drive.

A request decodes the answer region ``[P, P + max_tokens)`` in blocks (:mod:`.block_schedule`). Each step
the engine asks :meth:`DLLMRequest.next_step` what to forward (the window ``[w0, w1)``, one row of tokens
per canvas of the block's decoder, and how much K/V becomes exact), runs one forward for all its requests,
updates every decoder at once with :func:`~model_executor.decoding.update_all` and then calls
:meth:`DLLMRequest.stepped`. That
commits positions through the decoder; when a block is complete its tokens are committed to the request, and the request
either starts the next block or finishes (the block holding the first EOS, or the last block).

Counting follows the PSD paper's appendix B.1: ``nfe`` is the number of decoding forwards, ``emitted`` the
committed tokens up to and including the first EOS, so ``tpf = emitted / nfe``.

The reference engine (:mod:`model_executor.engine`) and the vLLM runner (:mod:`psd_plugin.vllm.dllm_runner`)
both hold one of these per request; what differs between them is only how a step's rows reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np
import torch

from .block_schedule import CacheSchedule, plan_blocks
from .decoding import (BlockDecoder, Proposal, RowPredictions, apply_rules, logits_map, merge_stats, predict_rows,
                       update_all)
from .decoding.base import decide_on_device, exclude_mask_token, launch_all
from .decoding.sampling import RowDraws, row_draws
from .grammar import GrammarFrontier, constrain_rows, mask_frontiers
from .staging import Staging


@dataclass
class DLLMStep:
    """What one step of a request forwards: positions ``[w0, w1)`` once per canvas (``tokens [K, w1 - w0]``);
    the block ``[b0, b1)`` is predicted by rows ``first_row + j``; after it the K/V of ``[0, keep)`` is exact.

    ``suffix = (s0, s1)``: DualCache's kept suffix (empty otherwise). A step whose window covers it (the block's
    first) stores its K/V; a later step, whose window ends at ``s0``, reads it from the cache: every row sees
    the keys ``[0, w0)`` and ``[s0, s1)`` of the cache, and its canvas's rows.

    ``committed``: where the request's committed tokens end, when that is past the block: the step replays an
    earlier block's first step (:meth:`DLLMRequest.preempted`). vLLM's tokens run to ``committed``, so the
    step's drafts start there; its window holds masks at ``[b0, committed)``, where vLLM holds the committed
    tokens (the runner writes those ids); and when the window ends before ``committed``, the positions
    ``[w1, committed)`` (``tail``, their committed ids) are scheduled rows too, in a segment of their own that
    no row of the window reads (their K/V is rewritten by a later step before anything reads it)."""

    w0: int
    w1: int
    b0: int
    b1: int
    tokens: torch.Tensor  # [K, S]
    keep: int
    shift: int
    suffix: tuple[int, int] = (0, 0)
    proposal: Proposal | None = None  # the decoder's proposal these canvases are (None: a rebuild step)
    kept: torch.Tensor | None = None  # [K * block_len] bool: the prediction rows whose logits are computed
    committed: int = 0  # a replay of an earlier block: the request's committed length (class docstring)
    tail: torch.Tensor | None = None  # [committed - w1] ids of the rows after the window (None: none)

    @property
    def num_canvases(self) -> int:
        return self.tokens.shape[0]

    @property
    def geometry(self) -> tuple:
        """What lays the step out but its ids and kept rows: window, block, kept K/V, shift, suffix, committed
        length."""
        return self.w0, self.w1, self.b0, self.b1, self.keep, self.shift, tuple(self.suffix), self.committed

    @property
    def rebuild(self) -> bool:
        """A step that only restores the K/V a block's later steps read (:meth:`DLLMRequest.preempted`)."""
        return self.proposal is None

    @cached_property
    def drafts(self) -> list[int]:
        """The first canvas from the block on (from ``committed`` on, when that is later): what vLLM schedules
        as the request's draft tokens."""
        # a host tensor (as all of a request's decoding state): its numpy view, where a torch slice costs more
        return self.tokens.numpy()[0, max(self.b0, self.committed) - self.w0:].tolist()

    @property
    def seg_len(self) -> int:
        return self.w1 - self.w0

    @property
    def tail_len(self) -> int:
        return 0 if self.tail is None else self.tail.numel()

    @property
    def num_scheduled(self) -> int:
        """The rows vLLM schedules for this step: the first canvas and the tail."""
        return self.seg_len + self.tail_len

    @property
    def rewrites(self) -> tuple[int, int]:
        """``[r0, r1)``: the window's positions whose ids differ from vLLM's tokens (masks where the request has
        committed tokens: a replay of an earlier block); empty otherwise."""
        r0, r1 = self.b0, min(self.w1, self.committed)
        return (r0, r1) if r1 > r0 else (r0, r0)

    @property
    def first_row(self) -> int:
        """Row (inside a canvas's window) of the block's first prediction."""
        return self.b0 - self.shift - self.w0

    @property
    def block_len(self) -> int:
        return self.b1 - self.b0

    @cached_property
    def num_logits_rows(self) -> int:
        """Rows of this step whose logits are computed (:attr:`kept`; fixed once planned)."""
        return 0 if self.kept is None else int(np.count_nonzero(self.kept.numpy()))

    @property
    def reads_suffix(self) -> int:
        """How many kept-suffix positions this step reads from the cache (0 unless it is after the window)."""
        s0, s1 = self.suffix
        return s1 - s0 if s0 >= self.w1 else 0


@dataclass
class DLLMRequest:
    """The decoding state of one request (module docstring)."""

    prompt: list[int]
    max_tokens: int
    block_size: int
    make_decoder: Callable[[torch.Tensor], BlockDecoder]
    mask_id: int
    eos_id: int
    aligned: bool = False  # blocks cut at multiples of block_size (SDAR's attention blocks)
    ignore_eos: bool = False
    grammar: GrammarFrontier | None = None  # structured outputs: the frontier rule (model_executor.grammar)
    schedule: CacheSchedule = field(default_factory=CacheSchedule)  # the windows its steps forward
    tokens: torch.Tensor = field(init=False)  # [prompt | answer region], mask id where undecoded (host, as all
    # of the request's decoding state: the engines copy a step's rows to their device once)
    blocks: list[tuple[int, int]] = field(init=False)
    blk: int = 0
    dec: BlockDecoder | None = None
    fresh: bool = True  # first step of the current block
    cached: int = 0  # leading positions whose K/V the next step reads from the cache
    nfe: int = 0
    emitted: int = 0
    stats: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)  # answer position -> (token, logprob, top alternatives)
    done: bool = False
    finish_reason: str = "length"
    step: DLLMStep | None = None  # planned (:meth:`plan`), not forwarded yet
    resume: DLLMStep | None = None  # after a preemption: the step to forward once the rebuild steps have run
    replays: list[int] = field(default_factory=list)  # after a preemption: blocks whose first step is replayed

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {self.max_tokens})")
        if not self.prompt:
            raise ValueError("empty prompt: at least one token is needed")
        P = len(self.prompt)
        self.tokens = torch.tensor(list(self.prompt) + [self.mask_id] * self.max_tokens, dtype=torch.long)
        self.blocks = plan_blocks(P, self.max_tokens, self.block_size, self.aligned)
        self._start_block()

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def total(self) -> int:
        return self.tokens.numel()

    @property
    def block(self) -> tuple[int, int]:
        return self.blocks[self.blk]

    def _start_block(self) -> None:
        b0, b1 = self.block
        self.dec = self.make_decoder(self.tokens[b0:b1])
        self.fresh = True
        if self.grammar is not None:
            if self.dec.rewrites_tokens:
                raise ValueError(f"{type(self.dec).__name__} edits committed tokens; structured outputs need a "
                                 "method that commits each token once (any other method)")
            self.dec.grammar = self.grammar
            self.grammar.new_block()

    @property
    def phase(self) -> str:
        """``done``; ``rebuild`` (preempted: the K/V the next step reads is restored first, :meth:`preempted`);
        ``first`` (no decoding forward yet); ``decode``."""
        if self.done:
            return "done"
        if self.replays:
            return "rebuild"
        return "first" if self.nfe == 0 else "decode"

    @property
    def needs_proposal(self) -> bool:
        """Whether the decoder's next canvases are wanted (:func:`~model_executor.decoding.propose_all`)."""
        return not self.done and self.step is None and not self.replays

    def plan(self, proposal: Proposal) -> DLLMStep:
        """Plan the next forward from the decoder's ``proposal`` (:meth:`next_step`); it is :attr:`step` until
        the engine reports it forwarded (:meth:`stepped`)."""
        self.step = self.next_step(proposal)
        return self.step

    def preempted(self) -> None:
        """The engine dropped this request's K/V and re-prefilled its prompt and committed tokens (vLLM's
        recompute preemption). Under the prefix and dual caches the next step reads K/V that earlier first steps
        of blocks wrote, each over the tokens and masks of its time; the re-prefill's K/V is not theirs. So
        those first steps are replayed in order (:meth:`plan_rebuild`; no NFE, no decoding) before the planned
        step, which waits in :attr:`resume`: with ``refresh`` ``full`` the current block's; ``answer`` block 0's
        (the prompt's K/V) and the current block's; ``last`` every block's so far. The current block's is left
        out while its first step has not run (it is the next step). The outputs are then those of an
        uninterrupted run."""
        if self.schedule.mode not in ("prefix", "dual") or self.done:
            return
        k = self.blk
        chain = {"full": {k}, "answer": {0, k}, "last": set(range(k + 1))}[self.schedule.refresh]
        chain = sorted(chain - ({k} if self.fresh else set()))
        if not chain:
            return
        if not self.replays:  # (preempted again during the replays: the planned step is already in resume)
            self.resume = self.step
        self.step, self.replays, self.cached = None, chain, 0

    def prefix_written(self, n: int) -> None:
        """The engine wrote the K/V of the first ``n`` positions before this request's first step (a prefix-cache
        hit, or vLLM's plain prefill of the prompt): its first window starts after what of it the schedule may
        read (:meth:`~model_executor.block_schedule.CacheSchedule.written_prefix`)."""
        self.cached = self.schedule.written_prefix(min(n, self.prompt_len))

    def plan_rebuild(self) -> DLLMStep:
        """Plan the next replay (:meth:`first_step` of the next block in :attr:`replays`); its logits are not
        for the decoder, it counts in no NFE."""
        self.step = self.first_step(self.replays[0])
        return self.step

    def rebuilt(self) -> None:
        """A replay ran: the K/V before its ``keep`` is as that block's first step left it; after the last one
        the preempted step is next."""
        self.cached = self.step.keep
        self.replays.pop(0)
        self.step = None
        if not self.replays:
            self.step, self.resume = self.resume, None

    def next_step(self, proposal: Proposal) -> DLLMStep:
        """The rows of this request's next forward: the canvases of its decoder's ``proposal``
        (:func:`~model_executor.decoding.propose_all`) over the step's window (module docstring)."""
        b0, b1 = self.block
        canvases, sch = proposal.canvases, self.schedule
        if self.fresh and sch.mode in ("prefix", "dual") and len(canvases) != 1:
            raise RuntimeError("a decoder must forward only its state on the first step of a block")
        w0, w1 = sch.window((b0, b1), self.total, fresh=self.fresh, cached=self.cached, prompt_len=self.prompt_len)
        if w0 > self.cached:
            raise RuntimeError(f"window starts at {w0} but only {self.cached} positions are cached")
        keep = sch.cached_after((b0, b1), w0, fresh=self.fresh, cached=self.cached)
        rows = self._canvas_rows(w0, w1, b0, b1, [c.numpy() for c in canvases])
        block = rows[:, b0 - w0: b1 - w0]
        # the rows a decoder reads: the positions each canvas leaves masked (no prediction is read elsewhere; a draw
        # is keyed by its position, so drawing the masked ones alone is the draw of the block), every row for a
        # decoder that reads filled positions too (edits, calibration)
        kept = np.ones(block.shape, dtype=bool) if self.dec.reads_all_rows else block == self.mask_id
        return DLLMStep(w0, w1, b0, b1, torch.from_numpy(rows), keep, sch.shift, sch.kept_suffix((b0, b1), self.total),
                        proposal, torch.from_numpy(kept.reshape(-1)))

    def _canvas_rows(self, w0: int, w1: int, b0: int, b1: int, blocks: list[np.ndarray]) -> np.ndarray:
        """``[K, w1 - w0]`` ids of a step's canvases over the window: the request's tokens, each canvas's block
        ``[b0, b1)`` from ``blocks``. Host arrays (numpy views of the host tensors: a step's few small ops cost
        microseconds each in torch)."""
        rows = np.empty((len(blocks), w1 - w0), dtype=np.int64)
        rows[:] = self.tokens.numpy()[w0:w1]
        for k, c in enumerate(blocks):
            rows[k, b0 - w0: b1 - w0] = c
        return rows

    def step_after(self, step: DLLMStep) -> tuple[int, int, int, int] | None:
        """``(w0, rows, extra rows, logits rows)`` of the step after ``step`` (planned, not yet forwarded) if
        ``step`` does not complete its block: what an engine that schedules a step before the last one's outcome
        guesses (:mod:`psd_plugin.vllm.scheduler` under async scheduling). A block's steps after its first
        forward one window, the same each step, in every cache mode (``step`` the first: the window of a later
        step from what it leaves cached); the canvases and logits rows are ``step``'s (a canvas's masks only
        shrink; a drafting method's canvases vary, and the runner fits what does not). None for a replay, and
        where ``step`` certainly completes its block: one mask left, which every decoder that does not rewrite
        its tokens commits (the engine then schedules nothing for the request until ``step``'s outcome, instead
        of a step that would be cut)."""
        if step.rebuild or step.committed or step.tail is not None:
            return None
        if self.grammar is None and not self.dec.rewrites_tokens and self.dec.masks_left == 1:
            return None
        w0, w1 = step.w0, step.w1
        if self.fresh:  # step is its block's first
            w0, w1 = self.schedule.window((step.b0, step.b1), self.total, fresh=False, cached=step.keep,
                                          prompt_len=self.prompt_len)
        return w0, w1 - w0, (step.num_canvases - 1) * (w1 - w0), step.num_logits_rows

    def continuation(self, step: DLLMStep) -> DLLMStep | None:
        """The step after ``step`` (planned, not yet decoded) as its block goes on, laid out before ``step``'s
        outcome is known (:meth:`step_after`'s guess, whole): its window, kept K/V and suffix, as many canvases
        as the decoder lays out ahead (:meth:`~model_executor.decoding.BlockDecoder.canvases_ahead`: a bound on
        the plan's, which may decode fewer), each with ``step``'s state's ids until the engine writes the next
        canvases there, and each with the rows of ``step``'s state's masks kept (a position masked in any later
        canvas is masked there, so its logits are computed; a decoder that does not read all rows ignores the
        others; as its plan keeps them, not a step laid out ahead's wider rows, which would stay as wide). Its
        ``proposal`` stands in until the plan is known (:meth:`settle`). None where :meth:`step_after` makes no
        guess, or the decoder cannot tell its next step's canvases before its decisions reach the host."""
        if self.step_after(step) is None or (K := self.dec.canvases_ahead(step.proposal)) is None:
            return None
        b0, b1 = step.b0, step.b1
        w0, w1 = self.schedule.window((b0, b1), self.total, fresh=False, cached=step.keep, prompt_len=self.prompt_len)
        keep = self.schedule.cached_after((b0, b1), w0, fresh=False, cached=step.keep)
        block = step.tokens.numpy()[0, b0 - step.w0: b1 - step.w0]
        rows = self._canvas_rows(w0, w1, b0, b1, [block] * K)
        kept = np.ones(block.shape, dtype=bool) if self.dec.reads_all_rows else block == self.mask_id
        return DLLMStep(w0, w1, b0, b1, torch.from_numpy(rows), keep, step.shift, step.suffix, step.proposal,
                        torch.from_numpy(np.tile(kept, K)))

    def settle(self, ahead: DLLMStep) -> bool:
        """The planned step (:attr:`step`, after the last one's outcome) is ``ahead`` (:meth:`continuation`, laid
        out and forwarded before that outcome, its canvases' ids written from the decisions where they were
        taken): then ``ahead`` becomes the step, with the plan's ids, canvases and proposal, and True; the plan
        may have fewer canvases than were laid out (a draft past the block's masks is not forwarded), whose
        rows then decode nothing, the step's kept rows its first canvases'. False where the plan is another
        step (the last one completed the block, or the request is done): ``ahead``'s rows decode nothing."""
        st = self.step
        if st is None or st.num_canvases > ahead.num_canvases or st.geometry != ahead.geometry \
                or st.tail is not None:
            return False
        kept = ahead.kept[: st.kept.numel()]
        if not np.all(kept.numpy() >= st.kept.numpy()):  # (masks only shrink: every row the plan reads)
            return False
        ahead.tokens, ahead.kept = st.tokens, kept
        for cached in ("drafts", "num_logits_rows"):  # (cached properties, of the stand-in ids and rows)
            ahead.__dict__.pop(cached, None)
        ahead.proposal = st.proposal
        self.step = ahead
        return True

    def first_step(self, j: int) -> DLLMStep:
        """Block ``j``'s first step again, as it was then: the block and every position after it masks, the
        window read from :attr:`cached`. Forwarding it restores the K/V that later
        steps were computed against (after a preemption, :meth:`preempted`); its logits are not for the decoder.
        Under ``dual`` it restores the block's kept suffix too. For an earlier block the step carries the
        request's committed length (:class:`DLLMStep`)."""
        (b0, b1), sch, n = self.blocks[j], self.schedule, self.block[0]
        w0, w1 = sch.window((b0, b1), self.total, fresh=True, cached=self.cached, prompt_len=self.prompt_len)
        keep = sch.cached_after((b0, b1), w0, fresh=True, cached=self.cached)
        rows = self.tokens[w0:w1].clone()
        rows[b0 - w0:] = self.mask_id
        return DLLMStep(w0, w1, b0, b1, rows[None], keep, sch.shift, sch.kept_suffix((b0, b1), self.total),
                        kept=torch.zeros(b1 - b0, dtype=torch.bool), committed=n if n > b0 else 0,
                        tail=self.tokens[w1:n].clone() if n > w1 else None)

    def stepped(self, step: DLLMStep) -> list[int]:
        """Bookkeeping after the decoder took ``step``'s predictions (the engine's batched
        :func:`~model_executor.decoding.update_all`); returns the block's tokens if the step completed it."""
        self.nfe += 1
        self.cached = step.keep
        self.fresh = False
        self.step = None
        if self.grammar is not None:  # the committed run from the frontier: the grammar accepts it
            self.grammar.advance(self.dec.state)
        if not self.dec.done:
            return []
        b0, b1 = self.block
        block = self.dec.state
        self.tokens[b0:b1] = block
        self.stats = merge_stats([self.stats, self.dec.stats()])  # method counters summed over blocks
        if self.grammar is not None:  # the grammar's counters run over the whole request
            self.stats.update(self.grammar.stats())
        out = block.tolist()
        eos = self.eos_id in out
        self.emitted += out.index(self.eos_id) + 1 if eos else len(out)
        if self.blk + 1 < len(self.blocks) and (self.ignore_eos or not eos):
            self.blk += 1
            self._start_block()
        else:
            self.done, self.dec = True, None
            self.finish_reason = "stop" if eos and not self.ignore_eos else "length"
        return out

    def logprobs_of(self, start: int, n: int) -> list[tuple[int, float, dict[int, float], int]]:
        """``(token, logprob, {top token: logprob}, rank)`` of answer positions ``[start, start + n)``."""
        return [self.logprobs[j] for j in range(start, start + n)]

    def history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt ids, answer ids committed so far: finished blocks and the current block's decided
        positions), what the repetition / presence / frequency penalties count."""
        b0, _ = self.block
        done = self.tokens[self.prompt_len: b0]
        if self.dec is not None:
            state = self.dec.state
            done = torch.cat([done, state[state != self.mask_id]])
        return self.tokens[: self.prompt_len], done[done != self.mask_id]

    def answer(self) -> list[int]:
        """The answer so far: up to and including the first EOS, without undecoded positions."""
        gen = self.tokens[self.prompt_len:].tolist()
        if self.eos_id in gen and not self.ignore_eos:
            return gen[: gen.index(self.eos_id) + 1]
        return [t for t in gen if t != self.mask_id]


def record_logprobs(requests: list[DLLMRequest], befores: list[torch.Tensor], preds: RowPredictions,
                    firsts: list[list[int]], ks: list[int]) -> None:
    """Log-probabilities of the positions each request's decoder committed in this step (``befores[i]``: its
    state before the step), under the distribution of this forward its token was taken from: the state canvas's
    (the block's prediction rows of ``preds`` from row ``firsts[i][0]``), or where the decoder took it from
    another canvas the row of that canvas (``firsts[i][k]``,
    :meth:`~model_executor.decoding.BlockDecoder.commit_canvases`: PSD's commits on its best draft's output and
    its accepted drafts; the position was masked there, so its logits were computed): the model's distribution,
    the mask token excluded, after the request's grammar and before its logits rules (vLLM's default
    ``raw_logprobs``; ``preds.raw``: the rows the rules changed, copied before them, by
    :func:`step_predictions`), with its ``ks[i]`` most likely tokens. Stored per answer position in
    ``DLLMRequest.logprobs`` (:meth:`DLLMRequest.logprobs_of`): a position is recorded when its token is written,
    and again whenever an editing decoder (joint_threshold) rewrites it, so the entry a block emits is the
    distribution its final token was taken from. Every request's rows are computed at once on the logits' device
    and come back in one copy."""
    picks, want = [], []  # per request: its committed block positions; per committed position: (request, pos)
    for i, (r, before) in enumerate(zip(requests, befores)):
        if r.dec is None:
            continue
        new = ((before != r.dec.state) & (r.dec.state != r.mask_id)).nonzero().flatten()  # filled or rewritten
        canvases = r.dec.commit_canvases()
        start = firsts[i][0] if canvases is None else torch.tensor(firsts[i])[canvases[new.numpy()]]
        picks.append(start + new)
        want.extend((i, pos) for pos in new.tolist())
    if not want:
        return
    logits = preds.logits
    dev, k = logits.device, max(ks)
    rows = preds.logits_of(torch.cat(picks))
    chosen_ids = torch.tensor([int(requests[i].dec.state[pos]) for i, pos in want])
    src = logits[rows.to(dev, non_blocking=True)]
    raw = getattr(preds, "raw", None)
    if raw is not None:  # rows a request's rules changed: their copy from before the rules (host indices)
        raw_rows, copy = raw
        where = np.full(logits.shape[0], -1, dtype=np.int64)
        where[raw_rows.numpy()] = np.arange(raw_rows.numel())
        w = where[rows.numpy()]
        sel = np.flatnonzero(w >= 0)
        if sel.size:
            take = torch.from_numpy(w[sel]).to(dev, non_blocking=True)
            src[torch.from_numpy(sel).to(dev, non_blocking=True)] = copy[take]
    lp = torch.log_softmax(src.double(), -1)
    chosen = lp.gather(1, chosen_ids.to(dev, non_blocking=True)[:, None])
    ranks = (lp >= chosen).sum(-1, keepdim=True).double()  # vLLM's rank: the tokens at least as likely
    parts = [chosen, ranks]
    if k > 0:
        top = lp.topk(k, -1)
        parts += [top.indices.double(), top.values]
    host = torch.cat(parts, 1).cpu()  # [n, 2 + 2k]: logprob, rank, top ids, top logprobs; one copy
    for (i, pos), tok, row in zip(want, chosen_ids.tolist(), host.tolist()):
        r, ki = requests[i], ks[i]
        alts = dict(zip(map(int, row[2: 2 + ki]), row[2 + k: 2 + k + ki])) if ki > 0 else {}
        r.logprobs[r.block[0] + pos - r.prompt_len] = (tok, row[0], alts, int(row[1]))


def step_predictions(logits: torch.Tensor, kept: torch.Tensor, mask_id: int, requests: list[DLLMRequest],
                     steps: list[DLLMStep], firsts: list[list[int]], rules: list | None = None,
                     failed: dict[int, Exception] | None = None, staging: Staging | None = None,
                     on_device: bool = False, logprobs: list[int | None] | None = None) -> RowPredictions:
    """What the decoders read of one forward's ``logits`` (the ``kept`` rows), both engines alike: the requests'
    rules applied (``rules``: per request of ``requests`` its :class:`~model_executor.decoding.LogitsRules` or
    None; :func:`~model_executor.decoding.apply_rules`), structured outputs' frontier rule (grammar masks before
    the top-1, the running-min constraint after), and the top-1 of every kept row computed once (:func:`~model_executor.decoding.predict_rows`; the
    mask token is never a prediction). ``requests``, ``steps``, ``firsts`` (each canvas's first prediction row):
    the step's requests.

    A request whose kept rows hold a non-finite logit (NaN, +inf, or every token -inf: its confidence is NaN)
    has no prediction to decode. ``failed`` (the serving engine's): such a request, and one whose rules or
    grammar raise, is recorded there under its index in ``requests`` and the others' predictions are unaffected
    (every stage writes a request's own rows only); without it (the reference engine) they raise.

    Where the logits are on an accelerator and every decoder's method decides there
    (:func:`~model_executor.decoding.base.decide_on_device`: every method, without a grammar), the predictions
    stay there (:class:`~model_executor.decoding.base.DeviceRowPredictions`): the methods' update decides on the
    device, checks the blocks' predictions are finite, and makes the step's one copy (of the decisions); its
    upload goes through the engine's ``staging`` (:class:`~model_executor.staging.Staging`; None: a plain copy).
    ``on_device``: so wherever the logits are (the host too), for decisions taken ahead (:func:`launch_step`).
    ``logprobs``: per request the logprobs it asks for (None: none); the rows of those whose rules change their
    logits are copied first (``preds.raw``: what :func:`record_logprobs` reports)."""
    at = logits_map(kept)
    # the grammar's masks first (vLLM applies its bitmask before its sampler), then the rules: the two commute
    # (both only lower logits to -inf, or shift or scale finite ones), and the logprobs are taken between them
    owners, jobs = grammar_jobs(requests, steps, firsts, skip=failed)
    job_failed = None if failed is None else {}
    if jobs:
        mask_frontiers(logits, jobs, at, job_failed)
    raw = _before_rules(logits, at, mask_id, steps, firsts, rules, logprobs)
    ruled = [i for i, r in enumerate(rules or ()) if r is not None]
    if ruled:
        rule_failed = None if failed is None else {}
        apply_rules(logits, [(rules[i], firsts[i][0], steps[i].num_canvases, steps[i].block_len,
                              steps[i].b0 - requests[i].prompt_len, requests[i].history) for i in ruled],
                    at, rule_failed)
        if rule_failed:
            failed.update({ruled[n]: e for n, e in rule_failed.items()})
    draws = step_draws(requests, steps, firsts, at, failed)
    if (on_device or logits.device.type != "cpu") and decide_on_device(
            [r.dec for i, r in enumerate(requests) if not failed or i not in failed]):
        # the decoders decide where the logits are: the predictions stay there, and their update copies the next
        # states back (and checks each block's predictions are finite) in the step's one copy
        preds = predict_rows(logits, mask_id=mask_id, kept=kept, draws=draws, on_device=True)
        preds.staging, preds.raw = staging, raw  # the engine's pinned buffers, for the update's upload
        return preds
    preds = predict_rows(logits, mask_id=mask_id, kept=kept, draws=draws)
    preds.raw = raw
    bad = preds.conf.isnan()
    if bool(bad.any()):  # host data; one reduction over the step's rows
        for i, (st, f) in enumerate(zip(steps, firsts)):
            L = st.block_len
            rows = [r for a in f for r in range(a, a + L)]
            if rows and bool(bad[rows].any()):
                e = RuntimeError(f"non-finite logits at {int(bad[rows].sum())} of the request's prediction rows "
                                 "(NaN or inf in the model's output for its canvases): nothing to decode")
                if failed is None:
                    raise e
                failed.setdefault(i, e)
    if jobs:
        if failed:  # a request that failed above is not constrained (its grammar may be what failed)
            job_failed.update({n: failed[i] for n, i in enumerate(owners) if i in failed})
        constrain_rows(preds.tokens, preds.conf, jobs, job_failed)
    if job_failed:
        for n, e in job_failed.items():
            failed.setdefault(owners[n], e)
    return preds


def _before_rules(logits: torch.Tensor, at: torch.Tensor, mask_id: int, steps: list[DLLMStep],
                  firsts: list[list[int]], rules: list | None,
                  logprobs: list[int | None] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept logits rows of every canvas (:func:`record_logprobs` reads the state canvas's, and those a
    decoder took commits from) of every request that asks for logprobs and whose rules will change them, copied
    before they do (after its grammar's masks, as vLLM's
    ``raw_logprobs`` come after its bitmask), the mask token excluded: ``(their logits rows [n] (host), the copy
    [n, V])``, or None (no such request: the reported distribution is the rows as the decoders read them)."""
    picks = []
    for i, (st, f) in enumerate(zip(steps, firsts)):
        if logprobs is None or logprobs[i] is None or st.rebuild or not f:
            continue
        if rules is None or rules[i] is None or not rules[i].active:
            continue
        for a in f:
            rows = at[a: a + st.block_len]
            picks.append(rows[rows >= 0])
    rows = torch.cat(picks) if picks else None
    if rows is None or not rows.numel():
        return None
    return rows, exclude_mask_token(logits[rows.to(logits.device, non_blocking=True)], mask_id)


def step_draws(requests: list[DLLMRequest], steps: list[DLLMStep], firsts: list[list[int]], at: torch.Tensor,
               skip: dict | None = None) -> RowDraws | None:
    """The step's sampled rows (:mod:`model_executor.decoding.sampling`): every kept prediction row of a request
    whose decoder samples (not in ``skip``), with its request's seed, its predicted position and its canvas's
    step in the block (:meth:`~model_executor.decoding.Proposal.canvas_steps`); ``at`` maps prediction rows to
    logits rows. None when no request samples."""
    jobs = []
    for i, (r, st, f) in enumerate(zip(requests, steps, firsts)):
        if st.rebuild or r.dec is None or r.dec.sampling is None or (skip and i in skip):
            continue
        jobs.append((r.dec.sampling, st.b0, f, st.proposal.canvas_steps(r.dec.t), st.block_len, st.kept.numpy()))
    return row_draws(jobs, at.numpy()) if jobs else None


def engine_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault of the engine itself (out of memory, a lost rank, an interrupt), never taken for
    one request's failure: :func:`decode_step` and the serving engine's error boundary raise it again."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or not isinstance(exc, Exception):
        return True
    dist = getattr(torch.distributed, "DistError", None)
    return dist is not None and isinstance(exc, dist)


def decode_step(logits: torch.Tensor, kept: torch.Tensor, mask_id: int, requests: list[DLLMRequest],
                steps: list[DLLMStep], firsts: list[list[int]], rules: list | None = None,
                logprobs: list[int | None] | None = None, failed: dict[int, Exception] | None = None,
                staging: Staging | None = None) -> RowPredictions:
    """One forward's decoding, both engines alike: the requests' predictions (:func:`step_predictions`), every
    decoder updated at once (:func:`~model_executor.decoding.update_all`, a method at a time), and the
    log-probabilities of what each committed, for the requests whose ``logprobs[i]`` is not None
    (:func:`record_logprobs`, under the distribution each token was taken from). The engine then calls each
    request's :meth:`DLLMRequest.stepped`.

    ``failed`` (the serving engine's): a request whose predictions, update or logprobs raise is recorded there
    under its index and the others' decoding is that of a step without it: where the batched update raises,
    each decoder it had not stepped yet is updated alone (an update reads its own rows and rebinds its
    ``state``, never writes into it, so a decoder the batched update stepped holds its right next state, and
    one it did not step is untouched). Engine faults (:func:`engine_fault`) always raise; without ``failed``
    (the reference engine) everything raises."""
    preds = step_predictions(logits, kept, mask_id, requests, steps, firsts, rules, failed, staging,
                             logprobs=logprobs)
    return update_step(preds, requests, steps, firsts, logprobs, failed)


def launch_step(logits: torch.Tensor, kept: torch.Tensor, mask_id: int, requests: list[DLLMRequest],
                steps: list[DLLMStep], firsts: list[list[int]], rules: list | None = None,
                failed: dict[int, Exception] | None = None, staging: Staging | None = None,
                logprobs: list[int | None] | None = None) -> tuple[RowPredictions, list[torch.Tensor | None]]:
    """:func:`decode_step`'s first half for decoders that decide ahead
    (:func:`~model_executor.decoding.base.decides_ahead`): the predictions where the logits are, and the decisions
    taken there with their copy to the host queued (:func:`~model_executor.decoding.base.launch_all`); nothing is
    stepped and the host waits for nothing. Returns the predictions, for :func:`update_step` (the second half,
    which waits for that copy), and per request its next block state on the logits' device (None: it failed
    here, in ``failed``)."""
    preds = step_predictions(logits, kept, mask_id, requests, steps, firsts, rules, failed, staging, on_device=True,
                             logprobs=logprobs)
    live = [i for i in range(len(requests)) if not failed or i not in failed]
    out: list = [None] * len(requests)
    try:
        nexts = launch_all([requests[i].dec for i in live], [steps[i].proposal for i in live], preds,
                           [firsts[i] for i in live]) if live else []
    except Exception as e:  # as decode_step's update: each alone, and one that raises alone fails (``failed``)
        if failed is None or engine_fault(e):
            raise
        nexts = []
        for i in live:
            try:
                nexts.append(launch_all([requests[i].dec], [steps[i].proposal], preds, [firsts[i]])[0])
            except Exception as err:
                if engine_fault(err):
                    raise
                failed[i] = err
                nexts.append(None)
    for i, t in zip(live, nexts):
        out[i] = t
    return preds, out


def update_step(preds: RowPredictions, requests: list[DLLMRequest], steps: list[DLLMStep], firsts: list[list[int]],
                logprobs: list[int | None] | None = None, failed: dict[int, Exception] | None = None
                ) -> RowPredictions:
    """:func:`decode_step` from the step's predictions on: every decoder updated, the logprobs recorded."""
    live = [i for i in range(len(requests)) if not failed or i not in failed]
    want = [i for i in live if logprobs is not None and logprobs[i] is not None]
    before = {i: requests[i].dec.state.clone() for i in want}
    decs = [requests[i].dec for i in live]
    props = [steps[i].proposal for i in live]
    rows = [firsts[i] for i in live]
    states = [d.state for d in decs]
    try:
        update_all(decs, props, preds, rows)
    except Exception as e:
        if failed is None or engine_fault(e):
            raise
        for i, d, p, r, old in zip(live, decs, props, rows, states):
            if d.state is old:
                try:
                    update_all([d], [p], preds, [r])
                except Exception as err:
                    if engine_fault(err):
                        raise
                    failed[i] = err
    want = [i for i in want if not failed or i not in failed]
    if want:
        args = ([requests[i] for i in want], [before[i] for i in want], preds, [firsts[i] for i in want],
                [max(logprobs[i], 0) for i in want])
        try:
            record_logprobs(*args)
        except Exception as e:
            if failed is None or engine_fault(e):
                raise
            failed.update({i: e for i in want})
    return preds


def grammar_jobs(requests: list[DLLMRequest], steps: list[DLLMStep], firsts: list[list[int]],
                 skip: dict | None = None) -> tuple[list[int], list]:
    """What :func:`~model_executor.grammar.mask_frontiers` and :func:`~model_executor.grammar.constrain_rows`
    read of a step: per decoding step of a request with a grammar (not in ``skip``), its index in ``requests``
    and ``(grammar, its canvases' block positions [K, L], the first prediction row of each canvas)``."""
    owners, jobs = [], []
    for i, (r, st, f) in enumerate(zip(requests, steps, firsts)):
        if r.grammar is not None and not st.rebuild and not (skip and i in skip):
            owners.append(i)
            jobs.append((r.grammar, st.tokens[:, st.b0 - st.w0: st.b1 - st.w0], f))
    return owners, jobs
