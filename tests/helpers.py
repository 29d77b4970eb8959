import math
import os

import numpy as np

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

settings.register_profile(
    "default",
    deadline=None,
    max_examples=int(os.environ.get("EDS_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("default")

DTYPES = ["float32", "float64", "int32", "int64", "bool", "int8", "int16", "uint8", "uint16", "uint32", "uint64",
          "complex64", "complex128", "float16", "bfloat16"]
# the dtypes np.einsum computes in (it refuses bfloat16): where a test compares keywords and errors
# with numpy's own, it has nothing to compare bfloat16 with (tests/reference.py states its rule)
NUMPY_DTYPES = [d for d in DTYPES if d != "bfloat16"]
# byte orders an array may come in: native, and the other one ('>' on this little-endian machine)
BYTE_ORDERS = ["=", "S"]


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random values that never are all zeros or ones; small ints so products don't overflow."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind == "i":
        return rng.integers(-4, 5, size=shape).astype(dtype)
    if dtype.kind == "u":
        return rng.integers(0, 6, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def with_byte_order(a: np.ndarray, order: str) -> np.ndarray:
    """``a`` in byte order ``order`` ('=' native, 'S' swapped), same values."""
    return a if order == "=" else a.astype(a.dtype.newbyteorder("S"))


def error_scale(spec: str, arrays) -> np.ndarray:
    """The einsum of the magnitudes: what rounding errors of a float result scale with."""
    return np.einsum(spec, *[np.abs(np.asarray(a)).astype(np.float64) for a in arrays])


def assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray | None = None, eps: float | None = None):
    """Same shape, same dtype (byte order aside: results are native), values equal for ints and
    bools, within rounding (``eps`` relative to ``scale``; by default the result dtype's) for
    floats and complex."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype.newbyteorder("="), (got.dtype, want.dtype)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    if want.dtype == np.dtype("bfloat16"):
        # ~2.5 units of its last place (2**-8): computed in float32 by both, rounded once, tiles
        # summed in another order than the reference's
        got, want, eps = got.astype(np.float32), want.astype(np.float32), 1e-2 if eps is None else eps
    if eps is None:
        # float16: ~10 units of its last place (2**-10), tiles summed in another order than numpy's
        eps = {np.float16: 1e-2, np.float32: 1e-4, np.complex64: 1e-4}.get(want.dtype.type, 1e-10)
    bound = eps * (np.abs(scale) if scale is not None else np.abs(want)) + eps
    both_nan = np.isnan(got) & np.isnan(want)
    same_inf = np.isinf(want) & (got == want)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same inf
        ok = both_nan | same_inf | (np.abs(got - want) <= bound)
    assert ok.all(), f"max abs error {np.nanmax(np.abs(got - want))}; got\n{got}\nwant\n{want}"


# Labels that differ only in case (a/A, b/B, c/C) are distinct labels, as in numpy.
LABELS = "abcdABC"


@st.composite
def einsum_case(draw, max_operands=5, min_size=1, max_size=5, dtypes=tuple(DTYPES), empty=False):
    """A random spec (explicit or implicit output) with shapes, dtypes, tile shapes and a seed.

    Written to find what narrower generators missed: 1-5 operands drawing their labels from a
    small pool (labels repeat across operands and inside one: diagonals, traces), labels that
    differ only in case, a label of size n (0 with ``min_size=0``) seen as size 1 by some
    operands (numpy's broadcasting, through repeated labels too), tiles that cut every
    dimension longer than 1 into several pieces, unevenly, and every dtype. ``empty=True``: one
    label has size 0 and the first operand has it (drawn so, not filtered: most draws would miss).
    """
    n = draw(st.integers(1, max_operands))
    pool = draw(st.lists(st.sampled_from(LABELS), min_size=1, max_size=5, unique=True))
    sizes = {c: draw(st.integers(min_size, max_size)) for c in pool}
    zero = draw(st.sampled_from(pool)) if empty else None
    if zero is not None:
        sizes[zero] = 0
    operands, shapes = [], []
    for q in range(n):
        k = draw(st.integers(0, 4))
        labels = "".join(draw(st.sampled_from(pool)) for _ in range(k))
        if q == 0 and zero is not None and zero not in labels:
            labels = zero + labels
        # each operand sees each of its labels at full size or (broadcast) at size 1
        seen = {c: 1 if draw(st.integers(0, 3)) == 0 and c != zero else sizes[c] for c in dict.fromkeys(labels)}
        operands.append(labels)
        shapes.append(tuple(seen[c] for c in labels))
    used = sorted(set("".join(operands)))
    if draw(st.booleans()):
        out = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
        spec = ",".join(operands) + "->" + out
    else:
        spec = ",".join(operands)
    dts = [draw(st.sampled_from(dtypes)) for _ in range(n)]
    tiles = [tuple(draw(st.integers(1, max(d - 1, 1))) for d in shape) for shape in shapes]
    seed = draw(st.integers(0, 2**31))
    return spec, shapes, dts, tiles, seed


def backend_tables(db, temporary: bool | None = None) -> list[str]:
    """Every table the session's backend holds, sorted: kept tensors and temporary results
    (``temporary``: only those, or only the kept ones). What "left nothing written" is checked
    against, on either backend."""
    if db.backend.name != "duckdb":  # the reference backend and the simulated device (its subclass)
        return db.backend.tables(temporary)
    where = "" if temporary is None else f" WHERE temporary = {str(temporary).lower()}"
    return [r[0] for r in db.backend._run(f"SELECT table_name FROM duckdb_tables(){where} ORDER BY table_name")]


def topk_key(row: list, largest: bool = True):
    """The top-k order of a row of exact Python numbers, as a sort key of an index: best first
    (largest, else smallest), NaN after every number, ties by the smaller index."""
    def key(j):
        v = row[j]
        nan = isinstance(v, float) and math.isnan(v)
        return (nan, 0 if nan else (-v if largest else v), j)

    return key
