"""Re-tiling: any tiling to any tiling round-trips exactly, through real DuckDB queries."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from eindecomp_sql.plan import Plan, RetileStep, TiledValue
from helpers import DTYPES, random_array


@st.composite
def retile_case(draw):
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(nd))
    src = tuple(draw(st.integers(1, d)) for d in shape)
    dst = tuple(draw(st.integers(1, d)) for d in shape)
    return shape, src, dst, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31))


@given(retile_case())
def test_any_tiling_to_any_tiling(db, case):
    shape, src, dst, dtype, seed = case
    a = random_array(np.random.default_rng(seed), shape, dtype)
    T = db.store("rt", a, tile=src, replace=True)
    target = TiledValue("rt2", shape, T.value.dtype, dst, T.keys, "rt2")
    step = RetileStep(T.value, target)
    tiles = db.backend.execute(Plan((step,), (T.value,), TiledValue("rt2", shape, T.value.dtype, dst, T.keys, None)))
    from eindecomp_sql.udfs.tiles import array_from_tiles

    assert tiles.num_rows == int(np.prod([-(-n // t) for n, t in zip(shape, dst)]))
    np.testing.assert_array_equal(array_from_tiles(tiles, shape, dst, dtype, T.keys), a)


def test_mismatched_operand_tilings_are_retiled(db):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((10, 12)), rng.standard_normal((12, 6))
    A = db.store("ma", a, tile=(4, 5), replace=True)
    B = db.store("mb", b, tile=(3, 6), replace=True)
    plan = db.plan("ij,jk->ik", A, B)
    retiles = [s for s in plan.steps if isinstance(s, RetileStep)]
    assert len(retiles) == 1 and retiles[0].source.name == "mb" and retiles[0].target.tile == (5, 6)
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b)
