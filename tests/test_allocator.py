"""Freed tile buffers are reused, not page-faulted in again (backends/allocator.py).

Each check runs in a subprocess of its own: the tuning is process-wide and applied once."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from eindecomp_sql.backends import allocator

# mallopt thresholds are glibc's: elsewhere the tuning is (correctly) not applied
glibc = pytest.mark.skipif(allocator._libc() is None, reason="glibc's mallopt only (Linux)")

SCRIPT = textwrap.dedent(
    """
    import json, resource, numpy as np, eindecomp_sql as eds
    from eindecomp_sql.backends import allocator
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3000, 3000)).astype(np.float32)   # 36 MB: above glibc's 32 MiB mmap cap
    b = rng.standard_normal((3000, 3000)).astype(np.float32)
    faults = []
    for _ in range(3):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c = eds.einsum("ij,ij->ij", a, b, join="add")
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        assert np.array_equal(c, a + b)
    print(json.dumps({"retaining": allocator.retaining(), "faults": faults}))
    """
)


def _run(env_value):
    env = dict(os.environ)
    env.pop("EDS_RETAIN_MEMORY", None)
    if env_value is not None:
        env["EDS_RETAIN_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_repeated_einsum_reuses_freed_buffers():
    tuned, plain = _run(None), _run("0")
    assert tuned["retaining"] and not plain["retaining"]
    pages = 3000 * 3000 * 4 // 4096  # one 36 MB buffer in 4 KiB pages
    # the first call faults its buffers in; later calls find them in the heap again
    assert tuned["faults"][-1] < pages // 4, tuned
    # without the tuning each call maps its big buffers afresh (several of them per call)
    assert plain["faults"][-1] > tuned["faults"][-1] + pages, (plain, tuned)

