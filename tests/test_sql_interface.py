"""SELECT * FROM einsum(...) and einsum_elements(...) inside DuckDB SQL."""

import threading

import duckdb
import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.udfs.tiles import array_from_tiles
from helpers import assert_close, random_array


@pytest.fixture(scope="module")
def sdb():
    s = eds.connect()
    rng = np.random.default_rng(11)
    s.arrays = {
        "A": rng.standard_normal((7, 5)).astype(np.float32),
        "B": rng.standard_normal((5, 6)).astype(np.float32),
        "C": rng.standard_normal((6, 3)).astype(np.float32),
        "D": rng.standard_normal((3, 2)).astype(np.float32),
        "V": random_array(rng, (5,), "int64"),
    }
    tiles = {"A": (3, 2), "B": (2, 4), "C": (4, 2), "D": (2, 2), "V": (2,)}
    for name, a in s.arrays.items():
        s.store(name, a, tile=tiles[name])
    yield s
    s.close()


@pytest.mark.parametrize(
    "spec,names",
    [
        ("ij,jk->ik", "AB"),
        ("ij->ji", "A"),
        ("ij->", "A"),
        ("ij,j->i", "AV"),
        ("ij,jk,kl->il", "ABC"),
        ("ij,jk,kl,lm->im", "ABCD"),
    ],
)
def test_einsum_table_function(sdb, spec, names):
    args = "?" + ", ?" * len(names)  # the spec and the names travel as parameters
    con = sdb.connection
    want = np.einsum(spec, *[sdb.arrays[n] for n in names])
    rel = con.sql("SELECT * FROM einsum(" + args + ")", params=[spec, *names])
    out_labels = spec.split("->")[1]
    assert rel.columns == list(out_labels) + ["tile"]
    tiles = rel.to_arrow_table()
    # the tile shape of the result is what the plan says: reconstruct from the plan
    plan = sdb.plan(spec, *names)
    got = array_from_tiles(tiles, want.shape, plan.result.tile, want.dtype, tuple(out_labels))
    assert_close(got, want)

    rows = con.execute("SELECT * FROM einsum_elements(" + args + ")", [spec, *names]).fetchall()
    assert len(rows) == want.size
    elem = np.zeros(want.shape, want.dtype)
    for r in rows:
        elem[tuple(r[:-1])] = r[-1]
    assert_close(elem, want)


def test_elements_column_names_and_types(sdb):
    rel = sdb.connection.sql("SELECT * FROM einsum_elements('ij,j->i', 'A', 'V')")
    assert rel.columns == ["i", "value"]
    assert [str(t) for t in rel.types] == ["BIGINT", "DOUBLE"]  # float32 x int64 -> float64, as numpy
    rel = sdb.connection.sql("SELECT * FROM einsum_elements('ij->j', 'A')")
    assert [str(t) for t in rel.types] == ["BIGINT", "FLOAT"]


def test_sql_result_composes_with_sql(sdb):
    con = sdb.connection
    total = con.execute("SELECT sum(value) FROM einsum_elements('ij,jk->ik', 'A', 'B') WHERE i < 3").fetchall()[0][0]
    want = (sdb.arrays["A"] @ sdb.arrays["B"])[:3].sum()
    assert abs(total - want) < 1e-3


def test_reserved_word_names(sdb):
    # AT is a reserved word in DuckDB 2.0: every identifier must be quoted
    a = np.arange(6.0).reshape(2, 3)
    sdb.store("At", a)
    got = sdb.einsum("ij->j", "At").to_numpy()
    np.testing.assert_array_equal(got, a.sum(0))
    rows = sdb.connection.sql("SELECT * FROM einsum_elements('ij->j', 'At') ORDER BY j").fetchall()
    assert [r[1] for r in rows] == list(a.sum(0))


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_element_rows_are_exact_floats(half):
    """DuckDB has no float16 or bfloat16: einsum_elements shows such a result's values as
    FLOAT, each exactly the value that Tensor.to_numpy() holds; a DuckDB FLOAT column still packs
    as float32 (never rounded to the half type)."""
    rng = np.random.default_rng(30)
    with eds.connect() as db:
        a = random_array(rng, (9, 6), half)
        b = random_array(rng, (6, 7), half)
        db.store("H1", a, tile=(4, 4))
        db.store("H2", b, tile=(4, 3))
        tiles = db.einsum_numpy("ij,jk->ik", "H1", "H2")
        assert tiles.dtype == np.dtype(half)
        con = db.connection
        rows = con.execute("SELECT i, k, value, typeof(value) FROM einsum_elements('ij,jk->ik', 'H1', 'H2')").fetchall()
        assert {r[3] for r in rows} == {"FLOAT"} and len(rows) == tiles.size
        got = np.zeros(tiles.shape, np.float32)
        for i, k, v, _ in rows:
            got[i, k] = v
        np.testing.assert_array_equal(got, tiles.astype(np.float32))
        # elements of a stored float16 tensor, and a FLOAT table as an operand: float32
        rows = con.execute("SELECT i, j, value FROM einsum_elements('ij->ij', 'H1')").fetchall()
        assert {np.array(v, np.float32).astype(half) == a[i, j] for i, j, v in rows} == {True}
        con.execute("CREATE TABLE h1_rows AS SELECT i, j, value FROM einsum_elements('ij->ij', 'H1')")
        back = con.execute("SELECT i, j, value, typeof(value) FROM einsum_elements('ij->ij', 'h1_rows')").fetchall()
        assert {r[3] for r in back} == {"FLOAT"} and len(back) == a.size
        assert {v == np.float32(a[i, j]) for i, j, v, _ in back} == {True}


def test_a_connection_switched_to_another_database_is_refused_not_served_its_tables():
    """The plan reads names on the session's own cursor; after ``USE other`` the caller's query
    would resolve the same names elsewhere (a 3x3 table's shape with another table's rows)."""
    db = eds.connect()
    con = db.connection
    con.execute("CREATE TABLE E(i INT, j INT, value DOUBLE)")
    con.execute("INSERT INTO E VALUES (0, 0, 1.0), (2, 2, 1.0)")
    con.execute("ATTACH ':memory:' AS other")
    con.execute("CREATE TABLE other.E(i INT, j INT, value DOUBLE)")
    con.execute("INSERT INTO other.E VALUES (0, 0, 100.0), (0, 1, 200.0)")
    db.store("A", np.arange(6.0).reshape(2, 3))
    con.execute("USE other")
    for q in ("SELECT * FROM einsum_elements('ij->ij', 'E')", "SELECT * FROM einsum('ij->ji', 'A')",
              "SELECT * FROM einsum_topk('ij->ij', 1, 'A')"):
        with pytest.raises(Exception, match=r"default schema is other\.main .*USE \"memory\"\.\"main\""):
            con.execute(q).fetchall()
    con.execute('USE "memory"."main"')
    rows = con.execute("SELECT i, j, value FROM einsum_elements('ij->ij', 'E') ORDER BY i, j").fetchall()
    assert len(rows) == 9 and rows[0] == (0, 0, 1.0) and rows[-1] == (2, 2, 1.0)
    db.close()


def test_a_plan_the_budget_splits_into_statements_is_refused_by_the_one_query_interface():
    """Under memory= a step over the budget runs as several statements (db.einsum does); a SQL
    table function is one query, which ran out of DuckDB's memory with a raw error."""
    a = np.random.default_rng(5).standard_normal((2048, 2048))
    with eds.connect(memory="256MB") as db:
        db.store("A", a)
        db.store("B", a)
        assert db.plan("ij,jk->ik", "A", "B").steps and any(s.batches > 1 for s in db.plan("ij,jk->ik", "A", "B").steps)
        for q in ("SELECT count(*) FROM einsum_topk('ij,jk->ik', 2, 'A', 'B')",
                  "SELECT count(*) FROM einsum_elements('ij,jk->ik', 'A', 'B')"):
            # (top-k: db.topk, and the memory= it needs as one query)
            then = r"which db\.topk\(\.\.\.\) from Python runs" if "topk" in q else r"call db\.einsum"
            with pytest.raises(Exception, match=r"EinsumError: .*as \d+ statements, but a SQL table function is one "
                                                rf"query(;|,) {then}"):
                db.connection.execute(q).fetchall()
        small = a[:64, :64].copy()
        db.store("S", small)
        got = db.connection.execute("SELECT i, k, value FROM einsum_elements('ij,jk->ik', 'S', 'S')").fetchall()
        want = small @ small
        assert len(got) == want.size and all(abs(v - want[i, k]) < 1e-9 for i, k, v in got)


def test_a_kernel_spec_written_in_sql_cannot_run_code_through_its_join_expression(tmp_path):
    """The kernels evaluate a spec's join expression; a spec is text any statement on the
    connection can write, and it reached eval without the notation's checks (with __import__
    there since the probe needs it, any Python ran)."""
    import json

    db = eds.connect()
    db.store("a", np.ones((4, 4)))
    db.store("b", np.ones((4, 4)))
    con = db.connection
    q = con.execute("SELECT eds_einsum_sql('ij,jk->ik', ['a', 'b'], 'tiles', 'x + y', NULL, NULL, "
                    "[current_database(), current_schema()])").fetchone()[0]
    assert '"expr":"x + y"' in q
    marker = tmp_path / "ran"
    for payload in (f"__import__('os').system('touch {marker}') * 0 + x + y",
                    "[c for c in ().__class__.__base__.__subclasses__()] and x + y",
                    "x * 10**10**10"):
        with pytest.raises(Exception, match="EinsumError: join expression"):
            con.execute(q.replace('"expr":"x + y"', '"expr":' + json.dumps(payload).replace("'", "''"))).fetchall()
        assert not marker.exists()
    assert con.execute(q).fetchall()  # the spec as written still runs
    db.close()


def test_a_temp_table_of_the_callers_with_a_tensors_name_does_not_stand_in_for_it():
    """The query named tables bare, so the caller's TEMP table 'a' was read in the stored
    tensor's planned shape (its bytes, the tensor's layout)."""
    with eds.connect() as db:
        a = np.arange(4.0).reshape(2, 2)
        db.store("a", a)
        e = db.connection.execute
        e("CREATE TEMP TABLE a AS SELECT d0, d1, tile FROM main.a")
        e("UPDATE temp.a SET tile = (SELECT tile FROM main.a LIMIT 1) || ''")  # other bytes, same lengths
        e("UPDATE temp.a SET tile = repeat('\\x00'::BLOB, 32)")
        rows = e("SELECT i, value FROM einsum_elements('ij->i', 'a') ORDER BY i").fetchall()
        assert rows == [(0, 1.0), (1, 5.0)], rows
        e("CREATE TABLE E(i INT, value DOUBLE)")
        e("INSERT INTO E VALUES (0, 2.0), (1, 3.0)")
        e("CREATE TEMP TABLE E(i INT, value DOUBLE)")
        e("INSERT INTO temp.E VALUES (0, 100.0), (1, 100.0)")
        # an ordinary table is the caller's SQL's: there the bare name is the TEMP table, so
        # reading main.E beside it was a silent surprise (a trial); refused, naming it
        with pytest.raises(duckdb.Error, match=r"TEMP table or view named 'E', as the table the einsum reads"):
            e("SELECT i, value FROM einsum_elements('i->i', 'E') ORDER BY i").fetchall()
        e("DROP TABLE temp.E")
        assert e("SELECT i, value FROM einsum_elements('i->i', 'E') ORDER BY i").fetchall() == [(0, 2.0), (1, 3.0)]


def test_a_ninth_operand_is_said_to_be_one_too_many():
    """A 9th name is read as the join: "unknown join 'I'" alone sent a new user to the wrong
    argument; the message says einsum() takes at most 8 operands."""
    with eds.connect() as db:
        for n in "ABCDEFGHI":
            db.store(n, np.ones(2))
        # a spec of 9 operands says so before anything is read (a documentation audit)
        with pytest.raises(Exception, match=r"names 9 operands, but einsum\(\) takes at most 8"):
            db.connection.execute("SELECT * FROM einsum('a,a,a,a,a,a,a,a,a->a', "
                                  "'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I')").fetchall()
        # 8 operands and a 9th name: read as the join
        with pytest.raises(Exception, match=r"unknown join 'I'.*at most 8 operands"):
            db.connection.execute("SELECT * FROM einsum('a,a,a,a,a,a,a,a->a', "
                                  "'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I')").fetchall()


def test_a_tensor_replaced_inside_the_callers_transaction_is_refused_not_misread():
    """The SQL interface plans from the committed catalog; in a transaction the caller opened
    before a tensor was replaced, the query reads the old tiles: 3x4 float64 bytes were read as
    the new 4x3 (wrong sums, no error; a new user's report)."""
    with eds.connect() as db:
        con = db.connection
        db.store("B", np.arange(12.0).reshape(3, 4))
        con.execute("BEGIN")
        con.sql("SELECT count(*) FROM einsum_elements('ij->ij', 'B')").fetchall()
        db.store("B", np.full((4, 3), 5.0), replace=True)
        with pytest.raises(duckdb.Error, match=r"not, in this query's transaction, what it was planned from: 'B' \(float64, shape \(4, 3\)\)"):
            con.sql("SELECT * FROM einsum_elements('ij->i', 'B')").fetchall()
        con.execute("ROLLBACK")
        assert sorted(con.sql("SELECT * FROM einsum_elements('ij->i', 'B')").fetchall()) == [(i, 15.0) for i in range(4)]


def test_cursors_run_sql_einsums_from_several_threads_at_once():
    """A DuckDB connection runs one statement at a time, and db.connection.cursor() had no
    einsum functions ("einsum_elements does not exist": a SQL user's trial): db.cursor() gives
    one that has them, a cursor per thread, beside the Python API's calls."""
    rng = np.random.default_rng(21)
    a = rng.standard_normal((60, 50))
    with eds.connect() as db:
        db.store("A", a)
        db.connection.execute("CREATE TABLE E AS SELECT range AS i, (range % 7)::DOUBLE AS value FROM range(50)")
        e = np.arange(50) % 7.0
        got, errors = {}, []

        def sql(k):
            try:
                cur = db.cursor()
                for _ in range(5):
                    got.setdefault(k, []).append(np.array(cur.sql(
                        "SELECT value FROM einsum_elements('ij,j->i', 'A', 'E') ORDER BY i").fetchnumpy()["value"]))
                cur.close()
            except Exception as error:  # noqa: BLE001 - asserted below
                errors.append(error)

        def python():
            try:
                for _ in range(5):
                    got.setdefault("py", []).append(db.einsum_numpy("ij,jk->ik", "A", a.T))
            except Exception as error:  # noqa: BLE001
                errors.append(error)

        threads = [threading.Thread(target=sql, args=(k,)) for k in range(3)] + [threading.Thread(target=python)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        for k in range(3):
            assert len(got[k]) == 5
            for r in got[k]:
                np.testing.assert_allclose(r, a @ e, rtol=1e-12)
        for r in got["py"]:
            np.testing.assert_allclose(r, a @ a.T, rtol=1e-12)
    with eds.connect(backend="reference") as other:
        with pytest.raises(EinsumError, match="cursor\\(\\) is the DuckDB backend's"):
            other.cursor()
