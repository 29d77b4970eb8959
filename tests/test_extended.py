"""Extended notation: join functions and aggregations, checked against a plain numpy reference,
with edge tiles (padding with zeros would be wrong for max, min and prod)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from helpers import DTYPES, assert_close, einsum_case, random_array
from reference import reference

BINARY = ["mul", "add", "sub", "div", "max", "min"]
AGGS = ["sum", "max", "min", "prod"]


@given(
    join=st.sampled_from(BINARY),
    agg=st.sampled_from(AGGS),
    spec=st.sampled_from(["ij,jk->ik", "ij,jk->ki", "ij,ij->i", "i,j->ij", "ijk,kj->i", "ij,j->", "bij,bjk->bik"]),
    sizes=st.lists(st.integers(1, 6), min_size=4, max_size=4),
    tile=st.integers(1, 4),
    dtypes=st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)),
    seed=st.integers(0, 2**31),
)
def test_binary_join_agg(db, join, agg, spec, sizes, tile, dtypes, seed):
    rng = np.random.default_rng(seed)
    size = dict(zip("ijkb", sizes))
    ins = spec.split("->")[0].split(",")
    arrays = [random_array(rng, tuple(size[c] for c in s), d) for s, d in zip(ins, dtypes)]
    if join == "div":  # keep away from 0/0 so nan placement is not the test
        arrays[1] = np.where(arrays[1] == 0, np.ones((), arrays[1].dtype), arrays[1]) if arrays[1].dtype != bool else arrays[1] | True
    if agg == "prod":  # keep products in range
        arrays = [np.clip(a, -2, 2) if a.dtype != bool else a for a in arrays]
    stored = [db.store(f"x{k}", a, tile=tuple(min(tile, d) for d in a.shape), replace=True) for k, a in enumerate(arrays)]
    with np.errstate(all="ignore"):
        try:
            want = reference(spec, *arrays, join=join, agg=agg)
        except TypeError:  # numpy refuses (bool - bool): so must we, with our error
            with pytest.raises(eds.EinsumError, match="failed on a probe"):
                db.einsum(spec, *stored, join=join, agg=agg)
            return
        got = db.einsum(spec, *stored, join=join, agg=agg).to_numpy()
    assert_close(got, want)


@pytest.mark.parametrize("fn", ["exp", "log", "relu", "neg", "square", "sqrt", "abs"])
@pytest.mark.parametrize("agg", AGGS)
def test_unary_functions(db, fn, agg):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((7, 5))
    if fn in ("log", "sqrt"):
        a = np.abs(a) + 0.1
    if agg == "prod":
        a = np.clip(a, 0.5, 1.5)
    want = reference("ij->i", a, join=fn, agg=agg)
    A = db.store("u", a, tile=(3, 2), replace=True)
    assert_close(db.einsum("ij->i", A, join=fn, agg=agg).to_numpy(), want)
    assert_close(eds.einsum("ij->j", a, join=fn, agg=agg), reference("ij->j", a, join=fn, agg=agg))


def test_expressions_and_callables(db):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((6, 5)), rng.standard_normal((5, 4))
    A = db.store("ea", a, tile=(4, 2), replace=True)
    B = db.store("eb", b, tile=(2, 3), replace=True)

    def leaky(x, y):
        return np.where(x - y > 0, x - y, 0.1 * (x - y))

    cases = [
        ("relu(x - y)", lambda x, y: np.maximum(x - y, 0)),
        ("x * y + 1", lambda x, y: x * y + 1),
        ("x if x > y else 2 * y", lambda x, y: np.where(x > y, x, 2 * y)),
        ("max(x, y, 0.5)", lambda x, y: np.maximum(np.maximum(x, y), 0.5)),
        (leaky, leaky),
    ]
    for join, fn in cases:
        for agg in AGGS:
            want = reference("ij,jk->ik", a, b, join=fn, agg=agg)
            got = db.einsum("ij,jk->ik", A, B, join=join, agg=agg).to_numpy()
            assert_close(got, want)


def test_max_plus_with_negative_values_and_edge_tiles(db):
    # all-negative values: a zero-padded edge tile would win every max
    a = -1 - np.random.default_rng(1).random((5, 7))
    b = -1 - np.random.default_rng(2).random((7, 3))
    A = db.store("mp_a", a, tile=(2, 3), replace=True)
    B = db.store("mp_b", b, tile=(3, 2), replace=True)
    got = db.einsum("ij,jk->ik", A, B, join="add", agg="max").to_numpy()
    np.testing.assert_allclose(got, (a[:, :, None] + b[None]).max(1))
    got = db.einsum("ij,jk->ik", A, B, join="mul", agg="min").to_numpy()
    np.testing.assert_allclose(got, (a[:, :, None] * b[None]).min(1))


def test_many_operand_non_semiring_stays_one_node(db):
    rng = np.random.default_rng(5)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal((4,)), rng.standard_normal((4, 2))
    plan = db.plan("ij,j,jk->ik", a, b, c, join="x + y - z", agg="sum")
    assert len([s for s in plan.steps if "einsum" in s.describe()]) == 1
    got = eds.einsum("ij,j,jk->ik", a, b, c, join="x + y - z", agg="sum")
    assert_close(got, reference("ij,j,jk->ik", a, b, c, join=lambda x, y, z: x + y - z, agg="sum"))
    # a semiring (add, max) is lowered to binary nodes and still right
    got = eds.einsum("ij,jk,kl->il", a, c, rng.standard_normal((2, 3)), join="add", agg="max")
    assert got.shape == (3, 3)


def test_a_join_that_is_no_product_materialises_a_bounded_block():
    """A join that is not a plain product materialises the join space block by block. One
    block was a slice of the longest reduced axis whatever the others held: 36^5 elements of a
    5-operand add/sum over 36 x 36 operands (+519 MB resident under memory="200MB", a trial).
    Now every block is within MIN_BLOCK or 8 output tiles' worth, split over every reduced
    axis; the result is numpy's. (The kernels' behaviour: the reference backend joins whole.)"""
    rng = np.random.default_rng(6)
    ops = [rng.standard_normal((16, 16)) for _ in range(5)]
    seen = []

    def add5(*xs):
        seen.append(int(np.prod(np.broadcast_shapes(*(x.shape for x in xs)))))
        return xs[0] + xs[1] + xs[2] + xs[3] + xs[4]

    with eds.connect() as db:
        got = db.einsum("ab,bc,cd,de,ef->af", *ops, join=add5, agg="max").to_numpy()
    want = ops[0]
    for m in ops[1:]:  # max-plus is associative: the same maxima, product by product
        want = (want[:, :, None] + m[None]).max(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert max(seen) <= 1 << 18  # MIN_BLOCK, where the join space is 16^6 (a task's slice 4M)


PEAK_CHILD = r"""
import resource, sys, numpy as np, eindecomp_sql as eds
join, agg = sys.argv[1], sys.argv[2]
a = np.random.default_rng(0).standard_normal((1024, 1024))
db = eds.connect()
db.einsum_numpy("ij,jk->ik", a[:64, :64], a[:64, :64], join=join, agg=agg)  # the kernels' pool up
plan = db.plan("ij,jk->ik", a, a, join=join, agg=agg)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
db.einsum_numpy("ij,jk->ik", a, a, join=join, agg=agg)
print(plan.run_peak(), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before)
"""


def test_a_small_non_product_join_is_projected_at_its_joined_space_not_a_minimum_block():
    """A max over 5 elements was projected at 2.1 MB (the kernel's minimum block of 256K
    elements, though it never materialises more than a tile's joined space) and refused under
    memory="3MB" (a trial)."""
    v = np.arange(1, 6, dtype=np.float64)
    with eds.connect(memory="3MB") as db:
        assert db.plan("i->", v, agg="max").peak_bytes < 1024
        assert db.einsum("i->", v, agg="max").to_numpy() == 5.0
        m = np.random.default_rng(3).standard_normal((7, 9))
        np.testing.assert_array_equal(db.einsum("ij,jk->ik", m, m.T, join="add", agg="min").to_numpy(),
                                      (m[:, :, None] + m.T[None, :, :]).min(1))


def test_a_non_product_joins_blocks_are_in_its_projected_peak():
    """The blocks of a join that is no product are memory the kernels hold besides the tiles:
    a 1024² max-plus product grew the process by ~92 MB where its projected peak said 48 MB,
    as much as its mul/sum twin's (the blocks were in no projection; on 16 cores, 16 tasks of
    32 MB). They are counted now (``cost.join_block_bytes``), so a budget holds them."""
    import subprocess
    import sys

    got = {}
    for join, agg in (("mul", "sum"), ("add", "max")):
        out = subprocess.run([sys.executable, "-c", PEAK_CHILD, join, agg], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got[join] = tuple(map(int, out.stdout.split()))
    (product_peak, _), (peak, grew) = got["mul"], got["add"]
    assert peak >= product_peak + (32 << 20)  # the blocks: 4M elements of float64 and a result tile
    assert grew <= 1.15 * peak + (8 << 20), (grew >> 20, peak >> 20)


def _explicit(spec: str) -> str:
    """numpy's implicit output made explicit: the labels seen once, in sorted (ASCII) order."""
    if "->" in spec:
        return spec
    letters = spec.replace(",", "")
    return spec + "->" + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))


JOINS_ANY = ["mul", "add", "max", "min", "x0 * 2 + x0", "max(x0, 0)"]
JOINS_TWO = ["sub", "div", "relu(x - y)", "x if x > y else y", "x * y + 1"]


@given(einsum_case(), st.sampled_from(AGGS), st.integers(0, 10), st.lists(st.sampled_from(["stored", "array"]),
                                                                          min_size=5, max_size=5))
def test_extended_joins_on_generated_cases(db, case, agg, pick, kinds):
    """Joins and aggregations over the widened cases (repeated and case-only labels, size-1
    broadcasts, multi-piece tiles, every dtype), stored and array operands, against the plain
    numpy reference. A join numpy refuses on these dtypes must be our EinsumError."""
    spec, shapes, dtypes, tiles, seed = case
    spec = _explicit(spec)
    joins = JOINS_ANY + (JOINS_TWO if len(shapes) == 2 else [])
    join = joins[pick % len(joins)]
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    if agg == "prod":  # keep products in range
        arrays = [np.where(np.abs(a) > 2, a / 4, a) if a.dtype.kind in "fc" else a for a in arrays]
    fn = {"x0 * 2 + x0": lambda *xs: xs[0] * 2 + xs[0], "max(x0, 0)": lambda *xs: np.maximum(xs[0], 0),
          "relu(x - y)": lambda x, y: np.maximum(x - y, np.zeros((), np.result_type(x, y))),
          "x if x > y else y": lambda x, y: np.where(x > y, x, y), "x * y + 1": lambda x, y: x * y + 1}.get(join, join)
    with np.errstate(all="ignore"):
        try:
            want = reference(spec, *arrays, join=fn, agg=agg)
        except TypeError:  # numpy refuses (bool - bool, complex comparisons): so must we
            with pytest.raises(eds.EinsumError):
                eds.einsum(spec, *arrays, join=join, agg=agg)
            return
        except ValueError:  # max/min over an empty set: numpy refuses, so must we
            with pytest.raises(eds.EinsumError):
                eds.einsum(spec, *arrays, join=join, agg=agg)
            return
        operands = [db.store(f"g{k}", a, tile=t, replace=True) if kind == "stored" else a
                    for k, (a, t, kind) in enumerate(zip(arrays, tiles, kinds))]
        got = db.einsum(spec, *operands, join=join, agg=agg).to_numpy()
    # rounding: numpy folds a join left to right in each pair's dtype, a semiring lowered to
    # binary nodes computes every step in the dtype of all operands; both are right to the
    # precision of the narrowest float, relative to the magnitudes of the terms
    # (half-precision operands of a float32 result: numpy's fold keeps a join that reads only
    # float16 operands in float16, its product over 4 terms too, rounding each to 2**-11; we
    # aggregate in the result's float32: 'cdab,aaa->', x0 * 2 + x0, prod gave -9.90625 against
    # our -9.902781, which is np.prod of the float16 terms in float32)
    half = any(np.dtype(d) in (np.float16, np.dtype("bfloat16")) for d in dtypes)
    narrow = any(np.dtype(d) in (np.float32, np.complex64) for d in dtypes)
    mags = [np.abs(a).astype(np.float64) for a in arrays]
    with np.errstate(all="ignore"):
        scale = np.abs(want) + 4 * sum(reference(spec, *mags, join=j, agg="sum" if agg == "sum" else "max")
                                       for j in (lambda *xs: sum(xs), lambda *xs: np.prod(np.broadcast_arrays(*xs), 0)))
    assert_close(got, want, scale, eps=1e-2 if half else 1e-4 if narrow else None)


def _tile_dependent_shape(x, y):
    r = x * y
    return r if r.size <= 8 else r[:1]  # element-wise on the probe, not on real tiles


def _tile_dependent_dtype(x, y):
    r = x * y
    return r if r.size <= 8 else r.astype(np.float32)


def _tile_dependent_strings(x, y):
    r = x * y
    return r if r.size <= 8 else r.astype(str)


def _sums(x, y):
    return x.sum()


def _raises(x, y):
    raise KeyError("boom")


@pytest.mark.parametrize(
    "fn,match",
    [
        (_sums, "_sums\\) is not element-wise.*returned shape \\(\\)"),
        (lambda x, y: None, "<lambda>\\) returned None"),
        (lambda x, y: np.full(np.broadcast_shapes(x.shape, y.shape), "s"), "<lambda>\\) returned <U1 values"),
        (lambda x, y: 2.0, "<lambda>\\) is not element-wise"),
        (lambda x, y: x, "<lambda>\\) is not element-wise"),
        (lambda x, y: (x * y)[..., :1], "<lambda>\\) is not element-wise"),
        (lambda x, y: (x * y).astype(np.longdouble), "float128"),
        (lambda x, y: (x * y).astype(object), "returned object values"),
        (_raises, "_raises\\) raised KeyError"),
        (_tile_dependent_shape, "_tile_dependent_shape\\) is not element-wise"),
        (_tile_dependent_dtype, "_tile_dependent_dtype\\) returned float32.*probe.*gave float64"),
        (_tile_dependent_strings, "_tile_dependent_strings\\) returned <U"),
        # shape and dtype kept, not element-wise: ran, its result depending on the tiling (a trial)
        (lambda x, y: x * y - (x * y).mean(), "<lambda>\\) is not element-wise: on probes.*first element"),
        (lambda x, y: np.sort(x * y, axis=None).reshape(np.broadcast_shapes(x.shape, y.shape)), "not element-wise"),
        (lambda x, y: np.cumsum(x + y, axis=-1), "<lambda>\\) is not element-wise: on probes.*last element"),
        (lambda x, y: x * y / np.abs(x * y).max(), "not element-wise"),
    ],
)
def test_callable_joins_are_checked_on_every_tile(db, fn, match):
    """A callable that is not element-wise made results depend on the tiling; one returning
    strings, None or a wrong shape raised TypeError/ValueError from numpy. Each is an
    EinsumError naming the callable (from the probe, or from the tile where it goes wrong)."""
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((5, 6)), rng.standard_normal((6, 4))
    A = db.store("cj_a", a, tile=(2, 3), replace=True)
    B = db.store("cj_b", b, tile=(3, 2), replace=True)
    before = db.tensors()
    with pytest.raises(eds.EinsumError, match=match):
        db.einsum("ij,jk->ik", A, B, join=fn, out="cj_out")
    assert db.tensors() == before  # nothing half-written
    with pytest.raises(eds.EinsumError, match=match):
        eds.einsum("ij,jk->ik", a, b, join=fn)


def test_element_wise_callables_still_run_on_every_tiling(db):
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((7, 6)), rng.standard_normal((6, 5))

    def hinge(x, y):
        return np.maximum(1 - x * y, np.zeros((), x.dtype))

    want = reference("ij,jk->ik", a, b, join=hinge, agg="sum")
    # the element-wise probe lets through what is element-wise in any form
    assert_close(eds.einsum("ij,jk->ik", a, b, join=np.vectorize(lambda x, y: max(1 - x * y, 0.0))), want)
    assert_close(eds.einsum("ij,jk->ik", a, b, join=lambda x, y: np.where(x * y < 1, 1 - x * y, 0 * x)), want)
    for ta, tb in [((7, 6), (6, 5)), ((2, 3), (3, 2)), ((1, 1), (1, 1)), ((3, 5), (4, 4))]:
        A = db.store("ok_a", a, tile=ta, replace=True)
        B = db.store("ok_b", b, tile=tb, replace=True)
        assert_close(db.einsum("ij,jk->ik", A, B, join=hinge).to_numpy(), want)
    assert_close(eds.einsum("ij,jk->ik", a, b, join=hinge), want)


@pytest.mark.parametrize("agg", ["max", "min"])
def test_add_join_over_bools_keeps_numpys_left_fold(db, agg):
    """numpy folds a join left to right and bool + bool is logical or until a number joins in:
    a many-operand add over two bools and a float must not be regrouped so that the bools meet
    first (found by hypothesis: 'b,ab,,abc,a' with join=add, agg=max gave 1 where numpy gives 2;
    here the contraction path would pair the two small bool operands)."""
    rng = np.random.default_rng(7)
    arrays = [random_array(rng, (3, 5), "float32"), np.ones(3, bool), np.ones(3, bool)]
    want = reference("ij,i,i->j", *arrays, join="add", agg=agg)
    assert_close(eds.einsum("ij,i,i->j", *arrays, join="add", agg=agg), want)


def test_add_join_over_mixed_dtypes_keeps_numpys_left_fold(db):
    """Each ``+`` of numpy's fold is in the dtype of the two operands it meets, so a regrouped
    sum rounds where numpy's order does not (found by hypothesis: ',aaab,,' over float16,
    float64, bool, float64 with join=add, agg=max paired the float16 and the bool first and was
    off by float16's half step): an add over mixed dtypes stays one node."""
    rng = np.random.default_rng(0)  # the example's values: float16 0.1257, True, -0.1321 and 0.6404, -0.5357
    shapes = [(), (1, 1, 1, 2), (), ()]
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, ("float16", "float64", "bool", "float64"))]
    want = reference(",aaab,,->b", *arrays, join="add", agg="max")
    assert_close(eds.einsum(",aaab,,->b", *arrays, join="add", agg="max"), want)
    stored = [db.store(f"m{k}", a, replace=True) for k, a in enumerate(arrays)]
    assert_close(db.einsum(",aaab,,->b", *stored, join="add", agg="max").to_numpy(), want)


@pytest.mark.parametrize("tile", [(1, 1), (1, 2), (2, 3), (2, 4)])
def test_float16_reductions_accumulate_in_float32_as_numpy_does(db, tile):
    """numpy reduces float16 with a float accumulator and rounds once: 300 * 300 * 0 is 0 for it,
    where float16 step by step overflows to inf and inf * 0 is nan. Tiles combine their partial
    results the same way, however the reduced label is cut (hypothesis found the nan,
    ``ijk,kj->i``, int8 / float16, ``join="div"``, ``agg="prod"``)."""
    a = np.array([[300, 300, 0.001, 0.5], [300, 300, 0, 300]], np.float16)
    A = db.store("h16", a, tile=tile, replace=True)
    with np.errstate(all="ignore"):
        want = np.multiply.reduce(a, axis=1)
        assert np.isnan(a[1, 0] * a[1, 1] * a[1, 2])  # float16 step by step: the trap
    got = db.einsum("ij->i", A, agg="prod").to_numpy()
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    d = np.full(a.shape, 0.5, np.float16)  # the same through a join: (a / 0.5) overflows sooner
    D = db.store("h16d", d, tile=tile, replace=True)
    with np.errstate(all="ignore"):
        want = np.multiply.reduce(a / d, axis=1)
    np.testing.assert_array_equal(db.einsum("ij,ij->i", A, D, join="div", agg="prod").to_numpy(), want)


def test_join_expressions_that_python_cannot_evaluate_sensibly_are_einsum_errors():
    """A 5,000-term expression raised RecursionError from ast.parse; 10**10**10 never returned
    (Python computes the exact integer); numpy's own OverflowError for an int8 operand times 1000
    read KeyError('__import__') (the expression ran without builtins)."""
    a, b = np.ones((2, 3)), np.ones((3, 2))
    for join, match in (("+".join(["x"] * 5000), "nested too deeply"), ("+".join(["x"] * 300), "more than 200"),
                        ("x * 10**10**10", r"constant 10 \*\* 10 \*\* 10 is too large"), ("x * (10**4000)**4000", "too large to compute")):
        with pytest.raises(EinsumError, match=match):
            eds.einsum("ij,jk->ik", a, b, join=join)
    with pytest.raises(EinsumError, match="Python integer 1000 out of bounds for int8"):
        eds.einsum("ij->ij", np.ones((2, 3), np.int8), join="x*1000")
    # numpy's TypeError (bool - bool) is a TypeError here too, and an EinsumError
    with pytest.raises(eds.EinsumTypeError, match="boolean subtract"):
        eds.einsum("i,i->i", np.ones(2, bool), np.ones(2, bool), join="sub")
    # 1j is a number: "only numeric constants are allowed" said otherwise (a trial)
    with pytest.raises(EinsumError, match=r"complex constants are not: pass a Python callable"):
        eds.einsum("i,i->i", np.ones(2, complex), np.ones(2, complex), join="x + 1j * y")
    np.testing.assert_allclose(eds.einsum("ij,jk->ik", a, b, join="x * 2**70 + " + "+".join(["y"] * 150)),
                               np.full((2, 2), 3 * (2.0**70 + 150)))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["int8", "uint8", "int16", "uint64", "int64"]), st.sampled_from(["max", "min"]),
       st.sampled_from(["i,,j->i", "ij,jk,kl->il", "i,ij,j->", "a,b,c,ab->c"]), st.integers(0, 2**32 - 1))
def test_add_join_over_integers_wraps_as_numpys_left_fold(dtype, agg, spec, seed):
    """A many-operand add/max (or min) over integers was regrouped into max_j(y + z_j) + x, which
    holds only while nothing wraps: int8 x = 100, y = 0, z = [0, 100] gave -56 where numpy's
    max(100 + 0 + 0, 100 + 0 + 100) is 100 (a new user's fuzzing). Values near the dtype's
    ends, so sums wrap."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    parsed = [part for part in spec.split("->")[0].split(",")]
    size = {lab: int(rng.integers(1, 4)) for lab in set("".join(parsed))}
    arrays = [rng.integers(info.min // 2, info.max // 2, size=tuple(size[c] for c in part), dtype=dtype, endpoint=True)
              for part in parsed]
    with np.errstate(over="ignore"):
        want = reference(spec, *arrays, join="add", agg=agg)
    got = eds.einsum(spec, *arrays, join="add", agg=agg)
    np.testing.assert_array_equal(got, want)
    assert np.asarray(got).dtype == np.asarray(want).dtype


def test_overflow_and_invalid_values_raise_no_warning_as_in_numpy(db):
    """np.einsum is silent on an overflow to inf and an invalid inf - inf; the kernels' BLAS
    products and ufuncs warned, and under warnings.simplefilter("error") (pytest -W error) the
    step failed where numpy returns inf (a trial)."""
    import warnings

    h = np.full((5, 4), 1e300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        want = np.einsum("ij,kj->ik", h, h)
        H = db.store("H", h, tile=(2, 3), replace=True)
        np.testing.assert_array_equal(db.einsum("ij,kj->ik", H, H).to_numpy(), want)
        np.testing.assert_array_equal(eds.einsum("ij,kj->ik", h, h), want)
        got = db.einsum("ij,kj->ik", H, H, join="x * y - x * y").to_numpy()
        assert np.isnan(got).all()
        g = eds.Graph()
        x = g.input("x", h.shape, "float64")
        g.map("exp", g.einsum("ij,kj->ik", x, x))
        np.testing.assert_array_equal(g.run(db, x=h).to_numpy(), np.full((5, 5), np.inf))


@pytest.mark.parametrize("n", [9, 11])
@pytest.mark.parametrize("join, agg", [("mul", "max"), ("add", "sum"), ("max", "min")])
def test_more_than_eight_operands_in_one_step(db, n, join, agg):
    """A join other than a product summed over 9 operands is one step, whose kernel of 9
    tiles was not registered ("Scalar Function with name eds_einsum9 does not exist", a
    trial; eds_einsum_group8s on tiled operands): the kernels of any operand count run, rows
    and grouped steps alike, and match numpy."""
    rng = np.random.default_rng(n)
    arrays = [rng.standard_normal((5, 4)) for _ in range(n)]
    spec = ",".join(["ij"] * (n - 1) + ["j"]) + "->i"
    ops = arrays[:-1] + [arrays[-1][0]]
    want = reference(spec, *ops, join=join, agg=agg)
    assert_close(eds.einsum(spec, *ops, join=join, agg=agg), want)
    stored = [db.store(f"many{k}", a, tile=(2, 3), replace=True) for k, a in enumerate(ops[:-1])]
    stored.append(db.store(f"many{n - 1}", ops[-1], tile=(3,), replace=True))
    assert_close(db.einsum(spec, *stored, join=join, agg=agg).to_numpy(), want)
    assert_close(db.einsum(spec, *stored[:-1], ops[-1], join=join, agg=agg).to_numpy(), want)
    vectors = [a[:, 0] for a in arrays]  # the trial's case: "i,i,...->i"
    assert_close(eds.einsum(",".join(["i"] * n) + "->i", *vectors, join=join, agg=agg),
                 reference(",".join(["i"] * n) + "->i", *vectors, join=join, agg=agg))
