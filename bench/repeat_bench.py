"""An operand repeating another (``ij,ij->i`` of X with itself): read once against joined with
itself. Each case runs in a fresh process (a stored 200,000 x 768 float32 matrix in 4096-row
tiles, 614 MB, the embeddings trial's), the tree under test given by ``--tree`` (a checkout of
the commit before, ``git worktree add /tmp/before <rev>``, against this one), interleaved in
rounds, pinned with ``--cores`` (``taskset``); numpy (``np.einsum`` on the array) in the same
children. Reports medians (min-max) of 3 calls per child and the resident rise of the first.

    python bench/repeat_bench.py --tree /tmp/before --rounds 3 --cores 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = ("ij,ij->i", "ij,ij->j", "ij,ij->")
ROWS, COLS, TILE_ROWS = 200_000, 768, 4096


def child(spec: str) -> dict:
    import numpy as np

    import eindecomp_sql as eds

    x = np.random.default_rng(0).standard_normal((ROWS, COLS), dtype=np.float32)
    db = eds.connect()
    X = db.store("X", x, tile=(TILE_ROWS, COLS))
    want = np.einsum(spec, x.astype(np.float64), x)
    times, rise = [], None
    for k in range(3):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the resident set
        r0 = _status("VmRSS")
        t = time.perf_counter()
        got = db.einsum(spec, X, X).to_numpy()
        times.append(time.perf_counter() - t)
        if rise is None:
            rise = _status("VmHWM") - r0
        assert np.allclose(got, want, rtol=1e-4, atol=1e-2), spec
    numpy = []
    for _ in range(3):
        t = time.perf_counter()
        np.einsum(spec, x, x)
        numpy.append(time.perf_counter() - t)
    db.close()
    return {"times": times, "rise_mb": rise / 1024, "numpy": numpy}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])  # kB
    raise KeyError(key)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True, help="the checkout to compare against (the commit before)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cores", default="1,2")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    trees = {"before": os.path.abspath(args.tree), "after": HERE}
    results: dict = {}
    for cores in [int(c) for c in args.cores.split(",")]:
        cpus = ",".join(str(c) for c in range(cores))
        env_base = {**os.environ, "OPENBLAS_NUM_THREADS": str(cores), "OMP_NUM_THREADS": str(cores)}
        for r in range(args.rounds):
            for spec in SPECS:
                order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
                for which in order:
                    env = {**env_base, "PYTHONPATH": trees[which]}
                    out = subprocess.run(["taskset", "-c", cpus, sys.executable, os.path.abspath(__file__),
                                          "--tree", args.tree, "--child", spec], env=env, capture_output=True,
                                         text=True, timeout=600, cwd=trees[which])
                    if out.returncode != 0:
                        raise SystemExit(f"{which} {spec} failed: {out.stderr[-2000:]}")
                    results.setdefault((cores, spec, which), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{ROWS} x {COLS} float32 in {TILE_ROWS}-row tiles; medians (min-max) over rounds of each child's "
          "median of 3 calls; rise: the first call's resident rise (MB)")
    print("| work | cores | before | after | speed-up | rise before / after | numpy |")
    print("|---|---|---|---|---|---|---|")
    for cores in [int(c) for c in args.cores.split(",")]:
        for spec in SPECS:
            cell = {}
            for which in ("before", "after"):
                runs = results[(cores, spec, which)]
                med = [statistics.median(x["times"]) for x in runs]
                cell[which] = (statistics.median(med), min(med), max(med),
                               statistics.median(x["rise_mb"] for x in runs))
            npy = statistics.median(statistics.median(x["numpy"]) for w in ("before", "after")
                                    for x in results[(cores, spec, w)])
            b, a = cell["before"], cell["after"]
            print(f"| `{spec}` | {cores} | {b[0]:.3f} s ({b[1]:.3f}-{b[2]:.3f}) | {a[0]:.3f} s ({a[1]:.3f}-{a[2]:.3f}) "
                  f"| {b[0] / a[0]:.1f}x | {b[3]:.0f} / {a[3]:.0f} | {npy:.4f} s |")


if __name__ == "__main__":
    main()
