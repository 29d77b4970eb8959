"""Issue 13's benchmark: the same plans on DuckDB and on a local Spark session, side by side.

1. GEMM 4096² float32 from stored tensors, stored in the plan's chunking (the tiles each
   engine's plan reads the arrays in, as the issue asks: no re-tile in the run) and in each
   engine's default tiles (``store`` without ``tile=``), and the FFN graph (b=4096, d=1024,
   f=4096 float32, arrays in): medians of ``--reps`` runs, one process.
2. Every Spark step's predicted shuffle bytes (``compile.spark.shuffle_bytes``, as EXPLAIN
   shows them) against Spark's own counters (the REST API of the session's UI: the stages of
   the jobs each step runs, which the backend labels ``eindecomp_sql step k``).
3. Spark MLlib's ``BlockMatrix.multiply`` (float64: MLlib's only type) on a GEMM against our
   Spark path on the same matrices in the same block size, and a GEMM whose middle dimension
   is 16x the others (SPARK-18218) on both.

4. With ``--tables``: the GEMM and the FFN also on a session keeping its tensors as tables of a
   Spark database (``spark_database=``; run values as run tables), beside the Parquet directories.

    .venv/bin/python bench/spark_bench.py [--reps 3] [--out bench/spark_bench.json] [--tables]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.compile.spark import inlined_steps, shuffle_bytes  # noqa: E402
from eindecomp_sql.plan import RetileStep  # noqa: E402
from graphs import random_inputs  # noqa: E402
from graphs_run import WORKLOADS  # noqa: E402


def spark_session():
    """A local session like the backend's own, with its UI on (the REST API counts shuffles)."""
    from eindecomp_sql.backends.spark import _broadcast_limit, _driver_memory
    from eindecomp_sql.udfs.pool import THREADS

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    s = (SparkSession.builder.master(f"local[{THREADS}]").appName("eds-bench")
         .config("spark.ui.enabled", "true").config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", str(max(2, THREADS)))
         .config("spark.sql.adaptive.enabled", "true")
         .config("spark.sql.autoBroadcastJoinThreshold", str(_broadcast_limit()))
         .config("spark.driver.memory", f"{_driver_memory() >> 20}m").getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    return s


def rest(spark, what: str):
    sc = spark.sparkContext
    with urllib.request.urlopen(f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/{what}") as r:
        return json.load(r)


def measured_shuffles(spark, since_job: int) -> dict[int, int]:
    """Shuffle bytes written, per plan step, by the jobs after ``since_job``."""
    time.sleep(1.5)  # the listener behind the REST API catches up
    stages = {s["stageId"]: s for s in rest(spark, "stages") if s["status"] == "COMPLETE"}
    out: dict[int, int] = {}
    for job in rest(spark, "jobs"):
        desc = job.get("description") or ""
        if job["jobId"] <= since_job or not desc.startswith("eindecomp_sql step "):
            continue
        k = int(desc.split()[2].rstrip(":"))
        out[k] = out.get(k, 0) + sum(stages[s]["shuffleWriteBytes"] for s in job["stageIds"] if s in stages)
    return out


def last_job(spark) -> int:
    jobs = rest(spark, "jobs")
    return max((j["jobId"] for j in jobs), default=-1)


WARMUPS = 3  # Spark's JIT compiles the generated code over the first runs (3.5 -> 1.9 s on the GEMM)


def timed(fn, reps: int) -> list[float]:
    for _ in range(WARMUPS):  # warm: the JVM's code, Spark's Python workers, DuckDB's caches
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def shuffle_rows(spark, sdb, plan, run, label: str) -> list[dict]:
    """Run ``run`` once and compare each step's measured shuffle with the prediction."""
    threshold = sdb.backend.broadcast_bytes()
    before = last_job(spark)
    run()
    got = measured_shuffles(spark, before)
    inlined = inlined_steps(plan)  # these run inside their reader's statement: counted with it
    rows = []
    for k, step in enumerate(plan.steps):
        if k in inlined:
            continue
        inner = [j for j in range(len(plan.steps)) if inlined.get(j) == k]
        rows.append({"workload": label, "step": k,
                     "describe": " + ".join(plan.steps[j].describe() for j in inner + [k]),
                     "predicted": sum(shuffle_bytes(plan.steps[j], threshold) for j in inner + [k]),
                     "measured": got.get(k, 0)})
    return rows


def gemm(spark, ddb, sdb, reps: int, tdb=None) -> dict:
    n = 4096
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    t = {"numpy": timed(lambda: a @ b, reps)}
    res = {}
    for name, db in (("duckdb", ddb), ("spark", sdb)) + ((("spark_tables", tdb),) if tdb else ()):
        for how in ("plan", "default"):
            key = name if how == "plan" else f"{name} (default tiles)"
            if how == "plan":  # the tiles the engine's plan reads the arrays in
                ta, tb = (v.tile for v in db.plan("ij,jk->ik", a, b).inputs)
                A, B = db.store("GA", a, tile=ta, replace=True), db.store("GB", b, tile=tb, replace=True)
                assert not any(isinstance(s, RetileStep) for s in db.plan("ij,jk->ik", A, B).steps)
            else:
                A, B = db.store("GA", a, replace=True), db.store("GB", b, replace=True)
            got = db.einsum("ij,jk->ik", A, B).to_numpy()
            assert np.allclose(got, a @ b, rtol=1e-3, atol=1e-2), name
            t[key] = timed(lambda: db.einsum("ij,jk->ik", A, B), reps)
            res[key + "_plan"] = db.plan("ij,jk->ik", A, B).explain().splitlines()[0]
            res[key + "_tiles"] = [A.tile, B.tile]
    plan = sdb.plan("ij,jk->ik", sdb.tensor("GA"), sdb.tensor("GB"))
    res["shuffle"] = shuffle_rows(spark, sdb, plan, lambda: sdb.einsum("ij,jk->ik", sdb.tensor("GA"),
                                                                       sdb.tensor("GB")), "gemm 4096² f32")
    res["times"] = t
    return res


def ffn(spark, ddb, sdb, reps: int, tdb=None) -> dict:
    g, ref = WORKLOADS["ffn"]()
    xs = random_inputs(g, 0)
    want = ref(**xs)
    t, res = {}, {}
    from eindecomp_sql.plan.graph_plan import plan_graph

    for name, db in (("duckdb", ddb), ("spark", sdb)) + ((("spark_tables", tdb),) if tdb else ()):
        # what ``g.run(db, ...)`` plans: the engine's workers, tile cap and cost model
        p = plan_graph(g, workers=db.workers, memory=db.plan_budget, tile_bytes=db.tile_bytes,
                       costs=db.backend.cost_model)
        got = p.run(db, **xs).to_numpy()
        assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max())), name
        t[name] = timed(lambda p=p, db=db: p.run(db, **xs), reps)
        res[name + "_plan"] = f"workers={db.workers}: {len(p.plan.steps)} step(s); " + \
            p.plan.explain().splitlines()[0]
        if name == "spark":
            res["shuffle"] = shuffle_rows(spark, sdb, p.plan, lambda p=p: p.run(sdb, **xs), "ffn f32")
    res["times"] = t
    return res


def block_matrix(spark, sdb, m: int, k: int, n: int, block: int, reps: int) -> dict:
    """MLlib's BlockMatrix.multiply against our Spark path, float64, blocks of ``block``²."""
    from pyspark.mllib.linalg import Matrices
    from pyspark.mllib.linalg.distributed import BlockMatrix

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    sc = spark.sparkContext

    def blocks(x):
        rows = [((i, j), Matrices.dense(block, block, x[i * block:(i + 1) * block, j * block:(j + 1) * block]
                                         .ravel(order="F").tolist()))
                for i in range(x.shape[0] // block) for j in range(x.shape[1] // block)]
        rdd = sc.parallelize(rows, max(2, len(rows) // 4)).cache()
        rdd.count()
        return BlockMatrix(rdd, block, block, x.shape[0], x.shape[1])

    res = {"shape": [m, k, n], "block": block}
    A, B = sdb.store("MA", a, tile=(block, block), replace=True), sdb.store("MB", b, tile=(block, block), replace=True)
    got = sdb.einsum("ij,jk->ik", A, B).to_numpy()
    assert np.allclose(got, a @ b, rtol=1e-8, atol=1e-8)
    res["ours"] = timed(lambda: sdb.einsum("ij,jk->ik", A, B), reps)
    plan = sdb.plan("ij,jk->ik", A, B)
    res["ours_plan"] = plan.explain().splitlines()[0]
    res["shuffle"] = shuffle_rows(spark, sdb, plan, lambda: sdb.einsum("ij,jk->ik", A, B),
                                  f"gemm {m}x{k}x{n} f64, {block}² blocks")
    BA, BB = blocks(a), blocks(b)
    try:
        C = BA.multiply(BB)
        local = C.toLocalMatrix().toArray()
        assert np.allclose(local, a @ b, rtol=1e-8, atol=1e-8)
        res["block_matrix"] = timed(lambda: BA.multiply(BB).blocks.count(), reps)
    except Exception as e:  # noqa: BLE001 - what failed is the result
        res["block_matrix_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "spark_bench.json"))
    ap.add_argument("--only", default="gemm,ffn,blockmatrix,middle")
    ap.add_argument("--tables", action="store_true", help="also keep tensors as Spark tables (spark_database=)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    spark = spark_session()
    import pyspark

    out = {"machine": platform.machine(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
           "pyspark": pyspark.__version__, "numpy": np.__version__, "warmups": WARMUPS, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    import contextlib
    import tempfile

    warehouse = tempfile.mkdtemp(prefix="eds-bench-warehouse-")
    if args.tables:
        spark.sql(f"CREATE DATABASE IF NOT EXISTS eds_bench LOCATION '{warehouse}/eds_bench.db'")
    with eds.connect() as ddb, eds.connect(backend="spark", spark=spark) as sdb, \
            (eds.connect(backend="spark", spark=spark, spark_database="eds_bench") if args.tables
             else contextlib.nullcontext()) as tdb:
        if "gemm" in only:
            out["gemm"] = gemm(spark, ddb, sdb, args.reps, tdb)
            print(json.dumps(out["gemm"]["times"]), flush=True)
        if "ffn" in only:
            out["ffn"] = ffn(spark, ddb, sdb, args.reps, tdb)
            print(json.dumps(out["ffn"]["times"]), flush=True)
        if "blockmatrix" in only:
            out["block_matrix"] = block_matrix(spark, sdb, 2048, 2048, 2048, 512, args.reps)
            print(json.dumps(out["block_matrix"]), flush=True)
        if "middle" in only:
            out["middle_16x"] = block_matrix(spark, sdb, 512, 8192, 512, 512, args.reps)
            print(json.dumps(out["middle_16x"]), flush=True)
        if tdb is not None:
            for name in tdb.tensors():
                tdb.drop(name)
    spark.stop()
    import shutil

    shutil.rmtree(warehouse, ignore_errors=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(markdown(out))


def _med(ts):
    return f"{statistics.median(ts):.2f} s ({min(ts):.2f}-{max(ts):.2f})"


def markdown(out: dict) -> str:
    lines = [f"Spark bench ({out['date']}, {out['cores']} cores, pyspark {out['pyspark']}, local[{out['cores']}]):", ""]
    for key, label in (("gemm", "GEMM 4096² float32"), ("ffn", "FFN b=4096 d=1024 f=4096 float32")):
        if key not in out:
            continue
        t = out[key]["times"]
        d = statistics.median(t["duckdb"])
        lines.append(f"| {label} | " + " | ".join(
            f"{k} {_med(v)} = {statistics.median(v) / d:.2f}x DuckDB" for k, v in t.items()) + " |")
    for key in ("block_matrix", "middle_16x"):
        if key not in out:
            continue
        r = out[key]
        ours = statistics.median(r["ours"])
        other = (f"BlockMatrix.multiply {_med(r['block_matrix'])} = {statistics.median(r['block_matrix']) / ours:.2f}x ours"
                 if "block_matrix" in r else f"BlockMatrix.multiply failed: {r['block_matrix_error']}")
        lines.append(f"| GEMM {r['shape']} float64, blocks {r['block']}² | ours on Spark {_med(r['ours'])} | {other} |")
    lines += ["", "| workload | step | predicted shuffle | measured | ratio |", "|---|---|---|---|---|"]
    for key in ("gemm", "ffn", "block_matrix", "middle_16x"):
        for row in out.get(key, {}).get("shuffle", []):
            p, m = row["predicted"], row["measured"]
            ratio = "-" if p == m == 0 else (f"{m / p:.2f}" if p else "inf")
            lines.append(f"| {row['workload']} | {row['step']}: {row['describe']} | {p / 1e6:.1f} MB | {m / 1e6:.1f} MB | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
