"""The top-k kernel of ``einsum_topk``: each result tile cut to its ``k`` largest elements per row.

A row is every output label but the last; the last label is ranked. Order: value descending,
NaN after every number, ties by the smaller index (numpy's stable argsort of the negated values
orders them so). Only these candidates leave the kernel, as
``[{r: row number (C order over the row labels), i: index of the last label, v: value}, ...]``
per tile; SQL ranks the candidates of a row across tiles (``compile/sql_interface.py: topk_query``).

>>> x = np.array([[3, 1, 3, 2], [0, 5, 5, 5]])
>>> rows, cols = row_top(x, 2)
>>> np.sort(cols.reshape(2, 2), axis=1).tolist()  # ties: the smaller indices win
[[0, 2], [1, 2]]
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pyarrow as pa

from .pool import THREADS, run_tasks
from .register import _key_rows, _spec, _with_arity, einsum_groups, einsum_rows
from .tiles import blob_views, tile_view
from eindecomp_sql.notation.checks import SQL_TYPES, sql_value_dtype
from eindecomp_sql.notation.numpy_impl import widened
from eindecomp_sql.plan.tiling import extent

# einsum kernels that have a fused top-k twin (a product's last step is binary after lowering)
FUSED_ARITIES = (1, 2)
# a task handles at least this many elements: below it, splitting costs more than it saves
MIN_TASK_ELEMENTS = 1 << 16


def _row_top_nan(x: np.ndarray, nan: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows holding NaN: a full stable sort (rare; NaN ranks after every number)."""
    R, L = x.shape
    cols = np.broadcast_to(np.arange(L), x.shape)
    order = np.lexsort((cols, -np.where(nan, 0, x), nan), axis=-1)[:, :k]
    return np.repeat(np.arange(R), k), order.reshape(-1)


def _row_top_partition(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exactly: the k-th largest value of each row by ``np.partition``; everything above it,
    and of the values equal to it those with the smallest indices."""
    L = x.shape[1]
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


def row_top(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of the ``k`` largest elements of every row of the 2-D ``x`` (all of a row
    when it has at most ``k``), in no particular order within a row.

    Cheap bound first: cut the first k*(L//k) elements of a row into k blocks; the smallest of
    the k block maxima is k distinct elements' minimum, so at most the row's k-th largest value.
    Only elements at or above it are candidates (typically a few times k, found in two passes
    over the tile, against a full ``np.partition`` copy), and the candidates are ordered exactly.
    Rows made to defeat the bound (ascending values) fall back to ``np.partition``.
    """
    R, L = x.shape
    if L <= k:
        return np.repeat(np.arange(R), L), np.tile(np.arange(L), R)
    if x.dtype == np.bool_:
        x = x.view(np.uint8)
    block = L // k
    bound = x[:, :k * block].reshape(R, k, block).max(axis=2).min(axis=1, keepdims=True)
    if x.dtype.kind == "f" and (np.isnan(bound).any() or np.isnan(x[:, k * block:]).any()):
        nan = np.isnan(x)  # NaN in a block maximum means NaN in the row (max propagates NaN)
        if nan.any():
            return _row_top_nan(x, nan, k)
    cand = x >= bound
    if np.count_nonzero(cand) > max(8 * k * R, x.size // 16):
        return _row_top_partition(x, k)
    rows, cols = np.nonzero(cand)
    vals = x[rows, cols]
    # by row, then value ascending, then index descending: a row's best k are its last k
    order = np.lexsort((-cols, vals, rows))
    rows, cols = rows[order], cols[order]
    counts = np.bincount(rows, minlength=R)
    ends = np.cumsum(counts)
    keep = np.arange(rows.size) >= (ends - np.minimum(counts, k))[rows]
    return rows[keep], cols[keep]


def reversed_order(x: np.ndarray) -> np.ndarray:
    """``x`` mapped so that the largest becomes the smallest, exactly, with NaN still NaN: ``-x``
    for floats, ``~x`` for integers (``-x`` overflows the smallest int, and wraps unsigned
    ones); bool as uint8. Ranking it ranks ``x`` smallest first."""
    if x.dtype == np.bool_:
        x = x.view(np.uint8)
    return -x if x.dtype.kind == "f" else ~x


def _global_rows(rows: np.ndarray, key: list[int], ext: tuple[int, ...], shape, tile) -> np.ndarray:
    """Row numbers (C order over the row labels) of a tile's local rows."""
    if len(ext) == 1:
        return np.zeros(rows.size, dtype=np.int64)
    local = np.unravel_index(rows, ext[:-1])
    glob = tuple(q + kk * t for q, kk, t in zip(local, key[:-1], tile[:-1]))
    return np.ravel_multi_index(glob, tuple(shape[:-1])).astype(np.int64, copy=False)


def _tile_candidates(x2: np.ndarray, key: list[int], ext: tuple[int, ...], shape, tile, k: int, row0: int,
                     largest: bool = True, bars=None):
    """Candidates of rows ``row0 ..`` of one tile (``x2``: those rows, 2-D), in global numbering;
    ``largest`` False: the ``k`` smallest. ``bars``: (each row's worst value still wanted, and
    whether the row has one), by global row, from a caller that has already seen other tiles
    (``ranking.tensor_topk``): elements worse are no candidates, and where every row has at most
    ``k`` others they are the candidates without a ranking (a k of 1,000 over tiles 1,563 wide
    ranked 64% of every tile: 9.6 s of 15.8)."""
    kx = x2 if largest else reversed_order(x2)
    if bars is not None and x2.size:
        bar, full = bars
        g = _global_rows(np.arange(x2.shape[0]) + row0, key, ext, shape, tile)
        kb = bar[g] if largest else reversed_order(bar[g])
        ok = kx >= kb[:, None]  # (equal ones may still win a tie by a smaller index)
        if kx.dtype.kind == "f":
            ok |= np.isnan(kb)[:, None]  # a NaN bar: fewer than m numbers yet, NaN ties it
        ok |= ~full[g][:, None]
        if np.count_nonzero(ok, axis=1).max() <= k:
            rows, cols = np.nonzero(ok)
        else:
            rows, cols = row_top(kx, k)
            keep = ok[rows, cols]
            rows, cols = rows[keep], cols[keep]
    else:
        rows, cols = row_top(kx, k)
    values = x2[rows, cols]
    r = _global_rows(rows + row0, key, ext, shape, tile)
    i = (cols + key[-1] * tile[-1]).astype(np.int64, copy=False)
    return r, i, values


def _candidates(spec: dict, keys: list[list[int]], views: list, bars=None) -> tuple[np.ndarray, ...]:
    """Offsets (per tile) and the r, i, v arrays of every tile's candidates (``bars``: see
    ``_tile_candidates``)."""
    shape, tile, dtype, k = spec["shape"], spec["tile"], np.dtype(spec["dtype"]), int(spec["k"])
    largest = not spec.get("smallest", False)
    parts: list[list] = []  # per tile, the candidates of each of its row blocks
    tasks = []
    for key, raw in zip(keys, views):
        ext = tuple(extent(n, t, q) for q, n, t in zip(key, shape, tile))
        x = widened(tile_view(raw, dtype, ext))  # bfloat16 ranks as float32 (exact; numpy sorts it)
        x2 = x.reshape(-1, ext[-1]) if ext[-1] else x.reshape(0, 0)
        # rows in blocks, so several kernel threads share one big tile
        n_blocks = max(1, min(2 * THREADS, x2.size // MIN_TASK_ELEMENTS, x2.shape[0]))
        bounds = [x2.shape[0] * b // n_blocks for b in range(n_blocks + 1)]
        slots = [None] * n_blocks
        parts.append(slots)
        for b in range(n_blocks):
            def task(b=b, slots=slots, x2=x2, key=key, ext=ext, lo=bounds[b], hi=bounds[b + 1]):
                slots[b] = _tile_candidates(x2[lo:hi], key, ext, shape, tile, k, lo, largest, bars)

            tasks.append(task)
    if tasks:
        run_tasks(tasks)
    counts = [sum(p[0].size for p in slots) for slots in parts]
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    flat = [p for slots in parts for p in slots]

    def cat(q, dt):
        return np.concatenate([p[q] for p in flat]) if flat else np.empty(0, dt)

    return offsets, cat(0, np.int64), cat(1, np.int64), cat(2, dtype)


def _as_list(offsets, r, i, v) -> pa.Array:
    v = v.astype(sql_value_dtype(v.dtype), copy=False)  # float16 goes as FLOAT
    structs = pa.StructArray.from_arrays([pa.array(r), pa.array(i), pa.array(v)], names=["r", "i", "v"])
    return pa.ListArray.from_arrays(pa.array(offsets), structs)


def topk_tiles(spec_arr, keys_arr, tile_arr) -> pa.Array:
    """``eds_topk_<dtype>(spec, key, tile)``: one tile's candidates. Registered with special
    NULL handling: a NULL tile (a stored tensor's row set NULL by hand) is refused here, where
    DuckDB's default gave the row no candidates and its values silently left the ranking."""
    spec = json.loads(_spec(spec_arr))
    keys = [kk.tolist() for kk in _key_rows(keys_arr)]
    tiles = tile_arr.combine_chunks() if isinstance(tile_arr, pa.ChunkedArray) else tile_arr
    if tiles.null_count:
        at = keys[tiles.is_null().to_numpy(zero_copy_only=False).nonzero()[0][0]]
        raise RuntimeError(f"eindecomp_sql kernel: tile {tuple(at)} is NULL: a tile column must hold every tile's "
                           "bytes")
    return _as_list(*_candidates(spec, keys, blob_views(tiles)))


def _fused(kernel: Callable, names: list[str]) -> Callable:
    """``eds_topk_<einsum kernel>(topk spec, result key, <the kernel's own arguments>)``: the
    einsum's result tiles never leave the call, only their candidates (values as DOUBLE: the
    SQL casts them back; only dtypes DOUBLE holds exactly are fused)."""

    def fused(topk_spec_arr, out_keys_arr, *args):
        spec = json.loads(_spec(topk_spec_arr))
        keys = [kk.tolist() for kk in _key_rows(out_keys_arr)]
        # with "stream" (a plan of a top-k over a result bigger than the budget, made with
        # CostModel.streamed_result): a slice of the call's rows at a time (that many bytes of
        # results, at least one tile), each cut to its candidates before the next is computed:
        # a vector of 16 joined rows of 50 MB result tiles held 800 MB at once. Else the call
        # whole, as the einsum kernel alone computes it (the same bits as einsum_elements')
        stream = spec.get("stream")
        step = max(1, len(keys)) if not stream else \
            max(1, stream // max(1, math.prod(spec["tile"]) * np.dtype(spec["dtype"]).itemsize))
        parts = []
        for lo in range(0, max(len(keys), 1), step):
            n = min(step, len(keys) - lo)
            tiles = kernel(*args) if n >= len(keys) else kernel(*(a.slice(lo, n) for a in args))
            parts.append(_candidates(spec, keys[lo:lo + n], blob_views(tiles)))
            del tiles
        if len(parts) == 1:
            offsets, r, i, v = parts[0]
        else:
            # each slice's offsets after the candidates of the slices before it
            before = np.cumsum([0] + [int(q[0][-1]) for q in parts[:-1]])
            offsets = np.concatenate([np.zeros(1, np.int32)] + [q[0][1:] + b for q, b in zip(parts, before)]
                                     ).astype(np.int32)
            r, i, v = (np.concatenate([q[c] for q in parts]) for c in (1, 2, 3))
        return _as_list(offsets, r, i, v.astype(np.float64))

    return _with_arity(fused, ["topk_spec", "out_keys"] + names)


def register_topk(con) -> None:
    """Register the top-k kernels on ``con``: one per value type, and the einsum kernels of
    arity 1 and 2 fused with a top-k (``compile/sql_interface.fuse_topk`` decides when)."""
    import duckdb

    text = duckdb.sqltype("VARCHAR")
    keys = duckdb.list_type(duckdb.sqltype("BIGINT"))
    blob = duckdb.sqltype("BLOB")
    bigint = duckdb.sqltype("BIGINT")
    # special: a NULL tile reaches the kernel, which refuses it (DuckDB's default skipped the row)
    opts = {"type": "arrow", "side_effects": False, "null_handling": "special"}
    for dtype, sqltype in SQL_TYPES.items():
        cand = duckdb.list_type(duckdb.struct_type({"r": bigint, "i": bigint, "v": duckdb.sqltype(sqltype)}))
        con.create_function(f"eds_topk_{dtype}", topk_tiles, [text, keys, blob], cand, **opts)
    cand = duckdb.list_type(duckdb.struct_type({"r": bigint, "i": bigint, "v": duckdb.sqltype("DOUBLE")}))
    for n in FUSED_ARITIES:
        tiles = [f"t{q}" for q in range(n)]
        con.create_function(f"eds_topk_eds_einsum{n}", _fused(einsum_rows, ["spec", "keys"] + tiles),
                            [text, keys, text, keys] + [blob] * n, cand, **opts)
        member = duckdb.list_type(duckdb.struct_type({"k": keys, **{t: blob for t in tiles}}))
        con.create_function(f"eds_topk_eds_einsum_group{n}", _fused(einsum_groups, ["spec", "keys", "members"]),
                            [text, keys, text, keys, member], cand, **opts)
