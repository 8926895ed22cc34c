"""Greedy (or sampled) decoding of an autoregressive Llama-format model with transformers: the AR baseline.

One forward per generated token (``nfe = len(token_ids)``), batched with left padding and a KV cache.
"""

from __future__ import annotations

import time

import torch

from .outputs import GenerationResult


class AREngine:
    def __init__(self, model):
        self.model = model.eval()
        self.eos = model.config.eos_token_id
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu") -> "AREngine":
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
                 batch_size: int = 64, **_) -> list[GenerationResult]:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {max_tokens})")
        limit = self.model.config.max_position_embeddings
        out: list[GenerationResult] = []
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s: s + batch_size]
            for p in chunk:
                if not p:
                    raise ValueError("empty prompt: at least one token is needed")
                if len(p) + max_tokens > limit:
                    raise ValueError(f"prompt of {len(p)} tokens + max_tokens {max_tokens} exceeds the model's "
                                     f"context of {limit} tokens")
            t0 = time.perf_counter()
            L = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), L), self.eos, dtype=torch.long)
            att = torch.zeros((len(chunk), L), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, L - len(p):] = torch.tensor(p)
                att[i, L - len(p):] = 1
            kw = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                                 "top_k": 0, "top_p": 1.0}
            if temperature > 0:
                torch.manual_seed(seed)
            gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                      max_new_tokens=max_tokens, eos_token_id=self.eos, pad_token_id=self.eos, **kw)
            dt = time.perf_counter() - t0
            for i, p in enumerate(chunk):
                toks = gen[i, L:].tolist()
                reason = "length"
                if self.eos in toks:
                    toks = toks[: toks.index(self.eos) + 1]
                    reason = "stop"
                out.append(GenerationResult(list(p), toks, len(toks), dt, reason))
        return out
