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

from .block_schedule import CACHE_MODES, cached_after_step, plan_blocks, window
from .decoding import METHODS, BlockDecoder, make_decoder, merge_stats
from .models.reference import ReferenceDLLM, attention_mask


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
    kv: list | None = None  # per layer (k, v) [1, H, cached_len, D]
    cached: int = 0  # number of positions whose K/V is in ``kv``
    fresh_block: bool = True  # first step of the current block
    done: bool = False
    dec: BlockDecoder | None = None  # decodes the current block
    make: Callable[[torch.Tensor], BlockDecoder] | None = None  # builds the decoder of a block
    stats: dict = field(default_factory=dict)  # method counters summed over blocks
    t0: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0


class ReferenceEngine:
    """Batched block decoding with a :class:`ReferenceDLLM` (see the module docstring)."""

    def __init__(self, model: ReferenceDLLM):
        self.model = model
        self.spec = model.spec
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "ReferenceEngine":
        return cls(ReferenceDLLM.from_pretrained(path, dtype=dtype, device=device))

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
            reqs = [self._new_request(i, prompts[i], max_tokens, block_size, cache) for i in
                    range(s, min(len(prompts), s + batch_size))]
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
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- internals
    def _new_request(self, idx, prompt, max_tokens, block_size, cache) -> _Request:
        x = torch.tensor(prompt + [self.spec.mask_token_id] * max_tokens, dtype=torch.long, device=self.device)
        aligned = cache == "block" or self.spec.attention == "block_causal"  # SDAR: model-aligned blocks
        return _Request(idx, list(prompt), x, plan_blocks(len(prompt), max_tokens, block_size, aligned))

    def _start_block(self, r: _Request) -> None:
        b0, b1 = r.blocks[r.block]
        r.dec = r.make(r.x[b0:b1])
        r.fresh_block = True

    def _window(self, r: _Request, cache: str) -> tuple[int, int]:
        """[start, end) of the positions this step forwards; K/V before ``start`` comes from the cache."""
        return window(cache, r.blocks[r.block], r.x.numel(), fresh=r.fresh_block, cached=r.cached,
                      shift=int(self.spec.shift_logits))

    def _step(self, reqs: list[_Request], cache: str) -> None:
        items = []  # (request, window, block canvas)
        for r in reqs:
            canv = r.dec.canvases()
            if r.fresh_block and cache == "prefix" and len(canv) != 1:
                raise RuntimeError("a decoder must forward only its state on the first step of a block")
            w = self._window(r, cache)
            items += [(r, w, c) for c in canv]
        logits, new_kv = self._forward(items, cache)
        off = 1 if self.spec.shift_logits else 0
        by_req: dict[int, list] = {}
        for (r, (w0, w1), _), lg, kv in zip(items, logits, new_kv):
            b0, b1 = r.blocks[r.block]
            if r.idx not in by_req:  # the K/V bookkeeping reads the first canvas (the state's context)
                by_req[r.idx] = []
                self._keep_kv(r, cache, w0, kv)
            # row j of ``lg`` is position w0 + j (+1 if logits are shifted)
            by_req[r.idx].append(lg[b0 - w0 - off: b1 - w0 - off])
        for r in reqs:
            r.nfe += 1
            r.fresh_block = False
            r.dec.update(by_req[r.idx])
            if r.dec.done:
                self._finish_block(r)

    def _keep_kv(self, r: _Request, cache: str, w0: int, kv) -> None:
        keep = cached_after_step(cache, r.blocks[r.block], w0, fresh=r.fresh_block, cached=r.cached,
                                 shift=int(self.spec.shift_logits), model_block=self.spec.block_size)
        if keep == r.cached:
            return
        if cache == "prefix":  # keep K/V of everything before the block
            r.kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in kv]
        else:  # block: K/V of the finished blocks (before the block's aligned start) is exact
            new = [(k[:, :, : keep - w0], v[:, :, : keep - w0]) for k, v in kv]
            r.kv = new if r.kv is None else [(torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                                             for (pk, pv), (k, v) in zip(r.kv, new)]
        r.cached = keep

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

    def _forward(self, items, cache: str):
        """One batched model call over ``(request, window, block canvas)`` items (several canvases of a
        request share its cached prefix); returns per-item logits and new K/V."""
        B = len(items)
        L = max(w1 - w0 for _, (w0, w1), _ in items)
        uses_cache = [r.kv is not None and w0 > 0 for r, (w0, _), _ in items]
        P = max((r.cached if u else 0) for (r, _, _), u in zip(items, uses_cache))
        dev = self.device
        ids = torch.full((B, L), self.spec.eos_token_id, dtype=torch.long, device=dev)
        pos = torch.zeros((B, L), dtype=torch.long, device=dev)
        q_valid = torch.zeros((B, L), dtype=torch.bool, device=dev)
        p_valid = torch.zeros((B, P), dtype=torch.bool, device=dev)
        p_pos = torch.zeros((B, P), dtype=torch.long, device=dev)
        past = None
        if P > 0:
            ref = next(r.kv for (r, _, _), u in zip(items, uses_cache) if u)
            past = [(k.new_zeros(B, k.shape[1], P, k.shape[3]), v.new_zeros(B, v.shape[1], P, v.shape[3]))
                    for k, v in ref]
        for b, ((r, (w0, w1), canvas), u) in enumerate(zip(items, uses_cache)):
            n = w1 - w0
            b0, b1 = r.blocks[r.block]
            ids[b, :n] = r.x[w0:w1]
            ids[b, b0 - w0: b1 - w0] = canvas
            pos[b, :n] = torch.arange(w0, w1, device=dev)
            q_valid[b, :n] = True
            if u:
                c = r.cached
                for i, (k, v) in enumerate(r.kv):
                    past[i][0][b, :, :c] = k[0, :, :c]
                    past[i][1][b, :, :c] = v[0, :, :c]
                p_valid[b, :c] = True
                p_pos[b, :c] = torch.arange(c, device=dev)
        k_pos = torch.cat([p_pos, pos], 1)
        k_valid = torch.cat([p_valid, q_valid], 1)
        mask = attention_mask(self.spec, pos, k_pos, k_valid)
        logits, kv = self.model(ids, positions=pos, past=past, mask=mask, return_kv=True)
        out_logits = [logits[b, : w1 - w0] for b, (_, (w0, w1), _) in enumerate(items)]
        out_kv = [[(k[b: b + 1, :, : w1 - w0], v[b: b + 1, :, : w1 - w0]) for k, v in kv]
                  for b, (_, (w0, w1), _) in enumerate(items)]
        return out_logits, out_kv

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
