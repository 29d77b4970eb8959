"""Spark DataFrames in and out of the Spark backend, tiled and untiled by Spark itself: never
whole on the driver.

**In.** 
``db.store(name, spark_df)`` on a Spark session: the rows (integer index columns and one value
column, as ``Session.store`` reads any table in element form; elements not present are 0) are
grouped by the tile each falls in, and each group becomes a tile in a Spark Python worker
(``elements_tile``), joined with every key of the grid so that tiles with no element are zeros.
Spark writes the tiles as it writes any step's result, so a tensor bigger than the driver's
memory is stored by the executors that hold its rows. The checks are the ones the driver path
makes on a table, in one Spark job before any tile is built (nulls, index types, negative
indices, indices outside ``shape=``, the value column's dtype and ``dtype=``'s cast); duplicate
indices, which always fall in the same tile, and values a cast would change are found where the
tile is built, and reported as the same ``EinsumError``.

A frame of tiles (key columns and a binary ``tile``, as ``to_spark()`` gives them), described by
``shape=``, ``dtype=`` and ``tile=``, is checked in Spark as the driver path checks a tiled table
and stored as it is (``_read_tiled``). Frames the driver path reads as well go there
(``read_frame`` returns None): a 0-d tensor, an empty frame, a tiled frame without its
description (the driver path's error says what to give).

**Out.** ``Tensor.to_spark()`` is the tensor's tiles as a Spark DataFrame (key columns, then
``tile``), read from where they are stored when it runs; ``to_spark("elements")`` one row per
element, as ``Tensor.to_arrow("elements")`` has them, each tile exploded in a worker
(``tile_elements``), so a Spark user joins a result with other tables without the driver holding
it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa

from .. import io
from ..compile.compiler import ident
from ..errors import EinsumError
from ..notation.checks import can_cast, check_dtype
from ..plan.steps import format_bytes
from ..plan import tiling

UDF = "eds_elements_tile"
MARK = "eindecomp_sql store: "  # what the driver finds in a worker's error (``worker_error``)


def is_spark_frame(x) -> bool:
    return (type(x).__module__ or "").startswith("pyspark.sql") and type(x).__name__ == "DataFrame"


def _quoted(name: str) -> str:
    """A column name as Spark reads it literally (no nested field, no expression), quoted by sqlglot."""
    return ident(name).sql("spark")


def read_frame(spark, df, where: str, want, room: int | None = None) -> object | None:
    """``df`` (element form) as an ``io.Incoming`` whose tiles are a Spark DataFrame not run yet,
    or None where the driver path reads it (see the module docstring). Every check that needs
    no tile runs here, in one Spark job. ``room``: the bytes the dense tensor may take (None:
    not checked)."""
    from pyspark.sql import functions as F

    empty = df.limit(0).toArrow()  # the columns as Arrow types: the driver path's rules apply as they are
    if io.TILE in empty.column_names:
        io._check_columns(empty.schema, False, where)
        return _read_tiled(df, empty, where, want)
    if any(c.lower() == io.TILE for c in empty.column_names):
        return None
    io._check_columns(empty.schema, False, where)  # a join's two i columns: said, not a KeyError
    column = io._array_column(empty, want, where)
    if column is not None:
        return _read_array_rows(spark, df, empty, column, where, want, room)
    index, value = io._element_columns(empty, want, where)
    if not index:
        return None
    dtype, decimal = _values_dtype(empty.schema.field(value).type, f"value column {value!r}", "", where, want)
    for c in index:
        t = empty.schema.field(c).type
        if io._kind(t) != "int":
            raise EinsumError(f"{where}: index column {c!r} holds {t}, not integers; cast it to an integer type "
                              "(or name the columns with index= and value=)")
    cols = [F.col(_quoted(c)) for c in index]
    stats = df.agg(F.count(F.lit(1)),
                   *[F.count_if(F.col(_quoted(c)).isNull()) for c in index + [value]],
                   *[F.min(x) for x in cols], *[F.max(x) for x in cols]).collect()[0]
    n, k = stats[0], len(index)
    nulls, lows, highs = stats[1:2 + k], stats[2 + k:2 + 2 * k], stats[2 + 2 * k:]
    for c, m in zip(index + [value], nulls):
        if m:
            raise EinsumError(f"{where}: column {c!r} has {m} null(s); fill or drop them first")
    if n == 0:
        return None  # nothing to tile: the driver path makes the zeros (or the empty tensor)
    for c, low in zip(index, lows):
        if low < 0:
            raise EinsumError(f"{where}: index column {c!r} holds {low} (its smallest); indices start at 0")
    shape = want.shape if want.shape is not None else tuple(int(h) + 1 for h in highs)
    if len(shape) != len(index):
        raise EinsumError(f"{where}: shape {shape} has {len(shape)} dimension(s) but there are {len(index)} index "
                          f"column(s) {index}")
    for c, high, side in zip(index, highs, shape):
        if high >= side:
            raise EinsumError(f"{where}: index column {c!r} holds {high} (its largest), outside shape {shape}")
    itemsize = np.dtype(dtype).itemsize
    nbytes = math.prod(shape) * itemsize
    if room is not None and nbytes > room:
        raise EinsumError(f"{where}: the DataFrame in element form is read as a dense {shape} {dtype} tensor of "
                          f"{format_bytes(nbytes)}, more than there is room for ({format_bytes(room)}: the memory "
                          "budget, or the free disk where the tensors are kept); tensors are stored dense "
                          "(renumber the indices densely from 0, or store only the rows you need)")
    tile = (tiling.check_tile(shape, want.tile) if want.tile is not None
            else tiling.auto_tile(shape, itemsize, want.tile_bytes, want.square))
    keys = io.check_keys(want.keys if want.keys is not None else tuple(f"d{d}" for d in range(len(shape))),
                         len(shape))
    tiles = _tiles(spark, df, index, value, shape, tile, keys, dtype, where, decimal)
    return io.Incoming(tuple(shape), dtype, tuple(tile), keys, tiles)


def _values_dtype(t: pa.DataType, what: str, of: str, where: str, want) -> tuple[str, bool]:
    """The dtype a frame's values (a value column, or an array column's elements: ``of``) are
    stored in, checked as the driver path checks them, and whether they are decimals: Spark's
    type of a literal such as 1.25 and of avg() over decimals, read as float64 as the driver
    path and DuckDB read them (a trial: refused as "not numbers")."""
    decimal = pa.types.is_decimal(t)
    if io._kind(t) == "other" and not decimal:
        raise EinsumError(f"{where}: {what} holds {io._type_word(t)}{of}, not numbers; cast it to a numeric type")
    source = np.dtype(np.float64) if decimal else np.dtype(t.to_pandas_dtype())
    check_dtype(source, f"{where}: {what}")
    dtype = want.dtype or source.name
    if source != dtype and not can_cast(source, dtype, "same_kind"):
        raise EinsumError(f"{where}: cannot cast {what} ({source}) to {dtype} (numpy's same_kind rule)")
    return dtype, decimal


def _read_array_rows(spark, df, empty: pa.Table, column: str, where: str, want, room: int | None):
    """A frame in array form (``(id, emb array<float>)``: embeddings) as a ``(rows, n)`` matrix,
    row ``r`` the array of the ``r``-th row in key order, as the driver path and the SQL
    functions read such a table (it was refused on Spark: a trial). Checked in one Spark job
    (NULL keys, arrays or elements, arrays of several lengths, repeated keys); the keys are
    ranked alone (a window over the key column only, not the arrays), joined back, and the
    arrays exploded into element rows that the element path tiles in Spark."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if want.index is not None:
        if len(want.index) != 1:
            raise EinsumError(f"{where}: a table in array form has one key column; index={tuple(want.index)} "
                              "names several")
        others = [io._find(empty, want.index[0], where, "index column")]
    else:
        others = [c for c in empty.column_names if c != column]
    if len(others) != 1:
        what = "none" if not others else f"{len(others)} ({', '.join(map(repr, others))})"
        raise EinsumError(f"{where}: a Spark DataFrame in array form has one array column ({column!r}) and one key "
                          f"column that orders its rows; it has {what} besides the array: select the two (a "
                          "DataFrame has no row order of its own: add a key, say F.monotonically_increasing_id())")
    key = others[0]
    dtype, decimal = _values_dtype(empty.schema.field(column).type.value_type, f"array column {column!r}",
                                   " elements", where, want)
    k, a = F.col(_quoted(key)), F.col(_quoted(column))
    stats = df.agg(F.count(F.lit(1)), F.count_if(k.isNull()), F.count_if(a.isNull()), F.min(F.size(a)),
                   F.max(F.size(a)), F.count_if(F.exists(a, lambda x: x.isNull())),
                   F.count_distinct(k)).collect()[0]
    rows, null_keys, null_arrays, low, high, null_elements, distinct = stats
    for n, what in ((null_keys, f"key column {key!r}"), (null_arrays, f"array column {column!r}")):
        if n:
            raise EinsumError(f"{where}: {what} has {n} null(s); fill or drop them first")
    if null_elements:
        raise EinsumError(f"{where}: array column {column!r} has NULL elements in {null_elements} row(s); fill them "
                          "first")
    if rows and low != high:
        raise EinsumError(f"{where}: array column {column!r} holds arrays of {low} to {high} elements; a table in "
                          "array form has arrays of one length")
    if distinct != rows:
        raise EinsumError(f"{where}: key column {key!r} repeats values ({rows - distinct} repeated); each row's key "
                          "must be unique: it orders the rows")
    if rows == 0:
        return None  # nothing to tile: the driver path makes the empty tensor
    shape = (int(rows), int(high))
    if want.shape is not None and tuple(want.shape) != shape:
        raise EinsumError(f"{where}: shape={tuple(want.shape)} given, but the DataFrame in array form holds {shape}")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if room is not None and nbytes > room:
        raise EinsumError(f"{where}: the DataFrame in array form is a {shape} {dtype} tensor of "
                          f"{format_bytes(nbytes)}, more than there is room for ({format_bytes(room)})")
    itemsize = np.dtype(dtype).itemsize
    tile = (tiling.check_tile(shape, want.tile) if want.tile is not None
            else tiling.auto_tile(shape, itemsize, want.tile_bytes, want.square))
    keys = io.check_keys(want.keys if want.keys is not None else ("d0", "d1"), 2)
    # rank the keys alone (one window over a column of keys), then join the arrays back to them
    ranked = df.select(k.alias("_eds_key")).withColumn(
        "_eds_row", F.row_number().over(Window.orderBy(F.col("_eds_key").asc())) - 1)
    arrays = df.select(k.alias("_eds_key"), a.alias("_eds_arr"))
    elements = (arrays.join(ranked, on="_eds_key")
                .select(F.col("_eds_row").alias("i"), F.posexplode(F.col("_eds_arr")).alias("j", "v")))
    tiles = _tiles(spark, elements, ["i", "j"], "v", shape, tile, keys, dtype, where, decimal)
    return io.Incoming(shape, dtype, tuple(tile), keys, tiles)


def _read_tiled(df, empty, where: str, want):
    """A frame of tiles (key columns, binary ``tile``), described by ``shape=``, ``dtype=`` and
    ``tile=`` (a Spark frame has no eindecomp_sql metadata), checked in Spark as the driver path
    checks a tiled table: integer keys inside the grid, every key once, no nulls, each tile the
    bytes its extents take. Its tiles are then stored as they are; None (the driver path, which
    says what is wrong) where a description is missing or the tile column holds no bytes."""
    from pyspark.sql import functions as F

    if want.shape is None or want.dtype is None or want.tile is None:
        return None  # the driver path's error says what to give
    t = io._describe_tiled(empty.column_names, {}, want, where)  # no metadata: never a re-cut
    tile_type = empty.schema.field(io.TILE).type
    if not (pa.types.is_binary(tile_type) or pa.types.is_large_binary(tile_type)):
        return None  # strings and others: the driver path refuses them as it does any table's
    for k in t.keys:
        kt = empty.schema.field(k).type
        if io._kind(kt) != "int":
            raise EinsumError(f"{where}: key column {k!r} holds {kt}, not integers")
    keys = [F.col(_quoted(k)) for k in t.keys]
    itemsize = np.dtype(t.dtype).itemsize
    extent = F.lit(itemsize).cast("bigint")
    for key, s, n in zip(keys, t.tile, t.shape):
        extent = extent * F.least(F.lit(s).cast("bigint"), F.lit(n).cast("bigint") - key * F.lit(s).cast("bigint"))
    bad_size = F.length(F.col(io.TILE)) != extent
    stats = df.agg(F.count(F.lit(1)), *[F.count_if(x.isNull()) for x in keys + [F.col(io.TILE)]],
                   *[F.min(x) for x in keys], *[F.max(x) for x in keys],
                   F.count_distinct(F.struct(*keys)) if keys else F.lit(1), F.count_if(bad_size)).collect()[0]
    k = len(keys)
    n, nulls = stats[0], stats[1:2 + k]
    lows, highs, distinct, bad = stats[2 + k:2 + 2 * k], stats[2 + 2 * k:2 + 3 * k], stats[2 + 3 * k], stats[3 + 3 * k]
    for c, m in zip(list(t.keys) + [io.TILE], nulls):
        if m:
            raise EinsumError(f"{where}: column {c!r} has {m} null(s); fill or drop them first")
    for c, low, high, g in zip(t.keys, lows, highs, t.grid):
        if n and (low < 0 or high >= g):
            raise EinsumError(f"{where}: key column {c!r} holds {low if low < 0 else high}; tiles of {t.tile} over "
                              f"shape {t.shape} have keys 0..{g - 1}")
    expect = math.prod(t.grid)
    if distinct < n:
        (dup,) = df.groupBy(*keys).count().where("count > 1").limit(1).collect()
        at = ", ".join(f"{c}={int(dup[j])}" for j, c in enumerate(t.keys))
        raise EinsumError(f"{where}: tile key ({at}) appears more than once; a tiled table holds each tile of the "
                          "grid exactly once")
    if n != expect:
        raise EinsumError(f"{where}: {n} tile rows, but shape {t.shape} in tiles of {t.tile} has {expect}")
    if bad:
        row = df.where(bad_size).select(*keys, F.length(F.col(io.TILE)), extent).limit(1).collect()[0]
        at = ", ".join(f"{c}={int(row[j])}" for j, c in enumerate(t.keys))
        raise EinsumError(f"{where}: the tile at ({at}) holds {row[k]} bytes; a {t.dtype} tile there takes "
                          f"{row[k + 1]} (tile {t.tile}, shape {t.shape}, edge tiles smaller)")
    tiles = df.select(*[x.cast("bigint").alias(nk) for x, nk in zip(keys, t.new_keys)], F.col(io.TILE))
    return io.Incoming(t.shape, t.dtype, t.tile, t.new_keys, tiles)


def _tiles(spark, df, index, value, shape, tile, keys, dtype, where, decimal=False):
    """The tiled DataFrame: every key of the grid (a range, cut into keys in C order), left-joined
    with the elements grouped by their tile, each group made a tile by ``elements_tile``."""
    from pyspark.sql import functions as F

    grid = tiling.grid(shape, tile)
    inner = [f"_eds_k{d}" for d in range(len(shape))]
    # integer division in SQL (Column has no //); names only as quoted identifiers, sizes as ints
    every = spark.range(math.prod(grid)).select(
        *[F.expr(f"(id DIV {int(math.prod(grid[d + 1:]))}) % {int(grid[d])}").alias(inner[d])
          for d in range(len(grid))])
    at = [f"CAST({_quoted(c)} AS BIGINT)" for c in index]
    grouped = (df.select(*[F.expr(f"{x} DIV {int(t)}").alias(k) for x, t, k in zip(at, tile, inner)],
                         F.struct(*[F.expr(f"{x} % {int(t)}").alias(f"o{d}") for d, (x, t) in enumerate(zip(at, tile))],
                                  (F.col(_quoted(value)).cast("double") if decimal else F.col(_quoted(value)))
                                  .alias("v")).alias("e"))
               .groupBy(*inner).agg(F.collect_list("e").alias("es")))
    spec = json.dumps({"shape": list(shape), "tile": list(tile), "dtype": dtype, "index": list(index),
                       "where": where, "value": value})
    made = F.call_udf(UDF, F.lit(spec), F.array(*[F.col(k) for k in inner]), F.col("es"))
    return (every.join(grouped, on=inner, how="left")
            .select(*[F.col(k).alias(name) for k, name in zip(inner, keys)], made.alias("tile")))


def elements_tile(spec_arr: pa.Array, keys_arr: pa.Array, lists_arr: pa.Array) -> pa.Array:
    """A Spark Arrow UDF: each row's tile (its grid keys) from the elements that fall in it
    (``(o0, ..., v)`` structs: offsets in the tile, value), zeros elsewhere, as C-order bytes.
    Raises the store's ``EinsumError`` (marked for the driver) for a duplicate index or a value
    the cast to the tensor's dtype would change."""
    if isinstance(spec_arr, pa.ChunkedArray):
        spec_arr, keys_arr, lists_arr = (a.combine_chunks() for a in (spec_arr, keys_arr, lists_arr))
    if not len(spec_arr):
        return pa.array([], pa.binary())
    spec = json.loads(spec_arr[0].as_py())
    shape, tile, dtype = spec["shape"], spec["tile"], np.dtype(spec["dtype"])
    names, where = spec["index"], spec["where"]
    ndim = len(shape)
    # flatten(): a sliced list array's values are its parent's (offsets index those, below)
    key_rows = keys_arr.flatten().to_numpy(zero_copy_only=False).reshape(-1, ndim)
    offsets = lists_arr.offsets.to_numpy()
    listed = lists_arr.is_valid().to_numpy(zero_copy_only=False)  # a null list may span a segment
    members = lists_arr.values
    offs = [members.field(f"o{d}").to_numpy(zero_copy_only=False) for d in range(ndim)]
    vals = members.field("v").to_numpy(zero_copy_only=False)
    out = []
    for r in range(len(keys_arr)):
        origin = key_rows[r] * np.asarray(tile)
        tshape = tuple(int(min(t, n - o)) for t, n, o in zip(tile, shape, origin))
        a = np.zeros(tshape, dtype)
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        if listed[r] and hi > lo:  # a tile no element falls in has no list (the left join's null): zeros
            at = tuple(o[lo:hi] for o in offs)
            flat = np.ravel_multi_index(at, tshape)
            order = np.argsort(flat, kind="stable")
            same = flat[order][1:] == flat[order][:-1]
            if same.any():
                j = int(order[int(np.argmax(same))])
                index = ", ".join(f"{c}={int(o + x[j])}" for c, o, x in zip(names, origin, at))
                raise EinsumError(f"{MARK}{where}: index ({index}) appears more than once. A table in element form "
                                  "holds each element once: aggregate duplicates first (GROUP BY the index columns)")
            v = vals[lo:hi]
            if v.dtype != dtype:
                try:
                    v = io._exact_cast(v, dtype, where)
                except EinsumError:
                    # the element by its index, not by its place in this group (an arbitrary order)
                    j = next(j for j in range(len(v)) if not _casts(v[j:j + 1], dtype))
                    index = ", ".join(f"{c}={int(o + x[j])}" for c, o, x in zip(names, origin, at))
                    with np.errstate(all="ignore"):
                        became = v[j:j + 1].astype(dtype)[0].item()
                    raise EinsumError(f"{MARK}{where}: value column {spec['value']!r}: value {v[j].item()!r} at index "
                                      f"({index}) does not fit dtype={dtype.name} (it would become "
                                      f"{became!r})") from None
            a[at] = v
        out.append(a.tobytes())
    return pa.array(out, pa.binary())


def _casts(v: np.ndarray, dtype) -> bool:
    try:
        io._exact_cast(v, dtype, "")
        return True
    except EinsumError:
        return False


# -- out: a tensor as a Spark DataFrame ------------------------------------------------------
# the Spark type of an element's value, by the tensor's dtype (Spark has no unsigned, half or
# complex types: unsigned go to the next signed size, half floats to float, which holds them exactly)
SPARK_VALUE = {"bool": ("boolean", "bool"), "int8": ("tinyint", "int8"), "int16": ("smallint", "int16"),
               "int32": ("int", "int32"), "int64": ("bigint", "int64"), "uint8": ("smallint", "int16"),
               "uint16": ("int", "int32"), "uint32": ("bigint", "int64"), "float16": ("float", "float32"),
               "bfloat16": ("float", "float32"), "float32": ("float", "float32"), "float64": ("double", "float64")}


ELEMENTS_PER_BATCH = 1 << 20  # rows of elements a worker hands Spark at once (~24-40 MB)


def elements_frame(tiles, value):
    """``tiles`` (a Spark DataFrame of ``value``'s tiles: key columns, then ``tile``) as one row
    per element: an index column per dimension (named like the keys), then ``value``, as
    ``Tensor.to_arrow("elements")`` has them, made from each tile in a worker
    (``mapInArrow`` of ``tile_elements``: record batches of at most ``ELEMENTS_PER_BATCH`` rows,
    so no tile becomes one giant row or list)."""
    import functools

    if value.dtype not in SPARK_VALUE:
        raise EinsumError(f"to_spark(form='elements'): Spark has no type for {value.dtype} values (complex "
                          "numbers, unsigned 64-bit integers); read the tiles (form='tiles') or to_numpy()")
    if io.VALUE in (k.lower() for k in value.keys):  # two columns of that name, as to_arrow refuses
        raise EinsumError(f"to_spark(form='elements') of {value.name!r}: the keys {value.keys} include "
                          f"{io.VALUE!r}, the element form's value column; store the tensor with other keys")
    spark_type, out = SPARK_VALUE[value.dtype]
    spec = {"shape": list(value.shape), "tile": list(value.tile), "dtype": value.dtype, "out": out,
            "keys": list(value.keys), "name": value.name}
    schema = ", ".join([f"{_quoted(k)} bigint" for k in value.keys] + [f"value {spark_type}"])
    return tiles.mapInArrow(functools.partial(tile_elements, spec=spec), schema)


def tile_elements(batches, spec: dict):
    """``mapInArrow``'s function: record batches of tiles (key columns, ``tile``) in, record
    batches of their elements out (an int64 column per dimension, the indices global, then
    ``value`` in ``spec["out"]``), C order within each tile, at most ``ELEMENTS_PER_BATCH`` rows
    each. A tile whose bytes do not fit its place in the grid is a tensor replaced under the
    DataFrame: said, not read as something else."""
    shape, tile, dtype, out = spec["shape"], spec["tile"], np.dtype(spec["dtype"]), np.dtype(spec["out"])
    keys, ndim = spec["keys"], len(spec["shape"])
    names = keys + ["value"]
    for batch in batches:
        key_cols = [batch.column(k).to_numpy(zero_copy_only=False).astype(np.int64) for k in keys]
        tiles = batch.column("tile")
        for r in range(batch.num_rows):
            origin = [int(c[r]) * t for c, t in zip(key_cols, tile)]
            tshape = tuple(int(min(t, n - o)) for t, n, o in zip(tile, shape, origin))
            raw = tiles[r].as_py()
            if len(raw) != int(np.prod(tshape, dtype=np.int64)) * dtype.itemsize:
                raise EinsumError(f"to_spark(): a tile of tensor {spec['name']!r} at {tuple(origin)} holds {len(raw)} "
                                  "bytes, not what its place in the grid needs: the tensor was replaced or dropped "
                                  "after this DataFrame was made; make it again")
            flat = np.frombuffer(raw, dtype).astype(out)
            for lo in range(0, flat.size, ELEMENTS_PER_BATCH):
                hi = min(lo + ELEMENTS_PER_BATCH, flat.size)
                at = np.unravel_index(np.arange(lo, hi, dtype=np.int64), tshape) if ndim else ()
                cols = [pa.array(a.astype(np.int64) + o) for a, o in zip(at, origin)]
                yield pa.RecordBatch.from_arrays(cols + [pa.array(flat[lo:hi])], names=names)


def worker_error(e: BaseException) -> EinsumError | None:
    """The store's own error, where a Spark worker raised it (``MARK``), else None."""
    text = str(e)
    if MARK not in text:
        return None
    line = text[text.index(MARK) + len(MARK):].splitlines()[0].strip()
    return EinsumError(line)


def register(spark) -> None:
    from pyspark.sql.functions import arrow_udf

    from ..udfs.spark import _arity

    spark.udf.register(UDF, arrow_udf(_arity(elements_tile, 3), "binary"))


__all__ = ["elements_frame", "is_spark_frame", "read_frame", "register", "worker_error"]
