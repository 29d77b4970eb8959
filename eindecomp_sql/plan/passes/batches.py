"""Pass: a step whose projected peak exceeds the memory budget is split into the fewest
statements (batches, over ranges of the keys of one or two output labels) that fit. A fill
is always cut to the budget's size or, without one, left whole.

>>> from eindecomp_sql.plan.draft import example
>>> from eindecomp_sql.plan.passes.chunking import choose_chunking
>>> from eindecomp_sql.plan.passes.retiles import insert_retiles
>>> d = example("ij,jk->ik", (512, 512), (512, 512), budget=4_000_000)
>>> [(s.batches, s.batch_grid) for s in split_batches(insert_retiles(choose_chunking(d))).steps]
[(16, (('i', 4), ('k', 4)))]
"""

from __future__ import annotations

from dataclasses import replace

from ..cost import batch_options, choose_batches, retile_max_batches, retile_peak
from ..draft import Draft
from ..steps import EinsumStep, FillStep, ProgramStep, RetileStep, fill_peak


def split_batches(d: Draft) -> Draft:
    budget = d.options.budget
    return replace(d, steps=tuple(_batched(s, budget, d.options.costs) for s in d.steps))


def _batched(step, budget, model):
    if isinstance(step, FillStep):
        r = step.result
        most = r.grid[0] if r.shape and r.nbytes else 1  # batches cut the first key
        return replace(step, batches=choose_batches(lambda b: fill_peak(r, b), most, budget))
    if budget is None or isinstance(step, ProgramStep):
        return step  # a program is one tile: one statement (passes/program.py checked its peak)
    if isinstance(step, RetileStep):
        s, t = step.source, step.target
        b = choose_batches(lambda k: retile_peak(s.shape, s.dtype, t.tile, k, model, s.tile),
                           retile_max_batches(s.shape, t.tile, model), budget)
        return replace(step, batches=b)
    assert isinstance(step, EinsumStep)
    # the step's own peak: a fused step's kernel holds more than its node alone
    b = choose_batches(lambda k: replace(step, batches=k).peak(model), batch_options(step.node, step.pieces, model), budget)
    return replace(step, batches=b)
