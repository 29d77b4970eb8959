"""Checks every layer shares: tensor and value names, supported dtypes.

>>> check_name("A_1")
'A_1'
>>> check_dtype("float32")
'float32'
>>> check_dtype(">u2")  # byte order is not part of a dtype's name: arrays enter in native order
'uint16'
"""

from __future__ import annotations

import re

import numpy as np

from ..errors import EinsumError

# Every dtype a tensor may have. numpy's promotion between any two of them stays in the set
# (uint64 with a signed int is float64, complex64 with float64 is complex128).
DTYPES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The DuckDB type of each dtype's values (element rows, packed tables, top-k values); complex
# has none (DuckDB has no complex type)
SQL_TYPES = {
    "bool": "BOOLEAN",
    "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT",
    "uint8": "UTINYINT", "uint16": "USMALLINT", "uint32": "UINTEGER", "uint64": "UBIGINT",
    "float16": "FLOAT", "float32": "FLOAT", "float64": "DOUBLE",
}
# DuckDB has no float16: its elements go to and from SQL as float32 values (exact), and a FLOAT
# value read from SQL is a float32, never rounded to float16 (``sql_value_dtype``)
SQL_WIRE = {"float16": "float32"}
RESERVED = ("_eds_", "eds_")
# dtypes users reach for that are planned but not stored yet: say when, not only "unsupported"
_LATER = {"bfloat16": "bfloat16 comes with GPU support; cast to float32 for now"}


def sql_value_dtype(dtype) -> np.dtype:
    """The numpy dtype of ``dtype``'s element values as DuckDB holds them (its own, but for
    float16: float32).

    >>> sql_value_dtype("float16"), sql_value_dtype("int8")
    (dtype('float32'), dtype('int8'))
    """
    dt = np.dtype(dtype)
    return np.dtype(SQL_WIRE.get(dt.name, dt))


def check_name(name, what: str = "tensor name") -> str:
    """Names are plain identifiers. They reach SQL only quoted by sqlglot, but a name that is
    not an identifier is refused outright, so nothing that looks like SQL gets in."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):  # fullmatch: "$" also matches before a final newline
        raise EinsumError(
            f"invalid {what} {name!r}: use letters, digits and '_' (starting with a letter or '_'), "
            "at most 63 characters"
        )
    if name.lower().startswith(RESERVED):
        raise EinsumError(f"invalid {what} {name!r}: names starting with '_eds_' or 'eds_' are reserved")
    return name


def check_dtype(dtype, where: str = "") -> str:
    """The numpy name of a supported dtype (one of ``DTYPES``), or an ``EinsumError``.

    Anything numpy cannot read as a dtype is an ``EinsumError`` too, never a ``TypeError``.
    """
    prefix = f"{where}: " if where else ""
    try:
        dt = np.dtype(dtype)
    except Exception as e:  # noqa: BLE001 - numpy raises TypeError/ValueError/... for bad dtypes
        raise EinsumError(f"{prefix}{dtype!r} is not a dtype ({e})") from None
    if dt.name not in DTYPES:
        hint = _LATER.get(dt.name, f"eindecomp_sql stores {', '.join(DTYPES)}")
        raise EinsumError(f"{prefix}unsupported dtype {dt.name}: {hint}")
    return dt.name
