"""The kernel spec: what a tile kernel reads to know its step, typed and versioned.

The compiler puts a spec's JSON in the SQL as the first argument of every tile UDF
(``kernel_spec(step)``); the kernels (``udfs/``) read it back with ``from_json``, which refuses
a version, op or device it does not know. A spec names the device its kernels run on; which
devices have kernels is the kernels' business (``udfs/devices.py``), the spec only carries the
name. A user's join callable travels with the spec in one of two ways:

- **live** (the default, for kernels in the planning process): a token, random per process
  plus the function's id, that a weak process-local table resolves to the function itself. The
  function runs as it is now (a closure that changes between calls computes with its current
  values), nothing is pickled, nothing big enters the SQL text, and the table forgets a
  function when it goes (a plan holds its callables while it is cached).
- **portable** (``kernel_spec(step, portable=True)``, for executors in other processes): the
  function cloudpickled (base64) and signed (HMAC-SHA256 under ``set_spec_key``'s key). Only a
  reader that asks for pickles (``KernelJoin.function(allow_pickle=True)``) unpickles one, and
  only a correctly signed one. The kernels DuckDB calls never do: SQL on the connection can call
  them with any text, and unpickling runs code.

Pure: stdlib, numpy and the notation; cloudpickle is imported only when a callable is pickled
or unpickled.

>>> spec = FillKernelSpec(shape=(0, 3), tile=(1, 3), dtype="float64", value=0.0)
>>> to_json(spec)
'{"device":"cpu","dtype":"float64","op":"fill","shape":[0,3],"tile":[1,3],"v":1,"value":0.0}'
>>> from_json(to_json(spec)) == spec
True
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import math
import os
import pickle
import threading
import weakref
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Union

import ml_dtypes  # noqa: F401 - "bfloat16" names a numpy dtype (a worker may decode a spec first)
import numpy as np

from ..errors import EinsumError
from ..notation.functions import AGGREGATIONS, JoinFunction

SPEC_VERSION = 1
# version 2 adds the einsum's optional "fused" program (element-wise stages around the
# contraction, ``KernelFusion``); a spec is written with the lowest version that can say it, so
# every unfused step's spec stays version 1
FUSED_VERSION = 2
# version 3 adds op "program": einsum specs run one after the other in one call (ProgramKernelSpec)
PROGRAM_VERSION = 3
# version 4 adds contraction stages in a fused program (``KernelStage.agg``: a chain's producer
# computed inside its consumer's kernel, plan/passes/chains.py); a reader of versions 1-3 refuses
# such a spec by its version, not by an unknown key
CHAIN_VERSION = 4
# version 5 adds an einsum's "args": the tile argument each operand reads, where an operand
# repeats an earlier one (``operand_args``)
REPEAT_VERSION = 5
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5)
# device names a spec may carry; whether this process has kernels for one is udfs/devices.py's
DEVICES = ("cpu", "cuda")
# the most tiles one kernel call takes: engines register a UDF per arity up to this, so a fused
# step may not join more operands (a random graph fused ten into one: "eds_einsum10 does not exist")
MAX_OPERANDS = 8
OPS = ("einsum", "retile", "fill", "program")


def shared_operands(inputs, reduced, size: dict, tile: dict) -> tuple[int, ...]:
    """The operands of a grouped einsum step whose tile is the same in every member of a
    group: those that carry no reduced label cut in several pieces (``tile < size``), so their
    keys are group keys or 0. The step's SQL gathers such a tile once per group, not once per
    member (``SQLCompiler.einsum_groups``); the kernels read the same rule from the spec, and
    the cost model prices it (``plan.cost.step_costs``). Empty for a step that is not grouped.

    >>> shared_operands([("b", "j"), ("j", "o"), ("o", "i")], ("j", "o"), {"b": 8, "j": 4, "o": 8, "i": 2},
    ...                 {"b": 4, "j": 4, "o": 2, "i": 2})
    (0,)
    """
    cut = {lab for lab in reduced if tile[lab] < size[lab]}
    if not cut:
        return ()
    return tuple(k for k, labels in enumerate(inputs) if not cut & set(labels))


def operand_args(operands) -> tuple[int, ...] | None:
    """The tile argument each operand of an einsum reads, where an operand repeats an earlier
    one, or None where none does. An operand repeats another when it reads the same value under
    the same labels (``ij,ij->i`` of X with itself, a graph's ``x * x``): its tile is the other's
    in every joined row, so the step's SQL reads that table once, joins nothing for it and hands
    the tile to the kernel once (``SQLCompiler.einsum_rows``). Row norms of a 614 MB matrix in
    49 tiles joined it with itself: 1.2-2.2 s and 3.5 GB; read once, 0.16-0.22 s.

    >>> from collections import namedtuple
    >>> Op = namedtuple("Op", "value labels dropped")
    >>> operand_args([Op("x", "ij", ()), Op("w", "jk", ()), Op("x", "ij", ())])
    (0, 1, 0)
    >>> operand_args([Op("x", "ij", ()), Op("x", "ji", ())]) is None
    True
    """
    first: dict = {}
    args = tuple(first.setdefault((op.value, tuple(op.labels), tuple(op.dropped)), len(first)) for op in operands)
    return args if len(first) < len(args) else None


def read_operands(args: tuple[int, ...] | None, n: int) -> list[int]:
    """The operands whose tiles a call hands (the first of each repeated one), in order."""
    if args is None:
        return list(range(n))
    return [k for k in range(n) if args[k] not in args[:k]]


def operands_read(operands) -> list[int]:
    """``read_operands`` of an einsum node's operands (``operand_args``)."""
    return read_operands(operand_args(operands), len(operands))


def _check_device(device) -> str:
    if device not in DEVICES:
        raise EinsumError(f"kernel spec device {device!r} is unknown; devices are {', '.join(DEVICES)}")
    return device


def _check_version(version) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise EinsumError(f"kernel spec version {version!r} is not supported; this eindecomp_sql reads version "
                          f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    return version


def _check_dtype(dtype) -> str:
    if not isinstance(dtype, str):
        raise EinsumError(f"kernel spec dtype must be a string, got {dtype!r}")
    try:
        np.dtype(dtype)
    except TypeError:
        raise EinsumError(f"kernel spec dtype {dtype!r} is not a numpy dtype") from None
    return dtype


def _ints(xs, what: str) -> tuple[int, ...]:
    xs = tuple(xs)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in xs):
        raise EinsumError(f"kernel spec {what} must be integers, got {list(xs)!r}")
    return xs


def _labels(xs, what: str) -> tuple[str, ...]:
    xs = tuple(xs)
    if not all(isinstance(x, str) for x in xs):
        raise EinsumError(f"kernel spec {what} must be label strings, got {list(xs)!r}")
    return xs


def _sizes(d, what: str) -> dict[str, int]:
    d = dict(d)
    _labels(d, what)
    _ints(d.values(), what)
    return d


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)  # normalising fields of a frozen dataclass


# -- callables ------------------------------------------------------------------------------

# id(fn) -> (weak reference to fn, its pickle): a function is pickled once, and forgotten with it
_pickled: dict[int, tuple[weakref.ref, str]] = {}
# live token -> the function, while it lives (a strong reference where it takes no weak one)
_live: "weakref.WeakValueDictionary[str, Callable]" = weakref.WeakValueDictionary()
_live_strong: dict[str, Callable] = {}


_PROCESS_KEY = os.urandom(32)
_key: bytes = _PROCESS_KEY
# live tokens start with this process's nonce: a token from elsewhere (another process, a
# forked child's parent, hand-written SQL) never resolves to a function here
_NONCE = os.urandom(8).hex()


def set_spec_key(key: bytes) -> None:
    """The key portable specs are signed and checked with: processes that run each other's
    plans share one (handed over by the job, not through the environment, which SQL can read
    from ``/proc``). By default a random key of this process."""
    global _key
    if not isinstance(key, bytes) or len(key) < 16:
        raise EinsumError("the spec key must be at least 16 random bytes")
    _key = key


def _spec_key() -> bytes:
    return _key


def _new_nonce() -> None:  # a forked child is another process
    global _NONCE
    _NONCE = os.urandom(8).hex()


os.register_at_fork(after_in_child=_new_nonce)


def sign(text: str) -> str:
    """The HMAC-SHA256 (hex) of a pickled callable under this process's spec key."""
    return hmac.new(_spec_key(), text.encode("ascii"), hashlib.sha256).hexdigest()


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _pickled.get(key)
    if entry is not None and entry[0] is ref:
        del _pickled[key]


def _callable_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def live_token(fn: Callable) -> str:
    """A token this process resolves back to ``fn`` while it lives (``nonce:id``)."""
    token = f"{_NONCE}:{id(fn)}"
    try:
        _live[token] = fn
    except TypeError:  # takes no weak reference (a builtin): module-level, kept
        _live_strong[token] = fn
    return token


_fresh = threading.local()  # .active: pickle_callable ignores its cache inside fresh_pickles()


@contextlib.contextmanager
def fresh_pickles():
    """Within: callables are pickled anew. A pickle is a snapshot of what the function reads
    (globals, closures): the Spark workers must see their state at this run, not the first."""
    before = getattr(_fresh, "active", False)
    _fresh.active = True
    try:
        yield
    finally:
        _fresh.active = before


def pickle_callable(fn: Callable) -> str:
    """``fn`` as base64 text of its cloudpickle, cached while ``fn`` lives.

    An unpicklable callable (one closing over a lock, a connection, an open file) is an
    ``EinsumError`` naming it.
    """
    key = id(fn)
    entry = _pickled.get(key)
    if entry is not None and entry[0]() is fn and not getattr(_fresh, "active", False):  # per thread
        return entry[1]
    import cloudpickle

    try:
        data = cloudpickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - whatever stops pickling, the answer is the same
        raise EinsumError(
            f"join callable {_callable_name(fn)!r} cannot be pickled for the tile kernels "
            f"({type(e).__name__}: {e}); define it at module level or make it (and what it closes over) picklable"
        ) from e
    text = base64.b64encode(data).decode("ascii")
    try:
        ref = weakref.ref(fn, lambda r, key=key: _forget(key, r))
    except TypeError:  # no weak references to it (a builtin, a class with __slots__): not cached
        return text
    _pickled[key] = (ref, text)
    return text


def unpickle_callable(text: str, signature: str | None = None) -> Callable:
    """The callable ``pickle_callable`` wrote (a copy: what it closes over is copied too),
    after checking ``signature`` (``sign(text)``): unpickling runs code, so only a pickle signed
    under this process's spec key is read."""
    if not isinstance(signature, str) or not hmac.compare_digest(signature, sign(text)):
        raise EinsumError("kernel spec callable is not signed by this process's spec key (unpickling runs "
                          "code, so only plans made here, or by processes sharing EDS_SPEC_KEY, may carry callables)")
    import cloudpickle  # noqa: F401 - the pickle's reducers live in it

    try:
        fn = pickle.loads(base64.b64decode(text.encode("ascii"), validate=True))
    except Exception as e:  # noqa: BLE001
        raise EinsumError(f"kernel spec callable cannot be unpickled ({type(e).__name__}: {e})") from e
    if not callable(fn):
        raise EinsumError(f"kernel spec callable unpickled to a {type(fn).__name__}, which is not callable")
    return fn


@dataclass(frozen=True)
class KernelJoin:
    """The join of an einsum kernel: exactly one of a name (``"mul"``), an expression
    (``"relu(x - y)"``) or a pickled callable (``pickle_callable``).

    >>> KernelJoin.of(JoinFunction(name="add"))
    KernelJoin(name='add', expr=None, pickled=None, signature=None, live=None)
    >>> KernelJoin(expr="x * y").function().expr
    'x * y'
    """

    name: str | None = None
    expr: str | None = None
    pickled: str | None = None  # base64 of cloudpickle.dumps(fn)
    signature: str | None = None  # sign(pickled)
    live: str | None = None  # live_token(fn): the planning process runs the function itself

    def __post_init__(self):
        func = self.live if self.pickled is None else self.pickled
        given = [v for v in (self.name, self.expr, func) if v is not None]
        if len(given) != 1 or not all(isinstance(v, str) for v in given):
            raise EinsumError(f"kernel spec join must be one of a name, an expression or a callable, got {self}")

    @classmethod
    def of(cls, join: JoinFunction, portable: bool = False) -> KernelJoin:
        if join.func is not None:
            if not portable:
                return cls(live=live_token(join.func))
            text = pickle_callable(join.func)
            return cls(pickled=text, signature=sign(text), live=live_token(join.func))
        if join.expr is not None:
            return cls(expr=join.expr)
        return cls(name=join.name)

    def function(self, allow_pickle: bool = False) -> JoinFunction:
        """The join as the notation describes it. A callable is the live function when the
        spec comes from this process; else, with ``allow_pickle``, the signed pickle."""
        if self.live is not None or self.pickled is not None:
            fn = None
            if self.live is not None and self.live.split(":")[0] == _NONCE:
                fn = _live.get(self.live) or _live_strong.get(self.live)
            if fn is None and self.pickled is not None and allow_pickle:
                fn = unpickle_callable(self.pickled, self.signature)
            if fn is None:
                raise EinsumError(
                    "kernel spec callable is not one of this process's live functions"
                    + ("" if self.pickled is None else " (its pickle is read only by executors that ask for pickles)")
                    + ": a plan with a Python callable join runs in the process that planned it")
            return JoinFunction(func=fn, func_id=id(fn))
        if self.expr is not None:
            return JoinFunction(expr=self.expr)
        return JoinFunction(name=self.name)

    def to_dict(self) -> dict:
        if self.pickled is not None:
            return {"callable": {"pickle": self.pickled, "sig": self.signature, "live": self.live}}
        if self.live is not None:
            return {"callable": {"live": self.live}}
        if self.expr is not None:
            return {"expr": self.expr}
        return {"name": self.name}

    @classmethod
    def from_dict(cls, d) -> KernelJoin:
        if not isinstance(d, dict) or len(d) != 1 or next(iter(d)) not in ("name", "expr", "callable"):
            raise EinsumError(f"kernel spec join must be one of {{name}}, {{expr}}, {{callable}}, got {d!r}")
        (key, value), = d.items()
        if key != "callable":
            return cls(**{key: value})
        if isinstance(value, dict) and set(value) == {"live"} and isinstance(value["live"], str):
            return cls(live=value["live"])
        if not isinstance(value, dict) or set(value) != {"pickle", "sig", "live"}:
            raise EinsumError(f"kernel spec join callable must be {{live}} or {{pickle, sig, live}}, got {value!r:.80}")
        return cls(pickled=value["pickle"], signature=value["sig"], live=value["live"])


# -- the specs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelStage:
    """One element-wise join inside a fused kernel: ``out[labels] = join(slots args...)``,
    broadcast the numpy way by label, stored in ``dtype`` as an unfused step would store it.
    ``cast``: the inputs are cast to ``dtype`` before the join (a product summed follows
    ``np.einsum``, which computes in the result dtype). Slots are numbered as ``KernelFusion`` says.

    ``agg``: a *contraction* stage (a chain's producer fused into its consumer's step:
    ``plan/passes/chains.py``): the labels its slots carry that ``labels`` lacks are reduced
    by ``agg`` (each whole in the tiles: the plan never cuts them), as an unfused step's
    kernel would. Written only when set, so element-wise stages read as before.

    >>> KernelStage(args=(2, 1), join=KernelJoin(name="add"), labels=("i", "k"), dtype="float64").to_dict()
    {'args': [2, 1], 'join': {'name': 'add'}, 'out': ['i', 'k'], 'dtype': 'float64', 'cast': False}
    """

    args: tuple[int, ...]
    join: KernelJoin
    labels: tuple[str, ...]
    dtype: str
    cast: bool = False
    agg: str | None = None

    def __post_init__(self):
        _set(self, "args", _ints(self.args, "fused stage args"))
        if not self.args:
            raise EinsumError("kernel spec fused stage reads no slot")
        if isinstance(self.join, dict):
            _set(self, "join", KernelJoin.from_dict(self.join))
        if not isinstance(self.join, KernelJoin):
            raise EinsumError(f"kernel spec fused stage join must be a KernelJoin, got {self.join!r}")
        _set(self, "labels", _labels(self.labels, "fused stage labels"))
        _check_dtype(self.dtype)
        if not isinstance(self.cast, bool):
            raise EinsumError(f"kernel spec fused stage cast must be true or false, got {self.cast!r}")
        if self.agg is not None and self.agg not in AGGREGATIONS:
            raise EinsumError(f"kernel spec fused stage agg {self.agg!r} is unknown; aggregations are "
                              f"{', '.join(AGGREGATIONS)}")

    def to_dict(self) -> dict:
        d = {"args": list(self.args), "join": self.join.to_dict(), "out": list(self.labels), "dtype": self.dtype,
             "cast": self.cast}
        if self.agg is not None:
            d["agg"] = self.agg
        return d

    @classmethod
    def from_dict(cls, d) -> KernelStage:
        keys = {"args", "join", "out", "dtype", "cast"}
        if not isinstance(d, dict) or not keys <= set(d) or not set(d) <= keys | {"agg"}:
            raise EinsumError(f"kernel spec fused stage must be {{args, join, out, dtype, cast[, agg]}}, got {d!r:.80}")
        return cls(args=d["args"], join=KernelJoin.from_dict(d["join"]), labels=d["out"], dtype=d["dtype"],
                   cast=d["cast"], agg=d.get("agg"))


@dataclass(frozen=True)
class KernelFusion:
    """What a fused einsum kernel computes around its contraction (``EinsumKernelSpec.fused``).

    Slots hold tiles: ``0 .. n-1`` the step's input tiles (the spec's ``inputs``), then one per
    prologue, then the contraction's result, then one per epilogue. Prologues read input tiles
    and earlier prologues; the contraction (the spec's ``join`` and ``agg``) reads ``core``
    slots and writes ``core_labels`` in ``core_dtype``; epilogues run once per output tile,
    after the aggregation, on input tiles (the same in every member of a group: their labels
    are output labels), the contraction's result and earlier epilogues. The last slot is the
    output tile.
    """

    core: tuple[int, ...]
    core_labels: tuple[str, ...]
    core_dtype: str
    prologues: tuple[KernelStage, ...] = ()
    epilogues: tuple[KernelStage, ...] = ()

    def __post_init__(self):
        _set(self, "core", _ints(self.core, "fused core args"))
        _set(self, "core_labels", _labels(self.core_labels, "fused core labels"))
        _check_dtype(self.core_dtype)
        for what in ("prologues", "epilogues"):
            stages = tuple(KernelStage.from_dict(x) if isinstance(x, dict) else x for x in getattr(self, what))
            if not all(isinstance(x, KernelStage) for x in stages):
                raise EinsumError(f"kernel spec fused {what} must be stages, got {stages!r:.80}")
            _set(self, what, stages)

    def check(self, inputs: int) -> None:
        """Every stage reads slots defined before it, as the class docstring says."""
        p = len(self.prologues)
        core_slot = inputs + p

        def bad(what, args, allowed):
            wrong = [a for a in args if a not in allowed]
            if wrong:
                raise EinsumError(f"kernel spec fused {what} reads slots {wrong}, which it may not (slots "
                                  f"0..{inputs - 1} are inputs, {inputs}..{core_slot - 1} prologues, {core_slot} the "
                                  "contraction, the rest epilogues)")

        for q, st in enumerate(self.prologues):
            bad(f"prologue {q}", st.args, set(range(inputs + q)))
        bad("core", self.core, set(range(core_slot)))
        for q, st in enumerate(self.epilogues):
            bad(f"epilogue {q}", st.args, set(range(inputs)) | set(range(core_slot, core_slot + 1 + q)))
            if st.agg is not None:
                raise EinsumError(f"kernel spec fused epilogue {q} reduces (agg {st.agg!r}); epilogues are "
                                  "element-wise")

    def to_dict(self) -> dict:
        return {"pro": [x.to_dict() for x in self.prologues], "core": list(self.core),
                "core_out": list(self.core_labels), "core_dtype": self.core_dtype,
                "epi": [x.to_dict() for x in self.epilogues]}

    @classmethod
    def from_dict(cls, d) -> KernelFusion:
        keys = {"pro", "core", "core_out", "core_dtype", "epi"}
        if not isinstance(d, dict) or set(d) != keys:
            raise EinsumError(f"kernel spec fused must have keys {sorted(keys)}, got {d!r:.80}")
        if not isinstance(d["pro"], list) or not isinstance(d["epi"], list):
            raise EinsumError("kernel spec fused prologues and epilogues must be lists")
        return cls(core=d["core"], core_labels=d["core_out"], core_dtype=d["core_dtype"],
                   prologues=tuple(KernelStage.from_dict(x) for x in d["pro"]),
                   epilogues=tuple(KernelStage.from_dict(x) for x in d["epi"]))


@dataclass(frozen=True)
class EinsumKernelSpec:
    """One einsum over tiles: ``out[output] = agg over reduced of join(inputs...)``, every label
    with its size and tile size, and the dtypes in and out.

    >>> spec = EinsumKernelSpec(inputs=(("i", "j"), ("j", "k")), output=("i", "k"), labels=("i", "j", "k"),
    ...                         reduced=("j",), size={"i": 4, "j": 6, "k": 5}, tile={"i": 4, "j": 3, "k": 5},
    ...                         join=KernelJoin(name="mul"), agg="sum", dtypes=("float32", "float32"),
    ...                         out_dtype="float32")
    >>> text = to_json(spec)
    >>> text[:60]
    '{"agg":"sum","device":"cpu","dtypes":["float32","float32"],"'
    >>> from_json(text) == spec, from_json(text).version
    (True, 1)
    """

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    labels: tuple[str, ...]
    reduced: tuple[str, ...]
    size: dict[str, int]
    tile: dict[str, int]
    join: KernelJoin
    agg: str
    dtypes: tuple[str, ...]
    out_dtype: str
    version: int = SPEC_VERSION
    device: str = "cpu"
    # the call is a query the user runs (the SQL interface), not a plan run of the session's:
    # the session's interrupt and progress count leave its kernels alone (udfs/register.py)
    user_query: bool = False
    fused: KernelFusion | None = None  # version 2: element-wise stages around the contraction
    # float32 products on a device may use TF32 tensor cores (10-bit mantissa inputs): opt-in,
    # as numpy users expect exact float32; written only when True, so other specs are unchanged
    tf32: bool = False
    # each operand's value name, by which a kernel finds a tile the SQL handed as NULL: an array
    # operand's in the caller's memory, a device's in its cache (udfs/device_cache.py); not
    # written in specs that travel (Spark's) or that SQL the backend does not run reads
    values: tuple[str, ...] | None = None
    # ... and the value it computes: on a device its tiles may stay there for a later step; a
    # result returned as an array is written straight into it (udfs/register.py: _host_out)
    result: str | None = None
    # version 5: the tile argument each operand reads, where one repeats another (``operand_args``)
    args: tuple[int, ...] | None = None

    op = "einsum"

    def __post_init__(self):
        _set(self, "inputs", tuple(_labels(x, "input labels") for x in self.inputs))
        _set(self, "output", _labels(self.output, "output labels"))
        _set(self, "labels", _labels(self.labels, "labels"))
        _set(self, "reduced", _labels(self.reduced, "reduced labels"))
        _set(self, "size", _sizes(self.size, "sizes"))
        _set(self, "tile", _sizes(self.tile, "tile sizes"))
        if isinstance(self.join, dict):
            _set(self, "join", KernelJoin.from_dict(self.join))
        if not isinstance(self.join, KernelJoin):
            raise EinsumError(f"kernel spec join must be a KernelJoin, got {self.join!r}")
        if self.agg not in AGGREGATIONS:
            raise EinsumError(f"kernel spec agg {self.agg!r} is unknown; aggregations are {', '.join(AGGREGATIONS)}")
        _set(self, "dtypes", tuple(_check_dtype(d) for d in self.dtypes))
        _check_dtype(self.out_dtype)
        _check_version(self.version)
        _check_device(self.device)
        missing = [lab for lab in self.labels if lab not in self.size or lab not in self.tile]
        if missing or len(self.dtypes) != len(self.inputs):
            raise EinsumError(f"kernel spec einsum is inconsistent: labels without size or tile {missing}, "
                              f"{len(self.inputs)} inputs and {len(self.dtypes)} dtypes")
        if isinstance(self.fused, dict):
            _set(self, "fused", KernelFusion.from_dict(self.fused))
        if self.fused is not None:
            self._check_fused()
        if self.args is not None:
            self._check_args()

    def _check_args(self) -> None:
        _set(self, "args", _ints(self.args, "args"))
        args = self.args
        n = len(self.inputs)
        firsts = [a for k, a in enumerate(args) if a not in args[:k]]
        if self.version < REPEAT_VERSION or len(args) != n or firsts != list(range(len(firsts))) or any(
                (self.inputs[k], self.dtypes[k]) != (self.inputs[args.index(a)], self.dtypes[args.index(a)])
                for k, a in enumerate(args)):
            raise EinsumError(f"kernel spec einsum args {list(args)} do not fit its {n} inputs {list(self.inputs)} "
                              f"(version {self.version}; each operand reads argument 0, 1, ... in order of first use, "
                              f"an argument read twice under the same labels and dtype, from version {REPEAT_VERSION})")

    def _check_fused(self) -> None:
        f = self.fused
        if not isinstance(f, KernelFusion):
            raise EinsumError(f"kernel spec einsum fused must be a KernelFusion, got {f!r:.80}")
        if self.version < FUSED_VERSION:
            raise EinsumError(f"kernel spec einsum: a fused program needs version {FUSED_VERSION}, the spec says "
                              f"{self.version}")
        f.check(len(self.inputs))
        if any(st.agg is not None for st in f.prologues) and self.version < CHAIN_VERSION:
            raise EinsumError(f"kernel spec einsum: a fused program with a contraction stage needs version "
                              f"{CHAIN_VERSION}, the spec says {self.version}")
        known = set(self.labels)
        stages = list(f.prologues) + list(f.epilogues)
        unknown = sorted(({lab for st in stages for lab in st.labels} | set(f.core_labels)) - known)
        last = f.epilogues[-1] if f.epilogues else None
        out, dtype = (last.labels, last.dtype) if last else (f.core_labels, f.core_dtype)
        if unknown or out != self.output or dtype != self.out_dtype:
            raise EinsumError(f"kernel spec einsum fused program is inconsistent: unknown labels {unknown}, its last "
                              f"slot is {list(out)} {dtype} where the output is {list(self.output)} {self.out_dtype}")

    def _body(self) -> dict:
        body = {"in": [list(x) for x in self.inputs], "out": list(self.output), "labels": list(self.labels),
                "reduced": list(self.reduced), "size": dict(self.size), "tile": dict(self.tile),
                "join": self.join.to_dict(), "agg": self.agg, "dtypes": list(self.dtypes),
                "out_dtype": self.out_dtype}
        if self.fused is not None:
            body["fused"] = self.fused.to_dict()
        if self.tf32:
            body["tf32"] = True
        if self.values is not None:
            body["values"] = list(self.values)
        if self.result is not None:
            body["result"] = self.result
        if self.args is not None:
            body["args"] = list(self.args)
        return body

    @classmethod
    def _from_body(cls, b: dict, version: int, device: str) -> EinsumKernelSpec:
        fused = b.get("fused")
        if not isinstance(b.get("tf32", False), bool):
            raise EinsumError(f"kernel spec einsum tf32 must be true or false, got {b['tf32']!r}")
        return cls(inputs=b["in"], output=b["out"], labels=b["labels"], reduced=b["reduced"], size=b["size"],
                   tile=b["tile"], join=KernelJoin.from_dict(b["join"]), agg=b["agg"], dtypes=b["dtypes"],
                   out_dtype=b["out_dtype"], version=version, device=device,
                   fused=KernelFusion.from_dict(fused) if fused is not None else None, tf32=b.get("tf32", False),
                   values=_values(b.get("values"), len(b["in"])), result=_result(b.get("result")),
                   args=_list(b.get("args"), "args"))


@dataclass(frozen=True)
class RetileKernelSpec:
    """Re-cut a tensor of ``shape`` from tiles of ``source_tile`` into tiles of ``target_tile``;
    ``first_key_range`` limits one statement to target tiles whose key on axis ``key_axis``
    (default 0, the first) is in [lo, hi).

    >>> spec = RetileKernelSpec(shape=(5, 6), source_tile=(5, 2), target_tile=(3, 5), dtype="float64")
    >>> to_json(spec)
    '{"device":"cpu","dtype":"float64","from":[5,2],"op":"retile","shape":[5,6],"to":[3,5],"v":1}'
    >>> from_json(to_json(spec)) == spec
    True
    """

    shape: tuple[int, ...]
    source_tile: tuple[int, ...]
    target_tile: tuple[int, ...]
    dtype: str
    first_key_range: tuple[int, int] | None = None
    version: int = SPEC_VERSION
    device: str = "cpu"
    # the call is a query the user runs (the SQL interface), not a plan run of the session's:
    # the session's interrupt and progress count leave its kernels alone (udfs/register.py)
    user_query: bool = False
    key_axis: int = 0

    op = "retile"

    def __post_init__(self):
        _set(self, "shape", _ints(self.shape, "shape"))
        _set(self, "source_tile", _ints(self.source_tile, "source tile"))
        _set(self, "target_tile", _ints(self.target_tile, "target tile"))
        if not len(self.shape) == len(self.source_tile) == len(self.target_tile):
            raise EinsumError(f"kernel spec retile: shape {self.shape}, tiles {self.source_tile} and "
                              f"{self.target_tile} differ in rank")
        _check_dtype(self.dtype)
        if self.first_key_range is not None:
            r = _ints(self.first_key_range, "first key range")
            if len(r) != 2:
                raise EinsumError(f"kernel spec first key range must be [lo, hi], got {list(r)!r}")
            _set(self, "first_key_range", r)
        if isinstance(self.key_axis, bool) or not isinstance(self.key_axis, int) \
                or not 0 <= self.key_axis < max(len(self.shape), 1):
            raise EinsumError(f"kernel spec key_axis must be an axis of shape {self.shape}, got {self.key_axis!r}")
        _check_version(self.version)
        _check_device(self.device)

    def _body(self) -> dict:
        body = {"shape": list(self.shape), "from": list(self.source_tile), "to": list(self.target_tile),
                "dtype": self.dtype}
        if self.first_key_range is not None:
            body["first_key_range"] = list(self.first_key_range)
        if self.key_axis:
            body["key_axis"] = self.key_axis
        return body

    @classmethod
    def _from_body(cls, b: dict, version: int, device: str) -> RetileKernelSpec:
        return cls(shape=b["shape"], source_tile=b["from"], target_tile=b["to"], dtype=b["dtype"],
                   first_key_range=b.get("first_key_range"), version=version, device=device,
                   key_axis=b.get("key_axis", 0))


@dataclass(frozen=True)
class FillKernelSpec:
    """Tiles of ``shape`` cut by ``tile``, every element ``value`` (an einsum over a label of
    size 0: the aggregation's identity).

    >>> spec = FillKernelSpec(shape=(3, 4), tile=(3, 4), dtype="float32", value=1.0)
    >>> from_json(to_json(spec))
    FillKernelSpec(shape=(3, 4), tile=(3, 4), dtype='float32', value=1.0, version=1, device='cpu', user_query=False)
    >>> '"user":true' in to_json(replace(spec, user_query=True))  # a user's query's: the session's interrupt leaves it
    True
    """

    shape: tuple[int, ...]
    tile: tuple[int, ...]
    dtype: str
    value: float | int | bool
    version: int = SPEC_VERSION
    device: str = "cpu"
    # the call is a query the user runs (the SQL interface), not a plan run of the session's:
    # the session's interrupt and progress count leave its kernels alone (udfs/register.py)
    user_query: bool = False

    op = "fill"

    def __post_init__(self):
        _set(self, "shape", _ints(self.shape, "shape"))
        _set(self, "tile", _ints(self.tile, "tile"))
        if len(self.shape) != len(self.tile):
            raise EinsumError(f"kernel spec fill: shape {self.shape} and tile {self.tile} differ in rank")
        _check_dtype(self.dtype)
        if isinstance(self.value, np.generic):
            _set(self, "value", self.value.item())
        if not isinstance(self.value, (bool, int, float)):
            raise EinsumError(f"kernel spec fill value must be a number, got {self.value!r}")
        _check_version(self.version)
        _check_device(self.device)

    def _body(self) -> dict:
        return {"shape": list(self.shape), "tile": list(self.tile), "dtype": self.dtype, "value": self.value}

    @classmethod
    def _from_body(cls, b: dict, version: int, device: str) -> FillKernelSpec:
        return cls(shape=b["shape"], tile=b["tile"], dtype=b["dtype"], value=b["value"], version=version,
                   device=device)


@dataclass(frozen=True)
class ProgramKernelSpec:
    """Einsums over single tiles computed one after the other in one kernel call: the call
    gets one tile per input (``dtypes``); ``steps[j]`` reads the slots ``args[j]``, where slots
    0..n-1 are the inputs and slot n+j is step j's result; the last step's result is the
    call's. Each step is an ``EinsumKernelSpec`` whose tiles hold whole values.

    >>> one = EinsumKernelSpec(inputs=(("i", "j"), ("j", "k")), output=("i", "k"), labels=("i", "j", "k"),
    ...                        reduced=("j",), size={"i": 2, "j": 3, "k": 2}, tile={"i": 2, "j": 3, "k": 2},
    ...                        join=KernelJoin(name="mul"), agg="sum", dtypes=("float64", "float64"),
    ...                        out_dtype="float64")
    >>> spec = ProgramKernelSpec(steps=(one, one), args=((0, 1), (2, 1)), dtypes=("float64", "float64"))
    >>> from_json(to_json(spec)) == spec
    True
    >>> ProgramKernelSpec(steps=(one,), args=((0, 2),), dtypes=("float64", "float64"))
    Traceback (most recent call last):
    ...
    eindecomp_sql.errors.EinsumError: kernel spec program step 0 reads slot 2, but only slots 0..1 are defined before it
    """

    steps: tuple[EinsumKernelSpec, ...]
    args: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    version: int = PROGRAM_VERSION
    device: str = "cpu"
    # the call is a query the user runs (the SQL interface), not a plan run of the session's:
    # the session's interrupt and progress count leave its kernels alone (udfs/register.py)
    user_query: bool = False
    values: tuple[str, ...] | None = None  # each input's value name (EinsumKernelSpec.values)
    result: str | None = None  # ... and the value it computes

    op = "program"

    def __post_init__(self):
        steps = tuple(_from_dict(dict(x)) if isinstance(x, dict) else x for x in self.steps)
        if not steps or not all(isinstance(x, EinsumKernelSpec) for x in steps):
            raise EinsumError(f"kernel spec program steps must be einsum specs, got {self.steps!r:.80}")
        _set(self, "steps", steps)
        _set(self, "args", tuple(_ints(a, "program step args") for a in self.args))
        _set(self, "dtypes", tuple(_check_dtype(d) for d in self.dtypes))
        _check_version(self.version)
        if self.version < PROGRAM_VERSION:
            raise EinsumError(f"kernel spec program needs version {PROGRAM_VERSION}, the spec says {self.version}")
        _check_device(self.device)
        if len(self.args) != len(steps):
            raise EinsumError(f"kernel spec program has {len(steps)} steps and {len(self.args)} argument lists")
        slots = list(self.dtypes)
        for j, (step, args) in enumerate(zip(steps, self.args)):
            if step.device != self.device:
                raise EinsumError(f"kernel spec program step {j} runs on {step.device!r}, the program on {self.device!r}")
            if len(args) != len(step.inputs):
                raise EinsumError(f"kernel spec program step {j} has {len(step.inputs)} inputs but reads {len(args)} slots")
            for a, want in zip(args, step.dtypes):
                if not 0 <= a < len(slots):
                    raise EinsumError(f"kernel spec program step {j} reads slot {a}, but only slots "
                                      f"0..{len(slots) - 1} are defined before it")
                if slots[a] != want:
                    raise EinsumError(f"kernel spec program step {j} wants {want} from slot {a}, which holds {slots[a]}")
            slots.append(step.out_dtype)

    @property
    def out_dtype(self) -> str:
        return self.steps[-1].out_dtype

    def _body(self) -> dict:
        body = {"steps": [_as_dict(x) for x in self.steps], "args": [list(a) for a in self.args],
                "dtypes": list(self.dtypes)}
        if self.values is not None:
            body["values"] = list(self.values)
        if self.result is not None:
            body["result"] = self.result
        return body

    @classmethod
    def _from_body(cls, b: dict, version: int, device: str) -> ProgramKernelSpec:
        if not isinstance(b["steps"], list) or not all(isinstance(x, dict) for x in b["steps"]):
            raise EinsumError(f"kernel spec program steps must be a list of specs, got {b['steps']!r:.80}")
        return cls(steps=tuple(_from_dict(dict(x)) for x in b["steps"]), args=b["args"], dtypes=b["dtypes"],
                   version=version, device=device, values=_values(b.get("values"), len(b["dtypes"])),
                   result=_result(b.get("result")))


KernelSpec = Union[EinsumKernelSpec, RetileKernelSpec, FillKernelSpec, ProgramKernelSpec]
_CLASSES = {"einsum": EinsumKernelSpec, "retile": RetileKernelSpec, "fill": FillKernelSpec,
            "program": ProgramKernelSpec}
_KEYS = {
    "einsum": {"in", "out", "labels", "reduced", "size", "tile", "join", "agg", "dtypes", "out_dtype"},
    "retile": {"shape", "from", "to", "dtype"},
    "fill": {"shape", "tile", "dtype", "value"},
    "program": {"steps", "args", "dtypes"},
}
_OPTIONAL = {"einsum": {"tf32", "values", "result"}, "retile": {"first_key_range", "key_axis"}, "fill": set(),
             "program": {"values", "result"}}


def _result(result) -> str | None:
    if result is not None and not isinstance(result, str):
        raise EinsumError(f"kernel spec result must be a value name, got {result!r:.80}")
    return result


def _list(xs, what: str) -> list | None:
    if xs is not None and not isinstance(xs, list):
        raise EinsumError(f"kernel spec {what} must be a list, got {xs!r:.80}")
    return xs


def _values(values, n: int) -> tuple[str, ...] | None:
    """A spec's operand value names, checked: one string per operand, or absent."""
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != n or not all(isinstance(v, str) for v in values):
        raise EinsumError(f"kernel spec values must be {n} value names, got {values!r:.80}")
    return tuple(values)
# keys a version adds (a version-1 reader refuses them as unknown)
_OPTIONAL_SINCE = {2: {"einsum": {"fused"}}, REPEAT_VERSION: {"einsum": {"args"}}}


def _optional(op: str, version: int) -> set[str]:
    keys = set(_OPTIONAL[op])
    for v, extra in _OPTIONAL_SINCE.items():
        if version >= v:
            keys |= extra.get(op, set())
    return keys


def _as_dict(spec: KernelSpec) -> dict:
    body = spec._body()
    body.update(v=spec.version, device=spec.device, op=spec.op)
    if spec.user_query:  # written only when True, so every other spec's text is unchanged
        body["user"] = True
    return body


def to_json(spec: KernelSpec) -> str:
    """The spec as compact JSON with sorted keys (equal specs give equal text), with its version
    ``"v"``, ``"device"`` and ``"op"``."""
    return json.dumps(_as_dict(spec), separators=(",", ":"), sort_keys=True)


def from_json(text: str) -> KernelSpec:
    """The spec ``to_json`` wrote; an ``EinsumError`` for an unknown version, op or device, or
    a malformed spec (saying what it got and what it reads).

    >>> from_json('{"v": 6, "op": "fill"}')
    Traceback (most recent call last):
    ...
    eindecomp_sql.errors.EinsumError: kernel spec version 6 is not supported; this eindecomp_sql reads version 1, 2, 3, 4, 5
    """
    try:
        body = json.loads(text)
    except (TypeError, ValueError) as e:
        raise EinsumError(f"kernel spec is not JSON ({e}): {str(text)[:80]!r}") from None
    return _from_dict(body)


def _from_dict(body) -> KernelSpec:
    if not isinstance(body, dict):
        raise EinsumError(f"kernel spec must be a JSON object, got {type(body).__name__}")
    if "v" not in body:
        raise EinsumError(f"kernel spec has no version (\"v\"); this eindecomp_sql reads version "
                          f"{', '.join(map(str, SUPPORTED_VERSIONS))}: keys {sorted(body)}")
    version = _check_version(body.pop("v"))
    op = body.pop("op", None)
    if op not in OPS:
        raise EinsumError(f"kernel spec op {op!r} is unknown; ops are {', '.join(OPS)}")
    device = _check_device(body.pop("device", None))
    user = body.pop("user", False)
    if not isinstance(user, bool):
        raise EinsumError(f"kernel spec user must be true or false, got {user!r:.80}")
    keys = set(body)
    missing, extra = _KEYS[op] - keys, keys - _KEYS[op] - _optional(op, version)
    if missing or extra:
        raise EinsumError(f"kernel spec {op}: missing keys {sorted(missing)}, unknown keys {sorted(extra)}")
    try:
        spec = _CLASSES[op]._from_body(body, version, device)
        return replace(spec, user_query=True) if user else spec
    except EinsumError:
        raise
    except (TypeError, ValueError) as e:
        raise EinsumError(f"kernel spec {op} is malformed ({e})") from None


def host_reason(step, min_work: int = 0) -> str | None:
    """Why ``step`` runs on the host in a session whose kernels run on a device, or None when
    it runs on the device. Data movement stays where the tiles are (DuckDB hands them to the
    UDFs in host memory); a Python callable join is numpy code the device cannot run; and with
    ``min_work`` (``device="auto"``), a step of fewer element operations (the product of its
    labels' sizes, summed over the nodes it runs) is done sooner on the host than sent."""
    from .steps import FillStep, ProgramStep, RetileStep

    if isinstance(step, RetileStep):
        return "a retile moves bytes between tiles in host memory"
    if isinstance(step, FillStep):
        return "a fill writes constant tiles in host memory"
    parts = step.steps if isinstance(step, ProgramStep) else [step]
    work = 0
    for part in parts:
        # a fused step's work is its nodes' (its joined node spans them all: a chain's would
        # count the product of every label of both products)
        nodes = list(part.fused.nodes) if getattr(part, "fused", None) is not None else [part.node]
        for n in nodes:
            if n.join.func is not None:
                return f"its join {n.join.label} is a Python callable (numpy code on host arrays)"
            work += math.prod(dict(n.sizes).values())
    if work < min_work:
        return f"small ({work:,} element operations, under {min_work:,}): quicker on the host than sent"
    return None


def device_only_results(plan, device: str, min_work: int = 0, exclude=frozenset()) -> frozenset[str]:
    """The values of ``plan`` whose tiles may stay on the device, their bytes never copied back
    to DuckDB (TURNIP: a result a later step consumes stays where it was made): computed by a
    step that runs on the device, no output of the plan (nor in ``exclude``), and read only by
    later steps that run there too, which take a tile the device holds as NULL
    (``eds_resident``). A step on the host (a retile, a fill, a callable join, a small step
    under ``auto``) needs the bytes, and so does a reader that drops a size-1 axis of it (numpy
    broadcasting): it names the tile by fewer keys than its writer did, so the cache would not
    find it by that name. Each tile stays only if the device cache has room for it
    (``DeviceCache.hold``); one that has none goes back as bytes, as any other."""
    from .steps import EinsumStep, ProgramStep, step_reads, step_target

    if device == "cpu":
        return frozenset()
    excluded = {v.name for v in plan.outputs} | set(exclude)
    readers: dict[str, list] = {}
    for s in plan.steps:
        for v in step_reads(s):
            readers.setdefault(v.name, []).append(s)
        excluded |= read_with_an_axis_dropped(s)
    kept = set()
    for s in plan.steps:
        name = step_target(s).name
        # (not a partial result: its kernel is not told the kept keys that tell its tiles apart)
        if (isinstance(s, (EinsumStep, ProgramStep)) and name not in excluded and readers.get(name)
                and not (isinstance(s, EinsumStep) and s.node.kept)
                and host_reason(s, min_work) is None
                and all(host_reason(r, min_work) is None for r in readers[name])):
            kept.add(name)
    return frozenset(kept)


def read_with_an_axis_dropped(step) -> set[str]:
    """The values an einsum step reads with a size-1 axis dropped (numpy broadcasting), named as
    its kernel names them (``step.inputs``): its kernel names their tiles by fewer keys than
    the tiles were made with, so it cannot find one by value and keys."""
    from .steps import EinsumStep

    if not isinstance(step, EinsumStep):
        return set()
    return {v.name for v, op in zip(step.inputs, step.node.operands) if op.dropped}


@lru_cache(maxsize=1024)
def inputs_read_by_name(plan) -> frozenset[str]:
    """The inputs of ``plan`` whose every reader is a kernel that can find a tile by its value's
    name and its keys (``udfs/register.py: _host_tile``): an einsum or program step, reading it
    with no axis dropped (a reader dropping a size-1 axis names the tile by fewer keys). An
    array operand among them need not pass through DuckDB at all: the SQL joins its keys and
    hands NULL, and the kernel reads the caller's array. A retile's kernel cuts bytes."""
    from .steps import RetileStep

    named = {v.name for v in plan.inputs}
    for s in plan.steps:
        if isinstance(s, RetileStep):
            named.discard(s.source.name)
        else:
            named -= read_with_an_axis_dropped(s)
    return frozenset(named)


def step_device(step, device: str, min_work: int = 0) -> str:
    """The device ``step``'s kernel runs on in a session whose kernels run on ``device``."""
    return device if device == "cpu" or host_reason(step, min_work) is None else "cpu"


def kernel_spec(step, batch: tuple[int, int] | None = None, device: str = "cpu", portable: bool = False,
                tf32: bool = False, names: bool = True, user_query: bool = False) -> str:
    """The JSON of a plan step's kernel spec: labels, sizes, tile sizes, dtypes, the join, the
    device. ``batch`` is the range of target keys (on the step's batch axis) one statement of
    a retile covers. ``tf32``: float32 products on the device may use TF32. ``names``: the
    operands' value names (by which a kernel finds a tile the SQL handed as NULL: an array
    operand's in the caller's memory, a device's in its cache) and the result's (where a
    result returned as an array, or kept on a device, is put); off for SQL that
    reads every tile from its table (``compile.compiler.for_sql_interface``), whose names
    would otherwise be taken for a plan running beside it. ``user_query``: the SQL is a query
    the user runs (``SELECT * FROM einsum(...)``), whose kernels the session's interrupt does
    not stop."""
    from .steps import FillStep, ProgramStep, RetileStep  # a step module imports the plan package

    if isinstance(step, ProgramStep):
        spec = _program_spec(step, device, portable, tf32, names)
    elif isinstance(step, RetileStep):
        s, t = step.source, step.target
        spec = RetileKernelSpec(shape=s.shape, source_tile=s.tile, target_tile=t.tile, dtype=s.dtype,
                                first_key_range=tuple(batch) if batch is not None else None, device=device,
                                key_axis=step.batch_axis if batch is not None else 0)
    elif isinstance(step, FillStep):
        r = step.result
        spec = FillKernelSpec(shape=r.shape, tile=r.tile, dtype=r.dtype, value=step.value, device=device)
    else:
        spec = _einsum_spec(step, device, portable, tf32, names)
    return to_json(replace(spec, user_query=True) if user_query else spec)


def _einsum_spec(step, device: str, portable: bool, tf32: bool = False, values: bool = True,
                 reads_once: bool = True) -> EinsumKernelSpec:
    node = step.node
    fused = _kernel_fusion(step, portable) if step.fused is not None else None
    args = operand_args(node.operands) if reads_once else None
    version = SPEC_VERSION if fused is None else CHAIN_VERSION if any(st.agg for st in fused.prologues) else FUSED_VERSION
    return EinsumKernelSpec(
        inputs=tuple(tuple(op.labels) for op in node.operands), output=tuple(node.output),
        labels=tuple(node.labels), reduced=tuple(node.reduced), size=dict(node.sizes), tile=step.tile_of,
        join=KernelJoin.of(node.join, portable), agg=node.agg.name, dtypes=tuple(v.dtype for v in step.inputs),
        out_dtype=step.result.dtype, device=device, fused=fused,
        version=REPEAT_VERSION if args is not None else version, tf32=tf32 and device != "cpu", args=args,
        # the operands' names: a tile the SQL hands as NULL is found by them (an array operand's
        # in the caller's memory, a device's in its cache); not in specs that travel (Spark's)
        values=tuple(v.name for v in step.inputs) if values and not portable else None,
        # (not a partial result's: its tiles are told apart by keys the kernel is not given)
        result=step.result.name if values and not portable and not node.kept else None,
    )


def _program_spec(step, device: str, portable: bool, tf32: bool = False, names: bool = True) -> ProgramKernelSpec:
    """A program step's einsums as slots: its inputs, then each step's result."""
    slot = {v.name: k for k, v in enumerate(step.inputs)}
    args = []
    for j, s in enumerate(step.steps):
        args.append(tuple(slot[v.name] for v in s.inputs))
        slot[s.result.name] = len(step.inputs) + j
    # a program's einsums read its slots, each handed once: none repeats an argument
    return ProgramKernelSpec(steps=tuple(_einsum_spec(s, device, portable, tf32, values=False, reads_once=False)
                                         for s in step.steps),
                             args=tuple(args), dtypes=tuple(v.dtype for v in step.inputs), device=device,
                             values=tuple(v.name for v in step.inputs) if names and not portable else None,
                             result=step.result.name if names and not portable else None)


def _kernel_fusion(step, portable: bool) -> KernelFusion:
    """A fused step's nodes (``steps.Fusion``) as slots: the step's operands, then each node's
    result in the order the kernel computes them."""
    f = step.fused
    slot = {(op.value, op.labels, op.dropped): k for k, op in enumerate(step.node.operands)}
    made: dict[str, int] = {}

    def args(n) -> tuple[int, ...]:
        return tuple(made[op.value] if op.value in made else slot[(op.value, op.labels, op.dropped)]
                     for op in n.operands)

    def stage(n) -> KernelStage:
        # the kernels' rule for a product summed (np.einsum's): inputs cast to the result dtype
        return KernelStage(args=args(n), join=KernelJoin.of(n.join, portable), labels=tuple(n.output),
                           dtype=n.result.dtype, cast=n.join.name == "mul" and n.agg.name == "sum",
                           agg=n.agg.name if n.reduced else None)

    nxt = len(step.node.operands)
    prologues = []
    for n in f.prologues:
        prologues.append(stage(n))
        made[n.result.name] = nxt
        nxt += 1
    core = args(f.core)
    made[f.core.result.name] = nxt
    nxt += 1
    epilogues = []
    for n in f.epilogues:
        epilogues.append(stage(n))
        made[n.result.name] = nxt
        nxt += 1
    return KernelFusion(core=core, core_labels=tuple(f.core.output), core_dtype=f.core.result.dtype,
                        prologues=tuple(prologues), epilogues=tuple(epilogues))
