"""The cost model, in bytes (docs/DESIGN.md has the formulas and their calibration).

For an einsum node cut into ``d[l]`` pieces per label:

- **join**: bytes fed to the join = sum over operands of ``bytes(operand) * prod(d[l] for the
  node's labels l the operand lacks)``: an input tile is repeated once for every piece of each
  label it does not have.
- **aggregation**: ``bytes(output) * (prod(d[l] for reduced labels l) - 1)``: partial results
  beyond the first that must be combined.
- **retile**: ``bytes(value)`` whenever a producer's tiling differs from what a consumer needs:
  every element moves once (sliced, regrouped, concatenated).
- **group** (this engine's own term): when a reduced label is cut, DuckDB routes the step's
  joined tiles through a ``list()`` aggregate before the kernel contracts each group, so those
  join bytes are moved once more.

The total is ``join + GROUP * group + AGG * agg + RETILE * retile + STATEMENT * statements``:
every term in "bytes that cost what one join byte costs" (a statement's fixed cost counted so).
The weights, and the rules for peak memory, are facts about the engine that runs the plan: a
``CostModel`` holds them, a backend brings its own (``Backend.cost_model``; DuckDB's are
calibrated by ``bench/calibrate.py``, numbers in bench/RESULTS.md), and the formulas here take it
as data.

Peak memory of a step (bytes), from how DuckDB runs it (``CostModel.vector_rows`` and
``CostModel.grouped_holds_all`` say how much of this an engine shares): a row step holds the tiles of the rows
in one UDF call (DuckDB hands a UDF a whole vector, up to 2,048 rows: a join of a few tiles
arrives in one call) plus their output tiles twice (kernel buffer and DuckDB's copy); a grouped
step holds every joined tile (``list()`` does not spill) plus the output tiles in flight; a
retile holds every piece (again ``list()``) plus the target tiles in flight. Cutting finer does
not lower these by itself (more, smaller tiles still arrive together), so a step over budget
runs as several statements, each over a range of keys of one output label (``batches``).

>>> from eindecomp_sql.graph import EinsumNode, Operand, ValueInfo
>>> from eindecomp_sql.notation import parse_agg, parse_join
>>> n = EinsumNode((Operand("A", ("i", "j")), Operand("B", ("j", "k"))), ("i", "k"),
...                (("i", 8), ("j", 8), ("k", 8)), parse_join(None, 2), parse_agg(None),
...                ValueInfo("C", (8, 8), "float32"))
>>> step_costs(n, {"i": 2, "j": 2, "k": 1}, {"A": 256, "B": 256}).join   # A once, B twice
768
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from ..graph import EinsumNode
from .kernel_spec import operand_args, operands_read
from .tiling import ceil_div, pieces_of, tile_of  # noqa: F401 - tile_of/pieces_of are part of this module's face

@dataclass(frozen=True)
class CostModel:
    """What an engine's plans cost: weights of the cost terms (relative to one join byte) and
    the facts its peak-memory rules need.

    ``vector_rows``: how many joined rows one kernel call may receive at once (DuckDB hands a
    UDF a whole vector); ``grouped_holds_all``: whether a grouped step holds every joined tile
    until its group is done (DuckDB's ``list()`` does not spill). The defaults are DuckDB's, the
    engine the product ships with; each backend states its own (``Backend.cost_model``).

    >>> CostModel(retile=1.0).total(Costs(join=100, retile=50))
    150.0
    """

    name: str = "duckdb"
    join: float = 1.0
    group: float = 0.7
    agg: float = 6.0
    retile: float = 3.0
    # what one more statement costs (binding, a TEMP table made and dropped, the kernel call):
    # ~1 ms on DuckDB, in join bytes at the calibrated ~0.4 ns a byte
    statement: float = 2.5e6
    vector_rows: int = 2048
    grouped_holds_all: bool = True
    # the engine holds a statement's distinct input tiles besides the kernels' copies
    # (DuckDB: hash-join build side and scanned blobs; ``engine_bytes``)
    engine_holds_inputs: bool = True
    # a retile of a stored input that re-cuts its leading axis only (``tiling.moves_whole_rows``):
    # None where the engine runs it as any other retile (DuckDB), else its own weight (Spark
    # concatenates byte ranges in SQL, without a kernel)
    row_retile: float | None = None
    # an engine that broadcasts a grouped step's right operand up to this many bytes and
    # repartitions the left one by an output key (Spark, ``repartition_label``) groups only the
    # left operand's bytes there; None: a grouped step groups every joined byte (DuckDB's list())
    broadcast_bytes: int | None = None
    # a grouped step's SQL hands an operand alike in every member of a group to the kernel once
    # per group (``kernel_spec.shared_operands``), so its join and group bytes count it so. Not
    # on Spark: its joined rows, each carrying every tile, are shuffled to their group before
    # the aggregate (the FFN's grouped plan, priced with the discount, was chosen there and ran
    # 1.6x slower than the plan it replaced, with 1.33x the shuffle predicted)
    shares_group_operands: bool = True
    # a grouped step over the budget may run as partial results and a combine step
    # (plan/partials.py); not tried on Spark, whose steps are not held by list() the same way
    splits_reductions: bool = True
    # the result's tiles are consumed inside the kernel that makes them (a top-k fused into its
    # einsum's kernel, ``compile/sql_interface.fuse_topk``), which computes a call's rows a
    # slice at a time (``STREAM_SLICE_BYTES``): a step holds one slice of results, not three
    # copies of a vector's. Only for a plan whose one einsum step is that kernel
    # (``sql_functions``' top-k over a result bigger than the budget)
    streamed_result: bool = False

    @property
    def row_retile_weight(self) -> float:
        return self.retile if self.row_retile is None else self.row_retile

    def total(self, c: "Costs") -> float:
        return (self.join * c.join + self.group * c.group + self.agg * c.agg + self.retile * c.retile
                + self.row_retile_weight * c.row_retile + self.statement * c.statements)


# DuckDB's weights (seconds per byte relative to a join byte), fitted by bench/calibrate.py
# (2048² float32 GEMMs under 23 chunkings and 10 re-tiles). Re-fitted 2026-11-23: four runs put
# aggregation at 3-7x a join byte (it was 1.5) and the grouped-join weight anywhere in 0.2-3.6
# (grouped steps are exactly those that aggregate, so the grid cannot tell them apart); with a
# fixed cost per statement (~1 ms, the floor of one DuckDB statement with a UDF: 2.5 MB of join
# bytes at ~0.4 ns/B), so that heavier aggregation does not buy bytes with extra statements on
# small plans. See docs/DESIGN.md "Cost model re-calibration" and bench/RESULTS.md. The default
# wherever no backend says otherwise.
DEFAULT_COSTS = CostModel()


@dataclass(frozen=True)
class Costs:
    """Bytes per term of the cost model; ``total`` is the weighted sum the optimizer minimizes,
    under ``model``'s weights."""

    join: int = 0
    agg: int = 0
    retile: int = 0
    group: int = 0
    model: CostModel = field(default=DEFAULT_COSTS, compare=False, repr=False)
    statements: int = 0  # statements run (each pays the model's fixed ``statement`` cost)
    row_retile: int = 0  # re-tiled bytes that move as whole rows (``CostModel.row_retile``)

    @property
    def total(self) -> float:
        return self.model.total(self)

    def __add__(self, other: "Costs") -> "Costs":
        return Costs(self.join + other.join, self.agg + other.agg, self.retile + other.retile,
                     self.group + other.group, self.model, self.statements + other.statements,
                     self.row_retile + other.row_retile)


def nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize




def repartition_label(node: EinsumNode, pieces: dict[str, int], operand_bytes: dict[str, int],
                      broadcast_bytes: int | None) -> str | None:
    """The output label whose key a grouped step's left operand is repartitioned by, on an
    engine that broadcasts up to ``broadcast_bytes`` (Spark; None or negative: never), or None:
    two operands, a reduced label cut (a grouped step), the right operand at most
    ``broadcast_bytes`` (so it is broadcast and the left one streams, keeping its partitioning)
    and no bigger than the left one, and an output label of the left operand in several pieces
    (the one in most: the step's parallelism). The joined rows are then partitioned by a group
    key already, and only the left operand is shuffled."""
    if broadcast_bytes is None or broadcast_bytes < 0 or len(node.operands) != 2 or operand_args(node.operands):
        return None
    if not any(pieces[lab] > 1 for lab in node.summed):
        return None
    left, right = (operand_bytes[op.value] for op in node.operands)
    if right > broadcast_bytes or right > left:
        return None
    split = [lab for lab in node.output if lab in node.operands[0].labels and pieces[lab] > 1]
    return max(split, key=lambda lab: pieces[lab], default=None)


def step_costs(node: EinsumNode, pieces: dict[str, int], operand_bytes: dict[str, int],
               agg_dtype: str | None = None, model: CostModel = DEFAULT_COSTS) -> Costs:
    """Join and aggregation bytes of ``node`` cut into ``pieces`` (label -> number of pieces);
    partial results are aggregated in ``agg_dtype`` (default: the result's; a fused step
    aggregates its core's result, before any epilogue changes the dtype). ``model``'s engine
    decides what a grouped step groups (``CostModel.broadcast_bytes``)."""
    red = 1
    for lab in node.summed:  # a kept label's pieces stay apart (a partial result: its keys)
        red *= pieces[lab]
    cut = {lab for lab in node.summed if pieces[lab] > 1}
    join = 0
    for k in operands_read(node.operands):  # a repeated operand is read once
        op = node.operands[k]
        rep = 1
        for lab in node.labels:
            if lab not in op.labels:
                rep *= pieces[lab]
        if cut and model.shares_group_operands and not cut & set(op.labels):
            # the same tile in every member of a group: the step hands it to the kernel once
            # per group (``kernel_spec.shared_operands``), not once per member
            rep //= red
        join += operand_bytes[op.value] * rep
    out = nbytes(node.result.shape, agg_dtype or node.result.dtype)
    group = join if red > 1 else 0
    if group and repartition_label(node, pieces, operand_bytes, model.broadcast_bytes) is not None:
        group = operand_bytes[node.operands[0].value]
    return Costs(join=join, agg=out * (red - 1), group=group, statements=1, model=model)


# the most statements one step is split into to fit a budget: beyond, each statement's fixed
# cost (~1 ms, a scan of its inputs' tables) outweighs what it saves; a budget that needs more
# is refused (a 12000² float32 GEMM under 20 MB asked for 16,384). 256 refused the FFN of
# bench/ooc_bench.py at 4x its budget (its second product needs 1,024 row-panel statements)
MAX_BATCHES = 1024


def batch_labels(node: EinsumNode, pieces: dict[str, int]) -> tuple[str, ...]:
    """The output labels a step's statements split (at most two, the most cut first; ties in
    output order; a partial result's kept labels count as output labels: they are its keys).
    Two, so that a statement reads a bounded share of *every* operand: split along ``i``
    alone, each statement of a GEMM ``ij,jk->ik`` still reads the whole of B."""
    return tuple(sorted(node.keys, key=lambda lab: -pieces[lab])[:2])


def batch_label(node: EinsumNode, pieces: dict[str, int]) -> str | None:
    """The output label a step is split into statements along first (the one cut most)."""
    labs = batch_labels(node, pieces)
    return labs[0] if labs else None


def batch_options(node: EinsumNode, pieces: dict[str, int], model: CostModel | None = None) -> list[int]:
    """The statement counts a step can run as, fewest first: 1..p1 statements over ranges of
    the first batch label's keys (p1 its pieces), then p1 * m (m = 2..p2) over every key of
    the first and m ranges of the second's. One only where ``model``'s results are streamed
    (a top-k's one query)."""
    labs = batch_labels(node, pieces)
    if not labs or (model is not None and model.streamed_result):
        return [1]
    p1 = pieces[labs[0]]
    more = [p1 * m for m in range(2, pieces[labs[1]] + 1)] if len(labs) > 1 else []
    return [b for b in range(1, p1 + 1) if b <= MAX_BATCHES] + [b for b in more if b <= MAX_BATCHES]


def needed_batches(node: EinsumNode, pieces: dict[str, int], operand_dtypes: dict[str, str], budget: int | None,
                   model: "CostModel" = None) -> int:
    """The fewest statements (``batch_options``) ``node`` cut into ``pieces`` runs as under
    ``budget`` (the most there are if none fits: the caller refuses such a chunking)."""
    model = model or DEFAULT_COSTS
    return choose_batches(lambda b: step_peak(node, pieces, operand_dtypes, b, model), batch_options(node, pieces, model),
                          budget)


def batch_grid(node: EinsumNode, pieces: dict[str, int], batches: int) -> tuple[tuple[str, int], ...]:
    """``(label, ranges)`` for each label a step of ``batches`` statements splits: its
    statements are every combination of one key range per label (see ``batch_options``)."""
    labs = batch_labels(node, pieces)
    if batches <= 1 or not labs:
        return ()
    p1 = pieces[labs[0]]
    if batches <= p1 or len(labs) == 1:
        return ((labs[0], min(batches, p1)),)
    return ((labs[0], p1), (labs[1], min(ceil_div(batches, p1), pieces[labs[1]])))


def max_batches(node: EinsumNode, pieces: dict[str, int], model: CostModel | None = None) -> int:
    return batch_options(node, pieces, model)[-1]


def _fraction(pieces_along: int, batches: int) -> float:
    return ceil_div(pieces_along, batches) / pieces_along


def _batch_pieces(node: EinsumNode, pieces: dict[str, int], batches: int) -> dict[str, int]:
    """Pieces of each label that one statement of the step covers (at most)."""
    grid = dict(batch_grid(node, pieces, batches))
    return {lab: ceil_div(pieces[lab], grid.get(lab, 1)) for lab in node.labels}


# what a step holds of each result tile in flight: the kernel's result, DuckDB's vector of it, and
# the table's copy (see step_peak)
OUT_COPIES = 3
# the result bytes a streaming kernel (``CostModel.streamed_result``: udfs/topk.py's fused
# top-k) computes at once, at least one result tile: small tiles go a few at a time, so a call
# of 2048 small rows is not 2048 kernel calls
STREAM_SLICE_BYTES = 2 << 20


def _results_held(model: CostModel, in_flight: int, out_tile: int, held_tile_bytes: int) -> int:
    """What a step's kernels and engine hold of its results while ``in_flight`` joined rows are
    handed over: three copies of each (``OUT_COPIES``) and a fused chain's hidden values; or,
    streamed, one slice of results (and of the hidden values) at a time."""
    if not model.streamed_result:
        return in_flight * (OUT_COPIES * out_tile + held_tile_bytes)
    # (a join's blocks stay counted per call, ``join_block_bytes``: a slice of one row is
    # still cut into tasks on every kernel thread, each with its block)
    return max(1, min(in_flight, STREAM_SLICE_BYTES // max(out_tile, 1))) * (out_tile + held_tile_bytes)


def step_peak(node: EinsumNode, pieces: dict[str, int], operand_dtypes: dict[str, str], batches: int = 1,
              model: CostModel = DEFAULT_COSTS, held_tile_bytes: int = 0, in_place: frozenset = frozenset()) -> int:
    """Projected peak memory of running ``node`` with ``pieces``, in bytes, when the step runs
    as ``batches`` statements (``batch_grid``), on ``model``'s engine: what the kernels hold
    (the rows of one call, their output twice) plus what the engine holds for the statement
    (``engine_bytes``). ``held_tile_bytes``: what a fused kernel holds besides its output, per
    output tile in flight (the values it computes and never stores). ``in_place``: operand
    values the kernels read from the caller's arrays (the SQL hands their tiles as NULL), which
    the engine neither holds nor copies."""
    size = node.size
    tile = {lab: tile_of(size[lab], pieces[lab]) for lab in node.labels}
    held_tile_bytes += held_bytes(node, tile)
    # an operand read in place, or repeating another (read and handed once), adds nothing
    read = operands_read(node.operands)
    op_tile = [0 if op.value in in_place or k not in read else
               math.prod(tile[lab] for lab in op.labels) * np.dtype(operand_dtypes[op.value]).itemsize
               for k, op in enumerate(node.operands)]
    in_tile = sum(op_tile)
    out_tile = math.prod(tile[lab] for lab in node.output) * np.dtype(node.result.dtype).itemsize
    each = _batch_pieces(node, pieces, batches)
    out_tiles = math.prod(each[lab] for lab in node.keys)
    reduced = math.prod(pieces[lab] for lab in node.summed)
    rows = model.vector_rows
    engine = engine_bytes(node, each, op_tile) if model.engine_holds_inputs else 0
    if reduced > 1 and model.grouped_holds_all:
        # every joined row is gathered by the join, held by list() until its group is done,
        # and the group is copied again into Arrow for the kernel (DuckDB's own allocator,
        # under its memory_limit: a statement of 128 MB of distinct tiles in groups of 4 pairs
        # failed at 298 MB; with 3 copies the FFN's grouped step still measured 1.5x its
        # projected run peak, bench/run_peak.py)
        lists = out_tiles * reduced * in_tile * (4 if model.engine_holds_inputs else 1)
        return (engine + lists + _results_held(model, min(out_tiles, rows), out_tile, held_tile_bytes)
                + join_block_bytes(node, tile, min(out_tiles, rows)))
    # each result tile is held three times: the kernel's (Arrow), DuckDB's vector of it and the
    # table's copy it is written into (a 50 MB result tile under memory="200MB", projected at
    # 2x: "could not allocate block of size 47.6 MiB (48.5 MiB/85.8 MiB used)" at commit, a trial)
    # a hash join copies its build side: the statement's tiles are held twice (one tile each
    # is read side by side, no hash table)
    # (nor is a table an operand repeats: it is read alone, not joined with itself; a one-operand
    # step keeps the rule the whole-run peaks were measured under, bench/run_peak.py)
    self_join = len(read) == 1 < len(node.operands)
    joined = 2 * engine if not self_join and any(pieces[lab] > 1 for lab in node.labels) else engine
    # each joined row in flight: its tiles' Arrow copy, its result twice; and rows that share a
    # tile get their own copy of it in the join's output (the model-parallel FFN, four rows
    # sharing a 64 MB tile, measured 1.7x its projected run peak without this, bench/run_peak.py;
    # one-row statements measured within theirs)
    in_flight = min(out_tiles, rows)
    shared = sum(max(in_flight - math.prod(each[lab] for lab in op.labels), 0) * b
                 for op, b in zip(node.operands, op_tile))
    return (joined + in_flight * in_tile + _results_held(model, in_flight, out_tile, held_tile_bytes) + shared
            + join_block_bytes(node, tile, in_flight))


# udfs/kernels.py's blocking of a join that is not a plain product (mul/sum is BLAS or np.einsum,
# which hold no join space): each kernel task materialises a block of the join space of up to
# max(MIN_BLOCK, its largest tile, 8 output tiles) elements, at most BLOCK_ELEMENTS, and one
# output tile's reduction of it, on each of the kernel pool's threads (udfs/pool.py: the CPUs
# this process may use). Uncounted, a 1024² max-plus product's blocks were 32 MB a task that
# no projected peak had (a trial); on 16 cores that is 512 MB.
BLOCK_ELEMENTS = 1 << 22
MIN_BLOCK = 1 << 18
try:
    KERNEL_THREADS = len(os.sched_getaffinity(0))
except AttributeError:  # not on Linux
    KERNEL_THREADS = os.cpu_count() or 1


def join_block_bytes(node: EinsumNode, tile: dict[str, int], rows: int) -> int:
    """What the kernels materialise of a non-product join's space while ``rows`` joined rows
    are in flight (see ``BLOCK_ELEMENTS``); 0 for a plain product or nothing reduced."""
    if not node.reduced or (node.join.name == "mul" and node.agg.name == "sum"):
        return 0
    out = math.prod(tile[lab] for lab in node.output)
    largest = max([out] + [math.prod(tile[lab] for lab in op.labels) for op in node.operands])
    # never under an output tile (the kernel cuts reduced axes only), never over the tile's
    # whole joined space (MIN_BLOCK made a 5-element max 2.1 MB, refused under memory="3MB": a
    # trial), and the accumulator and a block's reduction besides
    space = math.prod(tile[lab] for lab in node.labels)
    block = max(min(BLOCK_ELEMENTS, max(MIN_BLOCK, largest, 8 * out), space), out)
    itemsize = max(np.dtype(node.result.dtype).itemsize, 4)  # float16 blocks reduce in float32
    return min(max(rows, 1), KERNEL_THREADS) * (block + 2 * out) * itemsize


def step_kernel_peak(node: EinsumNode, pieces: dict[str, int], operand_dtypes: dict[str, str],
                     batches: int = 1, model: CostModel = DEFAULT_COSTS, held_tile_bytes: int = 0) -> int:
    """The part of ``step_peak`` the kernels hold outside the engine: the result tiles of one
    call (and a fused kernel's hidden values). The rest is DuckDB's, under its ``memory_limit``:
    the tiles it reads, the Arrow copies it hands a UDF (its allocator makes them: a 64 MiB
    tile into a kernel under a 64 MiB limit failed to allocate), its copy of the result."""
    size = node.size
    out_tile = math.prod(tile_of(size[lab], pieces[lab]) for lab in node.output) * np.dtype(node.result.dtype).itemsize
    each = _batch_pieces(node, pieces, batches)
    out_tiles = math.prod(each[lab] for lab in node.keys)
    tile = {lab: tile_of(size[lab], pieces[lab]) for lab in node.labels}
    held_tile_bytes += held_bytes(node, tile)
    rows = min(out_tiles, model.vector_rows)
    if model.streamed_result:
        return _results_held(model, rows, out_tile, held_tile_bytes) + join_block_bytes(node, tile, rows)
    return rows * (out_tile + held_tile_bytes) + join_block_bytes(node, tile, rows)


def held_bytes(node: EinsumNode, tile: dict[str, int]) -> int:
    """A tile of every value a fused chain's kernel computes and holds (``EinsumNode.held``)."""
    return sum(math.prod(tile[lab] for lab in labels) * np.dtype(dtype).itemsize for labels, dtype in node.held)


def engine_bytes(node: EinsumNode, each: dict[str, int], op_tile: list[int]) -> int:
    """What the engine holds while one statement runs: every distinct input tile the statement
    reads (a hash join's build side, the probe's scanned rows; DuckDB keeps them in its buffer
    manager, under its ``memory_limit``), ``each`` being the pieces of each label one
    statement covers."""
    return sum(b * math.prod(each[lab] for lab in op.labels) for op, b in zip(node.operands, op_tile))


def retile_peak(shape, dtype, target_tile, batches: int = 1, model: CostModel = DEFAULT_COSTS,
                source_tile=None) -> int:
    """Peak of a retile run as ``batches`` statements over ranges of one target key (``retile_axis``):
    the pieces of the batch (held by list()) plus its target tiles in flight, and, when
    ``source_tile`` is known, the source tiles it reads three times (read by the engine, copied
    into the kernel that cuts them, cut into pieces)."""
    return (retile_engine_peak(shape, dtype, target_tile, batches, model, source_tile)
            + retile_kernel_peak(shape, dtype, target_tile, batches, model, source_tile))


def retile_axis(shape, target_tile) -> int:
    """The target key a batched retile's statements split: the one with the most tiles (ties:
    the first). Along the first alone, re-tiling B into column panels (4096, 256) was one
    statement holding all of B, so the budget ruled out the panels a rows-step GEMM wants."""
    grid = [pieces_of(n, t) for n, t in zip(shape, target_tile)]
    return max(range(len(grid)), key=lambda a: grid[a]) if grid else 0


def _retile_parts(shape, dtype, target_tile, batches, model, source_tile):
    """(pieces held by list(), source tiles read, target tiles in flight) of one statement."""
    grid = [pieces_of(n, t) for n, t in zip(shape, target_tile)]
    frac = _fraction(grid[retile_axis(shape, target_tile)], batches)
    in_flight = min(math.ceil(math.prod(grid) * frac), model.vector_rows) * nbytes(target_tile, dtype)
    held = math.ceil(nbytes(shape, dtype) * frac) if model.grouped_holds_all else nbytes(target_tile, dtype)
    # the source tiles overlapping the batch: its share, plus a tile's overhang at its edges
    read = held + nbytes(source_tile, dtype) if source_tile is not None and model.engine_holds_inputs else 0
    return held, read, in_flight


def retile_engine_peak(shape, dtype, target_tile, batches: int = 1, model: CostModel = DEFAULT_COSTS,
                       source_tile=None) -> int:
    """The part of ``retile_peak`` the engine holds: the batch's pieces in ``list()``, the
    source tiles it reads and their Arrow copy for the kernel, the target tiles it stores."""
    if not shape:
        return nbytes(shape, dtype)
    held, read, in_flight = _retile_parts(shape, dtype, target_tile, batches, model, source_tile)
    return held + 2 * read + in_flight


def retile_kernel_peak(shape, dtype, target_tile, batches: int = 1, model: CostModel = DEFAULT_COSTS,
                       source_tile=None) -> int:
    """The part of ``retile_peak`` the kernels hold: the source tiles' pieces, target tiles."""
    if not shape:
        return nbytes(shape, dtype)
    _, read, in_flight = _retile_parts(shape, dtype, target_tile, batches, model, source_tile)
    return read + in_flight


def retile_max_batches(shape, target_tile, model: CostModel | None = None) -> int:
    if not shape or (model is not None and model.streamed_result):  # (one query: one statement)
        return 1
    a = retile_axis(shape, target_tile)
    return pieces_of(shape[a], target_tile[a])


def choose_batches(peak, most, budget: int | None) -> int:
    """The fewest statements whose projected ``peak(batches)`` fits ``budget``: among
    ``most`` (a list of statement counts, fewest first, as ``batch_options`` gives) or 1..most."""
    if budget is None:
        return 1
    options = range(1, most + 1) if isinstance(most, int) else most
    for b in options:
        if peak(b) <= budget:
            return b
    return options[-1]


# The share of a session's memory budget its plans and DuckDB's memory_limit divide; the rest
# is for what no model here counts (DuckDB's memory outside its buffer manager, allocators'
# retained pages, Arrow's buffer growth). Measured: with the whole budget shared out, a 4096²
# float64 GEMM under 100 MB grew the process by ~200 MB, and an 8192² float32 one under 201 MB
# by ~350 MB (bench/ooc_bench.py), twice what the plans and DuckDB's limit allowed.
BUDGET_SHARE = 0.6


def plan_share(memory: int | None) -> int | None:
    """What plans under a memory budget may project: its ``BUDGET_SHARE`` (None: no budget).
    Sessions, jobs and the DuckDB backend's ``memory_limit`` all split a budget by this."""
    return None if memory is None else int(memory * BUDGET_SHARE)


# under a budget, DuckDB keeps at least this much whatever the kernels take: its catalog, a
# statement's hash tables and the blocks it is reading
MIN_ENGINE_BYTES = 64 << 20
# DuckDB's memory_limit while a plan runs gets this share of the budget on top of what the
# plan's steps project for it, out of the budget's unplanned part: room for what DuckDB holds
# beyond the projection (its vectors' and aggregates' own copies). Without it a retile of 64 MB
# in 4 batches on a file database under memory="200MB" failed in 8 of 9 runs: projected at
# 66 MB for DuckDB, it needed 86-89 MiB against a limit of 85.4 MB (docs/DESIGN.md, "Bounded
# memory"); with 8 MiB more it ran, the process rising 114 MB
ENGINE_MARGIN = 0.1


def engine_limit(memory: int | None, plan) -> int | None:
    """DuckDB's ``memory_limit`` while ``plan`` runs in a session of ``memory=`` (None: none):
    the plans' share less what the kernels hold, never less than what the plan's steps need
    DuckDB to hold (a plan made under a budget of its own, ``g.plan(memory=)``), nor than
    ``MIN_ENGINE_BYTES``; and ``ENGINE_MARGIN`` on top, for what DuckDB holds beyond the
    projection. Also what a plan's whole-run projection caps DuckDB's share at (``run_peak``)."""
    if memory is None:
        return None
    return max(plan_share(memory) - plan.kernel_bytes, plan.engine_bytes, MIN_ENGINE_BYTES) + int(memory * ENGINE_MARGIN)


def rounded_up(nbytes: float) -> str:
    """``nbytes`` as memory= takes it, rounded up to a tenth of its unit (never below it)."""
    for unit, name in ((10**9, "GB"), (10**6, "MB"), (10**3, "kB")):
        if nbytes >= unit:
            return f"{math.ceil(nbytes / unit * 10) / 10:g} {name}"
    return f"{math.ceil(nbytes)} B"


def in_memory_terms(e, memory: int | None, whose: str):
    """A planner's refusal for want of memory (``e.needed``: the plans' budget it needs), said
    in the ``memory=`` given, whose plans' share the planner had ("the memory budget of 6.0 MB"
    under memory="10MB" left a trial guessing what to pass); None where it is no such refusal."""
    from .steps import format_bytes

    needed = getattr(e, "needed", None)
    if needed is not None and hasattr(e, "needed_by_all"):
        needed = e.needed_by_all()  # every node's need (plan/optimize.py's _refuse)
    if needed is None or memory is None:
        return None
    return type(e)(f"{e}: {whose} memory={format_bytes(memory)} gives plans {BUDGET_SHARE:.0%} of it "
                   f"({format_bytes(plan_share(memory))}); this needs memory= of at least "
                   f"{rounded_up(needed / BUDGET_SHARE)}")


def parse_memory(memory, what: str = "memory budget") -> int | None:
    """``"2GB"``, ``"512MiB"``, ``1 << 30`` -> bytes; None -> no budget. A budget is a positive,
    finite, whole number of bytes: anything else is an EinsumError naming ``what``, never a
    ValueError or OverflowError."""
    from ..errors import EinsumError

    if memory is None:
        return None
    bad = EinsumError(f"{what} {memory!r}: write a positive whole number of bytes or a size such as '2GB' "
                      "or '512MiB'")
    if isinstance(memory, bool):
        raise bad
    if isinstance(memory, (int, float, np.integer, np.floating)):
        num, unit = float(memory), ""
    elif isinstance(memory, str):
        # a space between the number and its unit, none inside either: "1 2 GB" was read as 12 GB
        m = re.fullmatch(r"\s*([^\s]+?)\s*([A-Za-z]*)\s*", memory)
        if m is None:
            raise bad
        num_text, unit = m.group(1), m.group(2).upper()
        try:
            num = float(num_text)
        except ValueError:
            raise bad from None
    else:
        raise bad
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if unit not in units or not math.isfinite(num) or num * units[unit] < 1 or not math.isfinite(num * units[unit]):
        raise bad
    if units[unit] == 1 and num != int(num):  # 1.5 bytes: a typo, not a size
        raise bad
    size = int(memory) if isinstance(memory, (int, np.integer)) else int(num * units[unit])
    if size > 2**63 - 1:  # DuckDB's parser refuses more (its own ParserException)
        raise EinsumError(f"{what} {memory!r} is larger than any machine's memory (at most 2**63 - 1 bytes)")
    return size
