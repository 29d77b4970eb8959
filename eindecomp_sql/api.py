"""The numpy face: ``eds.einsum`` on arrays, run on one in-memory session opened once."""

from __future__ import annotations

import atexit
import threading

import numpy as np

from .session import Session

_default: Session | None = None
_default_lock = threading.Lock()


def default_session() -> Session:
    """The in-memory session ``eds.einsum`` runs on: opened once (a connection costs ~30 ms),
    closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Session()
            atexit.register(_close_default)
        return _default


def _close_default() -> None:
    global _default
    if _default is not None:
        _default.close()
        _default = None



def einsum(spec: str, *operands, join=None, agg=None) -> np.ndarray:
    """``numpy.einsum`` semantics (plus ``join=`` / ``agg=``), run as SQL in an embedded DuckDB.

    >>> einsum("ij,jk->ik", np.eye(2), np.arange(4.).reshape(2, 2))
    array([[0., 1.],
           [2., 3.]])
    """
    return default_session().einsum_numpy(spec, *operands, join=join, agg=agg)
