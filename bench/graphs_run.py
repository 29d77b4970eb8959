"""Benchmark the EinDecomp optimizer: for each graph workload, the EinDecomp plan against the
data-parallel, model-parallel and square-tile plans and a grid of forced chunkings, all run
for real in DuckDB, next to numpy and dask.array on the same graph. Also: cost-model
calibration (predicted vs measured) and the time to plan a 100-node graph.

    .venv/bin/python bench/graphs_run.py          # writes bench/graphs_results.json
    .venv/bin/python bench/graphs_run.py --planning   # planning times only (cold and cached), nothing written
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.plan import TiledValue  # noqa: E402
from eindecomp_sql.plan.cost import tile_of  # noqa: E402
from eindecomp_sql.plan.draft import Draft  # noqa: E402
from eindecomp_sql.plan.graph_plan import GraphPlan  # noqa: E402
from eindecomp_sql.plan.passes.fuse import fuse_elementwise  # noqa: E402
from eindecomp_sql.plan.passes.retiles import insert_retiles  # noqa: E402
from eindecomp_sql.plan.optimize import Choice, _Problem  # noqa: E402
from graph_eval import evaluate  # noqa: E402
from graphs import attention, chain, ffn, llama_block, random_inputs  # noqa: E402

WORKERS = 4
WORKLOADS = {
    "chain6": lambda: chain(sizes=(2048, 512, 3072, 256, 2048, 1024, 768), dtype="float32"),
    "ffn": lambda: ffn(b=4096, d=1024, f=4096, dtype="float32"),
    "attention": lambda: attention(s=1024, d=512, h=8, e=64, dtype="float32"),
    "llama_block": lambda: llama_block(s=512, d=512, h=8, e=64, f=1408, dtype="float32"),
}


def _rss() -> tuple[int, int]:
    rss = hwm = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return rss, hwm


def run_measured(f):
    Path("/proc/self/clear_refs").write_text("5")
    base, _ = _rss()
    t = time.perf_counter()
    r = f()
    elapsed = time.perf_counter() - t
    _, hwm = _rss()
    return r, elapsed, max(hwm - base, 0)


def grid_choices(g, workers):
    """Forced chunkings: every node cuts its leading output label p ways, its last output
    label q ways and its reduced labels r ways; kept if every node has >= workers tasks."""
    inputs = {v.name: v for v in g.inputs}
    prob = _Problem(g.nodes, inputs, {}, workers, None)
    out = {}
    for p, q, r in itertools.product((1, 2, 4, 8), (1, 2, 4), (1, 2)):
        pieces, ok = {}, True
        for n in g.nodes:
            size = n.size
            pc = {lab: 1 for lab in n.labels}
            if n.output:
                pc[n.output[0]] = min(p, size[n.output[0]])
                if len(n.output) > 1:
                    pc[n.output[-1]] = min(q, size[n.output[-1]])
            for lab in n.reduced:
                pc[lab] = min(r, size[lab])
            pc = {lab: -(-size[lab] // tile_of(size[lab], d)) for lab, d in pc.items()}
            if np.prod(list(pc.values())) < workers:
                ok = False
            pieces[n.result.name] = pc
        if ok:
            tiles = prob.free_input_tiles(pieces, {})
            out[f"grid p{p} q{q} r{r}"] = Choice(pieces, tiles, prob.evaluate(pieces, tiles))
    return out


def plan_from_choice(g, choice, name) -> GraphPlan:
    last = g.nodes[-1].result  # what g.plan() computes: the last-added value
    inputs = tuple(TiledValue(v.name, v.shape, v.dtype, choice.input_tiles.get(v.name, v.shape),
                              tuple(f"d{k}" for k in range(len(v.shape)))) for v in g.inputs)
    # fused as the optimizer's plans are, so the grid compares chunkings, not fusion
    plan = fuse_elementwise(insert_retiles(Draft(tuple(g.nodes), inputs, (last.name,), choice=choice))).plan()
    return GraphPlan(g.nodes, g.inputs, (last,), name, WORKERS, None, choice, plan, {}, single=True)


def bench_workload(name, make, reps=3):
    g, ref = make()
    xs = random_inputs(g, 0)
    want = ref(**xs)
    db = eds.connect()
    plans = {s: g.plan(workers=WORKERS, strategy=s) for s in ("eindecomp", "data-parallel", "model-parallel",
                                                                "square-tiles")}
    plans["eindecomp (workers=1)"] = g.plan(workers=1)
    rows = {}
    for label, p in plans.items():
        out = p.run(db, **xs)
        err = float(np.max(np.abs(out.to_numpy() - want)) / (np.max(np.abs(want)) + 1e-30))
        ts, peaks = [], []
        for _ in range(reps):
            _, t, peak = run_measured(lambda: p.run(db, **xs))
            ts.append(t)
            peaks.append(peak)
        rows[label] = {"cost": p.cost, "retiles": p.retiles, "time": float(np.median(ts)), "times": ts,
                       "peak_bytes": int(np.median(peaks)), "projected_peak": p.plan.peak_bytes, "rel_err": err}
        print(f"  {label:24s} cost {p.cost / 1e6:9.1f} MB  time {np.median(ts):.3f} s", flush=True)
    grid, grid_plans = {}, {}
    for label, choice in grid_choices(g, WORKERS).items():
        p = plan_from_choice(g, choice, label)
        p.run(db, **xs)
        _, t, _ = run_measured(lambda: p.run(db, **xs))
        grid[label] = {"cost": p.cost, "time": t, "times": [t]}
        grid_plans[label] = p
    # one run each is noisy: the three fastest grid plans run again, interleaved round by round
    # with the EinDecomp plan, and everything compared by medians of the same rounds
    top = sorted(grid, key=lambda k: grid[k]["time"])[:3]
    final = {k: [] for k in top + ["eindecomp"]}
    for _ in range(reps):
        for k in final:
            p = plans["eindecomp"] if k == "eindecomp" else grid_plans[k]
            final[k].append(run_measured(lambda: p.run(db, **xs))[1])
    for k in top:
        grid[k]["times"] += final[k]
        grid[k]["time"] = float(np.median(final[k]))
    rows["eindecomp"]["times_vs_grid"] = final["eindecomp"]
    rows["eindecomp"]["time_vs_grid"] = float(np.median(final["eindecomp"]))
    best = min(top, key=lambda k: grid[k]["time"])
    print(f"  grid best {best}: {grid[best]['time']:.3f} s (eindecomp in the same rounds "
          f"{rows['eindecomp']['time_vs_grid']:.3f} s) of {len(grid)} plans", flush=True)
    peers = {}
    ts = [run_measured(lambda: evaluate(g, xs))[1] for _ in range(reps)]
    peers["numpy"] = float(np.median(ts))
    import dask.array as da

    dxs = {k: da.from_array(v, chunks=1024) for k, v in xs.items()}
    evaluate(g, dxs, xp=da)
    ts = [run_measured(lambda: evaluate(g, dxs, xp=da))[1] for _ in range(reps)]
    peers["dask.array"] = float(np.median(ts))
    print(f"  numpy {peers['numpy']:.3f} s  dask {peers['dask.array']:.3f} s", flush=True)
    db.close()
    return {"plans": rows, "grid": grid, "grid_best": best, "peers": peers,
            "nodes": len(g.nodes), "explain": plans["eindecomp"].explain(sql=False)}


def planning_time_100_nodes():
    g = eds.Graph()
    x = g.input("x", (4096, 1024))
    h = x
    for k in range(25):  # 25 residual FFN layers: 4 nodes each
        w1 = g.input(f"w1_{k}", (1024, 4096))
        w2 = g.input(f"w2_{k}", (4096, 1024))
        a = g.map("relu", g.einsum("bi,io->bo", h, w1))
        h = g.add(h, g.einsum("bo,oi->bi", a, w2))
    from eindecomp_sql.plan.graph_plan import _plan_cached

    ts = []
    for _ in range(3):  # median of 3: the machine is shared
        _plan_cached.cache_clear()  # cold: a cached plan would measure nothing
        t = time.perf_counter()
        g.plan(workers=4)
        ts.append(time.perf_counter() - t)
    return len(g.nodes), float(np.median(ts))


def planning_times(reps: int = 7) -> dict:
    """Seconds to plan each workload (the benchmark's sizes) at workers 1, 2, 4, 8: cold (a
    freshly built graph and an empty plan cache) and cached (the same call again); medians of
    ``reps`` rounds, as the machine is shared."""
    from eindecomp_sql.plan.graph_plan import _plan_cached

    out = {}
    for name, make in WORKLOADS.items():
        for workers in (1, 2, 4, 8):
            cold, cached = [], []
            for _ in range(reps):
                _plan_cached.cache_clear()
                g, _ = make()
                t = time.perf_counter()
                g.plan(workers=workers)
                cold.append(time.perf_counter() - t)
                t = time.perf_counter()
                g.plan(workers=workers)
                cached.append(time.perf_counter() - t)
            row = {"nodes": len(g.nodes), "cold": float(np.median(cold)), "cached": float(np.median(cached))}
            out[f"{name} workers={workers}"] = row
            print(f"  plan {name:12s} ({row['nodes']:2d} nodes) workers={workers}: cold {row['cold'] * 1e3:6.1f} ms"
                  f"  cached {row['cached'] * 1e3:6.3f} ms", flush=True)
    return out


def main():
    if "--planning" in sys.argv[1:]:
        planning_times()
        n, t = planning_time_100_nodes()
        print(f"planning a {n}-node graph: {t:.3f} s")
        return
    results = {"workers": WORKERS, "workloads": {}}
    only = sys.argv[1:]
    for name, make in WORKLOADS.items():
        if only and name not in only:
            continue
        print(f"graph {name} ...", flush=True)
        results["workloads"][name] = bench_workload(name, make)
    results["planning_times"] = planning_times()
    n, t = planning_time_100_nodes()
    results["planning"] = {"nodes": n, "seconds": t}
    print(f"planning a {n}-node graph: {t:.3f} s")
    (HERE / "graphs_results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
