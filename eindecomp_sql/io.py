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

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import mmap
import os
import pathlib
import re
import sys
from dataclasses import dataclass, field, replace
from importlib import resources

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .arrays import as_array, check_series_missing, read_array
from .backends import spill
from .errors import EinsumError, duckdb_said
from .notation.checks import can_cast, check_dtype, check_name, is_bfloat16
from .plan import DEFAULT_TILE_BYTES, TiledValue, auto_tile, check_tile, tiling
from .plan.steps import format_bytes
from .plan.tiling import _physical_memory, check_count
from .udfs.tiles import array_from_tiles, blob_views, tiles_from_array

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
    square: bool = False  # an automatic tile holds a power of 4 elements (square for square powers of 2)
    # the session's memory budget: a table in element form is built dense, and one whose dense
    # array exceeds it (or, without one, this machine's memory) is refused before it is built
    memory: int | None = None


@dataclass(frozen=True)
class Incoming:
    """A source ready to store: its description and its tiles (key columns, then ``tile``).

    ``tiles`` is a pyarrow Table; or, for a file read on a DuckDB backend (``stream=True``), a
    ``pyarrow.RecordBatchReader`` that cuts or reads the tiles batch by batch as the backend
    stores them, or a :class:`ParquetRows` whose SELECTs DuckDB runs to read them from the
    file itself. Such
    sources check their tiles as they pass: ``failure(error)`` is the check's own error when
    storing failed because of one."""

    shape: tuple[int, ...]
    dtype: str
    tile: tuple[int, ...]
    keys: tuple[str, ...]
    tiles: object
    failures: list = field(default_factory=list, compare=False, repr=False)

    def failure(self, error: BaseException) -> BaseException | None:
        """What stopped the store, when the stream or the SQL check raised ``error``'s cause."""
        if self.failures:
            return self.failures[0]
        text = str(error)
        said = getattr(self.tiles, "said", None)
        if said is not None and said(text) is not None:
            return said(text)
        if _CHECK_MARK in text:
            return EinsumError(text[text.index(_CHECK_MARK) + len(_CHECK_MARK):].strip())
        return None


def check_keys(keys, ndim: int) -> tuple[str, ...]:
    """Key column names: one valid, distinct (ignoring case, as DuckDB does) name per dimension."""
    if isinstance(keys, str):
        raise EinsumError(f"keys must be a tuple of {ndim} column name(s), got the string {keys!r}")
    try:
        keys = tuple(keys)
    except TypeError:
        raise EinsumError(f"keys must be a tuple of {ndim} column name(s), got {keys!r}") from None
    keys = tuple(check_name(k, "key column name") for k in keys)
    if len(keys) != ndim or len(set(keys)) != len(keys) or TILE in (k.lower() for k in keys):
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


def _exact_cast(a: np.ndarray, dtype, where: str, origin: tuple[int, ...] | None = None) -> np.ndarray:
    """``a`` as ``dtype`` when no value changes beyond rounding: same_kind lets int64 -> int8
    wrap (300 -> 44) and float64 -> float32 overflow to inf, silently. ``origin``: where ``a``
    (a tile) starts in the whole array, for the position an error names."""
    dtype = np.dtype(dtype)
    if can_cast(a.dtype, dtype, "safe"):
        return a.astype(dtype)
    with np.errstate(all="ignore"):
        b = a.astype(dtype)
    if dtype.kind in "biu":
        bad = b.astype(a.dtype) != a
        if a.dtype.kind in "iu" and dtype.kind in "iu" and a.dtype.kind != dtype.kind:
            # uint64 -> int64 wraps 2**64 - 1 to -1 and back again: the round trip alone misses it
            bad |= (b < 0) != (a < 0)
    else:  # float / complex narrowing: rounding is expected, overflow to inf is not
        bad = np.isinf(b) & ~np.isinf(a)
    if np.any(bad):
        at = tuple(int(k) for k in np.unravel_index(int(np.argmax(bad)), a.shape)) if a.ndim else ()
        shown = tuple(o + k for o, k in zip(origin, at)) if origin is not None else at
        raise EinsumError(f"{where}: value {a[at].item()!r} at {shown} does not fit dtype={dtype.name} "
                          f"(it would become {b[at].item()!r})")
    return b


def _from_array(a: np.ndarray, want: Wanted, where: str, stream: bool = False) -> Incoming:
    """Cut a dense array into tiles. ``stream``: as ``_from_npy`` cuts a file, a batch of
    tiles at a time as the backend stores them (cast and put in native byte order tile by
    tile), so storing the array adds a batch, not a second copy of it (a 549 MiB array rose
    resident memory by 677 MB, a trial); else the whole table of tiles at once."""
    if stream:
        return _tile_stream(a, want, where)
    if want.dtype is not None and a.dtype != want.dtype:
        if not can_cast(a.dtype, want.dtype, "same_kind"):
            raise EinsumError(f"{where}: cannot cast {a.dtype} values to dtype={want.dtype} "
                              "(numpy's same_kind rule)")
        a = _exact_cast(a, want.dtype, where)
    dtype = check_dtype(a.dtype, where)
    if want.tile is not None:
        tile = check_tile(a.shape, want.tile)
    else:
        tile = auto_tile(a.shape, a.dtype.itemsize, want.tile_bytes, want.square)
    keys = check_keys(want.keys if want.keys is not None else tuple(f"d{k}" for k in range(a.ndim)), a.ndim)
    return Incoming(a.shape, dtype, tile, keys, tiles_from_array(a, tile, keys))


def _tile_stream(a: np.ndarray, want: Wanted, where: str, own_map: bool = False) -> Incoming:
    """``a`` (an array, or a ``.npy`` file's memory map) as a stream of batches of tiles, cast to
    ``want.dtype`` and put in native byte order tile by tile. ``own_map``: ``a`` is a ``.npy``
    file's memory map this module opened, read from the file and its pages released as it goes;
    never a caller's array (a caller's memmap may be a slice, whose filename and offset are its
    parent's, or copy-on-write, whose edits the file does not have and a release would drop:
    a review found both stored wrong, and the edits lost)."""
    dtype = np.dtype(a.dtype.name)  # native byte order
    if want.dtype is not None and dtype != want.dtype:
        if not can_cast(dtype, want.dtype, "same_kind"):
            raise EinsumError(f"{where}: cannot cast {dtype} values to dtype={want.dtype} (numpy's same_kind rule)")
        dtype = np.dtype(want.dtype)
    check_dtype(dtype, where)
    shape = tuple(int(n) for n in a.shape)
    tile = check_tile(shape, want.tile) if want.tile is not None else auto_tile(shape, dtype.itemsize, want.tile_bytes, want.square)
    keys = check_keys(want.keys if want.keys is not None else tuple(f"d{k}" for k in range(len(shape))), len(shape))
    largest = math.prod(tile) * dtype.itemsize
    per = max(1, min(STREAM_BATCH_BYTES // max(largest, 1), 1 << 16))
    schema = _tile_schema(keys, _binary_type(per * largest))
    failures: list = []
    tiles = _streamed(schema, _npy_batches(a, shape, tile, keys, dtype, per, schema, where, own_map), failures)
    return Incoming(shape, dtype.name, tile, keys, tiles, failures)


def read_source(source, where: str, want: Wanted, con=None, stream: bool = False) -> Incoming:
    """What ``source`` holds, as tiles to store. ``con`` (a DuckDB connection) reads Parquet.
    ``stream``: the backend takes a stream of tiles (DuckDB): files are read batch by batch as
    they are stored (see ``Incoming``), never whole. Every error names ``where``."""
    try:
        return _read_source(source, where, want, con, stream)
    except EinsumError as e:
        if str(e).startswith(where):
            raise
        # the shared checks (check_keys, check_tile) do not know which store they serve
        raise EinsumError(f"{where}: {e}") from None


def _wanted_checked(want: Wanted, where: str) -> Wanted:
    """``store``'s options checked and normalised (shape a tuple of ints, dtype a name, index a
    tuple of names), as every reader of a source takes them."""
    want = Wanted(want.tile, want.keys, _shape_arg(want.shape, where),
                  None if want.dtype is None else check_dtype(want.dtype, where),
                  _names_arg(want.index, "index", where), want.value, want.tile_bytes, want.square, want.memory)
    if want.value is not None and not isinstance(want.value, str):
        raise EinsumError(f"{where}: value= names the value column, got {want.value!r}")
    return want


def _read_source(source, where: str, want: Wanted, con=None, stream: bool = False) -> Incoming:
    want = _wanted_checked(want, where)
    if _is_path(source):
        return _read_path(source, where, want, con, stream)
    table = as_table(source, where, con)
    if table is not None and (hint := _pandas_index_hint(source)):
        try:
            return _from_table(table, want, where)
        except EinsumError as e:
            raise EinsumError(f"{e}{hint}" if "reset_index" not in str(e) else str(e)) from None
    if table is None:
        if any(x is not None for x in (want.shape, want.index, want.value)):
            raise EinsumError(f"{where}: shape=, index= and value= describe a table in element form; "
                              "an array brings its own shape")
        if stream:  # byte order and casts tile by tile: no whole copy first
            return _from_array(read_array(source, where), want, where, stream=True)
        return _from_array(as_array(source, where), want, where)
    return _from_table(table, want, where)


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
    if _module(x).startswith("pyarrow") and hasattr(x, "to_table") and hasattr(x, "scanner"):
        return x.to_table()  # a pyarrow.dataset Dataset (its files read whole, as a table)
    if hasattr(x, "__arrow_c_array__") and not hasattr(x, "__array__") and not hasattr(x, "__arrow_c_stream__"):
        try:  # an Arrow C array export: a struct array is a table, another an array
            got = pa.array(x)
        except Exception as e:  # noqa: BLE001 - a foreign exporter's failure is bad input
            raise EinsumError(f"{where}: cannot read this {type(x).__name__} as an Arrow array ({e})") from None
        return pa.Table.from_struct_array(got) if pa.types.is_struct(got.type) else None
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
    if mod.startswith("pandas") and name == "Series":
        return _series_elements(x, where)
    if mod.startswith("pandas") and name == "DataFrame":
        try:
            # the frame's index is not a column: reset_index() makes it one
            table = pa.Table.from_pandas(x, preserve_index=False)
            for k, dt in enumerate(x.dtypes):
                # pandas reads NaN in a numpy float column as missing, and from_pandas makes it
                # null, which store refuses; a NaN there is a value (as in the array), so keep it
                if isinstance(dt, np.dtype) and dt.kind in "fc" and table.column(k).null_count:
                    table = table.set_column(k, table.field(k),
                                             pa.array(x.iloc[:, k].to_numpy(), type=table.field(k).type))
            return table
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


def _series_elements(x, where: str) -> pa.Table | None:
    """A pandas Series: its values as an array where its index is the default one (0, 1, ...,
    unnamed); element rows where every level of its index is named (``df.groupby(["i",
    "j"])["v"].sum()``, ``df.set_index("i")["v"]``: the levels are the index columns, the values
    the value column). An unnamed index of other labels (a filtered frame's column) says where
    each value belongs or nothing: refused, not guessed (a trial stored a grouped Series' values
    as a flat vector, its coordinates lost)."""
    import pandas as pd

    index = x.index
    names = list(index.names)
    if (isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1) and names == [None]:
        return None
    if any(n is None for n in names):
        raise EinsumError(f"{where}: this pandas Series has an unnamed index other than 0, 1, ..., {len(x) - 1}, "
                          "so where its values belong is not clear; name the index levels (s.rename_axis(['i', "
                          "...])) to store it in element form, or pass s.to_numpy() for its values in order")
    columns = [str(n) for n in names]
    if len({c.lower() for c in columns}) != len(columns) or VALUE in {c.lower() for c in columns}:
        raise EinsumError(f"{where}: this pandas Series' index levels {columns} repeat a name or are named "
                          f"{VALUE!r}; rename them (s.rename_axis([...]))")
    check_series_missing(x, where)
    try:
        arrays = [pa.array(index.get_level_values(k)) for k in range(index.nlevels)]
        bad = [f"{c!r} ({_type_word(a.type)})" for c, a in zip(columns, arrays) if _kind(a.type) != "int"]
        if bad:
            raise EinsumError(f"{where}: this pandas Series' index level(s) {', '.join(bad)} are not integers; its "
                              "named index levels are read as element indices (pass s.to_numpy() for its values "
                              "in order)")
        values = x.to_numpy()
        arrays.append(pa.array(values, type=pa.from_numpy_dtype(values.dtype)) if values.dtype.kind in "fc"
                      else pa.array(x))  # NaN in a float Series is a value, not a missing one
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise EinsumError(f"{where}: this pandas Series cannot be read as element rows ({e})") from None
    return pa.table(arrays, names=columns + [VALUE])


def _pandas_index_hint(x) -> str:
    """What to say of a DataFrame whose named index ``store`` did not read."""
    names = [n for n in getattr(getattr(x, "index", None), "names", []) if n is not None]
    if not names or type(x).__name__ != "DataFrame" or not _module(x).startswith("pandas"):
        return ""
    return (f" (this DataFrame's index {', '.join(map(repr, map(str, names)))} is not read: .reset_index() "
            "makes it a column)")


def _parquet_memory_hint(e: Exception, p: str) -> str:
    """What to do when DuckDB ran out of memory reading a Parquet file: it holds a row group
    whole (a file of one 154 MB row group under memory="200MB" failed in DuckDB's words alone,
    a trial), and an element-form file is read whole."""
    import duckdb

    if not isinstance(e, duckdb.OutOfMemoryException):
        return ""
    try:
        import pyarrow.parquet as pq

        f = pq.ParquetFile(p)
        md = f.metadata
        largest = max((md.row_group(k).total_byte_size for k in range(md.num_row_groups)), default=0)
        rows = md.num_rows
        tiled = "tile" in f.schema_arrow.names and (f.schema_arrow.metadata or {}).get(f"{PREFIX}layout".encode()) == b'"tiles"'
    except Exception:  # noqa: BLE001 - the hint is a courtesy; DuckDB's error stands
        return ""
    if tiled:
        # a tiled file (Tensor.export's) said "store it from a tiled file" (a budget trial): its
        # tiles are read whole, whatever tile= is asked, and only smaller ones fit
        return (f" under its memory limit [this tiled file's largest row group is {format_bytes(largest)} uncompressed "
                f"({rows:,} tile(s) in {md.num_row_groups} row group(s)), which DuckDB reads whole, whatever tile= is "
                "asked: write it again in smaller tiles (a session with the memory to read it: "
                "db.store(name, path, tile=...).export(path); a session with memory= exports tiles sized from its "
                "budget), or give a larger memory=]. DuckDB said")
    return (f" under its memory limit [DuckDB reads a row group whole: this file's largest is {format_bytes(largest)} uncompressed, in "
            f"{md.num_row_groups} row group(s); a file in element form is read whole, about 100 bytes an element "
            f"at peak ({rows:,} rows), and so is one in array form unless its key ascends in the file. Write it "
            "with smaller row groups (pyarrow.parquet.write_table(table, path, row_group_size=...)), store it from "
            "a tiled file (Tensor.export(path) writes one), or give a larger memory=]. DuckDB said")


def _other_files(con, path: str) -> str:
    """What to do with a file this module does not read: DuckDB reads it, or on an engine without
    a DuckDB connection (Spark), the engine's reader does (a directory of Parquet files, as
    Spark writes them, was sent to db.connection, which is None there: a trial)."""
    if con is None:
        what = "a directory of Parquet files, as Spark writes them," if os.path.isdir(path) else "other files"
        return f"read {what} with your engine (spark.read.parquet(path)) and store the DataFrame"
    return "read other files with DuckDB (db.connection.read_csv(path)) and store the relation"


def read_parquet(path, where: str, con=None) -> pa.Table:
    """A Parquet file read whole by DuckDB (on a cursor of ``con``, or a connection of its
    own), with the file's key-value metadata put back on the Arrow schema."""
    import duckdb

    p = os.fspath(path)
    if not p.lower().endswith(".parquet"):
        raise EinsumError(f"{where}: a path must name a Parquet file ending in .parquet, got {p!r}; "
                          f"{_other_files(con, p)}")
    cur = _parquet_cursor(p, where, con)
    try:
        table = cur.read_parquet(p).to_arrow_table()
        meta = _parquet_meta(cur, p)
    except duckdb.Error as e:
        raise EinsumError(f"{where}: DuckDB could not read {p!r} as Parquet{_parquet_memory_hint(e, p)}: {duckdb_said(e)}") from None
    finally:
        cur.close()
    return _float16_back(table, p).replace_schema_metadata(meta)


def _has_float16(path: str) -> bool:
    """Whether the Parquet file has a FLOAT16 column (DuckDB reads it as FLOAT: ``_float16_back``)."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError):
        return True  # unknown: the path that reads it whole says what is wrong
    return any("halffloat" in str(f.type) or "float16" in str(f.type) for f in schema)


def _float16_back(table: pa.Table, path: str) -> pa.Table:
    """DuckDB has no float16 type and reads a Parquet FLOAT16 column as FLOAT; the file's own
    type comes back (exactly: every float16 is a float32), so a float16 file stores float16."""
    import pyarrow.parquet as pq

    if not any(pa.types.is_float32(col.type) or (_is_list(col.type) and pa.types.is_float32(col.type.value_type))
               for col in table.schema):
        return table  # nothing DuckDB could have widened: no second read of the footer
    try:
        schema = pq.read_schema(path)  # the footer only
    except (OSError, pa.ArrowException):
        return table
    for k, col in enumerate(table.schema):
        if col.name not in schema.names:
            continue
        was = schema.field(col.name).type
        if pa.types.is_float32(col.type) and pa.types.is_float16(was):
            to = pa.float16()
        elif (_is_list(col.type) and pa.types.is_float32(col.type.value_type) and _is_list(was)
              and pa.types.is_float16(was.value_type)):
            to = _list_like(col.type, pa.float16())  # an array-form file's embeddings (a trial)
        else:
            continue
        table = table.set_column(k, pa.field(col.name, to, col.nullable), pc.cast(table.column(k), to))
    return table


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
        if field in _META_TYPES and (not isinstance(out[field], _META_TYPES[field])
                                     or isinstance(out[field], bool)):  # JSON true is no int here
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


def _check_columns(schema: pa.Schema, tiled: bool, where: str) -> None:
    """Each column name once (a join's two ``i`` columns made a KeyError), and a tiled source's
    ``tile`` column present and holding bytes (strings were stored as VARCHAR, a tensor no
    kernel can read)."""
    names = schema.names
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise EinsumError(f"{where}: column name(s) {', '.join(map(repr, dup))} appear more than once (a join's "
                          "columns, say); select or rename them first (SELECT a.i AS i, b.i AS j, ...)")
    if not tiled:
        return
    if TILE not in names:
        raise EinsumError(f"{where}: the eindecomp_sql metadata says tiled form, but there is no {TILE!r} column")
    t = schema.field(TILE).type
    if not (_is_binary(t) or pa.types.is_fixed_size_binary(t)):
        raise EinsumError(f"{where}: column {TILE!r} holds {_type_word(t)}; a tile is raw bytes (binary, "
                          "large_binary, binary_view or fixed_size_binary: cast it, or decode a dictionary first)")


# -- element form --------------------------------------------------------------------------
def _element_columns(table: pa.Table, want: Wanted, where: str) -> tuple[list[str], str]:
    """Which columns are the indices and which is the value. The rules (``Session.store``):
    ``value=`` names the value column, else a column named ``value``, else the one column that
    is not integer; ``index=`` names the index columns, else every other column, in order (in
    the order of the metadata's keys, for a table this package wrote, unless ``shape=`` is
    given: ``_from_elements``)."""
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
            dense = len(cols) > 1 and all(_kind(table.schema.field(c).type) == "number" for c in cols)
            raise EinsumError(f"{where}: no integer columns ({typed}); a table in element form "
                              "has integer index columns, one per dimension, and one numeric value column "
                              + ("(a table whose every column is a number is a dense array: store "
                                 "df.to_numpy(), or an array column as array form)" if dense else
                                 "(a DataFrame's index is not read: .reset_index() makes it a column)"))
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
    named = meta.get("keys")
    if (want.index is None and want.shape is None and isinstance(named, list) and len(named) == len(index)
            and sorted(str(k).lower() for k in named) == sorted(c.lower() for c in index)):
        # the metadata names the dimensions: a table whose columns were reordered (select,
        # a join) keeps them, as the tiled form does, instead of transposing the tensor
        by_name = {c.lower(): c for c in index}
        index = [by_name[str(k).lower()] for k in named]
    vcol = _no_nulls(table, value, where)
    if _kind(vcol.type) == "other":
        raise EinsumError(f"{where}: value column {value!r} holds {_type_word(vcol.type)}, not numbers; cast it "
                          "to a numeric type")
    vals = vcol.to_numpy()
    check_dtype(vals.dtype, f"{where}: value column {value!r}")
    written = meta.get("dtype")
    if written is not None and want.dtype is None and vals.dtype != _written_as(written):
        # a value column replaced since to_arrow("elements") wrote it (pyarrow's set_column
        # keeps the metadata): its own type, not the old dtype (float64 values were rounded to
        # the old float32 without a word, a trial)
        written = None
    dtype = want.dtype or written or vals.dtype.name
    if vals.dtype != dtype:
        if not can_cast(vals.dtype, dtype, "same_kind"):
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
    limit = want.memory or _physical_memory()
    if limit and nbytes > limit:
        # np.zeros would not fail: Linux hands pages out as they are written, and the scatter
        # then writes until the process is killed (a trial: one row at index 1e9, killed at 19 GB)
        what = "the session's memory budget" if want.memory else "this machine's memory"
        raise EinsumError(f"{where}: the table in element form is read as a dense {shape} {dtype} array of "
                          f"{format_bytes(nbytes)}, more than {what} ({format_bytes(limit)}); tensors are stored "
                          "dense (renumber the indices densely from 0, or store only the rows you need)")
    try:  # before the duplicate check, whose flat indices must fit an int64
        dense = np.zeros(shape, dtype=dtype)
    except (MemoryError, ValueError):
        raise EinsumError(f"{where}: shape {shape} would take {format_bytes(nbytes)} as a dense array") from None
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
    return _from_array(dense, Wanted(tile, keys, tile_bytes=want.tile_bytes, square=want.square, memory=want.memory),
                       where)


def _check_unique(idx: np.ndarray, shape: tuple[int, ...], names: list[str], where: str, tiles: bool = False) -> None:
    """Each element (``tiles``: each tile key) at most once: duplicates are named, with their rows."""
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
    if tiles:
        raise EinsumError(f"{where}: tile key ({at}) appears more than once (rows {int(rows[0])} and {int(rows[1])}); "
                          "a tiled table holds each tile of the grid exactly once")
    raise EinsumError(f"{where}: index ({at}) appears more than once (rows {int(rows[0])} and {int(rows[1])}); "
                      f"{len(np.unique(dup_at))} index tuple(s) are duplicated in all. A table in element form "
                      "holds each element once: aggregate duplicates first (GROUP BY the index columns)")


# -- tiled form ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tiled:
    """What a tiled source says it holds, checked against ``store``'s options."""

    shape: tuple[int, ...]
    dtype: str
    tile: tuple[int, ...]
    keys: tuple[str, ...]  # the source's key columns
    new_keys: tuple[str, ...]  # the stored tensor's
    byte_order: str
    recut: bool  # tile=, dtype= or the byte order ask for the tiles to be cut anew

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(tiling.grid(self.shape, self.tile))


def _describe_tiled(columns: list[str], meta: dict, want: Wanted, where: str) -> _Tiled:
    """A tiled source's description (its metadata, or ``shape=``, ``dtype=``, ``tile=``)."""
    if meta.get("layout") == "elements":
        raise EinsumError(f"{where}: the metadata says element form but the table has a 'tile' column")
    if want.index is not None or want.value is not None:
        raise EinsumError(f"{where}: index= and value= are for tables in element form; this one is tiled "
                          "(a binary 'tile' column)")
    if meta:
        missing = [k for k in ("shape", "dtype", "tile") if meta.get(k) is None]
        if missing:  # the tiles' bytes mean nothing without them (a missing dtype read them as float64)
            raise EinsumError(f"{where}: the table's eindecomp_sql metadata lacks {', '.join(missing)}; it cannot "
                              "be read as tiles (write it with Tensor.to_arrow() / export())")
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
        keys = tuple(c for c in columns if c != TILE)
    dtype = check_dtype(dtype, f"{where}: metadata dtype")
    tile = check_tile(shape, tile)
    for k in keys:
        if k not in columns:
            raise EinsumError(f"{where}: key column {k!r} is missing; the columns are {columns}")
    if len(keys) != len(shape):
        raise EinsumError(f"{where}: {len(keys)} key column(s) {list(keys)} for a tensor of shape {shape}")
    order = meta.get("byte_order", sys.byteorder)
    new_keys = check_keys(want.keys if want.keys is not None else keys, len(shape))
    recut = ((want.tile is not None and bool(meta) and check_tile(shape, want.tile) != tile)
             or (want.dtype is not None and want.dtype != dtype) or order != sys.byteorder)
    return _Tiled(tuple(shape), dtype, tile, keys, new_keys, order, recut)


def _check_key_range(t: _Tiled, kcols: list[np.ndarray], where: str, row0: int = 0) -> None:
    for k, col, g in zip(t.keys, kcols, t.grid):
        if col.size and (col.min() < 0 or col.max() >= g):
            row = int(np.argmax((col < 0) | (col >= g)))
            raise EinsumError(f"{where}: key column {k!r} holds {col[row]} at row {row0 + row}; tiles of {t.tile} "
                              f"over shape {t.shape} have keys 0..{g - 1}")


def _check_tile_rows(t: _Tiled, table, where: str, row0: int = 0) -> tuple[list[np.ndarray], pa.ChunkedArray]:
    """Check rows of tiles (a table, or one batch of a stream whose first row is ``row0``):
    keys inside the grid, no nulls, each tile exactly the bytes its extents take. Returns the
    key columns (int64) and the tile column."""
    kcols = [_index_array(table, k, where) for k in t.keys]
    _check_key_range(t, kcols, where, row0)
    tcol = _no_nulls(table, TILE, where)
    if pa.types.is_binary_view(tcol.type) or pa.types.is_fixed_size_binary(tcol.type):
        # no length kernel for views in pyarrow (26); Spark's tile reader takes offsets
        tcol = tcol.cast(pa.large_binary())
    itemsize = np.dtype(t.dtype).itemsize
    ext = [np.minimum(s, n - col * s) for col, s, n in zip(kcols, t.tile, t.shape)]
    want_bytes = np.prod(np.stack(ext), axis=0) * itemsize if ext else np.full(len(tcol), itemsize)
    got = pc.binary_length(tcol).to_numpy(zero_copy_only=False).astype(np.int64)
    bad = np.nonzero(got != want_bytes)[0]
    if bad.size:
        r = int(bad[0])
        at = ", ".join(f"{k}={int(c[r])}" for k, c in zip(t.keys, kcols))
        raise EinsumError(f"{where}: the tile at ({at}) holds {got[r]} bytes; a {t.dtype} tile there takes "
                          f"{want_bytes[r]} (tile {t.tile}, shape {t.shape}, edge tiles smaller)")
    return kcols, tcol


def _check_tile_keys(t: _Tiled, kcols: list[np.ndarray], rows: int, where: str) -> None:
    """Every key of the grid exactly once (after the rows' own checks)."""
    expect = int(np.prod(t.grid, dtype=np.int64))
    if rows != expect:
        raise EinsumError(f"{where}: {rows} tile rows, but shape {t.shape} in tiles of {t.tile} has {expect}")
    idx = np.stack(kcols) if kcols else np.zeros((0, rows), np.int64)
    _check_unique(idx, t.grid, list(t.keys), where, tiles=True)


def check_stored_tiles(table: pa.Table, value, where: str) -> None:
    """The rows read from a stored tensor's table are its grid's tiles, each once, each the
    bytes its extents take, none NULL: ``store`` checked them as they came in, but the table is
    the user's to edit in SQL, and a deleted, repeated or NULL tile read as it was gave zeros,
    a doubled tile or uninitialised memory. ~µs a tile: keys and lengths, not the tile bytes."""
    t = _stored(value)
    kcols, _ = _check_tile_rows(t, table, where)
    _check_tile_keys(t, kcols, table.num_rows, where)


def _stored(value) -> _Tiled:
    return _Tiled(tuple(value.shape), value.dtype, tuple(value.tile), tuple(value.keys), tuple(value.keys),
                  sys.byteorder, False)


def checked_tile_batches(value, batches, where: str):
    """``batches`` (a context manager giving an iterator of a stored tensor's tile batches),
    each checked as ``check_stored_tiles`` checks a whole table, and the grid's every key
    exactly once when the last has passed: an export of a table edited out of shape in SQL
    wrote zeros for a deleted tile. Raised at the end, the writer's temporary file is dropped."""
    t = _stored(value)

    @contextlib.contextmanager
    def checked():
        with batches() as it:
            def each():
                keys, rows = [], 0
                for b in it:
                    kcols, _ = _check_tile_rows(t, b, where, rows)
                    keys.append(np.stack(kcols) if kcols else np.zeros((0, b.num_rows), np.int64))
                    rows += b.num_rows
                    yield b
                idx = np.concatenate(keys, axis=1) if keys else np.zeros((len(t.keys), 0), np.int64)
                _check_tile_keys(t, list(idx), rows, where)

            yield each()

    return checked


def _from_tiles(table: pa.Table, meta: dict, want: Wanted, where: str) -> Incoming:
    """Check a tiled table against its description and pass its tiles on as they are (re-cut
    through a dense array only when ``tile=``, ``dtype=`` or the byte order asks for it)."""
    t = _describe_tiled(table.column_names, meta, want, where)
    kcols = [_index_array(table, k, where) for k in t.keys]
    if all(not c.size or (c.min() >= 0 and c.max() < g) for c, g in zip(kcols, t.grid)):
        _check_tile_keys(t, kcols, table.num_rows, where)  # a missing or repeated key before tile bytes
    kcols, tcol = _check_tile_rows(t, table, where)  # (refuses keys outside the grid)
    if t.recut:
        # re-cut, convert or swap bytes through the dense array (whole in memory)
        source_dtype = np.dtype(t.dtype).newbyteorder("<" if t.byte_order == "little" else ">")
        dense = array_from_tiles(table, t.shape, t.tile, source_dtype, t.keys)
        dense = dense.astype(np.dtype(t.dtype).newbyteorder("="))
        return _from_array(dense, Wanted(want.tile or t.tile, t.new_keys, dtype=want.dtype,
                                         tile_bytes=want.tile_bytes, square=want.square), where)
    tiles = pa.table({**{nk: pa.array(c) for nk, c in zip(t.new_keys, kcols)}, TILE: tcol})
    return Incoming(t.shape, t.dtype, t.tile, t.new_keys, tiles)


# -- out: Arrow and Parquet ----------------------------------------------------------------
def elements_table(a: np.ndarray, names: tuple[str, ...]) -> pa.Table:
    """One row per element of ``a`` (C order): an int64 column per dimension, then ``value``.
    Builds every index column at once: the whole array and its indices are in memory."""
    _element_form_check(a.dtype, names)
    cols = {n: pa.array(c.reshape(-1).astype(np.int64, copy=False))
            for n, c in zip(names, np.indices(a.shape, sparse=False))} if a.ndim else {}
    cols[VALUE] = pa.array(np.ascontiguousarray(a).reshape(-1).astype(arrow_value_dtype(a.dtype), copy=False))
    return pa.table(cols)


def _written_as(dtype) -> np.dtype | None:
    """The value column's numpy dtype that ``to_arrow("elements")`` writes for ``dtype`` (None:
    no dtype this package writes)."""
    try:
        return arrow_value_dtype(dtype)
    except TypeError:
        return None


def arrow_value_dtype(dtype) -> np.dtype:
    """The numpy dtype of an element column's values in Arrow: the tensor's own, but float32
    for bfloat16 (Arrow has no bfloat16; every bfloat16 is a float32 exactly, and the table's
    metadata brings the dtype back on the way in)."""
    dt = np.dtype(dtype)
    return np.dtype(np.float32) if is_bfloat16(dt) else dt


def write_parquet(table: pa.Table, path, sync: bool = False) -> pathlib.Path:
    """Write ``table`` to ``path`` atomically: into a temporary file in the same directory, then
    renamed over ``path``, so a failure leaves no half-written file (and any old file intact);
    ``sync``: fsynced too (``_atomic_write``)."""
    import pyarrow.parquet as pq

    return _atomic_write(path, lambda tmp: pq.write_table(table, tmp), "Parquet", sync)


# -- files: .npy, Arrow IPC and Parquet, streamed -------------------------------------------
# A streamed source reaches the backend in batches of about this many bytes of tiles (at least
# one tile a batch): what Python holds of it at a time, about twice over (the batch the engine
# reads while the next is cut, and the memory-map pages behind it). 64 MB peaked at +250 MB
# streaming a 400 MB .npy in 8 MB tiles, 32 MB at +146 MB.
STREAM_BATCH_BYTES = 16 << 20
NPY_SUFFIXES = (".npy",)
IPC_SUFFIXES = (".arrow", ".feather")
PARQUET_SUFFIXES = (".parquet",)
# error() messages of the SQL that stores a Parquet file start with this: Incoming.failure
# finds our text in DuckDB's error
_CHECK_MARK = "[eds-check] "


def _suffix(p: str) -> str:
    return pathlib.PurePath(p).suffix.lower()


def _binary_type(largest_batch: int) -> pa.DataType:
    return pa.binary() if largest_batch <= (1 << 31) - 1 else pa.large_binary()


def _tile_schema(keys: tuple[str, ...], tile_type: pa.DataType, meta: dict | None = None) -> pa.Schema:
    return pa.schema([(k, pa.int64()) for k in keys] + [(TILE, tile_type)], metadata=meta)


def _streamed(schema: pa.Schema, batches, failures: list) -> pa.RecordBatchReader:
    """A reader over ``batches``; an exception raised while making them (a check, a bad file,
    Ctrl-C) is kept in ``failures`` as well: the engine reading the stream only sees its text."""
    def run():
        try:
            yield from batches
        except GeneratorExit:  # the reader was dropped: whatever stopped it is the error
            raise
        except BaseException as e:
            failures.append(e)
            raise
    return pa.RecordBatchReader.from_batches(schema, run())


def _read_path(path, where: str, want: Wanted, con, stream: bool) -> Incoming:
    """A file source, by its suffix: ``.npy``, ``.arrow`` / ``.feather``, ``.parquet``."""
    p = os.fspath(path)
    suffix = _suffix(p)
    kinds = NPY_SUFFIXES + IPC_SUFFIXES + PARQUET_SUFFIXES
    if suffix not in kinds:
        table = ""
        if con is not None and not suffix and os.sep not in p and not os.path.exists(p):
            # a name, not a path: a table of the database is stored from its relation (a trial)
            table = f", or to store a table or view {p!r} of the database, pass db.connection.table({p!r})"
        raise EinsumError(f"{where}: a path must name a .npy, .arrow / .feather (Arrow IPC) or .parquet file, got "
                          f"{p!r}; {_other_files(con, p)}{table}")
    if suffix in NPY_SUFFIXES:
        return _from_npy(p, want, where, stream)
    if suffix in IPC_SUFFIXES:
        return _from_ipc(p, want, where, stream)
    return _from_parquet(p, want, where, con, stream)


# .npy: a memory map, cut tile by tile
def _release(mm) -> None:
    """Drop the pages of memory map ``mm`` from this process (its resident size): the data stays
    in the file and the page cache, and comes back on the next touch."""
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


def _load_npy(p: str, where: str) -> np.ndarray:
    if not os.path.isfile(p):
        raise EinsumError(f"{where}: no such .npy file {p!r}")
    try:
        return np.load(p, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise EinsumError(f"{where}: cannot read {p!r} as a .npy file: {e}") from None


def npy_dtype(file_dtype: np.dtype, want, where: str) -> np.dtype:
    """The dtype a .npy file's elements are read as: the file's own, one of ``DTYPES``; 2-byte
    voids are bfloat16 when ``want`` (the dtype asked for) says so. np.save writes a bfloat16
    array as '|V2' (numpy has no name for it), so only the caller can tell."""
    if file_dtype.kind == "V" and file_dtype.itemsize == 2 and file_dtype.names is None and not is_bfloat16(file_dtype):
        if want is None or not is_bfloat16(want):
            raise EinsumError(f"{where} holds 2-byte void elements ({file_dtype.str!r}), which is how numpy saves a "
                              "bfloat16 array; pass dtype='bfloat16' to read them as bfloat16")
        return np.dtype("bfloat16")
    check_dtype(file_dtype, where)
    return file_dtype


def _from_npy(p: str, want: Wanted, where: str, stream: bool) -> Incoming:
    """A ``.npy`` file through a memory map, cut into tiles a batch at a time: only one batch of
    tiles is in memory (the pages of the map read so far are released after each batch)."""
    if any(x is not None for x in (want.shape, want.index, want.value)):
        raise EinsumError(f"{where}: shape=, index= and value= describe a table in element form; a .npy file "
                          "brings its own shape")
    a = _load_npy(p, where)
    if npy_dtype(a.dtype, want.dtype, f"{where}: {p!r}") != a.dtype:
        a = a.view(np.dtype("bfloat16"))
    incoming = _tile_stream(a, want, where, own_map=True)
    if not stream:
        return replace(incoming, tiles=incoming.tiles.read_all())
    return incoming


SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of the range's dirty pages, do not wait


@functools.cache
def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


class _FileBoxes:
    """Boxes (tiles) of a C-order array stored in a file, read with ``preadv`` into the caller's
    buffer or written with ``pwritev`` from it: one call per contiguous run of the box. Not
    through a memory map: reading a 1024-row tile of a 32768-wide float32 array through one
    mapped 83 MB of file pages (the kernel maps 64 KB around each faulting row), which put a
    4 GiB store at 600 MB; writing through one kept the written pages mapped until released
    (+146 MB in a 2 GiB export) and took a page fault per 4 KB."""

    def __init__(self, path, offset: int, shape, itemsize: int, where: str, write: bool = False):
        self.fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
        self.offset = int(offset)
        self.shape = tuple(int(n) for n in shape)
        self.itemsize = int(itemsize)
        self.strides = [math.prod(self.shape[d + 1:]) for d in range(len(self.shape))]  # in elements
        self.where = where

    def close(self) -> None:
        os.close(self.fd)

    def _runs(self, box: tuple[slice, ...]) -> tuple[list[int], int]:
        """(file offset of each contiguous run of the box, in C order; bytes per run)."""
        ext = [s.stop - s.start for s in box]
        j = len(ext) - 1  # the box is contiguous in the file over dims j.. (trailing dims it covers whole)
        run = ext[j]
        while j > 0 and ext[j] == self.shape[j]:
            j -= 1
            run *= ext[j]
        base = self.offset + self.itemsize * box[j].start * self.strides[j]
        if not j:
            return [base], run * self.itemsize
        grid = np.indices(ext[:j]).reshape(j, -1).T + [s.start for s in box[:j]]
        return (base + self.itemsize * (grid @ np.array(self.strides[:j], np.int64))).tolist(), run * self.itemsize

    def read(self, box: tuple[slice, ...], out: np.ndarray) -> None:
        """Fill ``out`` (C-contiguous, the box's shape, the file's dtype) with the box."""
        starts, size = self._runs(box)
        view = memoryview(out.reshape(-1).view(np.uint8))
        for r, start in enumerate(starts):
            part, at = view[r * size:(r + 1) * size], start
            while len(part):
                n = os.preadv(self.fd, [part], at)
                if n <= 0:
                    raise EinsumError(f"{self.where}: the .npy file ends before the data its header describes")
                part, at = part[n:], at + n

    def writeback(self, rows: slice) -> None:
        """Start writing rows ``rows`` (of the first axis) to the disk, without waiting: Linux's
        ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, so an fsync at the end finds them written.
        Nothing where libc has no such call."""
        call = _sync_file_range()
        if call is not None:
            row = self.itemsize * self.strides[0]
            call(self.fd, self.offset + rows.start * row, (rows.stop - rows.start) * row, SYNC_FILE_RANGE_WRITE)

    def write(self, box: tuple[slice, ...], data: np.ndarray) -> None:
        """Write ``data`` (the box's bytes in C order, any array) to the box."""
        starts, size = self._runs(box)
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        for r, start in enumerate(starts):
            part, at = view[r * size:(r + 1) * size], start
            while len(part):
                n = os.pwritev(self.fd, [part], at)
                part, at = part[n:], at + n


def _npy_batches(a: np.ndarray, shape, tile, keys, dtype: np.dtype, per: int, schema: pa.Schema, where: str,
                 own_map: bool = True):
    grid = tiling.grid(shape, tile)
    coords = np.ndindex(*grid)  # C order of keys; one () for a 0-d array, none for a size-0 one
    mm = getattr(a, "_mmap", None) if own_map else None
    cast = a.dtype.name != dtype.name
    # C-order files are read with preadv; Fortran order (and 0-d arrays) through the map
    # (a size-0 view of a map, as bfloat16 of '|V2' is, has no file: there is nothing to read)
    boxes_in = (_FileBoxes(a.filename, a.offset, a.shape, a.dtype.itemsize, where)
                if own_map and isinstance(a, np.memmap) and a.filename is not None and a.ndim and a.flags.c_contiguous
                and hasattr(os, "preadv") else None)
    try:
        while True:
            chunk = list(itertools.islice(coords, per))
            if not chunk:
                return
            boxes = [tuple(slice(k * t, min((k + 1) * t, n)) for k, t, n in zip(c, tile, shape)) for c in chunk]
            counts = [math.prod(s.stop - s.start for s in b) for b in boxes]
            offsets = np.zeros(len(chunk) + 1, np.int64)
            np.cumsum(np.array(counts, np.int64) * dtype.itemsize, out=offsets[1:])
            buf = np.empty(int(offsets[-1]), np.uint8)
            for r, b in enumerate(boxes):
                out = buf[offsets[r]:offsets[r + 1]].view(dtype).reshape(tuple(s.stop - s.start for s in b))
                if boxes_in is not None and a.dtype == dtype:  # the file's bytes are the tile's
                    boxes_in.read(b, out)
                    continue
                if boxes_in is not None:
                    piece = np.empty(out.shape, a.dtype)
                    boxes_in.read(b, piece)
                else:
                    piece = a[b]
                if cast:
                    piece = _exact_cast(np.asarray(piece), dtype, where, tuple(s.start for s in b))
                out[...] = piece  # converts the byte order too
            _release(mm)
            cols = [pa.array(np.array([c[p] for c in chunk], np.int64)) for p in range(len(keys))]
            otype = pa.int32() if schema.field(TILE).type == pa.binary() else pa.int64()
            tiles = pa.Array.from_buffers(schema.field(TILE).type, len(chunk),
                                          [None, pa.py_buffer(offsets.astype(otype.to_pandas_dtype())),
                                           pa.py_buffer(buf)])
            yield pa.record_batch(cols + [tiles], schema=schema)
    finally:
        _release(mm)
        if boxes_in is not None:
            boxes_in.close()


# Arrow IPC (.arrow / .feather): batches read from the file one at a time
def _open_ipc(p: str, where: str):
    """(schema, batch iterator factory) of an Arrow IPC file (or stream) at ``p``. The file is
    read, not mapped: a batch's memory is freed once it has been stored."""
    if not os.path.isfile(p):
        raise EinsumError(f"{where}: no such Arrow IPC file {p!r}")
    try:
        f = pa.OSFile(p)
        try:
            reader = pa.ipc.open_file(f)
        except pa.ArrowInvalid:
            f.close()
            f = pa.OSFile(p)
            reader = pa.ipc.open_stream(f)
    except (pa.ArrowException, OSError) as e:
        raise EinsumError(f"{where}: cannot read {p!r} as an Arrow IPC file ({e}); write it with "
                          "pyarrow.ipc.new_file, pyarrow.feather.write_feather (version 2) or Tensor.export") from None

    def batches():
        try:
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
            else:
                yield from reader
        except pa.ArrowException as e:
            raise EinsumError(f"{where}: cannot read {p!r}: {e}") from None
        finally:
            f.close()

    return reader.schema, batches


def _from_ipc(p: str, want: Wanted, where: str, stream: bool) -> Incoming:
    """An Arrow IPC file: a tiled one streams (checked batch by batch), anything else (element
    form, or tiles to re-cut) is read whole."""
    schema, batches = _open_ipc(p, where)
    meta = read_metadata(schema.metadata, where)
    tiled = meta.get("layout") == "tiles" or (
        TILE in schema.names and _is_binary(schema.field(TILE).type) and want.value is None)
    _check_columns(schema, tiled, where)
    if tiled and stream:
        t = _describe_tiled(schema.names, meta, want, where)
        if not t.recut:
            failures: list = []
            out = _tile_schema(t.new_keys, pa.large_binary())
            reader = _streamed(out, _checked_tile_batches(t, batches(), out, where), failures)
            return Incoming(t.shape, t.dtype, t.tile, t.new_keys, reader, failures)
    try:
        table = pa.Table.from_batches(list(batches()), schema)
    except pa.ArrowException as e:
        raise EinsumError(f"{where}: cannot read {p!r}: {e}") from None
    table = table.replace_schema_metadata(schema.metadata)
    # array form too, as a table or a Parquet file of it is read (it was taken for element form:
    # "column 'emb' holds fixed_size_list ... neither integer indices nor a numeric value", a trial)
    return _from_table(table, want, where)


def _checked_tile_batches(t: _Tiled, batches, schema: pa.Schema, where: str):
    """The batches of a tiled stream, each checked as it passes, the keys all checked at the
    end (a failure there still stops the store: the engine has not committed yet)."""
    seen: list[list[np.ndarray]] = [[] for _ in t.keys]
    rows = 0
    for batch in batches:
        kcols, tcol = _check_tile_rows(t, batch, where, rows)
        rows += batch.num_rows
        for acc, c in zip(seen, kcols):
            # a copy: a zero-copy view of a key column keeps its whole batch alive, tiles and
            # all (an IPC reader reads a batch into one buffer), so a 549 MiB tiled .arrow file
            # was held whole by a store that streams it (a trial: pool peak 548 MB, now 2 MB)
            acc.append(np.array(c, dtype=np.int64, copy=True))
        tcol = tcol.cast(pa.large_binary()) if tcol.type != pa.large_binary() else tcol
        yield pa.record_batch([pa.array(c) for c in kcols] + [tcol], schema=schema)
    _check_tile_keys(t, [np.concatenate(a) if a else np.zeros(0, np.int64) for a in seen], rows, where)


# Parquet: DuckDB reads the file; a tiled file goes into the table in one statement
def _parquet_cursor(p: str, where: str, con):
    """A cursor of ``con`` (or a connection of its own) that reads the Parquet file ``p``, after
    the checks that it exists and is not read as a pattern."""
    import duckdb

    if os.path.isdir(p):
        # a directory of Parquet files named x.parquet, as Spark writes one, was "no such
        # Parquet file" (a trial)
        advice = _other_files(con, p) if con is None else (
            "read a directory of Parquet files with DuckDB (db.connection.read_parquet(path + '/*.parquet')) "
            "and store the relation")
        raise EinsumError(f"{where}: {p!r} is a directory, not one Parquet file; {advice}")
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
    except duckdb.Error as e:
        cur.close()
        raise EinsumError(f"{where}: DuckDB could not read {p!r} as Parquet{_parquet_memory_hint(e, p)}: {duckdb_said(e)}") from None
    except BaseException:
        cur.close()
        raise
    return cur


def _parquet_meta(cur, p: str) -> dict[bytes, bytes] | None:
    meta = dict(cur.execute("SELECT key, value FROM parquet_kv_metadata(?)", [p]).fetchall())
    meta = {bytes(k): bytes(v) for k, v in meta.items() if bytes(k).startswith(PREFIX.encode())}
    return meta or None


def _from_parquet(p: str, want: Wanted, where: str, con, stream: bool) -> Incoming:
    """A Parquet file. Tiled, on a DuckDB backend, without re-cutting: the keys are read and
    checked here, and the tiles go from the file into the table in the store's one statement
    (DuckDB checks each tile's bytes as it reads them). Otherwise read whole, as a table."""
    import duckdb

    if not stream:
        table = read_parquet(p, where, con)
        return _from_table(table, want, where)
    cur = _parquet_cursor(p, where, con)
    try:
        rel = cur.read_parquet(p)
        schema = rel.limit(0).to_arrow_table().schema
        meta = read_metadata(_parquet_meta(cur, p), where)
        tiled = meta.get("layout") == "tiles" or (
            TILE in schema.names and _is_binary(schema.field(TILE).type) and want.value is None)
        _check_columns(schema, tiled, where)
        t = _describe_tiled(schema.names, meta, want, where) if tiled else None
        if t is None and not _has_float16(p) and (packed := _packed_array_rows(p, want, where, con)) is not None:
            return packed  # array form: DuckDB numbers and packs the rows, never whole in Python
        if t is None or t.recut:
            table = _float16_back(rel.to_arrow_table(), p).replace_schema_metadata(_parquet_meta(cur, p))
            return _from_table(table, want, where)
        rows = cur.execute("SELECT count(*) FROM read_parquet(?)", [p]).fetchall()[0][0]
        keys = rel.project(", ".join(_quote(k) for k in t.keys)).to_arrow_table() if t.keys else None
    except duckdb.Error as e:
        raise EinsumError(f"{where}: DuckDB could not read {p!r} as Parquet{_parquet_memory_hint(e, p)}: {duckdb_said(e)}") from None
    finally:
        cur.close()
    kcols = [_index_array(keys, k, where) for k in t.keys]
    _check_key_range(t, kcols, where)
    _check_tile_keys(t, kcols, rows, where)
    return Incoming(t.shape, t.dtype, t.tile, t.new_keys, ParquetRows(p, t, where, rows))


_SOURCES = itertools.count()  # names of array-form sources DuckDB packs (PackedRows)
RANK = "_eds_rank"  # their rows' rank (file_row_number): a name no user column takes ('r' was one)


@dataclass(frozen=True)
class PackedRows:
    """The tiles of a Parquet file in array form whose rows are in key order, packed by DuckDB
    as the SQL functions pack an embeddings table (``sql_interface.pack_rows``, whole rows per
    tile): ``select_rows(lo, hi)`` is the SELECT of tiles [lo, hi) (one tile per row key),
    reading only the file's rows of those tiles (``file_row_number`` is the row's rank, and a
    range of it skips the other row groups, as ``ParquetRows`` reads a tiled file);
    ``attach(cursor)`` makes the file readable on the cursor that runs them, for its block.
    Read whole and cut in Python, a 1 GiB (id, FLOAT[8192]) file rose resident memory by 3.5
    GB under memory="500MB" (a trial)."""

    op: object  # the ArrayTable, over the attached view: (RANK, the array column)
    tiled: TiledValue
    rows: int
    path: str
    where: str = ""  # how errors name the store

    def said(self, text: str) -> EinsumError | None:
        """A pack kernel's error about the attached view, said of the store (a NULL element
        was "table '_eds_src36': column 'emb' has NULL elements", a review)."""
        m = re.search(rf"einsum\(\): table {re.escape(repr(self.op.table))}(.*)", text)
        return EinsumError(f"{self.where}{m.group(1)}") if m else None

    def select_rows(self, lo: int | None = None, hi: int | None = None):
        from .compile.sql_interface import pack_rows

        return pack_rows(self.op, self.tiled, band=None if lo is None else (lo, min(hi, self.rows)), ranked=True)

    @contextlib.contextmanager
    def attach(self, cur):
        _attach(cur, self.op.table, self.path, self.op.column)
        try:
            yield
        finally:
            _detach(cur, self.op.table)


def _attach(cur, name: str, path: str, column: str | None = None) -> None:
    """A TEMP view ``name`` over the Parquet file: every column, or the row's number (as
    ``RANK``) and ``column`` (the path a literal, the names identifiers)."""
    from sqlglot import exp

    what = "*" if column is None else f"file_row_number AS {RANK}, {exp_ident(column)}"
    cur.execute(f"CREATE OR REPLACE TEMP VIEW {exp_ident(name)} AS SELECT {what} FROM read_parquet("
                f"{exp.Literal.string(path).sql(dialect='duckdb')}, file_row_number = true)")


def _detach(cur, name: str) -> None:
    import duckdb

    try:
        cur.execute(f"DROP VIEW IF EXISTS {exp_ident(name)}")
    except duckdb.Error:
        pass


def exp_ident(name: str) -> str:
    """``name`` as a quoted DuckDB identifier (the compiler's, rendered)."""
    from .compile.compiler import ident

    return ident(name).sql(dialect="duckdb")


def packs_array_file(path: str, memory: int | None) -> bool:
    """Whether an array-form Parquet file is worth packing by DuckDB: read whole it takes ~4x
    its bytes (uncompressed, from the file's footer), so where that passes the budget (without
    one, half this machine's memory). Packing costs time: 61 MB (20000 x 768 float32) stored in
    1.6 s against 0.57 s whole (+114 MB against +186 MB under memory="100MB"), 2000 x 64 in 0.25
    s against 0.05 s."""
    import pyarrow.parquet as pq

    try:
        md = pq.ParquetFile(path).metadata
        nbytes = sum(md.row_group(k).total_byte_size for k in range(md.num_row_groups))
    except (pa.ArrowException, OSError):
        return False
    limit = memory if memory is not None else (_physical_memory() or 1 << 62) // 2
    return 4 * nbytes > limit


def _packed_array_rows(path: str, want: Wanted, where: str, con) -> Incoming | None:
    """A Parquet file in array form whose key is ascending in file order, as tiles DuckDB packs
    (``PackedRows``); None where it is not in array form with a key column, its keys are not
    in order (its rows would need a sort; the file is then read whole, as before), or the store
    asks for what this route does not do (a tile that is not whole rows, a shape, a dtype, an
    index). A ``tile=`` of whole rows and a ``value=`` naming the array column are this
    route's own: with either, a file it packed under 200MB in +110 MB was read whole, +850 MB
    (a budget trial; the CLI's ``--tile`` too)."""
    import duckdb

    from .compile.sql_interface import ArrayTable, array_tile, classify_table, stats_query, with_stats

    if con is None or any(x is not None for x in (want.shape, want.dtype, want.index)):
        return None
    if not packs_array_file(path, want.memory):
        return None
    name = f"_eds_src{next(_SOURCES)}"
    try:
        cur = con.cursor()
    except duckdb.Error:
        return None
    try:
        _attach(cur, name, path)
        rel = cur.sql(f"SELECT * EXCLUDE (file_row_number) FROM {exp_ident(name)} LIMIT 0")
        columns, types = list(rel.columns), [str(t) for t in rel.types]
        if len(set(columns)) != len(columns) or RANK in (c.lower() for c in columns):
            return None
        try:
            op = classify_table(name, columns, types)
        except EinsumError:
            return None  # not array form: the old path's messages
        if not isinstance(op, ArrayTable) or (want.value is not None and want.value.lower() != op.column.lower()):
            return None  # (names are DuckDB's: case-insensitive)
        try:
            op = with_stats(op, cur.execute(stats_query(op).sql(dialect="duckdb")).fetchone())
        except EinsumError as e:
            raise EinsumError(str(e).replace(f"einsum(): table {name!r}", where, 1)) from None
        if not op.rows or not op.width:
            return None
        key = exp_ident(op.key)
        unordered = cur.execute(f"SELECT count(*) FROM (SELECT {key} AS k, lag({key}) OVER (ORDER BY file_row_number) "
                                f"AS before FROM {exp_ident(name)}) WHERE before >= k").fetchone()[0]
        if unordered:
            return None
        if want.tile is None:
            tile = array_tile(op, want.tile_bytes)
            if math.prod(tile) * np.dtype(op.dtype).itemsize > want.tile_bytes:
                return None  # a row longer than a tile: cut by the old path
        else:  # the user's: whole rows, or the old path's
            try:  # a tile the old path would refuse is refused there, in its words
                tile = check_tile(op.shape, want.tile)  # (clipped to the shape, as every store clips)
            except EinsumError:
                return None
            if tile[1] != op.width:
                return None  # rows cut across
        keys = check_keys(want.keys if want.keys is not None else ("d0", "d1"), 2)
        tiled = TiledValue(name, op.shape, op.dtype, tile, keys)
        ranked = dataclasses.replace(op, key=RANK)
        return Incoming(op.shape, op.dtype, tile, keys, PackedRows(ranked, tiled, -(-op.rows // tile[0]), path, where))
    except duckdb.Error:
        return None  # DuckDB cannot read it so: the old path says why
    finally:
        _detach(cur, name)
        cur.close()


@dataclass(frozen=True)
class ParquetRows:
    """The tiles of a Parquet file that DuckDB reads itself: ``select_rows(lo, hi)`` is the
    SELECT of the file's rows [lo, hi) (every row without bounds), keys renamed, each tile's
    bytes checked as it passes. A range skips the file's other row groups: 64 statements of 4
    rows each stored a 1 GiB file in 6.0 s (DuckDB's Arrow stream of the whole file, cut into
    parts, took 10.6 s and +1.8 GB; pyarrow's ``iter_batches`` +1.4 GB)."""

    path: str
    tiled: _Tiled
    where: str
    rows: int

    def select_rows(self, lo: int | None = None, hi: int | None = None):
        return _parquet_select(self.path, self.tiled, self.where, lo, hi)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _parquet_select(p: str, t: _Tiled, where: str, lo: int | None = None, hi: int | None = None):
    """``SELECT keys AS new keys, tile FROM read_parquet(p)``, every tile's byte count checked
    against its extents by DuckDB's ``error()`` as the rows pass; rows [lo, hi) of the file
    when given (``file_row_number``)."""
    from sqlglot import exp

    def fn(name, *args):
        return exp.Anonymous(this=name, expressions=list(args))

    def lit(x):
        return exp.Literal.string(str(x)) if isinstance(x, str) else exp.Literal.number(int(x))

    def cat(*parts):
        out = parts[0]
        for q in parts[1:]:
            out = exp.DPipe(this=out, expression=q, safe=True)
        return out

    col = {k: exp.Column(this=exp.to_identifier(k, quoted=True)) for k in t.keys}
    tile_col = exp.Column(this=exp.to_identifier(TILE, quoted=True))
    itemsize = np.dtype(t.dtype).itemsize
    # the byte count in BIGINT: DuckDB multiplies a TINYINT key column in TINYINT (8 * 16 overflowed)
    wide = {k: exp.cast(c, "BIGINT") for k, c in col.items()}
    extents = [fn("least", lit(s), exp.Sub(this=lit(n), expression=exp.Mul(this=wide[k], expression=lit(s))))
               for k, s, n in zip(t.keys, t.tile, t.shape)]
    want = lit(itemsize)
    for e in extents:
        want = exp.Mul(this=exp.Paren(this=want), expression=exp.Paren(this=e))
    at = [lit(f"{_CHECK_MARK}{where}: the tile at (")]
    for q, k in enumerate(t.keys):
        at += [lit(f"{', ' if q else ''}{k}="), exp.cast(col[k], "VARCHAR")]
    message = cat(*at, lit(") holds "), exp.cast(fn("octet_length", tile_col), "VARCHAR"),
                  lit(f" bytes; a {t.dtype} tile there takes "), exp.cast(want, "VARCHAR"),
                  lit(f" (tile {t.tile}, shape {t.shape}, edge tiles smaller)"))
    null = lit(f"{_CHECK_MARK}{where}: column 'tile' has null(s); fill or drop them first")
    checked = exp.Case(ifs=[exp.If(this=exp.Is(this=tile_col, expression=exp.Null()), true=fn("error", null)),
                            exp.If(this=exp.NEQ(this=fn("octet_length", tile_col), expression=want),
                                   true=fn("error", message))],
                       default=tile_col)
    cols = [exp.alias_(exp.cast(col[k], "BIGINT"), exp.to_identifier(nk, quoted=True))
            for k, nk in zip(t.keys, t.new_keys)]
    cols.append(exp.alias_(checked, exp.to_identifier(TILE, quoted=True)))
    if lo is None:
        return exp.select(*cols).from_(fn("read_parquet", lit(p)))
    number = exp.column("file_row_number")
    source = fn("read_parquet", lit(p), exp.EQ(this=exp.column("file_row_number"), expression=exp.true()))
    return exp.select(*cols).from_(source).where(
        exp.and_(exp.GTE(this=number, expression=lit(lo)), exp.LT(this=number, expression=lit(hi))))


def _drop_pandas_index(table: pa.Table) -> pa.Table:
    """Columns pandas writes for a frame's unnamed index (``__index_level_0__``): not data, as
    ``store`` of the DataFrame itself does not read its index either."""
    drop = [c for c in table.column_names if re.fullmatch(r"__index_level_\d+__", c)]
    return table.drop_columns(drop) if drop else table


def _from_table(table: pa.Table, want: Wanted, where: str) -> Incoming:
    meta = read_metadata(table.schema.metadata, where)
    tiled = meta.get("layout") == "tiles" or (
        TILE in table.column_names and _is_binary(table.schema.field(TILE).type) and want.value is None)
    _check_columns(table.schema, tiled, where)
    if tiled:
        return _from_tiles(table, meta, want, where)
    table = _drop_pandas_index(table)
    column = _array_column(table, want, where)
    # an array-form table's key is ordered as it is: a DECIMAL or HUGEINT key made float64 or
    # int64 first was refused as repeating (distinct decimals, one double) or as too big,
    # where the SQL functions order it (a trial)
    table = _plain_columns(table, where, keep=frozenset(table.column_names) - {column} if column else frozenset())
    if column is not None:
        return _from_array_rows(table, column, want, where)
    return _from_elements(table, meta, want, where)


def _plain_columns(table: pa.Table, where: str, keep: frozenset = frozenset()) -> pa.Table:
    """Columns of a table not in tiled form in the types element and array rows are read in:
    dictionary-encoded ones (a pandas category, Arrow's dictionary arrays) decoded; decimals
    (DuckDB's type of a literal such as 1.5, and of ``sum()`` over decimals) as float64, as the
    SQL functions read them, and DuckDB's HUGEINT (what ``sum()`` of integers gives; Arrow's
    decimal128(38, 0)) as int64, where each value fits (else an error naming the column)."""
    for k, f in enumerate(table.schema):
        t = f.type
        if pa.types.is_dictionary(t):
            t = t.value_type
        via = None
        if pa.types.is_decimal(t) and f.name not in keep:  # (``keep``: ordered, never computed with)
            t = pa.int64() if (t.precision, t.scale) == (38, 0) else pa.float64()
            via = pa.string() if t == pa.float64() else None
        elif (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and \
                pa.types.is_decimal(t.value_type):
            t, via = _list_like(t, pa.float64()), _list_like(t, pa.string())
        if t == f.type:
            continue
        try:
            column = table.column(k)
            if via is not None:
                # through the decimal's text: Arrow's decimal -> float64 cast is not correctly
                # rounded (-3.258643 came out -3.2586429999999997, 28% of random DECIMAL(18,6)
                # values 1 ulp off, where DuckDB's ::DOUBLE and the SQL functions are exact: a
                # trial); its text -> float64 parse is
                column = pc.cast(column, via)
            column = pc.cast(column, t)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise EinsumError(f"{where}: column {f.name!r} ({_type_word(f.type)}) cannot be read as {t} ({e}); cast "
                              "it to a numeric type first") from None
        table = table.set_column(k, pa.field(f.name, t), column)
    return table


def _list_like(t: pa.DataType, value: pa.DataType) -> pa.DataType:
    if pa.types.is_fixed_size_list(t):
        return pa.list_(value, t.list_size)
    return pa.large_list(value) if pa.types.is_large_list(t) else pa.list_(value)


# -- array form: one array column (a row each) and a key ordering the rows ----------------------
def _is_list(t: pa.DataType) -> bool:
    return (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)
            or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _array_column(table: pa.Table, want: Wanted, where: str) -> str | None:
    """The array column of a table in array form (an embeddings table: ``(id, emb FLOAT[768])``,
    as the SQL functions read it), or None for a table in element form."""
    lists = [c for c in table.column_names if _is_list(table.schema.field(c).type)]
    if want.value is not None:
        value = _find(table, want.value, where, "value=")
        return value if value in lists else None
    if len(lists) > 1:
        raise EinsumError(f"{where}: several array columns ({', '.join(map(repr, lists))}); a table in array form "
                          "has one array column and one key column: pass value='...' (and index='...')")
    return lists[0] if lists else None


def _from_array_rows(table: pa.Table, column: str, want: Wanted, where: str) -> Incoming:
    """A table in array form as a ``(rows, n)`` matrix: row ``r`` is the array of the ``r``-th
    row in key order (the SQL functions' rule, docs/sql_interface.md), or in table order where
    there is no other column. Arrays of one length (fixed-size or not), no NULLs, unique keys."""
    if want.index is not None:
        if len(want.index) != 1:
            raise EinsumError(f"{where}: a table in array form has one key column; index={tuple(want.index)} "
                              "names several")
        others = [_find(table, want.index[0], where, "index column")]
    else:
        others = [c for c in table.column_names if c != column]
    if len(others) > 1:
        raise EinsumError(f"{where}: a table in array form has one array column ({column!r}) and one key column, "
                          f"not {len(others)} others ({', '.join(map(repr, others))}); select the two, or pass "
                          f"index='...' and value={column!r}")
    arrays = _no_nulls(table, column, where).combine_chunks()
    if isinstance(arrays, pa.ChunkedArray):  # (an empty table's has no chunk)
        arrays = pa.concat_arrays(arrays.chunks) if arrays.num_chunks else pa.array([], arrays.type)
    rows = len(arrays)
    if pa.types.is_fixed_size_list(arrays.type):
        n = arrays.type.list_size
    else:
        lengths = pc.list_value_length(arrays).to_numpy(zero_copy_only=False)
        # (no row says how long an array is: shape= may)
        n = int(lengths[0]) if rows else want.shape[1] if want.shape is not None and len(want.shape) == 2 else 0
        if rows and (lengths != n).any():
            r = int(np.argmax(lengths != n))
            raise EinsumError(f"{where}: array column {column!r} holds arrays of {n} elements in row 0 and of "
                              f"{lengths[r]} in row {r}; a table in array form has arrays of one length")
    flat = arrays.flatten()
    if flat.null_count:
        raise EinsumError(f"{where}: array column {column!r} has {flat.null_count} NULL element(s); fill them first")
    if _kind(flat.type) == "other":
        raise EinsumError(f"{where}: array column {column!r} holds {_type_word(flat.type)} elements, not numbers; "
                          "cast them to a numeric type")
    vals = flat.to_numpy(zero_copy_only=False)
    check_dtype(vals.dtype, f"{where}: array column {column!r}")
    dtype = want.dtype or vals.dtype.name
    if vals.dtype != dtype:
        if not can_cast(vals.dtype, dtype, "same_kind"):
            raise EinsumError(f"{where}: cannot cast array column {column!r} ({vals.dtype}) to {dtype} "
                              "(numpy's same_kind rule)")
        vals = _exact_cast(vals, dtype, f"{where}: array column {column!r}")
    dense = vals.reshape(rows, n)
    if others and rows:
        key = others[0]
        keys = _no_nulls(table, key, where)
        # -0.0 and 0.0 are one key, as DuckDB (and the SQL functions' ordering) compare them:
        # Arrow counts them apart, so store took them in file order where SQL refused them
        if pc.count_distinct(pc.add(pc.cast(keys, pa.float64()), 0.0) if pa.types.is_floating(keys.type)
                             else keys).as_py() < rows:
            raise EinsumError(f"{where}: key column {key!r} repeats values; a table in array form is ordered by its "
                              "key, which must be unique")
        try:
            # (Arrow sorts no float16: its keys ordered as the float32s they are exactly)
            by = pa.table({key: pc.cast(keys, pa.float32())}) if pa.types.is_float16(keys.type) else table.select([key])
            order = pc.sort_indices(by, [(key, "ascending")]).to_numpy()
        except pa.ArrowException as e:
            raise EinsumError(f"{where}: key column {key!r} ({_type_word(keys.type)}) cannot be ordered ({e})") from None
        if not (order == np.arange(rows)).all():
            dense = dense[order]
    shape = (rows, n)
    if want.shape is not None and tuple(want.shape) != shape:
        raise EinsumError(f"{where}: shape={tuple(want.shape)} does not fit the table in array form, a {shape} "
                          "matrix (one row per key, one column per array element)")
    return _from_array(np.ascontiguousarray(dense), Wanted(want.tile, want.keys, tile_bytes=want.tile_bytes,
                                                           square=want.square, memory=want.memory), where)


# -- out: export to a file, streamed ------------------------------------------------------------
def _atomic_write(path, write, what: str, sync: bool = False) -> pathlib.Path:
    """Run ``write(tmp)`` on a temporary file in the directory of ``path``, then rename it over
    ``path``: a failure leaves no half-written file (and an older file at ``path`` intact).

    A symlink is followed (the file it names is replaced, the link stays); an existing file's
    permissions carry over to the new one. The temporary name is short, so a target name near
    the file system's limit still works.

    ``sync``: the data and the rename are fsynced, so a power loss leaves the old file or the
    new one, not an empty one. Off by default, as in ``np.save``, pyarrow's writers and DuckDB's
    ``COPY ... TO`` (none fsyncs): the rename alone already makes the write atomic against a
    crash of this process, and the fsync waits for the disk (1 GiB: +0.35-0.8 s here, more than
    the whole export takes into the page cache)."""
    given = pathlib.Path(file_path(path, "to_parquet"))
    target = pathlib.Path(os.path.realpath(given)) if given.is_symlink() else given
    # named for this process: an export killed mid-write (SIGKILL, SIGTERM) left its partial
    # file beside the target for good (a new user's report); the next export to the folder
    # removes those whose process has ended
    tmp = target.with_name(spill.partial_name())
    spill.quietly(spill.sweep_named, str(target.parent), spill.PARTIAL)

    def cleanup():
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass

    try:
        write(tmp)
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        if sync:
            _fsync_path(tmp)
        os.replace(tmp, target)
        if sync:
            try:
                _fsync_path(target.parent)
            except OSError:
                pass  # a directory that cannot be opened for reading: the rename stands unsynced
    except OSError as e:
        cleanup()
        raise EinsumError(f"cannot write {what} file {str(given)!r}: {e}") from None
    except BaseException:
        cleanup()
        raise
    return given


def _fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def tile_batches(backend, value):
    """Batches of stored tensor ``value``'s tiles, streamed where the backend streams."""
    with backend.tile_batches(value, STREAM_BATCH_BYTES) as batches:
        yield batches


def file_path(path, where: str) -> str:
    """``path`` (a str or an os.PathLike) as a str; anything else is an EinsumError naming ``where``."""
    try:
        p = os.fspath(path)
    except TypeError:
        raise EinsumError(f"{where}: a path must be a str or a pathlib.Path, got {type(path).__name__} "
                          f"{path!r:.60}") from None
    if not isinstance(p, str):  # bytes
        raise EinsumError(f"{where}: a path must be a str or a pathlib.Path, got {type(path).__name__}")
    return p


def export_tensor(value, batches, path, form: str = "tiles", sync: bool = False, parquet: bool = False) -> pathlib.Path:
    """Write stored tensor ``value`` (a TiledValue) to ``path`` by its suffix, from ``batches``:
    a context manager giving an iterator of tile batches (key columns + tile, any order).
    ``.npy``: the dense array (``form`` must be "tiles", the default); ``.parquet``, ``.arrow``
    / ``.feather``: the tile table or element rows (``form``) with the metadata. Streamed: one
    batch of tiles at a time is in memory; written atomically (``sync``: and durably, see
    ``_atomic_write``). ``parquet``: Parquet whatever the suffix (``Tensor.to_parquet``)."""
    p = file_path(path, "export")
    suffix = PARQUET_SUFFIXES[0] if parquet else _suffix(p)
    where = f"export({p!r})"
    if form not in ("tiles", "elements"):
        raise EinsumError(f"{where}: form is 'tiles' or 'elements', got {form!r}")
    if suffix in NPY_SUFFIXES:
        if form != "tiles":
            raise EinsumError(f"{where}: a .npy file holds the dense array; form='elements' is for .parquet, "
                              ".arrow and .feather files")
        return _atomic_write(p, lambda tmp: _write_npy(tmp, value, batches), ".npy", sync)
    if suffix not in PARQUET_SUFFIXES + IPC_SUFFIXES:
        raise EinsumError(f"{where}: export writes .npy, .parquet, .arrow or .feather files; got suffix "
                          f"{suffix or 'none'!r}")
    if form == "elements":
        _element_form_check(np.dtype(value.dtype), value.keys)
    meta = tensor_metadata(value.shape, value.dtype, value.tile, value.keys, form, value.name)
    if form == "tiles":
        schema = _tile_schema(value.keys, pa.large_binary(), meta)

        def convert(b):
            return pa.record_batch([b.column(k) for k in value.keys] + [b.column(TILE).cast(pa.large_binary())],
                                   schema=schema)
    else:
        dtype = np.dtype(value.dtype)
        schema = pa.schema([(k, pa.int64()) for k in value.keys] + [(VALUE, pa.from_numpy_dtype(arrow_value_dtype(dtype)))],
                           metadata=meta)

        def convert(b):
            return _element_batch(b, value, schema)
    if suffix in PARQUET_SUFFIXES:
        return _atomic_write(p, lambda tmp: _write_parquet_batches(tmp, schema, batches, convert, value.keys),
                             "Parquet", sync)
    return _atomic_write(p, lambda tmp: _write_ipc(tmp, schema, batches, convert), "Arrow IPC", sync)


def _write_parquet_batches(tmp, schema: pa.Schema, batches, convert, keys) -> None:
    import pyarrow.parquet as pq

    # no dictionary and no min/max statistics for the tile bytes: neither helps a reader, and both
    # cost a pass over every byte
    with pq.ParquetWriter(tmp, schema, use_dictionary=list(keys) or False,
                          write_statistics=list(keys) or False) as w, batches() as it:
        for b in it:
            w.write_batch(convert(b))


def _write_ipc(tmp, schema: pa.Schema, batches, convert) -> None:
    with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, schema) as w, batches() as it:
        for b in it:
            w.write_batch(convert(b))


def _write_npy(tmp, value, batches) -> None:
    """The dense array, its header first (``open_memmap`` writes it and sizes the file), then
    in runs of tiles with ``pwritev`` (``_FileBoxes``, ``_TileRuns``): the file is never whole in
    this process. Without ``pwritev`` (not POSIX), through the memory map, released after each
    batch. Each band of rows is handed to the disk once written (``_FileBoxes.writeback``): the
    page cache then never holds the whole file dirty (a 4 GiB export capped as the CLI does, 4
    shuffled rounds: 10.6 s median, 7.9-12.7, without; 8.3 s, 7.8-9.0, with), and an fsync at
    the end (``sync=True``) waits for the last band only."""
    dtype = np.dtype(value.dtype)
    shape = tuple(value.shape)
    if math.prod(shape) == 0:
        with open(tmp, "wb") as f:  # (np.save given a path would add '.npy' to it)
            np.save(f, np.zeros(shape, dtype), allow_pickle=False)
        return
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    if hasattr(os, "pwritev") and out.ndim:
        boxes = _FileBoxes(tmp, out.offset, shape, dtype.itemsize, f"export({str(tmp)!r})", write=True)
        del out
        try:
            runs = _TileRuns(boxes, value)
            with batches() as it:
                for b in it:
                    for box, raw in _tile_boxes(b, value):
                        runs.add(box, raw)
            runs.flush()
        finally:
            boxes.close()
        return
    mm = getattr(out, "_mmap", None)
    try:
        with batches() as it:
            for b in it:
                for box, raw in _tile_boxes(b, value):
                    out[box] = raw.view(dtype).reshape(tuple(s.stop - s.start for s in box))
                _release(mm)
    finally:
        del out  # unmapped; the written pages go to the file as the page cache writes back


# the most bytes of side-by-side tiles an export joins before writing them as one box
RUN_BYTES = 32 << 20


class _TileRuns:
    """Tiles that lie side by side along the last axis (the same other keys, the last key one
    more: stored parts hold tiles in C order of their keys, so a stream of them mostly does),
    joined in one buffer of at most ``RUN_BYTES`` and written as one box: a row of the box is
    then one ``pwritev`` of several tiles' row instead of one each. Written tile by tile, a
    4 GiB float32 export in 1024² tiles made 4M calls of 4 KB and took 2.7x ``np.save``.

    Once the runs move on to the next rows of the first axis, the rows before are handed to the
    disk (``_FileBoxes.writeback``), while the export goes on."""

    def __init__(self, boxes: _FileBoxes, value):
        self.boxes = boxes
        self.dtype = np.dtype(value.dtype)
        self.tile, self.shape = tuple(value.tile), tuple(value.shape)
        self.box: tuple[slice, ...] | None = None  # the run so far
        self.buf: np.ndarray | None = None
        self.width = 0  # of the buffer's last axis, filled
        self.band: slice | None = None  # the rows (first axis) of the last run written

    def add(self, box: tuple[slice, ...], raw: np.ndarray) -> None:
        ext = tuple(s.stop - s.start for s in box)
        tile = raw.view(self.dtype).reshape(ext)
        if (self.box is not None and box[:-1] == self.box[:-1] and box[-1].start == self.box[-1].stop
                and self.width + ext[-1] <= self.buf.shape[-1]):
            self.buf[..., self.width:self.width + ext[-1]] = tile
            self.width += ext[-1]
            self.box = (*box[:-1], slice(self.box[-1].start, box[-1].stop))
            return
        self.flush()
        # room for as many tiles of this size as fit RUN_BYTES, up to the end of the axis
        per = max(1, RUN_BYTES // max(tile.nbytes, 1))
        width = min(per * self.tile[-1], self.shape[-1] - box[-1].start)
        if width <= ext[-1]:  # a run of one: written as it is
            self._write(box, tile)
            return
        if self.buf is None or self.buf.shape != (*ext[:-1], width):
            self.buf = np.empty((*ext[:-1], width), self.dtype)
        self.buf[..., :ext[-1]] = tile
        self.box, self.width = box, ext[-1]

    def flush(self) -> None:
        if self.box is None:
            return
        full = self.width == self.buf.shape[-1]
        self._write(self.box, self.buf if full else self.buf[..., :self.width])
        self.box, self.width = None, 0

    def _write(self, box: tuple[slice, ...], data: np.ndarray) -> None:
        self.boxes.write(box, data)
        if self.band is not None and box[0] != self.band:
            self.boxes.writeback(self.band)  # (a tile of it coming later is written again: harmless)
        self.band = box[0]


def _tile_boxes(batch, value):
    """(slices of the tensor, tile bytes as a uint8 array) for each row of a batch of tiles."""
    keys = [np.asarray(batch.column(k).to_numpy(zero_copy_only=False), np.int64) for k in value.keys]
    for r, raw in enumerate(blob_views(batch.column(TILE))):
        box = tuple(slice(int(kc[r]) * t, min((int(kc[r]) + 1) * t, n))
                    for kc, t, n in zip(keys, value.tile, value.shape))
        yield box, raw


def _element_form_check(dtype: np.dtype, names) -> None:
    if dtype.kind == "c":
        raise EinsumError("a complex tensor has no element form in Arrow (Arrow has no complex type); use "
                          "form='tiles'")
    if VALUE in (n.lower() for n in names):
        raise EinsumError(f"the keys {tuple(names)} include 'value', the element form's value column; store the "
                          "tensor with other keys")


def _element_batch(batch, value, schema: pa.Schema) -> pa.RecordBatch:
    """Element rows of a batch of tiles (C order inside each tile)."""
    dtype = np.dtype(value.dtype)
    idx: list[list[np.ndarray]] = [[] for _ in value.keys]
    vals = []
    for box, raw in _tile_boxes(batch, value):
        ext = tuple(s.stop - s.start for s in box)
        if ext:  # a 0-d tensor's one element has no index
            for p, ix in enumerate(np.indices(ext).reshape(len(ext), -1)):
                idx[p].append(ix.astype(np.int64) + box[p].start)
        vals.append(raw.view(dtype).reshape(-1).astype(arrow_value_dtype(dtype), copy=False))
    cols = [pa.array(np.concatenate(c) if c else np.zeros(0, np.int64)) for c in idx]
    cols.append(pa.array(np.concatenate(vals) if vals else np.zeros(0, arrow_value_dtype(dtype)), type=schema.field(VALUE).type))
    return pa.record_batch(cols, schema=schema)


# -- the element macros ----------------------------------------------------------------------
def element_macros_sql() -> str:
    """The plain-SQL macros of ``sql_templates/elements_macro.sql`` (``eds_elements(name)`` and
    the byte decoders): paste them into any DuckDB to read stored tensors without this package."""
    return resources.files("eindecomp_sql.sql_templates").joinpath("elements_macro.sql").read_text()


def create_element_macros(con) -> None:
    """Create the element macros as TEMP macros on DuckDB connection ``con`` (for example
    ``db.connection``), then ``con.sql("SELECT * FROM eds_elements('A')")``."""
    con.execute(element_macros_sql())
