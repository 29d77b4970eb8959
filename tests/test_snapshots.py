"""Golden SQL for a set of einsums (tests/fixtures/sql_snapshots.sql).

Each entry is a titled einsum over shape-level operands; the test plans and compiles it (no
connection) and compares the SQL text, then runs the same plan against numpy. Regenerate after
an intended change with ``EDS_UPDATE_SNAPSHOTS=1 pytest tests/test_snapshots.py`` and review
the diff.
"""

import os
import re
from pathlib import Path

import numpy as np
import pytest

from eindecomp_sql.compile import bind_sql, compile_plan
from eindecomp_sql.plan import TiledValue, plan_einsum
from helpers import assert_close, random_array
from reference import reference

FIXTURE = Path(__file__).parent / "fixtures" / "sql_snapshots.sql"

# title, spec, operands as (name, shape, tile, dtype), join, agg
CASES = [
    ("gemm, one tile each", "ij,jk->ik", [("A", (4, 3), (4, 3), "float32"), ("B", (3, 5), (3, 5), "float32")], None, None),
    ("gemm, contracted label cut: grouped", "ij,jk->ik", [("A", (4, 6), (2, 3), "float32"), ("B", (6, 5), (3, 5), "float32")], None, None),
    ("gemm, operands cut differently: retile", "ij,jk->ik", [("A", (5, 6), (5, 2), "float64"), ("B", (6, 5), (3, 5), "float64")], None, None),
    ("trace", "ii->", [("A", (5, 5), (2, 2), "float64")], None, None),
    ("batched matmul", "bij,bjk->bik", [("A", (2, 3, 4), (1, 3, 4), "float32"), ("B", (2, 4, 5), (1, 4, 5), "float32")], None, None),
    ("two contracted labels", "abcd,cdef->abef", [("A", (2, 2, 3, 3), (2, 2, 3, 3), "float32"), ("B", (3, 3, 2, 2), (3, 3, 2, 2), "float32")], None, None),
    ("3-operand chain lowered to binary", "ij,jk,kl->il", [("A", (4, 8), (4, 8), "float32"), ("B", (8, 2), (8, 2), "float32"), ("C", (2, 6), (2, 6), "float32")], None, None),
    ("max-plus product", "ij,jk->ik", [("A", (4, 6), (2, 3), "float64"), ("B", (6, 5), (3, 5), "float64")], "add", "max"),
    ("unary relu, sum", "ij->i", [("A", (4, 6), (4, 6), "float32")], "relu", "sum"),
    ("scalar operand", ",ij->ij", [("s", (), (), "float64"), ("A", (3, 4), (2, 4), "float64")], None, None),
    ("broadcast size-1 axis", "ij,jk->ik", [("A", (3, 1), (3, 1), "float64"), ("B", (4, 2), (4, 2), "float64")], None, None),
    ("contracted label of size 0: fill", "ij,jk->ik", [("A", (3, 0), (3, 1), "float32"), ("B", (0, 4), (1, 4), "float32")], None, "prod"),
]


def _values(operands):
    return tuple(TiledValue(n, s, d, t, tuple(f"d{k}" for k in range(len(s)))) for n, s, t, d in operands)


def _render(title, spec, operands, join, agg) -> str:
    plan = plan_einsum(spec, _values(operands), join, agg)
    names = {v.name: v.name for v in plan.inputs} | {c.value: c.value for c in compile_plan(plan)}
    ops = "; ".join(f"{n}{list(s)} tile {list(t)} {d}" for n, s, t, d in operands)
    lines = [f"-- title: {title}", f"-- einsum: {spec} join={join or 'mul'} agg={agg or 'sum'}", f"-- operands: {ops}"]
    for c in compile_plan(plan):
        lines.append(f"-- step -> {c.value}")
        lines.append(bind_sql(c.sql(), names) + ";")
    return "\n".join(lines)


def _snapshots() -> dict[str, str]:
    text = FIXTURE.read_text() if FIXTURE.exists() else ""
    blocks = [b.strip() for b in re.split(r"\n(?=-- title: )", text) if b.strip()]
    return {re.match(r"-- title: (.*)", b).group(1): b for b in blocks}


def test_update_or_compare_snapshots():
    rendered = {c[0]: _render(*c) for c in CASES}
    if os.environ.get("EDS_UPDATE_SNAPSHOTS"):
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text("\n\n".join(rendered.values()) + "\n")
    stored = _snapshots()
    assert list(stored) == list(rendered), "snapshot titles differ: regenerate with EDS_UPDATE_SNAPSHOTS=1"
    for title, text in rendered.items():
        assert stored[title] == text, f"SQL for {title!r} changed"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_snapshot_plans_compute_the_right_answer(db, case):
    title, spec, operands, join, agg = case
    rng = np.random.default_rng(len(title))
    arrays = [random_array(rng, s, d) for _, s, _, d in operands]
    for (n, s, t, d), a in zip(operands, arrays):
        db.store(f"snap_{n}", a, tile=t, replace=True)
    got = db.einsum(spec, *[f"snap_{n}" for n, *_ in operands], join=join, agg=agg).to_numpy()
    full = spec if "->" in spec else None
    want = reference(full, *arrays, join=join or "mul", agg=agg or "sum")
    assert_close(got, want)
