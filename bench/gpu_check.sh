#!/usr/bin/env bash
# Issue 11's checks on a machine with an NVIDIA GPU, as one short script.
#
#   bench/gpu_check.sh fetch     # here, with the network: wheels the GPU machine lacks, into .whl/
#   bench/gpu_check.sh run       # there (CUDA, CuPy, PyTorch, numpy, pyarrow installed; no network)
#   bench/gpu_check.sh cpu       # there too: issue 9's benchmarks on the machine's 16 CPU cores
#   bench/gpu_check.sh all       # there: both, shortened, in one command under 600 s
#   bench/gpu_check.sh profile   # there: where the open questions' time goes, ~5 minutes (below)
#   bench/gpu_check.sh alloc     # there: the allocator questions the second lease left, ~4 minutes
#   bench/gpu_check.sh lease4    # there: the third lease's question (the cold GEMM in 128 MiB tiles), the
#                                #   FFN pair and the Belady bar on the device, ~5 minutes
#
# `run` installs the carried wheels (duckdb, sqlglot) and this checkout into /tmp/site, then
#   1. runs tests/test_device_kernels.py with the kernels on the real GPU (CuPy; a fresh machine
#      compiles CuPy's kernels for each dtype on first use, so hypothesis draws 25 examples),
#   2. runs bench/gpu_bench.py at the issue's sizes (GEMM 16384² TF32, FFN bfloat16),
# writing logs and bench JSON under $OUT (or ./gpu_out). `cpu` installs the same way (with dask,
# which scaling.py compares against) and runs, each under a time cap, bench/scaling.py pinned to
# 2 cores and to all of them, its big GEMMs on all cores, bench/cursor_probe.py on all cores (the
# parallel data path's open question) and bench/graph_bars.py --pair, ~6 minutes on 16 cores.
# `profile` answers what the first lease (2026-11-26) left open, each under a time cap: the
# capped FFN's 5 s a run on the GPU (bench/gpu_bench.py --only ffn_half --profile: its plan, each
# step's wall and kernel time, cProfile's top functions), and on the CPU cores (GPU hidden) the
# SQL path's time outside the kernels, which grew with the cores (`bij,bjk`: 111 ms at 16 cores,
# 28 ms at 2): bench/trim_bench.py (page faults of freed buffers, DuckDB's allocators as DuckDB
# runs them and as a session leaves them), every statement around a stored GEMM timed
# (bench/statements_probe.py), scaling.py's step split with page faults a call, and py-spy's
# native stacks of the stored `bij,bjk` (the py-spy wheel carried in .whl/).
# `alloc` (GPU hidden, all 16 cores) measures what the second lease (2026-11-26) could not: the
# stored path with big blocks sent to jemalloc's shared oversize arena (the code since 14fea4c;
# the lease measured its first version, threads bound to arena 0) against DuckDB's allocators
# and against big blocks in each thread's arena (bench/trim_bench.py, three modes), the oversize
# arena's kept block at 8192² and 6000² (bench/alloc_probe.py with and without
# --oversize-decay 0), whether the shared arena slows a user's own parallel SQL
# (bench/duckdb_alloc_probe.py), DuckDB's per-append BLOB hash there (bench/blob_hash_probe.py),
# and bench/scaling.py --cores all for the table.
# .whl/ must be ignored by git (`echo /.whl/ >> .git/info/exclude`) and carried.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
if [ "$mode" = fetch ]; then
    py=${PYTHON:-.venv/bin/python}
    for pkg in "duckdb==$($py -c 'import duckdb; print(duckdb.__version__)')" \
               "sqlglot==$($py -c 'import sqlglot; print(sqlglot.__version__)')" \
               "dask==$($py -c 'import dask; print(dask.__version__)')" partd locket py-spy; do
        $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$pkg" || $py -m pip download -q --no-deps -d .whl "$pkg"
    done
    ls -la .whl
    exit 0
fi
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . \
    > "$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
export PYTHONPATH=/tmp/site
cpu_checks() {
    set +e
    (nproc; lscpu | grep -E 'Model name|^CPU\(s\)'; free -g | head -2) | tee -a "$out/machine.txt"
    # (a script's own folder, bench/, heads sys.path, not the checkout: no -P needed here; at most
    # 8 files come back from $OUT: scaling's tables are in its .md files, the probes' JSON beside
    # them, and the tails below go to stdout). Each line reports its exit status (124: its cap cut
    # it short)
    timeout ${SCALING_CAP:-180} python3 bench/scaling.py --cores ${SCALING_CORES:-2,all} --rounds 3 --out "$out/scaling" 2>&1 | tail -3
    echo "scaling exit: ${PIPESTATUS[0]}"
    if [ "$mode" = cpu ]; then
        timeout 130 python3 bench/scaling.py --cores all --big --only gemm_6000_f64,gemm_8192_f32 --rounds 3 \
            --out "$out/scaling_big" 2>&1 | tail -3
        echo "scaling --big exit: ${PIPESTATUS[0]}"
    fi
    timeout ${CURSOR_CAP:-130} python3 bench/cursor_probe.py --cores all --parts 4,16 --only gemm_4096,gemm_8192,bij_bjk \
        --rounds 3 --out "$out/cursor_probe.json" 2>&1 | tail -14
    echo "cursor_probe exit: ${PIPESTATUS[0]}"
    if [ "$mode" = cpu ]; then
        timeout 80 python3 bench/graph_bars.py --pair --rounds 5 --out "$out/graph_bars.json" 2>&1 | tail -8
        echo "graph_bars exit: ${PIPESTATUS[0]}"
    fi
}
gpu_checks() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/machine.txt"
    python3 -c "import cupy, ml_dtypes, numpy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount(), 'numpy', numpy.__version__)" | tee -a "$out/machine.txt"
    set +e
    # -P: the checkout's own eindecomp_sql/ (no udfs/ inside) must not shadow the installed package
    EDS_TEST_DEVICE_NAMESPACE=cupy EDS_EXAMPLES=${EDS_EXAMPLES:-25} timeout ${TESTS_CAP:-300} python3 -P -m pytest \
        -p no:cacheprovider -q -x --rootdir=. -c pyproject.toml tests/test_device_kernels.py 2>&1 | tee "$out/tests.log" | tail -25
    echo "tests exit: ${PIPESTATUS[0]}"
    timeout ${BENCH_CAP:-300} python3 bench/gpu_bench.py --out "$out/gpu_bench.json" 2>&1 | tee "$out/bench.log" | tail -20
    echo "bench exit: ${PIPESTATUS[0]}"
}
profile_checks() {
    set +e
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/machine.txt"
    (nproc; lscpu | grep -E 'Model name|^CPU\(s\)') | tee -a "$out/machine.txt"
    timeout 150 python3 bench/gpu_bench.py --only ffn_half --profile "$out/ffn_half_profile.txt" \
        --out "$out/ffn_half.json" 2>&1 | tail -6
    echo "ffn_half profile exit: ${PIPESTATUS[0]}"
    export CUDA_VISIBLE_DEVICES=  # the CPU's own numbers from here on ("auto" would use the GPU)
    timeout 100 python3 bench/trim_bench.py --processes 1 --calls 20 --pause 0.8 2>&1 | tee "$out/trim_bench.txt"
    echo "trim_bench exit: ${PIPESTATUS[0]}"
    # every statement around a stored 4096² GEMM, timed, with DuckDB on all cores and on 2
    timeout 40 python3 bench/statements_probe.py --size 4096 --calls 8 --out "$out/statements_all.json" 2>&1
    timeout 40 python3 bench/statements_probe.py --size 4096 --calls 8 --threads 2 2>&1
    timeout 60 python3 bench/scaling.py --cores all --rounds 3 --only batched_bij_bjk,gemm_4096 \
        --out "$out/scaling_split" 2>&1 | tail -2
    echo "scaling exit: ${PIPESTATUS[0]}"
    if [ -x /tmp/site/bin/py-spy ]; then
        timeout 60 /tmp/site/bin/py-spy record --native --format raw --rate 250 -o "$out/bij_bjk_pyspy.txt" -- \
            python3 bench/trim_bench.py --child kept --calls 12 --pause 0 2>&1 | tail -2
        echo "py-spy exit: ${PIPESTATUS[0]}"
        # the frames that held most samples, innermost first (the file has every stack)
        python3 -c "import collections,sys; c=collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(' ')
    c[stack.split(';')[-1]] += int(n)
[print(n, f[:150]) for f, n in c.most_common(25)]" "$out/bij_bjk_pyspy.txt"
    fi
}
alloc_checks() {
    set +e
    export CUDA_VISIBLE_DEVICES=
    (nproc; lscpu | grep -E 'Model name|^CPU\(s\)') | tee -a "$out/machine.txt"
    timeout 100 python3 bench/trim_bench.py --processes 1 --calls 16 --pause 0.5 2>&1 | tee "$out/trim_bench.txt"
    for n in "8192 float32" "6000 float64"; do
        set -- $n
        timeout 40 python3 bench/alloc_probe.py --sizes $1 --dtype $2 --calls 4 --processes 1
        timeout 40 python3 bench/alloc_probe.py --sizes $1 --dtype $2 --calls 4 --processes 1 --oversize-decay 0
    done 2>&1 | tee "$out/alloc_probe.txt"
    timeout 90 python3 bench/duckdb_alloc_probe.py --rows 20000000 --rounds 3 --processes 1 2>&1 | tee "$out/duckdb_alloc.txt"
    timeout 30 python3 bench/blob_hash_probe.py 2>&1 | tee "$out/blob_hash.txt"
    timeout 60 python3 bench/scaling.py --cores all --rounds 3 --only batched_bij_bjk,gemm_4096,two_label_abcd_cdef \
        --out "$out/scaling" 2>&1 | grep -E "eds_|numpy \||page faults"
    set -e
}
case "$mode" in
    run) gpu_checks ;;
    alloc) alloc_checks ;;
    profile) profile_checks ;;
    cpu) cpu_checks ;;
    # a lease of 15 minutes in one command under 600 s: the GPU's checks, then the 16-core ones
    # (all cores only, no big GEMMs, no graph bars), each under a shorter cap
    all) export EDS_EXAMPLES=${EDS_EXAMPLES:-8} SCALING_CORES=${SCALING_CORES:-all} TESTS_CAP=${TESTS_CAP:-100} \
             BENCH_CAP=${BENCH_CAP:-210} SCALING_CAP=${SCALING_CAP:-130} CURSOR_CAP=${CURSOR_CAP:-90}
         gpu_checks; cpu_checks ;;
    # the third lease's open question (~4 minutes): the cold GEMM with tiles under 256 MiB, whose
    # Arrow copies reuse the heap (a 512 MiB tile's is mapped and faulted in afresh: 0.82 s
    # against 0.075 s for the same bytes in 128 MiB tiles on the 2-core VM), then the FFN pair
    lease4) set +e
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$out/machine.txt"
        for tb in "" 134217728; do
            timeout 120 python3 bench/gpu_bench.py --only gemm ${tb:+--tile-bytes $tb} \
                --out "$out/gemm${tb:+_$tb}.json" 2>&1 | grep -E "GEMM|same"
            echo "gemm ${tb:-default} exit: ${PIPESTATUS[0]}"
        done
        timeout 120 python3 bench/gpu_bench.py --only ffn --out "$out/ffn.json" 2>&1 | grep -E "FFN|Capped"
        # the Belady bar on the real device (bytes do not depend on its speed; tiny sizes)
        timeout 60 python3 bench/device_bytes.py --namespace cupy --fractions 0.5,0.25 2>&1 | tail -9
        set -e ;;
    # the twenty-third session's open question (~4 minutes, CPU only): the 16-core bars with
    # tiles over 16 MiB in struct parts (no BLOB hash on write): the phases around the kernel
    # and the bars' ratios, then both layouts side by side
    struct16) set +e
        (nproc; lscpu | grep -E 'Model name|^CPU\(s\)') | tee -a "$out/machine.txt"
        export CUDA_VISIBLE_DEVICES=
        timeout 90 python3 bench/udf_phases.py --workloads batched_bij_bjk,gemm_4096,two_label_abcd_cdef --calls 6 2>&1 | tail -5
        timeout 120 python3 bench/scaling.py --cores all --only gemm_4096,batched_bij_bjk,gemm_2048 --rounds 5 \
            --out "$out/scaling" 2>&1 | tail -3
        timeout 90 python3 bench/struct_tiles.py --rounds 7 --tag 16core --out "$out/struct_tiles_16core.json" 2>&1 | tail -6
        set -e ;;
    *) echo "usage: $0 fetch|run|cpu|all|profile|alloc|lease4|struct16" >&2; exit 2 ;;
esac
