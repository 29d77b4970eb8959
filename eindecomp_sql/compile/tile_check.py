"""Whether stored tensors' tables still hold their grids: the query, and what its rows say.

A stored tensor's table is the user's to edit in SQL. An einsum reading one edited out of shape
went wrong in silence: a deleted tile left a re-tiled tile's bytes uninitialised, or an output
tile missing (its result read uninitialised memory); a repeated tile was summed twice; a key
outside the grid was an index past the array or a negative one in ``einsum_elements``. So
before a plan reads stored tables, one query fetches each table's keys and tile lengths (not
the tile bytes), and the plan is refused, before any statement runs, unless every table holds
its grid: every key once, none NULL or outside the grid, no tile NULL or of the wrong length.
``to_numpy()``, ``to_arrow()`` and ``export()`` check the rows they read the same way
(``io.check_stored_tiles``).

Why rows and not aggregates: DuckDB answered ``count(*)``, the keys' ranges, a distinct count
and the lengths' check as one aggregate per table in 1.6 ms a table; the rows come back in
~0.3 ms a table, and numpy checks them in microseconds (bench/RESULTS.md "Checks").

Pure: the query text and numpy over what it returns; the backend runs it.

>>> from eindecomp_sql.plan import TiledValue
>>> v = TiledValue("A", (5, 4), "float64", (2, 3), ("d0", "d1"))
>>> keys = np.array([[0, 0], [0, 1], [1, 0], [1, 1], [2, 0]])
>>> problems(v, keys, np.array([48, 16, 48, 16, 24]))
['5 tile rows, but shape (5, 4) in tiles of (2, 3) has 6']
"""

from __future__ import annotations

import functools
import math

import numpy as np
from sqlglot import exp

from ..plan import TiledValue
from .compiler import TILE, col, ident, num

# what the query gives for a NULL key (no key is this small: the grid starts at 0)
NULL_KEY = -(1 << 62)


def grid(value: TiledValue) -> tuple[int, ...]:
    return tuple(-(-n // t) if t else 0 for n, t in zip(value.shape, value.tile))


def check_query(values: tuple[tuple[TiledValue, str], ...]) -> str:
    """One query (DuckDB SQL) over every ``(value, table name)``: a row per tile, the value's
    position first, then its keys (0 past a value's own, so that every branch of the union has
    as many), then the tile's length. Plain columns: a CAST or COALESCE on each made the query
    0.2 ms slower (NULLs come back masked instead). Cached per values."""
    return _check_query(tuple(values))


@functools.lru_cache(maxsize=256)
def _check_query(values: tuple[tuple[TiledValue, str], ...]) -> str:
    most = max(len(v.keys) for v, _ in values)
    selects = []
    for q, (v, name) in enumerate(values):
        cols = [exp.alias_(num(q), "q")]
        cols += [exp.alias_(col(v.keys[p]) if p < len(v.keys) else num(0), f"k{p}") for p in range(most)]
        cols.append(exp.alias_(exp.Anonymous(this="octet_length", expressions=[col(TILE)]), "n"))
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


def split_rows(values, columns: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """The query's columns (``fetchnumpy``) as, per value, its keys (rows x keys; a NULL key
    ``NULL_KEY``) and its tiles' lengths (-1: NULL)."""
    q = np.asarray(columns["q"])
    lengths = _filled(columns["n"], -1)
    keys = [_filled(columns[f"k{p}"], NULL_KEY) for p in range(max(len(v.keys) for v, _ in values))]
    out = []
    for k, (v, _) in enumerate(values):
        mine = q == k
        mk = (np.stack([keys[p][mine] for p in range(len(v.keys))], axis=1) if v.keys
              else np.zeros((int(mine.sum()), 0), np.int64))
        out.append((mk, lengths[mine]))
    return out


def problems(value: TiledValue, keys: np.ndarray, lengths: np.ndarray) -> list[str]:
    """What the rows of ``value``'s table say is wrong (nothing: it holds its grid). ``keys``:
    one row per tile (``NULL_KEY`` for a NULL key); ``lengths``: each tile's bytes (-1 NULL)."""
    g = grid(value)
    n = len(lengths)
    expect = math.prod(g)
    out = []
    if n != expect:
        out.append(f"{n} tile rows, but shape {value.shape} in tiles of {value.tile} has {expect}")
    keyed = (keys != NULL_KEY).all(axis=1) if keys.size else np.ones(n, bool)
    if not keyed.all():
        out.append(f"{int((~keyed).sum())} tile key(s) NULL")
    k = keys[keyed]
    outside = []
    for p, (name, size) in enumerate(zip(value.keys, g)):
        if len(k) and (k[:, p].min() < 0 or k[:, p].max() >= size):
            outside.append(f"key {name} runs {int(k[:, p].min())}..{int(k[:, p].max())}, outside the grid's "
                           f"0..{size - 1}")
    out += outside
    if not outside and len(k):
        distinct = len(np.unique(np.ravel_multi_index(k.T, g))) if value.keys else 1
        if distinct < len(k):
            out.append(f"{len(k) - distinct} tile key(s) repeated")
    nulls = int((lengths < 0).sum())
    if nulls:
        out.append(f"{nulls} tile(s) NULL")
    if not outside and len(k):
        itemsize = np.dtype(value.dtype).itemsize
        want = np.full(len(k), itemsize, np.int64)
        for p, (t, size) in enumerate(zip(value.tile, value.shape)):
            want *= np.minimum(t, size - k[:, p] * t)
        have = lengths[keyed]
        bad = int(((have != want) & (have >= 0)).sum())
        if bad:
            out.append(f"{bad} tile(s) of the wrong length for their place (dtype {value.dtype}, tile {value.tile}, "
                       "edge tiles smaller)")
    return out
