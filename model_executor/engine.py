"""The reference engine: block-wise dLLM decoding in plain PyTorch, batched over requests.

It runs on any machine with torch (no vLLM), is the quality reference for the vLLM path, and is what
the benchmarks and GPU checks drive. Each request decodes its ``max_tokens`` answer region in blocks of
``block_size`` (semi-autoregressive, as LLaDA ``generate.py``); every step runs one forward per active
request (all active requests batched into one model call) and a spatial policy commits positions of the
request's current block. Generation stops once the block that holds the first EOS is complete; the
output ends at that EOS.

KV-cache modes (``cache``):

- ``none``: recompute ``[prompt | answer region]`` at every step (LLaDA ``generate.py``'s loop).
- ``prefix`` (Fast-dLLM prefix cache; LLaDA, Dream): the first step of a block is a full forward that also
  stores the K/V of everything before the block; later steps forward the block and the masks after it
  against that cache. For Dream, whose prediction for position ``i`` is the output at ``i - 1``, the
  window starts one position early so the block's first prediction is exact (a choice; Fast-dLLM reuses
  the block's own first output there).
- ``dual`` (Fast-dLLM DualCache; LLaDA, Dream): as ``prefix``, and the block's first step also keeps the
  K/V of the masks after the block; later steps forward the block alone (from ``b0 - 1`` for Dream) against
  the cached prefix and that kept suffix, which is refreshed by the next block's first step.
- ``block`` (SDAR, LLaDA2: block-causal; exact): blocks are aligned to absolute positions (``position // block_size``, the
  model's attention block), the K/V of finished blocks is exact and cached; the forward that finishes a
  block's K/V is fused with the first step of the next block (one model call, block-causal mask), so
  the cache costs no extra forward.

Counting follows the PSD paper's appendix B.1: ``nfe`` is the number of model forwards a request took
part in, ``tpf = len(token_ids) / nfe`` with ``token_ids`` counted up to and including the first EOS.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from attention_backends.paged_kv_cache import PagedKVCache
from attention_backends.prefix_attention import AttentionPlan, make_backend

from .block_schedule import CACHE_MODES
from .decoding import (METHODS, BlockDecoder, LogitsRules, apply_rules, make_decoder, predict_rows, propose_all,
                       update_all)
from .decoding.policies import SPATIAL_POLICIES
from .dllm_request import DLLMRequest, DLLMStep
from .models.reference import ReferenceDLLM
from .outputs import GenerationResult


class ReferenceEngine:
    """Batched block decoding with a :class:`ReferenceDLLM` (see the module docstring)."""

    def __init__(self, model: ReferenceDLLM, attention_backend: str = "auto", page_size: int = 16):
        """``attention_backend``: ``auto``, ``torch`` or ``flashinfer`` (:func:`attention_backends.prefix_attention.make_backend`);
        ``page_size``: tokens per page of the paged KV cache."""
        self.model = model
        self.spec = model.spec
        p = next(model.parameters())
        self.device = p.device
        self.attn = make_backend(attention_backend, p.device, p.dtype)
        self.page_size = page_size
        self.kv: PagedKVCache | None = None
        self.step_time = {"steps": 0, "forward_seconds": 0.0}  # steps taken, seconds in the model forward

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu", **kw) -> "ReferenceEngine":
        return cls(ReferenceDLLM.from_pretrained(path, dtype=dtype, device=device), **kw)

    def default_cache(self) -> str:
        return "block" if self.spec.attention == "block_causal" else "prefix"

    # --------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_tokens: int = 32, block_size: int = 8,
                 method: str = "confidence", cache: str | None = None, seed: int = 0, batch_size: int = 64,
                 decoder_factory: Callable[[torch.Tensor], BlockDecoder] | None = None,
                 rules: LogitsRules | None = None, logprobs: int | None = None, **knobs) -> list[GenerationResult]:
        """Decode every prompt (token ids); one :class:`GenerationResult` per prompt, in order.

        ``knobs`` go to :func:`model_executor.decoding.make_decoder` (``threshold``, ``policy``, ``depth``,
        ``branches``, ``steps``, ``temperature``, ``top_k`` ...). ``rules`` (logit bias, allowed and banned
        tokens, ``min_tokens``) apply to every request's logits before the decoders see them. ``logprobs=k``
        gives each token's log-probability and the ``k`` most likely tokens' (:attr:`GenerationResult.logprobs`).
        ``decoder_factory(block)`` replaces the method's decoder (calibration uses it to record trajectories).
        """
        spec = self.spec
        cache = cache or self.default_cache()
        if method not in METHODS:
            raise ValueError(f"method {method!r}; allowed: {', '.join(METHODS)}")
        if cache not in CACHE_MODES:
            raise ValueError(f"cache {cache!r}; allowed: {', '.join(CACHE_MODES)}")
        if cache == "block" and spec.attention != "block_causal":
            raise ValueError(f"cache 'block' is exact only for block-causal models (SDAR, LLaDA2); {spec.family} "
                             "allows: none, prefix, dual")
        if cache in ("prefix", "dual") and spec.attention == "block_causal":
            raise ValueError(f"cache {cache!r} is for bidirectional models; a block-causal {spec.family} model "
                             "allows: none, block")
        if spec.attention == "block_causal" and block_size != spec.block_size:
            raise ValueError(f"block_size {block_size}: a block-causal {spec.family} model decodes in its attention block of "
                             f"{spec.block_size} tokens")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {max_tokens})")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0 (got {block_size})")
        for p in prompts:
            if not p:
                raise ValueError("empty prompt: at least one token is needed")
            if len(p) + max_tokens > spec.max_position:
                raise ValueError(f"prompt of {len(p)} tokens + max_tokens {max_tokens} exceeds the model's "
                                 f"context of {spec.max_position} tokens")
        make_decoder(method, torch.zeros(1, dtype=torch.long), spec.mask_token_id, **knobs)  # validate knobs early
        if rules is not None and rules.penalized and method not in SPATIAL_POLICIES:
            raise ValueError(f"penalties with method {method!r}: they count the tokens committed so far, which its "
                             f"draft canvases would see out of date; use one of {', '.join(SPATIAL_POLICIES)}")
        results: list[GenerationResult | None] = [None] * len(prompts)
        aligned = cache == "block" or spec.attention == "block_causal"  # SDAR, LLaDA2: model-aligned blocks
        for s in range(0, len(prompts), batch_size):
            idx = list(range(s, min(len(prompts), s + batch_size)))
            reqs: list[DLLMRequest] = []
            for i in idx:
                gen = None
                if knobs.get("temperature", 0) > 0:
                    gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + i)
                make = decoder_factory or (
                    lambda blk, gen=gen: make_decoder(method, blk, spec.mask_token_id, generator=gen, **knobs))
                reqs.append(DLLMRequest(list(prompts[i]), max_tokens, block_size, make, spec.mask_token_id,
                                        spec.eos_token_id, aligned=aligned, device=self.device))
            w = next(self.model.parameters())
            self.kv = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, [r.total for r in reqs],
                                   self.page_size, w.dtype, w.device)
            t0, seconds = time.perf_counter(), [0.0] * len(reqs)
            while True:
                live = [(j, r) for j, r in enumerate(reqs) if not r.done]
                if not live:
                    break
                self._step(live, cache, rules, logprobs)
                for j, r in live:
                    if r.done:
                        seconds[j] = time.perf_counter() - t0
            for j, (i, r) in enumerate(zip(idx, reqs)):
                answer = r.answer()
                lps = None if logprobs is None else [{t: lp, **alts} for t, lp, alts, _ in r.logprobs_of(0, len(answer))]
                results[i] = GenerationResult(list(r.prompt), answer, r.nfe, seconds[j], r.finish_reason, r.stats,
                                              lps)
            self.kv = None  # the batch's pages
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- internals
    def _step(self, live: list[tuple[int, DLLMRequest]], cache: str, rules: LogitsRules | None = None,
              logprobs: int | None = None) -> None:
        """One forward for every live request (``(sequence in the batch's cache, request)``)."""
        shift = int(self.spec.shift_logits)
        proposals = propose_all([r.dec for _, r in live])  # every decoder's canvases, a method at a time
        steps = [r.next_step(p, cache, shift, self.spec.block_size or 1) for p, (_, r) in zip(proposals, live)]
        t0 = time.perf_counter()
        logits = self._forward([(seq, st) for (seq, _), st in zip(live, steps)])
        self.step_time["forward_seconds"] += time.perf_counter() - t0
        self.step_time["steps"] += 1
        firsts, i = [], 0
        for st in steps:
            firsts.append([i + k * st.block_len for k in range(st.num_canvases)])
            i += st.num_canvases * st.block_len
        if rules is not None:
            apply_rules(logits, [(rules, f[0], st.num_canvases, st.block_len, st.b0 - r.prompt_len, r.history)
                                 for f, st, (_, r) in zip(firsts, steps, live)])
        # once for every canvas of every request; the mask token is never a prediction
        mask = self.spec.mask_token_id  # predictions only where a canvas is masked
        preds = predict_rows(logits, mask_id=mask, need=torch.cat([st.masked_rows(mask) for st in steps]))
        before = [r.dec.state.clone() for _, r in live] if logprobs is not None else None
        update_all([r.dec for _, r in live], proposals, preds, firsts)  # a method at a time
        for j, ((_, r), st) in enumerate(zip(live, steps)):
            if before is not None:  # under the state canvas's distribution (rules applied, mask excluded)
                r.record_logprobs(before[j], logits[firsts[j][0]: firsts[j][0] + st.block_len], logprobs)
            r.stepped(st)

    def _forward(self, items: list[tuple[int, DLLMStep]]) -> torch.Tensor:
        """One model call over every request's window, once per block canvas: the canvases of a request
        are segments that share its cached prefix ``[0, w0)`` (and DualCache's kept suffix) on the paged cache
        and each see only themselves (:class:`~attention_backends.prefix_attention.AttentionPlan`). Stores the
        K/V of the positions ``[w0, keep)`` of the first canvas (the state's context), and of the kept suffix
        on a dual block's first step, and returns the logits of every canvas's block rows, concatenated in
        item order (row ``j`` predicts block position ``j``)."""
        dev = self.device
        ids, pos, rows, w_slots, w_rows = [], [], [], [], []
        qo, seg, prefix, seqs, suf0, suf = [0], [0], [], [], [], []
        for seq, st in items:
            n, K, start = st.seg_len, st.num_canvases, qo[-1]
            ids.append(st.tokens.flatten())
            pos.append(torch.arange(st.w0, st.w1).repeat(K))
            for k in range(K):
                seg.append(seg[-1] + n)
                rows.append(torch.arange(st.first_row, st.first_row + st.block_len) + start + k * n)
            qo.append(start + K * n)
            prefix.append(st.w0)
            seqs.append(seq)
            suf0.append(st.suffix[0])
            suf.append(st.reads_suffix)  # DualCache's kept suffix, read by the block's later steps
            for a, b in ((st.w0, st.keep), st.suffix if st.writes_suffix else (0, 0)):
                if b > a:  # positions [w0, keep) become exact cache; a dual block's first step keeps its suffix
                    w_slots.append(self.kv.slots(torch.full((b - a,), seq), torch.arange(a, b)))
                    w_rows.append(torch.arange(a - st.w0, b - st.w0) + start)
        positions = torch.cat(pos)
        plan = AttentionPlan(torch.tensor(qo), torch.tensor(prefix), self.kv.block_table[seqs], self.kv.page_size,
                             kind=self.spec.attention, seg_indptr=torch.tensor(seg), positions=positions,
                             block_size=self.spec.block_size,
                             **(dict(suffix_starts=torch.tensor(suf0), suffix_lens=torch.tensor(suf)) if any(suf) else {}))
        write = (torch.cat(w_slots).to(dev), torch.cat(w_rows).to(dev)) if w_slots else None
        return self.model.forward_paged(torch.cat(ids).to(dev), positions.to(dev), plan, self.kv, self.attn,
                                        write=write, logits_rows=torch.cat(rows).to(dev))
