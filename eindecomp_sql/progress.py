"""``progress=``: watch a running plan. ``True`` draws a bar (tqdm) on stderr; a callable gets a
:class:`~eindecomp_sql.backends.running.StepProgress` several times a second and once when each
step finishes; None or False, nothing.

DuckDB's own progress bar jumps from 0 to 100% on CREATE TABLE AS (duckdb/duckdb#22519), so
progress is counted in output tiles the tile kernels have finished.
"""

from __future__ import annotations

from typing import Callable

from .backends.running import StepProgress
from .errors import EinsumError


class _Bar:
    """A tqdm bar over the output tiles of the running step (reset at each step, so its rate
    and ETA are the step's)."""

    def __init__(self):
        self.bar = None
        self.step = 0

    def __call__(self, p: StepProgress) -> None:
        from tqdm.auto import tqdm

        if self.bar is None:
            self.bar = tqdm(total=p.tiles, unit="tile", leave=False)
        if p.step != self.step:
            self.step = p.step
            self.bar.reset(total=p.tiles)
            self.bar.set_description(f"step {p.step}/{p.steps}", refresh=False)
        self.bar.update(max(0, p.tiles_done - self.bar.n))
        if p.step == p.steps and p.tiles_done == p.tiles:
            self.bar.close()


def reporter(progress) -> Callable[[StepProgress], None] | None:
    """The callable the backend calls for ``progress=``."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return _Bar()
    if callable(progress):
        return progress
    raise EinsumError(f"progress must be True, False, None or a callable taking a StepProgress, got {progress!r}")
