#!/usr/bin/env bash
# lamina's one-call GPU device check (see benchmarks/README.md).
#
# On a GPU machine with no network: install lamina (and fla-core, flash-linear-attention from
# wheels/ if carried), JIT-build the CUDA extension, run `pytest -m gpu`, run one small case of every
# kernel under `compute-sanitizer --tool memcheck` and `--tool racecheck` where the machine supports it
# (benchmarks/sanitizer_cases.py), run the benchmark suite
# at the standard shapes against every available provider (with the copy/matmul ceilings),
# optionally the layer benchmark (`lamina bench --op layers`), run `lamina info --kernels`, and
# write everything under $OUT. Each step is time-boxed with `timeout`, and the steps share one
# total budget (TOTAL_BUDGET_S, default 450 s, under the 8 minutes one device call may take). A
# failed step is recorded and the next one runs.
#
# SKIP_BUILD=1, SKIP_PYTEST=1, SKIP_SANITIZER=1, SKIP_INFO=1 leave a step out (SANITIZER_TIMEOUT, default
# 100 s, limits each sanitizer tool's run). The second call, benchmarks only:
#   SKIP_BUILD=1 SKIP_PYTEST=1 SKIP_SANITIZER=1 SKIP_INFO=1 BENCH_TIMEOUT=200 BENCH_LAYERS_TIMEOUT=120 BENCH_DECODE_TIMEOUT=60
# and the sweep call (attention and HRM update: the dispatch table; `python benchmarks/sweep_attention.py
# --table-from bench.jsonl` rebuilds the table from the records that come back):
#   SKIP_BUILD=1 SKIP_PYTEST=1 SKIP_SANITIZER=1 SKIP_INFO=1 BENCH_TIMEOUT=0 SWEEP_TIMEOUT=360 TOTAL_BUDGET_S=400
# and the delta-rule sweep call (every speed alternative of the chunked kernels against the defaults and fla;
# benchmarks/sweep_delta.py --report-from bench.jsonl prints its report again from the records):
#   SKIP_BUILD=1 SKIP_PYTEST=1 SKIP_SANITIZER=1 SKIP_INFO=1 BENCH_TIMEOUT=0 SWEEP_DELTA_TIMEOUT=360 TOTAL_BUDGET_S=400
# (the kernel ops, then lamina's layers against fla's, then the decode step and generation;
# BENCH_LAYERS_TIMEOUT=0 and BENCH_DECODE_TIMEOUT=0, the defaults, leave those out).
#
# fla on the GPU image: the image has transformers 5.17.0 and its stack (tokenizers, huggingface-hub,
# safetensors, regex, pyyaml, tqdm, packaging, numpy) but neither fla-core (fla.ops) nor
# flash-linear-attention (fla.layers, fla.models): both are pure-Python wheels carried in wheels/
# (benchmarks/README.md). Without them the fla provider and the fla comparisons in the GPU tests
# are skipped, each with its reason.
#
# DRY_RUN=1: every step that can run without a GPU runs on the CPU (pip's dry-run install,
# pytest -m gpu (all skipped), a few sanitizer cases on the CPU without the sanitizer, the suite on
# tiny CPU shapes, the static kernel report); the CUDA build is skipped. CI uses this to keep the
# script working.
#
# Files written under $OUT (default ./device_out), at most 8 as the device tool returns:
#   summary.txt  steps, environment, benchmark table (also printed at the end)
#   setup.log    environment, installs, fla's import check and the CUDA build
#   pytest_gpu.log, bench.jsonl (kernel ops and layers), bench.log, info_kernels.log
#   sanitizer.log   both sanitizer tools' output, one line per case (verdicts in summary.txt)
#   layers_gpu.txt  RMS error ratios of tests/test_fla_layers_gpu.py (lamina, fla, float64), when it ran

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
# GPU tests: about 100 s before the layer tests (tests/test_fla_layers_gpu.py, about a minute of
# compiles on their own workers) joined them.
PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-150}"
# The kernel-op suite in this call is a sample (the second call runs it with the time it needs).
BENCH_TIMEOUT="${BENCH_TIMEOUT:-90}"
# The layer benchmark (`lamina bench --op layers`): 0 leaves it out; the second call sets it.
BENCH_LAYERS_TIMEOUT="${BENCH_LAYERS_TIMEOUT:-0}"
INFO_TIMEOUT="${INFO_TIMEOUT:-60}"
# The decode-step and generation benchmarks (each this long at most): 0 leaves them out.
BENCH_DECODE_TIMEOUT="${BENCH_DECODE_TIMEOUT:-0}"
# The attention / HRM-update sweep (benchmarks/sweep_attention.py, its records into bench.jsonl and its
# dispatch table and ratios into bench.log): 0 leaves it out; the sweep call sets it (360).
SWEEP_TIMEOUT="${SWEEP_TIMEOUT:-0}"
# The delta-rule sweep (benchmarks/sweep_delta.py, its records into bench.jsonl and its report into bench.log):
# 0 leaves it out; its call sets it (360).
SWEEP_DELTA_TIMEOUT="${SWEEP_DELTA_TIMEOUT:-0}"
# compute-sanitizer (step 3b): each tool's run of benchmarks/sanitizer_cases.py is limited to
# SANITIZER_TIMEOUT and leaves SANITIZER_RESERVE_S of the total budget to the benchmark sample, the
# kernel report and the summary. SANITIZER=path picks the binary (under DRY_RUN it is used only when
# given: CI passes a stand-in that runs the cases); SANITIZER_TOOLS adds initcheck or synccheck.
SANITIZER_TIMEOUT="${SANITIZER_TIMEOUT:-100}"
SANITIZER_RESERVE_S="${SANITIZER_RESERVE_S:-90}"
SANITIZER_TOOLS="${SANITIZER_TOOLS:-memcheck racecheck}"
SANITIZER_GIVEN="${SANITIZER:+1}"
if [ -z "${SANITIZER:-}" ]; then
    SANITIZER=$(command -v compute-sanitizer || true)
    for dir in "${CUDA_HOME:-/usr/local/cuda}/bin" /usr/local/cuda/bin; do
        if [ -z "$SANITIZER" ] && [ -x "$dir/compute-sanitizer" ]; then SANITIZER="$dir/compute-sanitizer"; fi
    done
fi
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
    LAYERS_BENCH_ARGS="${LAYERS_BENCH_ARGS:---device cpu --shapes tiny --threads 1 --cpu-min-run-s 0.05}"
else
    BENCH_ARGS="${BENCH_ARGS:---device cuda --shapes standard --warmup-ms 10 --rep-ms 40}"
    LAYERS_BENCH_ARGS="${LAYERS_BENCH_ARGS:---device cuda --shapes standard --warmup-ms 10 --rep-ms 40}"
fi
if [ "$DRY_RUN" = "1" ]; then
    # the cheapest cases under the Triton interpreter, and the C++ CPU kernels (about 10 s)
    SANITIZER_CASE_ARGS="${SANITIZER_CASE_ARGS:---device cpu --quick}"
else
    SANITIZER_CASE_ARGS="${SANITIZER_CASE_ARGS:---device cuda}"
fi
if [ "$DRY_RUN" = "1" ]; then
    SWEEP_ARGS="${SWEEP_ARGS:---dry-run}"
    SWEEP_DELTA_ARGS="${SWEEP_DELTA_ARGS:---dry-run}"
else
    SWEEP_ARGS="${SWEEP_ARGS:---device cuda}"
    SWEEP_DELTA_ARGS="${SWEEP_DELTA_ARGS:---device cuda}"
fi
if [ "$DRY_RUN" = "1" ]; then
    DECODE_BENCH_ARGS="${DECODE_BENCH_ARGS:---device cpu --threads 1}"
    GENERATION_BENCH_ARGS="${GENERATION_BENCH_ARGS:---device cpu --threads 1}"
else
    DECODE_BENCH_ARGS="${DECODE_BENCH_ARGS:---device cuda}"
    GENERATION_BENCH_ARGS="${GENERATION_BENCH_ARGS:---device cuda}"
fi
LAYERS_REPORT="$OUT/layers_gpu.txt"

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
FLA_WHEELS=(wheels/fla_core-*.whl wheels/flash_linear_attention-*.whl)
shopt -u nullglob
if [ "${#WHEELS[@]}" -gt 0 ]; then
    run_step install_wheels "$INSTALL_TIMEOUT" "$SETUP_LOG" "${PIP[@]}" "${WHEELS[@]}"
else
    skip_step install_wheels "no wheels/ folder: fla is not installed, its provider is skipped"
fi
run_step install "$INSTALL_TIMEOUT" "$SETUP_LOG" "${PIP[@]}" -e .

# fla.layers needs flash-linear-attention, fla-core and transformers (the image's): say which are there.
FLA_CHECK='
import importlib, importlib.metadata as md, sys
for name in ("fla-core", "flash-linear-attention", "transformers", "tokenizers", "huggingface-hub", "safetensors"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
for module in ("fla.ops", "fla.layers"):
    try:
        importlib.import_module(module)
    except Exception as exc:
        sys.exit(f"{module} is not importable ({type(exc).__name__}: {exc}): the fla provider and the fla "
                 "comparisons of the GPU tests skip; carry the wheels named in benchmarks/README.md")
    print(f"{module} imports")
'
if [ "${#FLA_WHEELS[@]}" -lt 2 ]; then
    skip_step fla_import "no fla_core and flash_linear_attention wheels in wheels/: fla's layers are skipped"
elif [ "$DRY_RUN" = "1" ]; then
    skip_step fla_import "DRY_RUN: the wheels were not installed"
else
    run_step fla_import 60 "$SETUP_LOG" "$PYTHON" -c "$FLA_CHECK"
fi

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
    run_step pytest_gpu "$PYTEST_TIMEOUT" "$OUT/pytest_gpu.log" env LAMINA_GPU_REPORT="$LAYERS_REPORT" \
        "$PYTHON" -m pytest $PYTEST_ARGS
fi

# ---- 3b. compute-sanitizer: one small case of every kernel under memcheck and racecheck --------
# benchmarks/sanitizer_cases.py runs every Triton kernel (forward and backward, varlen, odd dims) and
# the CUDA C++ kernels of lamina._C on tiny shapes. PyTorch's caching allocator is turned off so that
# memcheck sees the bounds of every tensor (an overrun into a neighbouring block of the cache is
# otherwise invisible to it). Both tools log to sanitizer.log (the device tool returns 8 files at most).
SANITIZER_LOG="$OUT/sanitizer.log"
SANITIZER_LINES=()
sanitizer_verdict() {  # TOOL FIRST_LINE: the tool's result from the lines of sanitizer.log from FIRST_LINE on
    local section
    section=$(tail -n +"$2" "$SANITIZER_LOG")
    if grep -qi "device not supported" <<<"$section"; then
        SANITIZER_LINES+=("$1: compute-sanitizer does not support the GPU on this machine (as on gVisor machines): not checked")
        STEPS[${#STEPS[@]}-1]="$(printf '%-14s %-28s %5s s' "$1" "unsupported device" 0)"
        return 1
    fi
    local cases
    cases=$(grep -h '^sanitizer cases: .* ok' <<<"$section" | tail -n 1) ||
        cases="cut short after $(grep -cE '^[a-z0-9_]+ +(ok|FAIL|skip) ' <<<"$section") cases ($(grep -cE \
'^[a-z0-9_]+ +FAIL ' <<<"$section") failed)"
    SANITIZER_LINES+=("$1: $cases | $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' <<<"$section" | sed 's/^=* *//' |
        paste -sd ';' - || true)")
    return 0
}
if [ "${SKIP_SANITIZER:-0}" = "1" ]; then
    skip_step sanitizer "SKIP_SANITIZER=1"
elif [ "$DRY_RUN" = "1" ] && [ -z "$SANITIZER_GIVEN" ]; then
    # shellcheck disable=SC2086  # SANITIZER_CASE_ARGS is a word list on purpose
    run_step sanitizer "$SANITIZER_TIMEOUT" "$SANITIZER_LOG" env TRITON_INTERPRET=1 \
        "$PYTHON" benchmarks/sanitizer_cases.py $SANITIZER_CASE_ARGS
    SANITIZER_LINES+=("DRY_RUN: the cases on the CPU, no sanitizer: $(grep -h '^sanitizer cases: .* ok' \
"$SANITIZER_LOG" | tail -n 1)")
elif [ -z "$SANITIZER" ]; then
    skip_step sanitizer "no compute-sanitizer on PATH or in /usr/local/cuda/bin"
else
    : >"$SANITIZER_LOG"
    for tool in $SANITIZER_TOOLS; do
        limit=$(( $(remaining) - SANITIZER_RESERVE_S ))
        if [ "$limit" -gt "$SANITIZER_TIMEOUT" ]; then limit=$SANITIZER_TIMEOUT; fi
        first=$(( $(wc -l <"$SANITIZER_LOG") + 1 ))
        # shellcheck disable=SC2086  # SANITIZER_CASE_ARGS is a word list on purpose
        run_step "$tool" "$limit" "$SANITIZER_LOG" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1 \
            "$SANITIZER" --tool "$tool" --error-exitcode 1 "$PYTHON" benchmarks/sanitizer_cases.py $SANITIZER_CASE_ARGS
        sanitizer_verdict "$tool" "$first" || break
    done
fi

# ---- 4. benchmark suite with the ceilings --------------------------------------------------
if [ "${SKIP_INFO:-0}" = "1" ]; then RESERVE_AFTER_BENCH=10; fi  # only the summary remains
bench_limit=$(( $(remaining) - RESERVE_AFTER_BENCH - BENCH_LAYERS_TIMEOUT - 2 * BENCH_DECODE_TIMEOUT - SWEEP_TIMEOUT \
    - SWEEP_DELTA_TIMEOUT ))
if [ "$bench_limit" -gt "$BENCH_TIMEOUT" ]; then bench_limit=$BENCH_TIMEOUT; fi
bench_budget=$(( bench_limit - BENCH_SLACK_S ))
if [ "$bench_budget" -lt 5 ]; then bench_budget=5; fi
if [ "$BENCH_TIMEOUT" -le 0 ]; then
    skip_step bench "BENCH_TIMEOUT=0"
else
    # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
    run_step bench "$bench_limit" "$OUT/bench.log" env LAMINA_BENCH_PLAIN=1 PYTHONUNBUFFERED=1 \
        "$PYTHON" -m lamina.cli bench $BENCH_ARGS --out "$OUT/bench.jsonl" --time-budget "$bench_budget"
fi

# ---- 4b. layer benchmark: lamina.layers against fla.layers, same weights ---------------------
if [ "$BENCH_LAYERS_TIMEOUT" -le 0 ]; then
    skip_step bench_layers "BENCH_LAYERS_TIMEOUT=0: the benchmark call runs it"
else
    layers_limit=$(( $(remaining) - RESERVE_AFTER_BENCH - 2 * BENCH_DECODE_TIMEOUT ))
    if [ "$layers_limit" -gt "$BENCH_LAYERS_TIMEOUT" ]; then layers_limit=$BENCH_LAYERS_TIMEOUT; fi
    layers_budget=$(( layers_limit - BENCH_SLACK_S ))
    if [ "$layers_budget" -lt 5 ]; then layers_budget=5; fi
    # shellcheck disable=SC2086  # LAYERS_BENCH_ARGS is a word list on purpose
    run_step bench_layers "$layers_limit" "$OUT/bench.log" env LAMINA_BENCH_PLAIN=1 PYTHONUNBUFFERED=1 \
        "$PYTHON" -m lamina.cli bench --op layers $LAYERS_BENCH_ARGS --out "$OUT/bench.jsonl" \
        --time-budget "$layers_budget"
fi

# ---- 4c. decode step and generation: lamina bench --op decode / --op generation -----------------
# The decode step (GDN, state pool in place, T=1) against fla's step and the memory floor, then
# tokens/s of generation (HRM-LM vs PrismDecoder). 0 (the default) leaves them out; the second call
# sets BENCH_DECODE_TIMEOUT.
if [ "$BENCH_DECODE_TIMEOUT" -le 0 ]; then
    skip_step bench_decode "BENCH_DECODE_TIMEOUT=0: the benchmark call runs it"
else
    run_step bench_decode "$BENCH_DECODE_TIMEOUT" "$OUT/bench.log" env LAMINA_BENCH_PLAIN=1 PYTHONUNBUFFERED=1 \
        "$PYTHON" -m lamina.cli bench --op decode $DECODE_BENCH_ARGS --out "$OUT/bench.jsonl"
    run_step bench_generation "$BENCH_DECODE_TIMEOUT" "$OUT/bench.log" env PYTHONUNBUFFERED=1 \
        "$PYTHON" -m lamina.cli bench --op generation $GENERATION_BENCH_ARGS --out "$OUT/bench.jsonl"
fi

# ---- 4d. attention / HRM-update sweep: the dispatch table of prism_attention(backend="auto") ----------
if [ "$SWEEP_TIMEOUT" -le 0 ]; then
    skip_step sweep "SWEEP_TIMEOUT=0: the sweep call runs it"
else
    sweep_limit=$(( $(remaining) - RESERVE_AFTER_BENCH - SWEEP_DELTA_TIMEOUT ))
    if [ "$sweep_limit" -gt "$SWEEP_TIMEOUT" ]; then sweep_limit=$SWEEP_TIMEOUT; fi
    sweep_budget=$(( sweep_limit - BENCH_SLACK_S ))
    if [ "$sweep_budget" -lt 5 ]; then sweep_budget=5; fi
    # shellcheck disable=SC2086  # SWEEP_ARGS is a word list on purpose
    run_step sweep "$sweep_limit" "$OUT/bench.log" env PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/sweep_attention.py \
        $SWEEP_ARGS --out "$OUT/bench.jsonl" --table "${TMPDIR:-/tmp}/attention_dispatch.json" \
        --time-budget "$sweep_budget"
fi

# ---- 4e. delta-rule sweep: every speed alternative of the chunked kernels, the defaults and fla ----------
if [ "$SWEEP_DELTA_TIMEOUT" -le 0 ]; then
    skip_step sweep_delta "SWEEP_DELTA_TIMEOUT=0: the delta sweep call runs it"
else
    sweep_delta_limit=$(( $(remaining) - RESERVE_AFTER_BENCH ))
    if [ "$sweep_delta_limit" -gt "$SWEEP_DELTA_TIMEOUT" ]; then sweep_delta_limit=$SWEEP_DELTA_TIMEOUT; fi
    sweep_delta_budget=$(( sweep_delta_limit - BENCH_SLACK_S ))
    if [ "$sweep_delta_budget" -lt 5 ]; then sweep_delta_budget=5; fi
    # shellcheck disable=SC2086  # SWEEP_DELTA_ARGS is a word list on purpose
    run_step sweep_delta "$sweep_delta_limit" "$OUT/bench.log" env PYTHONUNBUFFERED=1 "$PYTHON" \
        benchmarks/sweep_delta.py $SWEEP_DELTA_ARGS --out "$OUT/bench.jsonl" --time-budget "$sweep_delta_budget"
fi

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
    if [ -s "$LAYERS_REPORT" ]; then
        echo
        echo "=== fla layers vs lamina on the GPU, largest RMS error ratio per case (all: $(basename "$LAYERS_REPORT"))"
        grep -h "largest" "$LAYERS_REPORT"
    fi
    if [ "${#SANITIZER_LINES[@]}" -gt 0 ]; then
        echo
        echo "=== compute-sanitizer ($(basename "$SANITIZER_LOG"))"
        printf '%s\n' "${SANITIZER_LINES[@]}"
    fi
    echo
    echo "=== steps"
    printf '%s\n' "${STEPS[@]}"
} >"$SUMMARY" 2>&1

cat "$SUMMARY"
