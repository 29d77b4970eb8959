"""The capped FFN chain with every input stored (x too), timed in the tree given: for an A/B of
a grouped step's operand handed once per group (docs/DESIGN.md, "An operand alike in every
member") against the commit before, run in alternating processes.

    git worktree add /tmp/oldtree c2d056e~1 && ln -s ../udfs /tmp/oldtree/eindecomp_sql/udfs
    for v in /work/main /tmp/oldtree /work/main /tmp/oldtree; do
        (cd $v && PYTHONPATH=$v .venv/bin/python /work/main/bench/shared_operand_probe.py $v); done

(the symlink: the editable install maps ``eindecomp_sql.udfs`` to the checkout's ``udfs``, so
without it the old tree would run the new kernels). Pin with ``taskset -c 0`` for one core.
"""

from __future__ import annotations

import statistics
import sys
import time

sys.path.insert(0, (sys.argv[1] if len(sys.argv) > 1 else ".") + "/bench")

import numpy as np  # noqa: E402

import eindecomp_sql as eds  # noqa: E402
from chain_bench import ffn, plan  # noqa: E402


def main():
    b, d, f = 2048, 2048, 7168
    rng = np.random.default_rng(0)
    xs = {"x": rng.standard_normal((b, d), dtype=np.float32),
          "w1": rng.standard_normal((d, f), dtype=np.float32) / float(np.sqrt(d)),
          "w2": rng.standard_normal((f, d), dtype=np.float32) / float(np.sqrt(f))}
    g = ffn(b, d, f, "float32")
    with eds.connect(memory=None, tile_bytes=13107200) as db:  # gpu_bench's cap rule: a 16th of the working set
        p = plan(db, g, "always")
        stored = {k: db.store(k.upper(), a, tile=p.plan_input_tile(k)) for k, a in xs.items()}
        p = plan(db, g, "always", inputs=stored)
        print(p.plan.explain().splitlines()[0][:150])
        ts = []
        for _ in range(6):
            t = time.perf_counter()
            y = p.run(db, **stored).to_numpy()
            ts.append(time.perf_counter() - t)
    want = np.maximum(xs["x"] @ xs["w1"], 0) @ xs["w2"]
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-4
    ts = ts[1:]  # the first run warms
    print(sys.argv[1] if len(sys.argv) > 1 else ".",
          f"median {statistics.median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f})")


if __name__ == "__main__":
    main()
