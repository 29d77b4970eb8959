"""``eds.einsum`` on numpy arrays against numpy, one process, interleaved: the ratio that array
operands read in place moved (bench/RESULTS.md "Array operands read in place"). Run it with
another checkout first on ``PYTHONPATH`` (its ``udfs/`` copied into its ``eindecomp_sql/``) to
compare commits in alternating processes.

    .venv/bin/python bench/array_inputs.py [reps]     # default 7; prints one JSON line
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np
from interleaved import interleaved
from workloads import WORKLOADS, is_matmul, make_inputs

NAMES = ("gemm_2048", "gemm_4096", "batched_bij_bjk", "two_label_abcd_cdef")


def main() -> None:
    import eindecomp_sql as eds

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    out = {}
    for name in NAMES:
        spec, shapes, dtype = WORKLOADS[name]
        arrays = make_inputs(shapes, dtype)
        ref = (lambda r: np.matmul(*arrays)) if is_matmul(spec) else (lambda r: np.einsum(spec, *arrays, optimize=True))
        times = interleaved({"numpy": ref, "eds": lambda r: eds.einsum(spec, *arrays)}, reps)
        out[name] = round(statistics.median(times["eds"]) / statistics.median(times["numpy"]), 3)
    print(json.dumps({"eds.einsum / numpy": out, "from": eds.__file__}))


if __name__ == "__main__":
    main()
