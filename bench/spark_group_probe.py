"""Issue 13: a grouped step on Spark with and without the shuffle of its joined rows.

Without: the grouped GEMM statement (operands in 512² tiles, the right one broadcast) shuffles
every joined row to its (i, k) group after a partial ``collect_list``; the joined rows carry
both tiles, so the shuffle moves the join's bytes (268 MB at 2048³ float64). With (what the
product compiles since 2026-11-25, ``compile/spark.py: repartition_label``): the left operand is
repartitioned by its output key first (``/*+ REPARTITION(d0) */``, 32 MB), which leaves the
joined rows hash-partitioned by ``i`` and satisfies the GROUP BY: Spark aggregates in the same
stage, no exchange. This probe compiles the step both ways (the "without" form is what a
session that broadcasts nothing compiles), runs them side by side (each written as Parquet, as
the backend does), checks they give the same tiles, and prints both physical plans and medians.

    .venv/bin/python bench/spark_group_probe.py [n] [reps]     # default 2048, 6
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import numpy as np


def main() -> None:
    import eindecomp_sql as eds

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    sdb = eds.connect(None, backend="spark")
    be, spark = sdb.backend, sdb.backend.spark
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    A = sdb.store("MA", a, tile=(512, 512), replace=True)
    B = sdb.store("MB", b, tile=(512, 512), replace=True)
    plan = sdb.plan("ij,jk->ik", A, B)
    print(plan.explain().splitlines()[0])
    from eindecomp_sql.compile.spark import spark_compiler

    views: list[str] = []
    tables = {v.name: be._view(be._find(v.name)[1], v, views) for v in plan.inputs}
    hinted = be.compiler.bind_sql(be.compiler.compile_plan(plan)[0].text, tables)
    plain = spark_compiler(-1)()
    text = plain.bind_sql(plain.compile_plan(plan)[0].text, tables)
    assert "REPARTITION" in hinted and "REPARTITION" not in text, "the step is not one the rule covers"
    for name, sql in (("without", text), ("hinted", hinted)):
        print(f"-- {name}")
        spark.sql(sql).explain()
    key = [("i", "ascending"), ("k", "ascending")]
    same = (spark.sql(text).toArrow().sort_by(key).column("tile").to_pylist()
            == spark.sql(hinted).toArrow().sort_by(key).column("tile").to_pylist())
    print("same tiles:", same)
    out = tempfile.mkdtemp(prefix="eds-probe-")
    times: dict[str, list[float]] = {"without": [], "hinted": []}
    for r in range(reps + 1):  # the first round warms both up
        for name, sql in (("without", text), ("hinted", hinted)):
            t = time.perf_counter()
            spark.sql(sql).write.mode("overwrite").parquet(f"{out}/{name.replace(' ', '_')}")
            if r:
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} s ({min(ts):.2f}-{max(ts):.2f})")
    sdb.close()


if __name__ == "__main__":
    main()
