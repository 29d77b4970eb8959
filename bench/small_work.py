"""Small work, side by side in one process: a 64² GEMM on stored tensors through ``db.einsum``
(a temporary result table, and a kept one replaced call after call) and ``db.einsum_numpy`` (an array back), ``eds.einsum`` on arrays,
numpy, and the planning + compile cost of a repeated einsum (both cached). Interleaved round by
round; medians and min-max in ms. With ``--cores`` it re-runs itself pinned (``taskset``) to each
core count and reports every run.

    .venv/bin/python bench/small_work.py                 # this process, all cores
    .venv/bin/python bench/small_work.py --cores 1,2,16  # pinned runs; writes bench/small_work.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

N, ROUNDS, INNER = 64, 30, 20


def measure() -> dict:
    import eindecomp_sql as eds
    from eindecomp_sql.compile import compile_plan

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((N, N)), rng.standard_normal((N, N))
    with eds.connect() as db:
        A, B = db.store("A", a), db.store("B", b)

        def temp_result():
            r = db.einsum("ij,jk->ik", A, B)
            del r  # dropped at the next call, as in a loop

        methods = {
            "db.einsum (stored, temporary result)": temp_result,
            # a kept result replaced call after call, operands by name: the catalog's reads and
            # writes around the one statement (docs/DESIGN.md, "The catalog, read once")
            "db.einsum (stored by name, out= replaced)": lambda: db.einsum("ij,jk->ik", "A", "B", out="C",
                                                                            replace=True),
            "db.einsum_numpy (stored)": lambda: db.einsum_numpy("ij,jk->ik", A, B),
            "eds.einsum (numpy arrays)": lambda: eds.einsum("ij,jk->ik", a, b),
            "numpy a @ b": lambda: a @ b,
            "plan + compile (repeated)": lambda: compile_plan(db.plan("ij,jk->ik", A, B)),
        }
        np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b, rtol=1e-12, atol=1e-12)
        for f in methods.values():
            for _ in range(INNER):
                f()
        times = {k: [] for k in methods}
        for _ in range(ROUNDS):
            for k, f in methods.items():
                t = time.perf_counter()
                for _ in range(INNER):
                    f()
                times[k].append((time.perf_counter() - t) / INNER * 1e3)
    out = {k: {"median_ms": float(np.median(v)), "min_ms": float(min(v)), "max_ms": float(max(v))}
           for k, v in times.items()}
    ref = out["db.einsum_numpy (stored)"]["median_ms"]
    for v in out.values():
        v["vs_einsum_numpy"] = v["median_ms"] / ref
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cores", help="comma-separated core counts to pin runs to (taskset)")
    ap.add_argument("--json", action="store_true", help="print this run's numbers as JSON")
    args = ap.parse_args()
    if not args.cores:
        res = measure()
        if args.json:
            print(json.dumps(res))
            return
        for k, v in res.items():
            print(f"{k:40s} {v['median_ms']:8.3f} ms  ({v['min_ms']:.3f}-{v['max_ms']:.3f})  "
                  f"{v['vs_einsum_numpy']:.2f}x einsum_numpy")
        return
    runs = {}
    for c in [int(x) for x in args.cores.split(",")]:
        if c > os.cpu_count():
            continue
        cmd = ["taskset", "-c", f"0-{c - 1}", sys.executable, __file__, "--json"]
        runs[str(c)] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        print(f"-- {c} core(s)")
        for k, v in runs[str(c)].items():
            print(f"{k:40s} {v['median_ms']:8.3f} ms  ({v['min_ms']:.3f}-{v['max_ms']:.3f})  "
                  f"{v['vs_einsum_numpy']:.2f}x einsum_numpy")
    meta = {"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    Path(__file__).with_name("small_work.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
