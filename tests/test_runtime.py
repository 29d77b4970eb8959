"""The device worker's runtime (udfs/runtime.py) against a simulated device: random task graphs
under random completion orders and budgets, real plans (the LLaMA block cut for 1-8 workers)
with working sets up to four times the budget, the cache's budget, no tile sent twice while it
stays resident, tiles kept between runs, refusals before anything runs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eindecomp_sql.backends.device_tasks import assemble, host_tiles, plan_tasks
from eindecomp_sql.backends.reference import _keys
from eindecomp_sql.errors import EinsumError
from eindecomp_sql.udfs.runtime import SimulatedDevice, Task, TileRuntime, belady_bytes
from graphs import attention, llama_block, random_inputs


def _check_log(stats) -> None:
    """A tile is uploaded again only after it left the cache (evicted or freed)."""
    resident = set()
    for what, tid in stats.log:
        if what == "upload":
            assert tid not in resident, f"{tid} sent twice while resident"
            resident.add(tid)
        else:
            resident.discard(tid)


@st.composite
def task_graphs(draw):
    """Random tasks over small float64 vectors: each reads 1-3 earlier tiles (inputs or results)
    and adds, multiplies or takes the max; sequential evaluation is the reference."""
    n_in = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    sizes = {f"in{k}": draw(st.integers(1, 6)) * 8 for k in range(n_in)}
    n = draw(st.integers(1, 5)) * 8  # every tile holds n elements here: ops line up
    host = {f"in{k}": rng.standard_normal(n) for k in range(n_in)}
    tasks, values = [], dict(host)
    ids = list(host)
    for j in range(draw(st.integers(1, 25))):
        reads = tuple(draw(st.lists(st.sampled_from(ids[-8:]), min_size=1, max_size=3)))
        op = draw(st.sampled_from(["add", "mul", "max"]))
        fn = {"add": lambda a: sum(a), "mul": lambda a: np.prod(np.stack(a), axis=0), "max": lambda a: np.max(np.stack(a), axis=0)}[op]
        out = f"t{j}"
        tasks.append(Task(out, reads, out, n * 8, fn, flops=float(n)))
        values[out] = fn([values[r] for r in reads])
        ids.append(out)
    keep = draw(st.lists(st.sampled_from([t.output for t in tasks]), min_size=1, unique=True))
    del sizes
    return tasks, host, keep, {k: values[k] for k in keep}, n * 8


@settings(max_examples=150, deadline=None)
@given(task_graphs(), st.integers(3, 12), st.sampled_from(["furthest", "lru"]), st.sampled_from(["dynamic", "static"]),
       st.integers(0, 1000), st.floats(0, 3))
def test_random_graphs_right_under_any_completion_order(case, room, eviction, order, seed, jitter):
    """Budgets from barely the largest task (so tiles are evicted, written back and sent again)
    to the whole working set; completion times jittered at random: every kept tile is the
    sequential evaluation's, the cache never holds more than its budget, no tile is sent twice
    while it stays resident, and the tasks start in an order their dependencies allow."""
    tasks, host, keep, want, tile = case
    budget = room * tile
    need = max(len(set(t.inputs) | {t.output}) for t in tasks) * tile
    rt = TileRuntime(SimulatedDevice(jitter=jitter, seed=seed), budget=budget, eviction=eviction, order=order)
    if need > budget:
        with pytest.raises(EinsumError, match="over the device budget"):
            rt.run(tasks, host, keep)
        return
    got = rt.run(tasks, host, keep)
    for k in keep:
        np.testing.assert_array_equal(got[k], want[k])
    assert rt.stats.peak_bytes <= budget
    _check_log(rt.stats)
    position = {name: k for k, name in enumerate(rt.stats.order)}
    assert sorted(position) == sorted(t.name for t in tasks)
    made = {t.output: t.name for t in tasks}
    for t in tasks:
        assert all(position[made[i]] < position[t.name] for i in t.inputs if i in made)
    if order == "static":
        assert rt.stats.order == [t.name for t in tasks]


def _llama(workers: int, make=llama_block):
    g, ref = make()
    xs = random_inputs(g, 0)
    plan = g.plan(workers=workers, fuse=False).plan
    host = {}
    for v in plan.inputs:
        host.update(host_tiles(v, xs[v.name]))
    out = plan.outputs[0]
    keep = [(out.name, k) for k in _keys(out.shape, out.tile)]
    tasks = plan_tasks(plan)
    sizes = {tid: a.nbytes for tid, a in host.items()} | {t.output: t.out_bytes for t in tasks}
    return tasks, host, keep, sizes, out, ref(**xs)


@pytest.mark.parametrize("make", [llama_block, attention])
@pytest.mark.parametrize("workers", [1, 4, 8])
@pytest.mark.parametrize("fraction", [2.0, 0.5, 0.25])
def test_real_plans_with_working_sets_over_the_budget(make, workers, fraction):
    """The LLaMA block and attention, cut for 1-8 workers, as tile tasks: with the budget at
    twice, half and a quarter of the working set (inputs, intermediates and outputs), the
    result is numpy's; furthest-next-use with dynamic order sends no more than 1.2x Belady's
    count for the order it ran."""
    tasks, host, keep, sizes, out, want = _llama(workers, make)
    working = sum(sizes.values())
    need = max(sum(sizes[i] for i in set(t.inputs) | {t.output}) for t in tasks)
    budget = max(int(working * fraction), need)
    rt = TileRuntime(SimulatedDevice(jitter=0.5, seed=workers), budget=budget)
    got = assemble(out, rt.run(tasks, host, keep))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert rt.stats.peak_bytes <= budget
    _check_log(rt.stats)
    by_name = {t.name: t for t in tasks}
    belady = belady_bytes([by_name[n] for n in rt.stats.order], sizes, budget)
    assert rt.stats.h2d_bytes <= 1.2 * belady
    if fraction >= 1:
        assert rt.stats.h2d_bytes == sum(a.nbytes for a in host.values())  # each input once
        assert rt.stats.d2h_bytes == sum(sizes[k] for k in keep)  # only what the caller keeps comes back


def test_tiles_stay_resident_between_runs():
    """A second run over the same weights sends nothing the cache still holds; a kept result
    read by the next run is not sent back."""
    tasks, host, keep, sizes, out, want = _llama(4)
    rt = TileRuntime(SimulatedDevice(), budget=2 * sum(sizes.values()))
    first = rt.run(tasks, host, keep)
    assert rt.stats.h2d_bytes > 0
    second = rt.run(tasks, host, keep)
    assert rt.stats.h2d_bytes == 0
    for k in keep:
        np.testing.assert_array_equal(first[k], second[k])
    follow = [Task("twice", (keep[0],), "y", sizes[keep[0]], lambda a: a[0] * 2)]
    got = rt.run(follow, {}, ["y"])
    assert rt.stats.h2d_bytes == 0
    np.testing.assert_array_equal(got["y"], first[keep[0]] * 2)


def test_refusals_before_anything_runs():
    x = np.ones(8)
    rt = TileRuntime(SimulatedDevice(), budget=100)
    big = Task("big", ("x",), "y", 64, lambda a: a[0])
    with pytest.raises(EinsumError, match="device task big needs 128 bytes at once .* over the device budget of 100"):
        rt.run([big], {"x": x}, ["y"])
    assert rt.stats.h2d_bytes == 0
    with pytest.raises(EinsumError, match="reads tile 'z', which is neither given nor made before it"):
        rt.run([Task("t", ("z",), "y", 8, lambda a: a[0])], {}, ["y"])
    with pytest.raises(EinsumError, match="eviction must be"):
        TileRuntime(SimulatedDevice(), budget=100, eviction="random")
    wrong = Task("wrong", ("x",), "y", 8, lambda a: a[0])  # makes 64 bytes, plans 8
    with pytest.raises(EinsumError, match="made 64 bytes, 8 were planned"):
        TileRuntime(SimulatedDevice(), budget=1000).run([wrong], {"x": x}, ["y"])


def test_belady_counts_the_offline_optimum_on_a_known_sequence():
    """Three tiles, room for two, read a b c a b: furthest-next-use sends a, b, c, then one of
    a/b again (4 transfers); a count any policy must reach at least."""
    one = np.ones(1)
    reads = ["a", "b", "c", "a", "b"]
    tasks = [Task(f"r{k}", (tid,), f"o{k}", 0, lambda a: np.empty(0)) for k, tid in enumerate(reads)]
    sizes = {"a": 8, "b": 8, "c": 8} | {f"o{k}": 0 for k in range(5)}
    assert belady_bytes(tasks, sizes, budget=16) == 4 * 8
    rt = TileRuntime(SimulatedDevice(), budget=16)
    rt.run(tasks, {"a": one, "b": one, "c": one}, [])
    assert rt.stats.h2d_bytes >= 4 * 8


def test_a_tile_left_by_an_earlier_run_is_written_back_before_it_is_evicted():
    """Run 1 keeps r on the device. Run 2 reads r only at its end and is given no host copy,
    under a budget that must evict r first: r goes back to the host and comes again."""
    n = 8
    rt = TileRuntime(SimulatedDevice(), budget=3 * n * 8)
    x = np.arange(float(n))
    rt.run([Task("r", ("x",), "r", n * 8, lambda a: a[0] + 1)], {"x": x}, ["r"])
    ys = {f"y{k}": np.full(n, float(k)) for k in range(3)}
    tasks = [Task(f"z{k}", (f"y{k}",), f"z{k}", n * 8, lambda a: a[0] * 2) for k in range(3)]
    tasks.append(Task("last", ("r", "z2"), "out", n * 8, lambda a: a[0] + a[1]))
    got = rt.run(tasks, ys, ["out", "z0"])
    np.testing.assert_array_equal(got["out"], x + 1 + 4)
    np.testing.assert_array_equal(got["z0"], np.zeros(n))
    assert rt.stats.peak_bytes <= 3 * n * 8
    assert ("evict", "r") in rt.stats.log and rt.stats.uploads.get("r") == 1  # it did leave, and came back
    _check_log(rt.stats)


def test_the_simulated_device_backend_keeps_tensors_resident_and_never_stale():
    """Through the session: a stored tensor read by a second plan is not sent again; once it is
    replaced, its new tiles are sent and the answer is the new one."""
    import eindecomp_sql as eds

    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((40, 30)), rng.standard_normal((40, 30))
    with eds.connect(backend="device-sim", tile_bytes=4096) as db:
        A = db.store("A", a)
        np.testing.assert_allclose(db.einsum("ij,kj->ik", A, A).to_numpy(), a @ a.T, rtol=1e-12)
        sent = db.backend.runtime.stats.h2d_bytes
        assert sent >= a.nbytes  # every tile of A went to the device (some of them twice over)
        np.testing.assert_allclose(db.einsum("ij->j", A).to_numpy(), a.sum(0), rtol=1e-12)
        assert db.backend.runtime.stats.h2d_bytes == 0  # still resident
        A = db.store("A", b, replace=True)
        np.testing.assert_allclose(db.einsum("ij->j", A).to_numpy(), b.sum(0), rtol=1e-12)
        assert db.backend.runtime.stats.h2d_bytes == b.nbytes
        cached = [tid for tid in db.backend.runtime.cache if tid[0] in ("stored", "array")]
        assert cached and all(tid[:3] == ("stored", "a", 2) for tid in cached)  # not version 1, no array
        db.einsum("ij,j->i", A, np.ones(30))
        assert not any(tid[0] == "array" for tid in db.backend.runtime.cache)
        with pytest.raises(EinsumError, match=r"step 0 \(einsum ij,ij->ij .*\) failed: join callable\(_fails_on_data\) raised ValueError: no"):
            db.einsum("ij,ij->ij", A, A, join=_fails_on_data)
        np.testing.assert_allclose(db.einsum("ij->i", A).to_numpy(), b.sum(1), rtol=1e-12)  # nothing left pinned


def _fails_on_data(x, y):
    if 40 in np.shape(x) or 20 in np.shape(x):
        raise ValueError("no")
    return x * y


def test_a_working_set_twice_the_device_budget_through_the_session():
    """``device_memory=`` caps the simulated device: a plan whose tiles add up to more than
    twice the cap completes with numpy's answer, evicting on the way and never above the cap."""
    import eindecomp_sql as eds

    rng = np.random.default_rng(12)
    a, b = rng.standard_normal((96, 80)), rng.standard_normal((80, 72))
    budget = 40_000
    with eds.connect(backend="device-sim", device_memory=budget, tile_bytes=4096) as db:
        A, B = db.store("A", a), db.store("B", b)
        got = db.einsum("ij,jk->ik", A, B).to_numpy()
        stats = db.backend.runtime.stats
        assert a.nbytes + b.nbytes + got.nbytes > 2 * budget
        assert stats.peak_bytes <= budget and stats.evictions > 0
        np.testing.assert_allclose(got, a @ b, rtol=1e-12)
        # a sum of 10,000 elements in 4 kB tiles is one task reading every tile: refused, named
        with pytest.raises(EinsumError, match="device task .* over the device budget of 40,000"):
            db.einsum("i->", np.ones(10_000))
        assert db.tensors() == ["A", "B"]
    with pytest.raises(EinsumError, match="device_memory sizes a device's tile cache; a 'duckdb' session on the CPU "
                                          "has none"):
        eds.connect(device="cpu", device_memory="1GB")
    with pytest.raises(EinsumError, match="memory budget 'lots'"):
        eds.connect(backend="device-sim", device_memory="lots")
