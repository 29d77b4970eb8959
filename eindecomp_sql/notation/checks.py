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

import ml_dtypes  # noqa: F401 - registers "bfloat16" with numpy (np.dtype("bfloat16")); ~4 ms
import numpy as np

from ..errors import EinsumError, EinsumTypeError

# Every dtype a tensor may have. Promotion between any two of them stays in the set (uint64
# with a signed int is float64, complex64 with float64 is complex128; bfloat16: ``promote``).
DTYPES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128",
)
# ml_dtypes' bfloat16: numpy knows it as kind 'V' with no promotion rules of its own
BFLOAT16 = np.dtype("bfloat16")
_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The DuckDB type of each dtype's values (element rows, packed tables, top-k values); complex
# has none (DuckDB has no complex type)
SQL_TYPES = {
    "bool": "BOOLEAN",
    "int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT",
    "uint8": "UTINYINT", "uint16": "USMALLINT", "uint32": "UINTEGER", "uint64": "UBIGINT",
    "float16": "FLOAT", "bfloat16": "FLOAT", "float32": "FLOAT", "float64": "DOUBLE",
}
# DuckDB has no float16 or bfloat16: their elements go to and from SQL as float32 values
# (exact), and a FLOAT value read from SQL is a float32, never rounded (``sql_value_dtype``)
SQL_WIRE = {"float16": "float32", "bfloat16": "float32"}
RESERVED = ("_eds_", "eds_")


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16, in either byte order."""
    return np.dtype(dtype).name == "bfloat16"


def promote(*dtypes) -> np.dtype:
    """``np.result_type`` over eindecomp_sql's dtypes, bfloat16 included.

    numpy has no promotion for bfloat16 (ml_dtypes raises with int16, int32, uint64 and
    float16), so it promotes as float16 does, with one difference: with float16 it gives
    float32 (neither holds the other's values). So bool, int8 and uint8 keep bfloat16, int16
    and uint16 give float32, wider integers float64, wider floats and complex themselves.

    >>> promote("bfloat16", "int8"), promote("bfloat16", "int16"), promote("bfloat16", "float16")
    (dtype(bfloat16), dtype('float32'), dtype('float32'))
    >>> promote("int32", "float16")
    dtype('float64')
    """
    dts = [np.dtype(d) for d in dtypes]
    if not any(is_bfloat16(d) for d in dts):
        return np.result_type(*dts)
    r = np.result_type(*[_F16 if is_bfloat16(d) else d for d in dts])
    return narrow_bfloat16(r, dts)


_KIND_ORDER = "buifc"  # numpy's same_kind order: bool, unsigned, signed, float, complex


def can_cast(frm, to, casting: str = "safe") -> bool:
    """``np.can_cast`` over eindecomp_sql's dtypes, bfloat16 included (ml_dtypes answers some
    directions only: bfloat16 -> float16 is not even same_kind there). bfloat16 casts as a float
    whose safe casts are exactly those ``promote`` agrees with.

    >>> can_cast("bfloat16", "float16", "same_kind"), can_cast("bfloat16", "float16")
    (True, False)
    >>> can_cast("int8", "bfloat16"), can_cast("int16", "bfloat16"), can_cast("complex64", "bfloat16", "same_kind")
    (True, False, False)
    """
    f, t = np.dtype(frm), np.dtype(to)
    if not (is_bfloat16(f) or is_bfloat16(t)):
        return bool(np.can_cast(f, t, casting))
    if casting == "unsafe":
        return True
    if casting in ("no", "equiv"):
        return f.name == t.name and (casting == "equiv" or f.byteorder == t.byteorder)
    safe = promote(f, t) == t.newbyteorder("=")
    if casting == "safe" or safe:
        return safe
    kind = [("f" if is_bfloat16(d) else d.kind) for d in (f, t)]
    return _KIND_ORDER.index(kind[0]) <= _KIND_ORDER.index(kind[1])  # same_kind


def narrow_bfloat16(dt, inputs) -> np.dtype:
    """A dtype numpy computed with float16 standing for bfloat16 (``promote``, a join's probe),
    turned back: float16 is bfloat16 if an input was bfloat16 (float32 if float16 was one too);
    anything else is itself."""
    dt = np.dtype(dt)
    ins = [np.dtype(d) for d in inputs]
    if dt != _F16 or not any(is_bfloat16(d) for d in ins):
        return dt
    return _F32 if any(d.newbyteorder("=") == _F16 for d in ins) else BFLOAT16


def sql_value_dtype(dtype) -> np.dtype:
    """The numpy dtype of ``dtype``'s element values as DuckDB holds them (its own, but for
    float16 and bfloat16: float32).

    >>> sql_value_dtype("float16"), sql_value_dtype("bfloat16"), sql_value_dtype("int8")
    (dtype('float32'), dtype('float32'), dtype('int8'))
    """
    dt = np.dtype(dtype)
    return np.dtype(SQL_WIRE.get(dt.name, dt))


def check_name(name, what: str = "tensor name") -> str:
    """Names are plain identifiers. They reach SQL only quoted by sqlglot, but a name that is
    not an identifier is refused outright, so nothing that looks like SQL gets in."""
    if not isinstance(name, str):
        # not its repr: an array passed where the name goes (``store(a, "A")``) printed whole
        shape = getattr(name, "shape", None)
        got = type(name).__name__ + (f" of shape {tuple(shape)}" if shape is not None else "")
        hint = " (the name comes first: store(name, data))" if shape is not None and what == "tensor name" else ""
        raise EinsumError(f"invalid {what}: expected a str, got a {got}{hint}")
    if not _NAME.fullmatch(name):  # fullmatch: "$" also matches before a final newline
        raise EinsumError(
            f"invalid {what} {name!r}: use letters, digits and '_' (starting with a letter or '_'), "
            "at most 63 characters"
        )
    if name.lower().startswith(RESERVED):
        raise EinsumError(f"invalid {what} {name!r}: names starting with '_eds_' or 'eds_' are reserved")
    return name


def check_dtype(dtype, where: str = "") -> str:
    """The numpy name of a supported dtype (one of ``DTYPES``), or an ``EinsumError``.

    Anything numpy cannot read as a dtype, or a dtype we do not compute in, is an
    ``EinsumTypeError`` (an EinsumError and a TypeError: numpy's einsum raises TypeError there).
    """
    prefix = f"{where}: " if where else ""
    try:
        dt = np.dtype(dtype)
    except Exception as e:  # noqa: BLE001 - numpy raises TypeError/ValueError/... for bad dtypes
        raise EinsumTypeError(f"{prefix}{dtype!r} is not a dtype ({e})") from None
    if dt.name not in DTYPES:
        # a TypeError too, as numpy's einsum raises for strings, datetimes, records (a trial)
        raise EinsumTypeError(f"{prefix}unsupported dtype {dt.name}: eindecomp_sql stores {', '.join(DTYPES)}")
    return dt.name
