"""Running a plan so that Ctrl-C stops it and a caller can watch it.

While DuckDB runs a statement the main thread sits inside a C++ call, and Python runs signal
handlers only between bytecodes of the main thread: a Ctrl-C waited until the statement ended
(a 6000³ GEMM ran ~20 s on) or surfaced as DuckDB's own "Query interrupted" RuntimeError.

So while a plan runs (on the main thread, as before) a watchdog thread (one per process, kept
between plans) waits on a socket that Python's C-level signal handler writes to at once
(``signal.set_wakeup_fd``). On SIGINT it
interrupts the connection and asks the tile kernels to stop between tasks
(the connection's ``udfs.pool.KernelState``); the statement fails, the transaction rolls back, and then the caller's
SIGINT handler runs: KeyboardInterrupt for Python's default one. Our own Python-level handler
only records the signal meanwhile, so nothing is raised half-way through a rollback. The
watchdog also polls progress.

(A first version ran the statements on a helper thread while the main thread waited; the
tile buffers the allocator tuning keeps for reuse were then page-faulted in afresh on many
calls — DuckDB's client thread is not a neutral choice — so DuckDB stays on the calling thread.)
"""

from __future__ import annotations

import _signal  # C: ``signal.signal`` is a Python wrapper (see run_interruptible)
import contextlib
import functools
import os
import select
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..udfs import pool

TICK_SECONDS = 0.1


@dataclass(frozen=True)
class StepProgress:
    """What a ``progress=`` callable receives, several times a second and once per finished step.

    ``step`` counts from 1 to ``steps``; ``tiles_done`` of ``tiles`` are the output tiles of this
    step the kernels have finished (``bytes_done`` their bytes); ``elapsed`` is seconds since the
    plan started; ``description`` names the step as EXPLAIN does."""

    step: int
    steps: int
    description: str
    tiles_done: int
    tiles: int
    bytes_done: int
    elapsed: float


class Watch:
    """Progress of one plan: the backend says which step runs, its kernels count tiles."""

    def __init__(self, report: Callable[[StepProgress], None] | None, steps: list[tuple[str, int]],
                 kernels: pool.KernelState):
        self.report = report
        self.steps = steps  # (description, output tiles) per step
        self.stopping: Callable[[], bool] = lambda: False  # Ctrl-C or a failed callback (run_interruptible)
        # asked once, just before the backend commits: False means roll back; after True, a
        # Ctrl-C no longer stops the plan (it came too late: the result is the caller's)
        self.commit: Callable[[], bool] = lambda: not self.stopping()
        # the callback's error on the plan's own thread (end of a step): the plan stops by
        # raising it; recorded so that the watchdog does not stop the plan a second time
        # (its interrupt would reach the rollback)
        self.fail: Callable[[BaseException], None] = lambda error: None
        self.kernels = kernels
        self.start = time.perf_counter()
        self.current = 0
        self._base = kernels.finished()

    def begin(self, k: int) -> None:
        self.current = k
        self._base = self.kernels.finished()

    def step_done(self) -> None:
        """The current step finished (called on the plan's thread): report it."""
        try:
            self.poll(finished=True)
        except BaseException as error:
            self.fail(error)
            raise

    # the user's callback is not kernel code, wherever it is called from (a kernel call's thread
    # ticks progress too): it may use the session (pool.in_kernel)
    @pool.outside_kernel
    def poll(self, finished: bool = False) -> None:
        if self.report is None or not self.steps:
            return
        desc, total = self.steps[self.current]
        tiles, nbytes = (a - b for a, b in zip(self.kernels.finished(), self._base))
        if finished:
            tiles = total
        self.report(StepProgress(self.current + 1, len(self.steps), desc, min(tiles, total), total, nbytes,
                                 time.perf_counter() - self.start))


class _Job:
    """One plan the watchdog looks after: how to stop it, whether Ctrl-C came, its progress."""

    def __init__(self, stop: Callable[[], None], watch: Watch | None):
        self._stop = stop
        self._stopped = False
        self.watch = watch if watch is not None and watch.report is not None else None
        self.hit = threading.Event()
        self.failed: list[BaseException] = []  # a progress callback's error
        self.old_fd = -1
        self.displaced: _Job | None = None  # the watchdog's job before this one (``arm``)
        # the commit point: a SIGINT before it stops the plan (``hit``), one after it is
        # ``late``: the plan committed, and the caller's handler runs as if the signal had
        # come just after the call returned (Python's default raises KeyboardInterrupt then)
        self.gate = threading.Lock()
        self.committed = False
        self.late = False

    def stopping(self) -> bool:
        return self.hit.is_set() or bool(self.failed)

    def check(self) -> None:
        """Raise the stop asked of this work (``Stopper.interrupt``), if one was: an engine whose
        jobs are cancelled calls this between them, since a job started after the cancel runs."""
        if self.failed:
            raise self.failed[0]

    def stop(self) -> None:
        """Interrupt the plan, once: a second Ctrl-C (or a callback error after a Ctrl-C) while
        the stopped plan rolls back would interrupt the ROLLBACK itself."""
        with self.gate:
            if self._stopped:
                return
            self._stopped = True
        self._stop()

    def fail(self, error: BaseException) -> None:
        """The progress callback raised on the plan's own thread, which stops by raising it."""
        with self.gate:
            if not self.committed:
                self._stopped = True  # nothing to interrupt: the plan is on its way out
                self.failed.append(error)

    def commit(self) -> bool:
        """The backend is about to commit: True if it may (nothing stopped the plan), and from
        then on a Ctrl-C is late. Under ``gate`` against the watchdog; the Python-level handler
        (on this, the main thread, between any two bytecodes) takes no lock, so ``hit`` is
        looked at again once ``committed`` is set."""
        with self.gate:
            self.committed = True
            if self.stopping():
                self.committed = False
                return False
            return True

    def on_sigint(self) -> bool:
        """A SIGINT came: True if it stops the plan (the caller then calls ``stop``)."""
        if self.committed:
            self.late = True
            return False
        self.hit.set()
        return True

    def poll(self) -> BaseException | None:
        """Report progress (on the watchdog's or a ticker's thread); the callback's error, if it
        raised."""
        if self.watch is None or self.stopping():
            return None
        _ticking.active = True  # (a session call from the callback here: ``ticking``)
        try:
            self.watch.poll()
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread
            return e
        finally:
            _ticking.active = False
        return None


_ticking = threading.local()


def ticking() -> bool:
    """Whether this thread is calling a progress callback between a plan's steps (the
    watchdog's or a ticker's thread, not the plan's own)."""
    return getattr(_ticking, "active", False)


class _Watchdog:
    """One thread per process, started with the first plan run on the main thread and kept:
    it waits on the socket the C-level signal handler writes to (``signal.set_wakeup_fd``)
    and ticks progress. Starting a thread per plan cost ~0.3 ms on an idle machine and
    several ms on a busy one, on every small einsum.

    Each plan that arms it gets a new ``generation``: bytes read while one plan was current are
    never applied to the next (a Ctrl-C at the end of a plan must not stop the following one).
    Progress callbacks run outside the lock, so one that uses the session (whose finishing plan
    waits on this lock) cannot deadlock it."""

    def __init__(self):
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.lock = threading.Lock()
        self.job: _Job | None = None
        self.generation = 0
        threading.Thread(target=self._loop, name="eds-watchdog", daemon=True).start()

    def wake(self) -> None:
        try:
            self.writer.send(b"\0")
        except OSError:
            pass

    def arm(self, job: _Job) -> None:
        """Make ``job`` current; the job it displaces (a plan run on the main thread from inside
        another's work: a user's ``__array__`` that runs an einsum) is put back by ``disarm``."""
        with self.lock:
            job.displaced = self.job  # no call between these two: nothing can run in between
            self.job = job
            self.generation += 1

    def disarm(self, job: _Job) -> None:
        """``job`` is done (the wakeup fd already given back): forget it, and drain what the
        signal handler wrote meanwhile, passing other signals' bytes on. Idempotent (the
        teardown retries it, see ``run_interruptible``)."""
        with self.lock:
            if self.job is job:
                self.job = job.displaced
            self.generation += 1
            self.reader.setblocking(False)
            try:
                while True:
                    data = self.reader.recv(4096)
                    if not data:
                        break
                    self._forward(job, data)
            except (BlockingIOError, InterruptedError):
                pass
            finally:
                self.reader.setblocking(True)

    def _forward(self, job: _Job, data: bytes) -> None:
        others = bytes(b for b in data if b not in (0, signal.SIGINT))
        # other signals: to whoever listened before (asyncio). Never to our own socket: a byte
        # passed to ourselves from the drain in ``disarm`` is read back by it, for ever (CI
        # hung so once, when a teardown cut short by a SIGALRM handler's error left our fd
        # installed). A plan inside another plan's work finds ours as the fd before it: the
        # outer plan's fd is the one
        fd, outer = job.old_fd, job
        while fd == self.writer.fileno() and outer.displaced is not None:  # nested: the outer's
            outer = outer.displaced
            fd = outer.old_fd
        if others and fd not in (-1, self.writer.fileno()):
            try:
                os.write(fd, others)
            except OSError:
                pass

    def _loop(self) -> None:
        while True:
            # not holding the job while waiting: a finished plan's objects (its progress
            # callback, DuckDB results it refers to) must go when the plan goes
            ticking = getattr(self.job, "watch", None) is not None
            ready, _, _ = select.select([self.reader], [], [], TICK_SECONDS if ticking else None)
            # the generation when the byte is read, not when the wait began: a plan armed
            # during an untimed wait (any plan without progress=) had its one Ctrl-C read under
            # the previous plan's generation and dropped; it stopped only when it ended. A
            # byte written during an earlier plan is drained by its disarm before the next arms.
            gen = self.generation
            try:
                data = self.reader.recv(64) if ready else b""
            except (BlockingIOError, InterruptedError):  # drained by disarm meanwhile
                data = b""
            self._handle(data, gen)

    def _handle(self, data: bytes, gen: int) -> None:
        with self.lock:
            job = self.job
            if job is None or gen != self.generation:
                return  # read while another plan (or none) was current
            self._forward(job, data)
            if signal.SIGINT in data:
                with job.gate:
                    stops = job.on_sigint()
                if stops:  # not once committed: an interrupt could reach the COMMIT itself
                    job.stop()
                return
        error = job.poll()  # outside the lock (see the class docstring)
        if error is not None:
            with self.lock:
                with job.gate:
                    stops = self.job is job and gen == self.generation and not job.committed and not job.stopping()
                    if stops:
                        job.failed.append(error)
                if stops:
                    job.stop()


_dog: _Watchdog | None = None
_dog_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    global _dog
    with _dog_lock:
        if _dog is None:
            _dog = _Watchdog()
        return _dog


def _forget_watchdog() -> None:  # a forked child has the socket but not the thread
    global _dog
    _dog = None


os.register_at_fork(after_in_child=_forget_watchdog)


@contextlib.contextmanager
def sigint_held():
    """Hold a SIGINT (and a SIGTERM) back while C++ code calls Python code (on the main thread,
    where Python runs signal handlers), and run the handlers when the block ends. duckdb-python's
    ``create_function`` runs typing code from C++, and its import initialises enums there:
    a handler's KeyboardInterrupt raised inside became a C++ exception nothing catches, and
    the process aborted (SIGABRT, "terminate called after throwing nanobind::python_error": a
    crash trial, 1 Ctrl-C in 70 during ``connect()``, and the CLI's SIGTERM, which it turns into
    a SIGINT). Only around such calls: a Ctrl-C there waits a few milliseconds."""
    # SIGTERM too: the CLI's handler passes it on as a SIGINT, and where SIGINT was ignored (a
    # background job) it installs Python's own first, which then raised in the C++ call
    held = [s for s in (signal.SIGTERM, signal.SIGINT) if callable(signal.getsignal(s))] \
        if threading.current_thread() is threading.main_thread() else []
    if not held:
        yield
        return
    came: list = []

    def hold(signum, frame):
        came.append((signum, frame))

    previous: dict = {}
    try:
        # installed one by one inside the try, each recorded by C code (no handler runs between
        # an install and the record of what it displaced), so a Ctrl-C between two installs
        # puts back the first (a review: SIGTERM left held for the rest of the process)
        for s in held:
            previous.update(zip((s,), map(_signal.signal, (s,), (hold,))))
        yield
    finally:
        _put_back(previous, came, hold)


def _put_back(previous: dict, came: list, hold) -> None:
    """``sigint_held``'s end: SIGTERM's handler back and its held signals run first (the CLI's
    passes itself on as a SIGINT, which is then still held, so none is lost), then SIGINT's."""
    try:
        if signal.SIGTERM in previous:
            _signal.signal(signal.SIGTERM, previous[signal.SIGTERM])
            for signum, frame in [c for c in came if c[0] == signal.SIGTERM]:
                previous[signum](signum, frame)
    finally:
        if signal.SIGINT in previous:
            if signal.getsignal(signal.SIGINT) is hold:  # (not replaced by a handler just run)
                _signal.signal(signal.SIGINT, previous[signal.SIGINT])
            for signum, frame in [c for c in came if c[0] == signal.SIGINT]:
                previous[signum](signum, frame)


class CtrlCMark:
    """For one session call on the main thread: whether a SIGINT came. duckdb-python checks
    signals while a statement runs and, when a handler raises, interrupts the statement and
    raises RuntimeError('Query interrupted'), the handler's own exception lost. Plans, stores
    and reads run watched (``run_interruptible``), but a call's quick statements around them
    (catalog lookups, existence checks) do not: watching each costs ~0.05 ms. A Ctrl-C that
    landed in one (CI met it under load: a ``store``'s first checks) came out as that
    RuntimeError. This wraps the caller's SIGINT handler for the whole call (~9 us on one core), so such a
    RuntimeError is known for a Ctrl-C's and the SIGINT handler's own exception raised instead
    (KeyboardInterrupt); another signal's handler's error stays what DuckDB made of it.

    Nothing is installed by the constructor: ``install`` inside a ``try``, ``settle(mark.remove)``
    in its ``finally``. ``remove`` also ends the call for ``stopper`` (``Session.interrupt``):
    one undo, where two calls in a ``finally`` could be cut apart by a signal handler's error."""

    def __init__(self, stopper: Stopper | None = None):
        self.raised: BaseException | None = None
        self._stopper = stopper
        self._installed: list = []  # the handler ``install`` displaced, kept by C (see below)

        def mark(signum, frame):
            try:
                return self._installed[0](signum, frame)
            except BaseException as error:  # what DuckDB is about to lose
                self.raised = error
                raise

        self._mark = mark

    def install(self) -> None:
        """Wrap the SIGINT handler; call it inside the ``try`` whose ``finally`` calls ``remove``
        (see ``settle``). The displaced handler is kept by C code inside the call that installs
        the mark: a signal handler's error raised as that call returns would otherwise lose it."""
        if threading.current_thread() is not threading.main_thread():
            return
        if not callable(signal.getsignal(signal.SIGINT)):  # ignored, or a C handler: nothing to wrap
            return
        self._installed.extend(map(_signal.signal, (signal.SIGINT,), (self._mark,)))

    def remove(self) -> None:
        """Put the caller's handler back, and end the call for the stopper; idempotent."""
        if self._stopper is not None:
            self._stopper.done()
        if self._installed and signal.getsignal(signal.SIGINT) is self._mark:
            signal.signal(signal.SIGINT, self._installed[0])

    def translate(self, error: BaseException) -> BaseException:
        """What the call should raise for ``error``: the SIGINT handler's own exception (Python's
        default: KeyboardInterrupt) where DuckDB replaced it."""
        if self.raised is not None and isinstance(error, RuntimeError) and str(error) == "Query interrupted":
            return self.raised
        return error


# a call that waits for the session (its turn): not in progress, so not stopped
WAITING = object()


class Stopper:
    """``Session.interrupt()``, from any thread: stops the work of the session's calls in
    progress as a progress callback's error stops it (the statement interrupted, the kernels
    cancelled between tasks, nothing committed), and every later piece of work of such a call
    before it starts (a call may run several: a table packed, then the plan). A call past its
    commit point finishes: the interrupt came too late for it. A job runs a session call per
    step: an interrupt between two steps finds no call in progress.

    One per backend; it takes no session lock (the call it stops holds that). Calls are kept
    per thread (``thread ident -> the stop asked of it``): a store reads its source before it
    takes the session, beside another thread's call, and one shared flag let either thread's
    end forget the other's stop (a review). ``call`` and ``done`` set and drop a thread's entry,
    not a count, and a call that takes the session starts without a stop asked before it
    (``fresh``): a signal handler's error may land anywhere in a call's start and end, and the
    worst a ``done`` so missed leaves is an ``interrupt()`` that says True with nothing running."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: list[_Job] = []
        # thread -> the stop asked of its call (None: none; WAITING: none, and it waits its turn)
        self._calls: dict[int, BaseException | object | None] = {}

    def call(self, fresh: bool = True) -> None:
        """A session call begins on this thread (or a store starts reading its source, before it
        takes the session); a stop asked from now on is for it, until ``done``; one asked before
        it is forgotten if ``fresh``."""
        me = threading.get_ident()
        with self._lock:
            if fresh or self._calls.get(me, WAITING) is WAITING:
                self._calls[me] = None

    def waiting(self) -> None:
        """This thread's call (a store that has read its source) now waits for the session: a
        stop asked until it takes it (``call(fresh=False)``) is not for it, as for every call
        waiting its turn; one asked before stays. One interrupt() stopped the running call and
        both stores waiting behind it, 10 trials of 10 (a soak trial)."""
        me = threading.get_ident()
        with self._lock:
            if me in self._calls and self._calls[me] is None:
                self._calls[me] = WAITING

    def done(self) -> None:
        """This thread's call ended: a stop asked of it is forgotten."""
        me = threading.get_ident()
        with self._lock:
            self._calls.pop(me, None)

    def begin(self, job: _Job) -> None:
        """``job`` starts on this thread: raise the stop asked of its call instead, if any."""
        with self._lock:
            pending = self._calls.get(threading.get_ident())
            if isinstance(pending, BaseException):
                raise pending
            self._jobs.append(job)

    def check(self) -> None:
        """Raise the stop asked of this thread's call, if any: for work of ours between an
        engine's jobs (a top-k ranking a result a batch at a time, in Python)."""
        with self._lock:
            pending = self._calls.get(threading.get_ident())
        if isinstance(pending, BaseException):
            raise pending

    def end(self, job: _Job) -> None:
        """``job`` ended (idempotent); under the lock, so that no stop reaches it afterwards (its
        interrupt would land on the connection's next statement)."""
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def interrupt(self, error: BaseException) -> bool:
        """Stop what runs now with ``error`` (raised by the calls); False if no call was in progress."""
        with self._lock:
            if all(pending is WAITING for pending in self._calls.values()):
                return False
            for thread, pending in self._calls.items():
                if pending is None:
                    self._calls[thread] = error
            for job in self._jobs:
                with job.gate:
                    stops = not job.committed and not job.stopping()
                    if stops:
                        job.failed.append(error)
                if stops:
                    job.stop()  # the kernels' cancel flag and DuckDB's interrupt: neither blocks
            return True


@contextlib.contextmanager
def stoppable(stopper: Stopper, stop: Callable[[], None]):
    """Work of a session call on an engine that runs its statements elsewhere (Spark):
    ``Session.interrupt()`` stops it by calling ``stop`` (which cancels the engine's running
    jobs; it must not block), and the work raises the interrupt at its next ``job.check()``
    (between its jobs) or ``job.commit()`` (False: the work must roll back). Yields the job.
    An error the stopped job raised (its cancelled job's) gives way to the interrupt, as in
    ``run_interruptible``. An interrupt already asked of this call raises on entry."""
    job = _Job(stop, None)
    stopper.begin(job)
    try:
        yield job
    except BaseException as e:
        if job.failed and e is not job.failed[0] and not isinstance(e, KeyboardInterrupt):
            raise job.failed[0] from e
        raise
    finally:
        settle(lambda: stopper.end(job))


def run_interruptible(work: Callable[[], object], interrupt: Callable[[], None], kernels: pool.KernelState,
                      watch: Watch | None = None, stopper: Stopper | None = None) -> object:
    """``work()`` on this thread; Ctrl-C interrupts it cleanly, progress is polled. A progress
    callback that raises stops the plan the same way, and its error is raised; so does
    ``stopper.interrupt`` from another thread (``Session.interrupt``)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    # signals reach only the main thread; a SIGINT that is ignored, or handled by C code we
    # cannot call, is left alone
    catch = main and callable(previous)
    if not catch and (watch is None or watch.report is None) and stopper is None:
        return work()

    def stop_plan():
        kernels.cancel.set()
        try:
            interrupt()
        except Exception:  # noqa: BLE001 - the statement may have just finished
            pass

    job = _Job(stop_plan, watch)
    if watch is not None:
        watch.stopping = job.stopping
        watch.commit = job.commit  # the backend asks before it commits
        watch.fail = job.fail
    dog = _watchdog() if catch else None
    # progress on another thread: a ticker for this plan only (off the main thread no signal
    # handler runs, so nothing below can be cut short there)
    ticker = _Ticker(job) if not catch and job.watch is not None else None
    # What the setup changes, each kept by C code inside the very call that changes it
    # (``_signal.signal``: ``signal.signal`` is Python code that converts the result). Python
    # runs signal handlers after a call returns and before its result is stored: a SIGALRM
    # handler's error there lost the fd ``set_wakeup_fd`` had displaced (CI hung on it, see
    # ``_Watchdog._forward``), or left our SIGINT handler installed, which swallows every
    # later Ctrl-C. With the setup inside the ``try`` and the teardown retried, whatever was
    # changed is put back.
    handlers: list = []
    fds: list = []
    error = None
    try:
        if stopper is not None:
            stopper.begin(job)  # an interrupt already asked of this call raises here
        if catch:
            handlers.extend(map(_signal.signal, (signal.SIGINT,), (lambda signum, frame: job.on_sigint(),)))
            fds.extend(map(_set_wakeup_fd, (dog.writer.fileno(),)))
            job.old_fd = fds[0]
            dog.arm(job)  # the watchdog stops the plan (our handler above only records)
            if job.watch is not None:
                dog.wake()  # out of its untimed wait: this plan's progress ticks
        result = work()
    except BaseException as e:
        if not job.stopping():
            raise
        result, error = None, e  # the stopped statement's error: what stopped it speaks instead
    finally:
        # A loop with no call outside its ``try`` (a handler may raise after any call): the
        # teardown is idempotent and runs to its end; a handler's error is raised after it.
        late_error, attempts = None, 0
        while True:
            try:
                _teardown(job, dog, ticker, handlers, fds, kernels, stopper)
                break
            except BaseException as e:  # noqa: BLE001 - raised below, once the teardown ended
                late_error = late_error or e
                attempts += 1
                if attempts > 100:
                    raise
        if late_error is not None:
            raise late_error
    if job.hit.is_set():
        previous(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt here
        # a handler that returns (asyncio's cancels its task; a flag-setter) still gets no result
        raise KeyboardInterrupt from error
    if job.late:  # after the commit: the result stands, the handler runs as after the call
        try:
            previous(signal.SIGINT, None)
        except KeyboardInterrupt as late:
            # marked: what it stopped had committed (the CLI said "interrupted", exit 130, "the
            # running step rolled back", for a store that was there: a crash trial)
            late.eds_committed = True
            raise
    if job.failed:
        raise job.failed[0]
    return result


def settle(undo: Callable[[], None]) -> None:
    """Run an idempotent ``undo`` to its end, though a signal handler raise in it (a SIGALRM
    deadline): retried, and the handler's first error raised after. Calling this is itself a
    point where a handler may run: write the loop out in a ``finally`` where nothing may be
    left undone (``run_interruptible``)."""
    late_error, attempts = None, 0
    while True:
        try:
            undo()
            break
        except BaseException as e:  # noqa: BLE001 - raised below, once undone
            late_error = late_error or e
            attempts += 1
            if attempts > 100:
                raise
    if late_error is not None:
        raise late_error


# C, not a Python function: a handler could run between a Python wrapper's call and its return
_set_wakeup_fd = functools.partial(signal.set_wakeup_fd, warn_on_full_buffer=False)


def _teardown(job: _Job, dog: _Watchdog | None, ticker: _Ticker | None, handlers: list, fds: list,
              kernels: pool.KernelState, stopper: Stopper | None) -> None:
    """Undo ``run_interruptible``'s setup, what of it was done; idempotent."""
    if stopper is not None:
        stopper.end(job)
    if ticker is not None:
        ticker.end()
    if fds:
        job.old_fd = fds[0]
        # the wakeup fd first: after it, nothing more is written for this plan, and what was
        # written is drained (never read by the next plan)
        signal.set_wakeup_fd(fds[0])
    if dog is not None:
        dog.disarm(job)
    if handlers:
        signal.signal(signal.SIGINT, handlers[0])
    kernels.cancel.clear()


class _Ticker:
    """Progress for a plan run off the main thread (no signals to watch): a thread that ticks.

    Not joined at the end (a callback may be waiting for the session the plan's caller still
    holds); a lock makes sure a callback's failure never stops anything once the plan ended
    (the next plan's kernels would find the cancel flag set)."""

    def __init__(self, job: _Job):
        self.job = job
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="eds-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            error = self.job.poll()
            if error is not None:
                with self._lock:
                    with self.job.gate:
                        stops = not self._stop.is_set() and not self.job.committed and not self.job.stopping()
                        if stops:
                            self.job.failed.append(error)
                    if stops:
                        self.job.stop()

    def end(self) -> None:
        with self._lock:
            self._stop.set()
