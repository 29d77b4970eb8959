"""Run a Graph node by node with an array library (numpy or dask.array): the peers' way of
doing the same work, for the benchmark."""

from __future__ import annotations

import string
from functools import reduce

import numpy as np

from eindecomp_sql.notation.numpy_impl import AGG_UFUNC, join_callable


def _letters(node):
    return {lab: string.ascii_letters[k] for k, lab in enumerate(node.labels)}


def run_node(node, arrays, xp):
    L = _letters(node)
    ops = []
    for op, a in zip(node.operands, arrays):
        if op.dropped:
            a = a.reshape([d for ax, d in enumerate(a.shape) if ax not in op.dropped])
        ops.append(a)
    ins = ["".join(L[lab] for lab in op.labels) for op in node.operands]
    out = "".join(L[lab] for lab in node.output)
    if node.join.name == "mul" and node.agg.name == "sum":
        return xp.einsum(",".join(ins) + "->" + out, *ops, optimize=True)
    order = list(node.output) + [lab for lab in node.labels if lab not in node.output]
    aligned = []
    for a, s in zip(ops, ins):
        uniq = "".join(dict.fromkeys(s))
        if uniq != s:
            a = xp.einsum(f"{s}->{uniq}", a)
        src = "".join(L[lab] for lab in order if L[lab] in uniq)
        if src != uniq:
            a = xp.einsum(f"{uniq}->{src}", a)
        shape = [a.shape[src.index(L[lab])] if L[lab] in uniq else 1 for lab in order]
        aligned.append(a.reshape(shape))
    vals = join_callable(node.join)(*aligned)
    axes = tuple(range(len(node.output), len(order)))
    if not axes:
        return vals
    ufunc = AGG_UFUNC[node.agg.name]
    if xp is np:
        return ufunc.reduce(vals, axis=axes)
    return {"sum": xp.sum, "max": xp.max, "min": xp.min, "prod": xp.prod}[node.agg.name](vals, axis=axes)


def evaluate(graph, inputs: dict, xp=np, compute=True):
    values = dict(inputs)
    for node in graph.nodes:
        values[node.result.name] = run_node(node, [values[op.value] for op in node.operands], xp)
    outs = [values[v.name] for v in graph.outputs]
    if xp is not np and compute:
        import dask

        outs = list(dask.compute(*outs))
    return outs[0] if len(outs) == 1 else outs


__all__ = ["evaluate", "reduce"]
