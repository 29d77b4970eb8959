"""Two-step reductions: a grouped step as partial results, then a combine step over them.

A grouped step (a reduced label cut into pieces) hands the kernel every joined tile of a group
at once, and DuckDB's ``list()`` holds the group whole (``cost.step_peak``): a reduction to a
small output (``ij->``, ``ij,ij->``, ``ij->i`` of a wide matrix) is one group of about the
whole input, so under a memory budget below that no chunking fitted (a 256 MB ``ij->`` under
``memory="100MB"`` was refused). Run as two steps instead:

- a *partial* step: a row step of the same node whose result keeps the cut reduced labels'
  pieces apart (``EinsumNode.kept``): one tile per output tile and piece of them, each the
  aggregation over that piece only. Its statements can be batched over the kept labels'
  keys, so they read a bounded share of the inputs;
- a *combine* step: the partial tiles of each output tile aggregated with the node's
  aggregation (a grouped step over tiles of the output's size).

Partial tiles are in the dtype the kernels combine a group's members in (``product_dtype``:
float32 for float16 and bfloat16 results), so the result is rounded once, as in one step.

>>> from eindecomp_sql.plan.draft import example
>>> from eindecomp_sql.plan.pipeline import run_passes
>>> d = example("ij->", (4096, 4096), dtype="float32", budget=60_000_000)
>>> [s.describe() for s in run_passes(d).plan().steps]  # doctest: +NORMALIZE_WHITESPACE
['einsum ij-> partial over j [i:1 j:4] in 4 batches over j:4 -> _eds_partial1',
 'einsum j-> [j:4] -> _eds_result']
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ..graph import EinsumNode, Operand, ValueInfo
from ..notation import parse_join
from ..notation.numpy_impl import product_dtype
from .cost import CostModel, Costs, max_batches, nbytes, needed_batches, step_costs, step_peak
from .kernel_spec import operands_read


def cut_reduced(node: EinsumNode, pieces: dict[str, int]) -> tuple[str, ...]:
    """The reduced labels cut into more than one piece (what makes a step grouped)."""
    return tuple(lab for lab in node.reduced if pieces[lab] > 1)


def can_split(node: EinsumNode, pieces: dict[str, int], model: CostModel) -> bool:
    """Whether ``node`` cut into ``pieces`` can run as partial and combine steps on ``model``'s
    engine: a grouped step, no fused chain (its kernel holds a producer's tiles per output
    tile, and its reduction is not the last thing it computes), not a partial step itself."""
    return model.splits_reductions and not node.held and not node.kept and bool(cut_reduced(node, pieces))


def partial_dtype(node: EinsumNode) -> str:
    """What partial tiles are computed in: the dtype a group's members combine in."""
    return _product_name(node.result.dtype)


@lru_cache(maxsize=64)
def _product_name(dtype: str) -> str:
    return product_dtype(dtype).name


def split_nodes(node: EinsumNode, pieces: dict[str, int], partial: str) -> tuple[EinsumNode, EinsumNode, dict[str, int]]:
    """The partial node (its result named ``partial``), the combine node, and the combine
    node's pieces (the output's, and the kept labels' pieces, each of extent 1)."""
    kept = cut_reduced(node, pieces)
    size = node.size
    dtype = partial_dtype(node)
    shape = tuple(size[lab] for lab in node.output) + tuple(pieces[lab] for lab in kept)
    first = replace(node, kept=kept, result=ValueInfo(partial, shape, dtype))
    # the kept labels name the partial tiles' extra axes (size: their pieces, one per key)
    sizes = tuple(sorted([(lab, size[lab]) for lab in node.output] + [(lab, pieces[lab]) for lab in kept]))
    combine = EinsumNode((Operand(partial, node.output + kept),), node.output, sizes, parse_join(None, 1),
                         node.agg, node.result)
    combine_pieces = {lab: pieces[lab] for lab in node.output + kept}
    return first, combine, combine_pieces


def split_peak(node: EinsumNode, pieces: dict[str, int], dtypes: dict[str, str], model: CostModel) -> int:
    """The projected peak of the two steps, each in as many statements as it may have."""
    first, combine, cp = split_nodes(node, pieces, "_eds_partial")
    return max(step_peak(first, pieces, dtypes, max_batches(first, pieces, model), model),
               step_peak(combine, cp, {"_eds_partial": first.result.dtype}, max_batches(combine, cp, model), model))


def split_costs(node: EinsumNode, pieces: dict[str, int], operand_bytes: dict[str, int], model: CostModel) -> Costs:
    """The cost terms of the two steps (their statements aside): the partial step joins what
    the grouped step would, and groups nothing; the combine step joins and groups the partial
    tiles and aggregates them."""
    first, combine, cp = split_nodes(node, pieces, "_eds_partial")
    made = nbytes(first.result.shape, first.result.dtype)
    return (step_costs(first, pieces, operand_bytes, model=model)
            + step_costs(combine, cp, {"_eds_partial": made}, model=model))


def split_statements(node: EinsumNode, pieces: dict[str, int], dtypes: dict[str, str], budget: int | None,
                     model: CostModel) -> int:
    """Statements the two steps run as under ``budget``."""
    first, combine, cp = split_nodes(node, pieces, "_eds_partial")
    return (needed_batches(first, pieces, dtypes, budget, model)
            + needed_batches(combine, cp, {"_eds_partial": first.result.dtype}, budget, model))


# a split is a candidate beside the steps that fit as one only for a reduction to a small
# output: partial tiles of at most this share of the bytes the step joins and of the budget (a
# GEMM's partials, a full output per piece of its reduced label, are not: an FFN's second
# product split so under 128 MB took a chunking whose re-tile of the intermediate was over it)
SMALL_PARTIALS = 1 / 16


def small_partials(node: EinsumNode, pieces: dict[str, int], operand_bytes: dict[str, int], budget: int) -> bool:
    """Whether ``node``'s partial results would be small against the bytes its step joins and
    against ``budget``."""
    first, _, _ = split_nodes(node, pieces, "_eds_partial")
    made = nbytes(first.result.shape, first.result.dtype)
    return made <= step_costs(first, pieces, operand_bytes).join * SMALL_PARTIALS and made <= budget * SMALL_PARTIALS


def splits(node: EinsumNode, pieces: dict[str, int], dtypes: dict[str, str], budget: int | None,
           model: CostModel, operand_bytes: dict[str, int] | None = None) -> bool:
    """Whether the planner runs ``node`` cut into ``pieces`` as two steps: it can, and its
    grouped step does not fit the budget in any number of statements, or (``operand_bytes``
    given) its partials are small and the two steps cost less (``cheaper_split``)."""
    if not can_split(node, pieces, model):
        return False
    if budget is not None and step_peak(node, pieces, dtypes, max_batches(node, pieces, model), model) > budget:
        return True
    return operand_bytes is not None and cheaper_split(node, pieces, operand_bytes, model) and (
        budget is None or split_peak(node, pieces, dtypes, model) <= budget)


def cheaper_split(node: EinsumNode, pieces: dict[str, int], operand_bytes: dict[str, int], model: CostModel) -> bool:
    """Whether two steps cost less than the grouped one, for a reduction to a small output
    (partials at most ``SMALL_PARTIALS`` of the bytes joined): the grouped step gathers every
    member of a group into one list, the partial step hands each tile to the kernel once.
    ``ij,ij->j`` of a 614 MB matrix in 49 tiles, no budget: one group of 49, 2.8 s and +1.9 GB
    of resident memory (bench/repeat_bench.py)."""
    # the optimizer prices the same node and chunking again in each of its passes: making the
    # two nodes for each of ~1,400 prices took the 11-node attention graph's cold planning from
    # ~14 to ~100 ms at workers 4 (a documentation audit); cached, ~55 ms
    read = tuple(operand_bytes[node.operands[k].value] for k in operands_read(node.operands))
    return _cheaper(node, tuple(sorted(pieces.items())), read, model)


@lru_cache(maxsize=4096)
def _cheaper(node: EinsumNode, pieces: tuple, read: tuple, model: CostModel) -> bool:
    pieces = dict(pieces)
    operand_bytes = {node.operands[k].value: b for k, b in zip(operands_read(node.operands), read)}
    first, _, _ = split_nodes(node, pieces, "_eds_partial")
    made = nbytes(first.result.shape, first.result.dtype)
    if made > step_costs(first, pieces, operand_bytes).join * SMALL_PARTIALS:
        return False
    two = split_costs(node, pieces, operand_bytes, model)
    return two.total < step_costs(node, pieces, operand_bytes, model=model).total
