"""Every supported dtype (bool, int8..int64, uint8..uint64, float16, bfloat16, float32/64,
complex64/128) with numpy's promotion (bfloat16: as float16's, ``checks.promote``), through
store, einsum (arrays and stored), retile, to_numpy, extended joins and einsum_elements; every
other dtype is an EinsumError."""

import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql import EinsumError, EinsumTypeError, Graph
from eindecomp_sql.notation.checks import DTYPES as SUPPORTED, can_cast, promote

from helpers import DTYPES, assert_close, error_scale, random_array
from reference import reference


def test_helpers_cover_every_supported_dtype():
    assert set(DTYPES) == set(SUPPORTED)


@pytest.mark.parametrize("pair", list(itertools.product(DTYPES, repeat=2)), ids="-".join)
def test_promotion_of_every_pair_is_numpys(backend, pair):
    rng = np.random.default_rng(3)
    a, b = random_array(rng, (4, 3), pair[0]), random_array(rng, (3, 5), pair[1])
    want = reference("ij,jk->ik", a, b)  # np.einsum, but for bfloat16 (numpy refuses it)
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
    assert_close(db.einsum("ij,jk->ik", A, B).to_numpy(), reference("ij,jk->ik", a, b),
                 error_scale("ij,jk->ik", [a, b]))
    assert_close(db.einsum("ij->ji", A).to_numpy(), a.T)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64", "complex64",
                                   "complex128"])
@pytest.mark.parametrize("join,agg", [("add", "max"), ("max", "min"), ("sub", "prod"), ("x * y + 1", "sum")])
def test_extended_joins_on_new_dtypes(db, dtype, join, agg):
    """Where numpy defines the operation, its answer (complex max/min compare as numpy does:
    real part first, then imaginary); unsigned subtraction wraps as in numpy."""
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


@pytest.mark.parametrize("dtype", ["no_such_dtype", 3.5, "void16", "float128"])
def test_non_dtypes_as_arguments(dtype):
    with pytest.raises(EinsumError):
        eds.einsum("i->", np.ones(3), dtype=dtype, casting="unsafe")
    if dtype in ("no_such_dtype", 3.5):
        # "i->i" is numpy's view case: numpy ignores dtype there (and so do we), but not a non-dtype
        with pytest.raises(EinsumError):
            eds.einsum("i->i", np.ones(3), dtype=dtype)
    with pytest.raises(EinsumError):
        Graph().input("x", (3,), dtype)


def test_dtype_applies_to_a_lone_operands_join_where_numpys_view_case_ignores_it():
    """numpy ignores ``dtype`` for a lone operand's copy, transpose or diagonal (a view); a join
    of ours computes there, and ``dtype`` widens it as when a label is reduced. It was ignored:
    int8 squares wrapped, ``sqrt`` stayed float16, an unsafe cast went unrefused (a trial)."""
    x = np.array([[100, 50], [-7, 3]], np.int8)
    for spec, want in (("ij->ij", x.astype(np.int64) ** 2), ("ij->ji", (x.astype(np.int64) ** 2).T),
                       ("ii->i", np.diagonal(x).astype(np.int64) ** 2)):
        got = eds.einsum(spec, x, join="square", dtype=np.int64)
        assert got.dtype == np.int64 and np.array_equal(got, want), (spec, got)
        assert eds.einsum(spec, x, agg="max", dtype=np.int64).dtype == np.int64
    h = np.array([[2.0, 3.0]], np.float16)
    got = eds.einsum("ij->ji", h, join="sqrt", dtype=np.float64)
    np.testing.assert_allclose(got, np.sqrt(h.astype(np.float64)).T, rtol=1e-15)
    assert got.dtype == np.float64
    with pytest.raises(EinsumTypeError):  # float64 into int8 under casting='safe', as "ij->i" refuses
        eds.einsum("ij->ij", np.full((1, 2), 0.5), join="exp", dtype=np.int8)
    # numpy's own view case is untouched: dtype ignored, the operand's dtype kept
    assert eds.einsum("ij->ji", x, dtype=np.int64).dtype == np.int8 == np.einsum("ij->ji", x, dtype=np.int64).dtype


def test_bfloat16_promotes_as_float16_does():
    """numpy has no promotion of its own for bfloat16 (ml_dtypes raises with int16, int32,
    uint64 and float16): it follows float16's, and with float16 gives float32."""
    bf = np.dtype("bfloat16")
    for other in DTYPES:
        d = np.dtype(other)
        if d == bf:
            want = bf
        elif d == np.float16:
            want = np.dtype(np.float32)
        else:
            f16 = np.result_type(np.float16, d)
            want = bf if f16 == np.float16 else f16
        assert promote(bf, d) == want == promote(d, bf), other
        a, b = np.ones((2, 3), bf), np.ones((3, 2), d)
        assert eds.einsum("ij,jk->ik", a, b).dtype == want, other


def test_bfloat16_casts_as_a_float():
    """ml_dtypes answers some directions only (bfloat16 -> float16 is not even same_kind
    there): casting rules follow ``promote`` for 'safe' and numpy's kind order otherwise, the
    same whether the values come as an array, a table or a file."""
    bf = np.dtype("bfloat16")
    for other in DTYPES:
        d = np.dtype(other)
        assert can_cast(bf, d, "safe") == (promote(bf, d) == d), other
        assert can_cast(d, bf, "safe") == (promote(bf, d) == bf), other
        assert can_cast(bf, d, "same_kind") == (d.kind in "fc" or d == bf), other
        assert can_cast(d, bf, "same_kind") == (d.kind in "buif" or d == bf), other
        assert can_cast(bf, d, "unsafe") and can_cast(d, bf, "unsafe")
        assert can_cast(bf, d, "no") == can_cast(d, bf, "equiv") == (d == bf)
    a = random_array(np.random.default_rng(12), (4, 3), "bfloat16")
    with eds.connect() as db:
        T = db.store("bf", a)
        for source in (a, T.to_arrow(), T.to_arrow("elements")):
            got = db.store("h", source, dtype="float16", replace=True).to_numpy()
            np.testing.assert_array_equal(got, a.astype(np.float16))
    assert eds.einsum("ij->i", a, dtype="float16", casting="same_kind").dtype == np.float16
    with pytest.raises(EinsumError, match="according to the rule 'safe'"):
        eds.einsum("ij->i", a, dtype="float16")


@pytest.mark.parametrize("join,agg", [("mul", "sum"), ("add", "max"), ("div", "sum"), ("exp", "sum"),
                                      ("x * y + 1", "prod"), ("sqrt", "max")])
def test_bfloat16_is_computed_in_float32_and_rounded_once(db, join, agg):
    """torch's rule (products and joins in float32, the result rounded to bfloat16 once) on
    every path: equal to the float32 computation rounded, not to one rounded at every step."""
    rng = np.random.default_rng(11)
    a = np.abs(random_array(rng, (9, 40), "bfloat16")) + np.array(0.5, "bfloat16")
    b = np.abs(random_array(rng, (40, 7), "bfloat16")) + np.array(0.5, "bfloat16")
    args = (a,) if join in ("exp", "sqrt") else (a, b)
    spec = "ij->i" if len(args) == 1 else "ij,jk->ik"
    fn = (lambda x, y: x * y + 1) if join == "x * y + 1" else join
    wide = reference(spec, *[x.astype(np.float32) for x in args], join=fn, agg=agg)
    want = wide.astype("bfloat16")
    stored = [db.store(f"bf_{k}", x, tile=(4, 16) if x.shape[0] == 9 else (16, 3), replace=True)
              for k, x in enumerate(args)]
    for got in (eds.einsum(spec, *args, join=join, agg=agg), db.einsum(spec, *stored, join=join, agg=agg).to_numpy()):
        assert got.dtype == np.dtype("bfloat16")
        # one rounding of a float32 result: within half a unit of bfloat16's last place (at
        # most 2**-8 of the value), where the float32 sums themselves differ in their last bits
        err = np.abs(got.astype(np.float64) - wide.astype(np.float64))
        assert (err <= np.abs(wide) * (2 ** -8 + 1e-5)).all(), (err.max(), join, agg)
        assert (got == want).mean() > 0.9


@pytest.mark.parametrize("name", ["ffn", "attention", "llama_block"])
@pytest.mark.parametrize("fuse,workers", [(True, 1), ("elementwise", 4), (False, 4)])
def test_bfloat16_graphs(db, name, fuse, workers):
    """The GPU issue's graphs in bfloat16 (maps, softmax, norms; programs, fused and unfused
    steps, cut for 4 workers) against numpy in float64 on the same bfloat16 inputs: each node
    rounds its result to bfloat16 once, so the error stays a few of its units (2**-8) of the
    result's scale, where a wrong tile or a lost stage is of the scale itself."""
    from graphs import attention, ffn, llama_block

    g, ref = {"ffn": ffn, "attention": attention, "llama_block": llama_block}[name](dtype="bfloat16")
    rng = np.random.default_rng(len(name))
    xs = {v.name: (rng.standard_normal(v.shape) / np.sqrt(v.shape[0])).astype("bfloat16") for v in g.inputs}
    got = g.plan(workers=workers, fuse=fuse).run(db, **xs).to_numpy()
    assert got.dtype == np.dtype("bfloat16")
    want = ref(**{k: x.astype(np.float64) for k, x in xs.items()})
    err = np.abs(got.astype(np.float64) - want)
    # (measured: at most 0.0045 of the scale, median 0.001, whatever the plan)
    assert err.max() <= 0.02 * np.abs(want).max(), (err.max(), np.abs(want).max())
    assert np.median(err) <= 2 ** -8 * np.abs(want).max()


# db.einsum(dtype=): numpy's einsum(dtype=) over stored tensors, each tile cast in the kernel
DTYPE_SPECS = [("ij,jk->ik", [(7, 5), (5, 6)]), ("bij,bjk->bik", [(3, 4, 5), (3, 5, 2)]),
               ("ij,jk,kl->il", [(4, 5), (5, 3), (3, 6)]), ("ii->", [(5, 5)]), ("ijk->k", [(3, 4, 5)])]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(DTYPE_SPECS), dtypes=st.lists(st.sampled_from(DTYPES), min_size=3, max_size=3),
       target=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1), casting=st.sampled_from(["safe", "unsafe"]))
def test_a_stored_einsum_computes_in_the_dtype_asked(db, case, dtypes, target, seed, casting):
    spec, shapes = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    tensors = [db.store(f"dt{k}", a, tile=tuple(max(1, n // 2) for n in a.shape), replace=True)
               for k, a in enumerate(arrays)]
    if not all(can_cast(a.dtype, np.dtype(target), casting) for a in arrays):
        with pytest.raises(eds.EinsumTypeError, match=r"operand \d: cannot cast from dtype"):
            db.einsum(spec, *tensors, dtype=target, casting=casting)
        return
    # numpy warns of a complex operand cast to a real dtype (ComplexWarning), at the caller's line
    to_real = np.dtype(target).kind != "c" and any(a.dtype.kind == "c" for a in arrays)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = db.einsum(spec, *tensors, dtype=target, casting=casting)
        again = db.einsum_numpy(spec, *tensors, dtype=target, casting=casting)
    complex_said = [w for w in said if issubclass(w.category, np.exceptions.ComplexWarning)]
    assert len(complex_said) == (2 if to_real else 0) and all(w.filename == __file__ for w in complex_said), said
    assert got.dtype == np.dtype(target)
    # numpy's einsum(dtype=) casts every operand to it and computes there
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        cast = [a.astype(target) for a in arrays]
        want = reference(spec, *cast)
    assert_close(got.to_numpy(), want, error_scale(spec, cast) if np.dtype(target).kind in "fcV" else None)
    np.testing.assert_array_equal(again, got.to_numpy())


def test_dtype_is_for_a_product_summed_and_must_be_one(db):
    a = db.store("dq", np.arange(6, dtype=np.int8).reshape(2, 3), replace=True)
    with pytest.raises(EinsumError, match=r"dtype=int32 computes a product summed in that dtype .* with join= or agg="):
        db.einsum("ij,ij->i", a, a, join="add", dtype="int32")
    with pytest.raises(eds.EinsumTypeError, match="einsum dtype: 'int3' is not a dtype"):
        db.einsum("ij->i", a, dtype="int3")
    with pytest.raises(eds.EinsumTypeError, match=r"cannot cast from dtype '\|i1' \(int8\) to '\|u1' \(uint8\) "
                                                  r"according to the rule 'safe'.* pass casting='unsafe'"):
        db.einsum_numpy("ij->i", a, dtype="uint8")
    # int8 values whose sum overflows int8 but not int32: numpy's answer in the dtype asked
    big = db.store("dr", np.full((3, 100), 100, dtype=np.int8), replace=True)
    np.testing.assert_array_equal(db.einsum_numpy("ij->i", big), np.einsum("ij->i", np.full((3, 100), 100, np.int8)))
    np.testing.assert_array_equal(db.einsum_numpy("ij->i", big, dtype="int32"), np.full(3, 10000, np.int32))
    assert "int32" in db.explain("ij->i", big, dtype="int32")
