"""Typed decoding configuration (msgspec), validated with errors that name the field and the allowed values."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Threshold = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]


class DecodeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Knobs of the reference engine's methods (``psd generate/eval --config JSON``).

    - ``threshold``: confidence threshold tau of the ``confidence`` method, in (0, 1].
    - ``cache``: ``none`` | ``prefix`` (LLaDA, Dream; default) | ``block`` (SDAR, exact; default for SDAR).
    - ``temperature``: 0 is greedy; > 0 samples with Gumbel noise in float64 (LLaDA ``generate.py``).
    - ``seed``: seed of the sampling noise.
    - ``batch_size``: requests decoded together in one model call.
    """

    threshold: Threshold = 0.9
    cache: Literal["none", "prefix", "block"] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    seed: int = 0
    batch_size: Annotated[int, msgspec.Meta(ge=1)] = 64


class ConfigError(ValueError):
    """A user-supplied configuration is invalid; the message names the field."""


def parse_config(text: str | None, cls=DecodeConfig, where: str = "--config"):
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
    values = [a for t in typing.get_args(hint) or (hint,) for a in typing.get_args(t)
              if typing.get_origin(t) is Literal]
    return f"; allowed: {', '.join(map(str, values))}" if values else ""
