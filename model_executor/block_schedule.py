"""Where each block of an answer lies and which positions a decoding step forwards: shared by both engines.

A request decodes the answer region ``[P, P + max_tokens)`` block by block. Each step forwards a *window*
``[w0, w1)`` of positions; the K/V of ``[0, w0)`` comes from the KV cache. :class:`CacheSchedule` is the single
definition of that bookkeeping, so the reference engine and the vLLM runner forward exactly the same
tokens at exactly the same positions (which is what makes their outputs comparable token for token).

Cache modes: ``none`` (recompute everything every step), ``prefix`` (Fast-dLLM prefix cache: the first
step of a block recomputes everything, later steps reuse the K/V before the block), ``dual`` (Fast-dLLM
DualCache: as ``prefix``, and the first step also keeps the K/V of the masks after the block, so later
steps forward the block alone against the cached prefix and that kept suffix), ``block`` (SDAR: the K/V of
finished, model-aligned attention blocks is exact and reused).

Two approximations make a bidirectional model's steps narrower (fewer rows a forward; each changes what the
model sees, so its accuracy is measured beside its speed, ``docs/benchmarks.md``):

- ``suffix`` (``none``, ``prefix``, ``dual``): a step forwards at most ``suffix`` positions after the current
  block, not every mask to the end of the answer region (the distant masks are dropped from the window; as
  DPad's suffix window). ``None``: all of them, as Fast-dLLM.
- ``refresh`` (``prefix``, ``dual``): what the first step of a block recomputes before the block. ``full``
  (Fast-dLLM): everything from position 0; ``answer``: keeps the prompt's K/V from the request's first
  forward and recomputes the answer so far; ``last``: keeps all K/V cached so far and recomputes only from
  the previous block on (the one block whose K/V was written while it still held masks).
"""

from __future__ import annotations

from dataclasses import dataclass

CACHE_MODES = ("none", "prefix", "dual", "block")


def plan_blocks(prompt_len: int, max_tokens: int, block_size: int, aligned: bool) -> list[tuple[int, int]]:
    """``[start, end)`` of each block of the answer. ``aligned`` (SDAR) cuts at multiples of ``block_size``
    (the model's attention blocks), so the first block may be shorter."""
    end = prompt_len + max_tokens
    if aligned:
        starts = [prompt_len] + list(range((prompt_len // block_size + 1) * block_size, end, block_size))
    else:
        starts = list(range(prompt_len, end, block_size))
    return [(a, min(end, b)) for a, b in zip(starts, starts[1:] + [end])]


@dataclass(frozen=True)
class CacheSchedule:
    """How a request's steps use the KV cache (module docstring): the cache ``mode``; ``shift`` = 1 when
    position ``i`` is predicted by the output at ``i - 1`` (Dream), so a window starts one position early and
    the block's first prediction is exact (a choice; Fast-dLLM reuses the block's own first output there);
    ``attention_block``: the model's attention block (``block`` mode); ``suffix`` and ``refresh``: the two
    approximations."""

    mode: str = "prefix"
    shift: int = 0
    attention_block: int = 1
    suffix: int | None = None
    refresh: str = "full"

    def end(self, block: tuple[int, int], total: int) -> int:
        """Where a step of ``block`` stops: the end of the answer region, or ``suffix`` positions after the block."""
        return total if self.suffix is None else min(total, block[1] + self.suffix)

    def window(self, block: tuple[int, int], total: int, *, fresh: bool, cached: int,
               prompt_len: int) -> tuple[int, int]:
        """``[w0, w1)``: the positions one step forwards. ``fresh``: first step of the block; ``cached``: the
        leading positions whose K/V is in the cache."""
        b0, b1 = block
        if self.mode == "block":
            return cached, b1
        end = self.end(block, total)
        if self.mode == "none":
            return 0, end
        if not fresh:
            return b0 - self.shift, end if self.mode == "prefix" else b1
        start = {"full": 0, "answer": min(cached, prompt_len - self.shift), "last": cached}[self.refresh]
        return start, end

    def cached_after(self, block: tuple[int, int], w0: int, *, fresh: bool, cached: int) -> int:
        """Length of the K/V prefix the next step reads from the cache, after a step that forwarded from ``w0``.

        ``prefix``, ``dual``: the first step of a block stores everything before the block (``b0 - shift``).
        ``block``: everything before the block's aligned start ``a0`` is final once a forward has covered it."""
        b0, _ = block
        if self.mode in ("prefix", "dual"):
            return b0 - self.shift if fresh else cached
        if self.mode == "block":
            a0 = b0 // self.attention_block * self.attention_block
            return a0 if w0 < a0 else cached
        return 0

    def written_prefix(self, n: int) -> int:
        """Of ``n`` leading positions whose K/V the serving engine wrote before a request's first step (a
        prefix-cache hit, or a plain prefill of the prompt), the prefix that step may read rather than forward:
        under ``block`` the whole attention blocks (a position sees its own block and those before it, so their
        K/V is final); under the other modes none (a bidirectional prompt's K/V depends on the canvas after it)."""
        return n // self.attention_block * self.attention_block if self.mode == "block" else 0

    def kept_suffix(self, block: tuple[int, int], total: int) -> tuple[int, int]:
        """``[s0, s1)``: the positions after the block whose K/V ``dual`` keeps from the block's first step (the
        masks after it, as they were then) for the block's later steps; empty for the other modes."""
        _, b1 = block
        return (b1, self.end(block, total)) if self.mode == "dual" else (total, total)

    def first_window_end(self, prompt_len: int, max_tokens: int, block_size: int, aligned: bool) -> int:
        """Where a request's first step ends (``w1`` of its first block's first window, nothing cached yet): the
        positions ``[prompt_len, w1)`` are its first canvas, all masks. vLLM's scheduler forwards them with the
        prompt (:class:`psd_plugin.vllm.scheduler.DLLMScheduler`)."""
        blocks = plan_blocks(prompt_len, max_tokens, block_size, aligned)
        return self.window(blocks[0], prompt_len + max_tokens, fresh=True, cached=0, prompt_len=prompt_len)[1]
