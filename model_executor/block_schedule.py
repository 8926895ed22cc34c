"""Where each block of an answer lies and which positions a decoding step forwards: shared by both engines.

A request decodes the answer region ``[P, P + max_tokens)`` block by block. Each step forwards a *window*
``[w0, w1)`` of positions; the K/V of ``[0, w0)`` comes from the KV cache. These functions are the single
definition of that bookkeeping, so the reference engine and the vLLM runner forward exactly the same
tokens at exactly the same positions (which is what makes their outputs comparable token for token).

Cache modes: ``none`` (recompute everything every step), ``prefix`` (Fast-dLLM prefix cache: the first
step of a block recomputes everything, later steps reuse the K/V before the block), ``dual`` (Fast-dLLM
DualCache: as ``prefix``, and the first step also keeps the K/V of the masks after the block, so later
steps forward the block alone against the cached prefix and that kept suffix), ``block`` (SDAR: the K/V of
finished, model-aligned attention blocks is exact and reused).
"""

from __future__ import annotations

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


def window(cache: str, block: tuple[int, int], total: int, *, fresh: bool, cached: int,
           shift: int) -> tuple[int, int]:
    """``[w0, w1)``: the positions one step forwards. ``fresh``: first step of the block; ``cached``: the
    exact K/V prefix length in ``block`` mode; ``shift`` = 1 when position ``i`` is predicted by the
    output at ``i - 1`` (Dream), so the window starts one position early and the block's first prediction
    is exact (a choice; Fast-dLLM reuses the block's own first output there)."""
    b0, b1 = block
    if cache == "none":
        return 0, total
    if cache in ("prefix", "dual"):
        return (0, total) if fresh else (b0 - shift, total if cache == "prefix" else b1)
    return cached, b1


def first_window_end(cache: str, prompt_len: int, max_tokens: int, block_size: int, aligned: bool) -> int:
    """Where a request's first step ends (``w1`` of its first block's first window, nothing cached yet): the
    positions ``[prompt_len, w1)`` are its first canvas, all masks. vLLM's scheduler forwards them with the
    prompt (:class:`psd_plugin.vllm.scheduler.DLLMScheduler`)."""
    blocks = plan_blocks(prompt_len, max_tokens, block_size, aligned)
    return window(cache, blocks[0], prompt_len + max_tokens, fresh=True, cached=0, shift=0)[1]


def cached_after_step(cache: str, block: tuple[int, int], w0: int, *, fresh: bool, cached: int, shift: int,
                      attention_block: int) -> int:
    """Length of the exact K/V prefix after a step that forwarded from ``w0``.

    ``prefix``, ``dual``: the first step of a block stores everything before the block (``b0 - shift``).
    ``block``: everything before the block's aligned start ``a0`` is final once a forward has covered it."""
    b0, _ = block
    if cache in ("prefix", "dual"):
        return b0 - shift if fresh else cached
    if cache == "block":
        a0 = b0 // attention_block * attention_block
        return a0 if w0 < a0 else cached
    return 0


def kept_suffix(cache: str, block: tuple[int, int], total: int) -> tuple[int, int]:
    """``[s0, s1)``: the positions after the block whose K/V ``dual`` keeps from the block's first step (the
    masks after it, as they were then) for the block's later steps; empty for the other modes."""
    _, b1 = block
    return (b1, total) if cache == "dual" else (total, total)
