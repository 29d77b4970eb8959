"""Pass: a contraction whose result only feeds, through element-wise nodes, one operand of
another contraction runs inside that contraction's step: one statement, and the intermediate
never stored. The FFN ``relu(x @ w1) @ w2`` under a tile cap or a budget is the case: cut over
the hidden label ``o``, each joined row computes ``relu(x_b @ w1_o) @ w2_o`` in its kernel and
the step sums the rows over ``o``, as a 3-operand einsum step would; the hidden value
(470 MB for a bfloat16 8192 x 28672) never crosses the engine or a re-tile.

A *chain* is a producer P (a node that reduces a label), one or more element-wise nodes E...
each reading only the value before it (maps, scales, transposes: one operand), and a consumer C reading the
last of them as one operand. Every value in between is read once, by the next node, and is no
output. The pass replaces the three by one node F over P's operands and C's others, with C's
output, join and aggregation, and with ``whole`` labels (``graph/node.py``) that no chunking
cuts: P's reduced labels (P's tile is computed whole inside the kernel) and C's labels that
P's result lacks (cut, they would make each kernel compute P's tile again). The optimizer then
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
    # walk back through element-wise nodes, each value read once and kept by no one
    to = {}  # the current node's labels -> C's
    labels_of = op.labels  # the current value's axes, in C's labels
    between: list[tuple[EinsumNode, dict]] = []
    name = op.value
    while True:
        n = producer.get(name)
        if n is None or name in keep or readers.get(name) != 1 or name in used:
            return None
        to = dict(zip(n.output, labels_of))
        if n.reduced:
            break
        if not n.elementwise or len(n.operands) != 1 or n.operands[0].dropped \
                or set(n.operands[0].labels) != set(n.output):
            return None  # a broadcast or a second operand: not a one-value chain
        between.append((n, to))
        labels_of = tuple(to[lab] for lab in n.operands[0].labels)
        name = n.operands[0].value
    p = n
    if not between or any(len(set(o.labels)) != len(o.labels) for o in p.operands):
        return None  # a product of products is an einsum of its own (the optimizer's paths)
    taken = set(c.labels) | set(to.values())
    for lab in p.reduced:  # P's reduced labels get names C does not use: a free letter first
        names = itertools.chain((lab, *_LETTERS), (f"{lab}_{k}" for k in itertools.count(1)))
        to[lab] = next(x for x in names if x not in taken)
        taken.add(to[lab])
    p_f = _relabel(p, to)
    hidden = [p_f] + [_relabel(e, m) for e, m in reversed(between)]
    others = tuple(o for o in c.operands if o is not op)
    operands = p_f.operands + others
    if len(operands) > MAX_OPERANDS:
        return None
    sizes = dict(c.size)
    sizes.update(p_f.size)
    whole = tuple(to[lab] for lab in p.reduced) + tuple(lab for lab in c.labels if lab not in op.labels)
    held = tuple((n.output, n.result.dtype) for n in hidden)
    fused = EinsumNode(operands, c.output, tuple(sorted(sizes.items())), c.join, c.agg, c.result, whole=whole,
                       held=held)
    chain = Chain(c.result.name, Fusion(c, prologues=tuple(hidden)),
                  tuple((n.result.name, tuple(m.items())) for n, m in [(p, to)] + list(reversed(between))))
    return fused, chain, [p.result.name] + [e.result.name for e, _ in between]


def _relabel(n: EinsumNode, to: dict[str, str]) -> EinsumNode:
    ops = tuple(Operand(o.value, tuple(to[lab] for lab in o.labels), o.dropped) for o in n.operands)
    return EinsumNode(ops, tuple(to[lab] for lab in n.output), tuple(sorted((to[lab], s) for lab, s in n.sizes)),
                      n.join, n.agg, n.result)
