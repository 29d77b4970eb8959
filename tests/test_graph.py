"""Graphs of extended einsums: workloads against numpy, plan structure, EXPLAIN, errors."""

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.graph import Graph
from eindecomp_sql.plan import RetileStep
from graphs import attention, chain, ffn, llama_block, random_inputs

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
    p = g.plan(workers=2)
    db.store("ffn_x", xs["x"], tile=(7, 5), replace=True)
    out = p.run(db, x="ffn_x", w1=xs["w1"], w2=db.store("ffn_w2", xs["w2"], tile=(3, 3), replace=True))
    np.testing.assert_allclose(out.to_numpy(), ref(**xs), rtol=1e-9, atol=1e-12)


def test_named_outputs_and_several_outputs(db):
    g = Graph()
    x = g.input("x", (6, 4), "float64")
    g.reduce(x, 1, agg="max", name="rowmax")
    g.reduce(x, 0, agg="min", name="colmin")
    a = np.random.default_rng(0).standard_normal((6, 4))
    outs = g.plan().run(db, x=a, out={"rowmax": "gr_rowmax"}, replace=True)
    np.testing.assert_array_equal(outs["rowmax"].to_numpy(), a.max(1))
    np.testing.assert_array_equal(outs["colmin"].to_numpy(), a.min(0))
    assert "gr_rowmax" in db.tensors()


def test_explain_and_dot():
    g, _ = ffn()
    p = g.plan(workers=4, memory="1GB")
    text = p.explain()
    n = p.nodes[0]
    chosen = "pieces " + " ".join(f"{lab}:{p.pieces[n.result.name][lab]}" for lab in n.labels)
    for word in ("data-parallel", "model-parallel", "square-tiles", chosen, "SELECT", "peak"):
        assert word in text
    dot = p.to_dot()
    assert dot.startswith("digraph") and '"x" -> "v1"' in dot and "pieces" in dot


def test_memory_budget_refused_before_running():
    g, _ = ffn(b=256, d=64, f=128)
    with pytest.raises(EinsumError, match="fits the memory budget"):
        g.plan(workers=1, memory=1000)
    # a budget the data-parallel plan breaks but a finer cut fits
    p = g.plan(workers=1, memory="200KB")
    assert p.plan.peak_bytes <= 200_000
    assert max(p.pieces["y"].values()) > 1


def test_graph_errors():
    g = Graph()
    x = g.input("x", (3, 4))
    with pytest.raises(EinsumError, match="label 'j' has size 3 in operand 1"):
        g.einsum("ij,jk->ik", x, x)
    with pytest.raises(EinsumError, match="already has a value"):
        g.input("x", (2,))
    with pytest.raises(EinsumError, match="unsupported dtype"):
        g.input("y", (2,), "float16")
    with pytest.raises(EinsumError, match="another graph"):
        Graph().map("relu", x)
    with pytest.raises(EinsumError, match="unknown strategy"):
        g.map("exp", x)
        g.plan(strategy="magic")
    with pytest.raises(EinsumError, match="missing inputs"):
        g.plan().run(eds.connect())
    with pytest.raises(EinsumError, match="memory budget"):
        g.plan(memory="lots")
