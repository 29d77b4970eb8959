"""On paper (issue 13): what EinDecomp picks for a LLaMA block when the workers are machines.

For 8, 64 and 512 workers, the plans EinDecomp, data-parallel and model-parallel make for one
LLaMA-7B-sized block (s=4096 tokens, d=4096, 32 heads of 128, f=11008, float32), and the bytes
each would move between machines on Spark: ``compile.spark.shuffle_bytes`` with broadcasts
off (on many machines a broadcast moves its bytes once per machine, so it is no saving), summed
over the plan's steps. Nothing runs: planning only.

    .venv/bin/python bench/scaleout_paper.py [--out bench/scaleout_paper.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

from eindecomp_sql.compile.spark import shuffle_bytes  # noqa: E402
from eindecomp_sql.plan import RetileStep  # noqa: E402
from graphs import llama_block  # noqa: E402

WORKERS = (8, 64, 512)
STRATEGIES = ("eindecomp", "data-parallel", "model-parallel")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "scaleout_paper.json"))
    args = ap.parse_args()
    g, _ = llama_block(s=4096, d=4096, h=32, e=128, f=11008, dtype="float32")
    rows = []
    for w in WORKERS:
        for strategy in STRATEGIES:
            t = time.perf_counter()
            p = g.plan(workers=w, strategy=strategy)
            plan = p.plan
            moved = sum(shuffle_bytes(s, -1) for s in plan.steps)
            rows.append({"workers": w, "strategy": strategy, "steps": len(plan.steps),
                         "retiles": sum(isinstance(s, RetileStep) for s in plan.steps),
                         "shuffle_bytes": moved, "cost_units": plan.cost, "plan_s": time.perf_counter() - t,
                         "pieces": {n.result.name: p.choice.pieces.get(n.result.name) for n in p.nodes[:3]}})
            print(rows[-1], flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("| workers | " + " | ".join(f"{s} (GB moved, steps, retiles)" for s in STRATEGIES) + " |")
    print("|---|" + "---|" * len(STRATEGIES))
    for w in WORKERS:
        cells = []
        for s in STRATEGIES:
            r = next(r for r in rows if r["workers"] == w and r["strategy"] == s)
            cells.append(f"{r['shuffle_bytes'] / 1e9:.2f} GB, {r['steps']}, {r['retiles']}")
        print(f"| {w} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
