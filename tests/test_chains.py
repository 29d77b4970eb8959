"""Fused chains (plan/passes/chains.py): a contraction feeding another through element-wise
nodes runs inside the consumer's step, its tile computed in the kernel; checked against numpy
on random shapes, dtypes, joins and aggregations, and on every engine's kernels."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql.errors import EinsumError
from eindecomp_sql.graph import Graph
from eindecomp_sql.plan import EinsumStep, ProgramStep
from eindecomp_sql.plan import graph_plan
from eindecomp_sql.plan.graph_plan import plan_graph
from eindecomp_sql.plan.passes.chains import find_chains
from eindecomp_sql.plan.kernel_spec import KernelFusion, KernelJoin, KernelStage, from_json

DTYPES = ("float64", "float32", "float16", "bfloat16", "int64")


@pytest.fixture
def chains(monkeypatch):
    """Set how graphs plan chains ("always": wherever one fits; "never"; "auto")."""
    def set_mode(mode):
        graph_plan._plan_cached.cache_clear()
        monkeypatch.setattr(graph_plan, "CHAINS", mode)
    yield set_mode
    graph_plan._plan_cached.cache_clear()


def chain_steps(plan) -> list[EinsumStep]:
    steps = [s for p in plan.steps for s in (p.steps if isinstance(p, ProgramStep) else (p,))]
    return [s for s in steps if isinstance(s, EinsumStep) and s.node.held]


def random_operands(g, dtype: str, seed: int) -> dict:
    """Random inputs of ``g`` in ``dtype`` (small integers for int64: no overflow)."""
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return {v.name: rng.integers(-3, 4, v.shape) for v in g.inputs}
    return {v.name: (rng.standard_normal(v.shape) / 2).astype(dtype) for v in g.inputs}


def assert_matches(got, want, dtype: str, terms: int) -> None:
    """A chain's result against the float64 reference: exact for int64, else within the
    dtype's tolerance on the result's scale (``terms``: how many rounded terms a value sums)."""
    assert got.dtype == np.dtype(dtype) and got.shape == want.shape
    if dtype == "int64":
        np.testing.assert_array_equal(got, want.astype(np.int64))
    else:
        tol = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}[dtype]
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * scale * terms)


def _graph(b, d, f, dtype, maps, transpose, p_agg, c_agg, p_join):
    """relu-like maps between two products; the reference computes each node as numpy would
    and stores it in ``dtype`` as an unfused step does."""
    g = Graph()
    x, w1, w2 = g.input("x", (b, d), dtype), g.input("w1", (d, f), dtype), g.input("w2", (f, d), dtype)
    h = g.einsum("bi,io->bo", x, w1, join=p_join, agg=p_agg)
    for m in maps:
        h = g.map(m, h)
    if transpose:
        h = g.einsum("bo->ob", h, join="neg")
        g.einsum("ob,oi->bi", h, w2, agg=c_agg, name="y")
    else:
        g.einsum("bo,oi->bi", h, w2, agg=c_agg, name="y")

    def ref(x, w1, w2):
        x, w1, w2 = (a.astype(np.float64) for a in (x, w1, w2))
        pair = (x[:, :, None] * w1[None]) if p_join == "mul" else (x[:, :, None] + w1[None])
        h = pair.sum(1) if p_agg == "sum" else pair.max(1)
        for m in maps:
            h = np.maximum(h, 0) if m == "relu" else np.abs(h) if m == "abs" else h * h
        if transpose:
            h = -h
        pair = h[:, :, None] * w2[None]
        return pair.sum(1) if c_agg == "sum" else pair.max(1)

    return g, ref


@given(b=st.integers(1, 23), d=st.integers(1, 9), f=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       maps=st.lists(st.sampled_from(["relu", "abs", "square"]), min_size=1, max_size=2), transpose=st.booleans(),
       p_agg=st.sampled_from(["sum", "max"]), c_agg=st.sampled_from(["sum", "max"]),
       p_join=st.sampled_from(["mul", "add"]), budget=st.sampled_from([None, 16 << 10, 48 << 10]),
       tile=st.sampled_from([None, 256, 1024]), workers=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_a_fused_chain_matches_numpy(db, chains, b, d, f, dtype, maps, transpose, p_agg, c_agg, p_join, budget,
                                     tile, workers, seed):
    """Random shapes that do not divide the tiles, every dtype, extended joins and
    aggregations in both products, maps and a transpose between, cut by a budget or a tile
    cap (the hidden label in pieces: a grouped step whose members each compute a tile of the
    first product) or by workers."""
    chains("always")
    g, ref = _graph(b, d, f, dtype, maps, transpose, p_agg, c_agg, p_join)
    xs = random_operands(g, dtype, seed)
    try:
        p = plan_graph(g, workers=workers, memory=budget, tile_bytes=tile)
    except EinsumError as e:  # the budget or the cap refuses every plan, chained or not
        assert "memory budget" in str(e) or "tile_bytes" in str(e)
        event("over the budget")
        return
    fused = chain_steps(p.plan)
    event(f"chain fused: {bool(fused)}; pieces {sorted(fused[0].pieces.items()) if fused else None}")
    for s in fused:  # what the kernel computes whole is never cut
        assert all(s.pieces[lab] == 1 for lab in s.node.whole)
    assert_matches(p.run(db, **xs).to_numpy(), ref(**xs), dtype, terms=max(d, f))


def test_the_ffn_under_a_tile_cap_runs_as_one_step_and_explain_says_so(chains):
    """The GPU issue's FFN under half its working set (a bfloat16 8192 x 8192 x 28672, tiles
    capped at a sixteenth of it): before, 4 steps (the product, a re-tile of its 470 MB
    result, the relu, a grouped product); fused, one step over pieces of the hidden label,
    the hidden values never stored (planned only: no data)."""
    chains("auto")
    b, d, f = 8192, 8192, 28672
    g = Graph()
    x, w1, w2 = g.input("x", (b, d), "bfloat16"), g.input("w1", (d, f), "bfloat16"), g.input("w2", (f, d), "bfloat16")
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2, name="y")
    p = plan_graph(g, tile_bytes=64 << 20)
    assert len(p.plan.steps) == 1 and p.retiles == 0
    step = p.plan.steps[0]
    assert step.node.whole == ("j", "i") and step.pieces["o"] > 1 and step.pieces["j"] == step.pieces["i"] == 1
    assert p.fused == {"v1": "y", "v2": "y"}
    text = p.explain()
    assert "3 node(s), 1 step(s), 0 retile(s), 2 node(s) fused into others' steps" in text
    assert re.search(r"step 0: einsum v1 = bj,jo->bo; v2 = relu; bo,oi->bi \[b:\d+ j:1 o:\d+ i:1\] -> y "
                     r"\[fused v1, v2; v1, v2 not stored\]", text)
    assert "pieces b:" in text and text.count("fused: runs in the step computing y, not stored") == 2
    # the kernel computes the first product as a contraction stage (its agg), then the relu
    spec = json.loads(re.search(r"'(\{.*\})'", text.split("-- step 0")[1]).group(1))
    pro = spec["fused"]["pro"]
    assert [st.get("agg") for st in pro] == ["sum", None] and spec["reduced"] == ["j", "o"]
    assert '"v1" -> "v2"' in p.to_dot()
    chains("never")
    unfused = plan_graph(g, tile_bytes=64 << 20)
    assert len(unfused.plan.steps) == 4 and unfused.retiles == 1  # what it replaced


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "int64"])
def test_an_operand_alike_in_every_member_is_gathered_once_per_group(db, chains, dtype):
    """The capped FFN's step groups by (b, i) over the pieces of o; x (labels b and the whole
    j) is the same tile in every member of a group, so the SQL hands it once per group
    (``eds_einsum_group2s``, ``ANY_VALUE``), not in each member's struct, and with b in pieces
    each group's x is its own (a kernel reading another group's x fails this). Inputs stored in
    the plan's tiles and as arrays."""
    chains("always")
    b, d, f = 12, 4, 30
    g = Graph()
    x, w1, w2 = g.input("x", (b, d), dtype), g.input("w1", (d, f), dtype), g.input("w2", (f, d), dtype)
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2, name="y")
    p = plan_graph(g, tile_bytes=25 * (2 if dtype == "bfloat16" else 8))
    (step,) = p.plan.steps
    assert step.pieces["b"] > 1 and step.pieces["o"] > 1 and step.grouped
    with eds.connect() as s:
        sql = s.backend.compiler.sql_listing(p.plan)
    assert "EDS_EINSUM_GROUP2S(" in sql and '[ANY_VALUE("t0")]' in sql and "'t0': \"t1\", 't1': \"t2\"" in sql
    xs = random_operands(g, dtype, 5)
    want = np.maximum(xs["x"].astype(np.float64) @ xs["w1"].astype(np.float64), 0)
    if dtype == "bfloat16":  # the unfused step stores the hidden value in the dtype
        want = want.astype(dtype).astype(np.float64)
    # stored, so the tiles come through the SQL (arrays' tiles are read in place, by key)
    stored = {k: db.store(f"shared_{k}", a, tile=p.plan_input_tile(k), replace=True) for k, a in xs.items()}
    assert_matches(p.run(db, **stored).to_numpy(), want @ xs["w2"].astype(np.float64), dtype, terms=f)
    assert_matches(p.run(db, **xs).to_numpy(), want @ xs["w2"].astype(np.float64), dtype, terms=f)


def test_a_chain_is_not_fused_where_it_must_not_be(chains):
    chains("always")
    g = Graph()
    x, w1, w2 = g.input("x", (40, 8)), g.input("w1", (8, 30)), g.input("w2", (30, 8))
    h = g.einsum("bi,io->bo", x, w1)
    a = g.map("relu", h)
    y = g.einsum("bo,oi->bi", a, w2)
    # an intermediate the user keeps is stored
    p = plan_graph(g, outputs=[h, y], memory="64kB")
    assert not chain_steps(p.plan)
    # read twice: by the product and by an add
    g2 = Graph()
    x, w1, w2 = g2.input("x", (40, 8)), g2.input("w1", (8, 30)), g2.input("w2", (30, 8))
    a = g2.map("relu", g2.einsum("bi,io->bo", x, w1))
    g2.einsum("bi,b->bi", g2.einsum("bo,oi->bi", a, w2), g2.einsum("bo->b", a))
    assert not any(s.node.held for s in chain_steps(plan_graph(g2, memory="64kB").plan))
    # a product of products with nothing element-wise between: the optimizer's own paths
    g3 = Graph()
    m = [g3.input(f"m{k}", (30, 30)) for k in range(3)]
    g3.einsum("ij,jk->ik", g3.einsum("ij,jk->ik", m[0], m[1]), m[2])
    assert not chain_steps(plan_graph(g3, memory="64kB").plan)


def test_auto_fuses_only_where_it_costs_no_more(chains):
    """The cost model with what the unchained plan writes (the hidden values, at a join
    byte's weight): a small FFN whose program is one statement anyway keeps the program."""
    chains("auto")
    g = Graph()
    x, w1, w2 = g.input("x", (64, 32)), g.input("w1", (32, 96)), g.input("w2", (96, 32))
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    p = plan_graph(g)
    assert isinstance(p.plan.steps[0], ProgramStep) and len(p.plan.steps) == 1
    # under a budget that cuts it, the chain: one statement per batch instead of two, and the
    # 2 MB of relu(h) never written (bench/RESULTS.md "Fused chains")
    g = Graph()
    x, w1, w2 = g.input("x", (256, 64)), g.input("w1", (64, 2048)), g.input("w2", (2048, 64))
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    assert chain_steps(plan_graph(g, memory="4MB").plan)
    chains("never")
    assert not chain_steps(plan_graph(g, memory="4MB").plan)


def test_kernel_specs_carry_a_contraction_stage():
    st_ = KernelStage(args=(0, 1), join=KernelJoin(name="mul"), labels=("b", "o"), dtype="float32", cast=True,
                      agg="sum")
    assert st_.to_dict()["agg"] == "sum" and KernelStage.from_dict(st_.to_dict()) == st_
    plain = KernelStage(args=(0,), join=KernelJoin(name="relu"), labels=("b", "o"), dtype="float32")
    assert "agg" not in plain.to_dict()  # element-wise stages read as before
    with pytest.raises(EinsumError, match="agg 'mean' is unknown"):
        KernelStage(args=(0,), join=KernelJoin(name="mul"), labels=("b",), dtype="float32", agg="mean")
    with pytest.raises(EinsumError, match="fused stage must be"):
        KernelStage.from_dict({**plain.to_dict(), "extra": 1})
    with pytest.raises(EinsumError, match="epilogues are element-wise"):
        KernelFusion(core=(0, 1), core_labels=("b", "i"), core_dtype="float32", epilogues=(st_,)).check(2)


def test_a_fused_chain_runs_on_the_reference_backend_as_its_nodes(chains):
    """The reference backend runs a fused step as the steps it stands for (``unfused``)."""
    chains("always")
    g, ref = _graph(13, 5, 29, "float64", ["relu"], False, "sum", "sum", "mul")
    rng = np.random.default_rng(3)
    xs = {v.name: rng.standard_normal(v.shape) for v in g.inputs}
    p = g.plan(memory="24kB")
    assert chain_steps(p.plan)
    with eds.connect(backend="reference") as ref_db:
        np.testing.assert_allclose(p.run(ref_db, **xs).to_numpy(), ref(**xs), rtol=1e-10, atol=1e-10)


def test_stored_inputs_are_retiled_for_a_chain(db, chains):
    chains("always")
    g, ref = _graph(30, 6, 50, "float32", ["relu"], False, "sum", "sum", "mul")
    rng = np.random.default_rng(4)
    xs = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in g.inputs}
    stored = {name: db.store(f"chain_{name}", a, tile=(7, 3), replace=True) for name, a in xs.items()}
    p = g.plan(inputs=stored, memory="40kB")
    assert chain_steps(p.plan) and p.retiles >= 1
    out = p.run(db, **stored).to_numpy()
    np.testing.assert_allclose(out, ref(**xs), rtol=1e-4, atol=1e-4)


def test_a_chain_under_a_budget_counts_what_its_kernel_holds(chains):
    """The optimizer prices a fused chain's peak with the hidden tiles its kernel holds
    (``EinsumNode.held``): without them it picked 2048 rows at once, 302 MB against a 252 MB
    budget, and the plan fell back to two steps and a stored intermediate (planned only)."""
    from eindecomp_sql.plan.cost import plan_share

    chains("auto")
    g = Graph()
    x, w1, w2 = g.input("x", (2048, 1024)), g.input("w1", (1024, 8192)), g.input("w2", (8192, 1024))
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    budget = plan_share(400 << 20)
    p = plan_graph(g, memory=budget)
    step, = chain_steps(p.plan)
    assert step.pieces["b"] > 1 and step.peak(p.plan.model) <= budget and p.plan.peak_bytes <= budget
    # the hidden tiles are counted once: by the node, not again as the fused nodes' results
    assert step.peak(p.plan.model) == replace(step, fused=None).peak(p.plan.model)


def test_chains_alike_but_for_their_hidden_values_plan_alike(chains):
    """Two FFN layers, one with more maps between its products (more hidden tiles held): each
    chain's candidates are its own (the optimizer shares candidate lists between nodes alike,
    and held tiles decide which fit), so both layers chain in either order (a reviewer's case:
    the second layer fell back to its unchained steps when it came second)."""
    chains("always")

    def two_ffns(maps_a, maps_b):
        g = Graph()
        v = g.input("x", (512, 64))
        for k, maps in enumerate((maps_a, maps_b)):
            h = g.einsum("bi,io->bo", v, g.input(f"w{k}a", (64, 2048)))
            for m in maps:
                h = g.map(m, h)
            v = g.einsum("bo,oi->bi", h, g.input(f"w{k}b", (2048, 64)))
        return g

    for a, b in ((["relu"], ["relu", "abs", "square"]), (["relu", "abs", "square"], ["relu"])):
        assert len(chain_steps(plan_graph(two_ffns(a, b), memory="4MB").plan)) == 2, (a, b)


def test_a_fused_chains_kernel_threads_never_compute_its_product_twice(chains, monkeypatch):
    """An integer chain (no BLAS: the kernel's work is cut across threads) whose batch tile is
    3 rows: the cut must not fall on a label the first product's tile lacks (i), or each task
    would compute that whole tile again."""
    from eindecomp_sql.udfs import kernels

    chains("always")
    seen = []
    contract = kernels.EinsumKernel.contract

    def spy(self, tiles, out, accumulate):
        seen.append((self.output, out.shape))
        return contract(self, tiles, out, accumulate)

    monkeypatch.setattr(kernels.EinsumKernel, "contract", spy)
    kernels.einsum_kernel.cache_clear()
    rng = np.random.default_rng(0)
    g = Graph()
    x, w1, w2 = g.input("x", (3, 200), "int64"), g.input("w1", (200, 300), "int64"), g.input("w2", (300, 400), "int64")
    g.einsum("bo,oi->bi", g.map("abs", g.einsum("bi,io->bo", x, w1)), w2, join="add", agg="max")
    xs = {v.name: rng.integers(-3, 4, v.shape) for v in g.inputs}
    p = plan_graph(g)
    assert chain_steps(p.plan)
    with eds.connect() as db:
        got = p.run(db, **xs).to_numpy()
    np.testing.assert_array_equal(got, (np.abs(xs["x"] @ xs["w1"])[:, :, None] + xs["w2"][None]).max(1))
    firsts = [shape for labels, shape in seen if labels == ("b", "o")]
    assert sum(shape[0] for shape in firsts) == 3, seen  # each row of the product once in all
    kernels.einsum_kernel.cache_clear()


def test_an_epilogue_fuses_onto_a_chain_and_the_spec_says_version_4(db, chains):
    """A relu after the FFN runs in the chain's step (one statement, three hidden values);
    its kernel spec is version 4, which a reader of versions 1-3 refuses by its version."""
    chains("auto")
    g = Graph()
    x, w1, w2 = g.input("x", (256, 64)), g.input("w1", (64, 2048)), g.input("w2", (2048, 64))
    y = g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
    g.map("relu", y)
    p = plan_graph(g, memory="4MB")
    step, = p.plan.steps
    assert step.node.held and step.fused.epilogues and len(step.node.held) == 3
    assert "(this plan keeps v1, v2, v3 inside its kernels" in p.explain(sql=False)
    spec = json.loads(re.search(r"'(\{.*\})'", p.explain().split("-- step 0")[1]).group(1))
    assert spec["v"] == 4
    with pytest.raises(EinsumError, match="contraction stage needs version 4"):
        from_json(json.dumps({**spec, "v": 2}))
    rng = np.random.default_rng(8)
    xs = {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in g.inputs}
    x64 = {k: v.astype(np.float64) for k, v in xs.items()}
    want = np.maximum(np.maximum(x64["x"] @ x64["w1"], 0) @ x64["w2"], 0)
    # float32 sums of 2048 terms, the result up to ~150: tolerance on the result's scale
    np.testing.assert_allclose(p.run(db, **xs).to_numpy(), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def _branched(b, d, f, dtype, shared, combine, maps, transposed):
    """SwiGLU's shape: two products (of one ``x``, or of two inputs), a map on either branch,
    one element-wise node joining them (the second branch maybe transposed), then a product."""
    g = Graph()
    x1 = g.input("x", (b, d), dtype)
    x2 = x1 if shared else g.input("x2", (b, d), dtype)
    w1, w3, w2 = g.input("w1", (d, f), dtype), g.input("w3", (d, f), dtype), g.input("w2", (f, d), dtype)
    gate = g.einsum("bi,io->bo", x1, w1)
    up = g.einsum("bi,io->ob", x2, w3) if transposed else g.einsum("bi,io->bo", x2, w3)
    for m, branch in maps:
        if branch == 0:
            gate = g.map(m, gate)
        else:
            up = g.map(m, up)
    act = g.einsum(f"bo,{'ob' if transposed else 'bo'}->bo", gate, up, join=combine)
    g.einsum("bo,oi->bi", act, w2, name="y")
    unary = {"relu": lambda h: np.maximum(h, 0), "abs": np.abs, "square": lambda h: h * h}
    joins = {"mul": lambda p, q: p * q, "add": lambda p, q: p + q,
             "x * sigmoid(x) * y": lambda p, q: p / (1 + np.exp(-p)) * q}

    def ref(**xs):
        xs = {k: a.astype(np.float64) for k, a in xs.items()}
        hs = [xs["x"] @ xs["w1"], xs.get("x2", xs["x"]) @ xs["w3"]]
        for m, branch in maps:
            hs[branch] = unary[m](hs[branch])
        return joins[combine](*hs) @ xs["w2"]

    return g, ref


@given(b=st.integers(1, 19), d=st.integers(1, 9), f=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       shared=st.booleans(), combine=st.sampled_from(["mul", "add", "x * sigmoid(x) * y"]),
       maps=st.lists(st.tuples(st.sampled_from(["relu", "abs", "square"]), st.integers(0, 1)), max_size=2),
       transposed=st.booleans(), budget=st.sampled_from([None, 24 << 10, 64 << 10]),
       tile=st.sampled_from([None, 256, 1024]), workers=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_a_chain_through_a_join_of_two_products_matches_numpy(db, chains, b, d, f, dtype, shared, combine, maps,
                                                             transposed, budget, tile, workers, seed):
    """SwiGLU's ``silu(x @ w1) * (x @ w3) @ w2``: the element-wise node between the products
    joins two of them, each maybe mapped or transposed; both are computed in the consumer's
    kernel, and a value both read (``x``) is one operand of the step."""
    if dtype == "int64" and combine != "mul" and combine != "add":
        combine = "mul"  # sigmoid of an integer is a float: not an int64 graph
    chains("always")
    g, ref = _branched(b, d, f, dtype, shared, combine, maps, transposed)
    assert len(find_chains(g.nodes, {"y"})[1]) == 1  # the graph is a chain, whatever the plan
    xs = random_operands(g, dtype, seed)
    try:
        p = plan_graph(g, workers=workers, memory=budget, tile_bytes=tile)
    except EinsumError as e:
        assert "memory budget" in str(e) or "tile_bytes" in str(e)
        event("over the budget")
        return
    fused = chain_steps(p.plan)
    event(f"chain fused: {bool(fused)}")
    for s in fused:
        assert all(s.pieces[lab] == 1 for lab in s.node.whole)
        assert len(s.fused.prologues) >= 3 and sum(n.reduced != () for n in s.fused.prologues) == 2
        values = [op.value for op in s.node.operands]
        assert len(values) == len(set(values))  # x, read by both products, joined once
    assert_matches(p.run(db, **xs).to_numpy(), ref(**xs), dtype, terms=max(d, f) ** 2)


def test_swiglu_runs_as_one_step_and_reads_x_once(chains):
    """A LLaMA FFN (bfloat16 8192 x 8192 x 28672) under a 64 MiB tile cap: 6 steps unchained
    (both halves, two re-tiles of their 470 MB results, the join, the product); chained, one
    step computing both halves and their join in its kernel (planned only), ``x`` one operand
    with one reduced label for both."""
    chains("auto")
    s, d, f = 8192, 8192, 28672
    g = Graph()
    x = g.input("x", (s, d), "bfloat16")
    w1, w3, w2 = (g.input(n, shape, "bfloat16") for n, shape in (("w1", (d, f)), ("w3", (d, f)), ("w2", (f, d))))
    act = g.elementwise("x * sigmoid(x) * y", g.einsum("sd,df->sf", x, w1), g.einsum("sd,df->sf", x, w3))
    g.einsum("sf,fd->sd", act, w2, name="y")
    p = plan_graph(g, tile_bytes=64 << 20)
    step, = chain_steps(p.plan)
    assert [op.value for op in step.node.operands] == ["x", "w1", "w3", "w2"]
    assert step.node.operands[0].labels == ("s", "j") and step.node.whole == ("j", "d")
    assert p.fused == {"v1": "y", "v2": "y", "v3": "y"} and len(p.plan.steps) == 1
    assert "v1 = sj,jf->sf; v2 = sj,jf->sf; v3 = sf,sf->sf" in p.explain(sql=False)
    chains("never")
    unchained = plan_graph(g, tile_bytes=64 << 20)
    assert len(unchained.plan.steps) == 6 and unchained.retiles == 2
