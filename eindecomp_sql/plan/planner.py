"""Choose the chunking of every node and insert the re-tiles it needs.

The rule here is the simple one: every label takes the largest tile size any of its operands
already has (fewest pieces, so the least replication in the join, which is what costs on this
engine: see docs/DESIGN.md), and an operand cut differently is re-tiled to match. Producers'
outputs are cut the way their node was, so a chain of nodes re-tiles only where an operand
was stored differently.

"""

from __future__ import annotations

from ..graph import EinsumNode
from .steps import EinsumStep, Plan, RetileStep, Step, TiledValue


def _choose_chunk(node: EinsumNode, values: dict[str, TiledValue]) -> dict[str, int]:
    size = node.size
    tile: dict[str, int] = {}
    for op in node.operands:
        v = values[op.value]
        kept = [t for ax, t in enumerate(v.tile) if ax not in op.dropped]
        for lab, t in zip(op.labels, kept):
            tile[lab] = max(tile.get(lab, 0), t)
    for lab in node.output:
        tile.setdefault(lab, size[lab])  # a label only in the output: a broadcast, one piece
    return {lab: min(t, size[lab]) for lab, t in tile.items()}


def plan_nodes(
    nodes: list[EinsumNode],
    inputs: dict[str, TiledValue],
    result_table: str | None,
    result_keys: tuple[str, ...] | None = None,
) -> Plan:
    """A plan for ``nodes`` (in dependency order) reading the tiled ``inputs``.

    The last node's result goes to ``result_table`` (None: returned as rows), with key
    columns ``result_keys`` (default: the output labels).
    """
    values = dict(inputs)
    steps: list[Step] = []
    n_temp = 0

    def temp_name() -> str:
        nonlocal n_temp
        n_temp += 1
        return f"_eds_s{n_temp}"

    for k, node in enumerate(nodes):
        last = k == len(nodes) - 1
        chunk = _choose_chunk(node, values)
        step_inputs = []
        for op in node.operands:
            v = values[op.value]
            kept_axes = [ax for ax in range(len(v.shape)) if ax not in op.dropped]
            want = list(v.tile)
            for ax, lab in zip(kept_axes, op.labels):
                want[ax] = chunk[lab]
            want_t = tuple(want)
            if want_t != v.tile:
                name = temp_name()
                target = TiledValue(name, v.shape, v.dtype, want_t, v.keys, name, temporary=True)
                steps.append(RetileStep(v, target))
                v = target
            step_inputs.append(v)
        res = node.result
        out_tile = tuple(chunk[lab] for lab in node.output)
        if last:
            keys = result_keys or tuple(node.output)
            result = TiledValue(res.name, res.shape, res.dtype, out_tile, keys, result_table)
        else:
            table = temp_name()
            result = TiledValue(res.name, res.shape, res.dtype, out_tile, tuple(node.output), table, temporary=True)
        values[res.name] = result
        steps.append(EinsumStep(node, tuple(step_inputs), result, tuple(sorted(chunk.items()))))
    return Plan(tuple(steps), tuple(inputs.values()), values[nodes[-1].result.name])
