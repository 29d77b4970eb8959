import pytest

import eindecomp_sql as eds
from helpers import *  # noqa: F401,F403  (hypothesis profile)


@pytest.fixture(scope="module")
def db():
    s = eds.connect()
    yield s
    s.close()
