"""Whether stored tensors' tables still hold their grids' keys: the query, and what its rows say.

A stored tensor's table is the user's to edit in SQL. An einsum reading one edited out of shape
went wrong in silence: a deleted tile left a re-tiled tile's bytes uninitialised, or an output
tile missing (its result read uninitialised memory); a repeated tile was summed twice; a key
outside the grid was an index past the array or a negative one in ``einsum_elements``. So
before a plan reads stored tables, one query fetches each table's keys, and the plan is
refused, before any statement runs, unless every key of the grid is there once and no key is
NULL or outside the grid. Only the key columns are read: ``octet_length(tile)`` loads every
tile (a 256 MiB tensor's check took 185 ms, 330 ms a call under a budget that keeps it on
disk). A tile NULL or of the wrong length is refused by the kernel that reads it
(``udfs/tiles.py``). ``to_numpy()``, ``to_arrow()`` and ``export()`` check the rows they read
whole (``io.check_stored_tiles``).

Why rows and not aggregates: DuckDB answered ``count(*)``, the keys' ranges and a distinct
count as one aggregate per table in over a ms a table; the keys come back in ~0.3 ms a table,
and numpy checks them in microseconds (bench/RESULTS.md).

Pure: the query text and numpy over what it returns; the backend runs it.

>>> from eindecomp_sql.plan import TiledValue
>>> v = TiledValue("A", (5, 4), "float64", (2, 3), ("d0", "d1"))
>>> problems(v, np.array([[0, 0], [0, 1], [1, 0], [1, 1], [2, 0]]))
['5 tile rows, but shape (5, 4) in tiles of (2, 3) has 6']
"""

from __future__ import annotations

import functools
import math

import numpy as np
from sqlglot import exp

from ..plan import TiledValue
from .compiler import col, ident, num

# what the query gives for a NULL key (no key is this small: the grid starts at 0)
NULL_KEY = -(1 << 62)


def grid(value: TiledValue) -> tuple[int, ...]:
    return tuple(-(-n // t) if t else 0 for n, t in zip(value.shape, value.tile))


def check_query(values: tuple[tuple[TiledValue, str], ...]) -> str:
    """One query (DuckDB SQL) over every ``(value, table name)``: a row per tile, the value's
    position first, then its keys (0 past a value's own, so that every branch of the union has
    as many). Plain columns: a CAST or COALESCE on each made the query 0.2 ms slower (NULLs
    come back masked instead). Cached per values."""
    return _check_query(tuple(values))


@functools.lru_cache(maxsize=256)
def _check_query(values: tuple[tuple[TiledValue, str], ...]) -> str:
    most = max(len(v.keys) for v, _ in values)
    selects = []
    for q, (v, name) in enumerate(values):
        cols = [exp.alias_(num(q), "q")]
        cols += [exp.alias_(col(v.keys[p]) if p < len(v.keys) else num(0), f"k{p}") for p in range(most)]
        selects.append(exp.select(*cols).from_(exp.Table(this=ident(name))))
    out = selects[0]
    for s in selects[1:]:
        out = exp.union(out, s, distinct=False)
    return out.sql(dialect="duckdb")


def _filled(column, null) -> np.ndarray:
    """A fetched column as int64, NULLs (masked) as ``null``."""
    if isinstance(column, np.ma.MaskedArray):
        return column.filled(null).astype(np.int64)
    return np.asarray(column).astype(np.int64)


def split_rows(values, columns: dict) -> list[np.ndarray]:
    """The query's columns (``fetchnumpy``) as, per value, its keys (rows x keys; a NULL key
    ``NULL_KEY``)."""
    q = np.asarray(columns["q"])
    keys = [_filled(columns[f"k{p}"], NULL_KEY) for p in range(max(len(v.keys) for v, _ in values))]
    out = []
    for k, (v, _) in enumerate(values):
        mine = q == k
        mk = (np.stack([keys[p][mine] for p in range(len(v.keys))], axis=1) if v.keys
              else np.zeros((int(mine.sum()), 0), np.int64))
        out.append(mk)
    return out


def problems(value: TiledValue, keys: np.ndarray) -> list[str]:
    """What the keys of ``value``'s table say is wrong (nothing: every key of its grid once).
    ``keys``: one row per tile, ``NULL_KEY`` for a NULL key."""
    g = grid(value)
    n = len(keys)
    expect = math.prod(g)
    out = []
    if n != expect:
        out.append(f"{n} tile rows, but shape {value.shape} in tiles of {value.tile} has {expect}")
    keyed = (keys != NULL_KEY).all(axis=1) if keys.size else np.ones(n, bool)
    if not keyed.all():
        out.append(f"{int((~keyed).sum())} tile key(s) NULL")
    k = keys[keyed]
    outside = [f"key {name} runs {int(k[:, p].min())}..{int(k[:, p].max())}, outside the grid's 0..{size - 1}"
               for p, (name, size) in enumerate(zip(value.keys, g))
               if len(k) and (k[:, p].min() < 0 or k[:, p].max() >= size)]
    out += outside
    if not outside and len(k) and value.keys:
        distinct = len(np.unique(np.ravel_multi_index(k.T, g)))
        if distinct < len(k):
            out.append(f"{len(k) - distinct} tile key(s) repeated")
    return out
