"""Pass: choose how many pieces to cut every label of every node into, and how to cut free inputs.

``strategy="eindecomp"`` is the optimizer (``plan/optimize.py``); the others are the fixed
baselines it is compared with. Inputs already cut (stored tensors) and values earlier passes
computed (fills) keep their tiles; a free input takes the tiling the choice gives it.

>>> from eindecomp_sql.plan.draft import example
>>> d = choose_chunking(example("ij,jk->ik", (4096, 64), (64, 64), workers=4))
>>> d.choice.pieces["_eds_result"], d.inputs[0].tile
({'i': 4, 'j': 1, 'k': 1}, (1024, 64))
"""

from __future__ import annotations

from dataclasses import replace

from ...errors import EinsumError
from ...graph import ValueInfo
from ..cost import Costs
from ..draft import Draft
from ..optimize import STRATEGIES, Choice, baseline, optimize


def choose_chunking(d: Draft) -> Draft:
    if not d.nodes:
        return replace(d, choice=Choice({}, {}, Costs(model=d.options.costs)))
    o = d.options
    known = d.values()
    values = {name: ValueInfo(name, v.shape, v.dtype) for name, v in known.items()}
    fixed = {name: v.tile for name, v in known.items() if v.tile is not None}
    if o.strategy == "eindecomp":
        budget = o.budget if o.chunking_budget is None else o.chunking_budget
        choice = optimize(d.nodes, values, fixed, workers=o.workers, budget=budget, tile_bytes=o.tile_bytes,
                          model=o.costs, fuse_into=frozenset(d.outputs) if o.fuse and o.price_epilogues else None)
    elif o.strategy in STRATEGIES:
        choice = baseline(o.strategy, d.nodes, values, fixed, workers=o.workers, model=o.costs)
    else:
        raise EinsumError(f"unknown strategy {o.strategy!r}: use one of {', '.join(STRATEGIES)}")
    if d.chains:  # a fused chain's hidden nodes are cut as its step cuts their labels
        pieces = dict(choice.pieces)
        for chain in d.chains:
            mine = choice.pieces[chain.result]
            pieces.update((name, {lab: mine[f] for lab, f in labels}) for name, labels in chain.labels)
        choice = replace(choice, pieces=pieces)
    inputs = tuple(v if v.tile is not None else replace(v, tile=choice.input_tiles.get(v.name, v.shape))
                   for v in d.inputs)
    return replace(d, choice=choice, inputs=inputs)
