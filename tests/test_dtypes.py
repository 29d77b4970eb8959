"""Every supported dtype (bool, int8..int64, uint8..uint64, float32/64, complex64/128) with
numpy's promotion, through store, einsum (arrays and stored), retile, to_numpy, extended joins
and einsum_elements; every other dtype is an EinsumError."""

import itertools

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError, Graph
from eindecomp_sql.notation.checks import DTYPES as SUPPORTED

from helpers import DTYPES, assert_close, error_scale, random_array


def test_helpers_cover_every_supported_dtype():
    assert set(DTYPES) == set(SUPPORTED)


@pytest.mark.parametrize("pair", list(itertools.product(DTYPES, repeat=2)), ids="-".join)
def test_promotion_of_every_pair_is_numpys(backend, pair):
    rng = np.random.default_rng(3)
    a, b = random_array(rng, (4, 3), pair[0]), random_array(rng, (3, 5), pair[1])
    want = np.einsum("ij,jk->ik", a, b)
    assert_close(eds.einsum("ij,jk->ik", a, b), want, error_scale("ij,jk->ik", [a, b]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_retiled_and_read_back(db, dtype):
    rng = np.random.default_rng(5)
    a = random_array(rng, (7, 5), dtype)
    b = random_array(rng, (5, 6), dtype)
    A = db.store("dt_a", a, tile=(3, 2), replace=True)
    B = db.store("dt_b", b, tile=(4, 4), replace=True)  # cut differently: the plan retiles one
    assert A.dtype == np.dtype(dtype) and db.tensor("dt_a").dtype == np.dtype(dtype)
    np.testing.assert_array_equal(A.to_numpy(), a)
    plan = db.plan("ij,jk->ik", A, B)
    assert any("retile" in s.describe() for s in plan.steps)
    assert_close(db.einsum("ij,jk->ik", A, B).to_numpy(), np.einsum("ij,jk->ik", a, b),
                 error_scale("ij,jk->ik", [a, b]))
    assert_close(db.einsum("ij->ji", A).to_numpy(), a.T)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64", "complex64",
                                   "complex128"])
@pytest.mark.parametrize("join,agg", [("add", "max"), ("max", "min"), ("sub", "prod"), ("x * y + 1", "sum")])
def test_extended_joins_on_new_dtypes(db, dtype, join, agg):
    """Where numpy defines the operation, its answer (complex max/min compare as numpy does:
    real part first, then imaginary); unsigned subtraction wraps as in numpy."""
    from reference import reference

    rng = np.random.default_rng(7)
    a = random_array(rng, (4, 5), dtype)
    b = random_array(rng, (5, 3), dtype)
    fn = {"x * y + 1": lambda x, y: x * y + 1}.get(join, join)
    with np.errstate(all="ignore"):
        want = reference("ij,jk->ik", a, b, join=fn, agg=agg)
    A = db.store("nd_a", a, tile=(3, 2), replace=True)
    B = db.store("nd_b", b, tile=(2, 2), replace=True)
    assert_close(db.einsum("ij,jk->ik", A, B, join=join, agg=agg).to_numpy(), want)
    assert_close(eds.einsum("ij,jk->ik", a, b, join=join, agg=agg), want)


def test_complex_max_is_numpys_lexicographic_max(backend):
    a = np.array([[1 + 5j, 2 + 0j, 2 - 1j], [-1j, -3 + 9j, -3 + 1j]])
    np.testing.assert_array_equal(eds.einsum("ij->i", a, agg="max"), np.max(a, axis=1))
    np.testing.assert_array_equal(eds.einsum("ij->i", a, agg="min"), np.min(a, axis=1))


@pytest.mark.parametrize("dtype,sqltype", [("int8", "TINYINT"), ("uint8", "UTINYINT"), ("int16", "SMALLINT"),
                                           ("uint16", "USMALLINT"), ("uint32", "UINTEGER"), ("uint64", "UBIGINT"),
                                           ("int32", "INTEGER"), ("float32", "FLOAT"), ("bool", "BOOLEAN")])
@pytest.mark.duckdb_only("einsum_elements is SQL")
def test_einsum_elements_of_new_dtypes(db, dtype, sqltype):
    rng = np.random.default_rng(2)
    a = random_array(rng, (3, 4), dtype)
    db.store("el_a", a, tile=(2, 3), replace=True)
    rows = db.connection.sql("SELECT *, typeof(value) FROM einsum_elements('ij->ji', 'el_a')").fetchall()
    assert {r[3] for r in rows} == {sqltype}
    got = np.empty((4, 3), dtype)
    for j, i, v, _ in rows:
        got[j, i] = v
    np.testing.assert_array_equal(got, a.T)


@pytest.mark.duckdb_only("einsum_elements is SQL")
def test_einsum_elements_of_complex_is_refused_clearly(db):
    db.store("el_c", np.array([1 + 2j, 3 - 1j]), replace=True)
    with pytest.raises(Exception, match="complex128, which has no DuckDB type") as e:
        db.connection.sql("SELECT * FROM einsum_elements('i->i', 'el_c')").fetchall()
    assert "einsum() for its tiles" in str(e.value)
    # the tiles themselves are fine
    assert db.connection.sql("SELECT count(*) FROM einsum('i->i', 'el_c')").fetchall()[0][0] >= 1


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, "datetime64[s]", "U3", object,
                                   [("a", "f8")], "V8"])
def test_every_other_dtype_is_an_einsum_error(db, dtype):
    a = np.zeros(3, dtype=dtype)
    with pytest.raises(EinsumError):
        eds.einsum("i->i", a)
    with pytest.raises(EinsumError):
        db.store("other", a)
    g = Graph()
    with pytest.raises(EinsumError):
        g.input("x", (3,), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "no_such_dtype", 3.5])
def test_bfloat16_and_non_dtypes_as_arguments(dtype):
    with pytest.raises(EinsumError):
        eds.einsum("i->", np.ones(3), dtype=dtype, casting="unsafe")
    # "i->i" is numpy's view case: numpy ignores dtype there (and so do we), but not a non-dtype
    # (numpy has no bfloat16)
    with pytest.raises(EinsumError):
        eds.einsum("i->i", np.ones(3), dtype=dtype)
    with pytest.raises(EinsumError):
        Graph().input("x", (3,), dtype)


def test_float16_as_an_argument_is_numpys(db):
    """float16 is stored and computed like any other dtype: dtype= and graph inputs take it."""
    x = np.linspace(-2, 3, 7)
    for spec in ("i->", "i->i"):
        got = np.asarray(eds.einsum(spec, x, dtype="float16", casting="unsafe"))
        want = np.einsum(spec, x, dtype="float16", casting="unsafe")
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3)
    g = Graph()
    g.einsum("i->", g.input("x", (7,), "float16"), name="s")
    got = g.run(db, x=x.astype(np.float16)).to_numpy()
    assert got.dtype == np.float16
    np.testing.assert_allclose(float(got), float(x.astype(np.float16).sum()), rtol=1e-3)


@pytest.mark.parametrize("join", ["sqrt", "exp", "log", "tanh", "sigmoid", lambda x: np.sqrt(x)])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "bool"])
def test_a_join_numpy_answers_in_float16_is_float16(join, dtype):
    """numpy's sqrt of int8 is float16: so is ours, with numpy's values."""
    x = np.arange(1, 4).astype(dtype)
    fn = {"sqrt": np.sqrt, "exp": np.exp, "log": np.log, "tanh": np.tanh}.get(join, join)
    if join == "sigmoid":
        if dtype == "bool":  # numpy refuses -bool inside sigmoid
            with pytest.raises(EinsumError, match="boolean negative"):
                eds.einsum("i->i", x, join=join)
            return
        fn = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    want = fn(x)
    got = eds.einsum("i->i", x, join=join)
    assert got.dtype == want.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-3)


def test_float16_products_are_summed_in_float32(db):
    """A float16 product summed runs in float32 and is rounded once per tile: on one tile it is
    the float32 product rounded to float16, to one float16 step (BLAS sums in its own order;
    the reference backend's numpy sums pairwise), on every backend."""
    def within_a_step(got, want, scale):
        """One float16 step, plus float32's own rounding of the terms' magnitudes (``scale``):
        where terms cancel, the float32 sum's order shows through."""
        assert got.dtype == want.dtype == np.float16
        bound = np.spacing(np.abs(want)).astype(np.float32) + 1e-5 * scale
        assert (np.abs(got.astype(np.float32) - want.astype(np.float32)) <= bound).all()

    rng = np.random.default_rng(40)
    a = rng.standard_normal((96, 200)).astype(np.float16)
    b = rng.standard_normal((200, 64)).astype(np.float16)
    db.store("h16a", a, replace=True)
    db.store("h16b", b, replace=True)
    within_a_step(db.einsum_numpy("ij,jk->ik", "h16a", "h16b"),
                  (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16),
                  np.abs(a).astype(np.float32) @ np.abs(b).astype(np.float32))
    # batched and with the output's labels in another order (the general einsum path)
    x = rng.standard_normal((3, 20, 30)).astype(np.float16)
    y = rng.standard_normal((3, 30, 10)).astype(np.float16)
    want = np.einsum("bij,bjk->kib", x.astype(np.float32), y.astype(np.float32)).astype(np.float16)
    within_a_step(db.einsum_numpy("bij,bjk->kib", db.store("h16x", x, replace=True), db.store("h16y", y, replace=True)),
                  want, np.einsum("bij,bjk->kib", np.abs(x).astype(np.float32), np.abs(y).astype(np.float32)))
