"""Stored tensors, the catalog, file databases and Arrow output."""

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import eindecomp_sql as eds
from helpers import DTYPES, random_array


def test_reopen_file_database(tmp_path):
    path = str(tmp_path / "t.duckdb")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((9, 4)).astype(np.float32)
    b = rng.standard_normal((4, 5)).astype(np.float32)
    with eds.connect(path) as db:
        db.store("A", a, tile=(4, 3))
        db.store("B", b)
        db.einsum("ij,jk->ik", "A", "B", out="C")
    with eds.connect(path) as db:
        assert db.tensors() == ["A", "B", "C"]
        C = db.tensor("C")
        assert C.shape == (9, 5) and C.dtype == np.float32
        np.testing.assert_allclose(C.to_numpy(), a @ b, rtol=1e-5, atol=1e-5)
        assert db.tensor("A").tile == (4, 3)
        # the SQL interface finds stored tensors after reopening too
        n = db.connection.execute("SELECT count(*) FROM einsum_elements('ij,jk->ik', 'A', 'B')").fetchone()[0]
        assert n == 45


def test_existing_connection():
    import duckdb

    con = duckdb.connect()
    db = eds.connect(con)
    db.store("x", np.arange(4.0))
    assert con.execute("SELECT count(*) FROM x").fetchone()[0] == 1
    np.testing.assert_array_equal(db.einsum("i->", "x").to_numpy(), 6.0)
    con.close()


def test_arrow_layout_and_dtypes(db):
    rng = np.random.default_rng(4)
    for dt in DTYPES:
        a = random_array(rng, (5, 3), dt)
        T = db.store(f"arr_{dt}", a, tile=(2, 2), replace=True)
        t = T.to_arrow()
        assert t.column_names == ["d0", "d1", "tile"]
        assert t.schema.field("d0").type == pa.int64()
        assert t.num_rows == 3 * 2
        np.testing.assert_array_equal(T.to_numpy(), a)
        np.testing.assert_array_equal(np.asarray(T), a)
        # a tile is the raw C-order bytes of its sub-array (edge tiles are smaller, not padded)
        row = t.filter(pc.and_(pc.equal(t["d0"], 2), pc.equal(t["d1"], 1))).to_pylist()[0]
        np.testing.assert_array_equal(np.frombuffer(row["tile"], dtype=dt).reshape(1, 1), a[4:, 2:])


def test_result_keys_are_output_labels(db):
    db.store("ka", np.ones((3, 4)), replace=True)
    C = db.einsum("ij->ji", "ka", out="kc", replace=True)
    assert C.to_arrow().column_names == ["j", "i", "tile"]
    assert db.tensor("kc").keys == ("j", "i")


def test_custom_keys_and_auto_tiles(db):
    a = np.ones((300, 200), np.float64)
    T = db.store("big", a, keys=("row", "col"), replace=True)
    assert T.keys == ("row", "col")
    small = eds.connect(tile_bytes=64 * 1024, backend=db.backend.name)
    S = small.store("s", a)
    assert np.prod(S.tile) * 8 <= 64 * 1024
    np.testing.assert_array_equal(small.einsum("ij->i", S).to_numpy(), a.sum(1))
    small.close()


def test_temporary_results_and_drop(db):
    a = np.arange(12.0).reshape(3, 4)
    T = db.store("tmp_src", a, replace=True)
    R = db.einsum("ij->j", T)
    assert R.name.startswith("_eds_r") and R.name not in db.tensors()
    np.testing.assert_array_equal(R.to_numpy(), a.sum(0))
    db.drop("tmp_src")
    assert "tmp_src" not in db.tensors()


def test_names_are_case_insensitive_like_duckdb(backend):
    # DuckDB's table names ignore case: "A" and "a" are one table, and so one catalog entry
    with eds.connect(backend=backend) as db:
        db.store("A", np.ones((2, 2), np.float32))
        db.store("a", np.arange(9, dtype=np.float32).reshape(3, 3), replace=True)
        assert db.tensors() == ["a"]
        assert db.tensor("A").shape == (3, 3)
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), np.arange(9, dtype=np.float32).reshape(3, 3))
        db.drop("A")
        assert db.tensors() == []


def test_output_labels_differing_only_in_case(backend):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal(4)
    with eds.connect(backend=backend) as db:
        c = db.einsum("iI,I->iI", a, b, out="C")
        assert c.keys == ("d0", "d1")  # i and I would be one column name to DuckDB
        np.testing.assert_allclose(c.to_numpy(), np.einsum("iI,I->iI", a, b))


def test_a_read_only_database_without_a_catalog_lists_no_tensors(tmp_path):
    import duckdb

    path = tmp_path / "plain.duckdb"
    duckdb.connect(str(path)).close()  # a DuckDB file this package never wrote to
    with eds.connect(path, read_only=True) as db:
        assert db.tensors() == []


def test_replace_overwrites_stored_tensors_only_never_a_users_table_or_view(tmp_path, capsys):
    """store(..., replace=True) and einsum(..., out=, replace=True) onto a plain table dropped the
    user's table; onto a view they failed with DuckDB's own error half-way."""
    a = np.arange(6.0).reshape(2, 3)
    path = tmp_path / "t.duckdb"
    with eds.connect(str(path)) as db:
        db.connection.execute("CREATE TABLE plain_t(x INT)")
        db.connection.execute("INSERT INTO plain_t VALUES (7)")
        db.connection.execute("CREATE VIEW plain_v AS SELECT 1 AS y")
        db.store("A", a)
        for name in ("plain_t", "PLAIN_V"):
            for call in (lambda: db.store(name, a, replace=True),
                         lambda: db.einsum("ij->ji", "A", out=name, replace=True)):
                with pytest.raises(eds.EinsumError, match="is a table or view of the database that is not a stored tensor"):
                    call()
        assert db.connection.execute("SELECT * FROM plain_t").fetchall() == [(7,)]
        assert db.connection.execute("SELECT * FROM plain_v").fetchall() == [(1,)]
        assert sorted(db.tensors()) == ["A"]
        db.store("A", a + 1, replace=True)  # a stored tensor is still replaced
        assert np.array_equal(db.tensor("A").to_numpy(), a + 1)
    from eindecomp_sql.cli import main as cli_main

    np.save(tmp_path / "x.npy", a)
    errs = []
    for args in (["store", path, "plain_t", tmp_path / "x.npy", "--replace"], ["store", path, "A", tmp_path / "x.npy"]):
        with pytest.raises(SystemExit) as e:
            cli_main([str(x) for x in args])
        errs.append(capsys.readouterr().err)
        assert e.value.code == 1 and errs[-1].count("\n") == 1, errs[-1]
    assert "'plain_t' is a table or view of the database that is not a stored tensor" in errs[0], errs[0]
    assert "pass --replace to overwrite it" in errs[1] and "replace=True" not in errs[1], errs[1]


def test_a_handle_on_a_tensor_replaced_or_dropped_since_is_refused_not_read_with_its_old_shape():
    """A Tensor handle kept its shape, dtype and tile while the table was replaced: int64 bytes
    read as float64, or a (3, 4) layout over a (4, 3) table, with no error."""
    with eds.connect() as db:
        A = db.store("A", np.arange(16.0).reshape(4, 4), tile=(2, 2))
        db.store("A", np.arange(16).reshape(4, 4) * 10, tile=(2, 2), replace=True)  # same bytes per tile
        g = eds.Graph()
        x = g.input("x", (4, 4), "float64")
        g.map("neg", x)
        # db.drop(A) too: it dropped the newer tensor (a trial)
        for use in (A.to_numpy, A.to_arrow, lambda: db.einsum("ij->i", A), lambda: g.run(db, x=A),
                    lambda: db.drop(A)):
            with pytest.raises(eds.EinsumError, match=r"'A' was replaced since this handle was made: it is now "
                                                      r"\(4, 4\) int64 .*db\.tensor\('A'\)"):
                use()
        assert db.tensors() == ["A"]
        fresh = db.tensor("A")
        assert np.array_equal(fresh.to_numpy(), np.arange(16).reshape(4, 4) * 10)
        same = db.store("A", np.ones((4, 4), np.int64), tile=(2, 2), replace=True)  # same layout: reads the new bytes
        assert np.array_equal(fresh.to_numpy(), np.ones((4, 4))) and np.array_equal(same.to_numpy(), fresh.to_numpy())
        # replaced by an einsum's result of the same layout, keyed by the spec's labels: the
        # message named no difference ("now (4, 4) float64 in tiles (2, 2) (this handle: (4, 4)
        # float64 in tiles (2, 2))", a trial)
        db.einsum("ij,jk->ik", fresh, fresh, out="A", replace=True)
        with pytest.raises(eds.EinsumError, match=r"keyed i, k \(this handle: .* keyed d0, d1\)"):
            fresh.to_numpy()
        db.drop(db.tensor("A"))  # a handle of the tensor as it is: dropped
        with pytest.raises(eds.EinsumError, match="'A' no longer exists"):
            fresh.to_numpy()
        with pytest.raises(eds.EinsumError, match="'A' no longer exists"):
            db.drop(fresh)


def test_a_table_of_the_same_name_elsewhere_does_not_block_a_store(tmp_path):
    """A table named A in another schema, or in an attached database, is not where the bare
    name A resolves: it blocked db.store("A") as "a table or view of the database that is not
    a stored tensor" (a new user's report). One in the session's own schema still does."""
    a = np.random.default_rng(3).standard_normal((3, 4))
    with eds.connect() as db:
        con = db.connection
        con.execute("CREATE SCHEMA s2")
        con.execute("CREATE TABLE s2.A(i BIGINT, value DOUBLE)")
        con.execute(f"ATTACH '{tmp_path / 'other.duckdb'}' AS other")
        con.execute("CREATE TABLE other.main.Q(i BIGINT, value DOUBLE)")
        np.testing.assert_array_equal(db.store("A", a).to_numpy(), a)
        np.testing.assert_array_equal(db.store("Q", a).to_numpy(), a)
        np.testing.assert_allclose(db.einsum("ij->i", db.tensor("Q")).to_numpy(), a.sum(1))
        con.execute("CREATE TABLE mine(i BIGINT, value DOUBLE)")
        with pytest.raises(eds.EinsumError, match="not a stored tensor"):
            db.store("MINE", a)


@pytest.mark.parametrize("use", ["an attached file", "a schema of it"])
def test_a_session_on_a_connection_works_where_the_connections_use_points(tmp_path, use):
    """``eds.connect(con)`` after ``USE`` of an attached file: our cursor started in the
    in-memory default, so the tensors went there and were gone with the process (a trial's
    report), and ``einsum()`` in SQL refused the user's own schema."""
    a = np.random.default_rng(5).standard_normal((5, 3))
    path = tmp_path / "f.duckdb"
    con = duckdb.connect()
    con.execute(f"ATTACH '{path}' AS f")
    con.execute("USE f")
    if use == "a schema of it":
        con.execute('CREATE SCHEMA "my s"')
        con.execute('USE f."my s"')
    db = eds.connect(con)
    db.store("A", a, tile=(2, 2))
    where = con.execute("SELECT database_name, schema_name FROM duckdb_tables() WHERE table_name = 'A'").fetchall()
    assert where == [("f", "main" if use == "an attached file" else "my s")]
    got = con.execute("SELECT i, value FROM einsum_elements('ij->i', 'A') ORDER BY i").fetchall()
    np.testing.assert_allclose([v for _, v in got], a.sum(1))
    # a plain table operand is read where the query reads it, not one of its name in memory
    # (the reviewer's case: float32 values from memory.main.T read as float64 f's T)
    con.execute("CREATE TABLE memory.main.T(i BIGINT, value FLOAT)")
    con.execute("INSERT INTO memory.main.T VALUES (0, 1.5), (1, 2.5)")
    con.execute("CREATE TABLE T(i BIGINT, value DOUBLE)")
    con.execute("INSERT INTO T VALUES (0, 0.1), (1, 0.2), (2, 0.30000000001)")
    got = con.execute("SELECT * FROM einsum_elements('i->', 'T')").fetchall()
    assert got == [(0.1 + 0.2 + 0.30000000001,)], got
    db.close()
    con.close()
    if use == "an attached file":
        with eds.connect(str(path)) as again:
            assert again.tensors() == ["A"]
            np.testing.assert_array_equal(again.tensor("A").to_numpy(), a)


EDITS = {  # SQL edits of a stored tensor's table that leave it out of shape, and what is named
    "a tile cut short": ("UPDATE t SET tile = '\\x00\\x01'::BLOB WHERE d0 = 0 AND d1 = 0", "holds 2 bytes"),
    "a tile row deleted": ("DELETE FROM t WHERE d0 = 1 AND d1 = 1", "3 tile rows"),
    "every row deleted": ("DELETE FROM t", "0 tile rows"),
    "a tile row repeated": ("INSERT INTO t SELECT * FROM t WHERE d0 = 0 AND d1 = 0", "5 tile rows"),
    "a key outside the grid": ("UPDATE t SET d0 = 5 WHERE d0 = 1 AND d1 = 1", "holds 5"),
    "a NULL tile": ("UPDATE t SET tile = NULL WHERE d0 = 0 AND d1 = 1", "null"),
    "a NULL key": ("UPDATE t SET d0 = NULL WHERE d0 = 0 AND d1 = 1", "null"),
    "a tile moved onto another's key": ("UPDATE t SET d1 = 0 WHERE d0 = 1 AND d1 = 1", "more than once"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_stored_tensor_edited_out_of_shape_in_sql_is_refused_not_read(edit):
    """``store`` checks what comes in, but the table is the user's to edit. Read as it was, a
    deleted tile came back as zeros, a repeated one overwrote its twin, and a NULL tile left
    ``np.empty``'s uninitialised memory in the result."""
    sql, named = EDITS[edit]
    db = eds.connect()
    a = random_array(np.random.default_rng(3), (4, 4), "float64")
    db.store("t", a, tile=(2, 2))
    db.connection.execute(sql)
    with pytest.raises(eds.EinsumError, match="stored tensor 't' does not match its catalog entry") as e:
        db.tensor("t").to_numpy()
    assert named in str(e.value)


@pytest.mark.parametrize("suffix", [".npy", ".parquet"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_stored_tensor_edited_out_of_shape_in_sql_is_refused_by_export_leaving_no_file(edit, suffix, tmp_path):
    """An export streams the tiles: a deleted tile was written as zeros into the .npy."""
    sql, named = EDITS[edit]
    db = eds.connect()
    db.store("t", random_array(np.random.default_rng(3), (4, 4), "float64"), tile=(2, 2))
    db.connection.execute(sql)
    with pytest.raises(eds.EinsumError, match="stored tensor 't' does not match its catalog entry") as e:
        db.tensor("t").export(tmp_path / f"t{suffix}")
    assert named in str(e.value)
    assert list(tmp_path.iterdir()) == []


# what the check of keys before a plan (compile/tile_check.py) names for each edit, or (tile
# bytes, which it does not read) what the kernel reading the tile says
EINSUM_NAMES = {
    "a tile cut short": "tile at keys (0, 0)",  # and which operand, where the kernel knows (a trial)
    "a tile row deleted": "3 tile rows, but shape (4, 4) in tiles of (2, 2) has 4",
    "every row deleted": "0 tile rows",
    "a tile row repeated": "5 tile rows",
    "a key outside the grid": "key d0 runs 0..5, outside the grid's 0..1",
    "a NULL tile": "NULL",
    "a NULL key": "1 tile key(s) NULL",
    "a tile moved onto another's key": "1 tile key(s) repeated",
}
KERNEL_REFUSES = ("a tile cut short", "a NULL tile")


@pytest.mark.parametrize("how", ["einsum", "einsum with a retile", "graph", "einsum_elements", "einsum()",
                                 "einsum_topk", "einsum_topk of a product", "to_arrow", "to_parquet"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_stored_tensor_edited_out_of_shape_is_refused_by_every_reader(edit, how, tmp_path):
    """A plan read the rows as they were (a trial's report): a deleted tile re-tiled came
    back as uninitialised memory, a deleted row panel left its output tile missing (and the
    result's ``to_numpy()`` returned ``np.empty``'s bytes), a repeated tile was summed twice, a
    key outside the grid was a negative index in ``einsum_elements``. Every reader now refuses
    such a table, before any statement runs, and ``to_arrow()`` / ``to_parquet()`` as
    ``to_numpy()`` does."""
    sql, _ = EDITS[edit]
    db = eds.connect()
    a = random_array(np.random.default_rng(3), (4, 4), "float64")
    db.store("t", a, tile=(2, 2))
    db.store("b", a, tile=(4, 4) if how == "einsum with a retile" else (2, 2))
    db.connection.execute(sql)
    tables = lambda: {r[0] for r in db.connection.sql("SELECT table_name FROM duckdb_tables()").fetchall()}  # noqa: E731
    before = tables()
    if how in ("einsum", "einsum with a retile"):
        run = lambda: db.einsum("ij,jk->ik", "t", "b", out="C")  # noqa: E731
    elif how == "graph":
        g = eds.Graph()
        g.map("relu", g.einsum("ij,jk->ik", g.input("t", (4, 4), "float64"), g.input("b", (4, 4), "float64")))
        run = lambda: g.run(db, t=db.tensor("t"), b=db.tensor("b"), out="C")  # noqa: E731
    elif how == "einsum_elements":
        run = lambda: db.connection.sql("SELECT * FROM einsum_elements('ij->i', 't')").fetchall()  # noqa: E731
    elif how == "einsum()":
        run = lambda: db.connection.sql("SELECT * FROM einsum('ij,jk->ik', 't', 'b')").fetchall()  # noqa: E731
    elif how.startswith("einsum_topk"):
        # the identity's top-k reads the stored tiles themselves: DuckDB's default NULL handling
        # skipped a NULL tile's row, its values silently out of the ranking (a trial)
        spec = "'ij,jk->ik', 2, 't', 'b'" if how.endswith("product") else "'ij->ij', 2, 't'"
        run = lambda: db.connection.sql(f"SELECT * FROM einsum_topk({spec})").fetchall()  # noqa: E731
    elif how == "to_arrow":
        run = lambda: db.tensor("t").to_arrow()  # noqa: E731
    else:
        run = lambda: db.tensor("t").to_parquet(tmp_path / "t.parquet")  # noqa: E731
    with pytest.raises((eds.EinsumError, duckdb.Error)) as e:
        run()
    text = str(e.value)
    if how.startswith("to_"):
        assert "stored tensor 't' does not match its catalog entry" in text and EDITS[edit][1] in text
        assert list(tmp_path.iterdir()) == []
    else:
        assert EINSUM_NAMES[edit] in text, text
        assert edit in KERNEL_REFUSES or "stored tensor 't' (table 't') no longer holds its tiles" in text, text
        assert tables() == before  # nothing written
        assert db.tensors() == ["b", "t"]


def test_a_stored_tensors_values_edited_in_sql_are_read_as_edited():
    db = eds.connect()
    a = random_array(np.random.default_rng(4), (5, 3), "float32")
    db.store("t", a, tile=(2, 2))
    # the edge tile at d0=2, d1=0 (1 x 2) takes the first row's first two values
    b = a.copy()
    b[4, :2] = a[0, :2]
    db.connection.execute("UPDATE t SET tile = ?::BLOB WHERE d0 = 2 AND d1 = 0", [a[0, :2].tobytes()])
    np.testing.assert_array_equal(db.tensor("t").to_numpy(), b)


def _statements(db, fn):
    """The statements the session runs on its own cursor while ``fn`` runs."""
    seen, run = [], db.backend._run

    def spy(sql, params=None):
        seen.append(sql)
        return run(sql, params)

    db.backend._run = spy
    try:
        fn()
    finally:
        del db.backend._run
    return seen


def test_a_repeated_einsum_into_the_same_tensor_reads_and_writes_no_catalog_rows():
    """Ten statements ran around a repeated ``db.einsum(..., out="C", replace=True)`` of 64²
    (4.9 ms): three catalog reads, one of eds_parts, the catalog's DELETE and INSERT of the same
    row. The catalog's answers are kept (checked once a call by one fingerprint statement)."""
    db = eds.connect()
    rng = np.random.default_rng(5)
    a, b = random_array(rng, (64, 48), "float32"), random_array(rng, (48, 32), "float32")
    db.store("A", a), db.store("B", b)
    run = lambda: db.einsum("ij,jk->ik", "A", "B", out="C", replace=True)  # noqa: E731
    run(), run()  # the first writes C's row; the second learns C is one table, not parts
    seen = _statements(db, run)
    about_catalog = [s for s in seen if "eds_catalog" in s or "eds_parts" in s]
    assert len(about_catalog) == 1 and "hash(" in about_catalog[0], seen  # the fingerprint only
    np.testing.assert_allclose(db.tensor("C").to_numpy(), a @ b, rtol=1e-5)


def test_the_catalog_seen_by_a_session_follows_every_change_it_makes(tmp_path):
    db = eds.connect(str(tmp_path / "t.duckdb"))
    rng = np.random.default_rng(6)
    a = random_array(rng, (5, 4), "float64")
    db.store("A", a)
    np.testing.assert_allclose(db.einsum("ij->i", "A").to_numpy(), a.sum(1))
    a2 = random_array(rng, (7, 3), "float32")
    db.store("a", a2, replace=True)  # another shape and dtype, the name in another case
    np.testing.assert_allclose(db.einsum("ij->i", "A").to_numpy(), a2.sum(1), rtol=1e-6)
    db.einsum("ij->j", "A", out="C")
    db.einsum("ij->i", "A", out="C", replace=True)  # another shape: its catalog row changes
    assert db.tensor("C").shape == (7,)
    with pytest.raises(eds.EinsumError, match="already exists"):
        db.einsum("ij->i", "A", out="C")
    db.drop("A")
    with pytest.raises(eds.EinsumError):
        db.einsum("ij->i", "A")
    # a plan that fails in its statement rolls back: nothing it wrote is seen afterwards
    bad = lambda x, y: (_ for _ in ()).throw(ValueError("no"))  # noqa: E731
    with pytest.raises(eds.EinsumError):
        db.einsum("i,i->i", "C", "C", join=bad, out="C", replace=True)
    assert db.tensor("C").shape == (7,)
    db.store("A", a, tile=(2, 2))
    np.testing.assert_allclose(db.einsum("ij->i", "A").to_numpy(), a.sum(1))
    db.close()
    with eds.connect(str(tmp_path / "t.duckdb")) as db:  # what was written is what is read
        assert db.tensors() == ["A", "C"] and db.tensor("C").shape == (7,)
        assert db.tensor("A").tile == (2, 2)


def test_the_catalog_edited_outside_the_session_is_seen_at_its_next_call():
    """A review's case: the session kept the catalog's answers, a user deleted a tensor's row in
    SQL and made a table of that name, and ``replace=True`` then overwrote the user's table (the
    README promises never). Each session call checks the catalog's fingerprint first."""
    db = eds.connect()
    a = random_array(np.random.default_rng(7), (3, 4), "float64")
    db.store("A", a)
    db.einsum("ij->i", "A", out="C")
    db.tensor("C")
    db.connection.execute("DELETE FROM eds_catalog WHERE name = 'C'")
    db.connection.execute("CREATE OR REPLACE TABLE C AS SELECT 42 AS mine")
    with pytest.raises(eds.EinsumError):
        db.tensor("C")
    with pytest.raises(eds.EinsumError, match="not a stored tensor"):
        db.einsum("ij->j", "A", out="C", replace=True)
    assert db.connection.execute("SELECT mine FROM C").fetchall() == [(42,)]
    # the SQL interface plans inside DuckDB's call of our UDF: it sees the catalog as it is too
    db.einsum("ij->i", "A", out="E")
    assert db.connection.execute("SELECT count(*) FROM einsum('i->i', 'E')").fetchall()[0][0] > 0
    db.connection.execute("DELETE FROM eds_catalog WHERE name = 'E'")
    with pytest.raises(Exception, match="table 'E'.*is BLOB"):  # an ordinary table to it now
        db.connection.execute("SELECT count(*) FROM einsum('i->i', 'E')").fetchall()
    # a row deleted alone: a replace of the same layout writes it again (not skipped as unchanged)
    db.einsum("ij->i", "A", out="D")
    db.connection.execute("DELETE FROM eds_catalog WHERE name = 'D'")
    db.connection.execute("DROP TABLE D")
    db.einsum("ij->i", "A", out="D", replace=True)
    assert "D" in db.tensors()


def test_a_tensor_stored_as_parts_and_one_replaced_by_the_other_through_the_catalog_seen():
    """The parts side of what the session keeps: a tensor stored as parts (a 64 MB budget cuts
    parts of 2 MB) replaced by an einsum's one-table result of the same name and back."""
    with eds.connect(memory="64MB") as db:
        rng = np.random.default_rng(8)
        a = random_array(rng, (512, 1024), "float64")  # 4 MB: parts
        A = db.store("A", a, tile=(128, 1024))
        assert db.backend._parts_of("A")
        np.testing.assert_allclose(db.einsum("ij->i", A).to_numpy(), a.sum(1))
        db.einsum("ij->j", "A", out="S")  # a small result: one table
        small = db.tensor("S").to_numpy()
        db.einsum("ij->j", "A", out="A", replace=True)  # the parted tensor replaced by one table
        assert not db.backend._parts_of("A")
        np.testing.assert_allclose(db.tensor("A").to_numpy(), small)
        db.store("A", a, tile=(128, 1024), replace=True)  # and parts again
        assert db.backend._parts_of("A")
        np.testing.assert_allclose(db.tensor("A").to_numpy(), a)
        np.testing.assert_allclose(db.einsum("ij->i", "A").to_numpy(), a.sum(1))


def test_a_connection_using_a_read_only_database_is_refused_and_left_as_it_was(tmp_path):
    """After ``USE`` of a database attached read-only, the session cannot keep its catalog
    there: DuckDB's raw InvalidInputException before, and ``arrow_large_buffer_size`` left set
    on the user's connection (a reviewer's case)."""
    path = tmp_path / "ro.duckdb"
    duckdb.connect(str(path)).close()
    con = duckdb.connect()
    con.execute(f"ATTACH '{path}' AS ro (READ_ONLY)")
    con.execute("USE ro")
    before = con.execute("SELECT current_setting('arrow_large_buffer_size')").fetchall()
    with pytest.raises(eds.EinsumError, match="current database is read-only.*USE a writable database"):
        eds.connect(con)
    assert con.execute("SELECT current_setting('arrow_large_buffer_size')").fetchall() == before
    con.execute("USE memory")
    with eds.connect(con) as db:  # nothing of the failed one is left in the way
        np.testing.assert_array_equal(db.store("A", np.ones(3)).to_numpy(), np.ones(3))
    con.close()


@pytest.mark.parametrize("alter", ["RENAME COLUMN d0 TO x0", "ALTER d0 TYPE VARCHAR", "DROP COLUMN tile"])
def test_a_tensor_table_altered_in_sql_is_the_steps_error_not_a_raw_one(alter):
    """The check before a plan met a table that no longer binds with DuckDB's raw
    BinderException (an "internal error" on the command line); the step's own error names it."""
    db = eds.connect()
    db.store("A", np.ones((4, 4)), tile=(2, 2))
    db.connection.execute(f"ALTER TABLE A {alter}")
    with pytest.raises(eds.EinsumError, match=r"step 0 \(einsum ij->j"):
        db.einsum("ij->j", "A")


def test_a_tensors_table_renamed_or_dropped_in_sql_is_said_by_name():
    """A tensor's table renamed (or dropped) in SQL failed step 0 with DuckDB's "Table with
    name A does not exist!" (a trial): the key check before a plan now names the tensor and
    the way out, for db.einsum and the SQL interface alike, and db.drop clears the entry."""
    db = eds.connect()
    a = random_array(np.random.default_rng(8), (5, 4), "float64")
    db.store("A", a, tile=(2, 2))
    db.store("B", a, tile=(2, 2))
    db.connection.execute("ALTER TABLE A RENAME TO A_moved")
    said = "stored tensor 'A': its table 'A' no longer exists .renamed or dropped in SQL.*db.drop.'A'."
    with pytest.raises(eds.EinsumError, match=said):
        db.einsum("ij,ij->", "B", "A", out="S")
    with pytest.raises(duckdb.Error, match=said):
        db.connection.sql("SELECT * FROM einsum('ij->', 'A')").fetchall()
    assert "S" not in db.tensors()
    db.connection.execute("ALTER TABLE A_moved RENAME TO A")  # back: runs
    np.testing.assert_allclose(db.einsum("ij,ij->", "B", "A").to_numpy(), (a * a).sum())
    db.connection.execute("DROP TABLE A")
    with pytest.raises(eds.EinsumError, match=said):
        db.einsum("ij->", "A")
    db.drop("A")
    assert db.tensors() == ["B"]
