"""The pure layers import without the engine: notation, graph and plan never load duckdb,
pyarrow or sqlglot (checked in a fresh interpreter)."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["eindecomp_sql", "eindecomp_sql.notation", "eindecomp_sql.graph",
                                    "eindecomp_sql.plan"])
def test_pure_layers_do_not_load_the_engine(module):
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in ('duckdb', 'pyarrow', 'sqlglot') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} loaded {out.stdout.strip()}"


def test_the_package_face_loads_on_first_use():
    code = ("import eindecomp_sql as eds, numpy as np\n"
            "print(eds.einsum('ij->', np.arange(4.0).reshape(2, 2)), eds.Graph.__name__, "
            "eds.Tensor.__name__, eds.Session.__name__, set(eds.__all__) <= set(dir(eds)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["6.0", "Graph", "Tensor", "Session", "True"], out.stdout
