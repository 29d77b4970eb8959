"""Kernels that pack rows of an ordinary table into tiles, for the SQL interface's operands that
are not stored tensors (``compile/sql_interface.py`` writes the SQL that groups the rows).

- ``eds_pack_<dtype>(spec, key, [{o, v}, ...])``: element rows of one tile (``o`` the element's
  C-order offset in a full tile, ``v`` its value) -> the tile's bytes; missing elements are 0,
  two rows for one element are an error.
- ``eds_pack_rows_<dtype>(spec, key, [array, ...])``: whole rows of a matrix, in row order ->
  the tile's bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from eindecomp_sql.errors import EinsumError

from .register import _key_rows, _spec
from .tiles import TileWriter, _as_array
from eindecomp_sql.notation.checks import SQL_TYPES, SQL_WIRE
from eindecomp_sql.plan.tiling import extent, grid as tiling_grid

# dtype -> DuckDB type of the values the kernels take (DuckDB has no complex type)


def _fields(list_arr) -> tuple[np.ndarray, dict[str, pa.Array]]:
    """Offsets of a list<struct> column and its struct's fields (offsets applied)."""
    arr = _as_array(list_arr)
    offsets = arr.offsets.to_numpy()
    structs = arr.values
    return offsets, dict(zip([f.name for f in structs.type], structs.flatten()))


def _numpy(values: pa.Array, dtype: np.dtype) -> np.ndarray:
    return values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _extent(key: list[int], shape, tile) -> tuple[int, ...]:
    return tuple(extent(n, t, k) for k, n, t in zip(key, shape, tile))


def _changed(table: str, why: str) -> EinsumError:
    return EinsumError(f"einsum(): table {table!r} changed while einsum read it ({why}); einsum plans from the "
                       "committed rows: COMMIT first")


def pack_elements(spec_arr, keys_arr, members_arr) -> pa.Array:
    spec = json.loads(_spec(spec_arr))
    table, shape, tile, dtype = spec["table"], spec["shape"], spec["tile"], np.dtype(spec["dtype"])
    grid = list(tiling_grid(shape, tile))
    keys = [k.tolist() for k in _key_rows(keys_arr)]
    offsets, fields = _fields(members_arr)
    if fields["v"].null_count:
        raise _changed(table, "a NULL value")
    o_all = _numpy(fields["o"], np.int64)
    v_all = _numpy(fields["v"], dtype)
    for key in keys:
        if any(not 0 <= k < g for k, g in zip(key, grid)):
            raise _changed(table, f"rows outside the shape {tuple(shape)}")
    writer = TileWriter(dtype, [_extent(k, shape, tile) for k in keys])
    writer.buffer[:] = 0
    for g, key in enumerate(keys):
        o = o_all[offsets[g]:offsets[g + 1]]
        if not o.size:
            continue
        ext = writer.shapes[g]
        if tuple(ext) != tuple(tile):  # an edge tile: from full-tile offsets to its own layout
            coords = np.unravel_index(o, tile)
            o = np.ravel_multi_index(coords, ext)
        out = writer.out(g).reshape(-1)
        seen = np.zeros(out.size, dtype=bool)
        seen[o] = True
        if np.count_nonzero(seen) != o.size:
            first = int(np.nonzero(np.bincount(o, minlength=out.size) > 1)[0][0])
            local = np.unravel_index(first, ext)
            index = ", ".join(f"{c}={int(q) + k * t}" for c, q, k, t in zip(spec["indices"], local, key, tile))
            raise EinsumError(f"einsum(): table {table!r} has more than one row for element ({index}); "
                              "sum them first (a view with GROUP BY the index columns)")
        out[o] = v_all[offsets[g]:offsets[g + 1]]
    return writer.array()


def pack_rows(spec_arr, keys_arr, members_arr) -> pa.Array:
    spec = json.loads(_spec(spec_arr))
    table, (rows, width), tile, dtype = spec["table"], spec["shape"], spec["tile"], np.dtype(spec["dtype"])
    keys = [k.tolist() for k in _key_rows(keys_arr)]
    groups = _as_array(members_arr)  # per tile, its rows' arrays in row order
    offsets = groups.offsets.to_numpy()
    arrays = groups.values
    if arrays.null_count or arrays.values.null_count:
        column = '"' + spec["column"].replace('"', '""') + '"'  # as SQL writes it
        # DuckDB 2.0 refuses the arrow lambda (x -> ...) a first hint gave (a trial)
        raise EinsumError(f"einsum(): table {table!r}: column {spec['column']!r} has NULL elements; "
                          f"replace them in a view (list_transform({column}, lambda x: coalesce(x, 0)) AS {column}) "
                          "or leave those rows out")
    starts = arrays.offsets.to_numpy()
    lengths = np.diff(starts)
    if lengths.size and (lengths != width).any():
        raise _changed(table, f"an array that is not {width} long")
    flat = _numpy(arrays.values, dtype)
    writer = TileWriter(dtype, [_extent(k, (rows, width), tile) for k in keys])
    for g, key in enumerate(keys):
        a, b = offsets[g], offsets[g + 1]
        out = writer.out(g)
        if key[0] * tile[0] >= rows or b - a != out.shape[0]:
            raise _changed(table, f"not {rows} rows")
        out[...] = flat[starts[a]:starts[b]].reshape(b - a, width)
    return writer.array()


def register_pack(con) -> None:
    """Register the packing kernels on ``con``, one per value type."""
    import duckdb

    text = duckdb.sqltype("VARCHAR")
    keys = duckdb.list_type(duckdb.sqltype("BIGINT"))
    blob = duckdb.sqltype("BLOB")
    bigint = duckdb.sqltype("BIGINT")
    for dtype, sqltype in SQL_TYPES.items():
        if dtype in SQL_WIRE:  # a DuckDB FLOAT packs as float32, never rounded to float16
            continue
        value = duckdb.sqltype(sqltype)
        element = duckdb.list_type(duckdb.struct_type({"o": bigint, "v": value}))
        con.create_function(f"eds_pack_{dtype}", pack_elements, [text, keys, element], blob, type="arrow",
                            side_effects=False)
        row = duckdb.list_type(duckdb.list_type(value))
        con.create_function(f"eds_pack_rows_{dtype}", pack_rows, [text, keys, row], blob, type="arrow",
                            side_effects=False)
