"""Run every benchmark side by side and write bench/results.json and bench/RESULTS.md.

    make bench                       # everything (~10 minutes on 2 cores)
    python bench/run.py --rounds 3 --only gemm_1024

Timing: all methods of a workload run in one process, interleaved round by round (this machine
is shared and noisy: only ratios from one run mean anything); medians and min-max are reported.
Peak memory: each method once more in a fresh subprocess, as the peak resident set above what
the inputs (and stored tables) already held, read from /proc after resetting VmHWM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from workloads import SMALL, WORKLOADS, Methods, is_matmul, make_inputs, pure_sql_gemm  # noqa: E402

HERE = Path(__file__).parent


def methods_for(spec: str) -> list[str]:
    ms = ["numpy_einsum", "dask_einsum", "eds_stored", "eds_stored_to_numpy", "eds_numpy"]
    if spec.count(",") > 1:
        # dask's einsum runs one blockwise over every label of every operand (no contraction
        # path): on the 3-matrix chain that is O(n^4) per chunk and did not finish in minutes
        ms.remove("dask_einsum")
    if is_matmul(spec) or spec == "ij,jk,kl->il":
        ms = ["numpy_matmul", "dask_matmul"] + ms
    return ms


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def measure_memory(workload: str, method: str) -> None:
    """Subprocess entry: print the peak bytes one run of ``method`` adds."""
    spec, shapes, dtype = WORKLOADS[workload] if workload in WORKLOADS else SMALL[1:]
    m = Methods(workload, spec, make_inputs(shapes, dtype))
    if method.startswith("eds_stored"):
        m.setup_eds_stored()
    if method.startswith("eds"):
        import eindecomp_sql as eds

        eds.einsum("i->", np.ones(2))  # open the default session before the baseline
    if method.startswith("dask"):
        m._dask_arrays()
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    getattr(m, method)()
    print(json.dumps({"peak_bytes": max(_status("VmHWM") - base, 0)}))
    m.close()


def time_workload(name: str, spec: str, shapes, dtype, rounds: int) -> dict:
    arrays = make_inputs(shapes, dtype)
    m = Methods(name, spec, arrays)
    t = time.perf_counter()
    m.setup_eds_stored()
    load_s = time.perf_counter() - t
    names = methods_for(spec)
    want = m.numpy_einsum()
    for meth in names:  # warm up, and check every method against numpy
        got = getattr(m, meth)()
        if got is not None:
            assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max()), f"{meth} wrong on {name}"
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(rounds):
        order = names[:]
        random.shuffle(order)
        for meth in order:
            t = time.perf_counter()
            getattr(m, meth)()
            times[meth].append(time.perf_counter() - t)
    m.close()
    return {"spec": spec, "shapes": shapes, "dtype": dtype, "eds_store_s": load_s, "times": times}


def time_small(rounds: int = 60) -> dict:
    name, spec, shapes, dtype = SMALL
    m = Methods(name, spec, make_inputs(shapes, dtype))
    m.setup_eds_stored()
    names = ["numpy_einsum", "eds_numpy", "eds_stored", "eds_stored_to_numpy"]
    for meth in names:
        getattr(m, meth)()
    times = {k: [] for k in names}
    for _ in range(rounds):
        for meth in names:
            t = time.perf_counter()
            getattr(m, meth)()
            times[meth].append(time.perf_counter() - t)
    m.close()
    return {"spec": spec, "shapes": shapes, "dtype": dtype, "times": times}


def machine() -> dict:
    import dask
    import duckdb
    import opt_einsum
    import pyarrow
    import sqlglot
    from threadpoolctl import threadpool_info

    blas = [f"{i.get('internal_api')} {i.get('version')} ({i.get('num_threads')} threads)" for i in threadpool_info()
            if i.get("user_api") == "blas"]
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": ", ".join(blas),
        "duckdb": duckdb.__version__,
        "pyarrow": pyarrow.__version__,
        "sqlglot": sqlglot.__version__,
        "dask": dask.__version__,
        "opt_einsum": opt_einsum.__version__,
    }


def summarize(ts: list[float]) -> dict:
    return {"median": float(np.median(ts)), "min": float(min(ts)), "max": float(max(ts)), "n": len(ts)}


def write_markdown(results: dict, path: Path) -> None:
    mc = results["machine"]
    out = [
        "# Benchmark results",
        "",
        f"Run {mc['date']} on {mc['cpu']}, {mc['cores']} cores, {mc['memory_gib']} GiB; Python {mc['python']}, "
        f"numpy {mc['numpy']} ({mc['blas']}), DuckDB {mc['duckdb']}, pyarrow {mc['pyarrow']}, sqlglot {mc['sqlglot']}, "
        f"dask {mc['dask']}, opt_einsum {mc['opt_einsum']}.",
        "",
        "Reproduce: `make bench` (or `.venv/bin/python bench/run.py`). All methods of a workload ran in one process, "
        "interleaved in random order each round; times are medians with min-max over the rounds; the ratio is the "
        "median over numpy's best median (`@` where it applies, else `einsum(optimize=True)`) in the same run. "
        "Peak memory is the resident set one run adds above its inputs (fresh subprocess per method). "
        "`eds_stored`: `db.einsum(..., out=table)` on stored tensors, the result staying in DuckDB (the SQL path); "
        "`eds_stored_to_numpy`: the same plus reading the result back; `eds_numpy`: `eds.einsum` on numpy arrays, "
        "loading included. dask.array uses chunks of "
        f"{results['dask_chunk']} per dimension.",
        "",
    ]
    bars = results.get("bars", {})
    if bars:
        out += ["## Performance bars", "", "| bar | target | measured | met |", "|---|---|---|---|"]
        for b in bars:
            out.append(f"| {b['bar']} | {b['target']} | {b['measured']} | {'yes' if b['met'] else 'NO'} |")
        out.append("")
    out += ["## Workloads", "", "| workload | method | median s | min-max s | ratio to numpy | peak MB |",
            "|---|---|---|---|---|---|"]
    for name, w in results["workloads"].items():
        base = min(w["summary"][k]["median"] for k in ("numpy_matmul", "numpy_einsum") if k in w["summary"])
        for meth, s in w["summary"].items():
            peak = w.get("peak_bytes", {}).get(meth)
            peak_s = f"{peak / 2**20:.0f}" if peak is not None else "-"
            out.append(f"| {name} `{w['spec']}` | {meth} | {s['median']:.3f} | {s['min']:.3f}-{s['max']:.3f} | "
                       f"{s['median'] / base:.2f}x | {peak_s} |")
    sm = results.get("small")
    if sm:
        out += ["", f"## Small work: {sm['spec']} on 64x64 float32", "", "| method | median ms | min-max ms |",
                "|---|---|---|"]
        for meth, s in sm["summary"].items():
            out.append(f"| {meth} | {1000 * s['median']:.2f} | {1000 * s['min']:.2f}-{1000 * s['max']:.2f} |")
    if "pure_sql_gemm_1024_s" in results:
        out += ["", f"Pure SQL over (i, j, value) rows, GEMM 1024² float32: {results['pure_sql_gemm_1024_s']:.2f} s."]
    for extra in results.get("notes", []):
        out += ["", extra]
    out += graph_sections()
    out += kept_sections(path, out)
    path.write_text("\n".join(out) + "\n")


def kept_sections(path: Path, generated: list[str]) -> list[str]:
    """The ``## `` sections of the existing file that this script does not write (other
    scripts' sections: small work, files in and out, scaling), kept as they are, at the end."""
    if not path.exists():
        return []
    ours = {line for line in generated if line.startswith("## ")}
    kept, current = [], None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            current = None if line in ours else []
            if current is not None:
                kept.append(current)
        if current is not None:
            current.append(line)
    return [line for section in kept for line in [""] + section]


def _same_plan(name: str, grid_label: str, workers: int) -> str:
    """Whether EinDecomp's chunking is the grid's fastest one (planning is deterministic, so
    re-planning here gives the plans that ran)."""
    try:
        sys.path.insert(0, str(HERE.parent / "tests"))
        import graphs_run

        g, _ = graphs_run.WORKLOADS[name]()
        mine = g.plan(workers=workers).pieces
        grid = graphs_run.grid_choices(g, workers)[grid_label].pieces
        return "yes (the same plan: the gap is noise)" if mine == grid else "no"
    except Exception as e:  # noqa: BLE001 - a report line, not a failure
        return f"unknown ({e})"


def graph_sections() -> list[str]:
    """The EinDecomp optimizer's results (bench/graphs_run.py, bench/calibrate.py), if run."""
    out: list[str] = []
    gpath, cpath = HERE / "graphs_results.json", HERE / "calibration.json"
    if gpath.exists():
        g = json.loads(gpath.read_text())
        out += ["", "## Graphs: EinDecomp against fixed strategies (bench/graphs_run.py)", "",
                f"Every plan ran for real in DuckDB (median of 3), workers={g['workers']} unless noted; the grid "
                "forces every node to cut its leading output label p ways, its last q ways and its reduced "
                "labels r ways (one run each; plans with fewer join tasks than workers left out). Peak is the "
                "resident set one run added; projected is the plan's largest step peak.", ""]
        bar_rows = []
        for name, w in g["workloads"].items():
            best = w["grid"][w["grid_best"]]["time"]
            out += [f"### {name} ({w['nodes']} nodes)", "",
                    "| plan | projected cost MB | time s | vs grid best | peak MB | projected peak MB | retiles |",
                    "|---|---|---|---|---|---|---|"]
            for label, r in w["plans"].items():
                t = r.get("time_vs_grid", r["time"])  # EinDecomp: the rounds it shared with the grid's best
                out.append(f"| {label} | {r['cost'] / 1e6:.1f} | {t:.3f} | {t / best:.2f}x | "
                           f"{r['peak_bytes'] / 2**20:.0f} | {r['projected_peak'] / 2**20:.0f} | {r['retiles']} |")
            out.append(f"| grid best ({w['grid_best']}) | {w['grid'][w['grid_best']]['cost'] / 1e6:.1f} | "
                       f"{best:.3f} | 1.00x | - | - | - |")
            for peer, t in w["peers"].items():
                out.append(f"| {peer} (same graph, node by node) | - | {t:.3f} | {t / best:.2f}x | - | - | - |")
            out.append("")
            e = w["plans"]["eindecomp"]
            cheapest = all(e["cost"] <= r["cost"] + 1e-6 for k, r in w["plans"].items() if "workers=1" not in k)
            bar_rows.append((name, cheapest, e.get("time_vs_grid", e["time"]) / best,
                             _same_plan(name, w["grid_best"], g["workers"])))
        out += ["### Bars", "", "The time ratio compares medians over the same interleaved rounds: the EinDecomp plan and the "
                "three fastest grid plans of the first pass, run again side by side.", "",
                "| graph | EinDecomp cost <= every baseline | EinDecomp time / best grid plan (<= 1.15) | "
                "EinDecomp chose the grid's best plan |",
                "|---|---|---|---|"]
        for name, cheapest, ratio, same in bar_rows:
            out.append(f"| {name} | {'yes' if cheapest else 'NO'} | {ratio:.2f}x {'yes' if ratio <= 1.15 else 'NO'} | "
                       f"{same} |")
        pl = g.get("planning")
        if pl:
            out += ["", f"Planning a {pl['nodes']}-node graph (25 residual FFN layers, workers=4): {pl['seconds']:.2f} s."]
    if cpath.exists():
        c = json.loads(cpath.read_text())
        out += ["", "## Cost model calibration (bench/calibrate.py)", "",
                f"{c['n']}² float32 GEMM steps under forced chunkings (inputs stored pre-cut, so only bytes vary) and "
                f"re-tiles, fitted by least squares: fixed {c['t0_s']:.3f} s, join {c['s_per_join_byte'] * 1e9:.2f} ns/B, "
                f"grouped join {c['s_per_group_byte'] * 1e9:.2f} ns/B more, aggregation {c['s_per_agg_byte'] * 1e9:.2f} "
                f"ns/B, retile {c['s_per_retile_byte'] * 1e9:.2f} ns/B: weights relative to a join byte group "
                f"{c['group_weight']:.2f}, aggregation {c['agg_weight']:.2f}, retile {c['retile_weight']:.2f}. "
                "Fits move by about a third from run to run on this shared machine; eindecomp_sql/plan/cost.py "
                "uses weights rounded over the runs so far (group 0.7, aggregation 6.0, retile 3.0, and a fixed "
                "2.5 MB of join bytes per statement; aggregation was 1.5 until 2026-11-23). Rank "
                "correlation of plan cost with measured time over the einsum "
                f"steps: the shipped weights {c.get('rank_correlation_shipped_weights', float('nan')):.3f}, "
                f"this run's fit {c.get('rank_correlation_fitted', float('nan')):.3f}.", "",
                "| run | join MB | agg MB | retile MB | measured s | predicted s |", "|---|---|---|---|---|---|"]
        for r in c["rows"]:
            what = f"einsum pieces {r['pieces']}" if r["kind"] == "einsum" else f"retile {r['tiles'][0]} -> {r['tiles'][1]}"
            out.append(f"| {what} | {r['join'] / 1e6:.1f} | {r['agg'] / 1e6:.1f} | {r['retile'] / 1e6:.1f} | "
                       f"{r['time']:.3f} | {r['predicted']:.3f} |")
    return out


def bars(results: dict) -> list[dict]:
    w = results["workloads"]
    rows = []

    def ratio(work, meth):
        s = w[work]["summary"]
        base = min(s[k]["median"] for k in ("numpy_matmul", "numpy_einsum") if k in s)
        return s[meth]["median"] / base

    if "gemm_4096" in w:
        r = ratio("gemm_4096", "eds_stored")
        rows.append({"bar": "4096² GEMM, stored tensors, SQL path (full table, dask einsum in the same rounds)", "target": "<= 1.3x numpy", "measured": f"{r:.2f}x", "met": r <= 1.3})
        r = ratio("gemm_4096", "eds_numpy")
        rows.append({"bar": "4096² GEMM, eds.einsum on numpy, load included (full table)", "target": "<= 1.6x numpy", "measured": f"{r:.2f}x", "met": r <= 1.6})
    if "pure_sql_gemm_1024_s" in results and "gemm_1024" in w:
        r = results["pure_sql_gemm_1024_s"] / w["gemm_1024"]["summary"]["eds_stored"]["median"]
        rows.append({"bar": "1024² GEMM vs pure (index, value) SQL", "target": ">= 100x faster", "measured": f"{r:.0f}x", "met": r >= 100})
    gb = HERE / "gemm_bar.json"
    if gb.exists():  # the same bars in a process of their own (bench/gemm_bar.py)
        g = json.loads(gb.read_text())
        r = g["ratio_stored"]
        lo, hi = min(g["round_ratios_stored"]), max(g["round_ratios_stored"])
        rows.append({"bar": "4096² GEMM, stored tensors, SQL path (bench/gemm_bar.py, own process)",
                     "target": "<= 1.3x numpy", "measured": f"{r:.2f}x (rounds {lo:.2f}-{hi:.2f})", "met": r <= 1.3})
        r = g["ratio_numpy"]
        rows.append({"bar": "4096² GEMM, eds.einsum on numpy (bench/gemm_bar.py, own process)",
                     "target": "<= 1.6x numpy", "measured": f"{r:.2f}x", "met": r <= 1.6})
    if "small" in results:
        ms = 1000 * results["small"]["summary"]["eds_numpy"]["median"]
        rows.append({"bar": "64³ GEMM end to end (eds.einsum)", "target": "<= 30 ms", "measured": f"{ms:.1f} ms", "met": ms <= 30})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", help="workload names")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-pure-sql", action="store_true")
    ap.add_argument("--memory", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS)
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite RESULTS.md from results.json, graphs_results.json and calibration.json")
    args = ap.parse_args()
    if args.memory:
        measure_memory(*args.memory)
        return
    if args.markdown_only:
        results = json.loads((HERE / "results.json").read_text())
        results["bars"] = bars(results)
        write_markdown(results, HERE / "RESULTS.md")
        return
    results = {"machine": machine(), "dask_chunk": 1024, "workloads": {}}
    for name, (spec, shapes, dtype) in WORKLOADS.items():
        if args.only and name not in args.only:
            continue
        print(f"timing {name} ...", flush=True)
        w = time_workload(name, spec, shapes, dtype, args.rounds)
        w["summary"] = {k: summarize(v) for k, v in w["times"].items()}
        if not args.no_memory:
            w["peak_bytes"] = {}
            for meth in w["times"]:
                r = subprocess.run([sys.executable, __file__, "--memory", name, meth], capture_output=True, text=True)
                if r.returncode == 0:
                    w["peak_bytes"][meth] = json.loads(r.stdout.strip().splitlines()[-1])["peak_bytes"]
        results["workloads"][name] = w
        for meth, s in w["summary"].items():
            print(f"  {meth:22s} {s['median']:.3f} s", flush=True)
    if not args.only or "small" in args.only:
        sm = time_small()
        sm["summary"] = {k: summarize(v) for k, v in sm["times"].items()}
        results["small"] = sm
    if not args.no_pure_sql and (not args.only or "gemm_1024" in args.only):
        print("pure SQL GEMM 1024 ...", flush=True)
        a, b = make_inputs([(1024, 1024), (1024, 1024)], "float32")
        results["pure_sql_gemm_1024_s"] = pure_sql_gemm(a, b)
    results["bars"] = bars(results)
    (HERE / "results.json").write_text(json.dumps(results, indent=1))
    write_markdown(results, HERE / "RESULTS.md")
    print((HERE / "RESULTS.md").read_text())


if __name__ == "__main__":
    main()
