"""Files in and out: db.store(name, path) of .npy (memory-mapped, cut tile by tile), Arrow IPC
(.arrow / .feather) and Parquet files, and Tensor.export(path) to each, streamed and atomic;
failures that leave nothing behind; the memory a streamed store takes in Python."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.feather  # noqa: F401  (pa.feather)
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

import eindecomp_sql as eds
from eindecomp_sql import EinsumError, io
from eindecomp_sql.backends import parts as parted
from helpers import DTYPES, random_array

FORMATS = [".npy", ".parquet", ".arrow", ".feather"]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_array_equal(got, want)


def assert_nothing_left(db, name):
    assert name not in db.tensors()
    from helpers import backend_tables

    assert name.lower() not in [t.lower() for t in backend_tables(db)]


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_through_every_format(db, tmp_path, dtype):
    rng = np.random.default_rng(abs(hash(dtype)) % 2**32)
    a = random_array(rng, (7, 5, 3), dtype)  # tiles of (3, 2, 2) do not divide it
    np.save(tmp_path / "a.npy", a)
    # numpy saves bfloat16 as 2-byte voids ('|V2'): such a file is read as bfloat16 when asked to
    as_npy = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
    T = db.store("fio_a", tmp_path / "a.npy", tile=(3, 2, 2), keys=("x", "y", "z"), replace=True, **as_npy)
    assert (T.shape, T.dtype, T.tile, T.keys) == ((7, 5, 3), np.dtype(dtype), (3, 2, 2), ("x", "y", "z"))
    same(T.to_numpy(), a)
    forms = ["tiles"] if np.dtype(dtype).kind == "c" else ["tiles", "elements"]
    for suffix in FORMATS:
        for form in forms if suffix != ".npy" else ["tiles"]:
            p = T.export(tmp_path / f"t{suffix}", form=form)
            assert p == tmp_path / f"t{suffix}"
            B = db.store("fio_b", p, replace=True, **(as_npy if suffix == ".npy" else {}))
            same(B.to_numpy(), a)
            if suffix != ".npy":  # a .npy file is the dense array: store picks tiles and keys anew
                assert (B.tile, B.keys) == ((3, 2, 2), ("x", "y", "z")), (suffix, form)
    assert sorted(os.listdir(tmp_path)) == ["a.npy"] + sorted(f"t{s}" for s in FORMATS)  # no temp files
    same(np.load(tmp_path / "t.npy").view(a.dtype), a)  # (a no-op but for bfloat16's voids)


def test_a_bfloat16_npy_file_needs_its_dtype_named(db, tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3).astype("bfloat16")
    np.save(tmp_path / "w.npy", a)
    with pytest.raises(EinsumError, match=r"2-byte void elements .* pass dtype='bfloat16'"):
        db.store("w", tmp_path / "w.npy")
    with pytest.raises(EinsumError, match=r"2-byte void elements .* a.view\(ml_dtypes.bfloat16\)"):
        db.store("w", np.load(tmp_path / "w.npy"))  # the same voids loaded by numpy
    assert "w" not in db.tensors()
    W = db.store("w", tmp_path / "w.npy", dtype="bfloat16")
    same(W.to_numpy(), a)
    # empty ones too (a view of an empty map has no file to read: nothing to read)
    for shape in ((0, 3), (3, 0)):
        np.save(tmp_path / "e.npy", np.zeros(shape, "bfloat16"))
        same(db.store("e", tmp_path / "e.npy", dtype="bfloat16", replace=True).to_numpy(), np.zeros(shape, "bfloat16"))
        p = db.tensor("e").export(tmp_path / "e2.npy")
        same(db.store("e2", p, dtype="bfloat16", replace=True).to_numpy(), np.zeros(shape, "bfloat16"))


@pytest.mark.parametrize("shape, tile", [((), ()), ((0,), (1,)), ((0, 4), (1, 3)), ((3, 0, 2), (2, 1, 1)),
                                         ((1,), (1,)), ((5, 7), (5, 7)), ((9, 4), (2, 3))])
def test_0d_and_empty_shapes_through_every_format(db, tmp_path, shape, tile):
    a = random_array(np.random.default_rng(1), shape, "float64")
    np.save(tmp_path / "a.npy", a)
    T = db.store("fio_e", tmp_path / "a.npy", tile=tile or None, replace=True)
    assert T.shape == shape
    same(T.to_numpy(), a)
    for suffix in FORMATS:
        for form in ["tiles", "elements"] if suffix != ".npy" else ["tiles"]:
            same(db.store("fio_e2", T.export(tmp_path / f"e{suffix}", form=form), replace=True).to_numpy(), a)


def test_npy_in_other_byte_order_fortran_order_and_cast(db, tmp_path):
    rng = np.random.default_rng(2)
    a = rng.integers(-100, 100, (11, 6)).astype(">i4")
    np.save(tmp_path / "be.npy", a)
    same(db.store("fio_be", tmp_path / "be.npy", tile=(4, 4), replace=True).to_numpy(), a.astype("<i4"))
    f = np.asfortranarray(rng.standard_normal((6, 5)))
    np.save(tmp_path / "f.npy", f)
    same(db.store("fio_f", tmp_path / "f.npy", tile=(4, 2), replace=True).to_numpy(), np.ascontiguousarray(f))
    T = db.store("fio_c", tmp_path / "be.npy", tile=(4, 4), dtype="int8", replace=True)
    same(T.to_numpy(), a.astype(np.int8))
    T = db.store("fio_auto", tmp_path / "f.npy", replace=True)  # tile chosen by tile_bytes
    same(T.to_numpy(), f)


@pytest.mark.duckdb_only("the tile-by-tile .npy read is the streamed store's")
@settings(max_examples=40)
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), order=st.sampled_from(["C", "F"]),
       dtype=st.sampled_from(["<f4", ">f8", "<i2", ">u4", "|b1", "<c8"]), cast=st.booleans(), data=st.data())
def test_npy_tiles_are_read_from_any_box(backend, tmp_path_factory, shape, order, dtype, cast, data):
    """Tiles of a C-order .npy file are read with preadv straight from the file (every box:
    trailing dimensions covered whole or not, edge tiles); Fortran order through the map; other
    byte orders and casts through a copy. All against the array numpy loads."""
    tile = tuple(data.draw(st.integers(1, n)) for n in shape)
    a = random_array(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), tuple(shape),
                     np.dtype(dtype).newbyteorder("="))
    a = np.asarray(a, dtype=dtype, order=order)
    d = tmp_path_factory.mktemp("npy")
    np.save(d / "a.npy", a)
    want = np.ascontiguousarray(a).astype(np.dtype(dtype).newbyteorder("="))
    to = None
    if cast and want.dtype.kind in "fiu":
        to = "float64" if want.dtype.kind == "f" else "int64" if want.dtype.kind == "i" else "uint64"
        want = want.astype(to)
    inc = io.read_source(d / "a.npy", "t", io.Wanted(tile=tile, dtype=to), stream=True)
    got = io._from_table(inc.tiles.read_all().replace_schema_metadata(
        io.tensor_metadata(inc.shape, inc.dtype, inc.tile, inc.keys, "tiles")), io.Wanted(), "t")
    from eindecomp_sql.udfs.tiles import array_from_tiles

    same(array_from_tiles(got.tiles, got.shape, got.tile, got.dtype, got.keys), want)


@pytest.mark.duckdb_only("the .npy export written with pwritev is the DuckDB backend's")
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), run=st.integers(1, 2048),
       dtype=st.sampled_from(["float32", "float64", "int16", "bool", "complex64"]), parts=st.booleans(),
       data=st.data())
def test_npy_export_joins_side_by_side_tiles_into_runs(backend, tmp_path_factory, shape, run, dtype, parts, data):
    """The export joins tiles that lie side by side along the last axis into runs of at most
    RUN_BYTES (random here, down to one tile), edge tiles and all, and writes each as one box;
    tiles in any order (a plain table's) or in C order (parts) give the array numpy has."""
    tile = tuple(data.draw(st.integers(1, n)) for n in shape)
    a = random_array(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), tuple(shape), dtype)
    d = tmp_path_factory.mktemp("runs")
    old = io.RUN_BYTES, parted.PART_BYTES
    io.RUN_BYTES = run
    if parts:
        parted.PART_BYTES = 64  # a few tiles a part: the C order of parts
    try:
        with eds.connect() as db:
            T = db.store("r", a, tile=tile)
            same(np.load(T.export(d / "r.npy")), a)
    finally:
        io.RUN_BYTES, parted.PART_BYTES = old


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), run=st.integers(1, 2048),
       dtype=st.sampled_from(["float32", "float64", "int16", "bool"]), data=st.data())
def test_tile_runs_write_tiles_in_any_order(tmp_path_factory, shape, run, dtype, data):
    """_TileRuns on its own: tiles in a random order (a run only joins a tile that lies right
    after it), runs of any length, every box lands where numpy has it, with bands handed to the
    disk early (the real sync_file_range on Linux), a tile coming later into one included."""
    from types import SimpleNamespace

    from eindecomp_sql.plan import tiling

    shape = tuple(shape)
    tile = tuple(data.draw(st.integers(1, n)) for n in shape)
    a = random_array(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), shape, dtype)
    keys = data.draw(st.permutations(list(np.ndindex(*tiling.grid(shape, tile)))))
    path = tmp_path_factory.mktemp("tr") / "a.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=a.dtype, shape=shape)
    boxes = io._FileBoxes(path, out.offset, shape, a.dtype.itemsize, "t", write=True)
    del out
    old = io.RUN_BYTES
    io.RUN_BYTES = run
    try:
        runs = io._TileRuns(boxes, SimpleNamespace(dtype=dtype, tile=tile, shape=shape))
        for k in keys:
            box = tuple(slice(q * t, min((q + 1) * t, n)) for q, t, n in zip(k, tile, shape))
            runs.add(box, np.ascontiguousarray(a[box]).reshape(-1).view(np.uint8))
        runs.flush()
    finally:
        io.RUN_BYTES = old
        boxes.close()
    same(np.load(path), a)


def test_a_truncated_npy_is_refused_with_its_name(db, tmp_path):
    a = np.arange(64 * 64, dtype=np.float64).reshape(64, 64)
    np.save(tmp_path / "a.npy", a)
    with open(tmp_path / "a.npy", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "a.npy") - 4096)
    with pytest.raises(EinsumError, match="a.npy"):
        db.store("fio_trunc", tmp_path / "a.npy", tile=(8, 8), replace=True)
    assert_nothing_left(db, "fio_trunc")


def test_npy_streams_in_many_batches(db, tmp_path, monkeypatch):
    monkeypatch.setattr(io, "STREAM_BATCH_BYTES", 100)  # a few tiles a batch
    a = random_array(np.random.default_rng(3), (50, 33), "float32")
    np.save(tmp_path / "a.npy", a)
    T = db.store("fio_many", tmp_path / "a.npy", tile=(4, 5), replace=True)
    same(T.to_numpy(), a)
    inc = io.read_source(tmp_path / "a.npy", "t", io.Wanted(tile=(4, 5)), stream=True)
    assert isinstance(inc.tiles, pa.RecordBatchReader)
    assert max(b.num_rows for b in inc.tiles) == 1  # 80-byte tiles, 100-byte batches


def test_tiled_parquet_and_arrow_written_by_pyarrow(db, tmp_path):
    """A tiled file another program wrote: pyarrow, no metadata of ours (shape=, dtype=, tile=)."""
    a = np.arange(35, dtype=np.int16).reshape(7, 5)
    t = db.store("fio_src", a, tile=(3, 2), replace=True).to_arrow()
    plain = t.replace_schema_metadata(None).rename_columns(["r", "c", "tile"])
    pq.write_table(plain, tmp_path / "t.parquet")
    with pa.ipc.new_file(tmp_path / "t.arrow", plain.schema) as w:
        for b in plain.to_batches(max_chunksize=2):
            w.write_batch(b)
    for p in (tmp_path / "t.parquet", tmp_path / "t.arrow"):
        T = db.store("fio_plain", p, shape=(7, 5), dtype="int16", tile=(3, 2), replace=True)
        assert T.keys == ("r", "c")
        same(T.to_numpy(), a)
    # an IPC *stream* (not file) reads too, and big-endian tiles are swapped
    big = t.replace_schema_metadata({**t.schema.metadata, b"eindecomp_sql.byte_order": b'"big"'})
    swapped = np.array([np.frombuffer(x, "<i2").astype(">i2").tobytes() for x in big.column("tile").to_pylist()],
                       dtype=object)
    big = big.set_column(2, "tile", pa.array(list(swapped), pa.binary()))
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, big.schema) as w:
        w.write_table(big)
    same(db.store("fio_stream", tmp_path / "s.arrow", replace=True).to_numpy(), a)


def test_store_recuts_a_tiled_file(db, tmp_path):
    a = random_array(np.random.default_rng(4), (9, 8), "float32")
    T = db.store("fio_r", a, tile=(4, 4), replace=True)
    for suffix in (".parquet", ".arrow"):
        B = db.store("fio_r2", T.export(tmp_path / f"r{suffix}"), tile=(3, 5), dtype="float64", replace=True)
        assert (B.tile, B.dtype) == ((3, 5), np.dtype("float64"))
        same(B.to_numpy(), a.astype(np.float64))


# -- element form from other writers ------------------------------------------------------------
def test_element_parquet_written_like_pandas_and_spark(db, tmp_path):
    rng = np.random.default_rng(5)
    a = np.zeros((4, 6))
    rows = [(1, 2, 1.5), (3, 0, -2.0), (0, 5, 7.25)]
    for i, j, v in rows:
        a[i, j] = v
    # what pandas writes for a filtered frame: int64 columns, its index as __index_level_0__, and
    # a 'pandas' metadata key
    t = pa.table({"i": [r[0] for r in rows], "j": [r[1] for r in rows], "value": [r[2] for r in rows],
                  "__index_level_0__": [7, 11, 40]},
                 metadata={b"pandas": json.dumps({"index_columns": ["__index_level_0__"]}).encode()})
    pq.write_table(t, tmp_path / "pandas.parquet")
    same(db.store("fio_pd", tmp_path / "pandas.parquet", replace=True).to_numpy(), a)
    # Spark: int32 index columns, a double value, its own row metadata
    s = pa.table({"row": pa.array([r[0] for r in rows], pa.int32()), "col": pa.array([r[1] for r in rows], pa.int32()),
                  "x": [r[2] for r in rows]},
                 metadata={b"org.apache.spark.sql.parquet.row.metadata": b"{}"})
    pq.write_table(s, tmp_path / "spark.parquet")
    same(db.store("fio_sp", tmp_path / "spark.parquet", shape=(4, 6), replace=True).to_numpy(), a)
    pa.feather.write_feather(s, tmp_path / "spark.feather")  # lz4-compressed Feather v2
    same(db.store("fio_fe", tmp_path / "spark.feather", shape=(4, 6), replace=True).to_numpy(), a)
    big = rng.standard_normal((30, 20))
    i, j = np.nonzero(big)
    pq.write_table(pa.table({"i": i, "j": j, "value": big[i, j]}), tmp_path / "dense.parquet", row_group_size=50)
    same(db.store("fio_dense", tmp_path / "dense.parquet", replace=True).to_numpy(), big)


def test_element_parquet_written_by_pandas(db, tmp_path):
    import pandas as pd  # a test dependency (pyproject's test extras)
    df = pd.DataFrame({"i": [0, 2, 1], "j": [1, 0, 1], "value": [1.5, -2.0, 3.0]})
    df[df.value != 3.0].to_parquet(tmp_path / "p.parquet")  # a filtered frame: its index is written
    same(db.store("fio_pandas", tmp_path / "p.parquet", replace=True).to_numpy(), np.array([[0, 1.5], [0, 0], [-2.0, 0]]))


# -- failures leave nothing -----------------------------------------------------------------------
def _bad_npy(tmp_path):
    (tmp_path / "junk.npy").write_bytes(b"not a numpy file")
    a = np.ones((100, 100))
    np.save(tmp_path / "short.npy", a)
    data = (tmp_path / "short.npy").read_bytes()
    (tmp_path / "short.npy").write_bytes(data[:len(data) // 2])
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))
    np.save(tmp_path / "f128.npy", np.ones(3, np.longdouble))
    return [("junk.npy", {}, "cannot read .*as a .npy file"), ("short.npy", {}, "cannot read"),
            ("obj.npy", {}, "cannot read"), ("f128.npy", {}, "float128"), ("missing.npy", {}, "no such .npy file"),
            ("missing.arrow", {}, "no such Arrow IPC file"), ("junk.npy", {"shape": (3,)}, "brings its own shape"),
            ("x.csv", {}, r"\.npy, \.arrow / \.feather .* or \.parquet")]


def test_bad_files_are_refused_and_leave_nothing(db, tmp_path):
    for name, kw, match in _bad_npy(tmp_path):
        with pytest.raises(EinsumError, match=match):
            db.store("fio_bad", tmp_path / name, **kw)
        assert_nothing_left(db, "fio_bad")
    (tmp_path / "junk.arrow").write_bytes(b"ARROW1 but not really")
    with pytest.raises(EinsumError, match="cannot read .* as an Arrow IPC file"):
        db.store("fio_bad", tmp_path / "junk.arrow")
    assert_nothing_left(db, "fio_bad")


def test_a_failure_mid_stream_leaves_nothing(db, tmp_path, monkeypatch):
    """An exception raised while the tiles stream in (after some are stored) rolls it all back,
    and is the exception store raises."""
    monkeypatch.setattr(io, "STREAM_BATCH_BYTES", 64)
    np.save(tmp_path / "a.npy", np.arange(400.0).reshape(20, 20))
    calls = []
    real = io._release

    def failing(mm):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("disk went away")
        real(mm)

    monkeypatch.setattr(io, "_release", failing)
    with pytest.raises(RuntimeError, match="disk went away"):
        db.store("fio_mid", tmp_path / "a.npy", tile=(2, 2))
    assert_nothing_left(db, "fio_mid")
    # a dtype= cast that overflows in a late tile says where, in the whole array
    b = np.zeros((20, 20), np.int64)
    b[17, 13] = 300
    np.save(tmp_path / "b.npy", b)
    monkeypatch.setattr(io, "_release", real)
    with pytest.raises(EinsumError, match=r"value 300 at \(17, 13\) does not fit dtype=int8"):
        db.store("fio_mid", tmp_path / "b.npy", tile=(2, 2), dtype="int8")
    assert_nothing_left(db, "fio_mid")


def _tiled(db, tmp_path):
    a = np.arange(48.0).reshape(8, 6)
    return db.store("fio_t", a, tile=(3, 4), replace=True).to_arrow()


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
@pytest.mark.parametrize("damage, match", [
    ("short_tile", r"the tile at \(d0=2, d1=1\) holds 8 bytes; a float64 tile there takes 32"),
    ("null_tile", "null"),
    ("dup_key", r"tile key \(d0=0, d1=0\) appears more than once"),
    ("missing_row", "5 tile rows, but shape"),
    ("key_range", "key column 'd1' holds 7"),
])
def test_bad_tiled_files_leave_nothing(db, tmp_path, suffix, damage, match):
    t = _tiled(db, tmp_path).sort_by([("d0", "ascending"), ("d1", "ascending")])
    tiles = t.column("tile").to_pylist()
    d0, d1 = t.column("d0").to_pylist(), t.column("d1").to_pylist()
    if damage == "short_tile":
        tiles[-1] = tiles[-1][:8]
    elif damage == "null_tile":
        tiles[3] = None
    elif damage == "dup_key":  # a copy of the first row in place of the second
        d0[1], d1[1], tiles[1] = d0[0], d1[0], tiles[0]
    elif damage == "missing_row":
        tiles, d0, d1 = tiles[:-1], d0[:-1], d1[:-1]
    else:
        d1[1] = 7
    bad = pa.table({"d0": d0, "d1": d1, "tile": pa.array(tiles, pa.binary())}, schema=t.schema)
    p = tmp_path / f"bad{suffix}"
    if suffix == ".parquet":
        pq.write_table(bad, p, row_group_size=2)
    else:
        with pa.ipc.new_file(p, bad.schema) as w:
            for b in bad.to_batches(max_chunksize=2):  # the damage is in a later batch
                w.write_batch(b)
    with pytest.raises(EinsumError, match=match):
        db.store("fio_badt", p)
    assert_nothing_left(db, "fio_badt")


# -- export -------------------------------------------------------------------------------------
def test_export_failure_leaves_no_file_and_keeps_the_old_one(db, tmp_path, monkeypatch):
    T = db.store("fio_x", np.arange(400.0).reshape(20, 20), tile=(3, 3), replace=True)
    for suffix in FORMATS:
        (tmp_path / f"old{suffix}").write_bytes(b"old")

    def failing(batch, value):
        raise RuntimeError("disk full")
        yield  # a generator, as the real one

    monkeypatch.setattr(io, "_tile_boxes", failing)  # after the new file is opened
    for suffix in FORMATS:
        with pytest.raises(RuntimeError, match="disk full"):
            T.export(tmp_path / f"old{suffix}", form="elements" if suffix != ".npy" else "tiles")
        with pytest.raises(RuntimeError, match="disk full"):
            T.export(tmp_path / f"new{suffix}", form="elements" if suffix != ".npy" else "tiles")
        assert (tmp_path / f"old{suffix}").read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == sorted(f"old{s}" for s in FORMATS)
    monkeypatch.undo()
    with pytest.raises(EinsumError, match="cannot write"):
        T.export(tmp_path / "no" / "such" / "dir.npy")


def test_exports_fsync_only_when_asked(db, tmp_path, monkeypatch):
    """Atomic always (a rename), durable on request: sync=True fsyncs the file and its
    directory, for every format and for to_parquet; without it nothing is fsynced (as np.save
    and DuckDB's COPY ... TO). A .npy export hands each finished band of rows to the disk as it
    goes, either way (not the last: the page cache, or the fsync, takes that one), and the file
    is numpy's array."""
    a = random_array(np.random.default_rng(11), (23, 17), "float64")
    T = db.store("fio_sync", a, tile=(5, 4), replace=True)
    synced, bands = [], []
    real_fsync, real_writeback = os.fsync, io._FileBoxes.writeback
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(io._FileBoxes, "writeback",
                        lambda self, rows: (bands.append((rows.start, rows.stop)), real_writeback(self, rows)))
    for name in ("a.npy", "a.parquet", "a.arrow"):
        T.export(tmp_path / name)
        T.to_parquet(tmp_path / "b.parquet")
    assert synced == []
    same(np.load(tmp_path / "a.npy"), a)
    assert sorted(bands) == [(r, r + 5) for r in range(0, 20, 5)]  # bands 0-3 of 5 (0..22)
    bands.clear()
    for name in ("a.npy", "a.parquet", "a.arrow"):
        T.export(tmp_path / name, sync=True)
        assert [pathlib.Path(p).parent for p in synced] == [tmp_path, tmp_path.parent]
        assert pathlib.Path(synced[0]).name.startswith(".eds-") and pathlib.Path(synced[1]) == tmp_path
        synced.clear()
    same(np.load(tmp_path / "a.npy"), a)
    assert sorted(bands) == [(r, r + 5) for r in range(0, 20, 5)]  # bands 0-3 of 5 (0..22)
    T.to_parquet(tmp_path / "b.parquet", sync=True)
    assert len(synced) == 2
    assert sorted(os.listdir(tmp_path)) == ["a.arrow", "a.npy", "a.parquet", "b.parquet"]


def test_export_refusals(db, tmp_path):
    T = db.store("fio_ref", np.ones((2, 3)), replace=True)
    with pytest.raises(EinsumError, match="export writes .npy, .parquet, .arrow or .feather"):
        T.export(tmp_path / "x.csv")
    with pytest.raises(EinsumError, match="form='elements' is for .parquet"):
        T.export(tmp_path / "x.npy", form="elements")
    with pytest.raises(EinsumError, match="form is 'tiles' or 'elements'"):
        T.export(tmp_path / "x.parquet", form="dense")
    Z = db.store("fio_z", np.ones(3, np.complex64), replace=True)
    with pytest.raises(EinsumError, match="no element form"):
        Z.export(tmp_path / "z.arrow", form="elements")
    assert os.listdir(tmp_path) == []


def test_exported_files_are_plain_files(db, tmp_path):
    """What other tools see: np.load, pyarrow, DuckDB's read_parquet and its metadata."""
    import duckdb

    a = random_array(np.random.default_rng(6), (5, 7), "float32")
    T = db.store("fio_plainout", a, tile=(2, 3), replace=True)
    same(np.load(T.export(tmp_path / "a.npy")), a)
    t = pq.read_table(T.export(tmp_path / "a.parquet"))
    assert io.read_metadata(t.schema.metadata, "t")["shape"] == [5, 7] and t.num_rows == 9
    e = pa.ipc.open_file(T.export(tmp_path / "e.arrow", form="elements")).read_all()
    assert e.column_names == ["d0", "d1", "value"] and e.num_rows == 35
    got = np.zeros((5, 7), np.float32)
    got[e.column("d0").to_numpy(), e.column("d1").to_numpy()] = e.column("value").to_numpy()
    same(got, a)
    con = duckdb.connect()
    kv = dict(con.execute("SELECT key::VARCHAR, value::VARCHAR FROM parquet_kv_metadata(?)",
                          [str(tmp_path / "a.parquet")]).fetchall())
    assert json.loads(kv["eindecomp_sql.tile"]) == [2, 3]
    con.close()


# -- memory -------------------------------------------------------------------------------------
_RSS_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from eindecomp_sql import io
    def hwm():  # this process's own peak, in KiB (ru_maxrss starts at the forking parent's size)
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    path, tile = sys.argv[1], (int(sys.argv[2]), int(sys.argv[3]))
    base = hwm()
    inc = io.read_source(path, "rss", io.Wanted(tile=tile), stream=True)
    n = sum(len(x) for b in inc.tiles for x in io.blob_views(b.column("tile")))
    peak = hwm()
    print(n, (peak - base) // 1024)
""")


@pytest.mark.duckdb_only("the streamed store is the DuckDB backend's")
def test_a_400mb_npy_streams_in_bounded_memory(tmp_path, backend):
    """What store hands DuckDB for a 400 MB .npy is cut from the memory map a batch at a time:
    the process grows by far less than the file (measured in a fresh interpreter)."""
    path = tmp_path / "big.npy"
    a = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(10240, 10240))
    for i in range(0, 10240, 1024):
        a[i:i + 1024] = np.float32(i)
    del a
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(path), "1024", "2048"], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    nbytes, grew_mb = map(int, out.stdout.split())
    assert nbytes == 10240 * 10240 * 4
    assert grew_mb < 200, f"RSS grew by {grew_mb} MB streaming a 400 MB .npy"


@pytest.mark.parametrize("drop", ["dtype", "shape", "tile"])
def test_tiled_metadata_missing_a_field_is_refused(tmp_path, drop):
    """A tiled file whose metadata lacks dtype (or shape, or tile) is refused: its bytes would be
    read as float64 (int64 0, 1, 2 came back as 0.0, 4.9e-324, ...)."""
    import eindecomp_sql as eds

    with eds.connect() as db:
        path = db.store("m", np.arange(12, dtype=np.int64).reshape(3, 4), tile=(2, 4)).export(tmp_path / "m.parquet")
        t = pq.read_table(path)
        meta = {k: v for k, v in t.schema.metadata.items() if k != f"eindecomp_sql.{drop}".encode()}
        assert len(meta) == len(t.schema.metadata) - 1
        pq.write_table(t.replace_schema_metadata(meta), tmp_path / "bad.parquet")
        with pytest.raises(EinsumError, match=f"metadata lacks {drop}"):
            db.store("bad", tmp_path / "bad.parquet")
        assert db.tensors() == ["m"]


def test_exports_keep_permissions_follow_symlinks_and_take_long_names(tmp_path):
    import eindecomp_sql as eds

    with eds.connect() as db:
        t = db.store("p", np.arange(6.0).reshape(2, 3))
        secret = tmp_path / "secret.npy"
        secret.write_bytes(b"old")
        os.chmod(secret, 0o600)
        t.export(secret)
        assert (secret.stat().st_mode & 0o777) == 0o600 and np.array_equal(np.load(secret), t.to_numpy())
        (tmp_path / "real").mkdir()
        link = tmp_path / "link.npy"
        link.symlink_to(tmp_path / "real" / "target.npy")
        t.export(link)
        assert link.is_symlink() and np.array_equal(np.load(tmp_path / "real" / "target.npy"), t.to_numpy())
        long = tmp_path / ("a" * 245 + ".npy")  # a valid name; target + a long temp suffix was not
        t.export(long)
        assert np.array_equal(np.load(long), t.to_numpy())
        t.export(tmp_path / "x.parquet")
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


EXPORTING = """
import sys, numpy as np, eindecomp_sql as eds
db = eds.connect(sys.argv[1])
A = db.store("A", np.random.default_rng(0).standard_normal((3072, 3072), dtype=np.float32))
while True:
    A.export(sys.argv[2], form="elements")
"""


def test_a_killed_exports_partial_file_goes_at_the_next_export(tmp_path):
    """A killed export (SIGKILL, SIGTERM) left its hidden partial file beside the target for good
    (17 MB, a new user's report). The next export to the folder removes the partial files of
    processes that have ended; a running process's (this one's) stays."""
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "x.py").write_text(EXPORTING)
    child = subprocess.Popen([sys.executable, "x.py", "d.duckdb", "out.parquet"], cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob(".eds-*.tmp")) and time.time() < deadline:
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    from eindecomp_sql.backends import spill

    left = list(tmp_path.glob(f".eds-{spill.HOST}-{child.pid}-*.tmp"))
    assert left, "the child left nothing: the test tests nothing"
    live = tmp_path / f".eds-{spill.HOST}-{os.getpid()}-{'0' * 12}.tmp"
    live.write_bytes(b"x")
    with eds.connect() as db:
        db.store("B", np.arange(6.0).reshape(2, 3)).export(tmp_path / "b.npy")
    assert not any(p.exists() for p in left) and live.exists()
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), np.arange(6.0).reshape(2, 3))


def test_a_tiled_arrow_file_streams_into_store(tmp_path):
    """Storing a tiled ``.arrow`` file held the whole file in pyarrow's memory (a trial: a 549
    MiB file, pool peak 548 MB): the key check kept zero-copy views of each batch's key
    columns, and a view keeps its batch's buffer (tiles included) alive. The keys are copied
    now, so the pool holds about a batch at a time."""
    import threading

    import pyarrow as pa

    a = np.random.default_rng(9).standard_normal((2048, 2048))  # 32 MiB, tiles of 1 MiB
    path = tmp_path / "a.arrow"
    with eds.connect() as db:
        db.store("A", a, tile=(256, 512)).export(path)
    table = pa.ipc.open_file(path).read_all()
    with pa.ipc.new_file(path, table.schema) as w:  # in batches of two tiles, as a writer may cut them
        for batch in table.to_batches(max_chunksize=1):
            w.write_batch(batch)
    del table, batch
    peak, stop = [0], threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], pa.total_allocated_bytes())
            stop.wait(0.0005)
    with eds.connect() as db:
        base = pa.total_allocated_bytes()
        t = threading.Thread(target=poll)
        t.start()
        try:
            B = db.store("B", path)
        finally:
            stop.set()
            t.join()
        np.testing.assert_array_equal(B.to_numpy(), a)
    assert peak[0] - base < a.nbytes // 4, (peak[0] - base) >> 20


_ARRAY_RSS_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import eindecomp_sql as eds
    def hwm():  # this process's own peak, in KiB
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
    a = np.full((8192, 8192), 1.5, np.float32)  # 256 MiB, in memory
    a[-1, -1] = 7.0
    with eds.connect(sys.argv[1], memory="200MB") as db:
        base = hwm()
        t = db.store("A", a)
        peak = hwm()
        ok = t.tile != a.shape and np.array_equal(t.to_numpy(), a)
    print(int(ok), (peak - base) // 1024)
""")


@pytest.mark.duckdb_only("the streamed store is the DuckDB backend's")
def test_storing_a_numpy_array_adds_a_batch_not_a_second_copy(tmp_path, backend):
    """A 256 MiB array stored under a 200 MB budget: its tiles are cut a batch at a time as
    DuckDB stores them (a trial: a 549 MiB array rose resident memory by 677 MB, the whole
    table of tiles cut first; this one 373 MB before, 154-157 MB now)."""
    out = subprocess.run([sys.executable, "-c", _ARRAY_RSS_CHILD, str(tmp_path / "a.duckdb")], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    ok, grew_mb = map(int, out.stdout.split())
    assert ok and grew_mb < 220, f"RSS grew by {grew_mb} MB storing a 256 MiB array"  # was 373-375 MB


def test_a_streamed_array_is_cast_and_swapped_tile_by_tile(tmp_path):
    """Arrays stream into DuckDB (tiles cut, cast and put in native byte order one batch at a
    time): a cast that fails in a late tile names its place in the whole array and leaves
    nothing; byte-swapped, Fortran-ordered and strided arrays store their values."""
    import eindecomp_sql as eds

    with eds.connect() as db:
        b = np.zeros((20, 20), np.int64)
        b[17, 13] = 300
        with pytest.raises(EinsumError, match=r"value 300 at \(17, 13\) does not fit dtype=int8"):
            db.store("late", b, tile=(2, 2), dtype="int8")
        assert "late" not in db.tensors() and not db.backend.table_exists("late")
        rng = np.random.default_rng(3)
        a = rng.standard_normal((13, 11))
        for x in (a.astype(">f8"), np.asfortranarray(a), a[::2, ::3], a.astype(">f4")[:, 1:]):
            t = db.store("s", x, tile=(4, 3), replace=True)
            assert t.dtype == x.dtype.newbyteorder("=").name
            np.testing.assert_array_equal(t.to_numpy(), x)
        t = db.store("c", a.astype(">i4") * 0 + 5, tile=(5, 5), dtype="int8", replace=True)
        assert t.dtype == "int8" and (t.to_numpy() == 5).all()


def test_a_tall_skinny_array_stored_under_a_budget_keeps_its_short_side_whole(tmp_path):
    """Under a budget store rounds a tile to a power of 4 elements (square tiles for square
    matrices); a 200k x 768 embeddings matrix got 391 x 384 tiles, and every product re-tiled
    them into row panels (3.4x slower, a trial). Its rows stay whole; a square matrix's tiles
    stay square."""
    from eindecomp_sql.plan.tiling import auto_tile

    assert auto_tile((200000, 768), 4, 3125000, square=True) == (782, 768)
    assert auto_tile((8192, 4096), 4, 3125000, square=True) == auto_tile((4096, 8192), 4, 3125000, square=True) \
        == (512, 512)
    assert auto_tile((4, 1024, 1024), 4, 3 << 20, square=True) == (4, 256, 256)  # a stack of squares: square
    with eds.connect(str(tmp_path / "t.duckdb"), memory="200MB") as db:
        e = db.store("E", np.zeros((20000, 768), np.float32))
        w = db.store("W", np.ones((768, 64), np.float32))
        assert e.tile[1] == 768
        assert not any(s.describe().startswith("retile") for s in db.plan("ij,jk->ik", e, w).steps)


def test_a_parquet_file_duckdb_cannot_hold_says_why_and_what_to_do(tmp_path):
    """A Parquet file of one big row group under a small budget failed in DuckDB's words alone
    ("could not allocate block", with advice to SET threads; a trial): the error says DuckDB
    reads a row group whole, how big this file's is, and what to do."""
    n = 20000  # 15.4M elements in element form, one row group of ~240 MB
    a = np.random.default_rng(0).standard_normal((n, 768), dtype=np.float32)
    t = pa.table({"i": np.repeat(np.arange(n), 768), "j": np.tile(np.arange(768), n), "value": a.ravel()})
    pq.write_table(t, tmp_path / "one.parquet", row_group_size=len(t))
    del t
    with eds.connect(str(tmp_path / "t.duckdb"), memory="32MB") as db:
        with pytest.raises(EinsumError, match=r"as Parquet under its memory limit \[DuckDB reads a row group whole: "
                                              r"this file's largest is .* in 1 row group\(s\).*row_group_size=") as e:
            db.store("X", tmp_path / "one.parquet")
        assert "DuckDB said: Out of Memory Error" in str(e.value)
        assert "Possible solutions" not in str(e.value) and "SET threads" not in str(e.value)  # not ours to set
        assert db.tensors() == []


def test_a_callers_memmap_slice_or_copy_on_write_map_stores_its_own_values(tmp_path):
    """Arrays stream through the cutter that reads a .npy file's own map from its file: a
    caller's memmap slice was read at its parent's offset (rows 0-9 stored for rows 10:20),
    and a copy-on-write map's edits were stored as the file's zeros and then dropped from the
    caller's array (a review). A caller's array is only ever read as an array."""
    p = tmp_path / "m.npy"
    np.save(p, np.arange(40 * 6, dtype=np.float64).reshape(40, 6))
    with eds.connect() as db:
        mm = np.load(p, mmap_mode="r")
        for x in (mm[10:20], mm[7], mm[::3, 1:], mm):
            np.testing.assert_array_equal(db.store("T", x, replace=True).to_numpy(), np.asarray(x))
        c = np.load(p, mmap_mode="c")
        c[:] = -1.0
        np.testing.assert_array_equal(db.store("T", c, replace=True).to_numpy(), np.full((40, 6), -1.0))
        assert (c == -1.0).all()  # the caller's edits are still there


def test_a_directory_named_like_a_parquet_file_is_said_to_be_one(tmp_path):
    """``df.write.parquet("x.parquet")`` makes a directory: store() said "no such Parquet file"
    though the path exists (a trial). It says what it is and how to read it, per engine."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eindecomp_sql import io

    d = tmp_path / "elems.parquet"
    d.mkdir()
    pq.write_table(pa.table({"i": [0, 1, 2], "v": [1.0, 2.0, 3.0]}), d / "part-0.parquet")
    with eds.connect() as db:
        with pytest.raises(eds.EinsumError, match=r"is a directory, not one Parquet file; read a directory of "
                                                  r"Parquet files with DuckDB \(db\.connection\.read_parquet"):
            db.store("P", str(d), value="v")
        rel = db.connection.read_parquet(str(d / "*.parquet"))
        np.testing.assert_array_equal(db.store("P", rel, value="v").to_numpy(), [1.0, 2.0, 3.0])
    with pytest.raises(eds.EinsumError, match=r"spark\.read\.parquet\(path\)"):  # an engine without DuckDB
        io._parquet_cursor(str(d), "store('P')", None)
