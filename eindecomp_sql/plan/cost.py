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
from dataclasses import dataclass, field

import numpy as np

from ..graph import EinsumNode
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

    def total(self, c: "Costs") -> float:
        return (self.join * c.join + self.group * c.group + self.agg * c.agg + self.retile * c.retile
                + self.statement * c.statements)


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

    @property
    def total(self) -> float:
        return self.model.total(self)

    def __add__(self, other: "Costs") -> "Costs":
        return Costs(self.join + other.join, self.agg + other.agg, self.retile + other.retile,
                     self.group + other.group, self.model, self.statements + other.statements)


def nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize




def step_costs(node: EinsumNode, pieces: dict[str, int], operand_bytes: dict[str, int],
               agg_dtype: str | None = None) -> Costs:
    """Join and aggregation bytes of ``node`` cut into ``pieces`` (label -> number of pieces);
    partial results are aggregated in ``agg_dtype`` (default: the result's; a fused step
    aggregates its core's result, before any epilogue changes the dtype)."""
    join = 0
    for op in node.operands:
        rep = 1
        for lab in node.labels:
            if lab not in op.labels:
                rep *= pieces[lab]
        join += operand_bytes[op.value] * rep
    red = 1
    for lab in node.reduced:
        red *= pieces[lab]
    out = nbytes(node.result.shape, agg_dtype or node.result.dtype)
    return Costs(join=join, agg=out * (red - 1), group=join if red > 1 else 0, statements=1)


def batch_label(node: EinsumNode, pieces: dict[str, int]) -> str | None:
    """The output label a step is split into statements along (the one cut most)."""
    if not node.output:
        return None
    return max(node.output, key=lambda lab: pieces[lab])


def max_batches(node: EinsumNode, pieces: dict[str, int]) -> int:
    lab = batch_label(node, pieces)
    return pieces[lab] if lab is not None else 1


def _fraction(pieces_along: int, batches: int) -> float:
    return ceil_div(pieces_along, batches) / pieces_along


def step_peak(node: EinsumNode, pieces: dict[str, int], operand_dtypes: dict[str, str], batches: int = 1,
              model: CostModel = DEFAULT_COSTS, held_tile_bytes: int = 0) -> int:
    """Projected peak memory of running ``node`` with ``pieces``, in bytes, when the step runs
    as ``batches`` statements over ranges of its batch label's keys, on ``model``'s engine.
    ``held_tile_bytes``: what a fused kernel holds besides its output, per output tile in
    flight (the values it computes and never stores)."""
    size = node.size
    tile = {lab: tile_of(size[lab], pieces[lab]) for lab in node.labels}
    in_tile = sum(
        math.prod(tile[lab] for lab in op.labels) * np.dtype(operand_dtypes[op.value]).itemsize for op in node.operands
    )
    out_tile = math.prod(tile[lab] for lab in node.output) * np.dtype(node.result.dtype).itemsize
    lab = batch_label(node, pieces)
    frac = _fraction(pieces[lab], batches) if lab is not None else 1.0
    out_tiles = math.ceil(math.prod(pieces[lab] for lab in node.output) * frac)
    reduced = math.prod(pieces[lab] for lab in node.reduced)
    rows = model.vector_rows
    if reduced > 1 and model.grouped_holds_all:  # every joined row is held by list() until its group is done
        return out_tiles * reduced * in_tile + min(out_tiles, rows) * (2 * out_tile + held_tile_bytes)
    return min(out_tiles, rows) * (in_tile + 2 * out_tile + held_tile_bytes)


def retile_peak(shape, dtype, target_tile, batches: int = 1, model: CostModel = DEFAULT_COSTS) -> int:
    """Peak of a retile run as ``batches`` statements over ranges of the first target key:
    the pieces of the batch (held by list()) plus its target tiles in flight."""
    if not shape:
        return 2 * nbytes(shape, dtype)
    grid = [pieces_of(n, t) for n, t in zip(shape, target_tile)]
    frac = _fraction(grid[0], batches)
    targets = math.ceil(math.prod(grid) * frac)
    held = math.ceil(nbytes(shape, dtype) * frac) if model.grouped_holds_all else nbytes(target_tile, dtype)
    return held + min(targets, model.vector_rows) * 2 * nbytes(target_tile, dtype)


def retile_max_batches(shape, target_tile) -> int:
    return pieces_of(shape[0], target_tile[0]) if shape else 1


def choose_batches(peak, most: int, budget: int | None) -> int:
    """The fewest statements (1..most) whose projected ``peak(batches)`` fits ``budget``."""
    if budget is None:
        return 1
    for b in range(1, most + 1):
        if peak(b) <= budget:
            return b
    return most


def parse_memory(memory) -> int | None:
    """``"2GB"``, ``"512MiB"``, ``1 << 30`` -> bytes; None -> no budget. A budget is a positive,
    finite number of bytes: anything else is an EinsumError, never a ValueError or OverflowError."""
    from ..errors import EinsumError

    if memory is None:
        return None
    bad = EinsumError(f"memory budget {memory!r}: write a positive number of bytes or a size such as '2GB' "
                      "or '512MiB'")
    if isinstance(memory, bool):
        raise bad
    if isinstance(memory, (int, float, np.integer, np.floating)):
        num, unit = float(memory), ""
    elif isinstance(memory, str):
        text = memory.strip().replace(" ", "")
        num_text = text.rstrip("BbKkMmGgTtIi")
        unit = text[len(num_text):].upper()
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
    return int(num * units[unit])
