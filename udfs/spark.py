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


def _in_worker(fn, key: bytes):
    """``fn`` as Spark's Python workers run it: their kernels read the callable joins of specs
    signed with ``key``, this (planning) process's spec key, which travels inside the pickled
    UDF to this application's workers only (never through the SQL text or the environment)."""
    def udf(*args):
        from .kernels import trust_signed_pickles

        trust_signed_pickles(key)
        return fn(*args)

    udf.__name__ = fn.__name__
    return udf


def register_spark_kernels(spark) -> None:
    """Register every tile UDF on ``spark`` (a SparkSession), as ``register_kernels`` does on a
    DuckDB connection; element rows (the SQL interface's) are DuckDB's alone."""
    from pyspark.sql.functions import arrow_udf

    from eindecomp_sql.plan.kernel_spec import _spec_key

    blob = "binary"
    keys = "array<bigint>"
    key = _spec_key()

    def register(name, fn, n, returns):
        spark.udf.register(name, arrow_udf(_arity(_in_worker(fn, key), n), returns))

    for n in range(1, MAX_ARITY + 1):
        register_spark_arity(spark, n)
    register("eds_program", _r.program_rows, 2, blob)
    for n in range(1, _r.MAX_PROGRAM_ARITY + 1):
        register(f"eds_program{n}", _r.program_args, 1 + n, blob)
    register("eds_split", _r.retile_split, 3, f"array<struct<n:{keys},k:{keys},t:{blob}>>")
    register("eds_assemble", _r.retile_assemble, 3, blob)
    register("eds_fill", _r.fill_tiles, 2, blob)


def register_spark_arity(spark, n: int) -> None:
    """The einsum kernels of ``n`` operands on ``spark`` (``register.register_arity``'s three)."""
    from pyspark.sql.functions import arrow_udf

    from eindecomp_sql.plan.kernel_spec import _spec_key

    key = _spec_key()
    for name, fn, count in ((f"eds_einsum{n}", _r.einsum_rows, 2 + n), (f"eds_einsum_group{n}", _r.einsum_groups, 3),
                            (f"eds_einsum_group{n}s", _r.einsum_groups, 4)):
        spark.udf.register(name, arrow_udf(_arity(_in_worker(fn, key), count), "binary"))
