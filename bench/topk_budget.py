"""A top-k over a result bigger than the memory budget: its time and the process's
resident-memory rise, against numpy's stable argsort of the whole product. ``--api sql``:
``einsum_topk`` (one query, the result streamed through the fused kernel); ``--api python``:
``db.topk`` on the stored tensors (under a budget it runs ``einsum_topk``'s query; without one
the product goes into an array, ranked in bands of rows). ``db.topk``'s other way under a budget
(arrays, or what SQL refuses: the product into a temporary table, ranked a batch at a time)
is measured with ``--api python-arrays``.

    .venv/bin/python bench/topk_budget.py [--api sql|python] [--queries 2000] [--items 100000] [--dim 64]
                                          [--memory 300MB] [--k 5] [--count]

Run it in a fresh process per setting (ru_maxrss is the process's high-water mark); pass
``--memory none`` for the session without a budget."""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

import eindecomp_sql as eds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--memory", default="300MB")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--api", choices=("sql", "python", "python-arrays"), default="sql")
    ap.add_argument("--count", action="store_true",
                    help="--api sql: run SELECT count(*) over the query (the query's own memory, no rows fetched)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((args.queries, args.dim)).astype(np.float32)
    e = rng.standard_normal((args.items, args.dim)).astype(np.float32)
    db = eds.connect(memory=None if args.memory == "none" else args.memory)
    db.store("Q", q)
    db.store("E", e)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    if args.api == "sql" and args.count:
        rows = db.connection.sql(f"SELECT count(*) FROM einsum_topk('id,jd->ij', {args.k}, 'Q', 'E')").fetchall()
        seconds = time.perf_counter() - t
        rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
        print(f"sql count(*), memory={args.memory}: {args.queries} x {args.items} x {args.dim} float32, top {args.k}: "
              f"{rows[0][0]:,} rows, {seconds:.2f} s, resident rise {rise / 1e6:.0f} MB")
        return
    if args.api == "sql":
        out = db.connection.sql(f"SELECT * FROM einsum_topk('id,jd->ij', {args.k}, 'Q', 'E')").fetchnumpy()
        got = np.asarray(out["j"]).reshape(args.queries, args.k)
    elif args.api == "python":
        got = db.topk("id,jd->ij", args.k, "Q", "E").indices
    else:
        got = db.topk("id,jd->ij", args.k, q, e).indices
    seconds = time.perf_counter() - t
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    x = q @ e.T
    top = np.argsort(-x, axis=1, kind="stable")[:, :args.k]
    same = np.array_equal(got, top)
    if not same:
        # float32 products summed in another order (other tiles, other BLAS calls) swap near
        # ties: say how near, as numpy's own values at the two answers' places
        gap = np.abs(np.take_along_axis(x, got, 1) - np.take_along_axis(x, top, 1)).max()
        same = f"False ({np.mean(got == top):.4%} of places equal; numpy's values there differ by <= {gap:.2g})"
    print(f"{args.api}, memory={args.memory}: {args.queries} x {args.items} x {args.dim} float32, top {args.k}, result "
          f"{args.queries * args.items * 4 / 1e6:.0f} MB: {seconds:.2f} s, resident rise {rise / 1e6:.0f} MB, "
          f"equal to numpy's: {same}")


if __name__ == "__main__":
    main()
