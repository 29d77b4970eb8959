"""The frozen plan IR: tiled values and the steps between them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

import numpy as np

from ..errors import EinsumError
from ..graph import EinsumNode
from .cost import (DEFAULT_COSTS, CostModel, Costs, batch_grid, batch_label, nbytes,
                   retile_axis, retile_kernel_peak, retile_peak, step_kernel_peak, step_costs, step_peak)
from .tiling import Chunking, ceil_div, grid, moves_whole_rows


class OverBudget(EinsumError):
    """A finished plan with a step over the memory budget (``Plan.check_budget``)."""


def format_bytes(n: float) -> str:
    """``512 B``, ``12.3 kB``, ``2.1 MB``, ``1.50 GB`` (powers of 1000, as the budgets are)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def describe_costs(c: Costs) -> str:
    """The cost model's total in *cost units* (a unit is what one byte fed to a join costs;
    the other terms are bytes weighted by calibration), with its non-zero terms. Not memory.

    >>> describe_costs(Costs(join=2_000_000, retile=1_000_000))
    '5,000,000 cost units = join 2.0 MB + 3 x retile 1.0 MB'
    """
    m = c.model
    terms = [(m.join, "join", c.join), (m.group, "grouped", c.group), (m.agg, "aggregation", c.agg),
             (m.retile, "retile", c.retile), (m.row_retile_weight, "row retile", c.row_retile)]
    parts = [f"{'' if w == 1 else f'{w:g} x '}{name} {format_bytes(b)}" for w, name, b in terms if b]
    if c.statements:
        parts.append(f"{c.statements} statement{'' if c.statements == 1 else 's'} x {format_bytes(m.statement)}")
    return f"{c.total:,.0f} cost units" + (" = " + " + ".join(parts) if parts else "")


def key_names(labels) -> tuple[str, ...]:
    """Key column names for a result: its labels, unless two differ only in case (``i`` and
    ``I`` are one column name to DuckDB); then ``d0, d1, ...`` as for stored arrays."""
    labels = tuple(labels)
    if len({lab.lower() for lab in labels}) == len(labels):
        return labels
    return tuple(f"d{k}" for k in range(len(labels)))


@dataclass(frozen=True)
class TiledValue:
    """A value cut into tiles: one key per dimension, and a tile shape (edge tiles smaller).

    Plans are built over values, never tables: a plan names its inputs, its intermediates and
    its outputs, and a backend binds each name to storage when it runs the plan (a table, an
    array, rows to return). Where a result goes is no part of its plan, so a repeated einsum is
    one plan and one compiled SQL whatever its result is called; operands are told apart by
    name (a stored tensor's value is named after its table, an array after its position). A
    graph input not yet bound to data has
    ``tile`` None until a plan chooses how to cut it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    tile: tuple[int, ...] | None
    keys: tuple[str, ...]

    @property
    def grid(self) -> tuple[int, ...]:
        return grid(self.shape, self.tile)

    @property
    def nbytes(self) -> int:
        """Size of the tile data, in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class RetileStep:
    """Re-cut ``source`` into ``target.tile``: slice each source tile into the pieces that
    overlap target tiles, then concatenate the pieces of each target tile. Peak memory is one
    target tile plus the pieces that make it: no step gathers the whole tensor."""

    source: TiledValue
    target: TiledValue
    batches: int = 1  # statements, over ranges of one target key (``batch_axis``)

    @property
    def batch_axis(self) -> int:
        """The target key the statements split (the one with the most tiles)."""
        return retile_axis(self.target.shape, self.target.tile)

    @property
    def by_rows(self) -> bool:
        """Whether only the leading axis is re-cut (``tiling.moves_whole_rows``)."""
        return moves_whole_rows(self.source.shape, self.source.tile, self.target.tile)

    @property
    def costs(self) -> Costs:
        if self.by_rows:
            return Costs(row_retile=self.source.nbytes, statements=self.batches)
        return Costs(retile=self.source.nbytes, statements=self.batches)

    def costs_on(self, model: CostModel) -> Costs:
        return replace(self.costs, model=model)

    @property
    def peak_bytes(self) -> int:
        return self.peak()

    def peak(self, model: CostModel = DEFAULT_COSTS) -> int:
        """Projected peak memory: the batch's pieces (held by list()) plus target tiles in flight."""
        return retile_peak(self.source.shape, self.source.dtype, self.target.tile, self.batches, model,
                           self.source.tile)

    def kernel_peak(self, model: CostModel = DEFAULT_COSTS) -> int:
        """The part of ``peak`` the kernels hold outside the engine (pieces, target tiles)."""
        return retile_kernel_peak(self.source.shape, self.source.dtype, self.target.tile, self.batches, model,
                                  self.source.tile)

    def describe(self) -> str:
        batched = f" in {self.batches} batches" if self.batches > 1 else ""
        return f"retile {self.source.name} {self.source.tile} -> {self.target.tile}{batched}"


def stage_text(node: EinsumNode) -> str:
    """A fused element-wise node in a step's description: its join alone when it maps one
    operand in place (``relu``), else the node (``bo,o->bo join=add``)."""
    (op, *more) = node.operands
    if not more and op.labels == node.output and not op.dropped and node.join.name != "identity":
        return node.join.label
    return node.describe()


@dataclass(frozen=True)
class Fusion:
    """The graph nodes one fused ``EinsumStep`` runs in a single kernel, relabelled into the
    step's labels (``plan/passes/fuse.py``): ``prologues`` compute operands of ``core``
    element-wise from tiles the step reads, ``core`` is the einsum the step joins and
    aggregates, and ``epilogues`` apply, in order, to every finished tile of ``core``'s result.
    Each node reads tiles the step's SQL joins or results of the nodes before it. Only the last
    node's result is stored: the others (``hidden``) live inside the kernel."""

    core: EinsumNode
    prologues: tuple[EinsumNode, ...] = ()
    epilogues: tuple[EinsumNode, ...] = ()

    @property
    def nodes(self) -> tuple[EinsumNode, ...]:
        """Every node, in the order the kernel computes them."""
        return self.prologues + (self.core,) + self.epilogues

    @property
    def names(self) -> tuple[str, ...]:
        """The results of the element-wise nodes fused around the core."""
        return tuple(n.result.name for n in self.prologues + self.epilogues)

    @property
    def hidden(self) -> tuple[str, ...]:
        """Values computed inside the kernel and never stored: every node's result but the last."""
        return tuple(n.result.name for n in self.nodes[:-1])

    def describe(self) -> str:
        pro = "".join(f"{n.result.name} = {stage_text(n)}; " for n in self.prologues)
        return pro + self.core.describe() + "".join(f" + {stage_text(n)}" for n in self.epilogues)


@dataclass(frozen=True)
class EinsumStep:
    """One einsum node run as a join of tiled tables plus tile kernels.

    ``chunk`` is how every label is cut (tile sides, and pieces). When a reduced label has more than one
    piece, partial results meet in a GROUP BY and the kernel contracts the whole group per call
    (``grouped``); otherwise every joined row is one output tile.

    A fused step (``fused`` set) runs several graph nodes in one kernel: ``node`` is then the
    einsum its SQL joins and aggregates (every tile any fused node reads, labelled in the step's
    labels, with the last node's output and result), and ``fused`` what the kernel computes.
    """

    node: EinsumNode
    inputs: tuple[TiledValue, ...]
    result: TiledValue
    chunk: Chunking
    batches: int = 1  # statements, over ranges of the keys of one or two output labels (``batch_grid``)
    fused: Fusion | None = None

    @property
    def batch_label(self) -> str | None:
        return batch_label(self.node, self.pieces)

    @property
    def batch_grid(self) -> tuple[tuple[str, int], ...]:
        """``(label, key ranges)`` per label the statements split (empty: one statement)."""
        return batch_grid(self.node, self.pieces, self.batches)

    @property
    def tile_of(self) -> dict[str, int]:
        return self.chunk.tile_of

    @property
    def pieces(self) -> dict[str, int]:
        return self.chunk.pieces

    @property
    def grouped(self) -> bool:
        pieces = self.pieces
        return any(pieces[lab] > 1 for lab in self.node.summed)

    @property
    def costs(self) -> Costs:
        """Join and aggregation bytes of the cost model (a fused step aggregates its core's
        result, in the core's dtype: an epilogue runs after the aggregation)."""
        return self.costs_on(DEFAULT_COSTS)

    def costs_on(self, model: CostModel) -> Costs:
        """``costs`` on ``model``'s engine: what a grouped step groups depends on it."""
        agg_dtype = self.fused.core.result.dtype if self.fused is not None else None
        c = step_costs(self.node, self.pieces, {op.value: v.nbytes for op, v in zip(self.node.operands, self.inputs)},
                       agg_dtype, model)
        return replace(c, statements=self.batches)

    @property
    def peak_bytes(self) -> int:
        return self.peak()

    def peak(self, model: CostModel = DEFAULT_COSTS, in_place: frozenset = frozenset()) -> int:
        """Projected peak memory; ``in_place``: names of the plan's inputs the kernels read from
        the caller's arrays (``Plan.run_peak``), whose tiles the SQL does not carry."""
        dtypes = {op.value: v.dtype for op, v in zip(self.node.operands, self.inputs)}
        read = frozenset(op.value for op, v in zip(self.node.operands, self.inputs) if v.name in in_place)
        return step_peak(self.node, self.pieces, dtypes, self.batches, model, held_tile_bytes=self._held(),
                         in_place=read)

    def _held(self) -> int:
        if self.fused is None or self.node.held:  # a fused chain's node counts its own (cost.step_peak)
            return 0
        # a fused kernel also holds, per output tile in flight, a tile of every value it
        # keeps to itself (prologue results, the core's result before the epilogues)
        tile = self.tile_of
        return sum(nbytes([tile[lab] for lab in n.output], n.result.dtype) for n in self.fused.nodes[:-1])

    def kernel_peak(self, model: CostModel = DEFAULT_COSTS) -> int:
        """The part of ``peak`` the kernels hold outside the engine (their result tiles)."""
        return step_kernel_peak(self.node, self.pieces, {}, self.batches, model, held_tile_bytes=self._held())

    def unfused(self) -> tuple["EinsumStep", ...]:
        """The steps a fused step stands for, over the same tiles: one per node, reading the
        step's inputs and each other's results (values named after the nodes' results, cut as
        the step cuts its labels). What the reference backend runs; an unfused step is itself."""
        if self.fused is None:
            return (self,)
        tile = self.tile_of
        reads = {(op.value, op.labels, op.dropped): v for op, v in zip(self.node.operands, self.inputs)}
        made: dict[str, TiledValue] = {}
        out = []
        last = self.fused.nodes[-1]
        for n in self.fused.nodes:
            inputs = tuple(made[op.value] if op.value in made else reads[(op.value, op.labels, op.dropped)]
                           for op in n.operands)
            result = self.result if n is last else TiledValue(
                n.result.name, n.result.shape, n.result.dtype, tuple(tile[lab] for lab in n.output),
                key_names(n.output))
            made[n.result.name] = result
            chunk = Chunking(tuple(sorted(n.sizes)), tuple(sorted((lab, tile[lab]) for lab in n.labels)))
            out.append(EinsumStep(n, inputs, result, chunk))
        return tuple(out)

    def describe(self) -> str:
        p = self.pieces
        chunks = " ".join(f"{lab}:{p[lab]}" for lab in self.node.labels)
        batched = (f" in {self.batches} batches over " + " x ".join(f"{lab}:{n}" for lab, n in self.batch_grid)
                   if self.batches > 1 else "")
        if self.fused is None:
            return f"einsum {self.node.describe()} [{chunks}]{batched} -> {self.result.name}"
        f = self.fused
        hidden = ", ".join(f.hidden)
        return (f"einsum {f.describe()} [{chunks}]{batched} -> {self.result.name} "
                f"[fused {', '.join(f.names)}; {hidden} not stored]")


def one_tile(v: TiledValue) -> bool:
    """Whether ``v`` is a single tile holding at least one element."""
    return v.nbytes > 0 and all(g == 1 for g in v.grid)


@dataclass(frozen=True)
class ProgramStep:
    """Einsum steps over values that are each one tile, run one after the other in a single
    kernel call (``plan/passes/program.py``): the statement reads every tile ``inputs`` names
    once (one row each), the kernel computes ``steps`` in order, each reading those tiles and
    the results of the steps before it, and only the last step's result is stored. Each step
    keeps its own chunking (every label in one piece) and may itself be fused.

    When a plan cuts nothing, a statement per node buys nothing: each costs DuckDB a few
    milliseconds outside its kernel and copies its tiles in and out (docs/DESIGN.md,
    "Programs: graphs of single tiles").
    """

    steps: tuple[EinsumStep, ...]
    inputs: tuple[TiledValue, ...]  # tiles read that no step here computes, in slot order

    batches = 1  # one statement: a program is never batched (it is one tile)

    @property
    def result(self) -> TiledValue:
        return self.steps[-1].result

    @property
    def hidden(self) -> tuple[str, ...]:
        """Values computed inside the kernel and never stored (fused nodes' included)."""
        out = []
        for s in self.steps:
            out += list(s.fused.hidden) if s.fused is not None else []
            if s is not self.steps[-1]:
                out.append(s.result.name)
        return tuple(out)

    @property
    def costs(self) -> Costs:
        """Only the inputs cross into the kernel, once: what the steps compute stays inside."""
        return Costs(join=sum(v.nbytes for v in self.inputs), statements=1)

    def costs_on(self, model: CostModel) -> Costs:
        return replace(self.costs, model=model)

    @property
    def peak_bytes(self) -> int:
        return self.peak()

    def peak(self, model: CostModel = DEFAULT_COSTS) -> int:
        """The input tiles (read by the engine, and their Arrow copy), then at each step the results still to be read
        (the kernel lets go of one after its last reader) and what a fused step holds besides,
        and the result's copy into DuckDB."""
        last_use: dict[str, int] = {}
        for j, s in enumerate(self.steps):
            for v in s.inputs:
                last_use[v.name] = j
        live: dict[str, int] = {}
        most = 0
        for j, s in enumerate(self.steps):
            held = sum(nbytes(n.result.shape, n.result.dtype) for n in s.fused.nodes[:-1]) if s.fused else 0
            live[s.result.name] = s.result.nbytes
            most = max(most, sum(live.values()) + held)
            for name in [n for n in live if last_use.get(n, -1) <= j and n != self.result.name]:
                del live[name]
        inputs = sum(v.nbytes for v in self.inputs)
        read = inputs if model.engine_holds_inputs else 0  # the engine's scan of the input tiles
        return read + inputs + most + self.result.nbytes

    def describe(self) -> str:
        """One line (what progress and errors say); ``Plan.explain`` lists the steps under it."""
        return (f"program of {len(self.steps)} einsums on single tiles -> {self.result.name} "
                f"[{', '.join(self.hidden)} not stored]")


# What a value DuckDB holds in a table costs the process, per byte of tiles: a TEMP table of
# 64 MB of tiles grew the resident set by 100-140 MB (1, 4 and 16 MB tiles; the table's
# blocks and the copies its INSERT made, which the allocator keeps for the next statement)
TABLE_FACTOR = 2


def _kernel_peak(step, model: CostModel) -> int:
    # programs and fills: one tile, or tiles made from nothing: all of it, to be safe
    return step.kernel_peak(model) if isinstance(step, (EinsumStep, RetileStep)) else step.peak(model)


def fill_peak(result: TiledValue, batches: int) -> int:
    """Bytes of the largest batch of a fill: whole rows of tiles along the first key."""
    if not result.shape or result.nbytes == 0:
        return result.nbytes
    g = result.grid
    rows = ceil_div(g[0], batches)
    return min(result.nbytes, rows * int(np.prod(g[1:], dtype=np.int64)) * nbytes(result.tile, result.dtype))


@dataclass(frozen=True)
class FillStep:
    """A result that reads no input: an einsum over a label of size 0, as numpy defines it.

    With an output label of size 0 the result has no elements (and no tiles); otherwise every
    element aggregates an empty set, which is the aggregation's identity (sum 0, prod 1).
    """

    result: TiledValue
    value: float | int | bool
    batches: int = 1  # statements, over ranges of the first result key

    @property
    def costs(self) -> Costs:
        return Costs(statements=self.batches)

    def costs_on(self, model: CostModel) -> Costs:
        return replace(self.costs, model=model)

    @property
    def peak_bytes(self) -> int:
        return self.peak()

    def peak(self, model: CostModel = DEFAULT_COSTS) -> int:
        """The tiles of one statement (DuckDB may hand them all to one kernel call)."""
        return fill_peak(self.result, self.batches)

    def describe(self) -> str:
        if self.result.nbytes == 0:
            return f"fill {self.result.name}: empty {self.result.shape}"
        batched = f" in {self.batches} batches" if self.batches > 1 else ""
        return f"fill {self.result.name} {self.result.shape} with {self.value!r}{batched} (a reduced label has size 0)"


Step = Union[RetileStep, EinsumStep, FillStep, ProgramStep]


def step_target(step: Step) -> TiledValue:
    """The value a step computes."""
    return step.target if isinstance(step, RetileStep) else step.result


def step_reads(step: Step) -> tuple[TiledValue, ...]:
    """The values a step's statement reads (a fill reads none)."""
    if isinstance(step, (EinsumStep, ProgramStep)):
        return step.inputs
    if isinstance(step, RetileStep):
        return (step.source,)
    return ()


def output_tiles(step: Step) -> int:
    """How many tiles a step writes (what progress counts)."""
    value = step_target(step)
    return int(np.prod(value.grid, dtype=np.int64)) if value.shape else 1


@dataclass(frozen=True)
class Plan:
    """Steps in execution order, the tiled inputs they read, and the values they keep;
    ``model``: the cost model (the engine's) its costs and peaks are projected under."""

    steps: tuple[Step, ...]
    inputs: tuple[TiledValue, ...]
    outputs: tuple[TiledValue, ...]
    model: CostModel = field(default=DEFAULT_COSTS)

    @property
    def result(self) -> TiledValue:
        """The last output (the only one for a single einsum)."""
        return self.outputs[-1]

    @property
    def scratch(self) -> tuple[TiledValue, ...]:
        """Values the steps compute that are not outputs: dropped when the plan finishes."""
        kept = {v.name for v in self.outputs}
        return tuple(v for v in (step_target(s) for s in self.steps) if v.name not in kept)

    @property
    def costs(self) -> Costs:
        total = Costs(model=self.model)
        for s in self.steps:
            total = total + s.costs_on(self.model)
        return total

    def peak_of(self, step: Step) -> int:
        """A step's projected peak memory on this plan's engine, in bytes."""
        return step.peak(self.model)

    @property
    def cost(self) -> float:
        """The cost model's total, in (join-equivalent) bytes."""
        return self.costs.total

    @property
    def peak_bytes(self) -> int:
        """The largest projected peak of any step."""
        return max((s.peak(self.model) for s in self.steps), default=0)

    @property
    def engine_bytes(self) -> int:
        """The largest share of a step's projected peak the engine holds (``kernel_bytes``'s
        complement): DuckDB's ``memory_limit`` must leave room for it."""
        return max((s.peak(self.model) - _kernel_peak(s, self.model) for s in self.steps), default=0)

    @property
    def kernel_bytes(self) -> int:
        """The largest share of a step's projected peak that the kernels and Arrow buffers hold
        (the rest, a statement's input tiles, the engine holds under its own limit). A budget's
        split: the engine may hold what this leaves."""
        return max((_kernel_peak(s, self.model) for s in self.steps), default=0)

    def run_peak(self, arrays=(), returned=(), engine_limit: int | None = None) -> int:
        """Projected peak memory of the whole run, in bytes: the largest step's working set
        (``peak_of``) on top of everything alive while it runs. Alive: the Arrow copies of the
        inputs named in ``arrays`` (inputs passed as arrays, for the run; none for those the
        kernels read in place, ``kernel_spec.inputs_read_by_name``, whose tiles no statement
        carries either: ``EinsumStep.peak``'s ``in_place``), and every value an
        earlier step computed (scratch values are dropped when the plan ends, kept results are
        tables; DuckDB holds both). At the end, the results named in ``returned`` are numpy
        arrays: written there by the kernels of an einsum or program step (their bytes), else
        fetched as Arrow and converted (twice their bytes). ``engine_limit``: DuckDB's
        ``memory_limit`` while the plan runs (a session's budget, see the DuckDB backend's
        ``engine_limit``): what DuckDB holds, values and a step's statement, is capped there
        (it evicts and spills), what the kernels hold is not. Not counted: the interpreter and
        libraries, and the allocators' retained pages (bench/run_peak.py measures the rest)."""
        from .kernel_spec import inputs_read_by_name

        by_name = inputs_read_by_name(self)
        in_place = frozenset(set(arrays) & by_name)
        arrays, returned = set(arrays) - by_name, set(returned)
        base = sum(v.nbytes for v in self.inputs if v.name in arrays)
        held = peak = 0
        for s in self.steps:
            kernel = _kernel_peak(s, self.model)
            step = s.peak(self.model, in_place) if isinstance(s, EinsumStep) else s.peak(self.model)
            engine = held + step - kernel
            if engine_limit is not None:
                engine = min(engine, engine_limit)
            peak = max(peak, base + engine + kernel)
            held += TABLE_FACTOR * step_target(s).nbytes
        if engine_limit is not None:
            held = min(held, engine_limit)
        written = {step_target(s).name for s in self.steps if isinstance(s, (EinsumStep, ProgramStep))}
        end = base + held + sum(v.nbytes * (1 if v.name in written else 2) for v in self.outputs if v.name in returned)
        return max(peak, end)

    def check_budget(self, budget: int | None) -> None:
        """Refuse before running if any step's projected peak exceeds ``budget`` bytes."""
        if budget is None:
            return
        for k, s in enumerate(self.steps):
            peak = s.peak(self.model)
            if peak > budget:
                raise OverBudget(
                    f"step {k} ({s.describe()}) would need {format_bytes(peak)}, over the memory "
                    f"budget of {format_bytes(budget)}; give more memory or let the optimizer cut finer"
                )

    def explain(self, engine_limit: int | None = None) -> str:
        """Steps with their cost (cost units, from bytes moved) and projected peak memory (bytes).
        ``engine_limit``: DuckDB's ``memory_limit`` while the plan runs under a session's budget,
        which caps what the whole-run figure counts for DuckDB (without it, an 8192² GEMM under
        256 MB said "whole run 1.61 GB" and peaked at 378 MB; a new user's report)."""
        lines = [f"plan: {len(self.steps)} step(s); {describe_costs(self.costs)}; "
                 f"peak memory {format_bytes(self.peak_bytes)} (largest step; whole run "
                 f"{format_bytes(self.run_peak(engine_limit=engine_limit))})"]
        for v in self.inputs:
            lines.append(f"  input {v.name}: shape {v.shape} {v.dtype} tile {v.tile} grid {v.grid}")
        for k, s in enumerate(self.steps):
            lines.append(f"  step {k}: {s.describe()} ({describe_costs(s.costs_on(self.model))}; "
                         f"peak memory {format_bytes(s.peak(self.model))})")
            if isinstance(s, ProgramStep):  # its einsums, in the order the kernel runs them
                lines += [f"    {k}.{j}: {part.describe()}" for j, part in enumerate(s.steps)]
        for r in self.outputs:
            lines.append(f"  result {r.name}: shape {r.shape} {r.dtype} tile {r.tile} grid {r.grid}")
        return "\n".join(lines)
