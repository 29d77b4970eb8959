import pytest

import eindecomp_sql as eds
from helpers import *  # noqa: F401,F403  (hypothesis profile)

# Every test that takes ``db`` or ``backend`` runs once per backend: the DuckDB engine, the
# reference backend that runs the same plans step by step in numpy
# (eindecomp_sql/backends/reference.py), and the simulated-device backend that runs them as tile
# tasks through the device worker's runtime (backends/device_sim.py). A test about DuckDB itself
# is marked ``duckdb_only("why")`` and runs on DuckDB alone.
BACKENDS = ("duckdb", "reference", "device-sim")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "duckdb_only(reason): the test is about DuckDB itself (SQL, the connection, files, its tables); "
        "its backend parameter (and so db) is duckdb only",
    )


def pytest_generate_tests(metafunc):
    """``backend`` (which ``db`` takes) is every backend, or ``duckdb`` alone for a test marked
    ``duckdb_only`` (with a reason: nothing is restricted silently)."""
    if "backend" not in metafunc.fixturenames:
        return
    only = metafunc.definition.get_closest_marker("duckdb_only")
    if only is not None and not (only.args or only.kwargs.get("reason")):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: duckdb_only needs a reason")
    metafunc.parametrize("backend", ["duckdb"] if only is not None else list(BACKENDS), scope="module")


@pytest.fixture(scope="module")
def db(backend):
    s = eds.connect(backend=backend)
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _numpy_face_on_the_backend(request):
    """In a test run per backend, ``eds.einsum`` (the numpy face, on a default session) runs on
    that backend too: for ``reference`` a fresh reference session stands in as the default
    session for the test."""
    if "backend" not in request.fixturenames or request.getfixturevalue("backend") == "duckdb":
        yield
        return
    from eindecomp_sql import api

    session = eds.connect(backend=request.getfixturevalue("backend"))
    with api._default_lock:
        saved, api._default = api._default, session
    try:
        yield
    finally:
        with api._default_lock:
            api._default = saved
        session.close()
