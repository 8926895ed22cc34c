"""PRESTO's prefix scorer ρ: an n-gram model with Witten-Bell interpolation, extended online per request.

PRESTO (§4.1, §5.1) corrects the drafter's prefix-blind marginals ``q_d`` with a cheap prefix-conditioned
signal ``ρ_d(t | c_d)``; the paper uses an n-gram model (n = 3). This one:

- counts n-grams of orders 1..n from a corpus of token-id sequences (:meth:`NGramModel.fit`), and is saved
  and loaded as a versioned msgspec JSON file;
- smooths with Witten-Bell interpolation (a choice; the paper names no smoothing):
  ``P(t | c) = (N(c, t) + T(c) · P(t | c[1:])) / (N(c) + T(c))`` with ``N(c)`` the count of context ``c``
  and ``T(c)`` the number of distinct tokens seen after it, down to an add-one unigram, so every token has
  a probability > 0 and ``log ρ`` is finite;
- is extended online (:class:`RequestNGram`): a request's prompt and accepted tokens are counted in an
  overlay on top of the shared model, so the scorer learns the request's own phrases (which is what makes
  an n-gram useful for copying tasks) without touching other requests;
- looks up a whole vocabulary row at once (:meth:`RequestNGram.logprobs`, a ``[V]`` tensor per context,
  cached per context), which is what tree expansion needs.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec
import torch

from ..typed_files import read_typed

FORMAT_VERSION = 1


class NGramFile(msgspec.Struct, forbid_unknown_fields=True):
    """On-disk form: for every context (a tuple of up to ``n - 1`` ids) the tokens seen after it and their counts."""

    version: int
    n: int
    vocab_size: int
    contexts: list[list[int]]
    tokens: list[list[int]]
    counts: list[list[int]]


class _Counts:
    """Counts of n-grams of orders 1..n: ``table[context][token]`` with contexts of length 0..n-1."""

    def __init__(self, n: int):
        self.n = n
        self.table: dict[tuple[int, ...], dict[int, int]] = defaultdict(dict)

    def add(self, seq: list[int], start: int = 0) -> None:
        """Count every n-gram (all orders) that ends at a position ``>= start`` of ``seq``."""
        for i in range(start, len(seq)):
            t = seq[i]
            for k in range(self.n):
                if i - k < 0:
                    break
                row = self.table[tuple(seq[i - k: i])]
                row[t] = row.get(t, 0) + 1


class NGramModel:
    """The shared n-gram counts (module docstring)."""

    def __init__(self, n: int, vocab_size: int):
        if n < 1:
            raise ValueError(f"n must be >= 1 (got {n})")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 (got {vocab_size})")
        self.n, self.vocab_size = n, vocab_size
        self.counts = _Counts(n)
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, dict[int, int]]] = {}

    def row(self, ctx: tuple[int, ...]):
        """(tokens, counts as float64, the count dict) seen after ``ctx``, as tensors built once; None if unseen."""
        hit = self._rows.get(ctx)
        if hit is None:
            d = self.counts.table.get(ctx)
            if not d:
                return None
            hit = (torch.tensor(list(d), dtype=torch.long), torch.tensor(list(d.values()), dtype=torch.float64), d)
            self._rows[ctx] = hit
        return hit

    @classmethod
    def fit(cls, sequences, n: int = 3, vocab_size: int = 0) -> "NGramModel":
        seqs = [list(map(int, s)) for s in sequences]
        model = cls(n, vocab_size or 1 + max((max(s) for s in seqs if s), default=0))
        for s in seqs:
            model.counts.add(s)
        return model

    def save(self, path: str | Path) -> None:
        items = sorted(self.counts.table.items())
        f = NGramFile(FORMAT_VERSION, self.n, self.vocab_size, [list(c) for c, _ in items],
                      [list(r.keys()) for _, r in items], [list(r.values()) for _, r in items])
        Path(path).write_bytes(msgspec.json.encode(f))

    @classmethod
    def load(cls, path: str | Path) -> "NGramModel":
        p = Path(path)
        f = read_typed(p, NGramFile, "n-gram")
        if f.version != FORMAT_VERSION:
            raise ValueError(f"n-gram file {p}: version {f.version}; this build reads version {FORMAT_VERSION}")
        if not (len(f.contexts) == len(f.tokens) == len(f.counts)):
            raise ValueError(f"n-gram file {p}: contexts, tokens and counts differ in length")
        model = cls(f.n, f.vocab_size)
        for c, ts, cs in zip(f.contexts, f.tokens, f.counts):
            if len(c) >= f.n or len(ts) != len(cs) or any(t < 0 or t >= f.vocab_size for t in ts):
                raise ValueError(f"n-gram file {p}: bad entry for context {c}")
            model.counts.table[tuple(c)] = dict(zip(ts, cs))
        return model

    def request(self) -> "RequestNGram":
        return RequestNGram(self)


class RequestNGram:
    """ρ for one request: the shared counts plus an overlay of the request's own tokens."""

    def __init__(self, base: NGramModel):
        self.base = base
        self.n, self.vocab_size = base.n, base.vocab_size
        self.own = _Counts(base.n)
        self.seq: list[int] = []
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def extend(self, tokens) -> None:
        """Count ``tokens`` (the prompt, then each round's accepted tokens) as continuing the request."""
        start = len(self.seq)
        self.seq.extend(int(t) for t in tokens)
        self.own.add(self.seq, start)
        self._cache.clear()

    def context(self, draft: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The last ``n - 1`` tokens of the request's sequence followed by ``draft``."""
        k = self.n - 1
        if k == 0:
            return ()
        full = tuple(self.seq[-k:]) + tuple(draft)
        return full[-k:]

    def logprobs(self, context: tuple[int, ...]) -> torch.Tensor:
        """``log ρ(· | context)`` over the vocabulary, float64 ``[V]`` (Witten-Bell, module docstring)."""
        context = context[len(context) - (self.n - 1):] if self.n > 1 else ()
        hit = self._cache.get(context)
        if hit is not None:
            return hit
        V = self.vocab_size
        p = torch.full((V,), 1.0 / V, dtype=torch.float64)
        uni = self._row(())
        if uni is not None:  # add-one unigram
            toks, cnts, N, _ = uni
            p = torch.ones(V, dtype=torch.float64).index_add_(0, toks, cnts) / (N + V)
        for k in range(1, len(context) + 1):  # interpolate upwards through the orders
            row = self._row(context[len(context) - k:])
            if row is None:
                continue
            toks, cnts, N, T = row
            p = (p * T).index_add_(0, toks, cnts) / (N + T)
        out = p.log()
        self._cache[context] = out
        return out

    def _row(self, ctx: tuple[int, ...]):
        """(tokens, counts, N, T) after ``ctx``, shared plus own counts (tokens may repeat: index_add sums them);
        None if never seen."""
        base, own = self.base.row(ctx), self.own.table.get(ctx)
        if base is None and not own:
            return None
        if not own:
            toks, cnts, d = base
            return toks, cnts, float(cnts.sum()), len(d)
        ot = torch.tensor(list(own), dtype=torch.long)
        oc = torch.tensor(list(own.values()), dtype=torch.float64)
        if base is None:
            return ot, oc, float(oc.sum()), len(own)
        toks, cnts, d = base
        return (torch.cat([toks, ot]), torch.cat([cnts, oc]), float(cnts.sum() + oc.sum()),
                len(d) + sum(t not in d for t in own))
