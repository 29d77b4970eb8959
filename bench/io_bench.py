"""Files in and out at size: db.store of a float32 .npy and of a tiled Parquet file, and
Tensor.export to .npy and Parquet, against numpy's np.save and pyarrow's Parquet writer of the
same array, side by side in one run. Each case runs in a fresh interpreter (a subprocess) that
reports its wall time and its peak RSS above its own baseline (VmHWM after imports and setup,
sampled from /proc/self/status); medians over --repeats runs go to bench/io_results.json.

    python bench/io_bench.py --size 1G --repeats 3      # what bench/io_results.json holds
    python bench/io_bench.py --size 64M                 # a quick run
    python bench/io_bench.py --size 4G --repeats 2 --cases baseline_np_save,baseline_pq_write,baseline_pq_write_plain,cli_import,cli_store_npy,cli_store_parquet,cli_export_npy,cli_export_parquet,store_npy,store_parquet,export_npy,export_parquet

A tensor above 16 MiB is stored as parts (eindecomp_sql/backends/parts.py), so the store
cases no longer take DuckDB ~4x the tensor (+4.2 GB for 1 GiB before parts); the library's
export cases still grow by the tensor, because DuckDB caches every block it reads up to its
memory_limit (the CLI's export caps it). The store cases close the connection too
(close_seconds: DuckDB checkpoints what is left of its WAL then), so the export cases read a
checkpointed file, as a later session would.

The cli_* cases run the command a user runs (`python -m eindecomp_sql store|export ...`) in a
process of its own and report its whole peak resident size (ru_maxrss of the finished child):
that is the bar's "peak RSS". cli_import is the floor under them (an interpreter that imports
the package, duckdb, pyarrow and numpy).

Inputs live under --dir (default /tmp/eds_io_bench) and are deleted at the end. The database
is a file there (an in-memory DuckDB holds the whole tensor in RAM by definition). The tensor
is square, cut in tiles of --tile (default 1024x1024, 4 MB of float32).

Cases:
  baseline_np_save      np.save of the array (already in memory)
  baseline_np_save_fsync  the same, then fsync (what an export with sync=True pays too)
  baseline_pq_write     pyarrow.parquet.write_table of the array as one float32 column
  baseline_pq_write_plain  the same without dictionary and statistics (as export writes tiles)
  stream_npy            what store hands DuckDB for the .npy: its tile batches, consumed
                        (Python's part of store_npy alone)
  store_npy             db.store("A", "a.npy", tile=...)   (returns after the commit)
  store_parquet         db.store("A", "a.parquet")         (a tiled file, as Tensor.export writes it)
  export_npy            T.export("out.npy")
  export_npy_sync       T.export("out.npy", sync=True)
  export_parquet        T.export("out.parquet")
  cli_import            python -c "import eindecomp_sql, duckdb, pyarrow, numpy"
  cli_store_npy         eindecomp-sql store DB A a.npy --tile ...
  cli_store_parquet     eindecomp-sql store DB A a.parquet
  cli_export_npy        eindecomp-sql export DB A out.npy
  cli_export_npy_sync   eindecomp-sql export DB A out.npy --sync
  cli_export_parquet    eindecomp-sql export DB A out.parquet
  scan_blobs            the floor under an export inside DuckDB: SELECT sum(octet_length(tile)) over
                        the database cli_store_npy wrote, under the CLI export's cache cap
  scan_arrow            the same tiles iterated as Arrow batches (what an export reads), same cap
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the stores run first in each round: the export and scan cases read the databases they leave
CASES = ["baseline_np_save", "baseline_np_save_fsync", "baseline_pq_write", "baseline_pq_write_plain", "stream_npy",
         "store_npy", "store_parquet", "export_npy", "export_npy_sync", "export_parquet", "cli_import", "cli_store_npy",
         "cli_store_parquet", "cli_export_npy", "cli_export_npy_sync", "cli_export_parquet", "scan_blobs", "scan_arrow"]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


# -- the child: one case, one process ------------------------------------------------------------
def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key}")


def hwm_mb() -> float:
    return _status_mb("VmHWM")


def baseline_mb() -> float:
    """The resident size now, with the peak reset to it (``5`` to clear_refs resets VmHWM), so
    that setup (opening the database, loading the baseline's array) is not the peak measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return hwm_mb()
    return _status_mb("VmRSS")


def child(case: str, d: pathlib.Path, tile: tuple[int, int]) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import duckdb
    import eindecomp_sql as eds
    from eindecomp_sql import io

    npy, parquet, dbfile = d / "a.npy", d / "a.parquet", d / "store.duckdb"
    out = d / ("out.npy" if "npy" in case or case.startswith("baseline_np") else "out.parquet")
    out.unlink(missing_ok=True)
    extra = {}
    if case.startswith("cli_"):
        return cli_child(case, d, tile, npy, parquet, out)
    if case.startswith("scan_"):
        from eindecomp_sql.jobs import files

        with eds.connect(str(d / "cli.duckdb"), read_only=True) as db:
            files.cap_cache(db, files.export_cache_limit(db.tensor("A").value))
            base = baseline_mb()
            t0 = time.perf_counter()
            if case == "scan_blobs":
                extra["bytes"] = db.connection.execute("SELECT sum(octet_length(tile)) FROM A").fetchall()[0][0]
            else:
                rows = max(1, io.STREAM_BATCH_BYTES // (tile[0] * tile[1] * 4))
                extra["tiles"] = sum(b.num_rows for b in db.connection.sql("SELECT * FROM A").to_arrow_reader(rows))
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "rss_growth_mb": hwm_mb() - base, "baseline_rss_mb": base, **extra}
    if case.startswith("baseline"):
        a = np.load(npy)  # in memory: the baselines write from RAM
        base = baseline_mb()
        t0 = time.perf_counter()
        if case.startswith("baseline_np_save"):
            with open(out, "wb") as f:
                np.save(f, a)
                if case.endswith("fsync"):
                    f.flush()
                    os.fsync(f.fileno())
        elif case == "baseline_pq_write":
            pq.write_table(pa.table({"value": a.reshape(-1)}), out)
        else:  # without the dictionary pyarrow tries (and drops) on random floats
            pq.write_table(pa.table({"value": a.reshape(-1)}), out, use_dictionary=False, write_statistics=False)
        seconds = time.perf_counter() - t0
    elif case == "stream_npy":
        base = baseline_mb()
        t0 = time.perf_counter()
        inc = io.read_source(str(npy), "bench", io.Wanted(tile=tile), stream=True)
        n = sum(b.num_rows for b in inc.tiles)
        seconds = time.perf_counter() - t0
        extra["tiles"] = n
    elif case.startswith("store"):
        # store_npy leaves its database for the export cases; store_parquet writes another
        dbfile = dbfile if case == "store_npy" else d / "store2.duckdb"
        for f in d.glob(dbfile.name + "*"):
            f.unlink()
        con = duckdb.connect(str(dbfile))
        db = eds.connect(con)
        base = baseline_mb()
        t0 = time.perf_counter()
        db.store("A", str(npy if case == "store_npy" else parquet), tile=tile)
        seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        db.close()  # the session only: the connection is ours, not the session's
        con.close()  # the last connection: DuckDB checkpoints its WAL into the file here
        extra["close_seconds"] = time.perf_counter() - t1
        extra["wal_left"] = any(d.glob(dbfile.name + ".wal"))
    else:
        con = duckdb.connect(str(dbfile))
        db = eds.connect(con)
        T = db.tensor("A")
        base = baseline_mb()
        t0 = time.perf_counter()
        T.export(out, sync=case.endswith("sync"))
        seconds = time.perf_counter() - t0
        db.close()
        con.close()
    peak = hwm_mb()
    out.unlink(missing_ok=True)
    return {"seconds": seconds, "rss_growth_mb": peak - base, "baseline_rss_mb": base, **extra}


def cli_child(case: str, d: pathlib.Path, tile, npy, parquet, out) -> dict:
    """The command as a user runs it (``python -m eindecomp_sql ...``) in a process of its own:
    its wall time and its whole peak resident size (``ru_maxrss`` of the finished child), which
    is what the bar's "peak RSS" means. ``cli_import``: an interpreter that imports the package,
    duckdb, pyarrow and numpy and exits (the floor under every command)."""
    import resource

    dbfile = d / ("cli.duckdb" if case != "cli_store_parquet" else "cli2.duckdb")
    py = [sys.executable]
    if case == "cli_import":
        cmd = py + ["-c", "import eindecomp_sql, eindecomp_sql.cli, duckdb, pyarrow, numpy"]
    elif case.startswith("cli_store"):
        for f in d.glob(dbfile.name + "*"):
            f.unlink()
        src = npy if case == "cli_store_npy" else parquet
        cmd = py + ["-m", "eindecomp_sql", "store", str(dbfile), "A", str(src)]
        if case == "cli_store_npy":
            cmd += ["--tile", f"{tile[0]}x{tile[1]}"]
    else:
        cmd = py + ["-m", "eindecomp_sql", "export", str(dbfile), "A", str(out)] + (["--sync"] * case.endswith("sync"))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    out.unlink(missing_ok=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "rss_peak_mb": peak, "rss_growth_mb": peak}


# -- the parent ---------------------------------------------------------------------------------
def make_inputs(d: pathlib.Path, n: int, tile) -> None:
    """a.npy (n x n float32, random) and a.parquet (its tiles, with the metadata, as
    Tensor.export writes them; made from the .npy stream, not through DuckDB)."""
    import numpy as np
    import pyarrow.parquet as pq

    from eindecomp_sql import io

    rng = np.random.default_rng(0)
    a = np.lib.format.open_memmap(d / "a.npy", mode="w+", dtype=np.float32, shape=(n, n))
    step = max(1, (64 << 20) // (4 * n))
    for i in range(0, n, step):
        a[i:i + step] = rng.standard_normal((min(step, n - i), n), dtype=np.float32)
    del a
    inc = io.read_source(str(d / "a.npy"), "bench", io.Wanted(tile=tile), stream=True)
    meta = io.tensor_metadata(inc.shape, inc.dtype, inc.tile, inc.keys, "tiles", "A")
    schema = inc.tiles.schema.with_metadata(meta)
    with pq.ParquetWriter(d / "a.parquet", schema, use_dictionary=list(inc.keys),
                          write_statistics=list(inc.keys)) as w:
        for b in inc.tiles:
            w.write_batch(b)


def run_case(case: str, d: pathlib.Path, tile, timeout: float) -> dict:
    os.sync()  # each case starts with no dirty pages of the one before (their write-back is not its cost)
    cmd = [sys.executable, __file__, "--child", case, "--dir", str(d), "--tile", f"{tile[0]}x{tile[1]}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout).strip().splitlines()[-1:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64M", help="bytes of float32 data (e.g. 64M, 1G, 4G)")
    ap.add_argument("--tile", default="1024x1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/eds_io_bench")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "io_results.json"))
    ap.add_argument("--keep", action="store_true", help="keep the input files")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tile = tuple(int(x) for x in args.tile.lower().split("x"))
    d = pathlib.Path(args.dir)
    if args.child:
        print(json.dumps(child(args.child, d, tile)))
        return
    size = parse_size(args.size)
    n = max(1, math.isqrt(size // 4))
    tile = (min(tile[0], n), min(tile[1], n))
    cases = [c for c in args.cases.split(",") if c]
    d.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        make_inputs(d, n, tile)
        print(f"inputs: {n}x{n} float32 ({n * n * 4 / 2**30:.2f} GiB), tile {tile}, "
              f"made in {time.perf_counter() - t0:.1f} s", flush=True)
        runs: dict[str, list[dict]] = {c: [] for c in cases}
        # each round runs every case once: the stores first (the exports and scans read what they
        # wrote), then the rest in a shuffled order. In a fixed order the second of two exports
        # ran faster whichever it was (4 GiB: synced 11.9 s after plain 13.7 s; swapped, plain
        # 9.7-10.3 s after synced 12.9-13.5 s)
        first = [c for c in cases if c.startswith(("store", "cli_store"))]
        rest = [c for c in cases if c not in first]
        for r in range(args.repeats):
            for c in first + random.Random(r).sample(rest, len(rest)):
                res = run_case(c, d, tile, timeout=3600)
                runs[c].append(res)
                print(f"  round {r + 1} {c:18s} " + (res["error"] if "error" in res else
                      f"{res['seconds']:7.2f} s  RSS " + (f"peak {res['rss_peak_mb']:6.0f} MB" if "rss_peak_mb" in res
                                                          else f"+{res['rss_growth_mb']:7.0f} MB")), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(d, ignore_errors=True)
    summary = {}
    for c, rs in runs.items():
        ok = [x for x in rs if "error" not in x]
        summary[c] = {"runs": len(rs), "failed": [x["error"] for x in rs if "error" in x]}
        if ok:
            summary[c].update(seconds_median=statistics.median(x["seconds"] for x in ok),
                              seconds_min=min(x["seconds"] for x in ok), seconds_max=max(x["seconds"] for x in ok),
                              rss_growth_mb_median=statistics.median(x["rss_growth_mb"] for x in ok),
                              rss_growth_mb_max=max(x["rss_growth_mb"] for x in ok))
            if "rss_peak_mb" in ok[0]:
                summary[c]["rss_peak_mb_max"] = max(x["rss_peak_mb"] for x in ok)
            if "close_seconds" in ok[0]:
                summary[c]["close_seconds_median"] = statistics.median(x["close_seconds"] for x in ok)

    def ratio(a, b):
        if "seconds_median" in summary.get(a, {}) and "seconds_median" in summary.get(b, {}):
            return summary[a]["seconds_median"] / summary[b]["seconds_median"]
        return None

    bars = {
        "store_npy / baseline_pq_write": ratio("store_npy", "baseline_pq_write"),
        "store_parquet / baseline_pq_write": ratio("store_parquet", "baseline_pq_write"),
        "export_npy / baseline_np_save": ratio("export_npy", "baseline_np_save"),
        "export_npy_sync / baseline_np_save_fsync": ratio("export_npy_sync", "baseline_np_save_fsync"),
        "export_parquet / baseline_pq_write": ratio("export_parquet", "baseline_pq_write"),
        "store_npy / baseline_pq_write_plain": ratio("store_npy", "baseline_pq_write_plain"),
        "store_parquet / baseline_pq_write_plain": ratio("store_parquet", "baseline_pq_write_plain"),
        "export_parquet / baseline_pq_write_plain": ratio("export_parquet", "baseline_pq_write_plain"),
        "cli_store_npy / baseline_pq_write": ratio("cli_store_npy", "baseline_pq_write"),
        "cli_store_parquet / baseline_pq_write": ratio("cli_store_parquet", "baseline_pq_write"),
        "cli_export_npy / baseline_np_save": ratio("cli_export_npy", "baseline_np_save"),
        "cli_export_npy_sync / baseline_np_save_fsync": ratio("cli_export_npy_sync", "baseline_np_save_fsync"),
        "cli_export_parquet / baseline_pq_write": ratio("cli_export_parquet", "baseline_pq_write"),
    }
    result = {"size_bytes": n * n * 4, "shape": [n, n], "dtype": "float32", "tile": list(tile),
              "repeats": args.repeats, "machine": {"cpus": os.cpu_count()},
              "bar": "time ratios <= 1.5; peak RSS of the store command <= 500 MB", "time_ratios": bars, "cases": summary}
    key = f"{n * n * 4 / 2**30:.3g}GiB" if n * n * 4 >= 2**30 else f"{n * n * 4 / 2**20:.3g}MiB"
    out = pathlib.Path(args.out)
    allres = json.loads(out.read_text()) if out.exists() else {}
    allres[key] = result
    out.write_text(json.dumps(allres, indent=1) + "\n")
    print(json.dumps({"time_ratios": bars, **{c: {k: v for k, v in s.items() if k != "failed" or v}
                                               for c, s in summary.items()}}, indent=1))


if __name__ == "__main__":
    main()
