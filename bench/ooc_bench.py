"""Out of core (issue 10): a GEMM whose inputs and output together are 4x the memory budget,
stored in a DuckDB file, against the same GEMM in memory (the same file, no budget), numpy on
the arrays, and dask.array (threaded scheduler) on memory-mapped .npy files with the tiles the
budget's session stores. Each run in a fresh process: time and peak resident set (ru_maxrss,
the interpreter and libraries included) against the bar, budget x 1.25 + 300 MB.

    .venv/bin/python bench/ooc_bench.py [--n 4096 8192] [--dtype float32] [--out bench/ooc_results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).parent

CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    def hwm():  # this process's own peak (ru_maxrss starts at the forking parent's size)
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    method, n, dtype, budget, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    db_path, a_path, b_path = folder + "/t.duckdb", folder + "/A.npy", folder + "/B.npy"
    extra = {}
    t = time.perf_counter()
    if method == "numpy":
        c = np.load(a_path) @ np.load(b_path)
    elif method == "dask":
        import dask, dask.array as da
        tile = json.loads(sys.argv[6])
        a = da.from_array(np.load(a_path, mmap_mode="r"), chunks=tile)
        b = da.from_array(np.load(b_path, mmap_mode="r"), chunks=tile)
        with dask.config.set(scheduler="threads"):
            da.to_npy_stack(folder + "/dask_c", a @ b, axis=0)
    else:
        import eindecomp_sql as eds
        with eds.connect(db_path, memory=budget if method == "out of core" else None) as db:
            plan = db.plan("ij,jk->ik", "A", "B")
            extra = dict(statements=sum(s.batches for s in plan.steps), projected=plan.peak_bytes,
                         plan=[s.describe() for s in plan.steps])
            t = time.perf_counter()
            db.einsum("ij,jk->ik", "A", "B", out="C", replace=True)
    seconds = time.perf_counter() - t
    print(json.dumps(dict(seconds=seconds, peak=hwm(), **extra)))
""")


def child(method: str, n: int, dtype: str, budget: int, folder: str, *extra) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, method, str(n), dtype, str(budget), folder, *extra],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(n: int, dtype: str) -> dict:
    import numpy as np

    import eindecomp_sql as eds

    itemsize = np.dtype(dtype).itemsize
    budget = 3 * n * n * itemsize // 4  # inputs and output together: 4x the budget
    folder = tempfile.mkdtemp(prefix="eds-ooc-", dir=os.environ.get("EDS_BENCH_DIR"))
    try:
        rng = np.random.default_rng(0)
        for name in "AB":
            np.save(f"{folder}/{name}.npy", rng.standard_normal((n, n), dtype=np.float32).astype(dtype))
        t = time.perf_counter()
        with eds.connect(f"{folder}/t.duckdb", memory=budget) as db:
            for name in "AB":  # stored under the budget: its tiles, cut from the .npy files
                tile = db.store(name, f"{folder}/{name}.npy").tile
        store_s = time.perf_counter() - t
        rows = {}
        for method in ("numpy", "in memory", "out of core", "dask"):
            rows[method] = child(method, n, dtype, budget, folder, json.dumps(list(tile)))
        # right? the out-of-core result against numpy, on a band of rows
        with eds.connect(f"{folder}/t.duckdb", read_only=True) as db:
            a, b = np.load(f"{folder}/A.npy", mmap_mode="r"), np.load(f"{folder}/B.npy", mmap_mode="r")
            band = slice(0, min(n, 256))
            err = float(np.abs(db.tensor("C").to_numpy()[band] - np.asarray(a[band]) @ b).max())
        return dict(n=n, dtype=dtype, budget=budget, tile=list(tile), store_seconds=store_s, max_err=err,
                    bar_bytes=budget * 1.25 + 300e6, runs=rows)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(HERE / "ooc_results.json"))
    args = ap.parse_args()
    import duckdb
    import numpy as np

    results = dict(machine=f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), duckdb=duckdb.__version__,
                   numpy=np.__version__, cases=[])
    for n in args.n:
        r = bench(n, args.dtype)
        results["cases"].append(r)
        print(f"GEMM {n}² {args.dtype}, budget {r['budget'] / 1e6:.0f} MB (tile {r['tile']}), max err {r['max_err']:.2g}")
        mem = r["runs"]["in memory"].get("seconds")
        for method, row in r["runs"].items():
            if "error" in row:
                print(f"  {method:12s} failed: {row['error']}")
                continue
            ratio = f"{mem / row['seconds']:.2f}" if mem else "-"
            print(f"  {method:12s} {row['seconds']:8.2f} s  peak {row['peak'] / 1e6:7.0f} MB "
                  f"(bar {r['bar_bytes'] / 1e6:.0f} MB)  throughput vs in memory {ratio}"
                  + (f"  {row['statements']} statements, projected {row['projected'] / 1e6:.0f} MB" if "statements" in row else ""))
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
