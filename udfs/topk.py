"""The top-k kernel of ``einsum_topk``: each result tile cut to its ``k`` largest elements per row.

A row is every output label but the last; the last label is ranked. Order: value descending,
NaN after every number, ties by the smaller index (numpy's stable argsort of the negated values
orders them so). Only these candidates leave the kernel, as
``[{r: row number (C order over the row labels), i: index of the last label, v: value}, ...]``
per tile; SQL ranks the candidates of a row across tiles (``sql_templates/topk.sql``).

>>> x = np.array([[3, 1, 3, 2], [0, 5, 5, 5]])
>>> rows, cols = row_top(x, 2)
>>> cols.reshape(2, 2).tolist()
[[0, 2], [1, 2]]
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from .pool import WORKERS, run_tasks
from .register import _key_rows, _spec
from .tiles import blob_views, tile_view

SQL_TYPES = {
    "bool": "BOOLEAN",
    "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT",
    "uint8": "UTINYINT", "uint16": "USMALLINT", "uint32": "UINTEGER", "uint64": "UBIGINT",
    "float32": "FLOAT", "float64": "DOUBLE",
}
# a task handles at least this many elements: below it, splitting costs more than it saves
MIN_TASK_ELEMENTS = 1 << 16


def _row_top_nan(x: np.ndarray, nan: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows holding NaN: a full stable sort (rare; NaN ranks after every number)."""
    R, L = x.shape
    cols = np.broadcast_to(np.arange(L), x.shape)
    order = np.lexsort((cols, -np.where(nan, 0, x), nan), axis=-1)[:, :k]
    return np.repeat(np.arange(R), k), order.reshape(-1)


def row_top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of the ``k`` largest elements of every row of the 2-D ``x`` (all of a row
    when it has at most ``k``), in no particular order within a row."""
    R, L = x.shape
    if L <= k:
        return np.repeat(np.arange(R), L), np.tile(np.arange(L), R)
    if x.dtype == np.bool_:
        x = x.view(np.uint8)
    if x.dtype.kind == "f":
        nan = np.isnan(x)
        if nan.any():
            return _row_top_nan(x, nan, k)
    # the k-th largest value of each row; everything at least as large is a candidate
    thr = np.partition(x, L - k, axis=1)[:, L - k:L - k + 1]
    take = x >= thr
    over = np.nonzero(np.count_nonzero(take, axis=1) > k)[0]
    if over.size:  # ties at the threshold: keep the ones with the smallest index
        sub, t = x[over], thr[over]
        gt = sub > t
        eq = sub == t
        need = k - np.count_nonzero(gt, axis=1)[:, None]
        take[over] = gt | (eq & (np.cumsum(eq, axis=1) <= need))
    return np.nonzero(take)


def _tile_candidates(x2: np.ndarray, key: list[int], ext: tuple[int, ...], shape, tile, k: int, row0: int):
    """Candidates of rows ``row0 ..`` of one tile (``x2``: those rows, 2-D), in global numbering."""
    rows, cols = row_top(x2, k)
    values = x2[rows, cols]
    rows = rows + row0
    if len(ext) > 1:
        local = np.unravel_index(rows, ext[:-1])
        glob = tuple(q + kk * t for q, kk, t in zip(local, key[:-1], tile[:-1]))
        r = np.ravel_multi_index(glob, tuple(shape[:-1])).astype(np.int64, copy=False)
    else:
        r = np.zeros(rows.size, dtype=np.int64)
    i = (cols + key[-1] * tile[-1]).astype(np.int64, copy=False)
    return r, i, values


def topk_tiles(spec_arr, keys_arr, tile_arr) -> pa.Array:
    spec = json.loads(_spec(spec_arr))
    shape, tile, dtype, k = spec["shape"], spec["tile"], np.dtype(spec["dtype"]), int(spec["k"])
    keys = [kk.tolist() for kk in _key_rows(keys_arr)]
    views = blob_views(tile_arr)
    parts: list[list] = []  # per tile, the candidates of each of its row blocks
    tasks = []
    for g, (key, raw) in enumerate(zip(keys, views)):
        ext = tuple(min(t, n - q * t) for q, n, t in zip(key, shape, tile))
        x = tile_view(raw, dtype, ext)
        x2 = x.reshape(-1, ext[-1]) if ext[-1] else x.reshape(0, 0)
        # rows in blocks, so several workers share one big tile
        n_blocks = max(1, min(2 * WORKERS, x2.size // MIN_TASK_ELEMENTS, x2.shape[0]))
        bounds = [x2.shape[0] * b // n_blocks for b in range(n_blocks + 1)]
        slots = [None] * n_blocks
        parts.append(slots)
        for b in range(n_blocks):
            def task(b=b, slots=slots, x2=x2, key=key, ext=ext, lo=bounds[b], hi=bounds[b + 1]):
                slots[b] = _tile_candidates(x2[lo:hi], key, ext, shape, tile, k, lo)

            tasks.append(task)
    if tasks:
        run_tasks(tasks)
    counts = [sum(p[0].size for p in slots) for slots in parts]
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flat = [p for slots in parts for p in slots]

    def cat(q, dt):
        return np.concatenate([p[q] for p in flat]) if flat else np.empty(0, dt)

    structs = pa.StructArray.from_arrays(
        [pa.array(cat(0, np.int64)), pa.array(cat(1, np.int64)), pa.array(cat(2, dtype))], names=["r", "i", "v"])
    return pa.ListArray.from_arrays(pa.array(offsets), structs)


def register_topk(con) -> None:
    """Register the top-k kernels on ``con``, one per value type."""
    import duckdb

    text = duckdb.sqltype("VARCHAR")
    keys = duckdb.list_type(duckdb.sqltype("BIGINT"))
    blob = duckdb.sqltype("BLOB")
    bigint = duckdb.sqltype("BIGINT")
    for dtype, sqltype in SQL_TYPES.items():
        cand = duckdb.list_type(duckdb.struct_type({"r": bigint, "i": bigint, "v": duckdb.sqltype(sqltype)}))
        con.create_function(f"eds_topk_{dtype}", topk_tiles, [text, keys, blob], cand, type="arrow",
                            side_effects=False)
