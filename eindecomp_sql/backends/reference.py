"""The reference backend: runs every plan step by step in plain numpy, tensors in memory.

A check on the DuckDB engine and its tile kernels (``udfs/kernels.py``), written apart from
them: clear rather than fast. It really runs the plan's tiling. Every value is a dict of tiles
(key tuple -> ndarray, edge tiles smaller, never padded) cut the way the plan says:

- a ``RetileStep`` builds each target tile from the pieces of the source tiles it overlaps;
- an ``EinsumStep`` computes each output tile from the operand tiles its keys select: for each
  combination of pieces of the reduced labels, the tiles are joined element-wise (the node's
  join), aggregated over the reduced labels, and the partial results of the pieces are
  combined with the node's aggregation;
- a ``FillStep`` fills its tiles with its value;
- a ``ProgramStep`` runs its einsum steps one after the other, each as above;
- a fused ``EinsumStep`` runs the graph nodes it fuses one after the other, each as above, over
  the step's tiling (``EinsumStep.unfused``): the DuckDB kernels run them in one call per tile.

What a join or an aggregation means comes from ``notation/numpy_impl.py``, as for the kernels.
Nothing is written until every step has run: a failed or interrupted ``execute`` leaves the
catalog as it was. Names compare case-insensitively, as DuckDB's do.

>>> import eindecomp_sql as eds
>>> with eds.connect(backend="reference", tile_bytes=32) as db:
...     A = db.store("A", np.arange(12.0).reshape(3, 4))
...     db.einsum("ij,kj->ik", A, A).to_numpy()
array([[ 14.,  38.,  62.],
       [ 38., 126., 214.],
       [ 62., 214., 366.]])
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace as _replace

import numpy as np
import pyarrow as pa

from ..errors import EinsumError
from ..notation.numpy_impl import AGG_UFUNC, join_callable, product_dtype, widened
from ..plan import EinsumStep, FillStep, Plan, ProgramStep, RetileStep, TiledValue
from ..plan import cost as _cost
from ..plan.steps import step_target
from .base import Target, array_as_wanted, stored_as_wanted

Tiles = dict  # key tuple -> ndarray


# -- tile arithmetic ----------------------------------------------------------------------------
def _keys(shape: tuple[int, ...], tile: tuple[int, ...]):
    """Every tile key of a value, in C order (none when a dimension has size 0; ``()`` for a
    scalar)."""
    return itertools.product(*(range(-(-n // t)) for n, t in zip(shape, tile)))


def _box(shape, tile, key) -> tuple[slice, ...]:
    """The elements tile ``key`` covers: [q*t, min((q+1)*t, n)) along each dimension."""
    return tuple(slice(q * t, min((q + 1) * t, n)) for q, t, n in zip(key, tile, shape))


def _extent(box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def _native(a: np.ndarray) -> np.ndarray:
    return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))


def _frozen(a: np.ndarray) -> np.ndarray:
    """A tile as the catalog keeps it: C order (its bytes are the tile's), read-only."""
    if not a.flags.c_contiguous:
        a = a.copy(order="C")
    a.flags.writeable = False
    return a


def cut(array: np.ndarray, tile: tuple[int, ...]) -> Tiles:
    """``array`` cut into tiles of ``tile`` (copies: the tiles never alias the caller's array)."""
    array = _native(np.asarray(array))
    return {key: _frozen(np.array(array[_box(array.shape, tile, key)], copy=True))
            for key in _keys(array.shape, tile)}


def assemble(value: TiledValue, tiles: Tiles) -> np.ndarray:
    """The dense array of a tiled value."""
    out = np.empty(value.shape, dtype=np.dtype(value.dtype))
    for key in _keys(value.shape, value.tile):
        out[_box(value.shape, value.tile, key)] = tiles[key]
    return out


def _check_tiles(value: TiledValue, tiles: Tiles, what: str) -> None:
    """Every tile of ``value`` present, of its shape and dtype, and no other."""
    want = set(_keys(value.shape, value.tile))
    if set(tiles) != want:
        raise EinsumError(f"{what}: tiles {sorted(set(tiles) ^ want)[:5]} are missing or extra for shape "
                          f"{value.shape} in tiles {value.tile}")
    for key, t in tiles.items():
        ext = _extent(_box(value.shape, value.tile, key))
        if t.shape != ext or t.dtype != np.dtype(value.dtype):
            raise EinsumError(f"{what}: tile {key} is {t.shape} {t.dtype}, where {ext} {value.dtype} belongs")


# -- steps --------------------------------------------------------------------------------------
def run_retile(step: RetileStep, source: Tiles) -> Tiles:
    """Each target tile assembled from the pieces of the source tiles that overlap it."""
    s, t = step.source, step.target
    if s.shape != t.shape or s.dtype != t.dtype:
        raise EinsumError(f"retile {s.name} -> {t.name}: {s.shape} {s.dtype} cannot become {t.shape} {t.dtype}")
    return {key: _frozen(retiled_tile(s, t, key, source)) for key in _keys(t.shape, t.tile)}


def overlapping(source: TiledValue, target: TiledValue, key) -> list[tuple[int, ...]]:
    """The keys of the source tiles that overlap target tile ``key``."""
    box = _box(target.shape, target.tile, key)
    return list(itertools.product(*(range(b.start // a, (b.stop - 1) // a + 1) for b, a in zip(box, source.tile))))


def retiled_tile(source: TiledValue, target: TiledValue, key, tiles: Mapping) -> np.ndarray:
    """Target tile ``key`` assembled from the pieces of the source tiles (``tiles``: source key
    -> tile, at least those ``overlapping`` names) that fall in it."""
    box = _box(target.shape, target.tile, key)
    tile = np.empty(_extent(box), dtype=np.dtype(target.dtype))
    for src in overlapping(source, target, key):
        sbox = _box(source.shape, source.tile, src)
        lo = [max(b.start, c.start) for b, c in zip(box, sbox)]
        hi = [min(b.stop, c.stop) for b, c in zip(box, sbox)]
        piece = tiles[src][tuple(slice(a - c.start, z - c.start) for a, z, c in zip(lo, hi, sbox))]
        tile[tuple(slice(a - b.start, z - b.start) for a, z, b in zip(lo, hi, box))] = piece
    return tile


def run_fill(step: FillStep) -> Tiles:
    r = step.result
    dtype = np.dtype(r.dtype)
    return {key: _frozen(np.full(_extent(_box(r.shape, r.tile, key)), step.value, dtype=dtype))
            for key in _keys(r.shape, r.tile)}


def _diagonals(x: np.ndarray, labels: tuple[str, ...]) -> tuple[np.ndarray, list[str]]:
    """``x`` with the diagonal taken for every label that names several axes ("ii" -> "i")."""
    labels = list(labels)
    while True:
        dup = next((lab for lab in labels if labels.count(lab) > 1), None)
        if dup is None:
            return x, labels
        a = labels.index(dup)
        b = labels.index(dup, a + 1)
        x = np.diagonal(x, axis1=a, axis2=b)  # the diagonal becomes the last axis
        labels = [lab for k, lab in enumerate(labels) if k not in (a, b)] + [dup]


class _Einsum:
    """One EinsumStep over tiles."""

    def __init__(self, step: EinsumStep):
        node = step.node
        self.step = step
        self.node = node
        self.tile = step.tile_of
        self.pieces = step.pieces
        self.out_dtype = np.dtype(step.result.dtype)
        # numpy's einsum (join mul, agg sum) computes in the result dtype: every operand is
        # cast to it first (a bool next to a float counts; int8 products wrap in int8)
        self.einsum = node.join.name == "mul" and node.agg.name == "sum"
        # float16 and bfloat16 are summed in float32, as the kernels do; a bfloat16 result of
        # another join is computed in float32 too; a float16 one is reduced in float32 (numpy's
        # half loops keep a float accumulator); the reduced labels' pieces meet in it
        self.work_dtype = product_dtype(self.out_dtype)
        self.acc_dtype = self.work_dtype
        self.join = join_callable(node.join)
        self.agg = AGG_UFUNC[node.agg.name]
        self.order = tuple(node.output) + tuple(node.reduced)  # axes of the joined values
        result = step.result
        # a partial result (kept labels) has one more axis per kept label: its pieces, each a key
        want = tuple(node.size[lab] for lab in node.output) + tuple(self.pieces[lab] for lab in node.kept)
        if result.shape != want:
            raise EinsumError(f"{step.describe()}: result shape {result.shape} is not that of labels {node.keys}")

    def extents(self, keys: dict[str, int]) -> dict[str, int]:
        return {lab: min(self.tile[lab], self.node.size[lab] - q * self.tile[lab]) for lab, q in keys.items()}

    def operand_tile(self, k: int, value: TiledValue, tiles: Tiles, keys: dict[str, int], ext: dict[str, int]):
        """Operand ``k``'s tile at the labels' keys, its dropped axes squeezed away."""
        op = self.node.operands[k]
        labels = iter(op.labels)
        key = tuple(0 if ax in op.dropped else keys[next(labels)] for ax in range(len(value.shape)))
        try:
            t = tiles[key]
        except KeyError:
            raise EinsumError(f"{self.step.describe()}: operand {k} ({value.name}) has no tile {key}") from None
        if op.dropped:
            if any(t.shape[ax] != 1 for ax in op.dropped):
                raise EinsumError(f"{self.step.describe()}: operand {k} drops axes {op.dropped} of a {t.shape} tile")
            t = t.reshape([n for ax, n in enumerate(t.shape) if ax not in op.dropped])
        want = tuple(ext[lab] for lab in op.labels)
        if t.shape != want:
            raise EinsumError(f"{self.step.describe()}: operand {k} ({value.name}) tile {key} is {t.shape}, but the "
                              f"step's tiling {self.tile} wants {want}: the operand is cut differently")
        return t

    def partial(self, tiles: list[np.ndarray], ext: dict[str, int]) -> np.ndarray:
        """join over one tile tuple, aggregated over its reduced labels, in the result dtype."""
        xs = []
        for op, t in zip(self.node.operands, tiles):
            if self.einsum:  # (a complex tile into a real dtype keeps its real part: udfs/kernels.py)
                t = (t.real if t.dtype.kind == "c" and self.work_dtype.kind != "c" else t).astype(self.work_dtype,
                                                                                               copy=False)
            else:
                t = widened(t)
            t, labels = _diagonals(t, op.labels)
            present = [lab for lab in self.order if lab in labels]
            t = t.transpose([labels.index(lab) for lab in present])
            xs.append(t.reshape([ext[lab] if lab in labels else 1 for lab in self.order]))
        vals = np.broadcast_to(np.asarray(self.join(*xs)), [ext[lab] for lab in self.order])
        axes = tuple(range(len(self.node.output), len(self.order)))
        if axes:
            wide = self.einsum or vals.dtype == np.float16
            vals = self.agg.reduce(vals, axis=axes, dtype=self.work_dtype if wide else None)
        return np.asarray(vals).astype(self.acc_dtype, casting="unsafe")

    def run(self, inputs: list[tuple[TiledValue, Tiles]]) -> Tiles:
        node, result = self.node, self.step.result
        out = {}
        for okey in itertools.product(*(range(self.pieces[lab]) for lab in node.keys)):
            acc = None
            for rkey in itertools.product(*(range(self.pieces[lab]) for lab in node.summed)):
                keys = dict(zip(node.keys, okey)) | dict(zip(node.summed, rkey))
                ext = self.extents(keys)
                tiles = [self.operand_tile(k, v, t, keys, ext) for k, (v, t) in enumerate(inputs)]
                part = self.partial(tiles, ext)
                # the pieces of the reduced labels meet in the aggregation, in ``acc_dtype``
                acc = part if acc is None else np.asarray(self.agg(acc, part)).astype(self.acc_dtype, casting="unsafe")
            if acc is None:  # a reduced label in no piece: fill_empty plans those as fills
                raise EinsumError(f"{self.step.describe()}: a reduced label has no pieces")
            acc = acc.astype(self.out_dtype, casting="unsafe", copy=False)
            want = _extent(_box(result.shape, result.tile, okey))
            if node.kept:  # a partial tile: extent 1 along each kept label's axis
                acc = acc.reshape(acc.shape + (1,) * len(node.kept))
            if acc.shape != want:
                raise EinsumError(f"{self.step.describe()}: output tile {okey} is {acc.shape}, but the result's "
                                  f"tiling {result.tile} wants {want}")
            out[okey] = _frozen(acc)
        return out


def run_einsum(step: EinsumStep, inputs: list[tuple[TiledValue, Tiles]]) -> Tiles:
    return _Einsum(step).run(inputs)


def run_in_turn(parts, values: dict[str, tuple[TiledValue, Tiles]]) -> Tiles:
    """Steps one after the other, each reading ``values`` and the results before it; the last
    one's tiles. What a fused step (``EinsumStep.unfused``: its nodes over the step's tiles) and
    a program (its einsum steps) stand for: the values they keep to themselves live here for the
    step only."""
    local = dict(values)
    tiles: Tiles = {}
    for part in parts:
        tiles = run_step(part, local)
        local[part.result.name] = (part.result, tiles)
    return tiles


def run_step(step, values: dict[str, tuple[TiledValue, Tiles]]) -> Tiles:
    """The tiles ``step`` computes from ``values`` (value name -> value, tiles)."""
    if isinstance(step, ProgramStep):
        return run_in_turn(step.steps, values)
    if isinstance(step, RetileStep):
        return run_retile(step, values[step.source.name][1])
    if isinstance(step, FillStep):
        return run_fill(step)
    if isinstance(step, EinsumStep):
        if step.fused is not None:
            return run_in_turn(step.unfused(), values)
        return run_einsum(step, [values[v.name] for v in step.inputs])
    raise EinsumError(f"the reference backend cannot run a {type(step).__name__}")


# -- the backend --------------------------------------------------------------------------------
class ReferenceBackend:
    """Tensors in a dict, plans run in numpy (see the module docstring)."""

    name = "reference"
    con = None  # no SQL: no connection, no SQL interface
    compiler = None  # ... and no compiler
    # plans are made under DuckDB's cost model (the default): the reference runs the very
    # plans the DuckDB engine runs, which is what it checks
    cost_model = _cost.DEFAULT_COSTS
    streams_in = False  # store_tiles takes whole tables

    def __init__(self, database=None, read_only: bool = False):
        if database is not None and not (isinstance(database, str) and database == ":memory:"):
            raise EinsumError(f"the reference backend keeps tensors in memory only: database must be None or "
                              f"':memory:', got {database!r}")
        self.read_only = read_only
        self.lock = threading.RLock()
        self._closed = False
        # lower-cased name -> (value named as stored, tiles): the catalog, and temporary results
        self._tensors: dict[str, tuple[TiledValue, Tiles]] = {}
        self._temporary: dict[str, tuple[TiledValue, Tiles]] = {}

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EinsumError("this session is closed")

    def _find(self, name: str) -> tuple[TiledValue, Tiles] | None:
        key = name.lower()
        return self._tensors.get(key) or self._temporary.get(key)

    def _check_target(self, name: str, replace: bool) -> None:
        if self._find(name) is not None and not replace:
            raise EinsumError(f"table {name!r} already exists; pass replace=True to overwrite it")

    def _check_writable(self, name: str) -> None:
        if self.read_only:
            raise EinsumError(f"cannot write table {name!r}: this session is read-only")

    def _put(self, name: str, value: TiledValue, tiles: Tiles, temporary: bool) -> None:
        key = name.lower()
        self._tensors.pop(key, None)
        self._temporary.pop(key, None)
        (self._temporary if temporary else self._tensors)[key] = (_replace(value, name=name), tiles)

    # -- SQL interface ------------------------------------------------------------------------
    def register_sql_interface(self, einsum_sql: Callable[..., str]) -> None:
        """No SQL here: nothing to register."""

    # -- catalog ------------------------------------------------------------------------------
    def lookup(self, name: str) -> TiledValue | None:
        with self.lock:
            self._check_open()
            found = self._tensors.get(name.lower())
            return found[0] if found is not None else None

    def names(self) -> list[str]:
        with self.lock:
            self._check_open()
            return sorted(v.name for v, _ in self._tensors.values())

    def table_exists(self, name: str) -> bool:
        """Whether a table of this name (any case), kept or temporary, exists."""
        with self.lock:
            self._check_open()
            return self._find(name) is not None

    def tables(self, temporary: bool | None = None) -> list[str]:
        """Every table's name, sorted: kept tensors and temporary results (``temporary``:
        only those, or only the kept ones)."""
        with self.lock:
            self._check_open()
            pools = {None: (self._tensors, self._temporary), True: (self._temporary,), False: (self._tensors,)}
            return sorted(v.name for pool in pools[temporary] for v, _ in pool.values())

    def drop(self, name: str) -> None:
        with self.lock:
            self._check_open()
            self._check_writable(name)
            self._tensors.pop(name.lower(), None)

    def set_memory(self, budget: int | None) -> None:
        """Nothing: tensors live in numpy arrays here: the plans' budget is the only bound."""

    def recover(self) -> None:  # nothing a call leaves open between its statements
        pass

    def drop_table(self, name: str) -> None:
        with self.lock:
            self._check_open()
            self._temporary.pop(name.lower(), None)

    # -- data in and out ----------------------------------------------------------------------
    def store_tiles(self, value: TiledValue, tiles: pa.Table, replace: bool = False) -> None:
        from ..udfs.tiles import blob_views

        dtype = np.dtype(value.dtype)
        keys = [tiles.column(k).to_numpy() for k in value.keys]
        got = {}
        for r, raw in enumerate(blob_views(tiles.column("tile"))):
            key = tuple(int(k[r]) for k in keys)
            ext = _extent(_box(value.shape, value.tile, key))
            if raw.nbytes != int(np.prod(ext, dtype=np.int64)) * dtype.itemsize:
                raise EinsumError(f"store {value.name!r}: tile {key} holds {raw.nbytes} bytes, not a {ext} {dtype} tile")
            # copied: the Arrow buffers may be a view of the caller's array
            got[key] = _frozen(np.array(np.asarray(raw).view(dtype).reshape(ext), copy=True))
        _check_tiles(value, got, f"store {value.name!r}")
        with self.lock:
            self._check_open()
            self._check_writable(value.name)
            self._check_target(value.name, replace)
            self._put(value.name, value, got, temporary=False)

    def tile_batches(self, value: TiledValue, batch_bytes: int):
        """The tiles as batches of one whole table (the tensors are in memory already)."""
        return contextlib.nullcontext(iter(self.read_tiles(value).to_batches()))

    def read_tiles(self, value: TiledValue) -> pa.Table:
        from ..udfs.tiles import tiles_to_arrow

        with self.lock:
            self._check_open()
            tiles = self._stored(value.name, value, f"tensor {value.name!r} was replaced: it is now")
        keys = sorted(tiles)
        cols = {k: pa.array(np.array([key[p] for key in keys], dtype=np.int64)) for p, k in enumerate(value.keys)}
        cols["tile"] = tiles_to_arrow([tiles[key] for key in keys])
        return pa.table(cols)

    # -- execution ----------------------------------------------------------------------------
    def execute(self, plan: Plan, inputs: Mapping[str, str | np.ndarray], outputs: Mapping[str, Target],
                replace: bool = False, progress: Callable | None = None) -> dict[str, np.ndarray]:
        """Run every step in numpy; see ``base.Backend.execute`` for the binding. Every value
        is computed before anything is written, so a failure (or Ctrl-C) leaves nothing."""
        with self.lock:
            self._check_outputs(outputs, replace)
            values: dict[str, tuple[TiledValue, Tiles]] = {}
            for v in plan.inputs:
                values[v.name] = (v, self._bind_input(v, inputs[v.name]))
            start = time.perf_counter()
            for k, step in enumerate(plan.steps):
                target = step_target(step)
                try:
                    with np.errstate(all="ignore"):  # as in SQL: inf and nan are values, not warnings
                        tiles = run_step(step, values)
                    _check_tiles(target, tiles, f"step {k} ({step.describe()})")
                except EinsumError as e:
                    raise EinsumError(f"step {k} ({step.describe()}) failed: {e}") from e
                except Exception as e:
                    raise EinsumError(f"step {k} ({step.describe()}) failed: {type(e).__name__}: {e}") from e
                values[target.name] = (target, tiles)
                if progress is not None:
                    from .running import StepProgress

                    n = len(tiles)
                    progress(StepProgress(k + 1, len(plan.steps), step.describe(), n, n,
                                          sum(t.nbytes for t in tiles.values()), time.perf_counter() - start))
            return self._finish(outputs, values)

    def _check_outputs(self, outputs: Mapping[str, Target], replace: bool) -> None:
        """Before anything runs: open, and every kept output writable and free (or replaced)."""
        self._check_open()
        for t in outputs.values():
            if t.table is not None and not t.temporary:
                self._check_writable(t.table)
                self._check_target(t.table, replace)

    def _finish(self, outputs: Mapping[str, Target], values: dict) -> dict[str, np.ndarray]:
        """Everything computed: the outputs asked for as arrays, and the tables written."""
        arrays = {name: assemble(*values[name]) for name, t in outputs.items() if t.table is None}
        for name, t in outputs.items():
            if t.table is not None:
                self._put(t.table, values[name][0], values[name][1], temporary=t.temporary)
        return arrays

    def _stored(self, name: str, want: TiledValue, what: str) -> Tiles:
        """The tiles of stored tensor ``name``, which must be cut as ``want`` says."""
        return stored_as_wanted(self._find(name), name, want, what)

    def _bind_input(self, v: TiledValue, x) -> Tiles:
        if isinstance(x, str):
            return self._stored(x, v, f"input {v.name!r}: tensor {x!r} is")
        a = array_as_wanted(v, x)
        return cut(a, v.tile)

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._tensors.clear()
            self._temporary.clear()


__all__ = ["ReferenceBackend", "assemble", "cut", "run_step"]
