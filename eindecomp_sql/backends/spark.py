"""The Spark backend: the same plans run as Spark SQL, tensors kept as Parquet or as Spark tables.

A tiled tensor is a directory of Parquet files (key columns, then ``tile``) under the
database directory, with its description in ``_eds_tensor.json`` beside them (Spark and
pyarrow skip files starting with ``_``). The catalog is those directories. With
``spark_database=`` instead, each tensor is a table of that Spark database
(``spark_tables.py``), and so is every value a run writes (but arrays a run reads on a local
session, and the values of a read-only session: Parquet, as below). A step is one
Spark SQL statement, printed from the compiler's sqlglot expressions in Spark's dialect
(``compile/spark.py``); its joins and group-bys are Spark's (its shuffle is our re-tiling),
and its tile kernels are the Arrow kernels DuckDB calls, registered as Spark Arrow UDFs
(``udfs/spark.py``) and run in Spark's Python workers.

Every step's result is written as Parquet under the run's scratch directory (or as a run table)
and read back by the next steps: a plan reads a value many times, and Spark would otherwise
recompute it for each reader. Outputs are moved into place only when every step has run, so a
failed or interrupted plan leaves the catalog as it was (each move is one directory or table
rename).

pyspark is an optional dependency (``pip install eindecomp_sql[spark]``), imported only here.
Without a ``spark=`` session the backend uses the one active in this process, or starts a local
one (``local[<cores>]``) whose Python workers run this interpreter and stops it when the last
session using it closes; a session passed in must run workers that can import
``eindecomp_sql`` (``PYSPARK_PYTHON``), and is left running.

Used as any session (``tests/test_spark.py`` runs this and the rest on a local session)::

    with eds.connect("tensors/", backend="spark") as db:
        A = db.store("A", np.arange(6.0).reshape(2, 3))
        db.einsum("ij,kj->ik", A, A).to_numpy()  # [[5., 14.], [14., 50.]]
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from dataclasses import replace as _replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..compile.spark import SparkCompiler, inlined_steps, shuffle_bytes, spark_compiler
from ..errors import EinsumError, ExecutionError
from ..plan import Plan, TiledValue
from ..plan.cost import CostModel
from ..plan.kernel_spec import fresh_pickles
from ..plan.steps import output_tiles, step_target
from ..udfs.pool import THREADS
from ..udfs.tiles import array_from_tiles, tiles_from_array
from .base import Target, array_as_wanted, stored_as_wanted
from .running import StepProgress, Stopper, stoppable
from . import spark_frames
from .spark_tables import SparkTables, describe, from_description

META = "_eds_tensor.json"
SCRATCH = "_eds_scratch"
# the job property Spark's SparkContext.setInterruptOnCancel sets (restored after our jobs)
INTERRUPT_ON_CANCEL = "spark.job.interruptOnCancel"
# How every step result is written (outputs are renamed into the catalog afterwards). Tiles are
# incompressible numbers and never repeat: no codec, no dictionary (both spend the writer's time
# on whole tiles for nothing); no min/max statistics of the tile column (a copy of whole tiles
# to keep the smallest and largest, dropped from the footer above 4 KB anyway; the key columns
# keep theirs, which prune row groups) and no page checksums (readers do not verify them by
# default). 256 MB of tiles from a scan: 0.53 s against 0.59 s (medians of 14, interleaved); on
# the 4096² GEMM, which writes 64 MB, within the noise (2026-11-25).
WRITE_OPTIONS = {"compression": "none", "parquet.enable.dictionary": "false",
                 "parquet.column.statistics.enabled#tile": "false", "parquet.page.write-checksum.enabled": "false"}


# What Spark's plans cost, fitted by ``bench/calibrate.py --backend spark`` (local[2], 2 cores,
# 2026-11-23: 51 forced GEMM steps at 1024², 2048², 4096² and 30 re-tiles; bench/RESULTS.md):
# a join byte ~8 ns (DuckDB's ~0.4: each tile crosses the JVM's rows, a shuffle file and Arrow
# to the Python worker and back), a re-tiled byte 3.1x that, a grouped byte 0.3x, an aggregated
# byte 1.0x (the aggregation is the kernel's, in Python, and no longer dominates), and a fixed
# ~0.77 s per statement (a Spark job or two): 93 MB of join bytes, where DuckDB's is 2.5 MB. With
# these weights the plan cost ranks the measured times with Spearman 0.80 (DuckDB's weights: 0.76).
# A UDF gets Arrow batches of up to 10,000 rows; collect_list holds a group's tiles whole.
# A retile of a stored input that re-cuts its leading axis only is byte ranges cut and joined
# in SQL, never through Python (``SparkCompiler.rows_retile``): 64 MB from two row panels into one
# tile took 0.23 s more than reading it stored whole, against ~0.7 s through the kernels
# (2026-11-25): ~0.5 of a join byte.
COSTS = CostModel("spark", join=1.0, group=0.3, agg=1.0, retile=3.0, statement=93e6, vector_rows=10_000,
                  grouped_holds_all=True, row_retile=0.5, shares_group_operands=False, splits_reductions=False)


_local_lock = threading.Lock()
_local_users = 0  # backends sharing the local session this module started: stopped with the last


def _acquire_local():
    """The process's local session, started on first use, or the session already active in this
    process (then never ours to stop); and whether it is ours."""
    global _local_users
    from pyspark.sql import SparkSession

    with _local_lock:
        active = SparkSession.getActiveSession()
        if active is not None and _local_users == 0:
            return active, False
        spark = active if active is not None else _local_session()
        _local_users += 1
        return spark, True


def _release_local(spark) -> None:
    global _local_users
    with _local_lock:
        _local_users -= 1
        if _local_users == 0:
            spark.stop()


def _local_session():
    """A local SparkSession for this process: its Python workers run this interpreter (so they
    import the kernels from the same environment), its UI off, shuffles in a few partitions."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{THREADS}]").appName("eindecomp_sql")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(max(2, THREADS)))
             .config("spark.sql.adaptive.enabled", "true")
             .config("spark.sql.autoBroadcastJoinThreshold", str(_broadcast_limit()))
             .config("spark.driver.memory", f"{_driver_memory() >> 20}m")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _driver_memory() -> int:
    """A local session's JVM heap: a quarter of this machine's memory, 1 to 8 GiB (Spark's
    default of 1 GiB ran out on a 4096² float32 GEMM)."""
    from ..plan.tiling import _physical_memory

    return min(max(_physical_memory() // 4, 1 << 30), 8 << 30)


def _broadcast_limit() -> int:
    """A local session's ``autoBroadcastJoinThreshold``: a sixteenth of its driver heap, at most
    256 MiB. Spark's 10 MB is for clusters, where a broadcast crosses the network to every
    executor; in one JVM it is a copy the tasks share, and the join then shuffles and sorts
    nothing (a 4096² float32 GEMM's join step of two 64 MB operands: 2.65 s sort-merge, 2.1-2.3 s
    broadcast). The broadcast side is held whole in the driver's heap, hence the sixteenth."""
    return min(256 << 20, _driver_memory() // 16)


def _spark_error(e: BaseException) -> str:
    """A Spark failure's message, without the JVM stack: its first lines, and where a Python
    worker's traceback is quoted, its last line (the exception itself, which the first lines
    never reach)."""
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head = lines[:6]
    if any("Traceback (most recent call last)" in ln for ln in head):
        # the worker's exception: the last line of the traceback that is no frame or code line
        cause = next((ln.strip() for ln in reversed(lines) if not ln.startswith((" ", "\t"))
                      and ("Error" in ln or "Exception" in ln) and "Traceback" not in ln
                      and not ln.lstrip().startswith("at ")), None)
        if cause is not None and cause not in head:
            head.append(cause)
    return "\n".join(head)


def _hold(path: str):
    """An open file holding an exclusive lock on ``path`` for as long as it stays open: the
    mark of a live session on its scratch (the system drops the lock when the process dies)."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 - held open for the session's life
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


@contextlib.contextmanager
def _locked(path: str, shared: bool = False):
    """A lock on file ``path`` (made if missing) for the ``with`` block, across the processes
    and sessions of a database directory: exclusive, or ``shared`` with other shared holders."""
    import fcntl

    f = None
    try:
        if shared:
            # a reader neither makes nor writes it (a read-only session wrote into the database
            # directory: a review); flock needs no write access
            f = open(path)  # noqa: SIM115 - closed below
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
            f = os.fdopen(fd)
    except OSError:
        if not shared:
            raise
    if f is None:  # no lock file yet (no replace ever ran), or none this reader may open
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sweep_scratch(folder: str) -> None:
    """Remove the scratch of sessions no longer alive from ``folder`` (``<db>/_eds_scratch``):
    a run killed with its process, or a session never closed, left its step results there (a
    trial: a killed run's Parquet stayed beside the tensors for good). A session is alive while
    its ``<id>.lock`` is locked (``_hold``); a folder without a lock file is an older version's."""
    import fcntl

    try:
        entries = [e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for name in entries:
        lock = os.path.join(folder, name + ".lock")
        try:
            f = open(lock, "r+")  # noqa: SIM115
        except FileNotFoundError:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            continue
        except OSError:
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live session's
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(lock)


@dataclass(frozen=True)
class Where:
    """Where a value's tiles are: a Parquet directory, or a table of the session's Spark database."""

    path: str | None = None
    table: str | None = None


@dataclass
class _Run:
    """What one plan run writes: its directory (Parquet values), or the tables it made."""

    path: str
    tables: list[str] = field(default_factory=list)


class SparkBackend:
    """Tensors as Parquet directories or Spark tables, plans as Spark SQL (see the module docstring)."""

    name = "spark"
    con = None  # no DuckDB connection: no SQL interface, no DuckDB sources

    @property
    def cost_model(self) -> CostModel:
        """What the session plans under: Spark's weights, and this session's broadcast
        threshold (read now), which decides what a grouped step shuffles."""
        return _replace(COSTS, broadcast_bytes=self.broadcast_bytes())
    streams_in = False  # store_tiles takes whole tables
    # the default tile caps: a tile is a row in the JVM, copied whole into Spark's row buffers
    # and Arrow batches (a 4096² float32 GEMM in 64 MiB tiles ran a 1 GiB driver out of heap;
    # a local session's driver has a quarter of memory now). Stored tiles stay at 32 MiB, so a
    # 4096² float32 matrix is two row panels, two tasks; a plan may make 64 MiB tiles: the
    # GEMM joins A's panels with B whole, put together from its panels in SQL (a retile by
    # rows), 1.98 s against 2.51 s for column panels of B re-tiled through the kernels (2026-11-25)
    max_tile_bytes = 64 << 20
    max_store_tile_bytes = 32 << 20

    def __init__(self, database=None, read_only: bool = False, spark=None, spark_database=None):
        self._tables: SparkTables | None = None  # the catalog, where tensors are Spark tables
        if spark_database is not None:
            if database is not None:
                raise EinsumError("give database= (a directory of Parquet tensors) or spark_database= (tensors as "
                                  "tables of a Spark database), not both")
            self.root = None
            self._owns_root = False
        elif database is None or (isinstance(database, str) and database == ":memory:"):
            if read_only:
                raise EinsumError("read_only needs a database directory to read")
            self.root = tempfile.mkdtemp(prefix="eds-spark-")
            self._owns_root = True
        elif isinstance(database, (str, os.PathLike)):
            # absolute: pyarrow writes relative to Python's working directory, Spark reads
            # relative to the one its JVM started in; after an os.chdir a session read another
            # directory's tensors (a trial: 28.0 where 4.0)
            self.root = os.path.abspath(os.fspath(database))
            self._owns_root = False
            glob = sorted(set(self.root) & set("[]?*{}"))
            if glob:
                # Spark reads a path as a glob pattern: run[1] read run1's tensors (a trial)
                raise EinsumError(f"the Spark backend cannot keep tensors under {self.root!r}: Spark reads paths as "
                                  f"glob patterns, and {' '.join(glob)} would match other directories; choose a "
                                  "directory name without [ ] ? * { }")
            if os.path.exists(self.root) and not os.path.isdir(self.root):
                raise EinsumError(f"the Spark backend keeps tensors in a directory; {self.root!r} is a file")
            if read_only and not os.path.isdir(self.root):
                raise EinsumError(f"no database directory {self.root!r} to open read-only")
            if not read_only:
                self._made_root = not os.path.exists(self.root)  # a refused connect removes it again
                os.makedirs(self.root, exist_ok=True)
        else:
            raise EinsumError(f"database must be None or a directory path for the Spark backend, got "
                              f"{type(database).__name__}")
        self.read_only = read_only
        self.lock = threading.RLock()
        self.stopper = Stopper()  # Session.interrupt(): cancels the call's Spark jobs (``_stoppable``)
        self._closed = False
        self._owns_spark = False
        try:
            if spark is None:
                spark, self._owns_spark = _acquire_local()
            elif not hasattr(spark, "sparkContext") or not hasattr(spark, "udf"):
                raise EinsumError(f"spark= must be a pyspark.sql.SparkSession, got {type(spark).__name__}")
            self.spark = spark
            from ..udfs.spark import register_spark_kernels

            register_spark_kernels(self.spark)
            spark_frames.register(self.spark)
            self._session_id = uuid.uuid4().hex[:12]
            if spark_database is not None:
                self._tables = SparkTables(self.spark, spark_database, read_only, self._session_id)
        except ImportError as e:
            self._remove_root()
            raise EinsumError("the Spark backend needs pyspark: pip install 'eindecomp_sql[spark]'") from e
        except BaseException:
            if self._owns_spark:
                _release_local(self.spark)
            self._remove_root()
            raise
        # a read-only session still writes its runs' scratch: beside the database, or in a
        # directory of its own (so does one whose tensors are tables, only when read-only)
        self._scratch_base = (tempfile.mkdtemp(prefix="eds-spark-") if read_only or self.root is None else None)
        self._scratch = os.path.join(self._scratch_base or self.root, SCRATCH, self._session_id)
        # where a run's values go: the tensors' Spark database, unless the session may not write it
        self._run_tables = self._tables if not read_only else None
        # a local session's executors share this machine's files (arrays may go there directly)
        self._local = str(self.spark.sparkContext.master).startswith("local")
        self._alive = None
        if self._scratch_base is None:
            self._alive = _hold(self._scratch + ".lock")  # before the folder: a sweep spares it
            _sweep_scratch(os.path.dirname(self._scratch))
        os.makedirs(self._scratch, exist_ok=True)
        self._counter = itertools.count()
        # lower-cased name -> (value named as the session knows it, where its tiles are)
        self._temporary: dict[str, tuple[TiledValue, Where]] = {}
        # stored tensor (lower-cased name, its value) -> the files its keys were last checked in
        self._checked: dict[tuple[str, TiledValue], tuple] = {}

    @property
    def compiler(self) -> SparkCompiler:
        """The compiler for this session's broadcast threshold, read now (the user may change
        the session's conf between plans)."""
        return spark_compiler(self.broadcast_bytes())()

    @property
    def default_workers(self) -> int:
        """Join tasks per step the optimizer aims for: Spark's default parallelism."""
        return int(self.spark.sparkContext.defaultParallelism)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EinsumError("this session is closed")
        if getattr(self.spark.sparkContext, "_jsc", None) is None:  # what SparkContext.stop() leaves
            raise EinsumError("the SparkSession this session runs on was stopped; connect again with a running one")

    def _check_writable(self, name: str) -> None:
        if self.read_only:
            raise EinsumError(f"cannot write table {name!r}: this session is read-only")

    # -- the catalog: a directory per tensor ------------------------------------------------
    def _dir(self, name: str) -> str:
        return os.path.join(self.root, name.lower())

    def _read_meta(self, path: str) -> TiledValue | None:
        try:
            with open(os.path.join(path, META)) as f:
                return from_description(f.read(), os.path.basename(path), f"its directory {path}")
        except (FileNotFoundError, NotADirectoryError):
            return None

    @staticmethod
    def _write_meta(path: str, value: TiledValue) -> None:
        with open(os.path.join(path, META), "w") as f:
            f.write(describe(value))

    def _stored_value(self, name: str) -> TiledValue | None:
        """The stored (not temporary) tensor ``name``'s description, or None."""
        if self._tables is not None:
            return self._tables.find(name)
        return self._read_meta(self._dir(name))

    def _find(self, name: str) -> tuple[TiledValue, Where] | None:
        temp = self._temporary.get(name.lower())
        if temp is not None:
            return temp
        value = self._stored_value(name)
        if value is None:
            return None
        return value, (Where(table=name) if self._tables is not None else Where(path=self._dir(name)))

    def _check_target(self, name: str, replace: bool) -> None:
        # (not between another session's renames of it: a drop's made a tensor's directory
        # read as "not a stored tensor" for an instant, CI met it once)
        with self._install_lock(shared=True):
            self._check_target_now(name, replace)

    def _check_target_now(self, name: str, replace: bool) -> None:
        found = self._find(name) is not None
        if found and not replace:
            raise EinsumError(f"table {name!r} already exists; pass replace=True to overwrite it")
        if self._tables is not None:
            if not found and self._tables.occupied(name):
                raise EinsumError(f"Spark table {self._tables.qualified(name)} exists and is not a stored tensor; "
                                  "choose another name (replace overwrites stored tensors only)")
            return
        if not found and os.path.lexists(self._dir(name)):
            # a file or folder of the user's under the database directory: never ours to move
            # away and delete (replace overwrites stored tensors only, as on DuckDB)
            raise EinsumError(f"{self._dir(name)!r} exists and is not a stored tensor; choose another name, or "
                              "move it out of the database directory")

    def _install(self, where: Where, value: TiledValue, replace: bool = True) -> None:
        """Move a written value into the catalog as tensor ``value.name`` (replacing one of that
        name): one rename puts it in place, after its description is written."""
        if where.table is not None:
            self._tables.install(where.table, value)
            self._temporary.pop(value.name.lower(), None)
            return
        written = where.path
        self._write_meta(written, value)
        path = self._dir(value.name)
        old = None
        # the two renames under a lock every session of the database takes: two sessions
        # replacing one tensor at once failed with a raw "Directory not empty" or
        # FileNotFoundError between them (a trial: 3 of 800 stores)
        with self._install_lock():
            if not replace and self._read_meta(path) is not None:
                # another session stored it since this call's check (both without replace=True:
                # the second overwrote the first in silence, a review)
                raise EinsumError(f"table {value.name!r} already exists (stored by another session meanwhile); pass "
                                  "replace=True to overwrite it")
            if os.path.exists(path):
                old = os.path.join(self._scratch, f"old-{next(self._counter)}")
                os.rename(path, old)
            os.rename(written, path)
        self._temporary.pop(value.name.lower(), None)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _install_lock(self, shared: bool = False):
        """The database directory's install lock (``_install``); none where tensors are tables."""
        if self.root is None:
            return contextlib.nullcontext()
        return _locked(os.path.join(self.root, SCRATCH, "install.lock"), shared)

    def owned_directory(self, path: str) -> str | None:
        """The directory of this session's that file ``path`` (a real path) would be written in
        or over, where a file becomes part of something: a stored tensor's directory (Spark reads
        every file there as its tiles: a trial's export into one added its tiles to the tensor),
        the runs' scratch, the tables' location in the warehouse; None elsewhere (a file beside
        the tensors, at the database directory's top, or in a folder of the user's there)."""
        if self.root is not None:
            root = os.path.realpath(self.root)
            rel = os.path.relpath(path, root)
            if rel == os.curdir:
                return root
            first = rel.split(os.sep)[0]
            if first != os.pardir and (first.lower().startswith("_eds_")
                                       or os.path.isfile(os.path.join(root, first, META))):
                return os.path.join(root, first)
        if self._tables is not None:
            location = self._tables.location()
            if location is not None:
                location = os.path.realpath(location)
                if path == location or path.startswith(location.rstrip(os.sep) + os.sep):
                    return location
        return None

    def broadcast_bytes(self) -> int:
        """Spark's ``autoBroadcastJoinThreshold`` (bytes; -1: never broadcast)."""
        text = str(self.spark.conf.get("spark.sql.autoBroadcastJoinThreshold", "10MB")).strip()
        if text.lstrip("-").rstrip("bB").isdigit():
            return int(text.rstrip("bB"))
        from ..plan.cost import parse_memory

        return parse_memory(text)

    def sql_listing(self, plan: Plan, tables: dict[str, str] | None = None) -> str:
        """Every step's Spark SQL, each headed by the bytes Spark is predicted to shuffle for it
        (``compile.spark.shuffle_bytes``, under this session's broadcast threshold)."""
        from ..plan.steps import format_bytes

        threshold = self.broadcast_bytes()
        moved = [shuffle_bytes(s, threshold) for s in plan.steps]
        inlined = inlined_steps(plan)
        lines = [f"-- Spark: predicted shuffle {format_bytes(sum(moved))} in all "
                 f"(broadcast joins under {format_bytes(max(threshold, 0))})"]
        for line in self.compiler.sql_listing(plan, tables).splitlines():
            if line.startswith("-- step "):
                k = int(line.split()[2])
                line += f"  (predicted shuffle {format_bytes(moved[k])}"
                line += f"; runs inside step {inlined[k]}'s statement)" if k in inlined else ")"
            lines.append(line)
        return "\n".join(lines)

    def register_sql_interface(self, einsum_sql: Callable[..., str]) -> None:
        """No DuckDB connection here: the SQL interface is DuckDB's."""

    def lookup(self, name: str) -> TiledValue | None:
        with self.lock, self._install_lock(shared=True):  # (not between another session's renames)
            self._check_open()
            return self._stored_value(name)

    def names(self) -> list[str]:
        with self.lock:
            self._check_open()
            if self._tables is not None:
                return self._tables.names()
            # a tensor may be named _x: skip only our own folders (_eds_...) and hidden ones
            found = (self._read_meta(os.path.join(self.root, d)) for d in sorted(os.listdir(self.root))
                     if not d.startswith(("_eds_", ".")))
            return sorted(v.name for v in found if v is not None)

    def table_exists(self, name: str) -> bool:
        with self.lock:
            self._check_open()
            return self._find(name) is not None

    def tables(self, temporary: bool | None = None) -> list[str]:
        with self.lock:
            kept = [] if temporary is True else self.names()
            temp = [] if temporary is False else [v.name for v, _ in self._temporary.values()]
            return sorted(kept + temp)

    def drop(self, name: str) -> None:
        with self.lock:
            self._check_open()
            self._check_writable(name)
            if self._tables is not None:
                self._tables.drop(name)
                return
            path = self._dir(name)
            gone = None
            with self._install_lock():  # (not between another session's renames: a review)
                if self._read_meta(path) is not None:
                    gone = os.path.join(self._scratch, f"dropped-{next(self._counter)}")
                    os.rename(path, gone)  # out of the catalog at once, then deleted
            if gone is not None:
                shutil.rmtree(gone, ignore_errors=True)

    def set_memory(self, budget: int | None) -> None:
        """Nothing: Spark's memory is the cluster's configuration (spark.executor.memory), not a session's."""

    def recover(self) -> None:  # nothing a call leaves open between its statements
        pass

    def drop_table(self, name: str) -> None:
        with self.lock:
            found = self._temporary.pop(name.lower(), None)
            if found is not None:
                self._discard(found[1])

    # -- data in and out --------------------------------------------------------------------
    def _write_tiles(self, tiles: pa.Table, path: str) -> None:
        """Tiles as one Parquet file in a new directory ``path``, in row groups of at most ~64 MB
        and at least as many as Spark has cores (16 at least) where there are that many tiles:
        Spark splits a file only between row groups, and a step that reads one split runs in one
        task, on one core. The FFN graph with its arrays in one row group (two 8 MB tiles) ran
        its two-piece plan in one task: 1.82 s, against 1.27 s in two (2026-11-25)."""
        os.makedirs(path)
        rows = max(1, tiles.num_rows)
        per_row = max(1, tiles.nbytes // rows)
        groups = max(16, self.default_workers)
        # a file name of its own: a DataFrame made before a replace keeps its list of files, and
        # must find none rather than the new tensor's under the old name
        pq.write_table(tiles, os.path.join(path, f"part-{uuid.uuid4().hex}.parquet"),
                       row_group_size=max(1, min((64 << 20) // per_row, -(-rows // groups))), compression="none")

    def _write_arrow(self, tiles: pa.Table, run: _Run, kind: str, stored: bool = False) -> Where:
        """Tiles from this process written as a value of ``run``: a run table (sent through
        Spark, in as many pieces as Spark has cores, so a cluster's executors can read it), or
        a Parquet directory of the run's. An array bound for one run on a local session goes
        to the directory even where tensors are tables: written by pyarrow, the FFN's three
        16 MB arrays cost ~0.4 s less than through Spark (``stored``: what ``store`` writes,
        which must be a table there)."""
        if self._run_tables is not None and (stored or not self._local):
            df = self.spark.createDataFrame(tiles)
            parts = min(max(1, tiles.num_rows), max(16, self.default_workers))
            if df.rdd.getNumPartitions() < parts:  # a task per piece, as the row groups below
                df = df.repartition(parts)
            return self._track(run, self._run_tables.write(df, WRITE_OPTIONS))
        path = os.path.join(run.path, f"{kind}{next(self._counter)}")
        self._write_tiles(tiles, path)
        return Where(path=path)

    def _write_df(self, df, run: _Run, kind: str) -> Where:
        """A statement's result written as a value of ``run`` (see ``_write_arrow``)."""
        if self._run_tables is not None:
            return self._track(run, self._run_tables.write(df, WRITE_OPTIONS))
        path = os.path.join(run.path, f"{kind}{next(self._counter)}")
        df.write.options(**WRITE_OPTIONS).parquet(path)
        return Where(path=path)

    @staticmethod
    def _track(run: _Run, table: str) -> Where:
        run.tables.append(table)
        return Where(table=table)

    def _read(self, where: Where, value: TiledValue) -> pa.Table:
        columns = list(value.keys) + ["tile"]
        if where.table is not None:
            return self.spark.table(self._tables.qualified(where.table)).select(*columns).toArrow()
        return pq.read_table(where.path, columns=columns)

    def _discard(self, where: Where) -> None:
        if where.table is not None:
            self._tables.discard(where.table)
        else:
            shutil.rmtree(where.path, ignore_errors=True)

    def read_frame(self, source, where: str, want):
        """A Spark DataFrame in element form as tiles Spark makes (``spark_frames``), or None
        for any other source (read on the driver, as every backend reads it)."""
        if not spark_frames.is_spark_frame(source):
            return None
        with self.lock:
            self._check_open()
        # what the dense tensor may take: the session's memory= budget, else the free disk where a
        # directory of this machine keeps the tensors (a frame with one index of 10**12 went on
        # shuffling the grid of a 16 TB tensor of zeros for a quarter of an hour: a trial); a
        # Spark database's warehouse may be anywhere, and is not asked
        room = want.memory
        if room is None and self.root is not None:
            try:
                room = shutil.disk_usage(self.root).free
            except OSError:
                room = None
        with self._stoppable():  # interrupt() cancels the frame's jobs
            try:
                return spark_frames.read_frame(self.spark, source, where, want, room=room)
            except EinsumError as e:
                if str(e).startswith(where):
                    raise
                raise EinsumError(f"{where}: {e}") from None  # the shared checks (tile, keys) name no store
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - the frame's own computation failed (Spark's errors)
                raise ExecutionError(f"{where} failed on Spark reading the DataFrame: {_spark_error(e)}") from e

    def spark_frame(self, value: TiledValue, form: str):
        """Tensor ``value`` as a Spark DataFrame, read from where it is stored when it runs:
        its tiles (``form="tiles"``: key columns, then ``tile``) or its elements (``"elements"``:
        an index column per dimension, named like the keys, then ``value``; ``spark_frames``)."""
        with self.lock:
            self._check_open()
            where = self._stored(value.name, value, f"tensor {value.name!r} was replaced: it is now")
            # the tiles a user's Spark job will read are checked as a plan's inputs are: a
            # table edited by hand (a tile repeated, deleted, re-keyed) is refused here, not
            # handed on (a trial: to_spark() gave the repeated tile twice)
            self._check_stored([(value, value.name, where)])
            tiles = self._frame(where, value)
        if form == "tiles":
            return tiles
        return spark_frames.elements_frame(tiles, value)

    def store_tiles(self, value: TiledValue, tiles, replace: bool = False) -> None:
        """Store ``tiles``: a pyarrow Table, or a Spark DataFrame of tiles (``read_frame``),
        which Spark writes."""
        with self.lock:
            self._check_open()
            self._check_writable(value.name)
            self._check_target(value.name, replace)
            run = _Run(os.path.join(self._scratch, f"store-{next(self._counter)}"))
            written = None
            with self._stoppable() as job:
                try:
                    os.makedirs(run.path)
                    if isinstance(tiles, pa.Table):
                        written = self._write_arrow(tiles.select(list(value.keys) + ["tile"]), run, "tiles",
                                                    stored=True)
                    else:
                        try:
                            written = self._write_df(tiles.select(*value.keys, "tile"), run, "tiles")
                        except Exception as e:  # noqa: BLE001 - Spark's errors come as many classes
                            job.check()  # cancelled by interrupt()
                            raise (spark_frames.worker_error(e) or ExecutionError(
                                f"store({value.name!r}) failed on Spark: {_spark_error(e)}")) from e
                    if not job.commit():  # from here on an interrupt() comes too late
                        job.check()
                    self._install(written, value, replace)
                    written = None
                finally:
                    if written is not None:
                        self._discard(written)
                    shutil.rmtree(run.path, ignore_errors=True)

    def read_tiles(self, value: TiledValue) -> pa.Table:
        with self.lock:
            self._check_open()
            # under the directory's install lock, shared: another session's replace renames the
            # tensor's directory away between two of its files (a trial: pyarrow's raw
            # FileNotFoundError, 7 reads in 300, or a fragment-less read "No match for d0")
            with self._install_lock(shared=True):
                where = self._stored(value.name, value, f"tensor {value.name!r} was replaced: it is now")
                with self._stoppable():  # interrupt() cancels the read's job (a table's)
                    return self._read(where, value)

    def tile_batches(self, value: TiledValue, batch_bytes: int):
        return contextlib.nullcontext(iter(self.read_tiles(value).to_batches()))

    def _stored(self, name: str, want: TiledValue, what: str) -> Where:
        """Where stored tensor ``name`` is, which must be cut as ``want`` says; a directory
        holding a file that is none of its tiles' is refused (Spark and pyarrow read every file
        there as Parquet: a trial's notes.txt failed a plan with Spark's unreadable-file error)."""
        where = stored_as_wanted(self._find(name), name, want, what)
        if where.path is not None and name.lower() not in self._temporary:
            try:
                with os.scandir(where.path) as it:
                    stray = sorted(e.name for e in it if not e.name.startswith(("_", "."))
                                   and not (e.name.endswith(".parquet") and e.is_file()))
            except OSError:
                stray = []  # gone meanwhile: the read says so
            if stray:
                raise EinsumError(f"stored tensor {name!r}: its directory {where.path} holds {', '.join(stray[:3])}"
                                  f"{' ...' if len(stray) > 3 else ''}, which is none of its tiles' Parquet files "
                                  "(Spark would read it as one); move it out of the directory")
        return where

    @contextlib.contextmanager
    def _stoppable(self):
        """The Spark jobs of one piece of a session call, under a job tag of their own that
        ``Session.interrupt()`` cancels (``cancelJobsWithTag``, the running tasks' threads
        interrupted: a Python UDF's worker is killed, not waited for). A job started after the
        cancel is cancelled too (the stop cancels the tag's jobs every 0.2 s until the work ends),
        and the work calls ``job.check()`` between its jobs and asks ``job.commit()`` before the
        catalog changes. Yields the job (``running.stoppable``)."""
        context = self.spark.sparkContext
        tag = f"eindecomp_sql-{self._session_id}-{next(self._counter)}"
        ended = threading.Event()

        def cancel_until_ended():
            # a stop that lands while Spark still plans a step's job (0.2-8 s here) finds no
            # job to cancel, and the job then ran its every task (a trial: 34 s): the tag's jobs
            # are cancelled again until this work ends
            while True:
                with contextlib.suppress(Exception):  # the session stopping meanwhile
                    context.cancelJobsWithTag(tag)
                if ended.wait(0.2):
                    return

        def stop():
            threading.Thread(target=cancel_until_ended, name="eds-spark-cancel", daemon=True).start()

        with stoppable(self.stopper, stop) as job:
            # both are properties of this thread's jobs (pyspark pins a JVM thread to it)
            old = context.getLocalProperty(INTERRUPT_ON_CANCEL)
            context.addJobTag(tag)
            try:
                context.setInterruptOnCancel(True)
                yield job
            finally:
                ended.set()
                context.removeJobTag(tag)
                context.setLocalProperty(INTERRUPT_ON_CANCEL, old)

    # -- execution --------------------------------------------------------------------------
    def _register_arities(self, compiled) -> None:
        """The einsum kernels of more than ``MAX_ARITY`` operands the statements call (see the
        DuckDB backend's), registered on the session once."""
        from ..udfs.register import ARITY_UDF, MAX_ARITY
        from ..udfs.spark import register_spark_arity

        done = self.__dict__.setdefault("_arities", set(range(1, MAX_ARITY + 1)))
        for n in sorted({int(n) for c in compiled for n in ARITY_UDF.findall(c.text)} - done):
            register_spark_arity(self.spark, n)
            done.add(n)

    def execute(self, plan: Plan, inputs: Mapping[str, str | np.ndarray], outputs: Mapping[str, Target],
                replace: bool = False, progress: Callable | None = None) -> dict[str, np.ndarray]:
        """Run the plan's steps, one Spark SQL statement each; see ``base.Backend.execute``.
        Every step's result is written as a value of the run (a Parquet directory under the
        run's scratch, or a run table); the outputs move into the catalog only once every step
        has run."""
        compiler = self.compiler
        compiled = compiler.compile_plan(plan)  # a callable join that cannot be pickled: EinsumError
        if any('"callable":' in c.text for c in compiled):
            # the cached SQL holds the callable's first pickle, a snapshot of the state it
            # reads; the workers must run it as it is now, as DuckDB's in-process kernels do
            with fresh_pickles():
                compiled = compiler.compile_plan_uncached(plan)
        with self.lock:
            self._check_open()
            self._register_arities(compiled)
            for t in outputs.values():
                if t.table is not None and not t.temporary:
                    self._check_writable(t.table)
                    self._check_target(t.table, replace)
            with self._stoppable() as job:
                run = _Run(os.path.join(self._scratch, f"run-{next(self._counter)}"))
                views: list[str] = []
                context = self.spark.sparkContext
                try:
                    os.makedirs(run.path)
                    where = {v.name: self._bind_input(v, inputs[v.name], run) for v in plan.inputs}
                    stored = [(v, inputs[v.name], where[v.name]) for v in plan.inputs if isinstance(inputs[v.name], str)]
                    stamps = self._check_stored(stored)
                    tables = {v.name: self._view(where[v.name], v, views) for v in plan.inputs}
                    arrays: dict[str, pa.Table] = {}
                    inlined = inlined_steps(plan)
                    start = time.perf_counter()
                    for k, c in enumerate(compiled):
                        job.check()  # an interrupt() between two steps' jobs
                        step = plan.steps[k]
                        text = compiler.bind_sql(c.text, tables)
                        # the step's jobs say which step they are (Spark's UI and REST API)
                        context.setJobDescription(f"eindecomp_sql step {k}: {step.describe()}")
                        try:
                            df = self.spark.sql(text)
                            if c.value in outputs and outputs[c.value].table is None:
                                arrays[c.value] = df.toArrow()
                            elif k in inlined:
                                # read by one later step only: a view of the statement, which Spark
                                # plans into its reader's (no Parquet written and read back, one job
                                # less, and the reader can broadcast it)
                                tables[c.value] = self._lazy_view(df, views)
                            else:
                                where[c.value] = self._write_df(df, run, "s")
                                tables[c.value] = self._view(where[c.value], step_target(step), views)
                        except KeyboardInterrupt:
                            raise
                        except Exception as e:  # noqa: BLE001 - Spark's errors come as many classes
                            job.check()  # cancelled by interrupt(): that is what stopped it
                            self._check_unchanged(stored, stamps, f"step {k} ({step.describe()}) failed: ")
                            raise ExecutionError(f"step {k} ({step.describe()}) failed on Spark: {_spark_error(e)}") from e
                        if progress is not None:
                            n = output_tiles(step)
                            progress(StepProgress(k + 1, len(compiled), step.describe(), n, n, 0,
                                                  time.perf_counter() - start))
                    self._check_unchanged(stored, stamps, "")
                    values = {o.name: o for o in plan.outputs}
                    result = {name: array_from_tiles(arrays[name], values[name].shape, values[name].tile,
                                                     values[name].dtype, values[name].keys)
                              for name, t in outputs.items() if t.table is None}
                    if not job.commit():  # from here on an interrupt() comes too late
                        job.check()
                    for name, t in outputs.items():  # everything ran: now the catalog changes
                        if t.table is None:
                            continue
                        v = values[name]
                        if not self._made_by(run, where[name]) or (self._run_tables is not None
                                                                   and where[name].table is None):
                            # an output no step wrote (an input's own tiles): a copy is moved, never
                            # the stored tensor; where tensors are tables, a table
                            where[name] = self._copy(where[name], v, run)
                        stored = _replace(v, name=t.table)
                        if t.temporary:
                            self._keep_temporary(where[name], stored, run)
                        else:
                            self._install(where[name], stored, replace)
                            if where[name].table is not None:
                                run.tables.remove(where[name].table)
                    return result
                finally:
                    context.setJobDescription(None)
                    for view in views:
                        with contextlib.suppress(Exception):
                            self.spark.catalog.dropTempView(view)
                    for name in run.tables:  # the run's tables not moved into the catalog
                        with contextlib.suppress(Exception):
                            self._tables.discard(name)
                    shutil.rmtree(run.path, ignore_errors=True)

    def _check_stored(self, stored: list[tuple[TiledValue, str, Where]]) -> dict[str, tuple | None]:
        """Refuse, before any statement runs, to read a stored tensor whose tiles no longer hold
        its grid's keys: a Parquet file or a table row deleted, repeated or re-keyed by hand
        (``compile/tile_check.py``, as the DuckDB backend checks its tables). Edited so, a GEMM
        on Spark summed a repeated tile twice, or dropped a deleted one's products, in silence.
        One Spark job reads the keys of every tensor not checked since its files last changed
        (``DataFrame.inputFiles``, and each local file's size and time): a tensor the session
        stored, read again, costs no job. A NULL tile or one of the wrong length, the kernels
        refuse. Returns each tensor's files as read (for ``_check_unchanged``)."""
        from ..compile.tile_check import NULL_KEY, problems, split_rows

        todo, stamps = [], {}
        for v, name, where in stored:
            frame = None
            stamp = self._dir_stamp(where.path) if where.table is None else None
            if stamp is None:
                frame = self._frame(where, v)
                stamp = self._files_stamp(frame)
            stamps[name.lower()] = stamp
            key = (name.lower(), v)
            if stamp is None or self._checked.get(key) != stamp:
                todo.append((v, name, frame if frame is not None else self._frame(where, v), key, stamp))
        if not todo:
            return stamps
        from pyspark.sql import functions as F

        most = max(len(v.keys) for v, *_ in todo)
        union = None
        for q, (v, _, frame, _, _) in enumerate(todo):
            cols = [F.lit(q).alias("q")] + [F.col(v.keys[p]).cast("bigint").alias(f"k{p}") if p < len(v.keys)
                                             else F.lit(0).cast("bigint").alias(f"k{p}") for p in range(most)]
            part = frame.select(*cols)
            union = part if union is None else union.unionAll(part)
        try:
            got = union.toArrow()
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - a file gone or unreadable: the statements say it, naming the step
            return stamps
        columns = {c: (got.column(c).fill_null(NULL_KEY) if c != "q" else got.column(c)).to_numpy()
                   for c in got.column_names}
        rows = split_rows([(v, name) for v, name, *_ in todo], columns)  # the DuckDB check's split
        for (v, name, _, key, stamp), keys in zip(todo, rows):
            wrong = problems(v, keys)
            if wrong:
                raise EinsumError(f"stored tensor {v.name!r} ({name!r}) no longer holds its tiles: {'; '.join(wrong)} "
                                  "(were its files or table edited? store it again with replace=True); nothing was run")
            if stamp is not None:
                self._checked[key] = stamp
        return stamps

    def _check_unchanged(self, stored: list[tuple[TiledValue, str, Where]], stamps: dict[str, tuple | None],
                         what: str) -> None:
        """Refuse a run's results if a stored tensor it read was replaced or dropped meanwhile
        (files not those ``_check_stored`` saw). Spark has no lock across sessions or processes:
        a replace by another session renames the tensor's files away mid-run, and a statement
        reads what is under its name when it runs (the old files, the new tiles under the old
        dtype, or none). Every replace writes files of new names, so a changed tensor never
        looks unchanged. Called before the catalog changes (nothing is written then) and when a
        statement fails (to say why, rather than Spark's missing file)."""
        for v, name, where in stored:
            before = stamps.get(name.lower())
            if before is None or name.lower() in self._temporary:  # the session's own: no other replaces it
                continue
            try:
                if where.table is None:
                    now = self._dir_stamp(where.path)
                else:
                    # the table's tensor as the plan read it: same layout, whatever value name the
                    # plan gave it (a graph input "p" bound to tensor "A"; comparing names refused
                    # every graph over stored tensors on Spark tables: a trial)
                    found = self._tables.find(name)
                    same = found is not None and dataclasses.replace(found, name=v.name) == v
                    now = self._files_stamp(self._frame(where, v)) if same else None
            except Exception:  # noqa: BLE001 - dropped meanwhile: the table is gone
                now = None
            if now != before:
                raise ExecutionError(f"{what}stored tensor {name!r} was replaced or dropped (by another session?) "
                                     "while this plan ran, so what it read is not one tensor: nothing was written; "
                                     "run it again")

    @staticmethod
    def _dir_stamp(path: str | None) -> tuple | None:
        """``_files_stamp`` of a tensor's directory on this machine, from the directory itself
        (~µs; asking Spark for a frame's files took ~13 ms a tensor)."""
        if path is None or not os.path.isdir(path):
            return None
        try:
            with os.scandir(path) as it:
                return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in it
                                    if not e.name.startswith(("_", "."))))
        except OSError:
            return None

    def _files_stamp(self, frame) -> tuple | None:
        """What a tensor's tiles are read from: its files' names, and for local ones their size
        and modification time (a file rewritten in place keeps its name). None where Spark
        cannot say (the check then runs every time)."""
        try:
            files = sorted(frame.inputFiles())
        except Exception:  # noqa: BLE001 - a source without files: check it every time
            return None
        stamp = []
        for f in files:
            path = f[len("file:"):] if f.startswith("file:") else None
            try:
                st = os.stat(path) if path is not None else None
            except OSError:
                st = None
            stamp.append((f, st.st_size, st.st_mtime_ns) if st is not None else (f,))
        return tuple(stamp)

    @staticmethod
    def _made_by(run: _Run, where: Where) -> bool:
        if where.table is not None:
            return where.table in run.tables
        return os.path.dirname(where.path) == run.path

    def _copy(self, where: Where, value: TiledValue, run: _Run) -> Where:
        if self._run_tables is not None or where.table is not None:  # a table, or from one
            return self._write_df(self._frame(where, value), run, "copy")
        copied = os.path.join(run.path, f"copy-{next(self._counter)}")
        shutil.copytree(where.path, copied)
        return Where(path=copied)

    def _keep_temporary(self, where: Where, stored: TiledValue, run: _Run) -> None:
        """A temporary result: the run's value, kept until dropped or the session closes."""
        if where.table is not None:
            run.tables.remove(where.table)
            self._temporary[stored.name.lower()] = (stored, where)
            return
        self._write_meta(where.path, stored)
        kept = os.path.join(self._scratch, f"temp-{next(self._counter)}")
        os.rename(where.path, kept)
        self._temporary[stored.name.lower()] = (stored, Where(path=kept))

    def _lazy_view(self, df, views: list[str]) -> str:
        """A temporary view of the statement ``df``, not run: its reader runs it."""
        name = f"_eds_{self._session_id}_{next(self._counter)}"
        df.createOrReplaceTempView(name)
        views.append(name)
        return name

    def _view(self, where: Where, value: TiledValue, views: list[str]) -> str:
        """A temporary view of ``value``'s tiles, named afresh (one Spark session may serve
        several backends). Of a Parquet directory, with the schema said, not inferred:
        inferring it runs a Spark job that reads the files' footers, on every view."""
        name = f"_eds_{self._session_id}_{next(self._counter)}"
        self._frame(where, value).createOrReplaceTempView(name)
        views.append(name)
        return name

    def _frame(self, where: Where, value: TiledValue):
        """A DataFrame of ``value``'s tiles (key columns, then ``tile``), not read yet."""
        if where.table is not None:
            return self.spark.table(self._tables.qualified(where.table)).select(*value.keys, "tile")
        from pyspark.sql.types import BinaryType, LongType, StructField, StructType

        schema = StructType([StructField(k, LongType()) for k in value.keys] + [StructField("tile", BinaryType())])
        return self.spark.read.schema(schema).parquet(where.path)

    def _bind_input(self, v: TiledValue, x, run: _Run) -> Where:
        """Where the tiles a plan input reads are: a stored tensor's, or the array's tiles
        written for this run (Parquet gives Spark their true size: an in-memory DataFrame is
        estimated at ~100 B per tile and broadcast)."""
        if isinstance(x, str):
            return self._stored(x, v, f"input {v.name!r}: tensor {x!r} is")
        a = array_as_wanted(v, x)
        return self._write_arrow(tiles_from_array(a, v.tile, v.keys), run, "in")

    def _remove_root(self) -> None:
        if getattr(self, "_owns_root", False):
            shutil.rmtree(self.root, ignore_errors=True)
        elif getattr(self, "_made_root", False):
            try:
                os.rmdir(self.root)  # only as we made it: empty
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._temporary.clear()
            if self._tables is not None:  # temporary results kept as run tables
                self._tables.close()
            shutil.rmtree(self._scratch, ignore_errors=True)
            if self._alive is not None:
                with contextlib.suppress(OSError):
                    os.remove(self._scratch + ".lock")
                self._alive.close()
            if self._scratch_base is not None:
                shutil.rmtree(self._scratch_base, ignore_errors=True)
            self._remove_root()
            if self._owns_spark:
                _release_local(self.spark)


__all__ = ["SparkBackend"]
