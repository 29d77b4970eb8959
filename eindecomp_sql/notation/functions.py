"""Join functions and aggregations of the extended einsum notation.

A *join* is an element-wise function of the inputs: a name (``"mul"``, ``"add"``, ``"sub"``,
``"div"``, ``"max"``, ``"min"``, ``"pow"``; for one operand ``"exp"``, ``"log"``, ``"relu"``,
``"neg"``, ``"square"``, ``"sqrt"``, ``"abs"``, ``"identity"``), a small scalar expression
over the operands ``x, y, z, w`` (or ``x0, x1, ...``) such as ``"relu(x - y)"`` or
``"where(x > y, x, 0.5 * y)"`` (comparisons, ``and``, ``or`` and ``not`` are element-wise and
logical, numpy's ``logical_or`` and kin: a bool, never an operand's value as Python's ``or``
returns; ``max`` and ``min`` take two or more arguments), or a Python callable taking numpy
arrays. An *aggregation*
combines the values of the labels not in the output: ``sum``, ``max``, ``min`` or ``prod``.

This module only validates and describes; ``udfs/`` turns a description into numpy code.

>>> parse_join("relu(x - y)", 2).expr
'relu(x - y)'
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable

from ..errors import EinsumError, caret

BINARY_JOINS = ("mul", "add", "sub", "div", "max", "min", "pow")
UNARY_JOINS = ("identity", "exp", "log", "relu", "neg", "square", "sqrt", "abs", "sigmoid", "tanh")
AGGREGATIONS = ("sum", "max", "min", "prod")

# Functions callable inside a join expression: name -> number of arguments (None: 2 or more:
# max(x) was read as x, where Python's max of one number and np.maximum refuse it; a trial).
EXPR_FUNCTIONS = {
    "exp": 1, "log": 1, "relu": 1, "neg": 1, "square": 1, "sqrt": 1, "abs": 1, "sigmoid": 1,
    "tanh": 1, "sin": 1, "cos": 1, "log1p": 1, "expm1": 1, "sign": 1,
    "max": None, "min": None, "where": 3, "pow": 2,
}
_OPERAND_NAMES = ("x", "y", "z", "w")

# (join, agg) pairs that form a commutative semiring: the join distributes over the
# aggregation, so a many-operand einsum may be lowered to a tree of binary ones.
SEMIRINGS = frozenset({("mul", "sum"), ("add", "max"), ("add", "min"), ("min", "max"), ("max", "min")})


@dataclass(frozen=True)
class JoinFunction:
    """An element-wise join. Exactly one of ``name``, ``expr``, ``func`` is set."""

    name: str | None = None
    expr: str | None = None
    func: Callable | None = field(default=None, compare=False)
    func_id: int | None = None  # identity of ``func`` for equality and plan caching

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.expr:
            return f"expr({self.expr})"
        return f"callable({getattr(self.func, '__name__', 'f')})"


@dataclass(frozen=True)
class Aggregation:
    name: str


def operand_index(name: str) -> int | None:
    """``x -> 0``, ``y -> 1``, ``x3 -> 3``; None for any other name."""
    if name in _OPERAND_NAMES:
        return _OPERAND_NAMES.index(name)
    if len(name) > 1 and name[0] == "x" and name[1:].isdigit():
        return int(name[1:])
    return None


MAX_EXPR_DEPTH = 200  # nested operations in a join expression (Python's compiler recurses on them)
MAX_CONST_BITS = 1 << 16  # a constant integer power beyond this many bits is refused, not computed


def _depth(tree: ast.AST) -> int:
    deepest, todo = 0, [(tree, 1)]
    while todo:  # iterative: the point is not to recurse on a tree too deep for Python
        node, d = todo.pop()
        deepest = max(deepest, d)
        todo.extend((child, d + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _constant(node):
    """The value of a constant subexpression of an expression already checked against the
    allowed nodes (None where it reads an operand or calls a function), refusing an integer
    power whose result would exceed ``MAX_CONST_BITS`` before Python computes it
    (``10**10**10``, ``(10**4000)**4000``: exact integers, for ever)."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, (int, float)) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _constant(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.Mod)):
        a, b = _constant(node.left), _constant(node.right)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 \
                and b > 0 and (abs(a).bit_length() - 1) * b > MAX_CONST_BITS:
            raise EinsumError(f"join expression: the constant {ast.unparse(node)} is too large to compute "
                              f"(over {MAX_CONST_BITS} bits)")
        try:
            return eval(compile(ast.Expression(node), "<constant>", "eval"), {"__builtins__": {}})  # noqa: S307
        except Exception:  # noqa: BLE001 - 1 / 0, a float overflow: left for the probe to report
            return None
    return None


def _check_expr(text: str, arity: int) -> None:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        pos = max((e.offset or 1) - 1, 0)
        raise EinsumError(f"join expression: {e.msg}\n{caret(text, pos)}") from None
    except (RecursionError, MemoryError):
        raise EinsumError(f"join expression: nested too deeply for Python to parse ({len(text)} characters)") from None
    if _depth(tree) > MAX_EXPR_DEPTH:
        raise EinsumError(f"join expression: nested more than {MAX_EXPR_DEPTH} operations deep ({len(text)} "
                          "characters); write it shorter, or pass a Python callable")
    allowed = (
        ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.Call, ast.Name,
        ast.Constant, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.Mod,
        ast.USub, ast.UAdd, ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.Eq, ast.NotEq, ast.BoolOp,
        ast.And, ast.Or, ast.Not,
    )
    for node in ast.walk(tree):
        pos = getattr(node, "col_offset", 0)
        if not isinstance(node, allowed):
            raise EinsumError(
                f"join expression: {type(node).__name__} is not allowed (operands x, y, z, w or x0..xN, "
                f"numbers, + - * / ** %, comparisons, if-else and {', '.join(EXPR_FUNCTIONS)})\n{caret(text, pos)}"
            )
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool)):
            # "x + 1j * y" said "only numeric constants", and 1j is one (a trial)
            what = ("complex constants are not: pass a Python callable (lambda x, y: x + 1j * y)"
                    if isinstance(node.value, complex) else f"{node.value!r} is not one")
            raise EinsumError(f"join expression: constants are real numbers (int, float, bool); {what}\n"
                              f"{caret(text, pos)}")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in EXPR_FUNCTIONS:
                what = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
                raise EinsumError(
                    f"join expression: unknown function {what!r}; use {', '.join(EXPR_FUNCTIONS)}\n{caret(text, pos)}"
                )
            want = EXPR_FUNCTIONS[node.func.id]
            if node.keywords or (len(node.args) != want if want is not None else len(node.args) < 2):
                raise EinsumError(
                    f"join expression: {node.func.id}() takes {want or '2 or more'} argument(s)\n{caret(text, pos)}"
                )
        if isinstance(node, ast.Name) and not (isinstance(getattr(node, "_parent", None), ast.Call)):
            pass
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in called:
            k = operand_index(node.id)
            if k is None:
                raise EinsumError(
                    f"join expression: unknown name {node.id!r}; operands are x, y, z, w or x0..x{arity - 1}"
                    f"\n{caret(text, node.col_offset)}"
                )
            if k >= arity:
                raise EinsumError(
                    f"join expression uses operand {node.id!r} but the einsum has {arity} operand(s)"
                    f"\n{caret(text, node.col_offset)}"
                )
    # only now, with every node known to be allowed, are constant parts looked at
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp):
            _constant(node)


def check_expression(text: str, arity: int | None = None) -> None:
    """Refuse a join expression that is not the notation's (``_check_expr``); ``arity`` None
    admits any operand. Whatever evaluates an expression calls this first: a kernel spec is
    text that any SQL on the connection may write, so the evaluator cannot trust its caller."""
    if not isinstance(text, str):
        raise EinsumError(f"join expression must be a string, got {type(text).__name__}")
    _check_expr(text, arity if arity is not None else 1 << 30)


def parse_join(join: str | Callable | JoinFunction | None, arity: int) -> JoinFunction:
    """Validate a join for an einsum of ``arity`` operands."""
    if isinstance(join, JoinFunction):
        return join
    if join is None:
        join = "mul"
    if callable(join):
        return JoinFunction(func=join, func_id=id(join))
    if not isinstance(join, str):
        raise EinsumError(f"join must be a name, an expression string or a callable, got {type(join).__name__}")
    # names as SQL users write them ('MAX', ' exp '): a name's case and the blanks around any
    # join mean nothing (an expression's variables are x, y, z, w: its case is kept)
    join = join.strip()
    if join.lower() in BINARY_JOINS or join.lower() in UNARY_JOINS:
        join = join.lower()
    if join in BINARY_JOINS:
        # with one operand mul/add/max/min fold over a single value: the identity
        if join in ("sub", "div", "pow") and arity != 2:
            raise EinsumError(f"join {join!r} needs 2 operands, the einsum has {arity}")
        return JoinFunction(name=join)
    if join in UNARY_JOINS:
        if arity != 1:
            raise EinsumError(
                f"join {join!r} is unary but the einsum has {arity} operands; write an expression "
                f"such as '{join}(x * y)'"
            )
        return JoinFunction(name=join)
    if join.isidentifier() and join not in _OPERAND_NAMES and operand_index(join) is None:
        raise EinsumError(
            f"unknown join {join!r}: use one of {', '.join(BINARY_JOINS + UNARY_JOINS)}, "
            "an expression over x, y, z, w, or a callable"
        )
    _check_expr(join, arity)
    return JoinFunction(expr=join)


def parse_agg(agg: str | Aggregation | None) -> Aggregation:
    if isinstance(agg, Aggregation):
        return agg
    if agg is None:
        agg = "sum"
    if not isinstance(agg, str):  # (an array here compared element-wise, unhashable)
        raise EinsumError(f"agg must be one of {', '.join(AGGREGATIONS)}, got {type(agg).__name__} {agg!r:.40}")
    agg = agg.strip().lower()  # 'MAX' as SQL users write it
    if agg not in AGGREGATIONS:
        raise EinsumError(f"unknown agg {agg!r}: use one of {', '.join(AGGREGATIONS)}")
    return Aggregation(agg)


def is_semiring(join: JoinFunction, agg: Aggregation) -> bool:
    return (join.name, agg.name) in SEMIRINGS
