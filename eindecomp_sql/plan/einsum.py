"""One extended einsum over tiled values -> a plan: parse, lower to nodes, choose chunkings
with the EinDecomp optimizer, insert re-tiles.

>>> from eindecomp_sql.plan import TiledValue
>>> a = TiledValue("A", (8, 6), "float32", (4, 3), ("d0", "d1"), "A")
>>> b = TiledValue("B", (6, 5), "float32", (6, 5), ("d0", "d1"), "B")
>>> [s.describe() for s in plan_einsum("ij,jk->ik", (a, b)).steps]
['retile A (4, 3) -> (8, 6)', 'einsum ij,jk->ik [i:1 j:1 k:1] -> _eds_result']
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import EinsumError
from ..graph import ValueInfo, lower_einsum
from ..notation import Aggregation, EinsumSpec, JoinFunction, parse_agg, parse_join, parse_spec
from ..notation.spec import describe_label
from .optimize import optimize
from .planner import plan_nodes
from .cost import choose_batches
from .steps import FillStep, Plan, TiledValue, fill_peak, key_names
from .tiling import DEFAULT_TILE_BYTES, auto_tile

RESULT = "_eds_result"
# what an aggregation of nothing is (numpy: np.add.reduce([]) == 0); max and min have none
AGG_IDENTITY = {"sum": 0, "prod": 1}


def plan_einsum(spec: str, values: tuple[TiledValue, ...], join=None, agg=None, out: str | None = None, *,
                temporary: bool = False, workers: int = 1, budget: int | None = None,
                max_tile_bytes: int | None = None, path=None) -> Plan:
    """The plan computing ``spec`` over ``values``; the result goes to table ``out`` (None:
    returned as rows). Values with ``tile`` None are free: the plan chooses their tiling."""
    j = join if isinstance(join, JoinFunction) else parse_join(join, len(values))
    a = agg if isinstance(agg, Aggregation) else parse_agg(agg)
    return _plan(spec, tuple(values), j, a, out, temporary, workers, budget, max_tile_bytes, path)


@lru_cache(maxsize=1024)
def _plan(spec, values, join, agg, out, temporary, workers, budget, max_tile_bytes, path) -> Plan:
    # cached: a small einsum repeated in a loop pays for parsing and planning once
    parsed = parse_spec(spec, [v.shape for v in values])
    infos = [ValueInfo(v.name, v.shape, v.dtype) for v in values]
    # the result is named apart from every table: `einsum("ij->ji", "A", out="A")` must not
    # confuse the input A with the output A
    nodes = lower_einsum(parsed, infos, join, agg, RESULT, path=path)
    if any(n == 0 for n in parsed.size.values()):
        return _fill_plan(parsed, nodes[-1].result, agg, out, temporary, max_tile_bytes, budget)
    unique = {v.name: v for v in values}  # an operand given twice is one value
    fixed = {v.name: v.tile for v in unique.values() if v.tile is not None}
    choice = optimize(nodes, {v.name: ValueInfo(v.name, v.shape, v.dtype) for v in unique.values()}, fixed,
                      workers=workers, budget=budget, max_tile_bytes=max_tile_bytes)
    inputs = {
        name: v if v.tile is not None else TiledValue(v.name, v.shape, v.dtype, choice.input_tiles[name], v.keys, v.table)
        for name, v in unique.items()
    }
    last = nodes[-1].result
    target = TiledValue(last.name, last.shape, last.dtype, None, key_names(parsed.output), out, temporary=temporary)
    plan = plan_nodes(nodes, inputs, choice.tiles(nodes), {last.name: target}, budget)
    plan.check_budget(budget)  # refused before anything runs, as a graph plan is
    return plan


def _fill_plan(parsed: EinsumSpec, result: ValueInfo, agg: Aggregation, out, temporary, max_tile_bytes,
               budget) -> Plan:
    """A label of size 0: nothing to join. The result is empty when an output label has size
    0, else every element aggregates nothing and is the aggregation's identity (numpy's
    answer: ``np.einsum("ij,jk->ik", a, b)`` with ``j`` of size 0 is all zeros)."""
    value = 0
    if all(parsed.size[lab] > 0 for lab in parsed.output):
        if agg.name not in AGG_IDENTITY:
            empty = ", ".join(describe_label(lab) for lab in parsed.labels if parsed.size[lab] == 0)
            raise EinsumError(f"agg={agg.name!r} reduces over label {empty} of size 0: the {agg.name} of "
                              f"nothing is undefined (numpy raises for a zero-size {agg.name} too)")
        value = AGG_IDENTITY[agg.name]
    dtype = np.dtype(result.dtype)
    fill = dtype.type(value).item()
    if isinstance(fill, complex):  # JSON has no complex numbers; the kernel casts 0 / 1 itself
        fill = value
    tile = auto_tile(result.shape, dtype.itemsize, max_tile_bytes or DEFAULT_TILE_BYTES)
    target = TiledValue(result.name, result.shape, result.dtype, tile, key_names(parsed.output), out,
                        temporary=temporary)
    most = target.grid[0] if target.shape and target.nbytes else 1  # batches cut the first key
    batches = choose_batches(lambda b: fill_peak(target, b), most, budget)
    plan = Plan((FillStep(target, fill, batches),), (), (target,))
    plan.check_budget(budget)
    return plan
