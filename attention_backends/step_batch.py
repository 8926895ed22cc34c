"""One forward's shape, built once by :func:`build_step_batch` and read by everyone (nano-vllm's ``Context``).

An engine describes each request's part of a forward as one entry:

- a dLLM step (:class:`~model_executor.dllm_request.DLLMStep`: the window ``[w0, w1)`` once per canvas of the
  block's decoder, the block ``[b0, b1)`` the decoder reads, DualCache's kept suffix), or
- :class:`Rows`: ``n`` rows from position ``start`` that decode nothing (a prompt prefill, a step cut short),
  or PRESTO's tree nodes with their own positions and visibility mask.

The batch has two row orders. **Model order** is the order the model runs its rows in: the first canvas of
every entry (its *scheduled* rows, ``T`` in all: what vLLM schedules as tokens, and the rows whose K/V is
written to the cache at their positions), request by request, then the further canvases of every dLLM step
(``E`` *extra* rows, which the model appends and whose K/V is never written). **Plan order** is the attention
plan's: request by request, canvas by canvas. ``order`` maps one to the other.

A row reads the cached prefix ``[0, start)`` of its request (``w0`` of a dLLM step; vLLM's
``num_computed_tokens``), its request's kept suffix, and its own segment (one per canvas) under the mask kind.
Rows a scheduled canvas writes past the prefix are never read before they are rewritten: the next forward
that reads those positions starts its window at or before them.

Both engines build the batch with this one function. The reference engine hands it to its model; in vLLM the
runner publishes it for the forward (:func:`set_step`), and the attention metadata builder and the model read
it (:func:`current_step`): one writer, readers that never recompute it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .prefix_attention import AttentionPlan, MaskKind


@dataclass
class Rows:
    """Rows that decode nothing: ``n`` rows from position ``start`` (reading the prefix ``[0, start)``), one
    segment under the layer's pattern, or under ``mask`` (``[n, n]`` bool, row ``i`` sees row ``j``) at
    ``positions`` (tree nodes). ``tokens``: their ids, when the engine supplies the model's input itself."""

    n: int
    start: int
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class HostPages:
    """Where each request's KV pages are, as host tensors, for one forward: per KV-cache group, the layers it
    serves, its page size and its block table rows of the batch's requests (``[R, max_pages]``). A model
    runner publishes them with the batch (vLLM keeps a host copy of every block table, which it copies to the
    device each step), so that planning attention reads no device memory."""

    layers: tuple[frozenset[str], ...]
    page_sizes: tuple[int, ...]
    block_tables: tuple[torch.Tensor, ...]

    def group(self, layer: str) -> int:
        """The KV-cache group of ``layer``."""
        for g, names in enumerate(self.layers):
            if layer in names:
                return g
        raise KeyError(f"layer {layer!r} is in no KV-cache group of the step")



@dataclass
class StepBatch:
    """One forward (module docstring). Host tensors; an engine moves what its device needs, once."""

    num_scheduled: int  # T: the first-canvas rows, model rows [0, T)
    scheduled_lens: torch.Tensor  # [R] of them per request
    positions: torch.Tensor  # [T + E] in model order
    input_ids: torch.Tensor | None  # [T + E] in model order (None where some entry has no tokens)
    extra_ids: torch.Tensor | None  # [E] the rows the model appends (None: none)
    order: torch.Tensor | None  # [T + E] model row of each plan row (None: the two orders agree)
    qo_indptr: torch.Tensor  # [R + 1] rows per request, plan order
    seg_indptr: torch.Tensor  # [S + 1] segments (one per canvas), plan order
    prefix_lens: torch.Tensor  # [R] cached prefix each request's rows read
    suffix_starts: torch.Tensor | None  # [R] DualCache's kept suffix (None: no request reads one)
    suffix_lens: torch.Tensor | None
    kind: MaskKind | None  # None: the layers' own pattern; "custom": ``custom_masks``
    custom_masks: list[torch.Tensor] | None
    logits_rows: torch.Tensor  # [N] model rows whose logits the decoders read: every canvas's block rows
    canvas_rows: list[list[int] | None]  # per entry: the first index into ``logits_rows`` of each canvas
    rewrite_ids: torch.Tensor | None = None  # [T]: the id of each scheduled row whose id is not vLLM's, else -1
    pages: HostPages | None = field(default=None, repr=False)  # set by a runner that publishes the batch
    # every entry's geometry as Python ints: two batches with equal keys have equal positions, segments, prefixes,
    # kept suffixes, row orders and logits rows (only their token ids may differ), so an attention plan of one
    # over the same pages serves the other; None where an entry has its own positions or mask (PRESTO's trees)
    layout_key: tuple | None = None

    @property
    def num_requests(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_extra(self) -> int:
        return 0 if self.extra_ids is None else self.extra_ids.numel()

    @property
    def num_rows(self) -> int:
        return self.num_scheduled + self.num_extra

    def host_inputs(self) -> torch.Tensor:
        """``[2, T + E]`` int64 on the host: row 0 the extra rows' token ids (from column ``T``; the scheduled
        rows' are vLLM's), row 1 every row's position: what the runner writes into vLLM's input buffers, in one
        copy. With :attr:`rewrite_ids`, ``[3, T + E]``: row 2 holds them (the scheduled rows' ids that differ from
        vLLM's tokens, -1 elsewhere)."""
        out = torch.zeros(2 if self.rewrite_ids is None else 3, self.num_rows, dtype=torch.long)
        if self.extra_ids is not None:
            out[0, self.num_scheduled:] = self.extra_ids
        if self.rewrite_ids is not None:
            out[2, : self.num_scheduled] = self.rewrite_ids
        out[1] = self.positions
        return out

    def fingerprint(self) -> int:
        """A 63-bit digest of the layout (rows, positions, extra ids, segments, prefixes, kept suffixes,
        masks, logits rows): equal on every rank of a tensor-parallel engine, or the ranks would compute
        different attention for the same all-reduce (:meth:`psd_plugin.vllm.runner.PSDRunnerMixin._check_ranks`)."""
        h = hashlib.blake2b(digest_size=8)
        for t in (self.scheduled_lens, self.host_inputs(), self.qo_indptr, self.seg_indptr, self.prefix_lens,
                  self.suffix_starts, self.suffix_lens, self.logits_rows, *(self.custom_masks or ())):
            if t is not None:
                h.update(t.contiguous().numpy().tobytes())
            h.update(b"|")
        h.update(str(self.kind).encode())
        return int.from_bytes(h.digest(), "little") >> 1

    def plan_positions(self) -> torch.Tensor:
        """``positions`` in plan order."""
        return self.positions if self.order is None else self.positions[self.order]

    def plan(self, block_table: torch.Tensor, page_size: int, pattern: MaskKind, block_size: int = 0
             ) -> AttentionPlan:
        """The attention plan of this batch over a paged cache (``block_table [R, pages]``, a host tensor), for
        layers of ``pattern`` (``block_size``: SDAR's attention block)."""
        kind = self.kind or pattern
        return AttentionPlan(self.qo_indptr, self.prefix_lens, block_table, page_size, kind=kind,
                             seg_indptr=self.seg_indptr, block_size=block_size,
                             positions=self.plan_positions() if kind == "block_causal" else None,
                             custom_masks=self.custom_masks, suffix_starts=self.suffix_starts,
                             suffix_lens=self.suffix_lens)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``range(starts[i], starts[i] + lens[i])`` end to end, as one int64 array (numpy: no Python int per row)."""
    ends = np.cumsum(lens)
    return np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]) if ends.size else 0)


def _index(pieces: list) -> torch.Tensor:
    """One int64 host tensor of ``pieces`` (ranges, or tensors) end to end: the layout's index arithmetic runs
    on Python ints, one tensor made at the end (a tensor op per request and canvas would cost more than the
    arithmetic). Ranges alone (every piece of a dLLM step's layout) are laid out by numpy from their starts and
    lengths, without a Python int per row, once there are enough of them to pay for numpy's few calls."""
    if len(pieces) >= 16 and all(type(p) is range and p.step == 1 for p in pieces):
        n = len(pieces)
        starts = np.fromiter((p.start for p in pieces), dtype=np.int64, count=n)
        lens = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=n)
        return torch.from_numpy(_ranges(starts, lens))
    flat: list[int] = []
    for p in pieces:
        flat.extend(p if isinstance(p, range) else p.tolist())
    return torch.tensor(flat, dtype=torch.long)


# from this many entries a batch of plain dLLM steps is laid out by :func:`_build_steps` (below it the per-entry
# loop costs less than numpy's fixed calls)
ARRAY_LAYOUT_MIN = 8


def build_step_batch(entries: list) -> StepBatch:
    """Lay out one forward from its entries, one per request, in the batch's request order: a dLLM step
    (anything with ``w0, w1, tokens [K, S], first_row, block_len, suffix, reads_suffix``, and ``tail``,
    ``rewrites``: :class:`~model_executor.dllm_request.DLLMStep`) or :class:`Rows` (module docstring). A step's
    tail is scheduled rows after its first canvas, a segment of their own."""
    if len(entries) >= ARRAY_LAYOUT_MIN:
        batch = _build_steps(entries)
        if batch is not None:
            return batch
    return _build_entries(entries)


def _build_entries(entries: list) -> StepBatch:
    """:func:`build_step_batch` entry by entry, for any batch."""
    T = sum(e.n if isinstance(e, Rows) else e.num_scheduled for e in entries)
    sched_ids, sched_pos, extra_ids, extra_pos = [], [], [], []
    plan_rows, qo, seg, prefix, suf0, suf = [], [0], [0], [], [], []
    logits_rows, canvas_rows, masks, scheduled = [], [], [], []
    t = e_next = n_logits = 0  # next scheduled row, next extra row (counted from T), logits rows so far
    rewrite = []  # (first scheduled row, ids): rows whose ids are not vLLM's tokens
    have_ids, custom = True, False
    key: list | None = []
    for e in entries:
        if isinstance(e, Rows):
            if e.positions is not None or e.mask is not None:
                key = None
            elif key is not None:
                key.append((e.n, e.start))
            sched_pos.append(e.positions.long() if e.positions is not None else range(e.start, e.start + e.n))
            sched_ids.append(e.tokens)
            have_ids &= e.tokens is not None
            plan_rows.append(range(t, t + e.n))
            seg.append(seg[-1] + e.n)
            qo.append(qo[-1] + e.n)
            prefix.append(e.start)
            suf0.append(0)
            suf.append(0)
            masks.append(e.mask)
            custom |= e.mask is not None
            canvas_rows.append(None)
            scheduled.append(e.n)
            t += e.n
            continue
        S, K, tail = e.seg_len, e.tokens.shape[0], e.tail_len
        if tail and K > 1:
            raise ValueError("a step with a tail has one canvas")
        pos = range(e.w0, e.w1)
        sched_ids.append(e.tokens[0])
        sched_pos.append(pos)
        r0, r1 = e.rewrites
        if r1 > r0:
            rewrite.append((t + r0 - e.w0, e.tokens[0, r0 - e.w0: r1 - e.w0]))
        starts = [t]
        plan_rows.append(range(t, t + S))
        if tail:
            sched_ids.append(e.tail)
            sched_pos.append(range(e.w1, e.w1 + tail))
            plan_rows.append(range(t + S, t + S + tail))
        if K > 1:  # the further canvases' ids, end to end (one piece a request)
            extra_ids.append(e.tokens[1:].reshape(-1))
        for k in range(1, K):
            starts.append(T + e_next)
            plan_rows.append(range(T + e_next, T + e_next + S))
            extra_pos.append(pos)
            e_next += S
        seg.extend([seg[-1] + S * (k + 1) for k in range(K)] + ([seg[-1] + S + tail] if tail else []))
        qo.append(qo[-1] + K * S + tail)
        prefix.append(e.w0)
        suf0.append(e.suffix[0])
        suf.append(e.reads_suffix)
        masks.extend([None] * (K + bool(tail)))
        canvas_rows.append([])
        first, L = e.first_row, e.block_len
        if key is not None:
            key.append((e.w0, e.w1, K, tail, e.suffix[0], e.reads_suffix, first, L))
        for a in starts:
            canvas_rows[-1].append(n_logits)
            logits_rows.append(range(a + first, a + first + L))
            n_logits += L
        scheduled.append(S + tail)
        t += S + tail
    E = e_next
    if custom and any(m is None for m in masks):
        raise ValueError("a step batch with custom masks needs one for every segment")
    ids, rewrite_ids = None, None
    if rewrite:
        rewrite_ids = torch.full((T,), -1, dtype=torch.long)
        for a, r in rewrite:
            rewrite_ids[a: a + r.numel()] = r
    if have_ids:
        ids = torch.cat([i.long().cpu() for i in sched_ids + extra_ids]) if sched_ids else \
            torch.zeros(0, dtype=torch.long)
    return StepBatch(
        num_scheduled=T,
        scheduled_lens=torch.tensor(scheduled, dtype=torch.long),
        positions=_index(sched_pos + extra_pos),
        input_ids=ids,
        extra_ids=torch.cat([i.long().cpu() for i in extra_ids]) if E else None,
        order=None if all(p.start == at for p, at in _starts(plan_rows)) else _index(plan_rows),
        qo_indptr=torch.tensor(qo), seg_indptr=torch.tensor(seg), prefix_lens=torch.tensor(prefix, dtype=torch.long),
        suffix_starts=torch.tensor(suf0) if any(suf) else None, suffix_lens=torch.tensor(suf) if any(suf) else None,
        kind="custom" if custom else None, custom_masks=masks if custom else None,
        logits_rows=_index(logits_rows), canvas_rows=canvas_rows, rewrite_ids=rewrite_ids,
        layout_key=None if key is None else tuple(key))


def _build_steps(entries: list) -> StepBatch | None:
    """:func:`build_step_batch` of a batch whose every entry is a dLLM step without a tail or rewritten rows (the
    steady batch), laid out by numpy from one ``[R, 8]`` array of the entries' geometry: the same batch as the
    per-entry loop, at a few microseconds an entry instead of one Python step per row piece. None for any other
    batch (a prefill, a replay, tokens off the host, an empty window), which the loop lays out."""
    geo, toks = [], []
    for e in entries:
        if isinstance(e, Rows) or e.tail_len:
            return None
        r0, r1 = e.rewrites
        t = e.tokens
        if r1 > r0 or t.device.type != "cpu" or e.w1 <= e.w0:
            return None
        # the layout key's fields, in its order: w0, w1, canvases, tail, kept suffix start, suffix read, first
        # prediction row, block length
        geo.append((e.w0, e.w1, t.shape[0], 0, e.suffix[0], e.reads_suffix, e.first_row, e.block_len))
        toks.append(t.numpy())
    g = np.array(geo, dtype=np.int64)
    w0, w1, K, _, s0, reads, first, L = g.T
    R, S = len(entries), w1 - w0
    T = int(S.sum())
    ext = S * (K - 1)  # extra rows per entry (its further canvases), after the T scheduled rows
    ent = np.repeat(np.arange(R), K)  # the entry of each canvas, canvases entry by entry
    k = np.arange(ent.size) - np.repeat(np.cumsum(K) - K, K)  # each canvas's index in its entry
    # each canvas's first model row: the first canvas at its entry's scheduled rows, a further one among the extras
    start = np.where(k == 0, (np.cumsum(S) - S)[ent], T + (np.cumsum(ext) - ext)[ent] + (k - 1) * S[ent])
    Sc, Lc = S[ent], L[ent]
    ids = np.concatenate([a[0] for a in toks]).astype(np.int64, copy=False)
    extra = np.concatenate([a[1:].reshape(-1) for a in toks]).astype(np.int64) if (K > 1).any() else None
    order = _ranges(start, Sc)
    offsets = (np.cumsum(Lc) - Lc).tolist()
    firsts = np.cumsum(K).tolist()
    return StepBatch(
        num_scheduled=T,
        scheduled_lens=torch.from_numpy(S.copy()),
        positions=torch.from_numpy(np.concatenate([_ranges(w0, S), _ranges(np.repeat(w0, K - 1),
                                                                             np.repeat(S, K - 1))])),
        input_ids=torch.from_numpy(ids if extra is None else np.concatenate([ids, extra])),
        extra_ids=None if extra is None else torch.from_numpy(extra),
        order=None if np.array_equal(order, np.arange(order.size)) else torch.from_numpy(order),
        qo_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum(K * S)])),
        seg_indptr=torch.from_numpy(np.concatenate([[0], np.cumsum(Sc)])),
        prefix_lens=torch.from_numpy(w0.copy()),
        suffix_starts=torch.from_numpy(s0.copy()) if reads.any() else None,
        suffix_lens=torch.from_numpy(reads.copy()) if reads.any() else None,
        kind=None, custom_masks=None,
        logits_rows=torch.from_numpy(_ranges(start + first[ent], Lc)),
        canvas_rows=[offsets[a - n: a] for a, n in zip(firsts, K.tolist())],
        layout_key=tuple(geo))


def _starts(plan_rows: list[range]):
    """Each plan-order range with the plan row it starts at (the model order equals the plan order exactly
    when every range starts there)."""
    at = 0
    for p in plan_rows:
        yield p, at
        at += len(p)


_current: StepBatch | None = None


def set_step(batch: StepBatch | None) -> None:
    """Publish the batch of the forward about to run (None: clear it once its logits are back)."""
    global _current
    _current = batch


def current_step() -> StepBatch | None:
    """The batch of the forward running now (None outside a step of the project's runners: a profiling run,
    vLLM's plain batch layout)."""
    return _current
