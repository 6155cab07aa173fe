// Delta-rule decode step, CPU kernel (registered for the CPU dispatch key of
// lamina_C::delta_decode_step), and the argument checks shared with the CUDA binding.
//
// Work items are (sequence, value head) pairs, independent of each other: at::parallel_for splits
// them over threads and each item runs the same arithmetic whatever the thread count, so results
// are reproducible. Per item the state lives in one buffer (the pool slot itself when it is updated
// in place, else the final_state row, else a thread-local buffer) and each token makes two passes
// over it, row by row, with inner loops over contiguous rows that the compiler vectorises:
//
//   [K, V] slots: pass 1  S[k,:] = d_k S[k,:],  r += e_k S[k,:]     (decay fused with the read)
//                 pass 2  S[k,:] += k_k u,      o += q_k S[k,:]     (u = w*v - r)
//   [V, K] slots: pass 1  S[v,:] *= d,          r_v = <S[v,:], e>
//                 pass 2  S[v,:] += u_v k,      o_v = <S[v,:], q>
//
// The first token reads the pool slot and writes the working buffer in the same pass, so a slot
// that is not updated in place is read exactly once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "delta_decode.h"

namespace lamina {
namespace decode {

namespace {

constexpr const char* kOp = "delta_decode_step";

DType kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      break;
  }
  TORCH_CHECK(false, kOp, ": ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  return DType::kFloat32;  // not reached
}

void check_device(const at::Tensor& ref, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), kOp, ": ", name, " is on ", t.device(), " but q is on ", ref.device());
}

// A float32 contiguous tensor of exactly `shape` (the Python side converts gates and parameters).
const float* float_arg(const at::Tensor& q, const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  check_device(q, t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, kOp, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, kOp, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), kOp, ": ", name, " must be contiguous");
  return t.data_ptr<float>();
}

// A gate of one value per head [B, T, HV] or one per channel [B, T, HV, width]; returns per-channel.
bool gate_arg(const at::Tensor& q, const at::Tensor& t, const char* name, int64_t B, int64_t T, int64_t HV,
              int64_t width, const char* width_name) {
  const bool per_channel = t.dim() == 4;
  TORCH_CHECK(t.dim() == 3 || per_channel, kOp, ": ", name, " must be [B, T, HV] = [", B, ", ", T, ", ", HV,
              "] or [B, T, HV, ", width_name, "] = [", B, ", ", T, ", ", HV, ", ", width, "], got ", t.sizes());
  if (per_channel) {
    float_arg(q, t, name, {B, T, HV, width});
  } else {
    float_arg(q, t, name, {B, T, HV});
  }
  return per_channel;
}

Index index_arg(const at::Tensor& q, const c10::optional<at::Tensor>& t, const char* name, int64_t dim) {
  if (!t) return {nullptr, false};
  check_device(q, *t, name);
  const auto st = t->scalar_type();
  TORCH_CHECK(st == at::kInt || st == at::kLong, kOp, ": ", name, " must be int32 or int64, got ", st);
  TORCH_CHECK(t->dim() == dim, kOp, ": ", name, " must have ", dim, " dimension(s), got shape ", t->sizes());
  TORCH_CHECK(t->is_contiguous(), kOp, ": ", name, " must be contiguous");
  return {t->data_ptr(), st == at::kLong};
}

}  // namespace

Params describe(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
                const at::Tensor& b, const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& A_log,
                const c10::optional<at::Tensor>& dt_bias, const c10::optional<at::Tensor>& state,
                const c10::optional<at::Tensor>& state_indices, const c10::optional<at::Tensor>& num_accepted_tokens,
                const c10::optional<at::Tensor>& cu_seqlens, const at::Tensor& out,
                const c10::optional<at::Tensor>& final_state, double scale, double lower_bound, int64_t gate_act,
                int64_t beta_act, bool l2norm, bool state_v_first, bool inplace) {
  Params p{};
  TORCH_CHECK(q.dim() == 4, kOp, ": q must be [B, T, H, K], got ", q.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  TORCH_CHECK(k.sizes() == q.sizes(), kOp, ": k must have the shape of q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.dim() == 4 && v.size(0) == B && v.size(1) == T, kOp, ": v must be [B, T, HV, V] with B = ", B,
              " and T = ", T, ", got ", v.sizes());
  const int64_t HV = v.size(2), V = v.size(3);
  TORCH_CHECK(H > 0 && HV % H == 0, kOp, ": v's head count HV = ", HV, " must be a multiple of q's H = ", H);
  TORCH_CHECK(K > 0 && V > 0, kOp, ": K and V must be positive, got K = ", K, ", V = ", V);
  check_device(q, k, "k");
  check_device(q, v, "v");
  check_device(q, out, "out");
  p.qk_dtype = kernel_dtype(q, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), kOp, ": k must have q's dtype ", q.scalar_type(), ", got ",
              k.scalar_type());
  p.v_dtype = kernel_dtype(v, "v");
  TORCH_CHECK(out.sizes() == v.sizes() && out.scalar_type() == v.scalar_type(), kOp,
              ": out must be a ", v.scalar_type(), " tensor of v's shape ", v.sizes(), ", got ", out.scalar_type(),
              " ", out.sizes());
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), kOp, ": q, k and v must be contiguous");
  TORCH_CHECK(out.is_contiguous(), kOp, ": out must be contiguous");
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.B = B, p.T = T, p.H = H, p.HV = HV, p.K = K, p.V = V;

  if (g) p.g_per_k = gate_arg(q, *g, "g", B, T, HV, K, "K");
  p.g = g ? g->data_ptr<float>() : nullptr;
  p.b_per_k = gate_arg(q, b, "b", B, T, HV, K, "K");
  p.b = b.data_ptr<float>();
  if (w) p.w_per_v = gate_arg(q, *w, "w", B, T, HV, V, "V");
  p.w = w ? w->data_ptr<float>() : nullptr;
  TORCH_CHECK(w || !p.b_per_k, kOp, ": w must be given when b is per K channel (w = b needs one beta per head)");
  TORCH_CHECK(gate_act >= kGateNone && gate_act <= kGateLowerBound, kOp, ": gate_act must be 0, 1 or 2, got ",
              gate_act);
  TORCH_CHECK(beta_act >= kBetaNone && beta_act <= kBetaSigmoid2, kOp, ": beta_act must be 0, 1 or 2, got ",
              beta_act);
  // A_log and dt_bias enter only the activated gate (ignored otherwise, as in the contract)
  const bool gated = g && gate_act != kGateNone;
  if (gated && A_log) p.A_log = float_arg(q, *A_log, "A_log", {HV});
  if (gated && dt_bias) {
    const int64_t n = p.g_per_k ? HV * K : HV;
    p.dt_bias = float_arg(q, *dt_bias, "dt_bias", {n});
  }

  // sequences
  p.cu_seqlens = index_arg(q, cu_seqlens, "cu_seqlens", 1);
  if (cu_seqlens) {
    TORCH_CHECK(B == 1, kOp, ": cu_seqlens needs B == 1 (sequences packed along T), got B = ", B);
    TORCH_CHECK(cu_seqlens->numel() >= 1, kOp, ": cu_seqlens must hold N + 1 >= 1 offsets");
    p.N = cu_seqlens->numel() - 1;
  } else {
    p.N = B;
  }
  const int64_t N = p.N;

  // state pool
  const int64_t rows = state_v_first ? V : K, cols = state_v_first ? K : V;
  const char* layout = state_v_first ? "[P, HV, V, K]" : "[P, HV, K, V]";
  if (state) {
    const at::Tensor& s = *state;
    check_device(q, s, "state");
    TORCH_CHECK(s.scalar_type() == at::kFloat, kOp, ": state must be float32, got ", s.scalar_type());
    TORCH_CHECK(s.dim() == 4 && s.size(1) == HV && s.size(2) == rows && s.size(3) == cols, kOp, ": state must be ",
                layout, " = [P, ", HV, ", ", rows, ", ", cols, "], got ", s.sizes());
    TORCH_CHECK(s.stride(3) == 1 && s.stride(2) == cols && s.stride(1) == rows * cols, kOp,
                ": each slot of state must be contiguous (strides [*, ", rows * cols, ", ", cols, ", 1]), got strides ",
                s.strides());
    TORCH_CHECK(s.size(0) <= 1 || s.stride(0) >= HV * rows * cols, kOp,
                ": the slots of state must not overlap (slot stride >= ", HV * rows * cols, "), got ", s.stride(0));
    p.state = s.data_ptr<float>();
    p.slot_stride = s.stride(0);
    p.P = s.size(0);
  }
  p.state_indices = index_arg(q, state_indices, "state_indices", 2);
  if (state_indices) {
    TORCH_CHECK(state_indices->size(0) == N, kOp, ": state_indices must be [N, S] with N = ", N, ", got ",
                state_indices->sizes());
    p.S = state_indices->size(1);
  }
  p.num_accepted = index_arg(q, num_accepted_tokens, "num_accepted_tokens", 1);
  if (num_accepted_tokens) {
    TORCH_CHECK(state_indices, kOp, ": num_accepted_tokens needs state_indices");
    TORCH_CHECK(num_accepted_tokens->numel() == N, kOp, ": num_accepted_tokens must be [N] with N = ", N, ", got ",
                num_accepted_tokens->sizes());
  }
  if (final_state) {
    const at::Tensor& f = *final_state;
    check_device(q, f, "final_state");
    TORCH_CHECK(f.scalar_type() == at::kFloat, kOp, ": final_state must be float32, got ", f.scalar_type());
    TORCH_CHECK(f.dim() == 4 && f.size(0) == N && f.size(1) == HV && f.size(2) == rows && f.size(3) == cols, kOp,
                ": final_state must be [N, HV, ...] = [", N, ", ", HV, ", ", rows, ", ", cols, "], got ", f.sizes());
    TORCH_CHECK(f.is_contiguous(), kOp, ": final_state must be contiguous");
    TORCH_CHECK(!state || !f.is_alias_of(*state), kOp, ": final_state must be a tensor separate from state");
    p.final_state = f.data_ptr<float>();
  }
  p.scale = static_cast<float>(scale);
  p.lower_bound = static_cast<float>(lower_bound);
  p.gate_act = static_cast<int>(gate_act);
  p.beta_act = static_cast<int>(beta_act);
  p.l2norm = l2norm;
  p.v_first = state_v_first;
  p.inplace = inplace && state.has_value();
  p.per_token = p.inplace && state_indices && p.S > 1;
  return p;
}

namespace {

// State elements per parallel task: small heads are grouped so that a task is worth a thread's
// start-up (a 128 x 128 head is one task on its own).
constexpr int64_t kGrainStateElems = 1 << 14;

void load_floats(const void* base, DType dtype, int64_t offset, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kFloat32: {
      const float* src = static_cast<const float*>(base) + offset;
      std::copy(src, src + n, dst);
      break;
    }
    case DType::kFloat16: {
      const c10::Half* src = static_cast<const c10::Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::kBFloat16: {
      const c10::BFloat16* src = static_cast<const c10::BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      break;
    }
  }
}

void store_floats(void* base, DType dtype, int64_t offset, int64_t n, const float* src) {
  switch (dtype) {
    case DType::kFloat32:
      std::copy(src, src + n, static_cast<float*>(base) + offset);
      break;
    case DType::kFloat16: {
      c10::Half* dst = static_cast<c10::Half*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
      break;
    }
    case DType::kBFloat16: {
      c10::BFloat16* dst = static_cast<c10::BFloat16*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
      break;
    }
  }
}

// Lanes of the dot products over contiguous rows: independent partial sums the compiler keeps in
// vector registers (a plain `s += a[i] * b[i]` is not reordered, so not vectorised, without
// -ffast-math). The lanes are added in a fixed order: the result does not depend on threads.
constexpr int64_t kDotLanes = 8;

inline float dot(const float* a, const float* b, int64_t n) {
  float lane[kDotLanes] = {};
  int64_t i = 0;
  for (; i + kDotLanes <= n; i += kDotLanes) {
    for (int64_t j = 0; j < kDotLanes; ++j) lane[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int64_t j = 0; j < kDotLanes; ++j) s += lane[j];
  return s;
}

// One token's transformed inputs for one value head (float32).
struct Token {
  std::vector<float> q, k, e, d, z, r, o;  // q, k, e = b k, d = exp(g) [K]; z = w v, r, o [V]
  Token(int64_t K, int64_t V) : q(K), k(K), e(K), d(K), z(V), r(V), o(V) {}
};

void l2_normalise(std::vector<float>& x) {
  float s = 0.f;
  for (float xi : x) s += xi * xi;
  const float inv = 1.f / std::sqrt(s + kL2NormEps);
  for (float& xi : x) xi *= inv;
}

// Fills tok with token `row` (index into [B * T]) of value head hv.
void prepare_token(const Params& p, int64_t row, int64_t hv, Token& tok) {
  const int64_t K = p.K, V = p.V;
  const int64_t h = hv / (p.HV / p.H);
  const int64_t qk_off = (row * p.H + h) * K;
  const int64_t head = row * p.HV + hv;  // index of (token, value head)
  load_floats(p.q, p.qk_dtype, qk_off, K, tok.q.data());
  load_floats(p.k, p.qk_dtype, qk_off, K, tok.k.data());
  load_floats(p.v, p.v_dtype, head * V, V, tok.z.data());
  if (p.l2norm) {
    l2_normalise(tok.q);
    l2_normalise(tok.k);
  }
  for (int64_t i = 0; i < K; ++i) tok.q[i] *= p.scale;
  // decay
  if (p.g == nullptr) {
    std::fill(tok.d.begin(), tok.d.end(), 1.f);
  } else {
    const bool has_a = p.A_log != nullptr;
    const float a_log = has_a ? p.A_log[hv] : 0.f;
    const int64_t width = p.g_per_k ? K : 1;
    for (int64_t i = 0; i < width; ++i) {
      float x = p.g[head * width + i];
      if (p.dt_bias != nullptr && p.gate_act != kGateNone) x += p.dt_bias[hv * width + i];
      tok.d[i] = std::exp(p.gate_act == kGateNone ? x : gate_value(x, has_a, a_log, p.gate_act, p.lower_bound));
    }
    if (!p.g_per_k) std::fill(tok.d.begin() + 1, tok.d.end(), tok.d[0]);
  }
  // erase and write strengths
  const float b_head = p.b_per_k ? 0.f : beta_value(p.b[head], p.beta_act);
  for (int64_t i = 0; i < K; ++i) {
    tok.e[i] = (p.b_per_k ? beta_value(p.b[head * K + i], p.beta_act) : b_head) * tok.k[i];
  }
  if (p.w == nullptr) {
    for (int64_t j = 0; j < V; ++j) tok.z[j] *= b_head;
  } else if (p.w_per_v) {
    for (int64_t j = 0; j < V; ++j) tok.z[j] *= p.w[head * V + j];
  } else {
    const float w_head = p.w[head];
    for (int64_t j = 0; j < V; ++j) tok.z[j] *= w_head;
  }
}

// Rows of a [K, V] state updated together: each pass over V then loads and stores the accumulator
// (r or o) once per kRowBlock rows instead of once per row. On the CPU of
// benchmarks/results/2026-12-01-decode-cpu.jsonl, one thread, GDN step at B = 1, H = 16, K = V = 128
// (state in cache): 0.21 ms per step one row at a time, 0.18 ms with 4; at B = 8 the state streams
// from memory and the difference is within the run-to-run noise.
constexpr int64_t kRowBlock = 4;

// The row loops below write row pointers that may equal the ones they read (src == dst), element
// for element: no iteration depends on another, which the compiler cannot prove by itself.
#if defined(__clang__)
#define LAMINA_NO_LOOP_DEPS _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define LAMINA_NO_LOOP_DEPS _Pragma("GCC ivdep")
#else
#define LAMINA_NO_LOOP_DEPS
#endif

// One token on a [K, V] state: reads `src` (nullptr: zeros), writes the new state to `dst`
// (may equal src) and the output to tok.o.
void step_kv(const float* src, float* dst, Token& tok, int64_t K, int64_t V) {
  float* r = tok.r.data();
  float* o = tok.o.data();
  const float *d = tok.d.data(), *e = tok.e.data(), *kk = tok.k.data(), *q = tok.q.data();
  std::fill(r, r + V, 0.f);
  if (src == nullptr) {
    std::fill(dst, dst + K * V, 0.f);
  } else {
    // pass 1: S[i,:] = d_i S[i,:] and r += e_i S[i,:]
    int64_t i = 0;
    for (; i + kRowBlock <= K; i += kRowBlock) {
      const float *in0 = src + i * V, *in1 = in0 + V, *in2 = in1 + V, *in3 = in2 + V;
      float *s0 = dst + i * V, *s1 = s0 + V, *s2 = s1 + V, *s3 = s2 + V;
      // coefficients in locals: the stores through s0..s3 could alias d and e as far as the compiler knows
      const float d0 = d[i], d1 = d[i + 1], d2 = d[i + 2], d3 = d[i + 3];
      const float e0 = e[i], e1 = e[i + 1], e2 = e[i + 2], e3 = e[i + 3];
      LAMINA_NO_LOOP_DEPS
      for (int64_t j = 0; j < V; ++j) {
        const float a0 = d0 * in0[j], a1 = d1 * in1[j], a2 = d2 * in2[j], a3 = d3 * in3[j];
        s0[j] = a0, s1[j] = a1, s2[j] = a2, s3[j] = a3;
        r[j] += (e0 * a0 + e1 * a1) + (e2 * a2 + e3 * a3);
      }
    }
    for (; i < K; ++i) {
      const float* in = src + i * V;
      float* row = dst + i * V;
      const float di = d[i], ei = e[i];
      LAMINA_NO_LOOP_DEPS
      for (int64_t j = 0; j < V; ++j) {
        const float a = di * in[j];
        row[j] = a;
        r[j] += ei * a;
      }
    }
  }
  for (int64_t j = 0; j < V; ++j) r[j] = tok.z[j] - r[j];  // r now holds u = z - r
  std::fill(o, o + V, 0.f);
  // pass 2: S[i,:] += k_i u and o += q_i S[i,:]
  int64_t i = 0;
  for (; i + kRowBlock <= K; i += kRowBlock) {
    float *s0 = dst + i * V, *s1 = s0 + V, *s2 = s1 + V, *s3 = s2 + V;
    const float k0 = kk[i], k1 = kk[i + 1], k2 = kk[i + 2], k3 = kk[i + 3];
    const float q0 = q[i], q1 = q[i + 1], q2 = q[i + 2], q3 = q[i + 3];
    LAMINA_NO_LOOP_DEPS
    for (int64_t j = 0; j < V; ++j) {
      const float u = r[j];
      const float a0 = s0[j] + k0 * u, a1 = s1[j] + k1 * u, a2 = s2[j] + k2 * u, a3 = s3[j] + k3 * u;
      s0[j] = a0, s1[j] = a1, s2[j] = a2, s3[j] = a3;
      o[j] += (q0 * a0 + q1 * a1) + (q2 * a2 + q3 * a3);
    }
  }
  for (; i < K; ++i) {
    float* row = dst + i * V;
    const float ki = kk[i], qi = q[i];
    LAMINA_NO_LOOP_DEPS
    for (int64_t j = 0; j < V; ++j) {
      const float a = row[j] + ki * r[j];
      row[j] = a;
      o[j] += qi * a;
    }
  }
}

// One token on a [V, K] state (rows over K).
void step_vk(const float* src, float* dst, Token& tok, int64_t K, int64_t V) {
  const float* d = tok.d.data();
  const float* e = tok.e.data();
  for (int64_t j = 0; j < V; ++j) {
    float* row = dst + j * K;
    if (src == nullptr) {
      std::fill(row, row + K, 0.f);
    } else {
      const float* in = src + j * K;
      for (int64_t i = 0; i < K; ++i) row[i] = d[i] * in[i];
    }
    tok.r[j] = tok.z[j] - dot(row, e, K);  // u_j
  }
  const float* kk = tok.k.data();
  const float* q = tok.q.data();
  for (int64_t j = 0; j < V; ++j) {
    float* row = dst + j * K;
    const float u = tok.r[j];
    for (int64_t i = 0; i < K; ++i) row[i] += u * kk[i];
    tok.o[j] = dot(row, q, K);
  }
}

// Per sequence: first token (index into [B * T]), token count and read slot (-1: skipped).
struct Sequence {
  int64_t bos, len, slot;
};

std::vector<Sequence> sequences(const Params& p) {
  std::vector<Sequence> seqs(p.N);
  for (int64_t n = 0; n < p.N; ++n) {
    int64_t bos = n * p.T, eos = bos + p.T;
    if (p.cu_seqlens.present()) {
      bos = p.cu_seqlens[n];
      eos = p.cu_seqlens[n + 1];
      TORCH_CHECK(0 <= bos && bos <= eos && eos <= p.T, kOp, ": cu_seqlens must be non-decreasing offsets in 0..",
                  p.T, ", got ", bos, ", ", eos, " at ", n);
    }
    seqs[n] = {bos, eos - bos, read_slot(p, n)};
  }
  return seqs;
}

void run(const Params& p) {
  const std::vector<Sequence> seqs = sequences(p);
  const int64_t K = p.K, V = p.V, KV = K * V, HV = p.HV;
  const int64_t work_per_item = KV * std::max<int64_t>(p.T, 1);
  const int64_t grain = std::max<int64_t>(1, kGrainStateElems / work_per_item);
  at::parallel_for(0, p.N * HV, grain, [&](int64_t begin, int64_t end) {
    Token tok(K, V);
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / HV, hv = item % HV;
      const Sequence& sq = seqs[n];
      float* fin = p.final_state ? p.final_state + item * KV : nullptr;
      if (sq.slot < 0) {  // skipped: zero outputs and final state, no slot touched
        for (int64_t t = 0; t < sq.len; ++t) {
          std::fill(tok.o.begin(), tok.o.end(), 0.f);
          store_floats(p.out, p.v_dtype, ((sq.bos + t) * HV + hv) * V, V, tok.o.data());
        }
        if (fin) std::fill(fin, fin + KV, 0.f);
        continue;
      }
      float* slot = p.state ? p.state + sq.slot * p.slot_stride + hv * KV : nullptr;
      // the buffer that carries the state through the tokens
      float* work;
      if (slot && p.inplace && !p.per_token) {
        work = slot;
      } else if (fin) {
        work = fin;
      } else {
        scratch.resize(KV);
        work = scratch.data();
      }
      const float* src = slot;
      if (sq.len == 0 && work != src) {
        if (src) {
          std::memcpy(work, src, KV * sizeof(float));
        } else {
          std::fill(work, work + KV, 0.f);
        }
      }
      for (int64_t t = 0; t < sq.len; ++t) {
        const int64_t row = sq.bos + t;
        prepare_token(p, row, hv, tok);
        if (p.v_first) {
          step_vk(src, work, tok, K, V);
        } else {
          step_kv(src, work, tok, K, V);
        }
        src = work;
        store_floats(p.out, p.v_dtype, (row * HV + hv) * V, V, tok.o.data());
        if (p.per_token && t < p.S) {
          const int64_t dst = p.state_indices[n * p.S + t];
          if (dst >= 0 && dst < p.P) std::memcpy(p.state + dst * p.slot_stride + hv * KV, work, KV * sizeof(float));
        }
      }
      if (fin && work != fin) std::memcpy(fin, work, KV * sizeof(float));
    }
  });
}

void delta_decode_step_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& g, const at::Tensor& b, const c10::optional<at::Tensor>& w,
                           const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& dt_bias,
                           const c10::optional<at::Tensor>& state, const c10::optional<at::Tensor>& state_indices,
                           const c10::optional<at::Tensor>& num_accepted_tokens,
                           const c10::optional<at::Tensor>& cu_seqlens, at::Tensor& out,
                           const c10::optional<at::Tensor>& final_state, double scale, double lower_bound,
                           int64_t gate_act, int64_t beta_act, bool l2norm, bool state_v_first, bool inplace) {
  TORCH_CHECK(q.device().is_cpu(), kOp, " (CPU kernel): q must be a CPU tensor, got ", q.device());
  const Params p = describe(q, k, v, g, b, w, A_log, dt_bias, state, state_indices, num_accepted_tokens, cu_seqlens,
                            out, final_state, scale, lower_bound, gate_act, beta_act, l2norm, state_v_first, inplace);
  run(p);
}

}  // namespace
}  // namespace decode

TORCH_LIBRARY_IMPL(lamina_C, CPU, m) { m.impl("delta_decode_step", &decode::delta_decode_step_cpu); }

}  // namespace lamina
