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

from .decoding.policies import POLICIES
from .models.reference import ReferenceDLLM, attention_mask

CACHE_MODES = ("none", "prefix", "block")


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids up to and including the first EOS
    nfe: int
    seconds: float = 0.0
    finish_reason: str = "length"  # "stop" when an EOS ended the answer

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
    generator: torch.Generator | None = None
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
                 method: str = "confidence", threshold: float = 0.9, cache: str | None = None,
                 temperature: float = 0.0, seed: int = 0, batch_size: int = 64) -> list[GenerationResult]:
        """Decode every prompt (token ids) and return one :class:`GenerationResult` per prompt, in order."""
        spec = self.spec
        cache = cache or self.default_cache()
        if method not in POLICIES:
            raise ValueError(f"method {method!r}; allowed: {', '.join(POLICIES)}")
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
        policy: Callable = POLICIES[method]
        kw = {"threshold": threshold} if method == "confidence" else {}
        results: list[GenerationResult | None] = [None] * len(prompts)
        for s in range(0, len(prompts), batch_size):
            reqs = [self._new_request(i, prompts[i], max_tokens, block_size, cache, temperature, seed)
                    for i in range(s, min(len(prompts), s + batch_size))]
            while any(not r.done for r in reqs):
                self._step([r for r in reqs if not r.done], policy, kw, cache, temperature)
            for r in reqs:
                results[r.idx] = self._result(r)
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- internals
    def _new_request(self, idx, prompt, max_tokens, block_size, cache, temperature, seed) -> _Request:
        P, mask = len(prompt), self.spec.mask_token_id
        x = torch.tensor(prompt + [mask] * max_tokens, dtype=torch.long, device=self.device)
        end = P + max_tokens
        if cache == "block" or self.spec.attention == "block_causal":  # SDAR: absolute, model-aligned blocks
            starts = [P] + list(range((P // block_size + 1) * block_size, end, block_size))
        else:
            starts = list(range(P, end, block_size))
        blocks = [(a, min(end, b)) for a, b in zip(starts, starts[1:] + [end])]
        gen = None
        if temperature > 0:
            gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + idx)
        return _Request(idx, list(prompt), x, blocks, generator=gen)

    def _window(self, r: _Request, cache: str) -> tuple[int, int]:
        """[start, end) of the positions this step forwards; K/V before ``start`` comes from the cache."""
        total = r.x.numel()
        if cache == "none":
            return 0, total
        b0, b1 = r.blocks[r.block]
        if cache == "prefix":
            if r.fresh_block:
                return 0, total
            return b0 - (1 if self.spec.shift_logits else 0), total
        return r.cached, b1  # block: uncached tokens of finished blocks + the current (aligned) block

    def _step(self, reqs: list[_Request], policy, kw, cache: str, temperature: float) -> None:
        windows = [self._window(r, cache) for r in reqs]
        logits, new_kv = self._forward(reqs, windows, cache)
        for r, (w0, w1), lg, kv in zip(reqs, windows, logits, new_kv):
            r.nfe += 1
            b0, b1 = r.blocks[r.block]
            if cache == "prefix" and r.fresh_block:  # keep K/V of everything before the block
                keep = b0 - (1 if self.spec.shift_logits else 0)
                r.kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in kv]
                r.cached = keep
            elif cache == "block":  # K/V of the finished blocks (before the block's aligned start) is exact
                a0 = b0 // self.spec.block_size * self.spec.block_size
                if w0 < a0:
                    new = [(k[:, :, : a0 - w0], v[:, :, : a0 - w0]) for k, v in kv]
                    r.kv = new if r.kv is None else [(torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                                                     for (pk, pv), (k, v) in zip(r.kv, new)]
                    r.cached = a0
            r.fresh_block = False
            # predictions for the block's positions: row j of ``lg`` is position w0 + j (+1 if shifted)
            off = 1 if self.spec.shift_logits else 0
            block_logits = lg[b0 - w0 - off: b1 - w0 - off].double()
            self._commit(r, block_logits, b0, b1, policy, kw, temperature)

    def _commit(self, r: _Request, block_logits, b0, b1, policy, kw, temperature) -> None:
        if temperature > 0:  # LLaDA: Gumbel-max in float64 picks the token, confidence from the plain softmax
            u = torch.rand(block_logits.shape, generator=r.generator, device=block_logits.device,
                           dtype=torch.float64).clamp_min(1e-300)
            x0 = (block_logits / temperature - torch.log(-torch.log(u))).argmax(-1)
        else:
            x0 = block_logits.argmax(-1)
        probs = torch.softmax(block_logits, -1)
        conf = probs.gather(-1, x0[:, None])[:, 0]
        masked = r.x[b0:b1] == self.spec.mask_token_id
        conf = torch.where(masked, conf, torch.full_like(conf, float("-inf")))
        commit = policy(conf, **kw) & masked
        r.x[b0:b1] = torch.where(commit, x0, r.x[b0:b1])
        if not (r.x[b0:b1] == self.spec.mask_token_id).any():  # block finished
            gen = r.x[len(r.prompt): b1]
            if (gen == self.spec.eos_token_id).any() or r.block + 1 == len(r.blocks):
                r.done = True
                r.seconds = time.perf_counter() - r.t0
            else:
                r.block += 1
                r.fresh_block = True

    def _forward(self, reqs: list[_Request], windows, cache: str):
        """One batched model call over each request's window; returns per-request logits and new K/V."""
        B = len(reqs)
        L = max(w1 - w0 for w0, w1 in windows)
        uses_cache = [r.kv is not None and w0 > 0 for r, (w0, _) in zip(reqs, windows)]
        P = max((r.cached if u else 0) for r, u in zip(reqs, uses_cache))
        dev = self.device
        ids = torch.full((B, L), self.spec.eos_token_id, dtype=torch.long, device=dev)
        pos = torch.zeros((B, L), dtype=torch.long, device=dev)
        q_valid = torch.zeros((B, L), dtype=torch.bool, device=dev)
        p_valid = torch.zeros((B, P), dtype=torch.bool, device=dev)
        p_pos = torch.zeros((B, P), dtype=torch.long, device=dev)
        past = None
        if P > 0:
            ref = next(r.kv for r in reqs if r.kv is not None)
            past = [(ref[i][0].new_zeros(B, ref[i][0].shape[1], P, ref[i][0].shape[3]),
                     ref[i][1].new_zeros(B, ref[i][1].shape[1], P, ref[i][1].shape[3])) for i in range(len(ref))]
        for b, (r, (w0, w1)) in enumerate(zip(reqs, windows)):
            n = w1 - w0
            ids[b, :n] = r.x[w0:w1]
            pos[b, :n] = torch.arange(w0, w1, device=dev)
            q_valid[b, :n] = True
            if uses_cache[b]:
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
        out_logits = [logits[b, : w1 - w0] for b, (w0, w1) in enumerate(windows)]
        out_kv = [[(k[b: b + 1, :, : w1 - w0], v[b: b + 1, :, : w1 - w0]) for k, v in kv]
                  for b, (w0, w1) in enumerate(windows)]
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
        return GenerationResult(r.prompt, gen, r.nfe, r.seconds, reason)
