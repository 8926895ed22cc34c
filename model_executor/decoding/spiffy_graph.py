"""Spiffy's draft graph file format (§4.4.1, Eqs. 4-7): formulas as nodes, an edge p -> c when c extends p.

A graph is calibrated offline (:func:`~.spiffy_calibration.calibrate`, Alg. 2), stored as JSON by
:func:`save_graph` and read back, validated, by :func:`load_graph`; the decoder (:mod:`.spiffy`) drafts from it.
A formula is a list of ``(i, j)`` pairs, both 1-based: "the j-th most likely token at the i-th most confident
masked position" (Eqs. 8-11).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from ..typed_files import read_typed

GRAPH_FORMAT_VERSION = 1


class GraphNode(msgspec.Struct, forbid_unknown_fields=True):
    formula: list[tuple[int, int]]  # (position rank i, vocabulary rank j), 1-based
    level: int
    parents: list[int]  # indices into DraftGraph.nodes
    count: int = 0  # calibration frequency


class DraftGraph(msgspec.Struct, forbid_unknown_fields=True):
    """A calibrated Spiffy draft graph, as stored on disk (JSON)."""

    format_version: int
    model: str  # the checkpoint it was calibrated on (directory name)
    block_size: int
    base_policy: str  # static | confidence
    threshold: float
    lookahead: int
    nodes: list[GraphNode]

    def validate(self, where: str = "draft graph") -> "DraftGraph":
        if self.format_version != GRAPH_FORMAT_VERSION:
            raise ValueError(f"{where}: format_version {self.format_version}; this psd-plugin reads "
                             f"{GRAPH_FORMAT_VERSION}")
        if self.base_policy not in ("static", "confidence"):
            raise ValueError(f"{where}: base_policy {self.base_policy!r}; allowed: static, confidence")
        for k, n in enumerate(self.nodes):
            if not n.formula or any(i < 1 or j < 1 for i, j in n.formula):
                raise ValueError(f"{where}: node {k} has an empty formula or a rank below 1")
            if any(p < 0 or p >= len(self.nodes) or p == k for p in n.parents):
                raise ValueError(f"{where}: node {k} has a parent index out of range")
        return self

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for k, n in enumerate(self.nodes):
            for p in n.parents:
                out[p].append(k)
        return out


def load_graph(path: str | Path) -> DraftGraph:
    """Read and validate a graph file; a missing or corrupt file is a one-line error naming the path."""
    return read_typed(path, DraftGraph, "draft graph").validate(f"draft graph {path}")


def save_graph(graph: DraftGraph, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(graph), indent=1))
