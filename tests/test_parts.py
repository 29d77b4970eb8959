"""Big stored tensors as part tables behind a view (eindecomp_sql/backends/parts.py): every way
in and out reads the same numbers, replacing and dropping leave nothing behind, a failed or
killed store leaves no tensor and no part that the next open does not sweep, plain DuckDB reads
the view, and the store's resident memory no longer grows with the tensor."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import duckdb
import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.backends import parts
from eindecomp_sql.jobs import files
from helpers import DTYPES, random_array
from reference import reference  # np.einsum, and bfloat16's rule where numpy has none

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.duckdb_only("parts are how the DuckDB backend stores big tensors")


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of 200 bytes of tiles: tensors of a few dozen elements are parted."""
    monkeypatch.setattr(parts, "PART_BYTES", 200)


def part_tables(con) -> list[str]:
    return sorted(r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE starts_with(table_name, '_eds_part_')").fetchall())


def listed(con, name) -> list[str]:
    return [r[0] for r in con.execute("SELECT part FROM eds_parts WHERE lower(name) = lower(?) ORDER BY k",
                                      [name]).fetchall()]


def is_view(con, name) -> bool:
    return bool(con.execute("SELECT count(*) FROM duckdb_views() WHERE lower(view_name) = lower(?)",
                            [name]).fetchone()[0])


# -- the reader split ----------------------------------------------------------------------------
@given(sizes=st.lists(st.integers(0, 9), max_size=8), rows=st.integers(1, 7))
def test_split_reader_cuts_at_exact_rows_and_keeps_order(sizes, rows):
    schema = pa.schema([("x", pa.int64())])
    start, batches = 0, []
    for n in sizes:
        batches.append(pa.record_batch([pa.array(range(start, start + n), pa.int64())], schema=schema))
        start += n
    got = [r.read_all().column("x").to_pylist() for r in
           parts.split_reader(pa.RecordBatchReader.from_batches(schema, iter(batches)), rows)]
    assert [x for g in got for x in g] == list(range(start))
    assert all(len(g) == rows for g in got[:-1]) and (not got or 1 <= len(got[-1]) <= rows)


def test_rows_per_part_one_table_when_small_and_bounded_count():
    from eindecomp_sql.plan import TiledValue

    small = TiledValue("a", (100, 100), "float32", (10, 10), ("d0", "d1"))
    assert parts.rows_per_part(small) is None  # 40 KB: one table
    big = TiledValue("a", (16384, 16384), "float32", (1024, 1024), ("d0", "d1"))  # 1 GiB, 256 tiles of 4 MB
    assert parts.rows_per_part(big) == parts.PART_BYTES // (4 << 20)
    huge = TiledValue("a", (1 << 20, 1 << 20), "float32", (1024, 1024), ("d0", "d1"))  # 4 TiB
    rows = parts.rows_per_part(huge)
    assert -(-(1 << 20) // rows) <= parts.MAX_PARTS
    one_tile = TiledValue("a", (8192, 8192), "float64", (8192, 8192), ("d0", "d1"))
    assert parts.rows_per_part(one_tile) == 1  # 512 MiB in one tile: one part, its tile in a struct
    at_most = TiledValue("a", (2048, 2048), "float32", (2048, 2048), ("d0", "d1"))  # 16 MiB: one table
    assert parts.rows_per_part(at_most) is None
    few = TiledValue("a", (3000, 3000), "float32", (3000, 1000), ("d0", "d1"))  # 36 MB in 3 tiles of 12 MB
    assert parts.rows_per_part(few) == 1


# -- every way in and out --------------------------------------------------------------------------
@settings(max_examples=25)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       data=st.data())
def test_parted_tensors_read_like_tables(dtype, shape, data, tmp_path_factory):
    parts.PART_BYTES, old = 200, parts.PART_BYTES
    try:
        tile = tuple(data.draw(st.integers(1, n)) for n in shape)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        a = random_array(rng, tuple(shape), dtype)
        d = tmp_path_factory.mktemp("parts")
        db = eds.connect(str(d / "p.duckdb"))
        try:
            T = db.store("A", a, tile=tile)
            expect_parts = None if parts.rows_per_part(T.value) is None else -(-np.prod(T.value.grid) // parts.rows_per_part(T.value))
            assert (len(listed(db.connection, "A")) or None) == expect_parts
            np.testing.assert_array_equal(T.to_numpy(), a)
            for suffix in (".npy", ".parquet", ".arrow"):
                p = T.export(d / f"a{suffix}")
                B = db.store("B", p, tile=tile, replace=True,
                             **({"dtype": dtype} if suffix == ".npy" and dtype == "bfloat16" else {}))
                np.testing.assert_array_equal(B.to_numpy(), a)
            # a contraction over parted operands
            spec = "".join("ijk"[:len(shape)]) + "->" + "".join("ijk"[:len(shape)])[::-1][:1]
            got, want = db.einsum_numpy(spec, "A"), reference(spec, a)
            if a.dtype.kind in "fc" or dtype == "bfloat16":  # sums in another order
                # bfloat16 is rounded once from float32 sums (4 of its eps is ample)
                eps = ml_dtypes.finfo(a.dtype).eps * (4 if dtype == "bfloat16" else 1000)
                np.testing.assert_allclose(got.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
                                           want.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
                                           rtol=eps, atol=eps * float(np.abs(a.astype(np.float64) if dtype == "bfloat16" else a).sum()))
            else:
                np.testing.assert_array_equal(got, want)
            db.drop("A")
            db.drop("B")
            assert part_tables(db.connection) == [] and db.connection.execute("SELECT count(*) FROM eds_parts").fetchone()[0] == 0
        finally:
            db.close()
    finally:
        parts.PART_BYTES = old


def test_gemm_over_parted_operands_and_plain_duckdb_reads_the_view(tmp_path, small_parts):
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((37, 23)), rng.standard_normal((23, 19))
    path = str(tmp_path / "g.duckdb")
    with eds.connect(path) as db:
        A, B = db.store("A", a, tile=(5, 4)), db.store("B", b, tile=(4, 6))
        assert is_view(db.connection, "A") and len(listed(db.connection, "A")) > 2
        C = db.einsum("ij,jk->ik", A, B, out="C")
        np.testing.assert_allclose(C.to_numpy(), a @ b, rtol=1e-12)
    con = duckdb.connect(path, read_only=True)  # no eindecomp_sql: the layout alone
    rows = con.execute('SELECT d0, d1, tile FROM "A" ORDER BY d0, d1').fetchall()
    con.close()
    assert len(rows) == 8 * 6
    d0, d1, raw = rows[-1]
    np.testing.assert_array_equal(np.frombuffer(raw, "<f8").reshape(2, 3), a[35:, 20:])


# -- tiles in a struct (docs/DESIGN.md "Tiles in a one-field struct") ----------------------------
def part_column_type(con, part: str) -> str:
    return con.execute("SELECT data_type FROM duckdb_columns() WHERE table_name = ? AND column_name = 'tile'",
                       [part]).fetchone()[0]


def test_a_one_tile_tensor_over_part_bytes_is_one_part_whose_tiles_are_a_struct(tmp_path, small_parts):
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((9, 7)), rng.standard_normal((7, 8))
    path = str(tmp_path / "s.duckdb")
    with eds.connect(path) as db:
        con = db.connection
        db.store("A", a, tile=(9, 7))  # 504 bytes in one tile, more than the 200 of a part
        db.store("B", b, tile=(7, 8))
        assert [len(listed(con, n)) for n in "AB"] == [1, 1] and is_view(con, "A")
        assert part_column_type(con, listed(con, "A")[0]) == "STRUCT(t BLOB)"
        # DuckDB keeps no distinct-count statistics of a struct column (what it hashes a BLOB for)
        C = db.einsum("ij,jk->ik", "A", "B", out="C")
        np.testing.assert_allclose(C.to_numpy(), a @ b, rtol=1e-12)
        assert len(listed(con, "C")) == 1 and part_column_type(con, listed(con, "C")[0]) == "STRUCT(t BLOB)"
    con = duckdb.connect(path, read_only=True)  # no eindecomp_sql: the view hands BLOBs
    (raw,) = con.execute('SELECT tile FROM "A"').fetchone()
    assert isinstance(raw, bytes)
    np.testing.assert_array_equal(np.frombuffer(raw, "<f8").reshape(9, 7), a)
    con.close()


def test_a_repeated_out_renames_its_new_part_into_the_old_ones_place(tmp_path, small_parts, monkeypatch):
    rng = np.random.default_rng(12)
    a, b, b2 = rng.standard_normal((9, 7)), rng.standard_normal((7, 8)), rng.standard_normal((7, 8))
    with eds.connect(str(tmp_path / "r.duckdb")) as db:
        con = db.connection
        db.store("A", a, tile=(9, 7))
        db.store("B", b, tile=(7, 8))
        db.store("B2", b2, tile=(7, 8))
        db.einsum("ij,jk->ik", "A", "B", out="C")
        names = listed(con, "C")
        oid = con.execute("SELECT table_oid FROM duckdb_tables() WHERE table_name = ?", names).fetchone()[0]
        ran = []
        real = type(db.backend)._run
        with monkeypatch.context() as m:
            m.setattr(type(db.backend), "_run", lambda self, sql, *args, **kw: (ran.append(sql), real(self, sql, *args, **kw))[1])
            C = db.einsum("ij,jk->ik", "A", "B2", out="C", replace=True)
        np.testing.assert_allclose(C.to_numpy(), a @ b2, rtol=1e-12)  # the new numbers, not the old part's
        assert listed(con, "C") == names  # the view and its eds_parts row stand
        assert con.execute("SELECT table_oid FROM duckdb_tables() WHERE table_name = ?", names).fetchone()[0] != oid
        writes = [q for q in ran if not q.lstrip().upper().startswith("SELECT")]
        assert not [q for q in writes if "eds_parts" in q or "eds_catalog" in q]
        assert not [q for q in writes if "VIEW" in q.upper()]
        assert set(part_tables(con)) == {p for n in ("A", "B", "B2", "C") for p in listed(con, n)}
        # another dtype, the same key columns: renamed in place too
        D = db.einsum("ij,jk->ik", "A", "B", out="C", replace=True, dtype="float32", casting="same_kind")
        np.testing.assert_allclose(D.to_numpy(), (a @ b).astype(np.float32), rtol=1e-5)
        assert listed(con, "C") == names and part_tables(con) == sorted({p for n in ("A", "B", "B2", "C") for p in listed(con, n)})
        # other key columns (the view's): listed anew, under a new view
        E = db.einsum("ij,jk->ikj", "A", "B", out="C", replace=True)  # 4 KB, one tile: one part
        np.testing.assert_array_equal(E.to_numpy(), np.einsum("ij,jk->ikj", a, b))
        assert len(listed(con, "C")) == 1 and listed(con, "C") != names
        assert part_tables(con) == sorted({p for n in ("A", "B", "B2", "C") for p in listed(con, n)})
        F = db.einsum("ij,jk->ik", "A", "B", out="C", replace=True)
        np.testing.assert_allclose(F.to_numpy(), a @ b, rtol=1e-12)
        # a view put in the tensor's place by hand is dropped, not left in front of the new part
        con.execute('CREATE OR REPLACE VIEW "C" AS SELECT * FROM "B"')
        G = db.einsum("ij,jk->ik", "A", "B2", out="C", replace=True)
        np.testing.assert_allclose(G.to_numpy(), a @ b2, rtol=1e-12)
        assert listed(con, "C") != names and part_tables(con) == sorted({p for n in ("A", "B", "B2", "C") for p in listed(con, n)})
        # the name spelled otherwise: the view and the catalog take the new spelling (a review)
        db.einsum("ij,jk->ik", "A", "B2", out="c", replace=True)
        assert con.execute("SELECT view_name FROM duckdb_views() WHERE lower(view_name) = 'c'").fetchall() == [("c",)]
        assert con.execute("SELECT name FROM eds_catalog WHERE lower(name) = 'c'").fetchall() == [("c",)]
        np.testing.assert_allclose(db.tensor("c").to_numpy(), a @ b2, rtol=1e-12)


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), data=st.data())
def test_results_replaced_as_parts_read_the_new_numbers(dtype, shape, data, tmp_path_factory):
    parts.PART_BYTES, old = 200, parts.PART_BYTES
    try:
        tile = tuple(data.draw(st.integers(1, n)) for n in shape)
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        a, a2 = random_array(rng, tuple(shape), dtype), random_array(rng, tuple(shape), dtype)
        spec = "ijk"[:len(shape)] + "->" + "ijk"[:len(shape)][::-1]  # a transpose: exact in every dtype
        with eds.connect(str(tmp_path_factory.mktemp("rp") / "r.duckdb")) as db:
            for k, x in enumerate((a, a2, a)):
                db.store("A", x, tile=tile, replace=True)
                C = db.einsum(spec, "A", out="C", replace=k > 0)
                np.testing.assert_array_equal(C.to_numpy(), np.transpose(x))
                np.testing.assert_array_equal(db.tensor("A").to_numpy(), x)
                listed_now = {p for n in ("A", "C") for p in listed(db.connection, n)}
                assert set(part_tables(db.connection)) == listed_now
    finally:
        parts.PART_BYTES = old


def test_a_database_with_blob_parts_from_before_reads_and_is_replaced(tmp_path, small_parts):
    """Parts written before tiles went into a struct (BLOB columns behind a view of ``SELECT *``)
    are read as they were, and replaced through a new view, never renamed under the old one."""
    rng = np.random.default_rng(13)
    a, a2 = rng.standard_normal((9, 7)), rng.standard_normal((9, 7))
    path = str(tmp_path / "old.duckdb")
    with eds.connect(path) as db:
        db.store("A", a, tile=(3, 7))
        con = db.connection
        # rewrite A as the code before this wrote it: BLOB parts named _eds_part_<hex>_<k>
        new = listed(con, "A")
        old = [f"_eds_part_0123456789ab_{k}" for k in range(len(new))]
        con.execute('DROP VIEW "A"')
        for o, n in zip(old, new):
            con.execute(f"CREATE TABLE {o} AS SELECT * REPLACE (struct_extract(tile, 't') AS tile) FROM {n}")
            con.execute(f"DROP TABLE {n}")
        con.execute('CREATE VIEW "A" AS ' + " UNION ALL ".join(f"SELECT * FROM {o}" for o in old))
        con.execute("DELETE FROM eds_parts")
        con.execute("INSERT INTO eds_parts SELECT 'A', k - 1, part FROM unnest(?) WITH ORDINALITY AS u(part, k)", [old])
    with eds.connect(path) as db:
        con = db.connection
        assert part_column_type(con, old[0]) == "BLOB"
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), a)
        np.testing.assert_array_equal(db.einsum_numpy("ij->ji", "A"), a.T)
        db.store("A", a2, tile=(3, 7), replace=True)  # as many parts: not renamed under the old view
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), a2)
        assert not set(old) & set(part_tables(con)) and set(part_tables(con)) == set(listed(con, "A"))
        assert all(part_column_type(con, p) == "STRUCT(t BLOB)" for p in listed(con, "A"))


# -- replacing and dropping ----------------------------------------------------------------------
def test_replace_between_parted_and_single_and_by_einsum(tmp_path, small_parts):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((20, 10)).astype(np.float32)
    with eds.connect(str(tmp_path / "r.duckdb")) as db:
        con = db.connection
        db.store("A", a, tile=(3, 3))
        first = listed(con, "A")
        db.store("A", a * 2, tile=(4, 4), replace=True)  # parted -> parted
        assert not set(first) & set(part_tables(con))
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), a * 2)
        db.store("A", a[:2, :2], replace=True)  # parted -> one table
        assert listed(con, "A") == [] and not is_view(con, "A") and part_tables(con) == []
        db.store("A", a, tile=(3, 3), replace=True)  # one table -> parted
        assert is_view(con, "A")
        with pytest.raises(EinsumError, match="already exists"):
            db.store("A", a, tile=(3, 3))
        # an einsum result over a parted tensor (a view is not replaced by CREATE OR REPLACE TABLE)
        db.store("B", a, tile=(5, 5))
        old_a = listed(con, "A")
        T = db.einsum("ij,ij->ij", "B", "B", out="A", replace=True)
        np.testing.assert_array_equal(T.to_numpy(), a * a)
        # one statement's result of more than PART_BYTES: one part (its tiles in a struct)
        assert len(listed(con, "A")) == 1 and not set(old_a) & set(part_tables(con))
        assert set(part_tables(con)) == set(listed(con, "A")) | set(listed(con, "B"))
        # one statement reading the parted tensor it replaces
        old_b = listed(con, "B")
        db.einsum("ij->ij", "B", join="x * 3", out="B", replace=True)
        np.testing.assert_array_equal(db.tensor("B").to_numpy(), a * 3)
        assert len(listed(con, "B")) == 1 and not set(old_b) & set(part_tables(con))
        assert set(part_tables(con)) == set(listed(con, "A")) | set(listed(con, "B"))
        db.drop("B")
        db.drop("A")
        assert db.tensors() == [] and part_tables(con) == []


def test_a_tensor_whose_eds_parts_rows_were_deleted_by_hand_keeps_its_data_and_can_be_dropped(tmp_path,
                                                                                               small_parts):
    """``DELETE FROM eds_parts WHERE name = 'A'`` (the view still reads its parts): the next open
    swept every part as listed by no tensor, the view and catalog row left reading nothing; and
    drop / replace failed with DuckDB's "Existing object A is of type View" (a trial)."""
    a = np.random.default_rng(41).standard_normal((12, 10))
    path = str(tmp_path / "f.duckdb")
    with eds.connect(path) as db:
        db.store("A", a, tile=(4, 5))
        db.store("B", a * 3, tile=(4, 5))
        made = listed(db.connection, "A")
        assert len(made) > 1
    con = duckdb.connect(path)
    con.execute("DELETE FROM eds_parts WHERE name = 'A'")
    con.close()
    with eds.connect(path) as db:  # the open's sweep spares what a view reads
        assert part_tables(db.connection) == sorted(made + listed(db.connection, "B"))
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), a)
        db.drop("A")
        assert db.tensors() == ["B"] and not is_view(db.connection, "A")
        assert part_tables(db.connection) == sorted(listed(db.connection, "B"))  # A's parts went with it
        np.testing.assert_array_equal(db.tensor("B").to_numpy(), a * 3)
    con = duckdb.connect(path)
    con.execute("DELETE FROM eds_parts WHERE name = 'B'")
    con.close()
    with eds.connect(path) as db:  # and a replace
        np.testing.assert_array_equal(db.store("B", a, tile=(4, 5), replace=True).to_numpy(), a)
        assert part_tables(db.connection) == sorted(listed(db.connection, "B"))


def test_a_result_of_several_statements_under_a_budget_is_parts_of_the_budgets_size(tmp_path):
    """A 16 MB result computed in 3 statements under memory="40MB" was one table (the fixed
    16 MiB part size), while store cut a 6 MB tensor into parts under the same budget (a trial):
    a batched result now follows the session's part size, a part a statement."""
    rng = np.random.default_rng(43)
    a = rng.standard_normal((2000, 64)).astype(np.float32)
    b = rng.standard_normal((64, 2000)).astype(np.float32)
    with eds.connect(str(tmp_path / "f.duckdb"), memory="40MB") as db:
        A, B = db.store("A", a), db.store("B", b)
        plan = db.plan("ij,jk->ik", A, B)
        batches = max(len(st.batches) for st in db.backend.compiler.compile_plan(plan))
        assert batches > 1 and plan.outputs[0].nbytes <= parts.PART_BYTES
        C = db.einsum("ij,jk->ik", A, B, out="C")
        assert is_view(db.connection, "C") and len(listed(db.connection, "C")) == batches
        np.testing.assert_allclose(C.to_numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_a_part_table_dropped_in_sql_is_named_by_every_read(tmp_path, small_parts):
    """"tensor 'A' no longer exists in this database" while db.tensors() listed it (a trial)."""
    with eds.connect() as db:
        A = db.store("A", np.arange(120.0).reshape(12, 10), tile=(4, 5))
        gone = listed(db.connection, "A")[0]
        db.connection.execute(f'DROP TABLE "{gone}"')
        for read in (A.to_numpy, A.to_arrow, lambda: A.export(tmp_path / "a.npy")):
            with pytest.raises(EinsumError, match=f"stored tensor 'A': its table '{gone}' no longer exists .*"
                                                  r"db.drop\('A'\)"):
                read()
        db.drop("A")
        assert db.tensors() == [] and part_tables(db.connection) == []


def test_a_failed_store_leaves_nothing_and_keeps_the_old_tensor(tmp_path, small_parts):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((30, 30))
    with eds.connect(str(tmp_path / "f.duckdb")) as db:
        db.store("A", a, tile=(4, 4))
        before = part_tables(db.connection)
        good = db.tensor("A").to_arrow()
        # the same tiles with a wrong byte count in the last row: checked as the stream passes,
        # after several parts have been written
        tiles = good.column("tile").to_pylist()
        tiles[-1] = tiles[-1][:-8]
        bad = good.set_column(good.schema.get_field_index("tile"), "tile", pa.array(tiles, pa.binary()))
        with pytest.raises(EinsumError):
            db.store("A", bad, replace=True)
        with pytest.raises(EinsumError):
            db.store("Z", bad)
        assert db.tensors() == ["A"] and part_tables(db.connection) == before
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), a)


def test_a_bad_tile_in_a_parquet_file_stops_a_parted_store_with_its_own_message(tmp_path, small_parts):
    """A tiled Parquet file is stored part by part, DuckDB reading a range of its rows each
    time; a tile of the wrong size in a late part is the check's error, and the parts
    written before it go."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    a = rng.standard_normal((30, 30))
    with eds.connect(str(tmp_path / "q.duckdb")) as db:
        good = db.store("A", a, tile=(4, 4)).to_arrow().combine_chunks()
        db.drop("A")
        order = np.lexsort([good.column("d1").to_numpy(), good.column("d0").to_numpy()])
        good = good.take(pa.array(order))
        pq.write_table(good, tmp_path / "good.parquet", row_group_size=5)
        np.testing.assert_array_equal(db.store("G", tmp_path / "good.parquet").to_numpy(), a)
        assert len(listed(db.connection, "G")) > 2
        tiles = good.column("tile").to_pylist()
        tiles[-1] = tiles[-1][:-8]
        bad = good.set_column(good.schema.get_field_index("tile"), "tile", pa.array(tiles, pa.binary()))
        pq.write_table(bad, tmp_path / "bad.parquet", row_group_size=5)
        with pytest.raises(EinsumError, match=r"the tile at \(d0=7, d1=7\) holds 24 bytes; a float64 tile there takes 32"):
            db.store("B", tmp_path / "bad.parquet")
        assert db.tensors() == ["G"] and set(part_tables(db.connection)) == set(listed(db.connection, "G"))


def test_cli_export_caps_duckdbs_cache(tmp_path, small_parts):
    """``eindecomp-sql export --memory`` is DuckDB's memory_limit while the tensor streams out
    (a real subprocess; the default caps are tested below)."""
    a = np.arange(40 * 40, dtype=np.float32).reshape(40, 40)
    path = str(tmp_path / "e.duckdb")
    with eds.connect(path) as db:
        db.store("A", a, tile=(8, 8))
    out = tmp_path / "a.npy"
    p = subprocess.run([sys.executable, "-m", "eindecomp_sql", "export", path, "A", str(out), "--memory", "64MB"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    np.testing.assert_array_equal(np.load(out), a)
    p = subprocess.run([sys.executable, "-m", "eindecomp_sql", "export", path, "A", str(out), "--memory", "lots"],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "lots" in p.stderr


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import numpy as np, pyarrow as pa
    import eindecomp_sql as eds
    from eindecomp_sql.backends import parts
    parts.PART_BYTES = 4096
    db = eds.connect(sys.argv[1])
    a = np.arange(64 * 64, dtype=np.float64).reshape(64, 64)
    db.store("Keep", a, tile=(8, 8))
    kill_after = int(sys.argv[2])
    t = db.store("Tmp", a, tile=(8, 8)).to_arrow()
    db.drop("Tmp")
    def batches():
        for k, b in enumerate(t.to_batches(max_chunksize=4)):
            if k == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash between parts, mid-store
            yield b
    db.store("Lost", pa.RecordBatchReader.from_batches(t.schema, batches()))
""")


@pytest.mark.parametrize("kill_after", [3, 11])
def test_a_killed_store_leaves_no_tensor_and_its_parts_are_swept(tmp_path, kill_after):
    path = str(tmp_path / "k.duckdb")
    p = subprocess.run([sys.executable, "-c", _KILLED, path, str(kill_after)], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    con = duckdb.connect(path, read_only=True)
    left = part_tables(con)
    con.close()
    assert left, "the kill came after some parts were committed"
    with eds.connect(path) as db:
        assert db.tensors() == ["Keep"]
        np.testing.assert_array_equal(db.tensor("Keep").to_numpy(), np.arange(64 * 64.0).reshape(64, 64))
        assert set(part_tables(db.connection)) == set(listed(db.connection, "Keep"))


def test_cap_cache_lowers_duckdbs_memory_limit_never_raises(tmp_path, small_parts):
    with eds.connect(str(tmp_path / "c.duckdb")) as db:
        T = db.store("A", np.ones((40, 40)), tile=(8, 8))
        assert files.export_cache_limit(T.value) == files.STREAM_CACHE_BYTES
        assert files.cap_cache(db, files.STREAM_CACHE_BYTES) == files.STREAM_CACHE_BYTES
        assert files._limit_now(db.connection) == files.STREAM_CACHE_BYTES
        assert files.cap_cache(db, 1 << 40) == files.STREAM_CACHE_BYTES  # not raised
        assert files.cap_cache(db, 100 << 20) == 100 << 20


def test_cache_limits_follow_the_parts_and_tiles(tmp_path):
    """Four parts, at least 128 MiB (256 MiB for a store): a part is one tile when tiles are
    bigger than parts."""
    from eindecomp_sql.plan import TiledValue

    big_tiles = TiledValue("a", (8192, 8192), "float64", (4096, 4096), ("d0", "d1"))  # 4 tiles of 128 MiB
    assert files.export_cache_limit(big_tiles) == 4 * (128 << 20)
    legacy = TiledValue("a", (4096, 4096), "float32", (4096, 4096), ("d0", "d1"))  # one 64 MiB tile
    assert files.export_cache_limit(legacy) == 4 * (64 << 20)
    np.save(tmp_path / "a.npy", np.zeros((64, 64), np.float32))
    with eds.connect(str(tmp_path / "l.duckdb"), tile_bytes=1 << 30) as db:
        assert files.store_cache_limit(db, tmp_path / "a.npy") == files.STORE_CACHE_BYTES
        big = np.lib.format.open_memmap(tmp_path / "b.npy", mode="w+", dtype=np.float64, shape=(8192, 8192))
        del big
        assert files.store_cache_limit(db, tmp_path / "b.npy", tile=(4096, 4096)) == 4 * (128 << 20)
        assert files.store_cache_limit(db, tmp_path / "b.npy") == 4 * (512 << 20)  # one 512 MiB tile


# -- memory: the point of parts --------------------------------------------------------------------
_RSS_STORE = textwrap.dedent("""
    import sys
    import eindecomp_sql as eds
    def hwm():  # this process's own peak, in KiB (ru_maxrss starts at the forking parent's
        # size: in the full suite, pytest's ~760 MB, which made base and peak equal)
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    db = eds.connect(sys.argv[1])
    base = hwm()
    db.store("A", sys.argv[2], tile=(512, 512))
    peak = hwm()
    db.close()
    print((peak - base) // 1024)
""")


def test_storing_a_512mb_npy_grows_memory_by_far_less_than_the_tensor(tmp_path):
    """One table of 512 MB of tiles took DuckDB ~4x the tensor to store (+4.2 GB for 1 GiB);
    as parts, a fraction of it (measured in a fresh interpreter)."""
    path = tmp_path / "big.npy"
    a = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(8192, 16384))
    for i in range(0, 8192, 1024):
        a[i:i + 1024] = np.float32(i + 0.5)
    del a
    out = subprocess.run([sys.executable, "-c", _RSS_STORE, str(tmp_path / "m.duckdb"), str(path)],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "EDS_PART_BYTES": str(32 << 20)})
    assert out.returncode == 0, out.stderr
    grew_mb = int(out.stdout.split()[-1])
    assert grew_mb < 460, f"storing 512 MB grew resident memory by {grew_mb} MB"
