"""Tensor files the command line reads and writes: ``.npy``, ``.parquet`` (tiled or element
form) and Arrow IPC (``.arrow`` / ``.feather``). ``Session.store(name, path)`` and
``Tensor.export(path)`` do the reading and writing (streamed); this module adds what a job needs
before it opens a database: a file's shape and dtype from its header or metadata, and its hash.
"""

from __future__ import annotations

import hashlib
import math
import pathlib

import numpy as np

from ..errors import EinsumError

ARROW_SUFFIXES = (".arrow", ".feather")
SUFFIXES = (".npy", ".parquet") + ARROW_SUFFIXES


def missing(path) -> str:
    """Why ``path`` cannot be loaded as a file (it is not one): a directory is not read as the
    files in it (a Spark-written ``x.parquet/`` is one), which "no such file" would hide."""
    if pathlib.Path(path).is_dir():
        return (f"{str(path)!r} is a directory, not a file; read a directory of Parquet files with DuckDB "
                "(read_parquet(path + '/*.parquet')) and store the relation")
    return f"no such file {str(path)!r}"


def kind(path) -> str:
    s = pathlib.Path(path).suffix.lower()
    if s == ".npy":
        return "npy"
    if s == ".parquet":
        return "parquet"
    if s in ARROW_SUFFIXES:
        return "arrow"
    raise EinsumError(f"{str(path)!r}: unknown kind of tensor file; use one of {', '.join(SUFFIXES)}")


def _arrow_schema(path):
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as src:
            try:
                return pa.ipc.open_file(src).schema
            except pa.ArrowInvalid:
                src.seek(0)
                return pa.ipc.open_stream(src).schema
    except (pa.ArrowException, OSError) as e:
        raise EinsumError(f"cannot read {str(path)!r} as an Arrow IPC file: {e}") from None


def _load_npy(path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise EinsumError(f"cannot read {str(path)!r} as a .npy file: {e}") from None


def info(path, dtype=None, table: dict | None = None) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of a tensor file: from its header or ``eindecomp_sql.*`` metadata when it
    has them (cheap), else by reading it (an element-form table without a shape). ``dtype``: the
    one the file is to be read as (a .npy of 2-byte voids is bfloat16 only when it says so).
    ``table``: ``shape=``, ``index=``, ``value=`` for a table file (read as ``store`` reads it)."""
    from ..io import Wanted, npy_dtype, read_metadata, read_source
    from ..notation.checks import check_dtype

    path = pathlib.Path(path)
    k = kind(path)
    where = str(path)
    if k == "npy":
        a = _load_npy(path)
        return tuple(a.shape), npy_dtype(a.dtype, dtype, where).name
    import pyarrow as pa

    if k == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.read_schema(path).metadata
        except (pa.ArrowException, OSError) as e:
            raise EinsumError(f"cannot read {where!r} as Parquet: {e}") from None
    else:
        meta = _arrow_schema(path).metadata
    m = read_metadata(meta, where)
    if "shape" in m and "dtype" in m and not table:
        return tuple(m["shape"]), check_dtype(m["dtype"], where)
    # element form without a shape, or a table read with store's options: read it
    got = read_source(path, where, Wanted(**(table or {})))
    return tuple(got.shape), got.dtype


def store_file(db, name: str, path, tile=None, dtype=None, shape=None, replace: bool = False, keys=None,
               index=None, value=None):
    """``db.store(name, path, ...)`` for a tensor file (its kind checked by suffix first);
    ``keys``: the key names to store it under (a job's plan reads its inputs as ``d0, d1, ...``,
    whatever keys a tiled file carries)."""
    path = pathlib.Path(path)
    kind(path)
    if not path.is_file():
        raise EinsumError(missing(path))
    kw = {"tile": tile, "replace": replace, "dtype": dtype, "keys": keys}
    for k, v in (("shape", shape), ("index", index), ("value", value)):
        if v is not None:
            kw[k] = v
    return db.store(name, str(path), **kw)


# the least DuckDB's cache is capped at by a streaming command (see cap_cache). A store gets
# more: under 128 MiB a 2 GiB store took 14.7 s and peaked at 361 MB, under 256 MiB 12.9 s and
# 376 MB, uncapped 10.5 s and 418 MB (growing with the tensor); an export reads each block once
STREAM_CACHE_BYTES = 128 << 20
STORE_CACHE_BYTES = 256 << 20


def cap_cache(db, limit: int) -> int:
    """Lower DuckDB's ``memory_limit`` to ``limit`` bytes (never raise it) for a command that
    streams a tensor once (``store``, ``export``): DuckDB keeps the blocks it reads and writes
    cached up to its limit (80% of the machine's memory by default), which is resident memory
    a one-shot command gains nothing from. A 1 GiB export of 32 parts grew resident memory by
    1.1 GB uncapped, +223 MB under a 150 MB limit; a 2 GiB store of 16 MB parts crept from
    +220 to +300 MB uncapped and stayed near +170 MB under 128 MB. Returns the limit in force."""
    con = db.connection
    # fetchall: a result left open holds its transaction, and DuckDB then skips every automatic
    # checkpoint (a 2 GiB store kept its 2.5 GB of committed blocks in memory until the close)
    now = _limit_now(con)
    if now is None or limit < now:
        import duckdb

        from ..errors import EinsumError

        try:
            con.execute(f"SET memory_limit = '{int(limit)}B'")
        except duckdb.Error as e:  # below what DuckDB holds already (--memory 1KB): an "internal error" before
            raise EinsumError(f"a memory cap of {int(limit)} bytes is less than DuckDB needs: {e}") from None
        return int(limit)
    return now


def _limit_now(con) -> int | None:
    """DuckDB's ``memory_limit`` in bytes (it prints ``'18.8 GiB'``); None if unreadable."""
    from ..errors import EinsumError
    from ..plan.cost import parse_memory

    try:
        return parse_memory(con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0])
    except EinsumError:
        return None


def _cap_for(part_bytes: int, least: int = STREAM_CACHE_BYTES) -> int:
    """The cache a stream needs: a few of its parts (each is read or written whole)."""
    return max(least, 4 * part_bytes)


def export_cache_limit(value) -> int:
    """The cap for streaming stored tensor ``value`` out: four of its parts, at least 128 MiB
    (a tensor stored before parts, or small, is one part)."""
    from ..backends import parts
    from ..plan.cost import nbytes

    rows = parts.rows_per_part(value)
    return _cap_for(value.nbytes if rows is None else rows * nbytes(value.tile, value.dtype))


def store_cache_limit(db, path, tile=None, dtype=None) -> int:
    """The cap for storing file ``path``: four parts of the tiles ``store`` will cut (``tile``,
    else the file's own or the session's choice), at least 256 MiB; from the file's header or
    metadata, without reading its data (a file that does not say falls back to the session's
    largest tile)."""
    from ..backends import parts
    from ..io import read_metadata
    from ..plan import auto_tile

    largest = None
    try:
        if kind(path) == "npy":
            shape, file_dtype = info(path, dtype)
            itemsize = np.dtype(dtype or file_dtype).itemsize
            largest = math.prod(tile or auto_tile(shape, itemsize, db.store_tile_bytes, db.store_square)) * itemsize
        else:
            import pyarrow.parquet as pq

            meta = read_metadata(pq.read_schema(path).metadata if kind(path) == "parquet"
                                 else _arrow_schema(path).metadata, str(path))
            if meta.get("layout") == "tiles" and {"tile", "dtype"} <= meta.keys():
                largest = math.prod(tile or meta["tile"]) * np.dtype(dtype or meta["dtype"]).itemsize
    except Exception:  # the store itself says what is wrong with the file
        largest = None
    return _cap_for(max(parts.PART_BYTES, largest if largest is not None else db.store_tile_bytes), STORE_CACHE_BYTES)


def export(tensor, path, form: str = "tiles", sync: bool = False) -> pathlib.Path:
    """``tensor.export(path, form, sync)``: by the suffix, atomically (its kind checked first)."""
    kind(path)
    return tensor.export(pathlib.Path(path), form=form, sync=sync)


def file_digest(path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes (hashlib: ~1.6 GB/s here)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
