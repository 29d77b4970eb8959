"""The seams engines and devices plug into: create_backend, the Backend protocol, the cost model."""

import subprocess
import sys

import numpy as np
import pytest

import eindecomp_sql as eds
from eindecomp_sql import EinsumError
from eindecomp_sql.backends import BACKENDS, Backend, create_backend
from eindecomp_sql.plan import TiledValue, plan_einsum
from eindecomp_sql.plan.cost import DEFAULT_COSTS, CostModel, Costs


def protocol_members() -> set[str]:
    names = {n for n in vars(Backend) if not n.startswith("_")}
    return names | set(Backend.__annotations__)


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_has_what_the_session_calls(name):
    b = create_backend(name)
    try:
        missing = [m for m in protocol_members() if not hasattr(b, m)]
        assert not missing, f"{name} lacks {missing}"
        assert b.name == name and isinstance(b.cost_model, CostModel)
    finally:
        b.close()


def test_the_session_calls_nothing_beyond_the_protocol():
    """Every ``self.backend.X`` in the session (and the tensor handle) is in the protocol."""
    import re
    from pathlib import Path

    root = Path(eds.__file__).parent
    used = set()
    for f in ("session.py", "tensor.py", "sql_functions.py", "io.py"):
        used |= set(re.findall(r"\bbackend\.([A-Za-z_]\w*)", (root / f).read_text()))
    assert used <= protocol_members(), used - protocol_members()


def test_unknown_backend_is_an_einsum_error():
    with pytest.raises(EinsumError, match="unknown backend 'oracle'.*'duckdb', 'reference'.*'spark'"):
        eds.connect(backend="oracle")


def test_session_plans_under_its_backends_cost_model():
    with eds.connect() as db:
        A = db.store("A", np.ones((64, 48)), tile=(16, 48))
        assert db.plan("ij->i", A).model == db.backend.cost_model == DEFAULT_COSTS


def test_the_cost_model_decides_the_chunking():
    """A cost model is data the optimizer reads: weights that make a retile cheaper than
    grouping flip the choice between re-tiling a cut operand and grouping its pieces."""
    a = TiledValue("A", (512, 512), "float64", (512, 64), ("d0", "d1"))
    b = TiledValue("B", (512, 512), "float64", None, ("d0", "d1"))  # free: cut as the plan likes
    expensive = CostModel("costly-groups", group=100.0, retile=0.01)
    cheap = CostModel("costly-retiles", group=0.0, retile=100.0)
    retiles = {m.name: sum(s.describe().startswith("retile") for s in plan_einsum("ij,jk->ik", (a, b), costs=m).steps)
               for m in (expensive, cheap)}
    assert retiles == {"costly-groups": 1, "costly-retiles": 0}
    assert plan_einsum("ij,jk->ik", (a, b), costs=cheap).model == cheap
    assert CostModel(retile=2.0).total(Costs(join=10, retile=5)) == 20.0


def test_plan_layers_import_without_engines():
    code = ("import sys, eindecomp_sql.plan, eindecomp_sql.plan.pipeline, eindecomp_sql.backends.base;"
            "print(sorted(m for m in ('duckdb', 'pyarrow', 'sqlglot') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
