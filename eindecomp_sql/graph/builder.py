"""``Graph``: write a DAG of extended einsums declaratively; shapes and dtypes are inferred
as nodes are added, so mistakes surface at the line that makes them.

>>> g = Graph()
>>> x = g.input("x", (8, 4)); w = g.input("w", (4, 6))
>>> y = g.map("relu", g.einsum("bi,io->bo", x, w))
>>> y.shape, [n.describe() for n in g.nodes]
((8, 6), ['bi,io->bo', 'ab->ab join=relu agg=sum'])
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from ..errors import EinsumError
from ..notation import parse_agg, parse_join, parse_spec
from ..notation.checks import check_dtype, check_name
from .lower import lower_einsum
from .node import EinsumNode, ValueInfo



@dataclass(frozen=True, eq=False)
class GraphValue:
    """A value of a graph: an input or the result of a node. Only shape-level facts."""

    graph: "Graph"
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"GraphValue({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def _letters(n: int, skip: str = "") -> str:
    return "".join([c for c in string.ascii_lowercase if c not in skip][:n])


class Graph:
    """A DAG of extended einsum nodes over named values."""

    def __init__(self):
        self._values: dict[str, ValueInfo] = {}
        self._inputs: list[str] = []
        self._nodes: list[EinsumNode] = []
        self._counter = 0

    # -- building ---------------------------------------------------------------------------
    def _fresh(self, stem: str) -> str:
        self._counter += 1
        name = f"{stem}{self._counter}"
        while name in self._values:
            self._counter += 1
            name = f"{stem}{self._counter}"
        return name

    def _check_new_name(self, name: str) -> str:
        check_name(name, "value name")
        if name in self._values:
            raise EinsumError(f"graph already has a value named {name!r}")
        return name

    def _value(self, x, where: str) -> ValueInfo:
        if isinstance(x, GraphValue):
            if x.graph is not self:
                raise EinsumError(f"{where}: {x.name!r} belongs to another graph")
            return self._values[x.name]
        if isinstance(x, str) and x in self._values:
            return self._values[x]
        raise EinsumError(f"{where}: expected a value of this graph, got {x!r}")

    def _handle(self, v: ValueInfo) -> GraphValue:
        return GraphValue(self, v.name, v.shape, v.dtype)

    def input(self, name: str, shape, dtype="float32") -> GraphValue:
        """A tensor given when the plan runs (an array, a stored Tensor or its name)."""
        self._check_new_name(name)
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise EinsumError(f"input {name!r}: shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 1 for d in shape):
            raise EinsumError(f"input {name!r}: every dimension must be >= 1, got {shape}")
        try:
            dt = check_dtype(dtype)
        except (EinsumError, TypeError) as e:
            raise EinsumError(f"input {name!r}: {e}") from None
        v = ValueInfo(name, shape, dt)
        self._values[name] = v
        self._inputs.append(name)
        return self._handle(v)

    def einsum(self, spec: str, *operands, join=None, agg=None, name: str | None = None) -> GraphValue:
        """An extended einsum node (many operands lower to a binary tree when that is exact)."""
        vals = [self._value(x, f"einsum {spec!r} operand {k}") for k, x in enumerate(operands)]
        parsed = parse_spec(spec, [v.shape for v in vals])
        j = parse_join(join, len(vals))
        a = parse_agg(agg)
        result = self._check_new_name(name) if name is not None else self._fresh("v")
        nodes = lower_einsum(parsed, vals, j, a, result, temp_prefix=f"{result}_t")
        for node in nodes:
            self._values[node.result.name] = node.result
            self._nodes.append(node)
        return self._handle(nodes[-1].result)

    def map(self, fn, x, name: str | None = None) -> GraphValue:
        """Apply a unary join (``"relu"``, ``"exp"``, ``"x * sigmoid(x)"``, a callable) element-wise."""
        v = self._value(x, "map")
        s = _letters(len(v.shape))
        return self.einsum(f"{s}->{s}", x, join=fn, name=name)

    def reduce(self, x, axis, agg: str = "sum", name: str | None = None) -> GraphValue:
        """Aggregate ``x`` over ``axis`` (an int or a tuple of ints) with sum, max, min or prod."""
        v = self._value(x, "reduce")
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        axes = tuple(a % len(v.shape) if -len(v.shape) <= a < len(v.shape) else None for a in axes)
        if None in axes:
            raise EinsumError(f"reduce: axis {axis} out of range for shape {v.shape}")
        s = _letters(len(v.shape))
        out = "".join(c for k, c in enumerate(s) if k not in axes)
        return self.einsum(f"{s}->{out}", x, agg=agg, name=name)

    def elementwise(self, join, *operands, name: str | None = None) -> GraphValue:
        """A join of operands broadcast against each other the numpy way (right-aligned)."""
        vals = [self._value(x, "elementwise") for x in operands]
        nd = max(len(v.shape) for v in vals)
        s = _letters(nd)
        spec = ",".join(s[nd - len(v.shape):] for v in vals) + "->" + s
        return self.einsum(spec, *operands, join=join, name=name)

    def add(self, x, y, name=None):
        return self.elementwise("add", x, y, name=name)

    def sub(self, x, y, name=None):
        return self.elementwise("sub", x, y, name=name)

    def mul(self, x, y, name=None):
        return self.elementwise("mul", x, y, name=name)

    def div(self, x, y, name=None):
        return self.elementwise("div", x, y, name=name)

    # -- reading ----------------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[EinsumNode, ...]:
        return tuple(self._nodes)

    @property
    def inputs(self) -> tuple[ValueInfo, ...]:
        return tuple(self._values[n] for n in self._inputs)

    @property
    def outputs(self) -> tuple[ValueInfo, ...]:
        """Values no node consumes (the graph's results)."""
        used = {op.value for n in self._nodes for op in n.operands}
        return tuple(n.result for n in self._nodes if n.result.name not in used)

    def value(self, name: str) -> ValueInfo:
        return self._values[name]

    def plan(self, workers: int = 1, memory=None, strategy: str = "eindecomp"):
        """Choose a chunking for every node (see ``eindecomp_sql.plan.optimize``)."""
        from ..plan.graph_plan import plan_graph

        return plan_graph(self, workers=workers, memory=memory, strategy=strategy)
