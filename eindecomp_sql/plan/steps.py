"""The frozen plan IR: tiled values and the steps between them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from ..graph import EinsumNode
from .tiling import grid


@dataclass(frozen=True)
class TiledValue:
    """A value stored as a tiled table: one key column per dimension plus a ``tile`` column.

    ``table`` is None for the result of a plan that returns rows instead of creating a table.
    ``temporary`` values live only while the plan runs.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    tile: tuple[int, ...]
    keys: tuple[str, ...]
    table: str | None
    temporary: bool = False

    @property
    def grid(self) -> tuple[int, ...]:
        return grid(self.shape, self.tile)

    @property
    def nbytes(self) -> int:
        """Size of the tile data, in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class RetileStep:
    """Re-cut ``source`` into ``target.tile``: slice each source tile into the pieces that
    overlap target tiles, then concatenate the pieces of each target tile. Peak memory is one
    target tile plus the pieces that make it: no step gathers the whole tensor."""

    source: TiledValue
    target: TiledValue

    @property
    def projected_bytes(self) -> int:
        """Bytes moved through the step: every element once as a piece, once assembled."""
        return 2 * self.source.nbytes

    def describe(self) -> str:
        return f"retile {self.source.name} {self.source.tile} -> {self.target.tile}"


@dataclass(frozen=True)
class EinsumStep:
    """One einsum node run as a join of tiled tables plus tile kernels.

    ``chunk`` is the tile size chosen for every label. When a reduced label has more than one
    piece, partial results meet in a GROUP BY and the kernel contracts the whole group per call
    (``grouped``); otherwise every joined row is one output tile.
    """

    node: EinsumNode
    inputs: tuple[TiledValue, ...]
    result: TiledValue
    chunk: tuple[tuple[str, int], ...]

    @property
    def tile_of(self) -> dict[str, int]:
        return dict(self.chunk)

    @property
    def pieces(self) -> dict[str, int]:
        size = self.node.size
        return {lab: -(-size[lab] // t) for lab, t in self.chunk}

    @property
    def grouped(self) -> bool:
        pieces = self.pieces
        return any(pieces[lab] > 1 for lab in self.node.reduced)

    @property
    def projected_bytes(self) -> int:
        """Bytes the join feeds the kernels: each input once per piece of labels it lacks."""
        pieces = self.pieces
        total = 0
        for op, value in zip(self.node.operands, self.inputs):
            rep = 1
            for lab, n in pieces.items():
                if lab not in op.labels:
                    rep *= n
            total += value.nbytes * rep
        return total

    def describe(self) -> str:
        p = self.pieces
        chunks = " ".join(f"{lab}:{p[lab]}" for lab in self.node.labels)
        return f"einsum {self.node.describe()} [{chunks}] -> {self.result.name}"


Step = Union[RetileStep, EinsumStep]


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    inputs: tuple[TiledValue, ...]
    result: TiledValue

    @property
    def projected_bytes(self) -> int:
        return sum(s.projected_bytes for s in self.steps)

    def explain(self) -> str:
        lines = [f"plan: {len(self.steps)} step(s), {self.projected_bytes / 1e6:.1f} MB through kernels"]
        for v in self.inputs:
            lines.append(f"  input {v.name}: shape {v.shape} {v.dtype} tile {v.tile} grid {v.grid}")
        for k, s in enumerate(self.steps):
            lines.append(f"  step {k}: {s.describe()} ({s.projected_bytes / 1e6:.1f} MB)")
        r = self.result
        lines.append(f"  result {r.name}: shape {r.shape} {r.dtype} tile {r.tile} grid {r.grid}")
        return "\n".join(lines)
