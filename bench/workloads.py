"""The benchmark workloads and the ways of running each: one function per method, all taking
the same inputs, so the same work runs side by side in one process."""

from __future__ import annotations

import numpy as np

# name -> (spec, shapes, dtype); sizes take seconds on 2 cores
WORKLOADS = {
    "gemm_1024": ("ij,jk->ik", [(1024, 1024), (1024, 1024)], "float32"),
    "gemm_2048": ("ij,jk->ik", [(2048, 2048), (2048, 2048)], "float32"),
    "gemm_4096": ("ij,jk->ik", [(4096, 4096), (4096, 4096)], "float32"),
    "batched_bij_bjk": ("bij,bjk->bik", [(16, 1024, 1024), (16, 1024, 1024)], "float32"),
    "chain_3": ("ij,jk,kl->il", [(2048, 4096), (4096, 512), (512, 2048)], "float32"),
    "two_label_abcd_cdef": ("abcd,cdef->abef", [(64, 64, 32, 32), (32, 32, 64, 64)], "float32"),
}
SMALL = ("gemm_64", "ij,jk->ik", [(64, 64), (64, 64)], "float32")

DASK_CHUNK = 1024  # dask.array chunks per dimension (4x4 chunks of 1024² at 4096², as in the brief)


def make_inputs(shapes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32).astype(dtype) for s in shapes]


def is_matmul(spec: str) -> bool:
    return spec in ("ij,jk->ik", "bij,bjk->bik")


class Methods:
    """Callables for one workload; ``setup`` does the loading that is not being timed."""

    def __init__(self, name: str, spec: str, arrays: list[np.ndarray]):
        self.name, self.spec, self.arrays = name, spec, arrays
        self._db = None
        self._dask = None

    # numpy ------------------------------------------------------------------------------
    def numpy_matmul(self):
        out = self.arrays[0]
        for b in self.arrays[1:]:
            out = out @ b
        return out

    def numpy_einsum(self):
        return np.einsum(self.spec, *self.arrays, optimize=True)

    # dask -------------------------------------------------------------------------------
    def _dask_arrays(self):
        if self._dask is None:
            import dask.array as da

            self._dask = [da.from_array(a, chunks=DASK_CHUNK) for a in self.arrays]
        return self._dask

    def dask_matmul(self):
        xs = self._dask_arrays()
        out = xs[0]
        for b in xs[1:]:
            out = out @ b
        return out.compute()

    def dask_einsum(self):
        import dask.array as da

        return da.einsum(self.spec, *self._dask_arrays()).compute()

    # eindecomp_sql ----------------------------------------------------------------------
    def setup_eds_stored(self):
        import eindecomp_sql as eds

        self._db = eds.connect()
        self._names = [self._db.store(f"x{k}", a).name for k, a in enumerate(self.arrays)]

    def eds_stored(self):
        """The SQL path: stored tensors in, result table out (it stays in DuckDB)."""
        self._db.einsum(self.spec, *self._names, out="result", replace=True)

    def eds_stored_to_numpy(self):
        self._db.einsum(self.spec, *self._names, out="result", replace=True)
        return self._db.tensor("result").to_numpy()

    def eds_numpy(self):
        """``eds.einsum`` on numpy arrays, loading included."""
        import eindecomp_sql as eds

        return eds.einsum(self.spec, *self.arrays)

    def close(self):
        if self._db is not None:
            self._db.close()
            self._db = None


def pure_sql_gemm(a: np.ndarray, b: np.ndarray) -> float:
    """The relational textbook formulation: (i, j, value) rows, join on j, GROUP BY (i, k)."""
    import time

    import duckdb
    import pyarrow as pa

    con = duckdb.connect()
    n, m = a.shape
    _, p = b.shape
    ii, jj = np.indices(a.shape)
    ta = pa.table({"i": ii.ravel().astype(np.int32), "j": jj.ravel().astype(np.int32), "v": a.ravel()})
    jj2, kk = np.indices(b.shape)
    tb = pa.table({"j": jj2.ravel().astype(np.int32), "k": kk.ravel().astype(np.int32), "v": b.ravel()})
    con.register("ta", ta)
    con.register("tb", tb)
    con.execute("CREATE TABLE A AS SELECT * FROM ta").fetchall()
    con.execute("CREATE TABLE B AS SELECT * FROM tb").fetchall()
    t = time.perf_counter()
    con.execute(
        "CREATE TABLE C AS SELECT A.i, B.k, sum(A.v * B.v) AS v FROM A JOIN B ON A.j = B.j GROUP BY A.i, B.k"
    ).fetchall()
    elapsed = time.perf_counter() - t
    got = con.sql("SELECT i, k, v FROM C").fetchnumpy()
    c = np.zeros((n, p), np.float32)
    c[got["i"], got["k"]] = got["v"]
    assert np.allclose(c, a @ b, rtol=1e-3, atol=1e-2), "pure SQL result is wrong"
    con.close()
    return elapsed
