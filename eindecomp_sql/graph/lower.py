"""Lower one (possibly many-operand) extended einsum to a list of einsum nodes.

A many-operand einsum whose join distributes over its aggregation (a semiring such as
mul/sum or add/max) becomes a tree of binary nodes in the order opt_einsum's contraction path
chooses; any other join (say ``x + y - z`` with sum) stays one n-ary node, because splitting
it would change its meaning.
"""

from __future__ import annotations

import opt_einsum

from ..notation import Aggregation, EinsumSpec, JoinFunction
from ..notation.functions import is_semiring
from ..notation.numpy_impl import result_dtype
from .node import EinsumNode, Operand, ValueInfo


def _node(operands, output, sizes, join, agg, dtypes, name, dtype=None) -> EinsumNode:
    labels = {lab for op in operands for lab in op.labels}
    reduces = bool(labels - set(output))
    dtype = dtype or result_dtype(join, agg, dtypes, reduces)
    shape = tuple(sizes[lab] for lab in output)
    used = tuple(sorted((lab, sizes[lab]) for lab in labels | set(output)))
    return EinsumNode(tuple(operands), tuple(output), used, join, agg, ValueInfo(name, shape, str(dtype)))


def lower_einsum(
    spec: EinsumSpec,
    inputs: list[ValueInfo],
    join: JoinFunction,
    agg: Aggregation,
    result_name: str,
    temp_prefix: str = "_eds_t",
) -> list[EinsumNode]:
    """Nodes computing ``spec`` over ``inputs``; the last node produces ``result_name``."""
    sizes = spec.size
    operands = [Operand(v.name, labs, sq) for v, labs, sq in zip(inputs, spec.inputs, spec.squeezed)]
    dtypes = {v.name: v.dtype for v in inputs}
    if len(operands) <= 2 or not is_semiring(join, agg):
        return [_node(operands, spec.output, sizes, join, agg, [v.dtype for v in inputs], result_name)]

    # opt_einsum sees single characters; map our labels (letters and e0, e1, ...) onto symbols
    symbol = {lab: opt_einsum.get_symbol(k) for k, lab in enumerate(spec.labels)}
    text = ",".join("".join(symbol[lab] for lab in op.labels) for op in operands)
    text += "->" + "".join(symbol[lab] for lab in spec.output)
    shapes = [tuple(sizes[lab] for lab in op.labels) for op in operands]
    path, _ = opt_einsum.contract_path(text, *shapes, shapes=True, optimize="auto")

    # like np.einsum, compute every step of a product in the promoted dtype of all operands
    dtype = result_dtype(join, agg, list(dtypes.values()), True)
    nodes: list[EinsumNode] = []
    live = list(operands)
    for step, positions in enumerate(path):
        picked = [live[p] for p in sorted(positions)]
        live = [op for p, op in enumerate(live) if p not in positions]
        last = not live
        if last:
            out = spec.output
            name = result_name
        else:
            needed = set(spec.output) | {lab for op in live for lab in op.labels}
            seen: dict[str, None] = {}
            for op in picked:
                seen.update(dict.fromkeys(lab for lab in op.labels if lab in needed))
            out = tuple(seen)
            name = f"{temp_prefix}{step}"
        node = _node(picked, out, sizes, join, agg, [dtypes[op.value] for op in picked], name, dtype)
        dtypes[name] = node.result.dtype
        nodes.append(node)
        live.append(Operand(name, out))
    if not nodes or nodes[-1].result.name != result_name:  # a path of zero steps: one operand
        nodes.append(_node(live, spec.output, sizes, join, agg, [dtypes[op.value] for op in live], result_name, dtype))
    return nodes

