"""Structured outputs for dLLMs: the grammar frontier rule, one request's grammar state, and grammar building.

A grammar constrains text left to right; a dLLM commits positions in any order. The rule that keeps every
output valid (issue 30), applied to every method through the predictions it reads:

- The **frontier** is the first undecided position of the current block after the committed text. Its logits
  are masked to the tokens the grammar allows after the committed text (:func:`mask_frontiers`, before the
  predictions are made, so a greedy or sampled prediction there is always allowed).
- A step may commit the frontier and the positions that follow it **in order**, each checked against the
  grammar state advanced by the ones before it (:meth:`GrammarFrontier.constrain`, on each canvas's
  predictions): the confidence of a position is capped by those of the positions before it (a running
  minimum from the frontier); a rejected prediction at a position where the grammar allows one token only is
  that token (what masking its logits would give, with probability 1: JSON keys, brackets, EOS after a closed
  value); the first position whose predicted token the grammar rejects otherwise, and every one after it, get
  confidence ``-inf`` (a decided position: no policy commits it). So every policy commits
  a run from the frontier: the static policy's top-1 *is* the frontier (ties go to the lower position), a
  threshold commits the frontier and the confident positions right after it, LocalLeap's anchors and window
  are a run too.
- A canvas whose decided positions are not a grammar-valid run from the committed text (a draft with a gap,
  or a draft token the grammar rejects) is invalid: all its confidences are ``-inf``. No method accepts it
  (it can never equal a state of the base policy under the rule).
- After the grammar accepted EOS (its stop token) the positions after it are not constrained: the answer
  ends at that EOS.

Each canvas's predictions are a function of the canvas alone (the committed text is the same for all canvases
of a request), which is what keeps FreeDave and Spiffy lossless with respect to their base policy under the
same rule, and PSD's and LoPA's acceptance sound: drafts are assembled from constrained predictions (a
position past the grammar's first rejection has confidence ``-inf`` and is never drafted by rank), and a draft
the rule could not reach is never accepted. Decoders that edit committed tokens (``joint_threshold``) are
refused with a grammar.

The grammar state is an ``xgrammar.GrammarMatcher`` (vLLM's structured-output backend) on the host, positioned
after the request's committed answer tokens; a step's checks advance it and roll it back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _xgr():
    import xgrammar

    return xgrammar


def build_grammar(kind: str, value, any_whitespace: bool = True):
    """The ``xgrammar.Grammar`` of one constraint: ``json`` (a JSON schema, dict or string), ``json_object``
    (any JSON object), ``regex``, ``choice`` (a list of strings) or ``grammar`` (EBNF, or Lark). Without
    ``any_whitespace`` JSON is compact (``,`` and ``:`` with no spaces, as vLLM's ``disable_any_whitespace``).
    A bad constraint raises ``ValueError`` naming it."""
    xgr = _xgr()
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"structured output kind {kind!r}; allowed: {', '.join(GRAMMAR_KINDS)}")
    try:
        if kind in ("json", "json_object"):
            schema = value if kind == "json" else {"type": "object"}
            schema = schema if isinstance(schema, str) else json.dumps(schema)
            return _json_strings_escaped(xgr.Grammar.from_json_schema(
                schema, any_whitespace=any_whitespace, separators=None if any_whitespace else (",", ":")))
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("a non-empty list of strings is needed")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in value))
        text = str(value)
        if "::=" in text:
            return xgr.Grammar.from_ebnf(text)
        return xgr.Grammar.from_lark(text)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
        raise ValueError(f"structured output {kind}: {e}") from None


# xgrammar (0.2.8) writes the characters of a length-bounded JSON string (``minLength`` / ``maxLength``) as
# ``[^"\\\r\n]``: raw control characters pass, which RFC 8259 forbids in a string (Python's ``json.loads`` rejects
# them); its unbounded strings exclude them. Sampled answers of a small model draw such bytes.
_BOUNDED_STRING_CHARS = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)


def _json_strings_escaped(grammar):
    """``grammar`` (from a JSON schema) with every length-bounded string's characters outside U+0000-U+001F, as
    xgrammar's unbounded strings already are (above); the grammar itself when it has none."""
    text = str(grammar)
    fixed = _BOUNDED_STRING_CHARS.sub(lambda m: m.group(1) + r' ::= (([^\0-\x1f\"\\]))', text)
    return grammar if fixed == text else _xgr().Grammar.from_ebnf(fixed)


_COMPILERS: dict[int, tuple] = {}  # id(tokenizer info) -> (info, its compiler)


def compiler_for(info, cache_limit_bytes: int = -1, max_threads: int = 8):
    """One ``xgrammar.GrammarCompiler`` per tokenizer info (compiled grammars are cached by the compiler, up to
    ``cache_limit_bytes``: -1 unbounded), compiling one grammar on up to ``max_threads`` threads (the first call
    for an info sets both). Thread-safe; a compile releases the GIL."""
    hit = _COMPILERS.get(id(info))
    if hit is None or hit[0] is not info:
        hit = _COMPILERS[id(info)] = (info, _xgr().GrammarCompiler(info, cache_enabled=True, max_threads=max_threads,
                                                                   cache_limit_bytes=cache_limit_bytes))
    return hit[1]


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's view of a Hugging Face tokenizer, over the model's ``vocab_size`` logits (padded ids are never
    allowed)."""
    return _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)


def deserialize_grammar(text: str):
    """A built grammar from its ``serialize_json`` text (what the vLLM front end ships to the workers)."""
    return _xgr().Grammar.deserialize_json(text)


def compile_grammar(grammar, info):
    """A built grammar (:func:`build_grammar`, or its ``serialize_json`` text) compiled for ``info``."""
    if isinstance(grammar, str):
        grammar = deserialize_grammar(grammar)
    return compiler_for(info).compile_grammar(grammar)


def bitmask_allows(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, V]`` bool from xgrammar's packed ``[n, ceil(V / 32)]`` int32 bitmask (bit ``t % 32`` of word
    ``t // 32``: token ``t`` allowed), on the bitmask's device; ids past the bitmask are not allowed."""
    out = torch.zeros(bitmask.shape[0], vocab_size, dtype=torch.bool, device=bitmask.device)
    ids = torch.arange(min(vocab_size, bitmask.shape[1] * 32), device=bitmask.device)
    out[:, : ids.numel()] = ((bitmask[:, ids >> 5] >> (ids & 31)) & 1).bool()
    return out


@dataclass
class _Walk:
    """A canvas read from the request's frontier: how many of its decided positions were accepted, where its
    first undecided position is (-1: none), whether it is valid and whether the grammar terminated."""

    accepted: int
    first_mask: int
    valid: bool
    terminated: bool


class GrammarFrontier:
    """One request's grammar state (module docstring): a matcher after the committed answer tokens, and how many
    positions of the current block are among them (:attr:`front`, the block's frontier)."""

    def __init__(self, compiled, vocab_size: int, eos_id: int, mask_id: int):
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=[eos_id], max_rollback_tokens=-1)
        self.vocab_size, self.mask_id = vocab_size, mask_id
        self.front = 0  # block positions the matcher has accepted (or passed after termination)
        self.rejected = 0  # predicted tokens the grammar rejected where it allows several (a statistic)
        self.forced = 0  # predicted tokens replaced by the one token the grammar allows there
        self._scratch = None  # one bitmask row, for forced tokens

    def new_block(self) -> None:
        self.front = 0

    def stats(self) -> dict:
        """Counters over every canvas the rule read (the request's ``stats``)."""
        return {"grammar_forced": self.forced, "grammar_rejected": self.rejected}

    def _walk(self, canvas: list[int]) -> _Walk:
        """Accept ``canvas``'s decided positions from :attr:`front` up to its first undecided one (the caller
        rolls back ``accepted``)."""
        m, n, j = self.matcher, 0, self.front
        while j < len(canvas) and canvas[j] != self.mask_id:
            if not m.is_terminated():
                if not m.accept_token(canvas[j]):
                    return _Walk(n, -1, False, False)
                n += 1
            j += 1
        return _Walk(n, j if j < len(canvas) else -1, True, m.is_terminated())

    def fill_bitmask(self, canvas: list[int], bitmask: torch.Tensor, row: int) -> int:
        """Write row ``row`` of ``bitmask`` with the tokens allowed at ``canvas``'s first undecided position (its
        frontier); returns that position, or -1 when it needs no mask (none left, the grammar terminated before
        it, or the canvas is invalid: its predictions are discarded by :meth:`constrain`)."""
        w = self._walk(canvas)
        pos = -1
        if w.valid and w.first_mask >= 0 and not w.terminated:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            pos = w.first_mask
        if w.accepted:
            self.matcher.rollback(w.accepted)
        return pos

    def constrain(self, canvas: torch.Tensor, tokens: torch.Tensor, conf: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``canvas``'s predictions (``tokens``, ``conf [L]`` on the host, -inf at decided positions) under the
        rule (module docstring): the confidences, and the tokens where a predicted token is rejected at a position
        the grammar leaves one token for (that token, as masking the position's logits would give it, with
        probability 1: the running minimum goes on)."""
        c = canvas.tolist()
        w = self._walk(c)
        out = conf.clone()
        if not w.valid:
            out.fill_(float("-inf"))
        elif w.first_mask >= 0:
            m, n, cap, stop, changed = self.matcher, 0, float("inf"), None, False
            toks, confs = tokens.tolist(), conf.tolist()
            terminated = w.terminated
            for j in range(w.first_mask, len(c)):
                if c[j] != self.mask_id:  # decided after an undecided position: a gap
                    if not terminated:
                        stop, out[:] = None, float("-inf")
                        break
                    continue
                if not terminated:
                    if not m.accept_token(toks[j]):
                        forced = self._forced()
                        if forced is None or not m.accept_token(forced):
                            if j == w.first_mask:  # its logits were masked: every allowed token had -inf
                                raise RuntimeError(
                                    f"grammar frontier: the prediction {toks[j]} at the frontier (block position {j}) "
                                    "is not allowed by the grammar: no allowed token had a finite logit (logits "
                                    "rules that ban what the grammar needs, or non-finite logits)")
                            stop = j
                            self.rejected += 1
                            break
                        toks[j], changed = forced, True  # the only token the grammar allows here
                        self.forced += 1
                    n += 1
                    terminated = m.is_terminated()
                cap = min(cap, confs[j])
                out[j] = cap
            if stop is not None:
                rest = torch.tensor([x == self.mask_id for x in c[stop:]], dtype=torch.bool)
                out[stop:] = out[stop:].masked_fill(rest, float("-inf"))
            if n:
                m.rollback(n)
            if changed:
                tokens = torch.tensor(toks, dtype=tokens.dtype)
        if w.accepted:
            self.matcher.rollback(w.accepted)
        return tokens, out

    def _forced(self) -> int | None:
        """The one token the grammar allows after the matcher's current text, or None (several, or none)."""
        if self._scratch is None:
            self._scratch = _xgr().allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(self._scratch, 0)
        words = self._scratch[0].numpy().view("uint32")
        nz = words.nonzero()[0]
        if len(nz) != 1:
            return None
        w = int(words[nz[0]])
        if w & (w - 1):
            return None
        return int(nz[0]) * 32 + w.bit_length() - 1

    def advance(self, state: torch.Tensor) -> None:
        """The step committed ``state`` (the block): accept its new run from :attr:`front`. A committed token
        the grammar rejects, or a decided position after an undecided one, is a broken invariant: it raises."""
        s = state.tolist()
        j = self.front
        while j < len(s) and s[j] != self.mask_id:
            if not self.matcher.is_terminated() and not self.matcher.accept_token(s[j]):
                raise RuntimeError(f"grammar frontier: committed token {s[j]} at block position {j} is rejected "
                                   "by the grammar (a decoder committed past the frontier rule)")
            j += 1
        if not self.matcher.is_terminated() and any(t != self.mask_id for t in s[j:]):
            raise RuntimeError(f"grammar frontier: block position {j} is undecided but later positions are "
                               "committed (a decoder committed out of order under a grammar)")
        self.front = j


def _contained(failed: dict[int, Exception] | None, n: int, fn, *args):
    """``fn(*args)``; where it raises and ``failed`` is given, the exception is recorded as job ``n``'s (the
    engines then fail that request alone) and None returned."""
    try:
        return fn(*args)
    except Exception as e:
        if failed is None:
            raise
        failed[n] = e
        return None


def mask_frontiers(logits: torch.Tensor, jobs: list[tuple["GrammarFrontier", torch.Tensor, list[int]]],
                   at: torch.Tensor | None, failed: dict[int, Exception] | None = None) -> None:
    """Mask, in place, the logits of every canvas's frontier row to the tokens its grammar allows (module
    docstring). ``jobs``: per request with a grammar, ``(grammar, canvases [K, L] (host), the first prediction
    row of each canvas)`` (canvas ``k``'s position ``l`` is prediction row ``firsts[k] + l``); ``at`` maps prediction rows to
    logits rows (:func:`~model_executor.decoding.logits_map`; None: the same row). The bitmasks are built on
    the host and reach the logits' device in one copy. ``failed``: a job whose grammar raises is recorded there
    under its index (its rows are left unmasked) instead of raising."""
    if not jobs:
        return
    xgr = _xgr()
    V = logits.shape[-1]
    n = sum(c.shape[0] for _, c, _ in jobs)
    bitmask = xgr.allocate_token_bitmask(n, jobs[0][0].vocab_size)
    rows, used = [], []
    r = 0
    for j, (g, canvases, firsts) in enumerate(jobs):
        marks = _contained(failed, j, _job_bitmask, g, canvases, firsts, bitmask, r)
        for row, pos in marks or ():
            rows.append(pos)
            used.append(row)
        r += canvases.shape[0]
    if not rows:
        return
    pred_rows = torch.tensor(rows)
    lrows = pred_rows if at is None else at[pred_rows]
    if bool((lrows < 0).any()):
        raise RuntimeError("grammar frontier: a frontier row has no logits (it must be kept: it is undecided)")
    allowed = bitmask_allows(bitmask[torch.tensor(used)].to(logits.device, non_blocking=True), V)
    lr = lrows.to(logits.device, non_blocking=True)
    logits[lr] = logits[lr].masked_fill(~allowed, float("-inf"))


def _job_bitmask(g: "GrammarFrontier", canvases: torch.Tensor, firsts: list[int], bitmask: torch.Tensor,
                 r: int) -> list[tuple[int, int]]:
    """One job's bitmask rows from row ``r`` on: ``(bitmask row, prediction row)`` of each canvas that has a
    frontier."""
    out = []
    for k in range(canvases.shape[0]):
        pos = g.fill_bitmask(canvases[k].tolist(), bitmask, r + k)
        if pos >= 0:
            out.append((r + k, firsts[k] + pos))
    return out


def constrain_rows(tokens: torch.Tensor, conf: torch.Tensor,
                   jobs: list[tuple["GrammarFrontier", torch.Tensor, list[int]]],
                   failed: dict[int, Exception] | None = None) -> None:
    """Apply :meth:`GrammarFrontier.constrain` to every canvas of ``jobs`` (as :func:`mask_frontiers`) in the
    step's host predictions ``tokens``, ``conf [N]`` (in place; -inf confidence where no logits were
    computed). ``failed``: as :func:`mask_frontiers` (jobs recorded there already are skipped)."""
    for j, (g, canvases, firsts) in enumerate(jobs):
        if failed is None or j not in failed:
            _contained(failed, j, _constrain_job, g, canvases, firsts, tokens, conf)


def _constrain_job(g: "GrammarFrontier", canvases: torch.Tensor, firsts: list[int], tokens: torch.Tensor,
                   conf: torch.Tensor) -> None:
    L = canvases.shape[1]
    for k, a in enumerate(firsts):
        tokens[a: a + L], conf[a: a + L] = g.constrain(canvases[k], tokens[a: a + L], conf[a: a + L])
