"""The 4096² GEMM bars in a process of their own: numpy `@`, the SQL path on stored tensors
and `eds.einsum` on arrays, interleaved round by round (nothing else allocated in between, unlike
the full table, where dask's 10-second einsum runs in the same rounds).

    .venv/bin/python bench/gemm_bar.py      # writes bench/gemm_bar.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

import eindecomp_sql as eds

N, ROUNDS = 4096, 15


def main():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((N, N), dtype=np.float32)
    b = rng.standard_normal((N, N), dtype=np.float32)
    with eds.connect() as db:
        A, B = db.store("A", a), db.store("B", b)
        methods = {
            "numpy_matmul": lambda: a @ b,
            "eds_stored": lambda: db.einsum("ij,jk->ik", A, B, out="C", replace=True),
            "eds_numpy": lambda: eds.einsum("ij,jk->ik", a, b),
        }
        for f in methods.values():
            f()
        times = {k: [] for k in methods}
        for _ in range(ROUNDS):
            for k, f in methods.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        assert np.allclose(db.tensor("C").to_numpy(), a @ b, rtol=1e-3, atol=1e-2)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out = {"n": N, "rounds": ROUNDS, "times": times, "median": med,
           "ratio_stored": med["eds_stored"] / med["numpy_matmul"],
           "ratio_numpy": med["eds_numpy"] / med["numpy_matmul"],
           "round_ratios_stored": [s / n for s, n in zip(times["eds_stored"], times["numpy_matmul"])]}
    (Path(__file__).parent / "gemm_bar.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "times"}, indent=1))


if __name__ == "__main__":
    main()
