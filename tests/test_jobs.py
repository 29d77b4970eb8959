"""Jobs (eindecomp_sql/jobs): a 5-step job run in real subprocesses, killed with SIGKILL at chosen
and at random points, resumed, and compared byte for byte with an uninterrupted run; bad job
files refused before anything is computed, naming the file, line and step; changed jobs refused
with what changed; --force."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import eindecomp_sql as eds
from eindecomp_sql.cli import main as cli_main

PARTS = ["A", "B", "W", "P", "Q", "R", "T", "U"]  # loads, then steps, in the order the job runs them

JOB = """\
# a 5-step job: integer GEMM, an expression, max-plus, a broadcast min, a max reduction
database = "job.duckdb"
workers = 4

[inputs]
A = { file = "A.npy" }
B = { file = "B.parquet" }          # element form: i, j, value
W = { file = "W.arrow", tile = [40, 96] }
S = { tensor = "S" }                # stored before the job runs

[steps.P]
spec = "ij,jk->ik"
operands = ["A", "B"]

[steps.Q]
spec = "ik->ik"
operands = ["P"]
join = "relu(x - 2)"

[steps.R]
spec = "ik,kl->il"
operands = ["Q", "W"]
join = "add"
agg = "max"

[steps.T]
spec = "il,l->il"
operands = ["R", "S"]
join = "min"

[steps.U]
spec = "il->l"
operands = ["T"]
agg = "max"
"""


def make_data(d: Path) -> dict[str, np.ndarray]:
    """Input files and a database holding S; returns the numpy reference of every tensor."""
    rng = np.random.default_rng(7)
    a = rng.integers(-4, 5, (192, 128)).astype(np.int64)
    b = rng.integers(-4, 5, (128, 160)).astype(np.int64)
    w = rng.standard_normal((160, 96))
    s = rng.standard_normal(96)
    np.save(d / "A.npy", a)
    i, j = np.indices(b.shape)
    pq.write_table(pa.table({"i": i.ravel(), "j": j.ravel(), "value": b.ravel()}), d / "B.parquet")
    i, j = np.indices(w.shape)
    table = pa.table({"i": i.ravel(), "j": j.ravel(), "value": w.ravel()})
    with pa.OSFile(str(d / "W.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as wr:
        wr.write_table(table)
    with eds.connect(str(d / "job.duckdb")) as db:
        db.store("S", s)
    (d / "job.toml").write_text(JOB)
    p = a @ b
    q = np.maximum(p - 2, 0)
    r = np.max(q[:, :, None] + w[None, :, :], axis=1)
    t = np.minimum(r, s[None, :])
    return {"A": a, "B": b, "W": w, "S": s, "P": p, "Q": q, "R": r, "T": t, "U": t.max(axis=0)}


# Runs the command line in this process after arranging, through jobs.runner.HOOK, to SIGKILL
# itself: at an event of a part ("at EVENT PART"), or at a random moment after the job's first
# part starts ("timer SEED SECONDS").
DRIVER = textwrap.dedent("""
    import os, random, signal, sys, threading
    import eindecomp_sql.jobs.runner as runner

    mode, a, b = sys.argv[1:4]
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "at":
        runner.HOOK = lambda event, name: die() if (event, name) == (a, b) else None
    else:
        armed = []
        def hook(event, name):
            if not armed:
                armed.append(1)
                threading.Timer(random.Random(int(a)).uniform(0, float(b)), die).start()
        runner.HOOK = hook
    from eindecomp_sql.cli import main
    main(sys.argv[4:])
""")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    return d, make_data(d)


def cli(*args, cwd=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eindecomp_sql", *map(str, args)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def stored(path: Path) -> dict[str, np.ndarray]:
    """Every tensor in the catalog of database ``path``, read back (each must read whole)."""
    with eds.connect(str(path), read_only=True) as db:
        return {n: db.tensor(n).to_numpy() for n in db.tensors()}


def same_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def test_job_runs_matches_numpy_and_resumes_after_sigkill(data, tmp_path):
    src, ref = data
    # the uninterrupted run, and the kills, each on a database file of its own, all at once
    # (two or more jobs on two or more files in parallel processes)
    # every window of the commit protocol (runner.py): after the pending row, inside the step's
    # transaction, after its commit (a load's and a step's), after the done row; and at random
    # (on a fresh database there is nothing to drop: before the pending row is like before a step)
    kills = [("at", "committed", "B"), ("at", "pending", "P"), ("at", "progress", "Q"), ("at", "committed", "R"),
             ("at", "done", "U"), ("timer", "1", "0.25"), ("timer", "2", "0.25")]
    dirs = {}
    for k, case in enumerate(["clean"] + kills):
        d = tmp_path / f"case{k}"
        shutil.copytree(src, d)
        dirs[case] = d
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    procs = {"clean": cli("run", "job.toml", "--json", cwd=dirs["clean"])}
    for case in kills:
        procs[case] = subprocess.Popen([sys.executable, str(driver), *case[:3], "run", "job.toml", "--json"],
                                       cwd=dirs[case], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {case: finish(p) for case, p in procs.items()}

    rc, out, err = results["clean"]
    assert rc == 0, err
    clean = stored(dirs["clean"] / "job.duckdb")
    for name, want in ref.items():
        assert np.array_equal(clean[name], want), name  # exact: integers, max, min and add
    summary = json.loads(out)
    assert [e["name"] for e in summary["steps"]] == PARTS and not any(e["skipped"] for e in summary["steps"])
    assert all(e["projected_peak_bytes"] > 0 for e in summary["steps"] if e["kind"] == "step")

    # after each kill: every tensor in the catalog is whole and holds the clean run's bytes
    present = {}
    for case in kills:
        rc, out, err = results[case]
        if case[0] == "at":
            assert rc == -signal.SIGKILL, (case, rc, err)
        else:
            assert rc in (0, -signal.SIGKILL), (case, rc, err)
        got = stored(dirs[case] / "job.duckdb")
        assert set(got) <= set(PARTS) | {"S"}, (case, got.keys())
        for name, x in got.items():
            assert same_bytes(x, clean[name]), (case, name)
        present[case] = set(got) - {"S"}
        if case[0] == "at":
            event, part = case[1], case[2]
            k = PARTS.index(part)
            assert present[case] == set(PARTS[:k + (event in ("committed", "done"))]), (case, present[case])

    # resume all at once: every part committed before the kill is skipped, the rest run once
    resumed = {case: cli("run", "job.toml", "--json", cwd=dirs[case]) for case in kills}
    explained = cli("explain", "job.toml", cwd=dirs["clean"])  # meanwhile, on the finished job
    for case, p in resumed.items():
        rc, out, err = finish(p)
        assert rc == 0, (case, err)
        steps = json.loads(out)["steps"]
        assert {e["name"] for e in steps if e["skipped"]} == present[case], (case, steps)
        got = stored(dirs[case] / "job.duckdb")
        assert set(got) == set(PARTS) | {"S"}
        for name in PARTS:
            assert same_bytes(got[name], clean[name]), (case, name)
    rc, out, err = finish(explained)
    assert rc == 0 and err == "", err
    assert out.count("done (unchanged: skipped on run)") == len(PARTS) and "graph plan (eindecomp, workers=4" in out
    assert "  step R (line 20): ik,kl->il of Q, W join=add agg=max -> (192, 96) float64" in out, out


# -- in this process: the command line's main(), for the many small cases ----------------------
def run_main(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


BASE = """\
database = "t.duckdb"
[inputs]
x = { file = "x.npy" }
"""

BAD = [
    # (job text, line, what the one error line says)
    ('database = "t.duckdb"\n[inputs\nx = 1\n', "2:8", "invalid TOML"),
    ('[inputs]\nx = { file = "x.npy" }\n[steps.h]\nspec = "ij->i"\noperands = ["x"]\n', None,
     "missing field 'database'"),
    (BASE + '[steps.h]\noperands = ["x"]\n', 4, "step 'h': missing field 'spec'"),
    (BASE + '[steps.h]\nspec = "ij->i"\noperands = ["x"]\nagregate = "max"\n', 7,
     "step 'h': unknown key 'agregate'"),
    ('database = "t.duckdb"\nwrkers = 2\n' + BASE[22:] + '[steps.h]\nspec = "ij->i"\noperands = ["x"]\n', 2,
     "unknown key 'wrkers' in the job"),
    ('databse = "t.duckdb"\n', 1, "unknown key 'databse' in the job"),
    (BASE + '[steps.h]\nspec = "ij,jk->ik"\noperands = ["x", "y"]\n', 6, "step 'h': unknown operand 'y'"),
    # a database path opening would refuse, said with its line (they came without one: a trial)
    (BASE.replace("t.duckdb", "x.npy") + '[steps.h]\nspec = "ij->i"\noperands = ["x"]\n', 1,
     "is not a DuckDB database file"),
    (BASE.replace("t.duckdb", "sub/t.duckdb") + '[steps.h]\nspec = "ij->i"\noperands = ["x"]\n', 1,
     "its folder"),
    # an operand forgotten: said so, not "input 'w1': no step reads this input" (a trial)
    (BASE + 'w1 = { file = "x.npy" }\n[steps.h]\nspec = "bi,io->bo"\noperands = ["x"]\n', 7,
     "step 'h': einsum spec 'bi,io->bo' has 2 operand(s) but 1 operand(s) were given"),
    ('database = "t.duckdb"\n[inputs]\nx = { file = "nope.npy" }\n[steps.h]\nspec = "ij->i"\noperands = ["x"]\n',
     3, "input 'x': no such file"),
    ('database = "t.duckdb"\n[inputs]\nx = { tensor = "X" }\n[steps.h]\nspec = "ij->i"\noperands = ["x"]\n',
     3, "input 'x': reads stored tensor 'X', but the database"),
    (BASE + '[steps.h]\nspec = "ij,jk->ik"\noperands = ["x", "x"]\n', 5,
     "step 'h': einsum label 'j' has size 4 in operand 1"),
    (BASE + '[steps.h]\nspec = "ij,kj->ik"\noperands = ["x", "x"]\nagg = "mean"\n', 7, "unknown agg 'mean'"),
    (BASE + '[steps.h]\nspec = "ij,kj->ik"\noperands = ["x", "x"]\njoin = "frob(x)"\n', 7,
     "join expression: unknown function 'frob'"),
    (BASE + '[steps.h]\nspec = "ij,kj->ik"\noperands = ["x", "x"]\njoin = "frobnicate"\n', 7,
     "unknown join 'frobnicate'"),  # was given the spec's line (6)
    (BASE + '[steps.h]\nspec = "ij->ij"\noperands = ["g"]\n[steps.g]\nspec = "ij,ij->ij"\noperands = ["h", "x"]\n',
     4, "the steps form a cycle: h -> g -> h"),
    (BASE + '[steps.X]\nspec = "ij->ij"\noperands = ["x"]\n', 4, "step 'X': writes over input 'x'"),
    ('database = "t.duckdb"\nmemory = "64B"\n' + BASE[22:] + '[steps.h]\nspec = "ij,kj->ik"\noperands = ["x", "x"]\n',
     2, "fits the memory budget"),
    (BASE + '[steps.h]\nspec = "ij->i"\noperands = "x"\n', 6, "operands must be a non-empty list"),
    (BASE + 'q = { file = "x.npy" }\n[steps.h]\nspec = "ij->i"\noperands = ["x"]\n', 4,
     "input 'q': no step reads this input"),
    ('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy", shape = [4, 6] }\n[steps.h]\nspec = "ij->i"\n'
     'operands = ["x"]\n', 3, "input 'x': shape, index and value describe a table file"),
    ('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy", shape = [4, -6] }\n[steps.h]\nspec = "ij->i"\n'
     'operands = ["x"]\n', 3, "shape must be a list of integers >= 0"),
    ('database = "t.duckdb"\n[inputs]\nx = { tensor = "X", index = ["i"] }\n[steps.h]\nspec = "ij->i"\n'
     'operands = ["x"]\n', 3, "'index' is for a file"),
]


@pytest.mark.parametrize("text,line,says", BAD, ids=[b[2].split("'")[0].strip() or b[2] for b in BAD])
def test_bad_job_files_fail_before_anything_runs(tmp_path, capsys, text, line, says):
    np.save(tmp_path / "x.npy", np.ones((4, 6), np.float32))
    job = tmp_path / "job.toml"
    job.write_text(text)
    for command in ("run", "explain"):
        code, out, err = run_main(capsys, command, job)
        assert code == 1, err
        assert err.count("\n") == 1 and err.startswith("eindecomp-sql: error: ") and "Traceback" not in err, err
        where = str(job) + (f":{line}" if line is not None else "")
        assert err.startswith(f"eindecomp-sql: error: {where}: "), err
        assert says in err, err
    assert not (tmp_path / "t.duckdb").exists()  # nothing was created, let alone computed


def test_an_input_that_is_a_directory_is_said_to_be_one(tmp_path, capsys):
    # a Spark-written x.parquet/ is a folder of files: "no such file" sent a trial looking for it
    (tmp_path / "x.parquet").mkdir()
    (tmp_path / "job.toml").write_text('database = "t.duckdb"\n[inputs]\nx = { file = "x.parquet" }\n'
                                       '[steps.h]\nspec = "i->"\noperands = ["x"]\n')
    code, _, err = run_main(capsys, "run", tmp_path / "job.toml")
    assert code == 1 and ":3: input 'x': " in err and "is a directory, not a file" in err, err
    assert "no such file" not in err and not (tmp_path / "t.duckdb").exists()


def test_unknown_stored_tensor_is_named_with_its_line(tmp_path, capsys):
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("Z", np.ones(3))
    (tmp_path / "job.toml").write_text('database = "t.duckdb"\n[inputs]\nz = { tensor = "Y" }\n'
                                       '[steps.h]\nspec = "i->"\noperands = ["z"]\n')
    code, _, err = run_main(capsys, "run", tmp_path / "job.toml")
    assert code == 1 and ":3: input 'z': no stored tensor 'Y'" in err and "stored: Z" in err, err
    assert stored(tmp_path / "t.duckdb").keys() == {"Z"}


def small_job(d: Path, extra: str = "", join: str = "relu(x - y)") -> Path:
    rng = np.random.default_rng(1)
    np.save(d / "x.npy", rng.standard_normal((8, 6)))
    (d / "job.toml").write_text(BASE + extra + f'[steps.h]\nspec = "ij,kj->ik"\noperands = ["x", "x"]\n'
                                f'join = "{join}"\nagg = "max"\n[steps.s]\nspec = "ik->i"\noperands = ["h"]\n')
    return d / "job.toml"


def test_operand_names_ignore_case_as_every_name_of_a_job_does(tmp_path, capsys):
    """docs/cli.md: names ignore case, operands in the fingerprint too; yet ["x", "X"] with an
    input x was refused as an unknown operand 'X' (a trial). Respelt, the job is unchanged."""
    job = small_job(tmp_path)
    job.write_text(job.read_text().replace('operands = ["x", "x"]', 'operands = ["x", "X"]')
                   .replace('operands = ["h"]', 'operands = ["H"]'))
    code, out, err = run_main(capsys, "run", job)
    assert code == 0, err
    x = np.load(tmp_path / "x.npy")
    h = np.max(np.maximum(x[:, None, :] - x[None, :, :], 0), axis=2)
    np.testing.assert_allclose(stored(tmp_path / "t.duckdb")["s"], h.sum(1))
    job.write_text(job.read_text().replace('["x", "X"]', '["X", "x"]').replace('["H"]', '["h"]'))
    code, out, err = run_main(capsys, "run", job, "--json")
    assert code == 0 and all(e["skipped"] for e in json.loads(out)["steps"]), err


def test_a_spec_join_or_agg_respelt_with_the_same_meaning_changes_nothing(tmp_path, capsys):
    """Names ignore case in the job; a join, agg or spec spelt otherwise (``MAX``, blanks) was
    a changed job that only --force ran (the fingerprint hashed the raw text). A change of
    meaning is still refused, naming that field alone."""
    job = small_job(tmp_path, join="relu(x-y)")
    assert run_main(capsys, "run", job, "-q")[0] == 0
    text = job.read_text()
    job.write_text(text.replace('"relu(x-y)"', '" relu( x  -  y ) "').replace('agg = "max"', 'agg = "MAX"')
                   .replace('"ij,kj->ik"', '"ij, kj -> ik"').replace('"ik->i"', '" ik -> i "'))
    code, out, err = run_main(capsys, "run", job, "--json")
    assert code == 0 and all(e["skipped"] for e in json.loads(out)["steps"]), out + err
    job.write_text(text.replace('agg = "max"', 'agg = "MIN"'))
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "step 'h' (line 4): agg 'max' -> 'MIN'; step 's'" in err, err
    assert "join '" not in err and "spec '" not in err, err


def test_changed_job_is_refused_saying_what_changed_then_forced(tmp_path, capsys):
    job = small_job(tmp_path)
    code, out, err = run_main(capsys, "run", job, "--json")
    assert code == 0, err
    x = np.load(tmp_path / "x.npy")
    h = np.max(np.maximum(x[:, None, :] - x[None, :, :], 0), axis=2)
    assert np.allclose(stored(tmp_path / "t.duckdb")["h"], h)

    small_job(tmp_path, join="relu(y - x)")
    code, out, err = run_main(capsys, "run", job)
    assert code == 1
    assert "step 'h' (line 4): join 'relu(x - y)' -> 'relu(y - x)'" in err and "step 's' (line 9): input h changed" in err
    assert "--force" in err and err.count("\n") == 1
    code, out, err = run_main(capsys, "explain", job)  # explain shows the same, and exits 0
    assert code == 0 and "CHANGED: join 'relu(x - y)' -> 'relu(y - x)'" in out, err
    code, out, err = run_main(capsys, "run", job, "--force", "--json")
    assert code == 0, err
    assert {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": True, "h": False, "s": False}
    assert np.allclose(stored(tmp_path / "t.duckdb")["h"], h.T)

    # a file's content: re-hashed when its size or mtime changes; a touch alone changes nothing,
    # and costs one re-hash, not one every run from then on (a trial: the new mtime was never
    # recorded)
    from eindecomp_sql.jobs import files

    hashed = []
    digest = files.file_digest
    files.file_digest = lambda path, *a, **k: hashed.append(path) or digest(path, *a, **k)
    try:
        os.utime(tmp_path / "x.npy", ns=(1, 10**18))
        for _ in range(3):
            code, out, err = run_main(capsys, "run", job, "--json")
            assert code == 0 and all(e["skipped"] for e in json.loads(out)["steps"]), err
    finally:
        files.file_digest = digest
    assert len(hashed) == 1, hashed
    np.save(tmp_path / "x.npy", x + 1)
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "input 'x' (line 3): the file's content changed" in err, err
    # settings change no fingerprint: a done result is read as it is stored, whatever tiles a
    # plan made now would give it (it was "its plan changed" for --workers 4)
    np.save(tmp_path / "x.npy", x)
    for setting in (["--workers", "4"], ["--memory", "1GB"]):
        code, out, err = run_main(capsys, "explain", job, *setting)
        assert code == 0 and "CHANGED" not in out and out.count("done (unchanged") == 3, out


def test_a_tensor_no_job_wrote_is_not_replaced_without_force(tmp_path, capsys):
    job = small_job(tmp_path)
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("s", np.zeros(8))
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "step 's' (line 9): tensor 's' is stored in the database, but no job wrote it" in err, err
    assert stored(tmp_path / "t.duckdb").keys() == {"s"}  # nothing ran
    code, out, err = run_main(capsys, "run", job, "--force")
    assert code == 0, err
    assert stored(tmp_path / "t.duckdb").keys() == {"s", "h", "x"}


def test_explain_prints_the_plan_and_dot_without_a_database(tmp_path, capsys):
    job = small_job(tmp_path)
    code, out, err = run_main(capsys, "explain", job)
    assert code == 0, err
    assert "(does not exist yet)" in out and "step h (line 4)" in out and "graph plan" in out
    assert "to run" in out
    code, out, err = run_main(capsys, "explain", job, "--dot")
    assert code == 0 and out.startswith("digraph"), err
    assert not (tmp_path / "t.duckdb").exists()


def test_the_job_in_docs_cli_md_runs(tmp_path, capsys):
    text = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    job = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "job.toml").write_text(job)
    rng = np.random.default_rng(5)
    x, w1, w2, b = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 12), (12, 8), (12,)))
    np.save(tmp_path / "x.npy", x)
    i, j = np.indices(w1.shape)
    pq.write_table(pa.table({"i": i.ravel(), "j": j.ravel(), "value": w1.ravel()}), tmp_path / "w1.parquet")
    i, j = np.indices(w2.shape)
    table = pa.table({"i": i.ravel(), "j": j.ravel(), "value": w2.astype(np.float64).ravel()})
    with pa.OSFile(str(tmp_path / "w2.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as wr:
        wr.write_table(table)
    with eds.connect(str(tmp_path / "tensors.duckdb")) as db:
        db.store("bias", b)
    code, out, err = run_main(capsys, "run", tmp_path / "job.toml", "--json")
    assert code == 0, err
    got = stored(tmp_path / "tensors.duckdb")
    y = np.maximum(x @ w1 + b, 0) @ w2
    assert got["w2"].dtype == np.float32
    assert np.allclose(got["y"], y, atol=1e-5)
    assert np.allclose(got["m"], np.max(y[:, None, :] + x[None, :, :], axis=2), atol=1e-5)


def test_a_part_that_fails_while_running_is_named_and_leaves_nothing(tmp_path, capsys):
    np.save(tmp_path / "a.npy", np.array([[1, 2], [300, 4]], np.int64))
    (tmp_path / "job.toml").write_text('database = "t.duckdb"\n[inputs]\na = { file = "a.npy", dtype = "int8" }\n'
                                       '[steps.s]\nspec = "ij->i"\noperands = ["a"]\n')
    code, out, err = run_main(capsys, "run", tmp_path / "job.toml", "--json")
    assert code == 1 and err.endswith(f"error: {tmp_path / 'job.toml'}:3: input 'a': store('a'): value 300 at (1, 0) "
                                      "does not fit dtype=int8 (it would become 44)\n"), err
    summary = json.loads(out)
    assert summary["ok"] is False and "does not fit" in summary["error"] and summary["steps"] == []
    assert stored(tmp_path / "t.duckdb") == {}


def test_a_bfloat16_npy_input_is_read_as_the_job_declares(tmp_path, capsys):
    """np.save writes bfloat16 as 2-byte voids: a job reads such a file when its input says
    dtype = "bfloat16", and says what to write when it does not."""
    import ml_dtypes  # noqa: F401 - numpy's "bfloat16"

    x = np.random.default_rng(4).standard_normal((5, 3)).astype("bfloat16")
    np.save(tmp_path / "x.npy", x)
    body = '[steps.g]\nspec = "ij,kj->ik"\noperands = ["x", "x"]\n'
    (tmp_path / "bad.toml").write_text('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy" }\n' + body)
    code, out, err = run_main(capsys, "run", tmp_path / "bad.toml")
    assert code == 1 and "2-byte void elements" in err and "dtype='bfloat16'" in err, err
    (tmp_path / "job.toml").write_text('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy", dtype = "bfloat16" }\n'
                                       + body)
    code, out, err = run_main(capsys, "run", tmp_path / "job.toml")
    assert code == 0, err
    got = stored(tmp_path / "t.duckdb")
    assert got["x"].dtype == got["g"].dtype == np.dtype("bfloat16")
    wide = x.astype(np.float32)
    np.testing.assert_array_equal(got["g"], (wide @ wide.T).astype("bfloat16"))


def test_a_result_replaced_by_hand_is_not_done(tmp_path, capsys):
    """Done needs the tiles the job recorded, not only a matching fingerprint and shape: a step's
    result (or a loaded input) replaced by hand with the same shape, dtype, tile and keys is
    computed again, and the job's results follow."""
    job = small_job(tmp_path)
    assert run_main(capsys, "run", job)[0] == 0
    before = stored(tmp_path / "t.duckdb")
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        h = db.tensor("h")
        db.store("h", np.full(h.shape, 7.0), tile=h.tile, keys=h.keys, replace=True)
    code, out, err = run_main(capsys, "explain", job)
    assert code == 0 and "stored tensor 'h' was replaced since the job wrote it" in out, out
    code, out, err = run_main(capsys, "run", job, "--force", "--json")
    assert code == 0, err
    # h is computed again; s was computed from the h the job wrote, which h is again: still done
    assert {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": True, "h": False, "s": True}
    after = stored(tmp_path / "t.duckdb")
    assert all(same_bytes(before[k], after[k]) for k in before)


def test_files_the_package_exported_are_job_inputs_and_databases_must_be_duckdb(tmp_path, capsys):
    """A tiled export keeps its keys (i, k for an einsum result); a job reads it as d0, d1. And a
    non-DuckDB file given as the database is refused (DuckDB would open a Parquet file as a
    database that silently keeps nothing)."""
    job = small_job(tmp_path)
    assert run_main(capsys, "run", job)[0] == 0
    assert run_main(capsys, "export", tmp_path / "t.duckdb", "h", tmp_path / "h.parquet")[0] == 0
    (tmp_path / "job2.toml").write_text('database = "u.duckdb"\n[inputs]\na = { file = "h.parquet" }\n'
                                        '[steps.c]\nspec = "ij,jk->ik"\noperands = ["a", "a"]\n')
    code, out, err = run_main(capsys, "run", tmp_path / "job2.toml")
    assert code == 0, err
    h = stored(tmp_path / "t.duckdb")["h"]
    assert np.allclose(stored(tmp_path / "u.duckdb")["c"], h @ h)
    assert run_main(capsys, "run", tmp_path / "job2.toml", "--json")[0] == 0  # resumes: all done
    code, out, err = run_main(capsys, "store", tmp_path / "h.parquet", "B", tmp_path / "x.npy")
    assert code == 1 and "is not a DuckDB database file" in err, err


def test_a_result_committed_before_a_kill_is_recorded_done_on_resume_so_a_later_replacement_is_found(tmp_path):
    """Killed between its commit and its 'done' row, a step's result is kept on resume; its row
    stayed 'pending' without the result's md5 for good, so replacing it by hand (same shape,
    other bytes) later went unnoticed and the job counted it done."""
    rng = np.random.default_rng(8)
    np.save(tmp_path / "x.npy", rng.standard_normal((64, 32)).astype(np.float32))
    np.save(tmp_path / "w.npy", rng.standard_normal((32, 48)).astype(np.float32))
    (tmp_path / "job.toml").write_text('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy" }\nw = { file = "w.npy" }\n'
                                       '[steps.h]\nspec = "bi,io->bo"\noperands = ["x", "w"]\n'
                                       '[steps.g]\nspec = "bo->o"\noperands = ["h"]\n')
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    killed = subprocess.run([sys.executable, str(driver), "at", "committed", "h", "run", "job.toml", "-q"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rc, out, err = finish(cli("run", "job.toml", "--json", cwd=tmp_path))
    assert rc == 0, err
    assert [e["name"] for e in json.loads(out)["steps"] if e["skipped"]] == ["x", "w", "h"]
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        rows = dict(db.connection.execute("SELECT name, state || ' ' || (content_md5 IS NOT NULL) FROM eds_jobs").fetchall())
        assert rows["h"] == "done true", rows
        h = db.tensor("h")
        db.store("h", np.zeros(h.shape, np.float32), tile=h.tile, keys=h.value.keys, replace=True)
    rc, out, err = finish(cli("run", "job.toml", cwd=tmp_path))
    assert rc == 1 and "stored tensor 'h' was replaced since the job wrote it" in err, err


def test_run_json_prints_a_failed_summary_also_when_nothing_ran(tmp_path, capsys):
    """docs/cli.md: a failed run prints its summary with "ok": false and "error"; a job refused or
    failing to plan before any step ran printed nothing on stdout."""
    np.save(tmp_path / "x.npy", np.ones((4, 3)))
    cases = {"unplannable.toml": BASE + '[steps.h]\nspec = "ij,jk->ik"\noperands = ["x", "x"]\n',
             "unreadable.toml": 'database = "t.duckdb"\n[inputs\n'}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        rc, out, err = run_main(capsys, "run", tmp_path / name, "--json")
        summary = json.loads(out)
        assert rc == 1 and summary["ok"] is False and summary["steps"] == [] and summary["ran"] == 0, (name, out)
        assert summary["error"] in err and summary["job"].endswith(name), (summary, err)


CTRL_C_IN_MD5 = textwrap.dedent("""
    import os, signal, sys, threading
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    from eindecomp_sql.jobs import runner
    from eindecomp_sql.cli import main
    np.save("x.npy", np.arange(12.0).reshape(3, 4))
    md5 = runner.content_md5

    def slow_md5(db, t):  # the md5 of a finished step, made long enough to be interrupted in
        # the Ctrl-C timed from here, not from the start: on a loaded machine a fixed 0.5 s
        # landed before the step had run, a case other tests cover
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        cur = db.connection.cursor()
        cur.execute("SELECT sum(range) FROM range(2000000000)").fetchall()
        return md5(db, t)

    runner.content_md5 = slow_md5
    main(["run", "j.toml", "--json"])
""")


def test_a_ctrl_c_in_a_jobs_own_statements_is_interrupted_not_an_internal_error(tmp_path):
    """A Ctrl-C landing in the md5 a job takes of a finished step came out as "internal error:
    RuntimeError: Query interrupted", exit 1 (a new user's random SIGINTs, 3 of 16); the docs
    promise "interrupted", exit 130, and the summary says so."""
    (tmp_path / "j.toml").write_text('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy" }\n'
                                     '[steps.h]\nspec = "ij->i"\noperands = ["x"]\n')
    (tmp_path / "c.py").write_text(CTRL_C_IN_MD5)
    r = subprocess.run([sys.executable, "c.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 130 and r.stderr.strip().endswith("\neindecomp-sql: interrupted"), (r.returncode, r.stderr)
    assert "internal error" not in r.stderr
    assert json.loads(r.stdout)["error"] == "interrupted"


def test_an_empty_input_is_refused_once_named_and_explained(capsys, tmp_path, monkeypatch):
    """A job input with a dimension of size 0 was refused as "input 'Z': input 'Z': every
    dimension must be >= 1" (a new user's report): named once, and the message says why (jobs
    plan one graph, which has no empty dimensions) and what takes them."""
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "z.npy", np.zeros((0, 3)))
    (tmp_path / "j.toml").write_text('database = "t.duckdb"\n[inputs]\nZ = { file = "z.npy" }\n'
                                     '[steps.h]\nspec = "ij->i"\noperands = ["Z"]\n')
    code, _, err = run_main(capsys, "run", "j.toml")
    assert code == 1 and err.count("input 'Z'") == 1 and "no empty dimensions" in err, err


def test_a_jobs_paths_expand_the_home_folder(tmp_path, monkeypatch):
    """database = "~/x.duckdb" became <job dir>/~/x.duckdb (a new user's report); files too."""
    from eindecomp_sql.jobs.spec import parse_job

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    np.save(tmp_path / "home" / "x.npy", np.ones((2, 3)))
    job = parse_job('database = "~/x.duckdb"\n[inputs]\nx = { file = "~/x.npy" }\n[steps.h]\nspec = "ij->i"\n'
                    'operands = ["x"]\n', tmp_path / "jobs" / "j.toml")
    assert job.database == tmp_path / "home" / "x.duckdb"
    assert job.inputs["x"].file == tmp_path / "home" / "x.npy"


def test_a_planning_refusal_names_the_setting_it_is_about(capsys, tmp_path, monkeypatch):
    """--memory on the command line was blamed on the job file's memory line, and a tile_bytes
    too small got no line at all (a new user's report)."""
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.ones((64, 64)))
    (tmp_path / "j.toml").write_text('database = "t.duckdb"\nmemory = "1GB"\ntile_bytes = 16\n[inputs]\n'
                                     'x = { file = "x.npy" }\n[steps.h]\nspec = "ij,jk->ik"\noperands = ["x", "x"]\n')
    code, _, err = run_main(capsys, "explain", "j.toml")
    assert code == 1 and err.startswith("eindecomp-sql: error: j.toml:3: cannot plan the job"), err
    code, _, err = run_main(capsys, "explain", "j.toml", "--memory", "1kB")
    assert code == 1 and err.startswith("eindecomp-sql: error: j.toml: cannot plan the job"), err


def test_a_rename_in_case_only_changes_nothing(capsys, tmp_path, monkeypatch):
    """Renaming [steps.h] to [steps.H] was reported as "its plan changed (chunking or tiles:
    memory, workers, ...)" (a new user's report); names ignore case, as the database's do."""
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", np.arange(12.0).reshape(3, 4))
    job = ('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy" }\n[steps.{h}]\nspec = "ij->i"\noperands = ["x"]\n'
           '[steps.g]\nspec = "i->i"\noperands = ["{h}"]\njoin = "relu"\n')
    (tmp_path / "j.toml").write_text(job.replace("{h}", "h"))
    assert run_main(capsys, "run", "j.toml", "-q")[0] == 0
    (tmp_path / "j.toml").write_text(job.replace("{h}", "H"))
    code, out, err = run_main(capsys, "explain", "j.toml")
    assert code == 0 and "CHANGED" not in out and out.count("done (unchanged") == 3, out + err


def test_a_write_that_fails_at_commit_is_the_steps_error_not_a_bug(tmp_path, capsys, monkeypatch):
    """The disk full (a trial filled a 3 MB tmpfs) failed COMMIT and the job's own records:
    "internal error: TransactionException", naming no step. Now an EinsumError saying it could
    not commit, and a JobError with the file, line and step; nothing half-written, and the
    next run resumes."""
    import duckdb

    from eindecomp_sql.jobs import runner

    db = eds.connect()
    db.store("A", np.arange(6.0).reshape(2, 3))
    real = db.backend._run

    def full_disk(sql, params=None):
        if sql == "COMMIT":
            raise duckdb.IOException('Could not write file "t.duckdb.wal": No space left on device')
        return real(sql, params)

    monkeypatch.setattr(db.backend, "_run", full_disk)
    with pytest.raises(eds.EinsumError, match="could not commit: .*No space left on device"):
        db.einsum("ij->j", "A", out="S")
    monkeypatch.undo()
    assert db.tensors() == ["A"]  # nothing of the failed call
    np.testing.assert_array_equal(db.einsum("ij->j", "A", out="S").to_numpy(), [3.0, 5.0, 7.0])
    db.close()

    job = small_job(tmp_path)
    init = runner.Runner.__init__

    class FullCursor:
        def __init__(self, cur):
            self.cur = cur

        def execute(self, sql, params=None):
            if sql.startswith(f"INSERT OR REPLACE INTO {runner.TABLE}") and params[0] == "h":
                raise duckdb.IOException("No space left on device")
            return self.cur.execute(sql, params) if params is not None else self.cur.execute(sql)

    def patched(self, *a, **k):
        init(self, *a, **k)
        self.cur = FullCursor(self.cur)

    monkeypatch.setattr(runner.Runner, "__init__", patched)
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "internal error" not in err, err
    assert "step 'h'" in err and "could not record its state in eds_jobs: " in err and "No space left" in err, err
    monkeypatch.undo()
    code, out, err = run_main(capsys, "run", job, "--json")  # space again: it resumes
    assert code == 0 and {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": True, "h": False,
                                                                                          "s": False}, err


def test_a_table_file_input_takes_shape_index_and_value(tmp_path, capsys):
    """An element-form input whose last rows and columns are empty was read as (3, 2), not
    (5, 4), and ``shape`` was an unknown key; an extra integer column became a dimension (a
    trial). A job's input takes store's ``shape``, ``index`` and ``value``; changing index or
    value re-loads it."""
    a = np.zeros((5, 4))
    a[0, 0], a[2, 1] = 1.5, -2.0
    i, j = np.nonzero(a)
    pq.write_table(pa.table({"batch": np.full(len(i), 7), "i": i, "j": j, "v": a[i, j], "w": 2 * a[i, j]}),
                   tmp_path / "a.parquet")
    job = tmp_path / "job.toml"
    text = ('database = "t.duckdb"\n[inputs]\na = {{ file = "a.parquet", shape = [5, 4], index = ["i", "j"], '
            'value = "{value}" }}\n[steps.r]\nspec = "ij->i"\noperands = ["a"]\n')
    job.write_text(text.format(value="v"))
    code, out, err = run_main(capsys, "run", job)
    assert code == 0, err
    with eds.connect(str(tmp_path / "t.duckdb"), read_only=True) as db:
        np.testing.assert_array_equal(db.tensor("a").to_numpy(), a)
        np.testing.assert_array_equal(db.tensor("r").to_numpy(), a.sum(1))
    job.write_text(text.format(value="w"))
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "input 'a'" in err and "changed" in err, err
    code, out, err = run_main(capsys, "run", job, "--force")
    assert code == 0, err
    with eds.connect(str(tmp_path / "t.duckdb"), read_only=True) as db:
        np.testing.assert_array_equal(db.tensor("r").to_numpy(), 2 * a.sum(1))


def test_a_job_resumes_under_another_budget_reading_done_steps_as_they_are_stored(tmp_path, capsys):
    """A job killed for want of memory could not resume under a larger --memory: its plan's
    chunking was in every fingerprint, so every step was "changed" and --force recomputed the
    loads too (a trial). Done parts are now read as they are stored by the steps planned after
    them (re-tiled where the new plan cuts otherwise)."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 170))
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    head = ('database = "t.duckdb"\n[inputs]\na = { file = "a.npy" }\nb = { file = "b.npy" }\n'
            '[steps.c]\nspec = "ij,jk->ik"\noperands = ["a", "b"]\n')
    job = tmp_path / "job.toml"
    job.write_text('tile_bytes = "64KiB"\n' + head)  # the first run cuts small tiles
    code, out, err = run_main(capsys, "run", job, "--memory", "220MB", "--json")
    assert code == 0, err
    with eds.connect(str(tmp_path / "t.duckdb"), read_only=True) as db:
        before = {n: db.tensor(n).tile for n in ("a", "b", "c")}
    assert before["c"] != (300, 170), before
    job.write_text(head + '[steps.d]\nspec = "ik,jk->ij"\noperands = ["c", "b"]\n'
                          '[steps.e]\nspec = "ij->j"\noperands = ["d"]\nagg = "max"\n')
    code, out, err = run_main(capsys, "run", job, "--memory", "4GB", "--json")
    assert code == 0, err
    ran = {e["name"]: e["skipped"] for e in json.loads(out)["steps"]}
    assert ran == {"a": True, "b": True, "c": True, "d": False, "e": False}, ran
    with eds.connect(str(tmp_path / "t.duckdb"), read_only=True) as db:
        assert {n: db.tensor(n).tile for n in ("a", "b", "c")} == before  # read as stored
        c = a @ b
        np.testing.assert_allclose(db.tensor("c").to_numpy(), c, rtol=1e-12)
        np.testing.assert_allclose(db.tensor("d").to_numpy(), c @ b.T, rtol=1e-10)
        np.testing.assert_allclose(db.tensor("e").to_numpy(), (c @ b.T).max(0), rtol=1e-10)
    for memory in ("220MB", "4GB", "1GB"):  # every budget: all done
        code, out, err = run_main(capsys, "run", job, "--memory", memory, "--json")
        assert code == 0 and all(e["skipped"] for e in json.loads(out)["steps"]), (memory, err)
    # a changed definition is still refused, and --force recomputes it and what reads it only
    np.save(tmp_path / "b.npy", b + 1)
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "input 'b' (line 4): the file's content changed" in err, err
    code, out, err = run_main(capsys, "run", job, "--force", "--json")
    assert code == 0, err
    assert {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {
        "a": True, "b": False, "c": False, "d": False, "e": False}
    with eds.connect(str(tmp_path / "t.duckdb"), read_only=True) as db:
        np.testing.assert_allclose(db.tensor("e").to_numpy(), ((a @ (b + 1)) @ (b + 1).T).max(0), rtol=1e-10)


def test_ls_flags_results_computed_from_inputs_since_changed(tmp_path, capsys):
    """After a step was renamed and its input file replaced (run --force), the old step's result
    was listed "step done" with yesterday's numbers (a trial)."""
    job = small_job(tmp_path)
    assert run_main(capsys, "run", job)[0] == 0
    np.save(tmp_path / "x.npy", np.load(tmp_path / "x.npy") + 1)
    job.write_text(job.read_text().replace("[steps.s]", "[steps.s2]"))
    code, out, err = run_main(capsys, "run", job, "--force")
    assert code == 0, err
    code, out, err = run_main(capsys, "ls", tmp_path / "t.duckdb", "--json")
    state = {r["name"]: r["job"] for r in json.loads(out)}
    assert state["s"] == "step done, STALE: input h changed since", state
    assert state["s2"] == "step done" and state["h"] == "step done" and state["x"] == "load done", state


def test_a_load_dropped_or_replaced_by_hand_whose_readers_are_done_is_loaded_again(tmp_path, capsys):
    """Only parts not done are planned, and a load no step still to run reads had no tiles:
    KeyError in run, run --force and explain (a review)."""
    np.save(tmp_path / "x.npy", np.arange(12.0).reshape(3, 4))
    job = tmp_path / "job.toml"
    job.write_text('database = "t.duckdb"\n[inputs]\nx = { file = "x.npy" }\n[steps.y]\nspec = "ij->i"\n'
                   'operands = ["x"]\n')
    assert run_main(capsys, "run", job)[0] == 0
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.drop("x")  # to save space
    code, out, err = run_main(capsys, "explain", job)
    assert code == 0 and "load x (line 3)" in out and "to run" in out, out + err
    code, out, err = run_main(capsys, "run", job, "--json")
    assert code == 0 and {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": False, "y": True}, err
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("x", np.zeros((3, 4)), replace=True)
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "input 'x' (line 3): stored tensor 'x' was replaced" in err, err
    code, out, err = run_main(capsys, "run", job, "--force", "--json")
    assert code == 0 and {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": False, "y": True}, err
    assert stored(tmp_path / "t.duckdb")["x"].tolist() == np.arange(12.0).reshape(3, 4).tolist()


def test_run_refresh_recomputes_for_new_input_data_and_still_refuses_an_edited_job(tmp_path, capsys):
    """A nightly job whose input files change needed --force every run, which waves edits of
    the job through too (a trial). --refresh recomputes what new input data changed, and only
    that; a changed definition is still refused."""
    job = small_job(tmp_path)
    assert run_main(capsys, "run", job)[0] == 0
    x = np.load(tmp_path / "x.npy")
    np.save(tmp_path / "x.npy", np.concatenate([x + 1, x]))  # new data, more rows
    code, out, err = run_main(capsys, "run", job)
    assert code == 1 and "Only input data changed: run with --refresh" in err, err
    code, out, err = run_main(capsys, "explain", job)  # said "--force" where --refresh does (a trial)
    assert code == 0 and out.count("(run refuses without --refresh: new input data)") == 3, out
    assert "--force" not in out, out
    code, out, err = run_main(capsys, "run", job, "--refresh", "--json")
    assert code == 0, err
    assert {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": False, "h": False, "s": False}
    x2 = np.concatenate([x + 1, x])
    h = np.max(np.maximum(x2[:, None, :] - x2[None, :, :], 0), axis=2)
    np.testing.assert_allclose(stored(tmp_path / "t.duckdb")["s"], h.sum(1))
    job.write_text(job.read_text().replace('agg = "max"', 'agg = "min"'))  # an edit: refused still
    np.save(tmp_path / "x.npy", x)
    code, out, err = run_main(capsys, "run", job, "--refresh")
    assert code == 1 and "agg 'max' -> 'min'" in err and "--refresh" not in err.split("agg")[0], err
    assert "Run with --force" in err


def test_run_refresh_takes_the_job_run_from_another_directory(tmp_path, capsys, monkeypatch):
    """The record named a loaded file as the command spelt its path: run as ``job.toml`` in its
    directory, then ``--refresh`` as ``proj/job.toml`` from the parent (a cron job by its path)
    was refused as a file pointed elsewhere, --force the only way on (a trial). Nor is the file
    hashed again on a run from elsewhere."""
    job = small_job(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run_main(capsys, "run", job.name)[0] == 0
    x = np.load(tmp_path / "x.npy")
    np.save(tmp_path / "x.npy", x * 2)  # new data
    monkeypatch.chdir(tmp_path.parent)
    code, out, err = run_main(capsys, "run", Path(tmp_path.name) / job.name, "--refresh", "--json")
    assert code == 0, err
    assert {e["name"]: e["skipped"] for e in json.loads(out)["steps"]} == {"x": False, "h": False, "s": False}
    h = np.max(np.maximum(2 * x[:, None, :] - 2 * x[None, :, :], 0), axis=2)
    np.testing.assert_allclose(stored(tmp_path / "t.duckdb")["s"], h.sum(1))
    from eindecomp_sql.jobs import files

    hashed, digest = [], files.file_digest
    monkeypatch.setattr(files, "file_digest", lambda path, *a, **k: hashed.append(path) or digest(path, *a, **k))
    for where, path in ((tmp_path, job.name), (tmp_path.parent, job)):  # all done: skipped, no hash
        monkeypatch.chdir(where)
        code, out, err = run_main(capsys, "run", path, "--json")
        assert code == 0 and all(e["skipped"] for e in json.loads(out)["steps"]), err
    assert hashed == []


def _two_jobs(d: Path, capsys, step: str, read_as: str, tensor: str) -> dict[str, str]:
    """Job one computes ``step`` from x.npy; job two reads stored ``tensor`` as input ``read_as``
    and negates it (step ``d2``). Both run; returns ``ls``'s job column by tensor."""
    (d / "one.toml").write_text(f'database = "t.duckdb"\n[inputs]\nx = {{ file = "x.npy" }}\n[steps.{step}]\n'
                                'spec = "ij->j"\noperands = ["x"]\n')
    (d / "two.toml").write_text(f'database = "t.duckdb"\n[inputs]\n{read_as} = {{ tensor = "{tensor}" }}\n'
                                f'[steps.d2]\nspec = "j->j"\noperands = ["{read_as}"]\njoin = "neg"\n')
    assert run_main(capsys, "run", d / "one.toml")[0] == 0
    assert run_main(capsys, "run", d / "two.toml")[0] == 0
    return _ls_jobs(d, capsys)


def _ls_jobs(d: Path, capsys) -> dict[str, str]:
    code, out, err = run_main(capsys, "ls", d / "t.duckdb", "--json")
    assert code == 0, err
    return {r["name"]: r["job"] for r in json.loads(out)}


def test_ls_stale_passes_by_a_stored_input_named_like_another_jobs_tensor(tmp_path, capsys):
    """A step reading a stored tensor through an input named like a tensor another job wrote was
    compared with that tensor's row (a review: a false STALE)."""
    np.save(tmp_path / "x.npy", np.arange(6.0).reshape(2, 3))
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("T", np.ones(3))
    state = _two_jobs(tmp_path, capsys, step="s", read_as="s", tensor="T")
    assert not any("STALE" in (job or "") for job in state.values()), state


def test_run_refresh_refuses_a_result_replaced_by_hand_and_inputs_pointed_elsewhere(tmp_path, capsys):
    """--refresh overwrote a result replaced by hand (no input data changed) and took a stored
    input pointed at another tensor, or a file input at another file, for new data (a review)."""
    np.save(tmp_path / "x.npy", np.ones((3, 4)))
    np.save(tmp_path / "x2.npy", np.full((3, 4), 2.0))
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("bias", np.arange(4.0))
        db.store("other_bias", np.zeros(4))
    job = tmp_path / "job.toml"
    text = ('database = "t.duckdb"\n[inputs]\nx = {{ file = "{x}" }}\nb = {{ tensor = "{b}" }}\n[steps.s]\n'
            'spec = "ij,j->j"\noperands = ["x", "b"]\njoin = "add"\n')
    job.write_text(text.format(x="x.npy", b="bias"))
    assert run_main(capsys, "run", job)[0] == 0
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("s", np.full(4, 7.0), replace=True)  # a user's own data over the result
    code, out, err = run_main(capsys, "run", job, "--refresh")
    assert code == 1 and "replaced since the job wrote it" in err and "--refresh" not in err, err
    assert stored(tmp_path / "t.duckdb")["s"].tolist() == [7.0] * 4
    assert run_main(capsys, "run", job, "--force")[0] == 0
    for edit in (text.format(x="x.npy", b="other_bias"), text.format(x="x2.npy", b="bias")):
        job.write_text(edit)
        code, out, err = run_main(capsys, "run", job, "--refresh")
        assert code == 1 and "Run with --force" in err and "Only input data changed" not in err, err
    # the same tensor with new tiles is new data
    job.write_text(text.format(x="x.npy", b="bias"))
    with eds.connect(str(tmp_path / "t.duckdb")) as db:
        db.store("bias", np.arange(4.0) + 10, replace=True)
    code, out, err = run_main(capsys, "run", job, "--refresh")
    assert code == 0, err
    np.testing.assert_array_equal(stored(tmp_path / "t.duckdb")["s"], 3 * (1 + np.arange(4.0) + 10))


def test_ls_flags_a_result_read_through_a_stored_input_another_job_recomputed(tmp_path, capsys):
    """job2 reads job1's step c as a stored input; job1 ran again on new data: d2 was computed from
    the old c, and ls no longer said so once stored inputs were passed by (a review)."""
    np.save(tmp_path / "x.npy", np.ones((3, 4)))
    state = _two_jobs(tmp_path, capsys, step="c", read_as="c", tensor="c")
    assert not any("STALE" in (job or "") for job in state.values()), state
    np.save(tmp_path / "x.npy", np.full((3, 4), 9.0))
    assert run_main(capsys, "run", tmp_path / "one.toml", "--refresh")[0] == 0
    state = _ls_jobs(tmp_path, capsys)
    assert state["d2"] == "step done, STALE: input c (tensor c) changed since" and "STALE" not in state["c"], state


def test_a_stop_after_every_step_committed_says_the_work_is_written(tmp_path, capsys, monkeypatch):
    """A SIGTERM (or Ctrl-C) landing while the runner closed, every step committed, was
    reported as "terminated", ok false, with nothing saying the results were written (a crash
    trial). It still exits as stopped; the message says the work is written."""
    from eindecomp_sql.jobs import runner

    job = small_job(tmp_path)
    close = runner.Runner.close

    def late_stop(self):
        close(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Runner, "close", late_stop)
    code, out, err = run_main(capsys, "run", job, "--json")
    assert code == 130, err
    assert "interrupted after the running operation committed (its result is written)" in err, err
    assert "after the running operation committed" in json.loads(out)["error"], out
    monkeypatch.setattr(runner.Runner, "close", close)
    code, out, err = run_main(capsys, "run", job, "--json")
    assert code == 0 and all(e["skipped"] for e in json.loads(out)["steps"]), out + err
