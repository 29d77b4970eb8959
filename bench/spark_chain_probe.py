"""The Spark bench's FFN (bench/graphs_run.py WORKLOADS["ffn"], float32, arrays in) planned as
``g.run`` plans it on a local Spark session, with and without fused chains
(plan/passes/chains.py), interleaved, medians of ``--reps`` after two warm-ups each.

    .venv/bin/python bench/spark_chain_probe.py [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.plan import graph_plan  # noqa: E402
from graphs import random_inputs  # noqa: E402
from graphs_run import WORKLOADS  # noqa: E402
from spark_bench import spark_session  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    spark = spark_session()
    g, ref = WORKLOADS["ffn"]()
    xs = random_inputs(g, 0)
    want = ref(**xs)
    with eds.connect(backend="spark", spark=spark) as db:
        plans = {}
        for mode in ("never", "auto"):
            graph_plan.CHAINS = mode
            graph_plan._plan_cached.cache_clear()
            plans[mode] = graph_plan.plan_graph(g, workers=db.workers, memory=db.plan_budget,
                                                tile_bytes=db.tile_bytes, costs=db.backend.cost_model)
            print(mode, plans[mode].plan.explain().splitlines()[0], flush=True)
            for _ in range(2):
                got = plans[mode].run(db, **xs).to_numpy()
            assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max())), mode
        times = {m: [] for m in plans}
        for _ in range(args.reps):
            for m, p in plans.items():
                t = time.perf_counter()
                p.run(db, **xs)
                times[m].append(time.perf_counter() - t)
        for m, ts in times.items():
            print(f"{m}: {statistics.median(ts):.3f} s ({min(ts):.3f}-{max(ts):.3f})")
    spark.stop()


if __name__ == "__main__":
    main()
