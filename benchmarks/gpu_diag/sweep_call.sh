#!/usr/bin/env bash
# One device call for the delta-rule sweep, each variant in its own process (a fault in one leaves the
# others' timings standing): first the four bf16 float64 checks (check.py) and an untimed pass of the sweep
# per variant, all at once (their Triton compiles fill the disk cache on every core); then the sweep, one
# variant after the other; then its report from all the records.
# WARM_S (default 140) limits the first part, PER_OP_S (default 65) each variant's sweep budget.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT/logs"
WARM_S="${WARM_S:-140}"; PER_OP_S="${PER_OP_S:-65}"
OPS="${OPS:-gated_delta_rule kda gdn2 delta_rule}"
t0=$(date +%s); say() { echo "[sweep_call $(( $(date +%s) - t0 ))s] $*"; }
{ date -u +%FT%TZ; git rev-parse HEAD; git status --short | head
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -r
  python3 -m pip install -q --no-deps --no-build-isolation --no-index wheels/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
  python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
say "warm: checks and untimed sweeps"
for v in delta gdn kda gdn2; do
    timeout "$WARM_S" python3 benchmarks/gpu_diag/check.py "$v" bf16 2x512x4x128 > "$OUT/logs/check_$v.log" 2>&1 &
done
for op in $OPS; do
    timeout "$WARM_S" python3 benchmarks/sweep_delta.py --device cuda --ops "$op" --out "$OUT/logs/warm_$op.jsonl" \
        --time-budget $(( WARM_S - 25 )) > "$OUT/logs/warm_$op.log" 2>&1 &
done
wait
for v in delta gdn kda gdn2; do tail -n 1 "$OUT/logs/check_$v.log"; done | tee "$OUT/checks.log"
for op in $OPS; do
    say "sweep $op"
    timeout $(( PER_OP_S + 25 )) python3 benchmarks/sweep_delta.py --device cuda --ops "$op" --out "$OUT/bench.jsonl" \
        --time-budget "$PER_OP_S" > "$OUT/logs/sweep_$op.log" 2>&1
    echo "rc $?" >> "$OUT/logs/sweep_$op.log"
    grep -c '"status": "ok"' "$OUT/bench.jsonl"
done
python3 benchmarks/sweep_delta.py --report-from "$OUT/bench.jsonl" > "$OUT/report.txt" 2>&1
cat "$OUT/report.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
say done
