"""Top-k in the Python API: the ``k`` largest (or smallest) elements of every row of an einsum's
result, as numpy arrays, the way ``torch.topk`` returns them (``db.topk``, ``eds.topk``).

>>> import eindecomp_sql as eds, numpy as np
>>> r = eds.topk("ij->ij", 2, np.array([[3., 1., 3., 2.], [0., 5., 4., 5.]]))
>>> r.values, r.indices
(array([[3., 3.],
       [5., 5.]]), array([[0, 2],
       [1, 3]]))

A row is every output label but the last; the last label is ranked, as in SQL's
``einsum_topk``. The product runs as any einsum does (its plan, its kernels); then the top-k
kernel (``udfs/topk.py``) cuts it to each row's candidates a batch at a time, and ``best``
orders them. Where it goes between the two depends on the budget:

- without ``memory=``, into a numpy array, as ``einsum_numpy`` returns it (the kernels write
  their tiles straight in), ranked in bands of rows (``array_topk``): the result is held once,
  as numpy's ``q @ e.T`` holds it;
- under ``memory=``, into a temporary table in as many statements as the budget asks (as
  ``db.einsum`` runs it), read back a batch of tiles at a time (``tensor_topk``): never whole
  in Python, so a product bigger than the budget is ranked within it.

Under ``memory=``, where every operand is a stored tensor or a table given by name (or
handle) and the join a string, the session first asks for ``einsum_topk``'s own query
(``sql_functions.einsum_sql``): one statement, the top-k fused into the einsum kernel and the
result streamed through it where the plan allows; only where SQL refuses it (a top-k that cannot
fuse, over a result bigger than the budget) does the table way run.

Measured (2,000 x 100,000 similarities, dimension 64, float32, top 5, 2 cores): the table way
took 3.2 s without a budget and raised resident memory 1.6 GB (the temporary table written
and read back: 0.7 s and 0.8 s of it); the array way is what the session does there.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from .errors import EinsumError, EinsumTypeError
from .notation.checks import SQL_TYPES
from .plan import TiledValue
from .udfs.tiles import blob_views
from .udfs.topk import _candidates, reversed_order

# the tiles a batch hands the top-k kernel (the export's batch: at least one tile)
RANK_BATCH_BYTES = 16 << 20
# under a budget, a batch is at most this share of the plans' part of it, and at least 1 MiB (a
# float32 batch's candidates are up to 3x its bytes, and the kernel ranks it in temporaries of its own)
RANK_BATCH_SHARE = 16
# candidates held before the first prune, whatever the answer's size (a prune sorts them)
PRUNE_MIN = 1 << 18


class TopK(NamedTuple):
    """``values`` and ``indices`` (int64, along the ranked label), each of shape
    ``(*rows, min(k, n))``: best first, NaN after every number, ties by the smaller index."""

    values: np.ndarray
    indices: np.ndarray


def check_k(k) -> int:
    """``k`` as an int >= 1 (a bool, a float or a string is refused, as ``torch.topk`` does)."""
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral):
        raise EinsumTypeError(f"topk(): k must be an int, got {type(k).__name__} {k!r:.40}")
    if k < 1:
        raise EinsumError(f"topk(): k must be >= 1, got {k}")
    return int(k)


def check_largest(largest) -> bool:
    if not isinstance(largest, (bool, np.bool_)):
        raise EinsumTypeError(f"topk(): largest must be True or False, got {type(largest).__name__} {largest!r:.40}")
    return bool(largest)


def check_rankable(result: TiledValue, spec: str) -> None:
    """Refuse a result with no label to rank, or of a dtype with no order (complex)."""
    if not result.shape:
        raise EinsumError(f"topk(): {spec!r} has no output label to rank (a row is every output label but the "
                          "last, and the last is ranked)")
    if result.dtype not in SQL_TYPES:
        raise EinsumError(f"topk(): the result is {result.dtype}, which has no order")


def empty(result: TiledValue, k: int) -> TopK:
    """The answer for a result with no row or an empty ranked label (nothing to read)."""
    shape = (*result.shape[:-1], min(k, result.shape[-1]))
    return TopK(np.empty(shape, np.dtype(result.dtype)), np.empty(shape, np.int64))


def tensor_topk(backend, value: TiledValue, k: int, largest: bool = True, check=None,
                batch_bytes: int = RANK_BATCH_BYTES) -> TopK:
    """The top ``k`` of every row of stored (or temporary) tensor ``value``: its tiles read a
    batch of about ``batch_bytes`` at a time (``backend.tile_batches``), each batch cut to its
    candidates by the top-k kernel. Candidates beyond the best ``min(k, n)`` of a row are pruned
    whenever those held reach twice the answer's count (at least ``PRUNE_MIN``), so what is held
    is bounded by the answer and a batch, whatever the number of tiles: kept to the end, a k of
    1,000 over 1,000 x 50,000 made every element a candidate and rose 1.45 GB under
    memory="100MB" (a trial). After a prune, the kernel drops a batch's elements worse than
    their row's ``m``-th best so far (``_bars``): that k sorted 12 s of candidates it could have
    dropped, and ranked 64% of every tile (24 s in all; now 7.9-8.7 s). Candidates are held as
    int32 rows and indices where they fit (12 B a float32 candidate, not 20), and a prune lets
    go of each column's pieces as it joins them (``_pruned``). ``check``: called between
    batches (``db.interrupt()``'s stop)."""
    rows, n = math.prod(value.shape[:-1]), value.shape[-1]
    if rows == 0 or n == 0:
        return empty(value, k)
    m = min(k, n)
    spec = {"shape": list(value.shape), "tile": list(value.tile), "dtype": value.dtype, "k": k,
            "smallest": not largest}
    r_type, i_type = _index_type(rows), _index_type(n)
    held: list[list] = [[], [], []]  # r, i, v pieces: the pruned best so far, then the batches' since
    count = 0
    bar = None  # after a prune: each row's m-th best value so far, and whether it has m
    with backend.tile_batches(value, batch_bytes) as batches:
        for b in batches:
            if check is not None:
                check()
            if not b.num_rows:
                continue
            keys = np.stack([b.column(c).to_numpy(zero_copy_only=False) for c in value.keys], axis=1).tolist()
            tiles = b.column("tile")
            if tiles.null_count:
                raise EinsumError(f"topk(): a tile of {value.name!r} is NULL")
            _, r, i, v = _candidates(spec, keys, blob_views(tiles), bar)
            del tiles, b
            for c, (x, t) in enumerate(((r, r_type), (i, i_type), (v, None))):
                held[c].append(x.astype(t, copy=False) if t is not None else x)
            del r, i, v
            count += held[0][-1].size
            if count > max(2 * rows * m, PRUNE_MIN):
                kept = _pruned(held, m, largest)
                held = [[x] for x in kept]
                count = kept[0].size
                bar = _bars(kept[0], kept[2], rows, m)
                del kept
    values, indices = placed(*_pruned(held, m, largest), rows, m)
    shape = (*value.shape[:-1], m)
    return TopK(values.astype(np.dtype(value.dtype), copy=False).reshape(shape),
                indices.astype(np.int64, copy=False).reshape(shape))


def batch_bytes(plan_budget: int | None) -> int:
    """The tiles a batch hands the top-k kernel: ``RANK_BATCH_BYTES``, less under a small budget."""
    if plan_budget is None:
        return RANK_BATCH_BYTES
    return min(RANK_BATCH_BYTES, max(1 << 20, plan_budget // RANK_BATCH_SHARE))


def _index_type(n: int):
    """The narrowest of int32 and int64 that holds ``0 .. n - 1``."""
    return np.int32 if n <= np.iinfo(np.int32).max else np.int64


def _pruned(held: list[list], m: int, largest: bool):
    """``best`` of ``held``'s r, i and v pieces, each column's pieces let go of as soon as they
    are joined (``held``'s lists are emptied): a prune held its pieces and their join at once."""
    cols = []
    for pieces in held:
        cols.append(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])
        pieces.clear()
    r, i, v = cols
    del cols
    return best(r, i, v, m, largest)


def _bars(r: np.ndarray, v: np.ndarray, rows: int, m: int):
    """From ``best``'s candidates (by row, best first): each row's ``m``-th best value, and
    whether the row has ``m`` (a row with fewer has no bar yet)."""
    counts = np.bincount(r, minlength=rows)
    full = counts == m
    last = np.cumsum(counts) - 1
    bar = np.zeros(rows, v.dtype)
    bar[full] = v[last[full]]
    return bar, full


def rows_topk(table, result: TiledValue, k: int) -> TopK:
    """``einsum_topk``'s rows (row labels..., rank, index, value; ordered by row, then rank) as
    a ``TopK`` of ``result``'s rows."""
    m = min(k, result.shape[-1])
    shape = (*result.shape[:-1], m)
    if table.num_rows != math.prod(shape):
        raise EinsumError(f"topk(): internal error: the query gave {table.num_rows} rows, not {math.prod(shape)}")
    index = table.column(table.num_columns - 2).to_numpy().astype(np.int64, copy=False)
    values = table.column(table.num_columns - 1).to_numpy()  # FLOAT for float16/bfloat16: exact
    return TopK(values.astype(np.dtype(result.dtype), copy=False).reshape(shape), index.reshape(shape))


def array_topk(x: np.ndarray, k: int, largest: bool = True, check=None) -> TopK:
    """The top ``k`` of every row of array ``x`` (its last axis ranked), by the top-k kernel over
    bands of whole rows of about ``RANK_BATCH_BYTES`` (a band is one tile as wide as a row: its
    candidates are its rows' answer, ordered and placed before the next band). ``check``:
    called between bands."""
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    m = min(k, n)
    values, indices = np.empty((rows, m), x.dtype), np.empty((rows, m), np.int64)
    shape = (*x.shape[:-1], m)
    if rows == 0 or n == 0:
        return TopK(values.reshape(shape), indices.reshape(shape))
    x2 = np.ascontiguousarray(x).reshape(rows, n)
    band = max(1, RANK_BATCH_BYTES // max(1, n * x2.itemsize))
    for lo in range(0, rows, band):
        if check is not None:
            check()
        part = x2[lo:lo + band]
        spec = {"shape": list(part.shape), "tile": list(part.shape), "dtype": x.dtype.name, "k": k,
                "smallest": not largest}
        _, r, i, v = _candidates(spec, [[0, 0]], [part.reshape(-1).view(np.uint8)])
        bv, bi = placed(*best(r, i, v, m, largest), part.shape[0], m)
        values[lo:lo + band], indices[lo:lo + band] = bv, bi  # (bfloat16 ranked as float32: exact back)
    return TopK(values.reshape(shape), indices.reshape(shape))


def best(r: np.ndarray, i: np.ndarray, v: np.ndarray, m: int, largest: bool = True):
    """The best ``m`` candidates of each row among (row ``r``, index ``i``, value ``v``), sorted
    by row, then best first: value descending (``largest``, else ascending), NaN after every
    number, ties by the smaller index; -0.0 and 0.0 tie. Only the kept candidates are gathered
    (a candidate's place in its row is its place in the sorted order less its row's first)."""
    nan = np.isnan(v) if v.dtype.kind == "f" else None
    if nan is not None and nan.any():
        key = np.where(nan, 0, v)
        order = np.lexsort((i, -key if largest else key, nan, r))
        del key
    elif nan is not None:  # (no NaN: one sort pass fewer)
        order = np.lexsort((i, -v if largest else v, r))
    else:
        order = np.lexsort((i, reversed_order(v) if largest else v, r))
    del nan
    if not r.size:
        return r, i, v
    counts = np.bincount(r)
    pos_type = _index_type(r.size)
    firsts = (np.cumsum(counts) - counts).astype(pos_type, copy=False)
    place = np.arange(r.size, dtype=pos_type)
    place -= firsts[r[order]]
    keep = order[place < m]
    del order, place
    return r[keep], i[keep], v[keep]


def placed(r: np.ndarray, i: np.ndarray, v: np.ndarray, rows: int, m: int):
    """``best``'s candidates of rows ``0 .. rows`` (``m`` each: every tile gives ``min(k, its
    width)`` of each of its rows, so every row has at least ``m``) as two ``(rows, m)`` arrays."""
    if r.size != rows * m or (r.size and (r[0] != 0 or r[-1] != rows - 1)):  # a kernel's fault, not the user's
        raise EinsumError(f"topk(): internal error: {r.size} candidates kept for {rows} rows of {m}")
    return v.reshape(rows, m), i.reshape(rows, m)
