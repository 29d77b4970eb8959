"""Kernels on a GPU (``connect(device="cuda")``): the DuckDB engine's UDFs send each call's tiles
to the device, run the same kernel classes with CuPy as their namespace, and copy the results
back (udfs/devices.py, udfs/register.py).

Without a GPU these run against ``simcupy`` (tests/simcupy.py), a numpy-backed stand-in as
strict as CuPy about host and device arrays, which also emulates TF32's rounding. On a machine
with a CUDA device and CuPy, ``EDS_TEST_DEVICE_NAMESPACE=cupy`` runs the same tests on the GPU
(bench/gpu_check.sh does).
"""

from __future__ import annotations

import contextlib
import os

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eindecomp_sql as eds
import simcupy
from eindecomp_sql.errors import EinsumError
from eindecomp_sql.udfs import devices, kernels
from helpers import assert_close, einsum_case, error_scale, random_array
from reference import reference

NAMESPACE = os.environ.get("EDS_TEST_DEVICE_NAMESPACE", "simcupy")
SIMULATED = NAMESPACE == "simcupy"


def _clear_kernel_caches():
    for f in (kernels.einsum_kernel, kernels.program_kernel, kernels.retile_kernel, kernels.read_spec):
        f.cache_clear()


@contextlib.contextmanager
def _cuda_on_namespace():
    """Within: "cuda" kernels compute with ``NAMESPACE`` (the stand-in, or CuPy on a GPU)."""
    saved = devices.KERNELS["cuda"]
    devices.KERNELS["cuda"] = (saved[0], NAMESPACE)
    _clear_kernel_caches()
    try:
        yield
    finally:
        devices.KERNELS["cuda"] = saved
        _clear_kernel_caches()


@pytest.fixture(scope="module")
def gpu():
    """A session whose kernels run on "cuda", its namespace ``NAMESPACE``."""
    with _cuda_on_namespace(), eds.connect(device="cuda") as db:
        yield db


@pytest.fixture
def on_cuda():
    """Sessions opened in the test with device="cuda" compute with ``NAMESPACE``."""
    with _cuda_on_namespace():
        yield


@pytest.fixture
def counted():
    simcupy.reset()
    yield simcupy
    simcupy.reset()


@given(einsum_case(max_operands=3, max_size=6), st.booleans())
@settings(max_examples=min(60, settings.default.max_examples))  # EDS_EXAMPLES lowers it (a fresh GPU)
def test_einsums_on_the_device_match_numpy(gpu, case, stored):
    """Random specs, shapes, tiles (grouped steps, programs, broadcasting, diagonals) and every
    dtype, through the device path, against numpy."""
    spec, shapes, dtypes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = reference(spec, *arrays)
    ops = [gpu.store(f"g{k}", a, tile=t, replace=True) if stored else a for k, (a, t) in enumerate(zip(arrays, tiles))]
    got = gpu.einsum(spec, *ops).to_numpy()
    assert_close(got, want, error_scale(spec, arrays))


def test_a_gemm_runs_on_the_device_and_its_result_comes_back(gpu, counted):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 200), np.float32), rng.standard_normal((200, 100), np.float32)
    A, B = gpu.store("A", a, tile=(128, 64), replace=True), gpu.store("B", b, tile=(64, 100), replace=True)
    got = gpu.einsum("ij,jk->ik", A, B).to_numpy()
    assert_close(got, a @ b, error_scale("ij,jk->ik", [a, b]))
    if SIMULATED:  # every operand tile went up once per product, every result tile came down
        assert counted.uploads[1] >= a.nbytes + b.nbytes
        assert counted.downloads[1] == got.nbytes


def test_explain_says_where_every_step_runs(gpu):
    rng = np.random.default_rng(2)
    a = gpu.store("E1", rng.standard_normal((64, 48)), tile=(16, 48), replace=True)
    b = gpu.store("E2", rng.standard_normal((48, 64)), tile=(48, 16), replace=True)
    text = gpu.explain("ij,jk->ik", a, b)
    assert "-- kernels on cuda" in text
    assert "(on cuda)" in text
    plan = gpu.plan("ij,jk->ik", a, b)
    for k, step in enumerate(plan.steps):
        where = "(on cuda)" if type(step).__name__ != "RetileStep" else "(on the host: a retile moves bytes"
        assert any(line.startswith(f"-- step {k} ") and where in line for line in text.splitlines()), (k, text)


def test_a_callable_join_runs_on_the_host_and_says_so(gpu, counted):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((20, 30)), rng.standard_normal((30, 10))

    def hyp(x, y):
        return np.hypot(x, y)  # numpy code on host arrays: it cannot take device arrays

    got = gpu.einsum("ij,jk->ik", a, b, join=hyp).to_numpy()
    np.testing.assert_allclose(got, np.hypot(a[:, :, None], b[None, :, :]).sum(axis=1), rtol=1e-12)
    assert "(on the host: its join callable(hyp) is a Python callable" in gpu.explain("ij,jk->ik", a, b, join=hyp)
    if SIMULATED:
        assert counted.uploads == [0, 0]


@pytest.mark.parametrize("join,agg", [("add", "max"), ("max", "min"), ("where(x > y, x, y - 1)", "sum"),
                                      ("mul", "prod")])
def test_extended_joins_and_aggregations_on_the_device(gpu, join, agg):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((33, 17)), rng.standard_normal((17, 9))
    A = gpu.store("X1", a, tile=(10, 5), replace=True)
    B = gpu.store("X2", b, tile=(5, 9), replace=True)
    got = gpu.einsum("ij,jk->ik", A, B, join=join, agg=agg).to_numpy()
    want = eds.connect(device="cpu").einsum("ij,jk->ik", a, b, join=join, agg=agg).to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["ffn", "attention", "llama_block"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fuse,workers", [(True, 1), (False, 4)])
def test_graphs_on_the_device(gpu, name, dtype, fuse, workers):
    """The GPU issue's graphs (maps, softmax, norms; programs, fused and unfused steps, cut for
    4 workers) against numpy in float64 on the same inputs; bfloat16 within a few of its units
    of the result's scale, as on the CPU (tests/test_dtypes.py)."""
    from graphs import attention, ffn, llama_block

    g, ref = {"ffn": ffn, "attention": attention, "llama_block": llama_block}[name](dtype=dtype)
    rng = np.random.default_rng(len(name))
    xs = {v.name: (rng.standard_normal(v.shape) / np.sqrt(v.shape[0])).astype(dtype) for v in g.inputs}
    got = g.plan(workers=workers, fuse=fuse).run(gpu, **xs).to_numpy()
    assert got.dtype == np.dtype(dtype)
    want = ref(**{k: x.astype(np.float64) for k, x in xs.items()})
    err = np.abs(got.astype(np.float64) - want)
    assert err.max() <= (0.02 if dtype == "bfloat16" else 1e-4) * np.abs(want).max(), (err.max(), np.abs(want).max())


@pytest.mark.parametrize("dtype,graph", [("float32", "ffn"), ("bfloat16", "ffn"), ("float32", "swiglu")])
def test_a_fused_chain_runs_on_the_device(gpu, dtype, graph, monkeypatch):
    """The capped FFN's plan (plan/passes/chains.py): the first product and the relu computed
    on the device inside the second product's kernel, over pieces of the hidden label (and
    SwiGLU's two products and their join)."""
    import graphs

    from eindecomp_sql.plan import graph_plan

    g, ref = getattr(graphs, graph)(b=40, d=24, f=150, dtype=dtype)
    rng = np.random.default_rng(9)
    xs = {v.name: (rng.standard_normal(v.shape) / np.sqrt(v.shape[0])).astype(dtype) for v in g.inputs}
    graph_plan._plan_cached.cache_clear()
    monkeypatch.setattr(graph_plan, "CHAINS", "always")
    try:
        p = graph_plan.plan_graph(g, tile_bytes=4096)
    finally:
        graph_plan._plan_cached.cache_clear()
    step, = p.plan.steps
    assert step.node.held and step.pieces["o"] > 1
    got = p.run(gpu, **xs).to_numpy()
    want = ref(**{k: x.astype(np.float64) for k, x in xs.items()})
    err = np.abs(got.astype(np.float64) - want)
    assert err.max() <= (0.02 if dtype == "bfloat16" else 1e-4) * np.abs(want).max()
    assert any(line.startswith("-- step 0 ") and "(on cuda)" in line for line in p.explain(db=gpu).splitlines())


def test_the_sql_interface_runs_on_the_device(gpu):
    rng = np.random.default_rng(6)
    a = rng.standard_normal((40, 30))
    gpu.store("S1", a, tile=(16, 30), replace=True)
    rows = gpu.connection.sql("SELECT i, k, value FROM einsum_elements('ij,kj->ik', 'S1', 'S1')").fetchall()
    got = np.zeros((40, 40))
    for i, k, v in rows:
        got[i, k] = v
    np.testing.assert_allclose(got, a @ a.T, rtol=1e-10, atol=1e-10)


def test_tf32_is_opt_in(counted, on_cuda):
    """float32 products are exact float32 unless ``allow_tf32=True`` (then their inputs are
    rounded to TF32's 10-bit mantissa: by the tensor cores on a GPU, by the stand-in's emulation
    here); float64 is never affected."""
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((64, 1024), np.float32), rng.standard_normal((1024, 32), np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    with eds.connect(device="cuda") as plain, eds.connect(device="cuda", allow_tf32=True) as fast:
        p = plain.einsum("ij,jk->ik", a, b).to_numpy()
        f = fast.einsum("ij,jk->ik", a, b).to_numpy()
        d = fast.einsum("ij,jk->ik", a.astype(np.float64), b.astype(np.float64)).to_numpy()
        assert "TF32 allowed" in fast.explain("ij,jk->ik", a, b) and "TF32" not in plain.explain("ij,jk->ik", a, b)
    assert np.abs(p - exact).max() < 2e-3  # float32 products summed over 1024: ~1e-4
    assert np.abs(f - exact).max() > 1e-2  # 10-bit inputs: ~5e-4 relative per product
    np.testing.assert_allclose(d, exact, rtol=1e-12)
    if SIMULATED:
        assert counted.tf32 == [False]  # set back after each call


def test_device_options_are_checked():
    with pytest.raises(EinsumError, match="device must be 'auto', 'cpu' or 'cuda'"):
        eds.connect(device="gpu")
    with pytest.raises(EinsumError, match="allow_tf32 must be True or False"):
        eds.connect(allow_tf32="yes")
    with pytest.raises(EinsumError, match="backend 'reference' runs its kernels on the CPU"):
        eds.connect(device="cuda", backend="reference")
    with eds.connect(device="cpu") as db:
        assert db.device == "cpu" and "kernels on" not in db.explain("ij->j", np.ones((2, 3)))


def test_no_cuda_device_is_a_clear_error_and_auto_means_the_cpu(monkeypatch):
    """Where CuPy is missing (this machine unless the gpu extra is installed) or finds no GPU."""
    monkeypatch.setitem(devices.KERNELS, "cuda", (devices.KERNELS["cuda"][0], "eindecomp_sql_no_such_module"))
    with pytest.raises(EinsumError, match=r"no CUDA device found .*eindecomp_sql\[gpu\]"):
        eds.connect(device="cuda")
    with eds.connect() as db:
        assert db.device == "cpu"


def test_the_stand_in_refuses_host_arrays_as_cupy_does():
    """The strictness the device tests rely on: if simcupy took host arrays, a kernel that
    forgot an upload would pass here and fail on a GPU."""
    host = np.ones((2, 2))
    dev = simcupy.asarray(host)
    with pytest.raises(TypeError, match="host array"):
        simcupy.matmul(dev, host)
    with pytest.raises(TypeError, match="host array"):
        np.add(dev, host)
    with pytest.raises(TypeError, match="numpy.concatenate called on a device array"):
        np.concatenate([dev, dev])
    out = np.empty((2, 2))
    dev.get(out=out)
    np.testing.assert_array_equal(out, host)


# -- tiles kept on the device between calls and plans (udfs/device_cache.py) -------------------

def test_stored_tiles_are_sent_once_and_stay_for_the_next_plans(gpu, counted):
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((96, 80)), rng.standard_normal((80, 72))
    A, B = gpu.store("RA", a, tile=(32, 40), replace=True), gpu.store("RB", b, tile=(40, 36), replace=True)
    first = gpu.einsum("ij,jk->ik", A, B).to_numpy()
    sent = list(counted.uploads)
    hits = gpu.backend.kernels.device_cache.hits
    second = gpu.einsum("ij,jk->ik", A, B).to_numpy()
    third = gpu.einsum("ij,kj->ik", A, A).to_numpy()  # another plan over the same tiles
    np.testing.assert_allclose(first, a @ b, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(second, first)
    np.testing.assert_allclose(third, a @ a.T, rtol=1e-10, atol=1e-10)
    if SIMULATED:
        assert sent[1] >= a.nbytes + b.nbytes
        assert counted.uploads == sent  # nothing sent again: every tile was resident
    assert gpu.backend.kernels.device_cache.hits > hits
    assert "eds_resident('ra'" in gpu.explain("ij,jk->ik", A, B).lower()


def test_a_replaced_tensor_is_sent_again_never_taken_from_the_cache(gpu, counted):
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((64, 48)), rng.standard_normal((48, 40))
    B = gpu.store("NB", b, tile=(24, 40), replace=True)
    gpu.store("NA", a, tile=(32, 24), replace=True)
    np.testing.assert_allclose(gpu.einsum("ij,jk->ik", "NA", B).to_numpy(), a @ b, rtol=1e-10, atol=1e-10)
    a2 = rng.standard_normal((64, 48))
    gpu.store("NA", a2, tile=(32, 24), replace=True)  # same name, same tiling, new data
    counted.reset()
    np.testing.assert_allclose(gpu.einsum("ij,jk->ik", "NA", B).to_numpy(), a2 @ b, rtol=1e-10, atol=1e-10)
    if SIMULATED:
        assert counted.uploads[1] == a2.nbytes  # the new tiles, and only them
    out = gpu.einsum("ij,jk->ik", "NA", B, out="NA", replace=True).to_numpy()  # an einsum's out= replaces too
    np.testing.assert_allclose(gpu.einsum("ij,jk->ik", "NA", np.eye(40)).to_numpy(), out, rtol=1e-10, atol=1e-10)


def test_a_tensor_stored_as_parts_stays_on_the_device_and_a_replaced_one_is_sent_again(counted, on_cuda):
    """A tensor stored as parts (a view over part tables) is named in the device cache by its
    parts: it was sent with every call (the H100's FFN under half its working set sent its 940 MB
    of weights every run); a store that replaces it writes new parts, sent again."""
    rng = np.random.default_rng(31)
    a, b = rng.standard_normal((96, 80)), rng.standard_normal((80, 72))
    with eds.connect(device="cuda") as db:
        db.backend.part_bytes = 2 * 32 * 40 * 8  # two tiles a part
        A, B = db.store("PA", a, tile=(32, 40), replace=True), db.store("PB", b, tile=(40, 36), replace=True)
        assert db.backend._parts_of("PA") and db.backend._parts_of("PB")
        counted.reset()
        np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b, rtol=1e-10, atol=1e-10)
        first = list(counted.uploads)
        np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b, rtol=1e-10, atol=1e-10)
        if SIMULATED:
            assert first[1] >= a.nbytes + b.nbytes and counted.uploads == first  # nothing sent again
        a2 = rng.standard_normal((96, 80))
        db.store("PA", a2, tile=(32, 40), replace=True)
        counted.reset()
        np.testing.assert_allclose(db.einsum("ij,jk->ik", "PA", B).to_numpy(), a2 @ b, rtol=1e-10, atol=1e-10)
        if SIMULATED:
            assert counted.uploads[1] == a2.nbytes  # the new parts' tiles, and only them


@pytest.mark.parametrize("parted", [False, True])
def test_a_capped_fused_ffn_keeps_what_fits_and_sends_a_groups_shared_tile_once(counted, on_cuda, parted):
    """The FFN as one fused step under a device budget of half its working set (the H100 bench's
    capped case at small scale): ``x``'s tile, alike in every member of a group, is sent once a
    group call, not once a member (it was 8x), and the weights that fit stay for the next runs."""
    import ml_dtypes

    rng = np.random.default_rng(32)
    bf = ml_dtypes.bfloat16
    b, d, f = 64, 128, 256
    x = (rng.standard_normal((b, d)) / np.sqrt(d)).astype(bf)
    w1 = (rng.standard_normal((d, f)) / np.sqrt(d)).astype(bf)
    w2 = (rng.standard_normal((f, d)) / np.sqrt(f)).astype(bf)
    g = eds.Graph()
    X, W1, W2 = g.input("x", (b, d), "bfloat16"), g.input("w1", (d, f), "bfloat16"), g.input("w2", (f, d), "bfloat16")
    g.einsum("bo,oi->bi", g.map("relu", g.einsum("bi,io->bo", X, W1)), W2, name="y")
    working = (2 * b * d + 2 * d * f + b * f) * 2
    want = np.maximum(x.astype(np.float32) @ w1.astype(np.float32), 0).astype(bf).astype(np.float32) @ \
        w2.astype(np.float32)
    with eds.connect(device="cuda", device_memory=working // 2) as db:
        if parted:  # parts, scanned on several threads: the sends ahead run at once
            db.backend.part_bytes = 1 << 12
            db.connection.execute("SET threads = 4")
        from eindecomp_sql.plan.graph_plan import plan_graph

        opts = dict(workers=db.workers, memory=db.plan_budget, tile_bytes=db.tile_bytes, costs=db.backend.cost_model)
        free = plan_graph(g, **opts)
        W1s = db.store("W1", w1, tile=free.plan_input_tile("w1"), replace=True)
        W2s = db.store("W2", w2, tile=free.plan_input_tile("w2"), replace=True)
        assert bool(db.backend._parts_of("W1")) == parted
        plan = plan_graph(g, inputs={"w1": W1s, "w2": W2s}, **opts)
        steps = plan.plan.steps
        assert len(steps) == 1 and steps[0].grouped, plan.explain(sql=False)
        sent = []
        for _ in range(3):
            counted.reset()
            plan.run(db, x=x, w1="W1", w2="W2", out={"y": "Y"}, replace=True)
            sent.append(counted.uploads[1])
            got = db.tensor("Y").to_numpy().astype(np.float32)
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
        cache = db.backend.kernels.device_cache
        assert cache.peak <= cache.budget
        if SIMULATED:
            assert sent[1] == sent[2] < x.nbytes + w1.nbytes + w2.nbytes, sent


@pytest.mark.parametrize("parted", [False, True])
def test_a_tile_the_join_hands_twice_is_sent_ahead_once_and_handed_as_null(counted, on_cuda, parted):
    """A GEMM cut i:2 k:2 with j whole: every operand tile meets two rows of the join. Sent
    ahead of the step, each crosses DuckDB and the bus once and the step's join hands NULL
    (before: DuckDB copied every tile for each row, the H100's cold 16384² GEMM 4 GiB for
    2 GiB of operands). Under a budget that holds none of them, they are staged for the step."""
    rng = np.random.default_rng(33)
    a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 40)).astype(np.float32)
    for budget in (None, 16000):
        with eds.connect(device="cuda", device_memory=budget, tile_bytes=32 * 48 * 4) as db:
            if parted:
                db.backend.part_bytes = 32 * 48 * 4
            A, B = db.store("SA", a, tile=(32, 48), replace=True), db.store("SB", b, tile=(48, 20), replace=True)
            plan = db.plan("ij,jk->ik", A, B)
            assert plan.steps[0].pieces == {"i": 2, "j": 1, "k": 2} and not plan.steps[0].grouped
            state = db.backend.kernels
            counted.reset()
            np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b, rtol=1e-5, atol=1e-5)
            assert state.device_handed_again == 0
            cache = state.device_cache
            if budget is None:
                assert cache.used == a.nbytes + b.nbytes and cache.staged_peak == 0
                if SIMULATED:
                    assert counted.uploads[1] == a.nbytes + b.nbytes
            else:
                # A's two tiles kept (12,288 bytes), B's first staged (a quarter of the budget
                # holds one of its 3,840-byte tiles), its second not sent ahead: the step's two
                # rows reading it send it each
                assert cache.used == a.nbytes and cache.staged_peak == 3840
                if SIMULATED:
                    assert counted.uploads[1] == a.nbytes + b.nbytes + 3840
            assert state.device_cache.staged_bytes == 0


def test_an_operand_read_on_a_diagonal_is_not_sent_ahead(counted, on_cuda):
    """``ii,j->ij`` with ``j`` cut: the join hands each diagonal tile of A once per piece of
    ``j``, and never an off-diagonal one; sending A ahead would send those too (a review)."""
    rng = np.random.default_rng(35)
    a, v = rng.standard_normal((48, 48)), rng.standard_normal(40)
    with eds.connect(device="cuda", tile_bytes=16 * 16 * 8) as db:
        A, V = db.store("DA", a, tile=(16, 16), replace=True), db.store("DV", v, tile=(8,), replace=True)
        step = db.plan("ii,j->ij", A, V).steps[-1]
        assert step.pieces["j"] > 1 and step.pieces["i"] > 1
        assert "DA" not in [name for name, _ in db.backend.compiler.send_ahead(step)]
        counted.reset()
        np.testing.assert_allclose(db.einsum("ii,j->ij", A, V).to_numpy(), np.einsum("ii,j->ij", a, v), rtol=1e-12)
        if SIMULATED:  # the diagonal's 3 tiles and v's, each once
            assert counted.uploads[1] == 3 * 16 * 16 * 8 + v.nbytes


def test_tiles_sent_ahead_cross_in_the_offsets_their_step_asked_for(counted, on_cuda, monkeypatch):
    """A step sets DuckDB's Arrow offsets (64-bit past 2 GiB, else 32-bit) before its
    statements; its send ahead must come after, or a step after a smaller one sends a chunk of
    more than 2 GiB in 32-bit offsets, which DuckDB refuses (a review). The thresholds scaled
    down: the small step sets 32-bit offsets, the big one 64-bit."""
    import pyarrow as pa

    from eindecomp_sql.backends import duckdb as backend
    from eindecomp_sql.udfs import register

    monkeypatch.setattr(backend, "SMALL_BUFFER_BYTES", 1)
    monkeypatch.setattr(backend, "LARGE_BUFFER_BYTES", 100_000)
    handed = []
    send = register.send
    monkeypatch.setattr(register, "send", lambda spec, keys, tiles: (handed.append(tiles.type), send(spec, keys, tiles))[1])
    rng = np.random.default_rng(34)
    a, b = rng.standard_normal((64, 48)), rng.standard_normal((48, 40))
    with eds.connect(device="cuda", tile_bytes=16 * 48 * 8) as db:
        g = eds.Graph()
        x = g.input("x", (8, 8), "float64")
        g.einsum("ij,jk->ik", x, x, name="small")
        g.einsum("ij,jk->ik", g.input("a", (64, 48), "float64"), g.input("b", (48, 40), "float64"), name="big")
        A, B = db.store("GA", a, tile=(16, 48), replace=True), db.store("GB", b, tile=(48, 20), replace=True)
        plan = g.plan(outputs=["small", "big"], inputs={"a": A, "b": B})
        got = plan.run(db, x=np.eye(8), a="GA", b="GB")
        np.testing.assert_allclose(got["big"], a @ b, rtol=1e-10, atol=1e-10)
    assert handed and all(t == pa.large_binary() for t in handed), handed


def test_a_runs_results_leave_the_cache_with_it_and_the_sql_interface_names_no_tiles(gpu):
    from eindecomp_sql.sql_functions import einsum_sql

    rng = np.random.default_rng(16)
    gpu.store("DR", rng.standard_normal((40, 30)), tile=(10, 30), replace=True)
    g = eds.Graph()
    x = g.input("x", (40, 30), "float64")
    g.einsum("ij,kj->ik", g.map("exp", x), x, name="y")
    g.plan(fuse=False, inputs={"x": gpu.tensor("DR")}).run(gpu, x="DR")
    cache = gpu.backend.kernels.device_cache
    assert cache.used > 0 and not [t for t in cache._tiles if t[0].startswith("run")]
    query = einsum_sql(gpu, "ij,kj->ik", ["DR", "DR"], "tiles")
    assert "eds_einsum" in query.lower() and "eds_resident" not in query.lower()


def test_arrays_are_sent_with_every_call(gpu, counted):
    rng = np.random.default_rng(10)
    a, b = rng.standard_normal((30, 20)), rng.standard_normal((20, 10))
    for _ in range(2):
        np.testing.assert_allclose(gpu.einsum("ij,jk->ik", a, b).to_numpy(), a @ b, rtol=1e-10, atol=1e-10)
    if SIMULATED:
        assert counted.uploads[1] == 2 * (a.nbytes + b.nbytes)


def test_an_arrays_tiles_are_sent_once_a_run_however_many_groups_read_them(counted, on_cuda):
    """A GEMM on arrays in 4 x 3 and 3 x 2 tiles, grouped: each tile of ``a`` meets 2 groups and
    each of ``b`` 4, and each is sent once per run (named for the run, as results are); the
    next call sends them again (other data may come under the same name)."""
    rng = np.random.default_rng(24)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((30, 20))
    with eds.connect(device="cuda", tile_bytes=8 * 10 * 10) as db:
        assert db.plan("ij,jk->ik", a, b).steps[-1].grouped
        for _ in range(2):
            counted.reset()
            np.testing.assert_allclose(db.einsum("ij,jk->ik", a, b).to_numpy(), a @ b, rtol=1e-10)
            if SIMULATED:
                assert counted.uploads[1] == a.nbytes + b.nbytes


def test_the_cache_stays_within_its_budget(counted, on_cuda):
    """A working set four times the budget: every result right, the cache never above it, and
    what it holds is kept for the next runs. (This one step re-reads its tiles in a cycle four
    times the cache: it sends 2.9x Belady's count, bench/RESULTS.md.)"""
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((128, 96)), rng.standard_normal((96, 64))
    budget = (a.nbytes + b.nbytes) // 4
    with eds.connect(device="cuda", device_memory=budget) as db:
        A, B = db.store("A", a, tile=(32, 48), replace=True), db.store("B", b, tile=(48, 32), replace=True)
        sent = []
        for _ in range(3):
            counted.reset()
            np.testing.assert_allclose(db.einsum("ij,jk->ik", A, B).to_numpy(), a @ b, rtol=1e-10, atol=1e-10)
            sent.append(counted.uploads[1])
        cache = db.backend.kernels.device_cache
        assert cache.budget == budget and 0 < cache.peak <= budget and cache.hits > 0
        if SIMULATED:  # what the first run left on the device is not sent again
            assert sent[1] == sent[2] < sent[0], sent


@pytest.mark.parametrize("fuse", [True, False])
def test_a_graphs_stored_weights_and_intermediates_stay_on_the_device(gpu, counted, fuse):
    """The FFN with stored weights, run twice: the second run sends only the activations, and
    only the result comes back. Fused it is one program; unfused, each step's result stays on
    the device for the next step, which takes it there: its bytes never go back to DuckDB."""
    from graphs import ffn

    g, ref = ffn(b=32, d=24, f=40, dtype="float32")
    rng = np.random.default_rng(12)
    w1, w2 = rng.standard_normal((24, 40), np.float32), rng.standard_normal((40, 24), np.float32)
    W1, W2 = gpu.store("FW1", w1, replace=True), gpu.store("FW2", w2, replace=True)
    plan = g.plan(fuse=fuse, inputs={"w1": W1, "w2": W2})
    assert len(plan.plan.steps) == 1 if fuse else len(plan.plan.steps) >= 3
    for run in range(2):
        x = rng.standard_normal((32, 24), np.float32)
        counted.reset()
        got = plan.run(gpu, x=x, w1="FW1", w2="FW2").to_numpy()
        np.testing.assert_allclose(got, ref(x=x, w1=w1, w2=w2), rtol=1e-4, atol=1e-4)
        if SIMULATED:
            assert counted.uploads[1] == x.nbytes + (0 if run else w1.nbytes + w2.nbytes)
            assert counted.downloads[1] == got.nbytes


def test_a_result_read_only_on_the_device_stays_there_and_the_rest_comes_back(gpu, counted, monkeypatch):
    """Which results skip DuckDB (``device_only_results``): those whose every reader runs on
    the device. One read by a callable join (host code) comes back; EXPLAIN says which stay;
    where the cache has no room for one, it comes back as bytes and the answer is the same."""
    from eindecomp_sql.plan.kernel_spec import device_only_results, host_reason
    from eindecomp_sql.plan.steps import step_reads, step_target
    from eindecomp_sql.udfs.device_cache import DeviceCache

    rng = np.random.default_rng(21)
    a, b, c = (rng.standard_normal(s) for s in ((30, 20), (20, 40), (40, 10)))
    g = eds.Graph()
    A, B, C = g.input("a", a.shape, "float64"), g.input("b", b.shape, "float64"), g.input("c", c.shape, "float64")
    h = g.einsum("ij,jk->ik", A, B, name="h")
    e = g.map("exp", g.einsum("ik,kl->il", h, C))
    g.einsum("il,il->i", e, e, join=lambda x, y: np.hypot(x, y), name="y")  # host code reads e
    plan = g.plan(fuse=False)
    steps = plan.plan.steps
    kept = device_only_results(plan.plan, "cuda")
    on_host = [s for s in steps if host_reason(s) is not None]
    host_reads = {v.name for s in on_host for v in step_reads(s)}
    assert on_host and host_reads and "h" in kept and not kept & host_reads and "y" not in kept, (kept, host_reads)
    text = plan.explain(db=gpu)
    says = [line for line in text.splitlines() if "its result stays on cuda" in line]
    assert len(says) == len(kept), text
    want = np.hypot(np.exp(a @ b @ c), np.exp(a @ b @ c)).sum(axis=1)
    for room in (True, False):
        if not room:  # no room to hold a result: its bytes go back, as before
            monkeypatch.setattr(DeviceCache, "hold", lambda self, *args, **kw: False)
        counted.reset()
        got = plan.run(gpu, a=a, b=b, c=c).to_numpy()
        np.testing.assert_allclose(got, want, rtol=1e-10)
        if SIMULATED:  # every result made on the device comes back but those it holds
            back = sum(step_target(s).nbytes for s in steps
                       if host_reason(s) is None and not (room and step_target(s).name in kept))
            assert counted.downloads[1] == back, (room, counted.downloads, back)


def test_tiles_come_from_the_device_budget_and_progress_says_where_steps_run(on_cuda):
    with eds.connect(device="cuda", device_memory="8MB") as db:
        assert db.tile_bytes == 1_000_000  # an eighth of the budget
        rng = np.random.default_rng(13)
        a, b = rng.standard_normal((700, 600)), rng.standard_normal((600, 500))
        seen = []
        got = db.einsum("ij,jk->ik", a, b, progress=seen.append).to_numpy()
        np.testing.assert_allclose(got, a @ b, rtol=1e-10, atol=1e-10)
        plan = db.plan("ij,jk->ik", a, b)
        assert max(v.nbytes / np.prod(v.grid) for v in plan.inputs) <= 1_000_000
        assert seen and all(" [on cuda]" in p.description or " [on the host: " in p.description for p in seen)
    with eds.connect(device="cuda") as db, eds.connect(device="cpu") as cpu:  # no budget given: as usual
        assert db.tile_bytes == cpu.tile_bytes


def test_eviction_keeps_the_tile_needed_sooner():
    """The cache's rule on its own: with the plan's reads known, a tile is evicted only for one
    needed sooner (the running step's tiles: now), else the newcomer is used and not kept;
    without them, LRU."""
    from eindecomp_sql.udfs.device_cache import DeviceCache
    from eindecomp_sql.udfs.pool import KernelState

    state = KernelState()
    state.device_reads = [frozenset({"w1"}), frozenset(), frozenset({"w2"})]  # an FFN, unfused
    cache = DeviceCache(budget=100)
    state.device_step = 0
    assert cache.put(("w1", (0,)), "W1", 80, state.next_use)
    state.device_step = 1  # w1 is read again next run's step 0 (2 steps off), w2 at step 2 (1 off)
    assert cache.put(("w2", (0,)), "W2", 80, state.next_use) and ("w1", (0,)) not in cache
    state.device_step = 0  # a tile the running step reads (0 off) goes before one needed later
    assert cache.put(("w1", (0,)), "W1", 80, state.next_use) and ("w2", (0,)) not in cache
    # two tiles the running step reads make no room for each other (a step may re-read its
    # tiles in a cycle longer than the cache: each would be evicted just before its turn)
    assert not cache.put(("w1", (1,)), "W1b", 80, state.next_use) and cache.used == 80
    state.device_reads = [frozenset({"run7/h"}), frozenset({"w1"}), frozenset()]
    state.device_step = 2  # a value the run computed dies with it; a stored one comes back
    assert state.next_use(("run7/h", ())) == float("inf") and state.next_use(("w1", ())) == 2
    lru = DeviceCache(budget=100)
    lru.put("a", "A", 60)
    lru.put("b", "B", 40)
    lru.pin("a")
    lru.unpin_all()
    assert lru.put("c", "C", 40) and "b" not in lru and "a" in lru  # b was the least recently used
    assert lru.peak <= lru.budget


def test_a_result_read_with_a_size_1_axis_dropped_comes_back(gpu):
    """numpy broadcasting: a reader that drops a size-1 axis of a value names its tiles by
    fewer keys than their writer, so such a value is not held (it would not be found)."""
    from eindecomp_sql.plan.kernel_spec import device_only_results

    rng = np.random.default_rng(22)
    a, b, x = rng.standard_normal((64, 20)), rng.standard_normal((20, 1)), rng.standard_normal((64, 40))
    g = eds.Graph()
    A, B, X = g.input("a", a.shape, "float64"), g.input("b", b.shape, "float64"), g.input("x", x.shape, "float64")
    g.einsum("ij,ij->ij", g.einsum("ij,jk->ik", A, B, name="h"), X, name="y")
    plan = g.plan(fuse=False, workers=4)
    assert any(op.dropped for s in plan.plan.steps for op in s.node.operands)
    assert "h" not in device_only_results(plan.plan, "cuda")
    np.testing.assert_allclose(plan.run(gpu, a=a, b=b, x=x).to_numpy(), (a @ b) * x, rtol=1e-10)


def test_runs_inside_a_run_and_sql_queries_beside_it_keep_their_own_tile_names(gpu):
    """A plan run from a progress callback (the session's lock is re-entrant) puts the outer
    run's tile names back when it ends, and a SQL-interface query run meanwhile (another
    thread in real use) names no tiles: the outer run still finds its held results."""
    rng = np.random.default_rng(23)
    shapes = ((64, 48), (48, 32), (32, 16))
    a, b, c = (rng.standard_normal(s) for s in shapes)
    p, q, r = (rng.standard_normal(s) for s in shapes)
    for n, v in zip(("NA", "NB", "NC", "NP", "NQ", "NR"), (a, b, c, p, q, r)):
        gpu.store(n, v, tile=(16, 16), replace=True)
    operands = [gpu.tensor(n) for n in ("NA", "NB", "NC")]
    assert device_only(gpu, gpu.plan("ij,jk,kl->il", *operands))  # something is held
    side = {}

    def progress(report):
        # on the plan's own thread (at a step's end): between steps the callback runs on the
        # watchdog's thread, where the session running the plan is refused
        on_plan_thread = threading.current_thread() is threading.main_thread()
        if on_plan_thread and gpu.backend.kernels.device_tokens and not side:
            side["inner"] = gpu.einsum("ij,jk->ik", p, q).to_numpy()
            side["rows"] = gpu.connection.sql(
                "SELECT i, l, value FROM einsum_elements('ij,jk,kl->il', 'NP', 'NQ', 'NR')").fetchall()

    got = gpu.einsum("ij,jk,kl->il", *operands, progress=progress).to_numpy()
    np.testing.assert_allclose(got, a @ b @ c, rtol=1e-10)
    np.testing.assert_allclose(side["inner"], p @ q, rtol=1e-10)
    m = np.full((64, 16), np.nan)
    for i, j, v in side["rows"]:
        m[i, j] = v
    np.testing.assert_allclose(m, p @ q @ r, rtol=1e-10)


def device_only(db, plan):
    return db.backend._device_only(plan)


def test_a_held_result_is_never_evicted_and_goes_when_dropped():
    """A result held on the device (its bytes never went back to DuckDB) is the only copy: no
    newcomer evicts it, whatever its next use; a hold that finds no room fails (the caller
    sends the bytes back); ``drop`` lets it go."""
    from eindecomp_sql.udfs.device_cache import DeviceCache

    cache = DeviceCache(300)
    soon = lambda tid: 0 if tid[0] in ("oid2", "run1/g") else 5  # noqa: E731 (C and G needed now)
    assert cache.hold(("run1/h", ()), "H", 100, soon)
    assert cache.put(("oid1", (0,)), "A", 100, soon) and cache.put(("oid1", (1,)), "B", 100, soon)
    assert cache.put(("oid2", ()), "C", 100, soon)  # room made by evicting A or B, never H
    assert ("run1/h", ()) in cache and cache.used == 300 and cache.evicted == 1
    assert not cache.hold(("run1/g", ()), "G", 250, soon)  # room only if H went: no
    assert ("run1/h", ()) in cache and cache.held == 1
    cache.drop("run1/h")
    assert ("run1/h", ()) not in cache and cache.used == 200


def _bytes_and_belady(db, run, runs: int = 3) -> list[tuple[int, int]]:
    """(bytes the kernels sent, Belady's count for the same calls) for each of ``runs`` runs."""
    from eindecomp_sql.udfs.runtime import belady_of_calls

    state, out = db.backend.kernels, []
    cache = state.device_cache
    for _ in range(runs):
        start = set(cache._tiles)
        state.device_trace, state.device_sent = [], 0
        run()
        out.append((state.device_sent, belady_of_calls(state.device_trace, cache.budget, start)))
    state.device_trace = None
    return out


def test_a_capped_llama_block_sends_about_beladys_count_and_less_than_lru(monkeypatch, on_cuda):
    """The issue's measure: the LLaMA block (unfused, 4 workers, every input stored) with the
    cache at half its working set (every tile one run's kernel calls touch), run three times;
    from the second run on, the bytes sent are within 1.2x of Belady's count for the same calls
    and below what least-recently-used eviction sends (bench/device_bytes.py, the same sizes:
    0.20 MB a run, 1.00x Belady's, against LRU's 0.43 MB)."""
    import graphs
    from eindecomp_sql.plan.graph_plan import plan_graph
    from eindecomp_sql.udfs.device_cache import DeviceCache

    admit = DeviceCache._admit
    g, ref = graphs.llama_block(s=64, d=128, h=4, e=32, f=256, dtype="float32")  # bench/device_bytes.py's
    xs = graphs.random_inputs(g, seed=1)
    sent, budget = {}, None
    for policy in ("whole", "plan", "lru"):
        if policy == "lru":
            monkeypatch.setattr(DeviceCache, "_admit", lambda self, tid, a, n, next_use, held, pin=False: admit(
                self, tid, a, n, None, held, pin))
        with eds.connect(device="cuda", device_memory=budget or 1 << 40, tile_bytes=1 << 30) as db:
            for name, x in xs.items():
                db.store(name, x, replace=True)
            plan = plan_graph(g, workers=4, fuse=False, inputs={n: db.tensor(n) for n in xs},
                              costs=db.backend.cost_model)

            def run():
                got = plan.run(db, **{n: n for n in xs}).to_numpy()
                np.testing.assert_allclose(got, ref(**xs), rtol=1e-4, atol=1e-4)

            if budget is None:  # room for everything: the working set
                state = db.backend.kernels
                state.device_trace = []
                run()
                budget = sum({tid: n for _, _, nb in state.device_trace for tid, n in nb.items()}.values()) // 2
                continue
            sent[policy] = _bytes_and_belady(db, run)
            assert db.backend.kernels.device_cache.peak <= budget
    for moved, best in sent["plan"][1:]:
        assert moved <= 1.2 * best, sent
    assert all(p[0] < q[0] for p, q in zip(sent["plan"][1:], sent["lru"][1:])), sent


def test_auto_keeps_small_steps_on_the_host(counted, on_cuda):
    """``device="auto"`` with a GPU there: a step too small to pay for a transfer runs on the
    host (EXPLAIN says so, nothing is sent); a big one goes to the device. ``"cuda"`` sends both."""
    from eindecomp_sql.session import AUTO_MIN_WORK

    rng = np.random.default_rng(15)
    small = [rng.standard_normal((64, 64)) for _ in range(2)]
    n = round(AUTO_MIN_WORK ** (1 / 3)) + 8  # an n³ GEMM just over the threshold
    big = [rng.standard_normal((n, n), np.float32) for _ in range(2)]
    with eds.connect() as auto, eds.connect(device="cuda") as cuda:
        assert auto.device == "cuda"
        assert "(on the host: small (262,144 element operations" in auto.explain("ij,jk->ik", *small)
        assert "(on cuda)" in cuda.explain("ij,jk->ik", *small)
        counted.reset()
        np.testing.assert_allclose(auto.einsum("ij,jk->ik", *small).to_numpy(), small[0] @ small[1], rtol=1e-10)
        if SIMULATED:
            assert counted.uploads == [0, 0]
        assert "(on cuda)" in auto.explain("ij,jk->ik", *big)
        got = auto.einsum("ij,jk->ik", *big).to_numpy()
        assert_close(got, big[0] @ big[1], error_scale("ij,jk->ik", big))
        if SIMULATED:
            assert counted.uploads[1] >= big[0].nbytes + big[1].nbytes
