"""Checks every layer shares: tensor and value names, supported dtypes.

>>> check_name("A_1")
'A_1'
>>> check_dtype("float32")
'float32'
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import EinsumError

DTYPES = ("float32", "float64", "int32", "int64", "bool")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
RESERVED = ("_eds_", "eds_")


def check_name(name, what: str = "tensor name") -> str:
    """Names are plain identifiers. They reach SQL only quoted by sqlglot, but a name that is
    not an identifier is refused outright, so nothing that looks like SQL gets in."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise EinsumError(
            f"invalid {what} {name!r}: use letters, digits and '_' (starting with a letter or '_'), "
            "at most 63 characters"
        )
    if name.lower().startswith(RESERVED):
        raise EinsumError(f"invalid {what} {name!r}: names starting with '_eds_' or 'eds_' are reserved")
    return name


def check_dtype(dtype) -> str:
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise EinsumError(f"unsupported dtype {dt.name}: eindecomp_sql stores {', '.join(DTYPES)}")
    return dt.name
