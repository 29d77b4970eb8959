"""Issue 11: host->device bytes of the SQL path's device cache against Belady's count.

Runs a graph (the LLaMA block by default) through a ``device="cuda"`` session whose tile cache
is capped at a fraction of the graph's working set, three times in a row (weights and
activations stored, so every tile has a name), and for runs 2 and 3 compares the bytes the
kernels sent with Belady's offline count (``udfs/runtime.belady_bytes``: furthest next use,
for the same order of kernel calls, the same budget, the cache's contents at the run's start).
Both eviction rules run side by side: the plan-aware one the product uses, and least recently
used. Bytes do not depend on the device's speed, so the CPU stand-in (tests/simcupy.py) gives
the same counts as a GPU (``--namespace cupy`` runs it on one).

    .venv/bin/python bench/device_bytes.py [--graph llama_block] [--fractions 1,0.5,0.25]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # simcupy, graphs


def run(graph: str, fraction: float | None, policy: str, namespace: str, fuse: bool, workers: int,
        working_set: int | None = None) -> dict:
    import eindecomp_sql as eds
    import graphs
    from eindecomp_sql.plan.graph_plan import plan_graph
    from eindecomp_sql.udfs.device_cache import DeviceCache
    from eindecomp_sql.udfs.runtime import belady_of_calls

    g, ref = getattr(graphs, graph)(**SIZES[graph])
    budget = int(fraction * working_set) if fraction is not None else 1 << 40
    admit = DeviceCache._admit
    if policy == "lru":  # the same cache, blind to the plan's future
        DeviceCache._admit = lambda self, tid, a, n, next_use, held, pin=False: admit(self, tid, a, n, None, held, pin)
    try:
        with eds.connect(device="cuda", device_memory=budget, tile_bytes=1 << 40) as db:
            xs = graphs.random_inputs(g, seed=1)
            for name, x in xs.items():
                db.store(name, x, replace=True)
            plan = plan_graph(g, workers=workers, fuse=fuse, inputs={n: db.tensor(n) for n in xs},
                              costs=db.backend.cost_model)
            state = db.backend.kernels
            cache = state.device_cache
            rows = []
            for r in range(3):
                start = set(cache._tiles)
                state.device_trace, state.device_sent, state.device_returned = [], 0, 0
                got = plan.run(db, **{n: n for n in xs}).to_numpy()
                np.testing.assert_allclose(got, ref(**xs), rtol=1e-4, atol=1e-4)
                trace = state.device_trace
                sizes = {tid: n for _, _, nb in trace for tid, n in nb.items()}
                touched = sum(sizes.values())
                best = belady_of_calls(trace, budget, start) if fraction is not None else None
                rows.append({"run": r + 1, "sent": state.device_sent, "belady": best, "touched": touched,
                             "returned": state.device_returned,
                             "peak": cache.peak, "calls": len(trace)})
            state.device_trace = None
            return {"budget": budget, "steps": len(plan.plan.steps), "rows": rows}
    finally:
        DeviceCache._admit = admit


SIZES = {"llama_block": dict(s=64, d=128, h=4, e=32, f=256, dtype="float32"),
         "attention": dict(s=64, d=96, h=4, e=24, dtype="float32"),
         "ffn": dict(b=128, d=96, f=384, dtype="float32")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", default="llama_block", choices=sorted(SIZES))
    ap.add_argument("--fractions", default="0.5,0.25")
    ap.add_argument("--namespace", default="simcupy")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--fuse", action="store_true", help="fused plans (fewer, bigger steps)")
    args = ap.parse_args()
    from eindecomp_sql.udfs import devices

    devices.KERNELS["cuda"] = (devices.KERNELS["cuda"][0], args.namespace)
    # the working set: every tile one run's kernel calls touch, with room for all of them
    whole = run(args.graph, None, "plan", args.namespace, args.fuse, args.workers)
    ws = whole["rows"][0]["touched"]
    print(f"{args.graph}: {whole['steps']} steps (fuse={args.fuse}, workers={args.workers}), "
          f"working set {ws / 1e6:.2f} MB; sent per run with room for everything: "
          f"{', '.join(format(r['sent'] / 1e6, '.2f') for r in whole['rows'])} MB; back to the host: "
          f"{', '.join(format(r['returned'] / 1e6, '.2f') for r in whole['rows'])} MB")
    print("| cache (of the working set) | eviction | run | sent MB | Belady MB | sent / Belady | cache peak MB "
          "| back to the host MB |")
    print("|---|---|---|---|---|---|---|---|")
    for frac in (float(f) for f in args.fractions.split(",")):
        for policy in ("plan", "lru"):
            out = run(args.graph, frac, policy, args.namespace, args.fuse, args.workers, ws)
            for row in out["rows"][1:]:
                ratio = row["sent"] / row["belady"] if row["belady"] else float("nan")
                print(f"| {frac:.0%} ({out['budget'] / 1e6:.2f} MB) | {policy} | {row['run']} | "
                      f"{row['sent'] / 1e6:.2f} | {row['belady'] / 1e6:.2f} | {ratio:.2f} | {row['peak'] / 1e6:.2f} | "
                      f"{row['returned'] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
