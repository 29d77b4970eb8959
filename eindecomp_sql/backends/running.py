"""Running a plan so that Ctrl-C stops it and a caller can watch it.

While DuckDB runs a statement the calling thread sits inside a C++ call, and Python runs signal
handlers only between bytecodes of the main thread: a Ctrl-C waited until the statement ended
(a 6000³ GEMM ran ~20 s on) or surfaced as DuckDB's own "Query interrupted" RuntimeError. So the
statements run on a helper thread while the main thread waits in short joins; a
KeyboardInterrupt there interrupts the connection, asks the tile kernels to stop between tasks
(``udfs.pool.cancel``), waits for the transaction to roll back, and re-raises
KeyboardInterrupt. The same waiting loop polls progress.
"""

from __future__ import annotations

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
    """Progress of one plan: the backend says which step runs, the kernels count tiles."""

    def __init__(self, report: Callable[[StepProgress], None] | None, steps: list[tuple[str, int]]):
        self.report = report
        self.steps = steps  # (description, output tiles) per step
        self.start = time.perf_counter()
        self.current = 0
        self._base = pool.tiles_finished()

    def begin(self, k: int) -> None:
        self.current = k
        self._base = pool.tiles_finished()

    def poll(self, finished: bool = False) -> None:
        if self.report is None or not self.steps:
            return
        desc, total = self.steps[self.current]
        tiles, nbytes = (a - b for a, b in zip(pool.tiles_finished(), self._base))
        if finished:
            tiles = total
        self.report(StepProgress(self.current + 1, len(self.steps), desc, min(tiles, total), total, nbytes,
                                 time.perf_counter() - self.start))


def run_interruptible(work: Callable[[], object], interrupt: Callable[[], None],
                      watch: Watch | None = None) -> object:
    """``work()`` on a helper thread; Ctrl-C (in the main thread) interrupts it cleanly."""
    if threading.current_thread() is not threading.main_thread():
        # signals reach only the main thread: another thread has nothing to wait for
        return work()
    box: dict = {}
    # an Event, not Thread.join/is_alive: a join that a KeyboardInterrupt cuts short can leave
    # the thread marked as stopped while it still runs (seen on CPython 3.11)
    done = threading.Event()

    def target():
        try:
            box["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    runner = threading.Thread(target=target, name="eds-plan", daemon=True)
    interrupted = False
    runner.start()
    while not done.is_set():
        try:
            if not done.wait(TICK_SECONDS) and watch is not None and not interrupted:
                watch.poll()
        except KeyboardInterrupt:
            # interrupt the statement and the kernels, then wait for the rollback: what runs
            # after us must find the database as it was
            interrupted = True
            pool.cancel()
            try:
                interrupt()
            except Exception:  # noqa: BLE001 - the statement may have just finished
                pass
    if interrupted:
        pool.cancel_done()
        raise KeyboardInterrupt
    if "error" in box:
        raise box["error"]
    return box.get("value")
