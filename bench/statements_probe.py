"""Each statement the SQL path runs around a stored einsum, timed: where the time between a
step's kernels goes (on 16 cores it was 30 ms for a 4096² GEMM against 7 ms on 2: bench/RESULTS.md
"On the lent machine"). Runs ``db.einsum(spec, names..., out="C", replace=True)`` a few times
to warm up, then ``--calls`` times with every statement on the session's cursor timed (its text's
first words as the key), and prints per statement kind the median ms a call and its count, the
time outside any statement (Python: planning, binding, the kernels' bookkeeping) and the call's
wall time. With ``--threads N`` DuckDB runs N threads (default: the cores this process may use).

    .venv/bin/python bench/statements_probe.py --size 4096 --calls 10
    CUDA_VISIBLE_DEVICES= python3 bench/statements_probe.py --size 4096   # on a GPU machine
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--spec", default="ij,jk->ik")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    args = ap.parse_args()

    import numpy as np

    import eindecomp_sql as eds
    from eindecomp_sql.backends import duckdb as backend

    db = eds.connect()
    if args.threads:
        db.connection.execute(f"SET threads = {int(args.threads)}")
    rng = np.random.default_rng(0)
    n = args.size
    db.store("A", rng.standard_normal((n, n), dtype=np.float32))
    db.store("B", rng.standard_normal((n, n), dtype=np.float32))

    def call():
        db.einsum(args.spec, "A", "B", out="C", replace=True)

    for _ in range(3):
        call()
    run = backend.DuckDBBackend._run
    seen: list[tuple[str, float]] = []

    def timed(self, sql, params=None):
        t = time.perf_counter()
        try:
            return run(self, sql, params)
        finally:
            seen.append((" ".join(sql.split()[:3])[:40], time.perf_counter() - t))

    backend.DuckDBBackend._run = timed
    per_kind: dict[str, list[float]] = collections.defaultdict(list)
    counts: dict[str, int] = {}
    walls, outside = [], []
    try:
        for _ in range(args.calls):
            seen.clear()
            t = time.perf_counter()
            call()
            wall = time.perf_counter() - t
            walls.append(wall)
            outside.append(wall - sum(s for _, s in seen))
            kinds = collections.defaultdict(float)
            for k, s in seen:
                kinds[k] += s
            for k, s in kinds.items():
                per_kind[k].append(s)
            counts = collections.Counter(k for k, _ in seen)
    finally:
        backend.DuckDBBackend._run = run
    threads = db.connection.execute("SELECT current_setting('threads')").fetchall()[0][0]
    out = {"size": n, "spec": args.spec, "duckdb_threads": threads, "calls": args.calls,
           "wall_ms": statistics.median(walls) * 1e3, "outside_statements_ms": statistics.median(outside) * 1e3,
           "statements": {k: {"ms": statistics.median(v) * 1e3, "count": counts.get(k, 0)}
                          for k, v in sorted(per_kind.items(), key=lambda kv: -statistics.median(kv[1]))}}
    print(f"{args.spec} {n}², DuckDB threads {threads}: wall {out['wall_ms']:.2f} ms a call, outside statements "
          f"{out['outside_statements_ms']:.2f} ms (medians of {args.calls})")
    for k, v in out["statements"].items():
        print(f"  {v['ms']:8.2f} ms  x{v['count']}  {k}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
