// HRM gated update: the interface between the CUDA kernels (hrm_update_kernel.cu, plain CUDA,
// compiled without torch headers) and the torch binding (hrm_update_cuda.cpp).
//
//   z = sigmoid(gate + bias)        gate [n, d] (per channel) or [n, 1] (per token)
//   y = z * h + (1 - z) * c
//   y = y * rstd * weight           when weight != nullptr; rstd = 1 / sqrt(mean(y^2) + eps), saved per row
//
// All row-major tensors are contiguous [n, d] (gate [n, 1] when per token). bias and weight are
// float32 (the binding converts them); rstd and the reduced parameter gradients are float32.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace lamina {
namespace hrm {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct FwdParams {
  const void* h;
  const void* c;
  const void* gate;
  const float* bias;    // [d] or [1], or nullptr
  const float* weight;  // [d], or nullptr (no normalisation)
  void* y;
  float* rstd;          // [n], written when weight != nullptr
  int64_t n;
  int64_t d;
  bool per_channel;     // gate is [n, d] (true) or [n, 1] (false)
  float eps;
  DType dtype;
};

struct BwdParams {
  const void* dy;
  const void* h;
  const void* c;
  const void* gate;
  const float* bias;
  const float* weight;
  const float* rstd;
  void* dh;
  void* dc;
  void* dgate;
  float* dbias;    // [d] or [1] when bias != nullptr
  float* dweight;  // [d] when weight != nullptr
  int64_t n;
  int64_t d;
  bool per_channel;
  DType dtype;
};

// Forward: one pass, each row read once.
cudaError_t fwd_launch(const FwdParams& p, cudaStream_t stream);

// Backward: floats of scratch memory the launch needs for the two-stage reductions.
size_t bwd_workspace_floats(const BwdParams& p, int num_sms);

// Backward: one pass over the rows, then a second kernel that sums the per-block partial
// sums of dbias and dweight in a fixed order (deterministic, no atomics).
cudaError_t bwd_launch(const BwdParams& p, float* workspace, int num_sms, cudaStream_t stream);

}  // namespace hrm
}  // namespace lamina
