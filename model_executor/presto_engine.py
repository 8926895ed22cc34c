"""PRESTO tree drafting in plain PyTorch: a block-diffusion drafter speculates for an autoregressive target.

Each round, batched over the active requests (one drafter call and one target call per round):

1. *Draft* (one drafter forward): the drafter (SDAR format, block-causal attention of ``block`` tokens)
   forwards the accepted tokens of its unfinished block plus masks up to ``k`` positions past the context
   (``k`` = ``draft_len``, by default the drafter's block), against the exact K/V of its finished blocks
   on its own paged cache; blocks the accepted context has finished are written to that cache in the same
   forward. Its logits at the ``k`` masked positions are the marginals ``q_d``.
2. *Tree*: :func:`model_executor.decoding.tree.build_tree` with the request's n-gram scorer ρ (prompt and
   accepted tokens counted online) under the node budget.
3. *Verify* (one target forward): the target (Llama format, causal) forwards the accepted tokens it has
   not cached yet (the last of them is the tree's root) and the tree's nodes, as one segment with a custom
   mask (pending tokens causal; a node sees the pending tokens, its ancestors and itself) over its paged
   prefix, through :mod:`attention_backends`; the pending tokens' K/V is written to the cache in that
   forward. Rejected nodes are never written; accepted ones are re-forwarded as pending tokens next round
   (a choice: it costs ``τ`` extra rows per round instead of a K/V copy out of the tree).
4. *Accept*: greedy (:func:`~model_executor.decoding.tree.accept_greedy`, outputs equal the target's
   greedy decoding) or, at ``temperature > 0``, lossless tree speculative sampling
   (:func:`~model_executor.decoding.tree.accept_sampling`). The matched path plus the target's bonus token
   are emitted, up to EOS and ``max_tokens``.

``search="ar"`` drafts nothing: every round is one target forward that emits one token (the AR baseline on
the same code path). ``nfe`` counts target forwards (the prompt's prefill is the first round's forward);
``accept_len = len(token_ids) / nfe`` is PRESTO's τ (tokens per target forward, bonus token included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attention_backends.prefix_attention import AttentionPlan, make_backend

from .decoding.ngram import NGramModel, RequestNGram
from .decoding.tree import SEARCHES, TokenTree, accept_greedy, accept_sampling, adaptive_lambda, build_tree
from .engine import GenerationResult
from .kv_cache import PagedKVCache
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


@dataclass
class _Req(DraftState):
    idx: int = 0
    prompt_len: int = 0
    gen: torch.Generator | None = None
    t_cached: int = 0  # target: exact K/V of positions [0, t_cached)
    nfe: int = 0
    nodes: int = 0
    done: bool = False
    reason: str = "length"


class TreeDrafter:
    """Steps 1-2 of a round (module docstring): one batched drafter forward, then a tree per request."""

    def __init__(self, drafter: ReferenceDLLM, ngram: NGramModel | None, attn, page_size: int = 16,
                 timing: dict | None = None):
        """``timing``: the dict its seconds accumulate in (``draft_forward_s``, ``tree_s``); the engine's."""
        if drafter.spec.family != "sdar":
            raise ValueError(f"the PRESTO drafter must be a block-diffusion (SDAR-format) model, got {drafter.spec.family}")
        self.drafter, self.ngram, self.attn, self.page_size = drafter, ngram, attn, page_size
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype
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

    def draft(self, reqs: list[DraftState], o: dict) -> None:
        """Marginals of the next ``o["k"]`` positions of every request (one forward), then its tree."""
        spec, k, blk = self.drafter.spec, o["k"], self.drafter.spec.block_size
        ids, pos, rows, qo, prefix, w_slots, w_rows = [], [], [], [0], [], [], []
        for r in reqs:
            n = len(r.seq)
            a0, end = r.d_cached, -(-(n + k) // blk) * blk
            ids += r.seq[a0:n] + [spec.mask_token_id] * (end - n)
            pos.append(torch.arange(a0, end))
            rows.append(torch.arange(n - a0, n - a0 + k) + qo[-1])
            done_to = n // blk * blk  # blocks the accepted tokens have finished: their K/V becomes exact
            if done_to > a0:
                w_slots.append(self.kv.slots(torch.full((done_to - a0,), r.slot), torch.arange(a0, done_to)))
                w_rows.append(torch.arange(done_to - a0) + qo[-1])
            qo.append(qo[-1] + end - a0)
            prefix.append(a0)
        positions = torch.cat(pos)
        plan = AttentionPlan(torch.tensor(qo), torch.tensor(prefix), self.kv.block_table[[r.slot for r in reqs]],
                             self.page_size, kind="block_causal", positions=positions, block_size=blk)
        write = (torch.cat(w_slots).to(self.device), torch.cat(w_rows).to(self.device)) if w_slots else None
        t0 = time.perf_counter()
        logits = self.drafter.forward_paged(torch.tensor(ids, device=self.device), positions.to(self.device), plan,
                                            self.kv, self.attn, write=write, logits_rows=torch.cat(rows).to(self.device))
        logq = torch.log_softmax(logits.double(), -1).cpu().split(k)
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
    k = draft_len or (drafter.spec.block_size if drafter is not None else 1)
    return dict(search=search, budget=tree_budget, width=width, top_b=top_b, lam=lam, adaptive=adaptive, k=k,
                candidates=candidates, temperature=temperature)


class PrestoEngine:
    """Tree speculative decoding of an AR ``target`` with a block-diffusion ``drafter`` (module docstring)."""

    def __init__(self, target: ReferenceDLLM, drafter: ReferenceDLLM | None, ngram: NGramModel | None = None,
                 attention_backend: str = "auto", page_size: int = 16):
        check_pair(target, drafter)
        self.target, self.drafter, self.ngram = target, drafter, ngram
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.attn = make_backend(attention_backend, p.device, p.dtype)
        self.page_size = page_size
        self.timing = {"draft_forward_s": 0.0, "tree_s": 0.0, "verify_forward_s": 0.0}
        self.drafting = TreeDrafter(drafter, ngram, self.attn, page_size, self.timing) if drafter is not None else None

    @classmethod
    def from_pretrained(cls, target, drafter=None, ngram=None, dtype=torch.float32, device="cpu", **kw) -> "PrestoEngine":
        t = ReferenceDLLM.from_pretrained(target, dtype=dtype, device=device)
        d = ReferenceDLLM.from_pretrained(drafter, dtype=dtype, device=device) if drafter else None
        return cls(t, d, NGramModel.load(ngram) if ngram else None, **kw)

    # --------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_tokens: int = 32, search: str = "beam",
                 tree_budget: int = 128, width: int = 10, top_b: int = 10, lam: float = 0.2,
                 adaptive: tuple[float, float] | None = None, draft_len: int | None = None, candidates: int = 64,
                 temperature: float = 0.0, seed: int = 0, batch_size: int = 64, **_) -> list[GenerationResult]:
        """Decode every prompt. ``search``: ``ar`` | ``linear`` | ``beam`` | ``best_first``; ``tree_budget``
        B; ``width`` W and ``top_b`` b (Alg. 1-2); ``lam`` λ, or ``adaptive=(β, C)`` for λ(H); ``draft_len`` k."""
        spec = self.target.spec
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {max_tokens})")
        opts = draft_options(self.drafter, search=search, tree_budget=tree_budget, width=width, top_b=top_b, lam=lam,
                             adaptive=adaptive, draft_len=draft_len, candidates=candidates, temperature=temperature)
        k, blk = opts["k"], (self.drafter.spec.block_size if self.drafter else 0)
        limit = spec.max_position if self.drafter is None else min(spec.max_position, self.drafter.spec.max_position)
        for p in prompts:
            if not p:
                raise ValueError("empty prompt: at least one token is needed")
            if len(p) + max_tokens + k + blk > limit:
                raise ValueError(f"prompt of {len(p)} tokens + max_tokens {max_tokens} + draft room exceeds the "
                                 f"models' context of {limit} tokens")
        results: list[GenerationResult | None] = [None] * len(prompts)
        for s in range(0, len(prompts), batch_size):
            chunk = range(s, min(len(prompts), s + batch_size))
            reqs = []
            for i in chunk:
                rho = self.drafting.new_rho(prompts[i]) if search != "ar" else None
                gen = torch.Generator().manual_seed(seed * 1_000_003 + i) if temperature > 0 else None
                reqs.append(_Req(list(prompts[i]), i - s, rho, idx=i, prompt_len=len(prompts[i]), gen=gen))
            room = [len(r.seq) + max_tokens + k + blk for r in reqs]
            s_ = self.target.spec
            self.t_kv = PagedKVCache(s_.num_layers, s_.num_kv_heads, s_.head_dim, room, self.page_size, self.dtype,
                                     self.device)
            if search != "ar":
                self.drafting.allocate(room)
            t0 = time.perf_counter()
            while any(not r.done for r in reqs):
                live = [r for r in reqs if not r.done]
                if search != "ar":
                    self.drafting.draft(live, opts)
                self._verify(live, opts, max_tokens)
            dt = time.perf_counter() - t0
            for r in reqs:
                toks = r.seq[r.prompt_len:]
                results[r.idx] = GenerationResult(r.seq[: r.prompt_len], toks, r.nfe, dt, r.reason, {
                    "accept_len": len(toks) / max(1, r.nfe), "drafter_calls": r.drafter_calls,
                    "tree_nodes": r.nodes})
            self.t_kv = None
            if self.drafting is not None:
                self.drafting.kv = None
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- internals
    def _verify(self, reqs: list[_Req], o: dict, max_tokens: int) -> None:
        """One target forward over every request's pending tokens and tree; accept and emit."""
        ids, pos, rows, qo, prefix, masks, w_slots, w_rows = [], [], [], [0], [], [], [], []
        for r in reqs:
            n, c, tree = len(r.seq), r.t_cached, (r.tree if o["search"] != "ar" else TokenTree())
            m, N = n - c, len(tree)
            ids += r.seq[c:n] + tree.tokens
            pos.append(torch.cat([torch.arange(c, n), torch.tensor(tree.depth, dtype=torch.long) + n - 1]))
            masks.append(tree.verify_mask(m))
            rows.append(torch.arange(m - 1, m + N) + qo[-1])  # the root (last pending token) and every node
            w_slots.append(self.t_kv.slots(torch.full((m,), r.slot), torch.arange(c, n)))
            w_rows.append(torch.arange(m) + qo[-1])
            qo.append(qo[-1] + m + N)
            prefix.append(c)
        seqs = [r.slot for r in reqs]
        positions = torch.cat(pos)
        plan = AttentionPlan(torch.tensor(qo), torch.tensor(prefix), self.t_kv.block_table[seqs], self.page_size,
                             kind="custom", custom_masks=masks)
        t0 = time.perf_counter()
        logits = self.target.forward_paged(torch.tensor(ids, device=self.device), positions.to(self.device), plan,
                                           self.t_kv, self.attn, write=(torch.cat(w_slots).to(self.device),
                                                                        torch.cat(w_rows).to(self.device)),
                                           logits_rows=torch.cat(rows).to(self.device))
        self.timing["verify_forward_s"] += time.perf_counter() - t0
        eos = self.target.spec.eos_token_id
        for r, lg in zip(reqs, logits.split([len(r.tree) + 1 if o["search"] != "ar" else 1 for r in reqs])):
            tree = r.tree if o["search"] != "ar" else TokenTree()
            if o["temperature"] > 0:
                out, _ = accept_sampling(tree, torch.softmax(lg.double() / o["temperature"], -1).cpu(), r.gen)
            else:
                out, _ = accept_greedy(tree, lg.argmax(-1).cpu())
            r.t_cached = len(r.seq)
            r.nfe += 1
            r.nodes += len(tree)
            room = max_tokens - (len(r.seq) - r.prompt_len)
            out = out[:room]
            if eos in out:
                out = out[: out.index(eos) + 1]
                r.done, r.reason = True, "stop"
            if self.drafting is not None:
                self.drafting.accepted(r, out)
            else:
                r.seq += out
            if len(r.seq) - r.prompt_len >= max_tokens:
                r.done = True
