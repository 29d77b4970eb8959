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
from ..plan.kernel_spec import kernel_spec
from .compiler import SQLCompiler, col, ident, name, num

# construct -> how Spark SQL spells it (each is a builder SparkCompiler overrides, or a tactic)
REWRITES = {
    "positional join": "none in Spark: one-tile operands are joined by key (a cross product of one-row tables)",
    "range(lo, hi) AS g(k)": "(SELECT id AS k FROM range(lo, hi)) AS g: the table function's column is id",
    "list() of structs": "COLLECT_LIST(STRUCT(... AS f)): order is not kept, so every member carries its keys",
    "unnest(list)": "EXPLODE(list) in the select list",
    "list[i] (1-based)": "list[i] (0-based): sqlglot's index offset per dialect",
    "a grouped step's join": "the left operand in a REPARTITION(key) subquery, the right one "
                             "BROADCAST, where it fits the broadcast threshold (repartition_label)",
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
    or None: two operands, the right one at most ``broadcast_bytes`` (so it is broadcast and
    the left one streams, keeping its partitioning), no bigger than the left one, and an output
    label of the left operand in several pieces (the one in most: the parallelism of the step)."""
    if not isinstance(step, EinsumStep) or not step.grouped or len(step.inputs) != 2:
        return None
    left, right = step.inputs
    if broadcast_bytes < 0 or right.nbytes > broadcast_bytes or right.nbytes > left.nbytes:
        return None
    split = [lab for lab in step.node.output if lab in step.node.operands[0].labels and step.pieces[lab] > 1]
    return max(split, key=lambda lab: step.pieces[lab], default=None)


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
    - a retile shuffles every byte of the source once, as pieces, to their target tile;
    - a fill and a program (one-row inputs, side by side) shuffle nothing.
    """
    if isinstance(step, RetileStep):
        return step.source.nbytes
    if isinstance(step, (FillStep, ProgramStep)):
        return 0
    moved = 0
    ops = step.node.operands
    seen = set(ops[0].labels)
    left = step.inputs[0].nbytes
    for op, value in zip(ops[1:], step.inputs[1:]):
        keyed = bool(seen & set(op.labels))
        if keyed and min(left, value.nbytes) > broadcast_bytes:
            moved += left + value.nbytes
        seen |= set(op.labels)
        left += value.nbytes  # the joined rows so far carry every tile read yet
    if step.grouped:
        moved += step.inputs[0].nbytes if repartition_label(step, broadcast_bytes) else step.costs.join
    return moved
