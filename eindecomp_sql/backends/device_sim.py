"""The simulated-device backend: the reference backend's catalog (tensors in memory), with
every plan run by the device worker's runtime (``udfs/runtime.py``) on a simulated device.

It is how the runtime that will drive a GPU is checked end to end without one: a plan becomes
tile tasks (``device_tasks.py``), the runtime schedules them under its device budget, prefetches,
evicts and writes back, and the results must be what the DuckDB engine and the reference backend
compute (the backend-parametrized suite runs on it). Its cache lives as long as the session, so
a stored tensor read by one plan is still resident for the next; tiles are named with the
tensor's version, so a tensor replaced since is never read stale.

>>> import numpy as np, eindecomp_sql as eds
>>> with eds.connect(backend="device-sim") as db:
...     A = db.store("A", np.arange(6.0).reshape(2, 3))
...     db.einsum("ij,kj->ik", A, A).to_numpy()
array([[ 5., 14.],
       [14., 50.]])
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np

from ..errors import EinsumError
from ..plan import EinsumStep, Plan, ProgramStep
from ..plan.steps import step_target
from .base import Target
from .device_tasks import plan_tasks
from .reference import ReferenceBackend, _check_tiles, _keys
from ..udfs.runtime import SimulatedDevice, TileRuntime

DEVICE_MEMORY = 1 << 30  # the simulated device's cache, by default


class _TaskFailed(Exception):
    def __init__(self, task: str, error: BaseException):
        super().__init__(task)
        self.task, self.error = task, error


class SimulatedDeviceBackend(ReferenceBackend):
    name = "device-sim"

    def __init__(self, database=None, read_only: bool = False, device_memory: int = DEVICE_MEMORY):
        super().__init__(database, read_only=read_only)
        self.runtime = TileRuntime(SimulatedDevice(), budget=device_memory)
        self._versions: dict[str, int] = {}  # lower-cased name -> writes so far
        self._runs = itertools.count()

    def _put(self, name, value, tiles, temporary) -> None:
        super()._put(name, value, tiles, temporary)
        key = name.lower()
        self._versions[key] = self._versions.get(key, 0) + 1
        # the tiles of the version before are never read again
        self.runtime.forget([tid for tid in self.runtime.cache if tid[:2] == ("stored", key)])

    def execute(self, plan: Plan, inputs: Mapping[str, str | np.ndarray], outputs: Mapping[str, Target],
                replace: bool = False, progress: Callable | None = None) -> dict[str, np.ndarray]:
        """Run the plan's tile tasks on the simulated device; as ``ReferenceBackend.execute``
        otherwise (every value computed before anything is written)."""
        with self.lock:
            self._check_outputs(outputs, replace)
            run = next(self._runs)
            rename, host = {}, {}
            for v in plan.inputs:
                x = inputs[v.name]
                tiles = self._bind_input(v, x)
                # a stored tensor's tiles are the same while its version is; an array's are new
                tag = ("stored", x.lower(), self._versions.get(x.lower(), 0)) if isinstance(x, str) else ("array", run)
                for key, tile in tiles.items():
                    rename[(v.name, key)] = tag + (v.name, key)
                    host[tag + (v.name, key)] = tile
            step_of = _step_of(plan)
            tasks = [replace_task(t, rename) for t in plan_tasks(plan)]
            keep = [(v.name, key) for v in plan.outputs for key in _keys(v.shape, v.tile)]
            start = time.perf_counter()
            on_done = None
            if progress is not None:
                on_done = _progress(plan, tasks, step_of, progress, start)
            try:
                with np.errstate(all="ignore"):  # as in SQL: inf and nan are values, not warnings
                    got = self.runtime.run(tasks, host, keep, on_done)
            except _TaskFailed as e:
                k = step_of[e.task[0]]
                step = plan.steps[k]
                detail = str(e.error) if isinstance(e.error, EinsumError) else f"{type(e.error).__name__}: {e.error}"
                raise EinsumError(f"step {k} ({step.describe()}) failed: {detail}") from e.error
            finally:  # this run's arrays are never read again
                self.runtime.forget([tid for tid in host if tid[0] == "array"])
            values = {}
            for v in plan.outputs:
                tiles = {key: got[(v.name, key)] for key in _keys(v.shape, v.tile)}
                _check_tiles(v, tiles, f"output {v.name}")
                values[v.name] = (v, tiles)
            return self._finish(outputs, values)


def replace_task(task, rename: dict):
    """``task`` reading the renamed ids, its failures named after it."""
    def run(arrays, f=task.run, name=task.output):
        try:
            return f(arrays)
        except BaseException as e:  # noqa: BLE001 - re-raised as the plan step's error
            raise _TaskFailed(name, e) from e

    return replace(task, inputs=tuple(rename.get(i, i) for i in task.inputs), run=run)


def _step_of(plan: Plan) -> dict[str, int]:
    """Value name -> the plan step computing it (every node a fused step or a program holds)."""
    out = {}
    for k, step in enumerate(plan.steps):
        out[step_target(step).name] = k
        for s in (step.steps if isinstance(step, ProgramStep) else (step,)):
            if isinstance(s, EinsumStep):
                for part in s.unfused():
                    out[part.result.name] = k
    return out


def _progress(plan: Plan, tasks, step_of: dict[str, int], report: Callable, start: float):
    """``on_done`` for the runtime: each plan step reported once all its tasks (and every
    earlier step's) have finished, in step order, as the reference backend reports them."""
    from .running import StepProgress

    left = [0] * len(plan.steps)
    for t in tasks:
        left[step_of[t.output[0]]] += 1
    state = {"next": 0}

    def done(task) -> None:
        left[step_of[task.output[0]]] -= 1
        while state["next"] < len(plan.steps) and left[state["next"]] == 0:
            k = state["next"]
            target = step_target(plan.steps[k])
            n = int(np.prod(target.grid, dtype=np.int64)) if target.shape else 1
            report(StepProgress(k + 1, len(plan.steps), plan.steps[k].describe(), n, n, target.nbytes,
                                time.perf_counter() - start))
            state["next"] += 1

    return done
