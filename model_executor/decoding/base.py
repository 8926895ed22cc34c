"""The engine-agnostic decoding protocol: a :class:`BlockDecoder` decodes one block of one request.

An engine steps every running request's decoder at once (one model call per loop, shared by all)::

    decs = [make_decoder(block_tokens, ...) for each request]
    while live := [d for d in decs if not d.done]:
        props = propose_all(live)          # per decoder >= 1 canvases to forward (the state, drafts...)
        preds = predict_rows(forward([c for p in props for c in p.canvases]), mask_id)
        update_all(live, props, preds, canvas_rows)   # commits; may commit more without a forward

Each method implements one batched step (:meth:`BlockDecoder.propose_batch`, :meth:`BlockDecoder.update_batch`);
what a proposal was made from travels in its :class:`Proposal`, never on the decoder. The methods written for
one block, as their papers state them, are the tests' oracles (``tests/oracles/decoders.py``).

Each canvas is forwarded in the same context (same prefix K/V, same window), so a canvas equal to a
state that plain decoding would reach gets *exactly* the prediction plain decoding would compute there:
that is what makes FreeDave and Spiffy lossless and lets every method reuse a verified prediction
instead of running the model again. Decoders hold no engine objects: only token tensors and logits.

Where the work runs: the logits stay on the engine's device and :func:`predict_rows` reduces them there (each
row's top-1 and its confidence come back in one copy). Everything after it, the methods' commit rules over a
step's states and predictions ``[R, K, L]``, is host data, computed in numpy on views of the host tensors (a few
microseconds an op where a small torch op costs tens, which a step pays dozens of times); every float operation
there is an element-wise IEEE one, :mod:`.portable_math`'s logarithm or a reduction kept in torch, so the decisions are bit for bit
those of the one-block oracles. The spatial policies' decoders are the exception where the logits are on an
accelerator: their step decides there (:class:`DeviceRowPredictions`, :meth:`~.policies.PolicyDecoder.update_batch`)
and the one copy brings their next states back instead of the predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..staging import Staging
from .sampling import RowDraws, Sampling, draw_rows, row_draws


@dataclass
class Prediction:
    """The model's view of one block state: top-1 tokens and their probabilities."""

    tokens: torch.Tensor  # [L] argmax (or drawn) token per position
    conf: torch.Tensor  # [L] its commit confidence; -inf at positions already decoded
    probs: torch.Tensor | None = None  # [L, V] full distribution (calibration only)
    logits: torch.Tensor | None = None  # [L, V] the canvas's logits (greedy; mask token excluded): :func:`top_token_gaps`


@dataclass
class RowPredictions:
    """Top-1 of every prediction row of one forward, computed once, batched (:func:`predict_rows`).

    The prediction rows are every canvas's block positions, canvas after canvas (``StepBatch.canvas_rows``
    indexes them); an engine hands each decoder its canvases' slices (``rows[a:b]``) and :func:`predict` then
    only masks decoded positions. ``tokens`` and ``conf`` are on the host, with the decoders' state. The logits
    stay on the engine's device, for decoders that sample or rank tokens, and exist only for the rows the
    decoders read (:func:`logits_kept`): ``at`` maps a prediction row to its logits row."""

    logits: torch.Tensor  # [M, V] on the engine's device: the kept rows, in prediction-row order
    tokens: torch.Tensor  # [N] argmax (host); -1 where no logits were computed
    conf: torch.Tensor  # [N] softmax probability of the argmax (host; float32 at least: confidence_dtype); -inf
    at: torch.Tensor | None = None  # [N] (host) logits row of each prediction row, -1: none; None: the same row

    def logits_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The logits rows ``[n]`` of prediction rows ``rows [n]`` (host); every one must have been computed."""
        if self.at is None:
            return rows
        out = self.at[rows]
        if out.numel() and bool((out < 0).any()):  # host data
            raise RuntimeError(f"logits of prediction rows {rows[out < 0].tolist()} were not computed: a decoder "
                               "reads rows its step did not keep (DLLMStep.kept)")
        return out

    def __getitem__(self, rows: slice) -> "RowPredictions":
        if self.at is None:
            return RowPredictions(self.logits[rows], self.tokens[rows], self.conf[rows])
        at = self.logits_of(torch.arange(self.tokens.numel())[rows])
        first = int(at[0]) if at.numel() else 0  # kept rows keep their order: a canvas's rows are contiguous
        return RowPredictions(self.logits[first: first + at.numel()], self.tokens[rows], self.conf[rows])


@dataclass
class DeviceRowPredictions:
    """A step's predictions left where the logits are, for decoders that decide there (:func:`decide_on_device`;
    e.g. :meth:`~.policies.PolicyDecoder.update_batch` with :func:`~.policies.commit_rows`): no copy to the host and
    no scatter to the prediction rows (:func:`predict_rows` with ``on_device``). ``tokens``/``conf [M]`` are per
    logits row, on the logits' device; ``at`` (host) maps a prediction row to its logits row, as in
    :class:`RowPredictions`."""

    logits: torch.Tensor  # [M, V]
    tokens: torch.Tensor  # [M] on the logits' device: the argmax (or the draw) of each logits row
    conf: torch.Tensor  # [M] its probability (float32 at least)
    at: torch.Tensor | None = None  # [N] (host) logits row of each prediction row, -1: none; None: the same row
    staging: Staging | None = None  # the engine's pinned upload buffers (model_executor.staging); None: plain copies
    # decisions taken ahead of the update (:func:`launch_all`): the group's key -> its copy on the way back
    launched: dict | None = None

    logits_of = RowPredictions.logits_of

    def logits_rows(self, rows: np.ndarray) -> np.ndarray:
        """The logits row of each prediction row in ``rows`` (numpy, -1: none), -1 where none was computed."""
        if self.at is None:
            return rows
        return np.where(rows >= 0, self.at.numpy()[np.maximum(rows, 0)], -1)

    def upload(self, key: str, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """A decoder update's host arrays (integers, or bools) on the predictions' device in one copy (through
        the engine's pinned buffer ``key``), each in its shape, as int64."""
        flat = torch.from_numpy(np.concatenate([np.asarray(a).reshape(-1).astype(np.int64) for a in parts]))
        dev = self.tokens.device
        up = self.staging.upload(key, flat, dev) if self.staging is not None else flat.to(dev, non_blocking=True)
        out, a = [], 0
        for p in parts:
            n = int(np.size(p))
            out.append(up[a: a + n].view(np.shape(p)))
            a += n
        return out

    def gather(self, at: torch.Tensor, canvases: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`canvas_predictions` where the predictions are: tokens and confidences of the positions whose
        logits rows are ``at`` (device, -1: none) of the canvases ``canvases`` (device); token -1 and confidence
        -inf where a position has no logits row, confidence -inf where the canvas is not masked."""
        safe = at.clamp(min=0)
        tok = torch.where(at < 0, torch.full_like(at, -1), self.tokens[safe])
        conf = self.conf[safe]
        return tok, torch.where((canvases != mask_id) | (at < 0), torch.full_like(conf, float("-inf")), conf)

    def _packed(self, cols: list[torch.Tensor], at: torch.Tensor) -> torch.Tensor:
        """``cols`` and each block's count of non-finite predictions at ``at``, as one float64 ``[R, sum n + 1]``
        where the predictions are (:meth:`read_back`)."""
        R = at.shape[0]
        bad = (self.conf[at.clamp(min=0)].isnan() & (at >= 0)).reshape(R, -1).sum(-1)
        return torch.cat([c.reshape(R, -1).double() for c in cols] + [bad[:, None].double()], 1)

    def read_back(self, cols: list[torch.Tensor], at: torch.Tensor) -> torch.Tensor:
        """A decoder update's decisions (per block: ``cols``, each ``[R]`` or ``[R, n]``) to the host in the step's
        one copy, as float64 ``[R, sum n]`` (token ids are exact in it, confidences widen exactly). The blocks'
        predictions at ``at`` (their logits rows, -1: none) are checked finite in the same copy: a NaN (the
        model's output held NaN or inf) raises, and the caller steps no decoder (:func:`decode_step` then steps
        each alone, so only the block's request fails)."""
        return finite_decisions(self._packed(cols, at).cpu())

    def read_back_later(self, cols: list[torch.Tensor], at: torch.Tensor) -> "PendingCopy":
        """:meth:`read_back`'s copy queued behind the work that computes it, the host not waiting
        (:class:`PendingCopy`; :func:`finite_decisions` of what it brings, split again by
        :meth:`PendingCopy.columns`)."""
        return PendingCopy(self._packed(cols, at), [c.shape for c in cols])

    def read_back_columns(self, cols: list[torch.Tensor], at: torch.Tensor) -> list[np.ndarray]:
        """:meth:`read_back`, the copy split again: each column as a float64 host array of its own shape
        ``[R, ...]`` (views of the one copy; ids ``.astype(np.int64)``, flags ``> 0``)."""
        return split_columns(self.read_back(cols, at).numpy(), [c.shape for c in cols])


def split_columns(h: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
    """A read-back's columns (:meth:`DeviceRowPredictions.read_back`, ``[R, sum n]``) each in its shape (views)."""
    out, a = [], 0
    for shape in shapes:
        n = int(np.prod(shape[1:], dtype=np.int64))
        out.append(h[:, a: a + n].reshape(shape))
        a += n
    return out


def finite_decisions(out: torch.Tensor) -> torch.Tensor:
    """A packed read-back (:meth:`DeviceRowPredictions.read_back`) on the host without its last column, the
    blocks' counts of non-finite predictions, which raise where any is not zero."""
    if bool((out[:, -1] > 0).any()):  # host data
        raise RuntimeError(f"non-finite logits at {int(out[:, -1].max())} of the request's prediction rows (NaN "
                           "or inf in the model's output for its canvases): nothing to decode")
    return out[:, :-1]


class PendingCopy:
    """A device tensor's copy to the host, queued on the current stream behind the work that computes it (into
    pinned memory, an event after it): the host goes on, launching more work, and :meth:`wait` waits for this
    copy alone, not for what was queued after it. Where the tensor is on the host, or there is no CUDA runtime (a
    stand-in device in the tests), the copy is made at once."""

    def __init__(self, dev: torch.Tensor, shapes: list | None = None):
        self.event, self.shapes = None, shapes  # (the columns packed in it: DeviceRowPredictions.read_back_later)
        if dev.device.type == "cuda":
            self.host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
            self.host.copy_(dev, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = dev.cpu()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def columns(self) -> list[np.ndarray]:
        """A packed read-back's columns once it is here, as :meth:`DeviceRowPredictions.read_back_columns` gives
        them (a block's non-finite prediction raises)."""
        return split_columns(finite_decisions(self.wait()).numpy(), self.shapes)


def logits_map(kept: torch.Tensor) -> torch.Tensor:
    """``[N]``: the logits row of each prediction row when only the rows ``kept [N]`` (bool, host) get logits,
    in order; -1 for the others."""
    k = kept.numpy()
    out = np.full(k.size, -1, dtype=np.int64)
    out[k] = np.arange(int(np.count_nonzero(k)))
    return torch.from_numpy(out)


def exclude_mask_token(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Set the mask token's logit to -inf, in place: no prediction, greedy or sampled, may be the mask token.
    A committed mask would leave its position masked, and a decoder that must fill every position would then
    step forever (a random or badly trained model can rank the mask first). Returns ``logits``."""
    logits.select(-1, mask_id).fill_(float("-inf"))
    return logits


def work_bytes(device: torch.device) -> int:
    """The most memory a row-wise pass over logits (:func:`predict_rows`, :func:`top_token_gaps`) takes for its work
    buffers, so a step's cost beyond its logits is bounded whatever its rows: about 16 MB on a CPU (a chunk's
    second pass reads it from cache), 256 MB on an accelerator (few, large launches)."""
    return (16 << 20) if device.type == "cpu" else (256 << 20)


def confidence_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype confidences are computed in from logits of ``dtype``: float32 at least (a bfloat16 softmax
    moves in steps of about 0.004 near 0.9 and rounds everything above about 0.996 to 1.0, which flips
    threshold decisions and makes ties; the authors' code takes the softmax in float32/float64), float64
    logits keep float64 (the exactness path)."""
    return torch.promote_types(dtype, torch.float32)


def predict_rows(logits: torch.Tensor, mask_id: int | None = None, kept: torch.Tensor | None = None,
                 draws: RowDraws | None = None, on_device: bool = False) -> RowPredictions | DeviceRowPredictions:
    """Argmax and its probability of every row of ``logits [M, V]``, without materialising a softmax: per row
    the max (first index on ties, as ``argmax``, in the logits' dtype) and ``sum(exp(x - max))`` in
    :func:`confidence_dtype` (float32 from bfloat16/float16 logits). The rows go in chunks whose work buffer
    fits :func:`work_bytes` (on a CPU about 16 MB, so the second pass reads it from cache; at a 126k vocabulary
    a whole batch would be gigabytes).

    ``mask_id``: the mask token is excluded first, in place (:func:`exclude_mask_token`); the engines pass it.
    ``kept [N]`` (bool, on the host): the logits are those of these prediction rows only (``M = kept.sum()``;
    the engines keep the rows a decoder reads, :attr:`~model_executor.dllm_request.DLLMStep.kept`); the
    others get token -1 and confidence -inf (a decoded position).

    ``draws``: the step's sampled rows (:func:`~.sampling.row_draws`); their tokens and confidences are the
    Gumbel-max draws (:func:`~.sampling.draw_rows`), computed where the logits are before the one copy.

    Device discipline: the tokens and confidences come back **on the host** (the decoders' state lives there),
    in one device-to-host copy (both packed into one float64 tensor: token ids are exact in it; none on a CPU,
    where they are already); the logits
    stay where they are, for what needs them (sampling, Spiffy's top tokens, logprobs).

    ``on_device``: no copy at all; the tokens and confidences stay with the logits, per logits row
    (:class:`DeviceRowPredictions`), for decoders that decide there."""
    if mask_id is not None:
        exclude_mask_token(logits, mask_id)
    M, V = logits.shape
    cdt = confidence_dtype(logits.dtype)
    # allocated as the logits are (``new_*``: their device): the work is there, the host waits once, below
    tokens = logits.new_empty((M,), dtype=torch.long)
    conf = logits.new_empty((M,), dtype=cdt)
    chunk = max(1, work_bytes(logits.device) // max(1, V * torch.finfo(cdt).bits // 8))
    # the greedy top-1 of the rows not drawn (a drawn row's tokens and confidences are its draw's)
    greedy = None  # every row
    if draws is not None and len(draws):
        drawn = np.zeros(M, dtype=bool)
        drawn[draws.rows] = True
        if drawn.any():
            greedy = torch.from_numpy(np.flatnonzero(~drawn)).to(logits.device, non_blocking=True)
    n = M if greedy is None else greedy.numel()
    work = logits.new_empty((min(chunk, n), V), dtype=cdt)  # reused: no fresh pages
    whole = greedy is None and n <= chunk  # every row in one pass: the results are the buffers themselves
    for a in range(0, n, chunk):
        rows = slice(a, a + chunk) if greedy is None else greedy[a: a + chunk]
        x = logits if whole else logits[rows]
        best, idx = x.max(-1)
        w = work[: x.shape[0]]
        if cdt == logits.dtype:
            torch.sub(x, best[:, None], out=w)
        else:  # upcast first: the difference of two bfloat16 logits is not a bfloat16
            w.copy_(x).sub_(best[:, None].to(cdt))
        z = w.exp_().sum(-1)  # >= 1: the max contributes exp(0)
        if whole:
            tokens, conf = idx, z.reciprocal_()  # (1.0 / z is z.reciprocal() * 1.0: the same bits)
        else:
            tokens[rows], conf[rows] = idx, z.reciprocal_()
    if draws is not None and len(draws):
        draw_rows(logits, draws, tokens, conf, work_bytes(logits.device))
    if on_device:
        return DeviceRowPredictions(logits, tokens, conf, None if kept is None else logits_map(kept))
    if logits.device.type == "cpu":  # the host already: no copy to make
        tokens_h, conf_h = tokens, conf
    else:  # one copy to the host: [2, M] float64 (ids < 2**53 are exact)
        both = torch.stack([tokens.to(torch.float64), conf.to(torch.float64)]).cpu()
        tokens_h, conf_h = both[0].long(), both[1].to(cdt)
    if kept is None:
        return RowPredictions(logits, tokens_h, conf_h)
    # scattered to every prediction row in numpy (host arrays: a few small torch ops cost more than the work)
    k = kept.numpy()
    at = np.flatnonzero(k)
    if at.size != M:
        raise ValueError(f"predict_rows: {M} logits rows for {at.size} kept prediction rows")
    out_tok = np.full(k.size, -1, dtype=np.int64)
    out_conf = np.full(k.size, -np.inf, dtype=conf_h.numpy().dtype)
    out_tok[at], out_conf[at] = tokens_h.numpy(), conf_h.numpy()
    return RowPredictions(logits, torch.from_numpy(out_tok), torch.from_numpy(out_conf), logits_map(kept))


def top_token_gaps(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The likeliest tokens at a few rows where the logits are, with no host read (what Spiffy's formulas read:
    :func:`~.spiffy.top_logprobs` makes their log-probabilities from these): ranks 2..k of the rows ``rows [n]`` (the
    likeliest tokens other than each row's prediction ``tokens [n]``, greedy or drawn), their ids ``[n, k - 1]``
    and their logits' gaps to the prediction's (float64), on the logits' device. The rows are gathered in chunks
    of :func:`work_bytes` into one reused buffer, as :func:`predict_rows` does; each row's result is its own
    (a selection and a subtraction: the same wherever the row sits in a batch)."""
    n, V = rows.numel(), logits.shape[1]
    dev = logits.device
    if not n or k < 2:
        return (torch.zeros(n, max(k - 1, 0), dtype=torch.long, device=dev),
                torch.zeros(n, max(k - 1, 0), dtype=torch.float64, device=dev))
    rows = rows.to(dev, non_blocking=True)
    tok = tokens.to(dev, non_blocking=True)[:, None]
    chunk = max(1, work_bytes(dev) // max(1, V * logits.element_size()))
    work = torch.empty(min(chunk, n), V, dtype=logits.dtype, device=dev)
    ids, gaps = [], []
    for a in range(0, n, chunk):
        x = torch.index_select(logits, 0, rows[a: a + chunk], out=work[: min(chunk, n - a)])
        t = tok[a: a + chunk]
        top = x.topk(k, dim=-1)
        # ranks 2..k: the likeliest tokens other than the prediction (a drawn one need not be the argmax)
        pick = torch.sort((top.indices == t).to(torch.int8), dim=1, stable=True).indices[:, : k - 1]
        ids.append(top.indices.gather(1, pick))
        gaps.append((top.values.gather(1, pick) - x.gather(1, t)).double())
    return torch.cat(ids), torch.cat(gaps)


def predict(out: torch.Tensor | RowPredictions, state: torch.Tensor, mask_id: int, keep_probs: bool = False,
            sampling: Sampling | None = None, position0: int = 0, step: int = 0) -> Prediction:
    """Greedy (or sampled) tokens and confidences over masked positions of one canvas, from its logits
    ``[L, V]`` or its slice of the step's :class:`RowPredictions`.

    Predictions come from the batched rows (computed here when given bare logits; confidences in
    :func:`confidence_dtype`, so a float64 model gives float64 confidences, the exactness path), and keep the
    canvas's logits (``Prediction.logits``) for a decoder that ranks tokens at a few positions
    (:func:`top_token_gaps`). ``sampling`` (bare logits only: the engines' rows are drawn already) draws the canvas
    as the engines draw it: position ``j`` is absolute position ``position0 + j`` in the block's ``step``-th
    step (:mod:`.sampling`). ``keep_probs`` (greedy; calibration) gives the full distributions, in float64.
    Several canvases: :func:`predict_each`."""
    return predict_each([(out, state, dict(keep_probs=keep_probs, sampling=sampling, position0=position0,
                                           step=step))], mask_id)[0]


def predict_each(jobs: list[tuple[torch.Tensor | RowPredictions, torch.Tensor, dict]], mask_id: int
                 ) -> list[Prediction]:
    """:func:`predict` ``(out, state, mask_id, **options)`` of every job ``(out, state, options)``; what the
    decoders read of full distributions (``keep_probs``) reaches the host in one copy for all jobs. An option
    ``grammar`` (the request's :class:`~model_executor.grammar.GrammarFrontier`) constrains the job's confidences
    to the frontier rule."""
    preds, drawn, grammars = [], [], []
    for out, state, kw in jobs:
        kw = dict(kw)
        grammars.append(kw.pop("grammar", None))
        p = _predict_here(out, state, mask_id, **kw)
        preds.append(p)
        if p.logits is None:  # still where the logits are
            drawn.append(p)
    fields = ("tokens", "conf")
    parts = [(p, f, getattr(p, f)) for p in drawn for f in fields]
    if parts:  # one copy: float64 holds the token ids exactly
        flat = torch.cat([t.reshape(-1).to(torch.float64) for _, _, t in parts]).cpu()
        at = 0
        for p, f, t in parts:
            setattr(p, f, flat[at: at + t.numel()].view(t.shape).to(t.dtype))
            at += t.numel()
    for p, (_, state, _), g in zip(preds, jobs, grammars):
        p.conf = torch.where(state == mask_id, p.conf, torch.full_like(p.conf, float("-inf")))
        if g is not None:  # the grammar frontier rule on the canvas's own prediction (model_executor.grammar)
            p.tokens, p.conf = g.constrain(state, p.tokens, p.conf)
    return preds


def _predict_here(out, state: torch.Tensor, mask_id: int, keep_probs: bool = False,
                  sampling: Sampling | None = None, position0: int = 0, step: int = 0) -> Prediction:
    """:func:`predict` before the state's mask: a ``keep_probs`` prediction (``logits`` None) is where the logits
    are; any other is the rows' host predictions."""
    rows = out if isinstance(out, RowPredictions) else None
    # the engines' rows exclude the mask token already (predict_rows(..., mask_id)); bare logits are copied
    logits = rows.logits if rows is not None else exclude_mask_token(out.clone(), mask_id)
    if keep_probs:
        if sampling is not None:
            raise ValueError("predict: keep_probs (calibration) is greedy; sampling is not supported with it")
        lg = logits.double()
        probs = torch.softmax(lg, -1)
        tokens = lg.argmax(-1)
        return Prediction(tokens, probs.gather(-1, tokens[:, None])[:, 0], probs)
    if rows is None:
        L = logits.shape[0]
        draws = None if sampling is None else row_draws([(sampling, position0, [0], [step], L,
                                                          (state == mask_id).cpu().numpy())], None)
        rows = predict_rows(logits, draws=draws)
    elif sampling is not None:
        raise ValueError("predict: the engines' rows are drawn already (predict_rows' draws); sampling is for "
                         "bare logits")
    return Prediction(rows.tokens, rows.conf, logits=rows.logits)


def commit(state: torch.Tensor, pred: Prediction, positions: torch.Tensor) -> torch.Tensor:
    """A new state with ``pred.tokens`` written at the boolean ``positions``."""
    return torch.where(positions, pred.tokens, state)


@dataclass
class Proposal:
    """What one decoder forwards in a step: its canvases (the state first, then drafts), and the method's own
    record of how they were made, which its update reads. It travels on the request's step
    (:class:`~model_executor.dllm_request.DLLMStep`), never as a flag on the decoder."""

    canvases: list[torch.Tensor]
    data: object = None
    # the base-policy step (in the block) whose draw each canvas's predictions take when sampling
    # (:mod:`.sampling`): a draft for the state k steps ahead is drawn as that state will be; None: every
    # canvas at the decoder's current step (:attr:`BlockDecoder.t`)
    steps: list[int] | None = None

    def canvas_steps(self, t: int) -> list[int]:
        return [t] * len(self.canvases) if self.steps is None else self.steps


class BlockDecoder:
    """Base class: one block of one request, and the method's step over many such blocks at once.

    A method implements two classmethods over a list of its decoders (what :func:`propose_all` and
    :func:`update_all` hand it, in any mix of knobs and progress): :meth:`propose_batch` returns one
    :class:`Proposal` per decoder, :meth:`update_batch` reads each decoder's own proposal and the step's
    predictions and advances its state. Between the two, nothing is kept on the decoder: the decoders updated
    together need not be those proposed together (a request may wait a step for room in the batch)."""

    def __init__(self, block: torch.Tensor, mask_id: int):
        self.state = block.clone()
        self.mask_id = mask_id
        self.forwards = 0  # model calls this block took
        # the base-policy steps that led to ``state`` in this block: the step index of its draws when sampling
        # (:mod:`.sampling`); a method that commits several steps at once (accepted drafts) advances it by as many
        self.t = 0
        self.sampling: Sampling | None = None  # the request's (set by make_decoder); None: greedy
        # the request's grammar (structured outputs, model_executor.grammar): the engines constrain the step's
        # predictions with it; a decoder that draws its own predictions passes it to predict_each
        self.grammar = None

    @property
    def masked(self) -> torch.Tensor:
        return self.state == self.mask_id

    @property
    def done(self) -> bool:
        return not self.has_masks

    @property
    def masks_left(self) -> int:
        """How many masks the state holds (host data: a numpy count)."""
        s = self.state
        return int((s.numpy() == self.mask_id).sum()) if s.device.type == "cpu" else int(self.masked.sum())

    @property
    def has_masks(self) -> bool:
        """Whether the state still holds a mask (host data: a numpy scan, where two small torch ops and a
        ``bool`` cost several times more)."""
        s = self.state
        return bool((s.numpy() == self.mask_id).any()) if s.device.type == "cpu" else bool(self.masked.any())

    def commit_canvases(self) -> np.ndarray | None:
        """Per block position, the canvas (index into the last step's proposal) whose prediction row the token the
        last update committed there was taken from, for its logprobs; None: the state canvas, every position."""
        return None

    rewrites_tokens = False  # whether the method edits positions it committed (then no grammar applies)
    # whether the method's update can decide where the logits are (from DeviceRowPredictions: decide_on_device)
    device_update = False

    @property
    def reads_all_rows(self) -> bool:
        """Whether this decoder's update reads the logits of every position of its canvases (it samples, or
        records distributions); else it reads the predictions of masked positions only, and a step computes
        logits for those alone (:attr:`~model_executor.dllm_request.DLLMStep.kept`)."""
        return False

    def stats(self) -> dict:
        """Method-specific counters (accepted drafts ...), summed over blocks by the engine."""
        return {}

    @classmethod
    def propose_batch(cls, decoders: list["BlockDecoder"]) -> list[Proposal]:
        """The next canvases of every decoder (not done), one :class:`Proposal` each, in order."""
        raise NotImplementedError

    @classmethod
    def update_batch(cls, decoders: list["BlockDecoder"], proposals: list[Proposal], preds: RowPredictions,
                     canvas_rows: list[list[int]]) -> None:
        """One step of every decoder from its own ``proposals[i]``: ``canvas_rows[i]`` lists the first row (in
        ``preds``) of each of its canvases (:func:`canvas_row_index` makes the ``[R, K, L]`` row index)."""
        raise NotImplementedError

    @classmethod
    def launch_batch(cls, decoders: list["BlockDecoder"], proposals: list[Proposal], preds: "DeviceRowPredictions",
                     canvas_rows: list[list[int]]) -> list[torch.Tensor]:
        """The decisions :meth:`update_batch` will take, taken now where the predictions are, nothing stepped
        (:func:`launch_all`): per decoder its next step's canvases on the device (``[K, L]``, ``K`` the
        decoder's canvases in this step, :meth:`canvases_ahead`), and the copy back queued in ``preds.launched``
        under :func:`launch_key` of the group the update will make. Only methods whose next canvases follow
        from the decisions where they are taken have it (:func:`decides_ahead`)."""
        raise NotImplementedError

    def canvases_ahead(self, proposal: Proposal) -> int | None:
        """How many canvases the step after the one forwarding ``proposal`` is laid out with before its decisions
        reach the host (:meth:`launch_batch`): at least as many as that step's plan will have (where it has fewer,
        the rest decode nothing); None where no bound is known before. One canvas stays one."""
        return 1 if len(proposal.canvases) == 1 else None


def groups(items: list, key) -> list[list[int]]:
    """Indices of ``items`` with equal ``key(item)``, groups in order of first appearance, indices in order."""
    out: dict = {}
    for i, x in enumerate(items):
        out.setdefault(key(x), []).append(i)
    return list(out.values())


def update_in_groups(update, key, decoders: list[BlockDecoder], proposals: list[Proposal], preds: RowPredictions,
                     canvas_rows: list[list[int]]) -> None:
    """``update(decoders, proposals, preds, canvas_rows)`` once per group of decoders with equal
    ``key(decoder, proposal)``: the knobs one batched update cannot mix (a policy, a draft DAG, a graph)."""
    for idx in groups(range(len(decoders)), lambda i: key(decoders[i], proposals[i])):
        update([decoders[i] for i in idx], [proposals[i] for i in idx], preds, [canvas_rows[i] for i in idx])


def decide_on_device(decoders: list[BlockDecoder]) -> bool:
    """Whether a step of ``decoders`` (the step's logits on an accelerator) takes its decisions there: every one
    of a method whose update has a device form (:attr:`BlockDecoder.device_update`: the spatial policies unless
    they record distributions, PSD, LoPA, FreeDave, Spiffy, joint_threshold), without a grammar (whose frontier rule runs on
    the host). Its update then gets :class:`DeviceRowPredictions` and makes the step's
    one copy back: the next states and what the host's bookkeeping reads."""
    return bool(decoders) and all(d.device_update and d.grammar is None for d in decoders)


def decides_ahead(decoders: list[BlockDecoder]) -> bool:
    """Whether a step of ``decoders`` can take its decisions ahead of its update (:func:`launch_all`): every one
    decides on the device (:func:`decide_on_device`) by a method whose next canvases are known there before the
    host reads anything (:meth:`BlockDecoder.launch_batch`: every method; PSD's and FreeDave's drafts are
    assembled there from the decisions, Spiffy's draft graph is instantiated, scored and pruned there, LoPA's
    branches are made by them)."""
    base = BlockDecoder.launch_batch.__func__
    return decide_on_device(decoders) and all(type(d).launch_batch.__func__ is not base for d in decoders)


def launch_all(decoders: list[BlockDecoder], proposals: list[Proposal], preds: "DeviceRowPredictions",
               canvas_rows: list[list[int]]) -> list[torch.Tensor]:
    """The decisions of a step of ``decoders`` (:func:`decides_ahead`) taken where the predictions are, before
    their update: per decoder its next step's canvases on the device (``[K, L]``: the next state, then any
    drafts :meth:`BlockDecoder.launch_batch`), and each method group's copy of them to the
    host queued on the way (``preds.launched``), which :func:`update_all` then waits for instead of deciding
    again. A step's next canvases can so be written on the device while the host has learnt nothing yet."""
    preds.launched = {} if preds.launched is None else preds.launched
    out: list = [None] * len(decoders)
    for idx in groups(decoders, type):
        for i, t in zip(idx, type(decoders[idx[0]]).launch_batch([decoders[i] for i in idx],
                                                                 [proposals[i] for i in idx], preds,
                                                                 [canvas_rows[i] for i in idx])):
            out[i] = t
    return out


def launch_key(decoders: list[BlockDecoder], canvas_rows: list[list[int]]) -> tuple:
    """What identifies one batched update's decisions taken ahead (:func:`launch_all`): its decoders, in order,
    and their rows."""
    return tuple(map(id, decoders)), tuple(r[0] for r in canvas_rows)


def propose_all(decoders: list[BlockDecoder]) -> list[Proposal]:
    """One :class:`Proposal` per decoder, in order: each method proposes for all its decoders at once
    (:meth:`BlockDecoder.propose_batch`)."""
    out: list = [None] * len(decoders)
    for idx in groups(decoders, type):
        for i, p in zip(idx, type(decoders[idx[0]]).propose_batch([decoders[i] for i in idx])):
            out[i] = p
    return out


def update_all(decoders: list[BlockDecoder], proposals: list[Proposal], preds: RowPredictions,
               canvas_rows: list[list[int]]) -> None:
    """One decoder step of every decoder of a forward from its batched predictions: ``canvas_rows[i]`` lists
    the first row (in ``preds``) of each canvas of ``proposals[i]`` (decoder ``i``'s), a block's length of rows
    each. Each method updates all its decoders at once (:meth:`BlockDecoder.update_batch`), whichever calls
    proposed them."""
    for idx in groups(decoders, type):
        type(decoders[idx[0]]).update_batch([decoders[i] for i in idx], [proposals[i] for i in idx], preds,
                                            [canvas_rows[i] for i in idx])


def canvas_row_index(decoders: list[BlockDecoder], canvas_rows: list[list[int]], K: int | None = None
                     ) -> torch.Tensor:
    """``[R, K, L]``: the row of ``preds`` of position ``l`` of canvas ``k`` of decoder ``r`` (-1 past its
    canvases or past a shorter block); ``K`` defaults to the most canvases of a decoder."""
    lens = np.array([d.state.numel() for d in decoders])
    K = max(len(c) for c in canvas_rows) if K is None else K
    # numpy from Python lists: the host index of a step (a tensor per decoder, or a few small torch ops, cost
    # more than the arithmetic)
    starts = np.array([list(c[:K]) + [-1] * (K - len(c[:K])) for c in canvas_rows], dtype=np.int64).reshape(-1, K)
    j = np.arange(lens.max() if lens.size else 0)
    ok = (starts[..., None] >= 0) & (j < lens[:, None, None])
    return torch.from_numpy(np.where(ok, starts[..., None] + j, -1))


def pad_rows(tensors: list[torch.Tensor], value) -> torch.Tensor:
    """``[R, n_max, ...]``: the tensors stacked, each padded with ``value`` along its first dimension."""
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value)


def canvas_predictions(preds: RowPredictions, rows: np.ndarray, canvases: np.ndarray, mask_id: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and confidences ``[..., L]`` (numpy) of the canvases ``[..., L]`` (numpy) whose predictions are at
    ``rows`` of ``preds`` (-1: none), as :func:`predict` gives them: confidence -inf where the canvas is not
    masked or has no row. Fresh arrays (the step's predictions are left as they are)."""
    at = np.maximum(rows, 0)
    tok, conf = preds.tokens.numpy()[at], preds.conf.numpy()[at]
    conf[(canvases != mask_id) | (rows < 0)] = -np.inf
    return tok, conf


def host_rows(rows: list[tuple[torch.Tensor, ...]]) -> list[np.ndarray]:
    """Per column of ``rows`` (each a tuple of host tensors ``[L_r]``: a decoder's state, its prediction's tokens
    and confidences ...), one numpy array ``[R, max L_r]``, padded with -1 (ids) or -inf (floats): the
    decoders' host data for a batched step, assembled in numpy."""
    if not rows:
        return []
    cols = [[t.numpy() for t in col] for col in zip(*rows)]
    lens = [a.size for a in cols[0]]
    L = max(lens)
    if min(lens) == L:  # blocks of one length (the usual step): no padding
        return [np.stack(col) for col in cols]
    out = []
    for col in cols:
        arr = np.full((len(col), L), -np.inf if col[0].dtype.kind == "f" else -1, dtype=col[0].dtype)
        for i, a in enumerate(col):
            arr[i, : a.size] = a
        out.append(arr)
    return out


def first_max(c: np.ndarray) -> np.ndarray:
    """The most confident position of each row of the confidences ``c [..., L]`` (numpy; first on ties, as
    numpy's and torch's argmax), none in a row of -inf: the static scheduler's one commit."""
    out = np.zeros(c.shape, dtype=bool)
    if c.size:
        np.put_along_axis(out, c.argmax(-1)[..., None], True, axis=-1)
        out &= np.isfinite(c).any(-1, keepdims=True)
    return out


def host_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor as a numpy array (a view; bfloat16 upcast, which numpy lacks). The decoders' state and a
    step's predictions are host data: their few element-wise ops over a step's ``[R, L]`` cost microseconds in
    numpy and tens of them as small torch ops."""
    return (t.float() if t.dtype == torch.bfloat16 else t).detach().cpu().numpy()


def onehot_first_max(conf: torch.Tensor) -> torch.Tensor:
    """:func:`first_max` of a tensor of confidences: in numpy on host data, as tensor ops where a device tensor
    is (:func:`first_max_tensor`)."""
    if conf.device.type != "cpu":
        return first_max_tensor(conf)
    return torch.from_numpy(first_max(host_array(conf))).to(conf.device)


def first_max_tensor(conf: torch.Tensor) -> torch.Tensor:
    """:func:`first_max` as tensor ops where ``conf`` is (the first maximum on ties, as argmax takes it in both
    libraries; none in a row of -inf), with no host read: the decision of :func:`first_max`, bit for bit."""
    c = conf.float() if conf.dtype == torch.bfloat16 else conf
    out = torch.zeros(c.shape, dtype=torch.bool, device=c.device)
    if c.shape[-1] == 0:
        return out
    out.scatter_(-1, c.argmax(-1, keepdim=True), True)
    return out & torch.isfinite(c).any(-1, keepdim=True)


def merge_stats(all_stats) -> dict:
    """Sum per-request method counters (ints, or per-node lists) into one dict."""
    out: dict = {}
    for st in all_stats:
        for k, v in st.items():
            old = out.get(k)
            out[k] = v if old is None else ([a + b for a, b in zip(old, v)] if isinstance(v, list) else old + v)
    return out
