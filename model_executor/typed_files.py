"""Versioned msgspec files (Spiffy draft graphs, n-gram tables): one reader with one-line errors naming the path."""

from __future__ import annotations

from pathlib import Path

import msgspec


def read_typed(path: str | Path, cls: type, what: str):
    """Decode ``path`` as ``cls``; a missing or corrupt file raises one line naming ``what`` and the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path}: no such file")
    try:
        return msgspec.json.decode(path.read_bytes(), type=cls)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ValueError(f"{what} {path}: not a valid {what} file ({e})") from None
