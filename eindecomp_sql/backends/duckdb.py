"""The DuckDB backend: owns the connection, the catalog and the kernel registrations, and runs
each plan step as one statement inside one transaction (a failure leaves nothing behind)."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import shutil
import threading
import weakref
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa
from sqlglot import exp

from ..compile import DuckDBCompiler, create_table_as, drop_table
from ..compile.compiler import ident, on_device
from ..compile.sql_interface import ArrayTable, ElementTable, pack_bytes, pack_query
from ..plan.kernel_spec import device_only_results, host_reason, inputs_read_by_name
from ..compile.sql import table
from ..errors import EinsumError, ExecutionError, duckdb_said
from ..plan import Plan, TiledValue
from ..plan.cost import (BUDGET_SHARE, ENGINE_MARGIN, MIN_ENGINE_BYTES, CostModel, engine_limit, parse_memory,
                         plan_share)
from ..plan.steps import EinsumStep, ProgramStep, format_bytes, output_tiles, step_reads, step_target
from ..sql_templates import template
from ..udfs.tiles import array_from_tiles, null_tiles, tiles_from_array
from . import allocator, parts as parted, spill
from ..udfs.pool import RUN_TOKEN, THREADS, Cancelled, KernelState
from .base import Target
from .running import Stopper, Watch, run_interruptible, sigint_held
from .tables import COUNT_NAMED, WHERE_BARE_NAMES_RESOLVE, read_table_operand


# a step whose projected peak (the tiles of one UDF call, every column together) reaches this
# exports with 64-bit offsets: below it no one column can pass the 2 GiB that 32-bit offsets
# address (at 1 GiB, a 6000² float64 GEMM of one-tile operands, 1.15 GB, took the slower path)
LARGE_BUFFER_BYTES = 2 << 30
# below this a step keeps the default 64-bit offsets: 32-bit ones save ~7 ms per 64 MB of
# tiles, nothing measurable on small tiles, and switching costs two SET statements (~1 ms,
# the setting is the database's, so it is put back after the plan)
SMALL_BUFFER_BYTES = 16 << 20
# under a budget, a stored tensor's parts are at most this fraction of it (see set_memory)
BUDGET_PARTS = 32
# what the process holds before any tensor: the interpreter, numpy, pyarrow, DuckDB, sqlglot
# (resident set after import and a first tiny einsum, measured 176 MB; README "Memory")
FIXED_OVERHEAD_MB = 190  # README: a session that has run one small einsum


# What DuckDB's plans cost (plan/cost.py has the formulas): weights fitted by bench/calibrate.py
# on this engine (bench/RESULTS.md "Cost model calibration"), a UDF gets up to one vector of
# 2,048 rows per call, and list() holds a grouped step's joined tiles without spilling. The
# pure layer's default (plans made without a session, g.plan()) is this same model.
COSTS = CostModel("duckdb", join=1.0, group=0.7, agg=6.0, retile=3.0, statement=2.5e6, vector_rows=2048, grouped_holds_all=True)


# run numbers: the device cache's names for the values one run of a plan computes
_RUNS = itertools.count()
_PACKS = itertools.count()  # TEMP tables of packed table operands (_packed), unique in a nested run too


# id(connection) -> (weak references to the backend that registered its UDFs and to the
# connection, their names), for connections we do
# not own: a new session there replaces a closed one's functions (DuckDB refuses a name twice)
_OWNERS: dict[int, tuple] = {}
SESSION_ON_CONNECTION = "this DuckDB connection already has an eindecomp_sql session open on it"


# the SQL interface's table macros: name, mode, and the k parameter einsum_topk adds
# (and its largest :=, passed with k as '<k>;<largest>': sql_functions._k_and_order)
_SQL_MACROS = (("einsum", "tiles", "", "", "NULL"),
               ("einsum_elements", "elements", "", "", "NULL"),
               ("einsum_topk", "topk", "k, ", ", largest := true",
                "CAST(k AS VARCHAR) || ';' || coalesce(CAST(largest AS VARCHAR), 'NULL')"))


class _Registrar:
    """The connection, recording the UDFs and TEMP macros registered on it. A session on a
    connection it does not own leaves them there when it closes (removing them would run
    statements on the user's connection, discarding a result being fetched, and refuses while
    one is); the next session on that connection removes them first (``_take_over``)."""

    MACROS = tuple(m[0] for m in _SQL_MACROS)

    def __init__(self, con):
        self._con = con
        self.names: list[str] = []

    def create_function(self, name, *args, **kw):
        with sigint_held():  # (a Ctrl-C inside aborted the process: running.sigint_held)
            self._con.create_function(name, *args, **kw)
        self.names.append(name)

    def __getattr__(self, attr):
        return getattr(self._con, attr)

    def remove_all(self, strict: bool = False) -> None:
        """Remove what was registered (``strict``: a failure is raised, else ignored)."""
        ours = "eds_einsum_sql" in self.names  # the macros were made over it, by us
        try:
            for name in reversed(self.names):
                try:
                    self._con.remove_function(name)
                except (ValueError, duckdb.InvalidInputException) as e:
                    if "No function by the name" not in str(e) and not isinstance(e, ValueError):
                        raise
                    # not registered (any more)
            for macro in self.MACROS if ours else ():  # over the functions just removed
                self._con.execute(f"DROP MACRO TABLE IF EXISTS temp.main.{macro}").fetchall()
            self.names.clear()
        except duckdb.Error:
            if strict:
                raise


def _forget_connection(ref) -> None:
    """A connection was collected: its entry goes (unless a newer connection took its id)."""
    for key, entry in list(_OWNERS.items()):
        if entry[1] is ref:
            del _OWNERS[key]


def _take_over(con) -> None:
    """Before a session registers its UDFs on a connection it does not own: refuse if another
    session there is open; remove a closed (or collected) one's functions."""
    entry = _OWNERS.get(id(con))
    if entry is None:
        return
    ref, con_ref, names = entry
    if con_ref() is not con:  # another connection, since collected, had this id: nothing of ours here
        del _OWNERS[id(con)]
        return
    owner = ref()
    if owner is not None and not owner.closed:
        raise EinsumError(f"{SESSION_ON_CONNECTION} (its functions are registered on the connection): use that "
                          "session, or close it first")
    leftover = _Registrar(con)
    leftover.names = list(names)  # (a connection that only reuses a dead one's id has none of them)
    try:
        leftover.remove_all(strict=True)
    except duckdb.Error as e:
        raise EinsumError(f"cannot use this DuckDB connection: the functions of a closed eindecomp_sql session "
                          f"on it cannot be removed ({e}); finish fetching any result on it first") from None
    del _OWNERS[id(con)]


class DuckDBBackend:
    name = "duckdb"
    cost_model = COSTS  # what plans cost here: the session plans under it
    compiler = DuckDBCompiler()  # how plans become SQL here: dialect and tactics as class data
    streams_in = True  # store_tiles scans a RecordBatchReader, or runs SELECTs (read_parquet) itself
    # arrays enter a plan through the client's source registry where it has one (see _arrays)
    source_registry = True

    def __init__(self, database=None, config: dict | None = None, read_only: bool = False, device: str = "cpu",
                 allow_tf32: bool = False, device_memory: int | None = None, device_min_work: int = 0):
        allocator.retain_freed_memory()  # before DuckDB starts its threads (see allocator.py)
        # where the tile kernels run: the specs the compiler writes name it (udfs/devices.py)
        self.device = device
        if device != "cpu" or allow_tf32:
            self.compiler = on_device(DuckDBCompiler, device, allow_tf32, device_min_work)()
        if isinstance(database, duckdb.DuckDBPyConnection):
            if read_only:
                # a connection is read-only as it was opened: with the flag over a writable one,
                # no catalog was made and writes failed later in DuckDB's words (a documentation audit)
                try:
                    writable = not database.execute("SELECT readonly FROM duckdb_databases() WHERE database_name = "
                                                    "current_database()").fetchall()[0][0]
                except duckdb.Error:
                    writable = False
                if writable:
                    raise EinsumError("read_only=True is for a database path: the connection you passed is "
                                      "writable (open it with duckdb.connect(path, read_only=True), or leave "
                                      "read_only out)")
            self.con = database
            self.owns_connection = False
        else:
            self.con = _open(database, read_only, config)
            self.owns_connection = True
        self._closed = True  # until set up: close() then only closes what we opened
        self._work = None
        self._functions = None  # what we register on the connection (_Registrar)
        self.budget: int | None = None  # the session's memory budget (set_memory)
        self.part_bytes: int | None = None  # tiles per stored part (None: parts.PART_BYTES)
        # temporary results written as parts (lower-cased name -> its TEMP part tables): the
        # result is a TEMP view over them, dropped with them (drop_table)
        self._temp_parts: dict[str, list[str]] = {}
        self._read_only: bool | None = None  # whether our cursor's database is read-only (_check_target)
        # the prefix of a run's own TEMP names (scratch, views): "" for a run, "1_" for one run
        # inside it (from its progress callback), ...: the inner run dropped the outer's _eds_s0
        self._nest = ""
        self._depth = 0  # runs under way (execute inside execute: see _nest)
        self._memory_limit: int | None = None  # what we last SET DuckDB's memory_limit to
        # a connection the user passed in keeps its own settings (docs/LAYOUT.md): those we
        # change (global in DuckDB: the database's) as they were, put back by close()
        self._their_settings: dict[str, str] = {}
        # the catalog's and eds_parts' answers by lower-cased name, kept until a statement of
        # ours writes either table, rolls back or fails (_run), or a session call finds the
        # catalog's fingerprint changed since the last (an edit in SQL outside the session).
        # Four of the ten statements around a repeated db.einsum(..., out=, replace=True) were
        # these reads (~0.45 ms each); one fingerprint a call replaces them
        self._catalog_seen: dict[str, TiledValue | None] = {}
        self._parts_seen: dict[str, list[str]] = {}
        self._calls = 0  # session calls begun (recover)
        self._checked: tuple[int, object] = (-1, None)  # (the call it was checked in, fingerprint)
        self._temp_dir: str | None = None  # our spill folder, for a database in memory
        self.open_transaction = False  # a BEGIN of ours may be open (``_Tx``, ``recover``)
        # One lock for everything this backend does on its connection: a session is shared
        # between threads, and a DuckDB connection runs one statement at a time.
        self.lock = threading.RLock()
        try:
            # Arrow batches of tiles above 2 GiB need 64-bit offsets on export; below that, 32-bit
            # offsets reach the kernels faster (~7 ms per 64 MB). Set per step from its projected peak.
            if not self.owns_connection:
                self._remember("arrow_large_buffer_size", self.con)
            self.con.execute("SET arrow_large_buffer_size = true").fetchall()
            from eindecomp_sql.udfs import register_kernels

            self.kernels = KernelState()  # this connection's cancel flag and tile count
            self.stopper = Stopper()  # Session.interrupt()
            self._last_reads: dict[int, list[str]] = {}  # step -> the run's values read last there
            if device != "cpu":  # stored tensors' tiles stay on the device between calls and plans
                from eindecomp_sql.udfs.device_cache import DeviceCache
                from eindecomp_sql.udfs.devices import default_budget

                self.kernels.device_cache = DeviceCache(device_memory if device_memory is not None
                                                        else default_budget(device))
                self.kernels.device_xp = device
            self._functions = _Registrar(self.con)
            if not self.owns_connection:
                _take_over(self.con)
                # the names list, not the registrar: the registry must not keep the connection alive
                _OWNERS[id(self.con)] = (weakref.ref(self), weakref.ref(self.con, _forget_connection),
                                         self._functions.names)
            register_kernels(self._functions, self.kernels)
            # Our own statements run on a cursor of the user's connection (the same database,
            # the UDFs registered above): a result the user is still fetching on
            # ``db.connection`` then never blocks a store, an einsum or a read, and interrupting
            # a plan interrupts only our statement.
            self._work = self.con.cursor()
            if not self.owns_connection:
                # a cursor starts in the database's default catalog, whatever the user's USE
                # said: tensors stored "in" an attached file went to memory and were lost
                # with the process (a trial's report); ours works where the user's works
                where = self.con.execute("SELECT current_database(), current_schema()").fetchall()[0]
                self._work.execute(f"USE {'.'.join(ident(str(n)).sql(dialect='duckdb') for n in where)}")
            self._closed = False
            self._large_buffers = None
            self._set_large_buffers(True)
            if not read_only:
                self._run(template("catalog"))
                self._run(parted.PARTS_SCHEMA)
                if self.owns_connection and database not in (None, ":memory:"):
                    self._sweep_parts()
                    # DuckDB's spill files of killed processes, in the folder beside this file
                    # (DuckDB's default), which its lock on the file keeps to us; never a
                    # folder the user chose (it may be shared between hosts or databases)
                    folder = self._run("SELECT current_setting('temp_directory')")[0][0]
                    if os.path.abspath(folder) == os.path.abspath(f"{database}.tmp"):
                        spill.quietly(spill.sweep_files, folder)
        except BaseException as e:
            self._closed = True
            for setting, value in self._their_settings.items():  # a failed connect changes nothing of theirs
                try:
                    self.con.execute(f"SET {setting} = ?", [_shown_limit(value) if setting == "memory_limit"
                                                             else value]).fetchall()
                except duckdb.Error:
                    pass
            if self._work is not None:
                self._work.close()
            if self.owns_connection:
                self.con.close()
            elif self._functions is not None and not isinstance(e, EinsumError):
                self._functions.remove_all()  # what this failed session registered
            if isinstance(e, duckdb.NotImplementedException) and "already created" in str(e):
                raise EinsumError("this DuckDB connection already has an eindecomp_sql session open on it (its "
                                  "functions are registered on the connection): use that session, or close it "
                                  "first") from None
            if isinstance(e, duckdb.ConnectionException):
                raise EinsumError(f"cannot use this DuckDB connection: {e}") from e
            if isinstance(e, duckdb.InvalidInputException) and "read-only" in str(e) and not self.owns_connection:
                # the session keeps its catalog where the connection's USE points
                raise EinsumError(f"the connection's current database is read-only ({e}): USE a writable database "
                                  "before eds.connect(con)") from None
            if isinstance(e, duckdb.CatalogException) and "already exists" in str(e):
                # the kernels are registered in the database, and a file opened twice in one
                # process is one database: the second session would share (and cancel, count
                # progress for) the first one's kernels
                raise EinsumError(
                    "this database is already open in another eindecomp_sql session of this process "
                    "(a file opened twice in one process is one DuckDB database, and the kernels are "
                    "registered in it once): use that session, or close it first (one whose handle you dropped "
                    "is closed for you, once nothing refers to it: no Tensor of it, not its db.connection)") from None
            raise
        allocator.attach()  # counted only once set up, so the last close() can trim

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the memory budget ------------------------------------------------------------------
    def set_memory(self, budget: int | None) -> None:
        """Hold this process to ``budget`` bytes (None: DuckDB's own default, 80% of RAM).
        DuckDB's ``memory_limit`` is the budget's planned share (``BUDGET_SHARE``; at least
        ``MIN_ENGINE_BYTES``) while no plan runs, and while a plan runs that share less what the
        plan's kernels and Arrow buffers may hold (``Plan.kernel_bytes``): DuckDB then evicts and spills (to ``temp_directory``:
        ``<file>.tmp`` beside a file database, a private folder in the system's temp dir for
        one in memory) rather than grow. Stored parts and retained freed memory shrink with it."""
        with self.lock:
            self.budget = budget
            if budget is None:
                return
            allocator.bound_retained(budget)  # freed buffers kept for reuse count too
            # a scan pins a whole part (DuckDB reads every blob of a row group, whatever the
            # filter): 16 MiB parts pinned by two threads filled a 64 MiB limit
            self.part_bytes = min(parted.PART_BYTES, max(budget // BUDGET_PARTS, 1))
            if self._temp_dir is None and self._run("SELECT current_setting('temp_directory')")[0][0] == ".tmp":
                # DuckDB's default for a database in memory is .tmp in the working directory
                spill.quietly(spill.sweep_folders)  # what killed sessions of this host left
                self._temp_dir = spill.new_folder()
                quoted = self._temp_dir.replace("'", "''")  # our own path, quoted as a literal
                self._remember("temp_directory")
                self._run(f"SET temp_directory = '{quoted}'")
            self._set_memory_limit(self._idle_limit())

    def _idle_limit(self) -> int:
        return max(plan_share(self.budget), MIN_ENGINE_BYTES)

    def engine_limit(self, plan: Plan) -> int | None:
        """DuckDB's ``memory_limit`` while ``plan`` runs under the session's budget (None: none)."""
        return engine_limit(self.budget, plan)

    def _device_only(self, plan: Plan, parted=frozenset()) -> frozenset[str]:
        """The values of ``plan`` whose tiles stay on the device (``device_only_results``)."""
        if self.device == "cpu" or not self.compiler.device_residency:
            return frozenset()
        return device_only_results(plan, self.device, self.compiler.device_min_work, parted)

    def _send_ahead(self, step, tables: dict[str, str]) -> None:
        """On a device, before ``step``'s statements: the tiles of its stored inputs that its
        join hands more than once, sent to the device once each (``SQLCompiler.send_ahead``,
        udfs/device_cache.py). The step's statement then reads them as NULL. A cold 16384²
        GEMM on the H100 handed each 512 MiB operand tile to two rows: 4 GiB through DuckDB
        for 2 GiB of operands."""
        if self.kernels.device_cache is None:
            return
        for value, text in self.compiler.send_ahead(step):
            if self.kernels.device_tokens.get(value, "").startswith("oid"):  # a stored tensor's tiles
                self._run(self.compiler.bind_sql(text, tables))

    def _release_after(self, k: int) -> None:
        """Step ``k`` has run: the device lets go of the values named for the run (results,
        array operands) no later step reads."""
        for token in self._last_reads.get(k, ()):
            self.kernels.device_cache.drop(token)

    def _placement(self, step) -> str:
        """Where a device session runs ``step``: ``on cuda``, or ``on the host: <why>``."""
        reason = host_reason(step, self.compiler.device_min_work)
        return f"on {self.device}" if reason is None else f"on the host: {reason}"

    def _where(self, step) -> str:
        """Where a step runs, for a device session's progress reports ('' on the CPU)."""
        return "" if self.device == "cpu" else f" [{self._placement(step)}]"

    def sql_listing(self, plan: Plan, tables: dict[str, str] | None = None) -> str:
        """Every step's SQL; on a device session each step headed by where its kernel runs,
        and why a step stays on the host (``kernel_spec.host_reason``): nothing falls back to
        the CPU unsaid."""
        listing = self.compiler.sql_listing(plan, tables)
        if self.device == "cpu":
            return listing
        lines = [f"-- kernels on {self.device}{' (TF32 allowed for float32 products)' if self.compiler.allow_tf32 else ''}"]
        outputs = {v.name for v in plan.outputs}
        parted_scratch = {c.value for st, c in zip(plan.steps, self.compiler.compile_plan(plan))
                          if c.value not in outputs and _parted(st, c, None, part_bytes=self.part_bytes)}
        kept = self._device_only(plan, parted_scratch)
        for line in listing.splitlines():
            if line.startswith("-- step "):
                step = plan.steps[int(line.split()[2])]
                where = self._placement(step)
                if step_target(step).name in kept:  # its readers all run there too
                    where += f"; its result stays on {self.device}, not copied back, where the device has room"
                line += f"  ({where})"
            lines.append(line)
        return "\n".join(lines)

    def memory_split(self, plan: Plan) -> str | None:
        """How the session's budget is split while ``plan`` runs (for ``explain``)."""
        limit = self.engine_limit(plan)
        if limit is None:
            return None
        spill = self._temp_dir or self._run("SELECT current_setting('temp_directory')")[0][0]
        return (f"memory budget {format_bytes(self.budget)}: DuckDB memory_limit {format_bytes(limit)} while this "
                f"plan runs (spills to {spill}), kernels and Arrow buffers {format_bytes(plan.kernel_bytes)} "
                f"(the plan's largest step), {format_bytes(max(self.budget - limit - plan.kernel_bytes, 0))} left for what "
                f"neither counts (plans get {BUDGET_SHARE:.0%} of the budget, DuckDB {ENGINE_MARGIN:.0%} more for what "
                f"it holds beyond their projection); not counted at all: the interpreter "
                f"and libraries (~{FIXED_OVERHEAD_MB} MB)")

    def _remember(self, setting: str, con=None) -> None:
        """Before we first change ``setting`` on a connection the user passed in: its value, for
        ``close()`` to put back."""
        if not self.owns_connection and setting not in self._their_settings:
            value = (con or self._work).execute("SELECT current_setting(?)::VARCHAR", [setting]).fetchall()[0][0]
            self._their_settings[setting] = value

    def _still_ours(self, setting: str) -> bool:
        """Whether ``setting`` on the user's connection is still what this session left it at:
        one the user changed since (``SET memory_limit`` between plans) is theirs, and
        ``close()`` put back the value from before the session over it (a trial)."""
        if setting == "memory_limit":
            if self._memory_limit is None:
                return False
            now, ours = self._work.execute("SELECT current_setting('memory_limit')::VARCHAR, format_bytes(?::BIGINT)",
                                           [int(self._memory_limit)]).fetchall()[0]
            return now == ours  # both as DuckDB shows a limit ("2.7 GiB")
        now = str(self._work.execute("SELECT current_setting(?)::VARCHAR", [setting]).fetchall()[0][0])
        if setting == "temp_directory":
            return self._temp_dir is not None and os.path.abspath(now) == os.path.abspath(self._temp_dir)
        if setting == "arrow_large_buffer_size":
            return now.lower() == "true"  # what every step leaves
        return True

    def _set_memory_limit(self, limit: int) -> None:
        if limit != self._memory_limit:
            self._remember("memory_limit")
            self._run(f"SET memory_limit = '{int(limit)}B'")
            self._memory_limit = limit

    def _engine_memory(self, plan: Plan):
        return self._memory_limit_while(self.engine_limit(plan))

    @contextlib.contextmanager
    def _memory_limit_while(self, limit: int | None):
        """DuckDB's ``memory_limit`` at ``limit`` for the block (None: as it is), then back to
        the limit the block found (a read inside a plan's progress callback, a plan inside
        another's: the outer one's; the idle one went back before, and the rest of the plan ran
        over its budget), surviving a late interrupt."""
        if limit is None:
            yield
            return
        found = self._memory_limit
        self._set_memory_limit(limit)
        try:
            yield
        finally:
            if not self._closed:
                back = found if found is not None else self._idle_limit()
                if back != self._memory_limit:
                    self._cleanup(f"SET memory_limit = '{int(back)}B'")
                    self._memory_limit = back

    def _reading(self, value: TiledValue):
        """Room for DuckDB to read ``value``'s table: a scan pins every blob of a row group
        (backends/parts.py), so a table read whole needs its bytes pinned at once. A temporary
        result (never written as parts) of 64 MiB under ``memory="100MB"`` (DuckDB's 64 MiB)
        was written while its plan ran and then could not be read back: DuckDB's own out-of-
        memory error (a new user's report, the README's own example). The read's array needs
        those bytes anyway; a tensor stored as parts needs one part's, and gets no more (a
        larger limit would let DuckDB cache more of a big file)."""
        if self.budget is None:
            return self._memory_limit_while(None)
        # a part holds ~PART_BYTES, or one tile of more (a one-tile tensor over PART_BYTES is
        # one part); a temporary result's, one statement's of the plan that wrote it
        parts = self._temp_parts.get(value.name.lower()) or self._parts_of(value.name)
        tile = math.prod(value.tile) * np.dtype(value.dtype).itemsize
        need = max(parted.PART_BYTES, tile, -(-value.nbytes // len(parts))) if parts else value.nbytes
        limit = self._idle_limit() + need + MIN_ENGINE_BYTES // 4
        return self._memory_limit_while(limit if limit > (self._memory_limit or 0) else None)

    def _set_large_buffers(self, on: bool, force: bool = False) -> None:
        if force or on != self._large_buffers:
            self._run(f"SET arrow_large_buffer_size = {'true' if on else 'false'}")
            self._large_buffers = on

    def _cleanup(self, sql: str) -> None:
        """Run a statement that undoes a stopped plan (ROLLBACK, a drop), whatever happens. A stop
        decided on another thread (the watchdog: Ctrl-C, a progress callback that raised) may
        reach the connection while this runs; DuckDB interrupts even a ROLLBACK, and the
        transaction then stays aborted: every later statement of the session failed ("Current
        transaction is aborted"; measured: 166 of 300 ROLLBACKs under repeated interrupts). An
        interrupt is spent on the statement it stops, so the statement is tried again."""
        stopped = None
        for attempt in range(4):
            try:
                self._run(sql)
                break
            except duckdb.InterruptException:
                continue
            except RuntimeError as e:  # a Ctrl-C through Python's handler, outside a watched run:
                if str(e) != "Query interrupted":  # the statement is done first, then it is raised
                    raise
                stopped = e
            except duckdb.Error:
                break
        if stopped is not None:
            raise stopped

    def _run(self, sql: str, params: list | None = None) -> list:
        """Execute on our cursor and drain (an unfinished result blocks a DuckDB connection)."""
        self._check_open()
        if (self._catalog_seen or self._parts_seen) and _touches_catalog(sql):
            self._forget_catalog()
        try:
            return self._work.execute(sql, params).fetchall() if params is not None else self._work.execute(sql).fetchall()
        except BaseException:  # a failed COMMIT rolls back what the cache may have seen
            self._forget_catalog()
            raise

    def _forget_catalog(self) -> None:
        self._catalog_seen.clear()
        self._parts_seen.clear()

    def _check_catalog(self) -> None:
        """Once a session call, before answering from what was seen: forget it if the catalog
        changed since the last check (its row count and the sum of its rows' hashes)."""
        if self._checked[0] == self._calls:
            return
        try:
            # eds_parts is ours alone (its part tables' names are internal): the catalog's rows
            # are what a user may edit (0.54 ms, 0.87 with eds_parts too)
            fingerprint = tuple(self._run("SELECT count(*), sum(hash(name, shape, dtype, tile, keys)) "
                                          "FROM eds_catalog")[0])
        except duckdb.CatalogException:  # a database without a catalog (read-only, or older)
            fingerprint = None
        if fingerprint != self._checked[1] or fingerprint is None:
            self._forget_catalog()
        self._checked = (self._calls, fingerprint)

    # -- SQL interface ----------------------------------------------------------------------
    def register_sql_interface(self, einsum_sql: Callable[..., str]) -> None:
        """``einsum(spec, a, ...)``, ``einsum_elements(...)`` and ``einsum_topk(spec, k, ...)`` as
        table macros (with ``join :=`` and ``agg :=``) over a UDF that plans the einsum and
        returns the query text for ``query()``; and the kernels that query may call beyond the
        plan steps' own (packing ordinary tables into tiles, top-k)."""
        from eindecomp_sql.udfs.pack import register_pack
        from eindecomp_sql.udfs.topk import register_topk

        text = duckdb.sqltype("VARCHAR")
        # names are resolved on our cursor, whose default is the session's database and schema
        home = self.home = tuple(self._run("SELECT current_database(), current_schema()")[0])

        def udf(spec, names, mode, join, agg, k, where):
            if where is not None and tuple(where) != home:
                raise EinsumError(
                    f"einsum(): this connection's default schema is {'.'.join(map(str, where))} (after USE or SET "
                    "search_path), but "
                    f"einsum() reads stored tensors and tables from the session's {'.'.join(home)}; run "
                    f"USE {'.'.join(ident(n).sql(dialect='duckdb') for n in home)} first")
            return einsum_sql(spec, list(names) if names is not None else [], mode, join, agg, k)

        # NULLs reach the planner (a NULL spec or k gets our message, not a NULL query text)
        self._functions.create_function("eds_einsum_sql", udf, [text, duckdb.list_type(text), text, text, text, text,
                                                         duckdb.list_type(text)], text,
                                 side_effects=True, null_handling="special")
        register_pack(self._functions)
        register_topk(self._functions)
        self._make_macros(self.con)

    @staticmethod
    def _make_macros(con) -> None:
        for macro, mode, k_param, more_params, k_arg in _SQL_MACROS:
            # TEMP macros live on the connection that creates them: the user's, not our cursor
            con.execute(template("macros").format(macro=macro, mode=exp.Literal.string(mode).sql(dialect="duckdb"),
                                                  k_param=k_param, more_params=more_params, k_arg=k_arg))

    def sql_cursor(self):
        """A new cursor of the user's connection with the SQL functions on it (its TEMP macros;
        the UDFs are the connection's), in the session's database and schema: DuckDB runs one
        statement at a time per connection, and ``db.connection.cursor()`` had no
        ``einsum_elements`` ("does not exist": a SQL user's trial), so threads could not run SQL
        einsums at once."""
        with self.lock:
            self._check_open()
            cur = self.con.cursor()
            try:
                cur.execute(f"USE {'.'.join(ident(str(n)).sql(dialect='duckdb') for n in self.home)}")
                self._make_macros(cur)
            except BaseException:
                cur.close()
                raise
            return cur

    # -- catalog ----------------------------------------------------------------------------
    def lookup(self, name: str) -> TiledValue | None:
        key = name.lower()  # DuckDB's table names are case-insensitive: so is the catalog
        with self.lock:
            self._check_open()
            self._check_catalog()
            if key in self._catalog_seen:
                return self._catalog_seen[key]
            try:
                rows = self._run("SELECT name, shape, dtype, tile, keys FROM eds_catalog WHERE lower(name) = lower(?)",
                                 [name])
            except duckdb.CatalogException:
                return None
            found = None
            if rows:
                stored, shape, dtype, tile, keys = rows[0]
                found = TiledValue(stored, tuple(shape), dtype, tuple(tile), tuple(keys))
            self._catalog_seen[key] = found
            return found

    @staticmethod
    def bound_free_memory() -> None:
        """Freed memory over the cap handed back (``allocator.bound_free_memory``)."""
        allocator.bound_free_memory()

    def table_operand(self, name: str):
        """Table or view ``name`` as an einsum operand (``tables.read_table_operand``: element or
        array form, with its statistics), or None where there is none by that name."""
        with self.lock:
            self._check_open()
            return read_table_operand(self.con, name, getattr(self, "home", None))

    def holds_table(self, name: str) -> bool:
        """Whether ``name`` is a table or view the connection reads by that bare name (what the
        SQL functions take as an operand), for the message that says so."""
        with self.lock:
            self._check_open()
            return bool(self._run(COUNT_NAMED.format(where=WHERE_BARE_NAMES_RESOLVE), [name])[0][0])

    def names(self) -> list[str]:
        with self.lock:
            try:
                # interruptibly: duckdb-python's own check turns a Ctrl-C into RuntimeError('Query
                # interrupted'), as it does any signal handler's error, so only our watch can
                # tell a Ctrl-C (KeyboardInterrupt) from the others
                return run_interruptible(lambda: [r[0] for r in self._run("SELECT name FROM eds_catalog ORDER BY name ASC")],
                                         self._work.interrupt, self.kernels, stopper=self.stopper)
            except duckdb.CatalogException:  # a database opened read-only that never had a catalog
                return []

    def table_exists(self, table_name: str) -> bool:
        """Whether a table or view of this name (DuckDB compares names case-insensitively)
        exists. Binding a query that reads nothing answers yes in ~0.5 ms; when it fails, the
        catalog functions (~4.5 ms) decide, since a view that no longer binds exists too."""
        if not self.open_transaction:  # a failed statement aborts the transaction it ran in (a
            # store from a progress callback runs inside the plan's: both failed, a review)
            try:
                self._run(exp.select("1").from_(table(table_name)).limit(0).sql(dialect="duckdb"))
                return True
            except duckdb.Error:
                pass
        n = self._run(COUNT_NAMED.format(where=WHERE_BARE_NAMES_RESOLVE), [table_name])
        return bool(n[0][0])

    def _write_catalog(self, table_name: str, value: TiledValue) -> None:
        # the row as lookup() reads it back; already there (as seen since our last write): a
        # tensor replaced by one of the same name and layout, a repeated out=
        entry = TiledValue(table_name, tuple(value.shape), value.dtype, tuple(value.tile), tuple(value.keys))
        if self._catalog_seen.get(table_name.lower()) == entry:
            return
        # _run forgets the cache on these writes; what they change is one row, so the rest is
        # put back (a spy on _run, as tests set, sees the same two statements as before)
        seen, parts = dict(self._catalog_seen), dict(self._parts_seen)
        self._run("DELETE FROM eds_catalog WHERE lower(name) = lower(?)", [table_name])
        self._run(
            "INSERT INTO eds_catalog VALUES (?, ?, ?, ?, ?)",
            [table_name, list(value.shape), value.dtype, list(value.tile), list(value.keys)],
        )
        # what the catalog now says: this name's row changed and nothing else (a failed
        # statement, or a rollback of the transaction, forgets it all again, in _run)
        seen[table_name.lower()] = entry
        self._catalog_seen.update(seen)
        self._parts_seen.update(parts)

    def _store_failed(self, value: TiledValue, e: duckdb.Error) -> str:
        """What a failed store says: DuckDB's error, and where it ran out of memory under a
        budget, which tile did not fit and what to pass (a trial: a 137.5 MiB tile under
        memory="100MB" was DuckDB's "could not allocate block", with its advice to SET threads)."""
        text = f"store({value.name!r}): DuckDB could not store the tiles: {duckdb_said(e)}"  # not its SET advice
        if not isinstance(e, duckdb.OutOfMemoryException) or self.budget is None:
            return text
        tile = math.prod(value.tile) * np.dtype(value.dtype).itemsize
        fit = max(1, self._idle_limit() // 4)
        if tile <= fit:
            return f"{text} (under memory={format_bytes(self.budget)}: give a larger memory=)"
        return (f"store({value.name!r}): a tile of {value.tile} {value.dtype} is {format_bytes(tile)}, more than "
                f"DuckDB can hold under memory={format_bytes(self.budget)} (its memory_limit "
                f"{format_bytes(self._memory_limit or 0)}): from an array or a table of elements or arrays, pass a "
                # a tiled file keeps its tiles: "without tile=, store cuts tiles to fit" misled a
                # budget trial storing one of 537 MB tiles
                f"smaller tile= (under {format_bytes(fit)}; without tile=, store cuts those to fit the budget); a "
                f"tiled file or table keeps its own tiles, which are read whole, whatever tile= is asked: write it "
                f"again in smaller tiles; or give a larger memory=. DuckDB said: "
                f"{str(e).splitlines()[0]}")

    def drop_table(self, table_name: str) -> None:
        """Drop a table that is not in the catalog (a temporary result), if it exists; one
        written as parts is a view, dropped with its parts."""
        with self.lock:
            names = self._temp_parts.get(table_name.lower())
            if names is None:
                self._run(self.compiler.drop_table_sql(table_name))
                return
            self._drop_parted(table_name, names)
            del self._temp_parts[table_name.lower()]

    def drop(self, name: str) -> None:
        with self.lock:
            self._check_writable(f"drop({name!r})")
        try:
            with self.lock, self._transaction():
                self._drop_stored(name)
                self._run("DELETE FROM eds_catalog WHERE lower(name) = lower(?)", [name])
        except duckdb.Error as e:  # a database opened read-only, say: the transaction rolled back
            raise EinsumError(f"drop({name!r}): DuckDB could not drop it: {e}") from e

    # -- parted tensors (backends/parts.py) -------------------------------------------------
    def _parts_of(self, name: str) -> list[str]:
        """The part tables of stored tensor ``name``, in order; [] for a tensor that is one table
        (or a database written before parts, which has no ``eds_parts``)."""
        key = name.lower()
        self._check_catalog()
        if key in self._parts_seen:
            return list(self._parts_seen[key])
        try:
            found = [r[0] for r in self._run(f"SELECT part FROM {parted.PARTS_TABLE} WHERE lower(name) = lower(?) "
                                             "ORDER BY k ASC", [name])]
        except duckdb.CatalogException:  # a database without eds_parts (read-only, or older)
            found = []
        self._parts_seen[key] = found
        return list(found)

    def _drop_stored(self, name: str) -> None:
        """Drop stored tensor ``name``'s table, or its view, parts and their list (inside the
        caller's transaction)."""
        parts = self._parts_of(name)
        if not parts:
            reads = self._view_parts(name)
            if reads is None:
                self._run(drop_table(name).sql(dialect="duckdb"))
                return
            # a view whose eds_parts rows were deleted by hand: DuckDB refused to drop it as a
            # table, so neither drop nor replace could remove the tensor (a trial); its parts are
            # the ones its SQL reads that no other tensor lists
            listed = {r[0].lower() for r in self._run(f"SELECT part FROM {parted.PARTS_TABLE}")}
            parts = [p for p in reads if p.lower() not in listed]
        self._drop_parted(name, parts)
        self._run(f"DELETE FROM {parted.PARTS_TABLE} WHERE lower(name) = lower(?)", [name])

    def _drop_parted(self, name: str, parts: list[str]) -> None:
        """A value written as parts: its view, then its part tables (a stored tensor's or a
        temporary result's)."""
        self._run(exp.Drop(tables=[table(name)], kind="VIEW", exists=True).sql(dialect="duckdb"))
        for p in parts:
            self._run(self.compiler.drop_table_sql(p))

    def _list_parts(self, name: str, parts: list[str]) -> None:
        """Make ``parts`` stored tensor ``name``: its view and its ``eds_parts`` rows (inside
        the caller's transaction, with the catalog row)."""
        self._run(parted.view_sql(name, parts))
        self._run(f"INSERT INTO {parted.PARTS_TABLE} SELECT ?, k - 1, part FROM "
                  "unnest(?) WITH ORDINALITY AS u(part, k)", [name, parts])

    def _commit_parts(self, name: str, parts: list[str], replacing: bool, keys: tuple[str, ...]) -> None:
        """Make ``parts`` stored tensor ``name`` (inside the caller's transaction, with the
        catalog row), in place of the tensor of that name when ``replacing``. One of as many
        parts, in structs too, with the same key columns (``keys``: the view's columns stay
        what it was made over) and the name spelled as before (the view keeps its spelling; a
        review), as a repeated ``out=`` or a store replaced, keeps its view and its
        ``eds_parts`` rows: the new parts take the old ones' names (two statements a part
        instead of the seven that drop and list them, ~8 ms a 64 MiB GEMM's ``out=`` here)."""
        old = self._parts_of(name) if replacing else []
        was = self.lookup(name) if old else None
        if (len(old) == len(parts) and parted.wrapped(old)  # new parts always are
                and was is not None and tuple(was.keys) == tuple(keys) and was.name == name
                # the view made over them, not one a user put in its place by hand (``CREATE OR
                # REPLACE VIEW``), which a replace must drop rather than leave in front of the
                # new parts (0.75 ms)
                and self._view_parts(name) == list(old)):
            for gone, new in zip(old, parts):
                self._run(self.compiler.drop_table_sql(gone))
                self._run(exp.Alter(this=table(new), kind="TABLE",
                                    actions=[exp.AlterRename(this=table(gone))]).sql(dialect="duckdb"))
            return
        if replacing:
            self._drop_stored(name)
        self._list_parts(name, parts)

    def _views_read(self) -> set[str]:
        """The part tables the views of the database read (lower-cased)."""
        rows = self._run("SELECT sql FROM duckdb_views() WHERE database_name = current_database() "
                         "AND schema_name = 'main' AND NOT internal")
        return {p.lower() for (text,) in rows for p in parted.parts_read(text or "")}

    def _view_parts(self, name: str) -> list[str] | None:
        """The part tables view ``name`` reads, or None where ``name`` is no view."""
        rows = self._run("SELECT sql FROM duckdb_views() WHERE database_name = current_database() "
                         "AND schema_name = 'main' AND lower(view_name) = lower(?)", [name])
        return parted.parts_read(rows[0][0] or "") if rows else None

    def _sweep_parts(self) -> None:
        """Drop part tables that no tensor lists: what a process killed while storing left.
        One a view still reads is spared: ``eds_parts`` rows deleted by hand made the next open
        drop a tensor's every part, its view and catalog row left reading nothing (a trial)."""
        rows = self._run(f"SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
                         f"AND schema_name = 'main' AND starts_with(table_name, '{parted.PREFIX}') "
                         f"AND table_name NOT IN (SELECT part FROM {parted.PARTS_TABLE})")
        read = self._views_read() if rows else set()
        for (name,) in rows:
            if name.lower() in read:
                continue
            try:
                self._run(self.compiler.drop_table_sql(name))
            except duckdb.Error:  # best effort: it holds nothing anyone reads
                pass

    def _store_parts(self, value: TiledValue, sources, replacing: bool, watch: Watch | None = None) -> None:
        """Store each of ``sources`` (RecordBatchReaders, or SELECTs DuckDB runs) as a part
        table, each created and committed by its own statement, then the view, the part list
        and the catalog row in one transaction (with the old tensor's removal when ``replacing``
        one that exists).
        A failure drops the parts made; a crash leaves parts listed nowhere, swept at the next
        open."""
        made: list[str] = []
        names = iter(parted.new_part_names(parted.MAX_PARTS + 1))
        view = "_eds_load"
        try:
            for source in sources:
                if watch is not None and watch.stopping():  # Ctrl-C between parts
                    raise Cancelled("the store was stopped")
                made.append(next(names))
                if isinstance(source, exp.Expression):
                    self._run(parted.create_part_sql(made[-1], source))
                    continue
                self._work.register(view, source)
                try:
                    self._run(parted.create_part_sql(made[-1], exp.select("*").from_(table(view))))
                finally:
                    self._unregister(view)
            with self._transaction():
                self._commit_parts(value.name, made, replacing, value.keys)
                self._write_catalog(value.name, value)
                if watch is not None and not watch.commit():  # roll back: the old tensor stands
                    raise Cancelled("the store was stopped before it committed")
        except BaseException:
            for p in made:
                self._cleanup(self.compiler.drop_table_sql(p))
            raise

    # -- transactions -----------------------------------------------------------------------
    class _Tx:
        def __init__(self, backend: "DuckDBBackend"):
            self.backend = backend
            self.own = False

        def __enter__(self):
            b = self.backend
            # set before BEGIN and cleared after COMMIT or ROLLBACK: never False while a
            # transaction of ours is open, though a signal handler raise anywhere (see ``recover``)
            outer = b.open_transaction
            b.open_transaction = True
            if outer:
                # a plan run inside a running one (from its progress callback, on its thread): in
                # the outer transaction. A BEGIN there fails, and a failed statement aborts the
                # transaction it ran in: both plans failed ("Current transaction is aborted", a trial)
                self.own = False
                return self
            try:
                b._run("BEGIN TRANSACTION")
                self.own = True
            except duckdb.TransactionException:
                self.own = False  # the caller's transaction holds us
            except BaseException:  # a handler's error as BEGIN returned: the transaction is ours
                if not outer:  # (not an enclosing one's)
                    b._cleanup("ROLLBACK")
                    b.open_transaction = False
                raise
            return self

        def __exit__(self, et, ev, tb):
            if not self.own:
                return False
            if et is None:
                try:
                    self.backend._run("COMMIT")
                except duckdb.Error as e:  # the disk full, the WAL not writable: bad luck, not a bug
                    self.backend._cleanup("ROLLBACK")  # (DuckDB rolled back already: "no transaction")
                    self.backend.open_transaction = False
                    raise EinsumError(f"could not commit: {e} (nothing of this call was written)") from None
            else:
                self.backend._cleanup("ROLLBACK")
            self.backend.open_transaction = False
            return False

    def recover(self) -> None:
        """Roll back a transaction an earlier call left open. Python runs a signal handler after
        any call returns, and one that raises (a SIGALRM deadline) just as BEGIN returned, or as
        a failed block's ROLLBACK was about to run, left the cursor in the transaction: every
        later statement ran inside it, and the session broke at the next BEGIN ("Current
        transaction is aborted"), or lost what those statements wrote. The session calls this
        at the start of each call; one attribute read when nothing is open."""
        self.call_begins()
        if self.open_transaction:
            with self.lock:
                self._cleanup("ROLLBACK")  # DuckDB's "no transaction is active" is caught there
                self.open_transaction = False

    def call_begins(self) -> None:
        """A session call (or an ``einsum(...)`` query's planning) begins: what the catalog
        says is checked again at its first read (``_check_catalog``)."""
        self._calls += 1

    def _transaction(self, needed: bool = True):
        """BEGIN ... COMMIT around a block, or nothing where the block is one statement that is
        atomic on its own (``needed`` False: BEGIN and COMMIT cost ~0.7 ms)."""
        return self._Tx(self) if needed else contextlib.nullcontext()

    def _check_writable(self, what: str) -> None:
        """Refuse a write to a database open read-only, before anything runs (it failed inside
        the plan's first step, or the drop's statement, in DuckDB's words)."""
        if self._read_only is None:  # our cursor's database: the same for the session's life (cached:
            # a query on every out= call cost the small-work path ~0.4 ms)
            self._read_only = bool(self._run("SELECT readonly FROM duckdb_databases() WHERE database_name = "
                                             "current_database()")[0][0])
        if self._read_only:
            raise EinsumError(f"{what}: this database is open read-only (connect(..., read_only=True)); open it "
                              "writable to store, drop or keep tensors (an einsum without out= gives a temporary "
                              "result here)")

    def _check_target(self, table: str, replace: bool) -> bool:
        """Refuse an existing table unless ``replace``, and a table or view that is not a stored
        tensor even then (``replace`` overwrites tensors: a user's own table is not ours to drop,
        and a view made DuckDB refuse mid-write); whether it exists."""
        self._check_writable(f"cannot write {table!r}")
        exists = self.table_exists(table)
        stored = exists and self.lookup(table) is not None
        if stored and not replace:
            raise EinsumError(f"table {table!r} already exists; pass replace=True to overwrite it")
        if exists and not stored:  # with or without replace (so no advice to pass it)
            why = "; replace=True overwrites stored tensors only" if replace else ""
            raise EinsumError(f"{table!r} is a table or view of the database that is not a stored tensor{why}: "
                              "choose another name, or drop it first")
        return exists

    # -- data in and out --------------------------------------------------------------------
    def store_tiles(self, value: TiledValue, tiles, replace: bool = False) -> None:
        """Store tiles as tensor ``value.name``: one table in one transaction, or, above
        ``parts.PART_BYTES``, part tables behind a view (backends/parts.py). Either way a failure
        leaves no table, no part and no catalog row. ``tiles``: a pyarrow Table; a
        ``pyarrow.RecordBatchReader``, scanned by DuckDB as it streams (a batch at a time in
        Python); or an ``io.ParquetRows``, whose SELECTs (``read_parquet(...)``) DuckDB runs
        itself. Key columns, then ``tile``."""
        with self.lock:
            exists = self._check_target(value.name, replace)
            # Ctrl-C interrupts the running statement, and one between statements is seen at
            # the commit point (watch.commit): either way nothing commits and the caller gets
            # KeyboardInterrupt, not DuckDB's "Query interrupted" inside our error (a ValueError)
            watch = Watch(None, [], self.kernels)
            run_interruptible(lambda: self._store_tiles(value, tiles, replace, exists, watch), self._work.interrupt,
                              self.kernels, watch, self.stopper)

    def _store_tiles(self, value: TiledValue, tiles, replace: bool, exists: bool, watch: Watch) -> None:
        attach = getattr(tiles, "attach", None)  # a source DuckDB packs itself (io.PackedRows)
        with attach(self._work) if attach is not None else contextlib.nullcontext():
            self._store_tile_rows(value, tiles, replace, exists, watch)

    def _store_tile_rows(self, value: TiledValue, tiles, replace: bool, exists: bool, watch: Watch) -> None:
        rows = parted.rows_per_part(value, self.part_bytes)
        file_rows = getattr(tiles, "select_rows", None)  # a file DuckDB reads itself (io.ParquetRows)
        if rows is not None:
            if file_rows is not None:
                sources = (file_rows(lo, lo + rows) for lo in range(0, tiles.rows, rows))
            elif isinstance(tiles, pa.RecordBatchReader):
                sources = parted.split_reader(tiles, rows)
            else:
                sources = parted.split_reader(pa.RecordBatchReader.from_batches(tiles.schema, tiles.to_batches()),
                                              rows)
            try:
                self._store_parts(value, sources, exists, watch)
            except duckdb.Error as e:
                raise EinsumError(self._store_failed(value, e)) from None
            return
        old_parts = exists and bool(self._parts_of(value.name))
        view = "_eds_load"
        query = file_rows() if file_rows is not None else None
        if query is None:
            self._work.register(view, tiles)
        try:
            with self._transaction():
                if old_parts:  # a parted tensor's view cannot be replaced by a table
                    self._drop_stored(value.name)
                select = query if query is not None else exp.select("*").from_(table(view))
                self._run(create_table_as(value.name, select, replace=replace).sql(dialect="duckdb"))
                self._write_catalog(value.name, value)
                if not watch.commit():  # Ctrl-C after the statement: roll back, the old tensor stands
                    raise Cancelled("the store was stopped before it committed")
        except duckdb.Error as e:
            raise EinsumError(self._store_failed(value, e)) from None
        finally:
            if query is None:
                self._unregister(view)

    def _unregister(self, view: str) -> None:
        """Drop a registered view in a ``finally``: a failure there (DuckDB invalidated the
        database when the disk filled at the commit) replaced the error that said why with
        DuckDB's raw FatalException (a crash trial); the next call says what to do."""
        try:
            self._work.unregister(view)
        except duckdb.Error:
            pass

    def read_tiles(self, value: TiledValue) -> pa.Table:
        from ..compile import select_value

        with self.lock:
            self._check_open()
            try:
                with self._reading(value):
                    return run_interruptible(
                        lambda: self._work.sql(select_value(value, value.name).sql(dialect="duckdb")).to_arrow_table(),
                        self._work.interrupt, self.kernels, stopper=self.stopper)
            except duckdb.CatalogException as e:
                raise self._gone(value, e) from None
            except duckdb.Error as e:  # out of memory, say: ours, not DuckDB's raw error
                raise EinsumError(f"reading tensor {value.name!r} failed: {e}") from None

    def query_arrow(self, sql: str) -> pa.Table:
        """A query of the SQL interface (``sql_functions.einsum_sql``'s) run on our cursor, as
        Arrow; Ctrl-C and ``interrupt()`` stop it as they stop a plan's statement."""
        with self.lock:
            self._check_open()
            try:
                return run_interruptible(lambda: self._work.sql(sql).to_arrow_table(), self._work.interrupt,
                                         self.kernels, stopper=self.stopper)
            except duckdb.Error as e:
                raise ExecutionError(f"the top-k query failed: {e}") from e

    @contextlib.contextmanager
    def tile_batches(self, value: TiledValue, batch_bytes: int = 64 << 20):
        """The tiles of stored tensor ``value.name`` as an iterator of Arrow record batches of
        about ``batch_bytes`` (at least one tile each), for the ``with`` block, which holds the
        connection. (DuckDB itself reads a table a vector of up to 2,048 rows at a time.)"""
        import math

        import numpy as np

        from ..compile import select_value

        def batches(reader):
            try:
                yield from reader
            except (duckdb.Error, pa.ArrowException) as e:
                raise EinsumError(f"reading tensor {value.name!r} failed: {e}") from None

        largest = max(1, math.prod(value.tile) * np.dtype(value.dtype).itemsize)
        rows = max(1, min(batch_bytes // largest, 2048))
        with self.lock:
            self._check_open()
            with self._reading(value):
                try:
                    reader = self._work.sql(select_value(value, value.name).sql(dialect="duckdb")).to_arrow_reader(rows)
                except duckdb.CatalogException as e:
                    raise self._gone(value, e) from None
                except duckdb.Error as e:
                    raise EinsumError(f"reading tensor {value.name!r} failed: {e}") from None
                try:
                    yield batches(reader)
                finally:
                    reader.close()

    def _gone(self, value: TiledValue, error: duckdb.Error) -> EinsumError:
        """What a read of stored tensor ``value`` that found a table missing says: the table by
        name where the catalog still lists the tensor (a part table dropped in SQL was said as
        "no longer exists in this database", though ``db.tensors()`` listed it: a trial)."""
        missing = re.search(r"Table with name (\S+) does not exist", str(error))
        if missing is not None and self.lookup(value.name) is not None:
            return EinsumError(f"stored tensor {value.name!r}: its table {missing.group(1)!r} no longer exists "
                               f"(renamed or dropped in SQL?); rename it back, or db.drop({value.name!r}) the tensor")
        return EinsumError(f"tensor {value.name!r} no longer exists in this database (dropped, or replaced by "
                           "another session)")

    def _check_open(self) -> None:
        if self._closed:
            raise EinsumError("this session is closed")

    def database_files(self) -> list[str]:
        """The files this connection's databases live in (each attached one, and its WAL): what
        no export may be written over."""
        with self.lock:
            paths = [r[0] for r in self._run("SELECT path FROM duckdb_databases() WHERE path IS NOT NULL")]
        return [f for p in paths for f in (p, f"{p}.wal")]

    def check_tables(self, tables: list[tuple[TiledValue, str]]) -> None:
        """Refuse, before anything runs, to read a stored table (``(value, table name)``) that no
        longer holds ``value``'s grid's keys: edited in SQL, a tile deleted or repeated, a key
        NULL or outside the grid (``compile/tile_check.py``; a NULL tile or one of the wrong
        length, the kernels refuse). One query for all (their keys, ~0.3 ms a table); a table
        that is gone (renamed or dropped in SQL) is said by name, one that no longer binds (its
        columns renamed or retyped) is left to the statements' own error."""
        if not tables:
            return
        from ..compile.tile_check import check_query, problems, split_rows

        tables = tuple(tables)
        query = check_query(tables)
        try:
            with self.lock:  # our cursor, which another thread's plan may be running on
                self._check_open()
                columns = self._work.execute(query).fetchnumpy()  # the keys only: quick
            rows = split_rows(tables, columns)
        except duckdb.CatalogException:
            self._say_gone(tables)  # a table renamed or dropped in SQL: "Table with name A does not
            return  # exist!" from step 0 said neither what nor why (a trial)
        except (duckdb.BinderException, duckdb.ConversionException, ValueError,
                TypeError):  # its columns renamed or retyped: the statements say so, naming the step
            return  # (a Ctrl-C's InterruptException is not caught: it stops the call)
        for (v, t), keys in zip(tables, rows):
            wrong = problems(v, keys)
            if wrong:
                now = self._replaced_since(v)
                if now is not None:
                    # another thread's or connection's store between the plan and this check (a
                    # trial was told to store it again, over the other writer's tensor)
                    raise EinsumError(f"stored tensor {v.name!r} was replaced (now {now}) after "
                                      "this einsum was planned from it, by another thread or connection; run it "
                                      "again; nothing was run")
                raise EinsumError(f"stored tensor {v.name!r} (table {t!r}) no longer holds its tiles: "
                                  f"{'; '.join(wrong)} (was its table edited in SQL? store it again with "
                                  "replace=True); nothing was run")

    def _replaced_since(self, v: TiledValue) -> str | None:
        """What the catalog holds for ``v``'s name now, where that is not ``v`` (shape, dtype,
        tile or keys): a tensor replaced since a plan read it; None where it is still ``v``."""
        try:
            with self.lock:
                rows = self._work.execute("SELECT shape, dtype, tile, keys FROM eds_catalog WHERE lower(name) = "
                                          "lower(?)", [v.name]).fetchall()
        except duckdb.Error:
            return None
        if not rows:
            return None
        shape, dtype, tile, keys = rows[0]
        now = (tuple(shape), dtype, tuple(tile), tuple(keys))
        if now == (tuple(v.shape), v.dtype, tuple(v.tile), tuple(v.keys)):
            return None
        return f"shape {now[0]} {now[1]} in tiles {now[2]}"

    def _say_gone(self, tables) -> None:
        """Refuse with the first stored tensor of ``tables`` whose table no longer exists."""
        for v, t in tables:
            try:
                with self.lock:
                    self._work.execute(exp.select("1").from_(exp.Table(this=ident(t))).limit(0).sql(dialect="duckdb"))
            except duckdb.CatalogException:
                raise EinsumError(f"stored tensor {v.name!r}: its table {t!r} no longer exists (renamed or dropped "
                                  f"in SQL?); rename it back, or db.drop({v.name!r}) its catalog entry; nothing "
                                  "was run") from None

    def execute(self, plan: Plan, inputs, outputs, replace: bool = False, progress=None) -> dict:
        """Run the plan's steps, one statement each (or one per batch), in one transaction;
        see ``base.Backend.execute`` for the binding. Numpy inputs are registered as Arrow
        views for the run; scratch values are TEMP tables dropped at the end.

        Ctrl-C interrupts the running statement and rolls the transaction back, then raises
        KeyboardInterrupt; ``progress`` (a callable) receives a :class:`StepProgress` several
        times a second."""
        outer = self._nest
        # a run inside a run (from its progress callback, on its thread; the session's lock is
        # re-entrant) is counted, not inferred from an open transaction: a plan writing parts
        # runs outside one, and its inner run took its names (a review)
        self._depth += 1
        self._nest = f"{self._depth - 1}_" if self._depth > 1 else ""
        try:
            return self._execute(plan, inputs, outputs, replace, progress)
        finally:
            self._depth -= 1
            self._nest = outer

    def _execute(self, plan: Plan, inputs, outputs, replace: bool = False, progress=None) -> dict:
        compiled = self.compiler.compile_plan(plan)
        self._register_arities(compiled)
        tables: dict[str, str] = {}
        arrays: dict[str, pa.Table] = {}  # value name -> its tiles, for the run
        host: dict[str, tuple] = {}  # ... or its keys only, the kernels reading the array itself
        by_name = inputs_read_by_name(plan) if self.compiler.device_residency else frozenset()
        packed = {}  # value name -> (table operand, value): packed into a TEMP table for the run
        for v in plan.inputs:
            x = inputs[v.name]
            if isinstance(x, str):
                tables[v.name] = x
            elif isinstance(x, (ElementTable, ArrayTable)):
                packed[v.name] = (x, v)
            elif v.name in by_name:
                # its tiles never enter DuckDB: the SQL joins their keys and hands the kernels
                # NULL, and they read views of the array (udfs/register.py: _host_tile). Two
                # 64 MB operands took 8.5 ms to reach a UDF through DuckDB, holding the GIL
                host[v.name] = (_native(x, v.dtype), v.tile)
                arrays[v.name] = null_tiles(v.shape, v.tile, v.keys)
            else:
                arrays[v.name] = tiles_from_array(x, v.tile, v.keys)
        # results returned as arrays, computed by kernels that name them: made here, and the
        # kernels write their tiles straight in (udfs/register.py: _host_out), so they neither
        # enter DuckDB nor come back out of it (three copies of the result, and two of its bytes)
        results = {}
        if self.compiler.device_residency:
            for s in plan.steps:
                v = step_target(s)
                t = outputs.get(v.name)
                if t is not None and t.table is None and isinstance(s, (EinsumStep, ProgramStep)):
                    results[v.name] = (np.empty(v.shape, v.dtype), v.tile)
        for k, v in enumerate(plan.scratch):
            tables[v.name] = f"_eds_s{self._nest}{k}"
        for name, t in outputs.items():
            if t.table is not None:
                tables[name] = t.table
        # step descriptions only when someone watches: describe() is string work on a hot path
        steps = [(s.describe() + self._where(s), output_tiles(s)) for s in plan.steps] if progress is not None else []
        watch = Watch(progress, steps, self.kernels)
        with self.lock:
            self._check_open()
            self.check_tables([(v, inputs[v.name]) for v in plan.inputs if isinstance(inputs.get(v.name), str)])
            swaps: dict[str, str] = {}  # a fresh table -> the parted tensor it replaces at the end
            # a kept result or scratch value over PART_BYTES is stored as parts, a statement
            # each (one part for a result of one statement; their names are fresh: nothing to swap)
            # (value -> whether its table exists: probed here, where a failed probe aborts nothing)
            device = self.kernels.device_cache is not None
            parts_of = {c.value: False for st, c in zip(plan.steps, compiled)
                        if _parted(st, c, outputs[c.value] if c.value in outputs else None, device,
                                   self.part_bytes)}
            for name, t in outputs.items():
                if t.table is not None and not t.temporary:
                    exists = self._check_target(t.table, replace)
                    if name in parts_of:
                        parts_of[name] = exists
                    elif exists and (parts_of or self._parts_of(t.table)):
                        # a view cannot be replaced by a table, and a plan writing parts runs
                        # outside one transaction: the result is written under a fresh name
                        # (the plan may still read the old one) and renamed once it is whole
                        tables[name] = parted.new_part_names(1)[0].replace(parted.PREFIX, "_eds_new_")
                        swaps[tables[name]] = t.table
            with (self._arrays(arrays, host, results) as names, self._engine_memory(plan),
                  self._packed(packed) as packs, self._device_tiles(plan, inputs, set(parts_of))):
                tables.update(names)
                tables.update(packs)
                rows = run_interruptible(
                    lambda: self._run_steps(plan, compiled, tables, outputs, replace, watch, swaps, parts_of),
                    self._work.interrupt, self.kernels, watch, self.stopper)
        allocator.bound_free_memory()
        # a result the kernels wrote into its array has NULL tiles here; any other tile fills in
        return {name: array_from_tiles(t, v.shape, v.tile, v.dtype, v.keys,
                                       out=results[name][0] if name in results else None)
                for (name, t), v in zip(rows.items(), (_output(plan, n) for n in rows))}

    @contextlib.contextmanager
    def _packed(self, packed: dict):
        """Tables of the database given as operands (element or array form), each packed into
        a TEMP table in the tiles the plan cuts it in, by the query the SQL functions inline
        (``pack_query``: its checks of indices and values included), for the block: value
        name -> the TEMP table. The table's rows are read once, before the plan's statements."""
        names: dict[str, str] = {}
        made: list[tuple[str, str]] = []  # (kind, name) of every TEMP table and view made, to drop
        try:
            for value, (op, v) in packed.items():
                name = f"_eds_t{next(_PACKS)}"
                names[value] = name
                axis, bands, as_parts = self._pack_bands(op, v)
                # several statements read one snapshot, which holds the rows the statistics
                # counted: each in autocommit read its own, and a writer's commit between two gave
                # a torn or short table in silence (a review; one statement checks in its query)
                with self._transaction(needed=len(bands) > 1):
                    if len(bands) > 1:
                        self._check_rows(op)
                    if not as_parts:
                        made.append(("TABLE", name))
                        for k, band in enumerate(bands):
                            self._pack_band(op, v, name, k, band, axis)
                        continue
                    # each band a TEMP table of its own behind a TEMP view, as a big stored
                    # tensor is kept in parts (backends/parts.py): DuckDB reads a row group's
                    # blobs whole, and one table of a 4000² float64 operand's 128 MB failed to
                    # pin under a 120 MB memory_limit where the same tensor stored ran (a trial)
                    bands_made = [f"{name}_{k}" for k in range(len(bands))]
                    for k, band in enumerate(bands):
                        made.append(("TABLE", bands_made[k]))
                        self._pack_band(op, v, bands_made[k], 0, band, axis, part=True)
                    made.append(("VIEW", name))
                    self._run(parted.view_sql(name, bands_made, temporary=True))
            yield names
        finally:
            for kind, name in reversed(made):
                if not self._closed:
                    self._run(f"DROP {kind} IF EXISTS {name}")

    def _check_rows(self, op) -> None:
        """Refuse a table whose rows, in this transaction's snapshot, are not those its
        statistics counted (its shape was planned from them)."""
        n = self._run(exp.select("count(*)").from_(table(op.table)).sql(dialect="duckdb"))[0][0]
        if n != op.rows:
            raise EinsumError(f"einsum(): table {op.table!r} changed while einsum read it (planned from {op.rows} "
                              f"rows; {n} now); run it again")

    def _pack_band(self, op, v, name: str, k: int, band, axis: int, part: bool = False) -> None:
        """One statement packing ``band`` of table operand ``op`` into TEMP table ``name`` (a
        part behind a view, ``part``: its tiles in a struct, backends/parts.py)."""
        query = pack_query(op, v, self.compiler, band, axis).sql(dialect="duckdb")
        if part:
            sql = parted.create_part_sql(name, query, temporary=True)
        else:
            sql = f"CREATE TEMP TABLE {name} AS {query}" if k == 0 else f"INSERT INTO {name} {query}"
        try:
            run_interruptible(lambda: self._run(sql), self._work.interrupt, self.kernels, stopper=self.stopper)
        except duckdb.Error as e:
            # the table's own fault (two rows for one element, rows added since its shape was
            # read), said by the pack kernel or the query's error(): ours
            said = re.search(r"(einsum\(\): .*)", str(e), re.S)
            if said:
                raise EinsumError(said.group(1)) from None
            raise ExecutionError(f"reading {op.describe()} into tiles failed: {e}") from e

    def _register_arities(self, compiled) -> None:
        """The einsum kernels of more than ``MAX_ARITY`` operands the statements call, registered
        now (a non-sum join of 9 operands is one step: "Scalar Function with name eds_einsum9
        does not exist", a trial); 1..MAX_ARITY are registered with the connection."""
        from eindecomp_sql.udfs.register import ARITY_UDF, MAX_ARITY, register_arity

        wanted = {int(n) for c in compiled for n in ARITY_UDF.findall(c.text)} - set(range(1, MAX_ARITY + 1))
        with self.lock:
            for n in sorted(wanted):
                if f"eds_einsum{n}" not in self._functions.names:
                    register_arity(self._functions, self.kernels, n)

    def _pack_bands(self, op, v: TiledValue) -> tuple[int, list[tuple[int, int] | None], bool]:
        """The statements a table operand is packed in: under a budget, bands of keys along its
        axis of most tiles (an array table's rows) whose packing (``pack_bytes``) fits half of
        DuckDB's limit (one statement held a 1500² table's element rows as lists for every tile
        at once, out of memory under memory="100MB"; a 3 x 1,200,000 table's tiles were all
        along its second axis) and whose tiles fit a stored part (``parts.rows_per_part``); else
        one statement (None). Returns (axis, bands, whether each band is a table of its own:
        the tiles are more than one part)."""
        if self.budget is None or not v.shape:
            return 0, [None], False
        axis = 0 if isinstance(op, ArrayTable) else max(range(len(v.grid)), key=lambda p: v.grid[p])
        across = math.prod(g for p, g in enumerate(v.grid) if p != axis)  # tiles per key of the axis
        per_key = pack_bytes(op, math.prod(v.tile) * across)
        step = max(1, (self._memory_limit or self.budget) // 2 // max(per_key, 1))
        part = parted.rows_per_part(v, self.part_bytes)
        if part is not None:
            step = min(step, max(1, part // across))
        if step >= v.grid[axis]:
            return axis, [None], False  # one statement, whose query counts the rows it reads (a review)
        return axis, [(lo, min(lo + step, v.grid[axis])) for lo in range(0, v.grid[axis], step)], part is not None

    @contextlib.contextmanager
    def _device_tiles(self, plan: Plan, inputs, parted=frozenset()):
        """On a device, for the block: each stored input's token, which names its tiles in the
        device cache (``eds_resident``, udfs/device_cache.py), and one for every value the plan
        computes and every array operand, new each run; which computed values stay on the
        device instead of going back to DuckDB (``device_only_results``; not one written as
        parts, ``parted``), and after which step each value named for the run is read no more
        (``_release_after``). The token is the table's oid in
        this database: a table written anew (store, replace, an einsum's ``out=``) is a new
        catalog entry with a new oid, so its old tiles are never taken for the new ones. A
        tensor stored as parts is named by its part tables' oids (a store writes new parts);
        a view of the user's own gets none: its tiles are sent every call."""
        cache = self.kernels.device_cache
        if cache is None:
            yield
            return
        stored = {v.name: inputs[v.name] for v in plan.inputs if isinstance(inputs.get(v.name), str)}
        oids, shadowed = {}, set()
        if stored:
            for name, oid, temporary in self._run(
                    "SELECT lower(table_name), table_oid, temporary FROM duckdb_tables() WHERE temporary OR "
                    "(database_name = current_database() AND schema_name = current_schema()) UNION ALL "
                    "SELECT lower(view_name), view_oid, true FROM duckdb_views() WHERE temporary AND NOT internal"):
                if temporary:  # a TEMP table or view of that name is what the SQL reads: no token
                    shadowed.add(name)
                else:
                    oids[name] = oid
        tokens = {}
        for v, t in stored.items():
            if t.lower() in shadowed:
                continue
            if t.lower() in oids:
                tokens[v] = f"oid{oids[t.lower()]}"
                continue
            # a tensor stored as parts: its view names no table, but its part tables (fresh
            # names, written anew by every store or replace) do; a view of the user's own,
            # whose tables may change under it, lists no parts and gets no token
            parts = self._parts_of(t)
            if parts and all(p.lower() in oids for p in parts):
                tokens[v] = "oid" + "+".join(str(oids[p.lower()]) for p in parts)
        # every value the plan computes, named for this run only: a step's result tiles stay on
        # the device for the later steps that read them (udfs/register.py: _keep_result)
        run = f"{RUN_TOKEN}{next(_RUNS)}/"
        computed = {step_target(s).name: f"{run}{step_target(s).name}" for s in plan.steps}
        # ... and so is every array operand: sent once per run, not once per kernel call that
        # reads a tile (a grouped step reads each tile once per group it meets); never kept for
        # the next run, which may pass other data under the same name
        computed.update({v.name: f"{run}{v.name}" for v in plan.inputs if not isinstance(inputs.get(v.name), str)})
        tokens.update(computed)
        # the plan's future for the cache's evictions: which stored tensors each step reads
        reads = [frozenset(tokens[v.name] for v in step_reads(s) if v.name in tokens) for s in plan.steps]
        last = {}
        for k, s in enumerate(plan.steps):
            for v in step_reads(s):
                if v.name in computed:
                    last[v.name] = k
        last_reads = {k: [computed[v] for v, j in last.items() if j == k] for k in set(last.values())}
        keep = self._device_only(plan, parted)
        state = self.kernels
        # a plan run from inside another's (a progress callback; the lock is re-entrant) puts
        # the outer run's names back when it ends: the outer run's held tiles are read by them
        saved = (state.device_tokens, state.device_reads, state.device_step, state.device_keep, self._last_reads)
        state.device_tokens, state.device_reads, state.device_step = tokens, reads, 0
        state.device_keep, self._last_reads = keep, last_reads
        try:
            yield
        finally:
            (state.device_tokens, state.device_reads, state.device_step, state.device_keep,
             self._last_reads) = saved
            cache.unpin_all()
            for token in computed.values():  # the run's results die with it
                cache.drop(token)

    @contextlib.contextmanager
    def _arrays(self, arrays: dict[str, pa.Table], host: dict[str, tuple] | None = None,
                results: dict[str, tuple] | None = None):
        """Arrow tables readable by our cursor's statements for the block: value name -> the
        name to read it by; ``host``, the arrays the kernels read themselves, and ``results``,
        those they write the returned results into (value name -> (array, tile shape):
        ``KernelState.host_arrays`` and ``host_results``, the enclosing run's put back after,
        for a run started inside another's). duckdb 2.0's source registry takes ~0.01 ms a table where
        ``register`` and ``unregister`` (a view each, in the catalog) took ~0.7 ms: 7 ms of a
        LLaMA block's 60 with its ten weights passed as arrays. A client without the registry
        gets views."""
        source = getattr(self._work, "_register_source", None) if self.source_registry else None
        handles, views = [], []
        state = self.kernels
        saved = state.host_arrays, state.host_results
        state.host_arrays, state.host_results = host or {}, results or {}
        try:
            names = {}
            for k, (value, tiles) in enumerate(arrays.items()):
                if source is not None:
                    handle = source(tiles, None)
                    handles.append(handle)  # registered while the handle lives
                    names[value] = handle.name
                else:
                    views.append(f"_eds_a{self._nest}{k}")
                    self._work.register(views[-1], tiles)
                    names[value] = views[-1]
            yield names
        finally:
            state.host_arrays, state.host_results = saved
            del handles[:]
            if not self._closed:
                for name in views:
                    self._unregister(name)

    def _run_steps(self, plan: Plan, compiled, tables, outputs, replace: bool, watch: Watch,
                   swaps: dict[str, str], parts_of: dict[str, bool] | None = None) -> dict[str, pa.Table]:
        scratch: list[str] = []
        made: list[str] = []  # tables written outside a transaction: dropped if the plan is stopped
        rows: dict[str, pa.Table] = {}
        parts: dict[str, list[str]] = {}  # value -> its part tables (see _parted)
        readers: list[str] = []  # TEMP views later steps read a parted value by
        bind = self.compiler.bind_sql
        # parts are committed one by one, as a store's are (an open transaction holding them
        # all is what DuckDB cannot spill); the view, its part list and the catalog rows then
        # commit together at the end, so the result is whole or absent all the same. A scratch
        # value's parts are TEMP tables: no WAL, no checkpoint, evicted straight to the spill
        # folder (the out-of-core FFN ran in 20 s instead of 36 s, the same peak)
        parts_of = parts_of or {}
        # a value of one statement is one part: it can be written inside the plan's
        # transaction as one table would be (one commit less)
        atomic = _atomic(plan, compiled, outputs) and not any(
            len(c.batches) > 1 for c in compiled if c.value in parts_of)
        big = False  # a step switched the (database-wide) Arrow offset setting
        def going_on(text=None):
            """``text``, unless the plan was stopped: a stop that came between statements met
            none (DuckDB drops such an interrupt, and a plan is interrupted once)."""
            if watch.stopping():
                raise Cancelled("the plan was stopped")
            return text

        try:
            with self._transaction(atomic):
                for k, c in enumerate(compiled):
                    going_on()
                    watch.begin(k)
                    self.kernels.device_step = k  # where the device cache's evictions look ahead from
                    target = outputs.get(c.value, _SCRATCH)
                    try:
                        peak = plan.peak_of(plan.steps[k])
                        returned = target.table is None and c.value in outputs
                        if returned:  # fetched as Arrow: the whole result is one column
                            peak = max(peak, step_target(plan.steps[k]).nbytes)
                        if peak >= SMALL_BUFFER_BYTES:
                            # the setting is the database's: another session may have changed it.
                            # A step that needs 64-bit offsets always says so; 32-bit ones only
                            # save time, so they are said once per plan (~0.3 ms a SET: LLaMA
                            # block's graph said it 4 times)
                            large = peak >= LARGE_BUFFER_BYTES
                            self._set_large_buffers(large, force=large or not big)
                            big = True
                        # after the offsets are set: the send hands the step's own tiles
                        self._send_ahead(plan.steps[k], tables)
                        if returned:
                            got = [self._work.sql(bind(going_on(text), tables)).to_arrow_table() for text in c.batches]
                            rows[c.value] = got[0] if len(got) == 1 else pa.concat_tables(got)
                        elif c.value in parts_of:
                            mine = parts[c.value] = []
                            for name, text in zip(parted.new_part_names(len(c.batches)), c.batches):
                                mine.append(name)
                                kept = c.value in outputs and not outputs[c.value].temporary
                                self._run(parted.create_part_sql(name, bind(going_on(text), tables), temporary=not kept))
                            if k + 1 < len(compiled):  # later steps read it by a TEMP view
                                readers.append(f"_eds_pv{self._nest}{k}")
                                self._run(parted.view_sql(readers[-1], mine, temporary=True))
                                tables[c.value] = readers[-1]
                        else:
                            # the first batch creates the table, the next ones append to it
                            self._run(bind(c.create[target.temporary, replace], tables))
                            for text in c.inserts:
                                self._run(bind(going_on(text), tables))
                            if target is _SCRATCH:
                                scratch.append(tables[c.value])
                            elif not atomic:
                                made.append(tables[c.value])
                    except duckdb.Error as e:
                        hint = ""
                        if isinstance(e, duckdb.OutOfMemoryException) and self.budget is not None:
                            # the plan was admitted: its projection missed what DuckDB held
                            # (docs/DESIGN.md, Known limits); say so, and what to do, not only
                            # DuckDB's advice about SET memory_limit
                            hint = (f" [under the memory budget of {format_bytes(self.budget)} this step was projected "
                                    f"to peak at {format_bytes(plan.peak_of(plan.steps[k]))}, with DuckDB's memory_limit "
                                    f"at {format_bytes(self._memory_limit or 0)}, and DuckDB needed more: a projection "
                                    "that missed (nothing was written); give a larger memory= or a smaller tile_bytes]")
                        raise ExecutionError(f"step {k} ({plan.steps[k].describe()}) failed{hint}: {e}") from e
                    finally:
                        if self.kernels.device_cache is not None:  # the step's pins end with its statements
                            self.kernels.device_cache.unpin_all()
                            self._release_after(k)
                    watch.step_done()
                # what makes the results visible, at once: inside the plan's transaction, or,
                # for a plan writing parts (which runs outside one), in a transaction of its own
                with self._transaction(bool(parts_of)):
                    for v in readers:
                        self._run(exp.Drop(tables=[table(v)], kind="VIEW", exists=True).sql(dialect="duckdb"))
                    for value, names in parts.items():
                        if value not in outputs:  # a scratch value's parts go with the plan
                            for p in names:
                                self._run(self.compiler.drop_table_sql(p))
                            continue
                        final = outputs[value].table
                        if outputs[value].temporary:  # a TEMP view over its TEMP parts
                            self._run(parted.view_sql(final, names, temporary=True))
                            self._temp_parts[final.lower()] = names
                            continue
                        self._commit_parts(final, names, parts_of[value], _output(plan, value).keys)
                    for fresh, final in swaps.items():
                        self._drop_stored(final)
                        self._run(exp.Alter(this=table(fresh), kind="TABLE",
                                            actions=[exp.AlterRename(this=table(final))]).sql(dialect="duckdb"))
                    for v in plan.outputs:
                        t = outputs[v.name]
                        if t.table is not None and not t.temporary:
                            self._write_catalog(t.table, v)
                    for t in scratch:
                        self._run(self.compiler.drop_table_sql(t))
                    if not watch.commit():  # Ctrl-C (or a failed progress callback) after the last
                        # statement: roll back rather than commit what the caller is told was stopped
                        raise Cancelled("the plan was stopped before it committed")
        except BaseException:
            # the drops first, each surviving a late interrupt (a review: an interrupt landing
            # on the SET below skipped them, leaving scratch tables and parts behind)
            for v in readers:
                self._cleanup(exp.Drop(tables=[table(v)], kind="VIEW", exists=True).sql(dialect="duckdb"))
            for t in scratch + made + [p for names in parts.values() for p in names]:
                # TEMP tables are not rolled back in every case, parts were committed: be sure
                self._cleanup(self.compiler.drop_table_sql(t))
            if big:
                self._cleanup("SET arrow_large_buffer_size = true")
                self._large_buffers = True
            raise
        # back to the safe default for whatever the connection runs next (a user's query)
        if big:
            self._set_large_buffers(True, force=True)
        return rows

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            if self.owns_connection:
                # first: a query another thread runs on db.connection makes DuckDB refuse, and
                # the session must then stay whole, to be closed again (it was marked closed
                # with its connection open, and the file could not be opened again)
                try:
                    self.con.close()
                except duckdb.Error as e:
                    raise EinsumError(f"cannot close the session now: {e} (a query on db.connection is still "
                                      "running; close the session once it ends)") from None
            self._closed = True
            if self.kernels.device_cache is not None:  # the device memory goes back with the session
                self.kernels.device_cache.clear()
                from eindecomp_sql.udfs.devices import release_memory

                release_memory(self.device)
            for setting, value in self._their_settings.items():  # the user's, as they were
                if setting == "memory_limit":
                    value = _shown_limit(value)
                try:
                    if self._still_ours(setting):
                        self._work.execute(f"SET {setting} = ?", [value]).fetchall()
                except duckdb.Error:  # best effort: DuckDB may refuse to move a spill folder in use
                    pass
            try:
                self._work.close()
            except duckdb.Error:  # its connection is closed already
                pass
            # on the user's connection our functions stay until the next session there takes
            # over (_take_over): removing them here would run statements on it
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
        allocator.detach()


_SCRATCH = Target(None, temporary=True)  # a value the plan computes but does not keep

def _shown_limit(text: str) -> str:
    """A ``memory_limit`` as DuckDB shows it ("2.7 GiB": rounded down to a tenth) as a limit
    that shows the same again: the middle of what rounds to it (SET '2.7 GiB' showed "2.6 GiB",
    so a session opened and closed on a user's connection lowered the user's limit each time)."""
    _, _, unit = text.strip().partition(" ")
    try:
        return f"{parse_memory(text, 'memory_limit') + parse_memory(f'0.05 {unit}', 'memory_limit')}B"
    except EinsumError:  # "0 bytes", or a form of DuckDB's we do not read: as DuckDB showed it
        return text


def _native(x: np.ndarray, dtype) -> np.ndarray:
    """An array operand as the kernels read it: a plain ndarray (an ``np.matrix`` multiplies on
    ``*`` and stays 2-D), the plan's dtype, in this machine's byte order (as
    ``tiles_from_array`` would have cut it)."""
    x = np.asarray(x)
    if x.dtype != np.dtype(dtype):
        x = x.astype(dtype)
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return x


def _parted(step, compiled, target: Target | None, device: bool = False, part_bytes: int | None = None) -> bool:
    """Whether a step's result is written as parts (a part a statement): more than
    ``PART_BYTES``, and a kept table or a scratch value (``target`` None), not a result returned
    as an array. Computed in several statements, a part each (one TEMP table of 256 MB of tiles
    filled a 150 MB ``memory_limit`` and failed: DuckDB 2.0 handles one table's blob column
    whole, see backends/parts.py); in one, one part, whose struct column DuckDB takes without
    hashing the tiles for its statistics. A scratch value of one statement on a ``device``
    session stays a table, which a result left on the device fills with NULLs
    (``_device_tiles``). ``part_bytes``: the session's part size under a memory budget (a
    result of several statements over it is parts, as ``store`` cuts a tensor: a 16 MB result
    of 3 statements under ``memory="40MB"`` was one table, a trial)."""
    nbytes = step_target(step).nbytes
    if len(compiled.batches) > 1 and nbytes > min(parted.PART_BYTES, part_bytes or parted.PART_BYTES):
        return target is None or target.table is not None
    if nbytes <= parted.PART_BYTES:
        return False
    if len(compiled.batches) > 1:
        # a temporary result too: one TEMP table of a 256 MB result could not be read back by
        # the next einsum under memory="100MB" (a scan pins its whole row group; a trial), nor
        # exported within the budget
        return target is None or target.table is not None
    return (target is None and not device) or (target is not None and target.table is not None)


def _atomic(plan: Plan, compiled, outputs) -> bool:
    """Whether running the plan needs a transaction to leave nothing half-written: more than
    one statement, or a kept table (a stop after its statement must not leave it replaced:
    BEGIN and COMMIT cost ~0.3 ms, and its catalog entry, when it changes, is a statement too)."""
    if len(compiled) > 1 or len(compiled[0].batches) > 1:
        return True
    return any(t.table is not None and not t.temporary for t in outputs.values())


def _touches_catalog(sql: str) -> bool:
    """Whether a statement may change what the catalog or eds_parts say (a write to either, or
    a ROLLBACK of writes): what the backend's catalog cache must forget."""
    head = sql.lstrip()[:8].upper()
    if head.startswith("ROLLBACK") or head.startswith("ABORT"):
        return True
    return not head.startswith("SELECT") and ("eds_catalog" in sql or parted.PARTS_TABLE in sql)


def _output(plan: Plan, name: str) -> TiledValue:
    return next(v for v in plan.outputs if v.name == name)


def _open(database, read_only: bool, config: dict | None):
    """``duckdb.connect`` with its failures said in our words."""
    if database is None:
        database = ":memory:"
    if not isinstance(database, (str, os.PathLike)):
        raise EinsumError(f"database must be a file path, ':memory:' or a duckdb connection, got "
                          f"{type(database).__name__}")
    if str(database) != ":memory:" and os.path.isfile(database) and os.path.getsize(database) > 0:
        # DuckDB 2.0 opens some other files (a Parquet file) as an in-memory database that
        # silently keeps nothing: a DuckDB file says DUCK at byte 8
        with open(database, "rb") as f:
            head = f.read(12)
        if head[8:12] != b"DUCK":
            raise EinsumError(f"{str(database)!r} is not a DuckDB database file")
    try:
        con = duckdb.connect(database, read_only=read_only, config=config or {})
    except duckdb.IOException as e:
        text = str(e)
        if "lock" in text.lower():
            # read-only readers share a file only among themselves: DuckDB's own text says when
            # read-only would open it (the holder reads); whether we asked for read-only does not
            # (a trial was told to open it read_only=True while a writer held it: the same refusal)
            # (DuckDB's own sentence only: the path in the text may say "read-only" itself)
            holder_reads = "would be able to open this database in read-only mode" in text
            advice = ("another process has it open read-only: open it read_only=True too, or wait until it closes"
                      if holder_reads and not read_only else
                      "another process writes it: wait until that process closes it (DuckDB lets no other process "
                      "open a file one process writes, read-only or not)")
            raise EinsumError(f"database {str(database)!r} is locked by another process ({advice}): {text}") from None
        if "not a valid DuckDB database" in text:
            raise EinsumError(f"{str(database)!r} is not a DuckDB database file") from None
        raise EinsumError(f"cannot open database {str(database)!r}: {text}") from None
    except duckdb.Error as e:
        raise EinsumError(f"cannot open database {str(database)!r}: {e}") from None
    _follow_affinity(con, config)
    _plain_tiles(con, config)
    return con


def _plain_tiles(con, config: dict | None) -> None:
    """No zstd in a database we open, unless the caller's config says otherwise: DuckDB
    compresses large BLOBs with zstd when it checkpoints, and tiles of floats do not compress,
    so every read paid for nothing. Measured on 4 MB float32 tiles (2 cores): reading one took
    4.3 ms with zstd, 0.6 ms without; the out-of-core FFN (bench/ooc_bench.py) ran 25% faster.
    Other compressions (dictionary, FSST, bit-packing) stay on for the keys and the user's
    tables. A connection the caller opened keeps its own settings (docs/LAYOUT.md)."""
    if any(k.lower() in ("disabled_compression_methods", "force_compression") for k in (config or {})):
        return
    try:
        con.execute("SET disabled_compression_methods = 'zstd'").fetchall()
    except duckdb.Error:  # best effort: a DuckDB without the setting reads as before
        pass


def _follow_affinity(con, config: dict | None) -> None:
    """DuckDB starts a thread per core of the machine, whatever the process may run on
    (taskset, a container's cpuset): pinned to 1 core of 2 it still ran 2 threads next to a
    kernel pool of 1. A database we open follows the cores this process may use, as the
    kernels' pool does (udfs/pool.py), unless the caller's config names a thread count. Set
    after connecting, not in the config: DuckDB refuses a second connection to a file open with
    another config, even one equal to its defaults."""
    if any(k.lower() in ("threads", "worker_threads") for k in (config or {})):
        return
    if THREADS >= (os.cpu_count() or THREADS):
        return  # not restricted: DuckDB's default is already every core
    try:
        con.execute(f"SET threads = {int(THREADS)}").fetchall()
    except duckdb.Error:  # best effort: the setting only sizes DuckDB's pool
        pass
