"""Issue 11's GPU bars, side by side in one process: the SQL path with its kernels on the GPU
(``connect(device="cuda")``) against PyTorch on the same data.

- GEMM ``n``² float32, TF32 on for both: our ``db.einsum(..., out=)`` on stored tensors (the
  result written to a DuckDB table) against torch taking numpy host arrays in and its result
  back to numpy. Bar: our throughput >= 70% of torch's, with the device's tile cache emptied
  before each run (the operands come from DuckDB); shown too with them left on the device.
- FFN forward (x ``b``×``d``, w1 ``d``×``f``, w2 ``f``×``d``, bfloat16, relu), the weights stored
  in DuckDB, run 5 times with the result written to a table, against torch eager with the
  weights already on the device and the result copied to host memory. Bar: runs 2-5 at >= 40%
  of torch's throughput.

Results are checked against torch's (both TF32 / bfloat16: a relative tolerance). Writes a JSON
file and prints a markdown table with the device named. Needs CuPy and a CUDA device; with
``--namespace simcupy --small`` it runs its own logic on the CPU stand-in (tests/simcupy.py)
and torch's CPU path, to check the script, not to time anything.

    python bench/gpu_bench.py [--out bench/gpu_bench.json]           # the issue's sizes
    python bench/gpu_bench.py --namespace simcupy --small              # a dry run, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # simcupy, for dry runs


def _sync(torch, cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _bf16_to_torch(torch, a: np.ndarray, dev: str):
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(dev)


def gemm(db, torch, n: int, reps: int, cuda: bool) -> dict:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    dev = "cuda" if cuda else "cpu"
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = True

    def with_torch():
        if torch is None:  # a dry run without torch: numpy stands in
            return a @ b
        c = (torch.from_numpy(a).to(dev) @ torch.from_numpy(b).to(dev)).cpu().numpy()
        _sync(torch, cuda)
        return c

    # stored as the session's plan reads them (the operands free): no retile in the timed runs,
    # whose results would be the run's own and sent again every time
    free = db.plan("ij,jk->ik", a, b)
    t = time.perf_counter()
    A = db.store("GA", a, tile=free.inputs[0].tile, replace=True)
    B = db.store("GB", b, tile=free.inputs[1].tile, replace=True)
    store_s = time.perf_counter() - t
    plan = db.plan("ij,jk->ik", A, B)
    assert not any(type(s).__name__ == "RetileStep" for s in plan.steps), plan.explain()
    cache = db.backend.kernels.device_cache
    times: dict[str, list[float]] = {"cold": [], "warm": [], "torch": []}
    want = with_torch()
    db.einsum("ij,jk->ik", A, B, out="GC", replace=True)  # warm-up (CuPy's cuBLAS handle, DuckDB)
    for r in range(reps):  # interleaved, the order rotating
        order = ["cold", "warm", "torch"]
        for who in order[r % 3:] + order[:r % 3]:
            if who == "cold":  # the operands come from DuckDB, as torch's come from host memory
                cache.clear()
            elif who == "warm":  # the operands' tiles on the device from the run before
                db.einsum("ij,jk->ik", A, B, out="GC", replace=True)
            t = time.perf_counter()
            if who == "torch":
                with_torch()
            else:
                db.einsum("ij,jk->ik", A, B, out="GC", replace=True)
            times[who].append(time.perf_counter() - t)
    got = db.tensor("GC").to_numpy()
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return {"n": n, "store_s": store_s, "plan": plan.explain().splitlines()[0], "ours_s": times["cold"],
            "warm_s": times["warm"], "torch_s": times["torch"], "max_rel_diff_vs_torch": err,
            "throughput_ratio": statistics.median(times["torch"]) / statistics.median(times["cold"]),
            "warm_throughput_ratio": statistics.median(times["torch"]) / statistics.median(times["warm"]),
            "handed_again": db.backend.kernels.device_handed_again}


def ffn_working_set(b: int, d: int, f: int) -> int:
    """Bytes of the FFN's values in bfloat16: x and y, w1 and w2, the hidden h."""
    return (2 * b * d + 2 * d * f + b * f) * 2


def ffn(db, torch, b: int, d: int, f: int, runs: int, cuda: bool, profile: str | None = None) -> dict:
    import eindecomp_sql as eds
    import ml_dtypes

    rng = np.random.default_rng(1)
    bf = ml_dtypes.bfloat16
    x = (rng.standard_normal((b, d), dtype=np.float32) / np.sqrt(d)).astype(bf)
    w1 = (rng.standard_normal((d, f), dtype=np.float32) / np.sqrt(d)).astype(bf)
    w2 = (rng.standard_normal((f, d), dtype=np.float32) / np.sqrt(f)).astype(bf)
    from eindecomp_sql.plan.graph_plan import plan_graph

    g = eds.Graph()
    X, W1, W2 = g.input("x", (b, d), "bfloat16"), g.input("w1", (d, f), "bfloat16"), g.input("w2", (f, d), "bfloat16")
    h = g.map("relu", g.einsum("bi,io->bo", X, W1))
    g.einsum("bo,oi->bi", h, W2, name="y")
    # the weights stored as this session's plan reads them (inputs free), so no run retiles them
    # (a retile's result is the run's own, sent to the device again every run)
    free = plan_graph(g, workers=db.workers, memory=db.plan_budget, tile_bytes=db.tile_bytes,
                      costs=db.backend.cost_model)
    t = time.perf_counter()
    W1s = db.store("W1", w1, tile=free.plan_input_tile("w1"), replace=True)
    W2s = db.store("W2", w2, tile=free.plan_input_tile("w2"), replace=True)
    store_s = time.perf_counter() - t
    plan = plan_graph(g, workers=db.workers, memory=db.plan_budget, tile_bytes=db.tile_bytes,
                      inputs={"w1": W1s, "w2": W2s}, costs=db.backend.cost_model)
    # the weights stored as the plan reads them; a capped budget may still retile a value the run
    # computes (counted in the result)
    retiles = plan.retiles
    ours, moved = [], []
    state = db.backend.kernels
    steps, prof = [], None
    if profile:  # where runs 2-5 spend their time: per plan step (step_probe) and per function
        import cProfile

        import step_probe

        prof = cProfile.Profile()
    for r in range(runs):
        before = (state.device_sent, state.device_returned)
        t = time.perf_counter()
        if prof is not None and r > 0:
            prof.enable()
            _, split = step_probe.profile(lambda: plan.run(db, x=x, w1="W1", w2="W2", out={"y": "FFN_Y"}, replace=True))
            prof.disable()
            steps.append(split)
        else:
            plan.run(db, x=x, w1="W1", w2="W2", out={"y": "FFN_Y"}, replace=True)
        ours.append(time.perf_counter() - t)
        moved.append((state.device_sent - before[0], state.device_returned - before[1]))
    if prof is not None:
        import io
        import pstats

        text = io.StringIO()
        text.write(plan.explain(sql=False) + "\n\n" + json.dumps(steps, indent=1) + "\n\n")
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        with open(profile, "w") as fh:
            fh.write(text.getvalue())
    dev = "cuda" if cuda else "cpu"
    theirs = []
    if torch is None:  # a dry run without torch: numpy in float32 stands in
        for r in range(runs):
            t = time.perf_counter()
            y = np.maximum(x.astype(np.float32) @ w1.astype(np.float32), 0).astype(bf).astype(np.float32) @ \
                w2.astype(np.float32)
            theirs.append(time.perf_counter() - t)
        want = y
    else:
        tw1, tw2 = _bf16_to_torch(torch, w1, dev), _bf16_to_torch(torch, w2, dev)
        for r in range(runs):
            t = time.perf_counter()
            y = (torch.relu(_bf16_to_torch(torch, x, dev) @ tw1) @ tw2).cpu()
            _sync(torch, cuda)
            theirs.append(time.perf_counter() - t)
        want = y.float().numpy()
    got = db.tensor("FFN_Y").to_numpy().astype(np.float32)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    later = statistics.median(ours[1:]) if len(ours) > 1 else ours[0]
    cache = db.backend.kernels.device_cache
    return {"b": b, "d": d, "f": f, "store_s": store_s, "plan": plan.explain(sql=False).splitlines()[0],
            "retiles": retiles, "ours_s": ours, "torch_s": theirs,
            "max_rel_diff_vs_torch": err, "throughput_ratio_runs_2_on": statistics.median(theirs[1:]) / later,
            "cache_budget": cache.budget, "cache_peak": cache.peak, "cache_hits": cache.hits,
            "bytes_sent_returned": moved, "working_set": ffn_working_set(b, d, f), "step_profiles": steps,
            "staged_peak": cache.staged_peak, "handed_again": state.device_handed_again}


def transfers(nbytes: int = 1 << 30, chunk: int = 64 << 20, reps: int = 3) -> dict:
    """Host <-> device rates for one float32 buffer of ``nbytes`` (best of ``reps``, GB/s), to
    decide issue 11's "transfers from pinned staging buffers" by measurement: pageable memory
    (what the kernels hand CuPy today: DuckDB's Arrow buffers are ordinary memory), already pinned
    memory, the host copy into pinned memory, and staging through two pinned buffers of ``chunk``
    bytes on a stream of its own, the DMA of one chunk overlapping the host copy of the next,
    that copy on 1 and on 4 threads (numpy's copy releases the GIL). The driver stages pageable
    transfers itself, so staging of ours pays only if it copies faster than the driver does."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp

    a = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    d = cp.empty(a.shape, a.dtype)
    back = np.empty_like(a)
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(a.nbytes), a.dtype, a.size)
    np.copyto(pinned, a)

    def rate(f) -> float:
        best = float("inf")
        for _ in range(reps):
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            f()
            cp.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t)
        return round(a.nbytes / best / 1e9, 2)

    n = chunk // 4
    bufs = [np.frombuffer(cp.cuda.alloc_pinned_memory(chunk), np.float32, n) for _ in range(2)]
    stream = cp.cuda.Stream(non_blocking=True)

    def staged(pool, threads: int) -> None:
        done = [None, None]  # the event after the last DMA out of each staging buffer
        for k, lo in enumerate(range(0, a.size, n)):
            hi, buf = min(lo + n, a.size), bufs[k % 2]
            if done[k % 2] is not None:
                done[k % 2].synchronize()  # the buffer's previous chunk has left it
            cuts = np.linspace(lo, hi, threads + 1).astype(np.int64)
            list(pool.map(lambda r: np.copyto(buf[r[0] - lo:r[1] - lo], a[r[0]:r[1]]), zip(cuts[:-1], cuts[1:])))
            d[lo:hi].set(buf[:hi - lo], stream=stream)
            done[k % 2] = stream.record()
        stream.synchronize()

    out = {"bytes": a.nbytes, "chunk": chunk,
           "h2d pageable GB/s": rate(lambda: d.set(a)),
           "h2d from pinned GB/s": rate(lambda: d.set(pinned)),
           "host copy into pinned GB/s": rate(lambda: np.copyto(pinned, a)),
           "d2h to pageable GB/s": rate(lambda: d.get(out=back)),
           "d2h to pinned GB/s": rate(lambda: d.get(out=pinned))}
    for threads in (1, 4):
        with ThreadPoolExecutor(threads) as pool:
            out[f"h2d staged, {threads} copy thread(s) GB/s"] = rate(lambda: staged(pool, threads))
    assert np.array_equal(d.get(), a), "the staged upload is wrong"
    return out


def markdown(out: dict) -> str:
    from eindecomp_sql.plan.steps import format_bytes

    lines = [f"Device: {out['device']}; host {out['host']}; {out['versions']}", "",
             "| work | ours median s (min-max) | torch median s | our throughput / torch's | bar | max diff vs torch |",
             "|---|---|---|---|---|---|"]
    if "transfers" in out:
        x = out["transfers"]
        lines[0:0] = [f"Transfers of {x['bytes'] / 2**30:.0f} GiB (best of 3): " + ", ".join(
            f"{k[:-5]} {v} GB/s" for k, v in x.items() if k.endswith("GB/s")), ""]
    g = out.get("gemm")
    if g:
        lines.append(f"| GEMM {g['n']}² float32, TF32, stored -> table, operands sent | "
                     f"{statistics.median(g['ours_s']):.3f} ({min(g['ours_s']):.3f}-{max(g['ours_s']):.3f}) | "
                     f"{statistics.median(g['torch_s']):.3f} | {g['throughput_ratio']:.0%} | >= 70% | "
                     f"{g['max_rel_diff_vs_torch']:.1e} |")
        lines.append(f"| the same, operands on the device from the run before | {statistics.median(g['warm_s']):.3f} "
                     f"({min(g['warm_s']):.3f}-{max(g['warm_s']):.3f}) | {statistics.median(g['torch_s']):.3f} | "
                     f"{g['warm_throughput_ratio']:.0%} | - | |")
    for key, what, bar in (("ffn", "runs 2-5", ">= 40%"), ("ffn_half", "runs 2-5, cache at half the working set",
                                                              ">= 50% of the line above")):
        f = out.get(key)
        if f:
            o = f["ours_s"][1:] or f["ours_s"]
            lines.append(f"| FFN {f['b']}x{f['d']}x{f['f']} bfloat16, {what} | {statistics.median(o):.3f} "
                         f"({min(o):.3f}-{max(o):.3f}) | {statistics.median(f['torch_s'][1:] or f['torch_s']):.3f} | "
                         f"{f['throughput_ratio_runs_2_on']:.0%} | {bar} | {f['max_rel_diff_vs_torch']:.1e} |")
    for key in ("ffn", "ffn_half"):
        if key in out:  # what the kernels moved: to the device, and back to DuckDB
            lines.append(f"{key}: bytes sent / returned per run: " + ", ".join(
                f"{format_bytes(s)} / {format_bytes(r)}" for s, r in out[key]["bytes_sent_returned"]))
    if "ffn" in out and "ffn_half" in out:
        h = out["ffn_half"]
        ratio = statistics.median(out["ffn"]["ours_s"][1:]) / statistics.median(h["ours_s"][1:])
        lines += ["", f"Capped cache: {ratio:.0%} of the unlimited cache's throughput; budget "
                      f"{h['cache_budget'] / 1e9:.2f} GB, peak {h['cache_peak'] / 1e9:.2f} GB "
                      f"({'never above' if h['cache_peak'] <= h['cache_budget'] else 'ABOVE'} its budget)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--namespace", default="cupy", help="the cuda kernels' namespace (simcupy: a dry run)")
    ap.add_argument("--small", action="store_true", help="small sizes (a dry run of the script)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="transfers,gemm,ffn")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="with --only ffn_half: write where the capped FFN's runs "
                                                     "2-5 spend their time (plan steps, cProfile) to this file")
    ap.add_argument("--profile-ffn", default=None, help="the same for the FFN with an unlimited device budget")
    ap.add_argument("--tile-bytes", type=int, default=None,
                    help="the GEMM's session's tile cap (e.g. 134217728: tiles under the 256 MiB above which "
                         "each Arrow copy of a tile is mapped and faulted in afresh)")
    args = ap.parse_args()
    if args.profile or args.profile_ffn:
        import step_probe  # bench/, beside this script: before the first connect (see step_probe)

        step_probe.install()
    try:
        import torch
    except ImportError:
        if args.namespace == "cupy":
            raise
        torch = None  # a dry run here: numpy stands in for torch

    import eindecomp_sql as eds
    from eindecomp_sql.udfs import devices

    devices.KERNELS["cuda"] = (devices.KERNELS["cuda"][0], args.namespace)
    cuda = args.namespace == "cupy"
    db = eds.connect(device="cuda", allow_tf32=True)
    out = {"device": torch.cuda.get_device_name(0) if cuda else f"none ({args.namespace} dry run)",
           "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
           "versions": f"Python {platform.python_version()}, numpy {np.__version__}, torch {getattr(torch, '__version__', '-')}, "
                       f"cupy {getattr(devices.namespace('cuda'), '__version__', '-')}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    only = set(args.only.split(","))

    def done(key: str, value: dict) -> None:
        # written after each part: a time cap that cuts the run short keeps the parts before it
        out[key] = value
        print(f"{key}: {json.dumps(value)}", flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(out, fh, indent=1)

    if "transfers" in only and cuda:  # rates of a real device only: the stand-in has no DMA
        done("transfers", transfers())
    if "gemm" in only:
        if args.tile_bytes:
            db.close()
            db = eds.connect(device="cuda", allow_tf32=True, tile_bytes=args.tile_bytes)
        done("gemm", gemm(db, torch, 512 if args.small else 16384, args.reps, cuda))
        if args.tile_bytes:
            db.close()
            db = eds.connect(device="cuda", allow_tf32=True)
    if "ffn" in only:
        shape = (64, 128, 256) if args.small else (8192, 8192, 28672)
        done("ffn", ffn(db, torch, *shape, runs=5, cuda=cuda, profile=args.profile_ffn))
    if "ffn" in only or "ffn_half" in only:
        # the same with the device's tile cache at half the FFN's working set
        shape = (64, 128, 256) if args.small else (8192, 8192, 28672)
        db.close()
        db = eds.connect(device="cuda", allow_tf32=True, device_memory=ffn_working_set(*shape) // 2)
        done("ffn_half", ffn(db, torch, *shape, runs=5, cuda=cuda, profile=args.profile))
    db.close()
    print(markdown(out))


if __name__ == "__main__":
    main()
