#!/usr/bin/env bash
# dslaunch's GPU check: one command on a machine with one CUDA GPU, about 6 minutes on an H200.
#
#   scripts/gpu/check.sh [RESULT_DIR]        (default: $OUT, else ./gpu-check; `make gpu-check`)
#
# Every step runs under its own timeout, so a hang or failure costs that step only, and appends
# one line to RESULT_DIR/steps.jsonl; each step's output is RESULT_DIR/<step>.log. At the end
# scripts/gpu/report.py writes RESULT_DIR/gpu-check.json and gpu-check.md; on a GPU the tables
# also go to scripts/bench/results/ (gpu_check.*, gpu_kernels_bench.*), which BENCHMARKS.md is
# assembled from. The exit status is 0 only when every step passed.
#
# The GPU machine has Python with its own CUDA torch, triton, pytest, pyyaml, psutil, nvidia-ml-py
# and no network: dslaunch is installed there editable with --no-deps onto that torch, and the
# dependencies it lacks (paramiko and its needs, crc32c) come as wheels in ./.whl (git-ignored),
# prepared on a machine with PyPI by
#   scripts/gpu/wheels.sh [PYTHON_VERSION]     (default 3.12)
# and carried with the working tree.
# Without a CUDA device (CI: tests/gpu/test_check_script.py) it says so in one line, runs its
# setup, the tests (which skip) and one engine configuration on CPU to exercise the bookkeeping,
# writes nothing under scripts/, and exits 0 when those pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULT_DIR=${1:-${OUT:-gpu-check}}
mkdir -p "$RESULT_DIR"
RESULT_DIR=$(cd "$RESULT_DIR" && pwd)
export PY=${PYTHON:-python3}
STEPS="$RESULT_DIR/steps.jsonl"
: >"$STEPS"
export PYTHONUNBUFFERED=1

# step NAME SECONDS CMD...: run CMD (a command or an exported function) under a timeout, log it,
# record its status and duration.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s%N)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" >"$RESULT_DIR/$name.log" 2>&1
    rc=$?
    printf '{"step": "%s", "rc": %d, "ms": %d, "limit": %d}\n' \
        "$name" "$rc" $((($(date +%s%N) - start) / 1000000)) "$limit" >>"$STEPS"
    echo "   rc=$rc  ($(tail -n 1 "$RESULT_DIR/$name.log" | cut -c1-160))"
    return 0
}

export GPU=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$GPU" != 1 ]; then
    echo "gpu-check: no CUDA device here: setup, bookkeeping and one engine configuration on CPU only"
fi

# --- setup: dslaunch onto the machine's own torch ------------------------------------------
setup() {
    if ! $PY -c "import paramiko, crc32c" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl || return 1
    fi
    if ! $PY -c "import dslaunch.launcher" 2>/dev/null; then  # a dev venv has it already
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile -e . || return 1
    fi
    # Lightning's DeepSpeed strategy (tests/gpu/test_lightning.py) imports `deepspeed`: dslaunch's
    # distribution, unless a real DeepSpeed is there (then that test skips). GPU machines only: a
    # dev venv must not get it (its tests, `make bench`'s real DeepSpeed).
    if [ "$GPU" = 1 ] && ! $PY -c "import deepspeed" 2>/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile -e compat/deepspeed || return 1
    fi
    $PY -c "import dslaunch.launcher, paramiko, crc32c; print('dslaunch importable with its dependencies')"
}
export -f setup
step setup 120 setup
export PATH="$(dirname "$(command -v "$PY")"):$PATH"  # the dslaunch command beside that python

step env 60 $PY scripts/gpu/report.py --env "$RESULT_DIR/env.json"

# --- tests on the device ----------------------------------------------------------------------
step pytest_gpu 240 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider
if [ "$GPU" = 1 ]; then  # tests that take another path when CUDA is present (CI runs them on CPU)
    step pytest_cuda_paths 180 $PY -m pytest -q -p no:cacheprovider \
        tests/kernels/test_dispatch.py tests/accelerator tests/kernels/triton/test_availability.py \
        tests/runtime/test_dist.py tests/runtime/test_timers.py tests/launcher/test_plan.py \
        tests/launcher/test_workerenv.py tests/runtime/test_heartbeat.py
fi

# --- the engine on NCCL against the same run on gloo ------------------------------------------
export CFG="$RESULT_DIR/engine"
$PY scripts/gpu/configs.py "$CFG" >"$CFG.list"
[ "$GPU" = 1 ] || printf 'z3_offload\n' >"$CFG.list"  # CI: one configuration keeps the bookkeeping honest
engine_pair() {  # the CPU run goes in the background: it uses cores, the GPU run the GPU
    local name=$1 cpu rc
    # its own NVMe folder and rendezvous port: the two runs of a pair overlap
    sed "s#$CFG/nvme#$CFG/nvme-cpu#" "$CFG/$name.json" >"$CFG/$name.cpu-config"
    mkdir -p "$CFG/nvme" "$CFG/nvme-cpu"
    local ports  # free ones, not 29500: another job on the machine (CI's tests) may hold it
    ports=($($PY -c "from dslaunch.utils.ports import free_port as f; print(f(), f())"))
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 dslaunch --num_gpus 1 --master_port "${ports[0]}" --log_dir "$CFG/logs-cpu" \
        scripts/gpu/engine_check.py --deepspeed_config "$CFG/$name.cpu-config" --out "$CFG/$name.cpu.json" \
        >"$CFG/$name.cpu.log" 2>&1 &
    cpu=$!
    dslaunch --num_gpus 1 --master_port "${ports[1]}" --log_dir "$CFG/logs" scripts/gpu/engine_check.py \
        --deepspeed_config "$CFG/$name.json" --out "$CFG/$name.gpu.json"
    rc=$?
    wait $cpu || { echo "CPU run of $name failed:"; tail -n 20 "$CFG/$name.cpu.log"; return 1; }
    return $rc
}
export -f engine_pair
while read -r name; do
    step "engine_$name" 120 engine_pair "$name"
done <"$CFG.list"

# --- benchmarks -------------------------------------------------------------------------------
if [ "$GPU" = 1 ]; then
    step bench_gpu_kernels 240 $PY scripts/bench/gpu_kernels_bench.py --rounds 7 --steps 20
    step probe_norms 120 $PY scripts/gpu/norm_probe.py "$RESULT_DIR/norm_probe.json"
    step bench_gpu_engine 300 $PY scripts/bench/gpu_engine_bench.py --timeout 150
    cp scripts/bench/results/gpu_kernels_bench.json scripts/bench/results/gpu_kernels_bench.md "$RESULT_DIR/"
    cp scripts/bench/results/gpu_engine_bench.json scripts/bench/results/gpu_engine_bench.md "$RESULT_DIR/"
    $PY scripts/gpu/report.py --summarize "$RESULT_DIR" --results scripts/bench/results
else
    step bench_gpu_kernels 120 $PY scripts/bench/gpu_kernels_bench.py --cpu-smoke
    $PY scripts/gpu/report.py --summarize "$RESULT_DIR"
fi
