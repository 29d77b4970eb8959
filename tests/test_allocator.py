"""Freed tile buffers are reused, not page-faulted in again (backends/allocator.py).

Each check runs in a subprocess of its own: the tuning is process-wide and applied once."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from eindecomp_sql.backends import allocator

# mallopt thresholds are glibc's: elsewhere the tuning is (correctly) not applied
glibc = pytest.mark.skipif(allocator._libc() is None, reason="glibc's mallopt only (Linux)")

SCRIPT = textwrap.dedent(
    """
    import json, resource, numpy as np, eindecomp_sql as eds
    from eindecomp_sql.backends import allocator
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3000, 3000)).astype(np.float32)   # 36 MB: above glibc's 32 MiB mmap cap
    b = rng.standard_normal((3000, 3000)).astype(np.float32)
    # stored operands, the result into a table: each call's tiles cross into the UDF and back
    # (arrays passed to eds.einsum are read in place and its result written into its array,
    # which allocate too little per call to show the tuning)
    db = eds.connect()
    db.store("A", a), db.store("B", b)
    faults = []
    for _ in range(6):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        db.einsum("ij,ij->ij", "A", "B", join="add", out="C", replace=True)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    assert np.array_equal(db.tensor("C").to_numpy(), a + b)
    print(json.dumps({"retaining": allocator.retaining(), "faults": faults}))
    """
)


def _run(env_value):
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    if env_value is not None:
        env["EDS_RETAIN_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_repeated_einsum_reuses_freed_buffers():
    tuned, plain = _run(None), _run("0")
    assert tuned["retaining"] and not plain["retaining"]
    pages = 3000 * 3000 * 4 // 4096  # one 36 MB buffer in 4 KiB pages
    # the first call faults its buffers in; later calls find them in the heap again. The second
    # fewest of the 5 later calls: glibc now and then places a buffer where the heap must grow
    # (or DuckDB's own threads trim it), on a loaded machine in 3 of 5 calls once (CI, beside
    # another test run: [19720, 8950, 8939, 8820, 82, 13]); untuned, every call maps afresh
    tuned_later = sorted(tuned["faults"][1:])[1]
    plain_later = sorted(plain["faults"][1:])[1]
    assert tuned_later < pages // 4, tuned
    # without the tuning each call maps its big buffers afresh (several of them per call)
    assert plain_later > tuned_later + pages, (plain, tuned)



TRIM_SCRIPT = textwrap.dedent(
    """
    import json, numpy as np, eindecomp_sql as eds
    from eindecomp_sql.backends import allocator

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    db = eds.connect()
    rounds = []
    for _ in range(2):
        # 600 MiB freed in the heap (each buffer below the 256 MiB mmap threshold); the second
        # round reuses the pages the first trim released, faulting them back in
        xs = [np.ones(200 << 20, dtype=np.uint8) for _ in range(3)]
        del xs
        before = rss()
        db.einsum("i->", np.ones(3))                # a plan run: the free heap is above the cap
        rounds.append({"free_before": before, "after": rss(), "free": allocator.resident_free_bytes()})
    print(json.dumps(rounds))
    """
)


@glibc
def test_memory_freed_beyond_the_cap_is_handed_back_every_time():
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", TRIM_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    if rounds[0]["free"] is None:
        pytest.skip("no mallinfo2 in this glibc (< 2.33): nothing to bound by")
    for r in rounds:  # the second round is what a bookkeeping of "free since the last trim" missed
        assert r["free"] <= allocator.FREE_CAP_BYTES, rounds
        # all but at most the cap went back to the system (DuckDB's own malloc_trim may already
        # have handed back part of it, leaving a free heap top under the cap that stays)
        assert r["free_before"] - r["after"] >= (600 << 20) - allocator.FREE_CAP_BYTES - (16 << 20), rounds


def test_failed_connect_leaves_no_user_counted():
    import duckdb

    import eindecomp_sql as eds
    from eindecomp_sql import EinsumError

    users = allocator._state["users"]
    with pytest.raises(EinsumError):
        eds.connect(memory="lots")
    closed = duckdb.connect()
    closed.close()
    with pytest.raises(EinsumError, match="cannot use this DuckDB connection"):
        eds.connect(closed)
    assert allocator._state["users"] == users
    db = eds.connect()
    assert allocator._state["users"] == users + 1
    db.close()
    db.close()  # twice is harmless
    assert allocator._state["users"] == users


ARENA_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, re, resource, sys, tempfile
    import eindecomp_sql as eds   # first: its import bounds malloc to one arena
    import numpy as np, pyarrow   # pyarrow's import starts a thread that allocates

    def arenas():
        libc = ctypes.CDLL(None)
        libc.fdopen.restype = ctypes.c_void_p
        fd, path = tempfile.mkstemp()
        f = libc.fdopen(os.dup(fd), b"w")
        libc.malloc_info(0, ctypes.c_void_p(f)); libc.fclose(ctypes.c_void_p(f))
        text = open(path).read(); os.close(fd); os.unlink(path)
        return len(re.findall(r'<heap nr="[0-9]+"', text))

    rng = np.random.default_rng(0)
    g = [rng.standard_normal((4096, 4096), dtype=np.float32) for _ in range(2)]
    with eds.connect() as db:                   # a first session of 64 MiB tiles, then another
        A, B = db.store("a", g[0]), db.store("b", g[1])
        for _ in range(3):
            db.einsum("ij,jk->ik", A, B, out="c", replace=True)
    x = [rng.standard_normal((16, 1024, 1024), dtype=np.float32) for _ in range(2)]
    faults = []
    with eds.connect() as db:
        X, Y = db.store("x", x[0]), db.store("y", x[1])
        for _ in range(8):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            db.einsum("bij,bjk->bik", X, Y, out="z", replace=True)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(json.dumps({"arenas": arenas(), "faults": faults}))
    """
)


@glibc
def test_one_malloc_arena_so_64_mib_tiles_are_reused_on_duckdbs_threads():
    """Importing eindecomp_sql before pyarrow bounds malloc to one arena (``_malloc.py``):
    otherwise pyarrow's thread makes a second one, DuckDB's threads share the two, and a UDF
    on a thread that drew the second got each 64 MiB block from a fresh mmap, every call
    (~33,800 faults a call for this step after a first session of 64 MiB tiles)."""
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", ARENA_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["arenas"] == 1, got
    pages = 64 << 20 >> 12  # one 64 MiB buffer in 4 KiB pages
    # the first calls fault their buffers in; later ones reuse them (a median: now and then the
    # heap must grow for one of them)
    assert sorted(got["faults"][3:])[2] < pages // 4, got


BIG_TILE_SCRIPT = textwrap.dedent(
    """
    import json, numpy as np, eindecomp_sql as eds

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    def peak():
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((6000, 6000)), rng.standard_normal((6000, 6000))  # 288 MB, one tile each
    eds.einsum("ij,jk->ik", np.ones((8, 8)), np.ones((8, 8)))  # threads and UDFs started
    start, calls = rss(), []
    for _ in range(3):
        base = rss()
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM back to the resident set
        r = eds.einsum("ij,ij->ij", x, y)
        calls.append({"rise": peak() - base})
        assert np.array_equal(r, x * y)
        del r
        calls[-1]["held"] = rss() - start
    print(json.dumps(calls))
    """
)


@glibc
def test_tiles_above_256_mib_leave_nothing_resident_and_peak_at_three_copies():
    # The one-call step's floor is three copies (two input tiles handed to the UDF and its
    # result). Kept in the heap, the freed input copies were a fourth while DuckDB took the
    # result back (4.0x at 6000² float64), and the second call's reuse left 2-3 tiles resident
    # for good, past the cap, because its free count had not moved since the last trim
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", BIG_TILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    calls = json.loads(out.stdout.strip().splitlines()[-1])
    tile = 6000 * 6000 * 8
    for c in calls:
        assert c["rise"] <= 3.1 * tile, calls
        assert c["held"] <= allocator.FREE_CAP_BYTES, calls


IDLE_TRIM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time, numpy as np, eindecomp_sql as eds
    from eindecomp_sql.backends import allocator, duckdb_allocator

    def idle_then_free_heap():
        # 96 MiB lie free inside the heap (below the 256 MiB mmap threshold, under another such
        # block that keeps them off the heap's top, which malloc_trim trims only beyond its
        # pad); then DuckDB's workers run a task and sit idle past their 0.5 s flush
        big = np.ones(96 << 20, dtype=np.uint8)
        above = np.ones(96 << 20, dtype=np.uint8)
        del big
        db.connection.sql("SELECT sum(r * 2) FROM numbers").fetchall()  # a parallel scan
        time.sleep(1.5)
        kept = allocator.resident_free_bytes()
        del above
        return kept

    db = eds.connect()
    db.connection.sql("SET threads = 2")  # a worker thread besides the caller's, whatever the machine
    db.connection.sql("CREATE TEMP TABLE numbers AS SELECT range AS r FROM range(20000000)")
    got = {"quieted": duckdb_allocator.trim_quieted(), "kept": idle_then_free_heap()}
    duckdb_allocator.restore()           # as DuckDB behaves on its own
    got["restored"] = not duckdb_allocator.trim_quieted()
    got["kept_restored"] = idle_then_free_heap()
    db.close()
    print(json.dumps(got))
    """
)


def _script(text: str) -> dict:
    """Run ``text`` in a fresh interpreter with the allocator tuning on; its last line as JSON."""
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", text], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _duckdb_imports_malloc_trim() -> bool:
    import duckdb  # noqa: F401 - its library, to read

    from eindecomp_sql.backends import duckdb_allocator as d

    return bool(d._duckdb_library() and d.got_slot_offsets(d._duckdb_library(), "malloc_trim"))


@glibc
def test_duckdbs_idle_threads_leave_the_heap_we_keep_alone():
    """A DuckDB worker idle for 0.5 s calls ``malloc_trim``, which hands back every free chunk
    inside the heap: the 64 MiB buffers kept for the next call came back fresh on 2-4 of 6
    calls (duckdb_allocator.py). While a session is open, that call does nothing; restored, the
    same idle workers trim the same freed memory (the check that the test sees the mechanism)."""
    if not _duckdb_imports_malloc_trim():
        pytest.skip("this DuckDB build calls no malloc_trim through a GOT slot we can find")
    got = _script(IDLE_TRIM_SCRIPT)
    if got["kept"] is None:
        pytest.skip("no mallinfo2 in this glibc (< 2.33): the free heap cannot be read")
    assert got["quieted"] and got["restored"], got
    assert got["kept"] >= 90 << 20, got
    assert got["kept_restored"] < 16 << 20, got


DECAY_SCRIPT = textwrap.dedent(
    """
    import json, os, numpy as np, eindecomp_sql as eds
    import duckdb                        # its library, for d._ctl before a session opens
    from eindecomp_sql.backends import duckdb_allocator as d

    before = d._ctl("arena.0.dirty_decay_ms")
    default = d._ctl("arenas.dirty_decay_ms")
    db = eds.connect()
    during = d._ctl("arena.0.dirty_decay_ms")
    # a block above the oversize threshold makes jemalloc's arena for such blocks with DuckDB's
    # decay (purged at once); a plan's end takes it up, and the next such block freed is kept
    # under the cap, alone in its arena (the greedy bound keeps the largest holding)
    big = "SELECT sum(strlen(repeat('x', 300000000)))"
    db.connection.sql(big).fetchall()
    oversize = range(d._ctl("opt.narenas", ctype=d.ctypes.c_uint), d._ctl("arenas.narenas", ctype=d.ctypes.c_uint))
    made = [d._ctl(f"arena.{k}.dirty_decay_ms") for k in oversize]
    eds.einsum("ij,jk->ik", np.ones((4, 4)), np.ones((4, 4)))  # a plan ends
    huge = [d._ctl(f"arena.{k}.dirty_decay_ms") for k in oversize]
    db.connection.sql("CREATE TABLE small AS SELECT range AS k, repeat('y', 300) AS s FROM range(200000)")
    db.connection.sql("DROP TABLE small")
    db.connection.sql(big).fetchall()
    page = d._ctl("arenas.page", ctype=d.ctypes.c_size_t)
    def held():
        d.dirty_bytes()
        huge = sum(d._ctl(f"stats.arenas.{k}.pdirty", ctype=d.ctypes.c_size_t) * page for k in oversize)
        return huge, d.dirty_bytes() - huge
    huge_freed, others = held()
    d.bound_dirty(huge_freed + (1 << 20))  # over the cap: the largest holding stays, the rest goes
    huge_kept, others_kept = held()
    # DuckDB's own memory, freed: kept while the session is open, below the cap
    db.connection.sql("CREATE TABLE t AS SELECT range AS k, repeat('x', 200) AS s FROM range(400000)")
    db.connection.sql("DROP TABLE t")
    kept = d.dirty_bytes()
    d.bound_dirty(1 << 20)               # above a 1 MiB cap: handed back
    bounded = d.dirty_bytes()
    with eds.connect(memory="256MB"):    # a budget: DuckDB decays by time again
        under_budget = d._ctl("arena.0.dirty_decay_ms")
    db.close()
    print(json.dumps({"before": before, "default": default, "default_during": d._ctl("arenas.dirty_decay_ms"),
                      "during": during, "made": made, "huge": huge, "huge_freed": huge_freed, "huge_kept": huge_kept,
                      "others": others, "others_kept": others_kept,
                      "kept": kept, "bounded": bounded, "under_budget": under_budget,
                      "after": d._ctl("arena.0.dirty_decay_ms"),
                      "huge_after": [d._ctl(f"arena.{k}.dirty_decay_ms") for k in oversize]}))
    """
)


@glibc
def test_duckdbs_jemalloc_keeps_freed_pages_while_a_session_is_open_and_under_the_cap():
    got = _script(DECAY_SCRIPT)
    if got["before"] is None:
        pytest.skip("this DuckDB has no jemalloc of its own")
    assert got["before"] == got["after"] == got["under_budget"] > 0, got
    assert got["during"] == -1, got
    assert got["default"] == got["default_during"], got  # new arenas get DuckDB's decay
    assert got["made"] and all(ms != -1 for ms in got["made"]), got  # DuckDB's, until a plan ends
    assert all(ms == -1 for ms in got["huge"]), got
    # the 300 MB string, freed, stays in the oversize arena; the other arenas' pages are purged
    assert got["huge_freed"] >= 286 << 20 and got["others"] >= 16 << 20, got
    assert got["huge_kept"] == got["huge_freed"] and got["others_kept"] <= 1 << 20, got
    assert got["huge_after"] == got["made"], got  # and put back at the last close
    assert got["kept"] >= 32 << 20 and got["bounded"] < 1 << 20, got


SHARED_ARENA_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, numpy as np, eindecomp_sql as eds
    import duckdb                        # its library, for d._ctl
    from eindecomp_sql.backends import duckdb_allocator as d

    if d._mallctl() is None:
        print(json.dumps(None))
        raise SystemExit
    per_core = d._ctl("opt.narenas", ctype=ctypes.c_uint)
    thresholds = lambda: [d._ctl(f"arena.{k}.oversize_threshold", ctype=ctypes.c_size_t) for k in range(per_core)]
    page = d._ctl("arenas.page", ctype=ctypes.c_size_t)
    db = eds.connect()
    db.connection.execute("SET threads = 4")  # the kernel runs on whichever thread takes it
    x = np.random.default_rng(0).standard_normal((8, 512, 512), dtype=np.float32)  # 8 MiB tiles
    X = db.store("X", x)
    # a first plan: an arena a thread draws after connect() is taken up at a plan's end, so a
    # block freed before then may sit in it; what the arenas hold then goes back
    db.einsum("bij,bjk->bik", X, X, out="Z", replace=True)
    d.purge()
    def big_blocks():                     # blocks the oversize arena has handed out so far
        d.dirty_bytes()                   # (refreshes jemalloc's statistics)
        return sum(d._ctl(f"stats.arenas.{k}.large.nmalloc", ctype=ctypes.c_uint64) or 0
                   for k in d._arenas()[per_core:])
    before = big_blocks()
    for _ in range(6):
        db.einsum("bij,bjk->bik", X, X, out="Z", replace=True)
    calls_big = big_blocks() - before
    d.dirty_bytes()
    held = [(d._ctl(f"stats.arenas.{k}.pdirty", ctype=ctypes.c_size_t) or 0) * page for k in d._arenas()]
    assert np.allclose(db.tensor("Z").to_numpy(), x @ x, rtol=1e-4, atol=1e-3)
    during = thresholds()                 # every per-core arena jemalloc made by a plan's end
    db.close()
    after = thresholds()
    with eds.connect(memory="1GB"):      # a budget: nothing kept, big blocks where DuckDB puts them
        under_budget = thresholds()
    print(json.dumps({"during": during, "after": after, "under_budget": under_budget,
                      "oversize_held": sum(held[per_core:]), "per_core_held": held[:per_core],
                      "calls_big": calls_big}))
    """
)


@glibc
def test_big_blocks_from_every_thread_share_one_arena_while_freed_pages_are_kept():
    """jemalloc reuses a freed page only in the arena that freed it, one per core, and a thread
    keeps the arena it drew. The result tile DuckDB copies out of a UDF is allocated by whichever
    of its threads ran the UDF, so on 16 cores the 64 MiB freed by the last call sat in another
    arena and every call faulted a fresh one (16,400 faults a call, measured on the lent 16-core
    machine). While freed pages are kept, every per-core arena sends blocks of 4 MiB and more to
    the one oversize arena: every call's result tile is allocated there and the freed ones are
    kept there; the per-core arenas' thresholds go back at the last close, and are never
    lowered under a budget."""
    got = _script(SHARED_ARENA_SCRIPT)
    if got is None:
        pytest.skip("this DuckDB has no jemalloc of its own")
    from eindecomp_sql.backends import duckdb_allocator as d

    made = [t for t in got["during"] if t is not None]  # per-core arenas no thread drew yet: none
    assert made and all(t == d.SHARED_BLOCK_BYTES for t in made), got
    assert got["after"] == got["under_budget"] and d.SHARED_BLOCK_BYTES not in got["after"], got
    # each call's 8 MiB result tile comes from the one arena every thread shares (as DuckDB
    # left them, it came from the thread's own: blocks under 256 MiB never went there), and a
    # freed one is kept there for the next call
    assert got["calls_big"] >= 6, got
    assert got["oversize_held"] >= 8 << 20, got


FORK_SCRIPT = textwrap.dedent(
    """
    import json, os, eindecomp_sql as eds
    from eindecomp_sql.backends import allocator, duckdb_allocator as d
    db = eds.connect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child has no session: DuckDB's allocators are DuckDB's again there
        os.write(w, json.dumps({"users": allocator._state["users"], "quieted": d.trim_quieted(),
                                "decay": d._ctl("arena.0.dirty_decay_ms")}).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = json.loads(os.read(r, 4096))
    print(json.dumps({"child": child, "parent_quieted": d.trim_quieted(), "users": allocator._state["users"]}))
    """
)


@glibc
def test_a_forked_child_starts_with_duckdbs_allocators_as_duckdb_left_them():
    if not _duckdb_imports_malloc_trim():
        pytest.skip("this DuckDB build calls no malloc_trim through a GOT slot we can find")
    got = _script(FORK_SCRIPT)
    assert got["parent_quieted"] and got["users"] >= 1, got
    assert got["child"]["users"] == 0 and not got["child"]["quieted"], got
    assert got["child"]["decay"] in (None, 1000) or got["child"]["decay"] > 0, got


def test_the_got_slot_is_found_only_for_what_the_library_imports(tmp_path):
    from eindecomp_sql.backends import duckdb_allocator as d

    path = d._duckdb_library()
    if allocator._libc() is not None and path is not None:
        with open(path, "rb") as f:
            elf = f.read(4) == b"\x7fELF"
        if elf:
            assert d.got_slot_offsets(path, "malloc_trim")
    if path is not None:
        assert d.got_slot_offsets(path, "no_such_function_anywhere") == ()
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + bytes(60))
    assert d.got_slot_offsets(str(junk), "malloc_trim") == ()
    (tmp_path / "empty.so").write_bytes(b"")
    assert d.got_slot_offsets(str(tmp_path / "empty.so"), "malloc_trim") == ()


BASELINE_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys, numpy as np, eindecomp_sql as eds
    import duckdb
    from eindecomp_sql.backends import duckdb_allocator as d

    if d._mallctl() is None:
        print(json.dumps(None))
        raise SystemExit
    per_core = d._ctl("opt.narenas", ctype=ctypes.c_uint)
    thresholds = lambda: [t for k in range(per_core)
                          if (t := d._ctl(f"arena.{k}.oversize_threshold", ctype=ctypes.c_size_t)) is not None]
    x = np.random.default_rng(0).standard_normal((8, 512, 512), dtype=np.float32)
    db = eds.connect()
    getattr(d, sys.argv[1])()            # unshare_big_blocks or leave_alone, then plans run
    for _ in range(2):
        eds.einsum("bij,bjk->bik", x, x)
        db.einsum("bij,bjk->bik", x, x).to_numpy()
    print(json.dumps({"thresholds": thresholds(), "quieted": d.trim_quieted(),
                      "decay": d._ctl("arena.0.dirty_decay_ms")}))
    """
)


def _baseline(mode: str) -> dict | None:
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", BASELINE_SCRIPT, mode], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_benchmark_baselines_stay_what_they_say_after_plans_run():
    """bench/trim_bench.py's baselines: ``leave_alone`` keeps DuckDB's allocators as DuckDB
    runs them (a plain ``restore()`` was undone by the next plan's end, which patched
    ``malloc_trim`` again), and ``unshare_big_blocks`` keeps each thread's big blocks in its own
    arena, arenas made later included, while freed pages are still kept."""
    from eindecomp_sql.backends import duckdb_allocator as d

    alone = _baseline("leave_alone")
    if alone is None:
        pytest.skip("this DuckDB has no jemalloc of its own")
    assert not alone["quieted"] and alone["decay"] != -1, alone
    assert alone["thresholds"] and d.SHARED_BLOCK_BYTES not in alone["thresholds"], alone
    unshared = _baseline("unshare_big_blocks")
    assert unshared["decay"] == -1, unshared
    assert unshared["thresholds"] and d.SHARED_BLOCK_BYTES not in unshared["thresholds"], unshared
