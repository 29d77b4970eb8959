"""Plan: tilings, chunk choices and the frozen list of steps the compiler turns into SQL.

Pure: sees labels, sizes, dtypes and tile shapes, never data, a table or a connection. Single
einsums and graphs go through one pipeline of passes (``pipeline.PASSES``).
"""

from .einsum import plan_einsum
from .steps import EinsumStep, FillStep, Plan, ProgramStep, RetileStep, Step, TiledValue
from .tiling import DEFAULT_TILE_BYTES, auto_tile, check_tile, grid

__all__ = [
    "DEFAULT_TILE_BYTES",
    "EinsumStep",
    "FillStep",
    "Plan",
    "ProgramStep",
    "RetileStep",
    "Step",
    "TiledValue",
    "auto_tile",
    "check_tile",
    "grid",
    "plan_einsum",
]
