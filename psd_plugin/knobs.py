"""Decoding knobs shared by every entry point (the ``psd`` command's ``--config`` and vLLM's
``speculative_config``): msgspec schemas validated with errors that name the field and the allowed values.
The dLLM knobs and their resolution live in :mod:`model_executor.decode_config`; PRESTO's tree knobs here."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from model_executor.decode_config import ConfigError, DecodeKnobs  # noqa: F401  (re-exported: the schemas' home)


class TreeKnobs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """PRESTO tree drafting for an AR target (PRESTO §4, Alg. 1-2; ``model_executor/decoding/tree.py``).

    - ``search``: ``beam`` (Alg. 1, default) | ``best_first`` (Alg. 2) | ``linear`` (the drafter's top-1 chain).
    - ``tree_budget``: node budget B (draft tokens verified per target forward).
    - ``width``, ``top_b``: beam width W and children per expansion b.
    - ``lam``: λ of the prefix correction; ``adaptive_beta`` (with ``adaptive_c``): λ(H) = β H / (H + C) instead.
    - ``draft_len``: positions the drafter proposes per round (default: its block).
    - ``candidates``: per-depth candidate tokens (top of q_d) a node's children are chosen from.
    - ``drafter``, ``ngram``: drafter checkpoint and n-gram file (default: the embedded ones).
    """

    search: Literal["linear", "beam", "best_first"] = "beam"
    tree_budget: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 128
    width: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 10
    top_b: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 10
    lam: Annotated[float, msgspec.Meta(ge=0.0)] = 0.2
    adaptive_beta: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    adaptive_c: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    draft_len: Annotated[int, msgspec.Meta(ge=1, le=256)] | None = None
    candidates: Annotated[int, msgspec.Meta(ge=1)] = 64
    drafter: str | None = None
    ngram: str | None = None

    def tree_kwargs(self) -> dict:
        """Keyword arguments of :meth:`model_executor.presto_engine.PrestoEngine.generate`."""
        return {"search": self.search, "tree_budget": self.tree_budget, "width": self.width, "top_b": self.top_b,
                "lam": self.lam, "adaptive": (self.adaptive_beta, self.adaptive_c) if self.adaptive_beta else None,
                "draft_len": self.draft_len, "candidates": self.candidates}


def parse_config(text: str | bytes | None, cls, where: str = "--config"):
    """Decode JSON text into ``cls``; any problem becomes a one-line :class:`ConfigError`."""
    if not text:
        return cls()
    try:
        return msgspec.json.decode(text.encode() if isinstance(text, str) else text, type=cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        if "unknown field" in msg:
            allowed = ", ".join(cls.__struct_fields__)
            raise ConfigError(f"{where}: {msg}; allowed fields: {allowed}") from None
        raise ConfigError(f"{where}: {msg}{_allowed_values(cls, msg)}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None


def _allowed_values(cls, msg: str) -> str:
    """'; allowed: a, b' for an enum field named in a msgspec error message (else '')."""
    import re
    import typing

    m = re.search(r"at `\$\.(\w+)`", msg)
    if "Invalid enum value" not in msg or not m:
        return ""
    hint = typing.get_type_hints(cls).get(m.group(1))
    options = [hint] if typing.get_origin(hint) is Literal else typing.get_args(hint)
    values = [a for t in options if typing.get_origin(t) is Literal for a in typing.get_args(t)]
    return f"; allowed: {', '.join(map(str, values))}" if values else ""


def resolve_for_model(method: str, knobs: DecodeKnobs, spec, model_dir, block_size: int | None = None,
                      where: str = "config"):
    """:func:`model_executor.decode_config.resolve` with Spiffy's draft graph loaded from ``knobs.graph`` (or
    the one shipped for the model) and checked: the one resolution every entry point uses."""
    from model_executor.decode_config import resolve

    graph = None
    if method == "spiffy":
        block = spec.attention_block if spec.attention == "block_causal" else block_size or 8
        graph = spiffy_graph(knobs, model_dir, block, where=f"{where}.graph")
    return resolve(method, knobs, spec, block_size=block_size, graph=graph, where=where)


def spiffy_graph(knobs: DecodeKnobs, model_dir, block_size: int, where: str = "graph"):
    """The Spiffy draft graph for a run (``knobs.graph``, or the one shipped for the model and policy),
    checked against the run: base policy, block size and model name must match."""
    from pathlib import Path

    from model_executor.decoding import load_graph

    from . import default_graph

    path = Path(knobs.graph) if knobs.graph else default_graph(model_dir, knobs.policy)
    name = Path(model_dir).resolve().name
    if not knobs.graph and not path.exists():
        raise ConfigError(f"method 'spiffy': no draft graph shipped for {name} with policy {knobs.policy!r}; "
                          f"make one with `psd calibrate` and set {where!r} to its path")
    try:
        g = load_graph(path)
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if g.base_policy != knobs.policy:
        raise ConfigError(f"draft graph {path}: calibrated for base_policy {g.base_policy!r}, but policy is "
                          f"{knobs.policy!r}")
    if g.block_size != block_size:
        raise ConfigError(f"draft graph {path}: calibrated with block_size {g.block_size}, this run uses "
                          f"{block_size}")
    if g.model != name:
        raise ConfigError(f"draft graph {path}: calibrated on model {g.model!r}, not {name!r}")
    return g
