"""Plans for whole graphs: the chosen chunking of every node, its cost next to the baseline
strategies', EXPLAIN text, Graphviz source, and running it on a session.

>>> from eindecomp_sql.graph import Graph
>>> g = Graph(); x = g.input("x", (1024, 64)); w = g.input("w", (64, 64))
>>> h = g.einsum("bi,io->bo", x, w)
>>> p = g.plan(workers=4)
>>> p.pieces[h.name], p.retiles
({'b': 4, 'i': 1, 'o': 1}, 0)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EinsumError
from ..graph import EinsumNode, ValueInfo
from .cost import Costs, parse_memory, tile_of
from .optimize import STRATEGIES, Choice, baseline, optimize
from .planner import plan_nodes
from .steps import EinsumStep, Plan, RetileStep, TiledValue


NL = "\\n"


@dataclass(frozen=True, eq=False)
class GraphPlan:
    """A graph with a chunking for every node; ``plan`` is the step list it runs."""

    nodes: tuple[EinsumNode, ...]
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    strategy: str
    workers: int
    budget: int | None
    choice: Choice
    plan: Plan
    baselines: dict[str, Costs | None]  # strategy -> its cost (None: over the memory budget)

    @property
    def cost(self) -> float:
        """The cost model's total for this plan, in (join-equivalent) bytes."""
        return self.choice.costs.total

    @property
    def costs(self) -> Costs:
        return self.choice.costs

    @property
    def pieces(self) -> dict[str, dict[str, int]]:
        """Chunk counts per label of every node, by the node's result name."""
        return self.choice.pieces

    @property
    def retiles(self) -> int:
        return sum(isinstance(s, RetileStep) for s in self.plan.steps)

    # -- explaining -------------------------------------------------------------------------
    def explain(self, sql: bool = True) -> str:
        from ..compile import sql_listing

        c = self.costs
        lines = [
            f"graph plan ({self.strategy}, workers={self.workers}, memory budget "
            f"{'none' if self.budget is None else f'{self.budget / 1e6:.0f} MB'}): {len(self.nodes)} node(s), "
            f"{len(self.plan.steps)} step(s), {self.retiles} retile(s)",
            f"cost {c.total / 1e6:.1f} MB from join {c.join / 1e6:.1f}, grouped {c.group / 1e6:.1f}, aggregation "
            f"{c.agg / 1e6:.1f}, retile {c.retile / 1e6:.1f} MB (weighted sum); largest step peak "
            f"{self.plan.peak_bytes / 1e6:.1f} MB",
            "",
            "cost vs baselines:",
        ]
        for strat, bc in self.baselines.items():
            if bc is None:
                lines.append(f"  {strat:15s} over the memory budget")
            else:
                ratio = bc.total / c.total if c.total else 1.0
                lines.append(f"  {strat:15s} {bc.total / 1e6:10.1f} MB  ({ratio:.2f}x this plan)")
        lines += ["", "nodes:"]
        for n in self.nodes:
            p = self.pieces[n.result.name]
            size = n.size
            tiles = {lab: tile_of(size[lab], p[lab]) for lab in n.labels}
            lines.append(f"  {n.result.name} = {n.describe()}  shape {n.result.shape} {n.result.dtype}")
            lines.append("    pieces " + " ".join(f"{lab}:{p[lab]}" for lab in n.labels)
                         + "   tile " + " ".join(f"{lab}:{tiles[lab]}" for lab in n.labels))
        lines += ["", self.plan.explain()]
        if sql:
            lines += ["", sql_listing(self.plan)]
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz source: inputs, nodes with their chunkings, retiles on the edges."""
        def q(s):  # a DOT string; NL stays the two characters backslash-n, a DOT line break
            return '"' + str(s).replace('"', r'\"') + '"'

        out = ["digraph eindecomp {", "  rankdir=TB;", "  node [fontname=Helvetica, fontsize=10];"]
        for v in self.inputs:
            tile = self.plan_input_tile(v.name)
            label = f"{v.name} {v.shape} {v.dtype}" + NL + f"tile {tile}"
            out.append(f"  {q(v.name)} [shape=box, label={q(label)}];")
        for n in self.nodes:
            p = self.pieces[n.result.name]
            chunks = " ".join(f"{lab}:{p[lab]}" for lab in n.labels)
            label = f"{n.result.name} = {n.describe()}" + NL + f"pieces {chunks}"
            out.append(f"  {q(n.result.name)} [shape=ellipse, label={q(label)}];")
        for step in self.plan.steps:
            if not isinstance(step, EinsumStep):
                continue
            for op, v in zip(step.node.operands, step.inputs):
                src = op.value
                if v.name != src:  # the operand was re-tiled on the way
                    out.append(f"  {q(src)} -> {q(step.node.result.name)} [color=red, label={q('retile ' + str(v.tile))}];")
                else:
                    out.append(f"  {q(src)} -> {q(step.node.result.name)};")
        out.append("}")
        return "\n".join(out)

    def plan_input_tile(self, name: str) -> tuple[int, ...] | None:
        for v in self.plan.inputs:
            if v.name == name:
                return v.tile
        return None

    # -- running ----------------------------------------------------------------------------
    def run(self, db, out=None, replace: bool = False, **inputs):
        """Run on session ``db``. Inputs by name: numpy arrays (stored the way the plan cuts
        them), Tensors or stored tensor names (re-tiled if cut differently). ``out``: a table
        name (one output) or {output: table}; without it outputs are temporary tables.
        Returns the output Tensor, or a dict of them when the graph has several."""
        missing = [v.name for v in self.inputs if v.name not in inputs]
        extra = [k for k in inputs if k not in {v.name for v in self.inputs}]
        if missing or extra:
            raise EinsumError(f"plan.run: missing inputs {missing}, unknown inputs {extra}")
        return db.run_graph_plan(self, inputs, out=out, replace=replace)

    def bind(self, values: dict[str, TiledValue], outputs: dict[str, TiledValue]) -> Plan:
        """The steps for concrete inputs (re-tiles added where a stored input is cut differently)."""
        tiles = self.choice.tiles(self.nodes)
        return plan_nodes(list(self.nodes), values, tiles, outputs, self.budget)


def plan_graph(graph, workers: int = 1, memory=None, strategy: str = "eindecomp",
               max_tile_bytes: int | None = None) -> GraphPlan:
    """Choose every node's chunking with ``strategy`` and build the steps."""
    if strategy not in STRATEGIES:
        raise EinsumError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if not isinstance(workers, int) or workers < 1:
        raise EinsumError(f"workers must be a positive int, got {workers!r}")
    nodes = graph.nodes
    if not nodes:
        raise EinsumError("the graph has no nodes")
    budget = parse_memory(memory)
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: TiledValue(v.name, v.shape, v.dtype, None, _keys(nodes, v.name), v.name, temporary=True)
               for v in graph.outputs}
    choices = {s: baseline(s, nodes, inputs, {}, workers=workers) for s in STRATEGIES[1:]}
    if strategy == "eindecomp":
        choices["eindecomp"] = optimize(nodes, inputs, {}, workers=workers, budget=budget,
                                        max_tile_bytes=max_tile_bytes)
    plan = _steps(nodes, inputs, choices[strategy], outputs, budget)
    plan.check_budget(budget)
    baselines: dict[str, Costs | None] = {s: choices[s].costs for s in STRATEGIES[1:]}
    if budget is not None:  # a baseline whose steps cannot fit is reported as such
        for s in STRATEGIES[1:]:
            steps = plan if s == strategy else _steps(nodes, inputs, choices[s], outputs, budget)
            if steps.peak_bytes > budget:
                baselines[s] = None
    return GraphPlan(tuple(nodes), tuple(graph.inputs), tuple(graph.outputs), strategy, workers, budget,
                     choices[strategy], plan, baselines)


def _steps(nodes, inputs: dict[str, ValueInfo], choice: Choice, outputs, budget) -> Plan:
    values = {
        name: TiledValue(name, v.shape, v.dtype, choice.input_tiles.get(name, v.shape),
                         tuple(f"d{k}" for k in range(len(v.shape))), name)
        for name, v in inputs.items()
    }
    return plan_nodes(list(nodes), values, choice.tiles(nodes), outputs, budget)


def _keys(nodes, name) -> tuple[str, ...]:
    for n in nodes:
        if n.result.name == name:
            return tuple(n.output)
    raise KeyError(name)
