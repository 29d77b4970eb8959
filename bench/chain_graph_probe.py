"""The graph benchmark's FFN (b=4096, d=1024, f=4096 float32, arrays in) planned for 2 and 4
workers with and without fused chains (the plans that changed: bench/RESULTS.md "Fused
chains"), interleaved with numpy, medians of 7 (min, max) after a warm-up each.

    .venv/bin/python bench/chain_graph_probe.py      # or under taskset -c 0
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent))
from graphs import ffn  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.plan import graph_plan  # noqa: E402
g, ref = ffn(b=4096, d=1024, f=4096, dtype="float32")
rng = np.random.default_rng(0)
xs = {v.name: (rng.standard_normal(v.shape) / 30).astype(np.float32) for v in g.inputs}
with eds.connect() as db:
    for workers in (2, 4):
        plans = {}
        for m in ("never", "auto"):
            graph_plan.CHAINS = m; graph_plan._plan_cached.cache_clear()
            plans[m] = graph_plan.plan_graph(g, workers=workers)
            plans[m].run(db, **xs)
        t = {m: [] for m in plans}; tn = []
        for r in range(7):
            s = time.perf_counter(); ref(**xs); tn.append(time.perf_counter() - s)
            for m, p in plans.items():
                s = time.perf_counter(); p.run(db, **xs).to_numpy(); t[m].append(time.perf_counter() - s)
        print(workers, {m: (len(p.plan.steps), round(statistics.median(t[m]), 3), round(min(t[m]),3), round(max(t[m]),3)) for m, p in plans.items()}, "numpy", round(statistics.median(tn), 3))
