"""The interface every backend implements: exactly what the session calls.

A backend owns an engine (a DuckDB connection, numpy arrays in memory, ...): a catalog of
stored tensors, the tile kernels, and ``execute``, which binds a plan's values to storage and
runs its steps. Plans name values, never tables; ``execute`` gets the binding:

- ``inputs``: value name -> a stored tensor's name, or a numpy array the backend cuts the way
  the plan's input says;
- ``outputs``: value name -> ``Target``: a table (kept, and entered in the catalog; or
  ``temporary``, which the session drops with ``drop_table`` when the result's Tensor goes), or
  ``Target()`` with no table: the value comes back from ``execute`` as a numpy array.

Every other value the steps compute is scratch, gone when ``execute`` returns. A failed or
interrupted ``execute`` leaves nothing written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ..plan import Plan, TiledValue
from ..plan.cost import CostModel


def stored_as_wanted(found: tuple[TiledValue, Any] | None, name: str, want: TiledValue, what: str):
    """What a backend holds for stored tensor ``name`` (``found``: its value and its data, or
    None), which must be cut as ``want`` says (the plan was made for that cut); its data."""
    from ..errors import EinsumError

    if found is None:
        raise EinsumError(f"tensor {name!r} no longer exists in this database (dropped, or replaced by another "
                          "session)")
    stored, data = found
    if (stored.shape, stored.dtype, stored.tile) != (want.shape, want.dtype, want.tile):
        raise EinsumError(f"{what} {stored.shape} {stored.dtype} in tiles {stored.tile}, but "
                          f"{want.shape} {want.dtype} in tiles {want.tile} is wanted")
    return data


def array_as_wanted(v: TiledValue, x) -> np.ndarray:
    """An array bound to plan input ``v``: its shape and dtype (any byte order) must be the plan's."""
    from ..errors import EinsumError

    a = np.asarray(x)
    if a.shape != v.shape or a.dtype.newbyteorder("=") != np.dtype(v.dtype):
        raise EinsumError(f"input {v.name!r}: the plan reads {v.shape} {v.dtype}, got an array {a.shape} {a.dtype}")
    return a


@dataclass(frozen=True)
class Target:
    """Where a plan output goes: ``table`` (None: returned as an array), ``temporary`` (a
    session-lived table, not in the catalog)."""

    table: str | None = None
    temporary: bool = False


class Backend(Protocol):
    name: str  # what create_backend() knows it by
    lock: Any  # an RLock: one session call at a time sees the engine
    con: Any  # the DuckDB connection for the SQL interface and DuckDB sources; None without one
    compiler: Any  # how its plans become SQL (the SQL interface's queries too); None for an engine without SQL
    cost_model: CostModel  # what plans cost on this engine: the planner optimizes under it
    streams_in: bool  # store_tiles also takes a pa.RecordBatchReader or an io.ParquetRows it reads itself

    @property
    def closed(self) -> bool: ...

    def execute(self, plan: Plan, inputs: Mapping[str, str | np.ndarray], outputs: Mapping[str, Target],
                replace: bool = False, progress: Callable | None = None) -> dict[str, np.ndarray]:
        """Run every step of ``plan``; return the outputs bound to no table, as arrays."""

    def store_tiles(self, value: TiledValue, tiles, replace: bool = False) -> None:
        """Store tiles (a pyarrow Table: key columns + ``tile``; where ``streams_in``, also a
        RecordBatchReader or an ``io.ParquetRows``) as tensor ``value.name``, all or nothing."""

    def lookup(self, name: str) -> TiledValue | None:
        """A stored tensor (named after its table; names compare case-insensitively)."""

    def names(self) -> list[str]: ...

    def read_tiles(self, value: TiledValue):
        """The tiles of stored tensor ``value.name``, as a pyarrow Table."""

    def tile_batches(self, value: TiledValue, batch_bytes: int):
        """A context manager giving an iterator of record batches of ``value.name``'s tiles, of
        about ``batch_bytes`` each where the engine streams (else its whole table)."""

    def set_memory(self, budget: int | None) -> None:
        """Hold the engine to the session's memory budget, in bytes (DuckDB: its
        ``memory_limit`` and a spill folder); engines without a limit of their own do nothing."""

    def drop(self, name: str) -> None:
        """Drop a stored tensor and its catalog entry."""

    def drop_table(self, name: str) -> None:
        """Drop a temporary result, if it still exists."""

    def recover(self) -> None:
        """At the start of each session call: undo what an earlier call, cut short by a signal
        handler's error between two of its statements, left behind (an open transaction)."""

    def register_sql_interface(self, einsum_sql: Callable[..., str]) -> None:
        """Offer ``SELECT * FROM einsum(...)`` (backends without SQL do nothing)."""

    def close(self) -> None: ...
