"""eindecomp_sql: extended einsum as tensor-relational SQL on embedded DuckDB.

>>> import numpy as np, eindecomp_sql as eds
>>> eds.einsum("ij,jk->ik", np.eye(2), np.ones((2, 2)))
array([[1., 1.],
       [1., 1.]])
"""

from . import _malloc  # noqa: F401 - one malloc arena, before pyarrow's import makes a second (see there)
from .errors import EinsumError, EinsumTypeError

# The engine-facing names load on first use: the pure layers (``eindecomp_sql.notation``,
# ``.graph``, ``.plan``) then import without duckdb, pyarrow or sqlglot (~0.3 s of imports).
_LAZY = {"einsum": "api", "topk": "api", "TopK": "ranking", "Session": "session", "connect": "session", "Tensor": "tensor", "Graph": "graph"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))

__all__ = ["EinsumError", "EinsumTypeError", "Graph", "Session", "Tensor", "TopK", "connect", "einsum", "topk"]
__version__ = "0.1.0"
