"""One PRESTO round, the pieces both engines share: draft (one batched drafter forward), tree, verification
layout, acceptance.

1. *Draft* (:meth:`TreeDrafter.draft`, one drafter forward for all requests): the drafter (SDAR format,
   block-causal attention of ``block`` tokens) forwards the accepted tokens of its unfinished block plus
   masks up to ``k`` positions past the context (``k`` = ``draft_len``, by default the drafter's block),
   against the exact K/V of its finished blocks on its own paged cache; blocks the accepted context has
   finished are written to that cache in the same forward. Its logits at the ``k`` masked positions are the
   marginals ``q_d``.
2. *Tree*: :func:`model_executor.decoding.tree.build_tree` with the request's n-gram scorer ρ (prompt and
   accepted tokens counted online) under the node budget.
3. *Verify* (:func:`verify_layout`): the target forwards the accepted tokens it has not cached yet (the
   last of them is the tree's root) and the tree's nodes at positions ``n - 1 + depth``, under the ancestor
   mask; the pending tokens' K/V becomes exact. Rejected nodes are never kept; accepted ones are re-forwarded
   as pending tokens next round.
4. *Accept* (:func:`accept`): greedy (outputs equal the target's greedy decoding) or, at
   ``temperature > 0``, lossless tree speculative sampling. The matched path plus the target's bonus token.

The reference engine (:mod:`model_executor.presto_engine`) and the vLLM runner
(:mod:`psd_plugin.vllm.presto_runner`) call these; they differ only in how the rows reach the target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attention_backends.paged_kv_cache import PagedKVCache
from attention_backends.prefix_attention import AttentionPlan

from .decoding.base import work_bytes
from .decoding.ngram import NGramModel, RequestNGram
from .decoding.tree import (SEARCHES, TokenTree, accept_greedy, adaptive_lambda, build_tree, sampling_bonus,
                            sampling_draws, sampling_walk)
from .models.reference import ReferenceDLLM

PRESTO_SEARCHES = ("ar",) + SEARCHES


@dataclass
class DraftState:
    """What drafting keeps per request (both engines): its tokens, its drafter cache, its ρ and last tree."""

    seq: list[int]
    slot: int  # its sequence in the drafter's paged cache
    rho: RequestNGram | None
    d_cached: int = 0  # drafter: exact K/V of its finished blocks [0, d_cached)
    drafter_calls: int = 0
    tree: TokenTree = field(default_factory=TokenTree)


class TreeDrafter:
    """Steps 1-2 of a round (module docstring): one batched drafter forward, then a tree per request."""

    def __init__(self, drafter: ReferenceDLLM, ngram: NGramModel | None, attn, page_size: int = 16,
                 timing: dict | None = None, max_rows: int | None = None):
        """``timing``: the dict its seconds accumulate in (``draft_forward_s``, ``tree_s``); the engine's.
        ``max_rows``: the most rows one drafter forward takes (its memory budget: :meth:`profile`); a step
        whose requests need more drafts them in several forwards, requests in order (None: one forward)."""
        if drafter.spec.family != "sdar":
            raise ValueError(f"the PRESTO drafter must be a block-diffusion (SDAR-format) model, got {drafter.spec.family}")
        self.drafter, self.ngram, self.attn, self.page_size = drafter, ngram, attn, page_size
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_rows = max_rows
        self.kv: PagedKVCache | None = None
        self.timing = timing if timing is not None else {}
        self.timing.setdefault("draft_forward_s", 0.0)
        self.timing.setdefault("tree_s", 0.0)

    def allocate(self, seq_lens: list[int]) -> None:
        """A paged cache with one sequence (``DraftState.slot``) per entry of ``seq_lens``."""
        s = self.drafter.spec
        self.kv = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, seq_lens, self.page_size, self.dtype,
                               self.device)

    def new_rho(self, prompt: list[int]) -> RequestNGram | None:
        """The request's ρ: the shared n-gram counts plus its prompt (None without an n-gram model)."""
        if self.ngram is None:
            return None
        rho = self.ngram.request()
        rho.extend(prompt)
        return rho

    def rows(self, r: DraftState, k: int) -> int:
        """Rows of ``r`` in a drafting forward: its unfinished block's accepted tokens, then masks up to ``k``
        positions past its context, to the end of their block."""
        blk = self.drafter.spec.attention_block
        return -(-(len(r.seq) + k) // blk) * blk - r.d_cached

    def draft(self, reqs: list[DraftState], o: dict) -> None:
        """Marginals of the next ``o["k"]`` positions of every request (one forward, or one per
        :attr:`max_rows` rows), then its tree."""
        k, blk = o["k"], self.drafter.spec.attention_block
        t0 = time.perf_counter()
        logq: list[torch.Tensor] = []
        for group in self._groups(reqs, k):
            logq += self._marginals(group, k).split(k)
        self.timing["draft_forward_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for r, lq in zip(reqs, logq):
            r.d_cached = max(r.d_cached, len(r.seq) // blk * blk)
            r.drafter_calls += 1
            lam = adaptive_lambda(lq, *o["adaptive"]) if o["adaptive"] else o["lam"]
            rho = None
            if r.rho is not None:
                rho = (lambda path, r=r: r.rho.logprobs(r.rho.context(path)))
            r.tree = build_tree(lq, rho, budget=o["budget"], search=o["search"], lam=lam, width=o["width"],
                                top_b=o["top_b"], candidates=o["candidates"])
        self.timing["tree_s"] += time.perf_counter() - t0

    def profile(self, num_seqs: int, k: int) -> None:
        """The largest drafting forward a step can take, for an engine's memory profile (vLLM sizes its KV
        cache from the peak it measures): :attr:`max_rows` rows over up to ``num_seqs`` requests, ``k`` logits
        rows each, on dummy tokens, writing no K/V."""
        blk = self.drafter.spec.attention_block
        least = -(-(1 + k) // blk) * blk  # a request's fewest rows
        budget = self.max_rows or num_seqs * least
        n = max(1, min(num_seqs, budget // least))
        longest = (self.drafter.spec.max_position - k) // blk * blk  # positions the drafter has
        per = max(least, min(budget // n // blk * blk, longest))
        self._marginals([DraftState([0] * max(1, per - k), slot, None) for slot in range(n)], k, write=False)

    def _groups(self, reqs: list[DraftState], k: int) -> list[list[DraftState]]:
        """``reqs`` in order, cut into forwards of at most :attr:`max_rows` rows (a request alone may take more:
        the engine's budget covers its longest context)."""
        if self.max_rows is None:
            return [reqs] if reqs else []
        out: list[list[DraftState]] = []
        used = self.max_rows
        for r in reqs:
            n = self.rows(r, k)
            if used + n > self.max_rows:
                out.append([])
                used = 0
            out[-1].append(r)
            used += n
        return out

    def _marginals(self, reqs: list[DraftState], k: int, write: bool = True) -> torch.Tensor:
        """One drafter forward of ``reqs``: the log-probabilities ``[len(reqs) * k, V]`` (float64, on the host)
        of each one's next ``k`` positions; with ``write``, the blocks its accepted tokens finished are
        written to the drafter's cache. The log-softmax runs on the drafter's device in chunks of
        :func:`~model_executor.decoding.base.work_bytes`, each copied into one host tensor."""
        spec, blk = self.drafter.spec, self.drafter.spec.attention_block
        ids, pos, rows, qo, prefix, w_slots, w_rows = [], [], [], [0], [], [], []
        for r in reqs:
            n = len(r.seq)
            a0, end = r.d_cached, -(-(n + k) // blk) * blk
            ids += r.seq[a0:n] + [spec.mask_token_id] * (end - n)
            pos.append(torch.arange(a0, end))
            rows.append(torch.arange(n - a0, n - a0 + k) + qo[-1])
            done_to = n // blk * blk  # blocks the accepted tokens have finished: their K/V becomes exact
            if write and done_to > a0:
                w_slots.append(self.kv.slots(torch.full((done_to - a0,), r.slot), torch.arange(a0, done_to)))
                w_rows.append(torch.arange(done_to - a0) + qo[-1])
            qo.append(qo[-1] + end - a0)
            prefix.append(a0)
        positions = torch.cat(pos)
        plan = AttentionPlan(torch.tensor(qo), torch.tensor(prefix), self.kv.block_table[[r.slot for r in reqs]],
                             self.page_size, kind="block_causal", positions=positions, block_size=blk)
        w = (torch.cat(w_slots).to(self.device), torch.cat(w_rows).to(self.device)) if w_slots else None
        logits = self.drafter.forward_paged(torch.tensor(ids, device=self.device), positions.to(self.device), plan,
                                            self.kv, self.attn, write=w, logits_rows=torch.cat(rows).to(self.device))
        M, V = logits.shape
        out = torch.empty(M, V, dtype=torch.float64)
        chunk = max(1, work_bytes(logits.device) // (V * 8))
        for a in range(0, M, chunk):
            out[a: a + chunk] = torch.log_softmax(logits[a: a + chunk].double(), -1).cpu()
        return out

    def accepted(self, r: DraftState, tokens: list[int]) -> None:
        """Append a round's emitted tokens to the request's context (and its ρ)."""
        r.seq += tokens
        if r.rho is not None:
            r.rho.extend(tokens)


def check_pair(target: ReferenceDLLM, drafter: ReferenceDLLM | None) -> None:
    """A Llama-format target and (if any) an SDAR-format drafter on the same vocabulary, or a clear error."""
    if target.spec.family != "llama":
        raise ValueError(f"the PRESTO target must be an autoregressive (Llama-format) model, got {target.spec.family}")
    if drafter is not None:
        if drafter.spec.family != "sdar":
            raise ValueError(f"the PRESTO drafter must be a block-diffusion (SDAR-format) model, got {drafter.spec.family}")
        if drafter.spec.vocab_size != target.spec.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.spec.vocab_size} != target vocabulary "
                             f"{target.spec.vocab_size}: the drafter must use the target's tokenizer")


def draft_options(drafter: ReferenceDLLM | None, *, search: str, tree_budget: int, width: int, top_b: int, lam: float,
                  adaptive, draft_len: int | None, candidates: int, temperature: float = 0.0) -> dict:
    """The options :meth:`TreeDrafter.draft` and verification read, validated."""
    if search not in PRESTO_SEARCHES:
        raise ValueError(f"search {search!r}; allowed: {', '.join(PRESTO_SEARCHES)}")
    if search != "ar" and drafter is None:
        raise ValueError(f"search {search!r} needs a drafter model")
    if tree_budget < 1:
        raise ValueError(f"tree_budget must be >= 1 (got {tree_budget})")
    k = draft_len or (drafter.spec.attention_block if drafter is not None else 1)
    return dict(search=search, budget=tree_budget, width=width, top_b=top_b, lam=lam, adaptive=adaptive, k=k,
                candidates=candidates, temperature=temperature)


def verify_layout(tree: TokenTree, pending: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[pending + N]`` and mask ``[pending + N, pending + N]`` of a verification forward: the
    ``pending`` accepted tokens ``[n - pending, n)`` (causal; the last is the root), then the tree's nodes at
    ``n - 1 + depth`` (each sees the pending tokens, its ancestors and itself)."""
    pos = torch.cat([torch.arange(n - pending, n), torch.tensor(tree.depth, dtype=torch.long) + n - 1])
    return pos, tree.verify_mask(pending)


def accept(tree: TokenTree, logits: torch.Tensor, temperature: float = 0.0,
           generator: torch.Generator | None = None, argmax: torch.Tensor | None = None) -> list[int]:
    """The target's verdict on ``tree`` from its logits at the root and every node (``[1 + N, V]``, the root
    first): the accepted path plus the bonus token. ``argmax``: the rows' argmax on the host, when the engine
    took every request's at once (one copy per step); sampling draws on the generator's device."""
    return accept_all([tree], [logits], [temperature], [generator],
                      None if argmax is None else [argmax[: len(tree) + 1]])[0]


def accept_all(trees: list[TokenTree], logits: list[torch.Tensor], temperatures: list[float],
               generators: list[torch.Generator | None], argmax: list[torch.Tensor] | None = None
               ) -> list[list[int]]:
    """:func:`accept` of every request of a step. Greedy requests read their rows' argmax (``argmax``: on the
    host already, else one copy for all); sampled ones draw where their generator is, the walks' draws reaching
    the host in one copy for all of them and their bonus tokens in one more
    (:func:`~model_executor.decoding.tree.accept_sampling`, batched)."""
    outs: list[list[int] | None] = [None] * len(trees)
    greedy = [i for i, t in enumerate(temperatures) if not t > 0]
    if greedy:
        tops = argmax if argmax is not None else \
            torch.cat([logits[i][: len(trees[i]) + 1].argmax(-1) for i in greedy]).cpu().split(
                [len(trees[i]) + 1 for i in greedy])
        for k, i in enumerate(greedy):
            top = tops[i] if argmax is not None else tops[k]
            outs[i], _ = accept_greedy(trees[i], top[: len(trees[i]) + 1])
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if sampled:
        # the draws are made where the generators are (vLLM's: the device; the reference engine's: the host),
        # the probabilities moved there in one copy when they are elsewhere
        dev = next((g.device for i in sampled if (g := generators[i]) is not None), logits[sampled[0]].device)
        probs = [torch.softmax(logits[i][: len(trees[i]) + 1].double() / temperatures[i], -1) for i in sampled]
        probs = torch.cat(probs).to(dev).split([p.shape[0] for p in probs])
        draws = [sampling_draws(trees[i], p, generators[i]) for i, p in zip(sampled, probs)]
        host = torch.cat(draws).cpu().split([d.numel() for d in draws])
        walks = [sampling_walk(trees[i], h) for i, h in zip(sampled, host)]
        bonus = torch.cat([sampling_bonus(p, w[2], w[3], generators[i])
                           for i, p, w in zip(sampled, probs, walks)]).cpu().tolist()
        for i, w, b in zip(sampled, walks, bonus):
            outs[i] = w[0] + [b]
    return outs
