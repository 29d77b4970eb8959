"""Pass: a contraction whose result only feeds, through element-wise nodes, one operand of
another contraction runs inside that contraction's step: one statement, and the intermediate
never stored. The FFN ``relu(x @ w1) @ w2`` under a tile cap or a budget is the case: cut over
the hidden label ``o``, each joined row computes ``relu(x_b @ w1_o) @ w2_o`` in its kernel and
the step sums the rows over ``o``, as a 3-operand einsum step would; the hidden value
(470 MB for a bfloat16 8192 x 28672) never crosses the engine or a re-tile.

A *chain* is a producer P (a node that reduces a label), one or more element-wise nodes E...
(maps, scales, transposes, and joins of such values without a broadcast), and a consumer C
reading the last of them as one operand. The element-wise nodes may join several branches,
each starting at a producer of its own: SwiGLU's ``(silu(x @ w1) * (x @ w3)) @ w2`` is one
chain with two producers. Every value in between is read once, by the next node, and is no
output. The pass replaces them by one node F over the producers' operands (an operand two
producers read alike, SwiGLU's ``x``, once) and C's others, with C's output, join and
aggregation, and with ``whole`` labels (``graph/node.py``) that no chunking cuts: the
producers' reduced labels (their tiles are computed whole inside the kernel) and C's labels
that the chain's value lacks (cut, they would make each kernel compute the producers' tiles
again). The optimizer then
prices F as the join it is (its tiles, rows and partial results), and ``insert_retiles`` gives
F's step the ``Fusion`` that computes P and E... as prologues of C (``steps.Fusion``; a
prologue that reduces runs as an einsum kernel of its own: ``udfs/kernels.py``).

The pass runs only when ``Options.chains`` is set: ``graph_plan`` plans a graph with and
without it and keeps the chained plan where it costs no more under the engine's model, the
unchained plan's writes of the hidden values counted (the model prices what steps read, not
what they write), and fits the budget and the tile cap; a tie goes to the plan with fewer
steps. A plan whose every value is one tile stays a program (``passes/program.py``).

>>> from eindecomp_sql.graph import Graph
>>> from eindecomp_sql.plan.graph_plan import plan_graph
>>> g = Graph(); x = g.input("x", (256, 64)); w1 = g.input("w1", (64, 2048)); w2 = g.input("w2", (2048, 64))
>>> y = g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", x, w1)), w2)
>>> [s.describe() for s in plan_graph(g, outputs=y, memory="4MB").plan.steps]  # doctest: +NORMALIZE_WHITESPACE
['einsum v1 = bj,jo->bo; v2 = relu; bo,oi->bi [b:8 j:1 o:1 i:1] in 8 batches over b:8 -> v3
  [fused v1, v2; v1, v2 not stored]']
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from ...graph import EinsumNode, Operand
from ..draft import Draft
from ..kernel_spec import MAX_OPERANDS
from ..steps import Fusion


_LETTERS = "jklmnpqrstuvwxyzabcdefgh"


@dataclass(frozen=True)
class Chain:
    """One fused chain: the node ``F`` standing for it (by its result, C's), the ``Fusion`` its
    step runs, and each hidden node's labels in F's (its result name, (its label, F's label)...),
    by which the choice shows their pieces."""

    result: str
    fusion: Fusion
    labels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


def fuse_chains(d: Draft) -> Draft:
    if not d.options.chains or d.options.fuse is not True:
        return d
    nodes, chains = find_chains(d.nodes, set(d.outputs))
    return replace(d, nodes=nodes, chains=chains) if chains else d


def find_chains(nodes: tuple[EinsumNode, ...], keep: set[str]) -> tuple[tuple[EinsumNode, ...], tuple[Chain, ...]]:
    """``nodes`` with every chain replaced by its fused node (at the consumer's place: every
    operand is computed before it), and the chains."""
    producer = {n.result.name: n for n in nodes}
    readers: dict[str, int] = {}
    for n in nodes:
        for op in n.operands:
            readers[op.value] = readers.get(op.value, 0) + 1
    used: set[str] = set()  # nodes already in a chain
    replaced: dict[str, EinsumNode] = {}
    chains = []
    for c in nodes:
        if c.result.name in used or not c.reduced:
            continue
        for op in c.operands:
            found = _chain(c, op, producer, readers, keep, used)
            if found is None:
                continue
            fused, chain, members = found
            replaced[c.result.name] = fused
            used.update(members)
            used.add(c.result.name)
            chains.append(chain)
            break
    if not chains:
        return nodes, ()
    out = tuple(replaced.get(n.result.name, n) for n in nodes if n.result.name not in used or n.result.name in replaced)
    return out, tuple(chains)


def _chain(c: EinsumNode, op: Operand, producer: dict, readers: dict, keep: set, used: set):
    if op.dropped or len(set(op.labels)) != len(op.labels):
        return None
    if sum(o.value == op.value for o in c.operands) != 1:
        return None
    order = _hidden(op.value, op.labels, producer, readers, keep, used)
    if order is None or all(n.reduced for n, _ in order):
        return None  # a product of products is an einsum of its own (the optimizer's paths)
    producers = [(n, to) for n, to in order if n.reduced]
    if any(len(set(o.labels)) != len(o.labels) for p, _ in producers for o in p.operands):
        return None
    taken = set(c.labels) | {lab for _, to in order for lab in to.values()}
    fresh: dict[str, int] = {}  # the names given to producers' reduced labels -> their sizes
    relabeled = []
    for n, to in order:
        if n.reduced:
            to.update(_reduced_names(n, to, relabeled, fresh, taken))
        relabeled.append(_relabel(n, to))
    hidden = tuple(relabeled)
    others = tuple(o for o in c.operands if o is not op)
    # an operand two producers read alike (SwiGLU's x, under both halves) is read once
    operands = tuple(dict.fromkeys(o for n in hidden if n.reduced for o in n.operands)) + others
    if len(operands) > MAX_OPERANDS:
        return None
    sizes = dict(c.size)
    for n in hidden:
        sizes.update(n.size)
    whole = tuple(fresh) + tuple(lab for lab in c.labels if lab not in op.labels)
    held = tuple((n.output, n.result.dtype) for n in hidden)
    fused = EinsumNode(operands, c.output, tuple(sorted(sizes.items())), c.join, c.agg, c.result, whole=whole,
                       held=held)
    chain = Chain(c.result.name, Fusion(c, prologues=hidden),
                  tuple((n.result.name, tuple(to.items())) for n, to in order))
    return fused, chain, [n.result.name for n, _ in order]


def _hidden(name: str, labels: tuple, producer: dict, readers: dict, keep: set, used: set):
    """The nodes computing value ``name`` (whose axes carry ``labels``, in C's labels) back to
    the products they start from, in the order a kernel computes them, each with its labels in
    C's (its reduced ones not yet named); None unless each is an element-wise node over values
    of its own labels (a map, a scale, a transpose, ``x * y``: no broadcast) or a product, and
    each value is read once, by the next node, and kept by no one."""
    n = producer.get(name)
    if n is None or name in keep or readers.get(name) != 1 or name in used:
        return None
    to = dict(zip(n.output, labels))
    if n.reduced:
        return [(n, to)]
    if not n.elementwise or any(o.dropped or set(o.labels) != set(n.output) for o in n.operands):
        return None  # a broadcast: not a value the kernel computes tile by tile
    order = []
    for o in n.operands:
        found = _hidden(o.value, tuple(to[lab] for lab in o.labels), producer, readers, keep, used)
        if found is None:
            return None
        order += found
    return order + [(n, to)]


def _reduced_names(p: EinsumNode, to: dict, done: list, fresh: dict, taken: set) -> dict:
    """Names in F for ``p``'s reduced labels, which C does not use: where an earlier producer
    reads the same value at the same axis (SwiGLU's ``x @ w1`` and ``x @ w3``), that
    producer's name, so that F reads the operand once; else a free letter first."""
    names: dict[str, str] = {}
    for o in p.operands:
        for q in done:
            for e in q.operands if q.reduced else ():
                if e.value != o.value or e.dropped != o.dropped or len(e.labels) != len(o.labels):
                    continue
                for lab, other in zip(o.labels, e.labels):
                    if lab in p.reduced and lab not in names and other in fresh and other not in names.values():
                        names[lab] = other
    for lab in p.reduced:
        if lab not in names:
            candidates = itertools.chain((lab, *_LETTERS), (f"{lab}_{k}" for k in itertools.count(1)))
            names[lab] = next(x for x in candidates if x not in taken)
            taken.add(names[lab])
            fresh[names[lab]] = p.size[lab]
    return names


def _relabel(n: EinsumNode, to: dict[str, str]) -> EinsumNode:
    ops = tuple(Operand(o.value, tuple(to[lab] for lab in o.labels), o.dropped) for o in n.operands)
    return EinsumNode(ops, tuple(to[lab] for lab in n.output), tuple(sorted((to[lab], s) for lab, s in n.sizes)),
                      n.join, n.agg, n.result)
