"""The tile UDFs on a Spark session: the same Arrow kernels DuckDB calls, as Spark Arrow UDFs.

Spark runs them in its Python workers, a batch of rows at a time (``pyarrow.Array`` in, one
out), under the names and argument lists ``register.register_kernels`` gives DuckDB, so the
compiler's statements call them unchanged. pyspark is imported here only: a Spark session is
the caller's (``backends/spark.py``).
"""

from __future__ import annotations

from . import register as _r

MAX_ARITY = _r.MAX_ARITY


def _arity(fn, n: int):
    """Spark reads a UDF's arity from its signature: one with exactly ``n`` parameters."""
    return _r._with_arity(fn, [f"a{k}" for k in range(n)])


def register_spark_kernels(spark) -> None:
    """Register every tile UDF on ``spark`` (a SparkSession), as ``register_kernels`` does on a
    DuckDB connection; element rows (the SQL interface's) are DuckDB's alone."""
    from pyspark.sql.functions import arrow_udf

    blob = "binary"
    keys = "array<bigint>"

    def register(name, fn, n, returns):
        spark.udf.register(name, arrow_udf(_arity(fn, n), returns))

    for n in range(1, MAX_ARITY + 1):
        register(f"eds_einsum{n}", _r.einsum_rows, 2 + n, blob)
        register(f"eds_einsum_group{n}", _r.einsum_groups, 3, blob)
    register("eds_program", _r.program_rows, 2, blob)
    register("eds_split", _r.retile_split, 3, f"array<struct<n:{keys},k:{keys},t:{blob}>>")
    register("eds_assemble", _r.retile_assemble, 3, blob)
    register("eds_fill", _r.fill_tiles, 2, blob)
