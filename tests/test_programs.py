"""Programs (plan/passes/program.py): consecutive einsum steps whose every value is one tile run
as one statement and one kernel call. Random single-tile graphs against numpy on both backends
(every dtype, reductions, several outputs), where programs are cut, the budget, the kernel spec
of a program and its refusals, and what explain() and to_dot() say."""

import json

import math

import numpy as np
import pytest
from hypothesis import event, given, reject, settings
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql.errors import EinsumError
from eindecomp_sql.graph import Graph
from eindecomp_sql.plan import EinsumStep, ProgramStep, RetileStep
from eindecomp_sql.plan.kernel_spec import (PROGRAM_VERSION, EinsumKernelSpec, ProgramKernelSpec, from_json,
                                            kernel_spec, to_json)
from graphs import llama_block, random_inputs
from test_explain_runs import Recorder, check_runs_as_explained
from test_fusion import MAPS, JOINS, _array, _kind, assert_near

DTYPES = ["float32", "float64", "int32", "int64", "complex128", "bool"]
AGGS = {"sum": np.sum, "max": np.max, "min": np.min}


@st.composite
def single_tile_graphs(draw):
    """A random graph of products, reductions, maps and broadcast joins over small arrays (one
    tile each under the default tile cap), one dtype, one to three outputs; with numpy's values."""
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    kind = _kind(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**31), label="seed"))
    sizes = {lab: draw(st.integers(1, 7), label=f"size {lab}") for lab in "ijk"}
    g = Graph()
    arrays, values = {}, []  # values: (GraphValue, labels, numpy value)
    for n in range(draw(st.integers(1, 3), label="inputs")):
        labels = draw(st.sampled_from(["ij", "jk", "ik", "i", "k"]), label=f"in{n} labels")
        shape = tuple(sizes[lab] for lab in labels)
        arrays[f"in{n}"] = _array(rng, shape, dtype)
        values.append((g.input(f"in{n}", shape, dtype), labels, arrays[f"in{n}"]))
    for n in range(draw(st.integers(3, 7), label="nodes")):
        # mostly the value just made: chains of steps, which is what programs are made of
        x, xl, xv = values[-1] if draw(st.integers(0, 3), label=f"node {n} chains") else \
            draw(st.sampled_from(values), label=f"node {n} first")
        what = draw(st.sampled_from(["product", "product", "reduce", "map", "join"]), label=f"node {n} kind")
        if what == "product" and kind != "b":
            y, yl, yv = draw(st.sampled_from(values), label=f"node {n} second")
            out = "".join(dict.fromkeys(lab for lab in xl + yl if (lab in xl) != (lab in yl))) or xl[:1]
            spec = f"{xl},{yl}->{out}"
            v = g.einsum(spec, x, y)
            ref = np.einsum(spec, xv, yv)
            values.append((v, out, ref.astype(v.dtype)))
        elif what == "reduce" and len(xl) > 1 and kind not in "bc":
            agg = draw(st.sampled_from(sorted(AGGS)), label=f"node {n} agg")
            keep = xl[:-1]
            v = g.einsum(f"{xl}->{keep}", x, agg=agg)
            values.append((v, keep, AGGS[agg](xv, axis=-1).astype(v.dtype)))
        elif what == "join":
            y, yl, yv = draw(st.sampled_from([t for t in values if set(t[1]) <= set(xl)]), label=f"node {n} other")
            fn = draw(st.sampled_from(sorted(JOINS[kind])), label=f"node {n} join")
            v = g.einsum(f"{xl},{yl}->{xl}", x, y, join=fn)
            yb = np.einsum(f"{yl}->{''.join(lab for lab in xl if lab in yl)}", yv)
            shape = [sizes[lab] if lab in yl else 1 for lab in xl]
            values.append((v, xl, np.asarray(JOINS[kind][fn](xv, yb.reshape(shape))).astype(v.dtype)))
        else:
            fn = draw(st.sampled_from(sorted(MAPS[kind])), label=f"node {n} map")
            v = g.map(fn, x)
            values.append((v, xl, np.asarray(MAPS[kind][fn](xv)).astype(v.dtype)))
    made = [t for t in values if t[0].name not in arrays]
    picked = [made[-1]] + draw(st.lists(st.sampled_from(made[:-1]), max_size=2, unique_by=lambda t: t[0].name),
                               label="more outputs") if len(made) > 1 else made
    return g, arrays, {v.name: ref for v, _, ref in picked}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=80, deadline=None)
@given(single_tile_graphs(), st.sampled_from([None, None, 1500, 6000]))
def test_random_single_tile_graphs_run_as_programs_and_match_numpy(db, case, memory):
    """Every einsum step ends up in a program or alone; a program stores one value, which is kept
    or read after it, and fits the budget; the results are numpy's, and the same bits as the
    per-node plan's."""
    g, arrays, want = case
    outputs = list(want)
    try:
        plans = {fuse: g.plan(outputs=outputs, fuse=fuse, memory=memory) for fuse in ("elementwise", True)}
    except EinsumError as e:  # a budget no chunking of some node fits: refused before running
        # (by the optimizer, or by the budget check of the finished plan, which knows each
        # retile's source tiles: both before anything runs)
        assert memory is not None and ("fits the memory budget" in str(e) or "over the memory budget" in str(e))
        reject()
    plan = plans[True].plan
    if memory is not None:
        assert plan.peak_bytes <= memory
    kept = {v.name for v in plan.outputs}
    for k, step in enumerate(plan.steps):
        if isinstance(step, ProgramStep):
            later = {v.name for s in plan.steps[k + 1:] for v in getattr(s, "inputs", ())}
            assert len(step.steps) > 1 and step.result.name in kept | later
            hidden = {s.result.name for s in step.steps[:-1]}
            assert not hidden & (kept | later)
    assert len(plan.steps) <= len(plans["elementwise"].plan.steps)
    event(f"programs: {sum(isinstance(s, ProgramStep) for s in plan.steps)}, outputs: {len(outputs)}")
    got = {fuse: {k: t.to_numpy() for k, t in p.run(db, **arrays).items()} for fuse, p in plans.items()}
    for name, w in want.items():
        assert_near(got[True][name], w)
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(got[True][name], got["elementwise"][name])
        else:  # the same kernels in the same order: the same numbers
            np.testing.assert_allclose(got[True][name], got["elementwise"][name], rtol=1e-6, atol=0)


def test_a_chain_of_products_is_one_statement():
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.standard_normal(s) for s in ((7, 5), (5, 9), (9, 4), (4, 6)))
    with eds.connect() as db:
        rec = Recorder(db.backend)
        got = eds.einsum("ij,jk,kl,lm->im", a, b, c, d, optimize="greedy")
        np.testing.assert_allclose(got, a @ b @ c @ d, rtol=1e-12)
        plan = db.plan("ij,jk,kl,lm->im", a, b, c, d)
        (step,) = plan.steps
        assert isinstance(step, ProgramStep) and len(step.steps) == 3
        assert db.einsum("ij,jk,kl,lm->im", a, b, c, d).to_numpy().shape == (7, 6)
        assert rec.writes() == (1, 0)


@pytest.mark.parametrize("n", [3, 16, 17, 20])
def test_a_program_takes_its_inputs_as_arguments_up_to_16_then_as_a_list(n):
    """DuckDB copies every tile of a list it builds, so a program's inputs go as one argument
    each (``eds_program<n>``) up to ``max_program_args``, and as a list above: same results."""
    rng = np.random.default_rng(n)
    g = Graph()
    xs = [g.input(f"x{k}", (6, 6), "float64") for k in range(n)]
    acc = xs[0]
    for x in xs[1:]:
        acc = g.einsum("ij,jk->ik", acc, x)
    arrays = {f"x{k}": rng.standard_normal((6, 6)) / 2 for k in range(n)}
    with eds.connect() as db:
        plan = g.plan()
        (step,) = plan.plan.steps
        assert isinstance(step, ProgramStep) and len(step.inputs) == n
        sql = plan.explain()
        assert (f"EDS_PROGRAM{n}(" in sql) == (n <= 16) and ("EDS_PROGRAM(" in sql) == (n > 16), sql[:300]
        want = arrays["x0"]
        for k in range(1, n):
            want = want @ arrays[f"x{k}"]
        np.testing.assert_allclose(plan.run(db, **arrays).to_numpy(), want, rtol=1e-10, atol=1e-12)


def test_a_kept_value_in_the_middle_ends_the_program():
    g = Graph()
    x, w, v = g.input("x", (4, 3), "float64"), g.input("w", (3, 5), "float64"), g.input("v", (5, 2), "float64")
    h = g.map("relu", g.einsum("ij,jk->ik", x, w))
    y = g.einsum("ik,kl->il", h, v)
    z = g.map("exp", y)
    p = g.plan(outputs=[h, z])  # h is kept: the first program stores it, the next reads it
    kinds = [type(s).__name__ for s in p.plan.steps]
    assert kinds in (["ProgramStep", "ProgramStep"], ["EinsumStep", "ProgramStep"], ["EinsumStep", "EinsumStep"])
    assert p.plan.steps[0].result.name == h.name
    rng = np.random.default_rng(3)
    xs = {"x": rng.standard_normal((4, 3)), "w": rng.standard_normal((3, 5)), "v": rng.standard_normal((5, 2))}
    with eds.connect() as db:
        out = p.run(db, **xs)
        hv = np.maximum(xs["x"] @ xs["w"], 0)
        np.testing.assert_allclose(out[h.name].to_numpy(), hv, rtol=1e-12)
        np.testing.assert_allclose(out[z.name].to_numpy(), np.exp(hv @ xs["v"]), rtol=1e-12)


def test_a_value_read_by_a_retile_ends_the_program():
    """Cut steps in between: a value read by a step outside (a retile) is stored."""
    g = Graph()
    x, w, u = (g.input(n, s, "float64") for n, s in (("x", (6, 4)), ("w", (4, 6)), ("u", (6, 3))))
    h = g.einsum("ij,jk->ik", x, w)
    h2 = g.einsum("ik,kl->il", h, u)
    y = g.einsum("il,ij->lj", h2, x)
    p = g.plan(outputs=y, inputs={"x": (3, 4)})  # x stored in two tiles: a retile or cut steps
    names = {s.result.name for s in p.plan.steps if isinstance(s, (EinsumStep, ProgramStep))}
    for k, s in enumerate(p.plan.steps):
        if isinstance(s, ProgramStep):
            outside = {v.name for other in p.plan.steps if other is not s for v in
                       (getattr(other, "inputs", None) or ((other.source,) if isinstance(other, RetileStep) else ()))}
            assert not {t.result.name for t in s.steps[:-1]} & outside
    assert y.name in names
    rng = np.random.default_rng(4)
    xs = {"x": rng.standard_normal((6, 4)), "w": rng.standard_normal((4, 6)), "u": rng.standard_normal((6, 3))}
    with eds.connect() as db:
        X = db.store("X", xs["x"], tile=(3, 4))
        got = g.run(db, x=X, w=xs["w"], u=xs["u"], outputs=y).to_numpy()
    np.testing.assert_allclose(got, np.einsum("il,ij->lj", xs["x"] @ xs["w"] @ xs["u"], xs["x"]), rtol=1e-12)


def test_the_budget_keeps_steps_apart():
    """A program holds its inputs and the results still to be read: over the budget, the steps
    run one statement each, and each fits."""
    g = Graph()
    x, w, v = g.input("x", (64, 64)), g.input("w", (64, 64)), g.input("v", (64, 64))
    y = g.einsum("ik,kl->il", g.einsum("ij,jk->ik", x, w), v)
    free = g.plan(outputs=y)
    (program,) = free.plan.steps
    assert isinstance(program, ProgramStep)
    parts = g.plan(outputs=y, fuse="elementwise").plan.steps
    assert program.peak_bytes >= max(s.peak_bytes for s in parts)
    # plans' budgets (g.plan(memory=M) plans under the plans' share of M, as a session does)
    from eindecomp_sql.plan.cost import BUDGET_SHARE, plan_share
    from eindecomp_sql.plan.graph_plan import plan_graph

    tight = plan_graph(g, outputs=y, memory=program.peak_bytes - 1)
    assert not any(isinstance(s, ProgramStep) for s in tight.plan.steps)
    assert tight.plan.peak_bytes <= program.peak_bytes - 1
    memory = math.ceil(program.peak_bytes / BUDGET_SHARE)
    while plan_share(memory) < program.peak_bytes:
        memory += 1
    fits = g.plan(outputs=y, memory=memory)  # a budget it fits: still one program
    (step,) = fits.plan.steps
    assert isinstance(step, ProgramStep) and fits.plan.peak_bytes == program.peak_bytes
    assert not any(isinstance(s, ProgramStep) for s in g.plan(outputs=y, memory=memory - 2).plan.steps)
    rng = np.random.default_rng(6)
    xs = {n: rng.standard_normal((64, 64)).astype(np.float32) for n in "xwv"}
    with eds.connect(memory=memory) as db:
        got = fits.run(db, **xs).to_numpy()
    np.testing.assert_allclose(got, xs["x"] @ xs["w"] @ xs["v"], rtol=1e-4, atol=1e-4)


def test_fuse_false_and_elementwise_make_no_programs():
    g, _ = llama_block()
    for fuse in (False, "elementwise"):
        assert not any(isinstance(s, ProgramStep) for s in g.plan(fuse=fuse).plan.steps)
    with pytest.raises(EinsumError, match="fuse must be True, False or 'elementwise'"):
        g.plan(fuse="programs")
    with pytest.raises(EinsumError, match="fuse must be"):
        g.plan(fuse=1)


def test_llama_block_is_one_statement_and_explain_says_so():
    g, ref = llama_block()
    xs = random_inputs(g, 0)
    p = g.plan()
    (step,) = p.plan.steps
    assert isinstance(step, ProgramStep) and len(step.steps) == 16
    text = p.explain()
    assert "program of 16 einsums on single tiles -> out" in text
    assert "24 node(s) fused into others' steps" in text
    assert p.fused.keys() == {n.result.name for n in p.nodes} - {"out"}
    dot = p.to_dot()
    assert "step 0: one statement" in dot and "inside the kernel" in dot
    with eds.connect() as db:
        rec = Recorder(db.backend)
        out = p.run(db, **xs).to_numpy()
        check_runs_as_explained(rec, p.plan, text)
        assert rec.writes() == (1, 0)
    np.testing.assert_allclose(out, ref(**xs), rtol=1e-9, atol=1e-9)


def test_a_program_in_the_sql_interface():
    db = eds.connect()
    rng = np.random.default_rng(5)
    a, b, c = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal((5, 2))
    for name, x in zip("ABC", (a, b, c)):
        db.store(name, x)
    rows = db.connection.sql("SELECT * FROM einsum_elements('ij,jk,kl->il', 'A', 'B', 'C') ORDER BY ALL").fetchall()
    want = a @ b @ c
    assert [(i, l) for i, l, _ in rows] == [(i, l) for i in range(3) for l in range(2)]
    np.testing.assert_allclose([v for *_, v in rows], want.reshape(-1), rtol=1e-12)


def test_a_failing_join_in_a_program_names_it():
    def bad(x, y):  # fine on the planner's probe, fails on the data
        if 3 in np.shape(x):
            raise ValueError("no")
        return x * y

    g = Graph()
    x, w = g.input("x", (3, 3), "float64"), g.input("w", (3, 3), "float64")
    y = g.einsum("ij,jk->ik", g.einsum("ij,jk->ik", x, w), w, join=bad)
    with eds.connect() as db:
        with pytest.raises(EinsumError, match="program of 2 einsums"):
            g.plan(outputs=y).run(db, x=np.ones((3, 3)), w=np.ones((3, 3)))
        assert db.tensors() == []


# -- the kernel spec ---------------------------------------------------------------------------
def _program_spec():
    g = Graph()
    x, w, v = g.input("x", (4, 3), "float32"), g.input("w", (3, 5), "float32"), g.input("v", (5, 2), "float64")
    y = g.einsum("ik,kl->il", g.einsum("ij,jk->ik", x, w), v)  # float32 product, then a float64 one
    (step,) = g.plan(outputs=y).plan.steps
    return step, json.loads(kernel_spec(step))


def test_a_program_spec_round_trips():
    step, body = _program_spec()
    spec = from_json(json.dumps(body))
    assert isinstance(spec, ProgramKernelSpec) and spec.version == PROGRAM_VERSION
    assert all(isinstance(s, EinsumKernelSpec) for s in spec.steps) and spec.args == ((0, 1), (3, 2))
    assert spec.dtypes == ("float32", "float32", "float64") and spec.out_dtype == "float64"
    assert from_json(to_json(spec)) == spec and to_json(spec) == json.dumps(body, separators=(",", ":"), sort_keys=True)


@pytest.mark.parametrize("change,match", [
    (lambda b: b.update(v=2), "program needs version 3"),
    (lambda b: b.update(args=[[0, 1]]), "2 steps and 1 argument lists"),
    (lambda b: b.update(args=[[0, 1], [4, 2]]), "reads slot 4, but only slots 0..3"),
    (lambda b: b.update(args=[[0, 1], [2, 3]]), r"wants float32 from slot 2, which holds float64"),
    (lambda b: b.update(args=[[0], [3, 2]]), "has 2 inputs but reads 1 slots"),
    (lambda b: b.update(steps=[]), "steps must be einsum specs"),
    (lambda b: b.update(steps="x"), "steps must be a list of specs"),
    (lambda b: b["steps"][0].update(device="cuda"), "runs on 'cuda', the program on 'cpu'"),
    (lambda b: b["steps"][1].update(op="fill"), "fill: missing keys"),
    (lambda b: b.pop("dtypes"), r"missing keys \['dtypes'\]"),
])
def test_a_bad_program_spec_is_refused(change, match):
    _, body = _program_spec()
    change(body)
    with pytest.raises(EinsumError, match=match):
        from_json(json.dumps(body))
