"""The public face: a session over a DuckDB database, tensors stored in it, and einsum.

Holds no planning or SQL logic of its own: it resolves operands, calls parse -> lower -> plan
-> compile -> backend, and turns tiles back into numpy.
"""

from __future__ import annotations

import atexit
import itertools
import re
import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .backends.duckdb import DuckDBBackend
from .compile import compile_plan, elements_query, single_query
from .errors import EinsumError
from .plan import DEFAULT_TILE_BYTES, Plan, TiledValue, auto_tile, check_tile, plan_einsum
from .udfs.tiles import array_from_tiles, tiles_from_array

DTYPES = ("float32", "float64", "int32", "int64", "bool")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
RESERVED = ("_eds_", "eds_")


def check_name(name, what: str = "tensor name") -> str:
    """Tensor names are plain identifiers. They reach SQL only quoted by sqlglot, but a name
    that is not an identifier is refused outright, so nothing that looks like SQL gets in."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise EinsumError(
            f"invalid {what} {name!r}: use letters, digits and '_' (starting with a letter or '_'), "
            "at most 63 characters"
        )
    if name.lower().startswith(RESERVED):
        raise EinsumError(f"invalid {what} {name!r}: names starting with '_eds_' or 'eds_' are reserved")
    return name


def check_dtype(dtype) -> str:
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise EinsumError(f"unsupported dtype {dt.name}: eindecomp_sql stores {', '.join(DTYPES)}")
    return dt.name


def as_array(x, where: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # noqa: BLE001 - anything numpy cannot read is bad input
        raise EinsumError(f"{where}: cannot be read as an array ({e})") from None
    if a.dtype == object:
        raise EinsumError(f"{where}: cannot be read as a numeric array")
    check_dtype(a.dtype)
    return a


@dataclass(frozen=True, eq=False)
class Tensor:
    """A tensor stored as a tiled table in a session's database."""

    session: "Session"
    value: TiledValue

    @property
    def name(self) -> str:
        return self.value.table

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.value.dtype)

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    @property
    def tile(self) -> tuple[int, ...]:
        return self.value.tile

    @property
    def keys(self) -> tuple[str, ...]:
        return self.value.keys

    def to_arrow(self) -> pa.Table:
        """The tiled table: one int64 key column per dimension, then ``tile`` (C-order bytes)."""
        return self.session.backend.read_tiles(self.value)

    def to_numpy(self) -> np.ndarray:
        v = self.value
        return array_from_tiles(self.to_arrow(), v.shape, v.tile, v.dtype, v.keys)

    def __array__(self, dtype=None, copy=None):
        a = self.to_numpy()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        v = self.value
        return f"Tensor({v.table!r}, shape={v.shape}, dtype={v.dtype}, tile={v.tile})"


class Session:
    """eindecomp_sql on one DuckDB database.

    >>> db = connect()                                   # in memory; or a path, or a connection
    >>> A = db.store("A", np.ones((4, 3), np.float32))
    >>> db.einsum("ij->j", A).to_numpy()
    array([4., 4., 4.], dtype=float32)
    """

    def __init__(self, database=None, *, tile_bytes: int = DEFAULT_TILE_BYTES, read_only: bool = False):
        self.backend = DuckDBBackend(database, read_only=read_only)
        self.tile_bytes = tile_bytes
        self._counter = itertools.count()
        self._lock = threading.RLock()
        self.backend.register_sql_interface(self._einsum_sql)

    @property
    def connection(self):
        """The DuckDB connection (``einsum`` and ``einsum_elements`` table functions are on it)."""
        return self.backend.con

    # -- tensors ----------------------------------------------------------------------------
    def store(self, name: str, array, tile=None, keys=None, replace: bool = False) -> Tensor:
        """Store ``array`` as tiled table ``name`` (tile shape chosen if not given)."""
        check_name(name)
        a = as_array(array, f"store({name!r})")
        dtype = check_dtype(a.dtype)
        tile = check_tile(a.shape, tile) if tile is not None else auto_tile(a.shape, a.dtype.itemsize, self.tile_bytes)
        if keys is None:
            keys = tuple(f"d{k}" for k in range(a.ndim))
        keys = tuple(check_name(k, "key column name") for k in keys)
        if len(keys) != a.ndim or len(set(keys)) != len(keys) or "tile" in keys:
            raise EinsumError(f"keys {keys} must name each of the {a.ndim} dimension(s) once (not 'tile')")
        if any(n == 0 for n in a.shape):
            raise EinsumError(f"store({name!r}): empty dimensions (shape {a.shape}) are not supported")
        value = TiledValue(name, a.shape, dtype, tile, keys, name)
        self.backend.store_tiles(value, tiles_from_array(a, tile, keys), replace=replace)
        return Tensor(self, value)

    def tensor(self, name: str) -> Tensor:
        """A stored tensor by name (also after reopening a file database)."""
        check_name(name)
        v = self.backend.lookup(name)
        if v is None:
            raise EinsumError(f"no stored tensor named {name!r}; stored: {', '.join(self.backend.names()) or 'none'}")
        return Tensor(self, v)

    def tensors(self) -> list[str]:
        return self.backend.names()

    def drop(self, name: str) -> None:
        self.tensor(name)
        self.backend.drop(name)

    # -- einsum -----------------------------------------------------------------------------
    def _operand(self, x, k: int, temps: list) -> TiledValue:
        if isinstance(x, Tensor):
            if x.session is not self and x.session.backend.con is not self.backend.con:
                raise EinsumError(f"operand {k} is a tensor of another session")
            return x.value
        if isinstance(x, str):
            return self.tensor(x).value
        a = as_array(x, f"operand {k}")
        if any(n == 0 for n in a.shape):
            raise EinsumError(f"operand {k}: empty dimensions (shape {a.shape}) are not supported")
        # a stable name per operand position (calls hold the session lock), so a repeated
        # einsum on same-shaped arrays finds its plan and SQL in the caches
        name = f"_eds_in{k}"
        keys = tuple(f"d{p}" for p in range(a.ndim))
        tile = auto_tile(a.shape, a.dtype.itemsize, self.tile_bytes)
        self.backend.register_arrow(name, tiles_from_array(a, tile, keys))
        temps.append(name)
        return TiledValue(name, a.shape, a.dtype.name, tile, keys, name)

    def plan(self, spec: str, *operands, join=None, agg=None, out: str | None = None, _values=None) -> Plan:
        """The plan ``einsum`` would run (operands: Tensors or names)."""
        values = _values if _values is not None else [self._operand(x, k, []) for k, x in enumerate(operands)]
        return plan_einsum(spec, tuple(values), join, agg, out)

    def explain(self, spec: str, *operands, join=None, agg=None, out: str | None = None) -> str:
        """The plan and the SQL of every step."""
        temps: list[str] = []
        try:
            values = [self._operand(x, k, temps) for k, x in enumerate(operands)]
            p = self.plan(spec, join=join, agg=agg, out=out, _values=values)
        finally:
            for t in temps:
                self.backend.unregister(t)
        lines = [p.explain(), ""]
        for k, c in enumerate(compile_plan(p)):
            target = f"-> {c.table}" if c.table else "-> result rows"
            lines.append(f"-- step {k} {target}")
            lines.append(c.select.sql(dialect="duckdb", pretty=True) + ";")
        return "\n".join(lines)

    def einsum(self, spec: str, *operands, join=None, agg=None, out: str | None = None, replace: bool = False):
        """Run an extended einsum as SQL in this database and return the result as a Tensor.

        ``out`` names the result table (kept in the catalog); without it the result is a
        temporary table that lives as long as the connection.
        """
        if out is not None:
            check_name(out, "output name")
        temps: list[str] = []
        with self._lock:
            try:
                values = [self._operand(x, k, temps) for k, x in enumerate(operands)]
                if out is None:
                    table, temporary = f"_eds_r{next(self._counter)}", True
                else:
                    table, temporary = out, False
                p = self.plan(spec, join=join, agg=agg, out=table, _values=values)
                if temporary:
                    r = p.result
                    p = Plan(p.steps[:-1] + (_retarget(p.steps[-1], temporary=True),), p.inputs,
                             TiledValue(r.name, r.shape, r.dtype, r.tile, r.keys, r.table, temporary=True))
                self.backend.execute(p, replace=replace)
            finally:
                for t in temps:
                    self.backend.unregister(t)
        return Tensor(self, p.result)

    def einsum_numpy(self, spec: str, *operands, join=None, agg=None) -> np.ndarray:
        """Run in this database, return numpy; nothing is stored."""
        temps: list[str] = []
        with self._lock:
            try:
                values = [self._operand(x, k, temps) for k, x in enumerate(operands)]
                p = self.plan(spec, join=join, agg=agg, _values=values)
                tiles = self.backend.execute(p)
            finally:
                for t in temps:
                    self.backend.unregister(t)
        r = p.result
        return array_from_tiles(tiles, r.shape, r.tile, r.dtype, r.keys)

    # -- SQL interface ----------------------------------------------------------------------
    def _einsum_sql(self, spec: str, names: list[str], mode: str) -> str:
        values = []
        for name in names:
            check_name(name)
            v = self.backend.lookup(name)
            if v is None:
                raise EinsumError(f"einsum(): no stored tensor named {name!r}")
            values.append(v)
        p = plan_einsum(spec, tuple(values))
        query = single_query(p)
        if mode == "elements":
            query = elements_query(p.result, p.result.keys, source=query)
        return query.sql(dialect="duckdb")

    def close(self) -> None:
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _retarget(step, temporary: bool):
    from dataclasses import replace

    r = step.result
    return replace(step, result=TiledValue(r.name, r.shape, r.dtype, r.tile, r.keys, r.table, temporary=temporary))


_default: Session | None = None
_default_lock = threading.Lock()


def default_session() -> Session:
    """The in-memory session ``eds.einsum`` runs on: opened once (a connection costs ~30 ms),
    closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Session()
            atexit.register(_close_default)
        return _default


def _close_default() -> None:
    global _default
    if _default is not None:
        _default.close()
        _default = None


def connect(database=None, **kwargs) -> Session:
    """A session over DuckDB: in memory (default), a database file path, or an open connection."""
    return Session(database, **kwargs)


def einsum(spec: str, *operands, join=None, agg=None) -> np.ndarray:
    """``numpy.einsum`` semantics (plus ``join=`` / ``agg=``), run as SQL in an embedded DuckDB.

    >>> einsum("ij,jk->ik", np.eye(2), np.arange(4.).reshape(2, 2))
    array([[0., 1.],
           [2., 3.]])
    """
    return default_session().einsum_numpy(spec, *operands, join=join, agg=agg)
