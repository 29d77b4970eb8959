"""BLAS's thread count around kernel calls: one thread inside them, the process's own after.

Kernel threads run BLAS at one thread each (udfs/pool.py); the limit is set when the first call
enters and restored when the last one leaves, on whichever DuckDB threads those are. With
threadpoolctl >= 3.8 only the thread that first set OpenBLAS's count may set it again (others
silently do nothing): a restore on another thread then left the whole process's BLAS at one
thread (numpy's own products half as fast on 2 cores, afterwards, for good), and a limit set on
another thread left the kernel threads running BLAS on every core each. Subprocesses, because
the state is process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, threading
    import numpy as np
    from threadpoolctl import ThreadpoolController, threadpool_info
    import eindecomp_sql as eds

    def blas():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    original = blas()
    seen = []

    def mul(x, y):  # a callable join: runs inside the kernel's tasks (and once, tiny, to plan)
        if np.shape(x) == (2, 32):  # a tile, so a kernel call
            seen.append(tuple(blas()))
        return x * y

    a = np.random.default_rng(0).standard_normal((64, 32))
    out = {"original": original}

    # 1. another live thread set BLAS's count last (threadpoolctl gave it control)
    db = eds.connect()
    db.store("A", a, tile=(2, 32))
    hold, done = threading.Event(), threading.Event()

    def holder():
        ThreadpoolController().limit(limits=original[0], user_api="blas")
        hold.set()
        done.wait()

    t = threading.Thread(target=holder)
    t.start()
    hold.wait()
    got = db.einsum("ij,ij->ij", "A", "A", join=mul).to_numpy()
    done.set()
    t.join()
    out["right"] = bool(np.array_equal(got, a * a))
    out["inside_while_held"] = [list(x) for x in sorted(set(seen))]
    out["after_held"] = blas()

    # 2. several sessions' kernel calls in flight at once, entering and leaving on different threads
    seen.clear()
    errors = []

    def run(k):
        try:
            s = eds.connect()
            s.store("B", a, tile=(2, 32))
            for _ in range(8):
                s.einsum("ij,ij->ij", "B", "B", join=mul)
            s.close()
        except BaseException as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    out["errors"] = errors
    out["inside_concurrent"] = [list(x) for x in sorted(set(seen))]
    out["after_concurrent"] = blas()
    print(json.dumps(out))
    """
)


def test_blas_is_one_thread_inside_kernels_and_the_processs_own_after_them():
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    env.pop("EDS_RETAIN_MEMORY", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["right"] and not out["errors"], out
    one = [[1] * len(out["original"])]  # every BLAS library found, at one thread
    assert out["inside_while_held"] == one, out
    assert out["inside_concurrent"] == one, out
    assert out["after_held"] == out["original"], out
    assert out["after_concurrent"] == out["original"], out


SAME_BITS = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    import eindecomp_sql as eds
    from eindecomp_sql.udfs import pool

    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    first = eds.einsum("ij,jk->ik", a, b)  # alone: one tile, BLAS on every core
    busy = threading.Event()

    def other_kernels():  # another call's kernels in flight, as DuckDB's other threads make them
        while not busy.is_set():
            pool.run_tasks([lambda: time.sleep(0.002)] * 4)

    t = threading.Thread(target=other_kernels)
    t.start()
    try:
        differ = sum(not np.array_equal(eds.einsum("ij,jk->ik", a, b), first) for _ in range(40))
    finally:
        busy.set()
        t.join()
    print(differ)
    """
)


def test_a_products_bits_do_not_depend_on_other_kernel_calls_in_flight(tmp_path):
    """A product of few tiles runs whole with BLAS on every core; when another kernel call was
    in flight it was cut into row slices instead, and float32 slices round otherwise (1571 of
    2000 random 4x4 @ 4x1 differ in the last bit): the same einsum on the same inputs gave
    other bits from run to run, as DuckDB's scheduling fell (a fusion test saw it; a 64³
    float32 product here: 40 of 40 runs differed from the first). Now it
    waits for the cores."""
    script = tmp_path / "bits.py"
    script.write_text(SAME_BITS)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "0", r.stdout


def test_kernel_calls_nested_on_one_thread_do_not_wait_for_themselves():
    """A wide call waits until no other kernel call is in flight, and a call waits while a wide
    one runs: nested on one thread, each would wait for the other for ever."""
    import threading

    from eindecomp_sql.udfs import pool

    done = []

    def nested():
        pool.run_tasks([lambda: pool.run_wide(lambda: done.append("wide in tasks"))])
        pool.run_wide(lambda: pool.run_tasks([lambda: done.append("tasks in wide")] * 3))
        pool.run_tasks([lambda: pool.run_tasks([lambda: done.append("tasks in tasks")])] * 2)

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive() and done.count("tasks in wide") == 3 and done.count("tasks in tasks") == 2, done
    assert pool._active == 0 and not pool._wide and not pool._wanting
