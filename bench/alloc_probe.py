"""Page faults per call of a stored GEMM, by tile size: where the SQL path's big tiles land in
fresh memory (docs/DESIGN.md "Outside the kernels, phase by phase, and tiles above 256 MiB").

Each size runs in a fresh process (the allocators' state is per process): the operands are
stored as one tile each, the GEMM runs once to warm up, then ``--calls`` times, each reporting
its time and its minor page faults; numpy's ``a @ b`` runs after, for the ratio. A 4 KiB fault
is one page of a buffer the process had handed back (or never had).

``--huge-decay MS`` sets the dirty-page decay of every arena of DuckDB's bundled jemalloc,
through the library's exported ``duckdb_je_mallctl``, after the warm-up call: that call creates
the dedicated arena for allocations above ``opt.oversize_threshold`` (256 MiB), which jemalloc
purges at once (decay 0; the others keep freed pages 1 s); -1 never purges. Since 2026-11-26
the session itself keeps every arena's pages (decay -1, under a cap: backends/duckdb_allocator.py),
the oversize one included; ``--oversize-decay 0`` puts only that arena back as DuckDB set it,
for a before/after of that change in one checkout (since the session also sends every block of
4 MiB and more there, that purges those at once too).

    .venv/bin/python bench/alloc_probe.py --sizes 5000,5700,5900,6000 --dtype float64
    .venv/bin/python bench/alloc_probe.py --sizes 6000 --dtype float64 --huge-decay -1
    .venv/bin/python bench/alloc_probe.py --sizes 6000 --dtype float64 --oversize-decay 0
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import statistics
import subprocess
import sys
import time


def _ctl(name: str, value: int | None = None, ctype=ctypes.c_ssize_t):
    """A jemalloc setting of DuckDB's bundled allocator, read (and with ``value``, set); None
    when it has none or the setting does not exist (yet): the product's own helper."""
    from eindecomp_sql.backends.duckdb_allocator import _ctl as ctl

    return ctl(name, value, ctype)


def child(n: int, dtype: str, calls: int, huge_decay: int | None, oversize_decay: int | None = None) -> dict:
    import numpy as np

    import eindecomp_sql as eds

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    db = eds.connect()
    db.store("a", a)
    db.store("b", b)
    db.einsum("ij,jk->ik", "a", "b", out="c", replace=True)  # warm-up: creates jemalloc's huge arena
    arenas = _ctl("arenas.narenas", ctype=ctypes.c_uint) or 0
    set_to = None
    if huge_decay is not None:  # every arena, the huge one (created by the warm-up) included
        set_to = [(k, _ctl(f"arena.{k}.dirty_decay_ms", huge_decay)) for k in range(arenas)]
    if oversize_decay is not None:  # the arenas past the per-core ones: blocks of 256 MiB and more
        regular = _ctl("opt.narenas", ctype=ctypes.c_uint) or 0
        set_to = [(k, _ctl(f"arena.{k}.dirty_decay_ms", oversize_decay)) for k in range(regular, arenas)]
    rows = []
    for _ in range(calls):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        db.einsum("ij,jk->ik", "a", "b", out="c", replace=True)
        rows.append((time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    t = time.perf_counter()
    a @ b
    numpy = time.perf_counter() - t
    seconds = statistics.median(r[0] for r in rows)
    return {"n": n, "dtype": dtype, "tile MiB": round(a.nbytes / 2**20, 1), "median s": round(seconds, 3),
            "numpy s": round(numpy, 3), "ratio": round(seconds / numpy, 2),
            "faults per call": [r[1] for r in rows], "oversize threshold MiB": (_ctl("opt.oversize_threshold", ctype=ctypes.c_size_t) or 0) >> 20,
            "huge decay set": set_to}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="5000,5700,5900,6000")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--processes", type=int, default=2, help="fresh processes per size")
    p.add_argument("--huge-decay", type=int, default=None)
    p.add_argument("--oversize-decay", type=int, default=None, help="the oversize arena's decay only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(int(args.sizes), args.dtype, args.calls, args.huge_decay, args.oversize_decay)))
        return
    for n in args.sizes.split(","):
        for _ in range(args.processes):
            cmd = [sys.executable, __file__, "--child", "--sizes", n, "--dtype", args.dtype, "--calls", str(args.calls)]
            if args.huge_decay is not None:
                cmd += ["--huge-decay", str(args.huge_decay)]
            if args.oversize_decay is not None:
                cmd += ["--oversize-decay", str(args.oversize_decay)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
