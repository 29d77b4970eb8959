"""Lower one (possibly many-operand) extended einsum to a list of einsum nodes.

A many-operand einsum whose join distributes over its aggregation (a semiring such as
mul/sum or add/max) becomes a tree of binary nodes in the order opt_einsum's contraction path
chooses; any other join (say ``x + y - z`` with sum) stays one n-ary node, because splitting
it would change its meaning.

``path`` picks the contraction order as ``np.einsum``'s ``optimize=`` does (normalised by
``contraction_path``): None for opt_einsum's ``"auto"``, a path algorithm's name with an optional
memory limit, or an explicit list of operand-position tuples.

>>> contraction_path(["einsum_path", (0, 1), (0, 1)], 3)
((0, 1), (0, 1))
>>> contraction_path(("greedy", 1000), 3)
('greedy', 1000)
"""

from __future__ import annotations

import math
import numbers
import operator

import opt_einsum

from ..errors import EinsumError, EinsumTypeError
from ..notation import Aggregation, EinsumSpec, JoinFunction
from ..notation.functions import is_semiring
from ..notation.spec import check_join_space
from ..notation.numpy_impl import result_dtype
from .node import EinsumNode, Operand, ValueInfo


# path algorithms opt_einsum knows (numpy's own are "greedy" and "optimal")
PATH_NAMES = tuple(opt_einsum.paths._PATH_OPTIONS) if hasattr(opt_einsum.paths, "_PATH_OPTIONS") else (
    "auto", "auto-hq", "optimal", "branch-all", "branch-2", "branch-1", "greedy", "eager", "opportunistic", "dp",
    "dynamic-programming", "random-greedy", "random-greedy-128")


def contraction_path(optimize, n_operands: int):
    """numpy's ``optimize=`` argument, checked and normalised: None (let the planner choose:
    ``False``, ``None``), a path algorithm's name (``True`` is numpy's ``"greedy"``), ``(name,
    memory_limit)``, or an explicit path ``["einsum_path", (0, 1), ...]`` as ``np.einsum_path``
    returns it: tuples of positions in the list of operands left, each step's result appended
    at the end. Anything else is an ``EinsumError``."""
    if optimize is None or optimize is False:
        return None
    if optimize is True:
        return "greedy"
    if isinstance(optimize, str):
        if optimize not in PATH_NAMES:
            raise EinsumError(f"optimize={optimize!r}: use True, False, 'greedy', 'optimal', an explicit path "
                              f"['einsum_path', (0, 1), ...] or one of opt_einsum's {', '.join(PATH_NAMES)}")
        return optimize
    if isinstance(optimize, (list, tuple)) and optimize and isinstance(optimize[0], str):
        if optimize[0] == "einsum_path":
            return _explicit_path(optimize[1:], n_operands)
        if len(optimize) == 2 and isinstance(optimize[1], numbers.Real) and not isinstance(optimize[1], bool):
            limit = float(optimize[1])
            if math.isnan(limit):
                raise EinsumError(f"optimize={optimize!r:.80}: the memory limit is NaN")
            # numpy takes any limit; opt_einsum wants a positive int: inf is no limit, <= 0 the least
            name = contraction_path(optimize[0], n_operands)
            return name if math.isinf(limit) and limit > 0 else (name, max(1, int(min(limit, 2**62))))
    raise EinsumTypeError(f"optimize={optimize!r:.80}: did not understand the path; numpy's forms are True, False, "
                      "'greedy', 'optimal', ('greedy', memory_limit) or ['einsum_path', (0, 1), ...]")


def _explicit_path(steps, n_operands: int) -> tuple[tuple[int, ...], ...]:
    left = n_operands
    out = []
    for k, step in enumerate(steps):
        try:
            pos = tuple(operator.index(p) for p in step)  # not int(): 0.5 is no position
        except (TypeError, ValueError):
            raise EinsumError(f"optimize: step {k} of the einsum_path, {step!r:.40}, is not a tuple of operand "
                              "positions") from None
        if not pos or len(set(pos)) != len(pos) or any(not 0 <= p < left for p in pos):
            raise EinsumError(f"optimize: step {k} of the einsum_path, {step!r:.40}, must name distinct positions "
                              f"among the {left} operand(s) left at that step")
        left -= len(pos) - 1
        out.append(pos)
    if left != 1:
        raise EinsumError(f"optimize: invalid einsum_path, {left - 1} more operand(s) have to be contracted")
    return tuple(out)


def _path(text: str, shapes, path) -> list[tuple[int, ...]]:
    if path is None:
        return opt_einsum.contract_path(text, *shapes, shapes=True, optimize="auto")[0]
    if isinstance(path, tuple) and path and isinstance(path[0], tuple):
        return list(path)
    name, limit = path if isinstance(path, tuple) else (path, None)
    return opt_einsum.contract_path(text, *shapes, shapes=True, optimize=name or "auto", memory_limit=limit)[0]


def _node(operands, output, sizes, join, agg, dtypes, name, dtype=None) -> EinsumNode:
    labels = {lab for op in operands for lab in op.labels}
    reduces = bool(labels - set(output))
    dtype = dtype or result_dtype(join, agg, dtypes, reduces)
    shape = tuple(sizes[lab] for lab in output)
    used = tuple(sorted((lab, sizes[lab]) for lab in labels | set(output)))
    return EinsumNode(tuple(operands), tuple(output), used, join, agg, ValueInfo(name, shape, str(dtype)))


def _order_matters(join: JoinFunction, dtypes: list[str]) -> bool:
    """Whether regrouping the join changes numpy's answer: numpy folds operands left to right,
    each ``+`` in the dtype of the two operands it meets. With mixed dtypes a regrouped sum meets
    other pairs first: bool + bool is logical or (True + True is True) until a number joins in,
    int8 + int8 wraps where int8 + int32 does not, and float16 + bool rounds to float16 where
    float16 + float64 is exact (``,aaab,,->b`` over float16, float64, bool, float64 with
    add/max was off by float16's half step). Such an einsum stays one node, joined in numpy's
    order; max and min are exact, and a product summed computes every step in the promoted
    dtype (``lower_einsum``), so only ``add`` is kept whole.

    So is an ``add`` over integers: the regrouped plan takes ``max_j(y + z_j)`` and adds ``x``
    after, which holds only while nothing wraps (int8 ``100 + max(0, 100)`` is -56 where
    numpy's ``max(100 + 0 + 0, 100 + 0 + 100)`` is 100; found by a new user's fuzzing). A float
    ``add`` is still regrouped, as a float sum is: it rounds in another order, as
    ``np.einsum(optimize=True)`` does, and keeps min-plus chains at a product's cost."""
    if join.name != "add":
        return False
    return len(set(dtypes)) > 1 or any(str(d).startswith(("int", "uint")) for d in dtypes)


def lower_einsum(
    spec: EinsumSpec,
    inputs: list[ValueInfo],
    join: JoinFunction,
    agg: Aggregation,
    result_name: str,
    temp_prefix: str = "_eds_t",
    path=None,
    dtype: str | None = None,
) -> list[EinsumNode]:
    """Nodes computing ``spec`` over ``inputs``; the last node produces ``result_name``.
    ``path`` (see ``contraction_path``) orders the binary nodes of a semiring. ``dtype``:
    every node's dtype, a product summed computing in it (numpy's ``einsum(dtype=)``; the
    caller checks the join is one)."""
    sizes = spec.size
    operands = [Operand(v.name, labs, sq) for v, labs, sq in zip(inputs, spec.inputs, spec.squeezed)]
    dtypes = {v.name: v.dtype for v in inputs}
    if len(operands) <= 2 or not is_semiring(join, agg) or _order_matters(join, list(dtypes.values())):
        check_join_space(spec.text, sizes, set(spec.labels) | set(spec.output))
        return [_node(operands, spec.output, sizes, join, agg, [v.dtype for v in inputs], result_name, dtype)]

    # opt_einsum sees single characters; map our labels (letters and e0, e1, ...) onto symbols
    symbol = {lab: opt_einsum.get_symbol(k) for k, lab in enumerate(spec.labels)}
    text = ",".join("".join(symbol[lab] for lab in op.labels) for op in operands)
    text += "->" + "".join(symbol[lab] for lab in spec.output)
    shapes = [tuple(sizes[lab] for lab in op.labels) for op in operands]
    path = _path(text, shapes, path)

    # like np.einsum, compute every step of a product in the promoted dtype of all operands
    dtype = dtype or result_dtype(join, agg, list(dtypes.values()), True)
    nodes: list[EinsumNode] = []
    live = list(operands)
    for step, positions in enumerate(path):
        picked = [live[p] for p in sorted(positions)]
        live = [op for p, op in enumerate(live) if p not in positions]
        # the path's last step makes the result; np.einsum_path may end in a lone-operand step
        # (0,) after the last product, which then is not the last (a trial: KeyError)
        last = step == len(path) - 1
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
        check_join_space(spec.text, sizes, {lab for op in picked for lab in op.labels} | set(out))
        node = _node(picked, out, sizes, join, agg, [dtypes[op.value] for op in picked], name, dtype)
        dtypes[name] = node.result.dtype
        nodes.append(node)
        live.append(Operand(name, out))
    if not nodes or nodes[-1].result.name != result_name:  # a path of zero steps: one operand
        nodes.append(_node(live, spec.output, sizes, join, agg, [dtypes[op.value] for op in live], result_name, dtype))
    return nodes

