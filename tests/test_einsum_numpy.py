"""Property tests: random einsums, shapes, tile shapes and dtypes against numpy.einsum."""

import numpy as np
import pytest
from hypothesis import given

import eindecomp_sql as eds

from helpers import DTYPES, assert_close, einsum_case, random_array


@given(einsum_case())
def test_stored_tensors_match_numpy(db, case):
    spec, shapes, dtypes, tiles, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = np.einsum(spec, *arrays)
    names = []
    for k, (a, t) in enumerate(zip(arrays, tiles)):
        names.append(db.store(f"p{k}", a, tile=t, replace=True))
    got = db.einsum(spec, *names).to_numpy()
    scale = np.einsum(spec, *[np.abs(a.astype(np.float64)) for a in arrays]) if want.dtype.kind == "f" else None
    assert_close(got, want, scale)


@given(einsum_case(max_operands=4))
def test_one_shot_numpy_api_matches_numpy(case):
    spec, shapes, dtypes, _, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    want = np.einsum(spec, *arrays)
    got = eds.einsum(spec, *arrays)
    scale = np.einsum(spec, *[np.abs(a.astype(np.float64)) for a in arrays]) if want.dtype.kind == "f" else None
    assert_close(got, want, scale)


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
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_language(db, spec, shapes, dtype):
    rng = np.random.default_rng(len(spec))
    arrays = [random_array(rng, s, dtype) for s in shapes]
    want = np.einsum(spec, *arrays)
    got = eds.einsum(spec, *arrays)
    assert_close(got, want, np.einsum(spec, *[np.abs(a.astype(np.float64)) for a in arrays]))
    # the same through stored tensors with tiles that cut every dimension unevenly
    stored = [db.store(f"q{k}", a, tile=tuple(max(1, (d + 1) // 2) for d in a.shape), replace=True)
              for k, a in enumerate(arrays)]
    assert_close(db.einsum(spec, *stored).to_numpy(), want, np.einsum(spec, *[np.abs(a.astype(np.float64)) for a in arrays]))


def test_python_scalars_and_mixed_dtypes():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert_close(eds.einsum(",ij->ij", 2.5, a), np.einsum(",ij->ij", 2.5, a))
    b = np.linspace(0, 1, 3, dtype=np.float32)
    assert_close(eds.einsum("ij,j->i", a, b), np.einsum("ij,j->i", a, b))
