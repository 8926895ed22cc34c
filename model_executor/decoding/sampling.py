"""Sampling for every decoding method: Gumbel-max with counter-based noise, drawn where the logits are.

LLaDA's ``generate.py`` samples a masked position by Gumbel-max: ``argmax(logits / T + g)`` with ``g`` Gumbel
noise drawn in float64 (its authors: low-precision Gumbel-max hurts quality). Here the noise is not drawn from a
stateful generator but computed: ``g`` of token ``v`` at absolute position ``i`` in the ``s``-th base-policy
step of a block of a request with seed ``seed`` is a fixed function of ``(seed, i, s, v)`` (:func:`uniforms`,
a SplitMix64 hash on int64 tensors). So

- a draft canvas built for step ``t + k`` and the base policy reaching that state at step ``t + k`` see the same
  draw: drafting methods verify sampled drafts exactly as greedy ones (FreeDave and Spiffy stay lossless against
  their sampled base policy, token for token; PSD and LoPA draft from the noised predictions);
- a draw does not depend on the batch, on which rows of a canvas get logits, on the device's thread count, or
  on the tensor-parallel rank (every rank computes the same noise from the same request seed);
- the draws of all the step's sampled rows are one batched pass (:func:`draw_rows`) beside the greedy top-1.

A decoder names the step index of each canvas it forwards (:attr:`~.base.Proposal.steps`); the engines give
each prediction row its request's seed, its predicted position and its canvas's step (:func:`row_draws`).

``top_k`` / ``top_p`` / ``min_p`` restrict the noised argmax to the kept set of ``logits / T`` (as vLLM's
sampler restricts its draw; :func:`filter_rows`). The commit confidence of a drawn token is a decision with
accuracy consequences (:data:`SAMPLE_CONFIDENCE`): ``drawn`` is the model's untempered probability of the drawn
token (LLaDA, Fast-dLLM); ``tempered`` is ``min(p_max, exp((z_drawn - z_max) / T))`` (SGLang's dLLM sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SAMPLE_CONFIDENCE = ("drawn", "tempered")


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``s`` bits (torch's ``>>`` is arithmetic on signed integers)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping arithmetic): a bijection whose outputs look uniform."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def row_keys(seed: torch.Tensor, position: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64: one key per (request seed, absolute position, step in the block)."""
    return _mix(_mix(_mix(seed) ^ position) ^ step)


_TOKEN_KEYS: dict[tuple[str, int], torch.Tensor] = {}  # (device, vocabulary end) -> token ids * golden ratio


def _token_keys(device: torch.device, token0: int, n_tokens: int) -> torch.Tensor:
    """``v * golden`` (wrapping int64) of tokens ``token0 ..``, kept per device: the per-token half of a draw's
    counter, the same every step."""
    end = token0 + n_tokens
    key = (str(device), end)
    if key not in _TOKEN_KEYS:
        if len(_TOKEN_KEYS) >= 16:
            _TOKEN_KEYS.pop(next(iter(_TOKEN_KEYS)))
        _TOKEN_KEYS[key] = torch.arange(end, device=device, dtype=torch.int64) * _GOLDEN
    return _TOKEN_KEYS[key][token0:]


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` in place on ``x``, with ``tmp`` (as ``x``) for the shifts: the same bits, without a fresh
    ``[n, V]`` int64 tensor per operation (a draw over a 126k vocabulary was mostly allocation and memory
    traffic)."""
    x.add_(_GOLDEN)
    for shift, mult in ((30, _M1), (27, _M2)):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (64 - shift)) - 1)
        x.bitwise_xor_(tmp).mul_(mult)
    torch.bitwise_right_shift(x, 31, out=tmp).bitwise_and_((1 << 33) - 1)
    return x.bitwise_xor_(tmp)


def uniforms(keys: torch.Tensor, token0: int, n_tokens: int) -> torch.Tensor:
    """``[n, n_tokens]`` float64 in (0, 1): the uniform of tokens ``token0 ..`` for each row key, 53 bits each."""
    x = torch.bitwise_xor(keys[:, None], _token_keys(keys.device, token0, n_tokens))
    tmp = torch.empty_like(x)
    _mix_(x, tmp)
    bits = torch.bitwise_right_shift(x, 11, out=tmp).bitwise_and_((1 << 53) - 1)
    return bits.to(torch.float64).add_(0.5).mul_(2.0 ** -53)


def gumbel(keys: torch.Tensor, token0: int, n_tokens: int) -> torch.Tensor:
    """Gumbel noise ``-log(-log u)`` of :func:`uniforms`, float64."""
    return uniforms(keys, token0, n_tokens).log_().neg_().log_().neg_()


@dataclass(frozen=True)
class Sampling:
    """One request's sampling options: ``temperature`` > 0, its seed (the engines derive one for an unseeded
    request), the filters (``top_k`` 0: all), and the commit-confidence rule (:data:`SAMPLE_CONFIDENCE`)."""

    temperature: float
    seed: int
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    confidence: str = "drawn"

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"Sampling.temperature must be > 0 (got {self.temperature}); 0 is greedy: no Sampling")
        if self.confidence not in SAMPLE_CONFIDENCE:
            raise ValueError(f"sample_confidence {self.confidence!r}; allowed: {', '.join(SAMPLE_CONFIDENCE)}")

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class RowDraws:
    """The sampled rows of one step's logits, with what their draws depend on (all ``[n]``, on the host until
    :func:`draw_rows` moves them): ``rows`` (logits rows), ``keys`` (:func:`row_keys`), temperatures, filters,
    and whether the row's confidence is ``tempered``."""

    rows: np.ndarray
    keys: torch.Tensor
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    tempered: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def row_draws(jobs: list[tuple[Sampling, int, list[int], list[int], int, np.ndarray]], at: np.ndarray | None
              ) -> RowDraws | None:
    """The :class:`RowDraws` of a step from its sampled requests' ``jobs``: ``(sampling, b0, canvas first rows,
    canvas steps, block length, kept [K * L] bool)`` (prediction rows: canvas ``k``'s block position ``j`` is row
    ``firsts[k] + j``, predicting absolute position ``b0 + j``); ``at`` maps prediction rows to logits rows (None:
    the same). Rows whose logits are not computed are not drawn. None when no job draws."""
    rows, seeds, pos, steps, knobs = [], [], [], [], []
    for s, b0, firsts, canvas_steps, L, kept in jobs:
        kept = np.asarray(kept, dtype=bool).reshape(len(firsts), L)
        for k, (a, st) in enumerate(zip(firsts, canvas_steps)):
            j = np.flatnonzero(kept[k])
            if not len(j):
                continue
            rows.append(a + j)
            pos.append(b0 + j)
            steps.append(np.full(len(j), st))
            # the seed's 64 bits as int64 (a seed past 2**63, vLLM's seed + 1 of an n > 1 child, would make numpy
            # join the step's seeds as float64 and round every other request's seed past 2**53)
            seeds.append(np.full(len(j), s.seed % 2 ** 64, dtype=np.uint64).view(np.int64))
            knobs.append(np.tile([s.temperature, s.top_k, s.top_p, s.min_p, s.confidence == "tempered"], (len(j), 1)))
    if not rows:
        return None
    r = np.concatenate(rows)
    if at is not None:
        r = at[r]
    kn = np.concatenate(knobs)
    keys = row_keys(torch.from_numpy(np.concatenate(seeds)),
                    torch.from_numpy(np.concatenate(pos).astype(np.int64)),
                    torch.from_numpy(np.concatenate(steps).astype(np.int64)))
    return RowDraws(r.astype(np.int64), keys, kn[:, 0], kn[:, 1].astype(np.int64), kn[:, 2], kn[:, 3], kn[:, 4] > 0)


def filter_rows(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Per row of (temperature-scaled) ``x [n, V]``, in vLLM's order (its sampler applies ``min_p`` as an
    argmax-invariant logits processor before its top-k/top-p sampler): keep the tokens with at least ``min_p``
    times the best one's probability, then the ``top_k`` best of those (0: all), then the smallest set of best
    tokens whose probability, renormalised over what is left, reaches ``top_p``; the others get -inf, in place.
    The best token always stays (ties by sort order). ``top_k``/``top_p``/``min_p``: ``[n]`` on ``x``'s device.
    Returns ``x``."""
    srt, idx = x.sort(-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)
    drop = (srt - srt[:, :1]).exp() < min_p[:, None]  # p / p_max
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    srt.masked_fill_(drop, float("-inf"))
    p = srt.softmax(-1)
    drop |= (top_p[:, None] < 1.0) & ((p.cumsum(-1) - p) >= top_p[:, None])
    drop[:, 0] = False
    return x.scatter_(-1, idx, srt.masked_fill_(drop, float("-inf")))


def draw_rows(logits: torch.Tensor, draws: RowDraws, tokens: torch.Tensor, conf: torch.Tensor,
              work_bytes: int) -> None:
    """The Gumbel-max draw of every row of ``draws``: ``tokens[row]`` and ``conf[row]`` (on the logits' device,
    as :func:`~.base.predict_rows` computes them) overwritten in place, in chunks of about ``work_bytes`` of
    float64 work. The logits are the ones the decoders read (the request's rules and grammar masks applied, the
    mask token excluded)."""
    dev, V = logits.device, logits.shape[1]
    n = len(draws)
    rows = torch.from_numpy(draws.rows).to(dev, non_blocking=True)
    keys = draws.keys.to(dev, non_blocking=True)
    knobs = torch.from_numpy(np.stack([draws.temperature, draws.top_p, draws.min_p, draws.tempered])
                             ).to(dev, torch.float64, non_blocking=True)
    top_k = torch.from_numpy(draws.top_k).to(dev, non_blocking=True)
    filtered = bool(((draws.top_k > 0) | (draws.top_p < 1.0) | (draws.min_p > 0.0)).any())  # host data
    chunk = max(1, work_bytes // max(1, V * 8 * 3))
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        z = logits[rows[a:b]].double()  # [c, V]
        temp = knobs[0, a:b, None]
        scaled = z / temp
        if filtered:
            filter_rows(scaled, top_k[a:b], knobs[1, a:b], knobs[2, a:b])
        tok = gumbel(keys[a:b], 0, V).add_(scaled).argmax(-1)
        z_max = z.max(-1).values
        z_tok = z.gather(1, tok[:, None])[:, 0]
        lse = torch.logsumexp(z, -1)
        drawn = (z_tok - lse).exp()  # the model's (untempered) probability of the drawn token
        tempered = torch.minimum((z_max - lse).exp(), ((z_tok - z_max) / temp[:, 0]).exp())
        tokens[rows[a:b]] = tok
        conf[rows[a:b]] = torch.where(knobs[3, a:b] > 0, tempered, drawn).to(conf.dtype)
