"""A graph of the graph benchmark (bench/graphs_run.py's sizes, float32, arrays in) planned for
2 and 4 workers with and without fused chains (the plans that changed: bench/RESULTS.md "Fused
chains"), interleaved with numpy, medians of 7 (min, max) after a warm-up each; every result
checked against numpy.

    .venv/bin/python bench/chain_graph_probe.py [--graph ffn|llama_block] [--workers 2,4]
    # or under taskset -c 0
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from graphs import random_inputs  # noqa: E402
from graphs_run import WORKLOADS  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.plan import graph_plan  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--graph", default="ffn", choices=sorted(WORKLOADS))
ap.add_argument("--workers", default="2,4")
ap.add_argument("--rounds", type=int, default=7)
args = ap.parse_args()
g, ref = WORKLOADS[args.graph]()
xs = random_inputs(g)
want = ref(**{k: v.astype(np.float64) for k, v in xs.items()})
with eds.connect() as db:
    for workers in (int(w) for w in args.workers.split(",")):
        plans = {}
        for m in ("never", "auto"):
            graph_plan.CHAINS = m
            graph_plan._plan_cached.cache_clear()
            plans[m] = graph_plan.plan_graph(g, workers=workers)
            got = plans[m].run(db, **xs).to_numpy()
            err = float(np.abs(got - want).max() / np.abs(want).max())
            assert err < 1e-4, (m, err)
        graph_plan.CHAINS = "auto"
        graph_plan._plan_cached.cache_clear()
        t = {m: [] for m in plans}
        tn = []
        for r in range(args.rounds):
            s = time.perf_counter()
            ref(**xs)
            tn.append(time.perf_counter() - s)
            for m, p in plans.items():
                s = time.perf_counter()
                p.run(db, **xs).to_numpy()
                t[m].append(time.perf_counter() - s)
        print(args.graph, "workers", workers,
              {m: (len(p.plan.steps), round(statistics.median(t[m]), 3), round(min(t[m]), 3), round(max(t[m]), 3))
               for m, p in plans.items()}, "numpy", round(statistics.median(tn), 3), flush=True)
        for m, p in plans.items():
            print("   ", m, [s.describe() for s in p.plan.steps])
