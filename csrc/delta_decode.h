// Delta-rule decode step (lamina.ops.delta_decode): the interface shared by the CPU kernel
// (delta_decode_cpu.cpp), the CUDA kernel (delta_decode_kernel.cu, plain CUDA, no torch headers)
// and its torch binding (delta_decode_cuda.cpp).
//
// Per sequence n and value head hv, from the slot's state S ([K, V], or [V, K] with v_first), for
// each token t:
//
//   S   <- diag(exp(g_t)) S                 g: none, one per head, or per K channel
//   r_t  = S^T (b_t * k_t)                  b: one per head or per K channel
//   S   <- S + k_t (w_t * v_t - r_t)^T      w: b (one per head) or per V channel
//   out_t = S^T (scale * q_t)
//
// with the raw gate and beta inputs transformed in the kernel (gate_value, beta_value below) and
// q, k optionally L2-normalised over K. The full contract (slots, skipped rows, speculative
// per-token writes) is the module docstring of python/lamina/ops/delta_decode.py.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LAMINA_HD __host__ __device__ __forceinline__
#else
#define LAMINA_HD inline
#endif

namespace lamina {
namespace decode {

// The op's integer arguments (lamina.ops.delta_decode: GATE_*, BETA_*).
enum GateAct : int { kGateNone = 0, kGateSoftplus = 1, kGateLowerBound = 2 };
enum BetaAct : int { kBetaNone = 0, kBetaSigmoid = 1, kBetaSigmoid2 = 2 };

// q and k are divided by sqrt(sum(x^2) + kL2NormEps) over K (lamina.ops.delta_decode.L2NORM_EPS).
constexpr float kL2NormEps = 1e-6f;
// softplus(x) = x above this (torch.nn.functional.softplus's default threshold).
constexpr float kSoftplusThreshold = 20.f;

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// An int32 or int64 index tensor, read element by element.
struct Index {
  const void* ptr;  // nullptr: absent
  bool is64;
  LAMINA_HD int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i]);
  }
  LAMINA_HD bool present() const { return ptr != nullptr; }
};

struct Params {
  // [B, T, H, K] (qk_dtype), contiguous
  const void* q;
  const void* k;
  // [B, T, HV, V] (v_dtype), contiguous; out written
  const void* v;
  void* out;
  DType qk_dtype;
  DType v_dtype;
  // float32, contiguous: g [B, T, HV(, K)] or nullptr; b [B, T, HV(, K)]; w [B, T, HV(, V)] or nullptr
  const float* g;
  const float* b;
  const float* w;
  const float* A_log;    // [HV] or nullptr
  const float* dt_bias;  // [HV] (scalar g) or [HV * K] (per-channel g), or nullptr
  bool g_per_k;
  bool b_per_k;
  bool w_per_v;
  // state pool: P slots of HV * K * V floats, slot p at state + p * slot_stride (nullptr: zeros)
  float* state;
  int64_t slot_stride;
  int64_t P;
  Index state_indices;  // [N, S] or absent
  int64_t S;            // columns of state_indices (0 when absent)
  Index num_accepted;   // [N] or absent
  Index cu_seqlens;     // [N + 1] or absent
  float* final_state;   // [N, HV, K, V] float32 contiguous, or nullptr
  int64_t B, T, H, HV, K, V, N;
  float scale;
  float lower_bound;
  int gate_act;
  int beta_act;
  bool l2norm;
  bool v_first;    // state slots are [HV, V, K]
  bool inplace;    // write the state back to the pool
  bool per_token;  // inplace with S > 1: the state after token t goes to slot state_indices[n, t]
};

// The slot sequence n reads, or -1 when the sequence is skipped (slot outside 0..P-1, accepted
// count outside 1..S; with no state and no indices every sequence starts from zeros: slot 0 is
// returned and the caller reads nothing).
LAMINA_HD int64_t read_slot(const Params& p, int64_t n) {
  int64_t slot = n;
  if (p.state_indices.present()) {
    const int64_t a = p.num_accepted.present() ? p.num_accepted[n] : 1;
    if (a < 1 || a > p.S) return -1;
    slot = p.state_indices[n * p.S + (a - 1)];
  } else if (p.state == nullptr) {
    return 0;
  }
  return (slot >= 0 && slot < p.P) ? slot : -1;
}

LAMINA_HD float sigmoid(float x) { return 1.f / (1.f + ::expf(-x)); }

LAMINA_HD float softplus(float x) { return x > kSoftplusThreshold ? x : ::log1pf(::expf(x)); }

// Log decay from the raw gate input x (g + dt_bias already added); a_log is A_log[hv] or absent.
LAMINA_HD float gate_value(float x, bool has_a, float a_log, int act, float lower_bound) {
  const float a = has_a ? ::expf(a_log) : 1.f;
  if (act == kGateSoftplus) return -a * softplus(x);
  if (act == kGateLowerBound) return lower_bound * sigmoid(a * x);
  return x;
}

LAMINA_HD float beta_value(float x, int act) {
  if (act == kBetaSigmoid) return sigmoid(x);
  if (act == kBetaSigmoid2) return 2.f * sigmoid(x);
  return x;
}

}  // namespace decode
}  // namespace lamina

#if defined(__CUDACC__) || defined(LAMINA_WITH_CUDA)
#include <cuda_runtime_api.h>

namespace lamina {
namespace decode {
// One launch: grid (V tiles, HV, N); each block carries its state tile through the sequence's tokens.
cudaError_t launch(const Params& p, cudaStream_t stream);
// Whether the kernel covers K (the state tile of a block is K rows; lamina's limit kMaxK).
bool cuda_supports_k(int64_t K);
}  // namespace decode
}  // namespace lamina
#endif

#if !defined(__CUDACC__)
// The torch side: validation shared by the CPU kernel and the CUDA binding.
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace lamina {
namespace decode {
// Checks every argument of lamina_C::delta_decode_step (TORCH_CHECK naming the argument) and
// describes them; the pointers are those of the given tensors (no copies are made).
Params describe(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
                const at::Tensor& b, const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& A_log,
                const c10::optional<at::Tensor>& dt_bias, const c10::optional<at::Tensor>& state,
                const c10::optional<at::Tensor>& state_indices, const c10::optional<at::Tensor>& num_accepted_tokens,
                const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& out,
                const c10::optional<at::Tensor>& final_state, double scale, double lower_bound, int64_t gate_act,
                int64_t beta_act, bool l2norm, bool state_v_first, bool inplace);
}  // namespace decode
}  // namespace lamina
#endif
