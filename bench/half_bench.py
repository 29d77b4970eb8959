"""Half-precision GEMMs (float16, bfloat16): eindecomp_sql (products summed in float32 by BLAS,
rounded once per tile) against what a numpy user has, interleaved in one process; medians
(min-max) in ms and the largest error against the float64 product of the same operands.

numpy's side: float16 ``a @ b`` (numpy's own loop, no BLAS); for bfloat16, ml_dtypes' ``a @ b``
(it returns float32) rounded to bfloat16, which is what a numpy user writes; and the float32
product of the same values (BLAS, the floor both halves aim at). eindecomp_sql's side:
``eds.einsum`` on the arrays and ``db.einsum(...).to_numpy()`` on stored tensors (the SQL path).

    .venv/bin/python bench/half_bench.py [--sizes 256,512,2048] [--dtypes float16,bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import ml_dtypes  # noqa: F401 - numpy's "bfloat16"
import numpy as np

import eindecomp_sql as eds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,512,2048")
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    db = eds.connect()
    print("| dtype | n | numpy `a @ b` | numpy float32 product | `eds.einsum` | SQL path, stored | "
          "max error vs float64: numpy / eds / SQL path |")
    print("|---|---|---|---|---|---|---|")
    for dt in args.dtypes.split(","):
        for n in (int(x) for x in args.sizes.split(",")):
            a = rng.standard_normal((n, n)).astype(dt)
            b = rng.standard_normal((n, n)).astype(dt)
            a32, b32 = a.astype(np.float32), b.astype(np.float32)
            A, B = db.store("A", a, replace=True), db.store("B", b, replace=True)
            if dt == "float16" and n > 1024:  # numpy's float16 loop: ~0.4 s at 512, ~25 s at 2048
                numpy_own = None
            else:
                numpy_own = (lambda: a @ b) if dt == "float16" else (lambda: (a @ b).astype(dt))
            cases = {"numpy": numpy_own, "numpy32": lambda: a32 @ b32,
                     "eds": lambda: eds.einsum("ij,jk->ik", a, b),
                     "sql": lambda: db.einsum("ij,jk->ik", A, B).to_numpy()}
            cases = {k: f for k, f in cases.items() if f is not None}
            for f in cases.values():
                f()
            times = {k: [] for k in cases}
            for _ in range(args.rounds):
                for k in random.sample(list(cases), len(cases)):
                    t = time.perf_counter()
                    cases[k]()
                    times[k].append((time.perf_counter() - t) * 1e3)
            exact = a.astype(np.float64) @ b.astype(np.float64)
            err = [f"{float(np.abs(cases[k]().astype(np.float64) - exact).max()):.4f}" if k in cases else "-"
                   for k in ("numpy", "eds", "sql")]
            cell = {k: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in times.items()}
            print(f"| {dt} | {n} | {cell.get('numpy', 'not run')} | {cell['numpy32']} | {cell['eds']} | {cell['sql']} "
                  f"| {' / '.join(err)} |", flush=True)
    db.close()


if __name__ == "__main__":
    main()
