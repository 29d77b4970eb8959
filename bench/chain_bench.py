"""Fused chains (plan/passes/chains.py) against the plan without them, on the FFN
``relu(x @ w1) @ w2`` (or LLaMA's SwiGLU, ``--graph swiglu``) where a budget or a tile cap
cuts it: both plans in one process, interleaved rounds, medians (min-max), numpy beside them.

    .venv/bin/python bench/chain_bench.py [--shapes 2048x1024x8192,4096x1024x8192] [--memory 400MB]
        [--tile-bytes N] [--dtype float32] [--rounds 5] [--graph relu|swiglu] [--stored]
        [--out bench/chain_bench.json]

Pin it with ``taskset -c 0`` / ``0,1`` to compare core counts (numpy's BLAS threads follow the
affinity; the kernels' pool is sized from it too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.plan import graph_plan  # noqa: E402


def ffn(b: int, d: int, f: int, dtype: str, kind: str = "relu"):
    """``relu(x @ w1) @ w2``, or LLaMA's ``(silu(x @ w1) * (x @ w3)) @ w2`` (kind "swiglu")."""
    g = eds.Graph()
    x, w1, w2 = g.input("x", (b, d), dtype), g.input("w1", (d, f), dtype), g.input("w2", (f, d), dtype)
    if kind == "swiglu":
        w3 = g.input("w3", (d, f), dtype)
        act = g.elementwise("x * sigmoid(x) * y", g.einsum("bi,io->bo", x, w1), g.einsum("bi,io->bo", x, w3))
    else:
        act = g.map("relu", g.einsum("bi,io->bo", x, w1))
    g.einsum("bo,oi->bi", act, w2, name="y")
    return g


def reference(xs: dict) -> np.ndarray:
    """The FFN in numpy (float32 products for float32 inputs, as numpy users run it)."""
    h = xs["x"] @ xs["w1"]
    if "w3" in xs:
        return (h / (1 + np.exp(-h)) * (xs["x"] @ xs["w3"])) @ xs["w2"]
    return np.maximum(h, 0) @ xs["w2"]


def plan(db, g, mode: str, inputs=None):
    graph_plan.CHAINS = mode
    graph_plan._plan_cached.cache_clear()
    try:
        return graph_plan.plan_graph(g, workers=db.workers, memory=db.plan_budget, tile_bytes=db.tile_bytes,
                                     costs=db.backend.cost_model, inputs=inputs)
    finally:
        graph_plan.CHAINS = "auto"
        graph_plan._plan_cached.cache_clear()


def stored_plan(db, g, mode: str, xs: dict):
    """As bench/gpu_bench.py runs the FFN: the weights stored in the tiles that mode's plan
    reads them in (so no run re-tiles them), x passed as an array."""
    free = plan(db, g, mode)
    stored = {w: db.store(f"chain_{mode}_{w}", xs[w], tile=free.plan_input_tile(w), replace=True)
              for w in xs if w != "x"}
    return plan(db, g, mode, inputs=stored), stored


def one(shape: tuple[int, int, int], dtype: str, memory, tile_bytes, rounds: int, stored: bool = False,
        kind: str = "relu") -> dict:
    b, d, f = shape
    rng = np.random.default_rng(0)
    xs = {"x": rng.standard_normal((b, d), dtype=np.float32).astype(dtype),
          "w1": (rng.standard_normal((d, f), dtype=np.float32) / np.sqrt(d)).astype(dtype),
          "w2": (rng.standard_normal((f, d), dtype=np.float32) / np.sqrt(f)).astype(dtype)}
    if kind == "swiglu":
        xs["w3"] = (rng.standard_normal((d, f), dtype=np.float32) / np.sqrt(d)).astype(dtype)
    g = ffn(b, d, f, dtype, kind)
    with eds.connect(memory=memory, tile_bytes=tile_bytes) as db:
        args = {k: {} for k in ("unchained", "chained", "auto")}
        if stored:
            plans = {}
            for k, mode in (("unchained", "never"), ("chained", "always"), ("auto", "auto")):
                plans[k], weights = stored_plan(db, g, mode, xs)
                args[k] = weights
        else:
            plans = {"unchained": plan(db, g, "never"), "chained": plan(db, g, "always"), "auto": plan(db, g, "auto")}
        res = {"graph": kind, "shape": list(shape), "dtype": dtype, "memory": memory, "tile_bytes": tile_bytes, "stored": stored,
               "auto_picks": "chained" if _chained(plans["auto"]) else "unchained",
               "plans": {k: p.plan.explain().splitlines()[0] for k, p in plans.items() if k != "auto"},
               "times": {"numpy": [], "unchained": [], "chained": []}}
        want = reference({k: a.astype(np.float64) for k, a in xs.items()})
        for k in ("unchained", "chained"):  # a warm-up each, and the results checked
            got = plans[k].run(db, **{**xs, **args[k]}).to_numpy()
            res[f"max_rel_err_{k}"] = float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())
        for _ in range(rounds):
            t = time.perf_counter()
            reference(xs)
            res["times"]["numpy"].append(time.perf_counter() - t)
            for k in ("unchained", "chained"):
                t = time.perf_counter()
                plans[k].run(db, **{**xs, **args[k]}).to_numpy()
                res["times"][k].append(time.perf_counter() - t)
    return res


def _chained(p) -> bool:
    return any(getattr(s, "node", None) is not None and s.node.held for s in p.plan.steps)


def _med(ts):
    return f"{statistics.median(ts):.3f} s ({min(ts):.3f}-{max(ts):.3f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2048x1024x8192,4096x1024x8192")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--memory", default="400MB")
    ap.add_argument("--tile-bytes", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stored", action="store_true", help="weights stored as each plan reads them (gpu_bench's FFN)")
    ap.add_argument("--graph", choices=("relu", "swiglu"), default="relu",
                    help="the FFN's activation: relu(x @ w1), or LLaMA's silu(x @ w1) * (x @ w3)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    memory = None if args.memory in ("", "none") else args.memory
    out = {"machine": platform.machine(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
           "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for s in args.shapes.split(","):
        shape = tuple(int(v) for v in s.split("x"))
        r = one(shape, args.dtype, memory, args.tile_bytes, args.rounds, args.stored, args.graph)
        out["runs"].append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nFused chains ({out['date']}, {out['cores']} cores, memory={memory}, tile_bytes={args.tile_bytes}"
          f"{', weights stored' if args.stored else ''}):\n")
    print(f"| FFN ({args.graph}) b x d x f | numpy | unchained | chained | chained / unchained | auto picks |")
    print("|---|---|---|---|---|---|")
    for r in out["runs"]:
        t = r["times"]
        ratio = statistics.median(t["chained"]) / statistics.median(t["unchained"])
        print(f"| {'x'.join(map(str, r['shape']))} {r['dtype']} | {_med(t['numpy'])} | {_med(t['unchained'])} | "
              f"{_med(t['chained'])} | {ratio:.2f}x | {r['auto_picks']} |")


if __name__ == "__main__":
    main()
