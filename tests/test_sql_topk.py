"""einsum_topk(spec, k, ...): the k largest elements of every output row, against numpy."""

import json
import math

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from eindecomp_sql.udfs.tiles import tiles_to_arrow
from eindecomp_sql.udfs.topk import row_top, topk_tiles
from helpers import assert_close, error_scale, random_array, topk_key
from reference import reference  # np.einsum, and bfloat16's rule where numpy has none

import eindecomp_sql as eds


def ref_topk(x: np.ndarray, k: int, largest: bool = True) -> list[tuple]:
    """(row indices..., rank, index, value): value descending (``largest``, else ascending),
    NaN last, ties by the smaller index; written with Python's sort on exact Python numbers,
    apart from the kernel."""
    out = []
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    for r, row in enumerate(rows):
        vals = [v.item() for v in row]
        for rank, j in enumerate(sorted(range(len(vals)), key=topk_key(vals, largest))[:k], 1):
            out.append((*(int(q) for q in np.unravel_index(r, x.shape[:-1])), rank, j, vals[j]))
    return out


def same_rows(got, want):
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want):
        assert g[:-1] == w[:-1], (g, w)
        gv, wv = g[-1], w[-1]
        if isinstance(wv, float) and math.isnan(wv):
            assert math.isnan(gv)
        elif isinstance(wv, float):
            assert gv == pytest.approx(wv, rel=1e-4, abs=1e-5), (g, w)
        else:
            assert gv == wv, (g, w)


@pytest.fixture(scope="module")
def tdb():
    # small tiles: results are cut into several tiles along the ranked label (and the rows)
    s = eds.connect(tile_bytes=128)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bool", "uint8", "float16", "bfloat16"])
@pytest.mark.parametrize("k", [1, 3, 40])
def test_topk_matches_numpy(tdb, dtype, k):
    rng = np.random.default_rng(21)
    a, b = random_array(rng, (7, 5), dtype if dtype != "uint8" else "int64"), random_array(rng, (5, 13), "int64")
    if dtype == "uint8":
        a = rng.integers(0, 6, (7, 5)).astype(np.uint8)
        b = rng.integers(0, 6, (5, 13)).astype(np.uint8)
    elif dtype != "int64":
        b = random_array(rng, (5, 13), dtype)
    tdb.store("A", a, tile=(3, 2), replace=True)
    tdb.store("B", b, tile=(2, 4), replace=True)
    want = reference("ij,jk->ik", a, b)
    if dtype in ("float16", "bfloat16"):
        # float16 products are summed in float32 and rounded per tile, numpy's in its own order:
        # a value may sit one float16 step away, which can reorder near-ties. The top k are
        # those of the tensor's own values, and those are numpy's to float16 rounding (bfloat16:
        # both in float32, the tensor's values compared as the float32 they are exactly)
        ours = tdb.einsum_numpy("ij,jk->ik", "A", "B")
        assert_close(ours, want, error_scale("ij,jk->ik", [a, b]))
        want = ours.astype(np.float32) if dtype == "bfloat16" else ours
    rows = tdb.connection.execute("SELECT * FROM einsum_topk('ij,jk->ik', ?, 'A', 'B')", [k]).fetchall()
    same_rows(rows, ref_topk(want, k))
    # the tie order is numpy's stable sort of the negated values
    if dtype.startswith(("float", "int")):
        order = np.argsort(-want, axis=1, kind="stable")[:, :k]
        got = np.array([r[2] for r in rows]).reshape(want.shape[0], -1)
        np.testing.assert_array_equal(got, order)


def test_topk_columns_and_types(tdb):
    rng = np.random.default_rng(22)
    tdb.store("A", random_array(rng, (4, 6), "float32"), tile=(3, 4), replace=True)
    rel = tdb.connection.sql("SELECT * FROM einsum_topk('ij->ij', 2, 'A')")
    assert rel.columns == ["i", "rank", "j", "value"]
    assert [str(t) for t in rel.types] == ["BIGINT", "BIGINT", "BIGINT", "FLOAT"]


def test_topk_three_dims_one_dim_and_extended(tdb):
    rng = np.random.default_rng(23)
    x, y = random_array(rng, (3, 4, 5), "float64"), random_array(rng, (3, 5, 9), "float64")
    tdb.store("X", x, tile=(2, 3, 2), replace=True)
    tdb.store("Y", y, tile=(2, 2, 4), replace=True)
    con = tdb.connection
    same_rows(con.sql("SELECT * FROM einsum_topk('bij,bjk->bik', 4, 'X', 'Y')").fetchall(),
              ref_topk(np.einsum("bij,bjk->bik", x, y), 4))
    # one output label: one row, the whole vector ranked
    same_rows(con.sql("SELECT * FROM einsum_topk('bij->j', 3, 'X')").fetchall(), ref_topk(x.sum((0, 1)), 3))
    # with join and agg (max-plus), and the ranked label not last in the inputs
    want = reference("bij,bjk->kb", x, y, join="add", agg="max")
    same_rows(con.sql("SELECT * FROM einsum_topk('bij,bjk->kb', 2, 'X', 'Y', join := 'add', agg := 'max')").fetchall(),
              ref_topk(want, 2))


def test_topk_nan_inf_and_signed_zero(tdb):
    a = np.array([[1.0, np.nan, 3.0, np.inf, -np.inf, 3.0, np.nan],
                  [np.nan, np.nan, -0.0, 0.0, -1.0, np.nan, -np.inf],
                  [2.0, -0.0, 0.0, 2.0, 0.0, -0.0, 2.0]])
    tdb.store("N", a, tile=(2, 3), replace=True)
    for k in (1, 2, 4, 6, 7):
        rows = tdb.connection.sql(f"SELECT * FROM einsum_topk('ij->ij', {k}, 'N')").fetchall()
        same_rows(rows, ref_topk(a, k))
        got = np.array([r[2] for r in rows]).reshape(3, -1)
        np.testing.assert_array_equal(got, np.argsort(-a, axis=1, kind="stable")[:, :k])


def test_topk_over_tables(tdb):
    """Similarity search: an array table of queries against an array table of items."""
    rng = np.random.default_rng(24)
    con = tdb.connection
    q, e = random_array(rng, (6, 4), "float32"), random_array(rng, (17, 4), "float32")
    con.execute("CREATE OR REPLACE TABLE queries(qid BIGINT, v FLOAT[4])")
    con.execute("CREATE OR REPLACE TABLE items(id BIGINT, v FLOAT[4])")
    con.executemany("INSERT INTO queries VALUES (?, ?)", [(i, r.tolist()) for i, r in enumerate(q)])
    con.executemany("INSERT INTO items VALUES (?, ?)", [(i, r.tolist()) for i, r in enumerate(e)])
    rows = con.sql("SELECT * FROM einsum_topk('id,jd->ij', 5, 'queries', 'items')").fetchall()
    same_rows(rows, ref_topk(q @ e.T, 5))


def test_topk_errors(tdb):
    tdb.store("A", np.arange(6.0).reshape(2, 3), replace=True)
    con = tdb.connection
    for k in ("0", "-1", "2.5", "0.0", "'x'", "NULL", "true"):
        with pytest.raises(duckdb.Error, match=r"k must be a whole number >= 1") as e:
            con.sql(f"SELECT * FROM einsum_topk('ij->ij', {k}, 'A')").fetchall()
        assert "eds_einsum_sql" not in str(e.value)
    with pytest.raises(duckdb.Error, match="no output label to rank"):
        con.sql("SELECT * FROM einsum_topk('ij->', 2, 'A')").fetchall()
    # 2.0 is a whole number (refused before: a trial), as the text '2' is
    want = con.sql("SELECT * FROM einsum_topk('ij->ij', 2, 'A')").fetchall()
    for k in ("2.0", "'2'", "2.00::DOUBLE"):
        assert con.sql(f"SELECT * FROM einsum_topk('ij->ij', {k}, 'A')").fetchall() == want


# -- the kernel -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint64", "bool", "float16"])
def test_row_top_kernel(dtype):
    rng = np.random.default_rng(25)
    for shape, k in (((5, 9), 1), ((5, 9), 4), ((3, 4), 4), ((3, 4), 7), ((40, 33), 6)):
        if dtype == "uint64":
            x = rng.integers(2**63, 2**64 - 1, size=shape, dtype=np.uint64)
            x[:, ::3] = x[:, :1]  # ties among huge values
        else:
            x = random_array(rng, shape, dtype)
        rows, cols = row_top(x, k)
        got = sorted(zip(rows.tolist(), cols.tolist()))
        want = [(r, j) for r, _, j, _ in ref_topk(x, k)]
        assert got == sorted(want)
    # rows that defeat the block-maxima bound (ascending: most of a row is above it) take the
    # np.partition path; with ties (small ints) too
    for x in (np.tile(np.arange(64, dtype=dtype if dtype != "bool" else "int8"), (6, 1)),
              (rng.integers(0, 3, (6, 64)) * np.arange(64) // 16).astype(dtype)):
        for k in (1, 5, 17):
            rows, cols = row_top(x, k)
            assert sorted(zip(rows.tolist(), cols.tolist())) == sorted((r, j) for r, _, j, _ in ref_topk(x, k))


def test_only_k_candidates_per_row_and_tile_leave_the_kernel():
    """A 300 x 1000 result in 1000/400 -> 3 tiles along the ranked label: at most k candidates
    per row per tile come back (not 300,000 elements), across several worker blocks."""
    rng = np.random.default_rng(26)
    x = rng.standard_normal((300, 1000)).astype(np.float32)
    tiles, keys = [], []
    for q in range(3):
        tiles.append(np.ascontiguousarray(x[:, q * 400:(q + 1) * 400]))
        keys.append([0, q])
    spec = json.dumps({"shape": [300, 1000], "tile": [300, 400], "dtype": "float32", "k": 5})
    out = topk_tiles(pa.array([spec] * 3), pa.array(keys, type=pa.list_(pa.int64())), tiles_to_arrow(tiles))
    cands = out.flatten()
    assert len(cands) == 3 * 300 * 5
    r, i, v = (cands.field(n).to_numpy() for n in ("r", "i", "v"))
    np.testing.assert_array_equal(v, x[r, i])
    best = {}
    for rr, ii, vv in zip(r, i, v):
        best.setdefault(int(rr), []).append((-float(vv), int(ii)))
    top = np.array([[j for _, j in sorted(best[rr])[:5]] for rr in range(300)])
    np.testing.assert_array_equal(top, np.argsort(-x, axis=1, kind="stable")[:, :5])


def test_fused_and_unfused_paths(tdb):
    """The top-k runs inside the einsum kernel when the last step is a binary (or unary) einsum
    with a dtype DOUBLE holds exactly; otherwise a separate kernel reads the result tiles.
    Both give numpy's answer."""
    rng = np.random.default_rng(27)
    con = tdb.connection
    a, b, c = (random_array(rng, s, "float64") for s in ((6, 9), (9, 11), (11,)))
    tdb.store("A", a, tile=(4, 4), replace=True)  # j cut in 3: the last step groups
    tdb.store("B", b, tile=(4, 4), replace=True)
    tdb.store("C", c, tile=(4,), replace=True)
    cases = [
        ("ij,jk->ik", ["A", "B"], None, "eds_topk_eds_einsum_group2", np.einsum("ij,jk->ik", a, b)),
        ("ij->ji", ["A"], None, "eds_topk_eds_einsum1", a.T),
        # a three-operand join that is not a semiring stays one 3-ary step: not fused
        ("ij,jk,k->ik", ["A", "B", "C"], "x * y + z", "eds_topk_float64(",
         reference("ij,jk,k->ik", a, b, c, join=lambda x, y, z: x * y + z, agg="sum")),
    ]
    for spec, names, join, kernel, want in cases:
        assert kernel in tdb._einsum_sql(spec, names, "topk", join, None, "3").lower()
        args = ", ".join("?" * len(names)) + (", join := ?" if join else "")
        rows = con.execute(f"SELECT * FROM einsum_topk(?, 3, {args})", [spec, *names] + ([join] if join else [])).fetchall()
        same_rows(rows, ref_topk(want, 3))
    # int64 values are not exact in DOUBLE: the separate kernel keeps them exact
    big = np.array([[2**62 + 1, 2**62, 2**62 + 3], [5, -(2**62), 2**62 - 1]], dtype=np.int64)
    tdb.store("I", big, replace=True)
    assert "eds_topk_int64(" in tdb._einsum_sql("ij->ij", ["I"], "topk", None, None, "2").lower()
    same_rows(con.sql("SELECT * FROM einsum_topk('ij->ij', 2, 'I')").fetchall(), ref_topk(big, 2))
    # a label of size 0: the plan fills the result (all zeros here), no einsum kernel to fuse
    tdb.store("Z1", np.zeros((3, 0)), replace=True)
    tdb.store("Z2", np.zeros((0, 4)), replace=True)
    same_rows(con.sql("SELECT * FROM einsum_topk('ij,jk->ik', 2, 'Z1', 'Z2')").fetchall(), ref_topk(np.zeros((3, 4)), 2))


def test_rows_come_in_order_whatever_the_labels_are_called():
    # ORDER BY r bound to an output column named "r" (the last label): rows came out of order
    rng = np.random.default_rng(12)
    a = rng.standard_normal((2, 4, 3))
    with eds.connect() as db:
        db.store("A", a, tile=(1, 2, 2))
        for spec in ("rab->rab", "riv->riv", "vir->vir"):
            rows = db.connection.sql(f"SELECT * FROM einsum_topk('{spec}', 2, 'A')").fetchall()
            want = []
            for x in range(2):
                for y in range(4):
                    for k, j in enumerate(np.argsort(-a[x, y], kind="stable")[:2]):
                        want.append((x, y, k + 1, int(j), float(a[x, y, j])))
            assert [tuple(r) for r in rows] == want, spec


def test_a_topk_over_a_result_bigger_than_the_budget_runs_as_one_query_within_it():
    """The embeddings case: 300 queries against 20,000 items is a 24 MB result, the whole of
    memory="40MB"'s plan share. Planned as it is held, the product ran as several statements
    and the SQL function refused it (asking for memory= the size of the result); the top-k
    fused into the einsum kernel never holds the result, so it is planned without it
    (``CostModel.streamed_result``): one query, within the budget, numpy's answer."""
    from eindecomp_sql.plan.steps import EinsumStep

    rng = np.random.default_rng(12)
    q = rng.standard_normal((300, 64)).astype(np.float32)
    e = rng.standard_normal((20000, 64)).astype(np.float32)
    with eds.connect(memory="40MB") as db:
        db.store("Q", q)
        db.store("E", e)
        assert db.plan("id,jd->ij", "Q", "E").steps[-1].batches > 1  # held, it would not be one query
        sql = db._einsum_sql("id,jd->ij", ["Q", "E"], "topk", None, None, "3").lower()
        assert "eds_topk_eds_einsum2" in sql
        rows = db.connection.sql("SELECT * FROM einsum_topk('id,jd->ij', 3, 'Q', 'E')").fetchall()
        same_rows(rows, ref_topk(q @ e.T, 3))
        from eindecomp_sql.sql_functions import _streamed_topk_plan, streamed_costs

        plan = _streamed_topk_plan(db, "id,jd->ij", [db.tensor("Q").value, db.tensor("E").value], None, None, 3)
        assert [type(s) for s in plan.steps].count(EinsumStep) == 1 and all(s.batches == 1 for s in plan.steps)
        assert max(s.peak(streamed_costs(db.backend.cost_model)) for s in plan.steps) <= db.plan_budget
        # a k as wide as a tile makes every element a candidate (~100 B each in DuckDB, 25x the result):
        # counted, that is over the budget, and refused as before
        with pytest.raises(duckdb.Error, match=r"which db\.topk\(\.\.\.\) from Python runs one after another"):
            db.connection.sql("SELECT * FROM einsum_topk('id,jd->ij', 1250, 'Q', 'E')").fetchall()
    # a join and an aggregation (its kernel blocks the join space: 34 MB at most here)
    with eds.connect(memory="80MB") as db:
        db.store("Q", q[:100])
        db.store("E", e)
        assert db.plan("id,jd->ij", "Q", "E", join="-abs(x - y)", agg="min").steps[-1].batches > 1
        rows = db.connection.sql("SELECT * FROM einsum_topk('id,jd->ij', 2, 'Q', 'E', join := '-abs(x - y)', "
                                 "agg := 'min')").fetchall()
    same_rows(rows, ref_topk(np.min(-np.abs(q[:100, None, :] - e[None, :, :]), axis=2), 2))


def test_topk_refused_under_a_budget_says_the_memory_that_runs_it():
    """Under memory= a top-k whose product is batched is one query it cannot split; the
    refusal said "call db.einsum(...) from Python", which has no top-k (a trial). It now says
    the memory= under which it runs, and it does run there."""
    import re

    rng = np.random.default_rng(12)
    # int64: not exact in DOUBLE, so the top-k is not fused into the einsum kernel, whose
    # result tiles then reach SQL and are planned as held (float32 runs: the test above)
    q = rng.integers(-1000, 1000, (300, 64))
    e = rng.integers(-1000, 1000, (20000, 64))
    with eds.connect(memory="40MB") as db:
        db.store("Q", q)
        db.store("E", e)
        with pytest.raises(duckdb.Error, match=r"which db\.topk\(\.\.\.\) from Python runs") as info:
            db.connection.sql("SELECT * FROM einsum_topk('id,jd->ij', 3, 'Q', 'E')").fetchall()
        need = re.search(r"memory= of at least (\S+ [kMG]?B)", str(info.value)).group(1).replace(" ", "")
        assert "db.einsum" not in str(info.value)
        # ... and db.topk does, under the same budget (the statements one after another)
        got = db.topk("id,jd->ij", 3, "Q", "E")
        np.testing.assert_array_equal(got.indices, np.argsort(-(q @ e.T), axis=1, kind="stable")[:, :3])
    with eds.connect(memory=need) as db:
        db.store("Q", q)
        db.store("E", e)
        rows = db.connection.sql("SELECT * FROM einsum_topk('id,jd->ij', 3, 'Q', 'E')").fetchall()
    same_rows(rows, ref_topk(q @ e.T, 3))


@pytest.mark.parametrize("tile", [(300, 1000), (20, 30)], ids=["big tiles", "small tiles"])
def test_the_fused_topk_kernel_computes_a_slice_of_results_at_a_time(tile):
    """In a streamed plan (its spec's "stream"), a vector of joined rows is computed a slice at a
    time (at least one result tile, ``STREAM_SLICE_BYTES`` of them when small), each cut to its
    candidates before the next:
    the candidates are those of the whole call. The einsum kernel is a stand-in here that
    hands back tiles it is given, counting the rows of each call."""
    from eindecomp_sql.plan.cost import STREAM_SLICE_BYTES
    from eindecomp_sql.udfs.topk import _fused

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2 * tile[0], 3 * tile[1]))
    keys = [[i, k] for i in range(2) for k in range(3)]
    tiles = tiles_to_arrow([np.ascontiguousarray(x[i * tile[0]:(i + 1) * tile[0], k * tile[1]:(k + 1) * tile[1]])
                            for i, k in keys])
    spec = json.dumps({"shape": list(x.shape), "tile": list(tile), "dtype": "float64", "k": 4,
                       "stream": STREAM_SLICE_BYTES})
    calls = []

    def kernel(t):
        calls.append(len(t))
        return t

    got = _fused(kernel, ["t"])(pa.array([spec] * 6), pa.array(keys, pa.list_(pa.int64())), tiles)
    assert calls == ([1] * 6 if tile[0] * tile[1] * 8 >= STREAM_SLICE_BYTES else [6]), calls
    # an ordinary plan's kernel computes its call whole (the bits einsum_elements gives)
    whole = json.dumps({**json.loads(spec), "stream": None})
    calls.clear()
    assert _fused(kernel, ["t"])(pa.array([whole] * 6), pa.array(keys, pa.list_(pa.int64())), tiles).equals(got)
    assert calls == [6], calls
    assert got.equals(topk_tiles(pa.array([spec] * 6), pa.array(keys, pa.list_(pa.int64())), tiles))
    cands = got.flatten()
    r, i = cands.field("r").to_numpy(), cands.field("i").to_numpy()
    np.testing.assert_array_equal(cands.field("v").to_numpy(), x[r, i])


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "int64", "uint64", "bool", "float16", "bfloat16"])
def test_largest_false_ranks_the_smallest(tdb, dtype):
    """``largest := false``: smallest first, NaN still last, ties by the smaller index, on the
    fused path (the einsum kernel ranks) and the separate kernel's (int64, uint64: not exact in
    DOUBLE), integers at their limits included (negating them would overflow)."""
    rng = np.random.default_rng(31)
    a = random_array(rng, (7, 19), dtype)
    if dtype in ("int64", "uint64"):
        info = np.iinfo(dtype)
        a[0, :4] = [info.min, info.max, info.min, 1]
    if dtype.startswith(("float", "bfloat")):  # (bfloat16's NaN ranked first: a review)
        a[1, :5] = [np.nan, -np.inf, np.inf, -0.0, 0.0]
    tdb.store("S", a, tile=(3, 5), replace=True)
    want = a.astype(np.float32) if dtype == "bfloat16" else a
    con = tdb.connection
    for k in (1, 4, 30):
        rows = con.sql(f"SELECT * FROM einsum_topk('ij->ij', {k}, 'S', largest := false)").fetchall()
        same_rows(rows, ref_topk(want, k, largest=False))
        same_rows(con.sql(f"SELECT * FROM einsum_topk('ij->ij', {k}, 'S', largest := true)").fetchall(),
                  ref_topk(want, k))
    # a product, fused into its kernel
    b = random_array(rng, (19, 6), dtype)
    tdb.store("T", b, tile=(5, 4), replace=True)
    ours = tdb.einsum_numpy("ij,jk->ik", "S", "T")
    rows = con.sql("SELECT * FROM einsum_topk('ij,jk->ik', 2, 'S', 'T', largest := false)").fetchall()
    same_rows(rows, ref_topk(ours.astype(np.float32) if dtype == "bfloat16" else ours, 2, largest=False))
    for bad in ("NULL", "'maybe'", "2"):
        with pytest.raises(duckdb.Error, match="largest must be true or false"):
            con.sql(f"SELECT * FROM einsum_topk('ij->ij', 2, 'S', largest := {bad})").fetchall()


def test_largest_false_under_a_budget_streams_as_largest_does():
    rng = np.random.default_rng(13)
    q = rng.standard_normal((300, 64)).astype(np.float32)
    e = rng.standard_normal((20000, 64)).astype(np.float32)
    with eds.connect(memory="40MB") as db:
        db.store("Q", q)
        db.store("E", e)
        sql = db._einsum_sql("id,jd->ij", ["Q", "E"], "topk", None, None, "3;false")
        assert '"stream"' in sql and '"smallest":true' in sql
        rows = db.connection.sql("SELECT * FROM einsum_topk('id,jd->ij', 3, 'Q', 'E', largest := false)").fetchall()
    same_rows(rows, ref_topk(q @ e.T, 3, largest=False))


def test_a_topk_whose_candidates_are_over_the_budget_is_refused_and_db_topk_ranks_it():
    """A plan that fits the budget left out the candidates its window holds at once (up to k a
    row of every result tile, ~100 B each in DuckDB, counted at 24 B then): k=20000 over a 150 x 20000 float32 result (12 MB)
    rose resident memory by 153 MiB under memory="100MB". Counted, the query is refused with
    what runs it: db.topk, a smaller k, or the memory= it names (which runs it)."""
    import re

    rng = np.random.default_rng(7)
    # small integers: every product exact whatever the tiles' order of summation (ties many)
    q = rng.integers(-8, 9, (40, 16)).astype(np.float32)
    e = rng.integers(-8, 9, (20000, 16)).astype(np.float32)
    x = q @ e.T
    order = np.argsort(-x, axis=1, kind="stable")

    def ranked(db, k):
        t = db.connection.sql(f"SELECT * FROM einsum_topk('id,jd->ij', {k}, 'Q', 'E')").to_arrow_table()
        return t.column("j").to_numpy().reshape(40, k)

    with eds.connect(memory="40MB") as db:
        db.store("Q", q)
        db.store("E", e)
        with pytest.raises(duckdb.Error, match=r"its window would hold 80\.0 MB of candidates") as info:
            ranked(db, 20000)
        assert "db.topk(...)" in str(info.value)
        need = re.search(r"memory= of at least (\S+ [kMG]?B)", str(info.value)).group(1).replace(" ", "")
        np.testing.assert_array_equal(ranked(db, 3), order[:, :3])  # a k whose candidates fit runs as before
        np.testing.assert_array_equal(db.topk("id,jd->ij", 20000, "Q", "E").indices, order)
    with eds.connect(memory=need) as db:
        db.store("Q", q)
        db.store("E", e)
        np.testing.assert_array_equal(ranked(db, 20000), order)


@pytest.mark.parametrize("operands", ["stored", "tables"])
def test_a_refusal_names_the_least_memory_its_streamed_plan_runs_under(operands):
    """Refused under a budget, einsum_topk names the memory= under which its streamed plan (the
    top-k inside the kernel) is one query, and it runs there: it named the whole product's,
    4.4 GB where 500MB ran it (a trial; here 870 MB against ~90 MB). Tables are cut by the
    budget they are read under: with the session's cuts the figure was refused again (a review)."""
    import re

    import pyarrow as pa

    rng = np.random.default_rng(13)
    q = rng.standard_normal((400, 32), dtype=np.float32)
    e = rng.standard_normal((100000, 32), dtype=np.float32)  # a 160 MB result

    def operands_in(db):
        if operands == "stored":
            db.store("Q", q, tile=(400, 32))
            db.store("E", e, tile=(6250, 32))
            return
        for name, x in (("Q", q), ("E", e)):
            db.connection.register("src", pa.table({"id": np.arange(len(x)), "emb": pa.FixedSizeListArray.from_arrays(
                pa.array(x.ravel()), 32)}))
            db.connection.execute(f"CREATE TABLE {name} AS SELECT * FROM src")
            db.connection.unregister("src")

    query = "SELECT * FROM einsum_topk('id,jd->ij', 3, 'Q', 'E')"
    for memory in ("30MB", "40MB"):
        with eds.connect(memory=memory) as db:
            operands_in(db)
            with pytest.raises(duckdb.Error, match="connect with memory= of at least") as info:
                db.connection.sql(query).fetchall()
        need = re.search(r"memory= of at least (\S+) ([kMG]?B)", str(info.value))
        assert need.group(2) == "MB" and float(need.group(1)) < 160, need.group(0)
        with eds.connect(memory=need.group(1) + need.group(2)) as db:
            operands_in(db)
            t = db.connection.sql(query).to_arrow_table()
        got = t.column("j").to_numpy().reshape(400, 3)
        np.testing.assert_array_equal(got, np.argsort(-(q @ e.T), axis=1, kind="stable")[:, :3])
