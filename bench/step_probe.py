"""Where the SQL path's wall time goes, plan step by plan step: inside the tile kernels (the
Python functions of the Arrow UDFs) or outside them (DuckDB's join and aggregation, and the
conversion of each UDF's input chunk to Arrow, which DuckDB does holding the GIL: one thread at
a time, however many cores there are). The time outside kernels is what does not shrink with
more cores, so it is what a projection to a bigger machine needs.

``install()`` must run before the first ``eds.connect()``: ``register_kernels`` looks the UDF
functions up in ``udfs.register`` when a connection registers them, so a later patch misses.
"""

from __future__ import annotations

import functools
import resource
import threading
import time

KERNELS = ("einsum_rows", "einsum_groups", "program_rows", "program_args", "retile_split", "retile_assemble", "fill_tiles")

_calls: list[tuple[float, float, int]] = []  # (start, end, thread id) of each kernel call
_steps: list[list] = []  # [step index, start, end] of each plan step, in order
_installed = False


def install() -> None:
    """Time every kernel call and every plan step from now on (idempotent)."""
    global _installed
    if _installed:
        return
    import eindecomp_sql.udfs.register as R
    from eindecomp_sql.backends import running

    for name in KERNELS:
        setattr(R, name, _timed(getattr(R, name)))

    # the backend marks each step's start (Watch.begin) and end (Watch.poll(finished=True))
    begin, poll = running.Watch.begin, running.Watch.poll

    def timed_begin(self, k):
        _steps.append([k, time.perf_counter(), None])
        begin(self, k)

    def timed_poll(self, finished=False):
        if finished and _steps:
            _steps[-1][2] = time.perf_counter()
        return poll(self, finished)

    running.Watch.begin, running.Watch.poll = timed_begin, timed_poll
    _installed = True


def _timed(f):
    @functools.wraps(f)  # keeps the signature: DuckDB checks a UDF's parameter count
    def timed(*args):
        t = time.perf_counter()
        try:
            return f(*args)
        finally:
            _calls.append((t, time.perf_counter(), threading.get_ident()))  # list.append: atomic

    return timed


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one interval (kernel calls on several threads overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile(fn) -> tuple[float, dict]:
    """Run ``fn`` (one plan) and return its wall time and where it went:

    ``steps``: per plan step, its ``wall`` seconds, ``kernel`` (seconds when at least one kernel
    call ran), ``kernel_sum`` (the calls' seconds added up: above ``kernel`` when calls overlap),
    ``outside`` (wall - kernel), ``calls`` and ``threads`` (distinct DuckDB threads that called);
    ``between_steps``: wall time outside every step (planning, compiling, commit, catalog);
    ``faults``: the process's minor page faults during the call (every thread's: a buffer the
    allocators handed back and the call faulted in again, 4 KiB each)."""
    _calls.clear()
    _steps.clear()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    steps = []
    for k, s0, s1 in _steps:
        s1 = s1 if s1 is not None else s0
        mine = [(max(a, s0), min(b, s1), tid) for a, b, tid in _calls if a < s1 and b > s0]
        kernel = _union([(a, b) for a, b, _ in mine])
        steps.append({"step": k, "wall": s1 - s0, "kernel": kernel, "kernel_sum": sum(b - a for a, b, _ in mine),
                      "outside": (s1 - s0) - kernel, "calls": len(mine), "threads": len({tid for *_, tid in mine})})
    return wall, {"wall": wall, "steps": steps, "between_steps": wall - sum(s["wall"] for s in steps),
                  "faults": faults}
