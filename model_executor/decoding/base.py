"""The engine-agnostic decoding protocol: a :class:`BlockDecoder` decodes one block of one request.

An engine drives it like this (one model call per loop, shared by all requests of a batch)::

    dec = make_decoder(block_tokens, ...)
    while not dec.done:
        canvases = dec.canvases()          # >= 1 versions of the block to forward (the current state, drafts...)
        logits = forward(canvases)         # per canvas [block_len, V], row i predicts block position i
        dec.update(logits)                 # commits; may commit more without a forward (reused predictions)

Each canvas is forwarded in the same context (same prefix K/V, same window), so a canvas equal to a
state that plain decoding would reach gets *exactly* the prediction plain decoding would compute there:
that is what makes FreeDave and Spiffy lossless and lets every method reuse a verified prediction
instead of running the model again. Decoders hold no engine objects: only token tensors and logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Prediction:
    """The model's view of one block state: greedy tokens and their probabilities (float64)."""

    tokens: torch.Tensor  # [L] argmax (or sampled) token per position
    conf: torch.Tensor  # [L] probability of that token; -inf at positions already decoded
    probs: torch.Tensor | None = None  # [L, V] full distribution, kept when a decoder needs ranks beyond top-1


def predict(logits: torch.Tensor, state: torch.Tensor, mask_id: int, keep_probs: bool = False,
            temperature: float = 0.0, generator: torch.Generator | None = None) -> Prediction:
    """Greedy (or Gumbel-max sampled, LLaDA ``generate.py``) tokens and confidences over masked positions."""
    logits = logits.double()
    if temperature > 0:
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64).clamp_min(1e-300)
        tokens = (logits / temperature - torch.log(-torch.log(u))).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    probs = torch.softmax(logits, -1)
    conf = probs.gather(-1, tokens[:, None])[:, 0]
    conf = torch.where(state == mask_id, conf, torch.full_like(conf, float("-inf")))
    return Prediction(tokens, conf, probs if keep_probs else None)


def commit(state: torch.Tensor, pred: Prediction, positions: torch.Tensor) -> torch.Tensor:
    """A new state with ``pred.tokens`` written at the boolean ``positions``."""
    return torch.where(positions, pred.tokens, state)


class BlockDecoder:
    """Base class: state handling shared by every method. Subclasses implement ``canvases``/``update``."""

    def __init__(self, block: torch.Tensor, mask_id: int):
        self.state = block.clone()
        self.mask_id = mask_id
        self.forwards = 0  # model calls this block took

    @property
    def masked(self) -> torch.Tensor:
        return self.state == self.mask_id

    @property
    def done(self) -> bool:
        return not bool(self.masked.any())

    def canvases(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def update(self, logits: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        """Method-specific counters (accepted drafts ...), summed over blocks by the engine."""
        return {}


def merge_stats(all_stats) -> dict:
    """Sum per-request method counters (ints, or per-node lists) into one dict."""
    out: dict = {}
    for st in all_stats:
        for k, v in st.items():
            old = out.get(k)
            out[k] = v if old is None else ([a + b for a, b in zip(old, v)] if isinstance(v, list) else old + v)
    return out
