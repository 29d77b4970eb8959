"""A sweep of bad inputs across the public API: every one ends in EinsumError (a ValueError)
naming the problem, never another exception type, and leaves the database as it was."""

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from helpers import backend_tables

A = np.arange(12.0).reshape(3, 4)


def _calls():
    """(id, fn(db, T) -> anything): each must raise EinsumError."""
    cases = {
        # einsum specs and operands
        "spec not a string": lambda db, T: db.einsum(["ij"], A),
        "spec None": lambda db, T: db.einsum(None, A),
        "bad subscript": lambda db, T: db.einsum("i1", A),
        "operand count": lambda db, T: db.einsum("ij,jk", A),
        "shape mismatch": lambda db, T: db.einsum("ij,ij", A, A.T),
        "object operand": lambda db, T: db.einsum("i", np.array(["a", "b"], dtype=object)),
        "string operand array": lambda db, T: db.einsum("i", np.array(["a", "b"])),
        "longdouble": lambda db, T: db.einsum("i", np.ones(2, np.longdouble)),
        "datetime": lambda db, T: db.einsum("i", np.array(["2020-01-01"], dtype="datetime64[D]")),
        "ragged": lambda db, T: db.einsum("i", [[1, 2], [3]]),
        "None operand": lambda db, T: db.einsum("i", None),
        "dict operand": lambda db, T: db.einsum("i", {"a": 1}),
        "unknown name": lambda db, T: db.einsum("ij->", "Nope"),
        "bad name operand": lambda db, T: db.einsum("ij->", "x; DROP TABLE T"),
        "join not str": lambda db, T: db.einsum("ij->", T, join=3),
        "join unknown": lambda db, T: db.einsum("ij->", T, join="nope"),
        "agg unknown": lambda db, T: db.einsum("ij->", T, agg="mean"),
        "agg not str": lambda db, T: db.einsum("ij->", T, agg=["sum"]),
        "callable returns str": lambda db, T: db.einsum("ij,ij->", A, A, join=lambda x, y: "s"),
        "callable returns None": lambda db, T: db.einsum("ij,ij->", A, A, join=lambda x, y: None),
        "callable wrong shape": lambda db, T: db.einsum("ij,ij->i", A, A, join=lambda x, y: x.sum()),
        "callable raises": lambda db, T: db.einsum("ij,ij->i", A, A, join=lambda x, y: 1 / 0),
        "out bad name": lambda db, T: db.einsum("ij->", T, out="a b"),
        "out exists": lambda db, T: db.einsum("ij->ij", T, out="T"),
        "progress bad": lambda db, T: db.einsum("ij->", T, progress="yes"),
        # store
        "store bad name": lambda db, T: db.store("1x", A),
        "store reserved name": lambda db, T: db.store("eds_catalog", A),
        "store exists": lambda db, T: db.store("T", A),
        "store tile strings": lambda db, T: db.store("U", A, tile=("a", "b")),
        "store tile nan": lambda db, T: db.store("U", A, tile=(float("nan"), 2)),
        "store tile inf": lambda db, T: db.store("U", A, tile=(float("inf"), 2)),
        "store tile length": lambda db, T: db.store("U", A, tile=(2,)),
        "store keys length": lambda db, T: db.store("U", A, keys=("x",)),
        "store keys tile": lambda db, T: db.store("U", A, keys=("x", "tile")),
        "store keys case": lambda db, T: db.store("U", A, keys=("x", "X")),
        "store keys bad": lambda db, T: db.store("U", A, keys=("x", "y z")),
        "store object": lambda db, T: db.store("U", np.array([object()])),
        # catalog
        "tensor unknown": lambda db, T: db.tensor("Nope"),
        "tensor bad name": lambda db, T: db.tensor("a\n"),
        "drop unknown": lambda db, T: db.drop("Nope"),
        "replace not bool-like target": lambda db, T: db.einsum("ij->", T, out=""),
        # from a new user's hunt (2026-11-26): TypeError, or a truthy string overwriting T
        "to_parquet to a number": lambda db, T: T.to_parquet(3),
        "export to None": lambda db, T: T.export(None),
        "store replace='no'": lambda db, T: db.store("T", np.zeros(2), replace="no"),
        "einsum replace='no'": lambda db, T: db.einsum("ij->", T, out="T", replace="no"),
        "graph value unknown": lambda db, T: eds.Graph().value("nope"),
        "key named Tile": lambda db, T: db.store("K", A, keys=("Tile", "x")),  # DuckDB and Spark ignore case
    }
    return cases


CASES = _calls()


@pytest.fixture(scope="module")
def sweep_db(backend):
    with eds.connect(backend=backend) as db:
        db.store("T", A, tile=(2, 3))
        yield db


def _state(db):
    return db.tensors(), backend_tables(db)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_an_einsum_error_and_changes_nothing(sweep_db, case):
    T = sweep_db.tensor("T")
    before = _state(sweep_db)
    with pytest.raises(EinsumError) as e:
        CASES[case](sweep_db, T)
    assert str(e.value).strip(), "the message must say what is wrong"
    assert _state(sweep_db) == before
    np.testing.assert_array_equal(T.to_numpy(), A)


@pytest.mark.parametrize("bad", [
    lambda: eds.connect(123),
    lambda: eds.connect(memory="1e400GB"),
    lambda: eds.connect(memory=float("nan")),
    lambda: eds.connect(memory="1 2 GB"),  # was read as 12 GB
    lambda: eds.connect(memory=10**30),  # was DuckDB's ParserException
    lambda: eds.connect(workers="x"),
    lambda: eds.connect(tile_bytes=0),
    lambda: eds.einsum(["ij"], A),
    lambda: eds.einsum("ij", A, order="Q"),
    lambda: eds.einsum("ij", A, casting="nope"),
    lambda: eds.einsum("ij", A, dtype="not a dtype"),
    lambda: eds.Graph().input("x", "ab"),
    lambda: eds.Graph().input("x", (2, -1)),
    lambda: eds.Graph().input("x", (2, 2), dtype="longdouble"),
    lambda: eds.Graph().input("x y", (2, 2)),
])
def test_bad_input_outside_a_session(bad):
    with pytest.raises(EinsumError):
        bad()


def test_more_bad_inputs_from_review():
    a, b, c = np.ones((2, 3)), np.ones((3, 4)), np.ones((4, 2))
    np.testing.assert_allclose(eds.einsum("ij,jk,kl->il", a, b, c, optimize=("greedy", 0)), a @ b @ c)
    np.testing.assert_allclose(eds.einsum("ij,jk,kl->il", a, b, c, optimize=("greedy", float("inf"))), a @ b @ c)
    for bad in (("greedy", float("nan")), ["einsum_path", (0.5, 1), (0, 1)]):
        with pytest.raises(EinsumError):
            eds.einsum("ij,jk,kl->il", a, b, c, optimize=bad)
    g = eds.Graph()
    x = g.input("x", (2, 3), "float64")
    g.map("relu", x)
    plan = g.plan()
    with eds.connect() as db:
        # (a list names one table per output: ["a", "b"] is one too many here)
        for kwargs in (dict(out=5), dict(out=["a", "b"]), dict(replace="x")):
            with pytest.raises(EinsumError):
                plan.run(db, x=a, **kwargs)
        assert db.tensors() == []
    with pytest.raises(EinsumError, match="at most 52 labels"):
        gg = eds.Graph()
        eds_x = gg.input("x", (1,) * 53)
        gg.map("relu", eds_x)


def test_a_tile_cap_below_one_element_says_so(tmp_path, capsys):
    """tile_bytes=2 with float32 tiles: no plan can keep its tiles under it. It was a TypeError
    (the message formatted a budget of None), and in a job an "internal error"."""
    with eds.connect(tile_bytes=2) as db:
        A = db.store("A", np.ones((4, 4), np.float32), tile=(2, 2))
        with pytest.raises(EinsumError, match=r"under tile_bytes = 2 B .*one element takes up to 4 B.*larger tile_bytes"):
            db.einsum("ij->ji", A)
    from eindecomp_sql.cli import main as cli_main

    np.save(tmp_path / "x.npy", np.ones((4, 4), np.float32))
    job = tmp_path / "job.toml"
    for value, match in (('"2B"', "larger tile_bytes"), ("1.5", "tile_bytes 1.5: write a positive whole number")):
        job.write_text(f'database = "t.duckdb"\ntile_bytes = {value}\n[inputs]\nx = {{ file = "x.npy" }}\n'
                       '[steps.h]\nspec = "ij->ji"\noperands = ["x"]\n')
        with pytest.raises(SystemExit) as e:
            cli_main(["run", str(job)])
        err = capsys.readouterr().err
        assert e.value.code == 1 and match in err and "internal error" not in err, err


def test_the_largest_budget_duckdb_takes_is_taken():
    """2**63 - 1 was refused as more than 2**63 - 1 (float rounding; a review)."""
    from eindecomp_sql.plan.cost import parse_memory

    assert parse_memory(2**63 - 1) == 2**63 - 1
    with pytest.raises(EinsumError, match="larger than any machine"):
        parse_memory(2**63)


def test_a_users_table_of_that_name_gets_no_advice_to_replace_it():
    """store/out= onto a user's table said "already exists; pass replace=True", advice that
    replace=True then refused (a new user's report): it says what the table is instead."""
    with eds.connect() as db:
        db.connection.execute("CREATE TABLE mine AS SELECT 1 AS x")
        for call in (lambda: db.store("mine", np.ones(3)), lambda: db.einsum("i->i", np.ones(3), out="mine")):
            with pytest.raises(EinsumError, match="not a stored tensor") as e:
                call()
            assert "replace" not in str(e.value)  # none was passed (it said "replace overwrites ...": a trial)
        assert db.connection.execute("SELECT x FROM mine").fetchall() == [(1,)]


def test_an_einsum_too_large_to_plan_is_an_einsum_error():
    """(2**31, 2**31) inputs reached the optimizer, whose int64 costs raised a raw
    OverflowError (a trial); an einsum whose join space passes 2**56 elements is refused
    where it is declared, naming the sizes. The largest that plans still plans."""
    g = eds.Graph()
    x, y = g.input("x", (2**31, 2**31)), g.input("y", (2**31, 4))
    with pytest.raises(eds.EinsumError, match=r"'ij,jk->ik' over sizes .*'i': 2147483648.* spans 1.84e\+19 elements"):
        g.einsum("ij,jk->ik", x, y)
    g = eds.Graph()
    g.einsum("ij,jk->ik", g.input("a", (2**20, 2**18)), g.input("b", (2**18, 2**18)))  # 2**56: plans
    assert g.plan(workers=4).plan.steps


def test_a_long_product_is_checked_pair_by_pair():
    """Nine 100x100 matrices span 1e20 together and 1e6 a pair: the whole spec was refused
    ("spans 1e+20 elements") where np.einsum(optimize=True) is instant (a trial). A product is
    planned pair by pair, and so checked; an extended join kept as one node is checked whole."""
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((100, 100)) / 10 for _ in range(9)]
    spec = ",".join("abcdefghij"[k:k + 2] for k in range(9)) + "->aj"
    for optimize in (True, "greedy", False):
        np.testing.assert_allclose(eds.einsum(spec, *mats, optimize=optimize), np.einsum(spec, *mats, optimize=True),
                                   rtol=1e-9, atol=1e-12)
    with pytest.raises(eds.EinsumError, match=r"spans 1e\+20 elements in one join"):
        # an integer add stays one node (joined in numpy's order: graph/lower.py)
        eds.einsum(spec, *[m.astype(np.int64) for m in mats], join="add")
