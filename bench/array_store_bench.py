"""Storing an embeddings file in array form, ``(id BIGINT, emb FLOAT[w])`` Parquet, under a
memory budget: peak resident rise and time of ``db.store(name, path)`` in a fresh process, and
the stored matrix checked against the file. With ``--trees A,B`` each case runs once per source
tree (``PYTHONPATH``), interleaved, to compare two commits side by side (a tree from ``git archive``
needs ``eindecomp_sql/udfs`` and ``eindecomp_sql/sql_templates`` linked to its ``udfs`` and
``sql_templates``, or the editable install's own are imported). ``--options``: the store's
keywords, as Python (``"dict(tile=(256, 8192))"``).

    .venv/bin/python bench/array_store_bench.py --rows 16384 --width 8192 --memory 200MB --order ascending
    .venv/bin/python bench/array_store_bench.py --trees /tmp/before,. --rounds 2
    .venv/bin/python bench/array_store_bench.py --options "dict(value='emb')"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
import eindecomp_sql as eds
rows, width, memory, order, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
options = eval(sys.argv[6])  # the store's keywords, as the command line gave them
path = os.path.join(folder, "emb.parquet")
rng = np.random.default_rng(0)
ids = np.arange(rows) if order == "ascending" else rng.permutation(rows)
if not os.path.exists(path):
    schema = pa.schema([("id", pa.int64()), ("emb", pa.list_(pa.float32(), width))])
    with pq.ParquetWriter(path, schema) as w:
        for s in range(0, rows, 256):  # 256-row groups
            blk = np.random.default_rng(s).standard_normal((min(256, rows - s), width), dtype=np.float32)
            w.write_batch(pa.record_batch([pa.array(ids[s:s + 256] * 3), pa.FixedSizeListArray.from_arrays(
                pa.array(blk.ravel()), width)], schema=schema))
db = eds.connect(os.path.join(folder, f"t{os.getpid()}.duckdb"), memory=memory)
rss = lambda: int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
base = rss()
t0 = time.perf_counter()
T = db.store("E", path, **options)
seconds = time.perf_counter() - t0
rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 - base
got = T.to_numpy()
table = pq.read_table(path)
want = np.asarray(table.column("emb").combine_chunks().flatten()).reshape(rows, width)[np.argsort(table.column("id"))]
print(json.dumps({"seconds": round(seconds, 2), "rise_mb": rise, "tile": list(T.tile), "exact": bool(np.array_equal(got, want))}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--memory", default="200MB")
    ap.add_argument("--order", default="ascending", choices=["ascending", "shuffled"])
    ap.add_argument("--trees", default=".", help="source trees to compare, comma-separated")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--options", default="{}", help="the store's keywords, as Python: \"dict(tile=(256, 8192))\"")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.rounds):
            for tree in args.trees.split(","):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
                out = subprocess.run([sys.executable, "-c", CHILD, str(args.rows), str(args.width), args.memory,
                                      args.order, folder, args.options], capture_output=True, text=True, env=env, cwd=tree)
                line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr.strip()[-300:]
                print(json.dumps({"tree": tree, "round": r, "memory": args.memory, "order": args.order,
                                  "rows": args.rows, "width": args.width, "options": args.options}), line, flush=True)


if __name__ == "__main__":
    main()
