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

from sqlglot import exp

from ..plan import FillStep, ProgramStep, RetileStep, Step
from ..plan.steps import step_reads, step_target
from ..plan.kernel_spec import kernel_spec
from .compiler import SQLCompiler, ident, name, num

# construct -> how Spark SQL spells it (each is a builder SparkCompiler overrides, or a tactic)
REWRITES = {
    "positional join": "none in Spark: one-tile operands are joined by key (a cross product of one-row tables)",
    "range(lo, hi) AS g(k)": "(SELECT id AS k FROM range(lo, hi)) AS g: the table function's column is id",
    "list() of structs": "COLLECT_LIST(STRUCT(... AS f)): order is not kept, so every member carries its keys",
    "unnest(list)": "EXPLODE(list) in the select list",
    "list[i] (1-based)": "list[i] (0-based): sqlglot's index offset per dialect",
}


class SparkCompiler(SQLCompiler):
    """``SQLCompiler`` printing Spark SQL."""

    dialect = "spark"
    positional_join_single_tiles = False  # Spark has no POSITIONAL JOIN
    small_tile_bytes = 0  # every join condition kept: a dropped one turns a shuffle join into a cross product

    def kernel_spec(self, step: Step, batch: tuple[int, int] | None = None) -> str:
        """Portable: a callable join travels as its signed pickle, for the Python workers
        (other processes) to run (``plan/kernel_spec.py``)."""
        return kernel_spec(step, batch, portable=True)

    def range_table(self, lo: int, hi: int, as_: str, column: str) -> exp.Expression:
        rows = exp.Table(this=exp.Anonymous(this="range", expressions=[num(lo), num(hi)]))
        select = exp.select(exp.alias_(exp.column(name("id")), ident(column))).from_(rows)
        return exp.Subquery(this=select, alias=exp.TableAlias(this=ident(as_)))


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
      all: map-side partial aggregation saves nothing);
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
        moved += step.costs.join
    return moved
