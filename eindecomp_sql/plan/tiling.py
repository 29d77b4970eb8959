"""Tile arithmetic. A dimension of size n cut into tiles of size t has ceil(n/t) pieces; the
piece with key q covers [q*t, min((q+1)*t, n)). Edge pieces are smaller, never padded: padding
with zeros would be wrong for max, min and prod aggregations.

>>> grid((10, 4), (4, 4))
(3, 1)
>>> Chunking.from_pieces({"i": 10, "j": 4}, {"i": 3, "j": 1}).tile_of
{'i': 4, 'j': 4}
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from ..errors import EinsumError

# Tiles are the unit one kernel call works on and one DuckDB row carries. Measured on 2 cores
# (docs/DESIGN.md): every byte that crosses DuckDB <-> Arrow costs ~1 ns, so fewer, larger
# tiles win until a tile no longer fits comfortably in memory; the kernels split large tiles
# across the cores themselves. A fixed cap made a cliff just above it: a 6000² float64 GEMM
# (288 MB operands) under a 64 MiB cap was cut into a grouped plan with a retile and took
# 3.4x numpy's time where one tile each took 1.13x (docs/DESIGN.md, "Tile size"). So the cap
# follows the machine: a 32nd of its memory (a step holds ~4 tiles: two operands, the result
# in Arrow and in DuckDB), never below 64 MiB nor above 1 GiB (Arrow's 32-bit offsets end at 2).
MIN_TILE_BYTES = 64 << 20
MAX_TILE_BYTES = 1 << 30


def machine_tile_bytes(memory: int | None = None) -> int:
    """The default tile cap for a machine with ``memory`` bytes (default: this one's),
    rounded down to a MiB.

    >>> machine_tile_bytes(24 << 30) >> 20, machine_tile_bytes(1 << 30) >> 20, machine_tile_bytes(1 << 40) >> 20
    (768, 64, 1024)
    """
    if memory is None:
        memory = _physical_memory()
    cap = min(max(memory // 32, MIN_TILE_BYTES), MAX_TILE_BYTES)
    return cap >> 20 << 20


def _physical_memory() -> int:
    """The memory this process may use: the machine's, or its container's limit if lower
    (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``; 0 when nothing says)."""
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on a POSIX system that says
        total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 1 << 62):  # "max" and 2^63-ish: no limit
            total = int(text)
    return max(total, 0)


DEFAULT_TILE_BYTES = machine_tile_bytes()


def ceil_div(a, b):
    """``ceil(a / b)`` for positive integers (or numpy integer arrays): the one ceil-divide."""
    return -(-a // b)


def tile_of(size: int, pieces: int) -> int:
    """The tile side cutting ``size`` into ``pieces`` pieces (the last may be smaller)."""
    return ceil_div(size, pieces)


def pieces_of(size: int, tile: int) -> int:
    """How many tiles of side ``tile`` cover ``size``."""
    return ceil_div(size, tile)


def moves_whole_rows(shape, source_tile, target_tile) -> bool:
    """Whether re-tiling ``shape`` from ``source_tile`` to ``target_tile`` re-cuts its leading
    axis only. Tiles are C-order bytes, so every target tile is then byte ranges of source
    tiles put back to back: an engine with byte functions re-tiles it without a kernel
    (``SparkCompiler.rows_retile``).

    >>> moves_whole_rows((10, 6), (3, 6), (10, 6)), moves_whole_rows((10, 6), (3, 2), (4, 2))
    (True, True)
    >>> moves_whole_rows((10, 6), (3, 6), (6, 3)), moves_whole_rows((0, 6), (1, 6), (2, 6))
    (False, False)
    """
    return (len(shape) >= 1 and all(n > 0 for n in shape) and tuple(source_tile[1:]) == tuple(target_tile[1:])
            and source_tile[0] != target_tile[0])


def extent(size: int, tile: int, key: int) -> int:
    """The side of tile ``key`` of a dimension of ``size`` cut into tiles of ``tile``."""
    return min(tile, size - key * tile)


def grid(shape: tuple[int, ...], tile: tuple[int, ...]) -> tuple[int, ...]:
    """Tiles per dimension."""
    return tuple(pieces_of(n, t) for n, t in zip(shape, tile))


@dataclass(frozen=True)
class Chunking:
    """How one einsum node is cut: every label's size and tile side. The optimizer searches
    piece counts, steps and kernels read tile sides; this one type gives both."""

    sizes: tuple[tuple[str, int], ...]
    tiles: tuple[tuple[str, int], ...]  # sorted by label

    @classmethod
    def from_pieces(cls, sizes: dict[str, int], pieces: dict[str, int]) -> "Chunking":
        return cls(tuple(sorted(sizes.items())),
                   tuple(sorted((lab, tile_of(sizes[lab], d)) for lab, d in pieces.items())))

    @property
    def tile_of(self) -> dict[str, int]:
        """Label -> tile side."""
        return dict(self.tiles)

    @property
    def pieces(self) -> dict[str, int]:
        """Label -> number of pieces."""
        size = dict(self.sizes)
        return {lab: pieces_of(size[lab], t) for lab, t in self.tiles}


# ``auto_tile(square=True)`` keeps to square tiles only for arrays whose longest side is at most
# this many times the next longest (a stack of 4 square matrices stays square)
SQUARE_ASPECT = 16


def auto_tile(shape: tuple[int, ...], itemsize: int, tile_bytes: int = DEFAULT_TILE_BYTES,
              square: bool = False) -> tuple[int, ...]:
    """A tile shape of at most ``tile_bytes``: halve the longest tile side until it fits.

    Halving keeps tile sides powers-of-two fractions of the shape, so tensors of equal sizes
    get equal tilings and meet in a join without re-tiling. ``square``: at most a power of 4
    elements, so a square matrix of a power-of-two side gets square tiles (whose both keys cut
    alike: ``ij,jk`` then joins A and B as stored).

    >>> auto_tile((2048, 2048), 8, 256 << 10), auto_tile((2048, 2048), 8, 256 << 10, square=True)
    ((128, 256), (128, 128))
    """
    if square and len(shape) > 1 and sorted(shape)[-1] > SQUARE_ASPECT * max(sorted(shape)[-2], 1):
        # a tall-skinny matrix (embeddings: 200k x 768) keeps its short side whole: rounding
        # the budget down to a power of 4 cut it (391 x 384), and every product re-tiled it
        # into row panels (a projection by a 768 x 64 matrix under 200 MB: 7.2 s, 2.1 s in
        # 782 x 768 tiles); square tiles are for matrices of comparable sides meeting in joins
        square = False
    if square:
        elements = max(1, tile_bytes // max(itemsize, 1))
        tile_bytes = itemsize * (1 << (2 * ((elements.bit_length() - 1) // 2)))
    tile = [max(int(n), 1) for n in shape]
    while tile and math.prod(tile) * itemsize > tile_bytes:
        k = max(range(len(tile)), key=lambda a: tile[a])
        if tile[k] == 1:
            break
        tile[k] = ceil_div(tile[k], 2)
    return tuple(tile)


def check_count(x, what: str, minimum: int = 1) -> int:
    """``x`` as an int of at least ``minimum`` (Python or numpy integers; not bools, floats or
    strings, which ``int()`` would quietly truncate or parse)."""
    if isinstance(x, bool):
        raise EinsumError(f"{what} must be an integer >= {minimum}, got {x!r}")
    try:
        n = operator.index(x)
    except TypeError:
        raise EinsumError(f"{what} must be an integer >= {minimum}, got {x!r}") from None
    if n < minimum:
        raise EinsumError(f"{what} must be an integer >= {minimum}, got {n}")
    return n


def check_tile(shape: tuple[int, ...], tile) -> tuple[int, ...]:
    """A user's tile shape: one positive int per dimension (clipped to the shape)."""
    try:
        sides = list(tile)
    except TypeError:
        raise EinsumError(f"tile must be a tuple of ints, one per dimension, got {tile!r}") from None
    tile = tuple(check_count(t, f"tile {tuple(sides)!r}: each side") for t in sides)
    if len(tile) != len(shape):
        raise EinsumError(f"tile {tile} has {len(tile)} dimension(s) but the tensor has shape {shape}")
    if any(t < 1 for t in tile):
        raise EinsumError(f"tile {tile}: every tile side must be >= 1")
    return tuple(min(t, max(n, 1)) for t, n in zip(tile, shape))
