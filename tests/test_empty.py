"""Dimensions of size 0 behave as in numpy: empty results, and reductions over nothing give
the aggregation's identity (sum 0, prod 1) or, for max and min, an error."""

import numpy as np
import pytest
from hypothesis import given

import eindecomp_sql as eds
from eindecomp_sql import EinsumError

from helpers import DTYPES, assert_close, einsum_case, random_array
from reference import reference  # np.einsum, and bfloat16's rule where numpy has none


@given(einsum_case(max_operands=3, min_size=0, empty=True))
def test_empty_dimensions_match_numpy(db, case):
    spec, shapes, dtypes, tiles, seed = case
    assert any(0 in s for s in shapes)
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = reference(spec, *arrays)
    assert_close(eds.einsum(spec, *arrays), want)
    names = [db.store(f"p{k}", a, tile=t, replace=True) for k, (a, t) in enumerate(zip(arrays, tiles))]
    got = db.einsum(spec, *names)
    assert got.shape == want.shape
    assert_close(got.to_numpy(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_and_reopen_empty_tensor(tmp_path, dtype):
    path = str(tmp_path / "e.duckdb")
    a = np.zeros((0, 5), dtype=dtype)
    with eds.connect(path) as db:
        t = db.store("E", a)
        assert t.to_arrow().num_rows == 0
    with eds.connect(path) as db:
        e = db.tensor("E")
        assert e.shape == (0, 5) and e.dtype == np.dtype(dtype)
        assert e.to_numpy().shape == (0, 5)


@pytest.mark.parametrize("agg,value", [("sum", 0), ("prod", 1)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_reduction_over_nothing_is_the_identity(db, agg, value, dtype):
    # j has size 0: every output element aggregates an empty set
    a = np.zeros((3, 0), dtype=dtype)
    b = np.zeros((0, 4), dtype=dtype)
    A, B = db.store("A", a, replace=True), db.store("B", b, replace=True)
    got = db.einsum("ij,jk->ik", A, B, agg=agg, out="C", replace=True).to_numpy()
    want_dtype = eds.einsum("ij,jk->ik", np.ones((3, 2), dtype), np.ones((2, 4), dtype), agg=agg).dtype
    np.testing.assert_array_equal(got, np.full((3, 4), value, dtype=want_dtype))
    assert got.dtype == want_dtype
    # with tiles smaller than the result, edge tiles are filled with their own shapes
    got = db.einsum("ij,jk->ik", a, b, agg=agg)
    np.testing.assert_array_equal(got.to_numpy(), np.full((3, 4), value, dtype=want_dtype))


def test_fill_cuts_a_large_result_into_tiles(backend):
    db = eds.connect(tile_bytes=64, backend=backend)  # 16 float32 per tile: the (7, 9) result needs many tiles
    got = db.einsum("ij,jk->ik", np.zeros((7, 0), np.float32), np.zeros((0, 9), np.float32))
    assert got.to_arrow().num_rows > 1
    np.testing.assert_array_equal(got.to_numpy(), np.zeros((7, 9), np.float32))
    db.close()


@pytest.mark.parametrize("agg", ["max", "min"])
def test_max_min_over_nothing_is_an_error(db, agg):
    a, b = np.ones((3, 0)), np.ones((0, 4))
    with pytest.raises(EinsumError, match=f"agg='{agg}' reduces over label 'j' of size 0"):
        db.einsum("ij,jk->ik", a, b, agg=agg, out="C_none")
    assert "C_none" not in db.tensors()
    # an empty output reduces nothing: no error, like numpy's max over an empty axis of nothing
    assert db.einsum("ij,jk->ik", np.ones((0, 0)), np.ones((0, 4)), agg=agg).shape == (0, 4)


@pytest.mark.duckdb_only("the SQL interface")
def test_sql_interface_on_empty_tensors(db):
    db.store("A", np.zeros((0, 3), np.float32), replace=True)
    db.store("B", np.zeros((0, 2), np.float32), replace=True)
    con = db.connection
    # ji,jk->ik sums over j of size 0: a full (3, 2) result of zeros
    rows = con.execute("SELECT i, k, value FROM einsum_elements('ji,jk->ik', 'A', 'B') ORDER BY i, k").fetchall()
    assert rows == [(i, k, 0.0) for i in range(3) for k in range(2)]
    # A with itself: a (3, 3) result of zeros in one tile; an empty output has no rows at all
    assert con.execute("SELECT count(*) FROM einsum('ji,jk->ik', 'A', 'A')").fetchone()[0] == 1
    assert con.execute("SELECT count(*) FROM einsum('ij->ij', 'A')").fetchone()[0] == 0


def test_explain_names_the_fill(db):
    text = db.explain("ij,jk->ik", np.ones((2, 0)), np.ones((0, 3)))
    assert "fill" in text and "eds_fill" in text.lower()


def test_fill_keeps_to_a_memory_budget(backend):
    # (a session's plans get BUDGET_SHARE of its budget: 4.2 of 7 MB)
    db = eds.connect(memory="7MB", tile_bytes=1 << 20, backend=backend)
    a, b = np.zeros((2000, 0), np.float32), np.zeros((0, 2000), np.float32)
    plan = db.plan("ij,jk->ik", a, b)
    assert plan.steps[0].batches > 1 and plan.peak_bytes <= 4_200_000
    got = db.einsum("ij,jk->ik", a, b, agg="prod")
    np.testing.assert_array_equal(got.to_numpy(), np.ones((2000, 2000), np.float32))
    db.close()


def test_labels_differing_only_in_case(backend):
    # DuckDB names are case-insensitive: key columns i and I must not clash in the fill's SQL
    a, b = np.ones((2, 0)), np.ones((0, 3))
    np.testing.assert_array_equal(eds.einsum("iJ,JI->iI", a, b), np.einsum("iJ,JI->iI", a, b))
