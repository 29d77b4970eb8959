"""Array operands read in place: a plan's numpy inputs are registered with DuckDB by their tile
keys only (NULL tiles), and the kernels read views of the caller's arrays by value name and
keys (``udfs/register.py: _host_tile``), so an array's bytes never go through DuckDB. Where a
reader cannot name a tile that way (a retile, a reader dropping a size-1 axis), the array goes
through DuckDB as tiles, as before (``plan.kernel_spec.inputs_read_by_name``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql.plan.kernel_spec import inputs_read_by_name
from eindecomp_sql.udfs import register
from helpers import assert_close, einsum_case, error_scale, random_array
from reference import reference


@pytest.fixture(scope="module")
def small_tiles():
    """Tiles of at most 64 bytes: arrays in many tiles, cut unevenly, grouped steps."""
    with eds.connect(tile_bytes=64) as db:
        yield db


@pytest.fixture
def read_in_place(monkeypatch):
    """Counts the tiles kernels read from the caller's arrays."""
    seen = []
    host_tile = register._host_tile

    def spy(state, value, keys, shape=None):
        seen.append((value, keys))
        return host_tile(state, value, keys, shape)

    monkeypatch.setattr(register, "_host_tile", spy)
    return seen


def _layout(a: np.ndarray, how: str) -> np.ndarray:
    """The same values in another memory layout: Fortran order, a strided view, the other byte order."""
    if how == "fortran":
        return np.array(a, order="F")  # (np.asfortranarray makes a 0-d array 1-d)
    if how == "strided" and a.ndim:
        big = np.zeros(tuple(2 * n for n in a.shape), a.dtype)
        view = big[tuple(slice(None, None, 2) for _ in a.shape)]
        view[...] = a
        return view
    if how == "swapped" and a.dtype.itemsize > 1 and a.dtype.kind != "b":
        return a.astype(a.dtype.newbyteorder())
    return a


@given(einsum_case(max_operands=3, max_size=6), st.sampled_from(["c", "fortran", "strided", "swapped"]),
       st.booleans())
@settings(max_examples=min(80, settings.default.max_examples))
def test_array_operands_read_in_place_match_numpy(small_tiles, case, layout, whole):
    """Random specs, shapes and dtypes over arrays in any memory layout, cut into many tiles
    (``whole=False``) or one: the answer is numpy's, whether the kernels read the arrays in
    place or a reader needed their tiles through DuckDB."""
    spec, shapes, dtypes, _, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = reference(spec, *arrays)
    ops = [_layout(a, layout) for a in arrays]
    db = small_tiles if not whole else eds.connect()
    try:
        assert_close(db.einsum(spec, *ops).to_numpy(), want, error_scale(spec, arrays))
    finally:
        if whole:
            db.close()


def test_an_arrays_tiles_do_not_pass_through_duckdb(read_in_place):
    """A GEMM on arrays in 4 x 3 tiles: the kernels read every operand tile from the arrays
    (a grouped step: each tile once per product it takes part in), DuckDB holds only keys."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    with eds.connect(tile_bytes=8 * 10 * 10) as db:
        plan = db.plan("ij,jk->ik", a, b)
        assert plan.steps[0].grouped and {v.name for v in plan.inputs} <= inputs_read_by_name(plan)
        np.testing.assert_allclose(db.einsum("ij,jk->ik", a, b).to_numpy(), a @ b, rtol=1e-12)
    assert read_in_place and {value for value, _ in read_in_place} == {v.name for v in plan.inputs}


def test_readers_that_cannot_name_a_tile_get_its_bytes(read_in_place):
    """A reader dropping a size-1 axis (numpy broadcasting) and a retile's kernel take the
    array's tiles through DuckDB; the answers are numpy's."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 40))
    with eds.connect(tile_bytes=8 * 16 * 10) as db:
        for small in (rng.standard_normal((64, 1)), rng.standard_normal((1, 40))):  # a column, a row
            plan = db.plan("ij,ij->ij", small, x)
            dropped = {op.value for s in plan.steps for op in s.node.operands if op.dropped}
            assert dropped and not dropped & inputs_read_by_name(plan)
            np.testing.assert_allclose(db.einsum("ij,ij->ij", small, x).to_numpy(), small * x, rtol=1e-12)
            assert not {value for value, _ in read_in_place} & dropped
        g = eds.Graph()
        a = g.input("a", (64, 40), "float64")
        g.einsum("ij,kj->ik", a, a, name="y")
        gp = g.plan(workers=4, fuse=False, inputs={"a": (64, 1)})  # read so cut: retiled first
        retiled = {s.source.name for s in gp.plan.steps if type(s).__name__ == "RetileStep"}
        assert retiled and not retiled & inputs_read_by_name(gp.plan)
        # a sum over j in pieces (workers=4): rounding relative to the magnitudes summed, not to a
        # result near cancellation (an element of 0.0012 from terms of ~1 was off by 1.2e-12 of it)
        assert_close(gp.run(db, a=x).to_numpy(), x @ x.T, error_scale("ij,kj->ik", [x, x]))


def test_a_kernel_cannot_write_into_the_callers_array():
    """The views kernels get are read-only: a join that tries to write into its operand fails
    (EinsumError) and the caller's array is unchanged."""
    a = np.arange(12.0).reshape(3, 4)
    before = a.copy()

    def scribble(x, y):
        x[...] = 0
        return x * y

    with eds.connect() as db:
        with pytest.raises(eds.EinsumError):
            db.einsum("ij,ij->ij", a, a, join=scribble).to_numpy()
    np.testing.assert_array_equal(a, before)


def test_an_ndarray_subclass_is_read_as_a_plain_array():
    """``np.matrix`` (scipy's ``todense()`` returns one) multiplies on ``*`` and stays 2-D: its
    tiles reach the kernels as plain arrays, as its bytes did through DuckDB."""
    rng = np.random.default_rng(3)
    m = np.asmatrix(rng.standard_normal((6, 6)))
    a = np.asarray(m)
    with eds.connect(tile_bytes=8 * 3 * 3) as db:
        for spec, join, want in (("ij,ij->ij", lambda x, y: x * y, a * a), ("ij,ij->ij", "x * y", a * a),
                                 ("ij,ij->i", None, (a * a).sum(1)), ("ij,jk->ik", None, a @ a)):
            got = db.einsum(spec, m, m, join=join).to_numpy()
            assert type(got) is np.ndarray
            np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.fixture
def written_in_place(monkeypatch):
    """Counts the output tiles kernels write straight into the array returned to the caller."""
    seen = []
    host_out = register._host_out

    def spy(state, value, keys, shape):
        got = host_out(state, value, keys, shape)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(register, "_host_out", spy)
    return seen


def test_a_returned_result_is_written_into_its_array(written_in_place):
    """A result returned as an array: each tile that is one C-ordered block of it (a row panel,
    or the whole) is written there by the kernel and never enters DuckDB; a column tile goes as
    bytes and is put in after. Either way the answer is numpy's."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    with eds.connect() as db:
        np.testing.assert_allclose(db.einsum_numpy("ij,jk->ik", a, b), a @ b, rtol=1e-12)
        assert written_in_place == [True]  # one tile, written in place
    written_in_place.clear()
    with eds.connect(tile_bytes=8 * 10 * 10) as db:  # 4 x 2 output tiles: column cuts, as bytes
        plan = db.plan("ij,jk->ik", a, b)
        assert plan.result.grid == (4, 2)
        np.testing.assert_allclose(db.einsum_numpy("ij,jk->ik", a, b), a @ b, rtol=1e-12)
        assert len(written_in_place) == 8 and not any(written_in_place)
        written_in_place.clear()
        x, v = rng.standard_normal((40, 10)), np.arange(40.0)
        assert db.plan("ij,i->ij", x, v).result.tile == (10, 10)  # row panels: each one block
        np.testing.assert_allclose(db.einsum_numpy("ij,i->ij", x, v), x * v[:, None], rtol=0)
        assert len(written_in_place) == 4 and all(written_in_place)


def test_sql_shown_by_explain_run_beside_a_plan_touches_none_of_its_arrays():
    """EXPLAIN's SQL names no values in its kernel specs: run on the session's connection while
    a plan runs (here from its progress callback), its kernels neither write into the plan's
    result array nor read its operands; both answers are right."""
    rng = np.random.default_rng(5)
    n = 50
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    with eds.connect() as db:
        db.store("X", np.ones((n, n))), db.store("Y", np.full((n, n), 2.0))
        listing = db.explain("ij,jk->ik", "X", "Y")
        assert '"values"' not in listing and '"result"' not in listing
        sql = listing[listing.index("SELECT"):].rstrip().rstrip(";")
        side = {}

        def progress(report):
            if report.tiles_done == report.tiles and not side:
                side["tiles"] = db.connection.sql(sql).to_arrow_table()

        np.testing.assert_allclose(db.einsum_numpy("ij,jk->ik", a, b, progress=progress), a @ b, rtol=1e-12)
        got = np.frombuffer(side["tiles"].column("tile")[0].as_py(), np.float64).reshape(n, n)
        np.testing.assert_array_equal(got, np.full((n, n), 2.0 * n))
