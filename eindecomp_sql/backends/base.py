"""The interface every backend implements: a name, a catalog of tiled tables, and execute()."""

from __future__ import annotations

from typing import Protocol

import pyarrow as pa

from ..plan import Plan, TiledValue


class Backend(Protocol):
    name: str

    def execute(self, plan: Plan, replace: bool = False) -> pa.Table | None:
        """Run every step; return the result's tiles when the plan's result has no table."""

    def store_tiles(self, value: TiledValue, tiles: pa.Table, replace: bool = False) -> None: ...

    def lookup(self, name: str) -> TiledValue: ...

    def read_tiles(self, value: TiledValue) -> pa.Table: ...
