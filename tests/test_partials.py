"""Two-step reductions (plan/partials.py): a grouped step over the memory budget runs as partial
results and a combine step. Checked against numpy on every backend with the split forced
wherever a step is grouped (random specs, tiles that do not divide, every dtype, every join and
aggregation), and under real budgets where the grouped step cannot fit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql.plan import EinsumStep, partials
from eindecomp_sql.plan.cost import BUDGET_SHARE
from helpers import DTYPES, assert_close, einsum_case, error_scale, random_array
from reference import reference


@pytest.fixture(scope="module")
def split_db(backend):
    """A session with a budget nothing here comes near and tiles of at most 32 bytes (so that
    reduced labels are cut); with ``forced``, every grouped step that can be split is split."""
    s = eds.connect(backend=backend, memory="64GB", tile_bytes=32)  # small tiles: steps are grouped
    yield s
    s.close()


@pytest.fixture
def forced(monkeypatch):
    """``partials.splits`` asks only that the step can be split, for this test alone (a
    module-scoped patch stayed on for the real-budget tests after it: a review)."""
    monkeypatch.setattr(partials, "splits", lambda node, pieces, dtypes, budget, model, *more:
                        budget is not None and partials.can_split(node, pieces, model))
    _forget_plans()  # plans are cached: none made before (or, after, with) the forced split
    yield
    _forget_plans()


def _forget_plans():
    from eindecomp_sql.plan import einsum, graph_plan

    einsum._plan.cache_clear()
    graph_plan._plan_cached.cache_clear()


def _split_steps(plan) -> list[EinsumStep]:
    return [s for s in plan.steps if isinstance(s, EinsumStep) and s.node.kept]


def _check_split(plan) -> None:
    """Every unfused grouped step of ``plan`` was split: the only grouped steps left combine
    partial results."""
    for s in plan.steps:
        if isinstance(s, EinsumStep) and s.fused is None and not s.node.held and s.grouped:
            assert s.inputs[0].name.startswith("_eds_partial"), s.describe()


@given(einsum_case(max_operands=3, max_size=6))
def test_split_reductions_match_numpy(split_db, forced, case):
    spec, shapes, dtypes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = reference(spec, *arrays)
    stored = [split_db.store(f"p{k}", a, tile=t, replace=True) for k, (a, t) in enumerate(zip(arrays, tiles))]
    plan = split_db.plan(spec, *stored)
    _check_split(plan)
    got = split_db.einsum(spec, *stored).to_numpy()
    assert_close(got, want, error_scale(spec, arrays))


@given(join=st.sampled_from(["mul", "add", "sub", "max", "min"]), agg=st.sampled_from(["sum", "max", "min", "prod"]),
       spec=st.sampled_from(["ij->", "ij,ij->", "ij,ij->i", "ijk,kj->i", "ij,j->", "bij,bjk->bik", "ij->j"]),
       sizes=st.lists(st.integers(1, 7), min_size=4, max_size=4), tile=st.integers(1, 3),
       dtypes=st.tuples(st.sampled_from(DTYPES), st.sampled_from(DTYPES)), seed=st.integers(0, 2**31))
def test_split_extended_reductions_match_numpy(split_db, forced, join, agg, spec, sizes, tile, dtypes, seed):
    """Partial tiles meet in the node's own aggregation (max, min, prod too), in the dtype a
    group's members combine in (float32 for float16 and bfloat16: rounded once)."""
    rng = np.random.default_rng(seed)
    size = dict(zip("ijkb", sizes))
    ins = spec.split("->")[0].split(",")
    if len(ins) == 1 and join in ("sub",):
        join = "mul"
    arrays = [random_array(rng, tuple(size[c] for c in s), d) for s, d in zip(ins, dtypes)]
    if agg == "prod":  # keep products in range
        arrays = [np.clip(a, -2, 2) if a.dtype != bool else a for a in arrays]
    stored = [split_db.store(f"x{k}", a, tile=tuple(min(tile, d) for d in a.shape), replace=True)
              for k, a in enumerate(arrays)]
    with np.errstate(all="ignore"):
        try:
            want = reference(spec, *arrays, join=join, agg=agg)
        except TypeError:  # numpy refuses (bool - bool): so do we, before anything runs
            with pytest.raises(eds.EinsumError):
                split_db.einsum(spec, *stored, join=join, agg=agg)
            return
        got = split_db.einsum(spec, *stored, join=join, agg=agg).to_numpy()
    assert_close(got, want)


def test_a_forced_split_runs_as_two_steps(split_db, forced):
    a = random_array(np.random.default_rng(1), (9, 7), "float16")
    A = split_db.store("h", a, tile=(4, 3), replace=True)
    plan = split_db.plan("ij->", A)
    (first,) = _split_steps(plan)
    combine = plan.steps[-1]
    # float16 partials are float32 (a group's members combine so), one per piece of the kept labels
    pieces = tuple(first.pieces[lab] for lab in first.node.kept)
    assert first.result.dtype == "float32" and first.result.shape == pieces and max(pieces) > 1
    assert combine.inputs == (first.result,) and combine.result.shape == () and combine.result.dtype == "float16"
    assert "partial over" in first.describe() and first.result.name in plan.explain()
    assert_close(split_db.einsum("ij->", A).to_numpy(), np.einsum("ij->", a))


@pytest.mark.duckdb_only("DuckDB's list() holds a group whole; the budget is DuckDB's")
@pytest.mark.parametrize("spec, shape, tile", [("ij->", (4096, 4096), (256, 256)),
                                               ("ij,ij->", (4096, 4096), (256, 256)),
                                               ("ij->i", (16, 1 << 20), (16, 16384)),
                                               ("ij,ij->i", (4096, 4096), (256, 256))])
def test_a_reduction_over_the_budget_plans_and_runs_within_it(backend, spec, shape, tile):
    """Reductions to a small output over many tiles were refused under a budget below their
    input (their one group holds every tile; a small output has no keys to batch over), or
    re-tiled every operand into row panels first (``ij->i``, ``ij,ij->i``: 6.5x and 2.9x
    slower than split, bench/RESULTS.md): 64 MB of float32 an operand under 40 MB now run as
    partial steps in batches, within the plans' share of the budget."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2,) + shape, dtype=np.float32)
    with eds.connect(memory="40MB") as db:
        ops = [db.store("A", a, tile=tile), db.store("B", b, tile=tile)][: spec.count(",") + 1]
        assert partials.splits.__module__ == partials.__name__  # the real decision, not a test's
        plan = db.plan(spec, *ops)
        (first,) = _split_steps(plan)
        assert first.batches > 1 and plan.peak_bytes <= 40e6 * BUDGET_SHARE
        got = db.einsum(spec, *ops).to_numpy()
    arrays = [a.astype(np.float64), b.astype(np.float64)][: len(ops)]
    np.testing.assert_allclose(got, np.einsum(spec, *arrays), rtol=1e-4, atol=1e-4 * np.abs(np.einsum(
        spec, *[np.abs(x) for x in arrays])).max())


_RUN = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import eindecomp_sql as eds
    path, spec = sys.argv[1], sys.argv[2]
    with eds.connect(path, memory="100MB") as db:
        a = db.tensor("A")
        ops = [a, db.tensor("B")][: spec.count(",") + 1]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        got = float(db.einsum(spec, *ops).to_numpy())
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps({"got": got, "rise": peak - before, "split": any(
            s.node.kept for s in db.plan(spec, *ops).steps if hasattr(s, "node"))}))
""")


@pytest.mark.duckdb_only("a file database and a fresh process's resident memory")
def test_a_sum_of_two_times_the_budget_stays_within_it(backend, tmp_path):
    """``ij,ij->`` of two 4096² float64 tensors (268 MB) from a file under 100 MB: completes,
    right, the process's resident memory rising within the bar (budget x 1.25 + 300 MB)."""
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((2, 4096, 4096))
    path = str(tmp_path / "t.duckdb")
    with eds.connect(path, memory="100MB") as db:
        db.store("A", a)
        db.store("B", b)
    out = subprocess.run([sys.executable, "-c", _RUN, path, "ij,ij->"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["split"] and got["rise"] <= 100e6 * 1.25 + 300e6, got
    assert abs(got["got"] - float(np.einsum("ij,ij->", a, b))) <= 1e-9 * float(np.einsum("ij,ij->", abs(a), abs(b)))


def test_a_gemm_under_a_budget_is_never_split():
    """A GEMM's partial results are a whole output per piece of its reduced label: it is cut
    and batched as before (a split is a candidate only for small partials, or where nothing
    else fits)."""
    from eindecomp_sql.plan.draft import example
    from eindecomp_sql.plan.pipeline import run_passes

    for budget in (16e6, 24e6, 60e6):
        plan = run_passes(example("ij,jk->ik", (4096, 4096), (4096, 4096), dtype="float32",
                                  budget=int(budget))).plan()
        assert not _split_steps(plan) and plan.peak_bytes <= budget


def test_a_graphs_dot_and_a_job_take_split_steps(tmp_path):
    """``to_dot()`` and jobs looked up every step's value among the graph's nodes: a partial
    value is none of them (KeyError '_eds_partial1', a review). The dot draws it between its
    inputs and the combine; a job runs it inside the step it belongs to."""
    from eindecomp_sql.cli import main
    from eindecomp_sql.graph import Graph

    g = Graph()
    x = g.input("x", (16, 1 << 20), "float32")
    plan = g.plan(outputs=g.einsum("ij->i", x), inputs={"x": (16, 16384)}, memory="40MB")  # x stored so
    dot = plan.to_dot()
    (first,) = _split_steps(plan.plan)
    assert f'"x" -> "{first.result.name}"' in dot and f'"{first.result.name}" -> "v1"' in dot
    assert "partial results, combined into the next step's v1" in dot
    a = np.random.default_rng(2).standard_normal((16, 1 << 20), dtype=np.float32)
    np.save(tmp_path / "A.npy", a)
    (tmp_path / "job.toml").write_text('database = "job.duckdb"\nmemory = "40MB"\n[inputs]\n'
                                       'A = { file = "A.npy", tile = [16, 16384] }\n'
                                       '[steps.S]\nspec = "ij->i"\noperands = ["A"]\n')
    with pytest.raises(SystemExit) as e:
        main(["run", str(tmp_path / "job.toml")])
    assert e.value.code == 0
    with eds.connect(str(tmp_path / "job.duckdb")) as db:
        np.testing.assert_allclose(db.tensor("S").to_numpy(), a.sum(axis=1, dtype=np.float64), rtol=1e-4, atol=1e-3)
