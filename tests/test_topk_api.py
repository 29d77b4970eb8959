"""db.topk / eds.topk: the k largest (or smallest) of every row of an einsum's result, as numpy
arrays, against a reference written with Python's sort on exact Python numbers."""

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers import topk_key

import eindecomp_sql as eds

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int64", "uint16", "uint64", "bool"]


def ref_topk(x: np.ndarray, k: int, largest: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Best first (largest, else smallest), NaN after every number, ties by the smaller index:
    Python's stable sort of exact Python numbers, one row at a time."""
    n = x.shape[-1]
    rows = x.reshape(-1, n).astype(np.float32) if x.dtype.name == "bfloat16" else x.reshape(-1, n)
    m = min(k, n)
    vals = np.empty((rows.shape[0], m), x.dtype)
    idx = np.empty((rows.shape[0], m), np.int64)
    for r, row in enumerate(rows):
        row = [v.item() for v in row]
        best = sorted(range(n), key=topk_key(row, largest))[:m]
        idx[r] = best
        vals[r] = [row[j] for j in best]
    shape = (*x.shape[:-1], m)
    return vals.reshape(shape), idx.reshape(shape)


def same(got: eds.TopK, want, exact_values=True):
    wv, wi = want
    assert isinstance(got, eds.TopK)
    assert got.values.shape == wv.shape and got.indices.shape == wi.shape, (got.values.shape, wv.shape)
    assert got.values.dtype == wv.dtype and got.indices.dtype == np.int64
    np.testing.assert_array_equal(got.indices, wi)
    if wv.dtype.name == "bfloat16":  # (numpy's NaN equality does not know ml_dtypes' NaN)
        got, wv = got._replace(values=got.values.astype(np.float32)), wv.astype(np.float32)
    np.testing.assert_array_equal(got.values, wv)  # NaN equal to NaN, -0.0 to 0.0


def small_ints(rng, shape, dtype):
    """Values every dtype holds exactly, products and sums of a few too: ties abound."""
    dtype = np.dtype(dtype) if dtype != "bfloat16" else None
    if dtype is None:
        import ml_dtypes

        return rng.integers(-3, 4, shape).astype(np.float32).astype(ml_dtypes.bfloat16)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    lo = 0 if dtype.kind == "u" else -3
    return rng.integers(lo, 4, shape).astype(dtype)


@pytest.fixture(scope="module", params=[None, "2GB"], ids=["array", "table"])
def db(request):
    """Small tiles: results cut along the ranked label and the rows. Without a budget the
    product is ranked as an array; under one, from a temporary table a batch at a time."""
    s = eds.connect(tile_bytes=256, memory=request.param)
    yield s
    s.close()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES), k=st.integers(1, 30),
       largest=st.booleans(), m=st.integers(1, 9), n=st.integers(1, 40), j=st.integers(1, 6),
       three=st.booleans())
def test_topk_of_a_product_matches_the_reference(db, seed, dtype, k, largest, m, n, j, three):
    """Random shapes that do not divide the tiles, every dtype, k below and above the ranked
    label, both directions; the reference ranks the session's own product (its values exact:
    small ints, so the order is numpy's to the last tie)."""
    rng = np.random.default_rng(seed)
    if three:
        a, b, spec = small_ints(rng, (2, m, j), dtype), small_ints(rng, (2, j, n), dtype), "bij,bjk->bik"
    else:
        a, b, spec = small_ints(rng, (m, j), dtype), small_ints(rng, (j, n), dtype), "ij,jk->ik"
    product = db.einsum_numpy(spec, a, b)
    got = db.topk(spec, k, a, b, largest=largest)
    same(got, ref_topk(product, k, largest))


@pytest.mark.parametrize("largest", [True, False])
def test_nan_inf_and_signed_zero(db, largest):
    x = np.array([[np.nan, 1.0, -np.inf, 0.0, -0.0, np.inf, 1.0, np.nan],
                  [-0.0, 0.0, -0.0, 0.0, 2.0, -2.0, np.nan, 2.0]])
    for k in (1, 3, 6, 8, 20):
        got = db.topk("ij->ij", k, x, largest=largest)
        same(got, ref_topk(x, k, largest))
    # integers at their limits: reversing the order must not overflow
    i = np.array([[np.iinfo(np.int64).min, 0, np.iinfo(np.int64).max, -1, np.iinfo(np.int64).min]])
    for k in (1, 2, 5):
        same(db.topk("ij->ij", k, i, largest=largest), ref_topk(i, k, largest))
    u = np.array([[0, 2**64 - 1, 7, 0]], dtype=np.uint64)
    same(db.topk("ij->ij", 2, u, largest=largest), ref_topk(u, 2, largest))


def test_random_floats_against_numpy(db):
    """Similarities of random embeddings: the values are the product's to float32 rounding, the
    indices numpy's (no near-ties at this size)."""
    rng = np.random.default_rng(3)
    q, e = rng.standard_normal((37, 16)).astype(np.float32), rng.standard_normal((501, 16)).astype(np.float32)
    s = q.astype(np.float64) @ e.T.astype(np.float64)
    got = db.topk("id,jd->ij", 5, q, e)
    want = np.argsort(-s, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(got.indices, want)
    np.testing.assert_allclose(got.values, np.take_along_axis(s, want, 1), rtol=1e-5, atol=1e-5)
    assert got.values.dtype == np.float32
    got = db.topk("id,jd->ij", 3, q, e, join="(x - y) ** 2", agg="sum", largest=False)  # nearest by L2
    d = ((q[:, None, :].astype(np.float64) - e[None].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_array_equal(got.indices, np.argsort(d, axis=1, kind="stable")[:, :3])


def test_shapes_rows_and_one_dimension(db):
    rng = np.random.default_rng(5)
    x = small_ints(rng, (3, 4, 11), "int32")
    same(db.topk("abc->abc", 4, x), ref_topk(x, 4))
    same(db.topk("abc->cab", 2, x), ref_topk(np.einsum("abc->cab", x), 2))  # the last output label ranked
    v = small_ints(rng, (19,), "float64")
    got = db.topk("i->i", 5, v)
    assert got.values.shape == (5,)
    same(got, ref_topk(v, 5))
    got = db.topk("ij->j", 2, x[0], agg="max")  # a reduction, then ranked
    same(got, ref_topk(x[0].max(axis=0), 2))


def test_empty_results(db):
    got = db.topk("ij,jk->ik", 3, np.ones((0, 4)), np.ones((4, 5)))
    assert got.values.shape == got.indices.shape == (0, 3)
    got = db.topk("ij,jk->ik", 3, np.ones((2, 4)), np.ones((4, 0)))
    assert got.values.shape == (2, 0) and got.indices.dtype == np.int64
    got = db.topk("ij,jk->ik", 3, np.ones((2, 0)), np.ones((0, 5)))  # a sum over nothing: zeros
    same(got, ref_topk(np.zeros((2, 5)), 3))


def test_operands_stored_named_and_tables(db):
    rng = np.random.default_rng(7)
    a = small_ints(rng, (9, 6), "float32")
    A = db.store("TA", a, tile=(4, 4), replace=True)
    want = ref_topk(a @ a.T, 4)
    same(db.topk("ij,kj->ik", 4, A, A), want)
    same(db.topk("ij,kj->ik", 4, "TA", a), want)
    same(eds.topk("ij,kj->ik", 4, A, a), want)  # a Tensor runs in its own session
    db.connection.execute("CREATE OR REPLACE TABLE te AS SELECT i, j, value FROM "
                          "(SELECT unnest(range(9)) AS i) CROSS JOIN (SELECT unnest(range(6)) AS j) "
                          "JOIN (SELECT ? AS v) ON true, LATERAL (SELECT v[i * 6 + j + 1] AS value)",
                          [a.ravel().tolist()])
    # the table's DOUBLE values and A's float32 promote to float64
    same(db.topk("ij,kj->ik", 4, "te", A), (want[0].astype(np.float64), want[1]))


def test_nothing_is_left_behind(db, monkeypatch):
    """The temporary result (a TEMP table on the session's own cursor, which db.connection does
    not see) is dropped after the call, and after a call that fails while ranking it."""
    from eindecomp_sql import ranking

    def tables():
        return set(db.backend._work.sql("SELECT table_name FROM duckdb_tables()").fetchnumpy()["table_name"].tolist())

    before = tables()
    x = np.random.default_rng(1).standard_normal((50, 70))
    db.topk("ij,jk->ik", 3, x, x.T)
    assert tables() == before

    def failing(spec, keys, views, *bars):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(ranking, "_candidates", failing)
    with pytest.raises(RuntimeError, match="a kernel failed") as info:
        db.topk("ij,jk->ik", 3, x, x.T)
    assert tables() == before  # (while info's traceback holds the call's frame and its result handle)
    del info
    with pytest.raises(eds.EinsumError):
        db.topk("ij,jk->ik", 3, x, x.T, join=lambda u, v: u.sum() + v)  # a callable that is not element-wise
    assert tables() == before


def test_bad_arguments(db):
    x = np.ones((3, 4))
    for k in (0, -2):
        with pytest.raises(eds.EinsumError, match="k must be >= 1"):
            db.topk("ij->ij", k, x)
    for k in (2.0, True, "3", None):
        with pytest.raises(eds.EinsumTypeError, match="k must be an int"):
            db.topk("ij->ij", k, x)
    with pytest.raises(eds.EinsumTypeError, match="largest must be True or False"):
        db.topk("ij->ij", 2, x, largest="no")
    with pytest.raises(eds.EinsumError, match="no output label to rank"):
        db.topk("ij->", 2, x)
    with pytest.raises(eds.EinsumError, match="complex128, which has no order"):
        db.topk("ij->ij", 2, x.astype(complex))
    with pytest.raises(eds.EinsumTypeError, match="spec must be a str"):
        db.topk(x, 2, [0, 1])
    with pytest.raises(eds.EinsumError, match="operand"):
        db.topk("ij,jk->ik", 2, x, x)
    assert db.topk("ij->ij", np.int64(2), x).values.shape == (3, 2)  # numpy's ints are ints


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_a_result_bigger_than_the_budget_is_ranked_within_it(dtype):
    """The product runs as db.einsum runs it under the budget (several statements: one query,
    as SQL's einsum_topk, could not for int64), and is ranked a batch at a time."""
    rng = np.random.default_rng(11)
    q = rng.integers(-50, 50, (2000, 8)).astype(dtype)
    e = rng.integers(-50, 50, (5000, 8)).astype(dtype)
    import tracemalloc

    with eds.connect(memory="60MB") as s:
        result = np.dtype(dtype).itemsize * 2000 * 5000
        assert result > s.plan_budget  # 40-80 MB of result
        assert any(st.batches > 1 for st in s.plan("id,jd->ij", q, e).steps)
        tracemalloc.start()  # numpy's allocations are traced: what Python held of the result
        try:
            got = s.topk("id,jd->ij", 5, q, e)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < result / 2, (peak, result)
    sim = q.astype(np.int64) @ e.T.astype(np.int64)
    want = np.argsort(-sim, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(got.indices, want)
    np.testing.assert_array_equal(got.values, np.take_along_axis(sim, want, 1).astype(dtype))


@pytest.mark.parametrize("memory", [None, "1GB"], ids=["array", "table"])
def test_the_ranking_reads_the_result_a_batch_at_a_time(memory, monkeypatch):
    """The result reaches the top-k kernel in batches of RANK_BATCH_BYTES, never whole: bands
    of rows of the array, or batches of the temporary table's tiles."""
    from eindecomp_sql import ranking

    seen = []
    real = ranking._candidates

    def counting(spec, keys, views, *bars):
        seen.append(sum(len(v) for v in views))
        return real(spec, keys, views, *bars)

    monkeypatch.setattr(ranking, "_candidates", counting)
    monkeypatch.setattr(ranking, "RANK_BATCH_BYTES", 4096)
    x = np.random.default_rng(2).standard_normal((200, 300))
    with eds.connect(tile_bytes=2048, memory=memory) as s:  # 16x16 float64 tiles
        got = s.topk("ij->ij", 3, x)
    assert len(seen) > 10 and max(seen) <= 4096
    np.testing.assert_array_equal(got.indices, np.argsort(-x, axis=1, kind="stable")[:, :3])


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_operands_under_a_budget_run_einsum_topks_query(dtype, largest):
    """Under memory=, stored operands by name or handle run as SQL's einsum_topk (one query,
    fused and streamed where it can be); the answer is the same as every other way's."""
    rng = np.random.default_rng(17)
    a, b = small_ints(rng, (11, 5), dtype), small_ints(rng, (5, 23), dtype)
    with eds.connect(tile_bytes=256, memory="1GB") as s:
        if dtype.startswith(("float", "bfloat")):  # NaN after every number, both ways (bfloat16 ranked
            a[2, 1], a[5, 3] = np.nan, np.nan     # NaN first on this path: a review)
            a[7, :] = -np.inf
        A, B = s.store("A", a, tile=(4, 3)), s.store("B", b, tile=(3, 6))
        rows = s._sql_topk("ij,jk->ik", 4, (A, "B"), None, None, largest)
        assert rows is not None and rows.num_rows == 11 * 4
        want = ref_topk(s.einsum_numpy("ij,jk->ik", a, b), 4, largest)
        calls = []
        real = s.backend.query_arrow
        s.backend.query_arrow = lambda sql: calls.append(sql) or real(sql)
        same(s.topk("ij,jk->ik", 4, A, "B", largest=largest), want)
        assert len(calls) == 1 and "einsum" in calls[0]  # it took SQL's query
        del s.backend.query_arrow
        # arrays, a callable join or a progress callback: the product's own way
        assert s._sql_topk("ij,jk->ik", 4, (a, "B"), None, None, largest) is None
        same(s.topk("ij,jk->ik", 4, a, B, largest=largest), want)
        same(s.topk("ij,jk->ik", 4, A, B, largest=largest, progress=lambda p: None), want)


def test_under_a_budget_what_sql_refuses_runs_the_product_way():
    """int64 does not fuse: over a result bigger than the budget, einsum_topk refuses one
    query, and db.topk runs the product in the budget's statements instead."""
    rng = np.random.default_rng(19)
    q, e = rng.integers(-50, 50, (2000, 8)), rng.integers(-50, 50, (5000, 8))
    with eds.connect(memory="60MB") as s:
        s.store("Q", q)
        s.store("E", e)
        assert s._sql_topk("id,jd->ij", 3, ("Q", "E"), None, None, True) is None
        got = s.topk("id,jd->ij", 3, "Q", "E", largest=False)
    sim = q @ e.T
    want = np.argsort(sim, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(got.indices, want)
    np.testing.assert_array_equal(got.values, np.take_along_axis(sim, want, 1))


def test_a_large_k_under_a_budget_holds_about_the_answer_not_every_candidate(monkeypatch):
    """k = 2,000 of 20,000 over small result tiles: every element of a tile is a candidate.
    Kept to the end, they were 6M (546 MB traced here; 1.45 GB resident in a trial); pruned
    to each row's best as they come, what is held follows the answer (7 MB) and a batch."""
    import tracemalloc

    from eindecomp_sql import ranking

    monkeypatch.setattr(ranking, "RANK_BATCH_BYTES", 1 << 20)
    rng = np.random.default_rng(23)
    q, e = rng.standard_normal((300, 8)).astype(np.float32), rng.standard_normal((20000, 8)).astype(np.float32)
    with eds.connect(memory="100MB", tile_bytes=1 << 16) as s:
        tracemalloc.start()
        try:
            got = s.topk("id,jd->ij", 2000, q, e)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        ours = s.einsum_numpy("id,jd->ij", q, e)
    assert peak < 250e6, peak
    want = np.argsort(-ours, axis=1, kind="stable")[:, :2000]
    np.testing.assert_array_equal(got.indices, want)
    np.testing.assert_array_equal(got.values, np.take_along_axis(ours, want, 1))


def test_every_element_a_candidate_under_a_budget_holds_a_few_answers():
    """k as wide as the result: every element is a candidate and the answer is the whole
    result sorted (14.4 MB here). Held as int64 rows and indices, joined while their pieces
    were still held, and gathered whole before the cut, a prune took 119 MB traced (k = 20,000
    of 150 x 20,000 rose 311-314 MB resident under memory="100MB"); now 41 MB."""
    import tracemalloc

    rng = np.random.default_rng(23)
    q, e = rng.standard_normal((60, 8)).astype(np.float32), rng.standard_normal((20000, 8)).astype(np.float32)
    with eds.connect(memory="100MB", tile_bytes=1 << 16) as s:
        tracemalloc.start()
        try:
            got = s.topk("id,jd->ij", 20000, q, e)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        ours = s.einsum_numpy("id,jd->ij", q, e)
    assert peak < 4 * (got.values.nbytes + got.indices.nbytes), peak
    want = np.argsort(-ours, axis=1, kind="stable")
    np.testing.assert_array_equal(got.indices, want)
    np.testing.assert_array_equal(got.values, np.take_along_axis(ours, want, 1))


@pytest.mark.parametrize("memory", [None, "1GB"], ids=["array", "table"])
def test_interrupt_stops_the_ranking(memory, monkeypatch):
    """db.interrupt() during the ranking (after the product) stops the call with Interrupted,
    as it stops a plan: it said True, and the call ran on and returned (a trial)."""
    import threading

    from eindecomp_sql import ranking
    from eindecomp_sql.errors import Interrupted

    monkeypatch.setattr(ranking, "RANK_BATCH_BYTES", 4096)
    real, calls = ranking._candidates, []
    x = np.random.default_rng(4).standard_normal((200, 300))
    with eds.connect(tile_bytes=2048, memory=memory) as s:
        def interrupting(spec, keys, views, *bars):
            calls.append(1)
            if len(calls) == 1:  # from another thread, as a service's deadline would
                said = []
                t = threading.Thread(target=lambda: said.append(s.interrupt()))
                t.start()
                t.join()
                assert said == [True]
            return real(spec, keys, views, *bars)

        monkeypatch.setattr(ranking, "_candidates", interrupting)
        with pytest.raises(Interrupted):
            s.topk("ij->ij", 3, x)
        assert 1 <= len(calls) <= 2
        monkeypatch.setattr(ranking, "_candidates", real)
        np.testing.assert_array_equal(s.topk("ij->ij", 3, x).indices, np.argsort(-x, axis=1, kind="stable")[:, :3])


def test_dtype_widens_the_product_before_it_is_ranked(db):
    """int8 products wrap in int8, as numpy's do; dtype= computes them in int32 first."""
    a = np.full((3, 40), 5, np.int8)
    b = np.arange(40 * 6, dtype=np.int8).reshape(40, 6) % 7
    wide = np.einsum("ij,jk->ik", a, b, dtype=np.int32)
    got = db.topk("ij,jk->ik", 2, a, b, dtype="int32")
    assert got.values.dtype == np.int32
    same(got, ref_topk(wide, 2))
    narrow = np.einsum("ij,jk->ik", a, b)  # int8: it wraps, and ranks otherwise
    same(db.topk("ij,jk->ik", 2, a, b), ref_topk(narrow, 2))
    assert not np.array_equal(ref_topk(narrow, 2)[0].astype(np.int32), got.values)
    with pytest.raises(eds.EinsumError):
        db.topk("ij,jk->ik", 2, a.astype(np.float64), b, dtype="int32")  # not castable under "safe"


def test_a_k_whose_candidates_overflow_the_budget_takes_the_pruning_way():
    """SQL's window holds up to k candidates a row of every tile (24 B each): over half the
    budget, db.topk takes the table way, which prunes them as they come."""
    rng = np.random.default_rng(29)
    q, e = rng.standard_normal((150, 8)).astype(np.float32), rng.standard_normal((20000, 8)).astype(np.float32)
    with eds.connect(memory="100MB") as s:  # (one query runs it: the result is 12 MB, its candidates 72 MB)
        s.store("Q", q)
        s.store("E", e)
        calls = []
        real = s.backend.query_arrow
        s.backend.query_arrow = lambda sql: calls.append(sql) or real(sql)
        small = s.topk("id,jd->ij", 3, "Q", "E")
        assert len(calls) == 1  # a small k: SQL's query
        got = s.topk("id,jd->ij", 20000, "Q", "E")
        assert len(calls) == 1  # 150 rows x 20000 x 24 B: the table way
        ours = s.einsum_numpy("id,jd->ij", "Q", "E")
    for r, k in ((small, 3), (got, 20000)):
        want = np.argsort(-ours, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(r.indices, want)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_drops_what_a_rows_bar_rules_out(dtype, largest, monkeypatch):
    """Pruned as soon as the candidates reach twice the answer, the kernel is handed each row's
    bar (its m-th best so far) and drops elements worse: ties at the bar (many: small ints),
    NaN (worse than every number; a NaN bar where a row's best m held NaN: 4 rows, pruned every
    few tiles), int limits, rows with no bar yet (30 rows in bands of 4: bands unseen at a
    prune). The batches come last to first too, so a tile met later holds smaller indices,
    whose ties at the bar win."""
    from eindecomp_sql import ranking

    monkeypatch.setattr(ranking, "PRUNE_MIN", 1)
    monkeypatch.setattr(ranking, "RANK_BATCH_BYTES", 1)  # a tile a batch
    rng = np.random.default_rng(37)
    bars = []
    real = ranking._candidates
    monkeypatch.setattr(ranking, "_candidates", lambda s, k, v, *b: bars.append(b and b[0] is not None) or real(s, k, v, *b))
    for shape in ((30, 200), (4, 800)):
        x = small_ints(rng, shape, dtype)
        if dtype.startswith(("float", "bfloat")):
            x[0, np.arange(shape[1]) % 8 != 0] = np.nan  # few numbers: a best 69 holds NaN, its bar too
            x[1, 5:9] = [np.inf, -np.inf, -0.0, 0.0]
        elif dtype in ("int64", "uint64"):
            info = np.iinfo(dtype)
            x[2, ::7] = info.min
            x[3, ::5] = info.max
        with eds.connect(memory="1GB") as s:
            s.store("X", x, tile=(4, 8))
            for order in ("forwards", "backwards"):
                if order == "backwards":
                    scan = s.backend.tile_batches

                    @contextlib.contextmanager
                    def backwards(value, batch_bytes, scan=scan):
                        with scan(value, batch_bytes) as it:
                            yield iter(list(it)[::-1])

                    s.backend.tile_batches = backwards
                for k in (1, 4, 30, 69):
                    # (progress=: the table way, not SQL's query, for a stored operand)
                    got = s.topk("ij->ij", k, "X", largest=largest, progress=lambda p: None)
                    same(got, ref_topk(x, k, largest))
    assert sum(bars) > len(bars) // 2
