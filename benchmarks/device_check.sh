#!/usr/bin/env bash
# lamina's one-call GPU device check (see benchmarks/README.md).
#
# On a GPU machine with no network: install lamina (and fla-core from wheels/ if carried),
# JIT-build the CUDA extension, run `pytest -m gpu`, run the benchmark suite at the standard
# shapes against every available provider (with the copy/matmul ceilings), run
# `lamina info --kernels`, and write everything under $OUT. Each step is time-boxed with
# `timeout`, and the steps share one total budget (TOTAL_BUDGET_S, default 450 s, under the
# 8 minutes one device call may take). A failed step is recorded and the next one runs.
#
# SKIP_BUILD=1, SKIP_PYTEST=1, SKIP_INFO=1 leave a step out (a benchmark-only call gives the
# suite the whole budget: SKIP_BUILD=1 SKIP_PYTEST=1 SKIP_INFO=1 BENCH_TIMEOUT=420).
#
# DRY_RUN=1: every step that can run without a GPU runs on the CPU (pip's dry-run install,
# pytest -m gpu (all skipped), the suite on tiny CPU shapes, the static kernel report); the
# CUDA build is skipped. CI uses this to keep the script working.
#
# Files written under $OUT (default ./device_out), at most 8 as the device tool returns:
#   summary.txt  steps, environment, benchmark table (also printed at the end)
#   setup.log    environment, installs and the CUDA build
#   pytest_gpu.log, bench.jsonl, bench.log, info_kernels.log

set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-./device_out}"
DRY_RUN="${DRY_RUN:-0}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT" || exit 1

# Step time limits (seconds); each is also capped by what is left of TOTAL_BUDGET_S.
TOTAL_BUDGET_S="${TOTAL_BUDGET_S:-450}"
INSTALL_TIMEOUT="${INSTALL_TIMEOUT:-60}"
BUILD_TIMEOUT="${BUILD_TIMEOUT:-150}"
PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-110}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-130}"
INFO_TIMEOUT="${INFO_TIMEOUT:-60}"
# Kept free for the steps after the benchmark (kernel report, summary) when sizing its budget.
RESERVE_AFTER_BENCH="${RESERVE_AFTER_BENCH:-50}"
# The suite stops starting new cases this long before its step limit (ceilings, the case in flight, exit).
BENCH_SLACK_S="${BENCH_SLACK_S:-30}"
PYTEST_ARGS="${PYTEST_ARGS:--m gpu -q -rfEs -p no:cacheprovider}"
# GPU tests spend most of their time in Triton's JIT compiles (CPU-bound; the delta-rule backward's GPU
# tests alone took 155 s serially on the H200): with pytest-xdist carried in wheels/, spread them over
# up to 8 worker processes sharing the one GPU.
PYTEST_WORKERS="${PYTEST_WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}"
# The GPU is sm_90: the report compiles for it only (every core in parallel), which halves its time.
INFO_ARGS="${INFO_ARGS:---kernels --arch 90}"
if [ "$DRY_RUN" = "1" ]; then
    BENCH_ARGS="${BENCH_ARGS:---device cpu --shapes tiny --mode fwd --exclude torch-compile --threads 1 --cpu-min-run-s 0.05}"
else
    BENCH_ARGS="${BENCH_ARGS:---device cuda --shapes standard --warmup-ms 10 --rep-ms 40}"
fi

START_S=$(date +%s)
STEPS=()

log() { printf '[device_check %4ds] %s\n' "$(( $(date +%s) - START_S ))" "$*"; }
remaining() { echo $(( TOTAL_BUDGET_S - ($(date +%s) - START_S) )); }

# run_step NAME LIMIT LOGFILE CMD...: run CMD under `timeout`, output appended to LOGFILE.
run_step() {
    local name=$1 limit=$2 logfile=$3
    shift 3
    local left
    left=$(remaining)
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$limit" -le 5 ]; then
        STEPS+=("$(printf '%-14s %-28s %5s s' "$name" "skipped (total budget spent)" 0)")
        log "$name: skipped, total budget spent"
        return 0
    fi
    log "$name: starting (limit ${limit} s, log $(basename "$logfile"))"
    echo "=== $name: $* (limit ${limit} s)" >>"$logfile"
    local t0 rc status
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >>"$logfile" 2>&1
    rc=$?
    case $rc in
        0) status="ok" ;;
        124|137) status="timed out after ${limit} s" ;;
        5) status="no tests collected" ;;
        *) status="failed (rc $rc)" ;;
    esac
    STEPS+=("$(printf '%-14s %-28s %5s s' "$name" "$status" "$(( $(date +%s) - t0 ))")")
    log "$name: $status"
    return 0
}

skip_step() {
    STEPS+=("$(printf '%-14s %-28s %5s s' "$1" "skipped ($2)" 0)")
    log "$1: skipped ($2)"
}

SETUP_LOG="$OUT/setup.log"
: >"$SETUP_LOG"

# ---- 0. environment ------------------------------------------------------------------------
{
    echo "=== environment (DRY_RUN=$DRY_RUN)"
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse HEAD 2>/dev/null || echo "commit: unknown"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    command -v nvcc >/dev/null && nvcc --version | tail -2
    nproc
    "$PYTHON" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| cuda', torch.version.cuda, '| triton', triton.__version__, '| gpu', torch.cuda.is_available())"
} >>"$SETUP_LOG" 2>&1

# ---- 1. install (no network) ---------------------------------------------------------------
PIP=("$PYTHON" -m pip install --no-deps --no-build-isolation --no-index)
if [ "$DRY_RUN" = "1" ]; then PIP+=(--dry-run); fi
shopt -s nullglob
WHEELS=(wheels/*.whl)
shopt -u nullglob
if [ "${#WHEELS[@]}" -gt 0 ]; then
    run_step install_wheels "$INSTALL_TIMEOUT" "$SETUP_LOG" "${PIP[@]}" "${WHEELS[@]}"
else
    skip_step install_wheels "no wheels/ folder: fla is not installed, its provider is skipped"
fi
run_step install "$INSTALL_TIMEOUT" "$SETUP_LOG" "${PIP[@]}" -e .

# ---- 2. CUDA extension (JIT build with ninja) ----------------------------------------------
if [ "$DRY_RUN" = "1" ]; then
    skip_step build_cuda "DRY_RUN: no nvcc build"
elif [ "${SKIP_BUILD:-0}" = "1" ]; then
    skip_step build_cuda "SKIP_BUILD=1"
else
    run_step build_cuda "$BUILD_TIMEOUT" "$SETUP_LOG" env LAMINA_BUILD_CUDA=1 CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
        MAX_JOBS="$(nproc)" "${PIP[@]}" -e .
    run_step import_ext 30 "$SETUP_LOG" "$PYTHON" -c "import lamina._C as C; print('lamina._C', C.__file__)"
fi

# ---- 3. GPU tests --------------------------------------------------------------------------
if [ "${SKIP_PYTEST:-0}" = "1" ]; then
    skip_step pytest_gpu "SKIP_PYTEST=1"
else
    if [ "$PYTEST_WORKERS" -gt 1 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
        PYTEST_ARGS="$PYTEST_ARGS -n $PYTEST_WORKERS"
    fi
    # shellcheck disable=SC2086  # PYTEST_ARGS is a word list on purpose
    run_step pytest_gpu "$PYTEST_TIMEOUT" "$OUT/pytest_gpu.log" "$PYTHON" -m pytest $PYTEST_ARGS
fi

# ---- 4. benchmark suite with the ceilings --------------------------------------------------
if [ "${SKIP_INFO:-0}" = "1" ]; then RESERVE_AFTER_BENCH=10; fi  # only the summary remains
bench_limit=$(( $(remaining) - RESERVE_AFTER_BENCH ))
if [ "$bench_limit" -gt "$BENCH_TIMEOUT" ]; then bench_limit=$BENCH_TIMEOUT; fi
bench_budget=$(( bench_limit - BENCH_SLACK_S ))
if [ "$bench_budget" -lt 5 ]; then bench_budget=5; fi
# shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
run_step bench "$bench_limit" "$OUT/bench.log" env LAMINA_BENCH_PLAIN=1 PYTHONUNBUFFERED=1 \
    "$PYTHON" -m lamina.cli bench $BENCH_ARGS --out "$OUT/bench.jsonl" --time-budget "$bench_budget"

# ---- 5. static kernel report on this machine -----------------------------------------------
if [ "${SKIP_INFO:-0}" = "1" ]; then
    skip_step info_kernels "SKIP_INFO=1"
else
    # shellcheck disable=SC2086  # INFO_ARGS is a word list on purpose
    run_step info_kernels "$INFO_TIMEOUT" "$OUT/info_kernels.log" "$PYTHON" -m lamina.cli info $INFO_ARGS
fi

# ---- 6. summary ----------------------------------------------------------------------------
SUMMARY="$OUT/summary.txt"
{
    echo "=== lamina device check (DRY_RUN=$DRY_RUN), $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START_S )) s"
    sed -n '2,12p' "$SETUP_LOG"
    echo
    echo "=== benchmark summary ($OUT/bench.jsonl)"
    if [ -s "$OUT/bench.jsonl" ]; then
        LAMINA_BENCH_PLAIN=1 timeout -k 5 60 "$PYTHON" -m lamina.cli bench summary "$OUT/bench.jsonl" 2>&1
    else
        echo "no benchmark results"
    fi
    echo
    echo "=== pytest -m gpu"
    if [ -s "$OUT/pytest_gpu.log" ]; then tail -n 3 "$OUT/pytest_gpu.log"; else echo "no log"; fi
    echo
    echo "=== steps"
    printf '%s\n' "${STEPS[@]}"
} >"$SUMMARY" 2>&1

cat "$SUMMARY"
