"""What enters eindecomp_sql: arrays in any byte order come out right (big-endian input gave
values around 1e220 and stored byte-swapped tiles); tables, frames, relations, sparse matrices
and non-numeric data are refused with an EinsumError that says what to do."""

import duckdb
import numpy as np
import pyarrow as pa
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError, Graph
from eindecomp_sql.arrays import as_array

from helpers import DTYPES, assert_close, random_array
from reference import reference  # np.einsum, and bfloat16's rule where numpy has none


@pytest.mark.parametrize("order", [">", "<"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_byte_order_stores_and_computes_right(db, dtype, order):
    # (random shapes, dtypes and byte orders also run through tests/test_einsum_numpy.py)
    rng = np.random.default_rng(len(dtype))
    shape = (5, 3)
    a = random_array(rng, shape, dtype)
    b = random_array(rng, shape[::-1], dtype)
    a_swapped = a.astype(a.dtype.newbyteorder(order))
    b_swapped = b.astype(b.dtype.newbyteorder(order))
    A = db.store("be_a", a_swapped, tile=(max(1, shape[0] - 1), max(1, shape[1] - 1)), replace=True)
    assert A.dtype == a.dtype.newbyteorder("=")
    np.testing.assert_array_equal(A.to_numpy(), a)
    assert A.to_numpy().dtype.isnative
    want = reference("ij,jk->ik", a, b)
    assert_close(eds.einsum("ij,jk->ik", a_swapped, b_swapped), want)
    assert_close(db.einsum("ij,jk->ik", A, b_swapped).to_numpy(), want)
    assert_close(eds.einsum("ij,jk->ik", a_swapped, b_swapped, join="add", agg="max"),
                 reference("ij,jk->ik", a, b, join="add", agg="max"))


def test_big_endian_graph_inputs_and_callable_results(db):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5))
    w = rng.standard_normal((5, 3))
    g = Graph()
    h = g.einsum("bi,io->bo", g.input("x", (6, 5), "float64"), g.input("w", (5, 3), "float64"))
    got = g.plan().run(db, x=x.astype(">f8"), w=w.astype(">f8")).to_numpy()
    assert_close(got, x @ w)
    assert h.shape == (6, 3)
    # a callable join that answers in big-endian: its values count, not its bytes
    got = eds.einsum("ij,jk->ik", x, w, join=lambda p, q: (p * q).astype(">f8"))
    assert_close(got, x @ w)


def test_pyarrow_arrays_of_numbers_are_arrays():
    assert_close(eds.einsum("i->", pa.array([1.5, 2.0, 3.0])), np.float64(6.5))
    assert_close(eds.einsum("i,i->i", pa.chunked_array([[1, 2], [3]]), np.ones(3, np.int64)),
                 np.array([1, 2, 3]))


class _FakeFrame:
    """Stands in for a pandas/polars DataFrame (the dataframe interchange protocol)."""

    def __dataframe__(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError


class csr_matrix:  # noqa: N801 - named as scipy names it
    """Stands in for a scipy.sparse matrix (scipy is not a dependency)."""

    __module__ = "scipy.sparse._csr"

    def toarray(self):  # pragma: no cover - never called
        raise AssertionError


_FakeFrame.__name__ = "DataFrame"
_FakeFrame.__module__ = "pandas.core.frame"


def _table():
    return pa.table({"i": [0, 1], "j": [1, 0], "value": [2.5, 3.5]})


@pytest.mark.parametrize(
    "make,match",
    [
        (_table, "pyarrow Table is a table.*db.store\\(name, table\\)"),
        (lambda: _table().to_batches()[0], "pyarrow RecordBatch is a table"),
        (lambda: pa.chunked_array([_table().to_struct_array()]), "of structs is a table"),
        (lambda: _table().to_struct_array(), "of structs is a table"),
        (lambda: duckdb.sql("SELECT 1 AS i, 2.5 AS value"), "DuckDB .* is a table"),
        (_FakeFrame, "pandas DataFrame is a table.*db.store"),
        (csr_matrix, "call .toarray\\(\\)"),
        (lambda: pa.array(["a", "b"]), "not numbers"),
        (lambda: pa.array([1.0, None]), "null"),
        (lambda: np.array(["a", "b"]), "holds strings"),
        (lambda: np.array([1, "b"], dtype=object), "Python objects"),
        (lambda: np.array([b"x"]), "bytes strings"),
        (lambda: np.array(["2020-01-01"], dtype="datetime64[D]"), "datetimes"),
        (lambda: np.zeros(2, dtype=[("x", "f8"), ("y", "i4")]), "records"),
        (lambda: np.ma.masked_array([1.0, 2.0], mask=[False, True]), "masked"),
        (lambda: [[1.0, 2.0], [3.0]], "cannot be read as an array"),
        (lambda: None, "Python objects"),
        (lambda: {"a": 1}, "Python objects"),
        (lambda: 2**80, "Python objects"),
        (lambda: np.ones(2, np.longdouble), "unsupported dtype"),
        (lambda: np.ones(2, np.clongdouble), "unsupported dtype"),
    ],
)
def test_what_is_not_an_array_is_refused_with_what_to_do(db, make, match):
    x = make()
    with pytest.raises(EinsumError, match=match):
        as_array(x, "operand 0")
    with pytest.raises(EinsumError, match=match):
        eds.einsum("i->", x)
    with pytest.raises(EinsumError, match="operand 1: .*" + match):
        eds.einsum("i,i->", np.ones(2), x)


@pytest.mark.parametrize(
    "make,match",
    [
        (csr_matrix, "toarray"),
        (lambda: np.array(["a"]), "strings"),
        (lambda: np.ma.masked_array([1.0], mask=[True]), "masked"),
        (lambda: np.ones(2, np.longdouble), "unsupported dtype"),
    ],
)
def test_store_refuses_what_is_not_an_array_and_keeps_nothing(db, make, match):
    before = db.tensors()
    with pytest.raises(EinsumError, match=f"store\\('bad'\\): .*{match}"):
        db.store("bad", make())
    assert db.tensors() == before


def test_masked_array_without_masked_elements_is_its_data():
    a = np.ma.masked_array([1.0, 2.0, 4.0], mask=[False, False, False])
    assert_close(eds.einsum("i->", a), np.float64(7.0))


def test_tiles_are_written_in_native_byte_order():
    from eindecomp_sql.udfs.tiles import array_from_tiles, tiles_from_array

    a = np.arange(12, dtype=">i4").reshape(3, 4)
    table = tiles_from_array(a, (2, 3), ("d0", "d1"))
    np.testing.assert_array_equal(array_from_tiles(table, a.shape, (2, 3), "int32", ("d0", "d1")), a)
