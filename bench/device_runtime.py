"""Issue 11's scheduler benchmark, on the simulated device (no GPU needed): the LLaMA block's
plan as tile tasks (udfs/runtime.py, backends/device_tasks.py) run by the worker with its device
cache capped below the working set, furthest-next-use eviction with dynamic order (the runtime)
against static order with LRU eviction (and the two mixed), counting host->device bytes against
Belady's count for the order each ran, and the simulated time.

The device is simulated (``SimulatedDevice``: H100-like rates, pinned-memory transfers at 55
GB/s each way, 50 TFLOP/s, 3 TB/s, 10 us a transfer, completion times jittered by up to 30%):
the bytes are exact, the times are the cost model's. The kernels are real (numpy) and every
result is checked against numpy.

    .venv/bin/python bench/device_runtime.py [--seeds 3] [--fractions 0.5,0.15,0.08] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

from eindecomp_sql.backends.device_tasks import assemble, host_tiles, plan_tasks  # noqa: E402
from eindecomp_sql.backends.reference import _keys  # noqa: E402
from eindecomp_sql.udfs.runtime import SimulatedDevice, TileRuntime, belady_bytes  # noqa: E402
from graphs import random_inputs  # noqa: E402
from graphs_run import WORKLOADS  # noqa: E402

POLICIES = [("furthest", "dynamic"), ("lru", "static"), ("furthest", "static"), ("lru", "dynamic")]


def device(seed: int) -> SimulatedDevice:
    return SimulatedDevice(h2d=55e9, d2h=55e9, flops=50e12, bandwidth=3e12, latency=10e-6, copy_streams=2,
                           jitter=0.3, seed=seed)


def bench(workers: int, fraction: float, seeds: int) -> dict:
    g, ref = WORKLOADS["llama_block"]()
    xs = random_inputs(g, 0)
    want = ref(**xs)
    plan = g.plan(workers=workers).plan
    tasks = plan_tasks(plan)
    host = {}
    for v in plan.inputs:
        host.update(host_tiles(v, xs[v.name]))
    out = plan.outputs[0]
    keep = [(out.name, k) for k in _keys(out.shape, out.tile)]
    sizes = {tid: a.nbytes for tid, a in host.items()} | {t.output: t.out_bytes for t in tasks}
    working = sum(sizes.values())
    need = max(sum(sizes[i] for i in set(t.inputs) | {t.output}) for t in tasks)
    budget = max(int(working * fraction), need)
    by_name = {t.name: t for t in tasks}
    rows = {}
    for eviction, order in POLICIES:
        runs = []
        for seed in range(seeds):
            rt = TileRuntime(device(seed), budget=budget, eviction=eviction, order=order)
            got = assemble(out, rt.run(tasks, host, keep))
            assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max())), (eviction, order)
            assert rt.stats.peak_bytes <= budget
            belady = belady_bytes([by_name[n] for n in rt.stats.order], sizes, budget)
            runs.append({"h2d": rt.stats.h2d_bytes, "d2h": rt.stats.d2h_bytes, "belady": belady,
                         "seconds": rt.stats.seconds, "peak": rt.stats.peak_bytes})
        rows[f"{eviction}/{order}"] = runs
    return {"workers": workers, "fraction": fraction, "tasks": len(tasks), "working_set": working,
            "inputs": sum(a.nbytes for a in host.values()), "budget": budget, "runs": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "device_runtime.json"))
    ap.add_argument("--fractions", default="0.5,0.15,0.08",
                    help="device budgets as fractions of the working set (never below the largest task)")
    ap.add_argument("--table-only", action="store_true", help="print the table of --out, run nothing")
    args = ap.parse_args()
    if args.table_only:
        table(json.loads(Path(args.out).read_text()))
        return
    fractions = [float(f) for f in args.fractions.split(",")]
    results = [bench(w, f, args.seeds) for w in (1, 4, 8) for f in fractions]
    Path(args.out).write_text(json.dumps(results, indent=1))
    table(results)


def table(results: list) -> None:
    seen = set()
    results = [r for r in results if not ((r["workers"], r["budget"]) in seen or seen.add((r["workers"], r["budget"])))]
    print("| plan | tasks | budget / working set | policy | host->device MB | / Belady | device->host MB | "
          "simulated ms (min-max) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for policy, runs in r["runs"].items():
            h2d = statistics.median(x["h2d"] for x in runs)
            ratio = statistics.median(x["h2d"] / x["belady"] for x in runs)
            d2h = statistics.median(x["d2h"] for x in runs)
            ms = [x["seconds"] * 1e3 for x in runs]
            print(f"| workers={r['workers']} | {r['tasks']} | {r['budget'] / 1e6:.1f} / {r['working_set'] / 1e6:.1f} MB "
                  f"| {policy} | {h2d / 1e6:.1f} | {ratio:.2f}x | {d2h / 1e6:.1f} | "
                  f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")


if __name__ == "__main__":
    main()
