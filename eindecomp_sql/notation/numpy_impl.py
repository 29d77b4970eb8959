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

from ..errors import EinsumError, EinsumTypeError
from .checks import check_dtype, is_bfloat16, narrow_bfloat16, promote
from .functions import Aggregation, JoinFunction, check_expression, operand_index, parse_join  # noqa: F401

AGG_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def product_dtype(out_dtype) -> np.dtype:
    """The dtype a product summed (join mul, agg sum) computes in, before its result is cast to
    ``out_dtype``: the result dtype, but float32 for float16 and bfloat16 (BLAS; numpy's float16
    matmul has none, 512³: 384 ms against 1.3 ms in float32, bench/half_bench.py, and rounds
    no better; np.einsum refuses bfloat16), so such a result is rounded once per tile. The
    kernels and the reference backend both."""
    dt = np.dtype(out_dtype)
    return np.dtype(np.float32) if dt == np.float16 or is_bfloat16(dt) else dt


def widened(a):
    """``a``, or for bfloat16 its float32 copy (exact): numpy's einsum refuses bfloat16 and
    ml_dtypes rounds every ufunc's result, so kernels compute bfloat16 operands in float32 and
    round their result once (as torch does)."""
    return a.astype(np.float32) if is_bfloat16(a.dtype) else a


def _stand_in(dt: np.dtype) -> np.dtype:
    """float16 for bfloat16: the dtype a probe computes with (``promote``'s rule)."""
    return np.dtype(np.float16) if is_bfloat16(dt) else dt


def _relu(a):
    # a zero of a's own dtype as a scalar, not an array: ``a`` may live on a device (CuPy),
    # where a numpy array operand is refused
    dt = a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype
    return np.maximum(a, dt.type(0))


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
    # checked here, where it is evaluated, whoever hands it in: the SQL path's kernels get it
    # from a kernel spec, JSON that any statement on the connection can write
    check_expression(text)
    tree = _Vectorize().visit(ast.parse(text, mode="eval"))
    ast.fix_missing_locations(tree)
    code = compile(tree, "<join expression>", "eval")
    # no builtins a name could reach (parse_join admits operands and EXPR_FUNCTIONS only), but
    # __import__: numpy's C code imports through the running frame's builtins when it raises
    # (an int8 operand times 1000), and without it its OverflowError became KeyError('__import__')
    namespace = {"__builtins__": {"__import__": __import__}, **_EXPR_NAMESPACE}
    return lambda *xs: eval(code, namespace, {"_x": xs})  # noqa: S307 - AST validated by parse_join


NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex


def _shapes(xs) -> str:
    return ", ".join(str(tuple(np.shape(x))) for x in xs)


def _callable_result(join: JoinFunction, xs) -> np.ndarray:
    """Call a user's join on ``xs`` and check what comes back is element-wise numbers: an array
    shaped like the inputs broadcast together, of a numeric dtype. Anything else would make
    the result depend on how the tensors are tiled, so it is an ``EinsumError`` naming the
    callable."""
    name = join.label
    try:
        r = join.func(*xs)
    except EinsumError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's function failing is bad input, said as ours
        raise EinsumError(f"join {name} raised {type(e).__name__}: {e} (on inputs of shapes {_shapes(xs)})") from e
    if r is None:
        raise EinsumError(f"join {name} returned None; it must return an array of numbers, element-wise in "
                          f"its inputs (shapes {_shapes(xs)})")
    try:
        r = np.asarray(r)
    except Exception as e:  # noqa: BLE001
        raise EinsumError(f"join {name} returned a {type(r).__name__} that is not an array ({e})") from None
    if r.dtype.kind not in NUMERIC_KINDS and not is_bfloat16(r.dtype):
        raise EinsumError(f"join {name} returned {r.dtype} values (shape {r.shape}); it must return numbers")
    shapes = [np.shape(x) for x in xs]
    full = np.broadcast_shapes(*shapes)
    if r.shape != full:
        # strict: a result shaped like one input alone (x[:1] of a joined tile) broadcasts too,
        # so accepting "some of the inputs broadcast" would let tiling-dependent results through
        raise EinsumError(
            f"join {name} is not element-wise: on inputs of shapes {_shapes(xs)} it returned shape {r.shape}, "
            f"where {full} (the inputs broadcast together) was expected; a join must compute each element "
            "from the same element of its inputs (no sums, no constants: np.full_like(x, c) instead of c; "
            "a join that ignores an input returns np.broadcast_to(x, np.broadcast_shapes(x.shape, y.shape)))"
        )
    if not r.dtype.isnative:
        r = r.astype(r.dtype.newbyteorder("="))
    return r


def _probes(dtypes: list[np.dtype], distinct: bool = False) -> list[np.ndarray]:
    """One small input per operand, as kernels pass them (one axis per label, 1 where the
    operand lacks the label): operand k has its own axis k of length 2 and shares the last,
    so a join that is not element-wise (a sum, a constant) shows in its result's shape. Ones,
    or with ``distinct`` values in no order (``_check_elementwise``: a sort or a running total
    shows)."""
    n = len(dtypes)
    out = []
    for k, d in enumerate(dtypes):
        shape = [1] * (n + 1)
        shape[k] = shape[n] = 2
        if distinct:
            values = np.array([3, 1, 4, 2])
            out.append((values % 2 == 0 if d.kind == "b" else values).reshape(shape).astype(d))
        else:
            out.append(np.ones(shape, dtype=d))
    return out


def join_callable(join: JoinFunction) -> Callable:
    """The join as a function of numpy arrays (broadcasting). A user's callable is checked on
    every call: element-wise numbers of the dtype its probe gave (``join_dtype``)."""
    if join.func is not None:
        seen: dict[tuple[np.dtype, ...], np.dtype] = {}  # input dtypes -> the probe's dtype

        def call(*xs):
            r = _callable_result(join, xs)
            key = tuple(np.asarray(x).dtype for x in xs)
            want = seen.get(key)
            if want is None:
                want = seen[key] = join_dtype(join, list(key))
            if r.dtype != want:
                raise EinsumError(
                    f"join {join.label} returned {r.dtype} on inputs of dtypes {[d.name for d in key]}, where a "
                    f"probe of the same dtypes gave {want}: a join's dtype may depend on its inputs' dtypes only"
                )
            return r

        return call
    if join.expr is not None:
        return _compile_expr(join.expr)
    if join.name in UNARY:
        return UNARY[join.name]
    return _fold(BINARY[join.name])


def join_dtype(join: JoinFunction, dtypes: list[np.dtype]) -> np.dtype:
    """The dtype of the join's values on inputs of ``dtypes`` (run on small probes). A bfloat16
    input probes as float16, whose promotion it follows (``checks.promote``)."""
    dtypes = [np.dtype(d) for d in dtypes]
    probes = _probes([_stand_in(d) for d in dtypes])
    try:
        with np.errstate(all="ignore"):
            if join.func is not None:
                vals = _callable_result(join, probes)
                _check_elementwise(join, [_stand_in(d) for d in dtypes])
            else:
                vals = np.asarray(join_callable(join)(*probes))
    except EinsumError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's join failing on a probe is bad input
        # where numpy's ufunc raises TypeError (bool - bool), a TypeError too, as numpy's
        # callers catch it (it was a ValueError only: a trial)
        kind = EinsumTypeError if isinstance(e, TypeError) else EinsumError
        raise kind(f"join {join.label} failed on a probe of dtypes {[d.name for d in dtypes]}: {e}") from e
    return narrow_bfloat16(vals.dtype, dtypes)


def _check_elementwise(join: JoinFunction, dtypes: list[np.dtype]) -> None:
    """A user's callable must compute each element from the same element of its inputs: on
    probes of distinct values, in no order, its first and last elements must be what it gives
    on those elements alone. ``v - v.mean()`` keeps the shape and dtype, so the checks on
    every call let it through, and its result depended on the tiling (a trial: the row maxima
    of ``x - x.mean()`` came out different at 1 and 16 workers, with no error). Compared
    within a tolerance: numpy's vectorised and scalar loops of one function may differ in the
    last bit."""
    n = len(dtypes)
    full = _probes(dtypes, distinct=True)
    whole = np.asarray(join.func(*full))
    for at in (0, -1):
        alone = np.asarray(join.func(*[x[(slice(at, None) if at else slice(0, 1),) * (n + 1)] for x in full]))
        got, want = alone.reshape(-1)[:1], whole[(at,) * (n + 1)].reshape(1)
        same = (np.array_equal(got, want) if got.dtype.kind not in "fc" or want.dtype.kind not in "fc"
                else np.allclose(got, want, rtol=1e-2, atol=1e-6, equal_nan=True))
        if alone.size != 1 or not same:
            raise EinsumError(
                f"join {join.label} is not element-wise: on probes of shape {_shapes(full)}, its "
                f"{'first' if at == 0 else 'last'} element was {want[0].item()!r}, but on that element alone it "
                f"gives {alone.reshape(-1)[0].item() if alone.size else alone!r}; a join must compute each element from the "
                "same element of its inputs (no means, sums, sorts or running totals: the result would depend "
                "on how the tensors are tiled)")


def result_dtype(join: JoinFunction, agg: Aggregation, dtypes: list[np.dtype], reduces: bool) -> np.dtype:
    """The dtype numpy gives for this join/agg on these input dtypes: ``np.einsum``'s for a
    product summed, else that of ``agg.reduce(join(inputs))``. A dtype eindecomp_sql does not
    store (a user's join returning longdouble) is an ``EinsumError``."""
    dtypes = [np.dtype(d) for d in dtypes]
    if join.name == "mul" and agg.name == "sum":
        # np.einsum keeps the promoted input dtype (bool stays bool)
        return promote(*dtypes) if dtypes else np.dtype("float64")
    dt = join_dtype(join, dtypes)
    if reduces:
        dt = narrow_bfloat16(AGG_UFUNC[agg.name].reduce(np.ones(2, dtype=_stand_in(dt)), axis=0).dtype, [dt])
    where = f"join {join.label} with agg {agg.name} on {', '.join(d.name for d in dtypes) or 'no inputs'}"
    return np.dtype(check_dtype(dt, f"{where} gives {dt.name}"))
