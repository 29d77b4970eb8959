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
import sqlglot
from sqlglot import exp

from ..errors import EinsumError
from ..notation.checks import check_dtype
from ..notation.spec import parse_spec
from ..plan import Plan, TiledValue
from ..sql_templates import template
from .sql import DIALECT, col, elements_query, ident, single_query, table
from ..notation.checks import SQL_TYPES

# numpy dtype -> DuckDB type, for every dtype a table's value can have (DuckDB has no complex)
DTYPE_OF = {v: k for k, v in SQL_TYPES.items()}
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

    @property
    def ndim(self) -> int:
        return len(self.indices)

    def describe(self) -> str:
        return f"table {self.table!r} (element form: indices {', '.join(self.indices) or 'none'}, value {self.value})"


@dataclass(frozen=True)
class ArrayTable:
    """A table with one fixed-size array column ``column`` (``width`` long) and a key column:
    a (rows x width) matrix, row r being the r-th row in ``key`` order."""

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
        return f"table {self.table!r} (array form: {self.column} {SQL_TYPES[self.dtype]}[{self.width}] ordered by {self.key})"


TableOperand = ElementTable | ArrayTable


def _value_dtype(table_name: str, column: str, sql_type: str) -> str:
    if sql_type.startswith("DECIMAL"):
        raise EinsumError(f"einsum(): table {table_name!r}: value column {column!r} is {sql_type}; cast it to "
                          f"DOUBLE in a view (CREATE VIEW ... AS SELECT ..., {_q(column)}::DOUBLE AS value FROM ...)")
    if sql_type not in DTYPE_OF:
        raise EinsumError(f"einsum(): table {table_name!r}: value column {column!r} is {sql_type}; a value must be "
                          f"one of {', '.join(SQL_TYPES.values())}")
    return check_dtype(DTYPE_OF[sql_type], f"einsum(): table {table_name!r}, column {column!r}")


def classify_table(table_name: str, columns: list[str], types: list[str]) -> TableOperand:
    """Which columns are indices, value, key or array, from the column names and DuckDB types."""
    arrays = [(c, t) for c, t in zip(columns, types) if _ARRAY.match(t)]
    if arrays:
        if len(arrays) > 1:
            raise EinsumError(f"einsum(): table {table_name!r} has {len(arrays)} array columns "
                              f"({', '.join(c for c, _ in arrays)}); select one in a view")
        column, sql_type = arrays[0]
        element, width = _ARRAY.match(sql_type).groups()
        if _ARRAY.match(element) or element.endswith("[]"):
            raise EinsumError(f"einsum(): table {table_name!r}: column {column!r} is {sql_type}; "
                              "only one-dimensional arrays (FLOAT[n], DOUBLE[n], ...) are read")
        others = [c for c in columns if c != column]
        if len(others) != 1:
            what = "no other column" if not others else f"{len(others)} other columns ({', '.join(others)})"
            raise EinsumError(
                f"einsum(): table {table_name!r} has array column {column!r} and {what}; an array table needs "
                f"exactly one key column that orders its rows (a view can select it: "
                f"CREATE VIEW v AS SELECT id, {_q(column)} FROM {_q(table_name)})")
        return ArrayTable(table_name, others[0], column, _value_dtype(table_name, column, element), int(width))
    lists = [c for c, t in zip(columns, types) if t.endswith("[]")]
    if lists:
        raise EinsumError(f"einsum(): table {table_name!r}: column {lists[0]!r} is a list of varying length; "
                          f"cast it to a fixed-size array (e.g. {_q(lists[0])}::FLOAT[64]) in a view")
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
            raise EinsumError(
                f"einsum(): table {table_name!r} is read in element form (integer index columns + one value "
                f"column), but {why}; name the value column 'value' (in a view: SELECT i, j, w AS value FROM ...)")
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
    return exp.select(*parts).from_(src)


def with_stats(op: TableOperand, row: tuple) -> TableOperand:
    """``op`` with its shape, from the statistics row; refuses NULLs, negative indices, an
    array table whose key repeats."""
    n = int(row[0])
    name = op.table
    if isinstance(op, ArrayTable):
        _, keys, distinct, arrays = (int(x) for x in row)
        if keys < n:
            raise EinsumError(f"einsum(): table {name!r}: key column {op.key!r} has {n - keys} NULL(s); "
                              "every row needs a key to order it")
        if distinct < n:
            raise EinsumError(f"einsum(): table {name!r}: key column {op.key!r} repeats values "
                              f"({n - distinct} duplicate(s)); the row order would be ambiguous")
        if arrays < n:
            raise EinsumError(f"einsum(): table {name!r}: array column {op.column!r} is NULL in {n - arrays} row(s)")
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
    return replace(op, shape=tuple(shape))


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


def _fill(name: str, **holes: str) -> exp.Expression:
    return sqlglot.parse_one(template(name).format(**holes), read=DIALECT)


def _sql(e: exp.Expression) -> str:
    return e.sql(dialect=DIALECT)


def _lit(value) -> str:
    if isinstance(value, str):
        return _sql(exp.Literal.string(value))
    return _sql(exp.Literal.number(value))


def _key_list(cols: list[str]) -> str:
    return f"CAST([{', '.join(cols)}] AS BIGINT[])"


def pack_elements(op: ElementTable, tiled: TiledValue) -> exp.Expression:
    """The tiled table of an element-form operand: every tile of the grid, empty ones too
    (they are zeros), each packed from the element rows whose indices fall in it."""
    spec = json.dumps({"table": op.table, "indices": list(op.indices), "shape": list(tiled.shape),
                       "tile": list(tiled.tile), "dtype": op.dtype}, separators=(",", ":"), sort_keys=True)
    keys = [_sql(ident(k)) for k in tiled.keys]
    idx = [f"CAST({_sql(col(c))} AS BIGINT)" for c in op.indices]
    strides = [math.prod(tiled.tile[p + 1:]) for p in range(op.ndim)]
    offset = " + ".join(f"({i} % {t}) * {s}" for i, t, s in zip(idx, tiled.tile, strides)) or "0"
    # the plan was made from the committed rows (read on another connection); rows this query
    # sees beyond that shape would be dropped silently, so they stop the query instead
    inside = " AND ".join(f"{i} BETWEEN 0 AND {n - 1}" for i, n in zip(idx, tiled.shape))
    changed = _lit(f"einsum(): table {op.table!r} changed after einsum read its shape {tuple(tiled.shape)} "
                   "(uncommitted rows in this transaction? einsum reads the committed state: COMMIT first)")
    checked = f"CASE WHEN {inside} THEN {offset} ELSE error({changed}) END" if inside else "0"
    grid = [f"range({g}) AS {_sql(ident(f'g{p}'))}({k})" for p, (g, k) in enumerate(zip(tiled.grid, keys))]
    return _fill(
        "pack_elements",
        tile_keys="".join(f"{i} // {t} AS {k}, " for i, t, k in zip(idx, tiled.tile, keys)),
        offset=checked,
        value=f"CAST({_sql(col(op.value))} AS {SQL_TYPES[op.dtype]})",
        source=_sql(table(op.table)),
        keys=", ".join(keys),
        comma=", " if keys else "",
        group_by=f"GROUP BY {', '.join(keys)}" if keys else "",
        out_keys="".join(f"coalesce(g.{k}, e.{k}) AS {k}, " for k in keys),
        kernel=f"eds_pack_{op.dtype}",
        spec=_lit(spec),
        key_list=_key_list([f"coalesce(g.{k}, e.{k})" for k in keys]),
        member_type=f"STRUCT(o BIGINT, v {SQL_TYPES[op.dtype]})[]",
        grid=f"(SELECT * FROM {' CROSS JOIN '.join(grid)})" if grid else "(SELECT 1 AS one)",
        join_on=" AND ".join(f"g.{k} = e.{k}" for k in keys) or "TRUE",
    )


def pack_rows(op: ArrayTable, tiled: TiledValue) -> exp.Expression:
    """The tiled table of an array-form operand: tiles of whole rows, in key order."""
    t0 = tiled.tile[0]
    spec = json.dumps({"table": op.table, "column": op.column, "shape": list(tiled.shape), "tile": list(tiled.tile),
                       "dtype": op.dtype}, separators=(",", ":"), sort_keys=True)
    k0, k1 = (_sql(ident(k)) for k in tiled.keys)
    key, column = _sql(col(op.key, "src")), _sql(col(op.column, "src"))
    single = tiled.grid[0] <= 1
    numbered = (f"JOIN (SELECT {_sql(col(op.key))} AS nk, row_number() OVER (ORDER BY {_sql(col(op.key))}) - 1 "
                f"AS r FROM {_sql(table(op.table))}) AS numbered ON numbered.nk = {key}")
    return _fill(
        "pack_rows",
        tile_key="CAST(0 AS BIGINT)" if single else f"numbered.r // {t0}",
        k0=k0,
        k1=k1,
        kernel=f"eds_pack_rows_{op.dtype}",
        spec=_lit(spec),
        column=column,
        list_type=f"{SQL_TYPES[op.dtype]}[]",
        order=key if single else "numbered.r",
        source=f"{_sql(table(op.table))} AS src",
        numbered="" if single else numbered,
        group_by="" if single else f"GROUP BY numbered.r // {t0}",
    )


def pack_query(op: TableOperand, tiled: TiledValue) -> exp.Expression:
    return pack_elements(op, tiled) if isinstance(op, ElementTable) else pack_rows(op, tiled)


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


def _topk_spec(result: TiledValue, k: int) -> str:
    return json.dumps({"shape": list(result.shape), "tile": list(result.tile), "dtype": result.dtype, "k": k},
                      separators=(",", ":"), sort_keys=True)


def fuse_topk(query: exp.Select, result: TiledValue, k: int) -> exp.Select | None:
    """``query`` (a plan's single query, whose last step is a binary einsum) with its kernel
    swapped for the fused top-k twin, so the result tiles never leave the kernel; None when
    the last step is another kind or the dtype is not exact in DOUBLE.

    Measured on the 1000 x 20000 (dim 128) similarity top-5: 0.21-0.27 s fused against
    0.27-0.40 s with the result tiles (80 MB) handed to a separate top-k kernel."""
    if result.dtype not in _EXACT_IN_DOUBLE or not isinstance(query, exp.Select):
        return None
    *keys, last = query.expressions
    call = last.this if isinstance(last, exp.Alias) else None
    if not isinstance(call, exp.Anonymous) or not _FUSABLE.match(call.name) or last.alias != "tile":
        return None
    key_list = exp.cast(exp.Array(expressions=[(c.this if isinstance(c, exp.Alias) else c).copy() for c in keys]),
                        "BIGINT[]")
    fused = exp.Anonymous(this=f"eds_topk_{call.name.lower()}",
                          expressions=[exp.Literal.string(_topk_spec(result, k)), key_list,
                                       *[a.copy() for a in call.expressions]])
    query = query.copy()
    query.expressions[-1].set("this", fused)
    return query


def topk_query(result: TiledValue, k: int, source: exp.Expression, fused: bool = False) -> exp.Expression:
    """The ``k`` largest elements of every row of ``result`` (the tiles ``source`` returns, or
    with ``fused`` the candidates ``fuse_topk``'s kernel returns in the tile column).

    A row is every output label but the last; the last is ranked. Each tile is cut to its
    top ``k`` per row inside the kernel (``udfs/topk.py``), so only ``k`` candidates per row
    and tile reach SQL; a window ranks them (value descending, NaN last, ties by the smaller
    index, as numpy's stable sort of the negated values) and keeps ``k``."""
    keys = list(result.keys)
    rows, last = keys[:-1], keys[-1]
    strides = [math.prod(result.shape[p + 1:len(rows)]) for p in range(len(rows))]
    row_cols = [f"(_eds_r // {s}) % {n} AS {_sql(ident(name))}, " for s, n, name in zip(strides, result.shape, rows)]
    floating = result.dtype.startswith("float")
    kernel = f"eds_topk_{result.dtype}({_lit(_topk_spec(result, k))}, {_key_list([_sql(col(c)) for c in keys])}, tile)"
    return _fill(
        "topk",
        row_cols="".join(row_cols),
        last=_sql(ident(last)),
        k=str(k),
        value=f"CAST(_eds_v AS {SQL_TYPES[result.dtype]})",
        nan_last="isnan(cand.v), " if floating else "",
        # -0.0 and 0.0 tie, as in numpy
        order_value="cand.v + 0.0" if floating else "cand.v",
        candidates="tile" if fused else kernel,
        source=_sql(source.subquery("src")),
    )


@lru_cache(maxsize=256)
def interface_query(plan: Plan, tables: tuple[tuple[str, TableOperand], ...], mode: str, k: int | None) -> str:
    """The whole answer of a SQL table function as DuckDB SQL: the plan as one query, preceded
    by the tiling of every table operand it reads (``tables``: CTE name and operand), then cut to
    elements or to the top ``k`` per row by ``mode`` (tiles, elements, topk).

    Cached: plans and operands are frozen, and sqlglot takes ~10-30 ms to parse and print each
    layer, so a query repeated over unchanged tables pays for it once."""
    result = plan.result
    # stored tensors are values named after their tables, table operands after their CTEs
    query = single_query(plan, {v.name: v.name for v in plan.inputs})
    fused = fuse_topk(query, result, k) if mode == "topk" else None
    query = fused if fused is not None else query
    by_table = {v.name: v for v in plan.inputs}
    query = with_ctes(query, [(cte, pack_query(op, by_table[cte])) for cte, op in tables])
    if mode == "elements":
        query = elements_query(result, result.keys, source=query)
    elif mode == "topk":
        query = topk_query(result, k, query, fused=fused is not None)
    return query.sql(dialect=DIALECT)
