"""DuckDB's idle threads and its jemalloc against the buffers the SQL path keeps for reuse
(docs/DESIGN.md, "DuckDB's idle threads trimmed our heap"): `bij,bjk` 16x1024³ on stored tensors
after a 4096² GEMM session, called with random pauses (what a user's program does between
calls), each call's time and page faults; with DuckDB's allocators as the session leaves them
(`kept`), as DuckDB runs them on its own (`duckdb`: `duckdb_allocator.leave_alone()` after
connecting; until 2026-11-26 this mode called `restore()`, which the first plan's end undid for
the `malloc_trim` patch) and as the session left them before big blocks from every DuckDB thread went to one
jemalloc arena (`unshared`: the per-core arenas' oversize thresholds put back, so each thread
allocates its tiles from its own arena), alternating fresh processes. `--modes` picks some.

    .venv/bin/python bench/trim_bench.py --processes 2 --calls 30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(mode: str, calls: int, pause: float, seed: int) -> dict:
    import resource
    import statistics
    import time

    import numpy as np

    import eindecomp_sql as eds
    from eindecomp_sql.backends import duckdb_allocator

    db = eds.connect()
    if mode == "duckdb":
        duckdb_allocator.leave_alone()
    elif mode == "unshared":
        duckdb_allocator.unshare_big_blocks()
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4096, 4096), dtype=np.float32) for _ in range(2))
    A, B = db.store("A", a), db.store("B", b)
    for _ in range(2):
        db.einsum("ij,jk->ik", A, B, out="C", replace=True)
    x, y = (rng.standard_normal((16, 1024, 1024), dtype=np.float32) for _ in range(2))
    X, Y = db.store("X", x), db.store("Y", y)
    pauses = np.random.default_rng(seed)
    ts, fs = [], []
    for i in range(calls + 1):
        time.sleep(pauses.uniform(0, pause))
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        db.einsum("bij,bjk->bik", X, Y, out="Z", replace=True)
        t = time.perf_counter() - t0
        if i:  # the first call places its buffers
            ts.append(t)
            fs.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    assert np.allclose(db.tensor("Z").to_numpy(), x @ y, rtol=1e-3, atol=1e-2)
    t0 = time.perf_counter()
    x @ y
    numpy = time.perf_counter() - t0
    tile_pages = 64 << 20 >> 12
    return {"mode": mode, "median_ms": round(statistics.median(ts) * 1e3, 1),
            "p90_ms": round(statistics.quantiles(ts, n=10)[-1] * 1e3, 1),
            "calls_faulting_a_tile": sum(f > tile_pages // 2 for f in fs), "calls": len(fs),
            "faults": sum(fs), "numpy_ms": round(numpy * 1e3, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2, help="fresh processes per mode")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--pause", type=float, default=0.8, help="the longest random pause between calls, s")
    p.add_argument("--modes", default="duckdb,unshared,kept", help="comma-separated: duckdb, unshared, kept")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.calls, args.pause, args.seed)))
        return
    rows = []
    for k in range(args.processes):
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, "--child", mode, "--calls", str(args.calls),
                   "--pause", str(args.pause), "--seed", str(k + 1)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
