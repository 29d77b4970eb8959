"""Top-k similarity from SQL: ``einsum_topk`` against numpy and against what a user wrote before
it existed (``einsum_elements`` + a window), in one process, rounds interleaved.

The issue's case: 1000 queries x 20000 items, dimension 128, float32, the 5 best items per query.

    .venv/bin/python bench/topk_bench.py                 # writes bench/topk_results.json
    .venv/bin/python bench/topk_bench.py --rounds 3 --items 5000

Ways (every one returns the k (index, value) pairs of every query row, best first):
- numpy: ``s = q @ e.T``, ``np.argpartition(-s, k - 1, axis=1)[:, :k]``, then those k sorted;
- einsum_topk, stored tensors: ``SELECT * FROM einsum_topk('id,jd->ij', 5, 'Q', 'E')``;
- einsum_topk, array tables: the same over ``queries(qid, v FLOAT[128])`` and ``items(id, v FLOAT[128])``
  (includes packing both tables into tiles inside the query);
- db.topk, the Python API: ``db.topk("id,jd->ij", 5, q, e)`` on the numpy arrays, and on the stored
  tensors (the product into a temporary table, ranked a batch at a time);
- (numpy's product alone, the floor every way pays);
- einsum_elements + window: ``... QUALIFY row_number() OVER (PARTITION BY i ORDER BY value DESC) <= 5``
  over all 20M element rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import eindecomp_sql as eds


def numpy_topk(q, e, k):
    s = q @ e.T
    idx = np.argpartition(-s, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(s, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1), np.take_along_axis(vals, order, axis=1)


def array_table(con, name, key, m):
    """``name(key BIGINT, v FLOAT[n])`` from the rows of ``m``."""
    n = m.shape[1]
    vec = pa.FixedSizeListArray.from_arrays(pa.array(m.reshape(-1)), n)
    con.register("_bench_rows", pa.table({key: pa.array(np.arange(len(m), dtype=np.int64)), "v": vec}))
    con.execute(f'CREATE OR REPLACE TABLE "{name}" AS SELECT * FROM _bench_rows')
    con.unregister("_bench_rows")


def as_arrays(table: pa.Table, rows: int, k: int):
    """(index, value) arrays of shape (rows, k) from result rows ordered by row then rank."""
    t = table.sort_by([("i", "ascending"), ("rank", "ascending")]) if "rank" in table.column_names else \
        table.sort_by([("i", "ascending"), ("value", "descending")])
    return (t.column("j").to_numpy().reshape(rows, k), t.column("value").to_numpy().reshape(rows, k))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--items", type=int, default=20000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "topk_results.json"))
    args = p.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    e = rng.standard_normal((args.items, args.dim), dtype=np.float32)
    k = args.k
    with eds.connect() as db:
        con = db.connection
        db.store("Q", q)
        db.store("E", e)
        array_table(con, "queries", "qid", q)
        array_table(con, "items", "id", e)
        topk = "SELECT * FROM einsum_topk('id,jd->ij', ?, ?, ?)"
        window = ("SELECT i, j, value FROM einsum_elements('id,jd->ij', 'Q', 'E') "
                  "QUALIFY row_number() OVER (PARTITION BY i ORDER BY value DESC) <= ?")
        ways = {
            "numpy argpartition": lambda: numpy_topk(q, e, k),
            "(numpy q @ e.T alone)": lambda: q @ e.T,
            "einsum_topk stored": lambda: as_arrays(con.sql(topk, params=[k, "Q", "E"]).to_arrow_table(), len(q), k),
            "einsum_topk array tables": lambda: as_arrays(con.sql(topk, params=[k, "queries", "items"]).to_arrow_table(),
                                                          len(q), k),
            "db.topk arrays": lambda: tuple(db.topk("id,jd->ij", k, q, e))[::-1],
            "db.topk stored": lambda: tuple(db.topk("id,jd->ij", k, "Q", "E"))[::-1],
            "einsum_elements + window": lambda: as_arrays(con.sql(window, params=[k]).to_arrow_table(), len(q), k),
        }
        want_idx, want_val = numpy_topk(q, e, k)
        for name, f in ways.items():  # warm up, and every way gives numpy's answer
            if name.startswith("("):
                f()
                continue
            idx, val = f()
            assert np.array_equal(idx, want_idx), name
            np.testing.assert_allclose(val, want_val, rtol=1e-4, atol=1e-4)
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, f in ways.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    base = float(np.median(times["numpy argpartition"]))
    # per-round ratios too: under load from other processes a round's ways share its conditions
    per_round = {name: float(np.median(np.array(t) / np.array(times["numpy argpartition"]))) for name, t in times.items()}
    summary = {name: {"median_s": float(np.median(t)), "min_s": min(t), "max_s": max(t),
                      "ratio_to_numpy": float(np.median(t)) / base, "round_ratio_median": per_round[name]}
               for name, t in times.items()}
    out = {"queries": args.queries, "items": args.items, "dim": args.dim, "k": k, "rounds": args.rounds,
           "dtype": "float32", "times": times, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"top-{k} of {args.queries} x {args.items} (dim {args.dim}, float32), {args.rounds} rounds")
    print(f"{'way':28s} {'median':>9s} {'min-max':>17s} {'x numpy':>8s} {'per round':>10s}")
    for name, s in summary.items():
        print(f"{name:28s} {s['median_s']:8.3f}s {s['min_s']:7.3f}-{s['max_s']:.3f}s {s['ratio_to_numpy']:7.2f}x "
              f"{s['round_ratio_median']:9.2f}x")


if __name__ == "__main__":
    main()
