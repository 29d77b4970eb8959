"""Issue 13, a probe: an operand cut finer than the step, gathered in SQL, assembled in the kernel.

The BlockMatrix comparison's GEMM (2048³ float64, both operands stored in 512² blocks) runs
today as one grouped step: every (i, j, k) block product is a joined row, 64 rows carrying both
blocks (268 MB) into the kernels. This probe runs the step with fewer, bigger pieces instead:
A's blocks grouped by a coarse ``i`` piece into one row (``COLLECT_LIST`` of the blocks with
their keys), B's sixteen blocks into one broadcast row, and a kernel that puts the blocks
together and runs one product per row. It prints medians of the product's plan and of the
gathered one at ``i`` cut 1, 2 and 4, run interleaved in one session, each checked against numpy.

    .venv/bin/python bench/spark_gather_probe.py [n] [reps]     # default 2048, 7
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np
import pyarrow as pa
from interleaved import interleaved, report


def main() -> None:
    import eindecomp_sql as eds
    from eindecomp_sql.compile.compiler import ident

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    blk = 512
    db = eds.connect(tempfile.mkdtemp(), backend="spark")
    spark, be = db.backend.spark, db.backend
    from pyspark.sql.functions import arrow_udf

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    A = db.store("MA", a, tile=(blk, blk))
    B = db.store("MB", b, tile=(blk, blk))
    print(db.plan("ij,jk->ik", A, B).explain().splitlines()[0])

    def assemble(ts):
        d0 = ts.field("d0").to_numpy()
        d1 = ts.field("d1").to_numpy()
        r0, c0 = d0.min(), d1.min()
        out = np.empty(((d0.max() - r0 + 1) * blk, (d1.max() - c0 + 1) * blk))
        for x, y, t in zip(d0, d1, ts.field("tile")):
            out[(x - r0) * blk:(x - r0 + 1) * blk, (y - c0) * blk:(y - c0 + 1) * blk] = \
                np.frombuffer(t.as_buffer(), np.float64).reshape(blk, blk)
        return out

    def gathered(ats, bts):
        out = []
        for x, y in zip(ats, bts):
            out.append((assemble(x.values) @ assemble(y.values)).tobytes())
        return pa.array(out, pa.binary())

    spark.udf.register("eds_probe_gathered", arrow_udf(gathered, "binary"))
    views: list[str] = []
    ta, tb = (ident(be._view(be._find(t.name)[1], t, views)).sql("spark") for t in (A.value, B.value))
    pieces = n // blk

    def sql(p: int) -> str:
        step = pieces // p
        return (f"SELECT /*+ BROADCAST(bg) */ ag.g AS i, eds_probe_gathered(ag.ts, bg.ts) AS tile FROM "
                f"(SELECT CAST(d0 DIV {step} AS INT) AS g, COLLECT_LIST(STRUCT(d0, d1, tile)) AS ts "
                f"FROM {ta} GROUP BY 1) ag, "
                f"(SELECT COLLECT_LIST(STRUCT(d0, d1, tile)) AS ts FROM {tb}) bg")

    want = a @ b
    for p in (1, 2, 4):
        got = spark.sql(sql(p)).toArrow().sort_by([("i", "ascending")])
        c = np.concatenate([np.frombuffer(t, np.float64).reshape(-1, n) for t in got.column("tile").to_pylist()])
        assert np.allclose(c, want), p
    out = tempfile.mkdtemp(prefix="eds-probe-")
    runs = {"product": lambda r: db.einsum("ij,jk->ik", A, B)}
    for p in (1, 2, 4):
        runs[f"gathered i:{p}"] = (lambda p: lambda r: spark.sql(sql(p)).write.mode("overwrite")
                                   .option("compression", "none").parquet(f"{out}/{p}-{r}"))(p)
    report(interleaved(runs, reps, warmups=2))
    db.close()


if __name__ == "__main__":
    main()
