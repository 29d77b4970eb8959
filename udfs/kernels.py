"""numpy kernels over tiles: extended einsum on one tile tuple, group contraction, re-tiling.

A kernel is built once per kernel spec (the JSON the compiler puts in the SQL,
``plan/kernel_spec.py``) and cached; each UDF call then only computes tile shapes from keys and
runs numpy. These are the ``"cpu"`` kernels: the spec's device picks the kernel module and the
array namespace ``xp`` it computes with (``devices.py``).
"""

from __future__ import annotations

import itertools
import string
from functools import lru_cache
import numpy as np

from eindecomp_sql.errors import EinsumError
from eindecomp_sql.plan.cost import BLOCK_ELEMENTS, MIN_BLOCK
from eindecomp_sql.notation.numpy_impl import AGG_UFUNC, join_callable, product_dtype, widened
from eindecomp_sql.plan.kernel_spec import (EinsumKernelSpec, KernelSpec, ProgramKernelSpec, RetileKernelSpec, from_json,
                                            read_operands, shared_operands, to_json)

from . import devices

# Elements one task materialises at once when a join is not a plain product (for mul/sum the
# kernel is np.einsum, i.e. BLAS, and needs no blocking): 4M elements = 32 MB of float64 ...
# and at least MIN_BLOCK where the tiles are smaller (a numpy call's own cost then stays small
# against its work): 256K elements, 2 MB of float64. The plans' projected peaks count them
# (plan/cost.py: join_block_bytes), hence defined there (imported above).
# Do not split a tile's work across kernel threads below this many element-operations.
MIN_SPLIT_WORK = 1 << 18

# Whether kernels built in this process unpickle a spec's signed callable join. Never in a
# process whose kernels SQL on a DuckDB connection can call with any text; set only in an
# engine's worker processes that run plans made elsewhere (Spark's Python workers: udfs/spark.py).
_signed_pickles = False


def trust_signed_pickles(key: bytes) -> None:
    """Let this process's kernels unpickle callable joins signed with ``key`` (the planning
    process's spec key: ``plan.kernel_spec``)."""
    global _signed_pickles
    from eindecomp_sql.plan.kernel_spec import set_spec_key

    set_spec_key(key)
    _signed_pickles = True


class _TileLayout:
    """Tile shapes from keys, and the cut of one tile's work into tasks: what the UDFs ask of
    every einsum kernel (``inputs``, ``output``, ``labels``, ``size``, ``tile`` set by it)."""

    def _take_layout(self, spec: EinsumKernelSpec, xp) -> None:
        """The spec's labels, sizes, tiles and dtypes, as every einsum kernel keeps them."""
        self.xp = xp  # the array namespace computing on tile data
        self.inputs = list(spec.inputs)
        self.output = spec.output
        self.labels = spec.labels
        self.reduced = spec.reduced
        self.size = spec.size
        self.tile = spec.tile
        self.dtypes = [np.dtype(d) for d in spec.dtypes]
        self.out_dtype = np.dtype(spec.out_dtype)
        self.tf32 = spec.tf32  # float32 products on a device may use TF32 (udfs/devices.py)
        self.values = spec.values  # on a device: the operands' value names (their tiles' cache names)
        self.result = spec.result  # ... and the result's
        # in a grouped step, the operands gathered once per group instead of in every member
        self.shared = shared_operands(spec.inputs, spec.reduced, spec.size, spec.tile)
        # the operands whose tiles a call hands (an operand repeating one of them reads its tile)
        self.args = spec.args or tuple(range(len(spec.inputs)))
        self.read = read_operands(spec.args, len(spec.inputs))
        # how errors name the kernel (an EinsumKernel's own numpy subscripts replace it)
        self.np_spec = ",".join(" ".join(x) for x in spec.inputs) + "->" + " ".join(spec.output)

    # -- shapes -----------------------------------------------------------------------------
    def extents(self, keys: dict[str, int]) -> dict[str, int]:
        return {lab: min(self.tile[lab], self.size[lab] - keys.get(lab, 0) * self.tile[lab]) for lab in self.labels}

    def in_shapes(self, ext: dict[str, int]) -> list[tuple[int, ...]]:
        return [tuple(ext[lab] for lab in x) for x in self.inputs]

    def out_shape(self, ext: dict[str, int]) -> tuple[int, ...]:
        return tuple(ext[lab] for lab in self.output)

    # -- parallel split ---------------------------------------------------------------------
    def split(self, ext: dict[str, int], parts: int, members: int = 1,
              labels: tuple[str, ...] | None = None) -> list[tuple[str, int, int] | None]:
        """Ranges of one output label (of ``labels`` if given) to cut a tile's work
        (``members`` tile tuples of extents ``ext``) into ``parts`` tasks."""
        labels = self.output if labels is None else labels
        work = int(np.prod(list(ext.values()), dtype=np.int64)) * members
        if parts <= 1 or not labels or work < MIN_SPLIT_WORK:
            return [None]
        # the first output label long enough keeps every slice of a C-order tile contiguous
        lab = next((lb for lb in labels if ext[lb] >= parts), max(labels, key=lambda lb: ext[lb]))
        n = ext[lab]
        parts = min(parts, n)
        if parts <= 1:
            return [None]
        bounds = [n * p // parts for p in range(parts + 1)]
        return [(lab, bounds[p], bounds[p + 1]) for p in range(parts)]

    def sliced(self, tiles: list[np.ndarray], out: np.ndarray, cut):
        if cut is None:
            return tiles, out
        lab, a, b = cut
        new_tiles = []
        for x, labs in zip(tiles, self.inputs):
            idx = tuple(slice(a, b) if lb == lab else slice(None) for lb in labs)
            new_tiles.append(x[idx])
        oidx = tuple(slice(a, b) if lb == lab else slice(None) for lb in self.output)
        return new_tiles, out[oidx]

    def contract_group(self, members: list[list[np.ndarray]], out: np.ndarray) -> None:
        """``out`` from the tiles of every member of a group (one member: a row step). A result
        narrower than the dtype it is computed in (float16 and bfloat16 products summed in
        float32) combines the members in that dtype and is rounded once."""
        acc = out
        if len(members) > 1 and out.dtype != self.acc_dtype:
            acc = self.xp.empty(out.shape, self.acc_dtype)
        for q, tiles in enumerate(members):
            self.contract(tiles, acc, accumulate=q > 0)
        if acc is not out:
            self.xp.copyto(out, acc, casting="unsafe")


class EinsumKernel(_TileLayout):
    """out[out labels] = agg over reduced labels of join(tiles...), for tiles of any extents."""

    def __init__(self, spec: EinsumKernelSpec, xp=np):
        self._take_layout(spec, xp)
        # the aggregation's ufunc in the kernel's namespace (CuPy has numpy's ufuncs under the
        # same names, with reduce): a numpy ufunc handed device arrays is a host round trip
        self.agg = getattr(xp, AGG_UFUNC[spec.agg].__name__)
        self.agg_name = spec.agg  # the reduction, as an array method (``_reduce``)
        self.fast = spec.join.name == "mul" and spec.agg == "sum"
        # a user's callable (unpickled from the spec) comes back checked on every call
        # (element-wise numbers of the dtype its probe gave; notation/numpy_impl.py): an
        # EinsumError naming it otherwise
        self.join = join_callable(spec.join.function(allow_pickle=_signed_pickles))
        letters = {lab: string.ascii_letters[k] for k, lab in enumerate(self.labels)}
        self.letters = letters
        self.np_spec = ",".join("".join(letters[lab] for lab in x) for x in self.inputs) + "->" + "".join(
            letters[lab] for lab in self.output
        )
        self.all = self.output + self.reduced
        self.matmul = _MatmulPlan.build(self.inputs, self.output) if self.fast and len(self.inputs) == 2 else None
        self.work_dtype = product_dtype(self.out_dtype)
        # what a group's members combine in: the product's dtype, which is float32 for a float16
        # or bfloat16 result of any join (bfloat16 operands are computed in float32: ``widened``).
        # numpy reduces float16 in float32 too (its half loops keep a float accumulator along the
        # reduced axis and round at the end), so a float16 prod whose running product would
        # overflow float16 before it meets a zero is 0 for numpy; combining members in float16
        # made it inf * 0 = nan (hypothesis, ``test_binary_join_agg``, 2026-11-25)
        self.acc_dtype = self.work_dtype
        # a product BLAS runs (and threads) itself: float and complex matmuls; numpy's integer
        # matmul is not BLAS
        self.blas = self.matmul is not None and self.work_dtype.kind in "fc"
        self._diag = []
        for x in self.inputs:
            uniq = tuple(dict.fromkeys(x))
            diag = None
            if len(uniq) != len(x):
                diag = "".join(letters[lab] for lab in x) + "->" + "".join(letters[lab] for lab in uniq)
            perm = [uniq.index(lab) for lab in self.all if lab in uniq]
            self._diag.append((uniq, diag, perm))

    # -- evaluation -------------------------------------------------------------------------
    def contract(self, tiles: list[np.ndarray], out: np.ndarray, accumulate: bool) -> None:
        """Compute into ``out`` (or combine into it with the aggregation if ``accumulate``)."""
        xp = self.xp
        if self.fast:
            # np.einsum computes in the promoted dtype of all operands; cast first so a bool
            # operand next to a float one counts instead of OR-ing (as optimize=True would);
            # float16 and bfloat16 run in float32 (``product_dtype``)
            work = self.work_dtype
            # a complex tile into a real dtype (einsum(dtype=..., casting="unsafe")) keeps its
            # real part, as numpy's cast does; numpy's warning is the session's, at the user's line
            tiles = [t if t.dtype == work else (t.real if t.dtype.kind == "c" and work.kind != "c" else t).astype(work)
                     for t in tiles]
            if self.matmul is not None and not accumulate and work == out.dtype:
                self.matmul.run(tiles[0], tiles[1], out, xp)
                return
            if self.matmul is not None:
                r = xp.empty(out.shape, work)
                self.matmul.run(tiles[0], tiles[1], r, xp)
            else:
                r = xp.einsum(self.np_spec, *tiles, optimize=len(tiles) > 1)
            if accumulate:
                xp.add(out, r, out=out, casting="unsafe")
            else:
                xp.copyto(out, r, casting="unsafe")
            return
        part = self._general([widened(t) for t in tiles])
        if accumulate:
            self.agg(out, part, out=out, casting="unsafe")
        else:
            xp.copyto(out, part, casting="unsafe")

    def _aligned(self, tiles: list[np.ndarray]) -> list[np.ndarray]:
        """Each operand with its diagonals taken, axes in ``self.all`` order, 1 where absent."""
        xs = []
        for x, (uniq, diag, perm) in zip(tiles, self._diag):
            if diag is not None:
                x = self.xp.einsum(diag, x)
            x = x.transpose(perm)
            shape = []
            it = iter(x.shape)
            for lab in self.all:
                shape.append(next(it) if lab in uniq else 1)
            xs.append(x.reshape(shape))
        return xs

    def _general(self, tiles: list[np.ndarray]) -> np.ndarray:
        xp = self.xp
        xs = self._aligned(tiles)
        full = [max(x.shape[a] for x in xs) for a in range(len(self.all))]
        n_out = len(self.output)
        red_axes = tuple(range(n_out, len(self.all)))
        if not red_axes:
            return xp.broadcast_to(xp.asarray(self.join(*xs)), full)
        # block over the reduced axes, longest first, so that no task holds more of the join
        # space than the larger of its tiles (which the projected peak counts) or MIN_BLOCK:
        # one slice of the longest axis alone was 36^5 elements of a 5-operand add/sum over
        # 36 x 36 tiles (+519 MB resident, projected 124 kB: a trial), and up to 32 MB a task
        # for a 512² max-plus product (+127 MB over its mul/sum twin)
        out_elems = int(np.prod(full[:n_out], dtype=np.int64))
        largest = max([int(np.prod(x.shape, dtype=np.int64)) for x in xs] + [out_elems])
        # a block of at least 8 output tiles' worth, where that fits BLOCK_ELEMENTS: each block
        # is folded into the accumulator, a pass over one output tile (2 a block made a 1024²
        # max-plus product 1.5x slower)
        limit = min(BLOCK_ELEMENTS, max(MIN_BLOCK, largest, 8 * out_elems))
        steps = {a: full[a] for a in red_axes}
        for a in sorted(red_axes, key=lambda a: -full[a]):
            rest = out_elems * int(np.prod([steps[b] for b in red_axes if b != a], dtype=np.int64))
            steps[a] = max(1, min(full[a], limit // max(rest, 1)))
            if out_elems * int(np.prod(list(steps.values()), dtype=np.int64)) <= limit:
                break
        acc = None
        for starts in itertools.product(*(range(0, full[a], steps[a]) for a in red_axes)):
            cut = dict(zip(red_axes, starts))
            sl = [x[tuple(slice(cut[a], cut[a] + steps[a]) if a in cut and x.shape[a] != 1 else slice(None)
                          for a in range(len(full)))] for x in xs]
            vals = xp.asarray(self.join(*sl))
            shape = [min(steps[a], full[a] - cut[a]) if a in cut else full[a] for a in range(len(full))]
            # float16 values reduce in float32, as numpy's half loops do (``acc_dtype``)
            wide = self.acc_dtype if vals.dtype == np.float16 and self.acc_dtype != vals.dtype else None
            part = _reduce(xp.broadcast_to(vals, shape), self.agg_name, red_axes, wide)
            acc = part if acc is None else self.agg(acc, part, out=acc)  # part is a reduction's own array
        return acc


def _reduce(x, agg: str, axes: tuple[int, ...], dtype=None):
    """``x`` reduced over ``axes`` by ``agg`` (sum, prod, max, min), in ``dtype`` if given: the
    array methods, which numpy and CuPy both have with tuple axes (numpy's ``add.reduce`` is
    its ``sum``; CuPy's ufuncs gained ``reduce`` late, with fewer options)."""
    if agg in ("max", "min"):
        return getattr(x if dtype is None else x.astype(dtype), agg)(axis=axes)
    return getattr(x, agg)(axis=axes, dtype=dtype)


class FusedKernel(_TileLayout):
    """A fused step's kernel (``KernelFusion``): element-wise prologues computing operands of
    the contraction from the input tiles, the contraction (an ``EinsumKernel`` over those
    slots, aggregating a group's members in place), then element-wise epilogues on each
    finished output tile. Values between the stages never leave the kernel."""

    def __init__(self, spec: EinsumKernelSpec, xp=np):
        from eindecomp_sql.notation.spec import first_appearance

        f = spec.fused
        self._take_layout(spec, xp)
        self.slot_labels = [tuple(x) for x in spec.inputs] + [st.labels for st in f.prologues]
        dtypes = list(spec.dtypes) + [st.dtype for st in f.prologues]
        # a contraction prologue (a chain's producer: plan/passes/chains.py) is an einsum
        # kernel of its own over its slots' tiles, whose reduced labels the plan keeps whole
        self.prologues = [self._compiled(st) if st.agg is None else self._contraction(st, spec, dtypes, xp)
                          for st in f.prologues]
        self.core_args = f.core
        core_inputs = tuple(self.slot_labels[a] for a in f.core)
        labels = first_appearance(*core_inputs)
        self.core = EinsumKernel(EinsumKernelSpec(
            inputs=core_inputs, output=f.core_labels, labels=labels,
            reduced=tuple(lab for lab in labels if lab not in f.core_labels), size=spec.size, tile=spec.tile,
            join=spec.join, agg=spec.agg, dtypes=tuple(dtypes[a] for a in f.core), out_dtype=f.core_dtype,
            device=spec.device, tf32=spec.tf32), xp=xp)
        self.slot_labels.append(tuple(f.core_labels))
        self.epilogues = []
        for st in f.epilogues:
            self.epilogues.append(self._compiled(st))
            self.slot_labels.append(st.labels)
        # a product BLAS threads itself (udfs/register.py: _run) is still one when fused
        self.blas = self.core.blas

    @staticmethod
    def _compiled(st):
        """A stage as (slots it reads, its join as a function, its labels, its dtype, cast first)."""
        return (st.args, join_callable(st.join.function(allow_pickle=_signed_pickles)), st.labels, np.dtype(st.dtype),
                st.cast)

    def _contraction(self, st, spec: EinsumKernelSpec, dtypes: list, xp):
        """A contraction stage as (slots it reads, its einsum kernel): computed as the unfused
        step's kernel computes the producer's tile (the same kernel class, dtypes and rounding)."""
        from eindecomp_sql.notation.spec import first_appearance

        ins = tuple(self.slot_labels[a] for a in st.args)
        labels = first_appearance(*ins)
        kernel = EinsumKernel(EinsumKernelSpec(
            inputs=ins, output=st.labels, labels=labels, reduced=tuple(lab for lab in labels if lab not in st.labels),
            size=spec.size, tile=spec.tile, join=st.join, agg=st.agg, dtypes=tuple(dtypes[a] for a in st.args),
            out_dtype=st.dtype, device=spec.device, tf32=spec.tf32), xp=xp)
        return st.args, kernel

    def _stage(self, stage, slots: list) -> np.ndarray:
        """One stage on the slots: its join of the arrays it reads (each with its labels, all
        distinct) broadcast by label, in its dtype, computed as the unfused step's kernel
        computes it (``EinsumKernel.contract``: a product summed casts its inputs first)."""
        if len(stage) == 2:  # a contraction (``_contraction``)
            args, kernel = stage
            tiles = [slots[a] for a in args]
            ext = {}
            for x, labs in zip(tiles, kernel.inputs):
                ext.update(zip(labs, x.shape))
            out = self.xp.empty(tuple(ext[lab] for lab in kernel.output), kernel.out_dtype)
            kernel.contract(tiles, out, accumulate=False)
            return out
        args, join, labels, dtype, cast = stage
        xs = []
        for a in args:
            x, labs = slots[a], self.slot_labels[a]
            if cast and x.dtype != dtype:
                x = x.astype(dtype)
            x = widened(x)  # bfloat16 computes in float32, rounded to the stage's dtype below
            present = [lab for lab in labels if lab in labs]
            x = x.transpose([labs.index(lab) for lab in present])
            dims = iter(x.shape)
            xs.append(x.reshape([next(dims) if lab in labs else 1 for lab in labels]))
        full = [max(x.shape[a] for x in xs) for a in range(len(labels))]
        r = self.xp.broadcast_to(self.xp.asarray(join(*xs)), full)
        return r if r.dtype == dtype else r.astype(dtype)

    def contract_group(self, members: list[list[np.ndarray]], out: np.ndarray) -> None:
        xp = self.xp
        core = self.core
        if self.epilogues:  # the contraction's own tile (dtype, label order) until the epilogues ran
            dims = dict(zip(self.output, out.shape))
            acc = xp.empty(tuple(dims[lab] for lab in core.output), dtype=core.out_dtype)
        else:
            acc = out
        # members combine in the contraction's own compute dtype (``EinsumKernel.contract_group``)
        total = acc if len(members) == 1 or acc.dtype == core.acc_dtype else xp.empty(acc.shape, core.acc_dtype)
        for q, tiles in enumerate(members):
            slots = list(tiles)
            for stage in self.prologues:
                slots.append(self._stage(stage, slots))
            core.contract([slots[a] for a in self.core_args], total, accumulate=q > 0)
        if total is not acc:
            xp.copyto(acc, total, casting="unsafe")
        if not self.epilogues:
            return
        # epilogues read output-labelled input tiles: the same in every member of the group
        slots = list(members[0]) + [None] * len(self.prologues) + [acc]
        for stage in self.epilogues:
            slots.append(self._stage(stage, slots))
        xp.copyto(out, slots[-1], casting="unsafe")

    def split(self, ext: dict[str, int], parts: int, members: int = 1):
        # cut where the contraction alone would (its label order), so a fused step's products
        # are sliced as the unfused step's were; not along a label a contraction prologue's
        # result lacks: every task would compute that whole tile again (a chain: its producer)
        whole = [st[1].output for st in self.prologues if len(st) == 2]
        labels = tuple(lab for lab in self.core.output if all(lab in labs for labs in whole))
        return self.core.split(ext, parts, members, labels)


class _MatmulPlan:
    """A binary product as one batched matmul written straight into the output tile.

    Labels sort into batch (both inputs and output), m (x and output), n (y and output) and k
    (both inputs, reduced); labels in one input only and reduced are summed first. This is what
    np.einsum(optimize=True) does via tensordot, minus its temporary result and the copy of it
    into the output buffer (one full pass over the output, ~10% of a 4096² GEMM here).
    """

    def __init__(self, x_pre, y_pre, x_perm, y_perm, groups, out_perm, out_labels_order, swap=False):
        self.x_pre, self.y_pre = x_pre, y_pre
        self.x_perm, self.y_perm = x_perm, y_perm
        self.groups = groups  # lengths of (batch, m, k, n)
        self.out_perm = out_perm  # None when the output is already in batch, m, n order
        self.swap = swap  # the operands' roles swapped: run(x, y) multiplies y by x

    @classmethod
    def build(cls, inputs, output):
        """The plan for ``inputs -> output``; when the output lists the second operand's labels
        first (``kl,ik->il``), the operands swap roles so the product lands in the output's
        order: no temporary and no transposing copy (the chain_3 benchmark's second step took
        0.046 s against 0.021 s for the same FLOPs the other way round)."""
        plan = cls._build(*inputs, output)
        if plan is not None and plan.out_perm is not None:
            other = cls._build(inputs[1], inputs[0], output)
            if other is not None and other.out_perm is None:
                other.swap = True
                return other
        return plan

    @classmethod
    def _build(cls, x, y, output):
        if len(set(x)) != len(x) or len(set(y)) != len(y):
            return None  # diagonals: leave to np.einsum
        out = set(output)
        batch = [lab for lab in output if lab in x and lab in y]
        m = [lab for lab in output if lab in x and lab not in y]
        n = [lab for lab in output if lab in y and lab not in x]
        k = [lab for lab in x if lab in y and lab not in out]
        x_pre = tuple(ax for ax, lab in enumerate(x) if lab not in y and lab not in out)
        y_pre = tuple(ax for ax, lab in enumerate(y) if lab not in x and lab not in out)
        x_kept = [lab for lab in x if lab in y or lab in out]
        y_kept = [lab for lab in y if lab in x or lab in out]
        x_perm = tuple(x_kept.index(lab) for lab in batch + m + k)
        y_perm = tuple(y_kept.index(lab) for lab in batch + k + n)
        order = batch + m + n
        out_perm = None if list(output) == order else tuple(order.index(lab) for lab in output)
        return cls(x_pre, y_pre, x_perm, y_perm, (len(batch), len(m), len(k), len(n)), out_perm, order)

    def run(self, x: np.ndarray, y: np.ndarray, out: np.ndarray, xp=np) -> None:
        """``out`` = the product of ``x`` and ``y``, computed by ``xp`` (numpy, or a device's
        namespace: all three are its arrays)."""
        if self.swap:
            x, y = y, x
        if self.x_pre:
            x = x.sum(axis=self.x_pre, dtype=x.dtype)
        if self.y_pre:
            y = y.sum(axis=self.y_pre, dtype=y.dtype)
        x = x.transpose(self.x_perm)
        y = y.transpose(self.y_perm)
        nb, nm, nk, nn = self.groups
        bshape = x.shape[:nb]
        B = int(np.prod(bshape, dtype=np.int64))
        M = int(np.prod(x.shape[nb:nb + nm], dtype=np.int64))
        K = int(np.prod(x.shape[nb + nm:], dtype=np.int64))
        N = int(np.prod(y.shape[nb + nk:], dtype=np.int64))
        # one product (no batch) as a 2-D matmul: CuPy routes only that through cuBLAS's GEMM
        # with a settable compute type (TF32); its batched path is another call
        x3 = x.reshape(M, K) if B == 1 else x.reshape(B, M, K)
        y3 = y.reshape(K, N) if B == 1 else y.reshape(B, K, N)
        if self.out_perm is None and out.flags.c_contiguous:
            xp.matmul(x3, y3, out=out.reshape((M, N) if B == 1 else (B, M, N)))
        else:
            r = xp.matmul(x3, y3).reshape(bshape + x.shape[nb:nb + nm] + y.shape[nb + nk:])
            out[...] = r.transpose(self.out_perm) if self.out_perm is not None else r


@lru_cache(maxsize=512)
def einsum_kernel(spec_json: str) -> EinsumKernel:
    """The kernel of an einsum spec, on the spec's device (built once per distinct spec: a
    callable join is unpickled once)."""
    spec = read_spec(spec_json, EinsumKernelSpec)
    module = devices.kernel_module(spec.device)
    kind = module.EinsumKernel if spec.fused is None else getattr(module, "FusedKernel", None)
    if kind is None:
        raise EinsumError(f"device {spec.device!r}: its kernel module {module.__name__} has no FusedKernel, so it "
                          "cannot run a fused step; add one, or plan with fuse=False")
    return kind(spec, xp=devices.namespace(spec.device))


class ProgramKernel:
    """A program step's kernel (``ProgramKernelSpec``): the einsum kernels of its steps, each
    over whole values, run one after the other on one call's input tiles. A result lives until
    the last step reading it has run."""

    def __init__(self, spec: ProgramKernelSpec):
        self.kernels = [einsum_kernel(to_json(s)) for s in spec.steps]
        self.xp = self.kernels[-1].xp  # every step's (a program runs on one device)
        self.values = spec.values  # on a device: the inputs' value names (udfs/device_cache.py)
        self.result = spec.result
        self.args = spec.args
        self.dtypes = [np.dtype(d) for d in spec.dtypes]
        last = self.kernels[-1]
        self.out_dtype = last.out_dtype
        self.out_shape = last.out_shape(last.extents({}))
        n = len(self.dtypes)
        last_read = {}
        for j, args in enumerate(self.args):
            for a in args:
                last_read[a] = j
        # slots to let go of once step j ran (inputs are DuckDB's: only results are freed)
        self.free_after = [[a for a, j2 in last_read.items() if j2 == j and a >= n] for j in range(len(self.args))]

    def run(self, tiles: list, out: np.ndarray, run) -> None:
        """Every step on ``tiles`` (one uint8 buffer per input), the last into ``out`` on the
        host, or, on a device, returned as a device array (``out`` untouched);
        ``run(kernel, items)`` runs a step's work on the kernel threads."""
        if len(tiles) != len(self.dtypes):
            raise ValueError(f"eindecomp_sql program kernel: got {len(tiles)} tiles for {len(self.dtypes)} inputs")
        xp = self.xp
        slots: list = []
        for raw, dt in zip(tiles, self.dtypes):
            if hasattr(raw, "get"):  # already on the device (udfs/register.py sends a program's inputs)
                slots.append(raw)
                continue
            if raw.nbytes % dt.itemsize:
                raise ValueError(f"eindecomp_sql program kernel: a tile of {raw.nbytes} bytes is no whole {dt} array")
            slots.append(devices.to_device(xp, raw.view(dt)))
        final = len(self.kernels) - 1
        for j, (k, args) in enumerate(zip(self.kernels, self.args)):
            ext = k.extents({})
            xs = [_whole(slots[a], dt, shape) for a, dt, shape in zip(args, k.dtypes, k.in_shapes(ext))]
            # on a device the last result is made there too (the caller copies it into ``out``)
            o = out if j == final and xp is np else k.xp.empty(k.out_shape(ext), dtype=k.out_dtype)

            def fn(cut, k=k, xs=xs, o=o):
                t, oo = k.sliced(xs, o, cut)
                k.contract_group([t], oo)

            run(k, [(ext, fn, 1)])
            slots.append(o)
            for a in self.free_after[j]:
                slots[a] = None
        if xp is not np:  # the caller copies it into ``out`` unless it stays on the device
            return slots[-1]
        return None


def _whole(x: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A value (an input's elements, or an earlier step's result) as the array a step reads."""
    if x.dtype != dtype or x.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"eindecomp_sql program kernel: a {x.dtype} value of {x.size} elements where {dtype} "
                         f"{shape} is read")
    return x.reshape(shape)


@lru_cache(maxsize=128)
def program_kernel(spec_json: str) -> ProgramKernel:
    return ProgramKernel(read_spec(spec_json, ProgramKernelSpec))


class RetileKernel:
    """Cut pieces out of source tiles and assemble target tiles from pieces."""

    def __init__(self, spec: RetileKernelSpec, xp=np):
        self.xp = xp
        self.shape = spec.shape
        self.src = spec.source_tile
        self.dst = spec.target_tile
        self.dtype = np.dtype(spec.dtype)
        self.first_key_range = spec.first_key_range
        self.key_axis = spec.key_axis

    def targets(self, old_key) -> list[tuple[int, ...]]:
        """Keys of the target tiles a source tile overlaps (within the batch's range)."""
        ranges = []
        for p, (k, a, b, n) in enumerate(zip(old_key, self.src, self.dst, self.shape)):
            lo, hi = k * a // b, (min((k + 1) * a, n) - 1) // b + 1
            if p == self.key_axis and self.first_key_range is not None:
                lo, hi = max(lo, self.first_key_range[0]), min(hi, self.first_key_range[1])
            ranges.append(range(lo, hi))
        return list(itertools.product(*ranges))

    def _box(self, tile: tuple[int, ...], key) -> list[tuple[int, int]]:
        return [(k * t, min((k + 1) * t, n)) for k, t, n in zip(key, tile, self.shape)]

    def src_shape(self, key) -> tuple[int, ...]:
        return tuple(b - a for a, b in self._box(self.src, key))

    def dst_shape(self, key) -> tuple[int, ...]:
        return tuple(b - a for a, b in self._box(self.dst, key))

    def overlap(self, old_key, new_key) -> list[tuple[int, int]]:
        return [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(self._box(self.src, old_key), self._box(self.dst, new_key))]

    def piece_index(self, old_key, new_key, relative_to: str) -> tuple[slice, ...]:
        box = self._box(self.src if relative_to == "src" else self.dst, old_key if relative_to == "src" else new_key)
        return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(self.overlap(old_key, new_key), box))


@lru_cache(maxsize=512)
def retile_kernel(spec_json: str) -> RetileKernel:
    spec = read_spec(spec_json, RetileKernelSpec)
    return devices.kernel_module(spec.device).RetileKernel(spec, xp=devices.namespace(spec.device))


@lru_cache(maxsize=512)
def read_spec(spec_json: str, kind: type | None = None) -> KernelSpec:
    """The spec a UDF got, checked to be of ``kind`` and for a device with kernels here."""
    spec = from_json(spec_json)
    if kind is not None and not isinstance(spec, kind):
        raise EinsumError(f"a {kind.op} kernel got a {spec.op} kernel spec")
    devices.kernel_module(spec.device)  # an EinsumError naming the devices with kernels
    return spec
