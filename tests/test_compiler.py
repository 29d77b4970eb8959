"""The compiler as a plug-in (compile/compiler.py, compile/duckdb.py): a subclass that changes a
tactic compiles plans whose SQL, run on DuckDB, gives numpy's answer; compiled plans are cached
per compiler class; the default compiler's golden SQL is unchanged."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from eindecomp_sql.udfs.tiles import array_from_tiles
from helpers import assert_close, random_array
from reference import reference
from test_snapshots import CASES, _snapshots, _values

import eindecomp_sql as eds
from eindecomp_sql.compile import COMPILER, DuckDBCompiler, SQLCompiler, compile_plan
from eindecomp_sql.compile.sql_interface import interface_query
from eindecomp_sql.plan import FillStep, RetileStep, plan_einsum
from eindecomp_sql.plan.steps import step_target


class KeyJoinCompiler(DuckDBCompiler):
    """Single-tile operands joined by key (a cross product here: their one-piece labels' conditions
    are still dropped for small tiles), not by position."""

    positional_join_single_tiles = False


class AllConditionsCompiler(DuckDBCompiler):
    """Every join condition kept, single tiles joined by key: the base class's tactics."""

    positional_join_single_tiles = False
    small_tile_bytes = 0


COMPILERS = [DuckDBCompiler, KeyJoinCompiler, AllConditionsCompiler]

# spec, operands as (shape, tile, dtype), join, agg, planner options
EINSUMS = [
    ("ij,jk->ik", [((4, 3), (4, 3), "float32"), ((3, 5), (3, 5), "float32")], None, None, {}),
    ("ij,jk->ik", [((4, 6), (2, 3), "float64"), ((6, 5), (3, 5), "float64")], None, None, {}),
    ("ij,jk->ik", [((5, 6), (5, 2), "float64"), ((6, 5), (3, 5), "float64")], None, None, {}),
    ("ij,jk->ik", [((4, 6), (2, 3), "float64"), ((6, 5), (3, 5), "float64")], "add", "max", {}),
    ("ii->", [((5, 5), (2, 2), "float64")], None, None, {}),
    ("bij,bjk->bik", [((2, 3, 4), (1, 3, 4), "int64"), ((2, 4, 5), (1, 4, 5), "int64")], None, None, {}),
    ("ij,jk,kl->il", [((4, 8), (4, 8), "float32"), ((8, 2), (8, 2), "float32"), ((2, 6), (2, 6), "float32")],
     None, None, {}),
    (",ij->ij", [((), (), "float64"), ((3, 4), (2, 4), "float64")], None, None, {}),
    ("ij,jk->ik", [((3, 0), (3, 1), "float32"), ((0, 4), (1, 4), "float32")], None, "prod", {}),
    ("ij->i", [((4, 6), (4, 6), "float32")], "relu", "sum", {}),
    # every step cut into batches (statements over ranges of a key): einsum rows and groups,
    # retiles, fills
    ("ij,jk->ik", [((6, 4), (2, 4), "float64"), ((4, 6), (4, 2), "float64")], None, None, {"batched": True}),
    ("ij,jk->ik", [((24, 24), (8, 8), "float64"), ((24, 24), (16, 8), "float64")], None, None,
     {"batched": True, "tile_bytes": 512}),
    ("ij,jk->ik", [((12, 0), (2, 1), "float32"), ((0, 4), (1, 4), "float32")], None, "prod",
     {"batched": True, "tile_bytes": 64}),
]


def _batched(plan):
    """``plan`` with every step that can be cut run in up to 3 statements."""

    def cut(step):
        if isinstance(step, RetileStep):
            n = step.target.grid[0] if step.target.grid else 1
        elif isinstance(step, FillStep):
            n = step.result.grid[0] if step.result.grid else 1
        else:
            n = step.pieces[step.batch_label] if step.batch_label is not None else 1
        return replace(step, batches=min(3, n))

    return replace(plan, steps=tuple(cut(s) for s in plan.steps))


@pytest.fixture(scope="module")
def cdb():
    s = eds.connect()
    yield s
    s.close()


def _run(db, compiler: SQLCompiler, plan) -> np.ndarray:
    """Run ``compiler``'s SQL for ``plan`` on the session's DuckDB connection, statement by
    statement (every value in a TEMP table of its own), and read the result as numpy."""
    tables = {v.name: v.name for v in plan.inputs}
    tables |= {step_target(s).name: f"cmp_value_{k}" for k, s in enumerate(plan.steps)}
    work = db.backend._work
    with db.backend.lock:
        for c in compiler.compile_plan(plan):
            work.execute(compiler.bind_sql(c.create[True, True], tables))
            for text in c.inserts:
                work.execute(compiler.bind_sql(text, tables))
        r = plan.result
        tiles = work.sql(compiler.sql(compiler.select_value(r, tables[r.name]))).to_arrow_table()
    return array_from_tiles(tiles, r.shape, r.tile, r.dtype, r.keys)


def _store(db, operands, seed: int):
    rng = np.random.default_rng(seed)
    arrays, values = [], []
    for k, (shape, tile, dtype) in enumerate(operands):
        a = random_array(rng, shape, dtype)
        db.store(f"cmp_in{k}", a, tile=tile, replace=True)
        arrays.append(a)
        values.append(db.backend.lookup(f"cmp_in{k}"))
    return arrays, tuple(values)


@pytest.mark.parametrize("compiler", COMPILERS, ids=[c.__name__ for c in COMPILERS])
@pytest.mark.parametrize("case", EINSUMS, ids=[f"{c[0]} {c[2] or 'mul'}/{c[3] or 'sum'} {[o[1] for o in c[1]]}{' batched' * bool(c[4].get('batched'))}"
                                            for c in EINSUMS])
def test_every_compiler_gives_numpys_answer(cdb, compiler, case):
    spec, operands, join, agg, options = case
    arrays, values = _store(cdb, operands, seed=len(spec) + len(operands))
    plan = plan_einsum(spec, values, join, agg, tile_bytes=options.get("tile_bytes"))
    if options.get("batched"):
        plan = _batched(plan)
        assert any(s.batches > 1 for s in plan.steps)
    got = _run(cdb, compiler(), plan)
    assert_close(got, reference(spec, *arrays, join=join or "mul", agg=agg or "sum"))


def test_the_tactics_change_the_sql(cdb):
    _, values = _store(cdb, EINSUMS[0][1], seed=1)
    plan = plan_einsum("ij,jk->ik", values)
    default, keyed, every = (c().compile_plan(plan)[-1].text for c in COMPILERS)
    assert "POSITIONAL JOIN" in default and "WHERE" not in default
    # by key: one tile each, so the one-piece label j needs no condition (small tiles)
    assert "POSITIONAL" not in keyed and "WHERE" not in keyed
    assert keyed.endswith('FROM "_eds_v_cmp_in0" AS "t0", "_eds_v_cmp_in1" AS "t1"')
    assert 'WHERE "t0"."d1" = "t1"."d0"' in every


def test_compiled_plans_are_cached_per_compiler_class(cdb):
    _, values = _store(cdb, EINSUMS[0][1], seed=3)
    plan = plan_einsum("ij,jk->ik", values)
    keyed = KeyJoinCompiler().compile_plan(plan)  # compiled first: must not leak into the default
    default = DuckDBCompiler().compile_plan(plan)
    assert keyed is not default and keyed[-1].text != default[-1].text
    assert DuckDBCompiler().compile_plan(plan) is default  # another instance, the same cache entry
    assert compile_plan(plan) is default and COMPILER.compile_plan(plan) is default
    assert KeyJoinCompiler().compile_plan(plan) is keyed
    assert DuckDBCompiler() == COMPILER and KeyJoinCompiler() != COMPILER


def test_tactics_are_class_attributes():
    with pytest.raises(AttributeError, match="subclass"):
        DuckDBCompiler().positional_join_single_tiles = False
    assert KeyJoinCompiler.dialect == "duckdb" and KeyJoinCompiler.small_tile_bytes == 1 << 20
    assert SQLCompiler.dialect is None and not SQLCompiler.positional_join_single_tiles


def test_the_default_compilers_golden_sql_is_unchanged():
    """An explicit DuckDBCompiler() (after a subclass compiled the same plans) prints the golden
    SQL of tests/fixtures/sql_snapshots.sql."""
    stored = _snapshots()
    compiler = DuckDBCompiler()
    for title, spec, operands, join, agg in CASES:
        plan = plan_einsum(spec, _values(operands), join, agg)
        AllConditionsCompiler().compile_plan(plan)
        compiled = compiler.compile_plan(plan)
        names = {v.name: v.name for v in plan.inputs} | {c.value: c.value for c in compiled}
        for c in compiled:
            assert compiler.bind_sql(c.sql(), names) + ";" in stored[title], title


def test_the_sql_interface_takes_a_compiler(cdb):
    """interface_query with another compiler: the whole answer as one query, run on DuckDB."""
    arrays, values = _store(cdb, EINSUMS[0][1], seed=4)
    plan = plan_einsum("ij,jk->ik", values)
    text = interface_query(plan, (), "elements", None, KeyJoinCompiler())
    assert "POSITIONAL" not in text and text != interface_query(plan, (), "elements", None)
    with cdb.backend.lock:
        rows = cdb.backend._work.sql(text).fetchall()
    got = np.zeros((4, 5), dtype=np.float32)
    for i, k, v in rows:
        got[i, k] = v
    assert_close(got, arrays[0] @ arrays[1])


def test_another_dialect_binds_its_own_quotes():
    class BigQueryCompiler(SQLCompiler):
        dialect = "bigquery"

    plan = plan_einsum("ij,jk->ik", _values(CASES[0][2]))
    text = BigQueryCompiler().compile_plan(plan)[-1].text
    bound = BigQueryCompiler().bind_sql(text, {"A": "left", "B": "right"})
    assert "`left` AS `t0`" in bound and "`right` AS `t1`" in bound and "_eds_v_" not in bound


def test_compile_stays_pure():
    code = ("import sys, eindecomp_sql.compile, eindecomp_sql.compile.duckdb, eindecomp_sql.compile.sql_interface; "
            "print(sorted(m for m in ('duckdb', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
