"""``make demo``: a small job on an embedded DuckDB, printing what it computed and how fast.

Run with ``python -m eindecomp_sql.demo``.
"""

from __future__ import annotations

import time

import numpy as np

import eindecomp_sql as eds


def _timed(f):
    t = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t


def main(n: int = 2048) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    print(f"eindecomp_sql {eds.__version__} demo: {n}x{n} float32 matrices in an in-memory DuckDB\n")

    with eds.connect() as db:
        (A, B), t_store = _timed(lambda: (db.store("A", a, tile=(n // 2, n // 2)), db.store("B", b)))
        print(f"stored {A} and {B} in {t_store:.2f} s")

        C, t_sql = _timed(lambda: db.einsum("ij,jk->ik", A, B, out="C"))
        ref, t_np = _timed(lambda: a @ b)
        err = np.abs(C.to_numpy() - ref).max()
        print(f"C = A @ B as SQL: {t_sql:.2f} s (numpy {t_np:.2f} s); max |C - numpy| = {err:.2e}")

        m = 512  # the extended kernels are numpy broadcasts, not BLAS: keep this one small
        db.store("S", a[:m, :m], tile=(m // 2, m // 2))
        db.store("T", b[:m, :m])
        D, t_mp = _timed(lambda: db.einsum("ij,jk->ik", "S", "T", join="add", agg="max", out="D"))
        ref_mp = (a[:m, :m, None] + b[None, :m, :m]).max(1)
        ok = np.allclose(D.to_numpy(), ref_mp)
        print(f"max-plus product D[i,k] = max_j S[i,j] + T[j,k] ({m}x{m}): {t_mp:.2f} s; equals numpy: {ok}")

        con = db.connection
        top = con.execute(
            "SELECT i, k, value FROM einsum_elements('ij,jk->ik', 'A', 'B') ORDER BY value DESC LIMIT 3"
        ).fetchall()
        print("largest entries of A @ B, from SQL:", ", ".join(f"C[{i},{k}]={v:.1f}" for i, k, v in top))

        x = rng.standard_normal((64, 64), dtype=np.float32)
        eds.einsum("ij,jk->ik", x, x)
        ts = []
        for _ in range(20):
            ts.append(_timed(lambda: eds.einsum("ij,jk->ik", x, x))[1])
        print(f"small einsum (64x64 @ 64x64) end to end: {1000 * float(np.median(ts)):.1f} ms median")

        print("\nthe plan and SQL of C = A @ B:\n")
        print(db.explain("ij,jk->ik", "A", "B"))


if __name__ == "__main__":
    main()
