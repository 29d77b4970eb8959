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

DTYPES = ["float32", "float64", "int32", "int64", "bool"]



def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random values that never are all zeros or ones; small ints so products don't overflow."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind == "i":
        return rng.integers(-4, 5, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray | None = None):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    eps = 1e-4 if want.dtype == np.float32 else 1e-10
    bound = eps * (np.abs(scale) if scale is not None else np.abs(want)) + eps
    both_nan = np.isnan(got) & np.isnan(want)
    same_inf = np.isinf(want) & (got == want)
    ok = both_nan | same_inf | (np.abs(got - want) <= bound)
    assert ok.all(), f"max abs error {np.nanmax(np.abs(got - want))}; got\n{got}\nwant\n{want}"


LABELS = "abcde"


@st.composite
def einsum_case(draw, max_operands=3, min_size=1):
    """A random spec (explicit or implicit output) with shapes, dtypes, tile shapes and a seed."""
    n = draw(st.integers(1, max_operands))
    sizes = {c: draw(st.integers(min_size, 7)) for c in LABELS}
    operands = []
    for _ in range(n):
        k = draw(st.integers(0, 3))
        operands.append("".join(draw(st.sampled_from(LABELS)) for _ in range(k)))
    used = sorted(set("".join(operands)))
    if draw(st.booleans()):
        out = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
        spec = ",".join(operands) + "->" + out
    else:
        spec = ",".join(operands)
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in range(n)]
    shapes = [tuple(sizes[c] for c in s) for s in operands]
    tiles = [tuple(draw(st.integers(1, max(d, 1))) for d in shape) for shape in shapes]
    seed = draw(st.integers(0, 2**31))
    return spec, shapes, dtypes, tiles, seed
