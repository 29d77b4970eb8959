"""The public face: a session over a DuckDB database, tensors stored in it, and einsum.

Holds no planning or SQL logic of its own: it resolves operands, calls parse -> lower -> plan
-> compile -> backend, and turns tiles back into numpy.
"""

from __future__ import annotations

import atexit
import collections
import collections.abc
import dataclasses
import contextlib
import itertools
import math
import os
import sys
import weakref

import numpy as np

from .arrays import as_array
from .backends import Target, create_backend
from .backends.running import CtrlCMark, settle, ticking
from .errors import FATAL_ADVICE, EinsumError, EinsumTypeError, Interrupted, duckdb_fatal, duckdb_said, warn
from .notation.checks import can_cast, check_name
from .notation.sublist import sublist_spec
from .plan import DEFAULT_TILE_BYTES, Plan, TiledValue, plan_einsum
from .plan.einsum import RESULT
from .plan.tiling import check_count
from .progress import reporter
from .udfs.pool import in_kernel
from .plan.cost import in_memory_terms, parse_memory, plan_share, rounded_up
from .plan.steps import format_bytes

# a session called from a tile kernel: DuckDB runs the kernel's query and waits for it, so the
# call waited for ever on the session (a trial), or re-entered its running plan
FROM_KERNEL = ("eindecomp_sql was called from inside a tile kernel (a join callable, say), which runs inside a "
               "query: compute there with numpy on the tiles it is given")

# a session called from a progress callback off the plan's thread, while the plan holds it
FROM_TICK = ("this progress callback was called between the steps of a plan that this session runs on another "
             "thread, which it would wait for: use the session from the callback only when it is called on the "
             "plan's own thread (at each step's end: threading.current_thread() is the caller's), or after the plan")

# under a memory budget, the default tile is at most this fraction of it (see __init__)
BUDGET_TILES = 64
# with device="auto", a step of fewer element operations (the product of its labels' sizes) runs
# on the host: 2**26, a 406³ GEMM, ~6 ms of numpy on 2 cores here, against a GPU call's fixed
# cost (a launch, a transfer each way, and CuPy compiling each kernel the first time it runs)
AUTO_MIN_WORK = 1 << 26
# with a device budget (device_memory), the default tile is at most this fraction of it: a
# kernel call holds a few operand tiles, its result and temporaries on the device at once
DEVICE_TILES = 8
from .tensor import Tensor


def _load_arrows_pandas_shim() -> None:
    """pyarrow imports pandas on its first ``to_numpy()`` (0.3-0.8 s), and a KeyboardInterrupt
    raised during that import is swallowed by pyarrow: a Ctrl-C or SIGTERM during a process's
    first export, read or element-form store was lost, and the file written (a trial: 6 of 10
    runs). So it happens here, as the session module loads, outside any call Ctrl-C stops; the
    first einsum paid for it anyway."""
    import pyarrow as pa

    pa.array([0], pa.int64()).to_numpy()


_load_arrows_pandas_shim()


class Session:
    """eindecomp_sql on one DuckDB database.

    >>> db = connect()                                   # in memory; or a path, or a connection
    >>> A = db.store("A", np.ones((4, 3), np.float32))
    >>> db.einsum("ij->j", A).to_numpy()
    array([4., 4., 4.], dtype=float32)
    """

    def __init__(self, database=None, *, tile_bytes: int | None = None, workers: int | None = None,
                 memory=None, read_only: bool = False, backend: str = "duckdb", device_memory=None, spark=None,
                 device: str = "auto", allow_tf32: bool = False, spark_database=None):
        # a Ctrl-C while the session opens is KeyboardInterrupt, as in every call: the
        # statements that open it (catalog, sweep, the SQL interface) ran unwatched, and
        # duckdb-python made the handler's KeyboardInterrupt a RuntimeError('Query
        # interrupted') (a crash trial); the backend closes what it opened either way
        mark = CtrlCMark()
        try:
            mark.install()
            self._open(database, tile_bytes=tile_bytes, workers=workers, memory=memory, read_only=read_only,
                       backend=backend, device_memory=device_memory, spark=spark, device=device,
                       allow_tf32=allow_tf32, spark_database=spark_database)
        except RuntimeError as error:
            translated = mark.translate(error)
            if translated is error:
                raise
            raise translated from None
        finally:
            settle(mark.remove)

    def _open(self, database, *, tile_bytes, workers, memory, read_only, backend, device_memory, spark, device,
              allow_tf32, spark_database):
        # The plans' knobs: largest tile a plan creates, join tasks per step, memory budget.
        # One worker by default: kernels already use every core inside a call (docs/DESIGN.md).
        # Checked before the connection opens, so bad options leave nothing open.
        self._pid = os.getpid()
        if tile_bytes is not None:
            tile_bytes = check_count(tile_bytes, "tile_bytes")
        if workers is not None:
            workers = check_count(workers, "workers")
        self.memory = parse_memory(memory)
        if not isinstance(read_only, bool):
            raise EinsumError(f"read_only must be True or False, got {read_only!r}")
        self._counter = itertools.count()
        options = {}
        self.device = _pick_device(device, allow_tf32, backend)
        if device_memory is not None:
            if backend != "device-sim" and self.device == "cpu":
                raise EinsumError(f"device_memory sizes a device's tile cache; a {backend!r} session on the CPU has "
                                  "none (device='cuda' and the 'device-sim' backend have one)")
            options["device_memory"] = parse_memory(device_memory)
        if spark is not None:
            if backend != "spark":
                raise EinsumError(f"spark= is the Spark session of backend 'spark', not of {backend!r}")
            options["spark"] = spark
        if spark_database is not None:
            if backend != "spark":
                raise EinsumError(f"spark_database= names where backend 'spark' keeps tensors as tables; backend "
                                  f"{backend!r} has no Spark database")
            options["spark_database"] = spark_database
        if backend == "duckdb":
            # device="auto" sends a step to the GPU only when it is big enough to pay for it;
            # device="cuda" sends every step it can
            options.update(device=self.device, allow_tf32=allow_tf32,
                           device_min_work=AUTO_MIN_WORK if device == "auto" and self.device != "cpu" else 0)
        self.backend = create_backend(backend, database, read_only=read_only, **options)
        if self.memory is not None:
            try:  # the engine's own limit follows the budget (DuckDB: memory_limit, spilling)
                self.backend.set_memory(self.memory)
            except BaseException:
                self.backend.close()
                raise
        # the engine's own parallelism where it has one (Spark's default parallelism), else 1;
        # tiles no bigger than the engine moves well (Spark: rows through the JVM)
        self.workers = workers if workers is not None else getattr(self.backend, "default_workers", 1)
        # bumped whenever this session may have changed the catalog: a Tensor handle checked at
        # the current count is still what the catalog says (Tensor._live_value)
        self.catalog_epoch = 0
        # lower-cased names this session wrote over or dropped: a SQL interface query reading one
        # checks, in its own transaction, that the tensor is still what it was planned from
        # (sql_interface._unchanged; ~0.7 ms a query, so only where it can have changed)
        self.rewritten: set[str] = set()
        self.tile_bytes = tile_bytes if tile_bytes is not None else min(
            DEFAULT_TILE_BYTES, getattr(self.backend, "max_tile_bytes", DEFAULT_TILE_BYTES))
        if tile_bytes is None and self.device != "cpu" and device_memory is not None:
            # a kernel call holds its operands' tiles, its result and temporaries on the device:
            # tiles come from the device budget the user gave, not from the card's memory
            self.tile_bytes = max(1, min(self.tile_bytes, options["device_memory"] // DEVICE_TILES))
        # what store() cuts when no tile is given: under a budget at most a 64th of it (a
        # statement holds several tiles of each operand, two or three times each), a power of 4
        # elements (square tiles for square matrices: 12 MB tiles of 1024x2048 made both GEMM
        # operands re-tile; io.Wanted.square). Plans are not held to it: their steps fit
        # the budget by their projected peaks, and a budget's GEMM wants panels larger than it
        # (4096² float32 under 50 MB: 10.6 s in 4 MB panels, 27.8 s in 256 KB square tiles)
        # An engine may store smaller tiles than its plans make (Spark: stored row panels keep
        # a GEMM's tasks apart, while a plan may join them with a whole operand)
        self._tile_bytes_given = tile_bytes is not None  # (a tile_bytes given is kept as is)
        self._store_cap = self.tile_bytes if tile_bytes is not None else min(
            self.tile_bytes, getattr(self.backend, "max_store_tile_bytes", self.tile_bytes))
        self.store_square = tile_bytes is None and self.memory is not None
        self.store_tile_bytes = self.store_tile_bytes_under(self.memory)
        # one lock for the session and its backend: a session is shared between threads, and
        # every call (plan, register, run, read back) must see the connection to itself
        self._lock = self.backend.lock
        # temporary results whose Tensor was collected: dropped at the next call (or at once
        # when the session is idle), never from inside another call's transaction
        self._garbage: collections.deque[str] = collections.deque()
        # names of dropped temporary results, used again: a name seen before is a cache hit
        # where statements are bound to tables (a fresh name costs sqlglot ~0.1 ms per call)
        self._free_names: list[str] = []
        self._depth = 0
        try:
            # through a holder that close() empties: the UDF lives in the connection (C++), where
            # a reference to the session, which holds the connection, is a cycle no collector
            # sees (a connection the user passed in stayed alive after both were closed and
            # dropped). While the session is open it stays alive for the SQL interface's sake.
            self._sql_target = _Holder(self)
            self.backend.register_sql_interface(self._sql_target.einsum_sql)
        except BaseException:
            self.backend.close()
            raise
        # what a session dropped without close() is found by (_close_dropped_sessions): its file,
        # and how many refer to its connection before the user can (db.connection held: kept)
        self._database = os.fspath(database) if isinstance(database, (str, os.PathLike)) else None
        self._con_refs = sys.getrefcount(self.backend.con) if getattr(self.backend, "con", None) is not None else 0
        _open_sessions.add(self)

    _pid = None  # set in __init__: the process the session belongs to

    @contextlib.contextmanager
    def _call(self, fresh: bool = True):
        """Hold the session for one call: the lock, a check that it is open, and the drop of
        temporary results collected since the last call. ``fresh``: an ``interrupt()`` asked
        before the call took the session is not for it (False: a store's, asked while it read
        its source)."""
        if os.getpid() != self._pid:
            # a forked child: DuckDB's threads, our locks' holders and the file's lock are the
            # parent's (a child waited for ever on a lock a parent thread held, or wrote into
            # a file the parent also writes: lost data, a corrupt file once)
            raise EinsumError(f"this session was opened in process {self._pid}, not this one (a fork): open a "
                              "session of this process with eds.connect()")
        if in_kernel():
            # DuckDB is running the kernel's query and waits for it: a call from there waited
            # for ever on this session (or re-entered its running plan), Ctrl-C included (a trial)
            raise EinsumError(FROM_KERNEL)
        stopper = getattr(self.backend, "stopper", None)  # interrupt(): DuckDB's backend
        if not fresh and stopper is not None and not _held_here(self._lock):
            stopper.waiting()  # a store's, its source read: waiting its turn, as other calls do
        if ticking():
            # a progress callback between the steps of a plan this session runs on another thread:
            # the call waited for the plan to end, and its error was lost with the plan committed
            # (a documentation audit); refused, the error stops the plan as the callback's does
            if not self._lock.acquire(blocking=False):
                raise EinsumError(FROM_TICK)
            self._lock.release()
        with self._lock:
            if self.backend.closed:
                raise EinsumError("this session is closed; open another with eds.connect()")
            # the depth goes up and down next to the try, with nothing between that runs Python
            # code (a Ctrl-C handler runs at such points): a Ctrl-C inside the mark's removal
            # once left the depth at 1 for good (no later call dropped temporary results)
            mark = CtrlCMark(stopper) if self._depth == 0 else None
            self._depth += 1
            try:
                if mark is not None:
                    mark.install()
                if self._depth == 1:
                    if stopper is not None:
                        stopper.call(fresh)
                    self.backend.recover()
                    self._collect()
                yield
            except RuntimeError as error:
                translated = mark.translate(error) if mark is not None else error
                if translated is error:
                    raise
                raise translated from None
            except Exception as error:
                fatal = duckdb_fatal(error)
                if fatal is not None:
                    # the disk filled at a checkpoint, say: every later call failed with DuckDB's
                    # raw "database has been invalidated", which said nothing of what to do (a
                    # crash trial)
                    said = str(error) if isinstance(error, EinsumError) else duckdb_said(fatal)
                    raise EinsumError(f"{said}; {FATAL_ADVICE}") from None
                if type(error).__name__ == "ConnectionException" and "closed" in str(error):
                    # db.connection.close() by hand: DuckDB's "Connection already closed!" named
                    # neither the session nor what to do (a trial)
                    raise EinsumError("this session's DuckDB connection was closed (db.connection.close() closes "
                                      "the session's too): open another with eds.connect()") from None
                raise
            finally:
                self._depth -= 1
                if mark is not None:  # the outermost call: its handler out, and interrupt()'s stop forgotten
                    settle(mark.remove)

    @staticmethod
    def _check_overwrites(plan: Plan, inputs: dict, outputs: dict, replace: bool) -> None:
        """Refuse a kept output written over a table the plan reads where a statement reads it
        after the output's step has begun writing it: that step in several statements (its
        batches) or a later step would read the half-made result (wrong answers). One statement
        reading and writing it is safe (DuckDB reads the old table whole before CREATE OR
        REPLACE swaps it), and so are steps before the output's (a reduction as partial and
        combine steps reads the table in its first step only)."""
        if not replace:  # an existing table is refused anyway ("already exists")
            return
        from .plan.steps import step_reads, step_target

        read: dict[str, set[str]] = {}  # table -> every value bound to it (two inputs may read one: a review)
        for value, t in inputs.items():
            if isinstance(t, str):
                read.setdefault(t.lower(), set()).add(value)
        for name, target in outputs.items():
            if target.table is None or target.temporary or target.table.lower() not in read:
                continue
            values = read[target.table.lower()]
            written = next((k for k, s in enumerate(plan.steps) if step_target(s).name == name), None)
            if written is not None and not any(
                    (k > written or (k == written and s.batches > 1)) and values & {v.name for v in step_reads(s)}
                    for k, s in enumerate(plan.steps)):
                continue
            raise EinsumError(f"out={target.table!r} is also read by this plan ({len(plan.steps)} step(s), "
                              f"{sum(s.batches for s in plan.steps)} statement(s)): a later statement would read the "
                              "half-written result; write to another table (and drop or rename afterwards)")

    def _collect(self) -> None:
        while self._garbage:
            # forgotten, then dropped: a drop that keeps failing must not fail every later call
            # (a signal handler's error between the two leaves a TEMP table to the session's end)
            name = self._garbage.popleft()
            self.backend.drop_table(name)
            if len(self._free_names) < 64:
                self._free_names.append(name)

    def _temp_name(self) -> str:
        """A table name for a temporary result: a dropped one's, else a new one."""
        return self._free_names.pop() if self._free_names else f"_eds_r{next(self._counter)}"

    def _release(self, table: str) -> None:
        """A temporary result's Tensor was collected (or closed): drop its table."""
        if os.getpid() != self._pid:  # a forked child's copy: the parent's connection is not its own
            return
        self._garbage.append(table)
        # drop now if no call is in progress (a finalizer can run inside one, on any thread)
        if self._lock.acquire(blocking=False):
            try:
                if self._depth == 0 and not self.backend.closed:
                    self.backend.recover()  # not inside what a cut-short call left open
                    self._collect()
            finally:
                self._lock.release()

    def _execute(self, plan: Plan, inputs: dict, targets: dict, replace: bool, progress) -> dict[str, Tensor]:
        """Run ``plan`` and hand back a Tensor per output. A temporary result's table lives as
        long as its Tensor, so when the call ends in an exception (a Ctrl-C landing after the
        commit, before the Tensors exist) no Tensor will drop it: it is dropped here."""
        kept = any(not t.temporary for t in targets.values())
        if replace:
            self.rewritten.update(t.table.lower() for t in targets.values() if not t.temporary and t.table)
        try:
            try:
                self.backend.execute(plan, inputs, targets, replace=replace, progress=reporter(progress))
            finally:
                self.catalog_epoch += kept  # a stored output may replace a tensor (failed: no harm)
            return {v.name: self._tensor(v, targets[v.name].table, targets[v.name].temporary) for v in plan.outputs}
        except BaseException:
            for t in targets.values():
                if t.temporary:
                    try:
                        self.backend.drop_table(t.table)
                    except Exception:  # noqa: BLE001 - the call's own error is the one to report
                        pass
            raise

    def _tensor(self, value: TiledValue, table: str | None = None, temporary: bool = False) -> Tensor:
        """A Tensor handle on ``value`` stored in ``table`` (default: its name); a temporary
        result's table lives as long as its handle."""
        # a Tensor's value is named after its table: plans tell operands apart by name
        if table is not None and value.name != table:
            value = dataclasses.replace(value, name=table)
        t = Tensor(self, value, temporary)
        if temporary:
            object.__setattr__(t, "_finalizer", weakref.finalize(t, self._release, value.name))
        else:  # made from what the catalog says now
            object.__setattr__(t, "_epoch", self.catalog_epoch)
        return t

    @property
    def connection(self):
        """The DuckDB connection (``einsum`` and ``einsum_elements`` table functions are on it)."""
        return self.backend.con

    def cursor(self):
        """A new DuckDB cursor of ``connection`` with the SQL functions on it (``einsum``,
        ``einsum_elements``, ``einsum_topk``): one per thread runs SQL einsums at once, where a
        connection runs one statement at a time (DuckDB's "connection is busy"). Closed by you
        (``cur.close()``), or with the connection; its functions go when the session closes."""
        sql_cursor = getattr(self.backend, "sql_cursor", None)
        if sql_cursor is None:
            raise EinsumError(f"cursor() is the DuckDB backend's: the {self.backend.name} backend has no SQL interface")
        return sql_cursor()

    def store_tile_bytes_under(self, memory: int | None) -> int:
        """What store() cuts when no tile is given, in this session with ``memory=`` (its own, or
        another a refusal names): a 64th of a budget, where the session picks its store tiles
        (no ``tile_bytes=`` given)."""
        if memory is None or self._tile_bytes_given:
            return self._store_cap
        return max(1, min(self._store_cap, memory // BUDGET_TILES))

    # -- tensors ----------------------------------------------------------------------------
    def store(self, name: str, source, tile=None, keys=None, replace: bool = False, *, shape=None, dtype=None,
              index=None, value=None) -> Tensor:
        """Store ``source`` as tiled table ``name`` and return its Tensor.

        ``source`` is one of
          - an array: numpy, or anything numpy reads as numbers (a pyarrow Array, a list, ...; a
            pyarrow array of fixed-size lists is 2-D, one row per list; a pandas Series with the
            default index, its values: one whose index levels are named is element rows, one
            with an unnamed index of other labels is refused);
          - a table: a pyarrow Table / RecordBatch / RecordBatchReader, a pandas DataFrame, a
            DuckDB relation (``db.connection.sql(...)``, read by DuckDB), any object with
            ``__arrow_c_stream__`` (polars);
          - a path (str or ``pathlib.Path``) to a file: ``.npy`` (memory-mapped and cut tile by
            tile), ``.parquet`` (read by DuckDB) or ``.arrow`` / ``.feather`` (Arrow IPC). On the
            DuckDB backend a ``.npy`` file or a tiled Parquet / Arrow file never passes through
            Python whole (docs/LAYOUT.md);
        and a table is in one of three forms:
          - **tiled**: integer key columns and a binary ``tile`` column, as ``Tensor.to_arrow()``
            and ``Tensor.to_parquet()`` write it. Shape, dtype, tile shape, key names and byte
            order come from the ``eindecomp_sql.*`` schema metadata (docs/LAYOUT.md); without it,
            give ``shape=``, ``dtype=`` and ``tile=`` (the tile shape it is cut in). Tiles are
            checked (one per key, each the right number of bytes) and stored as they are.
          - **element form**, one row per element (sparse COO: elements not present are 0):
            integer index columns, one per dimension, and one numeric value column. The value
            column is ``value=``, else a column named ``value``, else the only column that is
            not an integer; the index columns are ``index=`` (names, in dimension order), else
            every other column in order (all must be integers; for a table carrying this
            package's metadata, in the order of its keys unless ``shape=`` is given). The shape is ``shape=``, else
            the table's metadata, else the largest index + 1 in each dimension. Duplicate,
            negative and out-of-range indices are refused, and so is a dense array larger than
            the session's ``memory=`` (without one, the machine's memory).
          - **array form**, one row per matrix row (an embeddings table, as the SQL functions
            read it): one array column (fixed-size or plain lists of one length, no NULLs) and at
            most one other column, a key of any orderable type: row ``r`` is the ``r``-th row in
            key order (in table order without a key); ``value=`` / ``index=`` name the two.

        ``tile`` is the tile shape (chosen to fit the session's ``tile_bytes`` if not given),
        ``keys`` the key column names (``d0, d1, ...``, or a tiled table's own), ``dtype`` a
        dtype to cast values to (numpy's same_kind rule), ``replace`` overwrites an existing
        table. Anything else is an ``EinsumError`` that says what to do (scipy sparse: call
        ``.toarray()``), and a failed store leaves nothing behind.

        >>> db = connect()
        >>> import pyarrow as pa
        >>> db.store("T", pa.table({"i": [0, 1], "j": [2, 0], "value": [1.5, -1.0]})).to_numpy()
        array([[ 0. ,  0. ,  1.5],
               [-1. ,  0. ,  0. ]])
        """
        check_name(name)
        _check_replace(replace)  # before reading: replace="no" is truthy
        # reading the source is part of the call interrupt() stops (the session's own ``_call``
        # ends it, or the ``except`` below where reading failed); a store inside this thread's
        # call (a progress callback's, on the plan's thread) is part of that call already
        stopper = getattr(self.backend, "stopper", None)
        if stopper is not None and self._depth and _held_here(self._lock):
            stopper = None
        try:
            if stopper is not None:
                stopper.call(fresh=True)
            from . import io

            # read the source before taking the session: a relation may call back into this
            # session (SELECT ... FROM einsum(...)) from DuckDB's threads
            # files stream into DuckDB (a batch of tiles at a time, or read by DuckDB itself); the
            # other backends take whole tables
            if isinstance(source, str) and not os.path.splitext(source)[1] and os.sep not in source \
                    and self.backend.lookup(source) is not None:
                source = self.tensor(source)  # a stored tensor's name: stored again (re-cut, renamed, cast)
            if isinstance(source, Tensor) and self.memory is not None:
                self._check_whole_read(name, source)
            want = io.Wanted(tile, keys, shape, dtype, index, value, tile_bytes=self.store_tile_bytes,
                             square=self.store_square, memory=self.memory)
            # an engine may read a source of its own without this process holding it whole (a
            # Spark DataFrame on Spark: tiles made by Spark); else every source is read here
            own = getattr(self.backend, "read_frame", None)
            incoming = own(source, f"store({name!r})", io._wanted_checked(want, f"store({name!r})")) \
                if own is not None else None
            if incoming is None:
                incoming = io.read_source(source, f"store({name!r})", want, con=self.backend.con,
                                          stream=self.backend.streams_in)
            stored = TiledValue(name, incoming.shape, incoming.dtype, incoming.tile, incoming.keys)
        except BaseException:
            if stopper is not None:
                settle(stopper.done)
            raise
        try:
            with self._call(fresh=False):  # an interrupt() while the source was read stops this call
                if replace:
                    self.rewritten.add(name.lower())
                try:
                    self.backend.store_tiles(stored, incoming.tiles, replace=replace)
                finally:
                    self.catalog_epoch += 1
        except Exception as e:
            # a check (or a read) that failed inside the stream reaches us through the engine's
            # error: raise the check's own
            cause = incoming.failure(e)
            if cause is not None and cause is not e:
                raise cause from None
            raise
        return self._tensor(stored)

    def _check_whole_read(self, name: str, source: Tensor) -> None:
        """A stored tensor stored again (re-cut, renamed, cast) is read whole, as ``to_numpy``
        reads it (~3x its bytes while it converts: README): under a budget that cannot hold that,
        refused before anything is read. The planner's own advice, db.store('A', 'A', tile=...,
        replace=True), rose 798 MB under memory="400MB" for a 268 MB tensor (a budget trial)."""
        size = math.prod(source.shape) * np.dtype(source.dtype).itemsize
        need = WHOLE_READ_FACTOR * size
        if need > self.memory and source.temporary:
            # a result computed without out= has no source data, and its table's name is ours
            raise EinsumError(
                f"store({name!r}): storing a computed result reads it whole, about {WHOLE_READ_FACTOR}x its "
                f"{format_bytes(size)} ({format_bytes(need)}), more than memory={format_bytes(self.memory)}: name it "
                f"where it is computed instead (db.einsum(..., out={name!r}))")
        if need > self.memory:
            raise EinsumError(
                f"store({name!r}): storing stored tensor {source.name!r} again reads it whole, about "
                f"{WHOLE_READ_FACTOR}x its {format_bytes(size)} ({format_bytes(need)}), more than memory="
                f"{format_bytes(self.memory)}: store it from its source data (an array, a .npy or Parquet path) with "
                f"the tile= you want, or do this in a session with memory= of at least {rounded_up(need)} (or none)")

    def tensor(self, name: str) -> Tensor:
        """A stored tensor by name (also after reopening a file database)."""
        check_name(name)
        with self._call():
            v = self.backend.lookup(name)
            if v is None:
                said = f"no stored tensor named {name!r}; stored: {', '.join(self.backend.names()) or 'none'}"
                if getattr(self.backend, "holds_table", lambda n: False)(name):
                    # a user's own table given to the Python API (a trial): what reads it
                    said += (f". {name!r} is a table or view of the database, not a stored tensor: db.einsum and "
                             f"the SQL functions read it as it is (element or array form, docs/sql_interface.md); "
                             f"to use it here, store it: db.store('{name}_t', db.connection.table('{name}'))")
                raise EinsumError(said)
        return self._tensor(v)

    def tensors(self) -> list[str]:
        """Names of the stored tensors (the catalog), sorted."""
        with self._call():
            return self.backend.names()

    def drop(self, name) -> None:
        """Drop stored tensor ``name`` (a name or its Tensor): its table and its catalog entry.
        A temporary result's Tensor (computed without ``out=``) has its table dropped now, as
        on leaving its ``with`` block; the handle reads no more."""
        if isinstance(name, Tensor):
            if name.session is not self:
                raise EinsumError(f"drop: {name.name!r} is a tensor of another session")
            if name.temporary:
                name.__exit__(None, None, None)
                return
            handle, name = name, name.name
        else:
            handle = None
        if isinstance(name, str) and name.lower().startswith("_eds_r"):
            # a temporary result's table, by the name its handle shows (a trial: "invalid tensor
            # name '_eds_r0' ... reserved")
            raise EinsumError(f"drop: {name!r} is a temporary result's table, dropped when its Tensor is collected; "
                              "to drop it now, pass the Tensor itself (db.drop(result)) or use it in a with block")
        with self._call():
            if handle is not None:
                # a handle whose tensor was since replaced by another layout (or dropped) is
                # refused here as by every other use: it dropped the newer tensor (a trial)
                handle._live_value()
            self.tensor(name)
            self.rewritten.add(name.lower())
            try:
                self.backend.drop(name)
            finally:
                self.catalog_epoch += 1

    # -- einsum -----------------------------------------------------------------------------
    def _resolve(self, operands, what=None, spec=None) -> tuple[list[TiledValue], dict[str, str | np.ndarray]]:
        """Operands as plan values, and what each is bound to: a stored tensor's table (the
        value is named after it), or an array (free: the plan picks its tiling). ``what``:
        how errors name each operand (default ``operand k``). With the einsum's ``spec``, a
        name that is no stored tensor may be a table of the database in element or array form,
        read as the SQL functions read it (``sql_functions.table_values``): bound to its table
        operand, which the backend packs into tiles as the plan cuts them."""
        values, inputs = [], {}
        tables = []  # positions of table operands
        for k, x in enumerate(operands):
            where = what[k] if what is not None else f"operand {k}"
            fresh = isinstance(x, str)
            if fresh and spec is not None:
                from .sql_functions import check_not_qualified

                check_not_qualified(x)  # "s.t": what to do, as the SQL functions say it
            if fresh:
                check_name(x, "tensor or table name" if spec is not None else "tensor name")
            if fresh and spec is not None and self.backend.lookup(x) is None:
                read_table = getattr(self.backend, "table_operand", None)  # (not in the protocol: DuckDB's)
                table = read_table(x) if read_table is not None else None
                if table is not None:
                    values.append(table)
                    tables.append(k)
                    continue
                if read_table is not None:  # "no stored tensor ...; stored: none" left tables unmentioned (a trial)
                    raise EinsumError(f"{where}: no stored tensor named {x!r}, nor a table or view of the database "
                                      f"(stored tensors: {', '.join(self.backend.names()) or 'none'})")
            if fresh:
                x = self.tensor(x)
            if isinstance(x, Tensor):
                if x.session is not self and (self.backend.con is None or x.session.backend.con is not self.backend.con):
                    raise EinsumError(f"{where} is a tensor of another session")
                v = x._live_value(fresh)
                values.append(v)
                inputs[v.name] = v.name
                continue
            a = as_array(x, where)
            # a stable name per operand position (calls hold the session lock), so a repeated
            # einsum on same-shaped arrays finds its plan and SQL in the caches
            name = f"_eds_in{k}"
            values.append(TiledValue(name, a.shape, a.dtype.name, None, tuple(f"d{p}" for p in range(a.ndim))))
            inputs[name] = a
        if tables:
            from .sql_functions import table_values

            _, values, read = table_values(self, spec, values)
            inputs.update(read)
            if self.plan_budget is not None:
                # under a budget an element table is packed in tiles one statement can pack
                # (the plan's own choice, one 9 MB tile of a 1500² table, ran DuckDB out of its
                # limit under memory="100MB"); the plan re-tiles it, in batches, where it wants
                from .compile.sql_interface import ElementTable, pack_tile

                values = [dataclasses.replace(v, tile=pack_tile(read[v.name], self.plan_budget // 2, self.tile_bytes))
                          if v.name in read and isinstance(read[v.name], ElementTable) else v for v in values]
        return values, inputs

    def _plan_over(self, spec, values, inputs, join, agg, path=None, dtype=None, casting="safe") -> Plan:
        """``_plan``, its errors naming a table operand as the user wrote it (not ``_eds_op0``)."""
        from .sql_functions import _said_of_tables

        try:
            return self._plan(spec, values, join, agg, path=path,
                              dtype=_computes_in(dtype, casting, values, join, agg))
        except EinsumError as e:
            raise _said_of_tables(e, {n: x for n, x in inputs.items() if n.startswith("_eds_op")}) from None

    @staticmethod
    def _spec_args(spec, operands) -> tuple[str, tuple]:
        """A spec string and operands, from either of numpy's forms (string or sublists)."""
        if isinstance(spec, str):
            return spec, operands
        s, ops = sublist_spec((spec, *operands))
        return s, tuple(ops)

    @property
    def plan_budget(self) -> int | None:
        """What the session's plans may project (None: no budget): ``BUDGET_SHARE`` of
        ``memory``, the rest is for what no model counts (see plan/cost.py). Einsums, graphs
        run with ``Graph.run`` and jobs all plan under it."""
        return plan_share(self.memory)

    def _plan(self, spec, values, join, agg, path=None, dtype=None) -> Plan:
        with self.said_in_memory():
            return plan_einsum(spec, tuple(values), join, agg, workers=self.workers, budget=self.plan_budget,
                               tile_bytes=self.tile_bytes, path=path, costs=self.backend.cost_model, dtype=dtype)

    @contextlib.contextmanager
    def said_in_memory(self):
        """A refusal for want of memory, said in the session's ``memory=``: the planner's budget
        is its share of it, and "the memory budget of 6.0 MB" under memory="10MB" left a trial
        guessing what to pass."""
        try:
            yield
        except EinsumError as e:
            said = in_memory_terms(e, self.memory, "this session's")
            if said is None:
                raise
            raise said from None

    def plan(self, spec: str, *operands, join=None, agg=None, out: str | None = None, dtype=None,
             casting="safe") -> Plan:
        """The plan ``einsum`` would run (exactly: ``explain`` lists its steps). ``out`` is
        accepted for symmetry with ``einsum``: where a result goes is no part of its plan."""
        spec, operands = self._spec_args(spec, operands)
        with self._call():
            values, inputs = self._resolve(operands, spec=spec)
            return self._plan_over(spec, values, inputs, join, agg, dtype=dtype, casting=casting)

    def explain(self, spec: str, *operands, join=None, agg=None, out: str | None = None, dtype=None,
                casting="safe") -> str:
        """The plan and the SQL of every step (the result shown going to ``out``, if given)."""
        from .compile import sql_listing

        spec, operands = self._spec_args(spec, operands)
        with self._call():
            values, inputs = self._resolve(operands, spec=spec)
            p = self._plan_over(spec, values, inputs, join, agg, dtype=dtype, casting=casting)
        # the engine's own SQL where it prints another dialect (Spark's, with its shuffle bytes)
        listing = getattr(self.backend, "sql_listing", sql_listing)
        split = getattr(self.backend, "memory_split", lambda plan: None)(p)
        limit = getattr(self.backend, "engine_limit", lambda plan: None)(p)
        # a table operand's value is named _eds_op<n> in the plan: say which table it is
        tables = "".join(f"\n  {n} is {x.describe()}, packed into tiles before the first step"
                         for n, x in inputs.items() if n.startswith("_eds_op"))
        return (p.explain(engine_limit=limit) + tables + ("\n" + split if split else "") + "\n\n"
                + listing(p, {RESULT: out} if out is not None else None))

    def einsum(self, spec: str, *operands, join=None, agg=None, out: str | None = None, replace: bool = False,
               progress=None, dtype=None, casting="safe"):
        """Run an extended einsum as SQL in this database and return the result as a Tensor.

        ``spec`` and ``operands`` as ``eds.einsum`` takes them (a subscript string, or numpy's
        sublist form); operands are stored ``Tensor``s, their names, or arrays (cut the way the
        plan wants and registered for this call only). ``join`` / ``agg``: the extended notation
        (see ``help(eds.einsum)`` for the grammar). ``out`` names the result table (entered in
        the catalog, kept); without it the result is a TEMP table dropped when the returned
        Tensor is collected or leaves a ``with`` block. ``replace=True`` overwrites an existing
        ``out``. ``progress``: ``True`` draws a bar, a callable receives a ``StepProgress``
        several times a second. Ctrl-C stops the plan (KeyboardInterrupt) and leaves nothing
        written; a plan over the session's ``memory`` budget is refused before it runs.
        ``dtype``: compute the product in this dtype and store the result in it, as numpy's
        ``einsum(dtype=)`` does (each tile cast to it in the kernel: int8 operands summed in
        int32, float16 ones in float32), every operand castable to it under ``casting``
        (numpy's rules, "safe" by default); a product summed only (join and agg the defaults).

        >>> db = connect()
        >>> A = db.store("A", np.arange(6.0).reshape(2, 3))
        >>> db.einsum("ij,kj->ik", A, A, out="G").to_numpy()
        array([[ 5., 14.],
               [14., 50.]])
        """
        spec, operands = self._spec_args(spec, operands)
        if out is not None:
            check_name(out, "output name")
        _check_replace(replace)
        with self._call():
            values, inputs = self._resolve(operands, spec=spec)
            p = self._plan_over(spec, values, inputs, join, agg, dtype=dtype, casting=casting)
            # where the result goes is no part of the plan: the plan and its SQL are the same
            # on every call (cached); a temporary result gets a fresh table
            target = Target(out) if out is not None else Target(self._temp_name(), temporary=True)
            self._check_overwrites(p, inputs, {RESULT: target}, replace)
            return self._execute(p, inputs, {RESULT: target}, replace, progress)[RESULT]

    def einsum_numpy(self, spec: str, *operands, join=None, agg=None, progress=None, path=None, dtype=None,
                     casting="safe") -> np.ndarray:
        """Run in this database, return numpy; nothing is stored. ``path``: a contraction
        order for a many-operand product, in any of numpy's ``optimize=`` forms (a name,
        ``["einsum_path", (1, 2), (0, 1)]``) or the bare steps (``[(1, 2), (0, 1)]``), else the
        planner's. A path that does not fit the operands is an ``EinsumError``. ``dtype`` and
        ``casting`` as ``einsum`` takes them."""
        spec, operands = self._spec_args(spec, operands)
        path = _contraction_order(path, len(operands))
        with self._call():
            values, inputs = self._resolve(operands, spec=spec)
            p = self._plan_over(spec, values, inputs, join, agg, path=path, dtype=dtype, casting=casting)
            return self.backend.execute(p, inputs, {RESULT: Target()}, progress=reporter(progress))[RESULT]

    def topk(self, spec: str, k: int, *operands, join=None, agg=None, largest: bool = True, progress=None,
             dtype=None, casting="safe"):
        """The ``k`` largest elements of every row of an einsum's result, as numpy arrays:
        ``TopK(values, indices)``, as ``torch.topk`` returns them.

        A row is every output label but the last; the last output label is ranked (for
        ``"id,jd->ij"``, each ``i`` gets its best ``j``s). Both arrays have the shape of the
        result with its last dimension ``min(k, n)``; ``indices`` (int64) index the ranked
        label. Order: best first, NaN after every number, ties by the smaller index (numpy's
        stable sort). ``largest=False`` ranks the smallest first. ``operands``, ``join``,
        ``agg``, ``progress``, ``dtype`` and ``casting`` as ``einsum`` takes them (the spec a
        string: numpy's sublist form is not taken here). The product is planned and run as
        ``einsum`` runs it, then cut to each row's candidates by the top-k kernel: without
        ``memory=`` into an array, as ``einsum_numpy`` returns it (held once, as numpy holds
        ``q @ e.T``); under ``memory=``, for stored operands by name or handle, as
        ``einsum_topk``'s one query (fused, streamed) where its candidates fit, else into a
        temporary table, in as many statements as the budget asks, read back a batch at a time,
        so a result bigger than the budget is ranked within it. Complex results have no order.

        >>> db = connect()
        >>> q, e = np.array([[1., 0.], [0., 1.]]), np.array([[1., 0.], [0.9, 0.1], [0., 2.]])
        >>> db.topk("id,jd->ij", 2, q, e).indices
        array([[0, 1],
               [2, 1]])
        """
        from .ranking import (
            array_topk,
            batch_bytes,
            check_k,
            check_largest,
            check_rankable,
            empty,
            rows_topk,
            tensor_topk,
        )

        if not isinstance(spec, str):
            raise EinsumTypeError(f"topk(): the spec must be a str such as 'id,jd->ij', got {type(spec).__name__}")
        k, largest = check_k(k), check_largest(largest)
        result = None
        try:
            with self._call():
                values, inputs = self._resolve(operands, spec=spec)
                p = self._plan_over(spec, values, inputs, join, agg, dtype=dtype, casting=casting)
                check_rankable(p.result, spec)
                stop = getattr(getattr(self.backend, "stopper", None), "check", None)  # db.interrupt()
                if not all(p.result.shape):  # no row, or nothing to rank: no product to run
                    return empty(p.result, k)
                if self.plan_budget is None:
                    # no budget to keep: the result straight into an array and ranked there
                    # (through a table it was written and read back: 3.2 s and 1.6 GB for an
                    # 800 MB result, where numpy's way took 1.4 s)
                    x = self.backend.execute(p, inputs, {RESULT: Target()}, progress=reporter(progress))[RESULT]
                    return array_topk(np.asarray(x), k, largest, stop)
                # SQL's query, unless its window would hold candidates over half the budget:
                # the table way prunes them
                from .sql_functions import candidate_bytes

                rows = self._sql_topk(spec, k, operands, join, agg, largest) \
                    if progress is None and dtype is None and candidate_bytes(p.result, k) <= self.plan_budget // 2 \
                    else None
                if rows is not None:
                    return rows_topk(rows, p.result, k)
                result = self._execute(p, inputs, {RESULT: Target(self._temp_name(), temporary=True)}, False,
                                       progress)[RESULT]
                return tensor_topk(self.backend, result.value, k, largest, stop, batch_bytes(self.plan_budget))
        finally:
            if result is not None:  # its table dropped now (the call is over): it may be big
                try:
                    result.__exit__(None, None, None)
                except Exception:  # noqa: BLE001 - the call's own error (if any) is the one to report
                    pass  # (a TEMP table whose drop failed goes with the connection, as in _collect)

    def _sql_topk(self, spec: str, k: int, operands, join, agg, largest: bool):
        """``einsum_topk``'s answer as Arrow rows, where every operand is a stored tensor or a
        table by name (a handle of this session's, still current) and the join a string; None
        where it is not, or where the SQL function refuses (the caller's way then runs, and
        says what is wrong if anything is). Under a budget this is one statement, the top-k
        inside the einsum kernel and the result streamed through it where the plan allows:
        1.7 s and +158 MB for an 800 MB similarity top-5 under memory="300MB", where the
        product into a temporary table, ranked a batch at a time, took 3.4 s and +260 MB."""
        from .sql_functions import MAX_OPERANDS, einsum_sql

        query = getattr(self.backend, "query_arrow", None)
        if query is None or len(operands) > MAX_OPERANDS or not isinstance(join, (str, type(None))) \
                or not isinstance(agg, (str, type(None))):
            return None
        names = []
        for x in operands:
            if isinstance(x, Tensor) and x.session is self and not x.is_temporary:
                x._live_value()  # a handle since replaced is refused, as everywhere
                names.append(x.name)
            elif isinstance(x, str):
                names.append(x)
            else:
                return None
        try:
            sql = einsum_sql(self, spec, names, "topk", join, agg, f"{k};{'true' if largest else 'false'}", own=True)
        except EinsumError:
            return None
        return query(sql)

    # -- graphs -----------------------------------------------------------------------------
    def run_graph_plan(self, gplan, inputs: dict, out=None, replace: bool = False, progress=None):
        """Run a ``GraphPlan`` (see ``GraphPlan.run``)."""
        _check_replace(replace)
        outputs = [v.name for v in gplan.outputs]
        if out is None:
            targets = {}
        elif isinstance(out, str):
            if len(outputs) != 1:
                raise EinsumError(f"the plan has {len(outputs)} outputs {outputs}: pass out as a dict")
            targets = {outputs[0]: out}
        elif isinstance(out, collections.abc.Mapping):
            # keyed by output name, or by the GraphValue itself as outputs= takes it (a trial)
            targets = {getattr(k, "name", k): t for k, t in out.items()}
        elif isinstance(out, (list, tuple)) and all(isinstance(t, str) for t in out):
            if len(out) != len(outputs):  # one table per output, in the order of the plan's outputs
                raise EinsumError(f"out names {len(out)} table(s) for the plan's {len(outputs)} outputs {outputs}: "
                                  "one table per output, in that order (or a dict {output: table name})")
            targets = dict(zip(outputs, out))
        else:
            raise EinsumError(f"out must be a table name, a list of one per output, or a dict {{output: table name}}, "
                              f"got {out!r:.60}")
        unknown = [k for k in targets if k not in outputs]
        if unknown:
            raise EinsumError(f"out names unknown outputs {unknown}; the outputs are {outputs}")
        for t in targets.values():
            check_name(t, "output name")
        seen: dict[str, str] = {}
        for k, t in targets.items():  # DuckDB's names ignore case
            if t.lower() in seen:
                raise EinsumError(f"out names table {t!r} for both {seen[t.lower()]!r} and {k!r}: one table per output")
            seen[t.lower()] = k
        with self._call():
            bound = {}
            by_name = {v.name: v for v in gplan.plan.inputs}
            for v in gplan.inputs:
                x = inputs[v.name]
                want = by_name.get(v.name)  # None: an input the plan no longer reads (a fill)
                if isinstance(x, (Tensor, str)):
                    t = self._graph_input(v, x)
                    if want is not None and (t.tile != want.tile or t.keys != want.keys):
                        raise EinsumError(
                            f"input {v.name!r}: tensor {t.name!r} is stored in tiles {t.tile} (keys {t.keys}), but this "
                            f"plan reads it in tiles {want.tile} (keys {want.keys}); plan for it with "
                            f"g.plan(inputs={{{v.name!r}: db.tensor({t.name!r})}}) (its explain() shows the re-tile), "
                            "or run g.run(db, ...), which does")
                    bound[v.name] = t.name
                else:
                    bound[v.name] = self._graph_input(v, x)
            outs = {}
            for v in gplan.outputs:
                table = targets.get(v.name)
                outs[v.name] = Target(table) if table is not None else Target(self._temp_name(), temporary=True)
            # a plan made without a budget (or for a larger one) ran past the session's (a trial:
            # 201 MB projected under memory="150MB"): refused, as memory= promises. Against the
            # plans' share, as the session's own plans are: checked against the whole of memory=,
            # a plan projecting 298 MB ran under 300 MB and rose 494-587 MB (a budget trial).
            # g.plan(memory=M) plans under that share of M, so on connect(memory=M) it runs
            try:
                gplan.plan.check_budget(self.plan_budget)
            except EinsumError as e:
                raise EinsumError(f"plan.run: {e} (the plans' share of the session's memory={format_bytes(self.memory)}); "
                                  "this plan was made for another budget: plan it for this session with "
                                  "g.plan(memory=db.memory), or run g.run(db, ...), which does") from None
            self._check_overwrites(gplan.plan, bound, outs, replace)
            result = self._execute(gplan.plan, bound, outs, replace, progress)
        # one return type per plan, fixed by how its outputs were asked for (never by count)
        return next(iter(result.values())) if gplan.single else result

    def _graph_input(self, v, x):
        """What is given for graph input ``v`` (a ValueInfo), checked against its shape and
        dtype: a stored tensor's value (a Tensor or a name), or the array cast as ``v`` says."""
        if isinstance(x, (Tensor, str)):
            t = self._resolve([x], [f"input {v.name!r}"])[0][0]
            if t.shape != v.shape or t.dtype != v.dtype:
                raise EinsumError(f"input {v.name!r}: the graph wants {v.shape} {v.dtype}, got {t.shape} {t.dtype}")
            return t
        given = as_array(x, f"input {v.name!r}")
        if given.shape != v.shape:  # before any cast: named as given, with no warning of a cast (a trial)
            raise EinsumError(f"input {v.name!r}: the graph wants {v.shape} {v.dtype}, got {given.shape} {given.dtype}")
        a = _cast_input(given, v)
        if a.dtype != v.dtype:
            raise EinsumError(f"input {v.name!r}: the graph wants {v.shape} {v.dtype}, got {a.shape} {a.dtype}")
        return a

    def check_graph_inputs(self, values, inputs: dict) -> None:
        """Check what ``inputs`` gives for graph inputs ``values`` (ValueInfos) a plan does not
        read, as if it did: an input given for no use must still be right."""
        with self._call():
            for v in values:
                if v.name in inputs:
                    self._graph_input(v, inputs[v.name])

    # -- SQL interface ----------------------------------------------------------------------
    def _einsum_sql(self, spec: str, names: list[str], mode: str, join=None, agg=None, k=None) -> str:
        """The query behind ``SELECT * FROM einsum(...)`` (see ``sql_functions.einsum_sql``)."""
        from .sql_functions import einsum_sql

        # planned inside DuckDB's call of our UDF, outside a session call: the catalog as the
        # query finds it, edits in SQL since the last call included
        if in_kernel():  # a join callable running a SQL einsum waited for the session (a review)
            raise EinsumError(FROM_KERNEL)
        getattr(self.backend, "call_begins", lambda: None)()
        # what the last SQL queries freed, handed back as after every plan of the Python API: a
        # service running only SQL einsums over element tables grew ~50 MB per 1,000 (a trial)
        getattr(self.backend, "bound_free_memory", lambda: None)()
        return einsum_sql(self, spec, names, mode, join, agg, k)

    def interrupt(self) -> bool:
        """Stop this session's call in progress, from another thread, as DuckDB's
        ``connection.interrupt()`` stops a query: the einsum, store, read or graph run raises
        ``eds.errors.Interrupted`` (an ``ExecutionError``) and nothing it was writing is kept
        (a job keeps the steps it had committed, and resumes at the stopped one). Calls waiting
        for their turn on the session are not stopped. False when no call was in progress
        (nothing happens); a call already committing its result finishes and returns it.

        A call stops within a kernel task, as on Ctrl-C; one still planning stops where its
        first statement would run. A query of yours on ``db.connection`` or a cursor (the SQL
        functions) is not stopped by it, but by DuckDB's own ``interrupt()`` of its connection. On Spark the call's jobs are
        cancelled (their tasks interrupted), those it starts after the stop too."""
        stopper = getattr(self.backend, "stopper", None)
        if stopper is None:
            raise EinsumError(f"interrupt() is not available on the {self.backend.name} backend: stop a plan "
                              "there with a progress= callable that raises")
        return stopper.interrupt(Interrupted("interrupted: db.interrupt() stopped this call; what it was writing "
                                             "was rolled back"))

    def close(self) -> None:
        """Close the session (and its connection, if the session opened it). Idempotent. In a
        forked child it does nothing: the connection is the parent's (closing a file database
        here would write to the parent's file)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if not self.backend.closed:
                try:
                    self._collect()
                except Exception:  # noqa: BLE001 - temp tables go with the connection anyway
                    pass
            self._garbage.clear()
            self.backend.close()
            holder = self.__dict__.get("_sql_target")
            if holder is not None:
                holder.session = None  # the connection's UDF no longer keeps this session alive
        _open_sessions.discard(self)

    def __enter__(self):
        """``with connect() as db``: the session closes on leaving the block."""
        return self

    def __exit__(self, *exc):
        self.close()


# Sessions still open at exit are closed then: DuckDB's Python binding prints leak warnings
# for connections alive at interpreter shutdown.
_open_sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()


@atexit.register
def _close_open_sessions() -> None:
    for s in list(_open_sessions):  # (in a forked child, the parent's close as no-ops)
        try:
            s.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _pick_device(device, allow_tf32, backend: str) -> str:
    """The device a session's kernels run on: ``"cpu"``, ``"cuda"`` (refused when no CUDA device
    and CuPy are there), or ``"auto"``: CUDA where the DuckDB engine finds one, else the CPU."""
    from .udfs import devices

    if device not in ("auto", "cpu", "cuda"):
        raise EinsumError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if not isinstance(allow_tf32, bool):
        raise EinsumError(f"allow_tf32 must be True or False, got {allow_tf32!r}")
    if device == "cuda":
        if backend != "duckdb":
            raise EinsumError(f"device='cuda' runs the DuckDB engine's kernels on a GPU; backend {backend!r} "
                              "runs its kernels on the CPU")
        if not devices.available("cuda"):
            raise EinsumError("device='cuda': no CUDA device found (the GPU kernels need CuPy and a CUDA "
                              "driver: pip install \"eindecomp_sql[gpu]\"); use device='cpu' or 'auto'")
        return "cuda"
    if device == "auto" and backend == "duckdb" and devices.available("cuda"):
        return "cuda"
    return "cpu"


_OPEN_ELSEWHERE = ("this database is already open in another eindecomp_sql session", "cannot open database")


ANY_DATABASE = object()  # _close_dropped_sessions: every database


def _close_dropped_sessions(database) -> bool:
    """Close the open sessions on file ``database`` that opened their connection themselves and
    that nothing can reach any more: no handle, no Tensor, not their ``db.connection`` (only
    the SQL interface's holder refers to them); or, ``database`` being a DuckDB connection of
    the caller's, the session on it that nothing reaches (its connection is the caller's, so
    only the session counts: a trial's ``eds.connect(con)`` inside a function left a session
    no handle could close, the connection refused to a new one and its memory_limit lowered).
    Whether one was closed."""
    target = None
    if database is ANY_DATABASE:
        on_connection = None
    elif type(database).__name__ == "DuckDBPyConnection":
        on_connection = database
    elif not isinstance(database, (str, os.PathLike)) or os.fspath(database) in ("", ":memory:"):
        return False
    else:
        on_connection = None
        target = os.path.realpath(os.fspath(database))
    closed = False
    for _ in range(3):  # a session opened on another thread meanwhile changes the set
        try:
            listed = list(_open_sessions)
            break
        except RuntimeError:
            continue
    else:
        return False
    if on_connection is not None:
        candidates = [s for s in listed if not getattr(s.backend, "owns_connection", True) and not s.backend.closed
                      and getattr(s.backend, "con", None) is on_connection]
    elif target is None:  # every session that opened its connection itself (files and :memory:)
        candidates = [s for s in listed if getattr(s.backend, "owns_connection", False) and not s.backend.closed]
    else:
        candidates = [s for s in listed if getattr(s.backend, "owns_connection", False) and not s.backend.closed
                      and s._database is not None and os.path.realpath(s._database) == target]
    del listed
    # by reference counts: a local variable of a running function is no object the collector
    # lists as a referrer. A dropped session has two: the holder's and ``s`` here, plus what
    # getrefcount's argument adds on this interpreter (nothing from Python 3.14, which lends
    # locals): measured on a probe held the same way. A handle, a Tensor or a temporary
    # result's finalizer is one more
    probe = object()
    keep = [probe]
    expected = sys.getrefcount(probe)
    while candidates:
        s = candidates.pop()
        held = sys.getrefcount(s) > expected or s.__dict__.get("_sql_target") is None
        if not held and (on_connection is not None or sys.getrefcount(s.backend.con) <= s._con_refs):
            s.close()
            closed = True
        del s
    del keep
    return closed


class _Holder:
    """The session the SQL interface's UDF serves, until the session closes."""

    def __init__(self, session):
        self.session = session

    def einsum_sql(self, *args, **kw):
        session = self.session
        if session is None:
            raise EinsumError("this session is closed")
        return session._einsum_sql(*args, **kw)


def _cast_input(a: np.ndarray, v) -> np.ndarray:
    """An array bound to graph input ``v``, in its declared dtype: integers (and bools) to any
    integer dtype their values fit, refused where one does not (numpy's cast wraps: 300 into
    int8 was 44, uint64 2**63 into int64 -2**63, in silence: a trial); otherwise numpy's
    same-kind casts (floats to narrower floats lose digits, as ``np.asarray`` would). Across
    kinds (floats to integers, complex to real) stays the caller's to do."""
    if a.dtype == v.dtype:
        return a
    if a.dtype.kind in "biu" and (v.dtype.startswith(("int", "uint"))):
        info = np.iinfo(v.dtype)
        if a.size and a.dtype.kind != "b":
            lo, hi = int(a.min()), int(a.max())
            if lo < info.min or hi > info.max:
                raise EinsumError(f"input {v.name!r}: values {lo}..{hi} do not fit the graph's {v.dtype} "
                                  f"({info.min}..{info.max}); cast them yourself, or declare a wider dtype")
        return a.astype(v.dtype)
    if can_cast(a.dtype, v.dtype, "same_kind"):
        if not v.dtype_given and not can_cast(a.dtype, v.dtype):
            # float64 data into a graph declared without a dtype came back float32, in silence (a
            # numpy user's arrays are float64 unless asked): said, with what to change
            warn(f"input {v.name!r}: the {a.dtype} array is cast to {v.dtype}, the dtype of an input declared "
                 f"without one; declare g.input({v.name!r}, {v.shape}, dtype={str(a.dtype)!r}) to compute in "
                 f"{a.dtype}, or pass a {v.dtype} array")
        return a.astype(v.dtype)
    return a  # refused by the caller: the graph wants another dtype


def _computes_in(dtype, casting, values, join, agg) -> str | None:
    """The dtype a ``dtype=`` einsum computes in (None: the operands' promoted dtype), checked as
    numpy checks it: a dtype eindecomp_sql has, each operand castable to it under ``casting``
    (EinsumTypeError, numpy's TypeError, where not); a product summed only, whose kernels cast
    each tile to it (another join computes in its operands' dtypes)."""
    if dtype is None:
        return None
    from .api import _cast_error, _check_casting, _named
    from .notation.checks import check_dtype

    casting = _check_casting(casting)
    ct = np.dtype(check_dtype(dtype, "einsum dtype"))
    if not ((join is None or _named(join, "mul")) and (agg is None or _named(agg, "sum"))):
        raise EinsumError(f"dtype={ct.name} computes a product summed in that dtype (numpy's einsum(dtype=)); with "
                          "join= or agg= the join computes in its operands' dtypes: cast the operands instead "
                          "(db.store(name, tensor, dtype=...))")
    for k, v in enumerate(values):
        if not can_cast(np.dtype(v.dtype), ct, casting):
            raise _cast_error(f"operand {k}", np.dtype(v.dtype), ct, casting)
    if ct.kind != "c" and any(np.dtype(v.dtype).kind == "c" for v in values):
        warn("Casting complex values to real discards the imaginary part", np.exceptions.ComplexWarning)
    return ct.name


# a stored tensor read whole into an array holds about this many times its bytes at peak
# (DuckDB's copy, Arrow's and the array: README's "to_numpy ... ~3x its bytes while it converts")
WHOLE_READ_FACTOR = 3


def _held_here(lock) -> bool:
    """Whether this thread holds the session's RLock (CPython's has ``_is_owned``)."""
    owned = getattr(lock, "_is_owned", None)
    return bool(owned()) if owned is not None else False


def _check_replace(replace) -> None:
    # numpy's bools are bools to a user; "no" or 0 is not a choice made (any truthy value
    # would overwrite a table)
    if not isinstance(replace, (bool, np.bool_)):
        raise EinsumError(f"replace must be True or False, got {replace!r}")


def _contraction_order(path, n_operands: int):
    """``path`` checked and normalised (``graph.lower.contraction_path``); bare steps too. A list
    raised TypeError (unhashable), a bad position IndexError (a new user's report)."""
    from .graph.lower import _explicit_path, contraction_path

    if isinstance(path, (list, tuple)) and path and not isinstance(path[0], str):
        return _explicit_path(path, n_operands)
    return contraction_path(path, n_operands)


def connect(database=None, *, tile_bytes: int | None = None, workers: int | None = None, memory=None,
            read_only: bool = False, backend: str = "duckdb", device_memory=None, spark=None,
            device: str = "auto", allow_tf32: bool = False, spark_database=None) -> Session:
    """A session over DuckDB.

    Parameters
    ----------
    database : None, str, os.PathLike or duckdb.DuckDBPyConnection
        None or ``":memory:"`` for an in-memory database, a file path (created if missing;
        tensors stored there are found again after reopening), or an open DuckDB connection to
        work in (it is not closed with the session). For ``backend="spark"``: a directory
        holding the tensors as Parquet (None: a temporary one, removed at ``close()``), or
        None with ``spark_database=``.
    tile_bytes : int
        The largest tile, in bytes, a plan creates (default: a 32nd of the memory this
        process may use, 64 MiB to 1 GiB; on Spark at most 32 MiB). Stored tensors are cut
        into tiles of at most this size unless ``store(..., tile=)`` says otherwise.
    workers : int
        Join tasks per step the optimizer aims for (default 1: kernels already use every core;
        on Spark, Spark's default parallelism).
    memory : None, int or str
        A memory budget (bytes, or a size such as ``"2GB"`` / ``"512MiB"``): a plan whose
        projected peak exceeds it is refused before anything runs.
    read_only : bool
        Open a database file read-only (several processes may do so at once).
    backend : str
        The engine: ``"duckdb"`` (the default; SQL, files, the SQL interface),
        ``"reference"`` (runs every plan step by step in numpy, tensors in memory: a check on
        the DuckDB engine, and the harness the next engines drop into) or ``"device-sim"``
        (the reference catalog, plans run as tile tasks by the device worker's scheduler and
        cache on a simulated device: what will drive a GPU, checked without one) or
        ``"spark"`` (every step a Spark SQL statement, tensors as Parquet or Spark tables;
        needs the ``eindecomp_sql[spark]`` extra).
    device_memory : None, int or str
        The device's tile cache (a size such as ``"256MB"``): stored tensors' tiles kept on the
        device between kernel calls and plans (default: half the GPU's memory); for
        ``device="cuda"``, and the ``"device-sim"`` backend's worker (default 1 GiB).
    spark : None or pyspark.sql.SparkSession
        The Spark session ``backend="spark"`` runs on (None: the one active in this process,
        else a local one, ``local[<cores>]``, stopped when the last session using it closes).
        Its Python workers must import ``eindecomp_sql``.
    spark_database : None or str
        For ``backend="spark"``: keep the tensors as tables of this Spark database
        (``"tensors"`` or ``"catalog.tensors"``; created if missing) instead of Parquet
        directories. Each is a managed Parquet table, key columns and ``tile``, described by
        its ``eindecomp_sql.tensor`` table property; other tables there are left alone. With
        Spark's default in-memory catalog they last as long as the Spark session.
    device : str
        Where the DuckDB engine's einsum kernels run: ``"cuda"`` (a GPU, through CuPy: the
        ``eindecomp_sql[gpu]`` extra), ``"cpu"``, or ``"auto"`` (the default: CUDA when CuPy
        finds a device, else the CPU; steps under ``AUTO_MIN_WORK`` element operations stay
        on the host). Retiles, fills and steps with a Python callable join run on the host;
        ``explain`` says where every step runs and why.
    allow_tf32 : bool
        Let float32 products on a GPU use TF32 tensor cores (inputs rounded to a 10-bit
        mantissa). Off by default: float32 results then match numpy's.

    Every bad option raises :class:`EinsumError` here, before a connection opens.

    >>> with connect() as db:
    ...     db.store("A", np.arange(6.0).reshape(2, 3)).shape
    (2, 3)
    """
    # sessions dropped without close() are closed as each session opens: nothing else frees
    # one (the SQL interface's UDF in its connection refers to it, a cycle through C++ that no
    # collector sees), and a service that forgot close() held ~5 MB and 9 DuckDB threads per
    # request, 2,722 threads after 300 (a soak trial)
    try:
        _close_dropped_sessions(ANY_DATABASE)
    except Exception:  # noqa: BLE001 - a sweep of others' leftovers never fails this open
        pass

    def opened():
        try:
            return Session(database, tile_bytes=tile_bytes, workers=workers, memory=memory, read_only=read_only,
                           backend=backend, device_memory=device_memory, spark=spark, device=device,
                           allow_tf32=allow_tf32, spark_database=spark_database)
        except Exception as e:
            fatal = duckdb_fatal(e)
            if fatal is None or isinstance(e, EinsumError):
                raise
            # opened writable on a full disk, DuckDB's raw FatalException (a crash trial)
            raise EinsumError(f"cannot open database {str(database)!r}: DuckDB failed fatally while opening it "
                              f"({duckdb_said(fatal)}); fix the cause (free disk space) and open it again") from None

    try:
        return opened()
    except EinsumError as e:
        # a session dropped without close() holds the file open (its SQL interface's UDF keeps
        # it alive): a notebook cell "db = eds.connect('f.duckdb')" run twice failed, with no
        # handle left to close the first. One nobody can reach is closed, and the open retried.
        from .backends.duckdb import SESSION_ON_CONNECTION

        if not str(e).startswith(_OPEN_ELSEWHERE + (SESSION_ON_CONNECTION,)) or not _close_dropped_sessions(database):
            raise
    return opened()
