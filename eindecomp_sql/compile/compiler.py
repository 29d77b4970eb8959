"""The compiler: plan steps -> sqlglot expressions -> SQL text, one statement per step.

``SQLCompiler`` builds every statement with sqlglot's expression builders (no SQL text is
formatted or parsed on the way), and keeps the dialect and the tactics as class attributes,
after ibis's ``DuckDBCompiler``: a backend holds a compiler instance, and a compiler that
differs in one choice is a subclass that sets one attribute (``compile/duckdb.py`` holds
DuckDB's choices, with the measurements behind them). Pure: sqlglot only, no connection.

Plans name values, not tables: the SQL reads and writes each value through a placeholder table
(``slot``) that ``bind_sql`` replaces with the table the backend binds the value to, so one
compiled plan serves every run of it. Tile kernels are generic UDFs taking a JSON description
of their step as first argument (``kernel_spec``): the SQL names no per-query function.

A compiler with another tactic, run next to the default one:

>>> from eindecomp_sql.compile.duckdb import DuckDBCompiler
>>> from eindecomp_sql.plan import TiledValue, plan_einsum
>>> class KeyJoinCompiler(DuckDBCompiler):
...     positional_join_single_tiles = False  # single tiles are joined like any others
>>> a = TiledValue("A", (4, 3), "float32", (4, 3), ("d0", "d1"))
>>> b = TiledValue("B", (3, 5), "float32", (3, 5), ("d0", "d1"))
>>> plan = plan_einsum("ij,jk->ik", (a, b))
>>> "POSITIONAL JOIN" in DuckDBCompiler().compile_plan(plan)[-1].text
True
>>> KeyJoinCompiler().sql_listing(plan).splitlines()[-1]
'FROM "A" AS "t0", "B" AS "t1";'

Compiled plans are cached per plan and per compiler class, so tactics are class attributes:
an instance refuses new attributes (set them in a subclass).
"""

from __future__ import annotations

import itertools
import json

import re
from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np
from sqlglot import exp

from ..plan import EinsumStep, FillStep, Plan, ProgramStep, RetileStep, Step, TiledValue
from ..plan.cost import nbytes
from ..plan.kernel_spec import host_reason, kernel_spec, operands_read, shared_operands, step_device
from ..plan.steps import step_target

TILE = "tile"
SLOT_PREFIX = "_eds_v_"


def ident(name: str) -> exp.Identifier:
    """``name`` as a quoted identifier (every user-facing name goes through here)."""
    return exp.to_identifier(name, quoted=True)


def col(name: str, of: str | None = None) -> exp.Column:
    """The quoted column ``name`` (of the quoted table ``of``)."""
    return exp.column(ident(name), table=ident(of) if of else None)


def table(name: str) -> exp.Table:
    return exp.Table(this=ident(name))


def slot(value_name: str) -> str:
    """The placeholder table standing for a plan value in compiled SQL. Value names are
    identifiers and user names never start with ``_eds_`` (reserved), so the quoted
    placeholder appears nowhere in the SQL but where the value is read or written."""
    return SLOT_PREFIX + value_name


# --- small builders (the statements' own names are unquoted: they are ours, never a user's)

def name(text: str) -> exp.Identifier:
    """An unquoted identifier: the compiler's own column and alias names (``tile``, ``cut``)."""
    return exp.Identifier(this=text, quoted=False)


def ucol(column: str, of: str | None = None) -> exp.Column:
    """The compiler's own (unquoted) column ``column``, of the unquoted table ``of``."""
    return exp.Column(this=name(column), table=name(of) if of else None)


def num(n) -> exp.Literal:
    return exp.Literal.number(n)


def alias(e: exp.Expression, to: exp.Identifier) -> exp.Alias:
    return exp.Alias(this=e, alias=to)


def call(function: str, *args: exp.Expression) -> exp.Anonymous:
    """A call of the UDF (or DuckDB function sqlglot has no class for) ``function``."""
    return exp.Anonymous(this=function, expressions=list(args))


def subquery(select: exp.Expression, as_: str) -> exp.Subquery:
    """``(select) AS as_`` with the alias unquoted."""
    return exp.Subquery(this=select, alias=exp.TableAlias(this=name(as_)))


def sql_type(text: str) -> exp.DataType:
    """A DuckDB type (``BIGINT[]``, ``STRUCT(o BIGINT, v DOUBLE)[]``) as a sqlglot type."""
    return _sql_type(text).copy()


@cache
def _sql_type(text: str) -> exp.DataType:
    return exp.DataType.build(text, dialect="duckdb")


def cast(e: exp.Expression, to: str) -> exp.Cast:
    return exp.Cast(this=e, to=sql_type(to))


def key_list(cols: list[exp.Expression]) -> exp.Cast:
    """A BIGINT[] of key expressions (typed, so an empty list binds too)."""
    return cast(exp.Array(expressions=cols), "BIGINT[]")


def ordered(e: exp.Expression, desc: bool = False) -> exp.Ordered:
    # An explicit ASC (desc False, not None): DuckDB's ``SET default_order = 'DESC'`` turns a
    # bare ORDER BY around, and the SQL interface's array tables came back reversed (wrong
    # values, no error) and top-k broke ties the other way (a new user's report).
    # nulls_first=False as DuckDB's parser sets it: NULLs sort last, and another dialect
    # that sorts them first gets an explicit NULLS LAST
    return exp.Ordered(this=e, desc=bool(desc), nulls_first=False)


def generate_range(lo: int, hi: int) -> exp.GenerateSeries:
    """DuckDB's ``range(lo, hi)`` (end exclusive)."""
    return exp.GenerateSeries(start=num(lo), end=num(hi), is_end_exclusive=True)


def range_table(lo: int, hi: int, as_: str, column: str) -> exp.Table:
    """``range(lo, hi) AS "as_"("column")``: a one-column table of the keys lo..hi-1."""
    return exp.Table(this=generate_range(lo, hi),
                     alias=exp.TableAlias(this=ident(as_), columns=[ident(column)]))


def struct(**fields: exp.Expression) -> exp.Struct:
    """DuckDB's struct literal ``{'field': value, ...}``."""
    return exp.Struct(expressions=[exp.PropertyEQ(this=name(k), expression=v) for k, v in fields.items()])


def _where(conditions: list[exp.Expression]) -> exp.Where | None:
    return exp.Where(this=exp.and_(*conditions)) if conditions else None


def _key_range(column: exp.Expression, bounds: tuple[int, int]) -> list[exp.Expression]:
    lo, hi = bounds
    return [exp.GTE(this=column.copy(), expression=num(lo)), exp.LT(this=column.copy(), expression=num(hi))]


def batch_bounds(step: Step) -> list | None:
    """Key ranges of a batched step's statements (None: one statement): ``(lo, hi)`` of the
    target key (``batch_axis``) for a retile, of the first for a fill, ``((label, lo, hi), ...)`` for an einsum step (one
    range per label of its ``batch_grid``, every combination)."""
    if step.batches <= 1:
        return None
    if isinstance(step, (RetileStep, FillStep)):
        n = step.target.grid[step.batch_axis] if isinstance(step, RetileStep) else step.result.grid[0]
        b = step.batches
        return [(n * k // b, n * (k + 1) // b) for k in range(b)]
    pieces = step.pieces
    per_label = [[(lab, pieces[lab] * k // b, pieces[lab] * (k + 1) // b) for k in range(b)]
                 for lab, b in step.batch_grid]
    return [tuple(combo) for combo in itertools.product(*per_label)]


def _single_tiles(step: EinsumStep) -> bool:
    return all(np.prod(v.grid, dtype=np.int64) == 1 for v in step.inputs)


@dataclass(frozen=True)
class CompiledStep:
    """A step as SQL over placeholder tables (``slot``; ``bind_sql`` puts the tables in).

    ``value`` is the name of the value the step computes; ``select`` the whole step as one
    SELECT, ``batches`` the SELECTs to run (the text, or one per batch of a batched step);
    ``create[temporary, replace]`` CREATE TABLE AS the first batch, and ``inserts`` INSERT INTO
    the table for the others. All text is in ``dialect``, the compiler's.
    """

    value: str
    select: exp.Expression
    text: str  # the select in the compiler's dialect, rendered once
    batches: tuple[str, ...]
    create: dict[tuple[bool, bool], str]
    inserts: tuple[str, ...]
    dialect: str | None = "duckdb"

    def sql(self, dialect: str | None = None) -> str:
        """The select in ``dialect`` (by default the compiler's, rendered once)."""
        return self.text if dialect is None or dialect == self.dialect else self.select.sql(dialect=dialect)


@cache
def on_device(compiler: type, device: str, allow_tf32: bool = False, min_work: int = 0) -> type:
    """``compiler`` (a compiler class) with its kernels on ``device`` (steps of fewer than
    ``min_work`` element operations on the host): a class of its own, as compiled plans are
    cached per compiler class."""
    if (device, allow_tf32, min_work) == (compiler.device, compiler.allow_tf32, compiler.device_min_work):
        return compiler
    return type(f"{compiler.__name__}_{device}{'_tf32' if allow_tf32 else ''}{f'_{min_work}' if min_work else ''}",
                (compiler,), {"device": device, "allow_tf32": allow_tf32, "device_min_work": min_work,
                              "__module__": compiler.__module__})


def unnamed_specs(e: exp.Expression) -> exp.Expression:
    """``e`` (a copy) with the value names (``values``, ``result``) taken out of its kernel specs:
    for SQL shown to a user (EXPLAIN), who may run it. Run beside a plan of the session, a spec
    naming that plan's values would find its arrays and results (udfs/register.py:
    ``_host_tile``, ``_host_out``): its kernels would write into the plan's result. Without the
    names its tiles are computed and returned as bytes, as any statement's."""
    e = e.copy()
    for lit in e.find_all(exp.Literal):
        text = lit.this
        if lit.is_string and text.startswith("{") and '"op":' in text:
            body = json.loads(text)
            named = [body.pop(key, None) for key in ("values", "result")]
            if any(n is not None for n in named):
                lit.set("this", json.dumps(body, separators=(",", ":"), sort_keys=True))
    return e


@cache  # one class per compiler: compiled plans are cached per compiler class
def for_sql_interface(compiler: type, own: bool = False) -> type:
    """``compiler`` for the SQL interface's queries (``SELECT * FROM einsum(...)``), which the
    backend does not run as a plan of its own:
      - every tile read from its table: no plan run names the tiles a device holds
        (``eds_resident`` would answer by another run's names);
      - unless ``own`` (``db.topk`` runs such a query as its own call), kernel specs that say
        the call is a user's query. The session's interrupt and progress count leave those
        kernels alone: they shared its cancel flag, and ``db.interrupt()`` failed SQL functions
        running on a cursor beside the call it stopped (a soak trial: 27 of 104 queries)."""
    attrs = {}
    if compiler.device_residency:
        attrs["device_residency"] = False
    if compiler.user_queries == own:
        attrs["user_queries"] = not own
    if not attrs:
        return compiler
    return type(f"{compiler.__name__}_{'own' if own else 'sql'}", (compiler,), {**attrs, "__module__": compiler.__module__})


@lru_cache(maxsize=1024)
def _compiled(compiler: SQLCompiler, plan: Plan) -> tuple[CompiledStep, ...]:
    # compilers are equal when their classes are (tactics are class attributes)
    return compiler.compile_plan_uncached(plan)


class SQLCompiler:
    """Plan steps as SQL. Class attributes are the dialect and the tactics; the methods build
    sqlglot expressions. This base makes no choice one engine's measurements made: the dialect
    is sqlglot's generic one, every join condition is kept, operands are joined by key.
    ``compile/duckdb.py``'s ``DuckDBCompiler`` is the one the backend runs."""

    # the dialect every statement is printed in (None: sqlglot's generic dialect)
    dialect: str | None = None
    # where the tile kernels run ("cpu", or "cuda": udfs/devices.py), and whether float32
    # products there may use TF32; a session on a device compiles with ``on_device(cls, ...)``
    device: str = "cpu"
    allow_tf32: bool = False
    device_min_work: int = 0  # steps of fewer element operations stay on the host (device="auto")
    # inputs read through eds_resident (tiles the device holds come as NULL); off for queries the
    # backend does not run itself (the SQL interface's), whose tiles it cannot name
    device_residency: bool = True
    # its kernel specs say the call is a query the user runs, not a plan run of the backend's
    # (``for_sql_interface``): the session's interrupt and progress leave those kernels alone
    user_queries: bool = False
    # a step whose operands are one tile each pairs them by position (POSITIONAL JOIN) rather
    # than by key; needs an engine that has positional joins
    positional_join_single_tiles: bool = False
    # a label in one piece has key 0 everywhere, so its join condition is redundant: drop it
    # when every input tile is at most this many bytes (0: keep every condition)
    small_tile_bytes: int = 0
    # the aggregate collecting a group's rows into a list (DuckDB's list(); sqlglot prints it
    # as ARRAY_AGG)
    list_aggregate: type[exp.AggFunc] = exp.ArrayAgg
    # the tile UDFs the SQL calls (udfs/register.py registers them under these names)
    einsum_udf: str = "eds_einsum{arity}"  # one joined row -> one output tile
    einsum_group_udf: str = "eds_einsum_group{arity}"  # a group of joined rows -> one tile
    split_udf: str = "eds_split"  # a source tile -> its pieces, keyed by target tile
    assemble_udf: str = "eds_assemble"  # pieces -> one target tile
    fill_udf: str = "eds_fill"  # a tile key -> a tile full of one value
    resident_udf: str = "eds_resident"  # (value, keys) -> whether the device holds that tile (pins it)
    send_udf: str = "eds_send"  # (spec, keys, tile) -> sent ahead of the step: kept or staged there
    program_udf: str = "eds_program"  # one tile per input, as a list -> the program's result tile
    program_args_udf: str = "eds_program{arity}"  # the same, one tile argument per input
    max_program_args: int = 16  # more inputs go as a list (DuckDB copies a list's tiles: +1 copy)
    values_udf: str = "eds_values_{dtype}"  # a tile -> the typed list of its elements
    # the SQL interface's UDFs (compile/sql_interface.py)
    pack_udf: str = "eds_pack_{dtype}"  # element rows -> one tile
    pack_rows_udf: str = "eds_pack_rows_{dtype}"  # fixed-size arrays -> one tile of rows
    topk_udf: str = "eds_topk_{dtype}"  # a result tile -> its top-k candidates per row
    topk_fused_udf: str = "eds_topk_{kernel}"  # an einsum kernel fused with the top-k cut
    # dtypes with element rows (each has a values_udf; DuckDB has no complex type; float16's
    # and bfloat16's values are FLOAT)
    element_dtypes: frozenset[str] = frozenset({
        "float16", "bfloat16", "float32", "float64", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
        "uint32", "uint64"})

    # --- identity: compiled plans are cached per plan and per compiler class

    def __eq__(self, other) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __setattr__(self, key, value):
        raise AttributeError(f"{type(self).__name__}: tactics are class attributes (compiled plans are cached "
                             f"per compiler class); set {key!r} in a subclass")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @staticmethod
    def cache_info():
        """The compiled-plan cache's statistics (shared by every compiler class)."""
        return _compiled.cache_info()

    # --- whole plans

    def compile_plan(self, plan: Plan) -> tuple[CompiledStep, ...]:
        """Every step as SQL (cached per plan and compiler class: plans are frozen, and
        printing costs ~1 ms a statement)."""
        return _compiled(self, plan)

    def compile_plan_uncached(self, plan: Plan) -> tuple[CompiledStep, ...]:
        out = []
        kept = {v.name for v in plan.outputs}
        for step in plan.steps:
            target = step_target(step)
            select = self.compile_step(step)
            text = self.sql(select)
            bounds = batch_bounds(step)
            parts = [select] if bounds is None else [self.compile_step(step, b) for b in bounds]
            batches = (text,) if bounds is None else tuple(self.sql(p) for p in parts)
            # scratch values are TEMP tables; an output may be either (the backend's binding says)
            kinds = [(temp, rep) for temp in ((False, True) if target.name in kept else (True,)) for rep in (False, True)]
            create = {(temp, rep): self.sql(self.create_table_as(slot(target.name), parts[0], temporary=temp,
                                                                  replace=temp or rep))
                      for temp, rep in kinds}
            inserts = tuple(self.sql(exp.insert(p, table(slot(target.name)))) for p in parts[1:])
            out.append(CompiledStep(target.name, select, text, batches, create, inserts, self.dialect))
        return tuple(out)

    def single_query(self, plan: Plan, tables: dict[str, str]) -> exp.Expression:
        """The whole plan as one query (for SQL table functions), reading its inputs from
        ``tables`` (value name -> table): each step but the last is a MATERIALIZED CTE named
        after its value's placeholder, the last step is the body."""
        compiled = self.compile_plan(plan)
        body = self._bind_tree(compiled[-1].select, tables)
        ctes = [exp.CTE(this=self._bind_tree(c.select, tables), alias=exp.TableAlias(this=ident(slot(c.value))),
                        materialized=True)
                for c in compiled[:-1]]
        if ctes:
            body.set("with_" if "with_" in body.arg_types else "with", exp.With(expressions=ctes))
        return body

    def sql_listing(self, plan: Plan, tables: dict[str, str] | None = None) -> str:
        """Every step's SQL, pretty-printed, with the value it computes; values read from
        ``tables`` (value name -> table; by default each value's own name)."""
        names = {v.name: v.name for v in plan.inputs} | {step_target(s).name: step_target(s).name for s in plan.steps}
        names.update(tables or {})
        lines = []
        for k, c in enumerate(self.compile_plan(plan)):
            lines.append(f"-- step {k} -> {names[c.value]}")
            lines.append(self.bind_sql(unnamed_specs(c.select).sql(dialect=self.dialect, pretty=True), names) + ";")
        return "\n".join(lines)

    # --- text

    def sql(self, e: exp.Expression) -> str:
        return e.sql(dialect=self.dialect)

    def quote(self, table_name: str) -> str:
        """A table name as a quoted identifier in the compiler's dialect (cached: rendering
        one costs sqlglot ~0.05 ms, several times on every run of a plan)."""
        return _quoted(table_name, self.dialect)

    def bind_sql(self, text: str, tables: dict[str, str]) -> str:
        """``text`` with every value's placeholder replaced by its table (``tables``: value
        name -> table name; each quoted by sqlglot)."""
        quoted = {k: self.quote(t) for k, t in tables.items()}
        return self._slot_pattern().sub(lambda m: quoted[m.group(1)], text)

    @classmethod
    def _slot_pattern(cls) -> re.Pattern:
        return _slot_pattern(cls.dialect)

    def _bind_tree(self, e: exp.Expression, tables: dict[str, str]) -> exp.Expression:
        """``e`` (a copy) with the placeholder tables of ``tables``' values replaced."""
        e = e.copy()
        for t in e.find_all(exp.Table):
            if isinstance(t.this, exp.Identifier) and t.name.startswith(SLOT_PREFIX):
                value = t.name[len(SLOT_PREFIX):]
                if value in tables:
                    t.set("this", ident(tables[value]))
        return e

    # --- steps

    def kernel_spec(self, step: Step, batch: tuple[int, int] | None = None) -> str:
        """The JSON a tile kernel reads to know its step (``plan/kernel_spec.py``), naming the
        device it runs on: the compiler's ``device``, or the host for a step a device cannot
        run (``step_device``)."""
        return kernel_spec(step, batch, device=step_device(step, self.device, self.device_min_work),
                           tf32=self.allow_tf32, names=self.device_residency, user_query=self.user_queries)

    def spec_literal(self, step: Step, batch: tuple[int, int] | None = None) -> exp.Literal:
        return exp.Literal.string(self.kernel_spec(step, batch))

    def compile_step(self, step: Step, batch: tuple[int, int] | None = None) -> exp.Expression:
        """The SELECT computing one step's tiled result (or one batch of it)."""
        if isinstance(step, RetileStep):
            return self.retile(step, batch)
        if isinstance(step, FillStep):
            return self.fill(step, batch)
        if isinstance(step, ProgramStep):
            return self.program(step)
        if step.grouped:
            return self.einsum_groups(step, batch)
        return self.einsum_rows(step, batch)

    def drops_condition(self, step: EinsumStep) -> bool:
        """Whether the join conditions of labels in one piece (key 0 everywhere) are left out."""
        small = max((nbytes(v.tile, v.dtype) for v in step.inputs), default=0) <= self.small_tile_bytes
        return small or self.pairs_by_position(step)

    def pairs_by_position(self, step: EinsumStep) -> bool:
        """Whether the operands, one row each, are paired by position (no join condition)."""
        return self.positional_join_single_tiles and _single_tiles(step)

    @staticmethod
    def read_operands(step: EinsumStep) -> list[int]:
        """The operands whose tables an einsum step reads, as ``t<k>``: an operand repeating
        one of them (``kernel_spec.operand_args``: the same value under the same labels) is
        neither read nor joined again, and its tile reaches the kernel once."""
        return operands_read(step.node.operands)

    def label_columns(self, step: EinsumStep) -> tuple[dict[str, exp.Column], list[exp.Expression]]:
        """The key column standing for each label, and the join conditions between occurrences."""
        first: dict[str, exp.Column] = {}
        conditions: list[exp.Expression] = []
        pieces = step.pieces
        drop = self.drops_condition(step)
        for k in self.read_operands(step):
            op, value = step.node.operands[k], step.inputs[k]
            kept = [key for ax, key in enumerate(value.keys) if ax not in op.dropped]
            for lab, key in zip(op.labels, kept):
                c = col(key, f"t{k}")
                if lab in first:
                    if pieces[lab] > 1 or not drop:
                        conditions.append(exp.EQ(this=first[lab].copy(), expression=c))
                else:
                    first[lab] = c
        return first, conditions

    def join_sources(self, step: EinsumStep, select: exp.Select) -> exp.Select:
        """``select`` reading the step's inputs ``t0, t1, ...``: pairwise by position when the
        tactic says so, else a cross product the WHERE clause turns into a join."""
        return self._read_inputs(step.inputs, select, self.pairs_by_position(step), step)

    def _read_inputs(self, inputs, select: exp.Select, positional: bool, step: Step | None = None) -> exp.Select:
        read = self.read_operands(step) if isinstance(step, EinsumStep) else range(len(inputs))
        tables = [self.input_source(step, k, inputs[k]) for k in read]
        method = "POSITIONAL" if positional else None
        select = select.from_(tables[0], copy=False)
        if len(tables) > 1:
            select.set("joins", [exp.Join(this=t, method=method) if method else exp.Join(this=t) for t in tables[1:]])
        return select

    def _einsum_conditions(self, step: EinsumStep, batch):
        first, conditions = self.label_columns(step)
        for lab, lo, hi in batch or ():  # one statement of a batched step: a range of keys per batch label
            conditions += _key_range(first[lab], (lo, hi))
        return first, conditions

    def einsum_rows(self, step: EinsumStep, batch: tuple | None = None) -> exp.Select:
        """One einsum step whose reduced labels are all in one piece: join the operands' tiled
        tables on the keys of their shared labels; each joined row is exactly one output tile,
        so the tile kernel runs once per row and nothing is grouped::

            SELECT <t.key AS out_key>..., eds_einsum<n>(spec, [key per label], t0.tile, ...) AS tile
            FROM <inputs> WHERE <shared labels' keys equal>
        """
        node = step.node
        first, conditions = self._einsum_conditions(step, batch)
        tiles = [col(TILE, f"t{k}") for k in self.read_operands(step)]
        kernel = call(self.einsum_udf.format(arity=len(tiles)), self.spec_literal(step),
                      key_list([first[lab].copy() for lab in node.labels]), *tiles)
        # a partial result (plan/partials.py) also keys each tile by its kept labels' pieces
        select = exp.Select(expressions=[alias(first[lab].copy(), ident(key))
                                         for lab, key in zip(node.keys, step.result.keys)]
                            + [alias(kernel, name(TILE))])
        select = self.join_sources(step, select)
        select.set("where", _where(conditions))
        return select

    def einsum_groups(self, step: EinsumStep, batch: tuple | None = None) -> exp.Select:
        """One einsum step with a reduced label cut into several pieces: join the tiled tables,
        then group the joined rows by the output keys and hand each whole group to the kernel,
        which contracts and aggregates it in one call. Grouping the inputs (not partial results)
        means partial products never travel back through the engine. One list of structs keeps
        each row's tiles together with the keys of its reduced labels::

            SELECT <out keys>, eds_einsum_group<n>(spec, [out keys], list({k: [r0, ...], t0: t0, ...})) AS tile
            FROM (SELECT <out keys>, <reduced keys r0...>, <tiles t0...> FROM <inputs> WHERE ...) AS joined
            GROUP BY <out keys>
        """
        node = step.node
        first, conditions = self._einsum_conditions(step, batch)
        read = self.read_operands(step)
        keys = step.result.keys
        # name every joined column after its role, group by the output keys
        joined = [alias(first[lab].copy(), ident(key)) for lab, key in zip(node.output, keys)]
        joined += [alias(first[lab].copy(), ident(f"r{q}")) for q, lab in enumerate(node.reduced)]
        joined += [alias(col(TILE, f"t{k}"), ident(f"t{k}")) for k in read]
        inner = self.join_sources(step, exp.Select(expressions=joined))
        inner.set("where", _where(conditions))
        # an operand whose tile is the same in every member of a group (no cut reduced label:
        # the FFN chain's x, a fused residual) is gathered once per group, not into each member:
        # the capped FFN's lists held x once per piece of o (8 x 8 MB a group; 369 -> 257 MB)
        shared = shared_operands([op.labels for op in node.operands], node.reduced, node.size, step.tile_of)
        shared = [k for k in read if k in shared]
        varying = [k for k in read if k not in shared]
        member = struct(k=exp.Array(expressions=[col(f"r{q}") for q in range(len(node.reduced))]),
                        **{f"t{j}": col(f"t{k}") for j, k in enumerate(varying)})
        args = [self.spec_literal(step), key_list([col(key) for key in keys]), self.list_aggregate(this=member)]
        if shared:
            args.append(exp.Array(expressions=[exp.AnyValue(this=col(f"t{k}")) for k in shared]))
        kernel = call(self.einsum_group_udf.format(arity=len(varying)) + ("s" if shared else ""), *args)
        select = exp.Select(expressions=[col(key) for key in keys] + [alias(kernel, name(TILE))])
        select = select.from_(subquery(inner, "joined"), copy=False)
        if keys:
            select.set("group", exp.Group(expressions=[col(key) for key in keys]))
        return select

    def program(self, step: ProgramStep) -> exp.Select:
        """A program step: its inputs are one row each, read side by side (by position where
        the engine can, else a cross product of one-row tables), and one kernel call computes
        every einsum of the program from their tiles::

            SELECT 0 AS <key>..., eds_program<n>(spec, t0.tile, t1.tile, ...) AS tile
            FROM <input 0> AS t0 POSITIONAL JOIN <input 1> AS t1 ...

        (``eds_program(spec, [t0.tile, ...])``, a list, above ``max_program_args`` inputs.)
        """
        tiles = [col(TILE, f"t{k}") for k in range(len(step.inputs))]
        if 1 <= len(tiles) <= self.max_program_args:
            kernel = call(self.program_args_udf.format(arity=len(tiles)), self.spec_literal(step), *tiles)
        else:
            kernel = call(self.program_udf, self.spec_literal(step), exp.Array(expressions=tiles))
        select = exp.Select(expressions=[alias(cast(num(0), "BIGINT"), ident(key)) for key in step.result.keys]
                            + [alias(kernel, name(TILE))])
        return self._read_inputs(step.inputs, select, self.positional_join_single_tiles, step)

    def input_source(self, step: Step | None, k: int, value: TiledValue) -> exp.Expression:
        """Input ``k`` of ``step`` as the table ``t<k>`` its SQL reads. On a device, a step that
        runs there reads a tile the device already holds as NULL (``eds_resident`` pins it in
        the session's device cache; udfs/device_cache.py), so DuckDB neither copies nor converts
        its bytes::

            (SELECT d0, d1, CASE WHEN eds_resident('A', [d0, d1]) THEN NULL ELSE tile END AS tile
             FROM A) AS t0

        The keys named are those of the operand's labels (a program's inputs: none, they are one
        tile each), as the kernel names the tile it receives."""
        source = exp.Table(this=ident(slot(value.name)))
        if (self.device == "cpu" or not self.device_residency or step is None
                or host_reason(step, self.device_min_work) is not None):
            source.set("alias", exp.TableAlias(this=ident(f"t{k}")))
            return source
        if isinstance(step, ProgramStep):
            named: list = []
        else:
            dropped = step.node.operands[k].dropped
            named = [col(key) for ax, key in enumerate(value.keys) if ax not in dropped]
        keys = cast(exp.Array(expressions=named), "BIGINT[]")
        held = call(self.resident_udf, exp.Literal.string(value.name), keys)
        tile = exp.Case(ifs=[exp.If(this=held, true=exp.Null())], default=col(TILE))
        inner = exp.select(*[col(key) for key in value.keys], alias(tile, name(TILE))).from_(source)
        return subquery(inner, f"t{k}")

    def send_ahead(self, step: Step) -> tuple[tuple[str, str], ...]:
        """(value, statement) for each input of a device step whose join hands its tiles more
        than once (a label the input lacks is cut: each of its tiles meets every piece of it):
        one statement sends its tiles to the device first, each once, so that the step's
        ``eds_resident`` finds them and its join hands NULL (udfs/device_cache.py)::

            SELECT count(eds_send('{"value": "A", ...}', [d0, d1], tile))
            FROM (SELECT d0, d1, CASE WHEN eds_resident('A', [d0, d1]) THEN NULL ELSE tile END
                  AS tile FROM A) AS t0

        The backend runs those of stored inputs whose tiles the device cache can name. Empty on
        the CPU, for a step on the host, and for a step in batches (a send pins every tile of
        the input for the whole step); none for an operand read on a diagonal (``ii``: its join
        reads only the diagonal's tiles)."""
        if (self.device == "cpu" or not self.device_residency or not isinstance(step, EinsumStep)
                or step.batches > 1 or host_reason(step, self.device_min_work) is not None):
            return ()
        pieces, sends, seen = step.pieces, [], set()
        for k, (value, operand) in enumerate(zip(step.inputs, step.node.operands)):
            if (value.name in seen or all(pieces[lab] == 1 for lab in pieces if lab not in operand.labels)
                    or len(set(operand.labels)) < len(operand.labels)):
                continue  # (a diagonal's join reads only some of its tiles: sending all would waste room)
            seen.add(value.name)
            named = [ax for ax in range(len(value.keys)) if ax not in operand.dropped]
            spec = json.dumps({"value": value.name, "dtype": str(value.dtype), "shape": list(value.shape),
                               "tile": list(value.tile), "named": named})
            keys = cast(exp.Array(expressions=[col(key) for key in value.keys]), "BIGINT[]")
            send = call(self.send_udf, exp.Literal.string(spec), keys, col(TILE))
            select = exp.select(exp.Count(this=send)).from_(self.input_source(step, k, value))
            sends.append((value.name, select.sql(dialect=self.dialect)))
        return tuple(sends)

    def retile(self, step: RetileStep, batch: tuple[int, int] | None = None) -> exp.Select:
        """Re-tile a tiled table the memory-efficient way (slice, regroup, concatenate):

        1. one kernel call per source tile cuts it into the pieces that fall in each target
           tile, so a source tile crosses into the kernel once, however many targets it feeds;
        2. unnest() turns the pieces into rows keyed by their target tile;
        3. the pieces of each target tile are grouped and concatenated.

        No step holds more than the source tiles of one vector and the pieces of its targets; a
        batched retile restricts both to a range of one target key (``step.batch_axis``)::

            SELECT n0 AS key0, ..., tile FROM (
              SELECT n0, ..., eds_assemble(spec, [n0, ...], list({k: old_k, t: piece})) AS tile
              FROM (SELECT cut.n[1] AS n0, ..., cut.k AS old_k, cut.t AS piece
                    FROM (SELECT unnest(eds_split(spec, [keys], tile)) AS cut FROM source) AS cuts
              ) AS pieces GROUP BY n0, ...
            ) AS retiled
        """
        s, t = step.source, step.target
        old = [col(k) for k in s.keys]
        new_names = [f"n{p}" for p in range(len(s.keys))]
        cut = call(self.split_udf, self.spec_literal(step, batch), key_list([c.copy() for c in old]), ucol(TILE))
        cuts = exp.Select(expressions=[alias(exp.Explode(this=cut), name("cut"))]).from_(
            table(slot(s.name)), copy=False)
        if batch is not None:  # only source tiles that overlap the batch's target keys
            lo, hi = batch
            ax = step.batch_axis
            a, b = s.tile[ax], t.tile[ax]
            cuts.set("where", exp.Where(this=exp.and_(
                exp.LT(this=exp.Mul(this=old[ax].copy(), expression=num(a)), expression=num(hi * b)),
                exp.GT(this=exp.Mul(this=exp.Paren(this=exp.Add(this=old[ax].copy(), expression=num(1))),
                                    expression=num(a)),
                       expression=num(lo * b)),
            )))
        # sqlglot counts list positions from 0 and prints DuckDB's 1-based index itself
        items = [alias(exp.Bracket(this=col("n", "cut"), expressions=[num(p)]), ident(n))
                 for p, n in enumerate(new_names)]
        pieces = exp.Select(expressions=items + [alias(ucol("k", "cut"), name("old_k")),
                                                 alias(ucol("t", "cut"), name("piece"))])
        pieces = pieces.from_(subquery(cuts, "cuts"), copy=False)
        new_cols = [col(n) for n in new_names]
        assemble = call(self.assemble_udf, self.spec_literal(step, batch), key_list([c.copy() for c in new_cols]),
                        self.list_aggregate(this=struct(k=col("old_k"), t=col("piece"))))
        select = exp.Select(expressions=[c.copy() for c in new_cols] + [alias(assemble, name(TILE))])
        select = select.from_(subquery(pieces, "pieces"), copy=False)
        select.set("group", exp.Group(expressions=[c.copy() for c in new_cols]))
        # rename n0.. back to the tensor's key names
        outer = exp.select(*[exp.alias_(col(n), ident(k)) for n, k in zip(new_names, t.keys)], col(TILE))
        return outer.from_(select.subquery("retiled"), copy=False)

    def fill(self, step: FillStep, batch: tuple[int, int] | None = None) -> exp.Select:
        """A result that reads no input (an einsum over a label of size 0): one row per tile of
        the result's grid, from a cross product of key ranges (none when a dimension has size
        0); the kernel writes each tile full of one value, the aggregation's identity::

            SELECT g0.key0 AS key0, ..., eds_fill(spec, [g0.key0, ...]) AS tile
            FROM range(lo, hi) AS g0(key0), range(0, n1) AS g1(key1), ...
        """
        r = step.result
        # each range's column is qualified by its alias: key names that differ only in case
        # (labels i and I) are one name to DuckDB
        keys = [col(k, f"g{p}") for p, k in enumerate(r.keys)]
        bounds = [(0, n) for n in r.grid]
        if batch is not None:
            bounds[0] = batch
        kernel = call(self.fill_udf, self.spec_literal(step), key_list([k.copy() for k in keys]))
        select = exp.Select(expressions=[alias(k.copy(), ident(n)) for k, n in zip(keys, r.keys)]
                            + [alias(kernel, name(TILE))])
        ranges = [self.range_table(lo, hi, f"g{p}", k) for p, ((lo, hi), k) in enumerate(zip(bounds, r.keys))]
        if ranges:
            select = select.from_(ranges[0], copy=False)
            if len(ranges) > 1:
                select.set("joins", [exp.Join(this=t) for t in ranges[1:]])
        return select

    def range_table(self, lo: int, hi: int, as_: str, column: str) -> exp.Expression:
        """A one-column table ``as_`` of the keys lo..hi-1 in column ``column`` (the dialect's
        table function: DuckDB's ``range(lo, hi) AS as_(column)``)."""
        return range_table(lo, hi, as_, column)

    # --- reading values

    def select_value(self, value: TiledValue, table_name: str) -> exp.Select:
        """A tiled value's rows: its key columns and the tile."""
        return exp.select(*[col(k) for k in value.keys], col(TILE)).from_(table(table_name))

    def elements_query(self, value: TiledValue, labels: tuple[str, ...],
                       source: exp.Expression | None = None) -> exp.Select:
        """One row per element of ``value`` (read from the table named after it, or from the
        query ``source``): a column per label, then ``value``.

        Tiles to element rows: a kernel turns each tile into a typed list of its values (C
        order), unnest() walks it next to its offsets, and each element's coordinates come from
        the tile key and the offset by key arithmetic: a tile with key k covers
        ``[k*t, min((k+1)*t, n))`` of a dimension, so element ``off`` sits at
        ``k*t + (off // (product of the later extents)) % extent``::

            SELECT <coordinate> AS label, ..., value FROM (
              SELECT keys, unnest(vals) AS value, unnest(range(len(vals))) AS off
              FROM (SELECT keys, eds_values_<dtype>(tile) AS vals FROM source) AS decoded
            ) AS cells

        Complex tensors have none: DuckDB has no complex type, so they are an ``EinsumError``
        (read them with ``einsum()``'s tiles or ``Tensor.to_numpy()``)."""
        if value.dtype not in self.element_dtypes:
            from ..errors import EinsumError

            raise EinsumError(f"einsum_elements: the result is {value.dtype}, which has no DuckDB type (DuckDB "
                              "has no complex numbers); use einsum() for its tiles or Tensor.to_numpy() in Python")
        src = source.subquery("src") if source is not None else table(value.name)
        keys = [col(k) for k in value.keys]
        # each tile's extent per dimension: least(t, n - k * t) (edge tiles are smaller)
        # (ignore_nulls as DuckDB's parser sets it: DuckDB's least() skips NULLs)
        exts = [exp.Least(this=num(t), expressions=[exp.Sub(this=num(n), expression=exp.Mul(this=k.copy(), expression=num(t)))],
                          ignore_nulls=True)
                for k, n, t in zip(keys, value.shape, value.tile)]
        elements = []
        for p, (k, lab, t) in enumerate(zip(keys, labels, value.tile)):
            stride = fold(exp.Mul, [e.copy() for e in exts[p + 1:]]) or num(1)
            index = exp.Mod(this=exp.Paren(this=exp.IntDiv(this=ucol("off"), expression=exp.Paren(this=stride))),
                            expression=exts[p].copy())
            coord = exp.Add(this=exp.Mul(this=k.copy(), expression=num(t)), expression=index)
            elements.append(alias(coord, ident(lab)))
        decoded = exp.Select(expressions=[k.copy() for k in keys]
                             + [alias(call(self.values_udf.format(dtype=value.dtype), ucol(TILE)), name("vals"))])
        decoded = decoded.from_(src, copy=False)
        cells = exp.Select(expressions=[k.copy() for k in keys] + [
            alias(exp.Explode(this=ucol("vals")), name("value")),
            alias(exp.Explode(this=exp.GenerateSeries(start=num(0), end=exp.Length(this=ucol("vals")),
                                                      is_end_exclusive=True)), name("off")),
        ]).from_(subquery(decoded, "decoded"), copy=False)
        return exp.Select(expressions=elements + [ucol("value")]).from_(subquery(cells, "cells"), copy=False)

    # --- statements around a select

    def create_table_as(self, table_name: str, select: exp.Expression, temporary: bool = False,
                        replace: bool = False) -> exp.Create:
        """``CREATE [OR REPLACE] [TEMP] TABLE "table" AS select``."""
        props = exp.Properties(expressions=[exp.TemporaryProperty()]) if temporary else None
        return exp.Create(this=table(table_name), kind="TABLE", expression=select, replace=replace,
                          properties=props)

    def drop_table(self, table_name: str) -> exp.Drop:
        return exp.Drop(tables=[table(table_name)], kind="TABLE", exists=True)

    def drop_table_sql(self, table_name: str) -> str:
        """``DROP TABLE IF EXISTS`` the table, as text (cached per name)."""
        return _drop_sql(table_name, self.dialect)


@lru_cache(maxsize=4096)
def _quoted(name: str, dialect) -> str:
    return ident(name).sql(dialect=dialect)


@lru_cache(maxsize=4096)
def _drop_sql(name: str, dialect) -> str:
    return exp.Drop(tables=[table(name)], kind="TABLE", exists=True).sql(dialect=dialect)


def fold(op: type[exp.Binary], terms: list[exp.Expression]) -> exp.Expression | None:
    """``t0 op t1 op ...`` (left-associative, as a parser reads it; ``op``: ``exp.Mul``,
    ``exp.Add``); None for no terms."""
    if not terms:
        return None
    out = terms[0]
    for term in terms[1:]:
        out = op(this=out, expression=term)
    return out


@cache
def _slot_pattern(dialect: str | None) -> re.Pattern:
    # a placeholder as the dialect quotes it, with the value name as the group
    quoted = ident(SLOT_PREFIX + "VALUE").sql(dialect=dialect)
    return re.compile(re.escape(quoted).replace("VALUE", "([A-Za-z0-9_]+)"))
