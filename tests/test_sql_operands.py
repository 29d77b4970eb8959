"""The SQL interface beyond stored tensors: join := / agg :=, and ordinary tables (element form,
fixed-size array columns) as operands, checked against numpy."""

import re
import threading

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from helpers import assert_close, random_array
from hypothesis import given
from hypothesis import strategies as st
from reference import reference

import eindecomp_sql as eds
from eindecomp_sql import EinsumError

SQL = {"float32": "FLOAT", "float64": "DOUBLE", "int32": "INTEGER", "int64": "BIGINT", "bool": "BOOLEAN",
       "int16": "SMALLINT"}


def elements(con, query, shape, dtype, params=None):
    """The rows of an einsum_elements query as a dense array (missing elements stay 0)."""
    out = np.zeros(shape, dtype)
    rows = con.execute(query, params or []).fetchall()
    assert len(rows) == int(np.prod(shape))
    for r in rows:
        out[tuple(r[:-1])] = r[-1]
    return out


@pytest.fixture
def sdb():
    # small tiles: the plan cuts the tables into several tiles that do not divide the shapes
    s = eds.connect(tile_bytes=96)
    yield s
    s.close()


def put_elements(con, name, a, density=0.6, rng=None, index_type="BIGINT", value_name="v"):
    """Store ``a`` as element rows (a random subset of its elements; the others are 0)."""
    rng = rng or np.random.default_rng(0)
    dense = np.zeros_like(a)
    keep = rng.random(a.shape) < density
    dense[keep] = a[keep]
    cols = ", ".join(f"x{p} {index_type}" for p in range(a.ndim))
    comma = ", " if a.ndim else ""
    con.execute(f'CREATE OR REPLACE TABLE "{name}"({cols}{comma}"{value_name}" {SQL[a.dtype.name]})')
    rows = [tuple(int(q) for q in idx) + (a[idx].item(),) for idx in zip(*np.nonzero(keep))]
    rng.shuffle(rows)  # element rows come in any order
    if rows:
        con.executemany(f'INSERT INTO "{name}" VALUES ({", ".join("?" * (a.ndim + 1))})', rows)
    return dense


# -- join := and agg := ----------------------------------------------------------------------
@pytest.mark.parametrize("join,agg", [("add", "max"), ("sub", "min"), ("relu(x - y)", "sum"), ("max", "prod"),
                                      ("x * y + 1", "max"), (None, "max"), ("add", None)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_join_and_agg_from_sql(join, agg, dtype):
    rng = np.random.default_rng(3)
    a, b = random_array(rng, (7, 5), dtype), random_array(rng, (5, 6), dtype)
    with eds.connect() as db:
        db.store("A", a, tile=(3, 2))
        db.store("B", b, tile=(2, 4))
        args = ", ".join(a for a, v in (("join := ?", join), ("agg := ?", agg)) if v is not None)
        params = [v for v in (join, agg) if v is not None]
        ref_join = {"relu(x - y)": lambda x, y: np.maximum(x - y, 0), "x * y + 1": lambda x, y: x * y + 1}.get(join, join)
        want = reference("ij,jk->ik", a, b, join=ref_join or "mul", agg=agg or "sum")
        got = elements(db.connection, f"SELECT * FROM einsum_elements('ij,jk->ik', 'A', 'B', {args})", want.shape,
                       db.plan("ij,jk->ik", "A", "B", join=join, agg=agg).result.dtype, params)
        assert_close(got, want.astype(got.dtype))
        # the tiled form agrees
        rel = db.connection.execute(f"SELECT * FROM einsum('ij,jk->ik', 'A', 'B', {args})", params)
        assert [d[0] for d in rel.description] == ["i", "k", "tile"]


def test_join_keyword_unquoted_and_bad_join(sdb):
    a = np.arange(6.0).reshape(2, 3) - 2
    sdb.store("A", a)
    got = sdb.connection.sql("SELECT i, value FROM einsum_elements('ij->i', 'A', join := 'relu', agg := 'max') "
                             "ORDER BY i").fetchall()
    assert [v for _, v in got] == list(np.maximum(a, 0).max(1))
    with pytest.raises(duckdb.Error, match="EinsumError") as e:
        sdb.connection.sql("SELECT * FROM einsum('ij->i', 'A', join := 'import os')").fetchall()
    assert "eds_einsum_sql" not in str(e.value)
    with pytest.raises(duckdb.Error, match="agg"):
        sdb.connection.sql("SELECT * FROM einsum('ij->i', 'A', agg := 'median')").fetchall()


# -- element form ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bool", "int16"])
@pytest.mark.parametrize("index_type", ["BIGINT", "INTEGER", "UTINYINT"])
def test_element_table_against_numpy(sdb, dtype, index_type):
    rng = np.random.default_rng(5)
    con = sdb.connection
    # an integer value column must be named 'value' (else every column is an integer)
    value_name = "value" if dtype.startswith("int") else "v"
    e = put_elements(con, "E", random_array(rng, (7, 5), dtype), rng=rng, index_type=index_type, value_name=value_name)
    b = random_array(rng, (5, 6), "float64")
    sdb.store("B", b, tile=(2, 4))
    want = np.einsum("ij,jk->ik", e, b)
    assert_close(elements(con, "SELECT * FROM einsum_elements('ij,jk->ik', 'E', 'B')", want.shape, want.dtype), want)
    # alone, transposed, reduced, and with itself
    for spec, want in (("ij->ji", e.T), ("ij->i", np.einsum("ij->i", e)), ("ij,ij->ij", np.einsum("ij,ij->ij", e, e))):
        n = spec.count(",") + 1
        got = elements(con, f"SELECT * FROM einsum_elements(?{', ?' * n})", want.shape, want.dtype, [spec] + ["E"] * n)
        assert_close(got, want)


def test_element_table_three_dims_value_column_and_view(sdb):
    rng = np.random.default_rng(6)
    con = sdb.connection
    # the value column is named 'value' and is an integer: the name decides
    e = put_elements(con, "T3", random_array(rng, (4, 3, 5), "int64"), rng=rng, value_name="value")
    want = np.einsum("abc->cab", e)
    assert_close(elements(con, "SELECT * FROM einsum_elements('abc->cab', 'T3')", want.shape, want.dtype), want)
    # a view that renames and casts
    con.execute('CREATE VIEW W AS SELECT x2 AS k, x0 AS i, x1 AS j, CAST("value" AS DOUBLE) * 0.5 AS w FROM T3')
    want = np.einsum("ijk->kij", e * 0.5)
    assert_close(elements(con, "SELECT * FROM einsum_elements('kij->kij', 'W')", want.shape, want.dtype), want)


def test_element_table_grows_to_other_operands(sdb):
    rng = np.random.default_rng(8)
    con = sdb.connection
    con.execute("CREATE TABLE S(i BIGINT, j BIGINT, v DOUBLE)")
    con.execute("INSERT INTO S VALUES (0, 1, 2.5), (2, 0, -1.0)")  # largest index (2, 1)
    b = random_array(rng, (4, 6), "float64")
    sdb.store("B", b, tile=(3, 4))
    dense = np.zeros((3, 4))
    dense[0, 1], dense[2, 0] = 2.5, -1.0
    want = dense @ b
    assert_close(elements(con, "SELECT * FROM einsum_elements('ij,jk->ik', 'S', 'B')", want.shape, want.dtype), want)
    # a repeated label takes the larger of its two index columns: diagonal of a 3x3
    want = np.einsum("ii->i", dense[:3, :3])
    assert_close(elements(con, "SELECT * FROM einsum_elements('ii->i', 'S')", (3,), "float64"), want)
    # an index beyond the other operand's size is an error naming both
    sdb.store("C", rng.standard_normal((2, 2)))
    with pytest.raises(duckdb.Error, match=r"table 'S' \(operand 0\) has i up to 2, but operand 1 gives i's label 'i' size 2"):
        con.sql("SELECT * FROM einsum('ij,ij->ij', 'S', 'C')").fetchall()
    # a size-1 dimension of another operand broadcasts, as in numpy
    c1 = rng.standard_normal((1, 2))
    sdb.store("C1", c1)
    want = dense[:, :2] * c1
    assert_close(elements(con, "SELECT * FROM einsum_elements('ij,ij->ij', 'S', 'C1')", (3, 2), "float64"), want)


def test_empty_and_scalar_element_tables(sdb):
    con = sdb.connection
    con.execute("CREATE TABLE Z(i BIGINT, j BIGINT, v DOUBLE)")
    b = np.arange(12.0).reshape(3, 4)
    sdb.store("B", b)
    got = elements(con, "SELECT * FROM einsum_elements('ij,jk->ik', 'Z', 'B')", (0, 4), "float64")
    assert got.shape == (0, 4)
    con.execute("CREATE TABLE Z1(value FLOAT)")
    con.execute("INSERT INTO Z1 VALUES (2.5)")
    want = np.float32(2.5) * b.astype(np.float32)
    got = elements(con, "SELECT * FROM einsum_elements(',jk->jk', 'Z1', 'B')", (3, 4), "float64")
    assert_close(got, want.astype(np.float64))


def test_element_table_errors(sdb):
    con = sdb.connection
    cases = [
        ("CREATE TABLE D(i BIGINT, j BIGINT, v DOUBLE); INSERT INTO D VALUES (0, 1, 1.0), (2, 0, 1.5), (0, 1, 2.0)",
         "D", "ij", r"table 'D' has more than one row for element \(i=0, j=1\)"),
        ("CREATE TABLE N(i BIGINT, v DOUBLE); INSERT INTO N VALUES (0, 1.0), (-3, 2.0)",
         "N", "i", r"table 'N': index column 'i' has negative values \(min -3\)"),
        ("CREATE TABLE U(i BIGINT, v DOUBLE); INSERT INTO U VALUES (0, 1.0), (NULL, 2.0)",
         "U", "i", r"table 'U': index column 'i' has 1 NULL"),
        ("CREATE TABLE UV(i BIGINT, v DOUBLE); INSERT INTO UV VALUES (0, NULL)",
         "UV", "i", r"table 'UV': value column 'v' has 1 NULL"),
        # the view to write is spelt with the table's own columns (it said "w AS value" always)
        ("CREATE TABLE AI(i BIGINT, n BIGINT)", "AI", "i",
         r'all its columns \(i, n\) are integers.*SELECT "i", "n" AS value FROM "AI"'),
        ("CREATE TABLE TV(i BIGINT, a DOUBLE, b DOUBLE)", "TV", "i",
         r'2 columns are not integers \(a, b\).*SELECT "i", "a" AS value FROM "TV"'),
        ("CREATE TABLE ST(i VARCHAR, value DOUBLE)", "ST", "i", r"column 'i' is VARCHAR, .* must be an integer"),
        ("CREATE TABLE LS(id BIGINT, a FLOAT[]); INSERT INTO LS VALUES (0, [1, 2]), (1, [3])", "LS", "ij",
         r"list column 'a' holds lists of 1 to 2 elements"),
        ("CREATE TABLE HU(i BIGINT, v DOUBLE); INSERT INTO HU VALUES (1099511627776, 1.0)",
         "HU", "i", r"goes up to 1099511627776"),
    ]
    for create, name, sub, message in cases:
        con.execute(create)
        with pytest.raises(duckdb.Error, match=message) as e:
            con.sql("SELECT * FROM einsum_elements(?, ?)", params=[f"{sub}->{sub}", name]).fetchall()
        # our words, not a binder message naming our functions
        assert "EinsumError" in str(e.value) and "Binder" not in str(e.value), str(e.value)


def test_decimal_and_hugeint_values_are_read_as_double_and_bigint(sdb):
    """DuckDB's type of a literal such as 1.5 (DECIMAL) and of sum() over integers (HUGEINT) and
    decimals (DECIMAL(38, s)) were refused as values: a trial's first table. They are read as
    DOUBLE and BIGINT, in SQL and by store() alike; a HUGEINT beyond BIGINT fails the cast."""
    con = sdb.connection
    con.execute("CREATE TABLE DL AS SELECT * FROM (VALUES (0, 0, 1.5), (1, 2, -2.25)) v(i, j, value)")
    con.execute("CREATE TABLE SU AS SELECT i, sum(x) AS value FROM (VALUES (0, 3), (0, 4), (2, 5)) v(i, x) GROUP BY i")
    con.execute("CREATE TABLE SD AS SELECT i, sum(x) AS value FROM (VALUES (0, 0.5), (1, 0.25)) v(i, x) GROUP BY i")
    con.execute("CREATE TABLE HK AS SELECT range::HUGEINT AS i, range * 0.5 AS value FROM range(3)")
    con.execute("CREATE TABLE DZ AS SELECT range AS i, (range * 3)::DECIMAL(10, 0) AS value FROM range(3)")
    types = {t: con.execute(f"SELECT typeof(value) FROM {t} LIMIT 1").fetchall()[0][0]
             for t in ("DL", "SU", "SD", "HK", "DZ")}
    assert types == {"DL": "DECIMAL(3,2)", "SU": "HUGEINT", "SD": "DECIMAL(38,2)", "HK": "DECIMAL(21,1)",
                     "DZ": "DECIMAL(10,0)"}, types
    # (a DECIMAL of scale 0 is a DECIMAL: float64 in SQL and store alike; only HUGEINT is BIGINT)
    want = {"DL": np.array([[1.5, 0, 0], [0, 0, -2.25]]), "SU": np.array([7, 0, 5]), "SD": np.array([0.5, 0.25]),
            "HK": np.array([0, 0.5, 1.0]), "DZ": np.array([0.0, 3.0, 6.0])}
    for t, w in want.items():
        spec = "ij->ij" if w.ndim == 2 else "i->i"
        rows = con.execute(f"SELECT * FROM einsum_elements('{spec}', '{t}')").fetchall()
        got = np.zeros(w.shape, dtype=w.dtype)
        for *idx, v in rows:
            got[tuple(idx)] = v
        np.testing.assert_array_equal(got, w)
        stored = sdb.store(f"s_{t}", con.table(t), replace=True).to_numpy()
        np.testing.assert_array_equal(stored, w)
        assert stored.dtype == w.dtype
    con.execute("CREATE TABLE BIG AS SELECT 0 AS i, (2::HUGEINT ** 70)::HUGEINT AS value")
    with pytest.raises(duckdb.Error, match="(?i)out of range|overflow|can't be cast|cannot be"):
        con.execute("SELECT * FROM einsum_elements('i->i', 'BIG')").fetchall()
    with pytest.raises(EinsumError, match="column 'value'"):
        sdb.store("s_big", con.table("BIG"))


def test_a_tiled_file_and_another_schemas_table_are_told_what_to_do(sdb, tmp_path):
    con = sdb.connection
    sdb.store("TT", np.ones((3, 4)), tile=(2, 2)).to_parquet(tmp_path / "t.parquet")
    con.execute(f"CREATE VIEW tv AS SELECT * FROM '{tmp_path / 't.parquet'}'")
    with pytest.raises(duckdb.Error, match=r"'tile' is BLOB; .*db\.store\(\) the file"):
        con.execute("SELECT * FROM einsum_elements('ij->i', 'tv')").fetchall()
    con.execute("CREATE SCHEMA IF NOT EXISTS s1; CREATE OR REPLACE TABLE s1.t AS SELECT 0::BIGINT AS i, 1.0::DOUBLE AS value")
    with pytest.raises(duckdb.Error, match=r"'s1\.t' names a table of another schema .* make a view there"):
        con.execute("SELECT * FROM einsum_elements('i->', 's1.t')").fetchall()


def test_dictionary_columns_are_decoded(sdb):
    """A pandas category or an Arrow dictionary column (refused as "no integer columns") is
    read as its values, as a Parquet file of it already was."""
    import pandas as pd

    frame = pd.DataFrame({"i": pd.Categorical([2, 0, 1]), "value": [1.0, 2.0, 3.0]})
    np.testing.assert_array_equal(sdb.store("cat", frame, replace=True).to_numpy(), [2.0, 3.0, 1.0])
    t = pa.table({"i": pa.array([1, 0]).dictionary_encode(), "v": pa.array([4.5, 5.5]).dictionary_encode()})
    np.testing.assert_array_equal(sdb.store("dic", t, replace=True).to_numpy(), [5.5, 4.5])


def test_size_mismatch_names_the_operands(sdb):
    sdb.store("A", np.ones((2, 3)))
    sdb.store("B", np.ones((4, 2)))
    con = sdb.connection
    con.execute("CREATE TABLE E3(i BIGINT, j BIGINT, v DOUBLE); INSERT INTO E3 VALUES (4, 1, 1.0)")
    with pytest.raises(duckdb.Error, match=r"table 'E3' \(operand 1\) has i up to 4, but operand 0 gives i's label "
                                           r"'j' size 3"):
        con.sql("SELECT * FROM einsum('ij,jk->ik', 'A', 'E3')").fetchall()
    con.execute("CREATE TABLE E4(i BIGINT, j BIGINT, v DOUBLE); INSERT INTO E4 VALUES (1, 1, 1.0)")
    with pytest.raises(duckdb.Error, match=r"(?s)label 'j' has size 4 .* operands: 0 = stored tensor 'A', shape "
                                           r"\(2, 3\); 1 = stored tensor 'B', shape \(4, 2\); 2 = table 'E4' "
                                           r"\(element form: indices i, j, value v\), shape \(2, 2\)"):
        con.sql("SELECT * FROM einsum('ij,jk,kl->il', 'A', 'B', 'E4')").fetchall()


def test_wrong_number_of_subscripts_names_the_table(sdb):
    sdb.connection.execute("CREATE TABLE E2(i BIGINT, j BIGINT, v DOUBLE)")
    with pytest.raises(duckdb.Error, match=r"table 'E2' .* 2 index column\(s\), but its subscripts 'ijk' name 3"):
        sdb.connection.sql("SELECT * FROM einsum('ijk->i', 'E2')").fetchall()


def test_a_temp_table_or_view_over_an_operands_name_is_refused_not_read_past(sdb):
    """In the caller's SQL a bare name means its TEMP table; the operand is read from the
    database. einsum_elements('i->', 'sh') summed main.sh beside a TEMP sh (a silent wrong
    answer, found by a new user): the query now stops, naming the table."""
    con = sdb.connection
    con.execute("CREATE TABLE sh(i BIGINT, value DOUBLE); INSERT INTO sh VALUES (0, 1), (1, 2)")
    assert con.sql("SELECT * FROM einsum_elements('i->', 'sh')").fetchall() == [(3.0,)]
    con.execute("CREATE TEMP TABLE sh(i BIGINT, value DOUBLE); INSERT INTO sh VALUES (0, 1000)")
    # ... also where the caller's query keeps no row of the result (the check on the result's
    # rows never ran there: a review)
    for query in ("SELECT * FROM einsum_elements('i->', 'sh')", "SELECT * FROM einsum('i,i->', 'SH', 'sh')",
                  "SELECT * FROM einsum_topk('i->i', 1, 'sh')", "SELECT * FROM einsum_elements('i->i', 'sh') "
                  "WHERE value > 5", "SELECT count(*) FROM einsum_elements('i->i', 'sh') WHERE value < -1"):
        with pytest.raises(duckdb.Error, match=r"TEMP table or view named '(sh|SH)', as the table the einsum reads"):
            con.sql(query).fetchall()
    con.execute("DROP TABLE temp.main.sh")
    con.execute("CREATE TEMP VIEW sh AS SELECT 0::BIGINT AS i, 5.0::DOUBLE AS value")
    with pytest.raises(duckdb.Error, match="TEMP table or view named 'sh'"):
        con.sql("SELECT * FROM einsum_elements('i->', 'sh')").fetchall()
    con.execute("DROP VIEW temp.main.sh")
    assert con.sql("SELECT * FROM einsum_elements('i->', 'sh')").fetchall() == [(3.0,)]
    # a TEMP table of another name, or over a stored tensor's name, does not stop it
    sdb.store("T", np.arange(3.0))
    con.execute("CREATE TEMP TABLE other(i BIGINT, value DOUBLE)")
    con.execute("CREATE TEMP TABLE t(i BIGINT, value DOUBLE)")
    assert con.sql("SELECT * FROM einsum_elements('i,i->', 'sh', 'T')").fetchall() == [(2.0,)]


def test_unknown_temp_and_uncommitted_tables(sdb):
    con = sdb.connection
    with pytest.raises(duckdb.Error, match=r"no stored tensor named 'Nope', nor a table or view"):
        con.sql("SELECT * FROM einsum('i->i', 'Nope')").fetchall()
    con.execute("CREATE TEMP TABLE TT(i BIGINT, v DOUBLE)")
    with pytest.raises(duckdb.Error, match="TEMP tables"):
        con.sql("SELECT * FROM einsum('i->i', 'TT')").fetchall()
    with pytest.raises(duckdb.Error, match="operand 1 is NULL but operand 2 is given"):
        con.sql("SELECT * FROM einsum('i,i,i->i', 'TT', NULL, 'TT')").fetchall()
    with pytest.raises(duckdb.Error, match="spec is NULL"):
        con.sql("SELECT * FROM einsum(NULL, 'TT')").fetchall()
    with pytest.raises(duckdb.Error, match="invalid tensor or table name"):
        con.sql("SELECT * FROM einsum('i->i', 'x; DROP TABLE TT')").fetchall()


def test_an_element_table_grown_by_another_connection_is_not_read_with_phantom_rows():
    """The shape is planned from the committed rows (read on a cursor of its own), the query
    reads its own snapshot: in a transaction begun before another connection's insert, the
    10 x 4 table the query sees came back as 20 rows, the last 10 zeros, in silence (a trial).
    Now the rows the query sees must be those counted, or it stops; after COMMIT it reads all."""
    with eds.connect() as db:
        con = db.connection
        con.execute("CREATE TABLE G(i BIGINT, j BIGINT, v DOUBLE)")
        con.execute("INSERT INTO G SELECT i, j, (i * 16 + j)::DOUBLE FROM range(10) t(i), range(4) s(j)")
        con.execute("BEGIN")
        con.execute("SELECT count(*) FROM G").fetchall()  # the transaction's snapshot: 10 x 4
        con.cursor().execute("INSERT INTO G SELECT i, j, 1.0 FROM range(10, 20) t(i), range(4) s(j)")
        with pytest.raises(duckdb.Error, match=r"table 'G' changed while einsum read it \(its shape \(20, 4\) was "
                                               r"planned from 80 committed rows; this query sees 40 rows"):
            con.execute("SELECT * FROM einsum_elements('ij->i', 'G')").fetchall()
        con.execute("COMMIT")
        want = np.concatenate([np.arange(10) * 64 + 6.0, np.full(10, 4.0)])
        got = elements(con, "SELECT * FROM einsum_elements('ij->i', 'G')", (20,), np.float64)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(db.einsum("ij->i", "G").to_numpy(), want)


def run_with_timeout(fn, seconds=60):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it deadlocks."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the query did not finish: deadlock?"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("threads", [1, 4])
def test_no_deadlock_in_transactions(sdb, threads):
    """The planning UDF reads tables on a cursor while the user's query (and transaction) holds
    the connection: it must neither hang nor read what the transaction has not committed."""
    con = sdb.connection
    con.execute(f"SET threads = {threads}")
    rng = np.random.default_rng(9)
    e = put_elements(con, "E", random_array(rng, (6, 4), "float64"), rng=rng)
    want = e.sum(1)
    con.execute("BEGIN")
    try:
        con.execute("CREATE TABLE OTHER AS SELECT 1 AS x")  # a write pending in this transaction
        got = run_with_timeout(lambda: elements(con, "SELECT * FROM einsum_elements('ij->i', 'E')", (6,), "float64"))
        assert_close(got, want)
        # a table made in this transaction is invisible to the cursor: our message, no hang
        con.execute("CREATE TABLE NEW(i BIGINT, v DOUBLE)")
        with pytest.raises(duckdb.Error, match="not yet committed"):
            run_with_timeout(lambda: con.sql("SELECT * FROM einsum('i->i', 'NEW')").fetchall())
    finally:
        con.execute("ROLLBACK")
    # rows this transaction added beyond the committed shape stop the query with our message
    con.execute("BEGIN")
    try:
        con.execute("INSERT INTO E VALUES (40, 0, 1.0)")
        with pytest.raises(duckdb.Error, match="changed after einsum read its shape"):
            run_with_timeout(lambda: con.sql("SELECT * FROM einsum_elements('ij->i', 'E')").fetchall())
    finally:
        con.execute("ROLLBACK")
    con.execute("RESET threads")


# -- array form ------------------------------------------------------------------------------
@pytest.mark.parametrize("elem", ["FLOAT", "DOUBLE", "INTEGER"])
@pytest.mark.parametrize("key_type", ["BIGINT", "VARCHAR"])
def test_array_table_against_numpy(sdb, elem, key_type):
    rng = np.random.default_rng(10)
    dtype = {"FLOAT": "float32", "DOUBLE": "float64", "INTEGER": "int32"}[elem]
    con = sdb.connection
    rows, width = 11, 3
    emb = random_array(rng, (rows, width), dtype)
    ids = rng.permutation(1000)[:rows]  # keys in no order, not 0..n-1
    keys = [int(i) if key_type == "BIGINT" else f"item{i:04d}" for i in ids]
    con.execute(f"CREATE TABLE emb(id {key_type}, vec {elem}[{width}])")
    con.executemany("INSERT INTO emb VALUES (?, ?)", [(k, r.tolist()) for k, r in zip(keys, emb)])
    ordered = emb[np.argsort(np.array(keys, dtype=object).astype(str if key_type == "VARCHAR" else np.int64),
                             kind="stable")]
    q = random_array(rng, (4, width), dtype)
    sdb.store("Q", q, tile=(3, 2))
    want = np.einsum("id,jd->ij", q, ordered)
    got = elements(con, "SELECT * FROM einsum_elements('id,jd->ij', 'Q', 'emb')", want.shape, want.dtype)
    assert_close(got, want)
    # the table alone is the matrix in key order; rows in several tiles (numbered by a window)
    assert "row_number" in sdb._einsum_sql("ij->ij", ["emb"], "tiles").lower()
    assert_close(elements(con, "SELECT * FROM einsum_elements('ij->ij', 'emb')", ordered.shape, ordered.dtype), ordered)
    # and in one tile (one ordered list, no window)
    saved = sdb.tile_bytes, sdb.store_tile_bytes
    sdb.tile_bytes = sdb.store_tile_bytes = 1 << 20  # a table is cut as a store cuts it
    try:
        assert "row_number" not in sdb._einsum_sql("ij->ij", ["emb"], "tiles").lower()
        assert_close(elements(con, "SELECT * FROM einsum_elements('ij->ij', 'emb')", ordered.shape, ordered.dtype),
                     ordered)
    finally:
        sdb.tile_bytes, sdb.store_tile_bytes = saved


def test_array_table_errors(sdb):
    con = sdb.connection
    con.execute("CREATE TABLE a1(id BIGINT, v FLOAT[2]); INSERT INTO a1 VALUES (1, [1, NULL])")
    con.execute("CREATE TABLE a2(id BIGINT, v FLOAT[2]); INSERT INTO a2 VALUES (1, [1, 2]), (1, [3, 4])")
    con.execute("CREATE TABLE a3(id BIGINT, name VARCHAR, v FLOAT[2])")
    con.execute("CREATE TABLE a4(v FLOAT[2])")
    con.execute("CREATE TABLE a5(id BIGINT, v FLOAT[2]); INSERT INTO a5 VALUES (1, NULL)")
    con.execute("CREATE TABLE a6(id BIGINT, v FLOAT[2][2])")
    for name, message in (("a1", "column 'v' has NULL elements"), ("a2", "key column 'id' repeats values"),
                          ("a3", r"and 2 other columns \(id, name\)"), ("a4", "and no other column"),
                          ("a5", "array column 'v' is NULL in 1 row"), ("a6", "only one-dimensional arrays")):
        with pytest.raises(duckdb.Error, match=message) as e:
            con.sql("SELECT * FROM einsum('ij->i', ?)", params=[name]).fetchall()
        assert "EinsumError" in str(e.value)


@pytest.mark.parametrize("tile_bytes", [None, 96])  # one tile of rows (no numbering), 8 tiles
def test_an_array_tables_keys_repeated_in_the_callers_transaction_are_refused(tile_bytes):
    """The statistics read the committed rows (unique keys); an UPDATE in the caller's open
    transaction repeated one, and with one tile of rows the two were packed in either order, in
    silence (a trial)."""
    with eds.connect(tile_bytes=tile_bytes) as db:
        con = db.connection
        con.execute("CREATE TABLE R AS SELECT range AS k, [range, range + 1]::DOUBLE[2] AS a FROM range(40)")
        want = [(i, 2.0 * i + 1) for i in range(40)]
        assert con.sql("SELECT * FROM einsum_elements('ij->i', 'R') ORDER BY 1").fetchall() == want
        con.execute("BEGIN")
        con.execute("UPDATE R SET k = 0 WHERE k = 1")
        with pytest.raises(duckdb.Error, match=r"table 'R'(: key column 'k' repeats values in this transaction|"
                                               r" changed while einsum read it)"):
            con.sql("SELECT * FROM einsum_elements('ij->i', 'R')").fetchall()
        con.execute("ROLLBACK")
        assert con.sql("SELECT * FROM einsum_elements('ij->i', 'R') ORDER BY 1").fetchall() == want


def test_the_hint_for_null_array_elements_is_sql_that_runs(sdb):
    """The error's suggested replacement runs as written in a view (it named a column 'a' and
    used the arrow lambda DuckDB 2.0 refuses: a trial)."""
    con = sdb.connection
    con.execute('CREATE TABLE items(id BIGINT, "my emb" DOUBLE[2]); INSERT INTO items VALUES (0, [1, NULL]), (1, [3, 4])')
    with pytest.raises(duckdb.Error, match="NULL elements") as e:
        con.sql("SELECT * FROM einsum_elements('ij->j', 'items')").fetchall()
    suggested = re.search(r"replace them in a view \((.*)\) or leave", str(e.value)).group(1)
    con.execute(f"CREATE VIEW items2 AS SELECT id, {suggested} FROM items")
    assert con.sql("SELECT * FROM einsum_elements('ij->j', 'items2') ORDER BY 1").fetchall() == [(0, 4.0), (1, 4.0)]


def test_sql_operand_mix_with_join(sdb):
    """An element table, an array table and a stored tensor in one extended einsum."""
    rng = np.random.default_rng(12)
    con = sdb.connection
    e = put_elements(con, "E", random_array(rng, (5, 3), "float64"), rng=rng)
    m = random_array(rng, (3, 4), "float64")
    con.execute("CREATE TABLE M(id BIGINT, v DOUBLE[4])")
    con.executemany("INSERT INTO M VALUES (?, ?)", [(i, r.tolist()) for i, r in enumerate(m)])
    c = random_array(rng, (4,), "float64")
    sdb.store("C", c, tile=(3,))
    want = reference("ij,jk,k->ik", e, m, c, join=lambda x, y, z: x + y * z, agg="max")
    got = elements(con, "SELECT * FROM einsum_elements('ij,jk,k->ik', 'E', 'M', 'C', join := 'x + y * z', "
                        "agg := 'max')", want.shape, want.dtype)
    assert_close(got, want)


def test_the_python_api_reads_tables_as_the_sql_functions_do(sdb):
    """``db.einsum`` on a table of the database said "no stored tensor named 'E'" though SQL's
    einsum() read it: an element table, an array table, a stored tensor and an array in one
    extended einsum, written to out=, each table read once into a TEMP table that goes after;
    a table's own faults are EinsumErrors, as in SQL."""
    rng = np.random.default_rng(13)
    con = sdb.connection
    e = put_elements(con, "E", random_array(rng, (7, 5), "float64"), rng=rng)
    m = random_array(rng, (5, 4), "float32")
    con.execute("CREATE TABLE M(id BIGINT, v FLOAT[4])")
    order = rng.permutation(5)
    con.executemany("INSERT INTO M VALUES (?, ?)", [(int(10 * i), m[i].tolist()) for i in order])
    sdb.store("C", c := random_array(rng, (4,), "float64"), tile=(3,))
    x = random_array(rng, (7,), "float64")
    before = set(con.sql("SELECT table_name FROM duckdb_tables()").fetchall())
    got = sdb.einsum("ij,jk,k,i->ik", "E", "M", "C", x, join=lambda a, b, cc, d: a + b * cc - d, agg="max", out="R")
    want = reference("ij,jk,k,i->ik", e, m, c, x, join=lambda a, b, cc, d: a + b * cc - d, agg="max")
    assert_close(got.to_numpy(), want)
    assert_close(sdb.einsum_numpy("ij,ij->i", "E", "E"), (e * e).sum(1))  # one table twice: read once
    assert_close(sdb.einsum("ij->j", "E").to_numpy(), e.sum(0))
    said = sdb.explain("ij->j", "E")
    assert "_eds_op0: shape (7, 5) float64" in said and "_eds_op0 is table 'E' (element form" in said
    assert set(con.sql("SELECT table_name FROM duckdb_tables()").fetchall()) == before | {("R",)}
    # the packed TEMP tables live on the session's cursor, which db.connection does not see
    assert not sdb.backend._run("SELECT table_name FROM duckdb_tables() WHERE temporary AND table_name LIKE '_eds_t%'")
    con.execute("CREATE TABLE D2(i BIGINT, j BIGINT, v DOUBLE); INSERT INTO D2 VALUES (0, 1, 1.0), (0, 1, 2.0)")
    con.execute("CREATE TABLE N2(i BIGINT, v DOUBLE); INSERT INTO N2 VALUES (0, 1.0), (-3, 2.0)")
    for name, sub, message in (("D2", "ij", r"^einsum\(\): table 'D2' has more than one row for element \(i=0, j=1\)"),
                               ("N2", "i", r"table 'N2': index column 'i' has negative values")):
        with pytest.raises(EinsumError, match=message):
            sdb.einsum(f"{sub}->{sub}", name)
    with pytest.raises(EinsumError, match=r"table 'E' \(operand 0\) has x0 up to 6, but operand 1 gives x0's label 'i' size 3"):
        sdb.einsum("ij,i->j", "E", np.ones(3))
    assert set(con.sql("SELECT table_name FROM duckdb_tables()").fetchall()) == before | {("R",), ("D2",), ("N2",)}


def test_a_table_under_a_budget_is_packed_in_statements_that_fit_and_runs_where_sql_cannot(tmp_path):
    """Under a budget, db.einsum packs a table in tiles and bands of statements that fit
    DuckDB's limit (one statement of a 1500² table's element rows ran out of memory under
    memory="100MB"), and runs the plans the SQL function refuses (a step in several
    statements), which its refusal tells the user to do."""
    n = 1000
    with eds.connect(str(tmp_path / "t.db"), memory="40MB") as db:
        db.connection.execute(f"CREATE TABLE E AS SELECT i, j, ((i * 7 + j * 3) % 11 - 5)::DOUBLE AS value "
                              f"FROM range({n}) t(i), range({n}) s(j) WHERE (i + j) % 4 <> 1")
        i = np.arange(n)
        e = ((i[:, None] * 7 + i[None, :] * 3) % 11 - 5).astype(float)
        e[(i[:, None] + i[None, :]) % 4 == 1] = 0
        bands = []
        pack_bands = db.backend._pack_bands
        db.backend._pack_bands = lambda op, v: bands.append(pack_bands(op, v)) or bands[-1]
        np.testing.assert_array_equal(db.einsum("ij->i", "E").to_numpy(), e.sum(1))
        assert len(bands) == 1 and len(bands[0][1]) > 1, bands
        m = e[:500, :500]
        db.connection.execute("CREATE VIEW F AS SELECT * FROM E WHERE i < 500 AND j < 500")
        # rows deleted between the statistics and the packing: the bands read one snapshot and
        # count it (each band in a snapshot of its own gave zeros in silence: a review)
        stats = db.backend.table_operand
        db.backend.table_operand = lambda name: (stats(name), db.connection.execute("DELETE FROM E WHERE i >= 900"))[0]
        with pytest.raises(EinsumError, match=r"table 'E' changed while einsum read it \(planned from \d+ rows; "):
            db.einsum("ij->i", "E")
        db.backend.table_operand = stats
        assert len(bands) == 2 and len(bands[1][1]) > 1, bands
        # a wide table: its tiles along its second axis, the bands too (it was refused: a review)
        db.connection.execute("CREATE TABLE W AS SELECT i, j, (i + j % 7)::DOUBLE AS value FROM range(3) t(i), "
                              "range(400000) s(j)")
        j = np.arange(400000) % 7
        np.testing.assert_array_equal(db.einsum_numpy("ij->i", "W"), [(i + j).sum() for i in range(3)])
        assert bands[-1][0] == 1 and len(bands[-1][1]) > 1, bands[-1]
        db.close()
    with eds.connect(str(tmp_path / "t.db"), memory="16MB") as db:
        with pytest.raises(duckdb.Error, match=r"as \d+ statements, but a SQL table function is one query; call "
                                               r"db.einsum\(\.\.\.\)"):
            db.connection.sql("SELECT count(*) FROM einsum('ij,jk->ik', 'F', 'F')").fetchall()
        np.testing.assert_allclose(db.einsum("ij,jk->ik", "F", "F").to_numpy(), m @ m, rtol=1e-12)


def test_a_table_packed_bigger_than_duckdbs_limit_is_packed_in_parts_and_runs():
    """DuckDB reads a row group's blobs whole: a 3000² float64 element table packed into one
    TEMP table (72 MB of tiles) failed to pin under memory="150MB" (DuckDB's limit 83 MB) where
    the same tensor stored ran (a trial). Packed as TEMP tables of a part each behind a view,
    as a stored tensor is kept, it runs and matches numpy, and nothing packed is left."""
    n = 3000
    rng = np.random.default_rng(5)
    idx = rng.integers(0, n, size=(300, 2))
    idx[0] = (n - 1, n - 1)
    with eds.connect(memory="150MB") as db:
        con = db.connection
        t = pa.table({"i": idx[:, 0], "j": idx[:, 1], "value": rng.standard_normal(300)})  # noqa: F841 - read by SQL
        con.execute("CREATE TABLE sp AS SELECT i, j, sum(value) AS value FROM t GROUP BY i, j")
        dense = np.zeros((n, n))
        for i, j, v in con.execute("SELECT * FROM sp").fetchall():
            dense[i, j] = v
        w = rng.standard_normal((n, 64))
        packs = []
        pack_bands = db.backend._pack_bands
        db.backend._pack_bands = lambda op, v: packs.append(pack_bands(op, v)) or packs[-1]
        np.testing.assert_allclose(db.einsum_numpy("ij,ik->jk", "sp", w), dense.T @ w, rtol=1e-10, atol=1e-12)
        assert len(packs) == 1 and packs[0][2] and len(packs[0][1]) > 1, packs
        assert db.backend._run("SELECT count(*) FROM duckdb_tables() WHERE temporary")[0][0] == 0
        assert db.backend._run("SELECT count(*) FROM duckdb_views() WHERE temporary AND NOT internal")[0][0] == 0


def test_dense_form_too_large_is_refused(sdb):
    con = sdb.connection
    con.execute("CREATE TABLE SP(i BIGINT, j BIGINT, v DOUBLE); INSERT INTO SP VALUES (0, 0, 1.0), "
                "(1000000000, 1000000000, 2.0)")
    with pytest.raises(duckdb.Error, match=r"table 'SP' .* is read as a dense \(1000000001, 1000000001\) float64"):
        con.sql("SELECT * FROM einsum('ij->i', 'SP')").fetchall()
    with eds.connect(memory="1MB") as small:
        small.connection.execute("CREATE TABLE SQ(i BIGINT, j BIGINT, v DOUBLE); INSERT INTO SQ VALUES (999, 999, 1.0)")
        # in units that tell the two apart (GiB to one decimal said "0.0 GiB, more than ... (0.0 GiB)")
        with pytest.raises(duckdb.Error, match=r"tensor of 8\.0 MB, more than the session's memory budget \(1\.0 MB\)"):
            small.connection.sql("SELECT * FROM einsum('ij->i', 'SQ')").fetchall()


@st.composite
def table_case(draw):
    """An element table of 1-3 dimensions (sizes 1-7, random density), a permutation or a
    reduction of it, the session's tile bytes (so tiles rarely divide the shape), a dtype."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    labels = "abc"[:ndim]
    out = "".join(draw(st.permutations(labels))[: draw(st.integers(0, ndim))])
    return shape, f"{labels}->{out}", draw(st.sampled_from([8, 24, 40, 200, 1 << 20])), \
        draw(st.sampled_from(["float32", "float64", "int32", "int64", "bool"])), \
        draw(st.floats(0.0, 1.0)), draw(st.integers(0, 2**32 - 1))


@pytest.fixture(scope="module")
def pdb():
    s = eds.connect()
    yield s
    s.close()


@given(table_case())
def test_element_tables_property(pdb, case):
    shape, spec, tile_bytes, dtype, density, seed = case
    rng = np.random.default_rng(seed)
    pdb.tile_bytes = tile_bytes  # how finely the plan may cut the table
    con = pdb.connection
    e = random_array(rng, shape, dtype)
    keep = rng.random(shape) < density
    keep[tuple(n - 1 for n in shape)] = True  # the largest index present decides the shape
    e[~keep] = 0
    idx = np.nonzero(keep)
    order = rng.permutation(idx[0].size)  # element rows in any order
    cols = {f"x{p}": idx[p][order].astype(np.int64) for p in range(len(shape))}
    con.register("_rows", pa.table({**cols, "value": e[idx][order]}))
    con.execute("CREATE OR REPLACE TABLE E AS SELECT * FROM _rows")
    con.unregister("_rows")
    want = np.einsum(spec, e)
    got = elements(con, "SELECT * FROM einsum_elements(?, 'E')", want.shape, want.dtype, [spec])
    assert_close(got, want)
    # the Python API reads the table as the SQL function does (packed before the plan runs)
    assert_close(pdb.einsum_numpy(spec, "E"), want)


def test_sql_einsum_next_to_python_einsum_in_threads():
    """A thread running SQL einsums over a table (the planning UDF takes the session's lock to
    read the catalog) next to one running Python einsums (which hold that lock while they run):
    both finish, with numpy's answers."""
    rng = np.random.default_rng(13)
    with eds.connect() as db:
        con = db.connection
        e = put_elements(con, "E", random_array(rng, (9, 6), "float64"), rng=rng)
        b = random_array(rng, (6, 5), "float64")
        db.store("B", b, tile=(4, 4))
        want = e @ b
        errors = []

        def sql_side():
            try:
                for _ in range(15):
                    got = elements(con, "SELECT * FROM einsum_elements('ij,jk->ik', 'E', 'B')", want.shape, want.dtype)
                    assert_close(got, want)
            except BaseException as x:  # noqa: BLE001 - reported below
                errors.append(x)

        def python_side():
            try:
                for _ in range(15):
                    assert_close(db.einsum_numpy("jk,kl->jl", "B", b.T.copy()), b @ b.T)
            except BaseException as x:  # noqa: BLE001 - reported below
                errors.append(x)

        threads = [threading.Thread(target=f, daemon=True) for f in (sql_side, python_side)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "deadlock"
        assert not errors, errors


def test_one_element_table_used_twice_with_two_shapes():
    # E is 2x3 by its own extent; as the right operand of ij,jk it is grown to 3x3
    with eds.connect() as db:
        con = db.connection
        con.execute("CREATE TABLE E(i BIGINT, j BIGINT, v DOUBLE)")
        con.execute("INSERT INTO E VALUES (0, 0, 1.5), (0, 2, -2.0), (1, 1, 3.0)")
        e = np.zeros((2, 3))
        e[0, 0], e[0, 2], e[1, 1] = 1.5, -2.0, 3.0
        want = e @ np.vstack([e, np.zeros((1, 3))])
        rows = con.sql("SELECT * FROM einsum_elements('ij,jk->ik', 'E', 'E')").fetchall()
        got = np.zeros(want.shape)
        for i, k, v in rows:
            got[i, k] = v
        np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("setting", ["SET default_order = 'DESC'", "SET GLOBAL default_order = 'DESC'",
                                     "SET default_null_order = 'NULLS_FIRST'"])
def test_a_connections_default_order_never_changes_a_result(setting):
    """DuckDB's default_order turns every ORDER BY without ASC around: the SQL interface's array
    tables were numbered in reverse (einsum_elements('ij->i', 'I') gave the rows' sums reversed,
    no error) and top-k broke ties toward the larger index (a new user's report)."""
    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    with eds.connect(tile_bytes=64) as db:  # tables cut into several tiles that do not divide them
        con = db.connection
        con.execute("CREATE TABLE I(id INT, emb DOUBLE[7])")
        con.executemany("INSERT INTO I VALUES (?, ?)", [(k, a[k].tolist()) for k in range(5)])
        db.store("B", b, tile=(3, 2))
        db.store("T", np.array([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 7.0, 7.0], [np.nan, 1.0, 3.0, 3.0]]))
        con.execute(setting)
        try:
            np.testing.assert_allclose(elements(con, "SELECT * FROM einsum_elements('ij->i', 'I')", (5,), "float64"),
                                       a.sum(1))
            np.testing.assert_allclose(elements(con, "SELECT * FROM einsum_elements('ij,jk->ik', 'I', 'B')", (5, 3),
                                                "float64"), a @ b)
            # ties to the smaller index; NaN ranks last; rows in order, then rank
            assert con.sql("SELECT * FROM einsum_topk('ij->ij', 2, 'T')").fetchall() == [
                (0, 1, 1, 5.0), (0, 2, 2, 5.0), (1, 1, 2, 7.0), (1, 2, 3, 7.0), (2, 1, 2, 3.0), (2, 2, 3, 3.0)]
            assert db.tensors() == ["B", "T"]
        finally:
            con.execute("RESET GLOBAL default_order" if "GLOBAL" in setting else setting.split("=")[0].replace("SET", "RESET"))


def test_join_and_agg_names_ignore_case_and_blanks(sdb):
    """SQL users write 'MAX' and ' exp ': they were refused ("unknown agg 'MAX'", "join
    expression: unexpected indent"; a new user's report)."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    sdb.store("A", a)
    sdb.store("B", b)
    got = elements(sdb.connection, "SELECT * FROM einsum_elements('ij,jk->ik', 'A', 'B', join := ' ADD ', agg := 'MAX')",
                   (4, 3), "float64")
    assert_close(got, (a[:, :, None] + b[None]).max(1))
    got = elements(sdb.connection, "SELECT * FROM einsum_elements('ij->ij', 'A', join := ' Exp ')", (4, 5), "float64")
    assert_close(got, np.exp(a))
    np.testing.assert_allclose(eds.einsum("ij,jk->ik", a, b, join="Add", agg="Min"), (a[:, :, None] + b[None]).min(1))


def test_a_view_over_einsum_as_an_operand_says_what_to_do():
    """A view over einsum_elements() is read on a cursor without the TEMP table macros: the
    error blamed a missing table function ("Did you mean pg_timezone_names?"; a new user's
    report). It now says to store the view's result first, and that works."""
    with eds.connect() as db:
        con = db.connection
        a = np.random.default_rng(2).standard_normal((3, 3))
        db.store("A", a)
        con.execute("CREATE VIEW V AS SELECT * FROM einsum_elements('ij,jk->ik', 'A', 'A')")
        with pytest.raises(duckdb.Error, match=r"view 'V' is itself over einsum\(\).*store its result first"):
            con.sql("SELECT * FROM einsum_elements('ik->i', 'V')").fetchall()
        con.execute("CREATE TABLE W AS SELECT * FROM V")
        np.testing.assert_allclose(elements(con, "SELECT * FROM einsum_elements('ik->i', 'W')", (3,), "float64"),
                                   (a @ a).sum(1))


@pytest.mark.duckdb_only("SQL table functions on DuckDB")
def test_an_array_form_table_is_cut_for_the_budget_and_named_in_errors(tmp_path):
    """An (id, emb FLOAT[768]) table of 50,000 rows (154 MB) under memory="1GB" was cut into
    one tile and ran DuckDB out of memory (a trial); its tiles are sized as a store's under
    the budget now (the one query that packs a table still holds it ~3-4 times: at 92 MB
    under 600 MB it ran out in 2 runs of 3, docs/DESIGN.md). And a refusal named the table by an internal name, with advice to store it
    ("store '_eds_op0' with tile=(50000, 1)"): it names the table and what applies."""
    import re

    path = str(tmp_path / "a.duckdb")
    with eds.connect(path) as db:
        db.connection.execute("CREATE TABLE items AS SELECT i AS id, list_transform(range(768), lambda x: "
                              "(random() - 0.5)::FLOAT)::FLOAT[768] AS emb FROM range(50000) t(i)")
    with eds.connect(path, memory="1GB") as db:
        got = db.connection.sql("SELECT * FROM einsum_elements('ij->j', 'items') ORDER BY 1").fetchall()
        emb = np.array(db.connection.sql("SELECT emb FROM items ORDER BY id").fetchnumpy()["emb"].tolist())
        np.testing.assert_allclose([v for _, v in got], emb.sum(axis=0), rtol=1e-4, atol=1e-3)
    from eindecomp_sql.compile.sql_interface import ArrayTable
    from eindecomp_sql.sql_functions import _said_of_tables

    op = ArrayTable("items", "id", "emb", "float32", 768, 50000)
    e = _said_of_tables(eds.EinsumError("no chunking fits: it reads stored '_eds_op0' (tiles (50000, 768)) in tiles "
                                        "(50000, 192), and that re-tile does not fit; store '_eds_op0' again in "
                                        "tiles of (50000, 192) (db.store('_eds_op0', <its source data>, tile=(50000, "
                                        "192), replace=True), or db.store('_eds_op0', '_eds_op0', tile=(50000, 192), "
                                        "replace=True) in a session whose memory= holds ~3x '_eds_op0''s bytes), or "
                                        "give more memory"), {"_eds_op0": op})
    assert "_eds_op0" not in str(e) and "it reads table 'items' (array form" in str(e)
    assert re.search(r"give a smaller tile_bytes \(a table is cut into tiles of up to tile_bytes\), or give more",
                     str(e))
    # a step's description names it bare (the refusal of a plan that needs several statements)
    e = _said_of_tables(eds.EinsumError("runs step 0 (retile _eds_op0 (938, 96) -> (1876, 96) in 4 batches)"),
                        {"_eds_op0": op})
    assert str(e) == "runs step 0 (retile table 'items' (938, 96) -> (1876, 96) in 4 batches)"


def test_list_columns_of_one_length_are_array_tables(sdb, tmp_path):
    """A view over a Parquet file of pyarrow's fixed-size lists reads as FLOAT[] (a list), which
    was refused with a hint to cast it (a trial); lists of one length are read as arrays."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    emb = rng.standard_normal((7, 5)).astype(np.float32)
    q = rng.standard_normal((3, 5)).astype(np.float32)
    perm = rng.permutation(7)
    fsl = pa.FixedSizeListArray.from_arrays(pa.array(emb[perm].ravel()), 5)
    pq.write_table(pa.table({"id": perm * 10, "emb": fsl}), tmp_path / "e.parquet")
    con = sdb.connection
    con.execute(f"CREATE OR REPLACE VIEW pitems AS SELECT * FROM '{tmp_path / 'e.parquet'}'")
    assert con.execute("SELECT typeof(emb) FROM pitems LIMIT 1").fetchall()[0][0] == "FLOAT[]"
    con.execute("CREATE OR REPLACE TABLE lq(k INTEGER, v DOUBLE[])")
    con.executemany("INSERT INTO lq VALUES (?, ?)", [(k, [float(x) for x in q[k]]) for k in range(3)])
    rows = con.execute("SELECT * FROM einsum_elements('id,jd->ij', 'lq', 'pitems')").fetchall()
    got = np.zeros((3, 7))
    for i, j, v in rows:
        got[i, j] = v
    np.testing.assert_allclose(got, q.astype(np.float64) @ emb.T.astype(np.float64), rtol=1e-5, atol=1e-6)
    con.execute("CREATE OR REPLACE TABLE el(k INTEGER, v DOUBLE[])")
    assert con.execute("SELECT count(*) FROM einsum_elements('ij->ij', 'el')").fetchall() == [(0,)]


def test_errors_about_table_operands_say_what_to_do():
    """What a SQL user met in a trial: messages that named a column the table lacks, left DECIMAL
    out of the accepted types, forgot tables exist, or said "invalid name" for a schema's table."""
    with eds.connect() as db:
        con = db.connection
        con.execute("CREATE TABLE E(i BIGINT, value DOUBLE); INSERT INTO E VALUES (0, 1)")
        con.execute("CREATE TABLE V(i BIGINT, value VARCHAR); INSERT INTO V VALUES (0, 'x')")
        con.execute("CREATE TABLE X(k BIGINT, name VARCHAR, emb DOUBLE[2]); INSERT INTO X VALUES (0, 'a', [1, 2])")
        con.execute("CREATE TABLE Y(emb DOUBLE[2]); INSERT INTO Y VALUES ([1, 2]), ([3, 4])")
        con.execute("CREATE SCHEMA s; CREATE TABLE s.t(i BIGINT, value DOUBLE)")
        with pytest.raises(EinsumError, match=r"^operand 0: no stored tensor named 'nope', nor a table or view"):
            db.einsum_numpy("i->", "nope")
        with pytest.raises(EinsumError, match=r"operand 's.t' names a table of another schema .* \(CREATE VIEW v AS"):
            db.explain("i->", "s.t")
        with pytest.raises(EinsumError, match=r"pass db.connection.table\('E'\)"):
            db.store("E2", "E")
        with pytest.raises(duckdb.Error, match=r"DECIMAL \(read as DOUBLE\) .* cast it in a view"):
            con.sql("SELECT * FROM einsum('i->', 'V')").fetchall()
        # the views the errors suggest run as written
        for name in ("X", "Y"):
            with pytest.raises(duckdb.Error, match="exactly one key column") as e:
                con.sql(f"SELECT * FROM einsum('ij->', '{name}')").fetchall()
            view = re.search(r"\(a view can select it: (CREATE VIEW v AS SELECT .*)\)", str(e.value)).group(1)
            con.execute(view.replace("VIEW v", f"VIEW {name}v"))
            total = con.sql(f"SELECT * FROM einsum_elements('ij->', '{name}v')").fetchall()[0][0]
            assert total == {"X": 3.0, "Y": 10.0}[name]
