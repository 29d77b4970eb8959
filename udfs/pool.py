"""The kernel threads: a process-wide pool sized to the machine's cores, BLAS at one thread
inside each kernel thread (``THREADS`` of them; "workers" are a plan's join tasks, not these).

DuckDB hands a UDF whole vectors (up to 2,048 rows), so a join of a few large tiles arrives in
one call on one DuckDB thread; parallelism must come from inside the call. Kernels split their
work into tasks (per tile, or per slice of an output label when there are fewer tiles than
kernel threads) and run them here. With BLAS at one thread per kernel thread, DuckDB threads,
BLAS threads and kernel threads never oversubscribe the cores: measured on 2 cores, OpenBLAS at
its default next to DuckDB's threads fell from ~60-95 to 2-7 GFLOP/s for 256² matmuls.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import threadpoolctl
from threadpoolctl import ThreadpoolController

try:
    THREADS = len(os.sched_getaffinity(0))
except AttributeError:  # not on Linux
    THREADS = os.cpu_count() or 1

_pool: ThreadPoolExecutor | None = None
class Cancelled(RuntimeError):
    """Raised inside a kernel when the plan it serves was interrupted."""


# the device cache's tokens for the values named for one run of a plan (those it computes, and
# its array operands) start with this (backends/duckdb.py); stored tensors' tokens never do
RUN_TOKEN = "run"


class Flag:
    """A flag that kernels read between tasks and nothing waits on. Not ``threading.Event``: its
    ``set`` and ``clear`` take a Condition in Python code, and a signal handler's error raised
    in there (a SIGALRM deadline landing as a plan's teardown clears the cancel flag, on the
    main thread) left the Condition's lock held: the next ``clear`` waited for ever. One
    attribute store cannot be cut half-way."""

    __slots__ = ("_on",)

    def __init__(self):
        self._on = False

    def set(self) -> None:
        self._on = True

    def clear(self) -> None:
        self._on = False

    def is_set(self) -> bool:
        return self._on


class KernelState:
    """What one connection's kernels share with its backend: a cancel flag (Ctrl-C during a
    plan, backends/running.py: kernels stop between tasks instead of finishing a call that may
    hold seconds of work; the statement fails and rolls back) and a count of the output tiles
    finished (progress). One per backend, so interrupting one session's plan never cancels
    another's, and concurrent plans do not count each other's tiles."""

    def __init__(self):
        self.cancel = Flag()
        self._lock = threading.Lock()
        self._tiles = 0
        self._bytes = 0
        # a device session's tiles kept on the device (udfs/device_cache.py), and while a plan
        # runs, the token of each stored input (value name -> token) its tiles are named by
        self.device_cache = None
        self.device_xp: str | None = None  # ... and the device whose namespace its kernels use ("cuda")
        self.device_tokens: dict[str, str] = {}
        # ... and the plan's future, for the cache's evictions: the tokens each step reads, and
        # the step running now (udfs/device_cache.py)
        self.device_reads: list[frozenset] = []
        self.device_step = 0
        # values whose result tiles stay on the device instead of going back to DuckDB (every
        # reader runs there: plan.kernel_spec.device_only_results)
        self.device_keep: frozenset = frozenset()
        # while a plan runs: its array operands the SQL hands as NULL tiles, which kernels read
        # from the caller's memory instead (value name -> (array, tile shape); backends/duckdb.py)
        self.host_arrays: dict = {}
        # ... and its results returned as arrays, which kernels write straight into (value name ->
        # (array, tile shape)): their tiles never enter DuckDB either
        self.host_results: dict = {}
        # bytes the device kernels sent to the device, and (when a list) the tiles each kernel
        # call read and wrote, in order: what bench/device_bytes.py compares with Belady's count
        self.device_sent = 0
        self.device_returned = 0  # ... and copied back to the host
        # ... and tile bytes a statement handed a kernel though the device held them already
        # (a join hands a tile once per row it meets; sending ahead avoids it: device_cache.py)
        self.device_handed_again = 0
        self.device_trace: list | None = None

    def next_use(self, tid) -> float:
        """Steps until tile ``tid`` (token, keys) is read again: 0 if the running step reads its
        value, else later in the running plan, or, for a stored tensor's, in the next run of it
        (taken to be this plan again), else never (inf). A value named for the run (one it
        computes, an array operand) dies with the run."""
        token, reads, now = tid[0], self.device_reads, self.device_step
        n = len(reads)
        if n and token in reads[now]:  # the running step may read it again (a join repeats tiles)
            return 0
        ahead = n - 1 - now if token.startswith(RUN_TOKEN) else n
        for d in range(1, ahead + 1):
            if token in reads[(now + d) % n]:
                return d
        return float("inf")

    def note(self, count: int, nbytes: int) -> None:
        with self._lock:
            self._tiles += count
            self._bytes += nbytes

    def finished(self) -> tuple[int, int]:
        """(tiles, bytes) the kernels of this connection have finished so far."""
        with self._lock:
            return self._tiles, self._bytes


_local = threading.local()


def current() -> KernelState | None:
    """The state of the connection whose kernel call runs on this thread (None outside one)."""
    return getattr(_local, "state", None)


def serving(fn: Callable, state: KernelState | None, whose: Callable | None = None) -> Callable:
    """``fn`` (a UDF) running with ``state`` as this thread's current kernel state; with
    ``whose``, only for calls ``whose(args)`` says are a run of the state's backend, and with
    none for the others (a user's query: its cancel flag and tile count are not theirs)."""
    @functools.wraps(fn)  # keeps the signature: DuckDB checks a UDF's parameter count
    def udf(*args):
        before = getattr(_local, "state", None)
        _local.state = state if whose is None or state is None or whose(args) else None
        try:
            return fn(*args)
        finally:
            _local.state = before

    return udf


# code objects whose frames mark "outside a kernel" though below one (a progress callback that
# a kernel call's tick runs): ``outside_kernel(fn)`` adds one
_OUTSIDE: set = set()


def outside_kernel(fn: Callable) -> Callable:
    """Mark ``fn``: code it calls is not kernel code, wherever it is called from."""
    _OUTSIDE.add(fn.__code__)
    return fn


def in_kernel() -> bool:
    """Whether this thread runs a tile kernel: inside a UDF call (a ``serving`` frame on the
    stack), or a kernel thread's task (a join callable runs there), and not below a frame
    ``outside_kernel`` marks. Read from the stack, not from a flag a call sets and clears: a
    signal handler's error between the two (a deadline) left the flag set for good (a test)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code in _OUTSIDE:
            return False
        if code is _UDF_CODE:
            return True
        frame = frame.f_back
    return threading.current_thread().name.startswith(_WORKER_PREFIX)


_UDF_CODE = serving(lambda: None, None).__code__  # the wrapper's code, shared by every UDF


def check_cancelled(state: KernelState | None = None) -> None:
    state = state if state is not None else current()
    if state is not None and state.cancel.is_set():
        raise Cancelled("eindecomp_sql: interrupted")


def note_tiles(count: int, nbytes: int) -> None:
    """Kernels call this with the output tiles of each finished call."""
    state = current()
    if state is not None:
        state.note(count, nbytes)


_controller: ThreadpoolController | None = None
# Held only as ``with _mutex`` (a C lock: nothing runs between its acquire and the block), and
# waited for by polling (``POLL_SECONDS``), not through a Condition: its ``__enter__``, ``wait``
# and ``notify_all`` are Python code, and a signal handler's error inside them (a SIGALRM
# deadline; DuckDB runs kernels on the main thread too) left the lock held (every later kernel
# call waited for ever), released twice (stolen from another thread), or a waiter unwoken.
_mutex = threading.Lock()
POLL_SECONDS = 0.0005  # a waiter looks again this often (waits last as long as a kernel call)
_active = 0  # kernel calls in flight with BLAS at one thread
_wide = False  # a call running BLAS on every core: it runs alone
_wanting: set = set()  # tokens of wide calls waiting for the cores: new calls let them go first
_inside = threading.local()  # .call: this thread runs a kernel call's work (run_tasks, run_wide)
_WORKER_PREFIX = "eds-kernel"
# our BLAS limit while kernel calls are in flight (threadpoolctl's limiter), kept in a list
# that C code fills as the limiter is returned (see ``_enter``)
_limits: list = []


# threadpoolctl < 3.8 has no controlling thread (and no way to clear one)
_CLEAR_CONTROL = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)


def _hand_back_blas_control() -> None:
    """Let the next thread set OpenBLAS's thread count. threadpoolctl >= 3.8 lets only the
    first thread that set it (pthreads builds: one process-wide pool) set it again, and makes
    every other thread's calls do nothing, until that thread leaves a ``with`` block. Our limit
    is set by whichever DuckDB thread's kernel call enters first and restored by whichever
    leaves last: with calls in flight on several threads (statements on several cursors, or a
    session used from several threads) the restore did nothing, and the process's BLAS stayed
    at one thread for good (numpy's 4096² product 0.55 -> 1.08 s on 2 cores afterwards); a
    thread that was not the first could not limit BLAS either, so kernel threads would each run
    BLAS on every core. Our changes are serialized by ``_mutex``, so no two threads fight."""
    if _CLEAR_CONTROL is not None:
        _CLEAR_CONTROL(force=True)


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix=_WORKER_PREFIX)
    return _pool


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: the pool's workers, and whoever held
    its locks, are gone. Start afresh (the parent's executor would take tasks no thread runs:
    a child's first kernel call waited for ever)."""
    global _pool, _mutex, _active, _wide, _wanting
    if _limits:  # a parent thread's kernel call had BLAS at one thread: not the child's
        try:
            _limits[0].restore_original_limits()
        except Exception:  # noqa: BLE001 - best effort: BLAS's own state after a fork
            pass
    _pool = None
    _mutex = threading.Lock()
    _limits.clear()
    _active, _wide, _wanting = 0, False, set()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _enter(token: list) -> None:
    """First kernel call in flight: BLAS to one thread (restored when the last one leaves),
    so user code outside queries keeps its own BLAS threads. ``token`` records that this call
    counted itself, in the same breath (no call in between): ``_leave`` then undoes exactly
    that, though a signal handler raise anywhere around."""
    global _active, _controller
    while True:
        with _mutex:
            if not (_wide or _wanting):
                if _active == 0:
                    if _limits:  # a last leave cut short before its restore: do it now
                        _restore_blas()
                    if _controller is None:
                        _controller = ThreadpoolController()
                    _hand_back_blas_control()  # whoever holds it (a user's limit left in place, say)
                    # iter(f, sentinel) calls f from C, and extend stores what it returns: a
                    # handler's error as ``limit`` returns would otherwise lose the limiter
                    # (BLAS at one thread for good)
                    limit = functools.partial(_controller.limit, limits=1, user_api="blas")
                    _limits.extend(itertools.islice(iter(limit, None), 1))
                    _hand_back_blas_control()
                _active += 1
                token.append(True)
                return
        time.sleep(POLL_SECONDS)


def _restore_blas() -> None:
    _hand_back_blas_control()
    _limits[0].restore_original_limits()  # again if cut short after it: restores the same counts
    _hand_back_blas_control()
    _limits.clear()


def _leave(token: list) -> None:
    global _active
    with _mutex:
        if not token:
            return
        _active -= 1
        token.clear()
        if _active == 0 and _limits:
            _restore_blas()


def run_wide(task: Callable[[], None]) -> None:
    """Run ``task`` alone, with BLAS at its own thread count, once no other kernel call is in
    flight. For one big product: OpenBLAS's threads share packed panels of the right operand,
    where four one-thread slices each pack all of it; measured on the 4096² float32 GEMM, one
    2-thread call was 9.5% faster than four 1-thread row slices (paired rounds).

    It waits rather than falling back to slices: a product's bits depend on how it is called
    (float32, row slices against the whole tile: 1571 of 2000 random 4x4 @ 4x1 differ in the
    last bit; BLAS at 1 against 2 threads: 224 of 300 random shapes), and whether another
    call was in flight is DuckDB's scheduling: the same plan on the same inputs gave other
    bits from run to run (a fusion test saw it). Calls that arrive while one waits go after it."""
    global _wide
    if getattr(_inside, "call", False) or threading.current_thread().name.startswith(_WORKER_PREFIX):
        task()  # inside a kernel call already: waiting for the cores would wait for ourselves
        return
    token = object()
    claimed: list = []  # inside the try: a handler's error right after the claim still frees it
    try:
        while True:
            with _mutex:
                _wanting.add(token)
                if not (_active or _wide):
                    _wide = True
                    claimed.append(True)
                    _wanting.discard(token)
                    break
            time.sleep(POLL_SECONDS)
        check_cancelled()
        _inside.call = True
        task()
    finally:
        _inside.call = False
        with _mutex:
            if claimed:  # first, and no call before it (a handler may raise after any call)
                _wide = False
            _wanting.discard(token)


def run_tasks(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` on the kernel threads and wait; re-raise the first failure."""
    state = current()  # the pool's threads check the caller's flag, not their own
    token: list = []
    outer = getattr(_inside, "call", False)
    try:
        if not outer:  # nested in a kernel call of this thread's, which holds the cores already
            _enter(token)
        _inside.call = True
        check_cancelled(state)
        if len(tasks) == 1:
            tasks[0]()
            return
        for f in [_get_pool().submit(_cancellable(t, state)) for t in tasks]:
            f.result()
    finally:
        _inside.call = outer
        # to its end though a signal handler raise at ``_leave``'s first instruction (the count
        # stayed up: no call ran wide again, BLAS stayed at one thread); the loop makes no call
        # outside its ``try``, and the handler's error is raised after
        late_error = None
        while token:
            try:
                _leave(token)
            except BaseException as e:  # noqa: BLE001 - raised below
                late_error = late_error or e
        if late_error is not None:
            raise late_error


def _cancellable(task: Callable[[], None], state: KernelState | None) -> Callable[[], None]:
    def run():
        check_cancelled(state)
        task()

    return run
