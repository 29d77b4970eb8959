"""Issue 13 lead: a grouped step on Spark without the shuffle of its joined rows.

The product's grouped GEMM statement (operands in 512² tiles, the right one broadcast) shuffles
every joined row to its (i, k) group after a partial ``collect_list``: the joined rows carry
both tiles, so the shuffle moves the join's bytes (268 MB at 2048³ float64). Repartitioning the
left operand by its output key first (``/*+ REPARTITION(d0) */``, 32 MB) leaves the joined rows
hash-partitioned by ``i``, which satisfies the GROUP BY's distribution: Spark plans the
aggregation in the same stage, no exchange. This probe runs the product's own statement and the
hinted one side by side (each written as Parquet, as the backend does), checks they give the
same tiles, and prints both physical plans and the medians.

    .venv/bin/python bench/spark_group_probe.py [n] [reps]     # default 2048, 6

Not in the product yet: the hint pays only when the other operands are broadcast (a sort-merge
join would shuffle the left operand again by the join key), and the compiled SQL is cached per
compiler class, not per session threshold; ``shuffle_bytes`` would change with it.
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
    c = be.compiler.compile_plan(plan)[0]
    views: list[str] = []
    tables = {v.name: be._view(be._find(v.name)[1], v, views) for v in plan.inputs}
    text = be.compiler.bind_sql(c.text, tables)
    left = tables[plan.inputs[0].name]
    hinted = text.replace(f"FROM `{left}` AS `t0`", f"FROM (SELECT /*+ REPARTITION(d0) */ * FROM `{left}`) AS `t0`")
    assert hinted != text, "the statement's shape changed: update the probe"
    for name, sql in (("as compiled", text), ("hinted", hinted)):
        print(f"-- {name}")
        spark.sql(sql).explain()
    key = [("i", "ascending"), ("k", "ascending")]
    same = (spark.sql(text).toArrow().sort_by(key).column("tile").to_pylist()
            == spark.sql(hinted).toArrow().sort_by(key).column("tile").to_pylist())
    print("same tiles:", same)
    out = tempfile.mkdtemp(prefix="eds-probe-")
    times: dict[str, list[float]] = {"as compiled": [], "hinted": []}
    for r in range(reps + 1):  # the first round warms both up
        for name, sql in (("as compiled", text), ("hinted", hinted)):
            t = time.perf_counter()
            spark.sql(sql).write.mode("overwrite").parquet(f"{out}/{name.replace(' ', '_')}")
            if r:
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts):.2f} s ({min(ts):.2f}-{max(ts):.2f})")
    sdb.close()


if __name__ == "__main__":
    main()
