"""What DuckDB spends appending one big BLOB to a table, and how much of it is the hash of its
distinct-count statistics (docs/DESIGN.md, "DuckDB's idle threads trimmed our heap", the
paragraph on what is left at 16 cores).

DuckDB updates a column's distinct-count statistics on every append (``RowGroupCollection::
Append`` -> ``DistinctStatistics::UpdateSample``), hashing a sample of the chunk's rows whole:
a one-row chunk's 64 MiB tile is hashed in full. Nested types get no such statistics, so the
same tile wrapped in a struct is appended without the hash. Raw DuckDB and pyarrow only, one
process, medians of ``--rounds``:

    .venv/bin/python bench/blob_hash_probe.py [--mib 64] [--rounds 9]

Rows: CREATE OR REPLACE TABLE AS of a stored BLOB tile into a BLOB column, into a struct column,
into a one-element list; the same with an Arrow UDF making a fresh tile (as a kernel does); reading
the struct back through a view; and ``hash(tile)`` alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import duckdb
import numpy as np
import pyarrow as pa


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="the tile's size in MiB")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    con = duckdb.connect()
    size = args.mib << 20
    blob = np.random.default_rng(0).bytes(size)
    con.register("src", pa.table({"k": pa.array([0], pa.int64()), "tile": pa.array([blob], pa.binary())}))
    con.execute("CREATE TABLE s AS SELECT * FROM src")
    con.execute("CREATE TABLE ss AS SELECT k, {'t': tile} AS tile FROM src")
    con.execute("CREATE VIEW sv AS SELECT k, tile.t AS tile FROM ss")

    def fresh(x):  # a kernel's result: a new buffer of the tile's size
        chunk = x.chunk(0) if isinstance(x, pa.ChunkedArray) else x
        return pa.array([bytes(memoryview(chunk.buffers()[2])[:size])], pa.binary())

    con.create_function("fresh", fresh, [duckdb.sqltypes.BLOB], duckdb.sqltypes.BLOB, type="arrow")
    cases = {
        "stored BLOB -> BLOB column": "CREATE OR REPLACE TABLE d AS SELECT k, tile FROM s",
        "stored BLOB -> struct column": "CREATE OR REPLACE TABLE d AS SELECT k, {'t': tile} AS tile FROM s",
        "stored BLOB -> list column": "CREATE OR REPLACE TABLE d AS SELECT k, [tile] AS tile FROM s",
        "UDF result -> BLOB column": "CREATE OR REPLACE TABLE d AS SELECT k, fresh(tile) AS tile FROM s",
        "UDF result -> struct column": "CREATE OR REPLACE TABLE d AS SELECT k, {'t': fresh(tile)} AS tile FROM s",
        "struct through a view -> UDF -> BLOB column": "CREATE OR REPLACE TABLE d AS SELECT k, fresh(tile) AS tile FROM sv",
        "hash(tile) alone": "SELECT hash(tile) FROM s",
    }
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, sql in cases.items():
            t = time.perf_counter()
            con.execute(sql).fetchall()
            times[name].append(time.perf_counter() - t)
    print(f"| one {args.mib} MiB tile (DuckDB {duckdb.__version__}, medians of {args.rounds}) | ms (min-max) |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) |")


if __name__ == "__main__":
    main()
