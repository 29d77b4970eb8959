"""The numpy face: ``eds.einsum`` on arrays, run on one in-memory session opened once."""

from __future__ import annotations

import atexit
import inspect
import os
import threading

import numpy as np

from .arrays import native, read_array
from .errors import EinsumError, EinsumTypeError, warn
from .graph.lower import contraction_path
from .notation import parse_spec
from .notation.checks import can_cast, check_dtype, is_bfloat16, promote
from .notation.sublist import FORMS, sublist_spec
from .session import Session
from .tensor import Tensor

_default: Session | None = None
_default_lock = threading.Lock()

CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")
ORDERS = ("C", "F", "A", "K")


def default_session() -> Session:
    """The in-memory session ``eds.einsum`` runs on: opened once (a connection costs ~30 ms),
    closed at exit."""
    global _default
    with _default_lock:  # (a forked child starts without the parent's: _forget_default_in_child)
        if _default is None:
            _default = Session()
            atexit.register(_close_default)
        return _default


def _forget_default_in_child() -> None:
    # a forked child: the parent's default session is not this process's, and a parent thread
    # may have held the lock at the fork (opening the session): a child waited on it for ever
    global _default, _default_lock
    _default, _default_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_default_in_child)


def _close_default() -> None:
    global _default
    if _default is not None:
        _default.close()
        _default = None


def _check_casting(casting) -> str:
    if not isinstance(casting, str) or casting not in CASTINGS:
        # not a string at all: a TypeError, as numpy's ("casting must be str, not NoneType")
        kind = EinsumError if isinstance(casting, str) else EinsumTypeError
        raise kind(f"casting must be one of {', '.join(map(repr, CASTINGS))} (got {casting!r})")
    return casting


def _check_order(order) -> str:
    if order is None:
        return "K"
    if isinstance(order, bytes):  # numpy takes b"C" too (it refused: a trial)
        try:
            order = order.decode("ascii")
        except UnicodeDecodeError:
            raise EinsumError(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})") from None
    if not isinstance(order, str) or order.upper() not in ORDERS:
        kind = EinsumError if isinstance(order, str) else EinsumTypeError
        raise kind(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})")
    return order.upper()


def _named(x, name: str) -> bool:
    """``x == name`` for a join/agg argument of any type (an array compared element-wise)."""
    return isinstance(x, str) and x == name


def _cast_error(what: str, frm: np.dtype, to: np.dtype, casting: str) -> EinsumTypeError:
    def word(d: np.dtype) -> str:  # (bfloat16's str is '<V2': numpy has no code for it)
        return repr(d.name) if is_bfloat16(d) else f"{d.str!r} ({d.name})"

    numpy_too = "" if is_bfloat16(frm) or is_bfloat16(to) else " (numpy's einsum refuses this too)"
    rules = ("no", "equiv", "safe", "same_kind", "unsafe")
    looser = [c for c in rules[rules.index(casting) + 1:] if can_cast(frm, to, c)] if casting in rules else []
    advice = f"; pass casting={looser[0]!r} to allow it" if looser else ""
    return EinsumTypeError(f"{what}: cannot cast from dtype {word(frm)} to {word(to)} according to the rule "
                       f"{casting!r}{numpy_too}{advice}")


def _computation_dtype(dtype, raw: list[np.dtype], out, casting: str) -> np.dtype:
    """The dtype numpy's einsum computes in: ``dtype``, else the operands' promoted dtype (with
    ``out``'s: bool operands summed into an int64 ``out`` count). Every operand must cast to it
    under ``casting``; a dtype eindecomp_sql does not compute in is an ``EinsumError``."""
    ct = dtype if dtype is not None else promote(*raw, *([out.dtype] if out is not None else []))
    for k, d in enumerate(raw):
        if not can_cast(d, ct, casting):
            raise _cast_error(f"operand {k}", d, ct, casting)
    if dtype is None and out is not None:
        check_dtype(ct, f"out of dtype {out.dtype} makes numpy's einsum compute in {ct.name}, which eindecomp_sql "
                        "cannot")
    return ct


def _is_view_case(spec: str, shapes) -> bool:
    """numpy answers a lone operand whose labels all reach the output (a copy, a transpose, a
    diagonal) with a view of it when there is no ``out``: ``dtype`` and ``casting`` are not
    looked at (``np.einsum("ij->ji", a_float32, dtype="int8")`` is float32). So do we."""
    parsed = parse_spec(spec, shapes)
    return len(shapes) == 1 and set(parsed.inputs[0]) <= set(parsed.output)


def einsum(*operands, out=None, dtype=None, order="K", casting="safe", optimize=False, join=None, agg=None,
           progress=None):
    """Evaluate an (extended) Einstein summation as SQL in an embedded DuckDB, with
    ``numpy.einsum``'s semantics and arguments.

    >>> einsum("ij,jk->ik", np.eye(2), np.arange(4.).reshape(2, 2))
    array([[0., 1.],
           [2., 3.]])
    >>> einsum(np.arange(4.).reshape(2, 2), [0, 1], [1, 0])  # numpy's sublist form
    array([[0., 2.],
           [1., 3.]])
    >>> einsum("ij->i", np.array([[1., 2.], [3., 4.]]), agg="max")
    array([2., 4.])

    Called as ``einsum(spec, *operands, ...)`` or ``einsum(a, [0, 1], b, [1, 2], [0, 2], ...)``.

    Parameters
    ----------
    spec : str
        numpy's subscripts: ``"ij,jk->ik"``, implicit output (``"ij,jk"``), repeated labels
        (diagonals, traces), ``...`` broadcasting, labels ``a-z`` and ``A-Z`` (distinct). Or
        numpy's sublist form, ``einsum(a, [0, 1], b, [1, 2], [0, 2])`` (ints in [0, 52),
        ``Ellipsis`` for ``...``).
    *operands : array_like
        Arrays (anything numpy reads as numbers: lists, scalars, numeric pyarrow Arrays),
        or stored ``Tensor``s (of one session: the einsum runs in it, and names given beside
        them are its tensors' names). Any byte order (converted to native). Tables, data frames, DuckDB relations and sparse matrices are refused:
        store tables with ``db.store``; call ``.toarray()`` on a sparse matrix.
    out : numpy.ndarray, optional
        Written with the result (numpy's casting rule ``casting`` from the result's dtype to
        ``out.dtype``) and returned. Its shape must be the result's.
    dtype : dtype, optional
        Compute in this dtype: every operand is cast to it first, under ``casting``; a cast the
        rule forbids is an ``EinsumError`` where numpy raises. Without it, the operands'
        promoted dtype, with ``out``'s when given (numpy's: bools summed into an int ``out``
        count); that is ``mul``/``sum`` only: another join/agg computes as numpy's ufuncs do,
        from the operands alone, and ``out`` receives the result (int8 ``add``/``max`` wraps
        into an int64 ``out``, as ``np.add(a, b, out=...)`` does; pass ``dtype`` to widen).
        As in numpy, a lone operand whose labels all reach the output (a copy, a transpose, a
        diagonal) keeps its dtype: numpy returns a view there and ignores it (not with a
        ``join``/``agg`` of ours, which computes: ``dtype`` applies there).
    order : {'K', 'C', 'F', 'A'}
        Memory layout of the returned array ('K' and 'C': C order; 'F': Fortran; 'A': Fortran
        when every array operand is Fortran-contiguous). Ignored with ``out``.
    casting : {'safe', 'no', 'equiv', 'same_kind', 'unsafe'}
        numpy's casting rule, for the operands to the computation dtype (``dtype``, else the
        operands' promoted dtype) and for the result into ``out``.
    optimize : {False, True, 'greedy', 'optimal', ('greedy', memory_limit), ['einsum_path', ...]}
        numpy's contraction-path argument (also opt_einsum's path names), checked as numpy
        checks it (an invalid path is an ``EinsumError``). It orders the binary products of a
        many-operand product (a semiring join/agg: ``mul``/``sum``, ``add``/``max``,
        ``add``/``min``, ``min``/``max``, ``max``/``min``): an explicit path is followed, a name
        picks opt_einsum's algorithm; ``False`` lets the planner choose (opt_einsum's
        ``"auto"``). The result's dtype never depends on it: every step computes in the dtype of
        the whole einsum, as numpy's unoptimized einsum does. Float values can, as with
        numpy's own ``optimize``: another order rounds sums (and max-plus additions) otherwise,
        and where ``+inf`` meets ``-inf`` in an add join (or ``inf`` meets ``0`` in a product)
        one order gives ``nan`` and another ``inf``, since the pairwise steps reduce a label
        before its values meet the other operands'. Integer, bool and ``min``/``max`` joins are
        exact in any order; a join written as one expression (``join="x + y + z"``) is never
        regrouped.
    join : str or callable, optional
        The element-wise function of the operands (default ``"mul"``). A name: binary
        ``mul add sub div max min pow`` (``mul add max min`` fold over any number of operands)
        or, for one operand, ``identity exp log relu neg square sqrt abs sigmoid tanh``. An
        expression over the operands ``x, y, z, w`` (or ``x0 .. xN``): numbers,
        ``+ - * / ** %``, comparisons, ``and or not``, ``a if c else b`` and the functions
        ``exp log relu neg square sqrt abs sigmoid tanh sin cos log1p expm1 sign max min where
        pow`` — e.g. ``"relu(x - y)"``, ``"x if x > y else 0.5 * y"``. Or a Python callable of
        numpy arrays, element-wise: it receives broadcastable blocks (one axis per label) and
        must return numbers of their broadcast shape, of a dtype that depends on its inputs'
        dtypes only; this is checked on every tile (``EinsumError`` naming the callable).
    agg : {'sum', 'max', 'min', 'prod'}
        How values of the labels not in the output combine (default ``"sum"``).
    progress : bool or callable, optional
        ``True`` draws a progress bar on stderr; a callable receives a ``StepProgress`` (step k
        of n, tiles done, bytes, elapsed) several times a second; None or False: nothing.

    Returns
    -------
    numpy.ndarray (a numpy scalar for a 0-d result, as ``np.einsum``), or ``out``.

    Notes
    -----
    dtypes: bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, bfloat16
    (ml_dtypes'), float32, float64, complex64, complex128, with numpy's promotion. ``mul``/``sum``
    gives ``np.einsum``'s dtype (bool stays bool); any other join/agg gives the dtype of
    ``agg.reduce(join(operands))`` (max/min of complex compare as numpy does, lexicographically),
    so a join numpy answers in float16 (``sqrt`` of int8) is float16 here too. A float16 product
    summed runs in float32 (BLAS; numpy's float16 product has none) and is rounded to float16
    once per tile. numpy has no bfloat16 rules (``np.einsum`` refuses it): bfloat16 promotes as
    float16 does, but to float32 next to float16, and every join and aggregation computes it in
    float32 and rounds the result once, as torch does. Results are in native byte order.
    Every bad input is an ``EinsumError`` (a ``ValueError``).
    """
    if not operands:
        raise EinsumError(f"einsum: no spec and no operands; einsum takes {FORMS}")
    spec, *operands = operands
    if isinstance(spec, bytes):  # numpy reads a bytes spec as its text
        try:
            spec = spec.decode("ascii")
        except UnicodeDecodeError:
            raise EinsumError(f"einsum: the spec {spec!r} is not ASCII") from None
    if not isinstance(spec, str):
        spec, operands = sublist_spec((spec, *operands))
    if not operands:
        raise EinsumError(f"einsum: no operands; einsum takes {FORMS}")
    casting = _check_casting(casting)
    order = _check_order(order)
    path = contraction_path(optimize, len(operands))
    # a Tensor runs in its own session (eds.einsum("ij->", A) of a db.store's A was refused as "a
    # tensor of another session": a documentation audit); names are that session's tensors
    owners = {id(x.session): x.session for x in operands if isinstance(x, Tensor)}
    if len(owners) > 1:
        raise EinsumError("einsum: the Tensor operands belong to different sessions; one einsum runs in one "
                          "database (read one with np.asarray(tensor), or store it in the other)")
    session = next(iter(owners.values())) if owners else None
    arrays, raw = [], []
    for k, x in enumerate(operands):
        if isinstance(x, (Tensor, str)):
            arrays.append(x if isinstance(x, Tensor) else (session or default_session()).tensor(x))
            raw.append(arrays[-1].dtype)
        else:
            a = read_array(x, f"operand {k}")
            raw.append(a.dtype)
            arrays.append(a)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise EinsumTypeError(f"out must be a numpy array, got {type(out).__name__}")
        if not out.flags.writeable:
            raise EinsumError("out is read-only")
    plain = (join is None or _named(join, "mul")) and (agg is None or _named(agg, "sum"))
    shapes = [x.shape for x in arrays]
    compute = kernel_dtype = None
    # numpy's view case is its plain product's: a join (``square``) or an aggregation computes,
    # and dtype= then widens or casts it as elsewhere (it was ignored: int8 squares wrapped)
    if out is None and plain and _is_view_case(spec, shapes):
        if dtype is not None:  # numpy ignores it here (a view), but it must be a dtype
            try:
                np.dtype(dtype)
            except Exception as e:  # noqa: BLE001 - numpy raises TypeError/ValueError/...
                raise EinsumTypeError(f"einsum dtype: {dtype!r} is not a dtype ({e})") from None
    else:
        ct = None if dtype is None else np.dtype(check_dtype(dtype, "einsum dtype"))
        compute = _computation_dtype(ct, raw, out if plain else None, casting)
        promoted = promote(*raw)
        if plain and compute != promoted:
            # a product summed computes in ``compute`` inside its kernels, each tile cast there:
            # no operand is cast whole first (a stored one read back to be cast)
            kernel_dtype = compute
        elif ct is not None or compute != promoted:
            # another join computes in its operands' dtypes: cast them first, as numpy would (a
            # stored operand of another dtype is read back to be cast)
            arrays = [x if x.dtype == compute and (isinstance(x, Tensor) or x.dtype.isnative)
                      else np.asarray(x).astype(compute) for x in arrays]
    arrays = [native(x) if isinstance(x, np.ndarray) else x for x in arrays]
    session = session or default_session()
    if out is not None:
        parsed = parse_spec(spec, shapes)
        shape = tuple(parsed.size[lab] for lab in parsed.output)
        if out.shape != shape:
            raise EinsumError(f"out has shape {out.shape} but the einsum {spec!r} gives shape {shape}")
        # numpy reads and writes out in the computation dtype; another join's result dtype is
        # the plan's (cached: the run below reuses the plan)
        rdt = compute if plain else np.dtype(session.plan(spec, *arrays, join=join, agg=agg).result.dtype)
        for frm, to in ((rdt, out.dtype), (out.dtype, rdt) if plain else (rdt, out.dtype)):
            if not can_cast(frm, to, casting):
                raise _cast_error("out", frm, to, casting)
    r = session.einsum_numpy(spec, *arrays, join=join, agg=agg, progress=progress, path=path, dtype=kernel_dtype,
                             casting="unsafe")  # (the cast was checked above, under ``casting``)
    if out is not None:
        if r.dtype.kind == "c" and out.dtype.kind != "c":
            # numpy's warning, at the caller's line (np.copyto's pointed into this file: a trial)
            warn("Casting complex values to real discards the imaginary part", np.exceptions.ComplexWarning)
            r = r.real
        np.copyto(out, r, casting="unsafe")  # the rule was checked above, on numpy's dtypes
        return out
    if order == "F" or (order == "A" and all(isinstance(x, np.ndarray) and x.flags.f_contiguous for x in arrays)):
        r = np.asarray(r, order="F")
    return r[()] if r.ndim == 0 else r


# help() shows the call as numpy documents its own: the spec first, then the operands
_P = inspect.Parameter
einsum.__signature__ = inspect.Signature(
    [_P("spec", _P.POSITIONAL_ONLY), _P("operands", _P.VAR_POSITIONAL)]
    + [p for p in inspect.signature(einsum).parameters.values() if p.kind is _P.KEYWORD_ONLY]
)


def topk(spec: str, k: int, *operands, join=None, agg=None, largest: bool = True, progress=None, dtype=None,
         casting="safe"):
    """The ``k`` largest elements of every row of an (extended) einsum's result:
    ``TopK(values, indices)``, numpy arrays, as ``torch.topk`` returns them.

    >>> q = np.array([[1., 0.], [0., 1.]]); e = np.array([[1., 0.], [0.9, 0.1], [0., 2.]])
    >>> topk("id,jd->ij", 1, q, e)   # each query's most similar item
    TopK(values=array([[1.],
           [2.]]), indices=array([[0],
           [2]]))

    A row is every output label but the last; the last output label is ranked. Both arrays
    have the result's shape with its last dimension ``min(k, n)``; ``indices`` (int64) index
    the ranked label. Best first, NaN after every number, ties by the smaller index (the order
    numpy's stable ``argsort`` gives; ``torch.topk`` ranks NaN as the largest); ``largest=False``:
    smallest first. ``operands``, ``join``, ``agg``, ``progress``, ``dtype`` and ``casting`` as
    ``einsum`` takes them (the spec a string, not numpy's sublist form); a Tensor runs in its
    own session, arrays in the in-memory one. That session has no memory budget: the product
    is computed into an array (held once, as numpy holds ``q @ e.T``) and ranked in bands of
    rows. To rank a product bigger than memory, use a session with one:
    ``eds.connect(memory="2GB").topk(...)`` runs it in the budget's statements and ranks it a
    batch at a time (``Session.topk``).
    """
    owners = {id(x.session): x.session for x in operands if isinstance(x, Tensor)}
    if len(owners) > 1:
        raise EinsumError("topk: the Tensor operands belong to different sessions; one einsum runs in one "
                          "database (read one with np.asarray(tensor), or store it in the other)")
    session = next(iter(owners.values())) if owners else default_session()
    return session.topk(spec, k, *operands, join=join, agg=agg, largest=largest, progress=progress, dtype=dtype,
                        casting=casting)
