"""Arrays entering eindecomp_sql: anything numpy reads as numbers, in native byte order, of a
supported dtype. Every entry point (store, einsum operands, graph inputs) goes through
``as_array``; what it cannot understand it refuses with an ``EinsumError`` that says what to do.

>>> as_array(np.arange(3, dtype=">i4"), "operand 0").dtype.str  # byte-swapped to native
'<i4'
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .errors import EinsumError, EinsumTypeError
from .notation.checks import check_dtype, is_bfloat16

_STORE_TABLE = ("store it with db.store(name, table), which reads element-form (index columns + value) "
                "or tiled tables")

# numpy dtype kinds that are not numbers, and what to say about them
_NOT_NUMBERS = {
    "O": "Python objects (dtype object)",
    "U": "strings",
    "S": "bytes strings",
    "T": "strings",
    "M": "datetimes",
    "m": "timedeltas",
    "V": "records (a structured dtype); pass one field, e.g. a['x']",
}


def _module(x) -> str:
    return type(x).__module__ or ""


def _from_arrow(x, where: str) -> np.ndarray:
    """A pyarrow Array / ChunkedArray of numbers without nulls, as a 1-D numpy array; of
    fixed-size lists (of fixed-size lists ...) of numbers, as an N-D one (rows, n, ...), as
    ``FixedSizeListArray.to_numpy`` cannot give it."""
    t = x.type
    if pa.types.is_fixed_size_list(t):
        if x.null_count:
            raise EinsumError(f"{where}: the pyarrow {type(x).__name__} has {x.null_count} null array(s); fill or "
                              "drop them first")
        arr = x.combine_chunks() if isinstance(x, pa.ChunkedArray) else x
        if isinstance(arr, pa.ChunkedArray):  # no chunk at all
            arr = pa.array([], t)
        inner = _from_arrow(arr.flatten(), where)
        return inner.reshape((len(arr), t.list_size) + inner.shape[1:])
    if pa.types.is_struct(t):
        raise EinsumError(f"{where}: a pyarrow {type(x).__name__} of structs is a table, not an array; "
                          f"{_STORE_TABLE}")
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise EinsumError(f"{where}: a pyarrow {type(x).__name__} of {t} is not numbers; cast it to a numeric "
                          "type first")
    if x.null_count:
        raise EinsumError(f"{where}: the pyarrow {type(x).__name__} has {x.null_count} null(s); fill them first "
                          "(pyarrow.compute.fill_null)")
    return x.to_numpy(zero_copy_only=False) if isinstance(x, pa.Array) else x.to_numpy()


def _refuse_tables(x, where: str) -> None:
    """Tables, data frames, relations and sparse matrices are not arrays: say what to do."""
    mod, name = _module(x), type(x).__name__
    if isinstance(x, (pa.Table, pa.RecordBatch, pa.RecordBatchReader)):
        raise EinsumError(f"{where}: a pyarrow {name} is a table, not an array; {_STORE_TABLE}")
    if mod.startswith("duckdb") and "Relation" in name:
        raise EinsumError(f"{where}: a DuckDB {name} is a table, not an array; {_STORE_TABLE} "
                          "(or fetch it with .fetchnumpy())")
    if mod.startswith("scipy.sparse") or (mod.startswith("sparse") and hasattr(x, "todense")):
        raise EinsumError(f"{where}: a sparse {name} is not a dense array; call .toarray() first "
                          "(eindecomp_sql stores dense tiles)")
    if name == "DataFrame" or hasattr(x, "__dataframe__") or hasattr(x, "__arrow_c_stream__"):
        # a Spark DataFrame has no .to_numpy(): a trial was sent to look for one
        fetch = ".toArrow() or .toPandas()" if mod.startswith("pyspark") else ".to_numpy()"
        raise EinsumError(f"{where}: a {mod.split('.')[0] or 'data'} {name} is a table, not an array; "
                          f"{_STORE_TABLE} (or pass {fetch} of its numeric columns)")


def check_series_missing(x, where: str) -> None:
    """Refuse a pandas Series of a nullable dtype holding missing values (pd.NA): they came out
    as NaN of a float64 array, an Int64 Series stored as float64 (a review); a DataFrame's are
    refused the same way."""
    if not isinstance(x.dtype, np.dtype) and x.isna().any():
        raise EinsumError(f"{where}: the pandas Series ({x.dtype}) has {int(x.isna().sum())} missing value(s); "
                          "fill or drop them first (s.fillna(...))")


def read_array(x, where: str) -> np.ndarray:
    """``x`` as a numpy array of a supported dtype, in the byte order it came in (casting rules
    such as numpy's ``casting='no'`` see the dtype as given). ``where`` starts every message."""
    if isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray):
        a = x
    elif isinstance(x, (pa.Array, pa.ChunkedArray)):
        a = _from_arrow(x, where)
    elif hasattr(x, "__arrow_c_array__") and not hasattr(x, "__array__"):  # an Arrow C array export
        try:
            arrow = pa.array(x)
        except Exception as e:  # noqa: BLE001 - a foreign exporter's failure is bad input
            raise EinsumError(f"{where}: cannot read this {type(x).__name__} as an Arrow array ({e})") from None
        a = _from_arrow(arrow, where)
    else:
        if isinstance(x, np.ma.MaskedArray):
            if np.ma.count_masked(x):
                raise EinsumError(f"{where}: the masked array has {np.ma.count_masked(x)} masked element(s); "
                                  "fill them first (a.filled(value))")
            x = x.data
        elif not (_module(x).startswith("pandas") and type(x).__name__ == "Series"):
            _refuse_tables(x, where)
        else:
            check_series_missing(x, where)
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - anything numpy cannot read is bad input
            raise EinsumError(f"{where}: cannot be read as an array ({type(e).__name__}: {e})") from None
    if a.dtype.kind == "V" and a.dtype.names is None and a.dtype.itemsize == 2 and not is_bfloat16(a.dtype):
        raise EinsumError(f"{where}: holds 2-byte void elements ({a.dtype.str!r}, shape {a.shape}), which is how "
                          "np.load returns a saved bfloat16 array; pass a.view(ml_dtypes.bfloat16)")
    if a.dtype.kind in _NOT_NUMBERS and not is_bfloat16(a.dtype):  # ml_dtypes' bfloat16 is kind 'V' too
        # a TypeError too, as numpy's einsum raises ("invalid data type for einsum")
        if a.dtype.kind == "V" and a.dtype.names is None:  # ml_dtypes' float8, int4...: numbers, not ours
            raise EinsumTypeError(f"{where}: holds {a.dtype.name} elements (shape {a.shape}), a dtype eindecomp_sql "
                                  "does not compute in; cast to float32 (or bfloat16, float16) first")
        raise EinsumTypeError(f"{where}: holds {_NOT_NUMBERS[a.dtype.kind]}, not numbers (shape {a.shape}); einsum "
                              "operands and stored tensors are numeric arrays")
    check_dtype(a.dtype, where)
    return a


def native(a: np.ndarray) -> np.ndarray:
    """``a`` in the machine's byte order (tiles are raw bytes that kernels read natively)."""
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def as_array(x, where: str) -> np.ndarray:
    """``x`` as a numpy array of a supported dtype in native byte order, or an ``EinsumError``
    saying what is wrong with it and what to do (``where`` names the argument)."""
    return native(read_array(x, where))
