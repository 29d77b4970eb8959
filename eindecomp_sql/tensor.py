"""``Tensor``: a handle on a tensor stored as a tiled table in a session's database."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .plan import TiledValue
from .udfs.tiles import array_from_tiles

if TYPE_CHECKING:
    from .session import Session


@dataclass(frozen=True, eq=False)
class Tensor:
    """A tensor stored as a tiled table in a session's database."""

    session: "Session"
    value: TiledValue

    @property
    def name(self) -> str:
        return self.value.table

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.value.dtype)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def tile(self) -> tuple[int, ...]:
        return self.value.tile

    @property
    def keys(self) -> tuple[str, ...]:
        return self.value.keys

    @property
    def temporary(self) -> bool:
        """A result computed without ``out=``: its table is dropped when this handle is
        collected, or on leaving a ``with`` block."""
        return self.value.temporary

    def __enter__(self) -> "Tensor":
        return self

    def __exit__(self, *exc) -> None:
        fin = self.__dict__.get("_finalizer")
        if fin is not None:
            fin()  # drops the temporary table now (a finalizer runs once)

    def to_arrow(self) -> pa.Table:
        """The tiled table: one int64 key column per dimension, then ``tile`` (C-order bytes)."""
        return self.session.backend.read_tiles(self.value)

    def to_numpy(self) -> np.ndarray:
        v = self.value
        return array_from_tiles(self.to_arrow(), v.shape, v.tile, v.dtype, v.keys)

    def __array__(self, dtype=None, copy=None):
        a = self.to_numpy()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        v = self.value
        return f"Tensor({v.table!r}, shape={v.shape}, dtype={v.dtype}, tile={v.tile})"
