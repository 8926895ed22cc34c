"""Attention *segments*: how several draft canvases of one request share its paged prefix in vLLM.

A segment is a run of query rows that attends, bidirectionally, to the keys ``[0, seq_len)`` of a
(possibly virtual) sequence whose pages are listed in a block-table row. With one segment per request
this is vLLM's own non-causal attention. Draft verification adds *detached* segments: canvas ``k`` of a
request is forwarded at the same positions as canvas 0 (``[w0, w1)``) but must see only the request's
cached prefix ``[0, w0)`` and itself. Its K/V is therefore written to private pages, and its block-table
row is ``prefix pages + private pages``: the paged kernel then reads exactly the prefix and the canvas,
with no copy of the prefix (only the page holding the prefix's last partial page is copied once per
canvas, so the canvas can continue it).

The runner publishes the segments of a step with :func:`set_step_segments` before the forward; the
metadata builders of :mod:`attention_backends.vllm_attention` read them with :func:`step_segments`.
Process-local state is enough: the builders run in the worker process that runs the model, right after
the runner prepared the inputs (the same pattern as vLLM's forward context).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Query rows ``[q_start, q_end)`` of batch request ``req`` attend to keys ``[0, seq_len)``.

    ``pages`` is the segment's block-table row (kernel block ids); ``None`` means the request's own row.
    """

    req: int
    q_start: int
    q_end: int
    seq_len: int
    pages: tuple[int, ...] | None = None


_STEP_SEGMENTS: list[Segment] | None = None


def set_step_segments(segments: list[Segment] | None) -> None:
    """Publish this step's segments (in query-row order, covering every scheduled row), or ``None``."""
    global _STEP_SEGMENTS
    _STEP_SEGMENTS = segments


def step_segments() -> list[Segment] | None:
    return _STEP_SEGMENTS


@dataclass(frozen=True)
class PrivatePages:
    """Where the extra canvases of one request keep their K/V: canvas ``k >= 1`` of ``seg_len`` tokens
    forwarded from position ``rf`` uses the request's pages ``first + (k - 1) * per_canvas`` onwards (past
    the pages canvas 0 writes); ``extra_slots`` is what the request must reserve beyond its scheduled tokens."""

    first: int
    per_canvas: int
    extra_slots: int

    @classmethod
    def plan(cls, rf: int, seg_len: int, n_canvases: int, page: int) -> "PrivatePages":
        per_canvas = (rf % page + seg_len + page - 1) // page  # continues the prefix's last partial page
        first = (rf + seg_len - 1) // page + 1
        needed = (first + (n_canvases - 1) * per_canvas) * page
        return cls(first, per_canvas, max(0, needed - (rf + n_canvases * seg_len)) if n_canvases > 1 else 0)


def split_block_causal(segments: list[Segment], block_size: int) -> list[Segment]:
    """Block-causal attention (SDAR) as non-causal sub-segments: rows of attention block ``j`` see keys up
    to the end of block ``j`` (``seq_len_j = last position in the sub-segment + 1``)."""
    out = []
    for s in segments:
        n = s.q_end - s.q_start
        first = s.seq_len - n  # position of the segment's first row
        pos = first
        if n == 0:
            out.append(s)
        while pos < first + n:
            end = min(first + n, (pos // block_size + 1) * block_size)
            q0 = s.q_start + pos - first
            out.append(Segment(s.req, q0, q0 + end - pos, end, s.pages))
            pos = end
    return out
