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

    def range_table(self, lo: int, hi: int, as_: str, column: str) -> exp.Expression:
        rows = exp.Table(this=exp.Anonymous(this="range", expressions=[num(lo), num(hi)]))
        select = exp.select(exp.alias_(exp.column(name("id")), ident(column))).from_(rows)
        return exp.Subquery(this=select, alias=exp.TableAlias(this=ident(as_)))
