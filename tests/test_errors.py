"""Bad input raises EinsumError (a ValueError) saying what and where; nothing is half-written."""

import duckdb
import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from helpers import backend_tables


@pytest.mark.parametrize(
    "spec,shapes,match",
    [
        ("ij,jk->il", [(2, 3), (3, 4)], "'l' does not appear"),
        ("ij,jk", [(2, 3), (4, 5)], "label 'j' has size 4"),
        ("ij", [(2, 3, 4)], "operand 0 has 3 dimension"),
        ("ij,jk", [(2, 3)], "2 operand\\(s\\) but 1"),
        ("i$j", [(2, 3)], "invalid subscript '\\$'"),
        ("ij->ii", [(2, 3)], "appears more than once"),
        ("i.j", [(2, 3)], "ellipsis"),
        ("ij->i->j", [(2, 3)], "more than one '->'"),
        ("ij-i", [(2, 3)], "stray '-'"),
        ("ii", [(2, 3)], "repeated in operand 0 with different sizes"),
        ("...ij,...jk->ik", [(2, 3, 4), (2, 4, 5)], "no ellipsis"),
    ],
)
def test_spec_errors(spec, shapes, match):
    arrays = [np.ones(s) for s in shapes]
    with pytest.raises(EinsumError, match=match):
        eds.einsum(spec, *arrays)


def test_parse_error_points_at_the_character():
    with pytest.raises(EinsumError) as e:
        eds.einsum("ab,b#->a", np.ones((2, 2)), np.ones((2, 2)))
    lines = str(e.value).splitlines()
    assert lines[-1].index("^") == lines[-2].index("#")


def test_error_is_a_value_error():
    assert issubclass(EinsumError, ValueError)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(join="nope"), "unknown join 'nope'"),
        (dict(agg="mean"), "unknown agg 'mean'"),
        (dict(join="exp"), "unary"),
        (dict(join="x + q"), "unknown name 'q'"),
        (dict(join="x.__class__"), "not allowed"),
        (dict(join="__import__('os')"), "unknown function"),
        (dict(join="x + z"), "operand 'z'"),
        (dict(join="max(x)"), r"max\(\) takes 2 or more argument"),  # was read as x (a trial)
        (dict(join="min(y)"), r"min\(\) takes 2 or more argument"),
        (dict(join="abs(x, y)"), r"abs\(\) takes 1 argument"),
    ],
)
def test_bad_join_agg(kwargs, match):
    with pytest.raises(EinsumError, match=match):
        eds.einsum("ij,jk->ik", np.ones((2, 2)), np.ones((2, 2)), **kwargs)


def test_unsupported_dtype_and_non_numeric(db):
    with pytest.raises(EinsumError, match="unsupported dtype float128"):
        eds.einsum("ij->i", np.ones((2, 2), np.longdouble))
    with pytest.raises(EinsumError, match="unsupported dtype"):
        db.store("c", np.ones(3, np.longdouble))
    with pytest.raises(EinsumError, match="numeric"):
        eds.einsum("i->", np.array(["a", None], dtype=object))


BAD_NAMES = ["A; DROP TABLE eds_catalog; --", "x\" OR 1=1", "a b", "", "1abc", "eds_catalog", "_eds_s1", None, "ä"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names(db, name):
    with pytest.raises(EinsumError, match="name"):
        db.store(name, np.ones(2))
    with pytest.raises(EinsumError):
        db.tensor(name)


@pytest.mark.duckdb_only("the SQL interface")
@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n is not None])
def test_bad_names_in_sql(db, name):
    # inside SQL the error crosses DuckDB, which re-raises it as its own error type
    with pytest.raises(duckdb.Error, match="invalid tensor or table name"):  # an operand may be a table
        db.connection.execute("SELECT * FROM einsum('i->', ?)", [name]).fetchall()
    with pytest.raises(EinsumError, match="invalid tensor or table name"):
        db.einsum("i->", name)


def test_unknown_tensor(db):
    with pytest.raises(EinsumError, match="no stored tensor named 'missing'"):
        db.einsum("ij->i", "missing")


@pytest.mark.duckdb_only("tables of the database")
def test_a_plain_table_given_to_the_python_api_is_named_as_one_with_what_reads_it(db):
    """``db.tensor("E")`` of a table in element form said only "no stored tensor named 'E';
    stored: none", though the table was there and db.einsum and the SQL functions read it."""
    db.connection.execute("CREATE OR REPLACE TABLE plain_e AS SELECT i, j, (i * j + 0.5)::DOUBLE AS value "
                          "FROM range(3) t(i), range(4) s(j)")
    try:
        with pytest.raises(EinsumError, match=r"no stored tensor named 'plain_e'.*'plain_e' is a table or view of the "
                                              r"database.*db.einsum and the SQL functions read it.*db.store\('plain_e_t', "
                                              r"db.connection.table\('plain_e'\)\)"):
            db.tensor("plain_e")
        t = db.store("plain_e_t", db.connection.table("plain_e"))
        want = np.add.outer(np.arange(3.0), np.zeros(4)) * np.arange(4.0) + 0.5
        np.testing.assert_array_equal(db.einsum("ij->i", t).to_numpy(), want.sum(1))
        np.testing.assert_array_equal(db.einsum("ij->i", "plain_e").to_numpy(), want.sum(1))
    finally:
        db.connection.execute("DROP TABLE IF EXISTS plain_e")
        if "plain_e_t" in db.tensors():
            db.drop("plain_e_t")
    with pytest.raises(EinsumError, match=r"^no stored tensor named 'missing'; stored: [^.]*$"):
        db.tensor("missing")


@pytest.mark.duckdb_only("the SQL interface")
def test_unknown_tensor_in_sql(db):
    with pytest.raises(duckdb.Error, match="no stored tensor named 'missing'"):
        db.connection.sql("SELECT * FROM einsum('ij->i', 'missing')").fetchall()


def test_failed_einsum_leaves_nothing(db):
    db.store("fa", np.ones((3, 4)), replace=True)
    db.store("fb", np.ones((4, 2)), replace=True)

    def boom(x, y):
        if x.size > 2:  # passes the dtype probe, fails on real tiles
            raise RuntimeError("kernel exploded")
        return x * y

    before = backend_tables(db)
    with pytest.raises(EinsumError, match="kernel exploded"):
        db.einsum("ij,jk->ik", "fa", "fb", join=boom, out="never")
    assert backend_tables(db) == before
    assert "never" not in db.tensors()
    # a shape error is caught before anything runs, also when the output would be new
    with pytest.raises(EinsumError):
        db.einsum("ij,jk->ik", "fa", "fa", out="never2")
    assert "never2" not in db.tensors()


def test_no_clobber_without_replace(db):
    a = np.arange(6.0).reshape(2, 3)
    db.store("keep", a, replace=True)
    with pytest.raises(EinsumError, match="already exists"):
        db.store("keep", np.zeros((2, 3)))
    with pytest.raises(EinsumError, match="already exists"):
        db.einsum("ij->ji", "keep", out="keep")
    np.testing.assert_array_equal(db.tensor("keep").to_numpy(), a)
    db.einsum("ij->ij", "keep", join="neg", out="keep2")
    db.einsum("ij->ij", "keep", out="keep2", replace=True)
    np.testing.assert_array_equal(db.tensor("keep2").to_numpy(), a)


def test_bad_tile(db):
    with pytest.raises(EinsumError, match="tile"):
        db.store("t", np.ones((4, 4)), tile=(2,))
    with pytest.raises(EinsumError, match="tile"):
        db.store("t", np.ones((4, 4)), tile=(0, 2))


@pytest.mark.parametrize("call", [
    lambda m, a, b: m.einsum("ij,jk->ik", a, b, dtype=np.float32),  # casting='safe' refuses
    lambda m, a, b: m.einsum("ij,jk->ik", a, b, out=np.empty((2, 2), np.int32)),
    lambda m, a, b: m.einsum(a, [0.0, 1.0]),
    lambda m, a, b: m.einsum("ij,jk->ik", a, b, optimize=3.5),
    lambda m, a, b: m.einsum("ij,jk->ik", a, b, dtype="nope"),
    lambda m, a, b: m.einsum("ij,jk->ik", a, b, out=[1]),
])
def test_where_numpy_raises_type_error_so_do_we(call):
    """``except TypeError`` written for np.einsum still catches these (a new user's report);
    they stay EinsumErrors (ValueErrors), the one family."""
    a, b = np.ones((2, 3)), np.ones((3, 2))
    with pytest.raises(TypeError):
        call(np, a, b)  # numpy's own
    with pytest.raises(TypeError) as raised:
        call(eds, a, b)
    assert isinstance(raised.value, eds.EinsumTypeError) and isinstance(raised.value, ValueError)
