"""Running a plan so that Ctrl-C stops it and a caller can watch it.

While DuckDB runs a statement the main thread sits inside a C++ call, and Python runs signal
handlers only between bytecodes of the main thread: a Ctrl-C waited until the statement ended
(a 6000³ GEMM ran ~20 s on) or surfaced as DuckDB's own "Query interrupted" RuntimeError.

So while a plan runs (on the main thread, as before) a watchdog thread waits on a socket that
Python's C-level signal handler writes to at once (``signal.set_wakeup_fd``). On SIGINT it
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
        self.kernels = kernels
        self.start = time.perf_counter()
        self.current = 0
        self._base = kernels.finished()

    def begin(self, k: int) -> None:
        self.current = k
        self._base = self.kernels.finished()

    def poll(self, finished: bool = False) -> None:
        if self.report is None or not self.steps:
            return
        desc, total = self.steps[self.current]
        tiles, nbytes = (a - b for a, b in zip(self.kernels.finished(), self._base))
        if finished:
            tiles = total
        self.report(StepProgress(self.current + 1, len(self.steps), desc, min(tiles, total), total, nbytes,
                                 time.perf_counter() - self.start))


def run_interruptible(work: Callable[[], object], interrupt: Callable[[], None], kernels: pool.KernelState,
                      watch: Watch | None = None) -> object:
    """``work()`` on this thread; Ctrl-C interrupts it cleanly, progress is polled. A progress
    callback that raises stops the plan the same way, and its error is raised."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    # signals reach only the main thread; a SIGINT that is ignored, or handled by C code we
    # cannot call, is left alone
    catch = main and callable(previous)
    if not catch and (watch is None or watch.report is None):
        return work()
    hit = threading.Event()
    stop = threading.Event()
    failed: list[BaseException] = []  # a progress callback's error
    reader, writer = socket.socketpair() if catch else (None, None)
    old_fd = -1
    if catch:
        writer.setblocking(False)
        signal.signal(signal.SIGINT, lambda signum, frame: hit.set())
        old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def stop_plan():
        kernels.cancel.set()
        try:
            interrupt()
        except Exception:  # noqa: BLE001 - the statement may have just finished
            pass

    def watchdog():
        while not stop.is_set():
            if reader is not None:
                ready, _, _ = select.select([reader], [], [], TICK_SECONDS)
                data = reader.recv(64) if ready else b""
                others = bytes(b for b in data if b not in (0, signal.SIGINT))
                if others and old_fd != -1:  # other signals: to whoever listened before (asyncio)
                    try:
                        os.write(old_fd, others)
                    except OSError:
                        pass
                if signal.SIGINT in data:
                    hit.set()
                    stop_plan()
            else:
                stop.wait(TICK_SECONDS)
            if watch is not None and not hit.is_set() and not failed and not stop.is_set():
                try:
                    watch.poll()
                except BaseException as e:  # noqa: BLE001 - raised on the calling thread
                    failed.append(e)
                    stop_plan()

    dog = threading.Thread(target=watchdog, name="eds-watchdog", daemon=True)
    dog.start()
    error = None
    try:
        result = work()
    except BaseException as e:
        if not (hit.is_set() or failed):
            raise
        result, error = None, e  # the stopped statement's error: what stopped it speaks instead
    finally:
        stop.set()
        if writer is not None:
            try:  # wake the watchdog out of select() now, not at its next tick (~50 ms a plan)
                writer.send(b"\0")
            except OSError:
                pass
        dog.join()
        kernels.cancel.clear()
        if catch:
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGINT, previous)
            reader.close()
            writer.close()
    if hit.is_set():
        previous(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt here
        # a handler that returns (asyncio's cancels its task; a flag-setter) still gets no result
        raise KeyboardInterrupt from error
    if failed:
        raise failed[0]
    return result
