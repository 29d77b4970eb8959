"""A plan as tile tasks for a device worker (``udfs/runtime.py``): one task per output tile of
every step, reading exactly the tiles the step's SQL would join for it, computed by the step's
tile kernel (einsums) or as the reference backend cuts and pastes (retiles, fills). Tile ids are
``(value name, key)``.

>>> import numpy as np
>>> from eindecomp_sql.plan import TiledValue, plan_einsum
>>> a = TiledValue("A", (4, 6), "float64", (2, 3), ("d0", "d1"))
>>> b = TiledValue("B", (6, 5), "float64", (3, 5), ("d0", "d1"))
>>> tasks = plan_tasks(plan_einsum("ij,jk->ik", (a, b)))
>>> [(t.name, t.inputs) for t in tasks][:1]
[('_eds_result(0, 0)', (('A', (0, 0)), ('B', (0, 0)), ('A', (0, 1)), ('B', (1, 0))))]
"""

from __future__ import annotations

import itertools

import numpy as np

from ..plan import EinsumStep, FillStep, Plan, ProgramStep, RetileStep, TiledValue
from . import reference as ref
from ..udfs.runtime import Task


def tile_ids(value: TiledValue) -> list:
    return [(value.name, key) for key in ref._keys(value.shape, value.tile)]


def host_tiles(value: TiledValue, array: np.ndarray) -> dict:
    """``array`` cut as ``value`` is, by tile id."""
    return {(value.name, key): t for key, t in ref.cut(array, value.tile).items()}


def assemble(value: TiledValue, tiles: dict) -> np.ndarray:
    return ref.assemble(value, {key: tiles[(value.name, key)] for key in ref._keys(value.shape, value.tile)})


def plan_tasks(plan: Plan) -> list[Task]:
    """Every step of ``plan`` as tile tasks, in the plan's order (fused steps and programs as
    the steps they stand for)."""
    tasks: list[Task] = []
    for step in plan.steps:
        for s in (step.steps if isinstance(step, ProgramStep) else (step,)):
            for part in (s.unfused() if isinstance(s, EinsumStep) else (s,)):
                tasks += _step_tasks(part)
    return tasks


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _step_tasks(step) -> list[Task]:
    if isinstance(step, FillStep):
        r = step.result
        return [Task(f"{r.name}{key}", (), (r.name, key), _nbytes(ref._extent(ref._box(r.shape, r.tile, key)), r.dtype),
                     lambda arrays, e=ref._extent(ref._box(r.shape, r.tile, key)), v=step.value, d=r.dtype:
                     np.full(e, v, dtype=d))
                for key in ref._keys(r.shape, r.tile)]
    if isinstance(step, RetileStep):
        return _retile_tasks(step)
    return _einsum_tasks(step)


def _einsum_tasks(step: EinsumStep) -> list[Task]:
    """One task per output tile, running the step's own tile kernel (``udfs/kernels.py``, built
    from its kernel spec, as the DuckDB UDFs build it) over the tiles of every piece of the
    reduced labels."""
    from ..plan.kernel_spec import kernel_spec
    from ..udfs.kernels import einsum_kernel

    kernel = einsum_kernel(kernel_spec(step))
    node, result = step.node, step.result
    tasks = []
    for okey in itertools.product(*(range(step.pieces[lab]) for lab in node.keys)):
        members = []  # per piece of the reduced labels: (the operands' tile shapes, their tile ids)
        work = []  # join-space elements per member (the simulated device's compute time)
        for rkey in itertools.product(*(range(step.pieces[lab]) for lab in node.summed)):
            keys = dict(zip(node.keys, okey)) | dict(zip(node.summed, rkey))
            ids = []
            for op, v in zip(node.operands, step.inputs):
                labels = iter(op.labels)
                ids.append((v.name, tuple(0 if ax in op.dropped else keys[next(labels)] for ax in range(len(v.shape)))))
            ext = kernel.extents(keys)
            members.append((kernel.in_shapes(ext), ids))
            work.append(float(np.prod(list(ext.values()))))
        inputs = tuple(dict.fromkeys(i for _, ids in members for i in ids))
        index = {i: n for n, i in enumerate(inputs)}

        shape = ref._extent(ref._box(result.shape, result.tile, okey))

        def run(arrays, members=members, index=index, shape=shape):
            # a tile read with its size-1 axes dropped is the same bytes in the kernel's shape
            out = np.empty(shape, dtype=kernel.out_dtype)
            # (a partial result's tile has an axis of extent 1 per kept label the kernel omits)
            kernel.contract_group([[arrays[index[i]].reshape(s) for s, i in zip(shapes, ids)]
                                   for shapes, ids in members], out.reshape(shape[:len(kernel.output)]))
            return out

        flops = 2.0 * sum(work)
        tasks.append(Task(f"{result.name}{okey}", inputs, (result.name, okey), _nbytes(shape, result.dtype), run, flops))
    return tasks


def _retile_tasks(step: RetileStep) -> list[Task]:
    s, t = step.source, step.target
    tasks = []
    for key in ref._keys(t.shape, t.tile):
        sources = ref.overlapping(s, t, key)

        def run(arrays, key=key, sources=sources):
            return ref.retiled_tile(s, t, key, dict(zip(sources, arrays)))

        tasks.append(Task(f"{t.name}{key}", tuple((s.name, src) for src in sources), (t.name, key),
                          _nbytes(ref._extent(ref._box(t.shape, t.tile, key)), t.dtype), run))
    return tasks
