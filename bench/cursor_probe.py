"""Issue 9, Required 1: do statements on their own cursors take the SQL path's time outside the
kernels off one thread on a many-core machine? A probe to run wherever many cores are lent (the
GPU machine's 16), before the executor is changed for it (docs/DESIGN.md, "A parallel data
path").

For each workload and each part count P, the left operand is stored as P row panels (the right
one whole), and the product's own statement for the step (compiled by the session's compiler,
kernel UDF and all) runs
- ``one``: as one statement over all panels (what the product runs today),
- ``serial``: as P statements, one per panel (``WHERE t0.d0 = p``), one after another on one cursor,
- ``cursors``: the same P statements at once, each on a cursor of its own in a thread of its own,
  each writing its own table (appends and new tables from several connections do not conflict),
- ``fetch``: the kernel outside DuckDB's pipeline. P threads at once, each on its own cursor,
  fetch their panel's joined tiles as Arrow (``to_arrow_table``: DuckDB builds the Arrow arrays
  in its own threads with the GIL released, where a UDF's input is converted holding it), run
  the product with numpy in the thread, and write the result tile back from an Arrow table
  (``CREATE TABLE ... AS SELECT ... FROM`` the registered table),
side by side with numpy's ``@`` and the product's default (``db.einsum(..., out=)`` on the
operands stored whole). Each core count runs in a child process pinned with ``taskset``, BLAS and
DuckDB at that many threads; methods run in random order each round; medians (min-max), ratios
to numpy in the same child.

    .venv/bin/python bench/cursor_probe.py                        # --cores 1,2,all --parts 2,4,8
    .venv/bin/python bench/cursor_probe.py --cores all --only gemm_8192 --rounds 3

What to read: if ``cursors`` beats ``one`` at 16 cores by more than the copies P panels add
(``serial`` against ``one``), the product should run a step's batches on their own cursors and
``workers`` can mean them. If not, the input copy DuckDB makes holding the GIL is the floor
(docs/DESIGN.md), and the parallel data path needs another formulation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

# name: (spec, left shape, right shape, whether the right operand is cut too). The left operand is
# cut along its first axis; so is the right one where that label is shared (the batch of bij,bjk:
# no operand replicated), else it stays whole (a GEMM: every panel statement reads all of it)
WORKLOADS = {
    "gemm_4096": ("ij,jk->ik", (4096, 4096), (4096, 4096), False),
    "gemm_8192": ("ij,jk->ik", (8192, 8192), (8192, 8192), False),
    "bij_bjk": ("bij,bjk->bik", (16, 1024, 1024), (16, 1024, 1024), True),
    "gemm_512": ("ij,jk->ik", (512, 512), (512, 512), False),  # a seconds-long check of the harness
}


def panel_statements(db, spec: str, left: str, right: str, parts: int) -> tuple[str, list[str]]:
    """The product's SELECT for ``spec`` over stored tensors ``left`` (P row panels) and
    ``right``, whole and cut into one statement per panel of the left operand (one step, no
    re-tile: the operands are stored as the plan wants them). The plan is the data-parallel
    one for P workers (the leading output label in P pieces): at larger P the session's own
    plan would put the panels back together first, which is not the question asked here."""
    import sqlglot

    import eindecomp_sql as eds
    from eindecomp_sql.plan.graph_plan import plan_graph

    A, B = db.tensor(left), db.tensor(right)
    g = eds.Graph()
    g.einsum(spec, g.input("a", A.shape, A.dtype), g.input("b", B.shape, B.dtype), name="c")
    plan = plan_graph(g, workers=parts, strategy="data-parallel", fuse=False, inputs={"a": A, "b": B},
                      costs=db.backend.cost_model).plan
    assert len(plan.steps) == 1, plan.explain()
    compiled = db.backend.compiler.compile_plan(plan)[0]
    names = {"a": A.name, "b": B.name}
    whole = db.backend.compiler.bind_sql(compiled.batches[0], names)
    tree = sqlglot.parse_one(whole, dialect="duckdb")
    return whole, [tree.copy().where(f't0.d0 = {p}').sql(dialect="duckdb") for p in range(parts)]


def child(cores: int, names: list[str], parts_list: list[int], rounds: int) -> dict:
    import eindecomp_sql as eds

    rng = np.random.default_rng(0)
    db = eds.connect()
    con = db.backend.con
    con.execute(f"SET threads = {cores}")
    out = {"cores": cores, "workloads": {}}
    for name in names:
        spec, sa, sb, cut_right = WORKLOADS[name]
        a = rng.standard_normal(sa, dtype=np.float32)
        b = rng.standard_normal(sb, dtype=np.float32)
        want = np.matmul(a, b)
        db.store("a_whole", a, tile=sa, replace=True)
        db.store("b_whole", b, tile=sb, replace=True)
        methods = {"numpy": lambda: np.matmul(a, b),
                   "product": lambda: db.einsum(spec, "a_whole", "b_whole", out="c_prod", replace=True)}
        statements = {}
        for parts in parts_list:
            if sa[0] % parts:
                continue
            left, right = f"a_{parts}", "b_whole"
            db.store(left, a, tile=(sa[0] // parts,) + sa[1:], replace=True)
            if cut_right:
                right = f"b_{parts}"
                db.store(right, b, tile=(sb[0] // parts,) + sb[1:], replace=True)
            whole, panels = panel_statements(db, spec, left, right, parts)
            statements[parts] = (whole, panels)
            methods[f"one P={parts}"] = lambda w=whole: _create(con, "c_one", w)
            methods[f"serial P={parts}"] = lambda ps=panels: [_create(con, f"c_s{k}", s) for k, s in enumerate(ps)]
            methods[f"cursors P={parts}"] = lambda ps=panels: _concurrent(con, ps)
            joins = fetch_statements(left, right, parts, cut_right)
            shapes = ((sa[0] // parts,) + sa[1:], (sb[0] // parts,) + sb[1:] if cut_right else sb)
            methods[f"fetch P={parts}"] = lambda js=joins, sh=shapes: _fetch(con, js, sh)
            statements[parts] += (joins, shapes)
        # every formulation checked against numpy once, before timing
        for parts, (whole, panels, joins, shapes) in statements.items():
            _fetch(con, joins, shapes)
            _check([r for k in range(parts) for r in con.sql(f"SELECT * FROM {_quoted(f'c_f{k}')}").fetchall()],
                   want, parts, name)
            _create(con, "c_check", whole)
            _check(con.sql(f"SELECT * FROM {_quoted('c_check')}").fetchall(), want, parts, name)
            _concurrent(con, panels)
            _check([r for k in range(parts) for r in con.sql(f"SELECT * FROM {_quoted(f'c_p{k}')}").fetchall()],
                   want, parts, name)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for fn in methods.values():
            fn()  # warm-up
        for _ in range(rounds):
            order = list(methods)
            random.shuffle(order)
            for m in order:
                t = time.perf_counter()
                methods[m]()
                times[m].append(time.perf_counter() - t)
        base = statistics.median(times["numpy"])
        out["workloads"][name] = {m: {"median": statistics.median(ts), "min": min(ts), "max": max(ts),
                                      "ratio": statistics.median(ts) / base} for m, ts in times.items()}
        got = db.tensor("c_prod").to_numpy()
        assert np.allclose(got, want, rtol=1e-3, atol=1e-2 * float(np.abs(want).max())), name
    return out


def fetch_statements(left: str, right: str, parts: int, cut_right: bool) -> list[str]:
    """Per panel p, the join of its tiles without a kernel: the left panel's tile and the right
    operand's (its panel p where the batch label is cut, else its one tile)."""
    on = "t0.d0 = t1.d0" if cut_right else "TRUE"
    return [f"SELECT t0.tile AS a, t1.tile AS b FROM {_quoted(left)} AS t0 JOIN {_quoted(right)} AS t1 ON {on} "
            f"WHERE t0.d0 = {p}" for p in range(parts)]


def _fetch(con, joins: list[str], shapes) -> None:
    """``fetch``: each panel's tiles out as Arrow on a cursor of its own, numpy's product in the
    thread, its result tile back into a table of its own (``c_f<p>``: key, tile)."""
    import pyarrow as pa

    sa, sb = shapes

    def one(cur, p: int, select: str) -> None:
        t = cur.sql(select).to_arrow_table()
        a = np.frombuffer(t.column("a").chunk(0).buffers()[2], np.float32, int(np.prod(sa))).reshape(sa)
        b = np.frombuffer(t.column("b").chunk(0).buffers()[2], np.float32, int(np.prod(sb))).reshape(sb)
        assert t.num_rows == 1 and t.column("a").chunk(0).offset == 0
        c = np.matmul(a, b)
        offsets = pa.py_buffer(np.array([0, c.nbytes], np.int64))
        res = pa.table({"tile": pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(c)])})
        cur.register("_eds_fetched", res)
        _create(cur, f"c_f{p}", f"SELECT {p}::BIGINT AS d0, tile::BLOB AS tile FROM _eds_fetched")
        cur.unregister("_eds_fetched")

    _threads(con, joins, one)


def _check(rows, want: np.ndarray, parts: int, name: str) -> None:
    """The result tiles (one per row panel, raw C-order bytes) against numpy's panels."""
    assert len(rows) == parts, (name, parts, len(rows))
    for row in rows:
        key, tile = row[0], row[-1]
        panel = np.split(want, parts)[key]
        got = np.frombuffer(tile, want.dtype).reshape(panel.shape)
        assert np.allclose(got, panel, rtol=1e-3, atol=1e-2 * float(np.abs(want).max())), (name, parts, key)


def _create(con, table: str, select: str) -> None:
    con.execute(f"CREATE OR REPLACE TABLE {_quoted(table)} AS {select}")


def _quoted(table: str) -> str:
    import sqlglot.expressions as exp

    return exp.to_identifier(table, quoted=True).sql(dialect="duckdb")


def _concurrent(con, panels: list[str]) -> None:
    _threads(con, panels, lambda cur, k, select: _create(cur, f"c_p{k}", select))


def _threads(con, statements: list[str], work) -> None:
    """``work(cursor, k, statement)`` for every statement at once, each in a thread with a
    cursor of its own; the first error is raised after all have finished."""
    errors: list[BaseException] = []

    def run(k: int, select: str) -> None:
        try:
            cur = con.cursor()
            try:
                work(cur, k, select)
            finally:
                cur.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k, s)) for k, s in enumerate(statements)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_child(cores: int, names: list[str], parts: list[int], rounds: int) -> dict:
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:cores])
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(cores), OMP_NUM_THREADS=str(cores), MKL_NUM_THREADS=str(cores))
    cmd = ["taskset", "-c", cpus, sys.executable, __file__, "--child", str(cores), "--rounds", str(rounds),
           "--only", ",".join(names), "--parts", ",".join(map(str, parts))]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def markdown(runs: list[dict]) -> str:
    lines = ["| workload | method | " + " | ".join(f"{r['cores']} cores" for r in runs) + " |",
             "|---|---|" + "---|" * len(runs)]
    for name in runs[0]["workloads"]:
        for m in runs[0]["workloads"][name]:
            cells = []
            for r in runs:
                s = r["workloads"][name].get(m)
                cells.append("-" if s is None else
                             f"{s['median']:.3g} s ({s['min']:.3g}-{s['max']:.3g}), {s['ratio']:.2f}x")
            lines.append(f"| {name} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", default="1,2,all")
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--only", default="gemm_4096,gemm_8192,bij_bjk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = args.only.split(",")
    parts = [int(p) for p in args.parts.split(",")]
    if args.child:
        print(json.dumps(child(args.child, names, parts, args.rounds)))
        return
    from scaling import core_counts  # bench/scaling.py: "all", and counts above the machine's dropped

    counts, _ = core_counts(args.cores)
    runs = []
    for c in counts:
        print(f"{c} core(s) ...", file=sys.stderr, flush=True)
        runs.append(run_child(c, names, [p for p in parts if p <= max(c, 2) * 4], args.rounds))
    from run import machine  # bench/run.py: CPU, cores, versions, date

    print(f"machine: {json.dumps(machine())}\n")
    print(markdown(runs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
