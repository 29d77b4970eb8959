"""numpy meaning of joins and aggregations: the one definition both the tile kernels and the
dtype inference use, so a plan's declared dtype is exactly what the kernels produce.

>>> join_callable(parse_join("relu(x - y)", 2))(np.array([1., 5.]), np.array([2., 2.]))
array([0., 3.])
"""

from __future__ import annotations

import ast
from functools import lru_cache, reduce
from typing import Callable

import numpy as np

from ..errors import EinsumError
from .functions import Aggregation, JoinFunction, operand_index, parse_join  # noqa: F401

AGG_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def _relu(a):
    return np.maximum(a, np.zeros((), dtype=np.asarray(a).dtype))


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


UNARY = {
    "identity": lambda a: a,
    "exp": np.exp,
    "log": np.log,
    "relu": _relu,
    "neg": np.negative,
    "square": np.square,
    "sqrt": np.sqrt,
    "abs": np.abs,
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "sin": np.sin,
    "cos": np.cos,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sign": np.sign,
}
BINARY = {
    "mul": np.multiply,
    "add": np.add,
    "sub": np.subtract,
    "div": np.true_divide,
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
}


def _fold(ufunc):
    return lambda *xs: reduce(ufunc, xs)


_EXPR_NAMESPACE = {
    **{k: v for k, v in UNARY.items()},
    "max": _fold(np.maximum),
    "min": _fold(np.minimum),
    "where": np.where,
    "pow": np.power,
    "_and": np.logical_and,
    "_or": np.logical_or,
    "_not": np.logical_not,
}


class _Vectorize(ast.NodeTransformer):
    """Rewrite scalar Python syntax into numpy calls that work on whole arrays."""

    def visit_IfExp(self, node):
        self.generic_visit(node)
        return ast.Call(ast.Name("where", ast.Load()), [node.test, node.body, node.orelse], [])

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        name = "_and" if isinstance(node.op, ast.And) else "_or"
        return reduce(lambda a, b: ast.Call(ast.Name(name, ast.Load()), [a, b], []), node.values)

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return ast.Call(ast.Name("_not", ast.Load()), [node.operand], [])
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        parts, left = [], node.left
        for op, right in zip(node.ops, node.comparators):
            parts.append(ast.Compare(left, [op], [right]))
            left = right
        return reduce(lambda a, b: ast.Call(ast.Name("_and", ast.Load()), [a, b], []), parts)

    def visit_Name(self, node):
        k = operand_index(node.id)
        if k is not None:
            return ast.Subscript(ast.Name("_x", ast.Load()), ast.Constant(k), ast.Load())
        return node


@lru_cache(maxsize=256)
def _compile_expr(text: str) -> Callable:
    tree = _Vectorize().visit(ast.parse(text, mode="eval"))
    ast.fix_missing_locations(tree)
    code = compile(tree, "<join expression>", "eval")
    namespace = {"__builtins__": {}, **_EXPR_NAMESPACE}
    return lambda *xs: eval(code, namespace, {"_x": xs})  # noqa: S307 - AST validated by parse_join


def join_callable(join: JoinFunction) -> Callable:
    """The join as a function of numpy arrays (broadcasting)."""
    if join.func is not None:
        return lambda *xs: np.asarray(join.func(*xs))
    if join.expr is not None:
        return _compile_expr(join.expr)
    if join.name in UNARY:
        return UNARY[join.name]
    return _fold(BINARY[join.name])


def result_dtype(join: JoinFunction, agg: Aggregation, dtypes: list[np.dtype], reduces: bool) -> np.dtype:
    """The dtype numpy gives for this join/agg on these input dtypes."""
    dtypes = [np.dtype(d) for d in dtypes]
    if join.name == "mul" and agg.name == "sum":
        # np.einsum keeps the promoted input dtype (bool stays bool)
        return np.result_type(*dtypes) if dtypes else np.dtype("float64")
    ones = [np.ones(2, dtype=d) for d in dtypes]
    try:
        with np.errstate(all="ignore"):
            vals = np.asarray(join_callable(join)(*ones))
    except Exception as e:  # noqa: BLE001 - a user's join failing on a probe is bad input
        raise EinsumError(f"join {join.label} failed on a probe of dtypes {[d.name for d in dtypes]}: {e}") from e
    if reduces:
        vals = AGG_UFUNC[agg.name].reduce(np.broadcast_to(vals, (2,)), axis=0)
    return np.asarray(vals).dtype
