"""The device worker's runtime (TURNIP, ../shared/DESIGN.md): a tile cache in device memory under
a budget, and a scheduler that runs kernels in whatever order their inputs become resident.

GPU memory is small and host memory large; transfers are slow and their finish times are not
known in advance. So the worker gets a plan's work as tile *tasks* (a kernel reading tiles and
writing one, ``Task``) in a valid order, and as events arrive (a transfer done, a kernel done) it

- starts the next kernel whose inputs are resident, not only the next in the plan's order
  (``order="dynamic"``; ``"static"`` waits for the next in order);
- prefetches the inputs of the tasks ahead on its copy streams, overlapped with compute;
- makes room by evicting the tile whose next use is furthest away (``eviction="furthest"``:
  the plan knows the future; ``"lru"`` evicts the least recently used). A tile only the device
  holds goes back to the host first if anything still reads it, or the caller keeps it;
- never sends a tile that is resident again: tiles are named by ids that stay the same while the
  tile is unchanged, and the cache outlives one ``run``, so a second plan over the same weights
  finds them resident;
- sends results back to the host only when the caller keeps them or the cache must let them go.

The cache never holds more than its budget (checked on every allocation). A task whose inputs
and output cannot fit at once is refused before anything runs, naming it: nothing falls back
to the CPU behind the caller's back.

The device is an interface (``upload``, ``download``, ``run`` and the time each takes).
``SimulatedDevice`` runs the kernels in numpy with a memory budget and a transfer and compute
cost model (and random jitter, so completions come in different orders): the runtime's tests and
benchmark run against it on any machine.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

import numpy as np

from eindecomp_sql.errors import EinsumError


@dataclass(frozen=True)
class Task:
    """One kernel on the device: ``run(arrays)`` computes the tile ``output`` (``out_bytes``)
    from the tiles ``inputs``; ``flops`` sizes its compute time."""

    name: str
    inputs: tuple[Hashable, ...]
    output: Hashable
    out_bytes: int
    run: Callable[[list], object]
    flops: float = 0.0


class SimulatedDevice:
    """A device simulated in numpy: arrays are copied in and out, kernels run for real, and each
    transfer and kernel takes the time the cost model gives (bandwidths in bytes a second, a
    latency per transfer, a compute rate in flop/s plus a pass over the bytes), times a random
    factor in [1, 1 + jitter)."""

    def __init__(self, h2d: float = 25e9, d2h: float = 25e9, flops: float = 50e12, bandwidth: float = 2e12,
                 latency: float = 10e-6, copy_streams: int = 2, jitter: float = 0.0, seed: int = 0):
        self.h2d, self.d2h, self.flops, self.bandwidth, self.latency = h2d, d2h, flops, bandwidth, latency
        self.copy_streams = copy_streams
        self.jitter = jitter
        self._rng = random.Random(seed)

    def _noise(self) -> float:
        return 1.0 + self.jitter * self._rng.random()

    def upload_time(self, nbytes: int) -> float:
        return (self.latency + nbytes / self.h2d) * self._noise()

    def download_time(self, nbytes: int) -> float:
        return (self.latency + nbytes / self.d2h) * self._noise()

    def compute_time(self, task: Task, in_bytes: int) -> float:
        return (task.flops / self.flops + (in_bytes + task.out_bytes) / self.bandwidth) * self._noise()

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True)

    def download(self, array: np.ndarray) -> np.ndarray:
        return np.array(array, copy=True)

    def run(self, task: Task, arrays: list) -> np.ndarray:
        out = np.asarray(task.run(arrays))
        if out.nbytes != task.out_bytes:
            raise EinsumError(f"device task {task.name}: made {out.nbytes} bytes, {task.out_bytes} were planned")
        return out


@dataclass
class RuntimeStats:
    """What a run moved and held: host->device and device->host bytes and transfers (per tile
    id, to show none was sent twice while resident), the most bytes the cache held, evictions,
    and the simulated time the run took."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    uploads: dict = field(default_factory=dict)  # tile id -> times sent to the device
    peak_bytes: int = 0
    evictions: int = 0
    seconds: float = 0.0
    order: list = field(default_factory=list)  # task names in the order they started
    log: list = field(default_factory=list)  # ("upload" | "evict" | "free", tile id), in order


class _Tile:
    __slots__ = ("array", "nbytes", "dirty", "pins", "busy", "used")

    def __init__(self, nbytes: int):
        self.array = None
        self.nbytes = nbytes
        self.dirty = False  # only the device holds it
        self.pins = 0  # read or written by a running kernel
        self.busy = False  # being uploaded, or written back
        self.used = 0.0  # when last read or written (for LRU)


class TileRuntime:
    """The worker: a tile cache of ``budget`` bytes on ``device``, kept between runs.

    >>> dev = SimulatedDevice()
    >>> rt = TileRuntime(dev, budget=64)
    >>> x = np.arange(4.0)
    >>> double = Task("double", ("x",), "y", 32, lambda a: a[0] * 2)
    >>> rt.run([double], {"x": x}, keep=["y"])["y"]
    array([0., 2., 4., 6.])
    >>> rt.run([double], {"x": x}, keep=["y"]) and rt.stats.h2d_bytes  # x is still resident
    0
    """

    def __init__(self, device, budget: int, eviction: str = "furthest", order: str = "dynamic", lookahead: int = 64):
        if eviction not in ("furthest", "lru") or order not in ("dynamic", "static"):
            raise EinsumError(f"eviction must be 'furthest' or 'lru' and order 'dynamic' or 'static', got "
                              f"{eviction!r}, {order!r}")
        self.device = device
        self.budget = int(budget)
        self.eviction = eviction
        self.order = order
        self.lookahead = lookahead
        self.cache: dict[Hashable, _Tile] = {}  # resident (or arriving, or leaving) tiles
        self._used = 0  # their bytes
        self.stats = RuntimeStats()

    # -- bookkeeping ------------------------------------------------------------------------
    def _used_bytes(self) -> int:
        return self._used

    def _allocate(self, tid, nbytes: int) -> _Tile:
        self._drop(tid)
        tile = _Tile(nbytes)
        self.cache[tid] = tile
        self._used += nbytes
        if self._used > self.budget:  # the scheduler makes room first: this is its invariant
            raise AssertionError(f"device cache over its budget: {self._used} > {self.budget} bytes")
        self.stats.peak_bytes = max(self.stats.peak_bytes, self._used)
        return tile

    def _drop(self, tid) -> None:
        """``tid`` leaves the cache (every removal goes through here: it keeps the count)."""
        tile = self.cache.pop(tid, None)
        if tile is not None:
            self._used -= tile.nbytes

    def forget(self, ids: Iterable[Hashable]) -> None:
        """Let go of cached tiles no run will read again (a replaced tensor's, an array's)."""
        for tid in list(ids):
            tile = self.cache.get(tid)
            if tile is not None and not tile.pins and not tile.busy:
                self._drop(tid)

    # -- one run ----------------------------------------------------------------------------
    def run(self, tasks: list[Task], host: dict, keep: Iterable[Hashable] = (),
            on_done: Callable[[Task], None] | None = None) -> dict:
        """Run ``tasks`` (in an order valid for their dependencies) on tiles ``host`` (tile id ->
        host array) and return the tiles ``keep`` names, on the host. ``on_done(task)`` is
        called as each task finishes (what raises there stops the run)."""
        tasks = list(tasks)
        keep = set(keep)
        self.stats = RuntimeStats()
        host = dict(host)
        made = {t.output: k for k, t in enumerate(tasks)}
        for k, t in enumerate(tasks):
            for tid in t.inputs:
                if tid not in host and tid not in self.cache and made.get(tid, k) >= k:
                    raise EinsumError(f"device task {t.name} reads tile {tid!r}, which is neither given nor made "
                                      "before it")
        sizes = {tid: np.asarray(a).nbytes for tid, a in host.items()}
        sizes.update((t.output, t.out_bytes) for t in tasks)
        for tid, tile in self.cache.items():
            sizes.setdefault(tid, tile.nbytes)
        for t in tasks:
            need = sum(sizes[tid] for tid in set(t.inputs) | {t.output})
            if need > self.budget:
                raise EinsumError(f"device task {t.name} needs {need:,} bytes at once (inputs and output), over the "
                                  f"device budget of {self.budget:,}: cut its tiles smaller")
        for tid in made:  # a tile a task writes anew is not the cached one of that id
            if tid in self.cache and not self.cache[tid].pins:
                self._drop(tid)
        uses: dict[Hashable, list[int]] = {}
        for k, t in enumerate(tasks):
            for tid in t.inputs:
                uses.setdefault(tid, []).append(k)
        for tid, tile in self.cache.items():
            # a tile an earlier run left here that this run reads but was not given on the host:
            # only the device holds it now, so it goes back to the host before any eviction
            tile.dirty = tile.dirty or (tid not in host and (tid in uses or tid in keep))
        try:
            _Run(self, tasks, host, keep, sizes, uses, on_done).go()
        except BaseException:
            # a kernel failed (or the run was stopped): what this run made or had in flight
            # goes; what earlier runs left stays, unpinned
            for tid in list(self.cache):
                tile = self.cache[tid]
                tile.pins, tile.busy = 0, False
                if tid in made or tile.array is None:
                    self._drop(tid)
            raise
        return {tid: host[tid] for tid in keep}


class _Run:
    """The event loop of one ``TileRuntime.run``."""

    def __init__(self, rt: TileRuntime, tasks, host, keep, sizes, uses, on_done=None):
        self.rt, self.tasks, self.host, self.keep, self.sizes, self.uses = rt, tasks, host, keep, sizes, uses
        self.on_done = on_done
        self.dev = rt.device
        self.clock = 0.0
        self.events: list = []  # (time, seq, kind, payload)
        self.seq = 0
        self.started: set[int] = set()
        self.done: set[int] = set()
        self.next = 0  # the first task in order not started
        self.computing: int | None = None
        self.copies = 0  # uploads in flight
        self.writing = False  # a write-back in flight
        self.made = {t.output for t in tasks}

    # -- time ---------------------------------------------------------------------------------
    def _at(self, delay: float, kind: str, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (self.clock + delay, self.seq, kind, payload))

    def _next_use(self, tid) -> float:
        """Index of the next task not started that reads ``tid`` (inf: none)."""
        for k in self.uses.get(tid, ()):
            if k not in self.started:
                return k
        return math.inf

    def _needed(self, tid) -> bool:
        return tid in self.keep or self._next_use(tid) != math.inf

    # -- room ---------------------------------------------------------------------------------
    def _free_dead(self) -> None:
        """Let go of what this run made and nothing reads or keeps any more (inputs the caller
        gave stay cached for later runs until room is needed)."""
        cache = self.rt.cache
        for tid in [t for t, tile in cache.items() if t in self.made and not tile.pins and not tile.busy
                    and tile.array is not None and not self._needed(t)]:
            self.rt._drop(tid)
            self.rt.stats.log.append(("free", tid))

    def _victim(self, before: float, exclude=()):
        """The resident tile to evict (whose next use is after task index ``before``), by policy."""
        best, best_key = None, None
        for tid, tile in self.rt.cache.items():
            if tile.pins or tile.busy or tile.array is None or tid in exclude:
                continue
            nxt = self._next_use(tid)
            if nxt <= before:
                continue
            key = -nxt if self.rt.eviction == "furthest" else tile.used
            if best_key is None or key < best_key:
                best, best_key = tid, key
        return best

    def _reserve(self, k: int, tid=None) -> int:
        """Room the first task not started needs and does not hold yet (its output, its missing
        inputs): what work for a later task ``k`` must leave free, or the head would wait on
        tiles fetched for tasks after it while they wait on it."""
        head = self.next
        if k == head and tid is None or head >= len(self.tasks) or head in self.started:
            return 0
        t = self.tasks[head]
        cache = self.rt.cache
        missing = sum(self.sizes[i] for i in set(t.inputs) if i not in cache and i != tid)
        return t.out_bytes + missing

    def _make_room(self, nbytes: int, before: float, reserve: int = 0) -> bool:
        """Evict until ``nbytes`` more fit with ``reserve`` to spare, evicting only tiles whose
        next use is after task ``before``; False (having evicted nothing) if that cannot be done
        now. A tile only the device holds and something still needs is written back first: its
        room comes when that lands."""
        rt = self.rt
        self._free_dead()
        over = rt._used_bytes() + nbytes + reserve - rt.budget
        if over <= 0:
            return True
        victims = []
        while True:  # by policy, until enough could go
            tid = self._victim(before, exclude=victims)
            if tid is None:
                return False
            victims.append(tid)
            over -= rt.cache[tid].nbytes
            if over <= 0:
                break
        dirty = [tid for tid in victims if rt.cache[tid].dirty and self._needed(tid)]
        if dirty:
            if not self.writing:
                self._write_back(dirty[0])
            return False
        for tid in victims:
            rt._drop(tid)
            rt.stats.evictions += 1
            rt.stats.log.append(("evict", tid))
        return True

    # -- transfers and kernels ----------------------------------------------------------------
    def _upload(self, tid) -> None:
        rt = self.rt
        tile = rt._allocate(tid, self.sizes[tid])
        tile.busy = True
        rt.stats.h2d_bytes += tile.nbytes
        rt.stats.uploads[tid] = rt.stats.uploads.get(tid, 0) + 1
        rt.stats.log.append(("upload", tid))
        self.copies += 1
        self._at(self.dev.upload_time(tile.nbytes), "uploaded", tid)

    def _write_back(self, tid) -> None:
        tile = self.rt.cache[tid]
        tile.busy = True
        self.writing = True
        self.rt.stats.d2h_bytes += tile.nbytes
        self._at(self.dev.download_time(tile.nbytes), "written", tid)

    def _inputs_ready(self, k: int) -> bool:
        cache = self.rt.cache
        return all(tid in cache and cache[tid].array is not None and not cache[tid].busy for tid in self.tasks[k].inputs)

    def _start(self, k: int) -> bool:
        t = self.tasks[k]
        cache = self.rt.cache
        for tid in t.inputs:
            cache[tid].pins += 1  # before making room: they must stay
        if not self._make_room(t.out_bytes, before=k, reserve=self._reserve(k)):
            for tid in t.inputs:
                cache[tid].pins -= 1
            return False
        out = self.rt._allocate(t.output, t.out_bytes)
        out.pins = 1
        self.started.add(k)
        self.computing = k
        self.rt.stats.order.append(t.name)
        in_bytes = sum(self.sizes[tid] for tid in t.inputs)
        self._at(self.dev.compute_time(t, in_bytes), "computed", k)
        return True

    def _try_compute(self) -> None:
        if self.computing is not None:
            return
        while self.next in self.started:
            self.next += 1
        if self.next >= len(self.tasks):
            return
        window = [self.next] if self.rt.order == "static" else [
            k for k in range(self.next, min(len(self.tasks), self.next + self.rt.lookahead)) if k not in self.started]
        for k in window:
            if self._inputs_ready(k) and self._start(k):
                return

    def _try_prefetch(self) -> None:
        """Upload the inputs of the tasks ahead, in order of need, while a copy stream is free
        and room can be made without evicting anything needed sooner."""
        cache = self.rt.cache
        end = min(len(self.tasks), self.next + self.rt.lookahead)
        window: set = set()  # tiles the tasks up to k touch: fetch no further than they fit at once
        window_bytes = 0
        for k in range(self.next, end):
            if k in self.started:
                continue
            for tid in (*self.tasks[k].inputs, self.tasks[k].output):
                if tid not in window:
                    window.add(tid)
                    window_bytes += self.sizes[tid]
            if window_bytes > self.rt.budget:
                return  # a tile fetched this early would be evicted before its use
            for tid in self.tasks[k].inputs:
                if self.copies >= self.dev.copy_streams:
                    return
                if tid in cache or tid not in self.host:
                    continue  # resident (or arriving), or not made yet
                if not self._make_room(self.sizes[tid], before=k, reserve=self._reserve(k, tid)):
                    return
                self._upload(tid)

    def _step(self) -> None:
        self._try_compute()
        self._try_prefetch()
        self._try_compute()

    def go(self) -> None:
        rt = self.rt
        self._step()
        while len(self.done) < len(self.tasks):
            if not self.events:
                self._unstick()
                continue
            self.clock, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(payload)
            self._step()
        rt.stats.seconds = self.clock
        for tid in self.keep:  # results kept and still only on the device come back now
            tile = rt.cache.get(tid)
            if tid not in self.host and tile is not None:
                self.host[tid] = self.dev.download(tile.array)
                rt.stats.d2h_bytes += tile.nbytes
                tile.dirty = False
        self._free_dead()

    def _unstick(self) -> None:
        """Nothing in flight and nothing could start: the next task's inputs are crowded out by
        tiles needed sooner. Evict by policy among everything not pinned, then go on."""
        k = self.next
        cache = self.rt.cache
        t = self.tasks[k]
        for tid in t.inputs:
            if tid not in cache and tid in self.host:
                victim = self._victim(before=-1, exclude=t.inputs)
                while victim is not None and self.rt._used_bytes() + self.sizes[tid] > self.rt.budget:
                    tile = cache[victim]
                    if tile.dirty and self._needed(victim):
                        self._write_back(victim)
                        return
                    self.rt._drop(victim)
                    self.rt.stats.evictions += 1
                    self.rt.stats.log.append(("evict", victim))
                    victim = self._victim(before=-1, exclude=t.inputs)
                if self.rt._used_bytes() + self.sizes[tid] <= self.rt.budget:
                    self._upload(tid)
                    return
        raise EinsumError(f"device runtime: task {t.name} cannot start (inputs {list(t.inputs)} not resident and "
                          "no room can be made)")  # cannot happen: every task fits the budget alone

    # -- events -------------------------------------------------------------------------------
    def _on_uploaded(self, tid) -> None:
        tile = self.rt.cache[tid]
        tile.array = self.dev.upload(self.host[tid])
        tile.busy = False
        tile.used = self.clock
        self.copies -= 1

    def _on_written(self, tid) -> None:
        tile = self.rt.cache[tid]
        self.host[tid] = self.dev.download(tile.array)
        tile.busy = False
        tile.dirty = False
        self.writing = False

    def _on_computed(self, k: int) -> None:
        t = self.tasks[k]
        cache = self.rt.cache
        arrays = [cache[tid].array for tid in t.inputs]
        out = cache[t.output]
        out.array = self.dev.run(t, arrays)
        out.dirty = True
        out.pins = 0
        out.used = self.clock
        self.host.pop(t.output, None)  # a stale host copy of an id written anew
        for tid in t.inputs:
            cache[tid].pins -= 1
            cache[tid].used = self.clock
        self.computing = None
        self.done.add(k)
        if self.on_done is not None:
            self.on_done(t)


def belady_bytes(tasks: list[Task], sizes: dict, budget: int, resident: Iterable[Hashable] = ()) -> int:
    """Host->device bytes of running ``tasks`` one after the other in the given order with
    the offline eviction (furthest next use, Belady's): the count to compare a run against.
    Tiles a task makes start on the device; ``resident`` ones are there at the start."""
    uses: dict[Hashable, list[int]] = {}
    for k, t in enumerate(tasks):
        for tid in t.inputs:
            uses.setdefault(tid, []).append(k)

    def next_use(tid, k):
        return next((j for j in uses.get(tid, ()) if j >= k), math.inf)

    cache = set(resident)
    moved = 0
    for k, t in enumerate(tasks):
        need = set(t.inputs) | {t.output}
        for tid in list(t.inputs) + [t.output]:
            if tid in cache:
                continue
            while sum(sizes[x] for x in cache) + sizes[tid] > budget:
                victims = [x for x in cache if x not in need]
                cache.remove(max(victims, key=lambda x: next_use(x, k)))
            cache.add(tid)
            if tid != t.output:
                moved += sizes[tid]
    return moved


def belady_of_calls(calls: list, budget: int, resident: Iterable[Hashable] = ()) -> int:
    """``belady_bytes`` for kernel calls as the SQL path's device kernels record them
    (``KernelState.device_trace``: per call, the tile ids read, the id written, and each id's
    bytes); ``resident``: ids on the device when the calls began."""
    sizes: dict = {}
    tasks = []
    for k, (reads, write, nbytes) in enumerate(calls):
        sizes.update(nbytes)
        tasks.append(Task(f"call{k}", tuple(reads), write, nbytes[write], run=None))
    return belady_bytes(tasks, sizes, budget, resident=set(resident) & set(sizes))
