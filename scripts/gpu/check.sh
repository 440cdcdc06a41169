#!/usr/bin/env bash
# dslaunch's GPU check: one command on a machine with one CUDA GPU, projected at about 6.5 minutes on
# an H100/H200 with the DeepSpeed comparison, and never more than GPU_CHECK_DEADLINE_S (default
# 460 s): give the device call 600 s.
#
#   scripts/gpu/check.sh [RESULT_DIR]        (default ./gpu-check; `make gpu-check`)
#
# Under the device tool ($OUT set, no RESULT_DIR), the results are written to a folder of their
# own and packed into $OUT after each part: gpu-check.md/.json, steps.jsonl, env.json,
# peer_bench.json, gpu_engine_bench.json and gpu-check-files.tar.gz (everything else: the logs,
# the tables), 7 files, within the 8 the tool brings back.
#
# The timeline (scripts/gpu/steps.sh): each part is a step with a budget (the seconds it should
# take) and a hard limit (its timeout), both within the check's deadline; each prints its start and
# end, in seconds since the check began, as it runs, and appends one line to RESULT_DIR/steps.jsonl;
# its output is RESULT_DIR/<step>.log. A stuck part costs its limit; a part the deadline leaves no
# time is recorded as skipped. The benchmarks write their results as each run finishes, and at the
# end scripts/gpu/report.py writes RESULT_DIR/gpu-check.json and gpu-check.md (the steps with their
# budgets, the engine checks, the targets met or not) from whatever ran; on a GPU the tables also
# go to scripts/bench/results/ (gpu_check.*, peer_bench.*, gpu_kernels_bench.*, gpu_engine_bench.*),
# which BENCHMARKS.md is assembled from. The exit status is 0 only when every step passed.
#
# In order: the machine's description, dslaunch's setup (before DeepSpeed's venv, which sees the
# same site-packages: no pip installs into them while its pip resolves); then, in the background,
# real DeepSpeed's venv and its two JIT-built ops (FusedAdam with nvcc, CPU Adam with the host
# compiler, at once, MAX_JOBS from the cores, TORCH_CUDA_ARCH_LIST the device's capability alone),
# while the untimed parts run in the foreground: the GPU tests beside the CUDA-path tests, the
# engine on NCCL against gloo (four configurations at a time). The builds are waited for before the first
# timed part, not pinned to cores of their own: the offloaded step's CPU Adam, which the
# benchmarks time, uses every core, and the kernel benchmark's launch costs are CPU time too.
# Then the timed parts, one at a time: dslaunch beside DeepSpeed (scripts/gpu/peer_bench.py: ZeRO-2,
# ZeRO-3 and ZeRO-2 + CPU offload on a 1.1B GPT under both, taking turns; tokens/s, peak memory,
# start-up, checkpoint save/load), the engine against plain torch (scripts/bench/gpu_engine_bench.py),
# the kernels (scripts/bench/gpu_kernels_bench.py). GPU_CHECK_PROBES=1 adds the norms' launch-cost
# probe (scripts/gpu/norm_probe.py; measured once, recorded in scripts/bench/results/).
#
# The GPU machine has Python with its own CUDA torch, triton, pytest, pyyaml, psutil, nvidia-ml-py
# and no network: dslaunch is installed there editable with --no-deps onto that torch, and the
# dependencies it lacks (paramiko and its needs, crc32c) come as wheels in ./.whl (git-ignored),
# prepared on a machine with PyPI by
#   scripts/gpu/wheels.sh [PYTHON_VERSION]     (default 3.12)
# and carried with the working tree (the paths to carry: scripts/gpu/carry.txt). Real DeepSpeed
# 0.19.8 comes the same way (.whl/deepspeed): it is installed into a venv of its own beside
# dslaunch's that sees the same torch, and its ops build into ./.ds-ext (reused by a rerun on the
# same machine).
# Without a CUDA device (CI: tests/gpu/test_check_script.py) it says so in one line, runs its
# setup, the tests (which skip), the DeepSpeed comparison on a tiny model with gloo (where a real
# DeepSpeed is at hand: DSLAUNCH_DEEPSPEED_PYTHON, .whl/deepspeed, or .venv-conformance/deepspeed)
# and one engine configuration on CPU to exercise the bookkeeping, writes nothing under scripts/,
# and exits 0 when those pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${1:-}" ] && [ -n "${OUT:-}" ]; then  # the device tool's folder: 8 files come back (pack_results)
    export PACK_DIR=$OUT
    RESULT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
else
    RESULT_DIR=${1:-gpu-check}
fi
mkdir -p "$RESULT_DIR"
RESULT_DIR=$(cd "$RESULT_DIR" && pwd)
export PY=${PYTHON:-python3} RESULT_DIR STEPS="$RESULT_DIR/steps.jsonl"
: >"$STEPS"
export PYTHONUNBUFFERED=1 CHECK_START=$(date +%s%N) CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-460} CHECK_MIN_S=5
source scripts/gpu/steps.sh
CORES=$(nproc)

# the machine's description first: whether there is a GPU comes from it (one torch import the fewer)
step env 5 60 $PY scripts/gpu/report.py --env "$RESULT_DIR/env.json"
export GPU=$($PY -c "import json, sys; print(int(bool(json.load(open(sys.argv[1]))['gpu'])))" "$RESULT_DIR/env.json" 2>/dev/null || echo 0)
if [ "$GPU" != 1 ]; then
    echo "gpu-check: no CUDA device here: setup, bookkeeping and one engine configuration on CPU only"
else  # DeepSpeed's JIT builds for this device alone, and its runs find them built for the same list
    export TORCH_CUDA_ARCH_LIST=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['capability'])" "$RESULT_DIR/env.json")
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
step setup 10 120 setup
export PATH="$(dirname "$(command -v "$PY")"):$PATH"  # the dslaunch command beside that python


# --- real DeepSpeed in a venv beside dslaunch's ------------------------------------------------
export DS_VENV=$PWD/.venv-gpu-deepspeed DS_EXT=$PWD/.ds-ext
if [ -n "${DSLAUNCH_DEEPSPEED_PYTHON:-}" ]; then
    export DS_PY=$DSLAUNCH_DEEPSPEED_PYTHON
elif ls .whl/deepspeed/deepspeed-*.whl >/dev/null 2>&1; then
    export DS_PY=$DS_VENV/bin/python
elif [ "$GPU" != 1 ] && [ -x .venv-conformance/deepspeed/bin/python ]; then
    export DS_PY=$PWD/.venv-conformance/deepspeed/bin/python
else
    export DS_PY=
fi
# deepspeed_setup: the venv from the carried wheels, offline. $PY may itself be a venv (the GPU
# image's is), whose packages --system-site-packages would not show: a .pth names them instead,
# after the venv's own, so that its deepspeed comes first and torch is $PY's.
deepspeed_setup() {
    if [ -z "$DS_PY" ]; then
        echo "no real DeepSpeed: run scripts/gpu/wheels.sh (needs PyPI) or name one with DSLAUNCH_DEEPSPEED_PYTHON"
        [ "$GPU" != 1 ]  # a failure only where the comparison is the point
        return
    fi
    if [ "$DS_PY" = "$DS_VENV/bin/python" ] && [ "$(cat "$DS_VENV/.installed" 2>/dev/null)" != "$(command -v "$PY")" ]; then
        rm -rf "$DS_VENV"
        $PY -m venv --without-pip "$DS_VENV" || return 1
        local site links=(--find-links .whl/deepspeed)
        site=$("$DS_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        $PY -c "import site, sysconfig; p = sysconfig.get_paths(); print(*dict.fromkeys(site.getsitepackages() + [p['purelib'], p['platlib']]), sep='\n')" >"$site/_dslaunch_beside.pth"
        [ -d .whl-local/deepspeed ] && links+=(--find-links .whl-local/deepspeed)  # this machine's Python, if not 3.12
        # First DeepSpeed alone: $PY may hold dslaunch's `deepspeed` (0.19.8+dslaunch...), which pip
        # would take for deepspeed==0.19.8; then what it requires that $PY lacks.
        local pip=("$DS_PY" -m pip install -q --no-index --no-compile --disable-pip-version-check)
        "${pip[@]}" --no-deps --ignore-installed .whl/deepspeed/deepspeed-0.19.8-*.whl || return 1
        "${pip[@]}" "${links[@]}" deepspeed==0.19.8 || return 1
        command -v "$PY" >"$DS_VENV/.installed"
    fi
    "$DS_PY" -c "import deepspeed, torch; print('DeepSpeed', deepspeed.__version__, 'at', deepspeed.__file__, 'with torch', torch.__version__)"
}
# deepspeed_ops: its FusedAdam (nvcc) and CPU Adam (the host compiler) JIT-built once into $DS_EXT,
# both at once, in the background while the untimed parts run: for this device's capability alone
# (TORCH_CUDA_ARCH_LIST, exported above; without it torch's extension loader may add every
# architecture it knows), each build with half the cores. A build killed earlier leaves a lock that blocks forever.
deepspeed_ops() {
    mkdir -p "$DS_EXT" && find "$DS_EXT" -name lock -delete && rm -f "$DS_EXT/fused_adam.built"
    local build='import sys; from deepspeed.accelerator import get_accelerator as a; a().create_op_builder(sys.argv[1]).load(); print(sys.argv[1], "loaded")'
    local jobs=$((CORES / 2 > 1 ? CORES / 2 : 1))
    local env=(env TORCH_EXTENSIONS_DIR="$DS_EXT" DS_ACCELERATOR=cuda PATH="$(dirname "$DS_PY"):$PATH" MAX_JOBS=$jobs)
    echo "building for capability ${TORCH_CUDA_ARCH_LIST:-?} with MAX_JOBS=$jobs each"
    "${env[@]}" "$DS_PY" -c "$build" CPUAdamBuilder &
    local cpu=$! rc=0
    if command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
        "${env[@]}" "$DS_PY" -c "$build" FusedAdamBuilder && touch "$DS_EXT/fused_adam.built" || rc=1
    else
        echo "no nvcc: DeepSpeed's FusedAdam cannot be built; the z2/z3 rows use torch's fused AdamW on both sides"
    fi
    wait $cpu && return $rc
}
export -f deepspeed_setup deepspeed_ops
export CORES
deepspeed_background() {  # the venv, then (on a GPU) the ops
    step deepspeed_setup 20 180 deepspeed_setup || return
    if [ "$GPU" = 1 ] && [ -n "$DS_PY" ]; then
        step deepspeed_ops 90 300 deepspeed_ops
    fi
}
deepspeed_background &
ds=$!

# --- untimed, in the foreground while DeepSpeed installs and builds ------------------------------
# the tests on the device, and beside them the tests that take another path when CUDA is present
# (CI runs those on CPU), spread over four workers where pytest-xdist is installed
if [ "$GPU" = 1 ]; then
    workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 4" || echo "")
    step pytest_cuda_paths 30 180 $PY -m pytest -q -p no:cacheprovider $workers \
        tests/kernels/test_dispatch.py tests/accelerator tests/kernels/triton/test_availability.py \
        tests/runtime/test_dist.py tests/runtime/test_timers.py tests/launcher/test_plan.py \
        tests/launcher/test_workerenv.py tests/runtime/test_heartbeat.py &
    paths=$!
fi
step pytest_gpu 70 240 $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider
[ "$GPU" = 1 ] && wait "$paths"

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
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=2 dslaunch --num_gpus 1 --master_port "${ports[0]}" --log_dir "$CFG/logs-$name-cpu" \
        scripts/gpu/engine_check.py --deepspeed_config "$CFG/$name.cpu-config" --out "$CFG/$name.cpu.json" \
        >"$CFG/$name.cpu.log" 2>&1 &
    cpu=$!
    dslaunch --num_gpus 1 --master_port "${ports[1]}" --log_dir "$CFG/logs-$name" scripts/gpu/engine_check.py \
        --deepspeed_config "$CFG/$name.json" --out "$CFG/$name.gpu.json"
    rc=$?
    wait $cpu || { echo "CPU run of $name failed:"; tail -n 20 "$CFG/$name.cpu.log"; return 1; }
    return $rc
}
export -f engine_pair
# four pairs at a time: each is two small processes, one on the GPU, one on two cores
xargs -P 4 -I NAME bash -c 'step engine_NAME 10 120 engine_pair NAME' <"$CFG.list"

# --- timed, one at a time, once DeepSpeed's builds are done ----------------------------------------
wait_for deepspeed "$ds"
if [ "$GPU" = 1 ] && [ -n "$DS_PY" ]; then
    opt=$([ -e "$DS_EXT/fused_adam.built" ] && echo config || echo torch)
    # The checkpoints (16 GiB each at 1.14B) on tmpfs where it has room: the two libraries' own cost,
    # not the machine's disk, which is the same for both (and seconds a run off the budget).
    ckpt=${TMPDIR:-/tmp}
    [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -n 1)" -gt $((40 << 20)) ] 2>/dev/null && ckpt=/dev/shm
    step bench_peer 165 300 $PY scripts/gpu/peer_bench.py --deepspeed-python "$DS_PY" --optimizer "$opt" \
        --steps 8 --timeout 120 --extensions-dir "$DS_EXT" --checkpoint-dir "$ckpt" --out "$RESULT_DIR"
elif [ -n "$DS_PY" ]; then  # the same path on a tiny model (DeepSpeed's CPU Adam: minutes to build)
    step bench_peer 40 300 $PY scripts/gpu/peer_bench.py --deepspeed-python "$DS_PY" --smoke --cases z2,z3 \
        --optimizer torch --steps 2 --extensions-dir "$DS_EXT" --out "$RESULT_DIR"
fi
if [ "$GPU" = 1 ]; then
    # z0_reference (the kernels off) left out: the kernel benchmark measures the kernels
    step bench_gpu_engine 70 200 $PY scripts/bench/gpu_engine_bench.py --cases torch,z0,z2,z3,z2_offload \
        --timeout 100 --out "$RESULT_DIR"
    # (it writes scripts/bench/results/ alone: copied only when this run wrote them)
    step bench_gpu_kernels 30 120 $PY scripts/bench/gpu_kernels_bench.py --rounds 5 --steps 20 &&
        cp scripts/bench/results/gpu_kernels_bench.json scripts/bench/results/gpu_kernels_bench.md "$RESULT_DIR/"
    [ "${GPU_CHECK_PROBES:-0}" = 1 ] && step probe_norms 12 120 $PY scripts/gpu/norm_probe.py "$RESULT_DIR/norm_probe.json"
    [ -e "$RESULT_DIR/peer_bench.md" ] && cp "$RESULT_DIR/peer_bench.json" "$RESULT_DIR/peer_bench.md" scripts/bench/results/
    $PY scripts/gpu/report.py --summarize "$RESULT_DIR" --results scripts/bench/results
else
    step bench_gpu_kernels 10 120 $PY scripts/bench/gpu_kernels_bench.py --cpu-smoke
    $PY scripts/gpu/report.py --summarize "$RESULT_DIR"
fi
status=$?
pack_results
exit $status
