"""Re-tiling: any tiling to any tiling round-trips exactly, through real DuckDB queries."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from eindecomp_sql.plan import Plan, RetileStep, TiledValue
from eindecomp_sql.backends import Target
from helpers import DTYPES, random_array


@st.composite
def retile_case(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    src = tuple(draw(st.integers(1, d)) for d in shape)
    dst = tuple(draw(st.integers(1, d)) for d in shape)
    batches = draw(st.integers(1, -(-shape[0] // dst[0])))
    return shape, src, dst, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31)), batches


@given(retile_case())
def test_any_tiling_to_any_tiling(db, case):
    shape, src, dst, dtype, seed, batches = case
    a = random_array(np.random.default_rng(seed), shape, dtype)
    T = db.store("rt", a, tile=src, replace=True)
    target = TiledValue("rt2", shape, T.value.dtype, dst, T.keys)
    step = RetileStep(T.value, target, batches)  # batched: one statement per range of target rows
    # bound to no table: the value comes back as an array
    out = db.backend.execute(Plan((step,), (T.value,), (target,)), {"rt": "rt"}, {"rt2": Target()})
    np.testing.assert_array_equal(out["rt2"], a)


def test_mismatched_operand_tilings_are_retiled(db):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((10, 12)), rng.standard_normal((12, 6))
    A = db.store("ma", a, tile=(4, 5), replace=True)
    B = db.store("mb", b, tile=(3, 6), replace=True)
    plan = db.plan("ij,jk->ik", A, B)
    retiles = [s for s in plan.steps if isinstance(s, RetileStep)]
    # j is cut 3 ways in A and 2 ways in B: a join needs one cut, so something is re-tiled
    assert retiles
    (step,) = [s for s in plan.steps if not isinstance(s, RetileStep)]
    assert step.inputs[0].tile[1] == step.inputs[1].tile[0]
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b)
