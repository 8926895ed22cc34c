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
- ``block`` (SDAR, exact): blocks are aligned to absolute positions (``position // block_size``, the
  model's attention block), the K/V of finished blocks is exact and cached; the forward that finishes a
  block's K/V is fused with the first step of the next block (one model call, block-causal mask), so
  the cache costs no extra forward.

Counting follows the PSD paper's appendix B.1: ``nfe`` is the number of model forwards a request took
part in, ``tpf = len(token_ids) / nfe`` with ``token_ids`` counted up to and including the first EOS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from attention_backends.prefix_attention import AttentionPlan, make_backend

from .block_schedule import CACHE_MODES, cached_after_step, plan_blocks, window
from .decoding import METHODS, BlockDecoder, make_decoder, merge_stats
from .kv_cache import PagedKVCache
from .models.reference import ReferenceDLLM


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids up to and including the first EOS
    nfe: int
    seconds: float = 0.0
    finish_reason: str = "length"  # "stop" when an EOS ended the answer
    stats: dict = field(default_factory=dict)  # method-specific counters (accepted drafts ...)

    @property
    def tpf(self) -> float:
        return len(self.token_ids) / max(1, self.nfe)


@dataclass
class _Request:
    idx: int
    prompt: list[int]
    x: torch.Tensor  # [prompt | answer region], masks where undecoded
    blocks: list[tuple[int, int]]  # [start, end) absolute positions of each block to decode
    block: int = 0
    nfe: int = 0
    seq: int = 0  # the request's sequence in the batch's paged KV cache
    cached: int = 0  # number of leading positions whose K/V in the cache is exact
    fresh_block: bool = True  # first step of the current block
    done: bool = False
    dec: BlockDecoder | None = None  # decodes the current block
    make: Callable[[torch.Tensor], BlockDecoder] | None = None  # builds the decoder of a block
    stats: dict = field(default_factory=dict)  # method counters summed over blocks
    t0: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0


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
                 **knobs) -> list[GenerationResult]:
        """Decode every prompt (token ids); one :class:`GenerationResult` per prompt, in order.

        ``knobs`` go to :func:`model_executor.decoding.make_decoder` (``threshold``, ``policy``, ``depth``,
        ``branches``, ``steps``, ``temperature`` ...). ``decoder_factory(block)`` replaces the method's
        decoder (calibration uses it to record trajectories).
        """
        spec = self.spec
        cache = cache or self.default_cache()
        if method not in METHODS:
            raise ValueError(f"method {method!r}; allowed: {', '.join(METHODS)}")
        if cache not in CACHE_MODES:
            raise ValueError(f"cache {cache!r}; allowed: {', '.join(CACHE_MODES)}")
        if cache == "block" and spec.attention != "block_causal":
            raise ValueError(f"cache 'block' is exact only for block-causal models (SDAR); {spec.family} "
                             "allows: none, prefix")
        if cache == "prefix" and spec.attention == "block_causal":
            raise ValueError("cache 'prefix' is for bidirectional models; SDAR allows: none, block")
        if spec.attention == "block_causal" and block_size != spec.block_size:
            raise ValueError(f"block_size {block_size}: an SDAR model decodes in its attention block of "
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
        results: list[GenerationResult | None] = [None] * len(prompts)
        for s in range(0, len(prompts), batch_size):
            reqs = [self._new_request(i, prompts[i], max_tokens, block_size, cache, batch_size) for i in
                    range(s, min(len(prompts), s + batch_size))]
            w = next(self.model.parameters())
            self.kv = PagedKVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, [r.x.numel() for r in reqs],
                                   self.page_size, w.dtype, w.device)
            for r in reqs:
                gen = None
                if knobs.get("temperature", 0) > 0:
                    gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + r.idx)
                r.make = decoder_factory or (
                    lambda blk, gen=gen: make_decoder(method, blk, spec.mask_token_id, generator=gen, **knobs))
                self._start_block(r)
            while any(not r.done for r in reqs):
                self._step([r for r in reqs if not r.done], cache)
            for r in reqs:
                results[r.idx] = self._result(r)
            self.kv = None  # the batch's pages
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- internals
    def _new_request(self, idx, prompt, max_tokens, block_size, cache, batch_size) -> _Request:
        x = torch.tensor(prompt + [self.spec.mask_token_id] * max_tokens, dtype=torch.long, device=self.device)
        aligned = cache == "block" or self.spec.attention == "block_causal"  # SDAR: model-aligned blocks
        return _Request(idx, list(prompt), x, plan_blocks(len(prompt), max_tokens, block_size, aligned),
                        seq=idx % batch_size)

    def _start_block(self, r: _Request) -> None:
        b0, b1 = r.blocks[r.block]
        r.dec = r.make(r.x[b0:b1])
        r.fresh_block = True

    def _window(self, r: _Request, cache: str) -> tuple[int, int]:
        """[start, end) of the positions this step forwards; K/V before ``start`` comes from the cache."""
        return window(cache, r.blocks[r.block], r.x.numel(), fresh=r.fresh_block, cached=r.cached,
                      shift=int(self.spec.shift_logits))

    def _step(self, reqs: list[_Request], cache: str) -> None:
        items = []  # (request, window, block canvases, cached length after this step)
        for r in reqs:
            canv = r.dec.canvases()
            if r.fresh_block and cache == "prefix" and len(canv) != 1:
                raise RuntimeError("a decoder must forward only its state on the first step of a block")
            w0, w1 = self._window(r, cache)
            if w0 > r.cached:
                raise RuntimeError(f"window starts at {w0} but only {r.cached} positions are cached")
            keep = cached_after_step(cache, r.blocks[r.block], w0, fresh=r.fresh_block, cached=r.cached,
                                     shift=int(self.spec.shift_logits), model_block=self.spec.block_size)
            items.append((r, (w0, w1), canv, keep))
        logits = self._forward(items).split([r.blocks[r.block][1] - r.blocks[r.block][0]
                                             for r, _, canv, _ in items for _ in canv])
        i = 0
        for r, _, canv, keep in items:
            r.cached = keep
            r.nfe += 1
            r.fresh_block = False
            r.dec.update(list(logits[i: i + len(canv)]))
            i += len(canv)
            if r.dec.done:
                self._finish_block(r)

    def _finish_block(self, r: _Request) -> None:
        b0, b1 = r.blocks[r.block]
        r.x[b0:b1] = r.dec.state
        r.stats = merge_stats([r.stats, r.dec.stats()])  # method counters summed over blocks
        gen = r.x[len(r.prompt): b1]
        if (gen == self.spec.eos_token_id).any() or r.block + 1 == len(r.blocks):
            r.done = True
            r.seconds = time.perf_counter() - r.t0
        else:
            r.block += 1
            self._start_block(r)

    def _forward(self, items) -> torch.Tensor:
        """One model call over every request's window, once per block canvas: the canvases of a request
        are segments that share its cached prefix ``[0, w0)`` on the paged cache and each see only
        themselves (:class:`~attention_backends.prefix_attention.AttentionPlan`). Stores the K/V of the
        positions ``[w0, keep)`` of the first canvas (the state's context) and returns the logits of every
        canvas's block rows, concatenated in item order (row ``j`` predicts block position ``j``)."""
        dev, off = self.device, int(self.spec.shift_logits)
        ids, pos, rows, w_slots, w_rows = [], [], [], [], []
        qo, seg, prefix, seqs = [0], [0], [], []
        for r, (w0, w1), canv, keep in items:
            n, (b0, b1), start = w1 - w0, r.blocks[r.block], qo[-1]
            toks = r.x[w0:w1].repeat(len(canv), 1)
            toks[:, b0 - w0: b1 - w0] = torch.stack(canv)
            ids.append(toks.flatten())
            pos.append(torch.arange(w0, w1).repeat(len(canv)))
            for k in range(len(canv)):
                seg.append(seg[-1] + n)
                rows.append(torch.arange(b0 - w0 - off, b1 - w0 - off) + start + k * n)
            qo.append(start + len(canv) * n)
            prefix.append(w0)
            seqs.append(r.seq)
            if keep > w0:  # positions [w0, keep) become exact cache
                w_slots.append(self.kv.slots(torch.full((keep - w0,), r.seq), torch.arange(w0, keep)))
                w_rows.append(torch.arange(keep - w0) + start)
        positions = torch.cat(pos)
        plan = AttentionPlan(torch.tensor(qo), torch.tensor(prefix), self.kv.block_table[seqs], self.kv.page_size,
                             kind=self.spec.attention, seg_indptr=torch.tensor(seg), positions=positions,
                             block_size=self.spec.block_size)
        write = (torch.cat(w_slots).to(dev), torch.cat(w_rows).to(dev)) if w_slots else None
        return self.model.forward_paged(torch.cat(ids), positions.to(dev), plan, self.kv, self.attn, write=write,
                                        logits_rows=torch.cat(rows).to(dev))

    def _result(self, r: _Request) -> GenerationResult:
        gen = r.x[len(r.prompt):].tolist()
        eos = self.spec.eos_token_id
        reason = "length"
        if eos in gen:
            gen = gen[: gen.index(eos) + 1]
            reason = "stop"
        else:
            gen = [t for t in gen if t != self.spec.mask_token_id]
        return GenerationResult(r.prompt, gen, r.nfe, r.seconds, reason, r.stats)
