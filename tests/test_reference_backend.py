"""The reference backend (eindecomp_sql/backends/reference.py): plans run step by step in numpy
over real tiles, checked against numpy directly on the backend and through a session; its
catalog behaves as DuckDB's does (names ignore case, replace=, nothing written on failure)."""

import numpy as np
import pyarrow as pa
import pytest
from eindecomp_sql.udfs.tiles import array_from_tiles, tiles_from_array
from helpers import DTYPES, assert_close, einsum_case, error_scale, random_array
from hypothesis import given
from hypothesis import strategies as st
from reference import reference

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.backends import Target, create_backend
from eindecomp_sql.backends.reference import ReferenceBackend, assemble, cut
from eindecomp_sql.graph import Graph
from eindecomp_sql.plan import (
    EinsumStep,
    FillStep,
    Plan,
    RetileStep,
    TiledValue,
    plan_einsum,
)
from eindecomp_sql.plan.einsum import RESULT
from eindecomp_sql.plan.tiling import Chunking


def _keys(n):
    return tuple(f"d{p}" for p in range(n))


def _value(name, a, tile):
    return TiledValue(name, a.shape, a.dtype.name, tuple(tile), _keys(a.ndim))


@pytest.fixture
def ref():
    b = ReferenceBackend()
    yield b
    b.close()


# -- plans run on the backend directly, against numpy --------------------------------------------
@given(einsum_case(), st.lists(st.booleans(), min_size=5, max_size=5), st.sampled_from([16, 64, 1 << 20]))
def test_plans_match_numpy(case, stored, tile_bytes):
    """Random specs (diagonals, case-only labels, size-1 broadcasts, scalars, every dtype) over
    operands cut in tiles that do not divide their shapes, stored or given as arrays the plan
    cuts (small tile_bytes: many pieces, grouped steps, re-tiles)."""
    spec, shapes, dtypes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = reference(spec, *arrays)
    b = ReferenceBackend()
    values, inputs = [], {}
    for k, (a, t, keep) in enumerate(zip(arrays, tiles, stored)):
        if keep:
            v = _value(f"S{k}", a, t)
            b.store_tiles(v, tiles_from_array(a, v.tile, v.keys))
            inputs[v.name] = v.name
        else:
            v = TiledValue(f"_eds_in{k}", a.shape, a.dtype.name, None, _keys(a.ndim))
            inputs[v.name] = a
        values.append(v)
    plan = plan_einsum(spec, tuple(values), tile_bytes=tile_bytes)
    got = b.execute(plan, inputs, {RESULT: Target()})[RESULT]
    assert_close(got, want, error_scale(spec, arrays))
    # and kept: the same tiles, read back as tiles_from_array cuts them
    b.execute(plan, inputs, {RESULT: Target("R")})
    r = b.lookup("R")
    assert r.shape == want.shape and r.dtype == plan.result.dtype
    assert_close(array_from_tiles(b.read_tiles(r), r.shape, r.tile, r.dtype, r.keys), want,
                 error_scale(spec, arrays))
    b.close()


AGGS = ["sum", "max", "min", "prod"]
JOINS = ["mul", "add", "max", "min", "x0 * 2 + x0"]


@given(einsum_case(max_operands=3, dtypes=("float64", "int64", "int8", "uint8", "bool", "float32", "complex128")),
       st.sampled_from(JOINS), st.sampled_from(AGGS))
def test_extended_plans_match_the_numpy_reference(case, join, agg):
    spec, shapes, dtypes, tiles, seed = case
    if "->" not in spec:
        letters = spec.replace(",", "")
        spec += "->" + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    if agg == "prod":
        arrays = [np.where(np.abs(a) > 2, a / 4, a) if a.dtype.kind in "fc" else a for a in arrays]
    fn = {"x0 * 2 + x0": lambda *xs: xs[0] * 2 + xs[0]}.get(join, join)
    with np.errstate(all="ignore"):
        try:
            want = reference(spec, *arrays, join=fn, agg=agg)
        except (TypeError, ValueError):  # numpy refuses (complex max, max of nothing): not ours to test here
            return
    values = tuple(_value(f"V{k}", a, t) for k, (a, t) in enumerate(zip(arrays, tiles)))
    try:
        plan = plan_einsum(spec, values, join=join, agg=agg, tile_bytes=32)
    except EinsumError:  # planning refuses what numpy answers in float16, max over nothing
        return
    b = ReferenceBackend()
    got = b.execute(plan, {v.name: a for v, a in zip(values, arrays)}, {RESULT: Target()})[RESULT]
    assert_close(got, want, np.abs(want) + 8, eps=1e-4 if "float32" in dtypes else None)


@given(st.data())
def test_retile_any_tiling_to_any_tiling(data):
    nd = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.integers(0, 7)) for _ in range(nd))
    src = tuple(data.draw(st.integers(1, max(n, 1))) for n in shape)
    dst = tuple(data.draw(st.integers(1, max(n, 1))) for n in shape)
    a = random_array(np.random.default_rng(data.draw(st.integers(0, 99))), shape, data.draw(st.sampled_from(DTYPES)))
    s, t = _value("s", a, src), TiledValue("t", shape, a.dtype.name, dst, ("a", "b", "c")[:nd])
    out = ReferenceBackend().execute(Plan((RetileStep(s, t),), (s,), (t,)), {"s": a}, {"t": Target()})
    np.testing.assert_array_equal(out["t"], a)


def test_steps_really_run_on_tiles(ref):
    """A grouped product: k in 3 pieces meets in the aggregation; the operand tiles are
    exactly those the step's keys select (a mis-cut operand is an error, not a wrong answer)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 4))
    A, B = _value("A", a, (2, 3)), _value("B", b, (3, 4))
    (planned,) = [s for s in plan_einsum("ik,kj->ij", (A, B), agg="max", join="add").steps
                  if isinstance(s, EinsumStep)]
    result = TiledValue(RESULT, (5, 4), "float64", (2, 4), ("i", "j"))
    chunk = Chunking(tuple(sorted(planned.node.size.items())), (("i", 2), ("j", 4), ("k", 3)))
    step = EinsumStep(planned.node, (A, B), result, chunk)
    assert step.grouped and step.pieces == {"i": 3, "j": 1, "k": 3}
    plan = Plan((step,), (A, B), (result,))
    got = ref.execute(plan, {"A": a, "B": b}, {RESULT: Target()})[RESULT]
    np.testing.assert_array_equal(got, (a[:, :, None] + b[None]).max(1))
    # the same step fed B cut (2, 4): its k tiles no longer line up with A's
    wrong = Plan(plan.steps, (A, TiledValue("B", b.shape, "float64", (2, 4), _keys(2))), plan.outputs)
    with pytest.raises(EinsumError, match="cut differently"):
        ref.execute(wrong, {"A": a, "B": b}, {RESULT: Target()})


def test_fill_steps():
    for agg, value in (("sum", 0), ("prod", 1)):
        plan = plan_einsum("ij,jk->ik", (TiledValue("A", (5, 0), "int32", (2, 1), _keys(2)),
                                         TiledValue("B", (0, 3), "int32", (1, 3), _keys(2))), agg=agg, tile_bytes=16)
        assert isinstance(plan.steps[0], FillStep)
        got = ReferenceBackend().execute(plan, {"A": np.zeros((5, 0), np.int32), "B": np.zeros((0, 3), np.int32)},
                                         {RESULT: Target()})[RESULT]
        np.testing.assert_array_equal(got, np.full((5, 3), value, got.dtype))


def test_cut_and_assemble_round_trip_and_copy():
    a = np.arange(35.0).reshape(5, 7)
    tiles = cut(a, (2, 3))
    assert sorted(tiles) == [(i, j) for i in range(3) for j in range(3)] and tiles[(2, 2)].shape == (1, 1)
    a[0, 0] = 99  # tiles never alias the array they were cut from
    assert tiles[(0, 0)][0, 0] == 0
    np.testing.assert_array_equal(assemble(TiledValue("x", (5, 7), "float64", (2, 3), _keys(2)), tiles),
                                  np.arange(35.0).reshape(5, 7))
    s = cut(np.float32(3), ())
    assert list(s) == [()] and s[()].shape == ()


# -- the catalog, as DuckDB's ------------------------------------------------------------------
def test_database_must_be_in_memory():
    assert isinstance(create_backend("reference"), ReferenceBackend)
    assert ReferenceBackend(":memory:").names() == []
    for bad in ("t.duckdb", 3):
        with pytest.raises(EinsumError, match="in memory only"):
            create_backend("reference", bad)
        with pytest.raises(EinsumError, match="in memory only"):
            eds.connect(bad, backend="reference")


def test_store_lookup_names_drop(ref):
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    v = _value("Alpha", a, (2, 3))
    ref.store_tiles(v, tiles_from_array(a, v.tile, v.keys))
    ref.store_tiles(_value("beta", a, (3, 4)), tiles_from_array(a, (3, 4), v.keys))
    assert ref.names() == ["Alpha", "beta"]
    assert ref.lookup("ALPHA") == v and ref.lookup("nope") is None
    with pytest.raises(EinsumError, match="table 'alpha' already exists; pass replace=True to overwrite it"):
        ref.store_tiles(_value("alpha", a, (1, 1)), tiles_from_array(a, (1, 1), v.keys))
    ref.store_tiles(_value("alpha", a, (1, 1)), tiles_from_array(a, (1, 1), v.keys), replace=True)
    assert ref.names() == ["alpha", "beta"] and ref.lookup("Alpha").tile == (1, 1)
    # read_tiles gives the table tiles_from_array builds (rows in key order)
    assert ref.read_tiles(ref.lookup("beta")).equals(tiles_from_array(a, (3, 4), v.keys))
    ref.drop("ALPHA")
    assert ref.names() == ["beta"]
    with pytest.raises(EinsumError, match="no longer exists"):
        ref.read_tiles(v)


def test_stored_tiles_are_copies_and_checked(ref):
    a = np.arange(6.0).reshape(2, 3)
    v = _value("A", a, (2, 3))
    ref.store_tiles(v, tiles_from_array(a, v.tile, v.keys))  # one tile: a view of a, in Arrow
    a[:] = -1
    np.testing.assert_array_equal(array_from_tiles(ref.read_tiles(v), (2, 3), (2, 3), "float64", v.keys),
                                  np.arange(6.0).reshape(2, 3))
    with pytest.raises(EinsumError, match="missing or extra"):
        ref.store_tiles(_value("B", a, (1, 3)), tiles_from_array(a, (1, 3), v.keys).slice(1))
    assert ref.names() == ["A"]


def test_execute_outputs_replace_temporary_and_atomicity(ref):
    a = np.arange(6.0).reshape(2, 3)
    A = _value("A", a, (1, 2))
    ref.store_tiles(A, tiles_from_array(a, A.tile, A.keys))
    plan = plan_einsum("ij->ji", (A,))
    ref.execute(plan, {"A": "A"}, {RESULT: Target("T")})
    with pytest.raises(EinsumError, match="table 't' already exists"):
        ref.execute(plan, {"A": "A"}, {RESULT: Target("t")})
    ref.execute(plan, {"A": "A"}, {RESULT: Target("_tmp", temporary=True)})
    assert ref.names() == ["A", "T"] and ref.tables(temporary=True) == ["_tmp"] and ref.table_exists("_TMP")
    r = plan.result
    np.testing.assert_array_equal(
        array_from_tiles(ref.read_tiles(TiledValue("_tmp", r.shape, r.dtype, r.tile, r.keys)), r.shape, r.tile,
                         r.dtype, r.keys), a.T)
    ref.drop_table("_tmp")
    assert not ref.table_exists("_tmp")
    # a graph whose second output fails on real tiles: neither output is written
    g = Graph()
    x = g.input("x", (4, 4), "float64")
    g.map("exp", x, name="ok")

    def boom(v):
        if (v > 50).any():  # the probe (ones) passes; the tile holding 99 does not
            raise RuntimeError("exploded on a real tile")
        return v

    g.map(boom, x, name="bad")
    gp = g.plan(outputs=["ok", "bad"])
    xs = np.ones((4, 4))
    xs[3, 3] = 99
    with pytest.raises(EinsumError, match="exploded on a real tile"):
        ref.execute(gp.plan, {"x": xs}, {"ok": Target("OK"), "bad": Target("BAD")})
    assert ref.names() == ["A", "T"] and ref.tables() == ["A", "T"]


def test_progress_callables_and_read_only():
    b = ReferenceBackend(read_only=True)
    seen, calls = [], []
    a = np.arange(20.0).reshape(4, 5)

    def traced(x, y):
        calls.append(x.shape)  # callable joins run in this process: the list sees every call
        return x * y

    v = _value("a", a, (2, 2))
    plan = plan_einsum("ij,ij->i", (v, v), join=traced)
    got = b.execute(plan, {"a": a}, {RESULT: Target()}, progress=seen.append)[RESULT]
    np.testing.assert_array_equal(got, (a * a).sum(1))
    assert calls and [p.step for p in seen] == list(range(1, len(plan.steps) + 1))
    assert seen[-1].tiles_done == seen[-1].tiles == 2
    with pytest.raises(EinsumError, match="read-only"):
        b.store_tiles(v, tiles_from_array(a, v.tile, v.keys))
    with pytest.raises(EinsumError, match="read-only"):
        b.execute(plan, {"a": a}, {RESULT: Target("kept")})
    b.execute(plan, {"a": a}, {RESULT: Target("_r", temporary=True)})  # temporary results are fine
    b.close()
    b.close()
    assert b.closed
    for call in (b.names, lambda: b.lookup("a"), lambda: b.execute(plan, {"a": a}, {RESULT: Target()})):
        with pytest.raises(EinsumError, match="closed"):
            call()


# -- through a session ---------------------------------------------------------------------------
def test_a_session_on_the_reference_backend():
    rng = np.random.default_rng(3)
    a, w = rng.standard_normal((9, 6)), rng.standard_normal((6, 5))
    with eds.connect(backend="reference", tile_bytes=64) as db:
        assert db.connection is None and db.backend.name == "reference"
        A = db.store("A", a, tile=(4, 4))
        C = db.einsum("ij,jk->ik", A, w, out="C")
        assert db.tensors() == ["A", "C"] and C.to_arrow().num_rows > 1
        assert_close(C.to_numpy(), a @ w)
        with pytest.raises(EinsumError, match="already exists"):
            db.einsum("ij->ji", A, out="c")
        t = db.einsum("ij->j", A, agg="max")
        assert t.temporary and t.name not in db.tensors()
        assert_close(t.to_numpy(), a.max(0))
        g = Graph()
        x, y = g.input("x", (9, 6), "float64"), g.input("w", (6, 5), "float64")
        g.map("relu", g.einsum("bi,io->bo", x, y), name="h")
        assert_close(g.run(db, x=A, w=w).to_numpy(), np.maximum(a @ w, 0))
        back = db.store("A2", A.to_arrow())
        assert back.tile == (4, 4)
        np.testing.assert_array_equal(back.to_numpy(), a)
        db.drop("A2")
        assert db.tensors() == ["A", "C"]


@pytest.fixture(scope="module")
def both():
    sessions = [eds.connect(backend=b, tile_bytes=64) for b in ("duckdb", "reference")]
    yield sessions
    for s in sessions:
        s.close()


@given(einsum_case(max_operands=3, dtypes=("int64", "int8", "uint16", "bool", "int32")))
def test_same_integers_as_duckdb(both, case):
    """Both engines run the same plan: integer results agree exactly."""
    spec, shapes, dtypes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    got = []
    for db in both:
        ops = [db.store(f"p{k}", a, tile=t, replace=True) for k, (a, t) in enumerate(zip(arrays, tiles))]
        got.append(db.einsum(spec, *ops).to_numpy())
    assert got[0].dtype == got[1].dtype
    np.testing.assert_array_equal(got[0], got[1])


def test_arrow_tables_match_duckdbs():
    a = np.arange(30, dtype=np.uint8).reshape(5, 6)
    tables = []
    for backend in ("duckdb", "reference"):
        with eds.connect(backend=backend) as db:
            tables.append(db.store("A", a, tile=(2, 4), keys=("r", "c")).to_arrow())
            tables.append(db.einsum("ij->ji", "A").to_arrow())
    key = lambda t: t.sort_by([(n, "ascending") for n in t.column_names[:-1]]).cast(
        pa.schema([pa.field(n, pa.int64()) for n in t.column_names[:-1]] + [pa.field("tile", pa.binary())],
                  metadata=t.schema.metadata))
    assert key(tables[0]).equals(key(tables[2]), check_metadata=True)
    assert key(tables[1]).equals(key(tables[3]), check_metadata=True)


def test_the_numpy_face_follows_the_backend_parameter(backend, db):
    """conftest: a test run per backend runs db and eds.einsum on that backend."""
    from eindecomp_sql.api import default_session

    assert db.backend.name == backend and default_session().backend.name == backend
