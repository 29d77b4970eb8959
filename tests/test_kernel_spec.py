"""The kernel spec (plan/kernel_spec.py): typed, versioned JSON between the compiler and the
tile kernels, with a user's callable join pickled inside it."""

import base64
import dataclasses
import gc
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eindecomp_sql.plan.kernel_spec as ks
from eindecomp_sql.errors import EinsumError
from eindecomp_sql.plan import EinsumStep, FillStep, RetileStep, TiledValue, plan_einsum
from eindecomp_sql.plan.kernel_spec import (SPEC_VERSION, EinsumKernelSpec, FillKernelSpec, KernelJoin,
                                            RetileKernelSpec, from_json, kernel_spec, pickle_callable, to_json)


def value(name, shape, tile, dtype="float64"):
    kw = dict(name=name, shape=shape, dtype=dtype, tile=tile, keys=tuple(f"d{k}" for k in range(len(shape))))
    if "table" in {f.name for f in dataclasses.fields(TiledValue)}:  # older TiledValue named its table
        kw["table"] = name
    return TiledValue(**kw)


def steps(spec, operands, join=None, agg=None):
    return plan_einsum(spec, tuple(value(*o) for o in operands), join, agg).steps


CASES = [
    ("ij,jk->ik", [("A", (4, 6), (2, 3)), ("B", (6, 5), (3, 5))], None, None),
    ("ij,jk->ik", [("A", (5, 6), (5, 2)), ("B", (6, 5), (3, 5))], None, None),  # retile
    ("ii->", [("A", (5, 5), (2, 2))], None, None),
    ("ij,jk->ik", [("A", (4, 6), (2, 3)), ("B", (6, 5), (3, 5))], "add", "max"),
    ("ij,jk->ik", [("A", (4, 6), (4, 6)), ("B", (6, 5), (6, 5))], "relu(x - y)", "min"),
    ("ij->i", [("A", (4, 6), (4, 6), "float32")], "relu", "sum"),
    (",ij->ij", [("s", (), ()), ("A", (3, 4), (2, 4))], None, None),
    ("ij,jk->ik", [("A", (3, 0), (3, 1), "float32"), ("B", (0, 4), (1, 4), "float32")], None, "prod"),  # fill
]


def test_every_step_round_trips_and_carries_version_and_device():
    ops = set()
    for spec, operands, join, agg in CASES:
        for step in steps(spec, operands, join, agg):
            for batch in ([None, (0, 1)] if isinstance(step, RetileStep) else [None]):
                text = kernel_spec(step, batch)
                parsed = from_json(text)
                assert to_json(parsed) == text
                body = json.loads(text)
                assert (body["v"], body["device"]) == (SPEC_VERSION, "cpu")
                assert parsed.op == body["op"]
                ops.add(body["op"])
                if isinstance(step, RetileStep):
                    assert (parsed.shape, parsed.source_tile, parsed.target_tile) == (
                        step.source.shape, step.source.tile, step.target.tile)
                    assert parsed.first_key_range == batch
                elif isinstance(step, FillStep):
                    assert (parsed.shape, parsed.tile, parsed.value) == (step.result.shape, step.result.tile, step.value)
                else:
                    assert isinstance(step, EinsumStep)
                    assert parsed.size == step.node.size and parsed.tile == step.tile_of
                    assert parsed.dtypes == tuple(v.dtype for v in step.inputs)
                    assert parsed.join.function() == step.node.join
    assert ops == {"einsum", "retile", "fill"}


def test_the_device_travels():
    step = steps(*CASES[0])[0]
    assert from_json(kernel_spec(step, device="cuda")).device == "cuda"
    with pytest.raises(EinsumError, match="device 'tpu' is unknown; devices are cpu, cuda"):
        kernel_spec(step, device="tpu")


LABELS = st.lists(st.sampled_from("ijklmn"), min_size=1, max_size=4, unique=True)
DTYPES = st.sampled_from(["float32", "float64", "int64", "bool", "complex128", "uint8"])


@st.composite
def einsum_specs(draw):
    labels = draw(LABELS)
    inputs = draw(st.lists(st.lists(st.sampled_from(labels), max_size=4), min_size=1, max_size=3))
    used = tuple(dict.fromkeys(lab for x in inputs for lab in x))
    output = tuple(draw(st.permutations(used))[:draw(st.integers(0, len(used)))])
    size = {lab: draw(st.integers(0, 50)) for lab in used}
    join = draw(st.sampled_from([KernelJoin(name="mul"), KernelJoin(name="max"), KernelJoin(expr="x * 2")]))
    return EinsumKernelSpec(inputs=tuple(tuple(x) for x in inputs), output=output, labels=used,
                            reduced=tuple(lab for lab in used if lab not in output), size=size,
                            tile={lab: draw(st.integers(1, 8)) for lab in used}, join=join,
                            agg=draw(st.sampled_from(["sum", "max", "min", "prod"])),
                            dtypes=tuple(draw(DTYPES) for _ in inputs), out_dtype=draw(DTYPES),
                            device=draw(st.sampled_from(ks.DEVICES)))


@st.composite
def retile_specs(draw):
    n = draw(st.integers(0, 4))
    ints = st.lists(st.integers(1, 20), min_size=n, max_size=n)
    first = draw(st.none() | st.tuples(st.integers(0, 5), st.integers(0, 9)))
    return RetileKernelSpec(shape=tuple(draw(ints)), source_tile=tuple(draw(ints)), target_tile=tuple(draw(ints)),
                            dtype=draw(DTYPES), first_key_range=first if n else None)


@st.composite
def fill_specs(draw):
    n = draw(st.integers(0, 4))
    ints = st.lists(st.integers(0, 20), min_size=n, max_size=n)
    v = draw(st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False))
    return FillKernelSpec(shape=tuple(draw(ints)), tile=tuple(draw(ints)), dtype=draw(DTYPES), value=v)


@given(st.one_of(einsum_specs(), retile_specs(), fill_specs()), st.booleans())
def test_specs_round_trip(spec, user):
    spec = dataclasses.replace(spec, user_query=user)  # a user's SQL query's, or a plan run's
    text = to_json(spec)
    back = from_json(text)
    assert back == spec and type(back) is type(spec) and to_json(back) == text
    assert json.loads(text)["v"] == 1
    assert ("user" in json.loads(text)) is user  # written only for a user's query: other specs unchanged


def _body(**change):
    body = json.loads(to_json(FillKernelSpec(shape=(3,), tile=(2,), dtype="float64", value=0.0)))
    body.update(change)
    return json.dumps({k: v for k, v in body.items() if v is not ...})


@pytest.mark.parametrize("text,match", [
    (_body(user="yes"), "user must be true or false, got 'yes'"),
    (_body(v=6), "version 6 is not supported; this eindecomp_sql reads version 1, 2, 3, 4, 5"),
    (_body(v="1"), "version '1' is not supported"),
    (_body(v=...), r"no version \(\"v\"\); this eindecomp_sql reads version 1"),
    (_body(op="gemm"), "op 'gemm' is unknown; ops are einsum, retile, fill"),
    (_body(device="tpu"), "device 'tpu' is unknown; devices are cpu, cuda"),
    (_body(device=...), "device None is unknown"),
    (_body(tile=...), r"fill: missing keys \['tile'\]"),
    (_body(extra=1), r"unknown keys \['extra'\]"),
    (_body(dtype="float99"), "dtype 'float99' is not a numpy dtype"),
    (_body(shape=[3, 1]), "differ in rank"),
    ("[1, 2]", "must be a JSON object, got list"),
    ("{nope", "not JSON"),
])
def test_refusals_say_what_they_got_and_what_is_read(text, match):
    with pytest.raises(EinsumError, match=match):
        from_json(text)


def test_a_bad_join_is_refused():
    good = json.loads(kernel_spec(steps(*CASES[0])[0]))
    for join in ({}, {"name": "mul", "expr": "x"}, {"func": "f"}, {"name": 3}):
        with pytest.raises(EinsumError, match="join must be one of"):
            from_json(json.dumps({**good, "join": join}))


def test_a_closure_round_trips_through_pickle_and_computes_the_same():
    scale = 3.0  # a local the join closes over

    def scaled(x, y):
        return scale * x - y

    a = np.random.default_rng(0).standard_normal((4, 6))
    b = np.random.default_rng(1).standard_normal((6, 5))
    step = steps("ij,jk->ik", [("A", (4, 6), (4, 6)), ("B", (6, 5), (6, 5))], scaled, "max")[0]
    text = kernel_spec(step)  # in-process: a live token only, nothing pickled into the SQL
    assert set(json.loads(text)["join"]["callable"]) == {"live"} and len(text) < 1000
    assert from_json(text).join.function().func is scaled  # the planning process runs the function itself
    portable = kernel_spec(step, portable=True)  # for another process: the signed snapshot too
    join = from_json(portable).join
    assert json.loads(portable)["join"] == {
        "callable": {"pickle": join.pickled, "sig": join.signature, "live": join.live}}
    with pytest.raises(EinsumError, match="not one of this process's live functions"):
        dataclasses.replace(join, live="elsewhere:1").function()  # the kernels DuckDB calls never unpickle
    fn = dataclasses.replace(join, live="elsewhere:1").function(allow_pickle=True)
    assert fn.func is not scaled and fn.func_id == id(fn.func)
    assert fn.label == "callable(scaled)"
    np.testing.assert_array_equal(fn.func(a, b.T[:4, :6]), scaled(a, b.T[:4, :6]))

    from eindecomp_sql.udfs.kernels import einsum_kernel

    kernel = einsum_kernel(text)
    out = np.empty((4, 5))
    kernel.contract([a, b], out, accumulate=False)
    np.testing.assert_allclose(out, scaled(a[:, :, None], b[None]).max(axis=1))
    assert einsum_kernel(text) is kernel  # one kernel (one unpickling) per distinct spec


def test_a_forged_or_unsigned_pickle_is_never_unpickled():
    """SQL on the connection can call the kernels with any spec text: a pickle runs code, so
    only one signed under this process's key is read."""
    import pickle

    evil = base64.b64encode(pickle.dumps(print)).decode()
    good = json.loads(kernel_spec(steps("ij,jk->ik", [("A", (4, 6), (4, 6)), ("B", (6, 5), (6, 5))],
                                        lambda x, y: x * y, "sum")[0], portable=True))
    for sig in (None, "0" * 64, good["join"]["callable"]["sig"]):
        body = {**good, "join": {"callable": {"pickle": evil, "sig": sig, "live": None}}}
        with pytest.raises(EinsumError, match="not one of this process's live functions"):
            from_json(json.dumps(body)).join.function()  # what the kernels DuckDB calls do
        with pytest.raises(EinsumError, match="not signed by this process's spec key"):
            from_json(json.dumps(body)).join.function(allow_pickle=True)
    # a live token from elsewhere resolves to nothing here
    body = {**good, "join": {"callable": {"live": "0123456789abcdef:" + good["join"]["callable"]["live"].split(":")[1]}}}
    with pytest.raises(EinsumError, match="not one of this process's live functions"):
        from_json(json.dumps(body)).join.function()


def test_the_live_function_runs_in_the_planning_process():
    """A callable's closure may change between calls: in-process runs use it as it is now
    (through the session too), never a pickled snapshot."""
    import eindecomp_sql as eds

    scale = [2.0]

    def scaled(x, y):
        return scale[0] * x * y

    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    with eds.connect() as db:
        first = db.einsum_numpy("ij,jk->ik", a, b, join=scaled)
        scale[0] = 5.0
        second = db.einsum_numpy("ij,jk->ik", a, b, join=scaled)
    np.testing.assert_allclose(first, 2.0 * a @ b)
    np.testing.assert_allclose(second, 5.0 * a @ b)


def test_an_unpicklable_callable_is_refused_naming_it():
    lock = threading.Lock()

    def locked(x, y):
        with lock:
            return x * y

    step = steps("ij,jk->ik", [("A", (4, 6), (4, 6)), ("B", (6, 5), (6, 5))], locked, "sum")[0]
    kernel_spec(step)  # in-process: nothing to pickle, the live function runs
    with pytest.raises(EinsumError, match=r"join callable '.*locked' cannot be pickled .*lock.*define it at module "
                                          r"level or make it \(and what it closes over\) picklable"):
        kernel_spec(step, portable=True)


def test_pickles_are_cached_while_the_function_lives():
    def f(x, y):
        return x + y

    text = pickle_callable(f)
    assert pickle_callable(f) is text
    key = id(f)
    assert key in ks._pickled
    del f
    gc.collect()
    assert key not in ks._pickled


def test_a_device_without_kernels_is_refused_listing_those_with(monkeypatch):
    from eindecomp_sql.udfs import devices
    from eindecomp_sql.udfs.kernels import einsum_kernel, read_spec, retile_kernel

    monkeypatch.delitem(devices.KERNELS, "cuda")
    for k in (einsum_kernel, retile_kernel, read_spec):
        k.cache_clear()
    for step in steps(*CASES[1]):
        text = kernel_spec(step, device="cuda")
        kernel = einsum_kernel if isinstance(step, EinsumStep) else retile_kernel
        with pytest.raises(EinsumError, match="no tile kernels for device 'cuda'; devices with kernels: cpu"):
            kernel(text)
    with pytest.raises(EinsumError, match="a retile kernel got a fill kernel spec"):
        read_spec(_body(), RetileKernelSpec)


def test_a_device_whose_namespace_is_missing_names_it(monkeypatch):
    """A "cuda" spec in a process without CuPy (or with no GPU driver): an EinsumError saying
    what to install, not a bare ImportError from inside a UDF."""
    from eindecomp_sql.udfs import devices
    from eindecomp_sql.udfs.kernels import einsum_kernel

    monkeypatch.setitem(devices.KERNELS, "cuda", (devices.KERNELS["cuda"][0], "eindecomp_sql_no_such_module"))
    einsum_kernel.cache_clear()
    step = next(s for s in steps(*CASES[1]) if isinstance(s, EinsumStep))
    with pytest.raises(EinsumError, match=r"device 'cuda' computes with eindecomp_sql_no_such_module, which "
                                          r"does not import here .*eindecomp_sql\[gpu\]"):
        einsum_kernel(kernel_spec(step, device="cuda"))
    einsum_kernel.cache_clear()


def test_the_module_is_pure():
    code = ("import sys, eindecomp_sql.plan.kernel_spec\n"
            "print(sorted(m for m in ('duckdb', 'pyarrow', 'sqlglot', 'cloudpickle') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_device_spec_names_its_values_and_says_tf32_only_when_asked():
    """What a step's spec carries on a device: the operands' and the result's value names (the
    device cache's names for their tiles) and TF32 when allowed; on the CPU the names but not
    TF32 (an array operand's tile comes as NULL and is found by its name; a result returned as
    an array is written into it by its name), and in a spec that travels to Spark's workers,
    none. Read back equal; malformed, an EinsumError."""
    step = next(s for s in steps(*CASES[1]) if isinstance(s, EinsumStep))
    cpu = json.loads(kernel_spec(step))
    assert cpu["values"] == [v.name for v in step.inputs] and cpu["result"] == step.result.name
    assert "tf32" not in cpu
    assert not {"values", "result", "tf32"} & set(json.loads(kernel_spec(step, portable=True)))
    assert "values" not in json.loads(kernel_spec(step, names=False))
    text = kernel_spec(step, device="cuda", tf32=True)
    body = json.loads(text)
    assert body["values"] == [v.name for v in step.inputs] and body["result"] == step.result.name and body["tf32"]
    spec = ks.from_json(text)
    assert spec.values == tuple(body["values"]) and spec.tf32 and ks.to_json(spec) == text
    for bad in ({"values": ["a"]}, {"result": 3}, {"tf32": "yes"}):
        with pytest.raises(EinsumError, match="kernel spec"):
            ks.from_json(json.dumps({**body, **bad}))


def test_a_callable_pickled_twice_on_another_thread():
    """fresh_pickles' flag is per thread; pickle_callable read it bare, so the second pickle of
    a cached callable on any thread but the importing one raised AttributeError (a graph with
    two nodes sharing a callable, planned on a worker thread)."""
    import threading

    from eindecomp_sql.plan.kernel_spec import fresh_pickles, pickle_callable

    def f(x, y):
        return x * y

    out = []

    def work():
        try:
            first = pickle_callable(f)
            out.append(pickle_callable(f) == first)
            with fresh_pickles():
                out.append(isinstance(pickle_callable(f), str))
        except BaseException as e:  # noqa: BLE001 - reported below
            out.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out == [True, True], out
