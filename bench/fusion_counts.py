"""Statements each benchmark graph runs, one step per node against element-wise fusion alone and
against full fusion (single-tile steps as programs) (docs/DESIGN.md "Fused graphs", "Programs"): the CREATE TABLE / INSERT statements the DuckDB backend runs for the plan's steps,
counted, and the results checked against numpy. Small sizes (tests/graphs.py's defaults): this
counts statements, it times nothing.

    .venv/bin/python bench/fusion_counts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

import eindecomp_sql as eds  # noqa: E402
from graphs import attention, chain, ffn, llama_block, random_inputs  # noqa: E402

WORKLOADS = {"chain6": chain, "ffn": ffn, "attention": attention, "llama_block": llama_block}


def count_statements(db, plan, xs) -> tuple[int, np.ndarray]:
    """CREATE and INSERT statements run for the plan's steps (catalog rows aside), and the result."""
    ran = []
    run = db.backend._run

    def recording(sql, params=None):
        ran.append(sql)
        return run(sql, params)

    db.backend._run = recording
    try:
        out = plan.run(db, **xs).to_numpy()
    finally:
        del db.backend._run
    writes = [s for s in ran if s.startswith(("CREATE", "INSERT INTO")) and "eds_catalog" not in s]
    return len(writes), out


def main():
    with eds.connect() as db:
        print(f"{'graph':12s} {'workers':>7s} {'nodes':>5s} {'unfused':>8s} {'elementwise':>11s} {'fused':>6s}  "
              "fused nodes")
        for name, make in WORKLOADS.items():
            g, ref = make()
            xs = random_inputs(g, 0)
            want = ref(**xs)
            for workers in (1, 4):
                counts = {}
                for fuse in (False, "elementwise", True):
                    p = g.plan(workers=workers, fuse=fuse)
                    counts[fuse], got = count_statements(db, p, xs)
                    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
                print(f"{name:12s} {workers:7d} {len(g.nodes):5d} {counts[False]:8d} {counts['elementwise']:11d} "
                      f"{counts[True]:6d}  "
                      f"{', '.join(f'{a}->{b}' for a, b in p.fused.items())}")


if __name__ == "__main__":
    main()
