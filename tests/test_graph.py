"""Graphs of extended einsums: workloads against numpy, plan structure, EXPLAIN, errors."""

import re
import warnings

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.graph import Graph
from eindecomp_sql.plan import EinsumStep, RetileStep
from graphs import attention, chain, ffn, llama_block, random_inputs
from helpers import NUMPY_DTYPES, random_array
from hypothesis import given, settings
from hypothesis import strategies as st

WORKLOADS = {"chain": chain, "ffn": ffn, "attention": attention, "llama_block": llama_block}


@pytest.mark.parametrize("name", list(WORKLOADS))
@pytest.mark.parametrize("strategy", ["eindecomp", "data-parallel", "model-parallel", "square-tiles"])
@pytest.mark.parametrize("workers", [1, 4])
def test_workloads_match_numpy(db, name, strategy, workers):
    g, ref = WORKLOADS[name]()
    xs = random_inputs(g, seed=len(name))
    plan = g.plan(workers=workers, strategy=strategy)
    out = plan.run(db, **xs)
    np.testing.assert_allclose(out.to_numpy(), ref(**xs), rtol=1e-9, atol=1e-9)


def test_eindecomp_cost_never_above_baselines():
    for make in WORKLOADS.values():
        g, _ = make()
        for workers in (1, 2, 4, 8):
            p = g.plan(workers=workers)
            for strat, c in p.baselines.items():
                assert p.cost <= c.total, (make.__name__, workers, strat)


def test_ffn_plan_structure():
    g, _ = ffn(b=1024, d=64, f=256)
    p = g.plan(workers=4)
    # the batch label is the big one: cut it, keep weights whole, no re-tiling between layers
    for n in p.nodes:
        pieces = p.pieces[n.result.name]
        assert pieces[n.output[0]] == 4 and all(v == 1 for lab, v in pieces.items() if lab != n.output[0])
    assert p.retiles == 0
    mp = g.plan(workers=4, strategy="model-parallel")
    assert mp.retiles >= 1 and mp.cost > p.cost
    assert p.baselines["model-parallel"].total == mp.cost


def test_chain_plans_a_binary_step_per_product():
    g, _ = chain()
    p = g.plan(workers=2)
    assert len([s for s in p.plan.steps if not isinstance(s, RetileStep)]) == 5


def test_stored_inputs_cut_differently_are_retiled(db):
    g, ref = ffn(b=40, d=12, f=20)
    xs = random_inputs(g, 3)
    x = db.store("ffn_x", xs["x"], tile=(7, 5), replace=True)
    w2 = db.store("ffn_w2", xs["w2"], tile=(3, 3), keys=("a", "b"), replace=True)
    # a plan made without knowing how the inputs are stored refuses them: it would have to
    # run steps its explain() never showed
    with pytest.raises(EinsumError, match=r"stored in tiles \(7, 5\).*g.plan\(inputs="):
        g.plan(workers=2).run(db, x="ffn_x", w1=xs["w1"], w2=w2)
    p = g.plan(workers=2, inputs={"x": x, "w2": w2})
    assert p.retiles >= 1 and "retile x (7, 5)" in p.explain()
    out = p.run(db, x="ffn_x", w1=xs["w1"], w2=w2)
    np.testing.assert_allclose(out.to_numpy(), ref(**xs), rtol=1e-9, atol=1e-12)
    # g.run plans for the inputs as stored, in one call
    np.testing.assert_allclose(g.run(db, x="ffn_x", w1=xs["w1"], w2=w2).to_numpy(), ref(**xs), rtol=1e-9, atol=1e-12)


def test_named_outputs_and_several_outputs(db):
    g = Graph()
    x = g.input("x", (6, 4), "float64")
    g.reduce(x, 1, agg="max", name="rowmax")
    colmin = g.reduce(x, 0, agg="min", name="colmin")
    a = np.random.default_rng(0).standard_normal((6, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # outputs named: nothing is left out, nothing to warn about
        plan = g.plan(outputs=["rowmax", colmin])
    outs = plan.run(db, x=a, out={"rowmax": "gr_rowmax"}, replace=True)
    np.testing.assert_array_equal(outs["rowmax"].to_numpy(), a.max(1))
    np.testing.assert_array_equal(outs["colmin"].to_numpy(), a.min(0))
    assert "gr_rowmax" in db.tensors()


def _dead_end_graph():
    """y = relu(x @ w) is the last value added; z = sum(x * u) is used by nobody."""
    g = Graph()
    x, w, u = g.input("x", (8, 4), "float64"), g.input("w", (4, 3), "float64"), g.input("u", (8, 4), "float64")
    h = g.einsum("bi,io->bo", x, w, name="h")
    g.einsum("bi,bi->", x, u, name="z")
    y = g.map("relu", h, name="y")
    return g, h, y


def test_a_node_nobody_uses_is_left_out_with_a_warning(db):
    g, h, y = _dead_end_graph()
    with pytest.warns(UserWarning, match=r"only the last-added value 'y'.*left out: z \(bi,bi->\)"):
        plan = g.plan()
    assert [n.result.name for n in plan.nodes] == ["h", "y"]
    assert [v.name for v in plan.outputs] == ["y"] and [v.name for v in plan.unused_inputs] == ["u"]
    xs = random_inputs(g, 4)
    out = plan.run(db, **xs)  # u is a graph input the plan does not read: checked, then ignored
    assert isinstance(out, eds.Tensor)
    np.testing.assert_allclose(out.to_numpy(), np.maximum(xs["x"] @ xs["w"], 0))
    assert "inputs not read: u" in plan.explain(sql=False)
    with pytest.raises(EinsumError, match=r"missing inputs \['w'\]"):
        plan.run(db, x=xs["x"])
    # ... but what is given for it must be right: a wrong shape or dtype ran in silence (a trial)
    for bad, match in [(np.ones((4, 8)), r"input 'u': the graph wants \(8, 4\) float64, got \(4, 8\)"),
                       (np.ones((8, 4), np.complex128), "got .8, 4. complex128"),
                       (np.full((8, 4), 2**70), "u"), ("nope", "no stored tensor named 'nope'"),
                       # the shape before any cast, named as given (it said float32 after casting a
                       # float64 array it warned of: a trial)
                       (np.ones((3, 4), np.int16), r"the graph wants \(8, 4\) float64, got \(3, 4\) int16")]:
        for run in (lambda: plan.run(db, **{**xs, "u": bad}), lambda: g.run(db, outputs=y, **{**xs, "u": bad})):
            with pytest.raises(EinsumError, match=match):
                run()
    np.testing.assert_allclose(g.run(db, outputs=y, **{**xs, "u": np.arange(32).reshape(8, 4)}).to_numpy(),
                               np.maximum(xs["x"] @ xs["w"], 0))  # ints cast as a read input's would be


def test_the_return_type_follows_how_outputs_were_given(db):
    g, h, y = _dead_end_graph()
    xs = random_inputs(g, 5)
    want = {"h": xs["x"] @ xs["w"], "y": np.maximum(xs["x"] @ xs["w"], 0), "z": np.sum(xs["x"] * xs["u"])}
    for outputs in (y, "y", h, "z"):
        out = g.plan(outputs=outputs).run(db, **xs)
        name = outputs if isinstance(outputs, str) else outputs.name
        assert isinstance(out, eds.Tensor)
        np.testing.assert_allclose(out.to_numpy(), want[name])
    for outputs in ([y], ("z",), [h, y], ["z", y, h]):
        outs = g.plan(outputs=outputs).run(db, **xs)
        names = [x if isinstance(x, str) else x.name for x in outputs]
        assert isinstance(outs, dict) and list(outs) == names
        for name in names:  # h is both an output and read by y
            np.testing.assert_allclose(outs[name].to_numpy(), want[name])
    with pytest.raises(EinsumError, match="pass out as a dict"):
        g.plan(outputs=[h, y]).run(db, out="both", **xs)


def test_bad_outputs_are_refused():
    g, h, y = _dead_end_graph()
    other = Graph()
    stranger = other.map("exp", other.input("x", (2,)))
    cases = [
        (stranger, "belongs to another graph"),
        ("nope", "expected a value of this graph, got 'nope'"),
        (["y", "nope"], r"outputs\[1\]: expected a value of this graph"),
        ("x", "'x' is a graph input, not computed by any node"),
        (3, "expected a value of this graph .* got int 3"),
        ({"y"}, "got set"),
        ([], "name at least one value"),
        ([y, "y"], r"outputs\[1\]: 'y' is given twice"),
    ]
    for outputs, message in cases:
        with pytest.raises(EinsumError, match=message):
            g.plan(outputs=outputs)
    with pytest.raises(EinsumError, match="no nodes"):
        Graph().plan()


def test_identical_plans_are_cached():
    g, _ = attention(s=64, d=32, h=4, e=8)
    p = g.plan(workers=2)
    assert g.plan(workers=2) is p
    twin, _ = attention(s=64, d=32, h=4, e=8)  # a plan depends on the nodes, not on the Graph object
    assert twin.plan(workers=2) is p
    different = [g.plan(workers=4), g.plan(workers=2, memory="1GB"), g.plan(workers=2, strategy="square-tiles"),
                 g.plan(workers=2, outputs=[g.nodes[-1].result.name]), g.plan(workers=2, outputs="v4")]
    assert all(q is not p for q in different) and len({id(q) for q in different}) == len(different)
    p.pieces["v1"]["h"] = 99  # a caller's edit of what it was handed does not reach the shared plan
    assert g.plan(workers=2).pieces["v1"]["h"] != 99
    g.map("relu", g.nodes[-1].result.name)  # a new last node: a new plan
    assert g.plan(workers=2) is not p


def test_callable_joins_are_cached_by_identity():
    def graph(fn):
        g = Graph()
        g.map(fn, g.input("x", (4, 4)))
        return g

    def double(x):
        return 2 * x

    assert graph(double).plan() is graph(double).plan()
    # equal source, different callables: the plan cannot know they are the same function
    assert graph(lambda x: x + 1).plan() is not graph(lambda x: x + 1).plan()


def test_attention_plan_structure():
    # the benchmark's attention graph: 8 heads, 1024 positions
    g, _ = attention(s=1024, d=512, h=8, e=64, dtype="float32")
    p = g.plan(workers=4)
    assert len(p.nodes) == 11
    unfused = g.plan(workers=4, fuse=False)
    assert len([s for s in unfused.plan.steps if isinstance(s, EinsumStep)]) == 11 and not unfused.fused
    einsums = [s for s in p.plan.steps if isinstance(s, EinsumStep)]
    # the scale runs in the scores' kernel, the division by the softmax sum in the kernel of
    # the product with v: two statements fewer, two intermediates never stored
    assert len(einsums) == 9 and p.retiles <= 1
    assert p.fused == {"v4": "v5", "v9": "v10"}
    # head-parallel: every projection, score, softmax and value node cuts the heads 4 ways
    # and nothing else, so no step groups partial results and the softmax never re-tiles
    for n in p.nodes[:-1]:
        assert p.pieces[n.result.name] == {lab: 4 if lab == "h" else 1 for lab in n.labels}, n.describe()
    assert not any(s.grouped for s in einsums[:-1])
    assert all(p.cost <= c.total for c in p.baselines.values())
    assert p.cost < unfused.cost  # the fused-away intermediates are no longer read


def test_explain_and_dot():
    g, _ = attention()
    p = g.plan(workers=4, memory="1GB")
    text = p.explain()
    n = p.nodes[0]
    chosen = "pieces " + " ".join(f"{lab}:{p.pieces[n.result.name][lab]}" for lab in n.labels)
    for word in ("data-parallel", "model-parallel", "square-tiles", chosen, "SELECT", "peak memory"):
        assert word in text
    # the user's own labels, the join only when it is not mul, the aggregation only when the
    # node reduces something and it is not sum
    for node in ("sd,dhe->hse", "hse,hte->hst", "hst->hs agg=max", "hst,hs->hst join=expr(exp(x - y))",
                 "hst->hs ", "hst,hs->hst join=div", "hse,hed->sd"):
        assert node in text, node
    assert "join=mul" not in text and "agg=sum" not in text and "abc" not in text
    # the cost is in cost units, apart from the peak memory in bytes
    assert re.search(r"^cost [\d,]+ cost units = join [\d.]+ \w?B", text, re.M)
    assert re.search(r"^peak memory [\d.]+ \w?B", text, re.M)
    assert " MB from join" not in text
    dot = p.to_dot()
    assert dot.startswith("digraph") and "pieces" in dot
    # shapes and bytes on nodes and edges
    assert '"v4" [shape=ellipse, label="v4 = hse,hte->hst\\n(3, 16, 16) float64, 6.1 kB' in dot
    assert '"x" -> "v1" [label="(16, 24) float64, 3.1 kB"]' in dot
    assert 'peripheries=2, label="v11' in dot


def test_node_describe():
    g = Graph()
    x, y = g.input("x", (4, 3)), g.input("y", (3,))
    s = g.einsum("ij,j->ij", x, y)
    g.reduce(s, 1)
    g.reduce(s, 1, agg="max")
    g.map("relu", s)
    g.einsum("ij->i", x, join="exp", agg="prod")
    g.einsum("ij->ij", x, agg="max")  # an aggregation over nothing: not shown
    g.add(y, s)
    # right-aligned: the (4,) value was made as "j" but j is axis 0 of the (3, 4) one: i it is
    g.elementwise("x * y", g.einsum("jk->j", x), g.einsum("ij->ji", s))
    g.map("exp", x)  # an input has no labels of its own
    assert [n.describe() for n in g.nodes] == [
        "ij,j->ij", "ij->i", "ij->i agg=max", "ij->ij join=relu", "ij->i join=exp agg=prod", "ij->ij",
        "j,ij->ij join=add", "jk->j", "ij->ji", "i,ji->ji join=expr(x * y)", "ab->ab join=exp"]


def test_memory_budget_refused_before_running():
    g, _ = ffn(b=256, d=64, f=128)
    with pytest.raises(EinsumError, match="fits the memory budget"):
        g.plan(workers=1, memory=1000)
    # a budget the data-parallel plan breaks but a finer cut fits
    p = g.plan(workers=1, memory="400KB")
    assert p.plan.peak_bytes <= 400_000
    assert max(p.pieces["y"].values()) > 1


def test_graph_errors():
    g = Graph()
    x = g.input("x", (3, 4))
    with pytest.raises(EinsumError, match="label 'j' has size 3 in operand 1"):
        g.einsum("ij,jk->ik", x, x)
    with pytest.raises(EinsumError, match="already has a value"):
        g.input("x", (2,))
    for shape in ("ab", "12", (2.5, 2), (2, "3"), 3, None):
        with pytest.raises(EinsumError, match=r"input 's': shape must be a tuple of ints"):
            g.input("s", shape)
    with pytest.raises(EinsumError, match="unsupported dtype"):
        g.input("y", (2,), "longdouble")
    with pytest.raises(EinsumError, match="another graph"):
        Graph().map("relu", x)
    with pytest.raises(EinsumError, match="unknown strategy"):
        g.map("exp", x)
        g.plan(strategy="magic")
    with pytest.raises(EinsumError, match="missing inputs"):
        g.plan().run(eds.connect())
    with pytest.raises(EinsumError, match="memory budget"):
        g.plan(memory="lots")


def test_inputs_named_like_run_arguments_go_in_a_dict(db):
    g = Graph()
    o, p, w = g.input("out", (3, 2), "float64"), g.input("progress", (2,), "float64"), g.input("w", (3,), "float64")
    y = g.einsum("ij,j,i->i", o, p, w)
    a, b, c = np.arange(6.0).reshape(3, 2), np.array([2.0, -1.0]), np.array([1.0, 2.0, 3.0])
    want = (a @ b) * c
    np.testing.assert_allclose(g.plan(outputs=y).run(db, inputs={"out": a, "progress": b}, w=c).to_numpy(), want)
    np.testing.assert_allclose(g.run(db, inputs={"out": a, "progress": b, "w": c}).to_numpy(), want)
    with pytest.raises(EinsumError, match=r"input\(s\) \['w'\] given both"):
        g.plan(outputs=y).run(db, inputs={"out": a, "progress": b, "w": c}, w=c)


def test_graph_arguments_numpy_users_write_and_bad_ones():
    """Numpy integer axes and axis=None reduce as numpy does; bad sessions, axes and value names
    are EinsumErrors (they were AttributeError, TypeError, KeyError); GraphPlan has run_peak."""
    a = np.random.default_rng(2).standard_normal((3, 4, 5))
    g = eds.Graph()
    x = g.input("x", a.shape, "float64")
    outs = {"i64": g.reduce(x, np.int64(1)), "none": g.reduce(x, None, agg="max"), "pair": g.reduce(x, (0, -1))}
    plan = g.plan(outputs=list(outs.values()))
    assert plan.run_peak() == plan.plan.run_peak() > 0
    with eds.connect() as db:
        got = plan.run(db, x=a)
        np.testing.assert_allclose(got[outs["i64"].name].to_numpy(), a.sum(axis=1))
        np.testing.assert_allclose(got[outs["none"].name].to_numpy(), a.max())
        np.testing.assert_allclose(got[outs["pair"].name].to_numpy(), a.sum(axis=(0, -1)))
    for bad, match in ((1.0, "axis must be an integer"), ("0", "axis must be an integer"),
                       ((1, -2), "duplicate value in axis"), (3, "out of range")):
        with pytest.raises(EinsumError, match=match):
            g.reduce(x, bad)
    with pytest.raises(EinsumError, match="no value named 'nope'"):
        g.value("nope")
    for run in (lambda: plan.run(None, x=a), lambda: plan.run("my.duckdb", x=a), lambda: g.run(None, x=a)):
        with pytest.raises(EinsumError, match="db must be a session from eds.connect"):
            run()


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), dtype=st.sampled_from(NUMPY_DTYPES),
       agg=st.sampled_from(["sum", "max", "min", "prod"]), workers=st.sampled_from([1, 4]), data=st.data())
@settings(max_examples=60, deadline=None)
def test_reduce_gives_numpys_reduction_in_numpys_dtype(shape, dtype, agg, workers, data):
    """``g.reduce`` is ``np.sum`` / ``np.max`` / ``np.min`` / ``np.prod`` over the axes, values
    and dtype: a sum of bools counts them (as einsum it OR-ed them: [True, True] where numpy
    says [2, 3]), a sum of int8 widens to int64 instead of wrapping, every dtype, random shapes
    and axes, the step cut or whole."""
    axes = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=0))))  # () too: a trial
    a = random_array(np.random.default_rng(len(shape) + sum(shape)), shape, dtype)
    if dtype in ("int8", "uint8"):
        a = (a * 60).astype(dtype)  # sums past int8's range: wrapped before
    want = getattr(np, agg)(a, axis=axes)
    g = eds.Graph()
    g.reduce(g.input("x", a.shape, dtype), axes, agg=agg, name="r")
    with eds.connect() as db:
        got = g.plan(workers=workers).run(db, x=a).to_numpy()
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype.kind in "fc":
        tol = {2: 2e-2, 4: 1e-5, 8: 1e-9}[np.finfo(want.dtype).dtype.itemsize]  # by its float precision
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def test_plan_run_refuses_a_plan_over_the_sessions_budget():
    """A plan made without a budget ran on a session opened with ``memory=`` below its peak
    (a trial: 201 MB projected, ``memory="150MB"``, max RSS +118 MB); the README says such a
    plan is refused before it runs. Planned for the session, or by ``g.run``, it runs."""
    n = 1024
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    g = eds.Graph()
    g.einsum("ij,jk->ik", g.input("a", (n, n), "float64"), g.input("b", (n, n), "float64"), name="c")
    free = g.plan()
    with eds.connect(memory="24MB") as db:
        assert free.plan.peak_bytes > db.memory
        with pytest.raises(EinsumError, match=r"plan.run: step 0 .* over the memory budget .* memory=24\.0 MB\); .*g.plan\(m"):
            free.run(db, a=a, b=b, out="c")
        assert "c" not in db.tensors()
        np.testing.assert_allclose(g.plan(memory=db.memory).run(db, a=a, b=b).to_numpy(), a @ b)
        np.testing.assert_allclose(g.run(db, a=a, b=b).to_numpy(), a @ b)


def test_a_plan_made_with_the_sessions_memory_runs_within_its_plans_share():
    """g.plan(memory=M) planned every step under the whole of M, and plan.run checked against
    the whole of M, so on connect(memory=M) a plan projecting 298 MB ran under 300 MB and rose
    494-587 MB (a budget trial). It now means what connect(memory=M) means: its steps within
    the plans' share (db.plan_budget), which run checks; a plan over that share is refused."""
    n = 512
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    g = eds.Graph()
    g.einsum("ij,jk->ik", g.input("a", (n, n), "float64"), g.input("b", (n, n), "float64"), name="c")
    with eds.connect(memory="6MB") as db:
        p = g.plan(memory="6MB")
        assert p.budget == db.plan_budget
        assert max(s.peak(p.plan.model) for s in p.plan.steps) <= db.plan_budget
        np.testing.assert_allclose(p.run(db, a=a, b=b).to_numpy(), a @ b)
        # planned for the whole of 6 MB (as plan_graph takes a plans' budget): over the share
        from eindecomp_sql.plan.graph_plan import plan_graph

        whole = plan_graph(g, memory=db.memory)
        assert max(s.peak(whole.plan.model) for s in whole.plan.steps) > db.plan_budget
        with pytest.raises(EinsumError, match=r"plans' share of the session's memory=6\.0 MB\); .*g\.plan\(memory=db"):
            whole.run(db, a=a, b=b)


def test_a_graph_plans_refusal_names_the_memory_that_plans_it():
    """g.plan(memory=M) plans under the plans' share of M; its refusal named the share ("the
    memory budget of 12.0 kB" for memory="20kB") and a peak that M would not give (a review):
    it names the memory= that plans it, and that memory= does."""
    import re

    g = eds.Graph()
    x, w1, w2 = g.input("x", (256, 128)), g.input("w1", (128, 512)), g.input("w2", (512, 128))
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    with pytest.raises(EinsumError, match=r"this memory=20\.0 kB gives plans 60% of it \(12\.0 kB\); this needs "
                                          r"memory= of at least") as info:
        g.plan(memory="20kB")
    need = re.search(r"needs memory= of at least (\S+ [kMG]?B)", str(info.value)).group(1).replace(" ", "")
    assert g.plan(memory=need).plan.steps
    assert "plans' memory budget 1.2 MB" in g.plan(memory="2MB").explain(sql=False)


def test_a_value_two_nodes_read_cut_alike_is_retiled_once():
    """square-tiles re-tiled h for relu(h) and again for the product that reads h: a statement
    and its bytes twice, and a baseline's cost inflated in explain()."""
    g = Graph()
    x, w = g.input("x", (37, 53), "float64"), g.input("w", (53, 29), "float64")
    h = g.einsum("ij,jk->ik", x, w)
    t = g.einsum("ik,ik->i", g.map("relu", h), h)
    p = g.plan(workers=4, fuse=False, strategy="square-tiles", outputs=[t])
    retiles = [s for s in p.plan.steps if isinstance(s, RetileStep)]
    assert len({(s.source.name, s.target.tile) for s in retiles}) == len(retiles) == 1, p.explain(sql=False)
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((37, 53)), rng.standard_normal((53, 29))
    with eds.connect() as db:
        hh = a @ b
        np.testing.assert_allclose(p.run(db, x=a, w=b)[t.name].to_numpy(), (np.maximum(hh, 0) * hh).sum(axis=1))


def test_a_graph_run_keeps_the_tiles_it_makes_under_tile_bytes():
    """Graph.run (and jobs) took a baseline's chunking after fusion without looking at the
    session's tile cap: a 2048² float32 GEMM under tile_bytes=4 MiB made 16 MB tiles (a new
    user's report). Every tile the plan creates stays under the cap."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    with eds.connect(tile_bytes=4 << 20) as db:
        A = db.store("a", a)
        g = eds.Graph()
        x = g.input("a", (2048, 2048), dtype="float32")
        g.einsum("ij,jk->ik", x, x)
        r = g.run(db, a=A)
        assert np.prod(r.tile) * 4 <= 4 << 20
        np.testing.assert_allclose(r.to_numpy(), a @ a, rtol=1e-3, atol=1e-2)


def test_explain_says_which_inputs_each_whole_run_peak_assumes():
    """The header's "whole run" counted the inputs as arrays read in place (138 kB) beside the
    largest step's peak with them stored (2.8 MB), and the plan's own line said 2.8 MB: read
    together, two whole-run figures for one plan (a trial). Each is now said with its
    assumption, and the stored one is the plan line's."""
    g = eds.Graph()
    x, w1, w2 = g.input("x", (96, 40), "float64"), g.input("w1", (40, 200), "float64"), g.input("w2", (200, 40), "float64")
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    p = g.plan(workers=16)
    text = p.explain()
    stored, arrays = p.plan.run_peak(), p.plan.run_peak(arrays=[v.name for v in p.plan.inputs])
    assert arrays < stored
    from eindecomp_sql.plan.steps import format_bytes

    assert (f"whole run {format_bytes(stored)} with the inputs stored, {format_bytes(arrays)} with them passed as "
            "arrays (read in place)") in text
    assert f"(largest step; whole run {format_bytes(stored)})" in text


def test_graph_inputs_are_cast_only_where_no_value_changes_past_digits():
    """Integers go to any integer dtype their values fit (np.arange's int64 into a uint8 input
    was refused) and are refused where one does not (300 into int8 became 44, uint64 2**63
    into int64 -2**63, in silence: a trial); floats narrow as numpy casts them; floats into
    integers stay refused."""
    def run(dtype, a):
        g = eds.Graph()
        g.map("identity", g.input("x", a.shape, dtype), name="y")
        with eds.connect() as db:
            return g.plan().run(db, x=a).to_numpy()

    np.testing.assert_array_equal(run("uint8", np.arange(5)), np.arange(5, dtype=np.uint8))
    np.testing.assert_array_equal(run("int8", np.array([-128, 127], np.int64)), np.array([-128, 127], np.int8))
    np.testing.assert_array_equal(run("int16", np.array([True, False])), np.array([1, 0], np.int16))
    assert run("float32", np.array([0.1, 2.5])).dtype == np.float32
    for dtype, a, match in (("int8", np.array([1, 300]), r"values 1..300 do not fit the graph's int8 \(-128..127\)"),
                            ("int64", np.array([2**63], np.uint64), "do not fit the graph's int64"),
                            ("uint8", np.array([-1, 3]), r"values -1..3 do not fit the graph's uint8"),
                            ("int8", np.array([1.0]), "the graph wants .* int8, got .* float64")):
        with pytest.raises(EinsumError, match=match):
            run(dtype, a)


@pytest.mark.parametrize("declared", [None, "float32"])
def test_a_wider_array_into_an_input_declared_without_a_dtype_warns_at_the_callers_line(declared):
    """float64 data bound to ``g.input("x", shape)`` was computed in float32 without a word (a
    numpy user's arrays are float64 unless asked): where the input's dtype was not declared, a
    cast that loses digits warns, pointing at the user's line and naming the dtype to declare.
    Declared, or cast losslessly (int8 into float32), it does not; a cached plan of an equal
    graph does not carry the other graph's choice."""
    def graph(dtype):
        g = eds.Graph()
        g.einsum("ij,jk->ik", g.input("x", (3, 4), dtype), g.input("w", (4, 2), dtype))
        return g

    rng = np.random.default_rng(1)
    a, w = random_array(rng, (3, 4), "float64"), random_array(rng, (4, 2), "float32")
    with eds.connect() as db:
        for _ in range(2):  # the second plan comes from the cache the first filled
            g = graph(declared)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = g.plan().run(db, x=a, w=w)
                g.run(db, x=a.astype(np.int8), w=w)
            np.testing.assert_allclose(out.to_numpy(), a.astype(np.float32) @ w, rtol=1e-6)
            if declared is None:
                assert len(seen) == 1, [str(m.message) for m in seen]
                assert seen[0].filename == __file__
                assert re.search(r"input 'x': the float64 array is cast to float32.*declare "
                                 r"g.input\('x', \(3, 4\), dtype='float64'\)", str(seen[0].message))
            else:
                assert not seen, [str(m.message) for m in seen]
            graph(None if declared else "float32").plan()  # fills the cache for the other kind
    # an input the plan does not read is checked (and cast) too: its flag is the graph's own
    for first, then in ((None, "float32"), ("float32", None)):
        for dtype in (first, then):
            g = eds.Graph()
            g.einsum("ij->i", g.input("x", (3, 4), dtype))
            g.input("z", (2,), dtype)
            with eds.connect() as db, warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                g.plan().run(db, x=a.astype(np.float32), z=np.arange(2.0))
            assert len(seen) == (dtype is None), (first, then, [str(m.message) for m in seen])


def test_out_names_tables_by_graph_value_or_as_a_list(db):
    """outputs= takes GraphValues, so out= does too (it said "out names unknown outputs
    [GraphValue('v1', ...)]; the outputs are ['v1', ...]"), and a list names one table per
    output in the plan's order (a trial)."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((5, 4)), rng.standard_normal((4, 3))
    g = Graph()
    p, q = g.input("p", a.shape, dtype="float64"), g.input("q", b.shape, dtype="float64")
    s = g.einsum("ij,jk->ik", p, q)
    t = g.einsum("ij->ji", s)
    got = g.run(db, outputs=[s, t], out={s: "GS", t: "GT"}, replace=True, p=a, q=b)
    np.testing.assert_allclose(db.tensor("GS").to_numpy(), a @ b, rtol=1e-12)
    np.testing.assert_allclose(got[t.name].to_numpy(), (a @ b).T, rtol=1e-12)
    g.run(db, outputs=[s, t], out=["GS2", "GT2"], replace=True, p=a, q=b)
    np.testing.assert_allclose(db.tensor("GT2").to_numpy(), (a @ b).T, rtol=1e-12)
    with pytest.raises(EinsumError, match=r"out names 1 table\(s\) for the plan's 2 outputs"):
        g.run(db, outputs=[s, t], out=["GS3"], p=a, q=b)


def test_a_refused_graph_says_the_memory_under_which_every_node_plans():
    """The memory= a refusal named was its first node's need: at that figure the graph's next
    node was refused with a bigger one (a trial: 1MB -> "1.1 MB" -> "1.5 MB"). It is now every
    node's, and the graph plans there."""
    import re

    g = eds.Graph()
    x, w1, w2 = g.input("x", (256, 128)), g.input("w1", (128, 512)), g.input("w2", (512, 128))
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    with pytest.raises(EinsumError, match="needs memory= of at least") as info:
        g.run(eds.connect(memory="20kB"), x=np.ones((256, 128), np.float32), w1=np.ones((128, 512), np.float32),
              w2=np.ones((512, 128), np.float32))
    need = re.search(r"needs memory= of at least (\S+ [kMG]?B)", str(info.value)).group(1).replace(" ", "")
    with eds.connect(memory=need) as db:
        assert g.plan(memory=db.memory).plan.steps


def test_a_plan_made_under_memory_projects_its_whole_run_with_duckdbs_share_capped():
    """g.plan(memory=M)'s explain() and run_peak() cap what DuckDB holds as a session of M caps
    it (its memory_limit: it evicts and spills), as db.explain does: uncapped, a softmax graph
    under 200MB projected a whole run of 1.17 GB and rose 198 MB (a budget trial)."""
    from eindecomp_sql.plan.cost import parse_memory
    from eindecomp_sql.plan.steps import format_bytes

    g = eds.Graph()
    n, d = 8192, 256
    q, k, v = (g.input(x, (n, d)) for x in "qkv")
    s = g.map("x * 0.0625", g.einsum("id,jd->ij", q, k))
    e = g.map("exp", g.einsum("ij,i->ij", s, g.reduce(s, 1, "max"), join="sub"))
    y = g.einsum("ij,jd->id", g.einsum("ij,i->ij", e, g.reduce(e, 1, "sum"), join="div"), v, name="y")
    p = g.plan(memory="200MB", outputs=y)
    assert p.plan.run_peak() > 4 * parse_memory("200MB")  # every value held to the end, uncapped
    assert p.plan.peak_bytes <= p.run_peak() <= parse_memory("200MB")
    assert p.run_peak() == p.plan.run_peak(engine_limit=p.engine_limit)
    text = p.explain(sql=False)
    assert f"whole run {format_bytes(p.run_peak())} with the inputs stored" in text
    assert f"(largest step; whole run {format_bytes(p.run_peak())})" in text
    assert g.plan(outputs=y).engine_limit is None  # no budget: nothing caps it
