"""One extended einsum over tiled values -> a plan: parse, lower to nodes, choose chunkings.

>>> from eindecomp_sql.plan import TiledValue
>>> a = TiledValue("A", (8, 6), "float32", (4, 3), ("d0", "d1"), "A")
>>> b = TiledValue("B", (6, 5), "float32", (6, 5), ("d0", "d1"), "B")
>>> [s.describe() for s in plan_einsum("ij,jk->ik", (a, b)).steps]
['retile A (4, 3) -> (4, 6)', 'einsum ij,jk->ik [i:2 j:1 k:1] -> _eds_result']
"""

from __future__ import annotations

from functools import lru_cache

from ..graph import ValueInfo, lower_einsum
from ..notation import Aggregation, JoinFunction, parse_agg, parse_join, parse_spec
from .planner import plan_nodes
from .steps import Plan, TiledValue

RESULT = "_eds_result"


def plan_einsum(spec: str, values: tuple[TiledValue, ...], join=None, agg=None, out: str | None = None) -> Plan:
    """The plan computing ``spec`` over ``values``; the result goes to table ``out`` (None:
    returned as rows)."""
    j = join if isinstance(join, JoinFunction) else parse_join(join, len(values))
    a = agg if isinstance(agg, Aggregation) else parse_agg(agg)
    return _plan(spec, tuple(values), j, a, out)


@lru_cache(maxsize=1024)
def _plan(spec: str, values: tuple[TiledValue, ...], join: JoinFunction, agg: Aggregation, out: str | None) -> Plan:
    # cached: a small einsum repeated in a loop pays for parsing and planning once
    parsed = parse_spec(spec, [v.shape for v in values])
    infos = [ValueInfo(v.name, v.shape, v.dtype) for v in values]
    nodes = lower_einsum(parsed, infos, join, agg, out or RESULT)
    # an operand given twice is one value: the dict keeps one entry per name
    inputs = {v.name: v for v in values}
    return plan_nodes(nodes, inputs, out, tuple(parsed.output))
