"""Tensor files the command line reads and writes: ``.npy``, ``.parquet`` (tiled or element
form) and Arrow IPC (``.arrow`` / ``.feather``).

``db.store(name, path)`` reads Parquet; ``.npy`` and Arrow IPC paths are going into
``Session.store`` and ``Tensor.export(path)`` (another change in progress). Until they are
there, ``store_file`` and ``export`` fall back to reading/writing those formats here (the whole
array in memory, as ``store`` of an array does), and use the session's own path intake and
``Tensor.export`` as soon as they exist.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import secrets

import numpy as np

from ..errors import EinsumError

ARROW_SUFFIXES = (".arrow", ".feather")
SUFFIXES = (".npy", ".parquet") + ARROW_SUFFIXES
_PATH_REFUSED = "Parquet file ending in .parquet"  # what Session.store says of other paths today


def kind(path) -> str:
    s = pathlib.Path(path).suffix.lower()
    if s == ".npy":
        return "npy"
    if s == ".parquet":
        return "parquet"
    if s in ARROW_SUFFIXES:
        return "arrow"
    raise EinsumError(f"{str(path)!r}: unknown kind of tensor file; use one of {', '.join(SUFFIXES)}")


def _read_arrow(path):
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as src:
            try:
                return pa.ipc.open_file(src).read_all()
            except pa.ArrowInvalid:
                src.seek(0)
                return pa.ipc.open_stream(src).read_all()
    except (pa.ArrowException, OSError) as e:
        raise EinsumError(f"cannot read {str(path)!r} as an Arrow IPC file: {e}") from None


def _load_npy(path) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise EinsumError(f"cannot read {str(path)!r} as a .npy file: {e}") from None


def info(path) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of a tensor file: from its header or ``eindecomp_sql.*`` metadata when it
    has them (cheap), else by reading it (an element-form table without a shape)."""
    from ..io import Wanted, read_metadata, read_source
    from ..notation.checks import check_dtype

    path = pathlib.Path(path)
    k = kind(path)
    where = str(path)
    if k == "npy":
        a = _load_npy(path)
        return tuple(a.shape), check_dtype(a.dtype, where)
    import pyarrow as pa

    if k == "parquet":
        import pyarrow.parquet as pq

        try:
            meta = pq.read_schema(path).metadata
        except (pa.ArrowException, OSError) as e:
            raise EinsumError(f"cannot read {where!r} as Parquet: {e}") from None
        table = None
    else:
        table = _read_arrow(path)
        meta = table.schema.metadata
    m = read_metadata(meta, where)
    if "shape" in m and "dtype" in m:
        return tuple(m["shape"]), check_dtype(m["dtype"], where)
    got = read_source(path if table is None else table, where, Wanted())
    return tuple(got.shape), got.dtype


def store_file(db, name: str, path, tile=None, dtype=None, shape=None, replace: bool = False):
    """``db.store(name, path, ...)``; for ``.npy`` / Arrow IPC while ``Session.store`` does not
    read those paths itself, the file is read here and stored as an array / a table."""
    path = pathlib.Path(path)
    k = kind(path)
    if not path.is_file():
        raise EinsumError(f"no such file {str(path)!r}")
    kw = {"tile": tile, "replace": replace, "dtype": dtype}
    if shape is not None:
        kw["shape"] = shape
    try:
        return db.store(name, str(path), **kw)
    except EinsumError as e:
        if k == "parquet" or _PATH_REFUSED not in str(e):
            raise
    if k == "npy":
        if shape is not None:
            raise EinsumError(f"{str(path)!r}: --shape is for element-form tables; a .npy file has its own shape")
        return db.store(name, _load_npy(path), **kw)
    return db.store(name, _read_arrow(path), **kw)


def export(tensor, path, form: str = "tiles") -> pathlib.Path:
    """Write ``tensor`` to ``path`` by its suffix, atomically (a temporary file renamed over it):
    ``Tensor.export`` where it exists, else ``.parquet`` by ``to_parquet`` and ``.npy`` / Arrow
    IPC here."""
    path = pathlib.Path(path)
    k = kind(path)
    if hasattr(tensor, "export"):
        return tensor.export(path, form=form)
    if k == "parquet":
        return tensor.to_parquet(path, form)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        if k == "npy":
            if form != "tiles":
                raise EinsumError("a .npy file holds the dense array; --form is for .parquet and Arrow files")
            with open(tmp, "wb") as f:
                np.save(f, tensor.to_numpy(), allow_pickle=False)
        else:
            import pyarrow as pa

            table = tensor.to_arrow(form)
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
                w.write_table(table)
        os.replace(tmp, path)
    except OSError as e:
        raise EinsumError(f"cannot write {str(path)!r}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
