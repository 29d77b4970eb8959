"""Extended notation: join functions and aggregations, checked against a plain numpy reference,
with edge tiles (padding with zeros would be wrong for max, min and prod)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eindecomp_sql as eds
from helpers import DTYPES, assert_close, random_array
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
