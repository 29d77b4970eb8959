"""An operand repeating another (the same value under the same labels: ``ij,ij->i`` of X with
itself, a graph's ``x * x``) is read once: its table is not joined again and its tile reaches
the kernel once (``kernel_spec.operand_args``). Checked against numpy on every backend with
random specs given a repeated operand, tiles that do not divide, every dtype, every join and
aggregation, in row and grouped steps (an operand alike in a group's members too), partial
steps, graphs and the SQL function; and the SQL read: one table, one tile argument."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql.errors import EinsumError
from eindecomp_sql.plan import EinsumStep
from eindecomp_sql.plan.kernel_spec import EinsumKernelSpec, KernelJoin, from_json, operand_args
from helpers import DTYPES, assert_close, einsum_case, error_scale, random_array
from reference import reference

JOINS = ["mul", "add", "sub", "max", "min"]
AGGS = ["sum", "max", "min", "prod"]


@pytest.fixture(scope="module")
def small(backend):
    """Tiles of at most 32 bytes: labels are cut, reduced ones too (grouped steps)."""
    s = eds.connect(backend=backend, tile_bytes=32)
    yield s
    s.close()


def _repeating_steps(plan) -> list[EinsumStep]:
    return [s for s in plan.steps if isinstance(s, EinsumStep) and operand_args(s.node.operands)]


@given(einsum_case(max_operands=2, max_size=6), st.data())
def test_a_repeated_operand_matches_numpy(small, case, data):
    """einsum_case's spec with one of its operands given twice, at a random place: the same
    array and the same stored tensor."""
    spec, shapes, dtypes, tiles, seed = case
    lhs, arrow, out = spec.partition("->")
    ins = lhs.split(",")
    q = data.draw(st.integers(0, len(ins) - 1))
    at = data.draw(st.integers(0, len(ins)))
    order = list(range(len(ins)))
    order.insert(at, q)
    spec = ",".join(ins[k] for k in order) + arrow + out
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    stored = [small.store(f"r{k}", a, tile=t, replace=True) for k, (a, t) in enumerate(zip(arrays, tiles))]
    ops = [arrays[k] for k in order]
    want = reference(spec, *ops)
    got = small.einsum(spec, *[stored[k] for k in order]).to_numpy()
    assert_close(got, want, error_scale(spec, ops))


@given(join=st.sampled_from(JOINS), agg=st.sampled_from(AGGS),
       spec=st.sampled_from(["ij,ij->i", "ij,ij->j", "ij,ij->", "ij,ij->ij", "ij,ij->ji", "b,b,bi->b",
                             "bi,b,b->bi", "ij,jk,ij->ik", "ii,ii->i", "ij,ij,ij->j"]),
       rows=st.integers(1, 9), cols=st.integers(1, 9), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_every_join_and_aggregation_in_rows_and_groups(small, join, agg, spec, rows, cols, dtype, seed):
    """Named specs whose repeated operands share one step (an extended join keeps a
    three-operand node whole), cut so that both row steps and grouped ones run, with an
    operand alike in every member of a group (``b,b,bi->b``: ``b`` is read once per group)."""
    if spec.startswith("ii"):
        cols = rows
    rng = np.random.default_rng(seed)
    size = {"i": rows, "j": cols, "b": rows, "k": cols}
    arrays = {}
    for term in spec.split("->")[0].split(","):
        if term not in arrays:
            arrays[term] = random_array(rng, tuple(size[c] for c in term), dtype)
    if agg == "prod":  # keep products in range
        arrays = {t: np.clip(x, -2, 2) if x.dtype != bool else x for t, x in arrays.items()}
    terms = spec.split("->")[0].split(",")
    if join == "sub" and len(terms) != 2:
        join = "add"
    ops = [arrays[t] for t in terms]
    stored = {t: small.store(f"n{k}", x, replace=True) for k, (t, x) in enumerate(arrays.items())}
    with np.errstate(all="ignore"):
        try:
            want = reference(spec, *ops, join=join, agg=agg)
        except TypeError:  # numpy refuses (bool - bool): so do we, before anything runs
            with pytest.raises(eds.EinsumError):
                small.einsum(spec, *[stored[t] for t in terms], join=join, agg=agg)
            return
        got = small.einsum(spec, *[stored[t] for t in terms], join=join, agg=agg).to_numpy()
    assert_close(got, want, error_scale(spec, ops) if join == "mul" and agg == "sum" else None)


def test_plans_read_a_repeated_operand_once(small):
    """Where both occurrences land in one step, the step's spec says which tile each operand
    reads, and its cost and peak count the operand once."""
    x = small.store("rx", np.arange(63.0).reshape(9, 7), replace=True)
    for spec in ("ij,ij->i", "ij,ij->j", "ij,ij->"):
        plan = small.plan(spec, x, x)
        steps = _repeating_steps(plan)
        assert steps, plan.explain()
        for s in steps:
            assert operand_args(s.node.operands) == (0, 0)
            assert s.costs.join == s.inputs[0].nbytes, s.describe()


@pytest.mark.duckdb_only("the SQL a step runs")
def test_the_sql_reads_the_table_once_and_hands_the_tile_once(backend):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((300, 40)).astype(np.float32)
    with eds.connect() as s:
        X = s.store("X", x, tile=(30, 40))
        text = s.explain("ij,ij->i", X, X)
        assert re.search(r'FROM "X" AS "t0";', text), text
        assert "EDS_EINSUM1(" in text and '"args":[0,0]' in text and '"v":5' in text, text
        assert_close(s.einsum("ij,ij->i", X, X).to_numpy(), np.einsum("ij,ij->i", x, x))
        grouped = s.explain("ij,ij->j", X, X)
        assert grouped.count('"X" AS "t') == 1 and "ARRAY_AGG({'k': [\"r0\"], 't0': \"t0\"})" in grouped, grouped
        assert_close(s.einsum("ij,ij->j", X, X).to_numpy(), np.einsum("ij,ij->j", x, x), eps=1e-5)
        # the SQL function: the same statement
        got = s.connection.execute("SELECT * FROM einsum('ij,ij->i', 'X', 'X') ORDER BY i").fetchall()
        assert len(got) == 10
        # the transpose is no repeat: joined as before
        t = s.explain("ij,ji->i", X, s.store("Y", x.T.copy(), tile=(40, 30)))
        assert '"args"' not in t


def test_graphs_with_a_repeated_value(small):
    """A graph's RMS-style norm (``x * x`` summed) and a fused chain reading ``x`` twice."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 6))
    w = rng.standard_normal((6, 5))
    g = eds.Graph()
    X, W = g.input("x", x.shape, "float64"), g.input("w", w.shape, "float64")
    ss = g.einsum("bi,bi->b", X, X)
    h = g.einsum("bi,io->bo", X, W)
    y = g.einsum("bo,b->bo", h, ss)
    out = g.plan(outputs=y).run(small, x=x, w=w).to_numpy()
    assert_close(out, (x @ w) * np.einsum("bi,bi->b", x, x)[:, None], eps=1e-9)


@pytest.mark.parametrize("spec,shapes", [("b,b,bi->b", [(7,), (7,), (7, 5)]), ("ij,ij->j", [(7, 5), (7, 5)]),
                                         ("ij,jk,ij->ik", [(7, 5), (5, 3), (7, 5)])])
def test_grouped_steps_hand_a_repeated_operand_once(small, spec, shapes):
    """Grouped steps (a reduced label cut) whose repeated operand varies in a group's members
    or is alike in all of them (``b``: handed once per group, in the group's shared list)."""
    rng = np.random.default_rng(5)
    terms = spec.split("->")[0].split(",")
    arrays = {t: rng.standard_normal(shape) for t, shape in zip(terms, shapes)}
    stored = {t: small.store(f"g{k}", x, replace=True) for k, (t, x) in enumerate(arrays.items())}
    ops = [arrays[t] for t in terms]
    plan = small.plan(spec, *[stored[t] for t in terms], join="add")
    assert any(s.grouped for s in _repeating_steps(plan)), plan.explain()
    got = small.einsum(spec, *[stored[t] for t in terms], join="add").to_numpy()
    assert_close(got, reference(spec, *ops, join="add"), eps=1e-12)


def test_partial_steps_read_a_repeated_operand_once(backend, monkeypatch):
    """A reduction to a small output that runs as partial results (the split forced, as in
    test_partials.py): the partial step reads the table once too."""
    from eindecomp_sql.plan import einsum, graph_plan, partials

    monkeypatch.setattr(partials, "splits", lambda node, pieces, dtypes, budget, model, *more:
                        budget is not None and partials.can_split(node, pieces, model))
    einsum._plan.cache_clear()
    graph_plan._plan_cached.cache_clear()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 30)).astype(np.float32)
    try:
        with eds.connect(backend=backend, memory="1GB", tile_bytes=256) as s:
            X = s.store("X", x, tile=(8, 7))
            plan = s.plan("ij,ij->", X, X)
            assert any(st.node.kept for st in _repeating_steps(plan)), plan.explain()
            want = np.einsum("ij,ij->", x.astype(np.float64), x).astype(np.float32)
            assert_close(s.einsum("ij,ij->", X, X).to_numpy(), want, eps=1e-5)
    finally:
        einsum._plan.cache_clear()
        graph_plan._plan_cached.cache_clear()


def test_specs_with_args_are_checked():
    """A spec's args must fit its inputs: each operand reads an argument, first uses in order,
    an argument read twice only under the same labels and dtype, and only from version 5."""
    base = dict(inputs=(("i", "j"), ("i", "j")), output=("i",), labels=("i", "j"), reduced=("j",),
                size={"i": 3, "j": 2}, tile={"i": 3, "j": 2}, join=KernelJoin(name="mul"), agg="sum",
                dtypes=("float32", "float32"), out_dtype="float32")
    ok = EinsumKernelSpec(**base, args=(0, 0), version=5)
    from eindecomp_sql.plan.kernel_spec import to_json
    assert from_json(to_json(ok)) == ok
    for args, version, kw in [((0, 0), 4, {}), ((1, 0), 5, {}), ((0, 2), 5, {}), ((0,), 5, {}),
                              ((0, 0), 5, {"dtypes": ("float32", "float64")}),
                              ((0, 0), 5, {"inputs": (("i", "j"), ("j", "i"))})]:
        with pytest.raises(EinsumError, match="args"):
            EinsumKernelSpec(**{**base, **kw}, args=args, version=version)
