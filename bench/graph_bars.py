"""The graph bars of issue 9: each benchmark graph under its default plan (EinDecomp, workers=1,
fused: element-wise nodes into their einsums, single-tile steps into programs) against numpy and
dask.array on the same graph, node by node, with the element-wise-only, unfused and workers=4
plans beside it. One process, every method once per round in a shuffled order (a
run right after dask's came out slower: its threads and freed memory linger), medians.

    .venv/bin/python bench/graph_bars.py [--rounds 11] [--only ffn,attention] [--out FILE] [--pair]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from graph_eval import evaluate  # noqa: E402
from graphs import random_inputs  # noqa: E402
from graphs_run import WORKLOADS  # noqa: E402


def bench(name: str, rounds: int, dask: bool = True, only_default: bool = False) -> dict:
    import dask.array as da

    g, ref = WORKLOADS[name]()
    xs = random_inputs(g, 0)
    dxs = {k: da.from_array(v, chunks=1024) for k, v in xs.items()}
    db = eds.connect()
    plans = {"default (fused, workers=1)": g.plan(), "element-wise fusion only": g.plan(fuse="elementwise"),
             "unfused, workers=1": g.plan(fuse=False), "fused, workers=4": g.plan(workers=4)}
    want = ref(**xs)
    for label, p in plans.items():  # every plan checked against numpy before it is timed
        got = p.run(db, **xs).to_numpy()
        assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max())), label
    fns = {label: (lambda p=p: p.run(db, **xs)) for label, p in plans.items()}
    fns["numpy"] = lambda: evaluate(g, xs)
    if only_default:
        fns = {k: f for k, f in fns.items() if k in ("default (fused, workers=1)", "numpy")}
    if dask:
        fns["dask.array"] = lambda: evaluate(g, dxs, xp=da)
        fns["dask.array"]()
    times = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns)
        random.Random(r).shuffle(order)
        for k in order:
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    db.close()
    steps = {label: len(p.plan.steps) for label, p in plans.items()}
    return {"times": times, "steps": steps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--only", help="comma-separated graph names")
    ap.add_argument("--out", default=str(HERE / "graph_bars.json"), help="where the JSON goes")
    ap.add_argument("--pair", action="store_true",
                    help="only the default plan and numpy, alternating (no dask.array, no other plans)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(WORKLOADS)
    out = {name: bench(name, args.rounds, dask=not args.pair, only_default=args.pair) for name in names}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| graph | method | steps | median s (min-max) | ratio to numpy |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        base = statistics.median(r["times"]["numpy"])
        for k, ts in r["times"].items():
            m = statistics.median(ts)
            print(f"| {name} | {k} | {r['steps'].get(k, '-')} | {m:.3f} ({min(ts):.3f}-{max(ts):.3f}) | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
