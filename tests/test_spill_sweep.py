"""Spill files a killed process left are removed by the next session (a new user killed a
spilling GEMM: 460 MB stayed beside the file database through later sessions, 1 GB in the
private folder of a session in memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

import eindecomp_sql as eds
from eindecomp_sql.backends import spill

SPILLING = textwrap.dedent("""
    import sys, numpy as np, eindecomp_sql as eds
    db = eds.connect(sys.argv[1] if sys.argv[1] != "memory" else None, memory="100MB")
    rng = np.random.default_rng(0)
    A = db.store("A", rng.standard_normal((6144, 6144), dtype=np.float32))
    print("spill", db.backend._temp_dir or "", flush=True)
    while True:
        db.einsum("ij,jk->ik", A, A, out="C", replace=True)
""")


def _kill_once_spilling(tmp_path: Path, database: str) -> tuple[str, int]:
    script = tmp_path / "spilling.py"
    script.write_text(SPILLING)
    child = subprocess.Popen([sys.executable, str(script), database], stdout=subprocess.PIPE, text=True)
    try:
        folder = child.stdout.readline().split(" ", 1)[1].strip() or database + ".tmp"
        deadline = time.time() + 120
        while time.time() < deadline:  # until DuckDB has spilled something
            if os.path.isdir(folder) and any(n.startswith("duckdb_temp_") for n in os.listdir(folder)):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the child never spilled")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return folder, child.pid


def test_a_killed_file_sessions_spill_files_go_at_the_next_open(tmp_path):
    path = str(tmp_path / "spilled.duckdb")
    folder, pid = _kill_once_spilling(tmp_path, path)
    left = [n for n in os.listdir(folder) if n.startswith(f"duckdb_temp_{pid}_")]
    assert left, "nothing was left to sweep: the test tests nothing"
    mine = Path(folder, f"duckdb_temp_{os.getpid()}_0_block-1.block")  # a live process's: kept
    mine.write_bytes(b"x")
    with eds.connect(path) as db:
        assert db.tensors() == ["A"]  # the database itself is whole
    assert not [n for n in os.listdir(folder) if n.startswith(f"duckdb_temp_{pid}_")]
    assert mine.exists()


def test_a_killed_memory_sessions_spill_folder_goes_at_the_next_budget(tmp_path):
    folder, pid = _kill_once_spilling(tmp_path, "memory")
    assert Path(folder).name.startswith(f"{spill.FOLDER_PREFIX}{spill.HOST}-{pid}-") and os.path.isdir(folder)
    live = spill.new_folder()  # this process's own: kept
    try:
        with eds.connect(memory="200MB") as db:
            assert db.backend._temp_dir != folder
            np.testing.assert_array_equal(db.einsum("i->", np.arange(4.0)), 6.0)
        assert not os.path.exists(folder)
        assert os.path.isdir(live)
    finally:
        os.rmdir(live)


def test_only_dead_processes_files_are_swept(tmp_path):
    """Files named for a running pid (this one, the parent's) stay, and so does anything that is
    not DuckDB's; a pid that ran and ended is swept."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True).stdout.strip()
    names = [f"duckdb_temp_{os.getpid()}_0_block-1.block", f"duckdb_temp_{os.getppid()}_0.tmp",
             f"duckdb_temp_{ended}_0_block-7.block", f"duckdb_temp_{ended}_storage_S32K-0.tmp", "mine.txt"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert spill.sweep_files(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([names[0], names[1], "mine.txt"])
    assert spill.sweep_files(str(tmp_path / "missing")) == 0


def test_a_sweep_never_fails_and_never_touches_what_it_cannot_know(tmp_path):
    """A pid too large for os.kill raised OverflowError from connect and export (a review); a
    folder the user chose (maybe shared between hosts, where a pid means nothing) and another
    host's names are left alone."""
    huge = str(2**40)
    (tmp_path / f"duckdb_temp_{huge}_0.tmp").write_bytes(b"x")
    assert spill.sweep_files(str(tmp_path)) == 0
    other_host = tmp_path / f"{spill.FOLDER_PREFIX}00000000-1-abc"
    other_host.mkdir()
    ours_huge = tmp_path / f"{spill.FOLDER_PREFIX}{spill.HOST}-{huge}-abc"
    ours_huge.mkdir()
    assert spill.sweep_folders(str(tmp_path)) == 0 and other_host.is_dir() and ours_huge.is_dir()
    (tmp_path / f".eds-{spill.HOST}-{huge}-{'a' * 12}.tmp").write_bytes(b"x")
    with eds.connect() as db:
        db.store("B", np.arange(3.0)).export(tmp_path / "b.npy")  # sweeps the folder: no error
    # a temp_directory the user set is not swept, even of a dead pid's files
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True).stdout.strip()
    shared = tmp_path / "shared"
    shared.mkdir()
    dead = shared / f"duckdb_temp_{ended}_0.tmp"
    dead.write_bytes(b"x")
    import duckdb

    con = duckdb.connect(str(tmp_path / "u.duckdb"), config={"temp_directory": str(shared)})
    with eds.connect(con) as db:
        assert db.tensors() == []
    con.close()
    assert dead.exists()
