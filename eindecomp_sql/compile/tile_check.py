"""Whether stored tensors' tables still hold their grids: the query, and what its rows say.

A stored tensor's table is the user's to edit in SQL. An einsum reading one edited out of shape
went wrong in silence: a deleted tile left a re-tiled tile's bytes uninitialised, or an output
tile missing (its result read uninitialised memory); a repeated tile was summed twice; a key
outside the grid was an index past the array or a negative one in ``einsum_elements``. So
before a plan reads stored tables, one query counts, for each, its rows, distinct keys, the
keys' range, NULL tiles and tiles of the wrong length (keys and lengths: the tile bytes are
not read), and the plan is refused, before any statement runs, unless every table is whole.
``to_numpy()``, ``to_arrow()`` and ``export()`` check the rows they read the same way
(``io.check_stored_tiles``).

Pure: sqlglot expressions and the arithmetic of the grid; the backend runs the query.

>>> from eindecomp_sql.plan import TiledValue
>>> v = TiledValue("A", (5, 4), "float64", (2, 3), ("d0", "d1"))
>>> problems(v, (5, 5, 5, 0, 2, 0, 1, 5, 0))
['5 tile rows, but shape (5, 4) in tiles of (2, 3) has 6']
"""

from __future__ import annotations

import functools
import math

import numpy as np
from sqlglot import exp

from ..plan import TiledValue
from .compiler import TILE, col, ident, num



def grid(value: TiledValue) -> tuple[int, ...]:
    return tuple(-(-n // t) if t else 0 for n, t in zip(value.shape, value.tile))


def check_query(values: tuple[tuple[TiledValue, str], ...]) -> str:
    """One query (DuckDB SQL) over every ``(value, table name)``: a row per value, its
    position first. Cached: sqlglot takes ~2 ms to build and print it, against ~0.3 ms to
    run."""
    return _check_query(tuple(values))


@functools.lru_cache(maxsize=256)
def _check_query(values: tuple[tuple[TiledValue, str], ...]) -> str:
    def least(*args):
        return exp.Anonymous(this="least", expressions=list(args))

    selects = []
    most = max(len(v.keys) for v, _ in values)
    for q, (v, name) in enumerate(values):
        keys = [exp.cast(col(k), "BIGINT") for k in v.keys]  # a TINYINT key multiplies in TINYINT
        tile = col(TILE)
        g = grid(v)
        want = num(np.dtype(v.dtype).itemsize)
        linear = num(0)  # the key's position in the grid (C order): distinct iff the keys are, in range
        for k, t, n, size in zip(keys, v.tile, v.shape, g):
            extent = least(num(t), exp.Sub(this=num(n), expression=exp.Mul(this=k.copy(), expression=num(t))))
            want = exp.Mul(this=want, expression=extent)
            linear = exp.Add(this=exp.Mul(this=exp.Paren(this=linear), expression=num(size)), expression=k.copy())
        cols = [exp.alias_(num(q), "q"), exp.alias_(exp.Count(this=exp.Star()), "n"),
                exp.alias_(exp.Count(this=exp.Distinct(expressions=[linear.copy()])), "u"),
                exp.alias_(exp.Count(this=linear), "keyed")]  # rows whose keys are all there
        for p in range(most):  # as many as the most keys any value has: a union's rows are alike
            lo, hi = ((exp.Min(this=keys[p].copy()), exp.Max(this=keys[p].copy())) if p < len(keys)
                      else (exp.cast(exp.Null(), "BIGINT"), exp.cast(exp.Null(), "BIGINT")))
            cols += [exp.alias_(lo, f"lo{p}"), exp.alias_(hi, f"hi{p}")]
        length = exp.Anonymous(this="octet_length", expressions=[tile.copy()])
        cols += [exp.alias_(exp.Count(this=tile.copy()), "tiles"),  # rows less these: NULL tiles
                 exp.alias_(exp.Sum(this=exp.cast(exp.NEQ(this=length, expression=want), "INTEGER")), "bad")]
        selects.append(exp.select(*cols).from_(exp.Table(this=ident(name))))
    out = selects[0]
    for s in selects[1:]:
        out = exp.union(out, s, distinct=False)
    return out.sql(dialect="duckdb")


def problems(value: TiledValue, row: tuple) -> list[str]:
    """What a check row says is wrong with ``value``'s table (nothing: whole). ``row`` is the
    query's row for it without its position: rows, distinct keys, rows with every key, (min,
    max) per key, non-NULL tiles, tiles of the wrong length."""
    n, distinct, keyed, *rest = row
    ranges, tiles, bad = rest[:-2], rest[-2], rest[-1] or 0
    g = grid(value)
    expect = math.prod(g)
    out = []
    if n != expect:
        out.append(f"{n} tile rows, but shape {value.shape} in tiles of {value.tile} has {expect}")
    if keyed < n:
        out.append(f"{n - keyed} tile key(s) NULL")
    outside = [f"key {k} runs {lo}..{hi}, outside the grid's 0..{size - 1}"
               for k, lo, hi, size in zip(value.keys, ranges[0::2], ranges[1::2], g)
               if lo is not None and (lo < 0 or hi >= size)]
    out += outside
    if distinct < keyed and not outside:  # (keys outside the grid may share a position)
        out.append(f"{keyed - distinct} tile key(s) repeated")
    if tiles < n:
        out.append(f"{n - tiles} tile(s) NULL")
    if bad:
        out.append(f"{bad} tile(s) of the wrong length for their place (dtype {value.dtype}, tile {value.tile}, "
                   "edge tiles smaller)")
    return out
