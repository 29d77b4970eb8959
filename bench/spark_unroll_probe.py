"""Issue 13, a probe for the next step: the Spark GEMM without its retile job.

The product's plan for a 4096² float32 GEMM stored as row panels puts B's two panels together
by rows (a shuffle, a concat, a broadcast) and joins each A panel with B whole. This probe joins
each A panel with B's panels as separate operands instead (each broadcast, no aggregate) and
lets a hand-written kernel sum the products of A's column blocks with them: a reduction over
``j`` unrolled into the join, which the product does not build yet. Both run interleaved in one
session; the probe's result is checked against numpy.

    .venv/bin/python bench/spark_unroll_probe.py [reps]     # default 9
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

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    db = eds.connect(tempfile.mkdtemp(), backend="spark")
    spark, be = db.backend.spark, db.backend
    from pyspark.sql.functions import arrow_udf

    n = 4096
    h = n // 2
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    A, B = db.store("GA", a), db.store("GB", b)
    assert A.tile == B.tile == (h, n), "the probe expects two row panels per operand"
    print(db.plan("ij,jk->ik", A, B).explain().splitlines()[0])

    def unrolled(at, b0, b1):
        out = []
        for x, y, z in zip(at, b0, b1):
            X = np.frombuffer(x.as_buffer(), np.float32).reshape(h, n)
            r = X[:, :h] @ np.frombuffer(y.as_buffer(), np.float32).reshape(h, n)
            r += X[:, h:] @ np.frombuffer(z.as_buffer(), np.float32).reshape(h, n)
            out.append(r.tobytes())
        return pa.array(out, pa.binary())

    spark.udf.register("eds_probe_unrolled", arrow_udf(unrolled, "binary"))
    views: list[str] = []
    ta, tb = (ident(be._view(be._find(t.name)[1], t, views)).sql("spark") for t in (A.value, B.value))
    sql = (f"SELECT /*+ BROADCAST(p0, p1) */ t0.d0 AS i, eds_probe_unrolled(t0.tile, p0.tile, p1.tile) AS tile "
           f"FROM {ta} t0, (SELECT tile FROM {tb} WHERE d0 = 0) p0, (SELECT tile FROM {tb} WHERE d0 = 1) p1")
    got = spark.sql(sql).toArrow().sort_by([("i", "ascending")])
    c = np.concatenate([np.frombuffer(t, np.float32).reshape(h, n) for t in got.column("tile").to_pylist()])
    assert np.allclose(c, a @ b, rtol=1e-3, atol=1e-2)
    out = tempfile.mkdtemp(prefix="eds-probe-")
    runs = {"product": lambda r: db.einsum("ij,jk->ik", A, B),
            "unrolled": lambda r: spark.sql(sql).write.mode("overwrite").option("compression", "none")
            .parquet(f"{out}/{r}")}
    report(interleaved(runs, reps, warmups=3))
    db.close()


if __name__ == "__main__":
    main()
