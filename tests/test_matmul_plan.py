"""The binary product kernel (udfs/kernels.py: _MatmulPlan) against np.einsum, for every way
two operands' labels can sort into batch, m, n, k and summed-first labels, in any order; the
operands swap roles when the output lists the second one's labels first (``kl,ik->il``)."""

import numpy as np
from hypothesis import given, settings, strategies as st

from eindecomp_sql.udfs.kernels import _MatmulPlan

LABELS = "abcdef"


@st.composite
def products(draw):
    x = draw(st.permutations(LABELS).map(lambda p: p[:draw(st.integers(1, 4))]))
    y = draw(st.permutations(LABELS).map(lambda p: p[:draw(st.integers(1, 4))]))
    both = [lab for lab in dict.fromkeys(x + y)]
    out = draw(st.permutations(both).map(lambda p: p[:draw(st.integers(0, len(both)))]))
    sizes = {lab: draw(st.integers(1, 5)) for lab in LABELS}
    dtype = draw(st.sampled_from(["float32", "float64", "complex128"]))
    return "".join(x), "".join(y), "".join(out), sizes, dtype


@settings(max_examples=300, deadline=None)
@given(products(), st.integers(0, 2**31 - 1))
def test_product_matches_numpy(case, seed):
    x, y, out, sizes, dtype = case
    plan = _MatmulPlan.build([tuple(x), tuple(y)], tuple(out))
    rng = np.random.default_rng(seed)
    a = rng.standard_normal([sizes[c] for c in x]).astype(dtype)
    b = rng.standard_normal([sizes[c] for c in y]).astype(dtype)
    want = np.einsum(f"{x},{y}->{out}", a, b)
    got = np.empty(want.shape, dtype)
    plan.run(a, b, got)
    tol = 1e-4 if dtype == "float32" else 1e-10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_operands_swap_when_the_output_starts_with_the_second():
    assert _MatmulPlan.build([("k", "l"), ("i", "k")], ("i", "l")).swap
    assert _MatmulPlan.build([("k", "l"), ("i", "k")], ("i", "l")).out_perm is None
    assert not _MatmulPlan.build([("i", "k"), ("k", "l")], ("i", "l")).swap
