"""Turn plan steps into SQL statements, one statement per step.

Each step fills one of the shapes in ``sql_templates/`` with fragments rendered by sqlglot
(every identifier quoted by sqlglot, never by string formatting) and is parsed back into a
sqlglot AST, so the same plan prints for any dialect. Plans name values, not tables: the SQL
reads and writes each value through a placeholder table (``slot``) that ``bind_sql`` replaces
with the table the backend binds the value to, so one compiled plan serves every run of it. Tile kernels are generic UDFs taking a
JSON description of their step as first argument: the SQL names no per-query function, and
``SELECT * FROM einsum(...)`` can run without registering anything at query time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sqlglot
from sqlglot import exp

from ..plan import EinsumStep, FillStep, Plan, RetileStep, Step, TiledValue
from ..plan.steps import step_target
from ..plan.cost import nbytes
from ..sql_templates import template

DIALECT = "duckdb"
TILE = "tile"


def ident(name: str) -> exp.Identifier:
    return exp.to_identifier(name, quoted=True)


def col(name: str, of: str | None = None) -> exp.Column:
    return exp.column(ident(name), table=ident(of) if of else None)


def table(name: str) -> exp.Table:
    return exp.Table(this=ident(name))


SLOT_PREFIX = "_eds_v_"
_SLOT = re.compile(r'"_eds_v_([A-Za-z0-9_]+)"')


def slot(value_name: str) -> str:
    """The placeholder table standing for a plan value in compiled SQL. Value names are
    identifiers and user names never start with ``_eds_`` (reserved), so the quoted
    placeholder appears nowhere in the SQL but where the value is read or written."""
    return SLOT_PREFIX + value_name


def bind_sql(text: str, tables: dict[str, str]) -> str:
    """``text`` with every value's placeholder replaced by its table (``tables``: value name ->
    table name; each is quoted by sqlglot)."""
    quoted = {name: ident(t).sql(dialect=DIALECT) for name, t in tables.items()}
    return _SLOT.sub(lambda m: quoted[m.group(1)], text)


def sql(e: exp.Expression) -> str:
    return e.sql(dialect=DIALECT)


def _join(parts: list[str], sep: str = ", ") -> str:
    return sep.join(parts)


def _key_list(cols: list[exp.Expression]) -> str:
    """A BIGINT[] literal of key expressions (typed, so an empty list binds too)."""
    return sql(exp.cast(exp.Array(expressions=cols), "BIGINT[]"))


def _fill(name: str, **holes: str) -> exp.Expression:
    return sqlglot.parse_one(template(name).format(**holes), read=DIALECT)


def _join_spec(join) -> dict:
    if join.func is not None:
        return {"callable": join.func_id}
    if join.expr is not None:
        return {"expr": join.expr}
    return {"name": join.name}


def kernel_spec(step: Step, batch: tuple[int, int] | None = None) -> str:
    """The JSON a tile kernel reads to know its step: labels, sizes, tile sizes, dtypes."""
    if isinstance(step, RetileStep):
        s, t = step.source, step.target
        body = {"op": "retile", "shape": s.shape, "from": s.tile, "to": t.tile, "dtype": s.dtype}
        if batch is not None:
            body["first_key_range"] = list(batch)
    elif isinstance(step, FillStep):
        r = step.result
        body = {"op": "fill", "shape": r.shape, "tile": r.tile, "dtype": r.dtype, "value": step.value}
    else:
        node = step.node
        body = {
            "op": "einsum",
            "in": [list(op.labels) for op in node.operands],
            "out": list(node.output),
            "labels": list(node.labels),
            "reduced": list(node.reduced),
            "size": dict(node.sizes),
            "tile": step.tile_of,
            "join": _join_spec(node.join),
            "agg": node.agg.name,
            "dtypes": [v.dtype for v in step.inputs],
            "out_dtype": step.result.dtype,
        }
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def _label_columns(step: EinsumStep) -> tuple[dict[str, exp.Column], list[exp.Expression]]:
    """The key column standing for each label, and the join conditions between occurrences."""
    first: dict[str, exp.Column] = {}
    conditions: list[exp.Expression] = []
    pieces = step.pieces
    # A label in one piece has key 0 everywhere, so its condition is redundant. Dropping it
    # turns the join into a cross product: ~1 ms faster on small tiles, but ~80 ms slower on
    # two 64 MB tiles (the cross product copies its right side; a hash join's build is cheaper).
    small = max((nbytes(v.tile, v.dtype) for v in step.inputs), default=0) <= SMALL_TILE_BYTES
    single = _single_tiles(step)
    for k, (op, value) in enumerate(zip(step.node.operands, step.inputs)):
        kept = [key for ax, key in enumerate(value.keys) if ax not in op.dropped]
        for lab, key in zip(op.labels, kept):
            c = col(key, f"t{k}")
            if lab in first:
                if pieces[lab] > 1 or not (small or single):
                    conditions.append(exp.EQ(this=first[lab].copy(), expression=c))
            else:
                first[lab] = c
    return first, conditions


SMALL_TILE_BYTES = 1 << 20


def _single_tiles(step: EinsumStep) -> bool:
    return all(np.prod(v.grid, dtype=np.int64) == 1 for v in step.inputs)


def _sources(step: EinsumStep) -> str:
    tables = [sql(exp.Table(this=ident(slot(v.name)), alias=exp.TableAlias(this=ident(f"t{k}"))))
              for k, v in enumerate(step.inputs)]
    # One row each: pair them by position. Measured on two 64 MB tiles (4096² GEMM), the step
    # took 1.02 s this way against 1.19 s with a hash join and 1.15 s with a cross product,
    # which both copy a whole side into a hash table / collection first.
    return " POSITIONAL JOIN ".join(tables) if _single_tiles(step) else _join(tables)


def _where(conditions: list[exp.Expression]) -> str:
    if not conditions:
        return ""
    return "WHERE " + sql(exp.and_(*conditions))


def _key_range(column: exp.Expression, bounds: tuple[int, int]) -> list[exp.Expression]:
    lo, hi = bounds
    return [exp.GTE(this=column.copy(), expression=exp.Literal.number(lo)),
            exp.LT(this=column.copy(), expression=exp.Literal.number(hi))]


def _compile_einsum(step: EinsumStep, batch: tuple[int, int] | None = None) -> exp.Expression:
    node = step.node
    first, conditions = _label_columns(step)
    if batch is not None:  # one statement of a batched step: a range of the batch label's keys
        conditions += _key_range(first[step.batch_label], batch)
    arity = len(node.operands)
    spec = sql(exp.Literal.string(kernel_spec(step)))
    keys = step.result.keys
    comma = ", " if keys else ""
    tiles = [col(TILE, f"t{k}") for k in range(arity)]
    if not step.grouped:
        out_keys = _join([sql(exp.alias_(first[lab].copy(), ident(key))) for lab, key in zip(node.output, keys)])
        return _fill(
            "einsum_rows",
            out_keys=out_keys,
            comma=comma,
            kernel=f"eds_einsum{arity}",
            spec=spec,
            key_list=_key_list([first[lab].copy() for lab in node.labels]),
            tiles=_join([sql(t) for t in tiles]),
            sources=_sources(step),
            where=_where(conditions),
        )
    # grouped: name every joined column after its role, group by the output keys
    joined = [exp.alias_(first[lab].copy(), ident(key)) for lab, key in zip(node.output, keys)]
    joined += [exp.alias_(first[lab].copy(), ident(f"r{q}")) for q, lab in enumerate(node.reduced)]
    joined += [exp.alias_(t, ident(f"t{k}")) for k, t in enumerate(tiles)]
    member = exp.Struct(
        expressions=[exp.PropertyEQ(this=ident("k"), expression=exp.Array(
            expressions=[col(f"r{q}") for q in range(len(node.reduced))]))]
        + [exp.PropertyEQ(this=ident(f"t{k}"), expression=col(f"t{k}")) for k in range(arity)]
    )
    group_by = "GROUP BY " + _join([sql(col(key)) for key in keys]) if keys else ""
    return _fill(
        "einsum_groups",
        out_keys=_join([sql(col(key)) for key in keys]),
        comma=comma,
        kernel=f"eds_einsum_group{arity}",
        spec=spec,
        group_key_list=_key_list([col(key) for key in keys]),
        member=sql(member),
        joined_columns=_join([sql(c) for c in joined]),
        sources=_sources(step),
        where=_where(conditions),
        group_by=group_by,
    )


def _compile_retile(step: RetileStep, batch: tuple[int, int] | None = None) -> exp.Expression:
    s, t = step.source, step.target
    spec = sql(exp.Literal.string(kernel_spec(step, batch)))
    old = [col(k) for k in s.keys]
    new_names = [f"n{p}" for p in range(len(s.keys))]
    cut_n = exp.Dot(this=col("cut"), expression=ident("n"))
    # sqlglot counts list positions from 0 and prints DuckDB's 1-based index itself
    items = [exp.alias_(exp.Bracket(this=cut_n.copy(), expressions=[exp.Literal.number(p)]), ident(n))
             for p, n in enumerate(new_names)]
    source_where = ""
    if batch is not None:  # only source tiles that overlap the batch's target rows
        lo, hi = batch
        a, b = s.tile[0], t.tile[0]
        source_where = "WHERE " + sql(exp.and_(
            exp.LT(this=exp.Mul(this=old[0].copy(), expression=exp.Literal.number(a)),
                   expression=exp.Literal.number(hi * b)),
            exp.GT(this=exp.Mul(this=exp.Paren(this=exp.Add(this=old[0].copy(), expression=exp.Literal.number(1))),
                                expression=exp.Literal.number(a)),
                   expression=exp.Literal.number(lo * b)),
        ))
    piece = exp.Struct(expressions=[
        exp.PropertyEQ(this=ident("k"), expression=col("old_k")),
        exp.PropertyEQ(this=ident("t"), expression=col("piece")),
    ])
    new_cols = [col(n) for n in new_names]
    select = _fill(
        "retile",
        new_keys=_join([sql(c) for c in new_cols]),
        spec=spec,
        new_key_list=_key_list([c.copy() for c in new_cols]),
        piece_struct=sql(piece),
        new_key_items=_join([sql(i) for i in items]),
        old_key_list=_key_list([c.copy() for c in old]),
        source=sql(table(slot(s.name))),
        source_where=source_where,
    )
    # rename n0.. back to the tensor's key names
    outer = exp.select(*[exp.alias_(col(n), ident(k)) for n, k in zip(new_names, t.keys)], col(TILE))
    return outer.from_(select.subquery("retiled"))


def _compile_fill(step: FillStep, batch: tuple[int, int] | None = None) -> exp.Expression:
    r = step.result
    # each range's column is qualified by its alias: key names that differ only in case
    # (labels i and I) are one name to DuckDB
    keys = [col(k, f"g{p}") for p, k in enumerate(r.keys)]
    bounds = [(0, n) for n in r.grid]
    if batch is not None:
        bounds[0] = batch
    ranges = [f"range({lo}, {hi}) AS {sql(ident(f'g{p}'))}({sql(ident(k))})"
              for p, ((lo, hi), k) in enumerate(zip(bounds, r.keys))]
    return _fill(
        "fill",
        keys=_join([sql(exp.alias_(k.copy(), ident(name))) for k, name in zip(keys, r.keys)]),
        comma=", " if keys else "",
        spec=sql(exp.Literal.string(kernel_spec(step))),
        key_list=_key_list([k.copy() for k in keys]),
        ranges="FROM " + _join(ranges) if ranges else "",
    )


def compile_step(step: Step, batch: tuple[int, int] | None = None) -> exp.Expression:
    """The SELECT computing one step's tiled result (or one batch of it)."""
    if isinstance(step, RetileStep):
        return _compile_retile(step, batch)
    if isinstance(step, FillStep):
        return _compile_fill(step, batch)
    return _compile_einsum(step, batch)


def batch_bounds(step: Step) -> list[tuple[int, int]] | None:
    """Key ranges of a batched step's statements (None: one statement)."""
    if step.batches <= 1:
        return None
    if isinstance(step, RetileStep):
        n = step.target.grid[0]
    elif isinstance(step, FillStep):
        n = step.result.grid[0]
    else:
        n = step.pieces[step.batch_label]
    b = step.batches
    return [(n * k // b, n * (k + 1) // b) for k in range(b)]


@dataclass(frozen=True)
class CompiledStep:
    """A step as SQL over placeholder tables (``slot``; ``bind_sql`` puts the tables in).

    ``value`` is the name of the value the step computes; ``select`` the whole step as one
    SELECT, ``batches`` the SELECTs to run (the text, or one per batch of a batched step);
    ``create[temporary, replace]`` CREATE TABLE AS the first batch, and ``inserts`` INSERT INTO
    the table for the others.
    """

    value: str
    select: exp.Expression
    text: str  # the select in DuckDB's dialect, rendered once
    batches: tuple[str, ...]
    create: dict[tuple[bool, bool], str]
    inserts: tuple[str, ...]

    def sql(self, dialect: str = DIALECT) -> str:
        return self.text if dialect == DIALECT else self.select.sql(dialect=dialect)


@lru_cache(maxsize=1024)
def compile_plan(plan: Plan) -> tuple[CompiledStep, ...]:
    """Every step as SQL (cached: plans are frozen, and sqlglot costs ~10 ms a statement)."""
    out = []
    kept = {v.name for v in plan.outputs}
    for step in plan.steps:
        target = step_target(step)
        select = compile_step(step)
        text = select.sql(dialect=DIALECT)
        bounds = batch_bounds(step)
        parts = [select] if bounds is None else [compile_step(step, b) for b in bounds]
        batches = (text,) if bounds is None else tuple(p.sql(dialect=DIALECT) for p in parts)
        # scratch values are TEMP tables; an output may be either (the backend's binding says)
        kinds = [(temp, rep) for temp in ((False, True) if target.name in kept else (True,)) for rep in (False, True)]
        create = {(temp, rep): create_table_as(slot(target.name), parts[0], temporary=temp,
                                               replace=temp or rep).sql(dialect=DIALECT)
                  for temp, rep in kinds}
        inserts = tuple(exp.insert(p, table(slot(target.name))).sql(dialect=DIALECT) for p in parts[1:])
        out.append(CompiledStep(target.name, select, text, batches, create, inserts))
    return tuple(out)


def _bind_tree(e: exp.Expression, tables: dict[str, str]) -> exp.Expression:
    """``e`` (a copy) with the placeholder tables of ``tables``' values replaced."""
    e = e.copy()
    for t in e.find_all(exp.Table):
        m = _SLOT.fullmatch(ident(t.name).sql(dialect=DIALECT))
        if m and m.group(1) in tables:
            t.set("this", ident(tables[m.group(1)]))
    return e


def single_query(plan: Plan, tables: dict[str, str]) -> exp.Expression:
    """The whole plan as one query (for SQL table functions), reading its inputs from
    ``tables`` (value name -> table): each step but the last is a MATERIALIZED CTE named after
    its value's placeholder, the last step is the body."""
    compiled = compile_plan(plan)
    body = _bind_tree(compiled[-1].select, tables)
    ctes = [
        exp.CTE(this=_bind_tree(c.select, tables), alias=exp.TableAlias(this=ident(slot(c.value))), materialized=True)
        for c in compiled[:-1]
    ]
    if ctes:
        body.set("with_", exp.With(expressions=ctes)) if "with_" in body.arg_types else body.set(
            "with", exp.With(expressions=ctes))
    return body


def sql_listing(plan: Plan, tables: dict[str, str] | None = None) -> str:
    """Every step's SQL, pretty-printed, with the value it computes; values read from
    ``tables`` (value name -> table; by default each value's own name)."""
    names = {v.name: v.name for v in plan.inputs} | {step_target(s).name: step_target(s).name for s in plan.steps}
    names.update(tables or {})
    lines = []
    for k, c in enumerate(compile_plan(plan)):
        lines.append(f"-- step {k} -> {names[c.value]}")
        lines.append(bind_sql(c.select.sql(dialect=DIALECT, pretty=True), names) + ";")
    return "\n".join(lines)


def select_value(value: TiledValue, table_name: str) -> exp.Expression:
    return exp.select(*[col(k) for k in value.keys], col(TILE)).from_(table(table_name))


# the UDF decoding a tile of each dtype into its typed elements (notation/checks.py SQL_TYPES)
_VALUES_FN = {dt: f"eds_values_{dt}" for dt in (
    "float32", "float64", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")}


def elements_query(value: TiledValue, labels: tuple[str, ...], source: exp.Expression | None = None) -> exp.Expression:
    """One row per element of ``value``: a column per label, then ``value``.

    Complex tensors have none: DuckDB has no complex type, so they are an ``EinsumError``
    (read them with ``einsum()``'s tiles or ``Tensor.to_numpy()``)."""
    if value.dtype not in _VALUES_FN:
        from ..errors import EinsumError

        raise EinsumError(f"einsum_elements: the result is {value.dtype}, which has no DuckDB type (DuckDB has "
                          "no complex numbers); use einsum() for its tiles or Tensor.to_numpy() in Python")
    src = source.subquery("src") if source is not None else table(value.name)
    keys = [col(k) for k in value.keys]
    exts = [f"least({t}, {n} - {sql(k)} * {t})" for k, n, t in zip(keys, value.shape, value.tile)]
    elements = []
    for p, (k, lab, t) in enumerate(zip(keys, labels, value.tile)):
        stride = " * ".join(exts[p + 1:]) or "1"
        coord = f"{sql(k)} * {t} + (off // ({stride})) % {exts[p]}"
        elements.append(f"{coord} AS {sql(ident(lab))}")
    return _fill(
        "elements",
        element_keys="".join(e + ", " for e in elements),
        keys=_join([sql(k) for k in keys]),
        comma=", " if keys else "",
        values_fn=_VALUES_FN[value.dtype],
        source=sql(src),
    )


def create_table_as(name: str, select: exp.Expression, temporary: bool = False, replace: bool = False) -> exp.Expression:
    """``CREATE [OR REPLACE] [TEMP] TABLE "table" AS select``."""
    props = exp.Properties(expressions=[exp.TemporaryProperty()]) if temporary else None
    return exp.Create(this=table(name), kind="TABLE", expression=select, replace=replace,
                      properties=props)


def drop_table(name: str) -> exp.Expression:
    return exp.Drop(tables=[table(name)], kind="TABLE", exists=True)
