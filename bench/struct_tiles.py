"""Stored tensors as a table of BLOB tiles against parts whose tiles are a one-field struct, side by
side in one process (docs/DESIGN.md "Tiles in a one-field struct").

DuckDB hashes every BLOB it appends to a table for the column's distinct-count statistics, and
keeps none for a struct column. Since this change a tensor of more than ``parts.PART_BYTES`` is
parts whose ``tile`` is ``STRUCT(t BLOB)``, even as one tile. Here ``parts.PART_BYTES`` is set per
call: 2**62 gives the layout before (one table, BLOB tiles) and 16 MiB the one now, for operands
stored that way and for the result ``db.einsum(..., out=, replace=True)`` writes each call; then
``db.store(..., replace=True)`` of a 64 MiB array both ways. Methods in random order each round,
numpy in the same rounds; medians (min-max):

    .venv/bin/python bench/struct_tiles.py [--rounds 11] [--only gemm_4096,...] [--out bench/struct_tiles.json]
    taskset -c 0 env OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/struct_tiles.py --tag 1core

The results match bit for bit between the two layouts (checked each workload).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import duckdb  # noqa: E402
import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from eindecomp_sql.backends import parts as parted  # noqa: E402
from workloads import WORKLOADS, is_matmul, make_inputs  # noqa: E402

MODES = {"table": 1 << 62, "struct": 16 << 20}
DEFAULT = ("gemm_2048", "gemm_4096", "batched_bij_bjk", "two_label_abcd_cdef")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--only", default=",".join(DEFAULT))
    ap.add_argument("--tag", default="", help="a label for this run (e.g. the cores it was pinned to)")
    ap.add_argument("--out", default=None, help="JSON file (default bench/struct_tiles[_TAG].json)")
    args = ap.parse_args()
    out = Path(args.out or Path(__file__).with_name(f"struct_tiles{'_' + args.tag if args.tag else ''}.json"))
    default_bytes = parted.PART_BYTES
    db = eds.connect()
    rows = []
    try:
        for name in args.only.split(","):
            spec, shapes, dtype = WORKLOADS[name]
            arrays = make_inputs(shapes, dtype)
            ops = "ABCD"[:len(arrays)]
            for mode, part_bytes in MODES.items():
                parted.PART_BYTES = part_bytes
                for op, x in zip(ops, arrays):
                    db.store(f"{op}_{mode}", x, replace=True)
                db.einsum(spec, *[f"{op}_{mode}" for op in ops], out=f"C_{mode}", replace=True)  # warm-up
            times = {m: [] for m in (*MODES, "numpy")}
            for _ in range(args.rounds):
                order = list(times)
                random.shuffle(order)
                for m in order:
                    t = time.perf_counter()
                    if m == "numpy":
                        arrays[0] @ arrays[1] if is_matmul(spec) else np.einsum(spec, *arrays, optimize=True)
                    else:
                        parted.PART_BYTES = MODES[m]
                        db.einsum(spec, *[f"{op}_{m}" for op in ops], out=f"C_{m}", replace=True)
                    times[m].append(time.perf_counter() - t)
            parted.PART_BYTES = default_bytes
            same = np.array_equal(db.tensor("C_table").to_numpy(), db.tensor("C_struct").to_numpy())
            rows.append(_row(name, times, same))
            print(_line(rows[-1]), flush=True)
        # a store of a 64 MiB array, replaced each call
        x = np.random.default_rng(1).standard_normal((4096, 4096), dtype=np.float32)
        times = {m: [] for m in MODES}
        for m, b in MODES.items():
            parted.PART_BYTES = b
            db.store(f"S_{m}", x, replace=True)
        for _ in range(args.rounds):
            order = list(times)
            random.shuffle(order)
            for m in order:
                parted.PART_BYTES = MODES[m]
                t = time.perf_counter()
                db.store(f"S_{m}", x, replace=True)
                times[m].append(time.perf_counter() - t)
        parted.PART_BYTES = default_bytes
        same = all(np.array_equal(db.tensor(f"S_{m}").to_numpy(), x) for m in MODES)
        rows.append(_row("store 4096² f32 (64 MiB, one tile)", times, same))
        print(_line(rows[-1]), flush=True)
    finally:
        parted.PART_BYTES = default_bytes
        db.close()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
            "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(), "numpy": np.__version__,
            "duckdb": duckdb.__version__, "rounds": args.rounds, "tag": args.tag}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


def _row(name, times, same):
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"work": name, "median_s": med, "min_s": {m: min(v) for m, v in times.items()},
            "max_s": {m: max(v) for m, v in times.items()}, "same_result": bool(same)}


def _line(r):
    med, lo, hi = r["median_s"], r["min_s"], r["max_s"]
    base = med.get("numpy")
    cells = []
    for m in med:
        ratio = f", {med[m] / base:.3f}x numpy" if base and m != "numpy" else ""
        cells.append(f"{m} {med[m] * 1e3:.1f} ms ({lo[m] * 1e3:.0f}-{hi[m] * 1e3:.0f}{ratio})")
    saved = (med["table"] - med["struct"]) * 1e3
    return f"| {r['work']} | " + " | ".join(cells) + f" | struct saves {saved:.1f} ms | same: {r['same_result']} |"


if __name__ == "__main__":
    main()
