"""float16 GEMMs: ``eds.einsum`` (products summed in float32 by BLAS, rounded once per tile)
against numpy's float16 ``a @ b`` (no BLAS) and numpy's float32 product, interleaved in one
process; medians (min-max) in ms and the largest error against the float64 product.

    .venv/bin/python bench/float16_bench.py [--sizes 256,512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

import eindecomp_sql as eds


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,512")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| n | numpy float16 `a @ b` | `eds.einsum` float16 | numpy float32 `a @ b` | max error vs float64: numpy float16 / eds |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        a = rng.standard_normal((n, n)).astype(np.float16)
        b = rng.standard_normal((n, n)).astype(np.float16)
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        cases = {"numpy16": lambda: a @ b, "eds16": lambda: eds.einsum("ij,jk->ik", a, b), "numpy32": lambda: a32 @ b32}
        for f in cases.values():
            f()
        times = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k in random.sample(list(cases), len(cases)):
                t = time.perf_counter()
                cases[k]()
                times[k].append((time.perf_counter() - t) * 1e3)
        exact = a.astype(np.float64) @ b.astype(np.float64)
        err = [float(np.abs(cases[k]().astype(np.float64) - exact).max()) for k in ("numpy16", "eds16")]
        cell = {k: f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in times.items()}
        print(f"| {n} | {cell['numpy16']} | {cell['eds16']} | {cell['numpy32']} | {err[0]:.4f} / {err[1]:.4f} |", flush=True)


if __name__ == "__main__":
    main()
