"""The Arrow UDFs, and their registration on a DuckDB connection.

All are generic: the first argument is the step's JSON description (a constant in the SQL), so
one registration per connection serves every plan, including plans built inside a query by
``SELECT * FROM einsum(...)``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Callable

import numpy as np
import pyarrow as pa

from eindecomp_sql.errors import EinsumError
from eindecomp_sql.plan.kernel_spec import MAX_OPERANDS, FillKernelSpec, from_json

from . import devices
from .devices import DEVICE_LOCK, float32_products, to_device, to_host
from .kernels import einsum_kernel, program_kernel, read_spec, retile_kernel
from .pool import THREADS, KernelState, check_cancelled, current, note_tiles, run_tasks, run_wide, serving
from .tiles import TileWriter, _as_array, blob_views, tile_view
from eindecomp_sql.notation.checks import SQL_TYPES, sql_value_dtype
from eindecomp_sql.plan.tiling import ceil_div, extent

MAX_ARITY = MAX_OPERANDS
MAX_PROGRAM_ARITY = 16  # programs with more inputs pass them as a list (``program_rows``)
# the DuckDB type of each dtype's elements (einsum_elements); DuckDB has no complex type, so
# complex tensors have no element rows (compile/sql.py refuses them)


def _spec(arr) -> str:
    arr = _as_array(arr)
    first = arr[0].as_py()
    if len(arr) > 1 and arr[len(arr) - 1].as_py() != first:
        raise ValueError("eindecomp_sql kernel: one call got rows of different steps")
    return first


def _a_run_s(args) -> bool:
    """Whether a UDF call whose first argument is its spec is part of a plan run of the backend's,
    not a query the user runs (``KernelSpec.user_query``): the backend's kernel state (its cancel
    flag, its tile count) is for the first only."""
    arr = _as_array(args[0])
    return len(arr) == 0 or not _users(arr[0].as_py())


@functools.lru_cache(maxsize=1024)
def _users(text) -> bool:
    try:
        return from_json(text).user_query
    except (EinsumError, TypeError):  # the kernel reads it again, and says what is wrong with it
        return False


def _key_rows(arr) -> list[np.ndarray]:
    arr = _as_array(arr)
    values = arr.values.to_numpy(zero_copy_only=False)
    offsets = arr.offsets.to_numpy()
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(arr))]


def _tasks_for(kernel, items: list[tuple[dict, Callable, int]]) -> list:
    """Split work items (extents, fn(cut), tile tuples it contracts) into tasks: one per item
    when there are enough items, else each item cut along an output label."""
    # two tasks per thread: a core shared with DuckDB's own threads (or anything else on the
    # machine) then costs half a task at the end, not half the whole tile
    want = 2 * THREADS
    parts = 1 if len(items) >= want else ceil_div(want, max(len(items), 1))
    tasks = []
    for ext, fn, members in items:
        for cut in kernel.split(ext, parts, members):
            tasks.append((lambda f, c: (lambda: f(c)))(fn, cut))
    return tasks


def _quiet(task: Callable[[], None]) -> Callable[[], None]:
    """``task`` under ``np.errstate(all="ignore")``, on whichever thread runs it (numpy's error
    state is per thread and context): np.einsum raises no floating-point warning for an overflow
    to inf or an invalid 0 * inf, while the kernels' BLAS products and ufuncs do, and under
    ``warnings.simplefilter("error")`` (pytest -W error) ``1e300 @ 1e300`` failed the step where
    numpy returns inf (a trial)."""
    def run():
        with np.errstate(all="ignore"):
            task()

    return run


def _run(kernel, items: list) -> None:
    """Too few tiles to give every kernel thread its own: a float product runs whole, one tile after
    the other, with BLAS threading each (see ``run_wide``); anything else is cut into tasks.
    On a device the items run whole, one after the other: the device parallelises each."""
    if kernel.xp is not np:
        with DEVICE_LOCK, float32_products(kernel.xp, kernel.tf32), np.errstate(all="ignore"):
            for _, fn, _ in items:
                check_cancelled()
                fn(None)
        return
    if kernel.blas and len(items) < 2 * THREADS and THREADS > 1:
        run_wide(_quiet(lambda: [(check_cancelled(), fn(None)) for _, fn, _ in items]))
        return
    run_tasks([_quiet(t) for t in _tasks_for(kernel, items)])


def _null_mask(arr) -> np.ndarray | None:
    """Which rows of a tile column are NULL (tiles the device holds: ``eds_resident``), or None."""
    arr = _as_array(arr)
    return None if arr.null_count == 0 else arr.is_null().to_numpy(zero_copy_only=False)


def _tile_key(keys) -> tuple:
    """A tile's keys as its cache id holds them: a value's first tile (every key 0) is ``()``,
    which is how a program, whose inputs and result are one tile each, names it too."""
    keys = tuple(keys)
    return keys if any(keys) else ()


def _host_tile(state, value: str | None, keys: tuple, shape=None) -> np.ndarray:
    """An array operand's tile, which the SQL handed as NULL (backends/duckdb.py registers such
    operands without their bytes): a read-only view of the caller's array, cut by the value's
    tile and the tile's ``keys`` (one per axis, as its reader names them; a program's input is
    the whole array, ``()``), so neither DuckDB nor the kernel copies it."""
    held = state.host_arrays.get(value) if state is not None and value is not None else None
    if held is None:  # (a tiled table whose tile column holds NULL, read through SQL)
        raise RuntimeError(f"eindecomp_sql kernel: a NULL tile{f' of {value!r}' if value else ''}, which is no "
                           f"array operand of a running plan: a tile column must hold every tile's bytes")
    view = _tile_of(*held, keys)
    view.flags.writeable = False
    if shape is not None and view.shape != tuple(shape):  # a tile cut wrong: never reinterpreted
        raise RuntimeError(f"eindecomp_sql kernel: tile {keys} of {value!r} is {view.shape}, the kernel reads "
                           f"{tuple(shape)}")
    return view


def _host_out(state, value: str | None, keys: tuple, shape) -> np.ndarray | None:
    """Where a kernel writes an output tile of a result returned as an array (the backend made
    the array, ``KernelState.host_results``): a view of it, the tile's bytes then never entering
    DuckDB (the UDF returns NULL for it); None where the result is not such a one, or the view
    is not one C-ordered block (a column tile of a result cut in several: it goes as bytes)."""
    held = state.host_results.get(value) if state is not None and value is not None else None
    if held is None:
        return None
    view = _tile_of(*held, keys)
    return view if view.shape == tuple(shape) and view.flags.c_contiguous else None


def _tile_of(array: np.ndarray, tile: tuple, keys: tuple) -> np.ndarray:
    """The tile at ``keys`` of ``array`` cut into ``tile``, as a plain ndarray view (a 0-d array
    indexed by ``()`` would be a scalar, an ``np.matrix`` would stay one)."""
    index = tuple(slice(k * t, (k + 1) * t) for k, t in zip(keys, tile))
    return (array[index] if index else array).view(np.ndarray)


def _operand_tiles(kernel, views, nulls, i, labkeys: dict, device: bool, state, values) -> list:
    """The operand tiles of joined row ``i`` (``labkeys``: every label's key; ``i`` a list: each
    operand's own row): views of the bytes DuckDB handed, or for a NULL tile, None on a device
    (``_device_tile`` finds it) and the array operand's own tile on the host (``_host_tile``)."""
    at = i if isinstance(i, list) else [i] * len(views)
    try:
        return _operand_views(kernel, views, nulls, at, labkeys, device, state, values)
    except ValueError as e:  # a tile of the wrong length: which operand, at which keys
        k = next((k for k in range(len(views)) if _wrong_length(views[k], nulls[k], kernel, k, labkeys, at[k]))
                 if str(e).startswith("tile holds") else None, None)
        if k is None:
            raise
        name = f" ({values[k]!r})" if values[k] else ""
        keys = tuple(labkeys[lab] for lab in kernel.inputs[k])
        raise ValueError(f"operand {k}{name} of the step, its tile at keys {keys}: {e}; was the table edited "
                         "by hand?") from None


def _wrong_length(view, null, kernel, k, labkeys, r) -> bool:
    if null is not None and null[r]:
        return False
    shape = kernel.in_shapes(kernel.extents(labkeys))[k]
    return view[r].nbytes != int(np.prod(shape, dtype=np.int64)) * kernel.dtypes[k].itemsize


def _operand_views(kernel, views, nulls, at, labkeys, device, state, values) -> list:
    return [tile_view(v[r], dt, s) if n is None or not n[r]
            else None if device else _host_tile(state, values[k], tuple(labkeys[lab] for lab in kernel.inputs[k]), s)
            for k, (v, n, dt, s, r) in enumerate(zip(views, nulls, kernel.dtypes,
                                                     kernel.in_shapes(kernel.extents(labkeys)), at))]


def _output_tile(writer: TileWriter, r: int, state, value: str | None, keys: tuple) -> np.ndarray:
    """Where output tile ``r`` (at ``keys``) of a kernel call is written: into the array returned
    to the caller where there is one (``_host_out``; the tile is then NULL in the call's
    result), else into the call's own buffer."""
    out = _host_out(state, value, keys, writer.shapes[r])
    if out is None:
        return writer.out(r)
    writer.nulls.add(r)
    return out


def _shaped(arr, shape):
    """``arr`` read as ``shape`` (None: as it is); a label of size 1 may be dropped by one
    reader of a tile and not by another."""
    return arr if shape is None or arr.shape == tuple(shape) else arr.reshape(shape)


def _device_tile(xp, state, value: str | None, keys: tuple, host: np.ndarray | None, shape=None):
    """One operand tile on the device: the cached copy where the SQL handed NULL (the tile was
    pinned as resident), shaped as this operand reads it (``shape``: a label of size 1 may be
    dropped here and not where the tile was made), else ``host`` (or, for an array operand read
    in place, its view) sent, and kept when its value has a token (a stored tensor's, or one
    named for the run: a result, an array operand; udfs/device_cache.py)."""
    cache = state.device_cache if state is not None else None
    tid = _tid(state, value, keys)
    if host is None and state is not None and value in state.host_arrays:  # an array operand
        held = cache.get(tid) if cache is not None and tid is not None else None
        if held is not None:  # sent by an earlier call of this run: no host copy to make
            return _shaped(held, shape)
        host = _host_tile(state, value, keys, shape)
        host = host if host.flags.c_contiguous else host.copy()  # (ascontiguousarray makes 0-d 1-d)
    if host is None:
        if cache is None or tid is None:
            raise RuntimeError("eindecomp_sql device kernel: a NULL tile that no device cache holds")
        held = cache.take(tid)
        return _shaped(held, shape)
    held = cache.get(tid) if cache is not None and tid is not None else None
    if held is not None:  # sent by an earlier call since the statement read it
        state.device_handed_again += host.nbytes  # bytes DuckDB copied for nothing
        return _shaped(held, host.shape)
    dev = to_device(xp, host)
    if state is not None:
        state.device_sent += host.nbytes
    if tid is not None and cache is not None and host.nbytes:
        cache.put(tid, dev, host.nbytes, state.next_use if state.device_reads else None)
    return dev


def _trace(state, reads: list, write, nbytes: dict) -> None:
    """Record one kernel call's tiles (ids, or None for an untracked one, which gets an id of
    its own) when the session traces them (``KernelState.device_trace``)."""
    if state is None or state.device_trace is None:
        return
    n = len(state.device_trace)
    named = [tid if tid is not None else ("untracked", n, k) for k, tid in enumerate(reads)]
    out = write if write is not None else ("untracked", n, "out")
    state.device_trace.append((named, out, {**dict(zip(named, nbytes["in"])), out: nbytes["out"]}))


def _tid(state, value: str | None, keys) -> tuple | None:
    """A tile's name in the device cache: its value's token for the running plan, and its
    keys; None for a value with no token (a tensor stored as parts, or no plan running)."""
    token = state.device_tokens.get(value) if state is not None and value is not None else None
    return (token, _tile_key(keys)) if token is not None else None


def _keep_result(state, value: str | None, keys: tuple, result, out: np.ndarray) -> bool:
    """A result tile computed on the device, kept there for the later steps that read it
    (named like a stored tile: its value's token for the run, and its keys). Its bytes go back
    into ``out`` for DuckDB's table, unless every reader of its value runs on the device
    (``KernelState.device_keep``) and the cache holds it: then nothing is copied and the tile
    is NULL in the table (True)."""
    cache = state.device_cache if state is not None else None
    tid = _tid(state, value, keys) if cache is not None else None
    nbytes = out.nbytes
    if tid is not None and nbytes:
        future = state.next_use if state.device_reads else None
        if value in state.device_keep and cache.hold(tid, result, nbytes, future):
            return True
        cache.put(tid, result, nbytes, future)
    to_host(result, out)
    if state is not None:
        state.device_returned += nbytes
    return False


def _on_device(kernel, members: list[tuple[list, dict]], out: np.ndarray, out_keys: dict) -> bool:
    """``kernel.contract_group`` on a device: each member's tiles (host arrays, or None for a
    tile the device holds) with its label keys; the result computed there, kept there for a
    later step (``out_keys``: its keys) and copied back into ``out`` (host memory), unless only
    the device needs it (``_keep_result``: True, nothing copied)."""
    xp, state = kernel.xp, current()
    values = kernel.values or [None] * len(kernel.inputs)
    sent: dict = {}  # tile id -> its device array: a tile every member reads is sent once a call

    def tile(k, keys, t, shape):
        tkeys = tuple(keys[lab] for lab in kernel.inputs[k])
        tid = _tid(state, values[k], tkeys)
        if tid is not None and tid in sent:
            held = sent[tid]
            return _shaped(held, shape)
        dev = _device_tile(xp, state, values[k], tkeys, t, shape)
        if tid is not None:
            sent[tid] = dev
        return dev

    dev = [[tile(k, keys, t, shape) for k, (t, shape) in enumerate(zip(tiles, kernel.in_shapes(kernel.extents(keys))))]
           for tiles, keys in members]
    result = xp.empty(out.shape, out.dtype)
    kernel.contract_group(dev, result)
    okeys = tuple(out_keys[lab] for lab in kernel.output)
    kept = _keep_result(state, kernel.result, okeys, result, out)
    if state is not None and state.device_trace is not None:
        reads = [_tid(state, values[k], tuple(keys[lab] for lab in kernel.inputs[k]))
                 for tiles, keys in members for k in range(len(tiles))]
        sizes = [int(a.nbytes) for row in dev for a in row]
        _trace(state, reads, _tid(state, kernel.result, okeys), {"in": sizes, "out": out.nbytes})
    return kept


def _per_operand(kernel, handed: list | tuple) -> list:
    """The tiles of each operand, from those a call hands: one per operand the kernel reads,
    an operand repeating one of them (``kernel.args``) reading the same."""
    if len(handed) != len(kernel.read):
        raise EinsumError(f"kernel {kernel.np_spec}: a call handed {len(handed)} tile columns where its spec reads "
                          f"{len(kernel.read)}")
    return [handed[kernel.args[k]] for k in range(len(kernel.inputs))]


def _finished(writer: TileWriter) -> pa.Array:
    """The output tiles of one kernel call, counted for progress reports."""
    note_tiles(len(writer.shapes), int(writer.offsets[-1]))
    return writer.array()


def einsum_rows(spec_arr, keys_arr, *tile_arrs) -> pa.Array:
    """One output tile per row: keys give every label's key, tiles are the operands' tiles."""
    kernel = einsum_kernel(_spec(spec_arr))
    tile_arrs = _per_operand(kernel, tile_arrs)
    rows = [dict(zip(kernel.labels, k.tolist())) for k in _key_rows(keys_arr)]
    views = [blob_views(a) for a in tile_arrs]
    exts = [kernel.extents(labkeys) for labkeys in rows]
    writer = TileWriter(kernel.out_dtype, [kernel.out_shape(e) for e in exts])
    items = []
    device = kernel.xp is not np
    nulls = [_null_mask(a) for a in tile_arrs]
    state, values = current(), kernel.values or [None] * len(views)
    for r, (ext, labkeys) in enumerate(zip(exts, rows)):
        tiles = _operand_tiles(kernel, views, nulls, r, labkeys, device, state, values)
        out = _output_tile(writer, r, state, kernel.result, tuple(labkeys[lab] for lab in kernel.output))

        def fn(cut, tiles=tiles, r=r, labkeys=labkeys, out=out):
            if device:
                if _on_device(kernel, [(tiles, labkeys)], out, labkeys):
                    writer.nulls.add(r)
                return
            t, o = kernel.sliced(tiles, out, cut)
            kernel.contract_group([t], o)

        items.append((ext, fn, 1))
    _run(kernel, items)
    return _finished(writer)


def einsum_groups(spec_arr, group_keys_arr, members_arr, shared_arr=None) -> pa.Array:
    """One output tile per group: every member is one joined row (keys of the reduced labels
    and one tile per operand); the kernel contracts them all and aggregates in place. With
    ``shared_arr`` (``eds_einsum_group<m>s``), the operands the kernel's ``shared`` names (the
    same tile in every member of a group) come once per group in that list, in operand order,
    and a member's struct carries the other operands' tiles as ``t0``, ``t1``, ..."""
    kernel = einsum_kernel(_spec(spec_arr))
    shared = kernel.shared if shared_arr is not None else ()
    gkeys = _key_rows(group_keys_arr)
    members = _as_array(members_arr)
    offsets = members.offsets.to_numpy()
    structs = members.values
    mkeys = _key_rows(structs.field("k"))
    n = len(kernel.inputs)
    # the operands handed (a repeated one reads its first's: ``kernel.args``), varying ones in
    # each member's struct, shared ones once per group
    varying = [k for k in kernel.read if k not in shared]
    shared = [k for k in kernel.read if k in shared]
    first = {kernel.args[k]: k for k in reversed(range(n))}
    fields = {k: structs.field(f"t{j}") for j, k in enumerate(varying)}
    if shared:
        lists = _as_array(shared_arr)
        shared_offsets = lists.offsets.to_numpy()
        if structs.type.num_fields != len(varying) + 1 or (np.diff(shared_offsets) != len(shared)).any():
            raise EinsumError(f"kernel {kernel.np_spec}: a group call's shared tiles and members {structs.type} do "
                              f"not match the spec's shared operands {list(shared)}")
        fields.update({k: lists.values for k in shared})
    fields.update({k: fields[first[kernel.args[k]]] for k in range(n)})
    views = [blob_views(fields[k]) for k in range(n)]
    nulls = [_null_mask(fields[k]) for k in range(n)]
    device = kernel.xp is not np
    state, values = current(), kernel.values or [None] * n
    base = [dict(zip(kernel.output, g.tolist())) for g in gkeys]
    writer = TileWriter(kernel.out_dtype, [kernel.out_shape(kernel.extents(b)) for b in base])
    items = []
    for g, b in enumerate(base):
        rows = range(offsets[g], offsets[g + 1])
        member_tiles, member_keys = [], []
        for m in rows:
            labkeys = {**b, **dict(zip(kernel.reduced, mkeys[m].tolist()))}
            at = [m] * n
            for j, k in enumerate(shared):
                at[k] = shared_offsets[g] + j
            at = [at[first[kernel.args[k]]] for k in range(n)]
            member_tiles.append(_operand_tiles(kernel, views, nulls, at, labkeys, device, state, values))
            member_keys.append(labkeys)
        out = _output_tile(writer, g, state, kernel.result, tuple(b[lab] for lab in kernel.output))

        def fn(cut, member_tiles=member_tiles, member_keys=member_keys, g=g, b=b, out=out):
            if device:
                if _on_device(kernel, list(zip(member_tiles, member_keys)), out, b):
                    writer.nulls.add(g)
                return
            parts = [kernel.sliced(tiles, out, cut) for tiles in member_tiles]
            kernel.contract_group([t for t, _ in parts], parts[0][1])

        items.append((kernel.extents(b), fn, len(rows)))
    _run(kernel, items)
    return _finished(writer)


def program_rows(spec_arr, tiles_arr) -> pa.Array:
    """A program step: each row holds one tile per input (a list); its einsums run one after
    the other, each on the kernel threads, and the last one's result is the row's tile."""
    lists = _as_array(tiles_arr)
    offsets = lists.offsets.to_numpy()
    views = blob_views(lists.values)
    nulls = _null_mask(lists.values)
    if nulls is not None:  # tiles the device holds
        views = [None if n else v for v, n in zip(views, nulls)]
    return _programs(spec_arr, [views[offsets[r]:offsets[r + 1]] for r in range(len(lists))])


def program_args(spec_arr, *tile_arrs) -> pa.Array:
    """``program_rows`` with one BLOB argument per input instead of a list of them: DuckDB
    copies every tile into a list it builds (the LLaMA block's 13 MB of inputs, ~1 ms), so up to
    ``MAX_PROGRAM_ARITY`` inputs go as arguments."""
    views = [blob_views(a) for a in tile_arrs]
    nulls = [_null_mask(a) for a in tile_arrs]
    return _programs(spec_arr, [[None if n is not None and n[r] else v[r] for v, n in zip(views, nulls)]
                                for r in range(len(_as_array(spec_arr)))])


def _programs(spec_arr, rows: list[list]) -> pa.Array:
    """One program run per row (``rows``: each row's input tiles, uint8 views)."""
    program = program_kernel(_spec(spec_arr))
    writer = TileWriter(program.out_dtype, [program.out_shape] * len(rows))
    state = current()
    values = program.values or [None] * len(program.dtypes)
    for r, tiles in enumerate(rows):
        check_cancelled()
        if program.xp is not np:  # each input on the device first (a program's inputs are one tile each)
            tiles = [_device_tile(program.xp, state, values[k], (), None if t is None else t.view(dt))
                     for k, (t, dt) in enumerate(zip(tiles, program.dtypes))]
        else:  # an array operand's tile (NULL in the SQL) is the caller's whole array
            tiles = [_host_tile(state, values[k], ()) if t is None else t for k, t in enumerate(tiles)]
        out = _output_tile(writer, r, state, program.result, ())
        result = program.run(tiles, out, _run)
        if result is not None:  # on a device: the result is there, and back in out unless kept
            if _keep_result(state, program.result, (), result, out):
                writer.nulls.add(r)
            if state is not None and state.device_trace is not None:
                _trace(state, [_tid(state, v, ()) for v in values], _tid(state, program.result, ()),
                       {"in": [int(t.nbytes) for t in tiles], "out": writer.out(r).nbytes})
    return _finished(writer)


def retile_split(spec_arr, keys_arr, tile_arr) -> pa.Array:
    """Every piece of each source tile, one per target tile it overlaps, as a list of
    {n: target key, k: source key, t: piece bytes}."""
    kernel = retile_kernel(_spec(spec_arr))
    keys = [k.tolist() for k in _key_rows(keys_arr)]
    views = blob_views(tile_arr)
    pieces, new_keys, old_keys, counts = [], [], [], []
    for old, raw in zip(keys, views):
        try:
            src = tile_view(raw, kernel.dtype, kernel.src_shape(old))
        except ValueError as e:  # which tile: the retile's source at these keys
            # (or a store of another thread or connection replaced it since the plan: a trial)
            raise ValueError(f"the tile at keys {tuple(old)} being re-tiled: {e}; was the table edited by hand, or "
                             "the tensor replaced by another thread or connection while this ran?") from None
        targets = kernel.targets(old)
        counts.append(len(targets))
        for new in targets:
            pieces.append(src[kernel.piece_index(old, new, "src")])
            new_keys.append(new)
            old_keys.append(old)
    writer = TileWriter(kernel.dtype, [p.shape for p in pieces])
    for r, piece in enumerate(pieces):
        writer.out(r)[...] = piece
    nd = len(kernel.shape)
    key_type = pa.list_(pa.int64())

    def key_array(rows):
        flat = np.asarray(rows, dtype=np.int64).reshape(-1)
        return pa.ListArray.from_arrays(pa.array(np.arange(len(rows) + 1, dtype=np.int32) * nd), pa.array(flat),
                                        type=key_type)

    structs = pa.StructArray.from_arrays([key_array(new_keys), key_array(old_keys), writer.array()],
                                         names=["n", "k", "t"])
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), structs)


def retile_assemble(spec_arr, keys_arr, members_arr) -> pa.Array:
    """A target tile from its pieces (each with its source tile's key)."""
    kernel = retile_kernel(_spec(spec_arr))
    keys = [k.tolist() for k in _key_rows(keys_arr)]
    members = _as_array(members_arr)
    offsets = members.offsets.to_numpy()
    structs = members.values
    mkeys = [k.tolist() for k in _key_rows(structs.field("k"))]
    views = blob_views(structs.field("t"))
    writer = TileWriter(kernel.dtype, [kernel.dst_shape(k) for k in keys])
    for g, new in enumerate(keys):
        out = writer.out(g)
        covered = 0
        for m in range(offsets[g], offsets[g + 1]):
            old = mkeys[m]
            idx = kernel.piece_index(old, new, "dst")
            piece = tuple(s.stop - s.start for s in idx)
            out[idx] = tile_view(views[m], kernel.dtype, piece)
            covered += math.prod(piece)
        if covered != out.size:  # a source tile NULL (its split was NULL: no pieces), or missing
            raise RuntimeError(f"eindecomp_sql kernel: re-tiled tile {new} got {covered} of its {out.size} elements: "
                               "a source tile is NULL or missing (a tile column must hold every tile's bytes)")
    return _finished(writer)


def fill_tiles(spec_arr, keys_arr) -> pa.Array:
    """Tiles all of one value (the result of an einsum over a label of size 0)."""
    spec = read_spec(_spec(spec_arr), FillKernelSpec)
    shape, tile, dtype = spec.shape, spec.tile, np.dtype(spec.dtype)
    shapes = [tuple(extent(n, t, k) for k, t, n in zip(key.tolist(), tile, shape)) for key in _key_rows(keys_arr)]
    writer = TileWriter(dtype, shapes)
    writer.buffer.view(dtype).fill(spec.value)
    return _finished(writer)


def resident(values_arr, keys_arr) -> pa.Array:
    """``eds_resident(value, keys)``: whether this connection's device cache holds that tile of
    a stored input of the running plan (pinned if so, until the step's statement ends)."""
    n = len(_as_array(values_arr))
    state = current()
    if state is None or state.device_cache is None or not state.device_tokens:
        return pa.array(np.zeros(n, dtype=bool))
    names = _as_array(values_arr).to_pylist()
    keys = _key_rows(keys_arr)
    held = np.zeros(n, dtype=bool)
    for r, (v, k) in enumerate(zip(names, keys)):
        token = state.device_tokens.get(v)
        if token is not None:
            held[r] = state.device_cache.pin((token, _tile_key(k.tolist())))
    return pa.array(held)


@functools.lru_cache(maxsize=256)
def _send_spec(text: str) -> tuple:
    """An ``eds_send`` spec: (value, dtype, shape, tile, the axes its keys name in the cache)."""
    spec = json.loads(text)
    return spec["value"], np.dtype(spec["dtype"]), tuple(spec["shape"]), tuple(spec["tile"]), tuple(spec["named"])


def send(spec_arr, keys_arr, tiles_arr) -> pa.Array:
    """``eds_send(spec, keys, tile)``: send a stored input's tile to the device ahead of the step
    that reads it (udfs/device_cache.py), kept and pinned there if room can be made, else staged
    for the step; a NULL tile is one the device holds (``eds_resident`` pinned it). True where
    the step will find the tile on the device. The spec (JSON) names the value, its dtype, shape
    and tile, and which of its axes name the tile in the cache (a size-1 axis the step drops
    does not, as the step's own ``eds_resident`` names it)."""
    tiles = _as_array(tiles_arr)
    n = len(tiles)
    found = np.zeros(n, dtype=bool)
    state = current()
    cache = state.device_cache if state is not None else None
    if n == 0 or cache is None or state.device_xp is None:
        return pa.array(found)
    value, dt, shape, tile, named = _send_spec(_spec(spec_arr))
    token = state.device_tokens.get(value)
    if token is None:  # no name for its tiles: the step's own statement hands them
        return pa.array(found)
    xp = devices.namespace(state.device_xp)
    nulls, views, keys = _null_mask(tiles), blob_views(tiles), _key_rows(keys_arr)
    for r in range(n):
        check_cancelled()
        if nulls is not None and nulls[r]:
            found[r] = True
            continue
        k = keys[r].tolist()
        tid = (token, _tile_key(k[a] for a in named))
        if cache.pin(tid):  # sent by an earlier row, or resident since the statement began
            found[r] = True
            continue
        host = tile_view(views[r], dt, tuple(extent(s, t, key) for s, t, key in zip(shape, tile, k)))
        future = state.next_use if state.device_reads else None
        # the check, the upload and the keeping as one (DuckDB calls this on several threads
        # over a view of parts: two told there was room both sent, and the second tile was
        # dropped, to be sent again by every call of the step; uploads are serial anyway)
        with DEVICE_LOCK:
            if not cache.would_keep(tid, host.nbytes, future):
                continue  # no room: the step's own calls send it, as without sending ahead
            dev = to_device(xp, host)
            state.device_sent += host.nbytes
            found[r] = cache.put(tid, dev, host.nbytes, future, pin=True) or cache.stage(tid, dev, host.nbytes)
    return pa.array(found)


def _values(dtype: str):
    dt = np.dtype(dtype)
    wire = sql_value_dtype(dt)  # float16 goes as FLOAT: DuckDB reads no Arrow float16
    arrow_type = pa.from_numpy_dtype(wire)

    def values(tile_arr) -> pa.Array:
        arr = _as_array(tile_arr)
        views = blob_views(arr)
        counts = np.array([v.nbytes // dt.itemsize for v in views], dtype=np.int64)
        offsets = np.zeros(len(views) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = np.concatenate([v.view(dt) for v in views]) if views else np.empty(0, dt)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(wire, copy=False), type=arrow_type))

    return values


def _with_arity(fn: Callable, names: list[str]) -> Callable:
    """DuckDB checks a UDF's parameter count: give a *args kernel a fixed signature."""
    import inspect

    def wrapper(*args):
        return fn(*args)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names]
    wrapper.__signature__ = inspect.Signature(params)
    wrapper.__name__ = fn.__name__
    return wrapper


# the einsum kernels' names by operand count: registered for 1..MAX_ARITY on every connection,
# beyond it when a plan calls one (``register_arity``; a non-sum join of 9 operands is one step)
ARITY_UDF = re.compile(r"\beds_einsum(?:_group)?(\d+)s?\(", re.IGNORECASE)


def _tile_types():
    import duckdb

    blob = duckdb.sqltype("BLOB")
    # a NULL tile is one the device holds (eds_resident) or an array operand's the kernel reads
    # in place (_host_tile): the kernel must see the row, where DuckDB's default null handling
    # would skip it and give the output tile NULL; and a kernel returns NULL for a result it
    # leaves on the device (_keep_result), which DEFAULT refuses
    opts = dict(type="arrow", side_effects=False)
    return (blob, duckdb.sqltype("VARCHAR"), duckdb.list_type(duckdb.sqltype("BIGINT")), opts,
            dict(opts, null_handling="special"))


def register_arity(con, state: KernelState | None, n: int) -> None:
    """The einsum kernels of ``n`` operands on ``con``: one joined row (``eds_einsum<n>``), a
    group (``eds_einsum_group<n>``), a group with shared operands (``eds_einsum_group<n>s``)."""
    import duckdb

    blob, text, keys, _, tile_opts = _tile_types()

    def create_function(name, fn, *args, **kw):
        con.create_function(name, serving(fn, state, _a_run_s), *args, **kw)

    rows = _with_arity(einsum_rows, ["spec", "keys"] + [f"t{k}" for k in range(n)])
    create_function(f"eds_einsum{n}", rows, [text, keys] + [blob] * n, blob, **tile_opts)
    member = duckdb.struct_type({"k": keys, **{f"t{k}": blob for k in range(n)}})
    groups = _with_arity(einsum_groups, ["spec", "keys", "members"])
    create_function(f"eds_einsum_group{n}", groups, [text, keys, duckdb.list_type(member)], blob, **tile_opts)
    # n operands in the members, the shared ones once per group in a list
    groups_shared = _with_arity(einsum_groups, ["spec", "keys", "members", "shared"])
    create_function(f"eds_einsum_group{n}s", groups_shared, [text, keys, duckdb.list_type(member),
                                                             duckdb.list_type(blob)], blob, **tile_opts)


def register_kernels(con, state: KernelState | None = None) -> None:
    """Register every tile UDF on ``con`` (idempotent per connection); ``state`` is the
    connection's cancel flag and tile count (``pool.KernelState``)."""
    import duckdb

    def create_function(name, fn, *args, whose=_a_run_s, **kw):  # whose: those whose spec comes first
        con.create_function(name, serving(fn, state, whose), *args, **kw)

    blob, text, keys, opts, tile_opts = _tile_types()
    for n in range(1, MAX_ARITY + 1):
        register_arity(con, state, n)
    create_function("eds_program", program_rows, [text, duckdb.list_type(blob)], blob, **tile_opts)
    for n in range(1, MAX_PROGRAM_ARITY + 1):
        args = _with_arity(program_args, ["spec"] + [f"t{k}" for k in range(n)])
        create_function(f"eds_program{n}", args, [text] + [blob] * n, blob, **tile_opts)
    cut = duckdb.struct_type({"n": keys, "k": keys, "t": blob})
    create_function("eds_split", retile_split, [text, keys, blob], duckdb.list_type(cut), **opts)
    piece = duckdb.struct_type({"k": keys, "t": blob})
    create_function("eds_assemble", retile_assemble, [text, keys, duckdb.list_type(piece)], blob, **opts)
    create_function("eds_fill", fill_tiles, [text, keys], blob, **opts)
    # pinning is a side effect: DuckDB must call it for every row it reads, never fold or reuse it
    create_function("eds_resident", resident, [text, keys], duckdb.sqltype("BOOLEAN"), type="arrow",
                    side_effects=True, whose=None)  # a run's only: a value name, not a spec
    create_function("eds_send", send, [text, keys, blob], duckdb.sqltype("BOOLEAN"), type="arrow",
                    side_effects=True, null_handling="special")
    for name, sqltype in SQL_TYPES.items():  # element rows: every dtype with a DuckDB type
        create_function(
            f"eds_values_{name}", _values(name), [blob], duckdb.list_type(duckdb.sqltype(sqltype)), whose=None, **opts
        )

