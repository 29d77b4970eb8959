"""Arrays entering eindecomp_sql: anything numpy can read, in native byte order, of a
supported dtype. Every entry point (store, einsum operands, graph inputs) goes through here.
"""

from __future__ import annotations

import numpy as np

from .errors import EinsumError
from .notation.checks import check_dtype


def as_array(x, where: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - anything numpy cannot read is bad input
        raise EinsumError(f"{where}: cannot be read as an array ({e})") from None
    if a.dtype == object:
        raise EinsumError(f"{where}: cannot be read as a numeric array")
    check_dtype(a.dtype)
    return a
