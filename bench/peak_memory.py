"""Peak resident memory one GEMM adds, in a fresh process per case: numpy's ``a @ b``,
``db.einsum`` on stored tensors (result kept in DuckDB) and ``eds.einsum`` on arrays, each in the
default session. The peak (``VmHWM``) is reset just before the call, so what storing the inputs
took is not counted; the rise is measured from the resident set at that moment.

    .venv/bin/python bench/peak_memory.py 6000 float64     # prints one line per method
"""

from __future__ import annotations

import subprocess
import sys
import time

METHODS = ("numpy", "stored", "eds")


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
    if method == "numpy":
        a @ b  # BLAS's own buffers, as the other methods' warm-up
        run = lambda: a @ b  # noqa: E731
    else:
        import eindecomp_sql as eds

        if method == "stored":
            db = eds.connect()
            db.store("a", a)
            db.store("b", b)
            run = lambda: db.einsum("ij,jk->ik", "a", "b", out="c", replace=True)  # noqa: E731
        else:
            run = lambda: eds.einsum("ij,jk->ik", a, b)  # noqa: E731
    base = _resident()
    _reset_peak()
    t = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - t
    rise = _peak() - base
    del result
    print(f"{method} {n}² {dtype}: {seconds:.2f} s, peak rise {rise / 1e6:.0f} MB", flush=True)


def main():
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    n, dtype = int(sys.argv[1]), sys.argv[2]
    for method in METHODS:
        subprocess.run([sys.executable, __file__, "--child", method, str(n), dtype], check=True)


if __name__ == "__main__":
    main()
