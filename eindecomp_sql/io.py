"""Data in and out of a session: the sources ``Session.store`` reads, and the Arrow / Parquet
form of a stored tensor.

A source is a numpy-like array, or a *table* in one of two forms:

- **tiled form**: integer key columns and a binary ``tile`` column, as ``Tensor.to_arrow()``
  writes it; shape, dtype, tile shape, key names and byte order come from the schema metadata
  (keys ``eindecomp_sql.*``, see ``docs/LAYOUT.md``);
- **element form**: integer index columns and one numeric value column, one row per element
  (sparse COO: elements not present are 0).

Tables arrive as pyarrow Tables / RecordBatches / readers, pandas DataFrames, DuckDB relations,
objects with ``__arrow_c_stream__`` (polars, ...), or a path to a Parquet file (read by DuckDB).
Anything else that looks like a table is refused with an ``EinsumError`` that says what to do.

>>> t = read_source(pa.table({"i": [0, 2], "j": [1, 0], "v": [1.5, -2.0]}), "store('T')", Wanted())
>>> t.shape, t.dtype, t.tile, t.keys
((3, 2), 'float64', (3, 2), ('d0', 'd1'))
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import sys
from dataclasses import dataclass
from importlib import resources

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .arrays import as_array
from .errors import EinsumError
from .notation.checks import check_dtype, check_name
from .plan import DEFAULT_TILE_BYTES, auto_tile, check_tile, tiling
from .plan.tiling import check_count
from .udfs.tiles import array_from_tiles, tiles_from_array

# Schema metadata this package writes on a tensor's Arrow table and Parquet file.
PREFIX = "eindecomp_sql."
FORMAT_VERSION = 1
TILE = "tile"
VALUE = "value"


# -- what store wants, and what a source holds -------------------------------------------------
@dataclass(frozen=True)
class Wanted:
    """The options of ``Session.store`` that shape the stored tensor (None: from the source)."""

    tile: tuple[int, ...] | None = None
    keys: tuple[str, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    index: tuple[str, ...] | None = None
    value: str | None = None
    tile_bytes: int = DEFAULT_TILE_BYTES


@dataclass(frozen=True)
class Incoming:
    """A source ready to store: its description and its tiles (key columns, then ``tile``)."""

    shape: tuple[int, ...]
    dtype: str
    tile: tuple[int, ...]
    keys: tuple[str, ...]
    tiles: pa.Table


def check_keys(keys, ndim: int) -> tuple[str, ...]:
    """Key column names: one valid, distinct (ignoring case, as DuckDB does) name per dimension."""
    if isinstance(keys, str):
        raise EinsumError(f"keys must be a tuple of {ndim} column name(s), got the string {keys!r}")
    try:
        keys = tuple(keys)
    except TypeError:
        raise EinsumError(f"keys must be a tuple of {ndim} column name(s), got {keys!r}") from None
    keys = tuple(check_name(k, "key column name") for k in keys)
    if len(keys) != ndim or len(set(keys)) != len(keys) or TILE in keys:
        raise EinsumError(f"keys {keys} must name each of the {ndim} dimension(s) once (not 'tile')")
    if len({k.lower() for k in keys}) != len(keys):
        raise EinsumError(f"keys {keys}: DuckDB's column names ignore case, so these name one column twice")
    return keys


def _shape_arg(shape, where: str) -> tuple[int, ...] | None:
    if shape is None:
        return None
    try:
        sides = tuple(shape)
    except TypeError:
        raise EinsumError(f"{where}: shape must be a tuple of ints, got {shape!r}") from None
    try:  # check_count refuses bools, floats and strings, as everywhere else
        return tuple(check_count(n, "side", minimum=0) for n in sides)
    except EinsumError:
        raise EinsumError(f"{where}: shape {sides!r} must hold integers >= 0") from None


def _exact_cast(a: np.ndarray, dtype, where: str) -> np.ndarray:
    """``a`` as ``dtype`` when no value changes beyond rounding: same_kind lets int64 -> int8
    wrap (300 -> 44) and float64 -> float32 overflow to inf, silently."""
    dtype = np.dtype(dtype)
    if np.can_cast(a.dtype, dtype, "safe"):
        return a.astype(dtype)
    with np.errstate(all="ignore"):
        b = a.astype(dtype)
    if dtype.kind in "biu":
        bad = b.astype(a.dtype) != a
    else:  # float / complex narrowing: rounding is expected, overflow to inf is not
        bad = np.isinf(b) & ~np.isinf(a)
    if np.any(bad):
        at = tuple(int(k) for k in np.unravel_index(int(np.argmax(bad)), a.shape)) if a.ndim else ()
        raise EinsumError(f"{where}: value {a[at].item()!r} at {at} does not fit dtype={dtype.name} "
                          f"(it would become {b[at].item()!r})")
    return b


def _from_array(a: np.ndarray, want: Wanted, where: str) -> Incoming:
    """Cut a dense array into tiles (the whole array is in memory here)."""
    if want.dtype is not None and a.dtype != want.dtype:
        if not np.can_cast(a.dtype, want.dtype, "same_kind"):
            raise EinsumError(f"{where}: cannot cast {a.dtype} values to dtype={want.dtype} "
                              "(numpy's same_kind rule)")
        a = _exact_cast(a, want.dtype, where)
    dtype = check_dtype(a.dtype, where)
    if want.tile is not None:
        tile = check_tile(a.shape, want.tile)
    else:
        tile = auto_tile(a.shape, a.dtype.itemsize, want.tile_bytes)
    keys = check_keys(want.keys if want.keys is not None else tuple(f"d{k}" for k in range(a.ndim)), a.ndim)
    return Incoming(a.shape, dtype, tile, keys, tiles_from_array(a, tile, keys))


def read_source(source, where: str, want: Wanted, con=None) -> Incoming:
    """What ``source`` holds, as tiles to store. ``con`` (a DuckDB connection) reads Parquet."""
    want = Wanted(want.tile, want.keys, _shape_arg(want.shape, where),
                  None if want.dtype is None else check_dtype(want.dtype, where),
                  _names_arg(want.index, "index", where), want.value, want.tile_bytes)
    if want.value is not None and not isinstance(want.value, str):
        raise EinsumError(f"{where}: value= names the value column, got {want.value!r}")
    table = as_table(source, where, con)
    if table is None:
        if any(x is not None for x in (want.shape, want.index, want.value)):
            raise EinsumError(f"{where}: shape=, index= and value= describe a table in element form; "
                              "an array brings its own shape")
        return _from_array(as_array(source, where), want, where)
    meta = read_metadata(table.schema.metadata, where)
    tiled = meta.get("layout") == "tiles" or (
        TILE in table.column_names and _is_binary(table.schema.field(TILE).type) and want.value is None)
    if tiled:
        return _from_tiles(table, meta, want, where)
    return _from_elements(table, meta, want, where)


# -- sources that are tables ---------------------------------------------------------------
def _module(x) -> str:
    return type(x).__module__ or ""


def _is_path(x) -> bool:
    return isinstance(x, (str, pathlib.PurePath))


def as_table(x, where: str, con=None) -> pa.Table | None:
    """``x`` as a pyarrow Table if it is a table-like source, None if it is an array, or an
    ``EinsumError`` if it is a kind of table we do not read."""
    import duckdb

    if isinstance(x, (pa.Array, pa.ChunkedArray, np.ndarray)):
        return None  # arrays (pyarrow arrays implement the stream protocol too)
    if _is_path(x):
        return read_parquet(x, where, con)
    if isinstance(x, pa.Table):
        return x
    if isinstance(x, pa.RecordBatch):
        return pa.Table.from_batches([x])
    if isinstance(x, pa.RecordBatchReader):
        return x.read_all()
    if isinstance(x, duckdb.DuckDBPyRelation):
        try:
            # DuckDB runs the relation (on its own connection) and hands back Arrow, whole in memory
            return x.to_arrow_table()
        except duckdb.Error as e:
            raise EinsumError(f"{where}: DuckDB could not run the relation: {e}") from None
    mod, name = _module(x), type(x).__name__
    if mod.startswith("scipy.sparse") or (mod.startswith("sparse") and hasattr(x, "todense")):
        raise EinsumError(f"{where}: a sparse {name} is not read directly; call .toarray() first, or "
                          "store its (row, col, value) triplets as a table in element form")
    if mod.startswith("pandas") and name == "DataFrame":
        try:
            # the frame's index is not a column: reset_index() makes it one
            return pa.Table.from_pandas(x, preserve_index=False)
        except (pa.ArrowException, TypeError, ValueError) as e:
            raise EinsumError(f"{where}: this DataFrame has columns Arrow cannot hold ({e}); keep integer "
                              "index columns and one numeric value column") from None
    if hasattr(x, "__arrow_c_stream__"):  # polars and other Arrow exporters
        try:
            return pa.table(x)
        except Exception as e:  # noqa: BLE001 - a foreign exporter's failure is bad input
            if hasattr(x, "__array__"):
                return None  # a stream of one column (a polars Series): an array
            raise EinsumError(f"{where}: cannot read this {name} as an Arrow table ({e})") from None
    return None


def read_parquet(path, where: str, con=None) -> pa.Table:
    """A Parquet file read by DuckDB (on a cursor of ``con``, or a connection of its own), with
    the file's key-value metadata put back on the Arrow schema. The whole table is held in
    memory (reading it in batches is the streaming issue's work)."""
    import duckdb

    p = os.fspath(path)
    if not p.lower().endswith(".parquet"):
        raise EinsumError(f"{where}: a path must name a Parquet file ending in .parquet, got {p!r}; read "
                          "other files with DuckDB (db.connection.read_csv(path)) and store the relation")
    if not os.path.isfile(p):
        raise EinsumError(f"{where}: no such Parquet file {p!r}")
    try:
        cur = con.cursor() if con is not None else duckdb.connect()
    except duckdb.Error as e:
        raise EinsumError(f"{where}: cannot read {p!r}: the connection is closed ({e})") from None
    try:
        # DuckDB reads a path as a glob pattern ('[', '*', '?'): x[1].parquet could read x1.parquet
        matched = [r[0] for r in cur.execute("SELECT file FROM glob(?)", [p]).fetchall()]
        if any(ch in p for ch in "*?[") and [os.path.realpath(m) for m in matched] != [os.path.realpath(p)]:
            raise EinsumError(f"{where}: {p!r} reads as a file pattern in DuckDB (it matches {len(matched)} "
                              "file(s)); rename the file without '*', '?' or '['")
        table = cur.read_parquet(p).to_arrow_table()
        meta = dict(cur.execute("SELECT key, value FROM parquet_kv_metadata(?)", [p]).fetchall())
    except duckdb.Error as e:
        raise EinsumError(f"{where}: DuckDB could not read {p!r} as Parquet: {e}") from None
    finally:
        cur.close()
    meta = {bytes(k): bytes(v) for k, v in meta.items() if bytes(k).startswith(PREFIX.encode())}
    return table.replace_schema_metadata(meta or None)


# -- metadata ----------------------------------------------------------------------------------
def tensor_metadata(shape, dtype, tile, keys, layout: str, name: str | None = None) -> dict[bytes, bytes]:
    """The schema metadata of a tensor's Arrow table / Parquet file (values are JSON text)."""
    meta = {
        "format_version": FORMAT_VERSION,
        "layout": layout,
        "shape": list(shape),
        "dtype": str(dtype),
        "tile": list(tile),
        "keys": list(keys),
        "byte_order": sys.byteorder,  # of the tile bytes: the machine's ("little" on x86-64 and arm64)
    }
    if name is not None:
        meta["name"] = name
    return {(PREFIX + k).encode(): json.dumps(v).encode() for k, v in meta.items()}


_META_TYPES = {"format_version": int, "layout": str, "shape": list, "dtype": str, "tile": list, "keys": list,
               "byte_order": str, "name": str}


def read_metadata(raw: dict | None, where: str) -> dict:
    """The ``eindecomp_sql.*`` entries of schema metadata, decoded and checked ({} if none)."""
    out = {}
    for k, v in (raw or {}).items():
        k = k.decode() if isinstance(k, bytes) else k
        if not k.startswith(PREFIX):
            continue
        field = k[len(PREFIX):]
        try:
            out[field] = json.loads(v)
        except ValueError:
            raise EinsumError(f"{where}: schema metadata {k!r} is not JSON: {v[:80]!r}") from None
        if field in _META_TYPES and not isinstance(out[field], _META_TYPES[field]):
            raise EinsumError(f"{where}: schema metadata {k!r} should be a {_META_TYPES[field].__name__}, "
                              f"got {out[field]!r}")
    if not out:
        return out
    version = out.get("format_version")
    if version != FORMAT_VERSION:
        raise EinsumError(f"{where}: the table was written in eindecomp_sql format {version!r}; this version "
                          f"reads format {FORMAT_VERSION}")
    if out.get("layout") not in ("tiles", "elements"):
        raise EinsumError(f"{where}: schema metadata {PREFIX}layout must be 'tiles' or 'elements', "
                          f"got {out.get('layout')!r}")
    if out.get("byte_order", sys.byteorder) not in ("little", "big"):
        raise EinsumError(f"{where}: schema metadata {PREFIX}byte_order must be 'little' or 'big'")
    for field in ("shape", "tile"):  # lists of non-negative ints, whatever wrote them
        if field in out:
            out[field] = list(_shape_arg(out[field], f"{where}: schema metadata {PREFIX}{field}"))
    return out


# -- columns -------------------------------------------------------------------------------
def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)


def _kind(t: pa.DataType) -> str:
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t) or pa.types.is_boolean(t):
        return "number"
    return "other"


def _find(table: pa.Table, name, where: str, what: str) -> str:
    """A column of ``table`` by name (exactly, else ignoring case as DuckDB does)."""
    if not isinstance(name, str):
        raise EinsumError(f"{where}: {what} must name a column, got {name!r}")
    if name in table.column_names:
        return name
    folded = [c for c in table.column_names if c.lower() == name.lower()]
    if len(folded) == 1:
        return folded[0]
    raise EinsumError(f"{where}: {what} {name!r} is not a column; the columns are {table.column_names}")


def _names_arg(names, what: str, where: str) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise EinsumError(f"{where}: {what}= must be column names, got {names!r}") from None
    if not all(isinstance(n, str) for n in names):
        raise EinsumError(f"{where}: {what}= must be column names, got {names!r}")
    return names


def _no_nulls(table: pa.Table, name: str, where: str) -> pa.ChunkedArray:
    col = table.column(name)
    if col.null_count:
        raise EinsumError(f"{where}: column {name!r} has {col.null_count} null(s); fill or drop them first")
    return col


def _index_array(table: pa.Table, name: str, where: str) -> np.ndarray:
    """An integer column as int64 (unsigned values beyond int64 are out of any shape)."""
    col = _no_nulls(table, name, where)
    if _kind(col.type) != "int":
        raise EinsumError(f"{where}: index column {name!r} holds {col.type}, not integers; cast it to an integer "
                          "type (or name the columns with index= and value=)")
    a = col.to_numpy()
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        row = int(np.argmax(a > np.iinfo(np.int64).max))
        raise EinsumError(f"{where}: index column {name!r} holds {a[row]} (row {row}), beyond any shape")
    return a.astype(np.int64, copy=False)


def _type_word(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "strings"
    return str(t)


# -- element form --------------------------------------------------------------------------
def _element_columns(table: pa.Table, want: Wanted, where: str) -> tuple[list[str], str]:
    """Which columns are the indices and which is the value. The rules (``Session.store``):
    ``value=`` names the value column, else a column named ``value``, else the one column that
    is not integer; ``index=`` names the index columns, else every other column, in order."""
    cols = table.column_names
    index = [_find(table, c, where, "index column") for c in want.index] if want.index is not None else None
    if index is not None and len({c.lower() for c in index}) != len(index):
        raise EinsumError(f"{where}: index={tuple(want.index)} names a column twice")
    if want.value is not None:
        value = _find(table, want.value, where, "value=")
    else:
        rest = [c for c in cols if index is None or c not in index]
        named = [c for c in rest if c.lower() == VALUE]
        others = [c for c in rest if _kind(table.schema.field(c).type) != "int"]
        if not cols:
            raise EinsumError(f"{where}: the table has no columns")
        if index is None and len(others) == len(cols) and not (len(cols) == 1 and named):
            typed = ", ".join(f"{c!r} ({_type_word(table.schema.field(c).type)})" for c in cols)
            raise EinsumError(f"{where}: no integer columns ({typed}); a table in element form "
                              "has integer index columns, one per dimension, and one numeric value column "
                              "(a DataFrame's index is not read: .reset_index() makes it a column)")
        if named:
            value = named[0]
        elif index is not None and len(rest) == 1:
            value = rest[0]
        elif len(others) == 1 and _kind(table.schema.field(others[0]).type) == "number":
            value = others[0]
        elif len(others) > 1:
            numeric = [c for c in others if _kind(table.schema.field(c).type) == "number"]
            bad = [f"{c!r} ({_type_word(table.schema.field(c).type)})" for c in others if c not in numeric]
            if len(numeric) == 1 and bad:
                raise EinsumError(f"{where}: column(s) {', '.join(bad)} are neither integer indices nor the value; "
                                  f"select the index columns and one value column first, or pass index=[...] "
                                  f"and value={numeric[0]!r}")
            raise EinsumError(f"{where}: several columns could be the value ({', '.join(map(repr, others))}); "
                              "a table in element form has integer index columns and one value column: pass "
                              "value='...' (and index=[...]) to choose")
        elif others:
            raise EinsumError(f"{where}: column {others[0]!r} holds {_type_word(table.schema.field(others[0]).type)}, "
                              "neither integer indices nor a numeric value; a table in element form has integer "
                              "index columns and one numeric value column")
        else:
            raise EinsumError(f"{where}: every column ({', '.join(map(repr, cols))}) is an integer, so which one "
                              "is the value is not clear: pass value='...' (or name the value column 'value')")
    if index is None:
        index = [c for c in cols if c != value]
    if value in index:
        raise EinsumError(f"{where}: column {value!r} cannot be both an index and the value")
    # no index columns: a 0-d tensor, its one value in one row (as Tensor.to_arrow("elements") writes it)
    return index, value


def _from_elements(table: pa.Table, meta: dict, want: Wanted, where: str) -> Incoming:
    """Element rows scattered into a dense array, then cut into tiles. The dense array (and the
    columns) are whole in memory here; building tiles group by group is the streaming issue's."""
    index, value = _element_columns(table, want, where)
    vcol = _no_nulls(table, value, where)
    if _kind(vcol.type) == "other":
        raise EinsumError(f"{where}: value column {value!r} holds {_type_word(vcol.type)}, not numbers; cast it "
                          "to a numeric type")
    vals = vcol.to_numpy()
    check_dtype(vals.dtype, f"{where}: value column {value!r}")
    dtype = want.dtype or meta.get("dtype") or vals.dtype.name
    if vals.dtype != dtype:
        if not np.can_cast(vals.dtype, dtype, "same_kind"):
            raise EinsumError(f"{where}: cannot cast value column {value!r} ({vals.dtype}) to {dtype} "
                              "(numpy's same_kind rule)")
        vals = _exact_cast(vals, dtype, f"{where}: value column {value!r}")
    if not index and table.num_rows > 1:  # a lone value column: a 0-d tensor, one element
        raise EinsumError(f"{where}: a table with only a value column is a 0-d tensor and holds one row, "
                          f"not {table.num_rows}")
    idx = np.stack([_index_array(table, c, where) for c in index]) if table.num_rows and index else \
        np.zeros((len(index), table.num_rows if not index else 0), np.int64)
    for c, col in zip(index, idx):
        if col.size and col.min() < 0:
            row = int(np.argmax(col < 0))
            raise EinsumError(f"{where}: index column {c!r} holds {col[row]} at row {row}; indices start at 0")
    shape = want.shape if want.shape is not None else (tuple(meta["shape"]) if "shape" in meta else None)
    if shape is None:
        shape = tuple(int(col.max()) + 1 if col.size else 0 for col in idx)
    elif len(shape) != len(index):
        raise EinsumError(f"{where}: shape {shape} has {len(shape)} dimension(s) but there are {len(index)} index "
                          f"column(s) {index}")
    for c, col, n in zip(index, idx, shape):
        if col.size and col.max() >= n:
            row = int(np.argmax(col >= n))
            raise EinsumError(f"{where}: index column {c!r} holds {col[row]} at row {row}, outside shape {shape}")
    nbytes = int(np.prod(shape, dtype=np.float64)) * np.dtype(dtype).itemsize
    try:  # before the duplicate check, whose flat indices must fit an int64
        dense = np.zeros(shape, dtype=dtype)
    except (MemoryError, ValueError):
        raise EinsumError(f"{where}: shape {shape} would take {nbytes / 2**30:.1f} GiB as a dense array") from None
    _check_unique(idx, shape, index, where)
    if index:
        dense[tuple(idx)] = vals
    elif len(vals):
        dense[()] = vals[0]
    # a table Tensor.to_arrow("elements") wrote comes back with its keys and tiles
    keys, tile = want.keys, want.tile
    if meta.get("shape") == list(shape):
        keys = keys if keys is not None else tuple(meta.get("keys", ())) or None
        tile = tile if tile is not None else tuple(meta.get("tile", ())) or None
    return _from_array(dense, Wanted(tile, keys, tile_bytes=want.tile_bytes), where)


def _check_unique(idx: np.ndarray, shape: tuple[int, ...], names: list[str], where: str) -> None:
    """Each element at most once: duplicates are named, with their rows."""
    if idx.shape[1] < 2:
        return
    flat = np.ravel_multi_index(tuple(idx), shape) if all(shape) else np.zeros(idx.shape[1], np.int64)
    order = np.argsort(flat, kind="stable")
    same = flat[order][1:] == flat[order][:-1]
    if not same.any():
        return
    first = int(np.argmax(same))
    rows = order[first:first + 2]
    dup_at = flat[order][1:][same]
    at = ", ".join(f"{c}={int(v)}" for c, v in zip(names, idx[:, rows[0]]))
    raise EinsumError(f"{where}: index ({at}) appears more than once (rows {int(rows[0])} and {int(rows[1])}); "
                      f"{len(np.unique(dup_at))} index tuple(s) are duplicated in all. A table in element form "
                      "holds each element once: aggregate duplicates first (GROUP BY the index columns)")


# -- tiled form ----------------------------------------------------------------------------
def _from_tiles(table: pa.Table, meta: dict, want: Wanted, where: str) -> Incoming:
    """Check a tiled table against its description and pass its tiles on as they are (re-cut
    through a dense array only when ``tile=``, ``dtype=`` or the byte order asks for it)."""
    if meta.get("layout") == "elements":
        raise EinsumError(f"{where}: the metadata says element form but the table has a 'tile' column")
    if want.index is not None or want.value is not None:
        raise EinsumError(f"{where}: index= and value= are for tables in element form; this one is tiled "
                          "(a binary 'tile' column)")
    if meta:
        shape, dtype, tile = tuple(meta.get("shape", ())), meta.get("dtype"), meta.get("tile")
        if want.shape is not None and tuple(want.shape) != shape:
            raise EinsumError(f"{where}: shape={want.shape} but the table holds a tensor of shape {shape}")
        keys = tuple(meta.get("keys", ()))
    else:
        if want.shape is None or want.dtype is None or want.tile is None:
            raise EinsumError(f"{where}: a tiled table (a binary 'tile' column) without eindecomp_sql's schema "
                              "metadata needs shape=, dtype= and tile= (the shape its tiles were cut in); "
                              "Tensor.to_arrow() and Tensor.to_parquet() write the metadata")
        shape, dtype, tile = want.shape, want.dtype, want.tile
        keys = tuple(c for c in table.column_names if c != TILE)
    dtype = check_dtype(dtype, f"{where}: metadata dtype")
    tile = check_tile(shape, tile)
    for k in keys:
        if k not in table.column_names:
            raise EinsumError(f"{where}: key column {k!r} is missing; the columns are {table.column_names}")
    if len(keys) != len(shape):
        raise EinsumError(f"{where}: {len(keys)} key column(s) {list(keys)} for a tensor of shape {shape}")
    grid = tiling.grid(shape, tile)
    kcols = [_index_array(table, k, where) for k in keys]
    for k, col, g in zip(keys, kcols, grid):
        if col.size and (col.min() < 0 or col.max() >= g):
            row = int(np.argmax((col < 0) | (col >= g)))
            raise EinsumError(f"{where}: key column {k!r} holds {col[row]} at row {row}; tiles of {tile} over shape "
                              f"{shape} have keys 0..{g - 1}")
    expect = int(np.prod(grid, dtype=np.int64))
    if table.num_rows != expect:
        raise EinsumError(f"{where}: {table.num_rows} tile rows, but shape {shape} in tiles of {tile} has {expect}")
    idx = np.stack(kcols) if kcols else np.zeros((0, table.num_rows), np.int64)
    _check_unique(idx, grid, list(keys), where)
    tcol = _no_nulls(table, TILE, where)
    if pa.types.is_binary_view(tcol.type):  # no length kernel for views in pyarrow (26)
        tcol = tcol.cast(pa.large_binary())
    itemsize = np.dtype(dtype).itemsize
    ext = [np.minimum(t, n - col * t) for col, t, n in zip(kcols, tile, shape)]
    want_bytes = np.prod(np.stack(ext), axis=0) * itemsize if ext else np.full(table.num_rows, itemsize)
    got = pc.binary_length(tcol).to_numpy().astype(np.int64)
    bad = np.nonzero(got != want_bytes)[0]
    if bad.size:
        r = int(bad[0])
        at = ", ".join(f"{k}={int(c[r])}" for k, c in zip(keys, kcols))
        raise EinsumError(f"{where}: the tile at ({at}) holds {got[r]} bytes; a {dtype} tile there takes "
                          f"{want_bytes[r]} (tile {tile}, shape {shape}, edge tiles smaller)")
    order = meta.get("byte_order", sys.byteorder)
    new_keys = check_keys(want.keys if want.keys is not None else keys, len(shape))
    if (want.tile is not None and meta and check_tile(shape, want.tile) != tile) \
            or (want.dtype is not None and want.dtype != dtype) or order != sys.byteorder:
        # re-cut, convert or swap bytes through the dense array (whole in memory)
        source_dtype = np.dtype(dtype).newbyteorder("<" if order == "little" else ">")
        dense = array_from_tiles(table, shape, tile, source_dtype, keys)
        dense = dense.astype(np.dtype(dtype).newbyteorder("="))
        return _from_array(dense, Wanted(want.tile or tile, new_keys, dtype=want.dtype,
                                         tile_bytes=want.tile_bytes), where)
    tiles = pa.table({**{nk: pa.array(c) for nk, c in zip(new_keys, kcols)}, TILE: tcol})
    return Incoming(tuple(shape), dtype, tile, new_keys, tiles)


# -- out: Arrow and Parquet ----------------------------------------------------------------
def elements_table(a: np.ndarray, names: tuple[str, ...]) -> pa.Table:
    """One row per element of ``a`` (C order): an int64 column per dimension, then ``value``.
    Builds every index column at once: the whole array and its indices are in memory."""
    if a.dtype.kind == "c":
        raise EinsumError("a complex tensor has no element form in Arrow (Arrow has no complex type); use "
                          "form='tiles'")
    if VALUE in (n.lower() for n in names):
        raise EinsumError(f"the keys {names} include 'value', the element form's value column; store the "
                          "tensor with other keys")
    cols = {n: pa.array(c.reshape(-1).astype(np.int64, copy=False))
            for n, c in zip(names, np.indices(a.shape, sparse=False))} if a.ndim else {}
    cols[VALUE] = pa.array(np.ascontiguousarray(a).reshape(-1))
    return pa.table(cols)


def write_parquet(table: pa.Table, path) -> pathlib.Path:
    """Write ``table`` to ``path`` atomically: into a temporary file in the same directory, then
    renamed over ``path``, so a failure leaves no half-written file (and any old file intact)."""
    import pyarrow.parquet as pq

    target = pathlib.Path(os.fspath(path))
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise EinsumError(f"cannot write Parquet file {str(target)!r}: {e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


# -- the element macros ----------------------------------------------------------------------
def element_macros_sql() -> str:
    """The plain-SQL macros of ``sql_templates/elements_macro.sql`` (``eds_elements(name)`` and
    the byte decoders): paste them into any DuckDB to read stored tensors without this package."""
    return resources.files("eindecomp_sql.sql_templates").joinpath("elements_macro.sql").read_text()


def create_element_macros(con) -> None:
    """Create the element macros as TEMP macros on DuckDB connection ``con`` (for example
    ``db.connection``), then ``con.sql("SELECT * FROM eds_elements('A')")``."""
    con.execute(element_macros_sql())
