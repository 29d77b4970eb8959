"""Storing a Spark DataFrame in element form on the Spark backend: tiled by Spark
(``backends/spark_frames.py``) against the rows read whole into this process (the driver path
every other source takes: Arrow, a dense array, tiles), side by side in one session. And the
way out: ``to_spark("elements")`` of the stored tensor, filtered (``value > 0``) and counted by
Spark (the "out" line).

    .venv/bin/python bench/spark_ingest_bench.py [--side 2000] [--density 1.0] [--rounds 5]

The frame is made by Spark (``range``: index columns ``i``, ``j`` and a double ``v``), so its rows
are Spark's, as a user's data would be. Reports medians (min-max) after one warm-up each, and
the driver process's peak resident memory rise for each way (``ru_maxrss`` of a child process).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def child(side: int, density: float, rounds: int, way: str) -> dict:
    sys.path.insert(0, str(HERE))
    import numpy as np

    import eindecomp_sql as eds
    from eindecomp_sql import io
    from spark_bench import spark_session

    spark = spark_session()
    df = spark.range(side * side).selectExpr(f"id DIV {side} AS i", f"id % {side} AS j", "rand(7) AS v")
    if density < 1:
        df = df.where(f"rand(11) < {density}")
    df = df.cache()
    n = df.count()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    with eds.connect(backend="spark", spark=spark) as db:
        if way == "driver":  # what store() does with any other table: rows into this process whole
            def store():
                return db.store("E", io.as_table(df, "bench"), value="v", shape=(side, side), replace=True)
        else:
            def store():
                return db.store("E", df, value="v", shape=(side, side), replace=True)
        T = store()  # the warm-up
        for _ in range(rounds):
            t = time.perf_counter()
            store()
            times.append(time.perf_counter() - t)
        rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024  # before reading it back
        tile = T.tile
        out = []
        if way == "spark":
            for _ in range(rounds):
                t = time.perf_counter()
                db.tensor("E").to_spark("elements").where("value > 0").count()
                out.append(time.perf_counter() - t)
        got = db.tensor("E").to_numpy()
        want = np.zeros((side, side))
        rows = df.toPandas()
        want[rows["i"].to_numpy(), rows["j"].to_numpy()] = rows["v"].to_numpy()
        assert np.array_equal(got, want)
    spark.stop()
    return {"way": way, "rows": n, "times": times, "tile": tile, "driver_peak_rise": rise, "out": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=2000)
    ap.add_argument("--density", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.side, args.density, args.rounds, args.child)))
        return
    out = []
    for way in ("spark", "driver"):
        r = subprocess.run([sys.executable, __file__, "--side", str(args.side), "--density", str(args.density),
                            "--rounds", str(args.rounds), "--child", way],
                           stdout=subprocess.PIPE, text=True, check=True, env=dict(os.environ))
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"{args.side}² elements, density {args.density}, {out[0]['rows']:,} rows, tile {out[0]['tile']}, "
          f"{os.cpu_count()} cores:")
    for r in out:
        t = r["times"]
        print(f"  {r['way']:>6}: {statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f}), "
              f"driver peak rise {r['driver_peak_rise'] / 1e6:.0f} MB")
        if r["out"]:
            o = r["out"]
            print(f"     out: to_spark('elements') filtered and counted {statistics.median(o):.2f} s "
                  f"({min(o):.2f}-{max(o):.2f})")


if __name__ == "__main__":
    main()
