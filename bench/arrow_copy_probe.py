"""What handing a stored tile to an Arrow UDF costs, by tile size: the cold GPU GEMM's question.

DuckDB copies each BLOB it hands a Python Arrow UDF into an Arrow buffer. A buffer above
glibc's mmap threshold (256 MiB, ``backends/allocator.py``) is mapped afresh and faulted in on
every statement; one below it comes back from the heap. This stores a 512 MiB float32 tensor
(16384 x 8192) in tiles of ``rows`` rows and times, per statement (3 each, in one session):
the scan alone (``octet_length``), a scan reading every byte (``md5``), and a UDF that takes
the tiles as Arrow and does nothing, with the page faults of each.

    python bench/arrow_copy_probe.py 16384 4096     # one 512 MiB tile; four 128 MiB tiles

Measured on the 2-core VM (2026-11-27, twenty-second session): one 512 MiB tile 0.82 s and
131,073 faults a statement; four 128 MiB tiles 0.075 s and 2-7 faults.
"""

from __future__ import annotations

import resource
import sys
import time

import numpy as np

import eindecomp_sql as eds


def main() -> None:
    n, m = 16384, 8192
    a = np.random.default_rng(0).standard_normal((n, m), dtype=np.float32)
    for rows in map(int, sys.argv[1:] or ["16384", "4096"]):
        with eds.connect() as db:
            db.store("A", a, tile=(rows, m), replace=True)
            con = db.backend._work
            con.create_function("eds_probe_nop", lambda t: __import__("pyarrow").array([True] * len(t)),
                                ["BLOB"], "BOOLEAN", type="arrow", side_effects=True)
            for label, sql in (("scan", "SELECT sum(octet_length(tile)) FROM A"),
                               ("scan reading every byte", "SELECT count(md5(tile)) FROM A"),
                               ("tiles handed to an Arrow UDF", "SELECT count(eds_probe_nop(tile)) FROM A")):
                for _ in range(3):
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t = time.perf_counter()
                    con.execute(sql).fetchall()
                    dt = time.perf_counter() - t
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                    print(f"{rows * m * 4 >> 20} MiB tiles x{n // rows}: {label}: {dt:.3f} s, {faults} faults", flush=True)


if __name__ == "__main__":
    main()
