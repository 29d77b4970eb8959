"""Pass: a node over a label of size 0 reads nothing: it becomes a fill step, as numpy defines it.

With an output label of size 0 the result has no elements; otherwise every element aggregates
an empty set, which is the aggregation's identity (sum 0, prod 1; numpy: ``np.einsum("ij,jk->ik",
a, b)`` with ``j`` of size 0 is all zeros); max and min of nothing are refused, as numpy refuses
them. Nodes left feeding nothing, and inputs no node reads any more, are dropped.

>>> from eindecomp_sql.plan.draft import example
>>> d = fill_empty(example("ij,jk->ik", (3, 0), (0, 2)))
>>> [s.describe() for s in d.steps], d.nodes, d.inputs
(['fill _eds_result (3, 2) with 0.0 (a reduced label has size 0)'], (), ())
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...errors import EinsumError
from ...notation.spec import describe_label
from ..steps import FillStep, TiledValue, key_names
from ..tiling import DEFAULT_TILE_BYTES, auto_tile
from ..draft import Draft

# what an aggregation of nothing is (numpy: np.add.reduce([]) == 0); max and min have none
AGG_IDENTITY = {"sum": 0, "prod": 1}


def fill_empty(d: Draft) -> Draft:
    empty = [n for n in d.nodes if any(s == 0 for s in n.size.values())]
    if not empty:
        return d
    fills = []
    for node in empty:
        res = node.result
        value = 0
        if all(node.size[lab] > 0 for lab in node.output):
            if node.agg.name not in AGG_IDENTITY:
                zero = ", ".join(describe_label(lab) for lab in node.labels if node.size[lab] == 0)
                raise EinsumError(f"agg={node.agg.name!r} reduces over label {zero} of size 0: the {node.agg.name} "
                                  f"of nothing is undefined (numpy raises for a zero-size {node.agg.name} too)")
            value = AGG_IDENTITY[node.agg.name]
        dtype = np.dtype(res.dtype)
        fill = dtype.type(value).item()
        if isinstance(fill, complex):  # JSON has no complex numbers; the kernel casts 0 / 1 itself
            fill = value
        tile = auto_tile(res.shape, dtype.itemsize, d.options.tile_bytes or DEFAULT_TILE_BYTES)
        fills.append(FillStep(TiledValue(res.name, res.shape, res.dtype, tile, key_names(node.output)), fill))
    filled = {n.result.name for n in empty}
    nodes = [n for n in d.nodes if n.result.name not in filled]
    # drop what only fed a filled node: walk back from the outputs
    want = set(d.outputs)
    for n in reversed(nodes):
        if n.result.name in want:
            want.update(op.value for op in n.operands)
    nodes = tuple(n for n in nodes if n.result.name in want)
    fills = tuple(f for f in fills if f.result.name in want)
    inputs = tuple(v for v in d.inputs if v.name in want)
    return replace(d, nodes=nodes, inputs=inputs, steps=d.steps + fills)
