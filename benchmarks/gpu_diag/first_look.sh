# A first look after the device check: which delta-rule case fails on the GPU (CUDA_LAUNCH_BLOCKING, one
# process per case), and one case under compute-sanitizer memcheck.
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index wheels/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi -L; uname -r
c() { echo "=== $*"; timeout 90 python3 benchmarks/gpu_diag/case.py "$@" 2>&1 | tail -n 14; }
c vecadd x bf16 1x1x1x1
c fla gdn bf16 1x128x2x64
c lam gdn bf16 1x128x2x64
c lam gdn fp32 1x128x2x64
c lam delta bf16 1x128x2x64
c lam kda bf16 1x128x2x64
c rec gdn bf16 1x128x2x64
c lam gdn bf16 2x512x4x128
S=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
echo "=== memcheck lam gdn bf16"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 $S --tool memcheck --print-limit 4 python3 benchmarks/gpu_diag/case.py lam gdn bf16 1x128x2x64 2>&1 | grep -v "^=========     Host Frame\|^=========         \|^\s*$" | head -60
