"""The command line (eindecomp_sql/cli.py): every command through a real subprocess (``python -m
eindecomp_sql`` and the installed ``eindecomp-sql`` script), results checked against numpy;
exit codes, one-line errors, a database locked by another process. The many small cases run
``main()`` in this process (a subprocess costs ~1 s of imports); subprocesses that do not
depend on each other run at the same time."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eindecomp_sql as eds
from eindecomp_sql.cli import cli as group
from eindecomp_sql.cli import main as cli_main

SCRIPT = Path(sys.executable).parent / "eindecomp-sql"


def command(*args, script: bool = False) -> list[str]:
    if script:
        # make test installs the package (pip install -e .), entry point included: a missing
        # script is a packaging failure, not a reason to skip
        assert SCRIPT.exists(), "the eindecomp-sql script is not installed (pyproject's [project.scripts])"
        return [str(SCRIPT), *map(str, args)]
    return [sys.executable, "-m", "eindecomp_sql", *map(str, args)]


def sh(*args, script: bool = False, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args, script=script), capture_output=True, text=True, timeout=240, cwd=cwd)


def chain(*commands) -> list[subprocess.CompletedProcess]:
    """Run commands one after the other (they share a database file), stopping at a failure."""
    out = []
    for c in commands:
        script = c[0] == "script"
        r = sh(*(c[1:] if script else c), script=script)
        out.append(r)
        if r.returncode:
            break
    return out


def run_main(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """a.npy (float64), b.parquet (int64 in element form), c.arrow (float32, tiled, with metadata)."""
    d = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((48, 40))
    b = rng.integers(-3, 4, (40, 24)).astype(np.int64)
    c = rng.standard_normal((24, 24)).astype(np.float32)
    np.save(d / "a.npy", a)
    i, j = np.indices(b.shape)
    pq.write_table(pa.table({"i": i.ravel(), "j": j.ravel(), "value": b.ravel()}), d / "b.parquet")
    with eds.connect() as db:
        table = db.store("C", c, tile=(16, 8)).to_arrow()
    with pa.OSFile(str(d / "c.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return d, {"a": a, "b": b, "c": c}


def test_every_command_through_subprocesses(files, tmp_path):
    d, arr = files
    a, b, c = arr["a"], arr["b"], arr["c"]
    db1, db2 = tmp_path / "one.duckdb", tmp_path / "two.duckdb"
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(chain,
                          ("script", "store", db1, "A", d / "a.npy", "--tile", "16x16"),
                          ("store", db1, "B", d / "b.parquet"),
                          ("einsum", db1, "ij,jk->ik", "A", "B", "--out", "D", "--join", "relu(x - y)", "--agg",
                           "max", "--json"),
                          ("export", db1, "D", tmp_path / "d.npy", "--sync"),
                          ("ls", db1, "--json"))
        two = pool.submit(chain,
                          ("store", db2, "C", d / "c.arrow"),
                          ("einsum", db2, "ij,jk->ik", "C", "C", "--out", "E", "--workers", "2", "--memory", "1GB"),
                          ("script", "einsum", db2, "ij->j", "C"),
                          ("export", db2, "E", tmp_path / "e.arrow"))
        one, two = one.result(), two.result()
    for r in one + two:
        assert r.returncode == 0 and r.stderr == "", (r.args, r.stderr)
    assert len(one) == 5 and len(two) == 4
    d_ref = np.max(np.maximum(a[:, :, None] - b[None, :, :], 0), axis=1)
    assert json.loads(one[2].stdout)["shape"] == [48, 24]
    assert np.allclose(np.load(tmp_path / "d.npy"), d_ref)
    listing = {t["name"]: t for t in json.loads(one[4].stdout)}
    assert listing["A"] == {"name": "A", "shape": [48, 40], "dtype": "float64", "tile": [16, 16], "tiles": 9,
                            "bytes": a.nbytes, "job": None}
    assert listing["B"]["dtype"] == "int64" and listing["D"]["shape"] == [48, 24]
    assert two[0].stdout.startswith("stored C: shape (24, 24) float32 in tiles (16, 8)")
    assert two[1].stdout.startswith("stored E: shape (24, 24) float32")
    printed = np.array(two[2].stdout.strip().strip("[]").split(), float)  # numpy's print of the result
    assert np.allclose(printed, c.sum(0), atol=1e-4)
    with pa.memory_map(str(tmp_path / "e.arrow")) as f:
        e = pa.ipc.open_file(f).read_all()
    with eds.connect() as db:
        assert np.allclose(db.store("E", e).to_numpy(), c @ c, atol=1e-4)  # metadata came along: read back whole
    with eds.connect(str(db1), read_only=True) as db:
        assert np.array_equal(db.tensor("B").to_numpy(), b)


def test_export_forms_and_ls_text(files, tmp_path, capsys):
    d, arr = files
    db = tmp_path / "x.duckdb"
    assert run_main(capsys, "store", db, "A", d / "a.npy", "--tile", "32,8")[0] == 0
    assert run_main(capsys, "store", db, "C", d / "c.arrow", "--tile", "8x8", "--dtype", "float64")[0] == 0
    code, out, err = run_main(capsys, "ls", db)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["name", "shape", "dtype", "tile", "tiles", "bytes", "job"]
    assert lines[1].split()[:3] == ["A", "(48,", "40)"] and "(32, 8)" in lines[1] and "10" in lines[1].split()
    assert "float64" in lines[2] and "(8, 8)" in lines[2]
    for name, form in (("a.parquet", "tiles"), ("ae.parquet", "elements"), ("ae.feather", "elements")):
        code, out, err = run_main(capsys, "export", db, "A", tmp_path / name, "--form", form)
        assert code == 0 and out.startswith("wrote A to "), err
        assert run_main(capsys, "store", db, "R", tmp_path / name, "--replace")[0] == 0
        with eds.connect(str(db), read_only=True) as s:
            assert np.array_equal(s.tensor("R").to_numpy(), arr["a"])
    code, out, err = run_main(capsys, "einsum", db, "ij,jk->ik", "A", "A")
    assert code == 1 and err.startswith("eindecomp-sql: error: ") and err.count("\n") == 1, err
    code, out, err = run_main(capsys, "einsum", db, "ij,kj->ik", "A", "A", "--out", "A")
    assert code == 1 and "already exists" in err and "Traceback" not in err, err


def test_usage_errors_exit_2_and_failures_exit_1_on_one_line(tmp_path, capsys):
    for args in (["store"], ["ls"], ["einsum", "x.duckdb", "ij->i"], ["frobnicate"], ["store", "d", "A", "a.npy",
                                                                                        "--tile", "4xq"],
                 ["einsum", "d", "ij->i", "A", "--agg", "mean"], ["run", "j.toml", "--workers", "0"]):
        code, out, err = run_main(capsys, *args)
        assert code == 2, (args, err)
        assert "Usage:" in err or "Error:" in err
    code, out, err = run_main(capsys, "ls", tmp_path / "missing.duckdb")
    assert (code, err) == (1, f"eindecomp-sql: error: no such database file {str(tmp_path / 'missing.duckdb')!r}\n")
    assert not (tmp_path / "missing.duckdb").exists()
    code, out, err = run_main(capsys, "run", tmp_path / "nope.toml")
    assert code == 1 and err == f"eindecomp-sql: error: {tmp_path / 'nope.toml'}: no such job file\n"
    (tmp_path / "not.duckdb").write_text("hello")
    code, out, err = run_main(capsys, "ls", tmp_path / "not.duckdb")
    assert code == 1 and "is not a DuckDB database file" in err and err.count("\n") == 1, err
    code, out, err = run_main(capsys, "ls", tmp_path / "not.duckdb", "--debug")
    assert code == 1 and "Traceback" in err and err.rstrip().endswith("is not a DuckDB database file")


def test_help_on_every_command(capsys):
    names = sorted(group.commands)
    assert names == ["einsum", "explain", "export", "ls", "run", "store"]
    for name in [None, *names]:
        code, out, err = run_main(capsys, *([name] if name else []), "--help")
        assert code == 0 and out.startswith("Usage: eindecomp-sql") and err == "", name
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip().endswith(eds.__version__)


@contextlib.contextmanager
def _holding(path, then: str):
    """A process that connects to ``path``, runs ``then`` (with ``db``) and holds the file until
    the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, eindecomp_sql as eds\n{then}\n"
                               "print('ready', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        yield
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0


def test_a_locked_database_is_one_line_exit_1(tmp_path):
    """One process holds the file (DuckDB: one writing process per file); commands on it from
    other processes fail at once, in one line. (Jobs on different files run side by side in
    test_jobs.py: nine at once.)"""
    path = tmp_path / "held.duckdb"
    np.save(tmp_path / "b.npy", np.arange(3.0))
    with _holding(path, f"db = eds.connect({str(path)!r}); db.store('A', [1.0, 2.0])"):
        t0 = time.perf_counter()
        locked = [subprocess.Popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for args in (("ls", path), ("store", path, "B", tmp_path / "b.npy"))]
        for p in locked:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 1, err
            assert err.startswith(f"eindecomp-sql: error: database {str(path)!r} is locked by another process"), err
            assert err.count("\n") == 1 and "Traceback" not in err
            # a writer holds it: neither is told to open it read-only (that is the same refusal)
            assert "another process writes it: wait until that process closes it" in err, err
            assert "open it read_only=True" not in err, err
        assert time.perf_counter() - t0 < 60
    # a reader holds it: a writer is told that read-only opens it (DuckDB's text says when)
    with _holding(path, f"db = eds.connect({str(path)!r}, read_only=True)"):
        p = subprocess.run(command("store", path, "B", tmp_path / "b.npy"), capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "another process has it open read-only: open it read_only=True too" in p.stderr, \
            p.stderr
        p = subprocess.run(command("ls", path), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "A" in p.stdout, p.stderr


def test_einsum_json_is_strict_json_for_non_finite_and_complex_values(capsys, tmp_path):
    """--json wrote NaN and Infinity (not JSON: strict parsers refuse them) and null for complex
    results (a new user's report)."""
    db = tmp_path / "j.duckdb"
    np.save(tmp_path / "n.npy", np.array([[1, np.nan], [np.inf, -np.inf]], np.float32))
    np.save(tmp_path / "c.npy", np.array([1 + 2j, 3 - 4j], np.complex64))
    assert run_main(capsys, "store", db, "N", tmp_path / "n.npy")[0] == 0
    assert run_main(capsys, "store", db, "C", tmp_path / "c.npy")[0] == 0
    code, out, _ = run_main(capsys, "einsum", db, "ij->ji", "N", "--json")
    strict = json.loads(out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert code == 0 and strict["value"] == [[1.0, "Infinity"], ["NaN", "-Infinity"]]
    code, out, _ = run_main(capsys, "einsum", db, "i->i", "C", "--json")
    assert code == 0 and json.loads(out)["value"] == [[1.0, 2.0], [3.0, -4.0]]


def test_store_takes_index_and_value_columns_and_its_advice_names_them(capsys, tmp_path):
    """The CLI's store advice said "pass value='...'" and "pass index=[...] and value=...", Python
    arguments it had no option for (a new user's report): it has --index and --value now."""
    db = tmp_path / "d.duckdb"
    pq.write_table(pa.table({"i": [0, 1, 1], "j": [0, 0, 2], "v": [1, 2, 3]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"i": [0, 1], "j": [1, 0], "w": [1.5, 2.5], "note": ["a", "b"]}), tmp_path / "m.parquet")
    code, _, err = run_main(capsys, "store", db, "X", tmp_path / "a.parquet")
    assert code == 1 and "pass --value COLUMN" in err and "value='" not in err, err
    code, _, err = run_main(capsys, "store", db, "M", tmp_path / "m.parquet")
    assert code == 1 and "--index COL,COL --value" in err and "index=[" not in err, err
    assert run_main(capsys, "store", db, "X", tmp_path / "a.parquet", "--value", "v", "--index", "i,j")[0] == 0
    assert run_main(capsys, "store", db, "M", tmp_path / "m.parquet", "--index", "i,j", "--value", "w")[0] == 0
    with eds.connect(db) as s:
        np.testing.assert_array_equal(s.tensor("X").to_numpy(), [[1, 0, 0], [2, 0, 3]])
        np.testing.assert_array_equal(s.tensor("M").to_numpy(), [[0, 1.5], [2.5, 0]])


def test_einsum_without_out_runs_beside_other_readers(capsys, tmp_path):
    """einsum without --out writes nothing, yet opened the file for writing: a read-only file,
    or one another process reads (DuckDB's lock), refused it (a new user's report)."""
    db = tmp_path / "r.duckdb"
    with eds.connect(db) as s:
        s.store("A", np.arange(12.0).reshape(3, 4))
    reader = subprocess.Popen([sys.executable, "-c", "import duckdb, sys; c = duckdb.connect(sys.argv[1], "
                               "read_only=True); print('open', flush=True); sys.stdin.read()", str(db)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "open"
        code, out, err = run_main(capsys, "einsum", db, "ij->i", "A", "--json")
        assert code == 0 and json.loads(out)["value"] == [6.0, 22.0, 38.0], err
        code, _, err = run_main(capsys, "einsum", db, "ij->i", "A", "--out", "B")  # a write still needs the lock
        assert code == 1 and "lock" in err.lower(), err
    finally:
        reader.communicate("")


def test_export_refuses_to_write_over_its_own_database(files, tmp_path):
    """A database named like a tensor file (``tensors.arrow``): ``export`` renamed its file over
    the database, said it wrote A, and every other tensor was gone (a trial). Refused, exit 1,
    the database intact; the Python face refuses the same."""
    d, arr = files
    db_path = tmp_path / "tensors.arrow"
    for r in chain(["store", db_path, "A", d / "a.npy"], ["store", db_path, "B", d / "a.npy"]):
        assert r.returncode == 0, r.stderr
    r = sh("export", db_path, "A", db_path)
    assert r.returncode == 1 and "one of this session's databases" in r.stderr and "destroy" in r.stderr, r.stderr
    r = sh("ls", db_path)
    assert r.returncode == 0 and "A " in r.stdout and "B " in r.stdout, r.stderr
    with eds.connect(str(db_path)) as db:
        for write in (lambda: db.tensor("B").export(db_path), lambda: db.tensor("B").to_parquet(db_path),
                      lambda: db.tensor("B").export(tmp_path / "." / "tensors.arrow")):
            with pytest.raises(eds.EinsumError, match="one of this session's databases"):
                write()
        np.testing.assert_array_equal(db.tensor("B").to_numpy(), arr["a"])


def test_a_closed_stdout_and_sigterm(files, tmp_path):
    """Started with fd 1 closed (a daemon, a cron wrapper), ``run`` and ``einsum`` died before
    doing anything on ``sys.stdout.isatty()``; SIGTERM (``timeout``, systemd) killed a job
    outright, with no summary and no message (a trial). Now the work runs without a stdout,
    and SIGTERM stops a run as Ctrl-C does: the running part rolled back, the JSON summary
    printed, exit 143."""
    import os
    import signal

    d, arr = files
    db_path = tmp_path / "t.duckdb"
    assert sh("store", db_path, "A", d / "a.npy").returncode == 0
    r = subprocess.run(command("einsum", db_path, "ij->j", "A", "--out", "S"), capture_output=False,
                       stderr=subprocess.PIPE, text=True, timeout=240, preexec_fn=lambda: os.close(1))
    assert r.returncode == 0, r.stderr
    with eds.connect(str(db_path), read_only=True) as db:
        np.testing.assert_allclose(db.tensor("S").to_numpy(), arr["a"].sum(0))
    job = tmp_path / "job.toml"
    job.write_text(f'database = "j.duckdb"\n[inputs]\na = {{ file = "{d / "a.npy"}" }}\n'
                   '[steps.s]\nspec = "ij->j"\noperands = ["a"]\n')
    # the child hashes the input file first: there it says so and waits, to be stopped
    child = ("import sys, time\nfrom eindecomp_sql.jobs import files\nfrom eindecomp_sql.cli import main\n"
             "def slow(path, chunk=1 << 22):\n    print('hashing', flush=True, file=sys.stderr)\n    time.sleep(60)\n"
             "files.file_digest = slow\nmain(sys.argv[1:])\n")

    def stopped(**popen) -> tuple[int, str, str]:
        """The child run, sent SIGTERM once it hashes: its exit status, stdout and stderr."""
        p = subprocess.Popen([sys.executable, "-c", child, "run", str(job), "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, **popen)
        try:
            assert p.stderr.readline().strip() == "hashing"
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=60)
        finally:
            p.kill()
        return p.returncode, out, err

    code, out, err = stopped()
    assert code == 143 and "terminated (SIGTERM)" in err, (code, err)
    summary = json.loads(out)
    # the summary says what stderr says (it said "interrupted" for a SIGTERM: a crash trial)
    assert summary["ok"] is False and summary["error"] == "terminated (SIGTERM)" and summary["ran"] == 0
    # started with SIGINT ignored, as a shell script's `cmd &` is: SIGTERM killed it outright,
    # no summary, no message (a trial); its summary said DuckDB's "Query interrupted"
    code, out, err = stopped(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert code == 143 and "terminated (SIGTERM)" in err, (code, err)
    summary = json.loads(out)
    assert summary["ok"] is False and summary["error"] == "terminated (SIGTERM)", summary


def test_a_failed_store_leaves_no_new_database_and_a_tiny_cap_is_an_error(files, tmp_path, capsys):
    """A store refused for its name left an empty 270 kB database it had created; ``--memory
    1KB`` / ``100KB`` were "internal error"s (DuckDB's OutOfMemoryException) (a trial)."""
    d, arr = files
    db_path = tmp_path / "new.duckdb"
    # (which of DuckDB's two refusals a tiny cap meets depends on what the process holds: SET
    # memory_limit fails, or the store runs out under it)
    tiny = ("less than DuckDB needs", "DuckDB ran out of memory")
    for args, said in ((["bad-name", d / "a.npy"], ("invalid tensor name",)),
                       (["A", d / "a.npy", "--memory", "1KB"], tiny),
                       (["A", d / "a.npy", "--memory", "100KB"], tiny)):
        code, out, err = run_main(capsys, "store", db_path, *args)
        assert code == 1 and "internal error" not in err and any(s in err for s in said), err
        assert not db_path.exists() and not Path(f"{db_path}.wal").exists()
    code, out, err = run_main(capsys, "store", db_path, "A", d / "a.npy")
    assert code == 0, err
    code, out, err = run_main(capsys, "store", db_path, "bad-name", d / "a.npy")  # one that was there stays
    assert code == 1 and db_path.exists()
    with eds.connect(str(db_path), read_only=True) as db:
        np.testing.assert_array_equal(db.tensor("A").to_numpy(), arr["a"])


def test_run_json_prints_its_summary_on_a_bad_option_value_too(capsys):
    """``run --json --memory lots``: click's usage message on stderr and nothing on stdout,
    where a script parses the summary a failed run promises (a trial)."""
    for bad in (["--memory", "lots"], ["--workers", "0"]):
        code, out, err = run_main(capsys, "run", "ok.toml", "--json", *bad)
        assert code == 2 and "Usage:" in err
        summary = json.loads(out)
        assert summary["ok"] is False and summary["job"] == "ok.toml" and bad[0] in summary["error"], summary


def test_main_gives_an_in_process_caller_its_sigterm_handler_back(capsys):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    code, out, err = run_main(capsys, "--version")
    assert code == 0 and signal.getsignal(signal.SIGTERM) is before


def test_einsum_and_ls_json_print_an_error_object_on_failure(capsys, tmp_path):
    """``einsum --json`` and ``ls --json`` printed nothing on stdout when they failed: a script
    parsing stdout got an empty string. They now print ``{"error": ..., "exit_code": ...}``
    (the message stderr has), for an error of ours and a usage error alike."""
    db = tmp_path / "j.duckdb"
    with eds.connect(db) as s:
        s.store("A", np.arange(6.0).reshape(2, 3))
    cases = [(("einsum", db, "ij->i", "Nope", "--json"), 1, "Nope"),
             (("einsum", db, "ij,jk->ik", "A", "A", "--json"), 1, "3"),
             (("einsum", db, "ij->i", "A", "--agg", "median", "--json"), 2, "median"),
             (("ls", tmp_path / "absent.duckdb", "--json"), 1, "absent.duckdb")]
    for args, want, named in cases:
        code, out, err = run_main(capsys, *args)
        assert code == want, (args, err)
        got = json.loads(out)
        assert got["exit_code"] == want and named in got["error"] and got["error"] in err, (args, out, err)
    code, out, _ = run_main(capsys, "einsum", db, "ij->i", "Nope")  # without --json: stdout stays empty
    assert code == 1 and out == ""
    code, out, _ = run_main(capsys, "ls", db, "--json")
    assert code == 0 and [t["name"] for t in json.loads(out)] == ["A"]


def test_store_memory_is_the_budget_tiles_are_cut_to(tmp_path):
    """``store --memory 100MB`` of a 144 MB .npy stored it as one tile and then ran out of
    memory under the cap (a trial; the library cut 376² tiles under the same budget): --memory
    is the session's budget now, as ``connect(memory=)`` is, and the tiles fit it."""
    a = np.random.default_rng(14).standard_normal((3000, 3500)).astype(np.float32)  # 42 MB
    np.save(tmp_path / "a.npy", a)
    db = tmp_path / "m.duckdb"
    r = sh("store", db, "A", tmp_path / "a.npy", "--memory", "64MB")
    assert r.returncode == 0, r.stderr
    with eds.connect(str(db), read_only=True) as s:
        t = s.tensor("A")
        assert np.prod(t.tile) * 4 <= (64 << 20) // 64, t.tile
        np.testing.assert_array_equal(t.to_numpy(), a)


def test_einsum_json_of_a_large_result_is_written_a_run_at_a_time(tmp_path):
    """``einsum --json`` built a result's whole text first (692 MB of JSON, a 3.16 GB peak for a
    134 MB result, a trial): it writes the values a run of the last axis at a time, the same
    JSON. A 16 MB float64 result (2M values, ~40 MB of text): the CLI process's peak rises by
    less than the text, its output parses to the values."""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1024, 2048))
    db = tmp_path / "big.duckdb"
    np.save(tmp_path / "a.npy", a)
    assert sh("store", db, "A", tmp_path / "a.npy").returncode == 0
    child = ("import resource, runpy, sys; sys.argv = ['eindecomp_sql'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('eindecomp_sql', run_name='__main__')\n"
             "finally:\n    sys.stderr.write('PEAK %d' % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    small = subprocess.run([sys.executable, "-c", child, "einsum", str(db), "ij->", "A", "--json"],
                           capture_output=True, text=True, timeout=240)
    big = subprocess.run([sys.executable, "-c", child, "einsum", str(db), "ij->ij", "A", "--json"],
                         capture_output=True, text=True, timeout=240)
    assert small.returncode == 0 and big.returncode == 0, big.stderr[-2000:]
    got = json.loads(big.stdout)
    assert got["shape"] == [1024, 2048] and np.array_equal(np.array(got["value"]), a)
    rise_mb = (int(big.stderr.rsplit("PEAK ", 1)[1]) - int(small.stderr.rsplit("PEAK ", 1)[1])) / 1024
    assert len(big.stdout) > 40e6 and rise_mb < 100, rise_mb


def test_a_stop_after_the_commit_says_the_result_is_written():
    """A Ctrl-C after a store committed was reported as "interrupted" (exit 130, "the running
    step rolled back") with the tensor stored (a crash trial): it says so now."""
    from eindecomp_sql.cli import _stopped

    late = KeyboardInterrupt()
    late.eds_committed = True
    assert _stopped(late, []) == "interrupted after the running operation committed (its result is written)"
    assert _stopped(KeyboardInterrupt(), []) == "interrupted"
    assert _stopped(KeyboardInterrupt(), [None, 15]) == "terminated (SIGTERM)"


def test_a_reader_that_goes_away_gives_exit_141_and_no_message(tmp_path):
    """docs/cli.md: `... | head` exits 141. click catches the broken pipe itself (even with
    standalone_mode=False) and exited 1, so a script read it as a failure (a documentation audit)."""
    np.save(tmp_path / "m.npy", np.random.default_rng(0).random((300, 300)))
    db = tmp_path / "t.duckdb"
    assert sh("store", db, "m", tmp_path / "m.npy").returncode == 0
    p = subprocess.Popen(command("einsum", db, "ij,jk->ik", "m", "m", "--json"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.read(1) == b"{"
    p.stdout.close()  # the reader goes away with ~1.8 MB still to write
    err = p.stderr.read()
    assert p.wait(timeout=240) == 141, err
    assert err == b"", err
