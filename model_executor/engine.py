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
from attention_backends.prefix_attention import make_backend
from attention_backends.step_batch import StepBatch, build_step_batch

import msgspec

from .decode_config import ConfigError, DecodeConfig, DecodeKnobs, resolve
from .decoding import BlockDecoder, LogitsRules, propose_all
from .dllm_request import DLLMRequest, decode_step
from .grammar import GrammarFrontier
from .models.reference import ReferenceDLLM
from .outputs import GenerationResult
from .staging import Staging


class ReferenceEngine:
    """Batched block decoding with a :class:`ReferenceDLLM` (see the module docstring)."""

    def __init__(self, model: ReferenceDLLM, attention_backend: str = "auto", page_size: int = 16):
        """``attention_backend``: ``auto``, ``torch`` or ``flashinfer`` (:func:`attention_backends.prefix_attention.make_backend`);
        ``page_size``: tokens per page of the paged KV cache."""
        self.model = model
        self.staging = Staging()  # pinned buffers of the decoders' uploads where they decide on the device
        self.spec = model.spec
        p = next(model.parameters())
        self.device = p.device
        self.attn = make_backend(attention_backend, p.device, p.dtype, model.spec.head_dim)
        self.page_size = page_size
        self.kv: PagedKVCache | None = None
        self.step_time = {"steps": 0, "forward_seconds": 0.0}  # steps taken, seconds in the model forward

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu", **kw) -> "ReferenceEngine":
        return cls(ReferenceDLLM.from_pretrained(path, dtype=dtype, device=device), **kw)

    # --------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_tokens: int = 32, block_size: int | None = None,
                 method: str = "confidence", cache: str | None = None, seed: int = 0, batch_size: int = 64,
                 config: DecodeConfig | None = None, decoder_factory: Callable[[torch.Tensor], BlockDecoder] | None = None,
                 rules: LogitsRules | None = None, logprobs: int | None = None, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, graph=None, dag=None, grammar=None,
                 **knobs) -> list[GenerationResult]:
        """Decode every prompt (token ids); one :class:`GenerationResult` per prompt, in order.

        ``config``: a resolved :class:`~model_executor.decode_config.DecodeConfig`; without one, ``method``,
        ``block_size``, ``cache``, ``graph``, ``dag`` and ``knobs`` (fields of
        :class:`~model_executor.decode_config.DecodeKnobs`: ``threshold``, ``policy``, ``depth`` ...) are resolved
        into one. ``temperature``, ``top_k``, ``top_p``, ``min_p`` sample, every method (prompt ``i``'s draws
        seeded ``seed * 1_000_003 + i``; :mod:`~model_executor.decoding.sampling`). ``rules`` (logit bias, allowed
        and banned tokens, ``min_tokens``, penalties) apply to every request's logits before the decoders see them. ``logprobs=k`` gives each token's log-probability
        and the ``k`` most likely tokens' (:attr:`GenerationResult.logprobs`). ``decoder_factory(block)``
        replaces the method's decoder (calibration uses it to record trajectories). ``grammar``: structured
        outputs, a compiled grammar (:func:`~model_executor.grammar.compile_grammar`) every answer must follow,
        or one per prompt (None: free); decoded under the frontier rule (:mod:`model_executor.grammar`).
        """
        spec = self.spec
        if config is None:
            try:
                knobs = msgspec.convert({**knobs, "cache": cache}, DecodeKnobs)
            except msgspec.ValidationError as e:
                raise ConfigError(f"knobs: {e}") from None
            config = resolve(method, knobs, spec, block_size=block_size, graph=graph, dag=dag, where="generate")
        config.check_request(rules is not None and rules.penalized, logprobs is not None)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {max_tokens})")
        for p in prompts:
            if not p:
                raise ValueError("empty prompt: at least one token is needed")
            if len(p) + max_tokens > spec.max_position:
                raise ValueError(f"prompt of {len(p)} tokens + max_tokens {max_tokens} exceeds the model's "
                                 f"context of {spec.max_position} tokens")
        grammars = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * len(prompts)
        if len(grammars) != len(prompts):
            raise ValueError(f"grammar: {len(grammars)} grammars for {len(prompts)} prompts")
        if rules is not None and rules.bans and any(g is not None for g in grammars):
            raise ValueError(f"{rules.bans} with a grammar: it can ban the only tokens the grammar allows; use one "
                             "or the other")
        results: list[GenerationResult | None] = [None] * len(prompts)
        for s in range(0, len(prompts), batch_size):
            idx = list(range(s, min(len(prompts), s + batch_size)))
            reqs: list[DLLMRequest] = []
            for i in idx:
                sampling = config.sampling(temperature, seed * 1_000_003 + i, top_k, top_p, min_p)
                make = decoder_factory or config.decoder_factory(spec.mask_token_id, sampling)
                g = None if grammars[i] is None else GrammarFrontier(grammars[i], spec.vocab_size, spec.eos_token_id,
                                                                     spec.mask_token_id)
                reqs.append(DLLMRequest(list(prompts[i]), max_tokens, config.block_size, make, spec.mask_token_id,
                                        spec.eos_token_id, aligned=config.aligned, grammar=g,
                                        schedule=config.schedule))
            w = next(self.model.parameters())
            self.kv = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, [r.total for r in reqs],
                                   self.page_size, w.dtype, w.device)
            t0, seconds = time.perf_counter(), [0.0] * len(reqs)
            while True:
                live = [(j, r) for j, r in enumerate(reqs) if not r.done]
                if not live:
                    break
                self._step(live, rules, logprobs)
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
    def _step(self, live: list[tuple[int, DLLMRequest]], rules: LogitsRules | None = None,
              logprobs: int | None = None) -> None:
        """One forward for every live request (``(sequence in the batch's cache, request)``)."""
        proposals = propose_all([r.dec for _, r in live])  # every decoder's canvases, a method at a time
        steps = [r.plan(p) for p, (_, r) in zip(proposals, live)]
        batch = build_step_batch(steps)
        kept = torch.cat([st.kept for st in steps])  # logits only for the rows the decoders read
        t0 = time.perf_counter()
        logits = self._forward([seq for seq, _ in live], batch, kept)
        self.step_time["forward_seconds"] += time.perf_counter() - t0
        self.step_time["steps"] += 1
        firsts = batch.canvas_rows
        decode_step(logits, kept, self.spec.mask_token_id, [r for _, r in live], steps, firsts,
                    [rules] * len(live), [logprobs] * len(live), staging=self.staging)
        for (_, r), st in zip(live, steps):
            r.stepped(st)

    def _forward(self, seqs: list[int], batch: StepBatch, kept: torch.Tensor) -> torch.Tensor:
        """One model call over the step ``batch`` (:func:`~attention_backends.step_batch.build_step_batch`, as
        the vLLM runner builds it): every request's canvases are segments that share its cached prefix
        ``[0, w0)`` (and DualCache's kept suffix) on the paged cache and each see only themselves. The first
        canvas's rows store their K/V at their positions (sequence ``seqs[i]`` of the batch's cache), as vLLM's
        scheduled rows do; returns the logits of the canvases' block rows ``kept`` (prediction rows, in
        ``batch.canvas_rows`` order)."""
        dev = self.device
        T = batch.num_scheduled
        seq_of_row = torch.repeat_interleave(torch.tensor(seqs), batch.scheduled_lens)
        write = (self.kv.slots(seq_of_row, batch.positions[:T]).to(dev), torch.arange(T, device=dev))
        plan = batch.plan(self.kv.block_table[seqs], self.kv.page_size, self.spec.attention, self.spec.attention_block)
        return self.model.forward_paged(batch.input_ids.to(dev), batch.positions.to(dev), plan, self.kv, self.attn,
                                        write=write, logits_rows=batch.logits_rows[kept].to(dev),
                                        order=batch.order)
