#!/usr/bin/env bash
# One device call for the delta-rule sweep (benchmarks/sweep_delta.py), each variant timed in its own process (a
# fault in one leaves the others' timings standing):
# 1. at once: the four bf16 float64 checks (check.py, 2x512x4x128, forward and backward, the defaults and each of
#    ALTERNATIVES: a timed alternative is also checked) and the warm pass
#    (sweep_delta.py --warm: every case's first call, one process per variant, mode and shape), whose Triton
#    compiles fill the disk cache on every core and whose autotuning results are kept on disk
#    (TRITON_CACHE_AUTOTUNING=1: tuned here, with the GPU shared by these processes);
# 2. the timed sweep, one variant after the other, each alone on the GPU with PER_OP_S of budget;
# 3. its report from all the records (report.txt).
# The defaults and fla first; ALTERNATIVES (labels of lamina.kernels.delta_tuning's speed alternatives, default
# the forward's blocked solves and its separate output kernel, fla's layout of the forward; "all", or "" for none)
# after them in each variant's budget.
# WARM_S (default 220) limits part 1, TOTAL_S (default 520) the whole call: a variant that would not end in time is
# not started. Files under $OUT: env.log, checks.log, bench.jsonl, report.txt, logs.tgz (every process's log).
# DRY_RUN=1 (on a CPU, PYTHON=a venv's python): the same steps at the sweep's dry-run shape under the interpreter.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/logs"
WARM_S="${WARM_S:-220}"; PER_OP_S="${PER_OP_S:-55}"; TOTAL_S="${TOTAL_S:-520}"
OPS="${OPS:-gated_delta_rule kda gdn2 delta_rule}"
ALTERNATIVES="${ALTERNATIVES-solve_block=16 solve_block=32 output_kernel=True}"
PYTHON="${PYTHON:-python3}"; DEVICE_ARGS=(--device cuda); SHAPE=2x512x4x128; SHAPES="0 1 2"
if [ "${DRY_RUN:-0}" = "1" ]; then
    DEVICE_ARGS=(--dry-run); SHAPE=1x40x1x16; SHAPES="0"; export DEV=cpu TRITON_INTERPRET=1
fi
case "$ALTERNATIVES" in
    all) ALT_ARGS=(); CHECK_LABELS=(all) ;;
    "") ALT_ARGS=(--no-alternatives); CHECK_LABELS=() ;;
    *) read -r -a ALT_LIST <<< "$ALTERNATIVES"; ALT_ARGS=(--alternatives "${ALT_LIST[@]}" --baseline-share 0.7)
       CHECK_LABELS=("${ALT_LIST[@]}") ;;
esac
t0=$(date +%s); elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "[sweep_call $(elapsed)s] $*"; }
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -r
  if [ "${DRY_RUN:-0}" != "1" ]; then
      "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index wheels/*.whl
      "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e .
  fi
  "$PYTHON" -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
  echo "ALTERNATIVES=$ALTERNATIVES WARM_S=$WARM_S PER_OP_S=$PER_OP_S TOTAL_S=$TOTAL_S"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
say "checks and warm pass"
for v in delta gdn kda gdn2; do
    timeout "$WARM_S" "$PYTHON" benchmarks/gpu_diag/check.py "$v" bf16 "$SHAPE" "${CHECK_LABELS[@]}" \
        > "$OUT/logs/check_$v.log" 2>&1 &
done
for op in $OPS; do
    for mode in fwd fwd+bwd; do
        for shape in $SHAPES; do
            name="warm_${op}_${mode}_${shape}"
            timeout "$WARM_S" "$PYTHON" benchmarks/sweep_delta.py "${DEVICE_ARGS[@]}" --warm --ops "$op" \
                --modes "$mode" --shapes "$shape" "${ALT_ARGS[@]}" --out "$OUT/logs/$name.jsonl" \
                > "$OUT/logs/$name.log" 2>&1 &
        done
    done
done
wait
for v in delta gdn kda gdn2; do grep -h "ok in\|WRONG in\|FAILED" "$OUT/logs/check_$v.log" || tail -n 1 "$OUT/logs/check_$v.log"
done | tee "$OUT/checks.log"
say "warm pass: $(grep -h "warm pass:" "$OUT"/logs/warm_*.log | wc -l) processes ended, of $(ls "$OUT"/logs/warm_*.log | wc -l)"
for op in $OPS; do
    limit=$(( PER_OP_S + 25 ))
    if [ $(( $(elapsed) + limit + 10 )) -gt "$TOTAL_S" ]; then say "no time left for $op"; continue; fi
    say "sweep $op"
    timeout "$limit" "$PYTHON" benchmarks/sweep_delta.py "${DEVICE_ARGS[@]}" --ops "$op" "${ALT_ARGS[@]}" \
        --out "$OUT/bench.jsonl" --time-budget "$PER_OP_S" > "$OUT/logs/sweep_$op.log" 2>&1
    echo "rc $?" >> "$OUT/logs/sweep_$op.log"
done
"$PYTHON" benchmarks/sweep_delta.py --report-from "$OUT/bench.jsonl" > "$OUT/report.txt" 2>&1
cat "$OUT/report.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
say done
