"""Ctrl-C during a long plan: KeyboardInterrupt within a second or two, nothing half-written.
A real subprocess and a real SIGINT; progress reports while a plan runs."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql.plan.steps import output_tiles

# A test run started in the background by a non-interactive shell inherits SIGINT ignored
# (POSIX), and so do its children: Ctrl-C must be Python's own here, and in each child below.
@pytest.fixture(autouse=True)
def python_ctrl_c():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


LONG_PLAN = r"""
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, time, numpy as np, eindecomp_sql as eds
path = sys.argv[1]
db = eds.connect(path)
a = np.random.default_rng(0).standard_normal((3000, 3000))
A = db.store("A", a, tile=(125, 125))


def slow(x, y):  # 576 tiles at 50 ms: ~15 s on 2 cores, ~2 s on 16, over at any tile
    time.sleep(0.05)  # (a GEMM is the wrong test: the planner makes it one BLAS call, ~1 s)
    return x * y


said = []

def running(p):  # the parent's cue: the plan has run a while and its tiles are not all done
    if not said and p.elapsed >= 0.3 and p.tiles_done < p.tiles:
        said.append(True)
        print("running", flush=True)

print("ready", flush=True)
try:
    db.einsum("ij,ij->ij", A, A, join=slow, out="C", progress=running)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", time.time(), flush=True)
    # the session still works, and C was never created
    print("tensors", sorted(db.tensors()), flush=True)
    print("sum", float(db.einsum("ij->", A).to_numpy()), flush=True)
db.close()
"""


def test_ctrl_c_interrupts_a_running_plan(tmp_path):
    path = str(tmp_path / "t.duckdb")
    proc = subprocess.Popen([sys.executable, "-c", LONG_PLAN, path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        # not a fixed sleep: CI once finished the GEMM within it, and the Ctrl-C came late
        assert proc.stdout.readline().strip() == "running"
        sent = time.time()
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = out.splitlines()
    assert lines and lines[0].startswith("interrupted"), out + err
    assert float(lines[0].split()[1]) - sent < 2.5, "KeyboardInterrupt came late"
    assert lines[1] == "tensors ['A']", out
    a = np.random.default_rng(0).standard_normal((3000, 3000))
    assert abs(float(lines[2].split()[1]) - a.sum()) < 1e-6 * abs(a).sum()
    with eds.connect(path) as db:  # and nothing half-written reached the file
        assert db.tensors() == ["A"]
        assert not db.backend.table_exists("C")


def test_progress_reports_steps_and_tiles():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 200))
    b = rng.standard_normal((200, 100))
    seen = []
    with eds.connect() as db:
        A = db.store("A", a, tile=(64, 64))
        B = db.store("B", b, tile=(50, 100))  # re-tiled before the product: two steps
        before = db.backend.kernels.finished()
        C = db.einsum("ij,jk->ik", A, B, progress=seen.append)
        after = db.backend.kernels.finished()
        np.testing.assert_allclose(C.to_numpy(), a @ b)
        plan = db.plan("ij,jk->ik", A, B)
        steps = len(plan.steps)
    # the kernels count every output tile once, with its bytes
    assert after[0] - before[0] == sum(output_tiles(s) for s in plan.steps)
    assert after[1] - before[1] >= a.shape[0] * b.shape[1] * 8
    assert steps >= 2
    assert {p.step for p in seen} == set(range(1, steps + 1))
    last = seen[-1]
    assert last.step == last.steps == steps and last.tiles_done == last.tiles > 0
    assert all(p.elapsed >= 0 and 0 <= p.tiles_done <= p.tiles for p in seen)


def test_progress_of_a_graph_plan(backend):
    g = eds.Graph()
    x = g.input("x", (64, 32), "float64")
    w = g.input("w", (32, 48), "float64")
    y = g.map("relu", g.einsum("bi,io->bo", x, w))
    plan = g.plan(workers=2, outputs=y)
    rng = np.random.default_rng(6)
    xs, ws = rng.standard_normal((64, 32)), rng.standard_normal((32, 48))
    seen = []
    with eds.connect(backend=backend) as db:
        out = plan.run(db, x=xs, w=ws, progress=seen.append)
        np.testing.assert_allclose(out.to_numpy(), np.maximum(xs @ ws, 0))
    assert seen and seen[-1].step == seen[-1].steps == len(plan.plan.steps)


def test_cancelling_one_sessions_plans_leaves_another_session_alone():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((40, 30))
    with eds.connect() as one, eds.connect() as two:
        A1, A2 = one.store("A", a, tile=(8, 8)), two.store("A", a, tile=(8, 8))
        one.backend.kernels.cancel.set()  # as a Ctrl-C in session one's plan does
        try:
            np.testing.assert_allclose(two.einsum("ij,kj->ik", A2, A2).to_numpy(), a @ a.T)
            with pytest.raises(eds.EinsumError, match="interrupted"):
                one.einsum("ij,kj->ik", A1, A1, out="G")
            assert not one.backend.table_exists("G")
        finally:
            one.backend.kernels.cancel.clear()
        np.testing.assert_allclose(one.einsum("ij,kj->ik", A1, A1).to_numpy(), a @ a.T)


def test_a_progress_callback_that_raises_stops_the_plan(backend):
    rng = np.random.default_rng(10)
    a = rng.standard_normal((1500, 1500))

    def boom(p):
        raise RuntimeError("callback says no")

    with eds.connect(backend=backend) as db:
        A = db.store("A", a, tile=(250, 250))
        with pytest.raises(RuntimeError, match="callback says no"):
            db.einsum("ij,jk->ik", A, A, out="C", progress=boom)
        assert db.tensors() == ["A"] and not db.backend.table_exists("C")
        np.testing.assert_allclose(db.einsum("ij->", A).to_numpy(), a.sum())


def test_ctrl_c_with_a_handler_that_does_not_raise(tmp_path):
    # asyncio's handler only cancels its task; a flag-setting handler returns: the interrupted
    # plan still has no result to give, so KeyboardInterrupt is raised, not a broken Tensor
    code = LONG_PLAN.replace('print("ready", flush=True)',
                             'import signal\nsignal.signal(signal.SIGINT, lambda *a: print("handler", flush=True))\n'
                             'print("ready", flush=True)')
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t.duckdb")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().strip() == "running"
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = out.splitlines()
    assert lines[:1] == ["handler"] and lines[1].startswith("interrupted"), out + err
    assert "tensors ['A']" in lines, out


def test_a_ctrl_c_at_the_end_of_a_plan_never_stops_the_next_one():
    """The watchdog is one thread kept between plans: a SIGINT byte written as a plan ends is
    drained with it, never read as the next plan's Ctrl-C (was 29 in 300 before)."""
    import signal

    a = np.ones((4, 4))
    with eds.connect() as db:
        for _ in range(60):
            fired = []

            def report(p):
                if not fired and p.tiles_done == p.tiles:  # the finished step's report
                    fired.append(True)
                    signal.raise_signal(signal.SIGINT)

            with pytest.raises(KeyboardInterrupt):
                db.einsum_numpy("ij,jk->ik", a, a, progress=report)
            db.einsum_numpy("ij,jk->ik", a, a)  # right away, no Ctrl-C: must not be interrupted


@pytest.mark.parametrize("out", [None, "C"])
def test_a_ctrl_c_after_the_last_statement_leaves_nothing_written(out):
    """A Ctrl-C that lands after the last statement but before the commit rolls the plan back
    (the caller gets KeyboardInterrupt: nothing may be written)."""
    import signal

    with eds.connect() as db:
        A = db.store("A", np.ones((4, 4)))

        def report(p):
            if p.tiles_done == p.tiles and p.step == p.steps:
                signal.raise_signal(signal.SIGINT)

        with pytest.raises(KeyboardInterrupt):
            db.einsum("ij,jk->ik", A, A, out=out, progress=report)
        tables = db.backend._run("SELECT table_name FROM duckdb_tables() ORDER BY 1")
        assert [t for (t,) in tables] == ["A", "eds_catalog", "eds_parts"] and db.tensors() == ["A"]


def test_a_progress_callback_may_use_the_session():
    """Callbacks run outside the watchdog's lock: one that calls into the session on the plan's
    own thread (at each step's end) neither deadlocks on the main thread nor on another thread.
    Between steps the callback runs on the watchdog's (or a ticker's) thread, where a call into
    the session waited for the plan, holding the watchdog (and its Ctrl-C) with it, and its
    error was lost with the plan committed (a documentation audit): refused there, the error
    stops the plan, nothing written."""
    code = """
import threading, time, numpy as np, eindecomp_sql as eds
def slow(x, y):
    time.sleep(0.05)
    return x * y
db = eds.connect()
A = db.store("A", np.random.default_rng(0).standard_normal((600, 600)), tile=(100, 100))
seen = []
def report(p, caller):
    if threading.current_thread() is caller:
        seen.append(db.tensors())
db.einsum("ij,jk->ik", A, A, progress=lambda p: report(p, threading.main_thread()))
def other():
    me = threading.current_thread()
    db.einsum("ij,jk->ik", A, A, progress=lambda p: report(p, me))
t = threading.Thread(target=other); t.start(); t.join()
print("ok", len(seen) > 0)
for where in ("main", "thread"):
    said = []
    def run():
        try:
            db.einsum("ij,ij->ij", A, A, join=slow, out="C", progress=lambda p: db.tensors())
        except eds.EinsumError as e:
            said.append("between the steps of a plan" in str(e))
    if where == "main":
        run()
    else:
        t = threading.Thread(target=run); t.start(); t.join()
    print(where, said, db.tensors())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ok True", "main [True] ['A']", "thread [True] ['A']"], out.stdout


def _signal_around_commit(before: bool, handler):
    """run_interruptible on this (the main) thread, with a SIGINT sent just before or just after
    the work passes its commit point; what the work returned and whether it was told to stop."""
    from eindecomp_sql.backends.running import Watch, run_interruptible
    from eindecomp_sql.udfs.pool import KernelState

    kernels = KernelState()
    watch = Watch(None, [], kernels)
    stopped = []

    def work():
        if before:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)  # the watchdog reads it
        committed = watch.commit()
        if not before:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
        return committed

    old = signal.signal(signal.SIGINT, handler)
    try:
        return run_interruptible(work, lambda: stopped.append(True), kernels, watch), stopped
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_ctrl_c_after_the_commit_point_leaves_the_result_standing():
    """A Ctrl-C during the COMMIT (CI once sent its SIGINT just as the GEMM ended) must not
    report a committed plan as stopped, nor interrupt the COMMIT: the caller's handler runs as
    if the signal came after the call returned."""
    calls = []
    committed, stopped = _signal_around_commit(False, lambda *a: calls.append(True))
    assert committed is True and stopped == [] and calls == [True]
    with pytest.raises(KeyboardInterrupt) as e:  # Python's own handler raises, as after any call
        _signal_around_commit(False, signal.default_int_handler)
    # ... marked: what it stopped had committed (the CLI said "rolled back" for a stored tensor)
    assert getattr(e.value, "eds_committed", False) is True
    with pytest.raises(KeyboardInterrupt) as e:
        _signal_around_commit(True, signal.default_int_handler)
    assert not getattr(e.value, "eds_committed", False)


def test_a_ctrl_c_before_the_commit_point_stops_the_plan():
    calls = []
    with pytest.raises(KeyboardInterrupt):
        _signal_around_commit(True, lambda *a: calls.append(True))
    assert calls == [True]


def test_a_ctrl_c_after_the_commit_leaves_no_temporary_result(monkeypatch):
    """A Ctrl-C that lands after the plan committed, before the result's Tensor exists, would
    leave a temporary result with no Tensor to drop it: the call drops it (einsum and graphs)."""
    with eds.connect() as db:
        A = db.store("A", np.ones((4, 4)))
        made = db._tensor

        def interrupted(*args, **kw):
            made(*args, **kw)  # the table is there, then the Ctrl-C
            raise KeyboardInterrupt

        monkeypatch.setattr(db, "_tensor", interrupted)
        with pytest.raises(KeyboardInterrupt):
            db.einsum("ij,jk->ik", A, A)
        g = eds.Graph()
        x = g.input("x", (4, 4), "float64")
        g.einsum("ij,jk->ik", x, x, name="y")
        with pytest.raises(KeyboardInterrupt):
            g.run(db, x=A)
        monkeypatch.undo()
        tables = db.backend._run("SELECT table_name FROM duckdb_tables() ORDER BY 1")
        assert [t for (t,) in tables] == ["A", "eds_catalog", "eds_parts"] and db.tensors() == ["A"]
        np.testing.assert_array_equal(db.einsum("ij,jk->ik", A, A).to_numpy(), np.full((4, 4), 4.0))


CTRL_C_IO = r"""
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import os, threading, time, numpy as np, eindecomp_sql as eds
db = eds.connect(memory="64MB")
a = np.random.default_rng(0).standard_normal((3000, 3000)).astype("float32")
Z = db.store("Z", a)
zeros = np.zeros_like(a)
calls = {"store": lambda: db.store("Z2", a, replace=True), "to_numpy": Z.to_numpy, "to_arrow": Z.to_arrow,
         "tensors": lambda: [db.tensors() for _ in range(200)]}  # catalog reads
for name, f in calls.items():
    t0 = time.time(); f(); full = time.time() - t0
    for i in range(8):  # a real SIGINT at 8 points of the call
        if name == "store":
            db.store("Z2", zeros, replace=True)
        timer = threading.Timer(full * (i + 0.5) / 8, lambda: os.kill(os.getpid(), signal.SIGINT))
        try:
            try:
                timer.start()  # inside: a short delay can fire before start() returns
                f(); got = "finished"
            except KeyboardInterrupt:
                got = "KeyboardInterrupt"
            except BaseException as e:
                got = "OTHER " + type(e).__name__ + ": " + str(e).splitlines()[0][:120]
            timer.join(); time.sleep(0.05)
        except KeyboardInterrupt:  # landed after the call returned
            pass
        if name == "store":  # the old tensor or the new one, whole; the new one only if the call got that far
            z = db.tensor("Z2").to_numpy()
            got += " old" if (z == 0).all() else " new" if (z == a).all() else " MIXED"
        print(name, i, got, flush=True)
print("after", sorted(db.tensors()), bool((Z.to_numpy() == a).all()), flush=True)  # the session still works
"""


def test_ctrl_c_during_store_and_reads_is_a_keyboard_interrupt(tmp_path):
    """DuckDB's "Query interrupted" surfaced from store (inside our EinsumError, a ValueError a
    caller may catch) and from reads as a RuntimeError: only plans were run interruptibly."""
    script = tmp_path / "ctrl_c_io.py"
    script.write_text(CTRL_C_IO)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert not [x for x in lines if " OTHER " in f" {x} " or "MIXED" in x], r.stdout
    assert len([x for x in lines if x.split()[0] in ("store", "to_numpy", "to_arrow", "tensors")]) == 32, r.stdout
    # a Ctrl-C early in the store rolls it back (it committed anyway once, after the signal)
    assert "store 0 KeyboardInterrupt old" in lines, r.stdout
    assert lines[-1] == "after ['Z', 'Z2'] True", r.stdout


SIGALRM_DURING_READS = r"""
import signal, time, numpy as np, eindecomp_sql as eds
def on_alarm(*a): raise TimeoutError("deadline")
signal.signal(signal.SIGALRM, on_alarm)
db = eds.connect()
for k in range(200): db.store(f"t{k}", np.ones(2))
seen = set()
for trial in range(8):
    signal.setitimer(signal.ITIMER_REAL, 0.03)
    deadline = time.time() + 5  # bounded: a handler's error that some layer swallowed ends no loop
    try:
        while time.time() < deadline: db.tensors()
        seen.add("lost")
    except BaseException as e:
        seen.add(type(e).__name__)
print(sorted(seen))
"""


def test_another_signal_handlers_error_during_a_read_is_not_called_ctrl_c(tmp_path):
    """duckdb-python reports any signal handler's error during a statement as RuntimeError
    ('Query interrupted'); a first fix called them all KeyboardInterrupt (a SIGALRM deadline, a
    SIGTERM handler's SystemExit): only a Ctrl-C our watch saw may say so."""
    script = tmp_path / "alarm.py"
    script.write_text(SIGALRM_DURING_READS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "KeyboardInterrupt" not in r.stdout and r.stdout.strip() != "[]", r.stdout


NO_PROGRESS = r"""
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import os, threading, time, numpy as np, eindecomp_sql as eds
db = eds.connect()
A = db.store("A", np.random.default_rng(0).standard_normal((3000, 3000)), tile=(125, 125))
db.einsum("i->", np.ones(3))  # a plan before: the watchdog now waits without a timeout
def slow(x, y):  # 576 tiles at 50 ms: ~15 s on 2 cores
    time.sleep(0.05)
    return x * y
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t = time.time()
try:
    db.einsum("ij,ij->ij", A, A, join=slow, out="C")
    print("finished", round(time.time() - t, 2), flush=True)
except KeyboardInterrupt:
    print("interrupted", round(time.time() - t, 2), sorted(db.tensors()), flush=True)
"""


def test_one_ctrl_c_stops_a_plan_run_without_progress(tmp_path):
    """The watchdog took its plan generation before its untimed wait, so the one Ctrl-C a plan
    without progress= got was read under the previous plan's generation and dropped: the plan
    ran to its end (progress= made the wait timed, which hid it from the other tests)."""
    script = tmp_path / "no_progress.py"
    script.write_text(NO_PROGRESS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[0] == "interrupted" and float(words[1]) < 6.0 and "['A']" in r.stdout, r.stdout


def test_a_stop_that_reaches_the_rollback_leaves_the_session_usable():
    """A stop decided on another thread (the watchdog) can reach the connection while the
    stopped plan rolls back, and DuckDB interrupts even a ROLLBACK: the transaction then stayed
    aborted and every later statement failed (CI met it once, in the test above). Here
    interrupts keep arriving during each first ROLLBACK (a ROLLBACK takes ~0.1 ms: one timed
    interrupt rarely meets it); at least one must land for the test to mean anything."""
    import threading

    import duckdb

    with eds.connect() as db:
        A = db.store("A", np.arange(6.0).reshape(2, 3))
        backend = db.backend
        run, landed = backend._run, []

        def watched(sql, params=None):
            if sql != "ROLLBACK" or watched.armed:
                return run(sql, params)
            watched.armed = True  # only the first attempt: the stop that comes late, once
            done = threading.Event()

            def stop_arriving():
                while not done.is_set():
                    backend._work.interrupt()

            hammer = threading.Thread(target=stop_arriving)
            hammer.start()
            try:
                return run(sql, params)
            except duckdb.InterruptException:
                landed.append(1)
                raise
            finally:
                done.set()
                hammer.join()

        backend._run = watched
        try:
            for _ in range(50):
                watched.armed = False
                with pytest.raises(RuntimeError, match="stopped"):
                    with backend._transaction():
                        run("CREATE TABLE big AS SELECT range AS a FROM range(300000)")
                        raise RuntimeError("stopped")
                assert db.tensors() == ["A"] and not backend.table_exists("big")
                if len(landed) >= 3:
                    break
        finally:
            backend._run = run
        assert landed, "no interrupt reached a ROLLBACK: the test did not test anything"
        np.testing.assert_allclose(db.einsum("ij->", A).to_numpy(), 15.0)


def test_a_plan_is_interrupted_once(monkeypatch):
    """A second Ctrl-C (or a callback's error after a Ctrl-C, or the callback raising on the
    plan's thread) must not interrupt the connection again: it would reach the rollback."""
    from eindecomp_sql.backends.running import Watch, _Job
    from eindecomp_sql.udfs.pool import KernelState

    stops = []
    job = _Job(lambda: stops.append(1), None)
    assert job.on_sigint()
    job.stop()
    assert job.on_sigint()
    job.stop()
    assert stops == [1]

    stops.clear()
    watch = Watch(lambda p: (_ for _ in ()).throw(ValueError("no")), [("step", 1)], KernelState())
    job = _Job(lambda: stops.append(1), watch)
    watch.fail = job.fail
    with pytest.raises(ValueError):
        watch.step_done()
    assert job.stopping() and isinstance(job.failed[0], ValueError)
    assert job.poll() is None  # the watchdog no longer calls the callback
    job.stop()
    assert stops == []  # the plan's thread is already on its way out: nothing to interrupt


def test_a_ctrl_c_in_a_calls_quick_statements_is_the_handlers_own_exception(monkeypatch):
    """A Ctrl-C landing in one of a call's unwatched statements (here a store's existence check,
    made slow) came out as duckdb-python's RuntimeError('Query interrupted'): CI met it under
    load. Now the SIGINT handler's own exception comes out; another signal's stays DuckDB's."""
    import threading

    class Stop(Exception):
        pass

    a = np.arange(12.0).reshape(3, 4)
    with eds.connect() as db:
        backend = db.backend
        quick = backend.table_exists

        def slow_check(name):
            # ~0.5 s: duckdb-python looks at signals between a statement's tasks, and this
            # aggregate's tasks are long, so the statement runs its course and then raises
            backend._run("SELECT sum(range) FROM range(400000000)")
            return quick(name)

        db.store("W", a)  # the first store imports modules: a Ctrl-C there is Python's own
        t0 = time.perf_counter()
        backend._run("SELECT sum(range) FROM range(400000000)")
        early = (time.perf_counter() - t0) / 10  # well inside the statement, on any machine

        monkeypatch.setattr(backend, "table_exists", slow_check)
        for handler, signum, expected in [(signal.default_int_handler, signal.SIGINT, KeyboardInterrupt),
                                          (lambda s, f: (_ for _ in ()).throw(Stop()), signal.SIGINT, Stop),
                                          (lambda s, f: (_ for _ in ()).throw(Stop()), signal.SIGALRM, RuntimeError)]:
            previous = signal.signal(signum, handler)
            timer = threading.Timer(early, lambda: os.kill(os.getpid(), signum))
            timer.start()
            try:
                with pytest.raises(expected):
                    db.store("Z", a)
            finally:
                timer.join()
                signal.signal(signum, previous)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ours is gone
        monkeypatch.undo()
        assert db.tensors() == ["W"]
        np.testing.assert_array_equal(db.store("Z", a).to_numpy(), a)


def test_a_ctrl_c_while_a_call_ends_leaves_the_session_whole(monkeypatch):
    """A Ctrl-C landing while a session call restored the SIGINT handler skipped the call's
    depth count (a review): the session's depth stayed 1, so no later call dropped its
    temporary results again. The depth now goes down first."""
    from eindecomp_sql.backends import running

    remove = running.CtrlCMark.remove
    once = []

    def interrupted_remove(self):
        if not once:
            once.append(1)
            signal.raise_signal(signal.SIGINT)
        remove(self)

    with eds.connect() as db:
        monkeypatch.setattr(running.CtrlCMark, "remove", interrupted_remove)
        with pytest.raises(KeyboardInterrupt):
            db.tensors()
        monkeypatch.undo()
        assert db._depth == 0
        for _ in range(3):
            db.einsum("i->", np.arange(4.0))  # temporary results, dropped by the next call
        db.tensors()
        left = db.connection.execute("SELECT count(*) FROM duckdb_tables() WHERE temporary").fetchall()[0][0]
        assert left <= 1


def test_a_late_interrupt_in_a_stopped_plans_cleanup_leaves_no_table_behind():
    """The stop's interrupt can land after the kernels already failed the statement: on the
    failure path's SET of the Arrow buffer size it skipped every drop after it, and a scratch
    table stayed (a review). The drops come first now, and each survives an interrupt."""
    import duckdb

    with eds.connect(tile_bytes=1 << 20, memory="300MB") as db:
        backend = db.backend
        A = db.store("A", np.random.default_rng(0).standard_normal((1500, 1500)), tile=(1500, 100))

        def ours():
            return sorted(r[0] for r in backend._run("SELECT table_name FROM duckdb_tables() WHERE "
                                                     "table_name NOT LIKE 'eds%'"))

        before = ours()
        run, state, hit = backend._run, {"failing": False}, []

        def late(sql, params=None):
            if state["failing"] and (sql.startswith("SET arrow_large_buffer_size") or sql.startswith("DROP")):
                state["failing"] = False
                hit.append(sql)
                raise duckdb.InterruptException("INTERRUPT Error: Interrupted!")  # the stop, arriving now
            return run(sql, params)

        def stop(p):
            if p.step == 1 and p.tiles_done == p.tiles:
                state["failing"] = True
                raise RuntimeError("stop")

        backend._run = late
        try:
            with pytest.raises(RuntimeError, match="stop"):
                db.einsum("ij,jk,kl->il", A, A, A, out="C", progress=stop)
        finally:
            backend._run = run
        assert hit, "no cleanup statement met the interrupt: the test tests nothing"
        assert ours() == before and db.tensors() == ["A"]


def test_a_stop_between_a_steps_statements_is_seen_before_the_next(monkeypatch):
    """A plan is interrupted once, and DuckDB drops an interrupt that meets no statement: a stop
    arriving between a step's batches must be seen before the next batch runs (a review), not
    only before the next step or at the commit."""
    from eindecomp_sql.backends import running

    state = {"after": None}

    def stopping(self):
        if state["after"] is not None and not self.failed:  # the stop, come between two batches
            self.failed.append(RuntimeError("stopped between batches"))
        return self.hit.is_set() or bool(self.failed)

    a = np.random.default_rng(2).standard_normal((2048, 1024), dtype=np.float32)
    with eds.connect(memory="100MB", tile_bytes=1 << 20) as db:
        A = db.store("A", a, tile=(128, 1024))
        plan = db.plan("ij,kj->ik", A, A)
        assert plan.steps[-1].batches >= 4, "no batches: the test tests nothing"
        ran = []
        run = db.backend._run

        last = len(plan.steps) - 1

        def writes(sql):  # a batch of a step's result: the first creates its table or part, the
            head = sql.lstrip().upper()  # next ones insert into the table or create parts
            return head.startswith("INSERT") or (head.startswith("CREATE") and ('"C"' in sql or "_eds_part_" in sql))

        def watched(sql, params=None):
            out = run(sql, params)
            ran.append(sql)
            if state["after"] is None and db.backend.kernels.device_step == last and writes(sql):
                state["after"] = len(ran)  # the last step's first batch has run
            return out

        monkeypatch.setattr(db.backend, "_run", watched)
        monkeypatch.setattr(running._Job, "stopping", stopping)
        with pytest.raises(RuntimeError, match="stopped between batches"):
            db.einsum("ij,kj->ik", A, A, out="C", progress=lambda p: None)
        monkeypatch.undo()
        assert state["after"] is not None, "the last step never ran: the test tests nothing"
        assert not [s for s in ran[state["after"]:] if writes(s)]
        assert db.tensors() == ["A"]


def test_a_ctrl_c_during_an_unwatched_rollback_still_rolls_back():
    """A Ctrl-C through Python's handler during a ROLLBACK outside a watched run (a drop's) came
    as RuntimeError('Query interrupted'), not a DuckDB error, so the rollback was not tried
    again and the transaction stayed aborted (a review). It is tried again, then raised."""
    with eds.connect() as db:
        db.store("A", np.arange(3.0))
        backend = db.backend
        run, once = backend._run, []

        def interrupted(sql, params=None):
            if sql == "ROLLBACK" and not once:
                once.append(1)
                raise RuntimeError("Query interrupted")
            return run(sql, params)

        backend._run = interrupted
        try:
            with pytest.raises(RuntimeError, match="Query interrupted"):
                with backend._transaction():
                    run("CREATE TABLE t AS SELECT 1 AS x")
                    raise ValueError("the block failed")
        finally:
            backend._run = run
        assert once and db.tensors() == ["A"] and not backend.table_exists("t")


HANDLER_ERRORS_EVERYWHERE = r"""
import contextlib, dis, os, signal, socket, sys, threading, time
import numpy as np
import eindecomp_sql as eds
import eindecomp_sql.session as session_module
from eindecomp_sql.backends import running
from eindecomp_sql.udfs import pool

signal.signal(signal.SIGINT, signal.default_int_handler)


class Deadline(Exception):
    pass  # what a signal handler raised: injected below where Python would run one


def handler_points(target, files, inject_at=None):
    # run target() tracing the frames of files' code, at every point where Python runs a
    # pending signal handler (a frame's first instruction, the one after a call returns, a
    # loop's jump back); raise Deadline at point inject_at, once. How many points, what raised
    points, raised, last = [0], [None], {}

    def trace(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        frame.f_trace_opcodes = True
        if event != "opcode":
            return trace
        before = last.get(id(frame))
        last[id(frame)] = dis.opname[frame.f_code.co_code[frame.f_lasti]]
        if before is None or before.startswith("CALL") or before == "JUMP_BACKWARD":
            k = points[0]
            points[0] += 1
            if k == inject_at:
                raise Deadline(k)
        return trace

    sys.settrace(trace)
    try:
        target()
    except BaseException as e:
        raised[0] = e
    finally:
        sys.settrace(None)
    return points[0], raised[0]


def slow(x, y):
    time.sleep(0.05)
    return x * y


files = {running.__file__, session_module.__file__, threading.__file__, pool.__file__, signal.__file__}
theirs_r, theirs_w = socket.socketpair()  # a wakeup fd of the caller's (asyncio has one)
theirs_w.setblocking(False)
signal.set_wakeup_fd(theirs_w.fileno())
db = eds.connect()
db.store("A", np.arange(6.0).reshape(2, 3))
db.tensors()  # the watchdog is up before counting
n, raised = handler_points(db.tensors, files)
assert raised is None and n > 20, n
for k in range(n):
    passed, raised = handler_points(db.tensors, files, inject_at=k)
    # a call may pass a point or two fewer than the first (nothing left to drop)
    assert isinstance(raised, Deadline) or (raised is None and passed <= k), (k, raised)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, k
    assert signal.set_wakeup_fd(theirs_w.fileno()) == theirs_w.fileno(), k
    assert running._dog.job is None, k
    assert not db.backend.kernels.cancel.is_set(), k
    assert not db.backend.stopper._jobs, k
# the same through a store and a plan: transactions, the kernel pool, temporary tables
from threadpoolctl import threadpool_info
blas_before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
import eindecomp_sql.backends.duckdb as duckdb_backend
import threadpoolctl
files.add(duckdb_backend.__file__)
files.add(threadpoolctl.__file__)
X = np.random.default_rng(0).standard_normal((30, 20))
db.store("X", X, tile=(10, 10))
work = lambda: db.einsum("ij,jk->ik", db.tensor("X"), db.store("Y", X.T, replace=True), out="Z", replace=True)
n2, raised = handler_points(work, files)
assert raised is None and n2 > 100, n2
for k in range(n2):
    passed, raised = handler_points(work, files, inject_at=k)
    # DuckDB reports an error raised in a kernel it ran on this thread as its own
    assert isinstance(raised, Deadline) or "Deadline" in str(raised) or (raised is None and passed <= k), (k, raised)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, k
    assert running._dog.job is None and pool._active == 0 and not pool._wide, k
    assert not db.backend.stopper._jobs, k  # no stop of db.interrupt() can reach a later statement
    assert set(db.tensors()) <= {"A", "X", "Y", "Z"}, (k, db.tensors())  # the session works
    if "Z" in db.tensors():
        np.testing.assert_allclose(db.tensor("Z").to_numpy(), X @ X.T)
assert not db.backend.open_transaction
# and the process's BLAS threads are its own again once a clean call has run
from threadpoolctl import threadpool_info
work()
assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == blas_before
# after it all: a Ctrl-C still stops a plan at once, and another signal's byte that came
# meanwhile reaches the caller's fd
theirs_r.setblocking(False)
with contextlib.suppress(BlockingIOError):
    while theirs_r.recv(4096):
        pass
signal.signal(signal.SIGUSR1, lambda *a: None)
A = db.store("A", np.random.default_rng(1).standard_normal((200, 200)), tile=(10, 10), replace=True)
threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
threading.Timer(0.4, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t = time.perf_counter()
try:
    db.einsum("ij,ij->ij", A, A, join=slow, out="B")  # 400 tiles at 50 ms: ~10 s on 2 cores
    print("not interrupted")
except KeyboardInterrupt:
    took = time.perf_counter() - t
    assert took < 6.0 and "B" not in db.tensors(), took
    theirs_r.settimeout(30)  # the timer thread may come late on a loaded machine
    assert bytes([signal.SIGUSR1]) in theirs_r.recv(4096)
    print("points", n, n2, flush=True)
"""


def test_a_signal_handlers_error_anywhere_in_a_watched_call_leaves_nothing_behind(tmp_path):
    """A SIGALRM handler's error (a deadline) can land wherever Python runs handlers: after any
    call returns, before its result is stored. One that landed as ``set_wakeup_fd`` returned
    lost the fd it displaced, and the next call's drain passed other signals' bytes to our own
    socket and read them back for ever (CI hung 240 s). One that landed after our SIGINT handler
    went in left it installed: every later Ctrl-C was swallowed. One inside a Condition's
    ``__enter__`` (``Event.clear``; the kernel pool's lock, in a kernel DuckDB ran on the main
    thread) left its lock held: the next call waited for ever. One as BEGIN returned left the
    transaction open: the session broke at the next BEGIN. Here the error is raised at each
    such point of a catalog read, then of a store and a plan (the session, its Ctrl-C mark,
    the watched statements, the DuckDB backend, and the threading and kernel-pool code they
    call); after each, the caller's SIGINT handler, its wakeup fd, the watchdog and the kernel
    pool must be as before and the session must work; at the end a Ctrl-C must still stop a
    plan. In a subprocess: what this catches is often a hang."""
    script = tmp_path / "everywhere.py"
    script.write_text(HANDLER_ERRORS_EVERYWHERE)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("points"), (r.stdout, r.stderr[-3000:])


OUR_FD_LEFT_BEHIND = r"""
import os, signal, threading, time, numpy as np, eindecomp_sql as eds
from eindecomp_sql.backends import running
db = eds.connect()
db.store("A", np.ones(3))
db.tensors()
signal.set_wakeup_fd(running._watchdog().writer.fileno())  # as a cut-short teardown once left it
signal.signal(signal.SIGUSR1, lambda *a: None)
stop = time.time() + 1.0
def usr1():
    while time.time() < stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.002)
threading.Thread(target=usr1).start()
n = 0
while time.time() < stop:
    db.tensors()
    n += 1
print("ended", n > 0, flush=True)
"""


def test_another_signals_byte_is_never_passed_to_our_own_socket(tmp_path):
    """Other signals' bytes go to the fd that listened before a plan (asyncio's). When that fd
    was our own watchdog's (a plan inside another's work, or a teardown a handler's error cut
    short), the drain wrote each byte back to the socket it reads: the call never ended."""
    script = tmp_path / "own_fd.py"
    script.write_text(OUR_FD_LEFT_BEHIND)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ended True" in r.stdout, (r.stdout, r.stderr)


NESTED_FORWARD = r"""
import os, signal, socket, time
from eindecomp_sql.backends import running
from eindecomp_sql.udfs import pool
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGUSR1, lambda *a: None)
theirs_r, theirs_w = socket.socketpair(); theirs_w.setblocking(False)
signal.set_wakeup_fd(theirs_w.fileno())  # the caller's (asyncio's)
k = pool.KernelState()
def inner_work():
    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.3)  # the watchdog reads it meanwhile
    return "inner"
def outer_work():  # a plan run inside another's work (a user's __array__ running an einsum)
    return running.run_interruptible(inner_work, lambda: None, k)
print(running.run_interruptible(outer_work, lambda: None, k))
theirs_r.settimeout(30)
print(list(theirs_r.recv(100)) == [int(signal.SIGUSR1)])
"""


def test_another_signals_byte_in_a_nested_plan_reaches_the_callers_fd(tmp_path):
    """A plan inside another plan's work finds our own socket as the fd that listened before
    it: its other signals' bytes go to the outer plan's previous fd (a review found the guard
    against feeding our own socket dropped them)."""
    script = tmp_path / "nested.py"
    script.write_text(NESTED_FORWARD)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["inner", "True"], (r.stdout, r.stderr)


def test_pyarrows_pandas_shim_is_loaded_before_any_call(tmp_path):
    """pyarrow imports pandas on its first to_numpy() and swallows a KeyboardInterrupt raised
    during that import: a Ctrl-C during a process's first export was lost and the file written
    (a trial, 6 runs of 10). A session's module loads it, so no call of ours is the first."""
    script = ("import sys, eindecomp_sql as eds\n"
              "assert 'pandas' not in sys.modules\n"
              "db = eds.connect()\n"
              "print('pandas' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", (r.stdout, r.stderr[-2000:])


CTRL_C_WHILE_OPENING = r"""
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import os, sys, threading, typing
import eindecomp_sql as eds
from eindecomp_sql.backends.duckdb import DuckDBBackend
path, where, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if where == "sigterm":  # the CLI's SIGTERM handling in a background job (SIGINT ignored)
    from eindecomp_sql.cli import _on_sigterm
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _on_sigterm()
if where in ("register", "sigterm"):  # a real signal whose handler runs inside create_function's C++ call
    calls, get_origin = [0], typing.get_origin
    def flaky(tp):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGINT if where == "register" else signal.SIGTERM)
            for _ in range(100): pass
        return get_origin(tp)
    typing.get_origin = flaky
else:  # a SIGINT during one of the statements that open the session
    run = DuckDBBackend._run
    def slow(self, sql, *a, **k):
        if "current_database" in str(sql) and not getattr(slow, "done", False):
            slow.done = True
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            self._work.execute("SELECT count(*) FROM range(3000000000)").fetchall()
        return run(self, sql, *a, **k)
    DuckDBBackend._run = slow
try:
    eds.connect(path)
    print("connected", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
except BaseException as e:
    print("OTHER", type(e).__name__, e, flush=True)
if where in ("register", "sigterm"):
    typing.get_origin = get_origin
else:
    DuckDBBackend._run = run
with eds.connect(path) as db:
    db.store("A", [1.0, 2.0])
    print("reopened", db.tensors(), flush=True)
"""


@pytest.mark.parametrize("where,n", [("register", 5), ("register", 60), ("sigterm", 60), ("statement", 0)])
def test_a_ctrl_c_while_a_session_opens_is_a_keyboard_interrupt(tmp_path, where, n):
    """A Ctrl-C whose handler ran inside duckdb-python's create_function (it runs typing code
    from C++) aborted the process ("terminate called after throwing nanobind::python_error",
    SIGABRT; a crash trial: 1 connect in 70, and the CLI's SIGTERM, which installs Python's
    SIGINT handler where SIGINT was ignored and passes itself on as one); one during the statements
    that open the session came out as RuntimeError('Query interrupted'). Both are now
    KeyboardInterrupt, and the file opens again."""
    script = tmp_path / "open.py"
    script.write_text(CTRL_C_WHILE_OPENING)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "t.duckdb"), where, str(n)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.splitlines() == ["KeyboardInterrupt", "reopened ['A']"], r.stdout + r.stderr[-2000:]


def test_a_ctrl_c_between_the_holds_puts_every_handler_back(monkeypatch):
    """sigint_held installs SIGTERM's holder, then SIGINT's: a Ctrl-C between the two left
    SIGTERM held for the rest of the process, every later SIGTERM dropped (a review)."""
    from eindecomp_sql.backends import running

    got = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    real = running._signal.signal

    fired = []

    def racy(signum, handler):  # (signal.signal calls it too)
        if signum == signal.SIGINT and not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C lands between the two installs
        return real(signum, handler)

    try:
        monkeypatch.setattr(running._signal, "signal", racy)
        with pytest.raises(KeyboardInterrupt):
            with running.sigint_held():
                pass
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_signals_held_around_c_calls_run_their_handlers_after_in_order():
    from eindecomp_sql.backends import running

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append("term"))
    try:
        signal.signal(signal.SIGINT, lambda s, f: seen.append("int"))
        with running.sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            assert seen == []  # held while the block runs
        assert seen == ["term", "int"]  # a SIGTERM first: the CLI's passes itself on as a SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
