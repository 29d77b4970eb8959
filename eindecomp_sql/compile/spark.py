"""Spark's compiler: the same statements printed in Spark SQL, with Spark's few differences.

Pure like the rest of ``compile`` (sqlglot only; this module does not import pyspark). The
Spark backend (``backends/spark.py``) holds a ``SparkCompiler()``. What differs from DuckDB is
data, not branches in the compiler: the tactics are class attributes, and each construct Spark
spells differently is one overridden builder, listed in ``REWRITES`` with the reason. Every
step shape is run on a real local Spark session in ``tests/test_spark.py``: sqlglot's
transpiler is not trusted with them (it prints DuckDB's ``range(lo, hi) AS g(k)`` as an
``EXPLODE(SEQUENCE(lo, hi))`` that includes ``hi`` and loses the column name, for one).
"""

from __future__ import annotations

import functools

from sqlglot import exp

from ..plan import EinsumStep, FillStep, ProgramStep, RetileStep, Step
from ..plan.steps import step_reads, step_target
from ..plan.cost import CostModel, nbytes
from ..plan.cost import repartition_label as _repartition_label
from ..plan.kernel_spec import kernel_spec
from .compiler import (TILE, SQLCompiler, alias, call, cast, col, fold, ident, name, num, slot, struct, subquery,
                       table, ucol)

# construct -> how Spark SQL spells it (each is a builder SparkCompiler overrides, or a tactic)
REWRITES = {
    "positional join": "none in Spark: one-tile operands are joined by key (a cross product of one-row tables)",
    "range(lo, hi) AS g(k)": "(SELECT id AS k FROM range(lo, hi)) AS g: the table function's column is id",
    "list() of structs": "COLLECT_LIST(STRUCT(... AS f)): order is not kept, so every member carries its keys",
    "unnest(list)": "EXPLODE(list) in the select list",
    "list[i] (1-based)": "list[i] (0-based): sqlglot's index offset per dialect",
    "a grouped step's join": "the left operand in a REPARTITION(key) subquery, the right one "
                             "BROADCAST, where it fits the broadcast threshold (repartition_label)",
    "a retile of the leading axis": "SUBSTRING and CONCAT of the tiles' bytes, no kernel (rows_retile)",
}


class SparkCompiler(SQLCompiler):
    """``SQLCompiler`` printing Spark SQL."""

    dialect = "spark"
    positional_join_single_tiles = False  # Spark has no POSITIONAL JOIN
    small_tile_bytes = 0  # every join condition kept: a dropped one turns a shuffle join into a cross product
    # the session's autoBroadcastJoinThreshold (Spark's default here): a grouped step's right
    # operand at most this big is broadcast and its left one repartitioned by an output key
    # (``repartition_label``). The backend uses ``spark_compiler(threshold)``: compiled plans
    # are cached per compiler class, so each threshold is a class of its own
    broadcast_bytes = 10 << 20

    def kernel_spec(self, step: Step, batch: tuple[int, int] | None = None) -> str:
        """Portable: a callable join travels as its signed pickle, for the Python workers
        (other processes) to run (``plan/kernel_spec.py``)."""
        return kernel_spec(step, batch, portable=True)

    def retile(self, step: RetileStep, batch: tuple[int, int] | None = None) -> exp.Select:
        if step.by_rows:
            return self.rows_retile(step, batch)
        return super().retile(step, batch)

    def rows_retile(self, step: RetileStep, batch: tuple[int, int] | None = None) -> exp.Select:
        """A retile that re-cuts the leading axis only, in the JVM: a target tile is byte ranges
        of source tiles back to back (C order), so ``SUBSTRING`` cuts them and ``CONCAT`` joins
        them, and no tile crosses into Python and back (``eds_split`` / ``eds_assemble``). A
        4096² float32 matrix from two row panels to one tile, inside a GEMM's statement: 0.45 s
        less than the kernels' retile (docs/DESIGN.md "Spark")::

            SELECT _eds_n0 AS key0, key1, ..., CONCAT(COALESCE(TRY_ELEMENT_AT(s, 1).t, ''), ...) AS tile
            FROM (SELECT _eds_n0, key1, ..., ARRAY_SORT(COLLECT_LIST(STRUCT(_eds_r AS r, _eds_piece AS t))) AS _eds_s
                  FROM (SELECT _eds_n0, key1, ..., key0 - _eds_n0 * T DIV S AS _eds_r,
                               SUBSTRING(tile, offset + 1, length) AS _eds_piece
                        FROM (SELECT *, EXPLODE(SEQUENCE(first target, last target)) AS _eds_n0 FROM source))
                  GROUP BY _eds_n0, key1, ...)

        where every source tile lies in one target (a merge) its key is computed, not exploded,
        and its tile is the piece; where every target lies in one source (a split) there is
        nothing to group. ``_eds_`` names are ours: no user name starts with it."""
        s, t = step.source, step.target
        n0, S, T = s.shape[0], s.tile[0], t.tile[0]
        keys = [col(k) for k in s.keys]
        k0 = keys[0]
        # bytes in one index of the leading axis of a tile: the trailing extents, smaller in the
        # last tile of an axis its tile does not divide
        extents = [num(tl) if n % tl == 0 else
                   exp.Least(this=num(tl), expressions=[exp.Sub(this=num(n), expression=exp.Mul(this=k.copy(),
                                                                                              expression=num(tl)))])
                   for n, tl, k in zip(s.shape[1:], s.tile[1:], keys[1:])]
        row = fold(exp.Mul, [num(nbytes((1,), s.dtype))] + extents)
        merge = T % S == 0 or T >= n0  # each source tile lies in one target tile
        split = cuts_only(step)  # each target tile lies in one source tile: nothing to group

        def times(e, k):
            return exp.Mul(this=exp.Paren(this=e.copy()), expression=num(k))

        def div(e, k):
            return exp.IntDiv(this=exp.Paren(this=e.copy()), expression=num(k))

        start = times(k0, S)  # the source tile's first and last-plus-one index
        end = exp.Least(this=times(exp.Add(this=k0.copy(), expression=num(1)), S), expressions=[num(n0)])
        target = ucol("_eds_n0")
        if merge:
            first = alias(div(start, T), name("_eds_n0"))
        else:
            first = alias(exp.Explode(this=call("SEQUENCE", div(start, T),
                                                div(exp.Sub(this=end.copy(), expression=num(1)), T))),
                          name("_eds_n0"))
        cuts = exp.select(exp.Star(), first).from_(table(slot(s.name)))
        where = []
        if batch is not None:
            lo, hi = batch
            if step.batch_axis == 0:  # source tiles overlapping targets lo..hi-1, then those targets
                cuts.set("where", exp.Where(this=exp.and_(
                    exp.LT(this=start.copy(), expression=num(hi * T)),
                    exp.GT(this=times(exp.Add(this=k0.copy(), expression=num(1)), S), expression=num(lo * T)))))
                where = [exp.GTE(this=target.copy(), expression=num(lo)), exp.LT(this=target.copy(), expression=num(hi))]
            else:  # a trailing key: the same in source and target
                k = keys[step.batch_axis]
                cuts.set("where", exp.Where(this=exp.and_(exp.GTE(this=k.copy(), expression=num(lo)),
                                                          exp.LT(this=k.copy(), expression=num(hi)))))
        if merge:
            piece = ucol(TILE)
        else:
            lo_ = exp.Greatest(this=start.copy(), expressions=[times(target, T)])
            hi_ = exp.Least(this=end.copy(), expressions=[times(exp.Add(this=target.copy(), expression=num(1)), T)])
            piece = call("SUBSTRING", ucol(TILE),
                         exp.Add(this=exp.Mul(this=exp.Paren(this=exp.Sub(this=lo_, expression=start.copy())),
                                              expression=exp.Paren(this=row.copy())), expression=num(1)),
                         exp.Mul(this=exp.Paren(this=exp.Sub(this=hi_, expression=lo_.copy())),
                                 expression=exp.Paren(this=row.copy())))
        rest = [k.copy() for k in keys[1:]]
        pieces = exp.select(target.copy(), *rest,
                            alias(exp.Sub(this=k0.copy(), expression=div(times(target, T), S)), name("_eds_r")),
                            alias(piece, name("_eds_piece"))).from_(subquery(cuts, "cuts"))
        if where:
            pieces.set("where", exp.Where(this=exp.and_(*where)))
        if split:
            tiles = pieces
            tile = ucol("_eds_piece")
        else:
            most = min(-(-T // S) + (0 if merge else 1), -(-n0 // S))  # source tiles a target can meet
            listed = call("ARRAY_SORT", self.list_aggregate(this=struct(r=ucol("_eds_r"), t=ucol("_eds_piece"))))
            tiles = exp.select(target.copy(), *[k.copy() for k in rest], alias(listed, name("_eds_s")))
            tiles = tiles.from_(subquery(pieces, "pieces"))
            tiles.set("group", exp.Group(expressions=[target.copy(), *[k.copy() for k in rest]]))
            empty = cast(exp.Literal.string(""), "BLOB")
            tile = call("CONCAT", *[exp.Coalesce(this=exp.Dot(this=call("TRY_ELEMENT_AT", ucol("_eds_s"), num(p + 1)),
                                                              expression=name("t")), expressions=[empty.copy()])
                                    for p in range(most)])
        out = exp.select(alias(target.copy(), ident(t.keys[0])),
                         *[alias(k.copy(), ident(kt)) for k, kt in zip(rest, t.keys[1:])], alias(tile, name(TILE)))
        return out.from_(subquery(tiles, "retiled"))

    def range_table(self, lo: int, hi: int, as_: str, column: str) -> exp.Expression:
        rows = exp.Table(this=exp.Anonymous(this="range", expressions=[num(lo), num(hi)]))
        select = exp.select(exp.alias_(exp.column(name("id")), ident(column))).from_(rows)
        return exp.Subquery(this=select, alias=exp.TableAlias(this=ident(as_)))

    def join_sources(self, step: EinsumStep, select: exp.Select) -> exp.Select:
        """A grouped step otherwise shuffles every joined row, both tiles in it, to its group
        after a partial ``COLLECT_LIST``. With the left operand repartitioned by one of its
        output keys and the right one broadcast, the joined rows are already partitioned by a
        group key, which satisfies the GROUP BY: Spark aggregates in the same stage, and only
        the left operand crosses a shuffle. 2048³ float64 in 512² tiles: 2.02 s -> 1.12 s
        (``bench/spark_group_probe.py``; 268 MB shuffled -> 34 MB)."""
        select = super().join_sources(step, select)
        label = repartition_label(step, self.broadcast_bytes)
        if label is None:
            return select
        key = self.label_columns(step)[0][label].name  # the left operand's column: it comes first
        source = select.args.get("from_") or select.args.get("from")  # the key's name moved in sqlglot 30
        left = source.this
        inner = exp.select(exp.Star()).from_(exp.Table(this=left.this.copy()))
        inner.set("hint", exp.Hint(expressions=[exp.Anonymous(this="REPARTITION", expressions=[col(key)])]))
        source.set("this", exp.Subquery(this=inner, alias=exp.TableAlias(this=ident("t0"))))
        # the right side fits the threshold, but Spark may not know it (a view of a step run
        # inside this statement has no size): say it, so the plan is the one priced
        select.set("hint", exp.Hint(expressions=[exp.Anonymous(this="BROADCAST", expressions=[ident("t1")])]))
        return select


@functools.lru_cache(maxsize=None)
def spark_compiler(broadcast_bytes: int) -> type[SparkCompiler]:
    """``SparkCompiler`` for a session whose broadcast threshold is ``broadcast_bytes``."""
    if broadcast_bytes == SparkCompiler.broadcast_bytes:
        return SparkCompiler
    return type(f"SparkCompiler_{broadcast_bytes}", (SparkCompiler,), {"broadcast_bytes": broadcast_bytes,
                                                                      "__module__": __name__})


def repartition_label(step: Step, broadcast_bytes: int) -> str | None:
    """The output label whose key a grouped step's left operand is repartitioned by on Spark,
    or None (``plan.cost.repartition_label``, which the optimizer prices by)."""
    if not isinstance(step, EinsumStep):
        return None
    sizes = {op.value: v.nbytes for op, v in zip(step.node.operands, step.inputs)}
    return _repartition_label(step.node, step.pieces, sizes, broadcast_bytes)


def cuts_only(step: RetileStep) -> bool:
    """Whether every target tile of a retile by rows lies in one source tile: ``rows_retile``
    then cuts byte ranges and groups nothing (no shuffle)."""
    n0, S, T = step.source.shape[0], step.source.tile[0], step.target.tile[0]
    return S % T == 0 or S >= n0


def inlined_steps(plan) -> dict[int, int]:
    """Steps whose value is no output and is read once, by one later step: the Spark backend
    runs them inside their reader's statement (a view of the statement, not a Parquet result),
    mapped to that reader's index. Spark's counters then see their shuffle in the reader's
    jobs; a chain of them ends at the first step written out."""
    kept = {v.name for v in plan.outputs}
    reads: dict[str, list[int]] = {}
    for k, step in enumerate(plan.steps):
        for v in step_reads(step):
            reads.setdefault(v.name, []).append(k)
    inner = {k: reads[v][0] for k, step in enumerate(plan.steps)
             if (v := step_target(step).name) not in kept and len(reads.get(v, ())) == 1}
    for k in sorted(inner, reverse=True):  # a step inlined into an inlined step runs in the latter's reader
        if inner[k] in inner:
            inner[k] = inner[inner[k]]
    return inner


def shuffle_bytes(step: Step, broadcast_bytes: int = 10 << 20) -> int:
    """The bytes Spark shuffles to run ``step`` as ``SparkCompiler`` prints it: a prediction
    from the plan alone, shown by EXPLAIN on Spark and checked against Spark's own shuffle
    counters in ``bench/spark_bench.py``.

    - a join by key shuffles both sides, hash-partitioned on the key, unless the smaller side
      is at most ``broadcast_bytes`` (Spark's ``autoBroadcastJoinThreshold``: it is broadcast,
      and nothing is shuffled); operands that share no label are a cross product (no shuffle);
    - a grouped step shuffles its joined rows to their group (the list aggregate keeps them
      all: map-side partial aggregation saves nothing), unless its left operand is
      repartitioned by an output key (``repartition_label``): then only that operand moves;
    - a retile shuffles every byte of the source once, as pieces, to their target tile, unless
      it only cuts the leading axis's tiles finer (``cuts_only``: nothing is grouped);
    - a fill and a program (one-row inputs, side by side) shuffle nothing.
    """
    if isinstance(step, RetileStep):
        return 0 if step.by_rows and cuts_only(step) else step.source.nbytes
    if isinstance(step, (FillStep, ProgramStep)):
        return 0
    moved = 0
    read = SQLCompiler.read_operands(step)  # a repeated operand is neither read nor joined again
    ops = [step.node.operands[k] for k in read]
    inputs = [step.inputs[k] for k in read]
    seen = set(ops[0].labels)
    left = inputs[0].nbytes
    for op, value in zip(ops[1:], inputs[1:]):
        keyed = bool(seen & set(op.labels))
        if keyed and min(left, value.nbytes) > broadcast_bytes:
            moved += left + value.nbytes
        seen |= set(op.labels)
        left += value.nbytes  # the joined rows so far carry every tile read yet
    if step.grouped:
        # every joined row, each with every tile (an operand alike in a group's members too:
        # the kernel gets it once, after the shuffle)
        moved += (step.inputs[0].nbytes if repartition_label(step, broadcast_bytes)
                  else step.costs_on(_UNSHARED).join)
    return moved


_UNSHARED = CostModel(shares_group_operands=False)
