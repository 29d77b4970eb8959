"""Where a one-call step's wall time goes, phase by phase, on the SQL path over stored tensors:
before the step (planning, compiling, the catalog), from the step's start to the kernel UDF's
entry (DuckDB reading the tiles and converting them to Arrow, holding the GIL), inside the UDF
(the kernel), from the UDF's return to the step's end (DuckDB converting the result back and
writing the table) and after it (commit, catalog). numpy's time for the same work is beside it.

    .venv/bin/python bench/udf_phases.py [--workloads batched_bij_bjk,gemm_4096,two_label_abcd_cdef] [--calls 8]
    .venv/bin/python bench/udf_phases.py --workloads gemm_4096_f64,gemm_6000_f64,gemm_8192_f32 --calls 4

Each workload runs ``--calls`` times after one warm-up; medians in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

import step_probe  # noqa: E402  (its kernel and step timers)
from workloads import WORKLOADS, is_matmul, make_inputs  # noqa: E402

# big single-tile GEMMs beside bench/workloads.py's (the tiles cross 64 and 256 MiB)
BIG = {
    "gemm_4096_f64": ("ij,jk->ik", [(4096, 4096), (4096, 4096)], "float64"),
    "gemm_6000_f64": ("ij,jk->ik", [(6000, 6000), (6000, 6000)], "float64"),
    "gemm_8192_f32": ("ij,jk->ik", [(8192, 8192), (8192, 8192)], "float32"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="batched_bij_bjk,gemm_4096,two_label_abcd_cdef")
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    step_probe.install()  # before the first connect
    import eindecomp_sql as eds

    print("| workload | numpy | total | before step | step start -> UDF | UDF (kernel) | UDF -> step end | after | outside the UDF |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in args.workloads.split(","):
        spec, shapes, dtype = {**WORKLOADS, **BIG}[w]
        arrays = make_inputs(shapes, dtype)
        db = eds.connect()
        names = [db.store(f"x{k}", a).name for k, a in enumerate(arrays)]
        rows, numpy = [], []
        for call in range(args.calls + 1):
            step_probe._calls.clear()
            step_probe._steps.clear()
            t = time.perf_counter()
            db.einsum(spec, *names, out="r", replace=True)
            done = time.perf_counter()
            (_, begin, end), = step_probe._steps  # one step, one kernel call
            (enter, leave, _), = step_probe._calls
            if call:
                rows.append((done - t, begin - t, enter - begin, leave - enter, end - leave, done - end))
            t = time.perf_counter()
            arrays[0] @ arrays[1] if is_matmul(spec) else np.einsum(spec, *arrays, optimize=True)
            numpy.append(time.perf_counter() - t)
        med = [statistics.median(c) * 1e3 for c in zip(*rows)]
        np_ms = statistics.median(numpy) * 1e3
        print(f"| {w} | {np_ms:.0f} | {med[0]:.0f} ({med[0] / np_ms:.2f}x) | " + " | ".join(f"{m:.1f}" for m in med[1:])
              + f" | {med[0] - med[3]:.0f} |", flush=True)
        db.close()


if __name__ == "__main__":
    main()
