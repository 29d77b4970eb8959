"""What ``explain()`` shows is exactly what runs: the backend is handed the very plan explained,
and executes one statement per step listed (plus one per extra batch), for single einsums and
for graphs whose inputs are stored under other tilings."""

import re

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql.graph import Graph
from eindecomp_sql.plan import RetileStep

STEP_LINE = re.compile(r"^  step \d+: (.*) \([\d,]+ cost units", re.M)


def explained_steps(text: str) -> list[str]:
    return STEP_LINE.findall(text)


class Recorder:
    """Wraps a DuckDB backend: the plans it is handed, and the statements it runs."""

    def __init__(self, backend):
        self.plans, self.statements = [], []
        execute, run = backend.execute, backend._run

        def recording_execute(plan, *args, **kwargs):
            self.plans.append(plan)
            return execute(plan, *args, **kwargs)

        def recording_run(sql, params=None):
            self.statements.append(sql)
            return run(sql, params)

        backend.execute, backend._run = recording_execute, recording_run

    def writes(self) -> tuple[int, int]:
        """(CREATE TABLE statements, INSERT statements) run for plan steps (a view over a value's
        parts writes nothing)."""
        creates = [s for s in self.statements if s.startswith("CREATE") and "eds_catalog" not in s
                   and " VIEW " not in s.split("(")[0].upper() + " "]
        inserts = [s for s in self.statements if s.startswith("INSERT INTO") and "eds_catalog" not in s]
        return len(creates), len(inserts)


def check_runs_as_explained(rec: Recorder, plan, text: str) -> None:
    (ran,) = rec.plans
    assert ran == plan
    assert explained_steps(text) == [s.describe() for s in ran.steps]
    # one write a statement: a table and an INSERT a further batch, or (a value over the
    # session's part size, batched under a budget) a part a batch
    creates, inserts = rec.writes()
    assert creates + inserts == sum(s.batches for s in ran.steps) and creates >= len(ran.steps)


@pytest.mark.parametrize("memory", [None, "2MB"])
def test_single_einsum_runs_the_explained_steps(memory):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 250))
    with eds.connect(memory=memory) as db:
        A = db.store("A", a, tile=(70, 45))
        B = db.store("B", b, tile=(33, 250))
        text = db.explain("ij,jk->ik", A, B)
        plan = db.plan("ij,jk->ik", A, B)
        assert any(isinstance(s, RetileStep) for s in plan.steps)  # the tilings disagree
        rec = Recorder(db.backend)
        got = db.einsum("ij,jk->ik", A, B).to_numpy()
        check_runs_as_explained(rec, plan, text)
        np.testing.assert_allclose(got, a @ b, rtol=1e-9, atol=1e-9)


def test_graph_over_inputs_stored_otherwise_runs_the_explained_steps():
    rng = np.random.default_rng(2)
    g = Graph()
    x, w1, w2 = (g.input("x", (96, 40), "float64"), g.input("w1", (40, 64), "float64"),
                 g.input("w2", (64, 24), "float64"))
    h = g.map("relu", g.einsum("bi,io->bo", x, w1))
    y = g.einsum("bo,op->bp", h, w2)
    xs = {"x": rng.standard_normal((96, 40)), "w1": rng.standard_normal((40, 64)), "w2": rng.standard_normal((64, 24))}
    with eds.connect() as db:
        X = db.store("X", xs["x"], tile=(17, 40))
        W2 = db.store("W2", xs["w2"], tile=(64, 5), keys=("o", "p"))
        p = g.plan(workers=2, outputs=y, inputs={"x": X, "w2": W2})
        text = p.explain()
        assert p.retiles >= 1
        rec = Recorder(db.backend)
        out = p.run(db, x=X, w1=xs["w1"], w2="W2")
        check_runs_as_explained(rec, p.plan, text)
        want = np.maximum(xs["x"] @ xs["w1"], 0) @ xs["w2"]
        np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-9, atol=1e-9)
