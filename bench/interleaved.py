"""Side-by-side timing for the probes: every method once per round, the order reversed every
other round (this VM drifts by ±20% between processes and within one), after warm-ups."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(runs: dict[str, Callable[[int], object]], reps: int, warmups: int = 2) -> dict[str, list[float]]:
    """Seconds per round for each of ``runs`` (name -> f(round)); warm-up rounds are numbered
    -1, -2, ... (a run writing per-round output keeps them apart)."""
    for r in range(warmups):  # Spark's JIT, Python workers, caches
        for f in runs.values():
            f(-1 - r)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(reps):
        for k in (list(runs) if r % 2 else list(runs)[::-1]):
            t = time.perf_counter()
            runs[k](r)
            times[k].append(time.perf_counter() - t)
    return times


def report(times: dict[str, list[float]]) -> None:
    for k, ts in times.items():
        print(f"{k}: median {statistics.median(ts):.2f} s ({min(ts):.2f}-{max(ts):.2f})")
