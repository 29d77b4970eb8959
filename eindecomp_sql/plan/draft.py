"""What the planning passes hand each other: a ``Draft`` of a plan, and the options it is made under.

A draft starts as nodes over input values (some cut already, some free) and the names of the
values to keep; every pass in ``pipeline.PASSES`` returns a new draft with one more decision
made, and ``Draft.plan()`` is the finished ``Plan``.

>>> d = example("ij,jk->ik", (8, 6), (6, 5))
>>> [v.name for v in d.inputs], d.outputs
(['A', 'B'], ('_eds_result',))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..graph import EinsumNode
from .cost import DEFAULT_COSTS, CostModel
from .optimize import Choice
from .steps import Plan, Step, TiledValue, step_target

FUSE_MODES = (True, False, "elementwise")


@dataclass(frozen=True)
class Options:
    """The knobs a plan is made under: join tasks per step (``workers``), the memory budget in
    bytes (None: none), the largest tile a plan creates (``tile_bytes``; None: no cap), how
    chunkings are chosen (``strategy``: the optimizer or a baseline), the engine's cost
    model (``costs``: weights and peak rules; the backend's) and what fuses (``fuse``)."""

    workers: int = 1
    budget: int | None = None
    tile_bytes: int | None = None
    strategy: str = "eindecomp"
    costs: CostModel = DEFAULT_COSTS
    # element-wise nodes run inside the einsum steps next to them (passes/fuse.py), and steps over
    # single tiles as programs (passes/program.py); "elementwise": only the first; False: neither
    fuse: bool | str = True
    # the optimizer prices an element-wise node as the epilogue it can be (plan/optimize.py);
    # graph_plan also plans without, and keeps the cheaper: the fuse pass may still refuse
    price_epilogues: bool = True
    # a contraction feeding another through element-wise nodes runs inside its step
    # (passes/chains.py); graph_plan plans with and without, and keeps the cheaper
    chains: bool = False
    # the budget the optimizer chooses chunkings under where it is lower than ``budget`` (the
    # other passes and the final check keep ``budget``): ``run_passes``' retry, for a plan whose
    # re-tiles the optimizer under-priced
    chunking_budget: int | None = None


@dataclass(frozen=True)
class Draft:
    """A plan being made. ``nodes`` still to run as einsum steps (dependency order),
    ``inputs`` (tile None: free, the plan chooses), ``outputs`` the names of the values to keep;
    ``choice`` the chunking of every node once chosen; ``steps`` what runs, so far."""

    nodes: tuple[EinsumNode, ...]
    inputs: tuple[TiledValue, ...]
    outputs: tuple[str, ...]
    options: Options = field(default_factory=Options)
    choice: Choice | None = None
    steps: tuple[Step, ...] = ()
    chains: tuple = ()  # the fused chains among ``nodes`` (passes/chains.py: Chain)

    def values(self) -> dict[str, TiledValue]:
        """Every value known so far by name: the inputs, then what the steps compute."""
        out = {v.name: v for v in self.inputs}
        out.update((step_target(s).name, step_target(s)) for s in self.steps)
        return out

    def plan(self) -> Plan:
        values = self.values()
        return Plan(self.steps, self.inputs, tuple(values[name] for name in self.outputs), self.options.costs)


def example(spec: str, *shapes, dtype: str = "float64", **options) -> Draft:
    """A draft for one einsum over free operands named A, B, ... (for examples and tests)."""
    from ..graph import ValueInfo, lower_einsum
    from ..notation import parse_agg, parse_join, parse_spec

    parsed = parse_spec(spec, [tuple(s) for s in shapes])
    infos = [ValueInfo(chr(65 + k), tuple(s), dtype) for k, s in enumerate(shapes)]
    nodes = lower_einsum(parsed, infos, parse_join(None, len(shapes)), parse_agg(None), "_eds_result")
    inputs = tuple(TiledValue(v.name, v.shape, v.dtype, None, tuple(f"d{p}" for p in range(len(v.shape))))
                   for v in infos)
    return Draft(tuple(nodes), inputs, ("_eds_result",), Options(**options))
