"""The SQL interface's own SQL: ordinary tables as einsum operands, and top-k results.

Pure, like the rest of ``compile``: it reads column names, DuckDB type names and the numbers a
statistics query returned, and builds sqlglot expressions; the backend runs them.

Two kinds of ordinary table can stand where a stored tensor's name goes in
``einsum(spec, 'A', ...)`` (the rules are in docs/DESIGN.md, "SQL interface"):

- **element form**, ``E(i BIGINT, j BIGINT, v DOUBLE)``: the integer columns are the indices in
  column order, the value is the column named ``value`` or else the one column that is not an
  integer. Missing elements are 0 (sparse COO); the size of each dimension is its largest index
  + 1, grown to the size another operand gives the same label; two rows for one index are an
  error.
- **array form**, ``T(id, emb FLOAT[n])``: one fixed-size array column and one key column, a
  matrix (rows x n) whose row r is the r-th row in key order.

Both are tiled inside the einsum's query, as MATERIALIZED CTEs: element rows are grouped by
tile key and packed into tile bytes by a UDF (``udfs/pack.py``), array rows likewise.

>>> t = classify_table("E", ["i", "j", "v"], ["BIGINT", "INTEGER", "DOUBLE"])
>>> t.indices, t.value, t.dtype
(('i', 'j'), 'v', 'float64')
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from sqlglot import exp

from ..errors import EinsumError
from ..notation.checks import SQL_TYPES, SQL_WIRE, check_dtype
from ..notation.spec import parse_spec
from ..plan import Plan, TiledValue
from ..plan.cost import STREAM_SLICE_BYTES
from .compiler import for_sql_interface
from .compiler import (
    TILE,
    SQLCompiler,
    alias,
    call,
    cast,
    col,
    fold,
    ident,
    key_list,
    name,
    num,
    ordered,
    range_table,
    sql_type,
    struct,
    subquery,
    table,
    ucol,
)
from .sql import COMPILER, DIALECT

# numpy dtype -> DuckDB type, for every dtype a table's value can have (DuckDB has no complex)
# (FLOAT is float32's: float16 values show as FLOAT too, but a FLOAT column stays float32)
DTYPE_OF = {v: k for k, v in SQL_TYPES.items() if k not in SQL_WIRE}
INDEX_TYPES = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
               "HUGEINT", "UHUGEINT"}
_ARRAY = re.compile(r"^(.*)\[(\d+)\]$")
# an index above this cannot be a dimension of a dense tensor on one machine (and keeps the
# key arithmetic inside BIGINT)
MAX_INDEX = 1 << 40


def _q(name: str) -> str:
    """A user's name as a quoted SQL identifier (for messages that show SQL to write)."""
    return ident(name).sql(dialect=DIALECT)


@dataclass(frozen=True)
class ElementTable:
    """A table in element form: index columns (in order) and a value column.

    ``shape`` is None until the statistics query has been read (``with_stats``)."""

    table: str
    indices: tuple[str, ...]
    value: str
    dtype: str
    shape: tuple[int, ...] | None = None
    rows: int | None = None  # the rows the statistics query counted

    @property
    def ndim(self) -> int:
        return len(self.indices)

    def describe(self) -> str:
        return f"table {self.table!r} (element form: indices {', '.join(self.indices) or 'none'}, value {self.value})"


@dataclass(frozen=True)
class ArrayTable:
    """A table with one array column ``column`` (``width`` long; a list column's width is None
    until the statistics query finds every list of one length) and a key column: a (rows x
    width) matrix, row r being the r-th row in ``key`` order."""

    table: str
    key: str
    column: str
    dtype: str
    width: int
    rows: int | None = None

    @property
    def ndim(self) -> int:
        return 2

    @property
    def shape(self) -> tuple[int, int] | None:
        return None if self.rows is None else (self.rows, self.width)

    def describe(self) -> str:
        width = "" if self.width is None else self.width
        return f"table {self.table!r} (array form: {self.column} {SQL_TYPES[self.dtype]}[{width}] ordered by {self.key})"


TableOperand = ElementTable | ArrayTable


def _value_dtype(table_name: str, column: str, sql_type: str) -> str:
    # DuckDB's type of a literal such as 1.5 and of sum() over decimals: read as DOUBLE (the pack
    # query casts every value to its dtype's type); HUGEINT, what sum() of integers gives, as
    # BIGINT (a value beyond it fails the cast, in DuckDB's words)
    if sql_type.startswith("DECIMAL"):
        return "float64"
    if sql_type in ("HUGEINT", "UHUGEINT"):
        return "int64" if sql_type == "HUGEINT" else "uint64"
    if sql_type not in DTYPE_OF:
        tiled = (" (a tensor's tiles, as to_parquet() writes them: db.store() the file, and name the stored "
                 "tensor here)" if sql_type == "BLOB" and column.lower() == "tile" else "")
        raise EinsumError(f"einsum(): table {table_name!r}: value column {column!r} is {sql_type}; a value must be "
                          f"one of {', '.join(DTYPE_OF)}, DECIMAL (read as DOUBLE) or HUGEINT (as BIGINT){tiled}; "
                          f"cast it in a view (CREATE VIEW v AS SELECT ..., CAST({_q(column)} AS DOUBLE) AS "
                          f"{_q(column)} FROM {_q(table_name)})")
    return check_dtype(DTYPE_OF[sql_type], f"einsum(): table {table_name!r}, column {column!r}")


def classify_table(table_name: str, columns: list[str], types: list[str]) -> TableOperand:
    """Which columns are indices, value, key or array, from the column names and DuckDB types."""
    # fixed-size arrays, and lists (FLOAT[]: a Parquet file of pyarrow's fixed-size lists reads
    # so), whose lengths the statistics query checks are one
    arrays = [(c, t) for c, t in zip(columns, types) if _ARRAY.match(t) or t.endswith("[]")]
    if arrays:
        if len(arrays) > 1:
            raise EinsumError(f"einsum(): table {table_name!r} has {len(arrays)} array columns "
                              f"({', '.join(c for c, _ in arrays)}); select one in a view")
        column, sql_type = arrays[0]
        element, width = _ARRAY.match(sql_type).groups() if _ARRAY.match(sql_type) else (sql_type[:-2], None)
        if _ARRAY.match(element) or element.endswith("[]"):
            raise EinsumError(f"einsum(): table {table_name!r}: column {column!r} is {sql_type}; "
                              "only one-dimensional arrays (FLOAT[n], DOUBLE[n], ...) are read")
        others = [c for c in columns if c != column]
        if len(others) != 1:
            what = "no other column" if not others else f"{len(others)} other columns ({', '.join(others)})"
            # the view to write, with a column of the table's own (it named an "id" the table
            # may not have: a trial); without one, a table's rowid numbers its rows as inserted
            key = _q(others[0]) if others else "rowid AS k"
            raise EinsumError(
                f"einsum(): table {table_name!r} has array column {column!r} and {what}; an array table needs "
                f"exactly one key column that orders its rows (a view can select it: "
                f"CREATE VIEW v AS SELECT {key}, {_q(column)} FROM {_q(table_name)})")
        return ArrayTable(table_name, others[0], column, _value_dtype(table_name, column, element),
                          None if width is None else int(width))
    named = [c for c in columns if c.lower() == "value"]
    if named:
        value = named[0]
    else:
        candidates = [c for c, t in zip(columns, types) if t not in INDEX_TYPES]
        if len(candidates) != 1:
            if not candidates:
                why = f"all its columns ({', '.join(columns)}) are integers, so the value column is ambiguous"
            else:
                why = f"{len(candidates)} columns are not integers ({', '.join(candidates)})"
            # the view spelt with the table's own columns (it said "SELECT i, j, w AS value"
            # whatever they were called, a documentation audit)
            guess = candidates[0] if candidates else columns[-1]
            select = ", ".join([_q(c) for c in columns if c != guess and c not in candidates]
                               + [f"{_q(guess)} AS value"])
            raise EinsumError(
                f"einsum(): table {table_name!r} is read in element form (integer index columns + one value "
                f"column), but {why}; name the value column 'value' (in a view: CREATE VIEW v AS SELECT {select} "
                f"FROM {_q(table_name)})")
        value = candidates[0]
    dtype = _value_dtype(table_name, value, types[columns.index(value)])
    indices = tuple(c for c in columns if c != value)
    bad = [(c, t) for c, t in zip(columns, types) if c != value and t not in INDEX_TYPES]
    if bad:
        c, t = bad[0]
        raise EinsumError(f"einsum(): table {table_name!r}: column {c!r} is {t}, but every column besides the "
                          f"value {value!r} is an index and must be an integer")
    return ElementTable(table_name, indices, value, dtype)


def stats_query(op: TableOperand) -> exp.Expression:
    """One scan giving what the plan needs (sizes) and what must be refused (NULLs, negative
    indices, duplicate keys). Element form: count(*), then per index count/min/max, then
    count(value). Array form: count(*), count(key), count(DISTINCT key), count(array)."""
    src = table(op.table)
    if isinstance(op, ElementTable):
        parts = [exp.Count(this=exp.Star())]
        for c in op.indices:
            parts += [exp.Count(this=col(c)), exp.Min(this=col(c)), exp.Max(this=col(c))]
        parts.append(exp.Count(this=col(op.value)))
    else:
        parts = [exp.Count(this=exp.Star()), exp.Count(this=col(op.key)),
                 exp.Count(this=exp.Distinct(expressions=[col(op.key)])), exp.Count(this=col(op.column))]
        if op.width is None:  # a list column: its lengths, which must be one
            length = exp.Anonymous(this="len", expressions=[col(op.column)])
            parts += [exp.Min(this=length), exp.Max(this=length.copy())]
    return exp.select(*parts).from_(src)


def with_stats(op: TableOperand, row: tuple) -> TableOperand:
    """``op`` with its shape, from the statistics row; refuses NULLs, negative indices, an
    array table whose key repeats."""
    n = int(row[0])
    name = op.table
    if isinstance(op, ArrayTable):
        _, keys, distinct, arrays = (int(x) for x in row[:4])
        if keys < n:
            raise EinsumError(f"einsum(): table {name!r}: key column {op.key!r} has {n - keys} NULL(s); "
                              "every row needs a key to order it")
        if distinct < n:
            raise EinsumError(f"einsum(): table {name!r}: key column {op.key!r} repeats values "
                              f"({n - distinct} duplicate(s)); the row order would be ambiguous")
        if arrays < n:
            raise EinsumError(f"einsum(): table {name!r}: array column {op.column!r} is NULL in {n - arrays} row(s)")
        if op.width is None:
            lo, hi = (0, 0) if not n else (int(row[4]), int(row[5]))
            if lo != hi:
                raise EinsumError(f"einsum(): table {name!r}: list column {op.column!r} holds lists of {lo} to {hi} "
                                  "elements; a table in array form has arrays of one length")
            return replace(op, rows=n, width=lo)
        return replace(op, rows=n)
    shape = []
    for p, c in enumerate(op.indices):
        count, lo, hi = row[1 + 3 * p: 4 + 3 * p]
        if count < n:
            raise EinsumError(f"einsum(): table {name!r}: index column {c!r} has {n - count} NULL(s)")
        if n and lo < 0:
            raise EinsumError(f"einsum(): table {name!r}: index column {c!r} has negative values (min {lo}); "
                              "indices count from 0")
        if n and hi >= MAX_INDEX:
            raise EinsumError(f"einsum(): table {name!r}: index column {c!r} goes up to {hi}: a dense dimension "
                              f"of that size cannot be built (renumber the indices densely from 0)")
        shape.append(int(hi) + 1 if n else 0)
    if int(row[-1]) < n:
        raise EinsumError(f"einsum(): table {name!r}: value column {op.value!r} has {n - int(row[-1])} NULL(s); "
                          "leave missing elements out (they are 0) or use coalesce() in a view")
    return replace(op, shape=tuple(shape), rows=n)


def _subscripts(spec: str, k: int) -> str | None:
    lhs = spec.split("->")[0].split(",")
    return lhs[k].replace(" ", "") if k < len(lhs) else None


def settle_shapes(spec: str, operands: list) -> list:
    """Element tables take the size the other operands give a label when it is larger than
    their own largest index + 1 (missing elements are 0); several element tables sharing a
    label take the largest. Stored tensors and array tables keep their shapes."""
    for k, op in enumerate(operands):
        sub = _subscripts(spec, k) if isinstance(spec, str) else None
        if isinstance(op, ElementTable) and sub is not None and "..." not in sub and len(sub) != op.ndim:
            raise EinsumError(f"einsum(): operand {k} is {op.describe()}, {op.ndim} index column(s), "
                              f"but its subscripts {sub!r} name {len(sub)}")
    if not any(isinstance(op, ElementTable) for op in operands):
        return operands
    # all-ones shapes: labels per axis without numpy's size-1 broadcasting moving them
    parsed = parse_spec(spec, [(1,) * len(op.shape) for op in operands])
    target: dict[str, int] = {}
    fixed: dict[str, tuple[int, int]] = {}  # label -> (size, operand) from stored or array operands
    for k, (labels, op) in enumerate(zip(parsed.inputs, operands)):
        for lab, size in zip(labels, op.shape):
            target[lab] = max(target.get(lab, 0), size)
            if not isinstance(op, ElementTable) and size != 1:
                fixed.setdefault(lab, (size, k))
    out = list(operands)
    for k, (labels, op) in enumerate(zip(parsed.inputs, operands)):
        if not isinstance(op, ElementTable):
            continue
        for lab, c, size in zip(labels, op.indices, op.shape):
            if lab in fixed and size > fixed[lab][0]:
                other, j = fixed[lab]
                raise EinsumError(
                    f"einsum(): table {op.table!r} (operand {k}) has {c} up to {size - 1}, but operand {j} gives "
                    f"{c}'s label {lab!r} size {other}")
        out[k] = replace(op, shape=tuple(target[lab] for lab in labels))
    return out


def array_tile(op: ArrayTable, tile_bytes: int) -> tuple[int, int]:
    """Whole rows, as many per tile as ``tile_bytes`` allows (halving, as auto tiles do)."""
    t0 = max(op.rows, 1)
    row_bytes = max(op.width, 1) * np.dtype(op.dtype).itemsize
    while t0 > 1 and t0 * row_bytes > tile_bytes:
        t0 = -(-t0 // 2)
    return (t0, max(op.width, 1))


def pack_bytes(op: TableOperand, elements: int) -> int:
    """What DuckDB holds to pack ``elements`` of a table operand in one statement (measured
    on an element table of float64: one 750 x 1500 tile, 1.1M list members of (offset, value),
    ran out of a 73.5 MiB limit; budgeted at 6x a member's bytes, the tile's in them); an
    array table's rows are lists of values (3x their bytes)."""
    item = np.dtype(op.dtype).itemsize
    return elements * (6 * (8 + item) if isinstance(op, ElementTable) else 3 * item)


def pack_tile(op: ElementTable, room: int, tile_bytes: int) -> tuple[int, ...]:
    """Tiles of whole trailing dimensions, as many leading rows per tile as one statement can
    pack in ``room`` bytes (``pack_bytes``) and a tile may hold (``tile_bytes``): an element
    table's tiling under a budget, fixed before planning (the plan re-tiles it where it wants
    other tiles). Where one row is more than either, smaller tiles (a 3 x 1,200,000 table was
    given (1, 1200000) tiles, over tile_bytes, and refused: a review)."""
    if not op.shape:
        return ()
    row = math.prod(op.shape[1:])
    item = np.dtype(op.dtype).itemsize
    t0 = min(op.shape[0], room // max(pack_bytes(op, row), 1), tile_bytes // max(row * item, 1))
    if t0 >= 1:
        return (t0, *op.shape[1:])
    # one row is more than a statement packs: tiles of as many elements as it does, cut in
    # every dimension (the plan's own one 3 x 400,000 tile ran DuckDB out of memory packing)
    from ..plan import auto_tile

    elements = max(1, min(room // max(pack_bytes(op, 1), 1), tile_bytes // item))
    return auto_tile(op.shape, item, elements * item)


def _type(dtype: str) -> exp.DataType:
    """DuckDB's type for a dtype's elements (``notation/checks.py`` SQL_TYPES)."""
    return sql_type(SQL_TYPES[dtype])


def _list_of(element: exp.DataType) -> exp.DataType:
    """``element[]``: a DuckDB list type."""
    return exp.DataType(this=exp.DataType.Type.ARRAY, expressions=[element], nested=True)


def _member_type(dtype: str) -> exp.DataType:
    """``STRUCT(o BIGINT, v <type>)[]``: the type of an element-form group's (offset, value) list."""
    fields = [exp.ColumnDef(this=name("o"), kind=sql_type("BIGINT")), exp.ColumnDef(this=name("v"), kind=_type(dtype))]
    return _list_of(exp.DataType(this=exp.DataType.Type.STRUCT, expressions=fields, nested=True))


def _of(key: str, alias_: str) -> exp.Column:
    """The quoted key column ``key`` of the compiler's (unquoted) alias ``alias_``: ``g."d0"``."""
    return exp.Column(this=ident(key), table=name(alias_))


def pack_elements(op: ElementTable, tiled: TiledValue, compiler: SQLCompiler | None = None,
                  band: tuple[int, int] | None = None, axis: int = 0) -> exp.Select:
    """The tiled table of an element-form operand: every tile of the grid, empty ones too
    (they are zeros), each packed from the element rows whose indices fall in it.

    An ordinary table in element form (index columns + value) as a tiled table, inside the
    einsum's query: element rows are grouped by tile key (index // tile side) and a kernel packs
    each group into one tile's bytes (offset = the element's C-order position in a full tile).
    Every tile of the grid is produced, empty ones too (zeros): a missing tile would drop out of
    the einsum's join. An index outside the planned shape stops the query (error())::

        SELECT coalesce(g.key, e.key) AS key, ..., eds_pack_<dtype>(spec, [keys], coalesce(e.m, [])) AS tile
        FROM (SELECT * FROM range(grid0) AS g0(key0) CROSS JOIN ...) AS g
        FULL OUTER JOIN (
          SELECT keys, list({'o': o, 'v': v}) AS m
          FROM (SELECT index // tile AS key, ..., <offset, checked> AS o, CAST(value AS type) AS v FROM table) AS cells
          GROUP BY keys
        ) AS e ON g.key = e.key AND ...
    """
    c = compiler or COMPILER
    spec = json.dumps({"table": op.table, "indices": list(op.indices), "shape": list(tiled.shape),
                       "tile": list(tiled.tile), "dtype": op.dtype}, separators=(",", ":"), sort_keys=True)
    keys = list(tiled.keys)
    idx = [cast(col(i), "BIGINT") for i in op.indices]
    strides = [math.prod(tiled.tile[p + 1:]) for p in range(op.ndim)]
    # (index % tile side) * stride, summed: the element's C-order position in a full tile
    offset = fold(exp.Add, [exp.Mul(this=exp.Paren(this=exp.Mod(this=i.copy(), expression=num(t))), expression=num(s))
                   for i, t, s in zip(idx, tiled.tile, strides)])
    # the plan was made from the committed rows (read on another connection); rows this query
    # sees beyond that shape would be dropped silently, so they stop the query instead
    inside = [exp.Between(this=i.copy(), low=num(0), high=num(n - 1)) for i, n in zip(idx, tiled.shape)]
    changed = exp.Literal.string(f"einsum(): table {op.table!r} changed after einsum read its shape "
                                 f"{tuple(tiled.shape)} (uncommitted rows in this transaction? einsum reads the "
                                 "committed state: COMMIT first)")
    checked = (exp.Case(ifs=[exp.If(this=exp.and_(*inside), true=offset)], default=call("error", changed))
               if inside else num(0))
    cells = exp.Select(expressions=[alias(exp.IntDiv(this=i.copy(), expression=num(t)), ident(k))
                                    for i, t, k in zip(idx, tiled.tile, keys)]
                       + [alias(checked, name("o")), alias(cast(col(op.value), SQL_TYPES[op.dtype]), name("v"))])
    cells = cells.from_(table(op.table), copy=False)
    if band is not None and keys:
        # the tiles of keys lo..hi-1 along ``axis`` only (a statement of its own: db.einsum under
        # a budget packs a big table in several); rows outside the shape still reach the check
        i0, t0, n0 = idx[axis], tiled.tile[axis], tiled.shape[axis]
        cells.set("where", exp.Where(this=exp.or_(
            exp.LT(this=i0.copy(), expression=num(0)), exp.GTE(this=i0.copy(), expression=num(n0)),
            exp.and_(exp.GTE(this=i0.copy(), expression=num(band[0] * t0)),
                     exp.LT(this=i0.copy(), expression=num(band[1] * t0))))))
    members = exp.Select(expressions=[col(k) for k in keys]
                         + [alias(c.list_aggregate(this=struct(o=ucol("o"), v=ucol("v"))), name("m"))])
    members = members.from_(subquery(cells, "cells"), copy=False)
    if keys:
        members.set("group", exp.Group(expressions=[col(k) for k in keys]))
    # the grid of tile keys: a cross product of range()s (one row of nothing for a scalar)
    if keys:
        lo_hi = [band if p == axis and band is not None else (0, g) for p, g in enumerate(tiled.grid)]
        ranges = [range_table(lo, hi, f"g{p}", k) for p, ((lo, hi), k) in enumerate(zip(lo_hi, keys))]
        grid = exp.Select(expressions=[exp.Star()]).from_(ranges[0], copy=False)
        if len(ranges) > 1:
            grid.set("joins", [exp.Join(this=r, kind="CROSS") for r in ranges[1:]])
    else:
        grid = exp.Select(expressions=[alias(num(1), name("one"))])
    out_keys = [exp.Coalesce(this=_of(k, "g"), expressions=[_of(k, "e")]) for k in keys]
    kernel = call(c.pack_udf.format(dtype=op.dtype), exp.Literal.string(spec), key_list([k.copy() for k in out_keys]),
                  exp.Coalesce(this=ucol("m", "e"), expressions=[exp.Cast(this=exp.Array(expressions=[]),
                                                                          to=_member_type(op.dtype))]))
    on = exp.and_(*[exp.EQ(this=_of(k, "g"), expression=_of(k, "e")) for k in keys]) if keys else exp.true()
    joins = [exp.Join(this=subquery(members, "e"), side="FULL", kind="OUTER", on=on)]
    if band is None and op.rows is not None:
        # The shape was planned from the rows committed when the statistics were read (on
        # another cursor); this query reads its own snapshot. Fewer rows here (a transaction
        # begun before another connection's insert, a table swapped meanwhile) gave the planned
        # shape's extra rows as zeros, in silence (a trial): the rows it sees must be the rows
        # counted (rows beyond the shape stop it above)
        seen = exp.Select(expressions=[alias(exp.Count(this=exp.Star()), name("n"))]).from_(table(op.table), copy=False)
        joins.append(exp.Join(this=subquery(seen, "seen"), kind="CROSS"))
        said = exp.DPipe(this=exp.DPipe(this=exp.Literal.string(
            f"einsum(): table {op.table!r} changed while einsum read it (its shape {tuple(tiled.shape)} was planned "
            f"from {op.rows} committed rows; this query sees "), expression=cast(ucol("n", "seen"), "VARCHAR")),
            expression=exp.Literal.string(" rows: a transaction begun before another connection's change, or a change "
                                          "meanwhile); COMMIT first, or run it again"))
        kernel = exp.Case(ifs=[exp.If(this=exp.EQ(this=ucol("n", "seen"), expression=num(op.rows)), true=kernel)],
                          default=call("error", said))
    select = exp.Select(expressions=[alias(k, ident(key)) for k, key in zip(out_keys, keys)] + [alias(kernel, name(TILE))])
    select = select.from_(subquery(grid, "g"), copy=False)
    select.set("joins", joins)
    return select


def pack_rows(op: ArrayTable, tiled: TiledValue, compiler: SQLCompiler | None = None,
              band: tuple[int, int] | None = None, ranked: bool = False) -> exp.Select:
    """The tiled table of an array-form operand: tiles of whole rows, in key order.

    A table with a fixed-size array column as a tiled (rows x n) matrix, inside the einsum's
    query: row r is the r-th in key order. Rows are numbered on the keys alone (a window that
    carried the arrays along took ~2x as long), joined back, grouped into tiles of ``t0`` whole
    rows, and a kernel packs each group's arrays, listed in row order, into one tile's bytes.
    With one tile of rows the numbering is skipped: one list of arrays in key order::

        SELECT numbered.r // t0 AS key0, CAST(0 AS BIGINT) AS key1,
               eds_pack_rows_<dtype>(spec, [numbered.r // t0, 0], list(CAST(src.column AS type[]) ORDER BY numbered.r ASC)) AS tile
        FROM table AS src
        JOIN (SELECT key AS nk, row_number() OVER (ORDER BY key ASC) - 1 AS r FROM table) AS numbered ON numbered.nk = src.key
        GROUP BY numbered.r // t0
    """
    c = compiler or COMPILER
    t0 = tiled.tile[0]
    spec = json.dumps({"table": op.table, "column": op.column, "shape": list(tiled.shape), "tile": list(tiled.tile),
                       "dtype": op.dtype}, separators=(",", ":"), sort_keys=True)
    k0, k1 = tiled.keys
    key = col(op.key, "src")
    single = tiled.grid[0] <= 1
    if ranked:
        # the key is the row's rank already, 0..rows-1 (a copy sorted once: io.PackedRows): no
        # numbering, and a band reads its rows' range only
        r = col(op.key, "src")
        tile_key = exp.IntDiv(this=r.copy(), expression=num(t0))
        rows = c.list_aggregate(this=exp.Order(this=exp.Cast(this=col(op.column, "src"), to=_list_of(_type(op.dtype))),
                                               expressions=[ordered(r.copy())]))
        kernel = call(c.pack_rows_udf.format(dtype=op.dtype), exp.Literal.string(spec),
                      key_list([tile_key.copy(), num(0)]), rows)
        select = exp.Select(expressions=[alias(tile_key.copy(), ident(k0)), alias(cast(num(0), "BIGINT"), ident(k1)),
                                         alias(kernel, name(TILE))])
        select = select.from_(exp.Table(this=ident(op.table), alias=exp.TableAlias(this=name("src"))), copy=False)
        if band is not None:
            select = select.where(exp.and_(exp.GTE(this=r.copy(), expression=num(band[0] * t0)),
                                           exp.LT(this=r.copy(), expression=num(band[1] * t0))), copy=False)
        select.set("group", exp.Group(expressions=[tile_key.copy()]))
        return select

    def tile_key() -> exp.Expression:
        return cast(num(0), "BIGINT") if single else exp.IntDiv(this=ucol("r", "numbered"), expression=num(t0))

    order = key.copy() if single else ucol("r", "numbered")
    rows = c.list_aggregate(this=exp.Order(this=exp.Cast(this=col(op.column, "src"), to=_list_of(_type(op.dtype))),
                                           expressions=[ordered(order)]))
    kernel = call(c.pack_rows_udf.format(dtype=op.dtype), exp.Literal.string(spec),
                  key_list([tile_key(), num(0)]), rows)
    if single:
        # keys repeated in the query's snapshot (the statistics read the committed rows, unique):
        # with no numbering to join on, two rows of one key were packed in either order, in
        # silence (a trial: an UPDATE in the caller's open transaction); numbered rows of a
        # repeated key meet twice in the join and the kernel finds a tile of the wrong size
        repeats = exp.Literal.string(f"einsum(): table {op.table!r}: key column {op.key!r} repeats values in this "
                                     "transaction (einsum read the committed rows, whose keys are unique); make "
                                     "the keys unique, or COMMIT first")
        kernel = exp.Case(ifs=[exp.If(this=exp.EQ(this=exp.Count(this=exp.Distinct(expressions=[key.copy()])),
                                                  expression=exp.Count(this=exp.Star())), true=kernel)],
                          default=call("error", repeats))
    select = exp.Select(expressions=[alias(tile_key(), ident(k0)), alias(cast(num(0), "BIGINT"), ident(k1)),
                                     alias(kernel, name(TILE))])
    select = select.from_(exp.Table(this=ident(op.table), alias=exp.TableAlias(this=name("src"))), copy=False)
    if not single:
        window = exp.Window(this=exp.RowNumber(), order=exp.Order(expressions=[ordered(col(op.key))]), over="OVER")
        numbered = exp.Select(expressions=[alias(col(op.key), name("nk")),
                                           alias(exp.Sub(this=window, expression=num(1)), name("r"))])
        numbered = numbered.from_(table(op.table), copy=False)
        on = exp.EQ(this=ucol("nk", "numbered"), expression=key.copy())
        if band is not None:  # the tiles of row keys lo..hi-1 only (see pack_elements)
            r = ucol("r", "numbered")
            on = exp.and_(on, exp.GTE(this=r, expression=num(band[0] * t0)),
                          exp.LT(this=r.copy(), expression=num(band[1] * t0)))
        select.set("joins", [exp.Join(this=subquery(numbered, "numbered"), on=on)])
        select.set("group", exp.Group(expressions=[tile_key()]))
    return select


def pack_query(op: TableOperand, tiled: TiledValue, compiler: SQLCompiler | None = None,
               band: tuple[int, int] | None = None, axis: int = 0) -> exp.Expression:
    """The tiled table of a table operand; ``band``: only the tiles whose key along ``axis``
    (an array table's rows: 0) is in ``range(*band)`` (a table packed in several statements)."""
    if isinstance(op, ElementTable):
        return pack_elements(op, tiled, compiler, band, axis)
    return pack_rows(op, tiled, compiler, band)


def with_ctes(query: exp.Expression, ctes: list[tuple[str, exp.Expression]]) -> exp.Expression:
    """``query`` with MATERIALIZED CTEs ``(name, select)`` placed before its own."""
    if not ctes:
        return query
    query = query.copy()
    key = "with_" if "with_" in query.arg_types else "with"
    new = [exp.CTE(this=s, alias=exp.TableAlias(this=ident(name)), materialized=True) for name, s in ctes]
    old = query.args.get(key)
    query.set(key, exp.With(expressions=new + (list(old.expressions) if old is not None else [])))
    return query


# einsum kernels with a fused top-k twin (udfs/topk.py registers eds_topk_<kernel>), and the
# result dtypes whose values the twin may hand over as DOUBLE exactly
_FUSABLE = re.compile(r"^eds_einsum(_group)?[12]$", re.IGNORECASE)
_EXACT_IN_DOUBLE = {"bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float32", "float64"}


def _topk_spec(result: TiledValue, k: int, stream: bool = False, largest: bool = True) -> str:
    # ``stream``: the fused kernel computes its call's results a slice at a time (a plan made
    # with ``CostModel.streamed_result``); else whole, as the einsum kernel alone would (fewer
    # rows a call change how BLAS splits a product: values 1 ulp from einsum_elements', a review)
    extra = {"stream": STREAM_SLICE_BYTES} if stream else {}
    if not largest:  # the kernel ranks the smallest (udfs/topk.py: reversed_order)
        extra["smallest"] = True
    return json.dumps({"shape": list(result.shape), "tile": list(result.tile), "dtype": result.dtype, "k": k,
                       **extra}, separators=(",", ":"), sort_keys=True)


def fuse_topk(query: exp.Select, result: TiledValue, k: int, compiler: SQLCompiler | None = None,
              stream: bool = False, largest: bool = True) -> exp.Select | None:
    """``query`` (a plan's single query, whose last step is a binary einsum) with its kernel
    swapped for the fused top-k twin, so the result tiles never leave the kernel; None when
    the last step is another kind or the dtype is not exact in DOUBLE.

    Measured on the 1000 x 20000 (dim 128) similarity top-5: 0.21-0.27 s fused against
    0.27-0.40 s with the result tiles (80 MB) handed to a separate top-k kernel."""
    c = compiler or COMPILER
    if result.dtype not in _EXACT_IN_DOUBLE or not isinstance(query, exp.Select):
        return None
    *keys, last = query.expressions
    kernel = last.this if isinstance(last, exp.Alias) else None
    if not isinstance(kernel, exp.Anonymous) or not _FUSABLE.match(kernel.name) or last.alias != TILE:
        return None
    keys = key_list([(e.this if isinstance(e, exp.Alias) else e).copy() for e in keys])
    fused = call(c.topk_fused_udf.format(kernel=kernel.name.lower()), exp.Literal.string(_topk_spec(result, k, stream, largest)), keys,
                 *[a.copy() for a in kernel.expressions])
    query = query.copy()
    query.expressions[-1].set("this", fused)
    return query


def fuses_topk(plan: Plan, compiler: SQLCompiler | None = None) -> bool:
    """Whether ``interface_query`` runs ``plan``'s top-k inside its last einsum's kernel."""
    c = for_sql_interface(type(compiler or COMPILER), False)()  # (the cache's key as interface_query spells it)
    query = c.single_query(plan, {v.name: v.name for v in plan.inputs})
    return fuse_topk(query, plan.result, 1, c) is not None


def topk_query(result: TiledValue, k: int, source: exp.Expression, fused: bool = False,
               compiler: SQLCompiler | None = None, largest: bool = True) -> exp.Select:
    """The ``k`` largest elements of every row of ``result`` (the tiles ``source`` returns, or
    with ``fused`` the candidates ``fuse_topk``'s kernel returns in the tile column).

    A row is every output label but the last; the last is ranked. Each tile is cut to its
    top ``k`` per row inside the kernel (``udfs/topk.py``), so only ``k`` candidates per row
    and tile reach SQL (candidates ``{r: row number, i: index of the last label, v: value}``);
    a window ranks the candidates of a row across tiles (value descending, NaN last, ties by the
    smaller index, as numpy's stable sort of the negated values) and keeps ``k``. The inner
    columns are ``_eds_*``: an output label named r, i or v must not capture them::

        SELECT (_eds_r // stride) % size AS row_label, ..., "rank", _eds_i AS last, CAST(_eds_v AS type) AS "value"
        FROM (
          SELECT cand.r AS _eds_r, cand.i AS _eds_i, cand.v AS _eds_v,
                 row_number() OVER (PARTITION BY cand.r ORDER BY isnan(cand.v) ASC, cand.v + 0.0 DESC, cand.i ASC) AS "rank"
          FROM (SELECT unnest(eds_topk_<dtype>(spec, [keys], tile)) AS cand FROM source) AS cands
        ) AS ranked
        WHERE "rank" <= k ORDER BY _eds_r ASC, "rank" ASC
    """
    c = compiler or COMPILER
    keys = list(result.keys)
    rows, last = keys[:-1], keys[-1]
    strides = [math.prod(result.shape[p + 1:len(rows)]) for p in range(len(rows))]
    row_cols = [alias(exp.Mod(this=exp.Paren(this=exp.IntDiv(this=ucol("_eds_r"), expression=num(s))), expression=num(n)),
                      ident(row))
                for s, n, row in zip(strides, result.shape, rows)]
    # bfloat16 too: "bfloat16".startswith("float") is False, and NaN ranked first there (a review)
    floating = result.dtype in ("float16", "bfloat16", "float32", "float64")
    # the kernel over the result tiles, or (fused: the einsum kernel already returned
    # candidates, values as DOUBLE) the tile column itself
    candidates = ucol(TILE) if fused else call(c.topk_udf.format(dtype=result.dtype),
                                               exp.Literal.string(_topk_spec(result, k, largest=largest)),
                                               key_list([col(key) for key in keys]), ucol(TILE))
    cands = exp.Select(expressions=[alias(exp.Explode(this=candidates), name("cand"))])
    cands = cands.from_(source.subquery("src"), copy=False)
    v = ucol("v", "cand")
    # -0.0 and 0.0 tie, as in numpy; NaN ranks last (smallest first too)
    order = ([ordered(exp.IsNan(this=v.copy()))] if floating else []) + [
        ordered(exp.Add(this=v.copy(), expression=num("0.0")) if floating else v.copy(), desc=largest),
        ordered(ucol("i", "cand"))]
    rank = exp.Window(this=exp.RowNumber(), partition_by=[ucol("r", "cand")], order=exp.Order(expressions=order),
                      over="OVER")
    ranked = exp.Select(expressions=[alias(ucol("r", "cand"), name("_eds_r")), alias(ucol("i", "cand"), name("_eds_i")),
                                     alias(v.copy(), name("_eds_v")), alias(rank, ident("rank"))])
    ranked = ranked.from_(subquery(cands, "cands"), copy=False)
    select = exp.Select(expressions=row_cols + [col("rank"), alias(ucol("_eds_i"), ident(last)),
                                                alias(cast(ucol("_eds_v"), SQL_TYPES[result.dtype]), ident("value"))])
    select = select.from_(subquery(ranked, "ranked"), copy=False)
    select.set("where", exp.Where(this=exp.LTE(this=col("rank"), expression=num(k))))
    select.set("order", exp.Order(expressions=[ordered(ucol("_eds_r")), ordered(col("rank"))]))
    return select


@lru_cache(maxsize=256)
def interface_query(plan: Plan, tables: tuple[tuple[str, TableOperand], ...], mode: str, k: int | None,
                    compiler: SQLCompiler | None = None, home: tuple[str, str] | None = None,
                    rewritten: tuple[str, ...] = (), stream: bool = False, largest: bool = True,
                    own: bool = False) -> str:
    """The whole answer of a SQL table function as SQL (DuckDB's, or ``compiler``'s): the plan
    as one query, preceded by the tiling of every table operand it reads (``tables``: CTE name
    and operand), then cut to elements or to the top ``k`` per row by ``mode`` (tiles, elements,
    topk). ``home``: the (database, schema) the operands were read in: every table the query
    names is qualified with it, so a TEMP table of the caller's with a tensor's name does not
    stand in for it (the plan was made from the tensor's shape). ``rewritten``: the stored
    tensors read that the session wrote over or dropped, checked in the query (``_unchanged``).
    ``stream``: the plan was made with its result streamed (``CostModel.streamed_result``), so
    the fused top-k kernel works a slice of its call at a time. ``largest`` False: the top-k
    ranks the smallest first. ``own``: the session runs the query as a call of its own
    (``db.topk``), which its interrupt stops; else it is a user's query (``for_sql_interface``).

    Cached: plans and operands are frozen, so a query repeated over unchanged tables pays for
    building and printing it once."""
    # no tile is named (a device's cache, a running plan's array operands): no run of the
    # backend's names the tiles this query's kernels are handed
    c = for_sql_interface(type(compiler or COMPILER), own)()
    result = plan.result
    # stored tensors are values named after their tables, table operands after their CTEs
    query = c.single_query(plan, {v.name: v.name for v in plan.inputs})
    fused = fuse_topk(query, result, k, c, stream, largest) if mode == "topk" else None
    query = fused if fused is not None else query
    by_table = {v.name: v for v in plan.inputs}
    query = with_ctes(query, [(cte, _not_shadowed(pack_query(op, by_table[cte], c), op.table)) for cte, op in tables])
    if mode == "elements":
        query = c.elements_query(result, result.keys, source=query)
    elif mode == "topk":
        query = topk_query(result, k, query, fused=fused is not None, compiler=c, largest=largest)
    query = _unchanged(query, [v for v in plan.inputs if v.name in rewritten])
    if home is not None:
        query = qualified(query, home)
    return c.sql(query)


def _not_shadowed(pack: exp.Expression, table_name: str) -> exp.Expression:
    """A table operand's packing, stopped (error()) where the connection running the query has a
    TEMP table or view of the table's name. In the caller's SQL a bare name means the TEMP one; the
    operand is read from the database (planned on a cursor of its own, which sees no TEMP table),
    so ``einsum_elements('i->', 'sh')`` summed ``main.sh`` while ``SELECT sum(value) FROM sh``
    summed the TEMP ``sh`` (a new user's report: a silent wrong answer). Checked in the query, on
    the caller's connection, where its TEMP catalog is seen: two catalog scans (~1 ms), only for
    queries reading ordinary tables (a stored tensor is read by its own name in the tensors'
    catalog, whatever the caller's TEMP tables).

    The check is a one-row subquery joined to the packing on its column (a cross join with it
    was optimised away, its column unused), which DuckDB runs whole (a MATERIALIZED CTE)
    whatever the caller's query keeps: as a condition on the result's rows it never ran where no
    row reached it (``WHERE value > 5`` of the caller's, a review). A table of no rows packs no
    tile, and is not checked::

        SELECT p.* FROM (<packing>) AS p JOIN (SELECT CASE WHEN (SELECT count(*) FROM
          duckdb_tables() WHERE database_name = 'temp' AND lower(table_name) = lower('sh')) + (...
          duckdb_views() ...) = 0 THEN 1 ELSE error('...') END AS ok) AS _eds_shadow
          ON _eds_shadow.ok = 1
    """
    def count(function: str, column: str) -> exp.Expression:
        return exp.Subquery(this=exp.Select(expressions=[exp.Count(this=exp.Star())]).from_(
            exp.Table(this=exp.Anonymous(this=function, expressions=[]))).where(exp.and_(
                exp.EQ(this=col("database_name"), expression=exp.Literal.string("temp")),
                exp.EQ(this=exp.Lower(this=col(column)), expression=exp.Lower(this=exp.Literal.string(table_name))))))

    message = exp.Literal.string(
        f"einsum(): this connection has a TEMP table or view named {table_name!r}, as the table the einsum reads; "
        "einsum reads the database's table of that name, not the TEMP one: rename one of them, or make the TEMP "
        "data a table of the database")
    ok = exp.Case(ifs=[exp.If(this=exp.EQ(this=exp.Add(this=count("duckdb_tables", "table_name"),
                                                       expression=count("duckdb_views", "view_name")),
                                          expression=num(0)), true=num(1))],
                  default=call("error", message))
    guard = exp.Select(expressions=[alias(ok, name("ok"))])
    return exp.Select(expressions=[exp.Column(this=exp.Star(), table=name("p"))]).from_(
        subquery(pack, "p"), copy=False).join(subquery(guard, "_eds_shadow"), join_type="INNER",
                                              on=exp.EQ(this=ucol("ok", "_eds_shadow"), expression=num(1)), copy=False)


def _unchanged(query: exp.Expression, stored: list[TiledValue]) -> exp.Expression:
    """``query``, stopped (error()) unless each stored tensor it reads has, in the query's own
    snapshot, the shape, dtype and tile it was planned with. The plan is made from the
    committed catalog (read on another connection); in a transaction the caller opened before
    a tensor was replaced, the query reads the old tiles: 3x4 bytes were read as the new 4x3
    (wrong values, no error; a new user's report). One scan of the catalog: +0.6-1.0 ms on a
    64² GEMM's 1.0 ms query (one core), so only for tensors this session wrote over or dropped
    (a tensor written once is either seen as planned or not at all). Another process writing
    over a tensor of a shared file database is not seen.

        ... WHERE ... AND CASE WHEN (SELECT count(*) FROM eds_catalog WHERE (lower(name) = lower('B')
                  AND shape = [4, 3] AND dtype = 'float64' AND tile = [4, 3]) OR ...) = <tensors> THEN TRUE
                  ELSE error('...') END
    """
    if not stored or not isinstance(query, exp.Select):
        return query
    same = [exp.and_(
        exp.EQ(this=exp.Lower(this=col("name")), expression=exp.Lower(this=exp.Literal.string(v.name))),
        exp.EQ(this=col("shape"), expression=key_list([num(n) for n in v.shape])),
        exp.EQ(this=col("dtype"), expression=exp.Literal.string(v.dtype)),
        exp.EQ(this=col("tile"), expression=key_list([num(n) for n in v.tile]))) for v in stored]
    count = exp.Select(expressions=[exp.Count(this=exp.Star())]).from_(table("eds_catalog")).where(exp.or_(*same))
    planned = ", ".join(f"{v.name!r} ({v.dtype}, shape {tuple(v.shape)})" for v in stored)
    message = exp.Literal.string(
        f"einsum(): the stored tensors it reads are not, in this query's transaction, what it was planned from: "
        f"{planned} (replaced, or stored, after this transaction began? einsum plans from the committed "
        "catalog: COMMIT first)")
    check = exp.Case(ifs=[exp.If(this=exp.EQ(this=exp.Subquery(this=count), expression=num(len(stored))),
                                 true=exp.true())], default=call("error", message))
    return query.where(check, copy=True)


def qualified(query: exp.Expression, home: tuple[str, str]) -> exp.Expression:
    """``query`` with every table it reads by bare name (not a CTE, not a table function)
    qualified as ``home``'s database and schema."""
    ctes = {cte.alias_or_name.lower() for cte in query.find_all(exp.CTE)}
    for t in query.find_all(exp.Table):
        if isinstance(t.this, exp.Identifier) and not t.args.get("db") and t.name.lower() not in ctes:
            t.set("db", ident(home[1]))
            t.set("catalog", ident(home[0]))
    return query
