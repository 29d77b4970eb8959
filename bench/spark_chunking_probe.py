"""GEMM 4096² float32 on local Spark: operands stored in the plan's chunking against the default
tiles, interleaved in one session with DuckDB's path (bench/RESULTS.md, "tensors as Spark tables,
operands in the plan's chunking").

    .venv/bin/python bench/spark_chunking_probe.py [--rounds 8] [--tables]

The plan's chunking: the tiles the Spark plan reads the arrays in (A whole, B in two column
panels), so the run re-tiles nothing; default tiles: ``store`` without ``tile=`` (32 MiB row
panels), which the plan re-tiles by rows. The first two rounds are dropped (Spark's JIT).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from spark_bench import spark_session  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tables", action="store_true", help="keep the tensors as Spark tables")
    args = ap.parse_args()
    spark = spark_session()
    n = 4096
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    options = {}
    if args.tables:
        spark.sql(f"CREATE DATABASE IF NOT EXISTS eds_probe LOCATION '{tempfile.mkdtemp()}/eds_probe.db'")
        options["spark_database"] = "eds_probe"
    with eds.connect() as ddb, eds.connect(backend="spark", spark=spark, **options) as sdb:
        tiles = [v.tile for v in sdb.plan("ij,jk->ik", a, b).inputs]
        A, B = sdb.store("A", a, replace=True), sdb.store("B", b, replace=True)
        PA = sdb.store("PA", a, tile=tiles[0], replace=True)
        PB = sdb.store("PB", b, tile=tiles[1], replace=True)
        DA, DB = ddb.store("A", a), ddb.store("B", b)
        print("plan's chunking", tiles, "default", A.tile, B.tile)
        runs = {"duckdb": lambda: ddb.einsum("ij,jk->ik", DA, DB),
                "spark, default tiles": lambda: sdb.einsum("ij,jk->ik", A, B),
                "spark, plan's chunking": lambda: sdb.einsum("ij,jk->ik", PA, PB)}
        t = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, f in runs.items():
                s = time.perf_counter()
                f()
                t[k].append(time.perf_counter() - s)
        base = statistics.median(t["duckdb"][2:])
        for k, v in t.items():
            v = v[2:]
            print(f"{k}: {statistics.median(v):.2f} s ({min(v):.2f}-{max(v):.2f}), "
                  f"{statistics.median(v) / base:.2f}x DuckDB")
        if args.tables:
            for name in sdb.tensors():
                sdb.drop(name)
    spark.stop()


if __name__ == "__main__":
    main()
