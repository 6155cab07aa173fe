// Delta-rule decode step: torch binding of the CUDA kernel (compiled only with LAMINA_WITH_CUDA).
//
// The arguments are checked by decode::describe (shared with the CPU kernel); on top of those the
// kernel needs K <= 256, K and V multiples of 4 and 16-byte aligned state slots (its vector loads).
// The launch reads the slot indices, accepted counts and offsets on the device: nothing is copied
// to the host and nothing synchronises, so the call can be captured in a CUDA graph.
#ifdef LAMINA_WITH_CUDA

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cstdint>

#include "delta_decode.h"

namespace lamina {
namespace decode {
namespace {

constexpr const char* kOp = "delta_decode_step (CUDA kernel)";
// Bytes of one state access of the kernel (float4).
constexpr int64_t kStateAlign = 16;

bool aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % kStateAlign == 0; }

void delta_decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& g, const at::Tensor& b,
                            const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& A_log,
                            const c10::optional<at::Tensor>& dt_bias, const c10::optional<at::Tensor>& state,
                            const c10::optional<at::Tensor>& state_indices,
                            const c10::optional<at::Tensor>& num_accepted_tokens,
                            const c10::optional<at::Tensor>& cu_seqlens, at::Tensor& out,
                            const c10::optional<at::Tensor>& final_state, double scale, double lower_bound,
                            int64_t gate_act, int64_t beta_act, bool l2norm, bool state_v_first, bool inplace) {
  TORCH_CHECK(q.is_cuda(), kOp, ": q must be a CUDA tensor, got ", q.device());
  const Params p = describe(q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens,
                            out, final_state, scale, lower_bound, gate_act, beta_act, l2norm, state_v_first, inplace);
  TORCH_CHECK(cuda_supports_k(p.K), kOp, ": K must be at most 256, got K = ", p.K);
  TORCH_CHECK(p.K % 4 == 0 && p.V % 4 == 0, kOp, ": K and V must be multiples of 4 (16-byte state accesses), got K = ",
              p.K, ", V = ", p.V);
  if (p.state) {
    TORCH_CHECK(aligned(p.state) && p.slot_stride % 4 == 0, kOp,
                ": state slots must start at 16-byte aligned addresses (slot stride a multiple of 4 floats), got "
                "slot stride ",
                p.slot_stride);
  }
  if (p.final_state) TORCH_CHECK(aligned(p.final_state), kOp, ": final_state must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(q.device());
  const cudaError_t err = launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "delta_decode_step launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace decode

TORCH_LIBRARY_IMPL(lamina_C, CUDA, m) { m.impl("delta_decode_step", &decode::delta_decode_step_cuda); }

}  // namespace lamina

#endif  // LAMINA_WITH_CUDA
