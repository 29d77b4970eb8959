"""Pass: consecutive einsum steps whose every value is one tile run as one *program* step: one
statement, one kernel call computing them all (``steps.ProgramStep``).

Where a plan cuts nothing (a graph at moderate sizes under one worker: the LLaMA block, 25
nodes of up to 8 MB), the relational plan is one row per value, and a statement per node buys
nothing: each cost DuckDB 2-6 ms outside its kernel (creating a table, copying the tiles into
it and out to Arrow again) against a kernel of 1-7 ms (docs/DESIGN.md, "Programs").

A run of steps becomes programs cut so that each stores exactly one value: a result the plan
keeps, or one a step after the program reads, ends the program at the step computing it. A
program must fit the memory budget (it holds its inputs and the results still to be read);
one that does not stays as its steps. ``fuse=False`` or ``"elementwise"`` turns this pass off.

>>> from eindecomp_sql.graph import Graph
>>> from eindecomp_sql.plan.graph_plan import plan_graph
>>> g = Graph(); x = g.input("x", (8, 4)); w = g.input("w", (4, 6)); v = g.input("v", (6, 3))
>>> y = g.einsum("bo,op->bp", g.einsum("bi,io->bo", x, w), v)
>>> for line in plan_graph(g, outputs=y).plan.explain().splitlines()[4:7]:
...     print(line[:78])
  step 0: program of 2 einsums on single tiles -> v2 [v1 not stored] (2,500,29
    0.0: einsum bi,io->bo [b:1 i:1 o:1] -> v1
    0.1: einsum bo,op->bp [b:1 o:1 p:1] -> v2
"""

from __future__ import annotations

from dataclasses import replace

from ..draft import Draft
from ..steps import EinsumStep, ProgramStep, one_tile, step_reads


def fuse_programs(d: Draft) -> Draft:
    if d.options.fuse is not True:
        return d
    steps = list(d.steps)
    readers: dict[str, set[int]] = {}
    for k, s in enumerate(steps):
        for v in step_reads(s):
            readers.setdefault(v.name, set()).add(k)
    keep = set(d.outputs)
    out: list = []
    run: list[int] = []
    for k, s in enumerate(steps + [None]):  # None closes the last run
        if s is not None and _eligible(s):
            run.append(k)
            continue
        for region in _regions(run, steps, readers, keep):
            out.append(_program(region, steps, d.options) if len(region) > 1 else steps[region[0]])
        run = []
        if s is not None:
            out.append(s)
    flat: list = []
    for s in out:  # a program over the budget came back as its steps
        flat += list(s) if isinstance(s, tuple) else [s]
    return replace(d, steps=tuple(flat))


def _eligible(step) -> bool:
    return (isinstance(step, EinsumStep) and step.batches == 1 and one_tile(step.result)
            and all(one_tile(v) for v in step.inputs))


def _regions(run: list[int], steps: list, readers: dict[str, set[int]], keep: set[str]) -> list[list[int]]:
    """``run`` (consecutive eligible steps) cut after every step whose result is kept or read
    outside its region, until each region's only such result is its last step's."""
    regions = [run] if run else []
    changed = True
    while changed:
        changed = False
        for r, region in enumerate(regions):
            inside = set(region)
            for p, k in enumerate(region[:-1]):
                name = steps[k].result.name
                if name in keep or not readers.get(name, set()) <= inside:
                    regions[r:r + 1] = [region[:p + 1], region[p + 1:]]
                    changed = True
                    break
            if changed:
                break
    return regions


def _program(region: list[int], steps: list, options):
    parts = tuple(steps[k] for k in region)
    made = {s.result.name for s in parts}
    inputs: dict[str, object] = {}
    for s in parts:
        for v in s.inputs:
            if v.name not in made:
                inputs.setdefault(v.name, v)
    program = ProgramStep(parts, tuple(inputs.values()))
    if options.budget is not None and program.peak(options.costs) > options.budget:
        return parts  # the budget wins: the steps run one statement each, as before
    return program
