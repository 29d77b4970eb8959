"""numpy's interface on eds.einsum: out=, dtype=, order=, casting=, optimize= and the sublist
form, compared with np.einsum on the same inputs, errors included (numpy's TypeError and
ValueError become EinsumError)."""

import inspect
import pydoc
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.graph.lower import contraction_path, lower_einsum
from eindecomp_sql.graph.node import ValueInfo
from eindecomp_sql.notation import parse_agg, parse_join, parse_spec
from eindecomp_sql.notation.checks import DTYPES as SUPPORTED
from eindecomp_sql.notation.functions import AGGREGATIONS, BINARY_JOINS, EXPR_FUNCTIONS, UNARY_JOINS

from helpers import BYTE_ORDERS, NUMPY_DTYPES, assert_close, einsum_case, error_scale, random_array, with_byte_order

CASTINGS = ["no", "equiv", "safe", "same_kind", "unsafe"]
ORDERS = st.lists(st.sampled_from(BYTE_ORDERS), min_size=5, max_size=5)


def _numpy(spec, arrays, **kw):
    """np.einsum (unoptimized: our dtype semantics) or the exception it raises."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        try:
            return np.einsum(spec, *arrays, **kw), None
        except (TypeError, ValueError) as e:
            return None, e


@given(
    einsum_case(max_operands=3, dtypes=tuple(NUMPY_DTYPES)),
    st.sampled_from([None] + NUMPY_DTYPES),
    st.sampled_from(CASTINGS),
    st.sampled_from([None] + NUMPY_DTYPES),
    st.sampled_from(["K", "C", "F", "A", "c", None]),
    st.sampled_from([False, True, "greedy", "optimal", ("greedy", 10**6)]),
    ORDERS,
)
def test_numpy_keywords_match_numpy(backend, case, dtype, casting, out_dtype, order, optimize, byte_orders):
    spec, shapes, dtypes, _, seed = case
    rng = np.random.default_rng(seed)
    arrays = [with_byte_order(random_array(rng, s, d), o) for s, d, o in zip(shapes, dtypes, byte_orders)]
    shape = np.einsum(spec, *arrays).shape
    np_out = None if out_dtype is None else np.zeros(shape, out_dtype)
    our_out = None if out_dtype is None else np.zeros(shape, out_dtype)
    kw = dict(dtype=dtype, casting=casting, order=order)
    want, err = _numpy(spec, arrays, out=np_out, **kw)
    if err is not None:
        with pytest.raises(EinsumError):
            eds.einsum(spec, *arrays, out=our_out, optimize=optimize, **kw)
        return
    computes_in = np.dtype(dtype) if dtype else np.result_type(*arrays, *([np_out] if out_dtype else []))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
        got = eds.einsum(spec, *arrays, out=our_out, optimize=optimize, **kw)
    if our_out is not None:
        assert got is our_out
    assert type(got) is type(want)  # a numpy scalar for a 0-d result, as np.einsum
    scale = error_scale(spec, arrays) if np.asarray(want).dtype.kind in "fc" else None
    if np.asarray(want).dtype.kind in "iub" and dtype is not None and np.dtype(dtype).kind in "fc":
        scale = None  # computed in floats, cast to ints: equal but for rounding at the cast
    # rounding is the computation dtype's, whatever out= holds (float32 work into a float64 out)
    eps = {np.float16: 1e-2, np.float32: 1e-4, np.complex64: 1e-4}.get(computes_in.type)
    assert_close(got, want, scale, eps=eps)
    if our_out is None and np.ndim(got) >= 2:
        if (order or "K").upper() == "F":
            assert got.flags.f_contiguous
        if (order or "K").upper() == "C":
            assert got.flags.c_contiguous


def _sublists(spec: str, arrays):
    """spec -> numpy's sublist form (A-Z as 0-25, a-z as 26-51, as numpy's C einsum maps them)."""
    code = {c: k for k, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")}
    lhs, _, out = spec.partition("->")
    args = []
    for a, s in zip(arrays, lhs.split(",")):
        args += [a, [code[c] for c in s]]
    if "->" in spec:
        args.append([code[c] for c in out])
    return args


@given(einsum_case(max_operands=4, dtypes=("float64", "int64", "complex64")))
def test_sublist_form_matches_numpy(backend, case):
    spec, shapes, dtypes, _, seed = case
    rng = np.random.default_rng(seed)
    arrays = [random_array(rng, s, d) for s, d in zip(shapes, dtypes)]
    args = _sublists(spec, arrays)
    assert_close(eds.einsum(*args), np.einsum(*args), error_scale(spec, arrays))


def test_sublist_form_with_ellipsis_and_numpy_ints(backend):
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 5))
    for args in ([a, [Ellipsis, 0, 1], b, [Ellipsis, 1, 2], [Ellipsis, 0, 2]],
                 [a, [Ellipsis, 0, 1], b, [Ellipsis, 1, 2]],
                 [a, np.array([7, 0, 1]), [0]],
                 [a, (np.int64(40), 0, 1), [40, 1]]):
        assert_close(eds.einsum(*args), np.einsum(*args))


@pytest.mark.parametrize(
    "args,match",
    [
        ((["ij"], np.ones((2, 2))), "subscript"),  # a spec that is neither a str nor sublists
        ((np.ones(2), [0, 52]), "valid range"),
        ((np.ones(2), [0, "x"]), "int in \\[0, 52\\)"),
        ((np.ones(2), [True]), "int in \\[0, 52\\)"),
        ((np.ones(2), 3), "list of ints"),
        ((np.ones(2), "ij"), "list of ints"),
        ((np.ones(2), [Ellipsis, Ellipsis]), "more than one Ellipsis"),
        ((np.ones(2),), "without a subscript list"),
        ((np.ones((2, 3)), [0, 1], np.ones((2, 3)), [1, 0]), "label"),
        ((None, [0]), "numbers"),
        ((), "no operands"),
    ],
)
def test_bad_sublist_forms_are_einsum_errors(args, match):
    with pytest.raises(EinsumError, match=match):
        eds.einsum(*args)


def test_no_operands_and_a_non_string_spec():
    with pytest.raises(EinsumError, match="no operands"):
        eds.einsum("->")
    with pytest.raises(EinsumError):
        eds.einsum(3, np.ones(2))
    # a bytes spec is numpy's too (a trial read it as the sublist form): read as its text
    assert eds.einsum(b"i->", np.arange(3.0)) == np.einsum(b"i->", np.arange(3.0)) == 3.0
    with pytest.raises(EinsumError, match="not ASCII"):
        eds.einsum("ü->".encode(), np.ones(2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(casting="Safe"), "casting must be one of"),
        (dict(casting=None), "casting must be one of"),
        (dict(order="x"), "order must be one of"),
        (dict(order=1), "order must be one of"),
        (dict(order="CF"), "order must be one of"),
        (dict(dtype="foo"), "not a dtype"),
        (dict(dtype=np.longdouble, casting="unsafe"), "unsupported dtype"),
        (dict(dtype=np.float32), "rule 'safe'"),
        (dict(out=[0.0, 0.0]), "out must be a numpy array"),
        (dict(out=np.zeros(3)), "shape"),
        (dict(out=np.zeros((2, 1))), "shape"),
        (dict(out=np.zeros(2, np.float32)), "rule 'safe'"),
        (dict(out=np.zeros(2, np.int64), casting="same_kind"), "same_kind"),
        (dict(optimize="bogus"), "optimize"),
        (dict(optimize=3), "did not understand"),
        (dict(optimize=[]), "did not understand"),
        (dict(optimize=[(0, 1)]), "did not understand"),
        (dict(optimize=["einsum_path"]), "more operand"),
        (dict(optimize=["einsum_path", (0, 5)]), "distinct positions"),
        (dict(optimize=["einsum_path", (0, 0)]), "distinct positions"),
        (dict(optimize=["einsum_path", "ab"]), "not a tuple"),
    ],
)
def test_bad_keywords_are_einsum_errors(kwargs, match):
    a = np.arange(6.0).reshape(2, 3)
    with pytest.raises(EinsumError, match=match):
        eds.einsum("ij,jk->i", a, a.T, **kwargs)


def test_order_as_bytes_as_numpy_takes_it():
    """``order=b"F"`` is numpy's too (it was refused: a trial)."""
    a = np.arange(6.0).reshape(2, 3)
    for order in (b"C", b"f", b"K"):
        got = eds.einsum("ij,kj->ik", a, a, order=order)
        want = np.einsum("ij,kj->ik", a, a, order=order)
        np.testing.assert_array_equal(got, want)
        assert got.flags["C_CONTIGUOUS"] == want.flags["C_CONTIGUOUS"] and got.flags["F_CONTIGUOUS"] == want.flags[
            "F_CONTIGUOUS"]
    with pytest.raises(EinsumError, match="order must be one of"):
        eds.einsum("ij->i", a, order=b"X")


def test_read_only_out():
    out = np.zeros(2)
    out.flags.writeable = False
    with pytest.raises(EinsumError, match="read-only"):
        eds.einsum("ij->i", np.ones((2, 3)), out=out)


def test_out_is_written_and_returned_with_numpy_casting(backend):
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((5, 7)), rng.standard_normal((7, 3))
    out = np.full((5, 3), np.nan)
    assert eds.einsum("ij,jk->ik", a, b, out=out) is out
    assert_close(out, a @ b)
    out32 = np.zeros((5, 3), np.float32)
    eds.einsum("ij,jk->ik", a, b, out=out32, casting="same_kind")
    assert_close(out32, (a @ b).astype(np.float32))
    fortran = np.zeros((3, 5), order="F")  # any layout, written in place
    eds.einsum("ij,jk->ki", a, b, out=fortran)
    assert_close(fortran, (a @ b).T)
    big = np.zeros((5, 3), ">f8")
    eds.einsum("ij,jk->ik", a, b, out=big, casting="equiv")
    assert_close(big.astype("<f8"), a @ b)
    scalar = np.zeros(())
    assert eds.einsum("ij,ij->", a, a, out=scalar) is scalar
    assert_close(scalar, np.einsum("ij,ij->", a, a))


def test_extended_join_with_numpy_keywords(backend):
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    got = eds.einsum("ij->i", a, agg="max", dtype=np.float64)
    assert_close(got, a.max(1).astype(np.float64))
    out = np.zeros(3, np.int64)
    assert eds.einsum("ij->i", a, join="x + 1", agg="min", out=out) is out
    np.testing.assert_array_equal(out, a.min(1) + 1)
    with pytest.raises(EinsumError, match="rule 'safe'"):
        eds.einsum("ij,ij->i", a, a, join="div", out=np.zeros(3, np.int64))


@pytest.mark.parametrize("optimize", ["greedy", "optimal", True, "dp", ("optimal", 100)])
def test_optimize_names_and_explicit_paths(backend, optimize):
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal(s) for s in [(3, 4), (4, 5), (5, 6), (6, 2)]]
    spec = "ab,bc,cd,de->ae"
    want = np.einsum(spec, *arrays)
    assert_close(eds.einsum(spec, *arrays, optimize=optimize), want)
    path = np.einsum_path(spec, *arrays, optimize=optimize if optimize != "dp" else "greedy")[0]
    assert_close(eds.einsum(spec, *arrays, optimize=path), want)
    assert_close(eds.einsum(spec, *arrays, optimize=path, join="add", agg="max"),
                 (arrays[0][:, :, None, None, None] + arrays[1][None, :, :, None, None]
                  + arrays[2][None, None, :, :, None] + arrays[3][None, None, None, :, :]).max(axis=(1, 2, 3)))


def test_lower_einsum_follows_an_explicit_path():
    """optimize's explicit path orders the binary nodes of a semiring (numpy's positions:
    operands left, each result appended)."""
    spec = parse_spec("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)])
    infos = [ValueInfo(n, s, "float64") for n, s in zip("xyz", [(2, 3), (3, 4), (4, 5)])]
    mul, total = parse_join("mul", 3), parse_agg("sum")
    path = contraction_path(["einsum_path", (1, 2), (0, 1)], 3)
    nodes = lower_einsum(spec, infos, mul, total, "r", path=path)
    assert [[op.value for op in n.operands] for n in nodes] == [["y", "z"], ["x", "_eds_t0"]]
    nodes = lower_einsum(spec, infos, mul, total, "r", path=contraction_path(["einsum_path", (0, 1), (0, 1)], 3))
    assert [[op.value for op in n.operands] for n in nodes] == [["x", "y"], ["z", "_eds_t0"]]
    assert contraction_path(False, 3) is None and contraction_path(None, 3) is None
    assert contraction_path(True, 3) == "greedy"


def test_help_lists_parameters_joins_aggregations_and_dtypes():
    text = pydoc.render_doc(eds.einsum, renderer=pydoc.plaintext)
    for name in inspect.signature(eds.einsum).parameters:
        assert name in text, name
    for word in BINARY_JOINS + UNARY_JOINS + tuple(EXPR_FUNCTIONS) + AGGREGATIONS + SUPPORTED:
        assert word in text, word
    for word in ("sublist", "casting", "float16", "Ellipsis", "callable"):
        assert word in text, word


def test_progress_reaches_the_plan(backend):
    seen = []
    a = np.random.default_rng(1).standard_normal((40, 30))
    assert_close(eds.einsum("ij,jk->ik", a, a.T, progress=seen.append), a @ a.T)
    assert seen and seen[-1].tiles_done == seen[-1].tiles
    with pytest.raises(EinsumError, match="progress"):
        eds.einsum("ij->", a, progress="yes")


def test_optimize_path_orders_the_products(backend):
    from eindecomp_sql.plan import ProgramStep, TiledValue, plan_einsum

    vals = tuple(TiledValue(n, s, "float64", None, ("d0", "d1"))
                 for n, s in (("A", (4, 5)), ("B", (5, 6)), ("C", (6, 3))))
    def first_node(plan):  # small enough to be one program: its first einsum
        step = plan.steps[0]
        return (step.steps[0] if isinstance(step, ProgramStep) else step).node

    first = {path: first_node(plan_einsum("ij,jk,kl->il", vals, path=path))
             for path in (((0, 1), (0, 1)), ((1, 2), (0, 1)))}
    assert [op.value for op in first[((0, 1), (0, 1))].operands] == ["A", "B"]
    assert [op.value for op in first[((1, 2), (0, 1))].operands] == ["B", "C"]
    rng = np.random.default_rng(8)
    a, b, c = rng.random((4, 5)), rng.random((5, 6)), rng.random((6, 3))
    for optimize in (["einsum_path", (1, 2), (0, 1)], "optimal", True, False):
        np.testing.assert_allclose(eds.einsum("ij,jk,kl->il", a, b, c, optimize=optimize), a @ b @ c)


def test_a_refused_cast_suggests_a_rule_that_would_allow_it():
    """The advice named 'same_kind' to a caller who had passed it (a new user's report)."""
    a = np.ones(3)
    for casting in ("safe", "same_kind"):
        with pytest.raises(eds.EinsumError, match=r"rule '%s'.*pass casting='unsafe'" % casting):
            eds.einsum("i->", a, out=np.zeros((), np.int8), casting=casting)
    with pytest.raises(eds.EinsumError, match=r"rule 'no'.*pass casting='safe'"):
        eds.einsum("i->", np.ones(3, np.int8), out=np.zeros((), np.int16), casting="no")


def test_out_does_not_widen_another_join_as_numpys_ufuncs_do_not():
    """mul/sum computes in out's dtype (np.einsum's rule); another join/agg is agg.reduce(join(
    operands)) with numpy's ufuncs, which compute from the operands and cast into out."""
    a = np.array([100, 100], np.int8)
    out = np.zeros((), np.int64)
    with np.errstate(over="ignore"):
        want = np.maximum.reduce(np.add(a, a))
    assert eds.einsum("i,i->", a, a, join="add", agg="max", out=out) is out and out == want == -56
    assert eds.einsum("i,i->", a, a, join="add", agg="max", dtype=np.int64) == 200
    assert eds.einsum("i,i->", a, a, out=np.zeros((), np.int64)) == 20000  # np.einsum's: in out's dtype


def test_einsum_numpy_takes_a_path_in_every_form_and_refuses_a_bad_one():
    """path=[(1, 2), (0, 1)] raised TypeError (unhashable list), a position out of range
    IndexError, numpy's ['einsum_path', ...] a bare ValueError (a new user's report)."""
    rng = np.random.default_rng(4)
    a, b, c = rng.standard_normal((2, 3)), rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    with eds.connect() as db:
        for path in ([(1, 2), (0, 1)], ((1, 2), (0, 1)), ["einsum_path", (1, 2), (0, 1)], "greedy", [[0, 1], [0, 1]]):
            np.testing.assert_allclose(db.einsum_numpy("ij,jk,kl->il", a, b, c, path=path), a @ b @ c)
        for bad in (((7, 2),), [(0, 1)], "nonsense", [(0, 0), (0, 1)]):
            with pytest.raises(EinsumError):
                db.einsum_numpy("ij,jk,kl->il", a, b, c, path=bad)


def test_what_a_trial_of_the_numpy_face_found():
    """A numpy user's trial: a crash, a leaked numpy error, and TypeErrors numpy raises that
    came out as ValueErrors (``except TypeError`` written for numpy missed them)."""
    rng = np.random.default_rng(11)
    a, b, c = rng.random((3, 4)), rng.random((4, 5)), rng.random((5, 2))
    # np.einsum_path may end in a lone-operand step after the last product: KeyError before
    path = ["einsum_path", (0, 1), (0, 1), (0,)]
    np.testing.assert_allclose(eds.einsum("ij,jk,kl->il", a, b, c, optimize=path),
                               np.einsum("ij,jk,kl->il", a, b, c, optimize=path))
    np.testing.assert_allclose(eds.einsum("ij,jk,kl->li", a, b, c, optimize=path), (a @ b @ c).T)
    # 53 labels (an ellipsis of 52 dimensions and i): an IndexError inside a UDF before
    with pytest.raises(EinsumError, match="53 distinct labels .* at most 52"):
        eds.einsum("...i->...", rng.random((1,) * 52 + (2,)))
    assert eds.einsum("...i->...", rng.random((1,) * 51 + (2,))).shape == (1,) * 51  # 52: fine
    # join=/agg= given an array: numpy's "truth value ... ambiguous", "unhashable type"
    with pytest.raises(EinsumError, match="join must be"):
        eds.einsum("ij,jk->ik", a, b, join=np.ones(2))
    with pytest.raises(EinsumError, match="agg must be one of"):
        eds.einsum("ij,jk->ik", a, b, agg=np.array(["max"]))
    # where numpy raises TypeError, a TypeError (and an EinsumError)
    for call in (lambda: eds.einsum("ij->ji", a, dtype="foo"),  # a lone operand's view case
                 lambda: eds.einsum(a, "ij"),  # a subscript list that is a string
                 lambda: eds.einsum("ij->i", a, casting=None),
                 lambda: eds.einsum("ij->i", a, order=1),
                 lambda: eds.einsum("i,i", ["a", "b"], [1, 2]),
                 lambda: eds.einsum("i->", np.array(["2026-01-01"], dtype="M8[D]")),
                 lambda: eds.einsum("ij->i", a, dtype="U5", casting="unsafe")):
        with pytest.raises(TypeError) as e:
            call()
        assert isinstance(e.value, EinsumError)
    with pytest.raises(TypeError, match="float8_e4m3fn elements .* cast to float32"):
        eds.einsum("ij->", a.astype(ml_dtypes.float8_e4m3fn))


def test_a_complex_result_into_a_real_out_warns_at_the_callers_line_as_numpy_does():
    """np.einsum warns ComplexWarning where casting="unsafe" puts a complex result into a real
    ``out``; ours did too, pointing at eindecomp_sql/api.py (a trial): at the caller's line now."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((3, 4)) + 1j * rng.standard_normal((3, 4))
    b = rng.standard_normal((4, 2))
    out = np.zeros((3, 2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eds.einsum("ij,jk->ik", a, b, out=out, casting="unsafe")
    assert [(w.category, w.filename) for w in seen] == [(np.exceptions.ComplexWarning, __file__)]
    np.testing.assert_allclose(out, (a @ b).real, rtol=1e-12)
