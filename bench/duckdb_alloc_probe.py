"""Does the session's handling of DuckDB's allocators slow down a user's own DuckDB queries on
the same process? While a session is open, DuckDB's jemalloc keeps freed pages (decay -1) and
every thread's blocks of 4 MiB and more go to one shared arena (backends/duckdb_allocator.py);
on a many-core machine a parallel query's big allocations then meet on that arena's locks.
This runs plain SQL (a GROUP BY, a self-join, a sort over ``--rows`` rows) on the session's
connection in fresh processes, one per mode, alternating:

- ``session``: as an open session leaves the allocators;
- ``unshared``: the same, with big blocks back in each thread's own arena;
- ``duckdb``: DuckDB's allocators as DuckDB runs them (``leave_alone``).

    .venv/bin/python bench/duckdb_alloc_probe.py [--rows 20000000] [--rounds 5] [--processes 2]

Medians (min-max) in seconds per query and mode; the ratio is to ``duckdb`` in the same round
of processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

QUERIES = {
    "group by": "SELECT g, sum(v), count(*) FROM t GROUP BY g",
    "self-join": "SELECT count(*), sum(a.v + b.v) FROM t a JOIN t b ON a.k = b.k",
    "sort": "SELECT k, v FROM t ORDER BY v DESC LIMIT 10",
}


def child(mode: str, rows: int, rounds: int) -> dict:
    import eindecomp_sql as eds
    from eindecomp_sql.backends import duckdb_allocator

    db = eds.connect()
    if mode == "duckdb":
        duckdb_allocator.leave_alone()
    elif mode == "unshared":
        duckdb_allocator.unshare_big_blocks()
    con = db.connection
    con.execute(f"CREATE TABLE t AS SELECT range AS k, range % 100003 AS g, random() AS v FROM range({rows})")
    times = {name: [] for name in QUERIES}
    for _ in range(rounds):
        for name, sql in QUERIES.items():
            t = time.perf_counter()
            con.execute(sql).fetchall()
            times[name].append(time.perf_counter() - t)
    threads = con.execute("SELECT current_setting('threads')").fetchall()[0][0]
    db.close()
    return {"mode": mode, "threads": threads, "times": times}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--processes", type=int, default=2, help="fresh processes per mode")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.rounds)))
        return
    modes = ("duckdb", "unshared", "session")
    runs = {m: {q: [] for q in QUERIES} for m in modes}
    threads = None
    for _ in range(args.processes):
        for mode in modes:
            cmd = [sys.executable, __file__, "--child", mode, "--rows", str(args.rows), "--rounds", str(args.rounds)]
            got = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            threads = got["threads"]
            for q, ts in got["times"].items():
                runs[mode][q] += ts
    print(f"| query ({args.rows:,} rows, DuckDB threads {threads}) | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    for q in QUERIES:
        base = statistics.median(runs["duckdb"][q])
        cells = []
        for m in modes:
            ts = runs[m][q]
            cells.append(f"{statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f}), {statistics.median(ts) / base:.2f}x")
        print(f"| {q} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
