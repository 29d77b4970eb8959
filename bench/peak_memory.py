"""Peak resident memory one GEMM adds, in a fresh process per case: numpy's ``a @ b``,
``db.einsum`` on stored tensors (result kept in DuckDB) and ``eds.einsum`` on arrays, each in the
default session. The peak (``VmHWM``) is reset just before each call, so what storing the inputs
took is not counted; the rise is measured from the resident set at that moment. Each method runs
twice; "held" is what stays resident after a call (its result deleted) above the level before
the first, the stored result excepted only in that it is a table.

    .venv/bin/python bench/peak_memory.py 6000 float64     # prints one line per method
"""

from __future__ import annotations

import subprocess
import sys
import time

METHODS = ("numpy", "stored", "eds")
CALLS = 2  # the second call shows what the first left resident (and whether it is reused)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set (Linux)


def child(method: str, n: int, dtype: str) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    # every method warms up on the same 512² GEMM: BLAS's buffers, and for eindecomp_sql its
    # kernel threads and UDFs (numpy's warm-up used to be the full-size product itself)
    w = a[:512, :512], b[:512, :512]
    if method == "numpy":
        w[0] @ w[1]
        run = lambda: a @ b  # noqa: E731
    else:
        import eindecomp_sql as eds

        eds.einsum("ij,jk->ik", *w)
        if method == "stored":
            db = eds.connect()
            db.store("a", a)
            db.store("b", b)
            run = lambda: db.einsum("ij,jk->ik", "a", "b", out="c", replace=True)  # noqa: E731
        else:
            run = lambda: eds.einsum("ij,jk->ik", a, b)  # noqa: E731
    start, rows = _resident(), []
    for _ in range(CALLS):
        base = _resident()
        _reset_peak()
        t = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - t
        rise = _peak() - base
        del result
        rows.append(f"{seconds:.2f} s, peak rise {rise / 1e6:.0f} MB, then {(_resident() - start) / 1e6:.0f} MB held")
    print(f"{method} {n}² {dtype}: " + "; ".join(rows), flush=True)


def main():
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    n, dtype = int(sys.argv[1]), sys.argv[2]
    for method in METHODS:
        subprocess.run([sys.executable, __file__, "--child", method, str(n), dtype], check=True)


if __name__ == "__main__":
    main()
