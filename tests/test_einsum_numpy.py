"""Property tests: random einsums, shapes, tile shapes, dtypes and byte orders against
numpy.einsum, on stored tensors and on arrays."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eindecomp_sql as eds

from helpers import BYTE_ORDERS, assert_close, einsum_case, error_scale, random_array, with_byte_order
from reference import reference  # np.einsum, and bfloat16's rule where numpy has none

KINDS = st.lists(st.sampled_from(["stored", "array"]), min_size=5, max_size=5)
ORDERS = st.lists(st.sampled_from(BYTE_ORDERS), min_size=5, max_size=5)


@given(einsum_case(), KINDS, ORDERS)
def test_stored_tensors_match_numpy(db, case, kinds, orders):
    """db.einsum over stored tensors (cut in the drawn tiles) mixed with array operands."""
    spec, shapes, dtypes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [with_byte_order(random_array(rng, s, d), o) for s, d, o in zip(shapes, dtypes, orders)]
    want = reference(spec, *arrays)
    operands = [db.store(f"p{k}", a, tile=t, replace=True) if kind == "stored" else a
                for k, (a, t, kind) in enumerate(zip(arrays, tiles, kinds))]
    got = db.einsum(spec, *operands).to_numpy()
    assert_close(got, want, error_scale(spec, arrays))


@given(einsum_case(), ORDERS)
def test_one_shot_numpy_api_matches_numpy(backend, case, orders):
    spec, shapes, dtypes, _, seed = case
    rng = np.random.default_rng(seed)
    arrays = [with_byte_order(random_array(rng, s, d), o) for s, d, o in zip(shapes, dtypes, orders)]
    want = reference(spec, *arrays)
    got = eds.einsum(spec, *arrays)
    assert_close(got, want, error_scale(spec, arrays))


@pytest.mark.parametrize(
    "spec,shapes",
    [
        ("ii,i->i", [(1, 1), (3,)]),
        ("cacc,bcb->", [(1, 1, 1, 1), (1, 4, 1)]),
        ("ii,ij->ij", [(1, 1), (4, 3)]),
        ("iij,i->ij", [(1, 1, 2), (5,)]),
        ("ii,i->i", [(1, 1), (0,)]),
    ],
)
def test_size_one_axis_broadcasts_through_a_repeated_label(db, spec, shapes):
    """numpy broadcasts a size-1 axis of a repeated label: "ii,i->i" of a (1, 1) and b (3,)
    is a[0, 0] * b (this raised "tile holds 8 bytes" on arrays and gave [2, 2, 3] stored)."""
    rng = np.random.default_rng(11)
    arrays = [random_array(rng, s, "float64") + 2 for s in shapes]
    want = np.einsum(spec, *arrays)
    assert_close(eds.einsum(spec, *arrays), want)
    stored = [db.store(f"b{k}", a, tile=tuple(max(1, d - 1) for d in a.shape), replace=True)
              for k, a in enumerate(arrays)]
    assert_close(db.einsum(spec, *stored).to_numpy(), want)


@pytest.mark.parametrize(
    "spec,shapes",
    [
        ("ii->i", [(5, 5)]),
        ("ii", [(4, 4)]),
        ("iij->j", [(3, 3, 4)]),
        ("ij->ji", [(3, 5)]),
        ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
        ("...ij,...jk", [(1, 3, 4), (6, 4, 2)]),
        ("ij...,j...->i...", [(3, 4, 2), (4, 2)]),
        ("...", [(2, 3)]),
        ("i...->...", [(3, 2, 2)]),
        (",ij->ij", [(), (3, 4)]),
        ("ij,jk", [(2, 1), (3, 4)]),
        ("ij,ij->ij", [(1, 3), (2, 3)]),
        ("bij,bjk->bik", [(3, 4, 5), (3, 5, 2)]),
        ("abcd,cdef->abef", [(2, 3, 4, 5), (4, 5, 3, 2)]),
        ("ab,bc,cd,de->ae", [(3, 4), (4, 5), (5, 6), (6, 2)]),
        ("i,i->", [(7,), (7,)]),
        ("i,j->ij", [(3,), (4,)]),
        ("ijk,jil->kl", [(3, 4, 5), (4, 3, 2)]),
    ],
)
# every dtype runs through the generated cases above; here one of each kind and width class
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bool", "uint16", "complex64"])
def test_numpy_language(db, spec, shapes, dtype):
    rng = np.random.default_rng(len(spec))
    arrays = [random_array(rng, s, dtype) for s in shapes]
    want = np.einsum(spec, *arrays)
    got = eds.einsum(spec, *arrays)
    assert_close(got, want, error_scale(spec, arrays))
    # the same through stored tensors with tiles that cut every dimension unevenly
    stored = [db.store(f"q{k}", a, tile=tuple(max(1, (d + 1) // 2) for d in a.shape), replace=True)
              for k, a in enumerate(arrays)]
    assert_close(db.einsum(spec, *stored).to_numpy(), want, error_scale(spec, arrays))


def test_python_scalars_and_mixed_dtypes(backend):
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert_close(eds.einsum(",ij->ij", 2.5, a), np.einsum(",ij->ij", 2.5, a))
    b = np.linspace(0, 1, 3, dtype=np.float32)
    assert_close(eds.einsum("ij,j->i", a, b), np.einsum("ij,j->i", a, b))
