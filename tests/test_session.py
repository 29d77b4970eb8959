"""A session as users share it: threads, results that free themselves, options checked at
connect(), clear errors for closed sessions, dropped tensors and files DuckDB cannot open."""

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from helpers import assert_close, backend_tables, random_array


def _temp_tables(db) -> int:
    return len([t for t in backend_tables(db, temporary=True) if t.startswith("_eds_r")])


def test_labels_differing_only_in_case_with_several_pieces(backend):
    # 'I' and 'i' were one key column of an intermediate table: 451 instead of numpy's 421
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 5, (4, 4)).astype(float) for _ in range(3))
    with eds.connect(backend=backend) as db:
        ts = [db.store(n, x, tile=(2, 2)) for n, x in zip("ABC", (a, b, c))]
        for spec in ("Ij,ji,Ii->", "Ij,ji,Ii->iI", "kj,ji,ki->"):
            assert_close(db.einsum(spec, *ts).to_numpy(), np.einsum(spec, a, b, c))


def test_threads_share_one_session(backend):
    rng = np.random.default_rng(1)
    a = random_array(rng, (33, 20), "float64")
    b = random_array(rng, (20, 17), "float64")
    want = a @ b
    errors, done = [], []
    with eds.connect(backend=backend) as db:
        A = db.store("A", a, tile=(8, 8))
        B = db.store("B", b, tile=(8, 8))

        def work():
            try:
                for _ in range(20):
                    assert_close(db.einsum("ij,jk->ik", A, B).to_numpy(), want)
                    assert_close(db.einsum("ij,jk->ik", a, b).to_numpy(), want)
                    done.append(1)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert len(done) == 80


def test_a_result_the_user_is_fetching_does_not_block_the_session():
    with eds.connect() as db:
        A = db.store("A", np.arange(12.0).reshape(3, 4))
        pending = db.connection.execute("SELECT * FROM range(1000000)")
        pending.fetchmany(2)
        np.testing.assert_array_equal(A.to_numpy(), np.arange(12.0).reshape(3, 4))
        np.testing.assert_array_equal(db.einsum("ij->j", A).to_numpy(), np.arange(12.0).reshape(3, 4).sum(0))
        assert len(pending.fetchmany(3)) == 3  # and the user's result is still there


def test_temporary_results_are_dropped_when_collected(backend):
    rng = np.random.default_rng(2)
    with eds.connect(backend=backend) as db:
        A = db.store("A", random_array(rng, (64, 64), "float32"))
        for _ in range(30):
            C = db.einsum("ij,jk->ik", A, A)
            del C
        gc.collect()
        assert _temp_tables(db) == 0
        kept = [db.einsum("ij->i", A) for _ in range(3)]
        assert _temp_tables(db) == 3
        with db.einsum("ij->j", A) as D:
            assert D.temporary and D.shape == (64,)
        assert _temp_tables(db) == 3
        del kept
        gc.collect()
        assert _temp_tables(db) == 0
        # a named result is the user's: never dropped behind their back
        E = db.einsum("ij->j", A, out="E")
        del E
        gc.collect()
        assert db.tensor("E").shape == (64,)


def test_temporary_results_give_memory_back():
    # measured in its own process: 30 results of a 1024² GEMM kept 142 MB before
    code = """
import gc, resource, numpy as np, eindecomp_sql as eds
db = eds.connect()
a = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
A = db.store("A", a)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
C = db.einsum("ij,jk->ik", A, A); del C; gc.collect()
base = rss()
for _ in range(30):
    C = db.einsum("ij,jk->ik", A, A)
    del C
gc.collect()
print((rss() - base) / 2**20)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown_mib = float(out.stdout.split()[-1])
    assert grown_mib < 60, grown_mib  # 30 x 4 MiB results would be 120 MiB


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(memory=-1), "memory budget"),
        (dict(memory="1e400GB"), "memory budget"),
        (dict(memory=float("nan")), "memory budget"),
        (dict(memory=float("inf")), "memory budget"),
        (dict(memory="lots"), "memory budget"),
        (dict(workers="x"), "workers must be an integer"),
        (dict(workers=0), "workers must be an integer"),
        (dict(workers=2.5), "workers must be an integer"),
        (dict(tile_bytes=0), "tile_bytes must be an integer"),
        (dict(tile_bytes=True), "tile_bytes must be an integer"),
        (dict(read_only="yes"), "read_only"),
    ],
)
def test_options_are_checked_at_connect(kwargs, match):
    with pytest.raises(EinsumError, match=match):
        eds.connect(**kwargs)


@pytest.mark.parametrize("tile,match", [(("a", "b"), "tile"), ((float("nan"), 2), "tile"),
                                        ((float("inf"), 2), "tile"), ((2.5, 2), "tile"), ((0, 2), "tile"),
                                        (3, "tile must be a tuple")])
def test_bad_tiles(db, tile, match):
    with pytest.raises(EinsumError, match=match):
        db.store("T", np.ones((4, 4)), tile=tile)
    assert "T" not in db.tensors()


def test_keys_that_differ_only_in_case_are_refused(db):
    with pytest.raises(EinsumError, match="ignore case"):
        db.store("K", np.ones((2, 2)), keys=("x", "X"))
    assert "K" not in db.tensors()


def test_closed_session_says_so(backend):
    db = eds.connect(backend=backend)
    A = db.store("A", np.ones((2, 2)))
    db.close()
    db.close()  # idempotent
    for call in (lambda: db.einsum("ij->", A), lambda: A.to_numpy(), lambda: db.store("B", np.ones(2)),
                 lambda: db.tensor("A"), lambda: db.tensors(), lambda: db.plan("ij->", A)):
        with pytest.raises(EinsumError, match="closed"):
            call()


def test_a_dropped_tensor_says_so(db):
    T = db.store("Gone", np.ones((2, 2)))
    db.drop("Gone")
    with pytest.raises(EinsumError, match="Gone"):
        T.to_numpy()


def test_connect_refuses_what_is_not_a_database(tmp_path):
    with pytest.raises(EinsumError, match="database must be"):
        eds.connect(123)
    bad = tmp_path / "text.duckdb"
    bad.write_text("not a database")
    with pytest.raises(EinsumError, match="not a DuckDB database"):
        eds.connect(str(bad))
    with pytest.raises(EinsumError, match="cannot open"):
        eds.connect(str(tmp_path / "no" / "such" / "dir.duckdb"))


def test_a_file_locked_by_another_process(tmp_path):
    path = tmp_path / "locked.duckdb"
    holder = eds.connect(str(path))
    try:
        code = f"""
import eindecomp_sql as eds
try:
    eds.connect({str(path)!r})
except eds.EinsumError as e:
    print("EinsumError:", e)
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "EinsumError:" in out.stdout and "locked by another process" in out.stdout, out.stdout + out.stderr
    finally:
        holder.close()


def test_a_single_einsum_over_the_budget_is_refused_before_it_runs(backend):
    # stored tiles fix the cut: the product's projected peak cannot fit 1 MB
    with eds.connect(memory="1MB", backend=backend) as db:
        A = db.store("A", np.random.default_rng(4).standard_normal((400, 400)), tile=(400, 400))
        with pytest.raises(EinsumError, match="memory budget"):
            db.einsum("ij,jk->ik", A, A, out="C")
        assert db.tensors() == ["A"] and not db.backend.table_exists("C")
        with pytest.raises(EinsumError, match="memory budget"):
            db.explain("ij,jk->ik", A, A)


def test_a_plan_whose_retile_cannot_fit_is_refused():
    # 6000² float32 stored in 1500² tiles under 100 MB: a retile of the stored tiles needed
    # 242 MB and the plan ran anyway (still running after 40 s; numpy ~3 s)
    from eindecomp_sql.plan import TiledValue, plan_einsum

    # (now it plans: retiles batched along the target key with the most tiles, into panels)
    a = TiledValue("A", (6000, 6000), "float32", (1500, 1500), ("d0", "d1"))
    with pytest.raises(EinsumError, match="memory budget"):  # a source tile alone is 9 MB, read 3 times
        plan_einsum("ij,jk->ik", (a, a), budget=20_000_000, tile_bytes=64 << 20)
    for budget in (100_000_000, 200_000_000):
        plan = plan_einsum("ij,jk->ik", (a, a), budget=budget, tile_bytes=64 << 20)
        assert plan.peak_bytes <= budget and all(s.batches > 1 for s in plan.steps)


@pytest.mark.parametrize("name", ["B2\n", "B2\n; DROP TABLE x", " B2", "B-2", "", "x" * 64, 12])
def test_names_must_be_plain_identifiers(db, name):
    with pytest.raises(EinsumError, match="invalid tensor name"):
        db.store(name, np.ones(2))
    with pytest.raises(EinsumError, match="invalid"):
        db.einsum("i->", np.ones(2), out=name)


def test_session_einsum_takes_numpy_sublist_form(db):
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((3, 4))
    A = db.store("SA", a, tile=(2, 2), replace=True)
    assert_close(db.einsum(A, [0, 1], b, [1, 2], [0, 2]).to_numpy(), a @ b)
    assert_close(db.einsum_numpy(a, [0, 1], [1]), a.sum(0))


def test_a_budget_never_buys_degenerate_tilings():
    # 12000² float32 under 300 MB: cut into 72M tile pairs of (2, 12000) x (12000, 1) before
    from eindecomp_sql.plan import TiledValue, plan_einsum
    from eindecomp_sql.plan.optimize import MAX_JOIN_TASKS

    # (still running after 600 s); under 20 MB 2D batches would need 16,384 statements
    from eindecomp_sql.plan.cost import MAX_BATCHES

    a = TiledValue("A", (12000, 12000), "float32", None, ("d0", "d1"))
    with pytest.raises(EinsumError, match="give more memory"):
        plan_einsum("ij,jk->ik", (a, a), budget=20_000_000, tile_bytes=64 << 20)
    for budget in (300_000_000, 2_000_000_000):  # out of core: statements over panels of both operands
        plan = plan_einsum("ij,jk->ik", (a, a), budget=budget, tile_bytes=64 << 20)
        for step in plan.steps:
            if hasattr(step, "pieces"):
                assert np.prod(list(step.pieces.values())) <= MAX_JOIN_TASKS
            assert step.peak_bytes <= budget and step.batches <= MAX_BATCHES


def test_results_used_as_operands_are_told_apart(backend):
    # every db.einsum result was a value named _eds_result (KeyError when used again), and two
    # graphs' outputs shared their graph value's name (silently merged into one operand)
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    with eds.connect(backend=backend) as db:
        A = db.store("A", a, tile=(2, 2))
        t = db.einsum("ij,jk->ik", A, A)
        u = db.einsum("ij->ji", A, out="U")
        assert_close(db.einsum_numpy("ij,jk->ik", t, A), a @ a @ a)
        assert_close(db.einsum("ij,jk->ik", t, u).to_numpy(), (a @ a) @ a.T)

        def scaled(k):
            g = eds.Graph()
            x = g.input("x", (4, 4), "float64")
            g.map(f"{k} * x", x)
            return g.plan()

        t1, t2 = scaled(2).run(db, x=a), scaled(3).run(db, x=b)
        assert_close(db.einsum_numpy("ij,jk->ik", t1, t2), (2 * a) @ (3 * b))


def test_a_repeated_einsum_is_planned_and_compiled_once():
    from eindecomp_sql.compile import compile_plan
    from eindecomp_sql.plan.einsum import _plan

    rng = np.random.default_rng(11)
    a = rng.standard_normal((64, 64))
    with eds.connect() as db:
        A = db.store("A", a)
        results = [db.einsum("ij,jk->ik", A, A) for _ in range(3)]  # distinct tables...
        assert len({r.name for r in results}) == 3
        for r in results:
            assert_close(r.to_numpy(), a @ a)
        plans, compiled = _plan.cache_info(), compile_plan.cache_info()
        more = [db.einsum("ij,jk->ik", A, A) for _ in range(5)]
        assert _plan.cache_info().misses == plans.misses  # ...one plan, one compiled SQL
        assert compile_plan.cache_info().misses == compiled.misses
        assert_close(more[-1].to_numpy(), a @ a)


def test_a_repeated_graph_run_reuses_its_compiled_sql():
    from eindecomp_sql.compile import compile_plan

    g = eds.Graph()
    x = g.input("x", (16, 8), "float64")
    h = g.einsum("ij,kj->ik", x, x)
    y = g.map("relu", h)
    plan = g.plan(outputs=[h, y])  # h is an output and read by y
    a = np.random.default_rng(13).standard_normal((16, 8))
    with eds.connect() as db:
        first = plan.run(db, x=a)
        misses = compile_plan.cache_info().misses
        second = plan.run(db, x=a)
        assert compile_plan.cache_info().misses == misses
        assert first[h.name].name != second[h.name].name
        for out in (first, second):
            assert_close(out[h.name].to_numpy(), a @ a.T)
            assert_close(out[y.name].to_numpy(), np.maximum(a @ a.T, 0))


def test_a_temporary_result_used_after_its_with_block_says_so(db):
    """Dropped temporary results' table names are used again (a cache hit when binding SQL):
    a handle used after its with block must never read whichever result holds the name now."""
    a = np.arange(12.0).reshape(3, 4)
    A = db.store("tw_A", a, replace=True)
    with db.einsum("ij->ji", A) as t:
        np.testing.assert_array_equal(t.to_numpy(), a.T)
    later = db.einsum("ij->j", A)  # may take the name t's table had
    for use in (t.to_numpy, t.to_arrow, lambda: db.einsum("ij->i", t)):
        with pytest.raises(EinsumError, match=r"was dropped \(db.drop\(result\), or it left its with block\)"):
            use()
    np.testing.assert_array_equal(later.to_numpy(), a.sum(axis=0))


def test_an_output_over_a_table_the_plan_reads(db, backend):
    """One statement may replace a table it reads (DuckDB reads it whole first), and so may a
    step after every statement that reads it (a re-tile first, or a reduction's partial step:
    ``ij->j`` of a tensor in parts was refused once it ran as two steps); a step in several
    statements that reads it may not: a later one would read the half-made result."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((30, 20))
    db.store("ow_A", a, replace=True)
    t = db.einsum("ij->ij", "ow_A", join="neg", out="ow_A", replace=True)  # one statement: fine
    np.testing.assert_array_equal(t.to_numpy(), -a)
    db.store("ow_B", a, tile=(7, 20), replace=True)  # cut otherwise: a retile, then the einsum
    np.testing.assert_array_equal(db.einsum("ij->ji", "ow_B", out="OW_B", replace=True).to_numpy(), a.T)
    with eds.connect(backend=backend, memory="200KB") as small:
        c = rng.standard_normal((64, 64))
        small.store("ow_C", c, tile=(8, 64))
        assert small.plan("ij->ij", "ow_C", join="neg").steps[-1].batches > 1
        with pytest.raises(EinsumError, match="out='ow_C' is also read by this plan"):
            small.einsum("ij->ij", "ow_C", join="neg", out="ow_C", replace=True)
        np.testing.assert_array_equal(small.tensor("ow_C").to_numpy(), c)  # untouched
    # one table bound to two graph inputs: a step after the output's reads it by the other name
    # (only the last name bound to the table was checked: wrong results, a review)
    x = rng.standard_normal((8, 8))
    db.store("ow_X", x, keys=["i", "j"], replace=True)
    db.store("ow_W", x.T.copy(), replace=True)
    g = eds.Graph()
    gx, gy, gw = g.input("x", (8, 8), "float64"), g.input("y", (8, 8), "float64"), g.input("w", (8, 8), "float64")
    g.einsum("ij->ij", gy, join="neg", name="o1")
    g.einsum("ij,jk->ik", gx, gw, name="o2")
    plan = g.plan(outputs=["o1", "o2"], inputs={"x": db.tensor("ow_X"), "y": db.tensor("ow_X"), "w": db.tensor("ow_W")})
    with pytest.raises(EinsumError, match="out='ow_X' is also read by this plan"):
        plan.run(db, out={"o1": "ow_X", "o2": "ow_Y"}, replace=True, inputs={"x": "ow_X", "y": "ow_X", "w": "ow_W"})
    np.testing.assert_array_equal(db.tensor("ow_X").to_numpy(), x)


def test_two_outputs_may_not_share_a_table(db):
    from eindecomp_sql.graph import Graph

    g = Graph()
    x = g.input("x", (4, 3), "float64")
    y, z = g.reduce(x, 1, name="y"), g.reduce(x, 0, name="z")
    with pytest.raises(EinsumError, match="out names table 'T' for both 'y' and 'z'"):
        g.plan(outputs=[y, z]).run(db, x=np.ones((4, 3)), out={"y": "t", "z": "T"}, replace=True)


def test_a_file_open_in_plain_duckdb_opens_in_a_session_too(tmp_path):
    """DuckDB refuses a second connection to a file opened with another config: the session
    opens files with the caller's config only (it sets its thread count after connecting)."""
    import duckdb

    path = str(tmp_path / "shared.db")
    con = duckdb.connect(path)
    with eds.connect(path) as db:
        db.store("a", np.arange(6.0).reshape(2, 3))
        other = duckdb.connect(path)  # and the other way round, while the session is open
        other.close()
    con.close()


def test_a_file_open_in_one_session_is_refused_by_a_second_with_our_error(tmp_path):
    """A file opened twice in one process is one DuckDB database, where the kernels are
    registered once: a second session says so in our words, and works once the first closes."""
    from eindecomp_sql.errors import EinsumError

    path = str(tmp_path / "twice.db")
    first = eds.connect(path)
    first.store("x", np.ones((3, 3)))
    with pytest.raises(EinsumError, match="already open in another eindecomp_sql session"):
        eds.connect(path)
    first.close()
    with eds.connect(path) as second:
        np.testing.assert_array_equal(second.einsum_numpy("ij,jk->ik", "x", "x"), np.full((3, 3), 3.0))


@pytest.mark.parametrize("registry", [True, False])
def test_arrays_are_readable_for_the_run_only(registry, monkeypatch):
    """Arrays enter a plan through duckdb's source registry (or, without it, as views): the
    answer is numpy's either way, and nothing stays readable once the plan ran, or failed."""
    import duckdb

    from eindecomp_sql.backends.duckdb import DuckDBBackend

    monkeypatch.setattr(DuckDBBackend, "source_registry", registry)
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((5, 4)), rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    with eds.connect() as db:
        seen = []
        arrays = db.backend._arrays

        def spy(tables, host=None, results=None):
            with arrays(tables, host, results) as names:
                seen.append(dict(names))
                yield names

        monkeypatch.setattr(db.backend, "_arrays", contextlib.contextmanager(spy))
        np.testing.assert_allclose(db.einsum_numpy("ij,jk,kl->il", a, b, c), a @ b @ c, rtol=1e-12)
        with pytest.raises(EinsumError):
            db.einsum_numpy("ij,jk->ik", a, np.full((4, 3), "x", dtype=object))
        def bad(x, y):  # fine on the planner's probe, fails on the data
            if 5 in np.shape(x):
                raise ValueError("no")
            return x * y

        with pytest.raises(EinsumError):  # a kernel fails mid-plan
            db.einsum_numpy("ij,jk->ik", a, b, join=bad)
        assert len(seen) >= 2 and all(len(s) >= 1 for s in seen)
        assert registry == all(not n.startswith("_eds_a") for s in seen for n in s.values())
        for s in seen:
            for name in s.values():
                with pytest.raises(duckdb.Error):  # no such table, or its object released
                    db.backend._work.execute(f'SELECT * FROM "{name}"').fetchall()


def test_a_session_dropped_on_a_users_connection_gives_way_to_a_new_one():
    """``eds.connect(con)`` inside a function, its handle gone: the SQL interface's holder kept
    the session alive, so the connection refused every later session and kept the lowered
    memory_limit. A session nothing reaches is closed by the next connect; one still held (a
    handle, a Tensor) is not."""
    import duckdb

    con = duckdb.connect()
    limit = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]

    def work():
        s = eds.connect(con, memory="512MB")
        return s.store("X", np.arange(3.0)).to_numpy()

    np.testing.assert_array_equal(work(), [0, 1, 2])
    gc.collect()
    assert con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0] != limit
    db = eds.connect(con)  # the dropped one is closed: its memory_limit put back
    assert con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0] == limit
    np.testing.assert_array_equal(db.tensor("X").to_numpy(), [0, 1, 2])
    with pytest.raises(eds.EinsumError, match="already has an eindecomp_sql session open on it"):
        eds.connect(con)  # a handle holds it
    kept = db.tensor("X")
    del db
    gc.collect()
    with pytest.raises(eds.EinsumError, match="already has an eindecomp_sql session open on it"):
        eds.connect(con)  # so does a Tensor
    del kept
    gc.collect()
    with eds.connect(con) as again:
        np.testing.assert_array_equal(again.tensor("X").to_numpy(), [0, 1, 2])
    con.close()


def test_a_users_connection_takes_a_new_session_after_close_and_refuses_a_second_at_once():
    """A session on a connection it does not own leaves the connection open; its functions
    stayed registered there, so a new session on it failed with DuckDB's own error."""
    import duckdb

    con = duckdb.connect()
    db = eds.connect(con)
    db.store("A", np.arange(4.0).reshape(2, 2))
    with pytest.raises(eds.EinsumError, match="already has an eindecomp_sql session open on it"):
        eds.connect(con)
    assert con.sql("SELECT count(*) FROM einsum('ij->i', 'A')").fetchall() == [(1,)]  # the first one unharmed
    pending = con.execute("SELECT * FROM range(5)")
    pending.fetchone()
    db.close()  # runs nothing on the user's connection: the result being fetched is intact
    assert pending.fetchall() == [(1,), (2,), (3,), (4,)]
    with pytest.raises(duckdb.Error, match="this session is closed"):
        con.sql("SELECT * FROM einsum('ij->i', 'A')").fetchall()
    with eds.connect(con) as again:  # takes over the closed session's functions
        np.testing.assert_array_equal(again.einsum("ij->i", "A").to_numpy(), [1.0, 5.0])
        assert con.sql("SELECT count(*) FROM einsum('ij->i', 'A')").fetchall() == [(1,)]
    con.close()


def test_a_users_connection_gets_its_settings_back_when_the_session_closes():
    """``eds.connect(con, memory=...)`` sets DuckDB's memory_limit, temp_directory and
    arrow_large_buffer_size (the database's settings); close() left them set, the spill folder
    deleted under DuckDB's feet (a trial's report). Sessions opened and closed again and again
    leave the limit as the user had it, not lower each time."""
    import duckdb

    con = duckdb.connect()
    con.execute("SET memory_limit = '3GB'")

    def settings():
        return con.execute("SELECT current_setting('memory_limit'), current_setting('temp_directory'), "
                           "current_setting('arrow_large_buffer_size')").fetchall()[0]

    before = settings()
    for _ in range(3):
        db = eds.connect(con, memory="64MB")
        db.store("A", np.arange(6.0).reshape(2, 3), replace=True)
        assert settings() != before  # the session's budget is in force while it is open
        np.testing.assert_array_equal(db.einsum("ij->j", "A").to_numpy(), [3.0, 5.0, 7.0])
        db.close()
        assert settings() == before
    # a setting the user changed while the session was open is theirs: close() leaves it (it
    # put back the value from before the session over it; a trial)
    db = eds.connect(con, memory="64MB")
    db.store("A", np.arange(6.0).reshape(2, 3), replace=True)
    con.execute("SET memory_limit = '5GB'")
    db.close()
    assert settings() == ("4.6 GiB",) + before[1:]  # the rest, still as the session left them, put back
    con.close()


def test_replace_must_be_a_bool_everywhere():
    """replace="no" is truthy: store overwrote the tensor with it, einsum raised a KeyError."""
    with eds.connect() as db:
        db.store("A", np.arange(4.0))
        for call in (lambda: db.store("A", np.zeros(2), replace="no"),
                     lambda: db.einsum("i->", "A", out="S", replace="no"),
                     lambda: db.einsum("i->", "A", out="S", replace=1)):
            with pytest.raises(eds.EinsumError, match="replace must be True or False"):
                call()
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), np.arange(4.0))
        assert db.tensors() == ["A"]
        db.store("A", np.zeros(2), replace=np.True_)
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), np.zeros(2))


def test_a_closed_session_lets_the_users_connection_go_and_an_open_one_serves_sql():
    """The SQL interface's UDF, held by the connection in C++, referenced the session, which
    holds the connection: a cycle no collector sees, so the connection (its whole database)
    outlived both. Closing the session now breaks it; an open session, handle dropped or not,
    still serves SELECT * FROM einsum(...)."""
    import weakref

    import duckdb

    con = duckdb.connect()
    gone = weakref.ref(con)
    db = eds.connect(con)
    db.store("A", np.ones(2))
    db.close()
    del db, con
    gc.collect()
    assert gone() is None
    con = duckdb.connect()
    eds.connect(con).store("B", np.arange(3.0))  # the session is never named again
    gc.collect()
    assert con.sql("SELECT * FROM einsum_elements('i->', 'B')").fetchall() == [(3.0,)]


FORKED = r"""
import os, threading, time, numpy as np, eindecomp_sql as eds
a = np.random.default_rng(0).standard_normal((400, 300))
want = a @ a.T
# a max-plus product runs on the kernel pool (a float product is one BLAS call): the pool is up
print("parent", np.allclose(eds.einsum("ij,kj->ik", a, a, join="add", agg="max"),
                            (a[:, None, :] + a[None, :, :]).max(-1)), flush=True)
db = eds.connect(os.environ["EDS_DB"]); db.store("A", a)
stop = threading.Event()
def busy():  # a parent thread inside session calls while the parent forks
    while not stop.is_set():
        eds.einsum("ij,kj->ik", a[:8], a[:8], join="add", agg="max")
threading.Thread(target=busy, daemon=True).start(); time.sleep(0.2)
for attempt in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            ok = np.allclose(eds.einsum("ij,kj->ik", a, a), want)  # a default session of its own
            ok = ok and np.allclose(eds.einsum("ij,kj->ik", a[:50], a[:50], join="add", agg="max"),
                                    (a[:50, None, :] + a[None, :50, :]).max(-1))  # a kernel pool of its own
            try:
                db.store("C", a)
                inherited = "used"
            except eds.EinsumError as e:
                inherited = "refused" if "opened in process" in str(e) else repr(e)
            with eds.connect() as mine:
                ok = ok and np.allclose(mine.einsum("ij,kj->ik", a, a).to_numpy(), want)
            print("child", ok, inherited, flush=True)
        finally:
            os._exit(0)
    for _ in range(300):
        if os.waitpid(pid, os.WNOHANG)[0]:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9); os.waitpid(pid, 0); print("child hung", flush=True)
stop.set(); time.sleep(0.2)
db.close()
with eds.connect(os.environ["EDS_DB"], read_only=True) as again:
    print("file", again.tensors(), np.allclose(again.tensor("A").to_numpy(), a), flush=True)
"""


def test_a_forked_child_gets_sessions_of_its_own_and_leaves_the_parents_alone(tmp_path):
    """A child forked after the kernel pool ran waited for ever on its first kernel call (the
    pool's threads are the parent's), a child forked while a parent thread held a session's
    lock waited for ever on it, and a child writing through the parent's file session lost
    its writes or corrupted the file."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    env = dict(os.environ, EDS_DB=str(tmp_path / "t.duckdb"), OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "parent True" and lines.count("child True refused") == 3, r.stdout
    assert lines[-1] == "file ['A'] True", r.stdout


def test_to_numpy_while_another_thread_replaces_the_tensor_is_old_new_or_refused():
    """The handle was checked, then the tiles read, with a replace between: int64 bytes read
    as float64 in 133 of 1,838 reads."""
    f, i = np.full((128, 128), 1.5), np.full((128, 128), 7, np.int64)
    with eds.connect() as db:
        A = db.store("A", f)
        stop = threading.Event()

        def replace():
            k = 0
            while not stop.is_set():
                k += 1
                db.store("A", i if k % 2 else f, replace=True)

        t = threading.Thread(target=replace)
        t.start()
        wrong = []
        try:
            for _ in range(300):
                try:
                    got = A.to_numpy()
                except eds.EinsumError as e:
                    assert "was replaced since this handle was made" in str(e)
                    A = db.tensor("A")
                    continue
                if not ((got == 1.5).all() or (got == 7).all()):
                    wrong.append(got.flat[0])
        finally:
            stop.set()
            t.join()
        assert not wrong, wrong[:5]


def test_closing_while_a_query_runs_on_the_connection_leaves_the_session_whole(tmp_path):
    """close() marked the session closed and then failed on DuckDB's busy connection: the file
    stayed open for good and could not be closed through the API."""
    path = str(tmp_path / "t.duckdb")
    db = eds.connect(path)
    db.store("A", np.random.default_rng(0).standard_normal((1024, 1024)))
    running, done = threading.Event(), threading.Event()

    def slow(x):  # the query is inside DuckDB while this runs
        running.set()
        time.sleep(0.5)
        return x

    db.connection.create_function("slow_marker", slow, ["BIGINT"], "BIGINT")

    def query():
        db.connection.sql("SELECT slow_marker(42)").fetchall()
        done.set()

    t = threading.Thread(target=query)
    t.start()
    assert running.wait(30)
    with pytest.raises(eds.EinsumError, match="cannot close the session now"):
        db.close()
    assert not db.backend.closed and db.tensors() == ["A"]  # whole and usable
    t.join()
    assert done.is_set()
    db.close()
    with eds.connect(path) as again:
        assert again.tensors() == ["A"]


def test_a_dropped_session_does_not_keep_its_file_from_opening_again(tmp_path):
    """A notebook cell ``db = eds.connect("f.duckdb")`` run twice: the first session, dropped
    without close(), stayed open (its SQL interface's UDF keeps it), and the second connect
    failed with "already open in another session", with no handle left to close. A session
    nothing refers to any more is closed for the new one; one still reachable (a Tensor of
    it, its ``db.connection`` held) is left open, and the error says why."""
    f = tmp_path / "nb.duckdb"
    db = eds.connect(f)
    db.store("A", np.arange(3.0))
    del db
    db = eds.connect(f)  # the same options
    np.testing.assert_array_equal(db.tensor("A").to_numpy(), np.arange(3.0))
    del db
    db = eds.connect(f, memory="100MB")  # other options: DuckDB's "different configuration"
    T = db.tensor("A")
    del db
    with pytest.raises(EinsumError, match="already open in another eindecomp_sql session.*no Tensor of it"):
        eds.connect(f)
    np.testing.assert_array_equal(T.to_numpy(), np.arange(3.0))  # its session kept, and working
    del T
    db = eds.connect(f)
    con = db.connection
    del db
    with pytest.raises(EinsumError, match="already open"):
        eds.connect(f)
    assert con.sql("SELECT * FROM einsum_elements('i->', 'A')").fetchall() == [(3.0,)]
    del con
    with eds.connect(f, read_only=True) as db:
        assert db.tensors() == ["A"]


def test_an_array_where_the_name_goes_is_named_by_its_type_not_printed(db):
    """``store(a, "A")`` (arguments swapped) printed the whole array in its message."""
    a = np.arange(100_000.0).reshape(1000, 100)
    with pytest.raises(EinsumError) as e:
        db.store(a, "A")
    msg = str(e.value)
    assert msg == ("invalid tensor name: expected a str, got a ndarray of shape (1000, 100) (the name comes first: "
                   "store(name, data))"), msg
    assert db.tensors() == [] or "A" not in db.tensors()


REENTRANT = r"""
import threading, numpy as np, eindecomp_sql as eds
a = np.arange(6.0).reshape(2, 3); b = np.arange(12.0).reshape(3, 4)
def sql_inside(x, y):  # a SQL einsum from a kernel hung too, now and then (a review)
    db.connection.sql("SELECT * FROM einsum('ij->i', 'A')").fetchall()
    return x * y
for call in (lambda: eds.einsum("ij,jk->ik", a, b, join=lambda x, y: eds.einsum("...,...->...", x, y)),
             lambda: db.einsum("ij,jk->ik", A, B, join=lambda x, y: db.einsum_numpy("...,...->...", x, y)),
             lambda: db.einsum("ij,jk->ik", A, B, join=sql_inside)):
    db = eds.connect(); A = db.store("A", a); B = db.store("B", b)
    try:
        call()
        print("ran")
    except eds.EinsumError as e:
        print("refused:", "called from inside a tile kernel" in str(e))
    print("then:", np.array_equal(db.einsum_numpy("ij,jk->ik", A, B), a @ b))
m = np.random.default_rng(5).standard_normal((1200, 1200))
db.store("M", m, tile=(400, 400)); seen = []
def cb(p):
    try:
        r = db.einsum("ij->i", "M").to_numpy()
        seen.append((threading.current_thread() is threading.main_thread(), r.shape if np.allclose(r, m.sum(1)) else "wrong"))
    except eds.EinsumError as e:
        seen.append((threading.current_thread() is threading.main_thread(), "refused" if "progress callback" in str(e) else str(e)))
r = db.einsum("ij,jk->ik", "M", "M", progress=cb)
print("plan:", np.allclose(r.to_numpy(), m @ m))
# a store of a new name and a run inside a run inside a run, from callbacks on the plan's thread
# (the store's probe of the name failed inside the plan's transaction, and a third level took
# the second's scratch names: both plans failed, a review)
depth = []
def deeper(p):
    if threading.current_thread() is threading.main_thread() and len(depth) < 3:
        depth.append(1)
        k = len(depth)
        db.store(f"N{k}", np.arange(3.0) + k, replace=True)
        got = db.einsum("ij,jk->ik", m[:40, :40] * k, m[:40, :40], progress=deeper).to_numpy()
        assert np.allclose(got, (m[:40, :40] * k) @ m[:40, :40])
r = db.einsum("ij,jk->ik", "M", "M", progress=deeper)
print("deeper:", np.allclose(r.to_numpy(), m @ m), len(depth), [float(db.tensor(f"N{k}").to_numpy()[0]) for k in (1, 2, 3)])
print("main:", sorted({str(s[1]) for s in seen if s[0]}), "other:", sorted({str(s[1]) for s in seen if not s[0]}))
"""


def test_a_session_called_from_its_own_kernel_is_refused_and_from_its_progress_callback_runs():
    """A join callable that calls einsum waited for ever (the query waits for the kernel, the
    kernel for the session; Ctrl-C did not stop it): refused, and the session works after. A
    progress callback that ran an einsum on the plan's own thread failed both plans (a trial:
    its BEGIN inside the running transaction aborted it, and its scratch table was the outer
    plan's _eds_s0): both run, right; a callback on another thread is refused."""
    out = subprocess.run([sys.executable, "-c", REENTRANT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[:6] == ["refused: True", "then: True"] * 3, out.stdout
    assert lines[6] == "plan: True", out.stdout
    assert lines[7] == "deeper: True 3 [1.0, 2.0, 3.0]", out.stdout
    main, other = lines[8].split(" other: ")
    # between steps the callback runs on the watchdog's thread, where the session is refused
    # (the call waited for the plan, and the watchdog with it: a documentation audit)
    assert main == "main: ['(1200,)']" and other in ("['refused']", "[]"), out.stdout


def test_a_refusal_for_memory_says_the_memory_to_pass(backend):
    """Under memory="10MB" a refusal said "fits the memory budget of 6.0 MB ... give more
    memory": the plans' share, and no number to pass (a trial). It says the memory= that this
    node needs, and that memory= plans it; graphs run with g.run say the same."""
    import re

    rng = np.random.default_rng(3)
    a = rng.standard_normal((2000, 2000))
    with eds.connect(memory="2MB", backend=backend) as db:
        with pytest.raises(EinsumError, match=r"this session's memory=2.0 MB gives plans 60% of it \(1.2 MB\); "
                                              r"this needs memory= of at least") as e:
            db.plan("ij,jk->ik", a, a)
        assert "tiles capped" not in str(e.value)
        g = eds.Graph()
        g.einsum("ij,jk->ik", g.input("x", a.shape, "float64"), g.input("y", a.shape, "float64"))
        with pytest.raises(EinsumError, match="this needs memory= of at least"):
            g.run(db, x=a, y=a)
        needed = re.search(r"at least ([0-9.]+ [kMG]?B)", str(e.value)).group(1).replace(" ", "")
    with eds.connect(memory=needed, backend=backend) as db:
        db.plan("ij,jk->ik", a, a)


def test_drop_takes_a_temporary_results_tensor(db):
    """``db.drop(R.name)`` of a graph's temporary result said "invalid tensor name '_eds_r0':
    ... reserved" (a trial): the Tensor drops it now, the name says how."""
    g = eds.Graph()
    g.einsum("bi,io->bo", g.input("x", (8, 4), "float64"), g.input("w", (4, 2), "float64"))
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((8, 4)), rng.standard_normal((4, 2))
    r = g.run(db, x=x, w=w)
    np.testing.assert_allclose(r.to_numpy(), x @ w)
    with pytest.raises(EinsumError, match="temporary result's table.*pass the Tensor itself"):
        db.drop(r.name)
    db.drop(r)
    with pytest.raises(EinsumError, match="was dropped"):
        r.to_numpy()
    s = db.store("drop_me", x, replace=True)
    db.drop(s)
    assert "drop_me" not in db.tensors()


def test_writing_to_a_read_only_database_is_refused_before_anything_runs(tmp_path):
    """``einsum(out=)`` on a read-only session failed inside the plan's first step in DuckDB's
    words (a trial): refused first, saying why; temporary results still run there."""
    f = str(tmp_path / "ro.duckdb")
    a = np.random.default_rng(6).standard_normal((5, 4))
    with eds.connect(f) as db:
        db.store("A", a)
    with eds.connect(f, read_only=True) as db:
        np.testing.assert_allclose(db.einsum("ij->i", "A").to_numpy(), a.sum(1))
        for call in (lambda: db.einsum("ij->i", "A", out="B"), lambda: db.store("C", a)):
            with pytest.raises(EinsumError, match=r"^cannot write '[BC]': this database is open read-only"):
                call()
        # a drop too (it said DuckDB's 'Cannot execute statement of type "DROP"': a crash trial)
        with pytest.raises(EinsumError, match=r"^drop\('A'\): this database is open read-only"):
            db.drop("A")
        assert db.tensors() == ["A"]


@pytest.mark.duckdb_only("the stored tables' check")
def test_a_tensor_replaced_after_planning_is_said_to_be_replaced_not_edited(db):
    """Another thread's store between a plan and its check was reported as a hand edit, with
    advice to store the tensor again (over the other writer's): a trial. The check says it
    was replaced, and with what."""
    db.store("Xr", np.ones((50, 40)), tile=(16, 16), replace=True)
    planned = db.tensor("Xr").value
    db.store("Xr", np.ones((40, 50)), tile=(16, 16), replace=True)
    with pytest.raises(EinsumError, match=r"stored tensor 'Xr' was replaced \(now shape \(40, 50\) float64 in tiles "
                                          r"\(16, 16\)\) after this einsum was planned"):
        db.backend.check_tables([(planned, "Xr")])
    db.backend.check_tables([(db.tensor("Xr").value, "Xr")])  # as it is now: nothing to say


@pytest.mark.duckdb_only("the DuckDB connection")
def test_a_session_whose_connection_was_closed_by_hand_says_so():
    """``db.connection.close()`` made every later call raise DuckDB's "Connection already
    closed!" (a trial): an EinsumError naming the session and what to do; close() still works."""
    db = eds.connect()
    a = db.store("A", np.ones((3, 3)))
    db.connection.close()
    for call in (lambda: db.einsum("ij->i", a), db.tensors, lambda: db.store("B", np.ones(2))):
        with pytest.raises(EinsumError, match=r"this session's DuckDB connection was closed"):
            call()
    db.close()


FILE_SIZE_CAPPED = r"""
import resource, signal, sys, numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG) instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (24 << 20, 24 << 20))
import eindecomp_sql as eds
db = eds.connect(sys.argv[1])
for i in range(8):
    try:
        db.store(f"T{i}", np.full((1024, 1024), float(i)))
    except Exception as e:
        print("store", i, type(e).__name__, str(e).replace("\n", " "))
        break
try:
    db.tensors()
except Exception as e:
    print("next", type(e).__name__, str(e).replace("\n", " "))
"""


def test_a_file_that_cannot_grow_fails_the_store_clearly_and_keeps_what_was_committed(tmp_path):
    """A disk that filled at a store's checkpoint (here: the process's file size capped) made
    DuckDB invalidate the database: the store raised DuckDB's raw FatalException (a view's
    unregister in a ``finally`` replaced our error), and every later call its "database has been
    invalidated" (a crash trial). Both are EinsumErrors saying what to do; reopened, the tensors
    committed before are whole and the failed one absent."""
    path = str(tmp_path / "capped.duckdb")
    r = subprocess.run([sys.executable, "-c", FILE_SIZE_CAPPED, path], capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr[-2000:])
    stored, nxt = lines
    assert stored.startswith("store ") and " EinsumError " in stored and "File too large" in stored, stored
    assert "open the database again with eds.connect()" in stored, stored
    assert nxt.startswith("next EinsumError ") and "open the database again with eds.connect()" in nxt, nxt
    failed = int(stored.split()[1])
    with eds.connect(path) as db:
        assert db.tensors() == [f"T{i}" for i in range(failed)]
        for i in range(failed):
            np.testing.assert_array_equal(db.tensor(f"T{i}").to_numpy(), np.full((1024, 1024), float(i)))


def test_what_a_documentation_audit_found():
    """eds.einsum of a session's Tensor runs in that session (it was refused as "a tensor of
    another session"); a SQL spec of more than 8 operands says einsum() takes at most 8 (it said
    "9 operand(s) but 8 were given"); read_only=True over a writable connection is refused (no
    catalog was made, and writes failed in DuckDB's words)."""
    import duckdb

    a = np.arange(6.0).reshape(2, 3)
    with eds.connect() as db, eds.connect() as other:
        A = db.store("A", a)
        assert eds.einsum("ij->", A) == a.sum()
        np.testing.assert_array_equal(eds.einsum("ij,kj->ik", A, "A"), a @ a.T)  # a name: A's session's
        B = other.store("B", a)
        with pytest.raises(EinsumError, match="the Tensor operands belong to different sessions"):
            eds.einsum("ij,ij->", A, B)
        for n in range(1, 10):
            db.connection.execute(f"CREATE TABLE v{n} AS SELECT range AS i, 1.0 AS value FROM range(3)")
        with pytest.raises(duckdb.Error, match=r"names 9 operands, but einsum\(\) takes at most 8"):
            db.connection.sql("SELECT * FROM einsum_elements('i,i,i,i,i,i,i,i,i->i', "
                              + ", ".join(f"'v{n}'" for n in range(1, 10)) + ")").fetchall()
    with pytest.raises(EinsumError, match="read_only=True is for a database path: the connection you passed is writable"):
        eds.connect(duckdb.connect(), read_only=True)


def test_sessions_dropped_without_close_are_closed_as_the_next_opens():
    """A service handler that forgot close() left each session open for the process's life
    (~5 MB and 9 DuckDB threads each, 2,722 threads after 300: a soak trial): the SQL interface's
    UDF refers to it through C++, a cycle no collector sees. Each connect() closes the ones
    nothing reaches; a session held, or whose connection is held, is kept."""
    import weakref

    a = np.ones((8, 8))
    held = eds.connect()
    H = held.store("H", a)
    con = eds.connect().connection  # its session reachable only through the connection, which is held
    con.execute("CREATE TABLE E AS SELECT range AS i, 1.0 AS value FROM range(4)")

    def request():
        db = eds.connect(memory="50MB")
        db.einsum("ij,jk->ik", a, a).to_numpy()
        return weakref.ref(db)

    dropped = [request() for _ in range(5)]
    gc.collect()
    eds.connect().close()  # the next open closes the dropped ones
    for ref in dropped:
        s = ref()
        assert s is None or s.backend.closed, "a dropped session is still open"
    assert held.tensors() == ["H"] and H.to_numpy().sum() == 64
    assert con.sql("SELECT * FROM einsum_elements('i->', 'E')").fetchall() == [(4.0,)]
    held.close()
