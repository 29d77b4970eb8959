"""Turn chosen chunkings into steps: einsum steps, and the re-tiles where a value is cut
differently from what its consumer needs.

"""

from __future__ import annotations

from dataclasses import replace

from ..graph import EinsumNode
from .cost import choose_batches, max_batches, retile_max_batches, retile_peak, step_peak
from .steps import EinsumStep, Plan, RetileStep, Step, TiledValue, key_names


def plan_nodes(
    nodes: list[EinsumNode],
    inputs: dict[str, TiledValue],
    chunks: dict[str, dict[str, int]],
    outputs: dict[str, TiledValue],
    budget: int | None = None,
) -> Plan:
    """A plan for ``nodes`` (dependency order) over the tiled ``inputs``.

    ``chunks`` gives each node (by result name) the tile size of every label. ``outputs`` maps
    the values to keep to their target (table, keys; the tile is filled in here); every other
    node result is a scratch table dropped when the plan finishes. A step whose projected peak
    exceeds ``budget`` bytes is split into the fewest statements that fit.
    """
    values = dict(inputs)
    steps: list[Step] = []
    n_temp = 0

    def temp_name() -> str:
        nonlocal n_temp
        n_temp += 1
        return f"_eds_s{n_temp}"

    for node in nodes:
        chunk = chunks[node.result.name]
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
                target = TiledValue(name, v.shape, v.dtype, want_t, v.keys, name, temporary=True, scratch=True)
                b = choose_batches(lambda k: retile_peak(v.shape, v.dtype, want_t, k),
                                   retile_max_batches(v.shape, want_t), budget)
                steps.append(RetileStep(v, target, b))
                v = target
            step_inputs.append(v)
        res = node.result
        out_tile = tuple(chunk[lab] for lab in node.output)
        if res.name in outputs:
            o = outputs[res.name]
            result = TiledValue(res.name, res.shape, res.dtype, out_tile, o.keys, o.table, temporary=o.temporary)
        else:
            table = temp_name()
            # key_names: labels that differ only in case (i, I) are one column name to DuckDB
            result = TiledValue(res.name, res.shape, res.dtype, out_tile, key_names(node.output), table,
                                temporary=True, scratch=True)
        values[res.name] = result
        step = EinsumStep(node, tuple(step_inputs), result, tuple(sorted(chunk.items())))
        if budget is not None:
            pieces = step.pieces
            dtypes = {op.value: v.dtype for op, v in zip(node.operands, step_inputs)}
            b = choose_batches(lambda k: step_peak(node, pieces, dtypes, k), max_batches(node, pieces), budget)
            step = replace(step, batches=b)
        steps.append(step)
    return Plan(tuple(steps), tuple(inputs.values()), tuple(values[name] for name in outputs))
