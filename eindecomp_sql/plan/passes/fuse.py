"""Pass: element-wise nodes run inside the kernel of the einsum next to them, so a graph runs
as few statements as its plan needs.

An *element-wise* node reduces no label (a map such as ``relu``, a scale ``x * 0.125``, a
broadcast ``add``, ``elementwise``, a transpose). It fuses

- into the step that **produces** its operand, as an *epilogue* applied to every finished
  output tile (after the aggregation), when that operand is read by this node alone, is not an
  output of the plan, is read as it is cut (no retile between: the tilings agree) and the
  node's output has exactly the operand's labels. Its other operands join the step's SQL on the
  output keys, cut as the output is;
- otherwise into the step that **consumes** its result, as a *prologue* computing that
  einsum's operand tile by tile, when the result is read by that step's contraction alone, is
  not an output, is read as cut, and each of its tiles is read once (no label it lacks is cut
  into pieces: nothing is computed twice).

Either way a statement and a stored intermediate go; the fused step keeps the chunking of the
einsum it joins (the fused node's agrees with it), must not cost more under the cost model and
must fit the memory budget. Epilogues are tried first: they compute each element once, however
the consumer replicates its operands. A chain of them (``relu`` then a scale) fuses one after
the other; a prologue may carry a whole chain of element-wise nodes.

>>> from eindecomp_sql.graph import Graph
>>> from eindecomp_sql.plan.graph_plan import plan_graph
>>> g = Graph(); x = g.input("x", (8, 4)); w = g.input("w", (4, 6)); v = g.input("v", (6, 3))
>>> h = g.map("relu", g.einsum("bi,io->bo", x, w))
>>> [s.describe() for s in plan_graph(g, outputs=g.einsum("bo,op->bp", h, v), fuse="elementwise").plan.steps]
['einsum bi,io->bo + relu [b:1 i:1 o:1] -> v2 [fused v2; v1 not stored]', 'einsum bo,op->bp [b:1 o:1 p:1] -> v3']
"""

from __future__ import annotations

from dataclasses import replace

from ...graph import EinsumNode, Operand
from ..cost import Costs, max_batches
from ..draft import Draft
from ..kernel_spec import MAX_OPERANDS
from ..steps import EinsumStep, Fusion, RetileStep, TiledValue, step_reads


def fuse_elementwise(d: Draft) -> Draft:
    if not d.options.fuse:
        return d
    keep = set(d.outputs)
    steps = list(d.steps)
    _fuse_epilogues(steps, keep, d.options)
    _fuse_prologues(steps, keep, d.options)
    _drop_unread(steps, keep)
    return replace(d, steps=tuple(steps))


# -- what a step reads and runs ----------------------------------------------------------------
def _reads(step) -> tuple[str, ...]:
    return tuple(v.name for v in step_reads(step))


class _Index:
    """Who reads each value (how many steps) and which einsum step makes it, by position;
    rebuilt after every fusion (positions shift)."""

    def __init__(self, steps: list):
        self.readers: dict[str, list[int]] = {}
        self.producer: dict[str, int] = {}
        for k, s in enumerate(steps):
            for name in dict.fromkeys(_reads(s)):
                self.readers.setdefault(name, []).append(k)
            if isinstance(s, EinsumStep):
                self.producer[s.result.name] = k


def _program(step: EinsumStep) -> Fusion:
    return step.fused if step.fused is not None else Fusion(step.node)


def relabel(node: EinsumNode, to: dict[str, str]) -> EinsumNode:
    """``node`` with every label renamed by ``to`` (which covers them all, one to one)."""
    ops = tuple(Operand(op.value, tuple(to[lab] for lab in op.labels), op.dropped) for op in node.operands)
    return EinsumNode(ops, tuple(to[lab] for lab in node.output), tuple(sorted((to[lab], n) for lab, n in node.sizes)),
                      node.join, node.agg, node.result)


def _key(op: Operand) -> tuple:
    return op.value, op.labels, op.dropped


def _cut_as(op: Operand, v: TiledValue, tile: dict[str, int]) -> bool:
    """Whether ``v``, read as ``op``, is cut the way the step cuts ``op``'s labels."""
    kept = [t for ax, t in enumerate(v.tile) if ax not in op.dropped]
    return len(kept) == len(op.labels) and all(t == tile[lab] for t, lab in zip(kept, op.labels))


def _fused_step(fusion: Fusion, base: EinsumStep, sources, result: TiledValue) -> EinsumStep | None:
    """The step running ``fusion`` with ``base``'s chunking: its SQL joins every tile a node
    reads that no node computes (``sources``: (operand in the step's labels, the value read),
    each tile once), and stores the last node's result as ``result``. None if a tile the
    nodes read is not cut as the step cuts its labels."""
    available: dict[tuple, TiledValue] = {}
    for op, v in sources:
        available.setdefault(_key(op), v)
    inside = {n.result.name for n in fusion.nodes}
    operands, inputs, seen = [], [], set()
    for n in fusion.nodes:
        for op in n.operands:
            if op.value in inside or _key(op) in seen:
                continue
            seen.add(_key(op))
            operands.append(op)
            inputs.append(available[_key(op)])
    if len(operands) > MAX_OPERANDS:
        return None  # no kernel takes that many tiles
    last = fusion.nodes[-1]
    sizes: dict[str, int] = {}
    for n in fusion.nodes:
        sizes.update(n.size)
    # a fused chain's step (passes/chains.py) keeps its whole labels, and its kernel holds a
    # tile of every value it computes and does not store
    held = tuple((n.output, n.result.dtype) for n in fusion.nodes[:-1]) if base.node.held else ()
    node = EinsumNode(tuple(operands), last.output, tuple(sorted(sizes.items())), fusion.core.join,
                      fusion.core.agg, last.result, whole=base.node.whole, held=held)
    tile = base.chunk.tile_of
    # labels a chain's contraction prologue reduces inside the kernel are the step's too
    inner = {lab for n in fusion.prologues for lab in n.reduced}
    if set(node.labels) != set(fusion.core.labels) | inner or set(node.reduced) != set(fusion.core.reduced) | inner:
        return None  # cannot happen for the fusions below; kept as the invariant the kernels rely on
    if not all(_cut_as(op, v, tile) for op, v in zip(operands, inputs)):
        return None
    return EinsumStep(node, tuple(inputs), result, base.chunk, fused=fusion)


def _worth(fused: EinsumStep, parts: list[EinsumStep], options) -> bool:
    """No dearer than the steps it replaces under the cost model, and within the budget."""
    model = options.costs
    before = Costs(model=model)
    for s in parts:
        before = before + s.costs_on(model)
    if fused.costs_on(model).total > before.total:
        return False
    if options.budget is not None:
        most = replace(fused, batches=max_batches(fused.node, fused.pieces, model))
        if most.peak(model) > options.budget:
            return False
    return True


# -- epilogues: into the producer ------------------------------------------------------------
def _fuse_epilogues(steps: list, keep: set[str], options) -> None:
    index = _Index(steps)
    k = 0
    while k < len(steps):
        s = steps[k]
        if isinstance(s, EinsumStep) and s.fused is None and s.node.elementwise:
            found = _as_epilogue(steps, k, index, keep, options)
            if found is not None:
                j, fused = found  # the producer, always before k
                steps[k] = fused
                del steps[j]
                index = _Index(steps)
                continue  # k now holds the next step
        k += 1


def _as_epilogue(steps: list, k: int, index: _Index, keep: set[str], options):
    s = steps[k]
    node = s.node
    for op, v in zip(node.operands, s.inputs):
        name = op.value
        if v.name != name or name in keep or op.dropped:
            continue  # re-tiled on the way (the tilings disagree), or kept
        if len(op.labels) != len(node.output) or set(op.labels) != set(node.output):
            continue  # the node broadcasts this operand: its tiles are not the output's
        if any(o.value == name and o != op for o in node.operands):
            continue
        j = index.producer.get(name)
        if j is None or index.readers.get(name) != [k]:
            continue
        p = steps[j]
        prog = _program(p)
        to = dict(zip(op.labels, prog.nodes[-1].output))
        fusion = Fusion(prog.core, prog.prologues, prog.epilogues + (relabel(node, to),))
        sources = list(zip(p.node.operands, p.inputs)) + [
            (relabel_operand(o, to), w) for o, w in zip(node.operands, s.inputs) if o.value != name]
        fused = _fused_step(fusion, p, sources, s.result)
        if fused is not None and _worth(fused, [p, s], options):
            return j, fused
    return None


def relabel_operand(op: Operand, to: dict[str, str]) -> Operand:
    return Operand(op.value, tuple(to[lab] for lab in op.labels), op.dropped)


# -- prologues: into the consumer ------------------------------------------------------------
def _fuse_prologues(steps: list, keep: set[str], options) -> None:
    index = _Index(steps)
    k = 0
    while k < len(steps):
        p = steps[k]
        if (isinstance(p, EinsumStep) and p.result.name not in keep
                and all(n.elementwise for n in _program(p).nodes)):
            readers = index.readers.get(p.result.name, [])
            if len(readers) == 1 and isinstance(steps[readers[0]], EinsumStep):
                c = readers[0]
                fused = _as_prologue(p, steps[c], options)
                if fused is not None:
                    steps[c] = fused
                    del steps[k]
                    index = _Index(steps)
                    continue
        k += 1


def _as_prologue(p: EinsumStep, c: EinsumStep, options) -> EinsumStep | None:
    name = p.result.name
    reads = [(op, v) for op, v in zip(c.node.operands, c.inputs) if op.value == name]
    if len(reads) != 1 or reads[0][1].name != name:
        return None  # read twice, or re-tiled on the way (the tilings disagree)
    prog = _program(c)
    core = prog.core
    if any(op.value == name for n in prog.prologues + prog.epilogues for op in n.operands):
        return None  # only the contraction's own operands are computed in front of it
    mine = [o for o in core.operands if o.value == name]
    if len(mine) != 1 or mine[0].dropped or len(set(mine[0].labels)) != len(mine[0].labels):
        return None
    op = mine[0]
    # computed once per tile: no label the operand lacks is cut (its tiles would be replicated)
    pieces = c.pieces
    if any(pieces[lab] > 1 for lab in c.node.labels if lab not in op.labels):
        return None
    mine_prog = _program(p)
    tail = mine_prog.nodes[-1]
    to = dict(zip(tail.output, op.labels))
    if not all(set(n.size) <= set(to) for n in mine_prog.nodes):
        return None
    fusion = Fusion(core, prog.prologues + tuple(relabel(n, to) for n in mine_prog.nodes), prog.epilogues)
    sources = list(zip(c.node.operands, c.inputs)) + [
        (relabel_operand(o, to), w) for o, w in zip(p.node.operands, p.inputs)]
    fused = _fused_step(fusion, c, sources, c.result)
    if fused is not None and _worth(fused, [p, c], options):
        return fused
    return None


def _drop_unread(steps: list, keep: set[str]) -> None:
    """Re-tiles nothing reads any more: two fused nodes that re-tiled one value the same way
    each now read the first copy."""
    read = {name for s in steps for name in _reads(s)}
    steps[:] = [s for s in steps if not (isinstance(s, RetileStep) and s.target.name not in keep | read)]
