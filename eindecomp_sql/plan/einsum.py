"""One extended einsum over tiled values -> a plan: parse, lower to nodes, then the planning
pipeline (``plan/pipeline.py``) every graph goes through too.

>>> from eindecomp_sql.plan import TiledValue
>>> a = TiledValue("A", (8, 6), "float32", (4, 3), ("d0", "d1"))
>>> b = TiledValue("B", (6, 5), "float32", (6, 5), ("d0", "d1"))
>>> [s.describe() for s in plan_einsum("ij,jk->ik", (a, b)).steps]
['retile A (4, 3) -> (8, 6)', 'einsum ij,jk->ik [i:1 j:1 k:1] -> _eds_result']
"""

from __future__ import annotations

from functools import lru_cache

from ..graph import ValueInfo, lower_einsum
from ..notation import Aggregation, JoinFunction, parse_agg, parse_join, parse_spec
from .cost import DEFAULT_COSTS, CostModel
from .draft import Draft, Options
from .pipeline import run_passes
from .steps import Plan, TiledValue

# the result's value name: apart from every operand's (names starting _eds_ are reserved), so
# `einsum("ij->ji", "A", out="A")` never confuses the input A with the output
RESULT = "_eds_result"


def plan_einsum(spec: str, values: tuple[TiledValue, ...], join=None, agg=None, *, workers: int = 1,
                budget: int | None = None, tile_bytes: int | None = None, path=None,
                costs: CostModel = DEFAULT_COSTS, dtype: str | None = None) -> Plan:
    """The plan computing ``spec`` over ``values`` into the value ``RESULT``. Values with
    ``tile`` None are free: the plan chooses their tiling. An operand given twice (one name)
    is one value. Plans name values, never tables: the backend binds them when it runs.
    ``costs``: the cost model of the engine the plan is for (its backend's). ``dtype``: the
    dtype a product summed computes in and gives (numpy's ``einsum(dtype=)``: the kernels
    cast each tile to it), else the operands' promoted dtype."""
    j = join if isinstance(join, JoinFunction) else parse_join(join, len(values))
    a = agg if isinstance(agg, Aggregation) else parse_agg(agg)
    return _plan(spec, tuple(values), j, a, workers, budget, tile_bytes, path, costs, dtype)


@lru_cache(maxsize=1024)
def _plan(spec, values, join, agg, workers, budget, tile_bytes, path, costs, dtype=None) -> Plan:
    # cached: a small einsum repeated in a loop pays for parsing and planning once
    parsed = parse_spec(spec, [v.shape for v in values])
    infos = [ValueInfo(v.name, v.shape, v.dtype) for v in values]
    nodes = lower_einsum(parsed, infos, join, agg, RESULT, path=path, dtype=dtype)
    unique = tuple({v.name: v for v in values}.values())
    draft = Draft(tuple(nodes), unique, (RESULT,), Options(workers, budget, tile_bytes, costs=costs))
    return run_passes(draft).plan()
