"""How fast DuckDB hands stored tile BLOBs to an Arrow UDF: the floor of every step that reads
big tiles, and of the GPU path's cold GEMM (issue 11), whose operands cross exactly this way.

1 GiB of random bytes stored as BLOB tiles of 512, 256, 128 and 64 MiB; ``SELECT sum(f(tile))``
with ``f`` an Arrow UDF that only reads its input's size, so the time is DuckDB's scan of the
stored BLOBs and its conversion of them to Arrow (holding the GIL). Medians (min-max) of 5.

    .venv/bin/python bench/blob_rate.py
    taskset -c 0 .venv/bin/python bench/blob_rate.py     # one core: the same, it is serial
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import eindecomp_sql  # noqa: F401  (its malloc settings, as the product runs)
import duckdb
import pyarrow as pa
import pyarrow.compute  # noqa: F401


def size_of(col):
    return pa.compute.binary_length(col).cast(pa.int64())  # reads the offsets; the bytes were copied in


def main(total: int = 1 << 30) -> None:
    con = duckdb.connect()
    con.create_function("f", size_of, [duckdb.sqltype("BLOB")], duckdb.sqltype("BIGINT"), type="arrow")
    print(f"duckdb {duckdb.__version__}, pyarrow {pa.__version__}; {total >> 20} MiB of tiles per query")
    for size in (512 << 20, 256 << 20, 128 << 20, 64 << 20):
        n = total // size
        t = pa.table({"k": pa.array(range(n), pa.int64()),
                      "tile": pa.array([np.random.default_rng(k).bytes(size) for k in range(n)], pa.large_binary())})
        con.register("src", t)
        con.execute("CREATE OR REPLACE TABLE t AS SELECT k, tile::BLOB AS tile FROM src")
        con.unregister("src")
        del t
        ts = []
        for _ in range(5):
            a = time.perf_counter()
            got = con.execute("SELECT sum(f(tile)) FROM t").fetchall()[0][0]
            ts.append(time.perf_counter() - a)
        assert got == total, got
        med = statistics.median(ts)
        print(f"{size >> 20:4d} MiB x {n:2d}: {med:.3f} s ({min(ts):.3f}-{max(ts):.3f}), {total / med / 1e9:.2f} GB/s",
              flush=True)


if __name__ == "__main__":
    main()
