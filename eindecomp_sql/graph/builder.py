"""``Graph``: write a DAG of extended einsums declaratively; shapes and dtypes are inferred
as nodes are added, so mistakes surface at the line that makes them.

>>> g = Graph()
>>> x = g.input("x", (8, 4)); w = g.input("w", (4, 6))
>>> y = g.map("relu", g.einsum("bi,io->bo", x, w))
>>> y.shape, [n.describe() for n in g.nodes]
((8, 6), ['bi,io->bo', 'bo->bo join=relu'])

``map``, ``reduce`` and ``elementwise`` write their einsum with the labels the operand was made
with (``bo`` above), so EXPLAIN shows the user's letters; only a graph input, which has no
labels of its own, gets generated ones (``ab``).
"""

from __future__ import annotations

import operator
import string
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
        """Number of dimensions."""
        return len(self.shape)

    def __repr__(self) -> str:
        return f"GraphValue({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def _letters(n: int, skip: str = "") -> str:
    return "".join([c for c in string.ascii_lowercase if c not in skip][:n])


def _pick_labels(wanted: Sequence[Sequence[str | None]]) -> str:
    """One distinct letter per axis: the first wanted letter of each axis not taken by an
    earlier axis, else a fresh lowercase letter no axis wants."""
    everything = {c for w in wanted for c in w if c is not None}
    fresh = iter(c for c in string.ascii_letters if c not in everything)
    out: list[str] = []
    for w in wanted:
        pick = next((c for c in w if c is not None and c not in out), None) or next(fresh, None)
        if pick is None:
            raise EinsumError(f"{len(wanted)} dimensions: an einsum has at most {len(string.ascii_letters)} labels")
        out.append(pick)
    return "".join(out)


class Graph:
    """A DAG of extended einsum nodes over named values."""

    def __init__(self):
        self._values: dict[str, ValueInfo] = {}
        self._inputs: list[str] = []
        self._nodes: list[EinsumNode] = []
        self._producer: dict[str, EinsumNode] = {}
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

    def _labels_of(self, v: ValueInfo) -> tuple[str | None, ...]:
        """The letters the node producing ``v`` wrote for its axes (None where there is no
        such letter: a graph input, or an ellipsis dimension)."""
        node = self._producer.get(v.name)
        if node is None:
            return (None,) * len(v.shape)
        return tuple(lab if len(lab) == 1 else None for lab in node.output)

    def input(self, name: str, shape, dtype=None) -> GraphValue:
        """A tensor given when the plan runs (an array, a stored Tensor or its name). An array is
        cast to ``dtype`` (float32 when not given): integers and bools to any integer dtype
        their values fit (one that does not fit is refused, where numpy would wrap it), and any
        same-kind cast numpy makes, even where that loses digits (int64 above 2**24 into
        float32, float64 into float32); floats into integers or complex into real values are
        refused. Where ``dtype`` was not given, a cast that loses digits (numpy's "safe" rule
        fails: float64 or int64 into float32) warns, naming the dtype to declare. A stored
        Tensor must have ``dtype``."""
        self._check_new_name(name)
        try:
            # operator.index: ints and numpy ints only; int() would take "12" as (1, 2) and 2.5 as 2
            if isinstance(shape, (str, bytes)):
                raise TypeError
            shape = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise EinsumError(f"input {name!r}: shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 1 for d in shape):
            raise EinsumError(f"input {name!r}: every dimension must be >= 1, got {shape}")
        try:
            dt = check_dtype("float32" if dtype is None else dtype)
        except (EinsumError, TypeError) as e:
            raise EinsumError(f"input {name!r}: {e}") from None
        v = ValueInfo(name, shape, dt, dtype_given=dtype is not None)
        self._values[name] = v
        self._inputs.append(name)
        return self._handle(v)

    def einsum(self, spec: str, *operands, join=None, agg=None, name: str | None = None) -> GraphValue:
        """An extended einsum node (many operands lower to a binary tree when that is exact)."""
        return self._einsum(spec, operands, join, agg, name)

    def _einsum(self, spec: str, operands, join, agg, name, dtype=None) -> GraphValue:
        vals = [self._value(x, f"einsum {spec!r} operand {k}") for k, x in enumerate(operands)]
        parsed = parse_spec(spec, [v.shape for v in vals])
        j = parse_join(join, len(vals))
        a = parse_agg(agg)
        result = self._check_new_name(name) if name is not None else self._fresh("v")
        nodes = lower_einsum(parsed, vals, j, a, result, temp_prefix=f"{result}_t", dtype=dtype)
        for node in nodes:
            self._values[node.result.name] = node.result
            self._nodes.append(node)
            self._producer[node.result.name] = node
        return self._handle(nodes[-1].result)

    def map(self, fn, x, name: str | None = None) -> GraphValue:
        """Apply a unary join (``"relu"``, ``"exp"``, ``"x * sigmoid(x)"``, a callable) element-wise."""
        v = self._value(x, "map")
        s = _pick_labels([(lab,) for lab in self._labels_of(v)])
        return self.einsum(f"{s}->{s}", x, join=fn, name=name)

    def reduce(self, x, axis, agg: str = "sum", name: str | None = None) -> GraphValue:
        """Aggregate ``x`` over ``axis`` (an int or a tuple of ints; None: every axis, as in
        numpy) with sum, max, min or prod, in the dtype numpy's reduction gives (``np.sum``
        of bools or small integers is int64, of unsigned ones uint64)."""
        v = self._value(x, "reduce")
        if axis is None:
            axis = tuple(range(len(v.shape)))
        try:  # an integer (numpy's too) or a tuple of them, as numpy takes
            axes = (operator.index(axis),) if not isinstance(axis, (tuple, list)) else tuple(map(operator.index, axis))
        except TypeError:
            raise EinsumError(f"reduce: axis must be an integer or a tuple of integers, got {axis!r}") from None
        axes = tuple(a % len(v.shape) if -len(v.shape) <= a < len(v.shape) else None for a in axes)
        if None in axes:
            raise EinsumError(f"reduce: axis {axis} out of range for shape {v.shape}")
        if len(set(axes)) != len(axes):
            raise EinsumError(f"reduce: duplicate value in axis {axis} (for shape {v.shape})")
        s = _pick_labels([(lab,) for lab in self._labels_of(v)])
        out = "".join(c for k, c in enumerate(s) if k not in axes)
        # np.sum's dtype, not np.einsum's: a sum of bools counts them and a sum of small
        # integers widens to int64 / uint64 (as einsum, bools were OR-ed and int8 wrapped, in
        # silence: a trial's mask count came back [True, True]); the identity join takes
        # ``agg.reduce``'s dtype, which is numpy's
        integral = v.dtype == "bool" or v.dtype.startswith(("int", "uint"))
        if integral and not axes:
            # nothing reduced: numpy's np.sum / np.prod(a, axis=()) still widen (int8 -> int64,
            # bool -> int64), where the identity kept int8 (a trial): the lone operand cast to
            # that dtype, a product "summed" over nothing in it
            want = getattr(np, parse_agg(agg).name)(np.zeros(1, v.dtype), axis=()).dtype.name
            if want != v.dtype:
                return self._einsum(f"{s}->{out}", (x,), None, "sum", name, dtype=want)
        join = "identity" if integral and parse_agg(agg).name == "sum" else None
        return self.einsum(f"{s}->{out}", x, join=join, agg=agg, name=name)

    def elementwise(self, join, *operands, name: str | None = None) -> GraphValue:
        """A join of operands broadcast against each other the numpy way (right-aligned)."""
        vals = [self._value(x, "elementwise") for x in operands]
        if not vals:
            raise EinsumError("elementwise: give at least one operand")
        nd = max(len(v.shape) for v in vals)
        # numpy aligns axes on the right: axis k of the result is axis k - (nd - ndim) of each operand
        known = [(nd - len(v.shape), self._labels_of(v)) for v in vals]
        s = _pick_labels([tuple(labs[k - off] for off, labs in known if k >= off) for k in range(nd)])
        spec = ",".join(s[nd - len(v.shape):] for v in vals) + "->" + s
        return self.einsum(spec, *operands, join=join, name=name)

    def add(self, x, y, name=None):
        """``x + y`` element-wise, broadcast the numpy way."""
        return self.elementwise("add", x, y, name=name)

    def sub(self, x, y, name=None):
        """``x - y`` element-wise, broadcast the numpy way."""
        return self.elementwise("sub", x, y, name=name)

    def mul(self, x, y, name=None):
        """``x * y`` element-wise, broadcast the numpy way."""
        return self.elementwise("mul", x, y, name=name)

    def div(self, x, y, name=None):
        """``x / y`` element-wise, broadcast the numpy way."""
        return self.elementwise("div", x, y, name=name)

    # -- reading ----------------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[EinsumNode, ...]:
        """The einsum nodes, in the order they were added (a topological order)."""
        return tuple(self._nodes)

    @property
    def inputs(self) -> tuple[ValueInfo, ...]:
        """The graph's inputs (shape and dtype), in the order they were declared."""
        return tuple(self._values[n] for n in self._inputs)

    @property
    def outputs(self) -> tuple[ValueInfo, ...]:
        """Values no node consumes (the graph's sinks). What a plan computes is chosen by
        ``plan(outputs=...)``: by default only the last-added node's value."""
        used = {op.value for n in self._nodes for op in n.operands}
        return tuple(n.result for n in self._nodes if n.result.name not in used)

    def value(self, name: str) -> ValueInfo:
        """The shape-level description of value ``name``."""
        try:
            return self._values[name]
        except (KeyError, TypeError):
            raise EinsumError(f"the graph has no value named {name!r}") from None

    def select(self, outputs=None) -> tuple[tuple[ValueInfo, ...], bool]:
        """The values a plan returns and whether it returns one (a Tensor) or several (a dict).

        ``None``: the last-added node's value; a GraphValue or a value's name: that value; a
        list or tuple of those: each of them (a dict even for one)."""
        if not self._nodes:
            raise EinsumError("the graph has no nodes")
        if outputs is None:
            return (self._nodes[-1].result,), True
        if isinstance(outputs, (list, tuple)):
            if not outputs:
                raise EinsumError("outputs=[]: name at least one value of the graph to compute")
            picked = tuple(self._output(x, f"outputs[{k}]") for k, x in enumerate(outputs))
            seen = set()
            for k, v in enumerate(picked):
                if v.name in seen:
                    raise EinsumError(f"outputs[{k}]: {v.name!r} is given twice")
                seen.add(v.name)
            return picked, False
        return (self._output(outputs, "outputs"),), True

    def _output(self, x, where: str) -> ValueInfo:
        if not isinstance(x, (GraphValue, str)):
            raise EinsumError(f"{where}: expected a value of this graph (a GraphValue or its name), got "
                              f"{type(x).__name__} {x!r}")
        v = self._value(x, where)
        if v.name not in self._producer:
            raise EinsumError(f"{where}: {v.name!r} is a graph input, not computed by any node")
        return v

    def needed(self, outputs) -> tuple[EinsumNode, ...]:
        """The nodes ``outputs`` (value names) depend on, in the order they were added."""
        want = set(outputs)
        for n in reversed(self._nodes):
            if n.result.name in want:
                want.update(op.value for op in n.operands)
        return tuple(n for n in self._nodes if n.result.name in want)

    def plan(self, workers: int = 1, memory=None, strategy: str = "eindecomp", outputs=None, inputs=None,
             fuse: bool = True):
        """Choose a chunking for every node (see ``eindecomp_sql.plan.optimize``).

        ``outputs``: what ``plan.run`` returns. None (the default): the last-added node's
        value, as a Tensor; nodes it does not depend on are left out, with a warning naming
        them. A GraphValue or a value's name: that value, as a Tensor. A list or tuple of
        them: a dict name -> Tensor (even for one). Either way only the nodes the outputs
        depend on are planned. Identical plans are cached, so planning again is cheap.

        ``workers``: join tasks to aim for per step; ``memory``: the memory budget the plan
        runs under (``"2GB"``, bytes; None: none), as ``connect(memory=)`` takes it: every step's
        projected peak within the plans' share of it (``db.plan_budget``, 60%), so a plan made
        with a session's ``memory=`` runs on that session within it; ``strategy``: ``"eindecomp"``
        (the optimizer) or a baseline, ``"data-parallel"``, ``"model-parallel"``,
        ``"square-tiles"``. ``inputs``: input name -> a stored ``Tensor`` (or the tile shape it
        is stored in): the plan reads that input cut so, choosing every other cut knowing it
        (and showing any re-tile in ``explain()``); other inputs are cut as the plan chooses.
        ``fuse``: element-wise nodes (maps, scales, broadcasts, ``elementwise``) run inside the
        kernel of the einsum that produces or consumes them where the tilings agree, saving a
        statement and a stored intermediate each, and consecutive steps whose every value is one
        tile run as one program (one statement, one kernel call; ``explain()`` shows what fused).
        ``"elementwise"``: only the first; False plans one step per node.
        """
        from ..errors import EinsumError
        from ..plan.cost import in_memory_terms, parse_memory, plan_share
        from ..plan.graph_plan import plan_graph

        # the share, as a session plans (a plan made with the whole of memory=M was admitted on
        # connect(memory=M) and rose 494-587 MB under 300 MB: a budget trial); a refusal says
        # the memory= it needs, not the share's
        given = parse_memory(memory)
        try:
            return plan_graph(self, workers=workers, memory=plan_share(given), strategy=strategy, outputs=outputs,
                              inputs=inputs, fuse=fuse)
        except EinsumError as e:
            said = in_memory_terms(e, given, "this")
            if said is None:
                raise
            raise said from None

    def run(self, db, outputs=None, out=None, replace: bool = False, progress=None, *, inputs=None, **named):
        """Plan for these inputs (stored tensors as they are cut) under session ``db``'s
        options and engine cost model, and run: ``g.plan(outputs=..., inputs=<the stored
        ones>).run(db, ...)`` in one call. Inputs as keywords, or as a dict ``inputs=`` (for
        inputs named like this method's own arguments)."""
        from ..plan.graph_plan import check_session, merge_inputs, plan_graph

        inputs = merge_inputs(inputs, named)
        check_session(db, "g.run")
        stored = {}
        for name, x in inputs.items():
            if isinstance(x, str):
                x = db.tensor(x)
            if hasattr(x, "tile") and hasattr(x, "session"):
                stored[name] = x
        with db.said_in_memory():
            p = plan_graph(self, workers=db.workers, memory=db.plan_budget, tile_bytes=db.tile_bytes,
                           outputs=outputs, inputs=stored, costs=db.backend.cost_model)
        return p.run(db, out=out, replace=replace, progress=progress, inputs=inputs)
