"""``Tensor``: a handle on a tensor stored as a tiled table in a session's database."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .errors import EinsumError
from .plan import TiledValue
from .udfs.tiles import array_from_tiles

if TYPE_CHECKING:
    from .session import Session


@dataclass(frozen=True, eq=False)
class Tensor:
    """A tensor stored as a tiled table in a session's database."""

    session: "Session"
    value: TiledValue  # named after the table holding the tiles
    is_temporary: bool = False

    @property
    def name(self) -> str:
        """The table holding the tiles."""
        return self.value.name

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self.value.shape

    @property
    def dtype(self) -> np.dtype:
        """The tensor's numpy dtype."""
        return np.dtype(self.value.dtype)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.value.shape)

    @property
    def tile(self) -> tuple[int, ...]:
        """The tile shape it is stored in (edge tiles are smaller)."""
        return self.value.tile

    @property
    def keys(self) -> tuple[str, ...]:
        """The key column names, one per dimension."""
        return self.value.keys

    @property
    def temporary(self) -> bool:
        """A result computed without ``out=``: its table is dropped when this handle is
        collected, or on leaving a ``with`` block."""
        return self.is_temporary

    def __enter__(self) -> "Tensor":
        """``with`` a temporary result: its table is dropped on leaving the block."""
        return self

    def __exit__(self, *exc) -> None:
        fin = self.__dict__.get("_finalizer")
        if fin is not None:
            fin()  # drops the temporary table now (a finalizer runs once)

    def _live_value(self, fresh: bool = False):
        """The value, if its table is still this tensor's: a temporary result that left its
        ``with`` block was dropped, and its table name may since hold another result; a stored
        tensor may have been dropped or replaced by another of a different shape, dtype or tile
        since this handle was made (its bytes read with the old shape would be garbage).
        ``fresh``: the handle was just read from the catalog (nothing to check again). The
        catalog is asked again only after this session changed it (``catalog_epoch``): a
        change made by another session on the same database is not seen until then."""
        fin = self.__dict__.get("_finalizer")
        if fin is not None and not fin.alive:
            raise EinsumError(f"this temporary result ({self.value.name!r}) was dropped (db.drop(result), or it "
                              "left its with block); compute it again, or pass out= to keep a result")
        if self.is_temporary or fresh:
            return self.value
        v = self.value
        epoch = getattr(self.session, "catalog_epoch", None)
        if epoch is not None and self.__dict__.get("_epoch") == epoch:
            return v  # checked since this session last changed the catalog
        now = self.session.backend.lookup(v.name)
        if now is None:
            raise EinsumError(f"stored tensor {v.name!r} no longer exists (dropped since this handle was made)")
        if (now.shape, now.dtype, now.tile, now.keys) != (v.shape, v.dtype, v.tile, v.keys):
            # (the keys said only where they differ: a replace that renamed them read as no change, a trial)
            keys = (lambda x: f" keyed {', '.join(x.keys)}") if now.keys != v.keys else (lambda x: "")
            raise EinsumError(
                f"stored tensor {v.name!r} was replaced since this handle was made: it is now {now.shape} {now.dtype} "
                f"in tiles {now.tile}{keys(now)} (this handle: {v.shape} {v.dtype} in tiles {v.tile}{keys(v)}); take a "
                f"new handle with db.tensor({v.name!r})")
        object.__setattr__(self, "_epoch", epoch)
        return v

    def to_arrow(self, form: str = "tiles") -> pa.Table:
        """The tensor as an Arrow table, described in its schema metadata (``eindecomp_sql.*``
        keys: format version, layout, shape, dtype, tile, keys, byte order; docs/LAYOUT.md), so
        ``db.store(name, table)`` reads it back as it was.

        ``form="tiles"``: the stored table, one int64 key column per dimension then ``tile``
        (the raw C-order bytes of each tile, edge tiles smaller). ``form="elements"``: one row
        per element, an int64 index column per dimension (named like the keys) then ``value``
        (not for complex dtypes: Arrow has no complex type).

        >>> import eindecomp_sql as eds
        >>> db = eds.connect()
        >>> db.store("A", np.arange(6.0).reshape(2, 3)).to_arrow("elements").column("value").to_pylist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        """
        from .io import elements_table, tensor_metadata

        if form == "tiles":
            with self.session._call():  # the check and the read with no replace between them
                v = self._live_value()
                table = self.session.backend.read_tiles(v)
            if not self.is_temporary:  # as to_numpy(): a table edited out of shape in SQL is refused,
                from .io import check_stored_tiles  # not handed on (a file store() then refuses)

                check_stored_tiles(table, v, _edited(v))
        elif form == "elements":
            # the whole tensor is in memory here, and its index columns next to it
            dense, v = self.to_numpy(), self.value  # (to_numpy checked the handle)
            table = elements_table(dense, v.keys)
        else:
            raise EinsumError(f"to_arrow(form={form!r}): form is 'tiles' or 'elements'")
        return table.replace_schema_metadata(tensor_metadata(v.shape, v.dtype, v.tile, v.keys, form, v.name))

    def to_spark(self, form: str = "tiles"):
        """The tensor as a Spark DataFrame, on a Spark session (``backend="spark"``): its tiles
        (``form="tiles"``: the stored key columns, then ``tile``) or one row per element
        (``form="elements"``: an index column per dimension, named like the keys, then ``value``,
        as ``to_arrow("elements")``; Spark has no half, complex or unsigned types: float16 and
        bfloat16 come as float, uint8-uint32 as the next signed size, complex and uint64 are
        refused). Spark makes the rows from the stored tiles when the DataFrame runs (never
        whole in this process); as any DataFrame over a table, it fails once the tensor is
        dropped or replaced (``.cache()`` or write it first where that matters)."""
        if form not in ("tiles", "elements"):
            raise EinsumError(f"to_spark(form={form!r}): form is 'tiles' or 'elements'")
        frame = getattr(self.session.backend, "spark_frame", None)
        if frame is None:
            raise EinsumError(f"to_spark() needs a Spark session (eds.connect(backend='spark')); this one is "
                              f"{self.session.backend.name!r}: use to_arrow() or to_numpy()")
        with self.session._call():
            return frame(self._live_value(), form)

    def to_parquet(self, path, form: str = "tiles", sync: bool = False) -> pathlib.Path:
        """Write ``to_arrow(form)`` to a Parquet file at ``path``, metadata included, atomically
        (a temporary file in the same directory renamed over ``path``: a failure leaves no
        half-written file; ``sync=True`` also fsyncs the file and the rename, for a power loss).
        ``db.store(name, path)`` and ``pyarrow.parquet.read_table(path)`` read it back. Returns
        the path.

        >>> import eindecomp_sql as eds, tempfile, pathlib
        >>> db, tmp = eds.connect(), pathlib.Path(tempfile.mkdtemp())
        >>> p = db.store("A", np.arange(6.0).reshape(2, 3)).to_parquet(tmp / "A.parquet")
        >>> db.store("B", p).to_numpy()
        array([[0., 1., 2.],
               [3., 4., 5.]])
        """
        # streamed as export() streams, a batch of tiles at a time: to_arrow() first held the
        # whole tensor (a 1 GiB tensor rose resident memory by 1.3 GB under memory="200MB")
        return self._export(path, form, sync, parquet=True)

    def export(self, path, form: str = "tiles", sync: bool = False) -> pathlib.Path:
        """Write the tensor to a file at ``path``, by its suffix, and return the path:

        - ``.npy``: the dense array (numpy's format; ``np.load`` reads it);
        - ``.parquet``: ``to_arrow(form)`` as Parquet, metadata included;
        - ``.arrow`` / ``.feather``: ``to_arrow(form)`` as an Arrow IPC file (Feather v2).

        ``db.store(name, path)`` reads each back (a bfloat16 ``.npy``, which numpy writes as raw
        2-byte voids, with ``dtype='bfloat16'``). Streamed: the tiles come from the database a
        batch at a time and go to the file (a ``.npy`` in runs of side-by-side tiles, each written
        with ``pwritev``), so the tensor is never whole in Python. Atomic: a temporary
        file in the same directory is renamed over ``path`` (a failure or a crash of the process
        leaves no half-written file, an older one intact). Not fsynced, as ``np.save`` and
        DuckDB's ``COPY ... TO`` are not: ``sync=True`` fsyncs the file and the rename, so a power
        loss too leaves the old file or the new one (it then waits for the disk).

        >>> import eindecomp_sql as eds, tempfile, pathlib
        >>> db, tmp = eds.connect(), pathlib.Path(tempfile.mkdtemp())
        >>> p = db.store("A", np.arange(6.0).reshape(2, 3), tile=(1, 2)).export(tmp / "A.npy")
        >>> np.load(p)
        array([[0., 1., 2.],
               [3., 4., 5.]])
        """
        return self._export(path, form, sync)

    def _export(self, path, form: str, sync: bool, parquet: bool = False) -> pathlib.Path:
        from .io import checked_tile_batches, export_tensor, tile_batches

        self._not_a_database(path)
        with self.session._call():  # the check and the reads with no replace between them
            v = self._live_value()
            batches = lambda: tile_batches(self.session.backend, v)  # noqa: E731
            if not self.is_temporary:  # a stored tensor's table may have been edited in SQL since
                batches = checked_tile_batches(v, batches, _edited(v))
            return export_tensor(v, batches, path, form, sync, parquet)

    def _not_a_database(self, path) -> None:
        """Refuse to write a file over one of the session's database files: the atomic write
        renames its new file over the path, so an export named like the database replaced it
        (a trial: ``eindecomp-sql export tensors.arrow A tensors.arrow`` said it wrote A, and the
        database with every other tensor was gone)."""
        files = getattr(self.session.backend, "database_files", None)
        try:
            target = os.path.realpath(os.fspath(path))
        except TypeError:  # not a path: the writer says so, in its own words
            return
        owned = getattr(self.session.backend, "owned_directory", None)
        inside = owned(target) if owned is not None else None
        if inside is not None:
            raise EinsumError(f"cannot write {self.name!r} to {os.fspath(path)!r}: that is inside {inside}, where this "
                              "session keeps its tensors' files (a file there would become part of a stored tensor); "
                              "write it elsewhere")
        if files is None:
            return
        for f in files():
            if os.path.realpath(f) == target or (os.path.exists(f) and os.path.exists(target)
                                                 and os.path.samefile(f, target)):
                raise EinsumError(f"cannot write {self.name!r} to {os.fspath(path)!r}: that file is one of this "
                                  f"session's databases ({f}); writing over it would destroy it")

    def to_numpy(self) -> np.ndarray:
        """The whole tensor as a numpy array (native byte order)."""
        with self.session._call():  # the check and the read with no replace between them (a thread
            v = self._live_value()  # replacing the tensor made int64 bytes read as float64)
            tiles = self.session.backend.read_tiles(v)
        if not self.is_temporary:  # a stored tensor's table may have been edited in SQL since
            from .io import check_stored_tiles

            check_stored_tiles(tiles, v, _edited(v))
        return array_from_tiles(tiles, v.shape, v.tile, v.dtype, v.keys)

    def __array__(self, dtype=None, copy=None):
        # numpy 2's protocol: copy=False asks for no copy, and the tiles are in DuckDB, so
        # reading them is always one (it was made silently: a trial). ValueError is numpy's.
        if copy is False:
            raise ValueError(f"{self!r}: np.asarray(..., copy=False) cannot be honoured: a stored tensor's "
                             "values are read out of DuckDB into a new array (use copy=None, or to_numpy())")
        a = self.to_numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def __repr__(self) -> str:
        v = self.value
        return f"Tensor({v.name!r}, shape={v.shape}, dtype={v.dtype}, tile={v.tile})"


def _edited(v) -> str:
    """How a check of a stored tensor's rows names it: what went wrong is said after."""
    return (f"stored tensor {v.name!r} does not match its catalog entry (was its table edited outside store()? "
            f"store it again with replace=True)")
