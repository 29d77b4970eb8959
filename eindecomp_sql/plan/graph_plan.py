"""Plans for whole graphs: the chosen chunking of every node, its cost next to the baseline
strategies', EXPLAIN text, Graphviz source, and running it on a session.

>>> from eindecomp_sql.graph import Graph
>>> g = Graph(); x = g.input("x", (1024, 64)); w = g.input("w", (64, 64))
>>> h = g.einsum("bi,io->bo", x, w)
>>> p = g.plan(workers=4)
>>> p.pieces[h.name], p.retiles
({'b': 4, 'i': 1, 'o': 1}, 0)
>>> g.plan(workers=4) is p          # plans are cached: the same graph, options and outputs
True
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from functools import lru_cache
from types import MappingProxyType

from ..errors import EinsumError
from ..graph import EinsumNode, ValueInfo
from .cost import DEFAULT_COSTS, CostModel, Costs, nbytes, parse_memory
from .tiling import tile_of
from .draft import FUSE_MODES, Draft, Options
from .optimize import STRATEGIES, Choice
from .passes.chains import find_chains
from .pipeline import PASSES, run_passes
from .steps import (EinsumStep, Plan, ProgramStep, RetileStep, TiledValue, describe_costs, format_bytes, step_reads,
                    step_target)
from .tiling import check_tile


NL = "\\n"


@dataclass(frozen=True, eq=False)
class GraphPlan:
    """A graph with a chunking for every node; ``plan`` is the step list it runs.

    ``nodes`` are the nodes the ``outputs`` depend on (others were left out); ``inputs`` the
    graph inputs they read. ``single``: ``run`` returns one Tensor (outputs given as None or
    one value) rather than a dict; ``unused_inputs``: graph inputs no kept node reads (``run``
    checks what it is given for them, then ignores it). Plans are cached and shared: treat them as read-only.
    """

    nodes: tuple[EinsumNode, ...]
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    strategy: str
    workers: int
    budget: int | None
    choice: Choice
    plan: Plan
    baselines: dict[str, Costs | None]  # strategy -> its cost (None: over the memory budget)
    single: bool = True
    unused_inputs: tuple[ValueInfo, ...] = ()
    # the baseline whose chunking EinDecomp took because it came out cheaper after fusion (None:
    # the optimizer's own)
    taken_from: str | None = None

    @property
    def cost(self) -> float:
        """The cost model's total for this plan, in cost units (a unit is what one byte fed to
        a join costs; see ``eindecomp_sql.plan.cost``). Not memory: see ``plan.peak_bytes``."""
        return self.costs.total

    @property
    def costs(self) -> Costs:
        """The cost model's terms (join, grouped, aggregation, retile bytes) of the steps this
        plan runs: a fused step counts the tiles it reads, not the intermediates it never
        stores (before fusion this is the optimizer's own total, ``choice.costs``, which counts
        the element-wise nodes it priced as epilogues as fused)."""
        return self.plan.costs

    @property
    def fused(self) -> dict[str, str]:
        """Node result -> the value of the step it runs in, for every node that runs inside
        another's step (``plan/passes/fuse.py``): its result is never stored."""
        out = {}
        for step in self.plan.steps:
            if isinstance(step, EinsumStep) and step.fused is not None:
                out.update((n.result.name, step.result.name) for n in step.fused.nodes[:-1])
            elif isinstance(step, ProgramStep):
                out.update((name, step.result.name) for name in step.hidden)
        return out

    @property
    def pieces(self) -> dict[str, dict[str, int]]:
        """Chunk counts per label of every node, by the node's result name (a copy: the plan
        itself is shared by everyone who plans the same graph)."""
        return {name: dict(p) for name, p in self.choice.pieces.items()}

    @property
    def retiles(self) -> int:
        """How many retile steps the plan has."""
        return sum(isinstance(s, RetileStep) for s in self.plan.steps)

    # -- explaining -------------------------------------------------------------------------
    def explain(self, sql: bool = True, db=None) -> str:
        """The plan as text: chunk counts, tile shapes, cost units against the baselines, projected peaks, and (``sql=True``) every step's SQL:
        as session ``db``'s engine runs it where one is given (on a GPU session, each step
        headed by where it runs; on Spark, Spark SQL), else as DuckDB's."""
        from ..compile import sql_listing

        c = self.costs
        fused = self.fused
        lines = [
            f"graph plan ({self.strategy}"
            + (f" taking {self.taken_from}'s chunking, cheaper once fused" if self.taken_from else "")
            + f", workers={self.workers}, plans' memory budget "
            f"{'none' if self.budget is None else format_bytes(self.budget)}): {len(self.nodes)} node(s), "
            f"{len(self.plan.steps)} step(s), {self.retiles} retile(s)"
            + (f", {len(fused)} node(s) fused into others' steps" if fused else ""),
            f"outputs: {', '.join(v.name for v in self.outputs)}"
            + (f"; inputs not read: {', '.join(v.name for v in self.unused_inputs)}" if self.unused_inputs else ""),
            f"cost {describe_costs(c)}",
            # both assumptions said, each by name: the whole run with the inputs passed as arrays
            # (read in place, none of their tiles in a statement) read as if below the largest
            # step's peak, which counts stored inputs' tiles (a trial: 138 kB against 2.8 MB)
            f"peak memory {format_bytes(self.plan.peak_bytes)} (the largest step's projected peak, inputs stored); "
            f"whole run {format_bytes(self.run_peak())} with the inputs stored, "
            f"{format_bytes(self.run_peak(arrays=[v.name for v in self.plan.inputs]))} with them passed as arrays "
            f"(read in place), every value it computes held to the end (Plan.run_peak)",
            "",
            "cost vs baselines (cost units):",
        ]
        for strat, bc in self.baselines.items():
            if bc is None:
                lines.append(f"  {strat:15s} over the memory budget or the tile cap (tile_bytes)")
            else:
                ratio = bc.total / c.total if c.total else 1.0
                lines.append(f"  {strat:15s} {bc.total:15,.0f}  ({ratio:.2f}x this plan)")
        hidden = [n for s in self.plan.steps if isinstance(s, EinsumStep) and s.node.held for n in s.fused.hidden]
        if hidden:  # a fused chain is chosen with what an unchained plan writes counted (_cheaper)
            values = {n.result.name: n.result for n in self.nodes}
            written = sum(nbytes(values[h].shape, values[h].dtype) for h in hidden if h in values)
            lines.append(f"  (this plan keeps {', '.join(hidden)} inside its kernels; a plan without fused chains "
                         f"writes some of them, up to {format_bytes(written)}, which the costs above leave out)")
        lines += ["", "nodes:"]
        for n in self.nodes:
            p = self.choice.pieces.get(n.result.name) or {lab: 1 for lab in n.labels}  # a fill: none
            size = n.size
            # a stored input's side where it is not even (not Choice.chunking: a fused chain's
            # hidden node has pieces for its own labels only, and a chunking needs every size)
            sides = self.choice.sides.get(n.result.name, {})
            tiles = {lab: sides.get(lab, {}).get(p[lab]) or tile_of(size[lab], p[lab]) for lab in n.labels}
            lines.append(f"  {n.result.name} = {n.describe()}  shape {n.result.shape} {n.result.dtype} "
                         f"({format_bytes(nbytes(n.result.shape, n.result.dtype))})")
            lines.append("    pieces " + " ".join(f"{lab}:{p[lab]}" for lab in n.labels)
                         + "   tile " + " ".join(f"{lab}:{tiles[lab]}" for lab in n.labels)
                         + (f"   fused: runs in the step computing {fused[n.result.name]}, not stored"
                            if n.result.name in fused else ""))
        lines += ["", self.plan.explain(engine_limit=self.engine_limit)]
        if sql:
            listing = getattr(db.backend, "sql_listing", sql_listing) if db is not None else sql_listing
            lines += ["", listing(self.plan)]
        return "\n".join(lines)

    def to_dot(self) -> str:
        """Graphviz source: inputs (boxes) and nodes (ellipses; outputs drawn double) with their
        shape, dtype, bytes and chunking; every edge carries the shape and bytes of the value it
        moves, and a re-tile on the way is drawn red with its target tile. The nodes of a fused
        step sit in one dashed box (one statement); a value that never leaves its kernel is a
        dashed node, its edges dashed."""
        def q(s):  # a DOT string; NL stays the two characters backslash-n, a DOT line break
            return '"' + str(s).replace('"', r'\"') + '"'

        def size(v) -> str:
            return f"{v.shape} {v.dtype}, {format_bytes(nbytes(v.shape, v.dtype))}"

        outputs = {v.name for v in self.outputs}
        fused = self.fused
        out = ["digraph eindecomp {", "  rankdir=TB;", "  node [fontname=Helvetica, fontsize=10];",
               "  edge [fontname=Helvetica, fontsize=9];"]
        for v in self.inputs:
            label = f"{v.name}" + NL + size(v) + NL + f"tile {self.plan_input_tile(v.name)}"
            out.append(f"  {q(v.name)} [shape=box, label={q(label)}];")
        for n in self.nodes:
            p = self.choice.pieces.get(n.result.name) or {lab: 1 for lab in n.labels}  # a fill: none
            chunks = " ".join(f"{lab}:{p[lab]}" for lab in n.labels)
            label = f"{n.result.name} = {n.describe()}" + NL + size(n.result) + NL + f"pieces {chunks}"
            extra = ", peripheries=2" if n.result.name in outputs else ""
            style = ""
            if n.result.name in fused:
                label += NL + f"fused into the step computing {fused[n.result.name]}, not stored"
                style = ", style=dashed"
            out.append(f"  {q(n.result.name)} [shape=ellipse{extra}, label={q(label)}{style}];")
        values = {v.name: v for v in self.inputs}
        values.update((n.result.name, n.result) for n in self.nodes)
        for step in self.plan.steps:  # a reduction run as partial results and a combine step
            if isinstance(step, EinsumStep) and step.node.kept:
                part = step.node.result
                values[part.name] = part
                label = (f"{part.name} = {step.node.describe()}" + NL + size(part) + NL
                         + f"partial results, combined into the next step's {step_reads_by(self.plan, part.name)}")
                out.append(f"  {q(part.name)} [shape=ellipse, label={q(label)}];")
        for k, step in enumerate(self.plan.steps):
            if isinstance(step, ProgramStep):
                parts, inside = step.steps, {s.result.name for s in step.steps}
            elif isinstance(step, EinsumStep):
                parts, inside = (step,), set()
            else:
                continue
            if isinstance(step, ProgramStep) or step.fused is not None:
                names = [n.result.name for s in parts for n in (s.fused.nodes if s.fused else (s.node,))]
                out.append(f"  subgraph {q(f'cluster_step{k}')} {{ label={q(f'step {k}: one statement')}; "
                           f"style=dashed; {' '.join(q(x) + ';' for x in names)} }}")
            reads = []
            for s in parts:
                if s.fused is None:
                    reads += [(s.node.result.name, op, None if v.name in inside else v)
                              for op, v in zip(s.node.operands, s.inputs)]
                else:
                    given = {(op.value, op.labels, op.dropped): v for op, v in zip(s.node.operands, s.inputs)}
                    for n in s.fused.nodes:
                        for op in n.operands:
                            v = given.get((op.value, op.labels, op.dropped))
                            reads.append((n.result.name, op, None if v is None or v.name in inside else v))
            for node, op, v in reads:
                src, dst = q(op.value), q(node)
                moved = size(values[op.value])
                if v is None:  # computed in the same kernel
                    out.append(f"  {src} -> {dst} [style=dashed, label={q(moved + NL + 'inside the kernel')}];")
                elif v.name != op.value:  # the operand was re-tiled on the way
                    out.append(f"  {src} -> {dst} [color=red, label={q(moved + NL + 'retile to tile ' + str(v.tile))}];")
                else:
                    out.append(f"  {src} -> {dst} [label={q(moved)}];")
        out.append("}")
        return "\n".join(out)

    def plan_input_tile(self, name: str) -> tuple[int, ...] | None:
        """The tile shape the plan cuts free input ``name`` into (None if it reads no such input)."""
        for v in self.plan.inputs:
            if v.name == name:
                return v.tile
        return None

    def run_peak(self, arrays=(), returned=(), engine_limit: int | None = None) -> int:
        """The whole run's projected peak memory in bytes: ``Plan.run_peak`` of the plan's steps
        (the README's ``plan.run_peak()`` on what ``g.plan()`` returns). ``engine_limit``:
        DuckDB's ``memory_limit`` while it runs; by default, a plan made under a budget caps
        DuckDB's share as a session of its ``memory=`` does (uncapped, a softmax graph under
        200MB projected 1.2 GB and rose 198 MB: a budget trial)."""
        if engine_limit is None:
            engine_limit = self.engine_limit
        return self.plan.run_peak(arrays=arrays, returned=returned, engine_limit=engine_limit)

    @property
    def engine_limit(self) -> int | None:
        """DuckDB's ``memory_limit`` while this plan runs on a DuckDB session of the ``memory=``
        it was made with (``plan.cost.engine_limit``; None: made without a budget)."""
        from .cost import BUDGET_SHARE, engine_limit

        return None if self.budget is None else engine_limit(round(self.budget / BUDGET_SHARE), self.plan)

    # -- running ---------------------------------------------------------------------------
    def run(self, db, out=None, replace: bool = False, progress=None, *, inputs=None, **named):
        """Run on session ``db``: exactly the steps ``explain()`` lists. Inputs by name: numpy
        arrays (cut the way the plan cuts them), Tensors or stored tensor names, stored in the
        tiles the plan reads (``plan_input_tile``; plan a graph over stored tensors with
        ``g.plan(inputs={...})``, or use ``g.run``). ``out``: a table name (one output), a list
        of one per output (in the plan's order) or {output (its name or GraphValue): table};
        without it outputs are temporary tables (dropped when their Tensor is collected).
        ``progress``: as for ``Session.einsum``.

        Returns one ``Tensor`` when the plan was made with ``outputs`` None or one value, a
        dict name -> Tensor when it was made with a list or tuple (even of one). ``inputs``: the
        inputs as a dict instead (for inputs named like this method's own arguments)."""
        check_session(db, "plan.run")
        inputs = merge_inputs(inputs, named)
        known = {v.name for v in self.inputs} | {v.name for v in self.unused_inputs}
        missing = [v.name for v in self.inputs if v.name not in inputs]
        extra = [k for k in inputs if k not in known]
        if missing or extra:
            raise EinsumError(f"plan.run: missing inputs {missing}, unknown inputs {extra}")
        used = {v.name for v in self.inputs}
        # an input no output needs is still checked: a wrong shape or dtype there is a mistake
        # of the caller's, which ran in silence (a trial)
        db.check_graph_inputs(self.unused_inputs, inputs)
        return db.run_graph_plan(self, {k: x for k, x in inputs.items() if k in used}, out=out, replace=replace,
                                 progress=progress)


def step_reads_by(plan: Plan, name: str) -> str:
    """The value of the step that reads ``name`` (a partial result's combine step)."""
    return next((step_target(s).name for s in plan.steps if any(v.name == name for v in step_reads(s))), "?")


def check_session(db, where: str) -> None:
    """``db`` must be a session (``eds.connect(...)``), not a path or None."""
    from ..session import Session

    if not isinstance(db, Session):
        raise EinsumError(f"{where}: db must be a session from eds.connect(...), got {type(db).__name__} {db!r:.60}")


def merge_inputs(given, named: dict) -> dict:
    """``inputs=`` (a dict) and keyword inputs, as one dict; a name given both ways is an error."""
    if given is None:
        return dict(named)
    if not hasattr(given, "items"):
        raise EinsumError(f"inputs must be a dict {{input name: array, Tensor or name}}, got {given!r:.60}")
    both = sorted(set(given) & set(named))
    if both:
        raise EinsumError(f"input(s) {both} given both in inputs= and as keywords")
    return {**dict(given), **named}


def plan_graph(graph, workers: int = 1, memory=None, strategy: str = "eindecomp",
               tile_bytes: int | None = None, outputs=None, inputs=None, costs: CostModel = DEFAULT_COSTS,
               fuse: bool | str = True) -> GraphPlan:
    """Choose every node's chunking with ``strategy`` and build the steps for ``outputs``
    (see ``Graph.plan``). Only the nodes the outputs depend on are planned. ``inputs``: graph
    input name -> the tile shape it is stored in (or a Tensor): the plan reads it so cut.
    ``costs``: the cost model of the engine the plan is for. ``fuse``: element-wise nodes run
    inside the einsum steps next to them where they can (``plan/passes/fuse.py``) and steps
    over single tiles run as programs (``plan/passes/program.py``); ``"elementwise"``: only
    the first; False: neither."""
    if strategy not in STRATEGIES:
        raise EinsumError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise EinsumError(f"workers must be a positive int, got {workers!r}")
    if fuse not in FUSE_MODES or isinstance(fuse, int) and not isinstance(fuse, bool):
        raise EinsumError(f"fuse must be True, False or 'elementwise', got {fuse!r}")
    budget = parse_memory(memory)
    picked, single = graph.select(outputs)
    nodes = graph.needed([v.name for v in picked])
    if len(nodes) < len(graph.nodes) and outputs is None:
        kept = {n.result.name for n in nodes}
        left = [f"{n.result.name} ({n.describe()})" for n in graph.nodes if n.result.name not in kept]
        # before outputs= existed every unused node silently became a second output
        warnings.warn(
            f"g.plan(): computing only the last-added value {picked[0].name!r}; node(s) it does not depend on "
            f"are left out: {', '.join(left)}. Pass outputs=[...] to compute several values.",
            stacklevel=3)
    read = {op.value for n in nodes for op in n.operands}
    fixed = _fixed_tiles(graph, inputs)
    used = tuple(v for v in graph.inputs if v.name in read)
    unused = tuple(v for v in graph.inputs if v.name not in read)
    made = _plan_cached(nodes, used, picked, single, unused, workers, budget, strategy, tile_bytes,
                        tuple(sorted(fixed.items())), costs, fuse)
    if any(a.dtype_given != b.dtype_given for a, b in zip(made.inputs + made.unused_inputs, used + unused)):
        # a cached plan made for an equal graph whose inputs' dtypes were (not) declared: this
        # graph's own inputs say whether binding a wider array warns (unused ones too: a review)
        made = replace(made, inputs=used, unused_inputs=unused)
    return made


def _fixed_tiles(graph, inputs) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """``inputs=`` of ``Graph.plan``, checked: input name -> (tile shape, key names)."""
    if inputs is None:
        return {}
    if not hasattr(inputs, "items"):
        raise EinsumError(f"inputs must be a dict {{input name: Tensor or tile shape}}, got {inputs!r:.60}")
    declared = {v.name: v for v in graph.inputs}
    fixed = {}
    for name, x in inputs.items():
        if name not in declared:
            raise EinsumError(f"inputs names {name!r}, which is not an input of the graph; inputs: "
                              f"{', '.join(declared) or 'none'}")
        v = declared[name]
        tile, keys = getattr(x, "tile", x), getattr(x, "keys", tuple(f"d{k}" for k in range(len(v.shape))))
        if hasattr(x, "shape") and hasattr(x, "tile") and tuple(x.shape) != v.shape:
            raise EinsumError(f"inputs[{name!r}]: the graph wants shape {v.shape}, the tensor has {tuple(x.shape)}")
        fixed[name] = (check_tile(v.shape, tile), tuple(keys))
    return fixed


# A plan is a pure function of these arguments, all hashable: nodes compare by value, and a
# callable join by the identity of the callable (JoinFunction.func_id). The cache key holds the
# nodes, so it keeps every such callable alive, and an id cannot be reused while a plan made
# with it is cached.
def _within_cap(plan: Plan, tile_bytes: int | None) -> bool:
    """Whether every tile ``plan`` creates (each step's result) is within ``tile_bytes``."""
    if tile_bytes is None:
        return True
    for step in plan.steps:
        v = step_target(step)
        if nbytes(v.tile, v.dtype) > tile_bytes:
            return False
    return True


def _cheaper(chained: Draft, made: Draft) -> bool:
    """Whether the chained plan costs less than ``made`` with what ``made`` writes and the
    chained one does not (``_stored``), or as much in fewer steps (measured faster there:
    bench/RESULTS.md "Fused chains")."""
    mine, other = chained.plan().costs.total, made.plan().costs.total + _stored(made, chained)
    return mine < other or mine == other and len(chained.steps) < len(made.steps)


def _stored(made: Draft, chained: Draft) -> float:
    """What ``made`` pays, beyond its steps' costs, for storing the values ``chained`` keeps
    inside its kernels: their bytes (and any re-tiled copy's) at a join byte's weight. The
    model prices what steps read, not what they write; a chain's gain is mostly the writes
    (bench/RESULTS.md "Fused chains")."""
    hidden = {name for c in chained.chains for name, _ in c.labels}
    model = made.options.costs
    written = 0
    for s in made.plan().steps:
        if isinstance(s, RetileStep) and s.source.name in hidden:
            hidden.add(s.target.name)
        v = step_target(s)
        if v.name in hidden:
            written += v.nbytes
    return model.join * written


# whether graphs plan fused chains (passes/chains.py): "auto" where cheaper; "always" and
# "never" are for benchmarks comparing the two (bench/chain_bench.py); plans are cached, so
# clear ``_plan_cached`` after changing it
CHAINS = "auto"


@lru_cache(maxsize=128)
def _plan_cached(nodes: tuple[EinsumNode, ...], inputs: tuple[ValueInfo, ...], picked: tuple[ValueInfo, ...],
                 single: bool, unused: tuple[ValueInfo, ...], workers: int, budget: int | None, strategy: str,
                 tile_bytes: int | None, fixed: tuple, costs: CostModel, fuse: bool | str = True) -> GraphPlan:  # noqa: PLR0913
    cut = dict(fixed)  # input name -> (tile, keys) it is stored in
    values = tuple(TiledValue(v.name, v.shape, v.dtype, *cut.get(v.name, (None, tuple(f"d{k}" for k in range(len(v.shape))))))
                   for v in inputs)

    def draft(strat: str) -> Draft:
        return Draft(nodes, values, tuple(v.name for v in picked),
                     Options(workers, budget, tile_bytes, strat, costs, fuse=fuse))

    first = draft(strategy)
    made = run_passes(first)
    if made.choice.priced:
        # The optimizer priced element-wise nodes as the epilogues they can be; the fuse pass
        # may still refuse one (over the budget at its most batches, dearer once a grouped
        # step replicates its other operands, too many operands), and then the plan paid for
        # a tiling that bought nothing. Planned without that pricing too, the cheaper is kept
        # (a chunking that priced none is the unpriced optimum already).
        plain = run_passes(replace(first, options=replace(first.options, price_epilogues=False)))
        if plain.plan().costs.total < made.plan().costs.total:
            made = plain
    baselines: dict[str, Costs | None] = {}
    others: dict[str, Draft] = {}
    for s in STRATEGIES[1:]:  # the fixed strategies' costs, and whether their steps fit the budget
        other = made if s == strategy else run_passes(draft(s), PASSES[:-1])
        # the budget, and the tile cap: a baseline's chunking ignores tile_bytes, and a graph of
        # 2048² float32 GEMMs under tile_bytes=4MiB took data-parallel's 16 MB tiles (a new
        # user's report; tiles a plan creates stay under the cap, stored ones may be larger)
        fits = (budget is None or other.plan().peak_bytes <= budget) and _within_cap(other.plan(), tile_bytes)
        baselines[s] = other.plan().costs if fits else None
        if fits:
            others[s] = other
    taken = None
    if strategy == "eindecomp":
        # The optimizer's candidates include every baseline's chunking, so before fusion it
        # never costs more than one; fusion, which it does not see, saves more under some
        # chunkings than others: a baseline left cheaper after fusion is taken as it is.
        cheaper = [s for s, o in others.items() if baselines[s].total < made.plan().costs.total]
        if cheaper:
            taken = min(cheaper, key=lambda s: baselines[s].total)
            made = others[taken]
        # a contraction feeding another through element-wise nodes, run inside its step
        # (passes/chains.py), where that costs less and fits
        if fuse is True and CHAINS != "never" and find_chains(nodes, {v.name for v in picked})[1]:
            try:
                chained = run_passes(replace(first, options=replace(first.options, chains=True)))
            except EinsumError:  # no chunking keeping the chain's labels whole fits
                chained = None
            if chained is not None and (CHAINS == "always" or _cheaper(chained, made)):
                made, taken = chained, None
    return GraphPlan(nodes, inputs, picked, strategy, workers, budget, made.choice, made.plan(),
                     MappingProxyType(baselines), single, unused, taken)
