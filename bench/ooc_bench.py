"""Out of core (issue 10): work whose inputs and output together are 4x the memory budget (or
the issue's GEMM, 16384² float32 against 1 GB), stored in a DuckDB file, against the same work
in memory (the same file, no budget), numpy on the arrays, dask.array (threaded scheduler) on
memory-mapped .npy files with the chunks the budget's session stores, and cubed (threads
executor, ``allowed_mem`` = the budget) on Zarr copies of the inputs with the same chunks.
Each run in a fresh process: time and peak resident set (VmHWM, the interpreter and libraries
included) against the bar, budget x 1.25 + 300 MB.

    .venv/bin/python bench/ooc_bench.py [--case gemm:4096 gemm:8192 gemm:16384@1GB batched ffn]
                                        [--skip cubed ...] [--timeout 1800] [--out bench/ooc_results.json]

Cases: ``gemm:N[@BUDGET]`` (ij,jk->ik, N² float32), ``batched`` (bij,bjk->bik, 16x1024³),
``ffn`` (relu(x @ w1) @ w2, x 16384x2048, hidden 8192: its 512 MB intermediate is re-tiled
between the products). The default budget is a quarter of inputs + output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).parent

# name -> (inputs: name -> shape, the output's shape); all float32
CASES = {
    "batched": ({"A": (16, 1024, 1024), "B": (16, 1024, 1024)}, (16, 1024, 1024)),
    "ffn": ({"x": (16384, 2048), "w1": (2048, 8192), "w2": (8192, 2048)}, (16384, 2048)),
}
SPECS = {"gemm": "ij,jk->ik", "batched": "bij,bjk->bik"}
METHODS = ("numpy", "in memory", "out of core", "dask", "cubed")

CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    def hwm():  # this process's own peak (ru_maxrss starts at the forking parent's size)
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    method, kind, budget, folder, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
    names = json.loads(sys.argv[6])
    spec = {"gemm": "ij,jk->ik", "batched": "bij,bjk->bik"}.get(kind)
    extra = {}
    t = time.perf_counter()
    if method == "numpy":
        xs = {n: np.load(f"{folder}/{n}.npy") for n in names}
        if kind == "ffn":
            y = np.maximum(xs["x"] @ xs["w1"], 0) @ xs["w2"]
        else:
            y = np.matmul(xs["A"], xs["B"])
        np.save(f"{folder}/numpy_out.npy", y)
    elif method == "dask":
        import dask, dask.array as da
        xs = {n: da.from_array(np.load(f"{folder}/{n}.npy", mmap_mode="r"), chunks=chunks[n]) for n in names}
        y = da.maximum(xs["x"] @ xs["w1"], 0) @ xs["w2"] if kind == "ffn" else da.matmul(xs["A"], xs["B"])
        with dask.config.set(scheduler="threads"):
            da.to_npy_stack(folder + "/dask_out", y, axis=0)
    elif method == "cubed":
        import cubed, cubed.array_api as xp
        spec_ = cubed.Spec(work_dir=folder + "/cubed_work", allowed_mem=budget, executor_name="threads")
        xs = {n: cubed.from_zarr(f"{folder}/{n}.zarr", spec=spec_) for n in names}
        y = xp.matmul(xp.maximum(xp.matmul(xs["x"], xs["w1"]), 0), xs["w2"]) if kind == "ffn" else xp.matmul(xs["A"], xs["B"])
        cubed.to_zarr(y, f"{folder}/cubed_out.zarr")
    else:
        import eindecomp_sql as eds
        limit = budget if method == "out of core" else None
        with eds.connect(folder + "/t.duckdb", memory=limit) as db:
            if kind == "ffn":
                sys.path.insert(0, sys.argv[7])
                from graphs import ffn
                g, _ = ffn(*db.tensor("x").shape, db.tensor("w1").shape[1], "float32")
                stored = {n: db.tensor(n) for n in names}
                p = g.plan(inputs=stored, memory=None if limit is None else db.memory)
                plan = p.plan
                run = lambda: p.run(db, out="C", replace=True, **stored)
            else:
                plan = db.plan(spec, *names)
                run = lambda: db.einsum(spec, *names, out="C", replace=True)
            extra = dict(statements=sum(s.batches for s in plan.steps), projected=plan.peak_bytes,
                         plan=[s.describe() for s in plan.steps])
            t = time.perf_counter()
            run()
    seconds = time.perf_counter() - t
    print(json.dumps(dict(seconds=seconds, peak=hwm(), **extra)))
""")


def child(method: str, kind: str, budget: int, folder: str, chunks: dict, names: list, timeout: float) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, method, kind, str(budget), folder, json.dumps(chunks),
                              json.dumps(names), str(HERE.parent / "tests")], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_case(text: str):
    """``gemm:4096@1GB`` -> ("gemm", inputs, output shape, budget or None)."""
    from eindecomp_sql.plan.cost import parse_memory

    name, _, budget = text.partition("@")
    kind, _, n = name.partition(":")
    if kind == "gemm":
        n = int(n)
        inputs, out = {"A": (n, n), "B": (n, n)}, (n, n)
    else:
        inputs, out = CASES[kind]
    return kind, inputs, out, parse_memory(budget) if budget else None


def bench(text: str, skip: set[str], timeout: float) -> dict:
    import numpy as np

    import eindecomp_sql as eds

    kind, inputs, out_shape, budget = parse_case(text)
    total = sum(4 * int(np.prod(s)) for s in [*inputs.values(), out_shape])
    budget = budget or total // 4
    folder = tempfile.mkdtemp(prefix="eds-ooc-", dir=os.environ.get("EDS_BENCH_DIR"))
    try:
        rng = np.random.default_rng(0)
        for name, shape in inputs.items():  # written a band at a time: never whole in memory
            with open(f"{folder}/{name}.npy", "wb") as f:
                np.lib.format.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
                scale = 1 / np.sqrt(shape[-2]) if kind == "ffn" else 1.0
                for lo in range(0, shape[0], 64):
                    band = (min(64, shape[0] - lo), *shape[1:])
                    f.write((rng.standard_normal(band, dtype=np.float32) * np.float32(scale)).tobytes())
        t = time.perf_counter()
        with eds.connect(f"{folder}/t.duckdb", memory=budget) as db:
            chunks = {name: list(db.store(name, f"{folder}/{name}.npy").tile) for name in inputs}
        store_s = time.perf_counter() - t
        if "cubed" not in skip:
            import zarr

            for name in inputs:  # Zarr copies with the same chunks, a band of chunks at a time
                src = np.load(f"{folder}/{name}.npy", mmap_mode="r")
                z = zarr.open_array(f"{folder}/{name}.zarr", mode="w", shape=src.shape, chunks=chunks[name],
                                    dtype=src.dtype)
                step = chunks[name][0]
                for lo in range(0, src.shape[0], step):
                    z[lo:lo + step] = src[lo:lo + step]
        rows = {}
        for method in METHODS:
            if method not in skip:
                rows[method] = child(method, kind, budget, folder, chunks, list(inputs), timeout)
        # right? the out-of-core result against numpy's, on a band of rows (when both ran)
        err = None
        if {"numpy", "out of core"}.isdisjoint(skip):
            with eds.connect(f"{folder}/t.duckdb", read_only=True) as db:
                got = db.tensor("C").to_numpy()[:64]
            want = np.load(f"{folder}/numpy_out.npy", mmap_mode="r")[:64]
            err = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
        return dict(case=text, kind=kind, inputs={k: list(v) for k, v in inputs.items()}, budget=budget,
                    tiles=chunks, store_seconds=store_s, max_rel_err=err, bar_bytes=budget * 1.25 + 300e6,
                    runs=rows)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", nargs="+", default=["gemm:4096", "gemm:8192", "batched", "ffn"])
    ap.add_argument("--skip", nargs="*", default=[], choices=METHODS)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take (default 1800)")
    ap.add_argument("--out", default=str(HERE / "ooc_results.json"))
    args = ap.parse_args()
    import duckdb
    import numpy as np

    results = dict(machine=f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), duckdb=duckdb.__version__,
                   numpy=np.__version__, cases=[])
    for text in args.case:
        r = bench(text, set(args.skip), args.timeout)
        results["cases"].append(r)
        err = "not checked" if r["max_rel_err"] is None else f"{r['max_rel_err']:.2g}"
        print(f"{text}: budget {r['budget'] / 1e6:.0f} MB (tiles {r['tiles']}), max rel err {err}")
        mem = r["runs"].get("in memory", {}).get("seconds")
        for method, row in r["runs"].items():
            if "error" in row:
                print(f"  {method:12s} failed: {row['error']}")
                continue
            ratio = f"{mem / row['seconds']:.2f}" if mem else "-"
            print(f"  {method:12s} {row['seconds']:8.2f} s  peak {row['peak'] / 1e6:7.0f} MB "
                  f"(bar {r['bar_bytes'] / 1e6:.0f} MB)  throughput vs in memory {ratio}"
                  + (f"  {row['statements']} statements, projected {row['projected'] / 1e6:.0f} MB" if "statements" in row else ""))
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
