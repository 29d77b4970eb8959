"""Reductions to a small output under a memory budget (plan/partials.py): each case in a fresh
process, interleaved rounds, against numpy on the same arrays in the same process.

- ``split``: the plan made now (partial results and a combine step where the optimizer takes
  them);
- ``unsplit``: the plan made with no split at all (``partials.can_split`` off), i.e. the plan
  before two-step reductions, or its refusal;

and for the cases that no plan fitted before, the time and the process's resident memory rise
(VmHWM) against the budget.

    .venv/bin/python bench/partials_bench.py [--rounds 5] [--out bench/partials_results.json]
    taskset -c 0 .venv/bin/python bench/partials_bench.py --rounds 5 --out bench/partials_results_1core.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

# name -> (spec, shape, stored tile, budget); float32, two operands where the spec has two
CASES = {
    "row sums of a wide matrix": ("ij->i", (16, 1 << 20), (16, 16384), "40MB"),
    "row dots, 4096²": ("ij,ij->i", (4096, 4096), (256, 256), "40MB"),
    "sum, 8192²": ("ij->", (8192, 8192), None, "100MB"),
    "dot, 8192²": ("ij,ij->", (8192, 8192), None, "100MB"),
}

CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import eindecomp_sql as eds
    from eindecomp_sql.plan import einsum as pe, partials

    def hwm():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

    spec, shape, tile, budget, path, rounds = json.loads(sys.argv[1])
    n_ops = spec.count(",") + 1
    can = partials.can_split
    out = {"split": [], "unsplit": [], "numpy": []}
    got = {}
    with eds.connect(path, memory=budget) as db:
        ops = [db.tensor(n) for n in "AB"[:n_ops]]
        base = hwm()  # the session open, nothing read yet: what our runs add (arrays load later)
        plans = {}
        for r in range(rounds):
            for mode in ("split", "unsplit"):
                partials.can_split = can if mode == "split" else (lambda *a: False)
                pe._plan.cache_clear()
                try:
                    plan = db.plan(spec, *ops)
                except eds.EinsumError as e:
                    plans[mode] = "refused: " + str(e)[:160]
                    continue
                plans[mode] = [s.describe() for s in plan.steps]
                t = time.perf_counter()
                got[mode] = db.einsum(spec, *ops).to_numpy()
                out[mode].append(time.perf_counter() - t)
        partials.can_split = can
        out["plans"] = plans
        out["rise"] = hwm() - base
    arrays = [np.load(f"{path}.{n}.npy") for n in "AB"[:n_ops]]
    want = np.einsum(spec, *[a.astype(np.float64) for a in arrays])
    scale = np.abs(np.einsum(spec, *[np.abs(a).astype(np.float64) for a in arrays])).max()
    for mode, g in got.items():
        assert np.abs(g - want).max() <= 1e-4 * scale, (mode, np.abs(g - want).max(), scale)
    for r in range(rounds):
        t = time.perf_counter()
        np.einsum(spec, *arrays)
        out["numpy"].append(time.perf_counter() - t)
    print(json.dumps(out))
""")


def _prepare(folder: str, name: str, spec: str, shape, tile, budget: str, python: str) -> str:
    path = os.path.join(folder, name.replace(" ", "_").replace(",", "").replace("²", "") + ".duckdb")
    code = textwrap.dedent("""
        import json, sys
        import numpy as np
        import eindecomp_sql as eds
        spec, shape, tile, budget, path = json.loads(sys.argv[1])
        rng = np.random.default_rng(0)
        with eds.connect(path, memory=budget) as db:
            for n in "AB"[:spec.count(",") + 1]:
                a = rng.standard_normal(shape, dtype=np.float32)
                np.save(f"{path}.{n}.npy", a)
                if tile is None:
                    db.store(n, f"{path}.{n}.npy")
                else:
                    db.store(n, a, tile=tuple(tile))
    """)
    subprocess.run([python, "-c", code, json.dumps([spec, shape, tile, budget, path])], check=True)
    return path


def _summary(ts: list[float]) -> dict:
    if not ts:
        return {}
    s = sorted(ts)
    return {"median": s[len(s) // 2], "min": s[0], "max": s[-1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case", nargs="*", default=list(CASES))
    ap.add_argument("--out", default=str(Path(__file__).parent / "partials_results.json"))
    args = ap.parse_args()
    import duckdb
    import numpy as np

    results = {"machine": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
               "python": platform.python_version(), "numpy": np.__version__, "duckdb": duckdb.__version__,
               "cases": {}}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.case:
            spec, shape, tile, budget = CASES[name]
            path = _prepare(folder, name, spec, shape, tile, budget, sys.executable)
            run = subprocess.run([sys.executable, "-c", CHILD, json.dumps([spec, shape, tile, budget, path, args.rounds])],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise SystemExit(f"{name}: {run.stderr[-2000:]}")
            got = json.loads(run.stdout.strip().splitlines()[-1])
            row = {"spec": spec, "shape": shape, "tile": tile, "budget": budget, "plans": got["plans"],
                   "rise_mb": got["rise"] / 1e6}
            for mode in ("split", "unsplit", "numpy"):
                row[mode] = _summary(got[mode])
            results["cases"][name] = row
            s, u, n = row["split"], row["unsplit"], row["numpy"]
            print(f"{name}: {spec} {shape} under {budget}: split {s['median']:.3f} s ({s['min']:.3f}-{s['max']:.3f})"
                  + (f", unsplit {u['median']:.3f} s ({u['min']:.3f}-{u['max']:.3f}), "
                     f"{u['median'] / s['median']:.2f}x" if u else f", unsplit {got['plans'].get('unsplit')}")
                  + f"; numpy {n['median']:.3f} s; rise {row['rise_mb']:.0f} MB", flush=True)
            for f in os.listdir(folder):
                os.remove(os.path.join(folder, f))
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
