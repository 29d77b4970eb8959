"""Benchmarks across core counts: each core count runs in a child process of its own, pinned
to that many cores, with numpy, dask.array and eindecomp_sql side by side in it.

    .venv/bin/python bench/scaling.py                 # --cores 1,2,all; writes bench/scaling.{json,md}
    .venv/bin/python bench/scaling.py --big           # also the 6000³ float64 and 8192² float32 GEMMs
    .venv/bin/python bench/scaling.py --quick         # 256²-sized check of the harness (seconds)
    .venv/bin/python bench/scaling.py --into-results  # also put the tables in bench/RESULTS.md

On 2 cores the default run should take 4-5 minutes (estimated from the times in RESULTS.md, most
of it the 1-core child and dask's einsum on two_label_abcd_cdef); --big adds minutes per core count.

In the child for n cores: ``taskset`` to the first n cores this process may use; BLAS at n
threads (OPENBLAS/OMP/MKL_NUM_THREADS, so numpy uses the same cores); dask's threaded scheduler
with n workers; DuckDB at ``SET threads = n`` (DuckDB sizes its pool from the machine, not from
the affinity mask: pinned to 1 core of 2 it still starts 2 threads; an n-core machine would give
it n); the kernel threads size themselves from the affinity mask (udfs/pool.py). Methods run in
random order each round; times are medians with min-max, the ratio is to numpy in the same child.

The SQL path's plan steps are timed as they run (bench/step_probe.py): the share of each step's
wall time outside the tile kernels is what more cores do not shrink. From the 1- and 2-core
medians each method gets an Amdahl fit T(n) = S + P/n, projected to 16 cores: a projection, to
be replaced by a measurement whenever a 16-core machine is available.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from workloads import WORKLOADS, Methods, is_matmul, make_inputs  # noqa: E402

DEFAULT = ["gemm_2048", "gemm_4096", "batched_bij_bjk", "chain_3", "two_label_abcd_cdef"]
# the big GEMMs, whose bars are for eds.einsum in the default session (eds_numpy below);
# every method runs on them, and each takes seconds to minutes per call on few cores
BIG = {"gemm_6000_f64": ("ij,jk->ik", [(6000, 6000), (6000, 6000)], "float64"),
       "gemm_8192_f32": ("ij,jk->ik", [(8192, 8192), (8192, 8192)], "float32")}
# the same shapes of work, small enough to check the harness end to end in seconds
QUICK = {"gemm_256": ("ij,jk->ik", [(256, 256), (256, 256)], "float32"),
         "batched_4x128": ("bij,bjk->bik", [(4, 128, 128), (4, 128, 128)], "float32"),
         "chain_3_256": ("ij,jk,kl->il", [(256, 512), (512, 128), (128, 256)], "float32"),
         "two_label_16x8": ("abcd,cdef->abef", [(16, 16, 8, 8), (8, 8, 16, 16)], "float32")}
CASES = {**{k: WORKLOADS[k] for k in DEFAULT}, **BIG, **QUICK}
METHODS = ("numpy", "dask", "eds_stored", "eds_numpy")
PROJECT_TO = 16


# -- the child: one core count ---------------------------------------------------------------
def method_fns(m: Methods) -> dict:
    """numpy and dask by ``@`` where the work is matmuls (the chain too), einsum otherwise."""
    mm = is_matmul(m.spec) or m.spec == "ij,jk,kl->il"
    return {"numpy": m.numpy_matmul if mm else m.numpy_einsum,
            "dask": m.dask_matmul if mm else m.dask_einsum,
            "eds_stored": m.eds_stored,  # db.einsum(..., out=) on stored tensors: the SQL path
            "eds_numpy": m.eds_numpy}  # eds.einsum on numpy arrays (the default session)


def child(n: int, names: list[str], rounds: int) -> dict:
    import step_probe

    step_probe.install()  # before the first connect (see step_probe)
    import dask
    import duckdb
    from threadpoolctl import threadpool_info

    import eindecomp_sql.udfs.pool as pool
    from eindecomp_sql.api import default_session

    dask.config.set(scheduler="threads", num_workers=n)
    con = default_session().connection  # eds.einsum's session (eds_numpy)
    con.execute(f"SET threads = {n}")
    facts = {"affinity": sorted(os.sched_getaffinity(0)), "kernel_threads": pool.THREADS,
             "duckdb_threads": con.execute("SELECT current_setting('threads')").fetchall()[0][0],
             "blas_threads": [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"],
             "duckdb": duckdb.__version__, "loadavg_start": os.getloadavg()[0],
             # where eds's kernels run: "auto" sends big steps to a GPU where one is found (on the
             # GPU machine, CUDA_VISIBLE_DEVICES= keeps them on the cores being measured)
             "eds_device": default_session().device}
    out = {}
    for name in names:
        spec, shapes, dtype = CASES[name]
        print(f"  {n} core(s): {name}", file=sys.stderr, flush=True)
        m = Methods(name, spec, make_inputs(shapes, dtype))
        m.setup_eds_stored()
        m._db.connection.execute(f"SET threads = {n}")
        fns = method_fns(m)
        want = fns["numpy"]()
        tol = dict(rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))
        for k, f in fns.items():  # warm up, and check every method against numpy
            got = f() if k != "eds_stored" else (f(), m._db.tensor("result").to_numpy())[1]
            assert np.allclose(got, want, **tol), f"{k} is wrong on {name}"
        times = {k: [] for k in fns}
        profiles = []
        for _ in range(rounds):
            order = list(fns)
            random.shuffle(order)
            for k in order:
                if k == "eds_stored":  # timed step by step; the probe's cost is two clock reads a call
                    t, prof = step_probe.profile(fns[k])
                    profiles.append(prof)
                else:
                    t0 = time.perf_counter()
                    fns[k]()
                    t = time.perf_counter() - t0
                times[k].append(t)
        steps = [s.describe() for s in m._db.plan(spec, *m._names).steps]
        m.close()
        out[name] = {"spec": spec, "shapes": shapes, "dtype": dtype, "times": times, "profiles": profiles,
                     "step_names": steps}
    facts["loadavg_end"] = os.getloadavg()[0]  # a shared machine: other work shows here
    return {"facts": facts, "workloads": out}


# -- the parent: one child per core count, then the tables -------------------------------------
def core_counts(text: str) -> tuple[list[int], int]:
    """The core counts asked for ("all": every core this process may use), those above what is
    available dropped, duplicates ("2,all" on 2 cores) run once."""
    avail = len(os.sched_getaffinity(0))
    counts = []
    for tok in text.split(","):
        c = avail if tok.strip() == "all" else int(tok)
        if c > avail:
            print(f"skipping {c} cores: only {avail} available", file=sys.stderr)
        elif c not in counts:
            counts.append(c)
    return counts, avail


def run_child(n: int, names: list[str], rounds: int) -> dict:
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:n])
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(n), OMP_NUM_THREADS=str(n), MKL_NUM_THREADS=str(n))
    cmd = ["taskset", "-c", cpus, sys.executable, __file__, "--child", str(n), "--rounds", str(rounds),
           "--workloads", ",".join(names)]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarize(ts: list[float]) -> dict:
    return {"median": float(np.median(ts)), "min": float(min(ts)), "max": float(max(ts)), "n": len(ts)}


def amdahl(t1: float, t2: float) -> tuple[float, float, str]:
    """S, P of T(n) = S + P/n through T(1) and T(2), held to 0 <= S <= T(1), and a note when
    held (noise, or a busy core, can put T(2) above T(1) or below T(1)/2)."""
    s = 2 * t2 - t1
    note = "T(2) > T(1): no speed-up, S held to T(1)" if s > t1 else "T(2) < T(1)/2: S held to 0" if s < 0 else ""
    s = min(max(s, 0.0), t1)
    return s, t1 - s, note


def representative(profiles: list[dict]) -> dict:
    """The round whose wall time is the median one: its steps add up, medians per step need not."""
    return sorted(profiles, key=lambda p: p["wall"])[len(profiles) // 2]


def analyse(runs: dict[int, dict]) -> dict:
    """Per workload: every method's summary per core count, the ratio to numpy, the step
    profile of the SQL path, and the projection to PROJECT_TO cores."""
    counts = sorted(runs)
    res = {}
    for name in runs[counts[0]]["workloads"]:
        w = {"spec": runs[counts[0]]["workloads"][name]["spec"], "by_cores": {}, "projection": {}}
        for n in counts:
            r = runs[n]["workloads"][name]
            summ = {k: summarize(v) for k, v in r["times"].items()}
            for s in summ.values():
                s["vs_numpy"] = s["median"] / summ["numpy"]["median"]
            rep = representative(r["profiles"])
            w["by_cores"][n] = {"summary": summ, "profile": rep, "step_names": r["step_names"],
                                "faults": [p["faults"] for p in r["profiles"] if "faults" in p]}
        if 1 in runs and 2 in runs:
            med = {n: {k: s["median"] for k, s in w["by_cores"][n]["summary"].items()} for n in (1, 2)}
            for k in med[1]:
                s, p, note = amdahl(med[1][k], med[2][k])
                w["projection"][k] = {"S": s, "P": p, "T": s + p / PROJECT_TO, "note": note}
            ref = w["projection"]["numpy"]
            for k, p in w["projection"].items():
                p["vs_numpy"] = p["T"] / ref["T"]
                if ref["note"] and k != "numpy":
                    p["note"] = "; ".join(x for x in (p["note"], "numpy's fit held: the ratio means little") if x)
            # the same projection from the measured split of the SQL path: time outside kernels
            # (and between steps) taken as serial, kernel time as scaling with the cores
            top = counts[-1]
            prof = w["by_cores"][top]["profile"]
            serial = prof["between_steps"] + sum(s["outside"] for s in prof["steps"])
            kernel = sum(s["kernel"] for s in prof["steps"])
            t = serial + kernel * top / PROJECT_TO
            note = f"split measured on {top} core{'s' if top > 1 else ''}"
            if ref["note"]:
                note += "; numpy's fit held: the ratio means little"
            w["projection"]["eds_stored (measured split)"] = {"S": serial, "P": kernel * top, "T": t,
                                                              "vs_numpy": t / ref["T"], "note": note}
        res[name] = w
    return res


def machine_facts() -> dict:
    from run import machine  # bench/run.py: CPU, cores, versions, date

    facts = machine()
    facts["nproc"] = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    facts["nproc_all"] = os.cpu_count()
    return facts


def _t(seconds: float) -> str:
    return f"{seconds:.3g}"  # 3 significant digits: the quick sizes take well under a millisecond


def _cell(s: dict) -> str:
    return f"{_t(s['median'])} ({_t(s['min'])}-{_t(s['max'])}), {s['vs_numpy']:.2f}x"


def markdown(results: dict, command: str) -> str:
    mc, counts = results["machine"], [int(c) for c in results["cores"]]
    runs, analysis = results["runs"], results["analysis"]
    label = {c: f"{c} core{'s' if c > 1 else ''}" + (" (all)" if c == results["available"] else "") for c in counts}
    out = ["# Scaling across core counts (bench/scaling.py)", "",
           f"Run {mc['date']} on {mc['cpu']}: `nproc` {mc['nproc']} ({mc['nproc_all']} online), "
           f"{mc['memory_gib']} GiB; Python {mc['python']}, numpy {mc['numpy']} ({mc['blas']}), DuckDB {mc['duckdb']}, "
           f"pyarrow {mc['pyarrow']}, dask {mc['dask']}, rounds {results['rounds']}.", "",
           f"Reproduce: `{command}`. Each core count ran in a child process of its own: `taskset` to that many "
           "cores, BLAS threads (OPENBLAS/OMP/MKL_NUM_THREADS), dask's threaded scheduler (`num_workers`) and "
           "DuckDB's `threads` all set to the count; methods in random order each round. Cells: median s "
           "(min-max), ratio to numpy in the same child. numpy: `@` for matmuls and the chain, else "
           "`einsum(optimize=True)`; dask.array likewise, chunks of 1024 per dimension; `eds_stored`: "
           "`db.einsum(..., out=)` on stored tensors (the SQL path); `eds_numpy`: `eds.einsum` on numpy arrays "
           "(loading included).", "",
           "Per child: " + "; ".join(f"{label[c]}: cores {runs[str(c)]['facts']['affinity']}, kernel threads "
                                     f"{runs[str(c)]['facts']['kernel_threads']}, DuckDB threads "
                                     f"{runs[str(c)]['facts']['duckdb_threads']}, BLAS threads "
                                     f"{runs[str(c)]['facts']['blas_threads']}, eds kernels on "
                                     f"{runs[str(c)]['facts'].get('eds_device', 'cpu')}, load average "
                                     f"{runs[str(c)]['facts']['loadavg_start']:.2f} at the start, "
                                     f"{runs[str(c)]['facts']['loadavg_end']:.2f} at the end" for c in counts)
           + " (load averages include this run's own work).", "",
           "## Times", "", "| workload | method | " + " | ".join(label[c] for c in counts) + " |",
           "|---|---|" + "---|" * len(counts)]
    for name, w in analysis.items():
        for k in METHODS:
            out.append(f"| {name} `{w['spec']}` | {k} | "
                       + " | ".join(_cell(w["by_cores"][str(c)]["summary"][k]) for c in counts) + " |")
    if any(w["projection"] for w in analysis.values()):
        out += ["", f"## Projection to {PROJECT_TO} cores (a projection, not a measurement)", "",
                "Amdahl's T(n) = S + P/n through each method's 1- and 2-core medians (S held to 0..T(1)), "
                f"evaluated at n = {PROJECT_TO}; the ratio is to numpy's projection made the same way. "
                "`eds_stored (measured split)`: S is the SQL path's time outside kernels and between steps as "
                "measured (table below, largest core count run), the kernel time taken to scale with the cores. "
                "Two points on a shared 2-core machine pin S and P down loosely; run this file on a "
                f"{PROJECT_TO}-core machine to replace the projection.", "",
                "| workload | method | T(1) s | T(2) s | S s | P s | projected T(16) s | projected ratio to numpy | note |",
                "|---|---|---|---|---|---|---|---|---|"]
        for name, w in analysis.items():
            for k, p in w["projection"].items():
                t1, t2 = (w["by_cores"][str(c)]["summary"].get(k, {}).get("median") for c in (1, 2))
                t1s, t2s = (_t(t) if t is not None else "-" for t in (t1, t2))
                out.append(f"| {name} | {k} | {t1s} | {t2s} | {_t(p['S'])} | {_t(p['P'])} | {_t(p['T'])} | "
                           f"{p['vs_numpy']:.2f}x | {p['note']} |")
    out += ["", "## SQL path per plan step: wall time outside the kernels", "",
            "From the round of median wall time. `in kernels`: time when at least one kernel UDF call ran "
            "(its Python function, pool work included); `outside`: the rest of the step (DuckDB's join and "
            "aggregation, and converting each UDF's input chunk to Arrow, which DuckDB does holding the GIL, "
            "so one thread at a time); `calls`/`threads`: kernel calls and the distinct DuckDB threads that made "
            "them. `between steps`: planning, compiling, commit and catalog, on one thread.", "",
            "| workload | step | cores | wall s | in kernels s | outside s | outside share | calls | threads |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, w in analysis.items():
        for c in counts:
            b = w["by_cores"][str(c)]
            prof = b["profile"]
            for s in prof["steps"]:
                desc = b["step_names"][s["step"]] if s["step"] < len(b["step_names"]) else "?"
                out.append(f"| {name} | {s['step']}: {desc} | {c} | {_t(s['wall'])} | {_t(s['kernel'])} | "
                           f"{_t(s['outside'])} | {s['outside'] / max(s['wall'], 1e-12):.0%} | {s['calls']} | "
                           f"{s['threads']} |")
            out.append(f"| {name} | between steps | {c} | {_t(prof['between_steps'])} | 0 | "
                       f"{_t(prof['between_steps'])} | {prof['between_steps'] / prof['wall']:.0%} of the call | - | - |")
            faults = b.get("faults")
            if faults:  # buffers handed back by an allocator and faulted in again, 4 KiB a fault
                out.append(f"| {name} | page faults a call (median, max of {len(faults)}) | {c} | "
                           f"{sorted(faults)[len(faults) // 2]:,}, {max(faults):,} | - | - | - | - | - |")
    return "\n".join(out) + "\n"


def into_results(text: str, path: Path = HERE / "RESULTS.md") -> None:
    """Put ``text`` in RESULTS.md as its "Scaling across core counts" section (headings one level
    down), replacing the section an earlier run put there and leaving every other section be."""
    section = "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())
    old = path.read_text() if path.exists() else ""
    head = "## Scaling across core counts"
    start = old.find(head)
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + section + "\n")
        return
    end = old.find("\n## ", start + len(head))  # the next section at our level
    path.write_text(old[:start] + section + "\n" + (old[end:] if end >= 0 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", default="1,2,all", help="comma-separated core counts; 'all': every core")
    ap.add_argument("--rounds", type=int, help="timed rounds per method (default 5; 2 with --quick)")
    ap.add_argument("--only", help="comma-separated workload names (default: " + ", ".join(DEFAULT) + ")")
    ap.add_argument("--big", action="store_true", help="also " + ", ".join(BIG) + " (minutes per core count)")
    ap.add_argument("--quick", action="store_true", help="small sizes (" + ", ".join(QUICK) + ")")
    ap.add_argument("--out", help="path prefix of the .json and .md written (default bench/scaling, "
                                  "bench/scaling_quick with --quick)")
    ap.add_argument("--into-results", action="store_true",
                    help="also put the tables in bench/RESULTS.md (its scaling section; not with --quick)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workloads", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    if args.child:
        print(json.dumps(child(args.child, args.workloads.split(","), rounds)))
        return
    if args.quick and args.into_results:
        ap.error("--quick numbers check the harness: they do not go into RESULTS.md")
    names = list(QUICK) if args.quick else DEFAULT + (list(BIG) if args.big else [])
    if args.only:
        names = args.only.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown workloads {unknown}; known: {', '.join(CASES)}")
    counts, avail = core_counts(args.cores)
    runs = {}
    for n in counts:
        print(f"-- {n} core(s)", file=sys.stderr, flush=True)
        runs[n] = run_child(n, names, rounds)
    results = {"machine": machine_facts(), "cores": counts, "available": avail, "rounds": rounds,
               "runs": {str(n): r for n, r in runs.items()}, "analysis": analyse(runs)}
    results = json.loads(json.dumps(results))  # core counts as string keys throughout, as read back
    prefix = Path(args.out) if args.out else HERE / ("scaling_quick" if args.quick else "scaling")
    Path(f"{prefix}.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, "python " + " ".join(["bench/scaling.py"] + sys.argv[1:]))
    Path(f"{prefix}.md").write_text(text)
    if args.into_results:
        into_results(text)
    print(text)


if __name__ == "__main__":
    main()
