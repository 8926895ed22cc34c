"""The ``psd`` command's ``--config`` (msgspec): the shared decoding knobs plus what only an offline run sets."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .knobs import DecodeKnobs, TreeKnobs

Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
BatchSize = Annotated[int, msgspec.Meta(ge=1)]


class TreeConfig(TreeKnobs, forbid_unknown_fields=True, kw_only=True):
    """``psd generate/eval --config JSON`` for AR targets (``--method ar | linear | presto``): the tree knobs
    plus ``temperature`` (sampling from the target; lossless with trees), ``seed`` and ``batch_size``."""

    temperature: Temperature = 0.0
    seed: int = 0
    batch_size: BatchSize = 64


class RunConfig(DecodeKnobs, forbid_unknown_fields=True, kw_only=True):
    """``psd generate/eval --config JSON`` for dLLMs: the method knobs (:class:`DecodeKnobs`) plus

    - ``temperature``: 0 is greedy; > 0 samples, every method, by Gumbel-max with the noise in float64 (LLaDA
      ``generate.py``), a function of the seed, the position and the step (:mod:`model_executor.decoding.sampling`:
      FreeDave and Spiffy sample their base policy's tokens losslessly).
    - ``seed``: seed of the sampling noise.
    - ``batch_size``: requests decoded together in one model call.
    """

    temperature: Temperature = 0.0
    seed: int = 0
    batch_size: BatchSize = 64

    def knobs(self) -> DecodeKnobs:
        """The method knobs alone (what :func:`~psd_plugin.knobs.resolve_for_model` resolves)."""
        raw = msgspec.structs.asdict(self)
        return DecodeKnobs(**{k: raw[k] for k in DecodeKnobs.__struct_fields__})
