"""Tiles as bytes: zero-copy numpy views of Arrow binary columns, and Arrow binary columns
written straight from one numpy buffer. A tile is the raw C-order bytes of a dense array."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from eindecomp_sql.plan.tiling import grid as tiling_grid


def _as_array(arr) -> pa.Array:
    if isinstance(arr, pa.ChunkedArray):
        return arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    return arr


def blob_views(arr) -> list[memoryview | np.ndarray]:
    """One uint8 numpy view per element of a binary / large_binary / binary_view array."""
    arr = _as_array(arr)
    t = arr.type
    n = len(arr)
    if pa.types.is_binary_view(t) or pa.types.is_string_view(t):
        arr = arr.cast(pa.large_binary())
        t = arr.type
    bufs = arr.buffers()
    off_dtype = np.int64 if pa.types.is_large_binary(t) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=off_dtype, count=n + 1, offset=arr.offset * off_dtype().itemsize)
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.empty(0, np.uint8)
    return [data[offsets[i]:offsets[i + 1]] for i in range(n)]


def tile_view(raw: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Read-only view of one tile's bytes as an array of ``shape``."""
    count = int(np.prod(shape, dtype=np.int64))
    if raw.nbytes != count * dtype.itemsize:
        raise ValueError(f"tile holds {raw.nbytes} bytes, expected {count} x {dtype} for shape {shape}")
    return raw.view(dtype).reshape(shape)


class TileWriter:
    """One output buffer for a batch of tiles of known shapes; ``array()`` wraps it in Arrow
    without copying."""

    def __init__(self, dtype: np.dtype, shapes: list[tuple[int, ...]]):
        self.dtype = np.dtype(dtype)
        counts = np.array([int(np.prod(s, dtype=np.int64)) for s in shapes], dtype=np.int64)
        self.offsets = np.zeros(len(shapes) + 1, dtype=np.int64)
        np.cumsum(counts * self.dtype.itemsize, out=self.offsets[1:])
        self.buffer = np.empty(int(self.offsets[-1]), dtype=np.uint8)
        self.shapes = shapes
        self.nulls: set[int] = set()  # tiles left on the device: NULL in the array (udfs/register.py)

    def out(self, k: int) -> np.ndarray:
        a, b = self.offsets[k], self.offsets[k + 1]
        return self.buffer[a:b].view(self.dtype).reshape(self.shapes[k])

    def array(self) -> pa.Array:
        if not self.nulls:
            return _binary(self.offsets, self.buffer)
        # a NULL row keeps its slot of the buffer (never written, so never paged in): Arrow
        # leaves the bytes under a null unspecified, and DuckDB reads none of them
        valid = np.ones(len(self.shapes), dtype=bool)
        valid[list(self.nulls)] = False
        return _binary(self.offsets, self.buffer, pa.array(valid).buffers()[1])


# Below 2 GiB a batch of tiles goes back as Arrow `binary` (32-bit offsets): DuckDB ingests it
# ~30 ms faster per 64 MB than `large_binary` (CREATE TABLE AS from a UDF: 93 ms against 131 ms).
_SMALL = (1 << 31) - 1


def _binary(offsets: np.ndarray, buffer: np.ndarray, validity: pa.Buffer | None = None) -> pa.Array:
    n = len(offsets) - 1
    if offsets[-1] <= _SMALL:
        return pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(offsets.astype(np.int32)),
                                                      pa.py_buffer(buffer)])
    return pa.Array.from_buffers(pa.large_binary(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(buffer)])


def tiles_to_arrow(tiles: list[np.ndarray]) -> pa.Array:
    """Pack C-order tiles into one large_binary array (one copy, into one buffer)."""
    if len(tiles) == 1 and tiles[0].flags.c_contiguous:
        t = tiles[0]
        return _binary(np.array([0, t.nbytes], dtype=np.int64), t.reshape(-1).view(np.uint8))
    w = TileWriter(tiles[0].dtype if tiles else np.uint8, [t.shape for t in tiles])
    for k, t in enumerate(tiles):
        w.out(k)[...] = t
    return w.array()


def tiles_from_array(array: np.ndarray, tile: tuple[int, ...], keys: tuple[str, ...]) -> pa.Table:
    """Cut ``array`` into C-order tiles: a table of one int64 key column per dimension + tile.

    Tiles are raw bytes that kernels read in the machine's byte order, so an array in the
    other order is converted here too (callers pass native arrays; this is the last guard)."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    shape = array.shape
    coords = _tile_coords(shape, tile)
    tiles = []
    for c in coords:
        idx = tuple(slice(k * t, min((k + 1) * t, n)) for k, t, n in zip(c, tile, shape))
        tiles.append(array[idx])
    if len(tiles) == 1:
        tiles = [np.ascontiguousarray(tiles[0])]
    cols = {k: pa.array(coords[:, p].astype(np.int64)) for p, k in enumerate(keys)}
    cols["tile"] = tiles_to_arrow(tiles)
    return pa.table(cols)


def null_tiles(shape, tile, keys: tuple[str, ...]) -> pa.Table:
    """The keys of every tile of a ``shape`` array cut into ``tile``, and a NULL tile column:
    an operand whose kernels read the array itself (udfs/register.py: ``_host_tile``)."""
    coords = _tile_coords(shape, tile)
    cols = {k: pa.array(coords[:, p].astype(np.int64)) for p, k in enumerate(keys)}
    cols["tile"] = pa.nulls(len(coords), pa.binary())
    return pa.table(cols)


def _tile_coords(shape, tile) -> np.ndarray:
    """Every tile's keys, one row per tile (C order), one column per axis."""
    grid = list(tiling_grid(shape, tile))
    return np.indices(grid).reshape(len(grid), -1).T if grid else np.zeros((1, 0), dtype=np.int64)


def array_from_tiles(table: pa.Table, shape, tile, dtype, keys, out: np.ndarray | None = None) -> np.ndarray:
    """Assemble the dense array from a tiled table (any row order). ``out``: the array to fill,
    which already holds the tiles that are NULL in the table (a kernel wrote them there)."""
    dtype = np.dtype(dtype)
    out = np.empty(shape, dtype=dtype) if out is None else out
    if table.num_rows == 0:
        return out
    key_cols = [table.column(k).to_numpy() for k in keys]
    column = table.column("tile")
    valid = None if column.null_count == 0 else column.is_valid().to_numpy(zero_copy_only=False)
    views = blob_views(column)
    for r, raw in enumerate(views):
        if valid is not None and not valid[r]:
            continue
        idx = tuple(
            slice(int(kc[r]) * t, min((int(kc[r]) + 1) * t, n)) for kc, t, n in zip(key_cols, tile, shape)
        )
        out[idx] = tile_view(raw, dtype, tuple(s.stop - s.start for s in idx))
    return out
