"""PRESTO tree speculative decoding in plain PyTorch: a block-diffusion drafter speculates for an AR target.

Each round, batched over the active requests, is one drafter call and one target call; its pieces (draft,
tree, verification layout, acceptance) are :mod:`model_executor.presto_round`'s, shared with the vLLM runner.
Here the target verifies on its own paged cache through :mod:`attention_backends`; the pending tokens' K/V is
written in that forward, rejected nodes are never written (a choice: accepted tokens are re-forwarded as
pending tokens next round, ``τ`` extra rows per round instead of a K/V copy out of the tree). The matched
path plus the target's bonus token are emitted, up to EOS and ``max_tokens``.

``search="ar"`` drafts nothing: every round is one target forward that emits one token (the AR baseline on
the same code path). ``nfe`` counts target forwards (the prompt's prefill is the first round's forward);
``accept_len = len(token_ids) / nfe`` is PRESTO's τ (tokens per target forward, bonus token included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from attention_backends.paged_kv_cache import PagedKVCache
from attention_backends.prefix_attention import AttentionPlan, make_backend

from .decoding.ngram import NGramModel
from .decoding.tree import TokenTree
from .models.reference import ReferenceDLLM
from .outputs import GenerationResult
from .presto_round import DraftState, TreeDrafter, accept, check_pair, draft_options, verify_layout


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


class PrestoEngine:
    """Tree speculative decoding of an AR ``target`` with a block-diffusion ``drafter`` (module docstring)."""

    def __init__(self, target: ReferenceDLLM, drafter: ReferenceDLLM | None, ngram: NGramModel | None = None,
                 attention_backend: str = "auto", page_size: int = 16):
        check_pair(target, drafter)
        self.target, self.drafter, self.ngram = target, drafter, ngram
        p = next(target.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.attn = make_backend(attention_backend, p.device, p.dtype, target.spec.head_dim)
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
        k, blk = opts["k"], (self.drafter.spec.attention_block if self.drafter else 0)
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
            p_, mask = verify_layout(tree, m, n)
            pos.append(p_)
            masks.append(mask)
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
            out = accept(tree, lg, o["temperature"], r.gen)
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
