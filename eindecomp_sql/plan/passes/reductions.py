"""Pass: a grouped step whose groups do not fit the memory budget in any number of statements,
or whose partial results are small and cheaper (``partials.cheaper_split``), runs as a partial
step and a combine step (``plan/partials.py``), as the optimizer priced it.

>>> from eindecomp_sql.plan.draft import example
>>> from eindecomp_sql.plan.passes.chunking import choose_chunking
>>> from eindecomp_sql.plan.passes.retiles import insert_retiles
>>> d = insert_retiles(choose_chunking(example("ij,ij->", (4096, 4096), (4096, 4096), budget=100_000_000)))
>>> [s.describe() for s in split_reductions(d).steps]
['einsum ij,ij-> partial over j [i:1 j:128] -> _eds_partial1', 'einsum j-> [j:128] -> _eds_result']
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from .. import partials
from ..draft import Draft
from ..steps import EinsumStep, TiledValue, key_names
from ..tiling import Chunking


def split_reductions(d: Draft) -> Draft:
    budget, model = d.options.budget, d.options.costs
    if not model.splits_reductions:
        return d
    fresh = (f"_eds_partial{k}" for k in itertools.count(1))
    steps = []
    for s in d.steps:
        if not isinstance(s, EinsumStep) or s.fused is not None or not partials.splits(
                s.node, s.pieces, {op.value: v.dtype for op, v in zip(s.node.operands, s.inputs)}, budget, model,
                {op.value: v.nbytes for op, v in zip(s.node.operands, s.inputs)}):
            steps.append(s)
            continue
        first, combine, _ = partials.split_nodes(s.node, s.pieces, next(fresh))
        info = first.result
        # a partial tile is an output tile's bytes: extent 1 along each kept label
        value = TiledValue(info.name, info.shape, info.dtype, s.result.tile + (1,) * len(first.kept),
                           key_names(first.keys))
        steps.append(replace(s, node=first, result=value))
        # the output's tile sides as the step cut them (a stored input's may not be even), the
        # kept labels' one element each
        tiles = {lab: s.tile_of[lab] for lab in s.node.output} | dict.fromkeys(first.kept, 1)
        steps.append(EinsumStep(combine, (value,), s.result,
                                Chunking(tuple(sorted(combine.size.items())), tuple(sorted(tiles.items())))))
    return replace(d, steps=tuple(steps))
