"""bench/scaling.py end to end at its quick sizes: one pinned child per core count, every
method timed in each, the SQL path's plan steps split into kernel and non-kernel time."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "scaling.py"


def test_quick_scaling_run(tmp_path):
    out = tmp_path / "scaling"
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=120)
    res = json.loads(out.with_suffix(".json").read_text())
    every = len(os.sched_getaffinity(0))
    assert sorted(res["cores"]) == sorted({1, min(2, every), every})
    for c in res["cores"]:
        run = res["runs"][str(c)]
        # the child really ran on c cores, with every pool sized to them
        assert len(run["facts"]["affinity"]) == c
        assert run["facts"]["kernel_threads"] == c and run["facts"]["duckdb_threads"] == c
        assert run["facts"]["blas_threads"] and set(run["facts"]["blas_threads"]) == {c}
        assert len(run["workloads"]) == 4
        for name, w in run["workloads"].items():
            assert sorted(w["times"]) == sorted(["numpy", "dask", "eds_stored", "eds_numpy"]), name
            for meth, ts in w["times"].items():
                assert len(ts) == res["rounds"] and all(t > 0 for t in ts), (c, name, meth)
            for prof in w["profiles"]:
                assert prof["steps"] and len(prof["steps"]) == len(w["step_names"])
                for s in prof["steps"]:
                    assert s["calls"] >= 1 and 0 < s["kernel"] <= s["wall"] and s["outside"] >= 0
    text = out.with_suffix(".md").read_text()
    assert "## Times" in text and "wall time outside the kernels" in text
    if 2 in res["cores"]:
        assert "## Projection to 16 cores" in text
