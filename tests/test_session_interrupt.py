"""``Session.interrupt()``: another thread stops the session's call in progress, as DuckDB's
``connection.interrupt()`` stops a query; the call raises ``Interrupted`` and nothing it was
writing is kept. The calls here are made slow with a sleeping join (a GEMM is one BLAS call the
planner may finish before any interrupt lands) and the interrupt is sent once the plan reports
progress, so that it always lands while the call runs."""

import threading
import time

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql.errors import ExecutionError, Interrupted


def slow(x, y):  # 64 tiles at 50 ms: ~2-3 s, stopped at any tile
    time.sleep(0.05)
    return x * y


@pytest.fixture
def db(tmp_path):
    with eds.connect(str(tmp_path / "t.duckdb")) as session:
        yield session


@pytest.fixture
def a():
    return np.random.default_rng(7).standard_normal((400, 400))


def _interrupt_when_running(db, started: threading.Event, said: list):
    """A thread that interrupts ``db`` once ``started`` is set (by a progress callback)."""

    def run():
        if started.wait(30):
            said.append(db.interrupt())

    t = threading.Thread(target=run)
    t.start()
    return t


def _cue(started: threading.Event):
    def progress(p):  # the plan has run a while and its tiles are not all done
        if p.elapsed >= 0.2 and p.tiles_done < p.tiles:
            started.set()
    return progress


def _in_thread(call):
    """``call()`` started on a thread of its own: the thread, and a list that gets what it
    returned or raised."""
    got = []

    def run():
        try:
            got.append(call())
        except BaseException as e:  # noqa: BLE001 - looked at by the test
            got.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, got


def _temp_tables(db) -> int:
    return db.connection.sql("SELECT count(*) FROM duckdb_tables() WHERE temporary").fetchall()[0][0]


def test_interrupt_with_nothing_running_says_so_and_stops_nothing_later(db, a):
    A = db.store("A", a)
    assert db.interrupt() is False
    np.testing.assert_allclose(db.einsum("ij,jk->ik", A, A, out="C").to_numpy(), a @ a, rtol=1e-10)


def test_interrupt_stops_a_plan_on_the_main_thread_and_writes_nothing(db, a):
    A = db.store("A", a, tile=(50, 50))
    old = db.einsum("ij->ji", A, out="C").to_numpy()
    started, said = threading.Event(), []
    t = _interrupt_when_running(db, started, said)
    with pytest.raises(Interrupted, match=r"db.interrupt\(\)") as info:
        db.einsum("ij,ij->ij", A, A, join=slow, out="C", replace=True, progress=_cue(started))
    t.join()
    assert said == [True]
    assert isinstance(info.value, ExecutionError) and isinstance(info.value, eds.EinsumError)
    # the replaced tensor is the old one, whole; nothing temporary is left
    assert sorted(db.tensors()) == ["A", "C"]
    np.testing.assert_array_equal(db.tensor("C").to_numpy(), old)
    assert _temp_tables(db) == 0
    # and the session goes on: the same call, uninterrupted, gives numpy's answer
    np.testing.assert_array_equal(db.einsum("ij,ij->ij", A, A, join=slow, out="C", replace=True).to_numpy(), a * a)


def test_interrupt_stops_a_plan_on_another_thread(db, a):
    A = db.store("A", a, tile=(50, 50))
    started = threading.Event()
    worker, got = _in_thread(lambda: db.einsum("ij,ij->ij", A, A, join=slow, out="D", progress=_cue(started)))
    assert started.wait(30)
    assert db.interrupt() is True
    worker.join(60)
    assert not worker.is_alive()
    assert len(got) == 1 and isinstance(got[0], Interrupted), got
    assert db.tensors() == ["A"] and _temp_tables(db) == 0


def test_interrupt_stops_only_the_running_call_not_those_waiting_their_turn(db, a):
    A = db.store("A", a, tile=(50, 50))
    started = threading.Event()
    first, long = _in_thread(lambda: db.einsum("ij,ij->ij", A, A, join=slow, out="L", progress=_cue(started)))
    assert started.wait(30)
    # waits for the session the long call holds
    second, short = _in_thread(lambda: db.einsum("ij,jk->ik", A, A, out="S").to_numpy())
    time.sleep(0.2)
    assert db.interrupt() is True
    first.join(60)
    second.join(60)
    assert len(long) == 1 and isinstance(long[0], Interrupted), long
    np.testing.assert_allclose(short[0], a @ a, rtol=1e-10)
    assert sorted(db.tensors()) == ["A", "S"]


def test_stores_waiting_their_turn_are_not_stopped_with_the_running_call(db, a):
    """A store reads its source before it takes the session, and interrupt() stops that
    reading; but once read, it waits its turn: one interrupt() stopped the running call and
    both stores waiting behind it, 10 trials of 10 (a soak trial)."""
    A = db.store("A", a, tile=(50, 50))
    started = threading.Event()
    first, long = _in_thread(lambda: db.einsum("ij,ij->ij", A, A, join=slow, out="L", progress=_cue(started)))
    assert started.wait(30)
    small = np.arange(600.0).reshape(20, 30)
    waiting = [_in_thread(lambda i=i: db.store(f"S{i}", small + i).to_numpy()) for i in range(2)]
    time.sleep(0.3)  # their sources (20 x 30) are read: they wait for the session
    assert db.interrupt() is True
    first.join(60)
    for t, _ in waiting:
        t.join(60)
    assert len(long) == 1 and isinstance(long[0], Interrupted), long
    for i, (_, got) in enumerate(waiting):
        np.testing.assert_array_equal(got[0], small + i)
    assert sorted(db.tensors()) == ["A", "S0", "S1"]


def test_an_interrupt_between_calls_is_not_kept_for_the_next_one(db, a):
    A = db.store("A", a, tile=(50, 50))
    started, said = threading.Event(), []
    t = _interrupt_when_running(db, started, said)
    with pytest.raises(Interrupted):
        db.einsum("ij,ij->ij", A, A, join=slow, out="C", progress=_cue(started))
    t.join()
    assert db.interrupt() is False  # nothing runs now
    np.testing.assert_array_equal(db.einsum("ij,ij->ij", A, A, join="mul", out="C").to_numpy(), a * a)


def test_interrupt_stops_a_store_while_it_cuts_its_source(db):
    """A store cuts an array into tiles in Python while DuckDB reads them: the interrupt stops
    it there (the statement reading the stream), and no table or catalog row is left."""
    b = np.random.default_rng(3).standard_normal((3000, 3000))  # 72 MB: parts
    stop_after = threading.Event()
    cut = []
    real_tiles = None

    from eindecomp_sql import io

    real_tiles = io.read_source

    def read_source(*args, **kw):  # the stream of tiles, which sets the cue at its second batch
        got = real_tiles(*args, **kw)
        tiles = got.tiles
        if hasattr(tiles, "read_next_batch"):
            import pyarrow as pa

            def batches():
                for k, batch in enumerate(tiles):
                    cut.append(k)
                    if k == 1:
                        stop_after.set()
                        time.sleep(0.3)  # the interrupt lands while this store runs
                    yield batch
            import dataclasses

            return dataclasses.replace(got, tiles=pa.RecordBatchReader.from_batches(tiles.schema, batches()))
        return got

    said = []
    t = _interrupt_when_running(db, stop_after, said)
    io_read = io.read_source
    io.read_source = read_source
    try:
        with pytest.raises(Interrupted):
            db.store("B", b, tile=(250, 250))
    finally:
        io.read_source = io_read
        t.join()
    assert said == [True] and len(cut) >= 2
    assert db.tensors() == []
    assert not db.backend.table_exists("B")
    assert db.connection.sql("SELECT count(*) FROM eds_parts").fetchall()[0][0] == 0
    np.testing.assert_array_equal(db.store("B", b, tile=(250, 250)).to_numpy(), b)


def test_interrupt_on_a_backend_without_it_is_refused_clearly():
    with eds.connect(backend="reference") as db:
        with pytest.raises(eds.EinsumError, match="interrupt\\(\\) is not available on the reference backend"):
            db.interrupt()


def test_interrupt_stops_a_store_still_reading_its_source(db, monkeypatch):
    """A store reads its source before it takes the session (a relation may call back into it):
    an interrupt then stops it before anything is written."""
    from eindecomp_sql import io

    real = io.read_source
    reading = threading.Event()

    def read_source(*args, **kw):  # a slow source
        reading.set()
        time.sleep(0.3)
        return real(*args, **kw)

    monkeypatch.setattr(io, "read_source", read_source)
    said = []
    t = _interrupt_when_running(db, reading, said)
    with pytest.raises(Interrupted):
        db.store("B", np.arange(12.0).reshape(3, 4))
    t.join()
    assert said == [True] and db.tensors() == []
    monkeypatch.setattr(io, "read_source", real)
    np.testing.assert_array_equal(db.store("B", np.arange(12.0).reshape(3, 4)).to_numpy(), np.arange(12.0).reshape(3, 4))


def test_another_threads_calls_neither_undo_nor_take_an_interrupt(db, a, monkeypatch):
    """Calls are kept per thread (a review): a store that failed on one thread while another
    thread's einsum ran turned interrupt() off for the einsum (it said False, and the einsum
    wrote its table); a quick call on one thread while another's store read its source forgot
    the stop asked of the store (it stored)."""
    A = db.store("A", a, tile=(50, 50))
    started = threading.Event()
    worker, got = _in_thread(lambda: db.einsum("ij,ij->ij", A, A, join=slow, out="D", progress=_cue(started)))
    assert started.wait(30)
    with pytest.raises(eds.EinsumError):
        db.store("X", "/nonexistent/x.npy")  # fails reading its source, on this thread
    assert db.interrupt() is True
    worker.join(60)
    assert isinstance(got[0], Interrupted), got
    assert "D" not in db.tensors()

    from eindecomp_sql import io

    real, reading, release = io.read_source, threading.Event(), threading.Event()

    def read_source(*args, **kw):  # the worker's store reads slowly, until released
        if threading.current_thread() is not threading.main_thread():
            reading.set()
            release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(io, "read_source", read_source)
    worker, stored = _in_thread(lambda: db.store("S", np.arange(6.0).reshape(2, 3)))
    assert reading.wait(30)
    assert db.interrupt() is True
    db.tensors()  # another thread's call meanwhile
    db.store("T", np.ones(3))
    release.set()
    worker.join(60)
    assert isinstance(stored[0], Interrupted), stored
    assert sorted(db.tensors()) == ["A", "T"]


def test_interrupt_leaves_the_sql_functions_a_user_runs_on_a_cursor_alone(db, a, monkeypatch):
    """interrupt() stops the session's call, not a SQL einsum a user runs on a cursor at that
    moment: every kernel shared the session's cancel flag, and 27 of 104 such queries failed
    with DuckDB's "Cancelled" under an interrupt every 50 ms (a soak trial). Here the cursor's
    kernel call has begun when the session's call starts and is stopped, and goes on after."""
    from eindecomp_sql.udfs import register

    A = db.store("A", a, tile=(50, 50))
    b = np.random.default_rng(8).standard_normal((400, 90))
    db.store("B", b, tile=(50, 50))
    real, entered, go, release = register._run, threading.Event(), threading.Event(), threading.Event()

    def first_waits(kernel, items):  # the first kernel call is the cursor's: it waits for the stop
        if not entered.is_set():
            entered.set()
            assert go.wait(30)
        return real(kernel, items)

    def held(x, y):  # the session's tiles wait until the cursor's kernel has gone on
        if np.size(x) > 16:  # (not the planner's probe of the callable's dtype)
            release.wait(30)
        return x * y

    monkeypatch.setattr(register, "_run", first_waits)
    cur = db.cursor()
    query, rows = _in_thread(  # max-plus: tasks on the kernel threads, which look at the flag first
        lambda: cur.sql("SELECT i, k, value FROM einsum_elements('ij,jk->ik', 'A', 'B', join := 'add', agg := 'max')").fetchnumpy())
    assert entered.wait(30)
    started = threading.Event()
    worker, got = _in_thread(lambda: db.einsum("ij,ij->ij", A, A, join=held, out="D", progress=_cue(started)))
    assert started.wait(30)
    assert db.interrupt() is True
    go.set()
    time.sleep(0.3)  # the cursor's kernel looks at the flag while the stopped call still holds it set
    release.set()
    query.join(60)
    worker.join(60)
    assert len(rows) == 1 and isinstance(rows[0], dict), rows
    want = np.max(a[:, :, None] + b[None, :, :], axis=1)
    got_ab = np.full((400, 90), np.nan)
    got_ab[rows[0]["i"], rows[0]["k"]] = rows[0]["value"]
    np.testing.assert_allclose(got_ab, want, rtol=1e-12)
    assert len(got) == 1 and isinstance(got[0], Interrupted), got
    assert sorted(db.tensors()) == ["A", "B"]
