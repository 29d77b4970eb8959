"""Pass: one einsum step per node, and a re-tile before it wherever an operand is cut
differently from what the node's chunking needs.

Node results keep their names; a re-tiled copy is a new value (``_eds_retile1``, ...), dropped
when the plan finishes, as every value that is not an output is.

>>> from dataclasses import replace
>>> from eindecomp_sql.plan.draft import example
>>> from eindecomp_sql.plan.passes.chunking import choose_chunking
>>> d = example("ij,jk->ik", (512, 512), (512, 512))  # A stored in 64 tiles of 64²
>>> d = replace(d, inputs=(replace(d.inputs[0], tile=(64, 64)), d.inputs[1]))
>>> [s.describe() for s in insert_retiles(choose_chunking(d)).steps]
['retile A (64, 64) -> (512, 512)', 'einsum ij,jk->ik [i:1 j:1 k:1] -> _eds_result']

(An 8×6 A in four tiles would not be re-tiled: the statement a retile adds costs more than the
bytes it saves there, so the step reads A as cut.)
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from ..draft import Draft
from ..steps import EinsumStep, RetileStep, TiledValue, key_names


def insert_retiles(d: Draft) -> Draft:
    values = d.values()
    steps = list(d.steps)
    fresh = (f"_eds_retile{k}" for k in itertools.count(1))
    made: dict[tuple[str, tuple[int, ...]], TiledValue] = {}  # one re-tiled copy per value and tiling
    fusions = {c.result: c.fusion for c in d.chains}  # fused chains (passes/chains.py)
    for node in d.nodes:
        chunking = d.choice.chunking(node)
        chunk = chunking.tile_of
        step_inputs = []
        for op in node.operands:
            v = values[op.value]
            kept_axes = [ax for ax in range(len(v.shape)) if ax not in op.dropped]
            want = list(v.tile)
            for ax, lab in zip(kept_axes, op.labels):
                want[ax] = chunk[lab]
            if tuple(want) != v.tile:
                # two nodes reading a value cut alike share its copy (a baseline re-tiled a
                # value used twice twice: a statement and its bytes for nothing)
                target = made.get((v.name, tuple(want)))
                if target is None:
                    target = made[v.name, tuple(want)] = TiledValue(next(fresh), v.shape, v.dtype, tuple(want), v.keys)
                    steps.append(RetileStep(v, target))
                v = target
            step_inputs.append(v)
        res = node.result
        # key_names: labels that differ only in case (i, I) are one column name to DuckDB
        result = TiledValue(res.name, res.shape, res.dtype, tuple(chunk[lab] for lab in node.output),
                            key_names(node.output))
        values[res.name] = result
        steps.append(EinsumStep(node, tuple(step_inputs), result, chunking, fused=fusions.get(res.name)))
    return replace(d, nodes=(), steps=tuple(steps))
