// Delta-rule decode step, CUDA kernel and launcher (plain CUDA: compiles with `nvcc -c -arch=sm_90`
// and no torch headers). The arithmetic mirrors delta_decode_cpu.cpp.
//
// One launch per call. Block (n, hv, tile) owns the state tile of value columns
// v0 .. v0 + kBlockV - 1 of sequence n and value head hv for every K row, in registers, and carries
// it through the sequence's tokens: the state is read once (16-byte vector loads) and written once
// (plus once per draft token with per-token writes). Per token the block stages the transformed
// q, k, e = b k and the decay exp(g) [K] and z = w v [tile] in shared memory, then
//
//   pass 1:  S = d S  and  r = S^T e         (partial sums per thread, reduced over K)
//   pass 2:  S += k (z - r)^T  and  o = S^T q (reduced over K; written by the tile's owner threads)
//
// Thread layout, with a thread holding kVec consecutive elements along the slot's contiguous axis:
//   [K, V] slots: kVec columns v, rows k = kg, kg + KG, ... ; the reduction over K adds partial sums
//                 across the kg threads (warp shuffles, then shared memory across warps);
//   [V, K] slots: kVec consecutive k (in kChunks chunks) for rows v = vg, vg + VG, ... ; the reduction
//                 over K is across the KT lanes of a warp that share the rows (shuffles only).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "delta_decode.h"

namespace lamina {
namespace decode {
namespace {

constexpr int kThreads = 128;  // 4 warps: 8 float4 loads in flight per thread at K = 128
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kVec = 4;        // floats per 16-byte state access
constexpr int kBlockV = 32;    // value columns per block: a 128-byte line per state row in [K, V] slots
// Rows of K a block holds: the state tile is kMaxK x kBlockV floats over kThreads threads (64 per
// thread at K = 256).
constexpr int kMaxK = 256;
// Blocks per SM the kernels are compiled for: 1 lets ptxas use up to 255 registers. Left to its
// heuristic (no minimum), ptxas 13.0 capped the K = 32 and K = 256 kernels at 96 and 168 registers
// and spilled 8-20 bytes; with 1 they take 105-229 registers and spill nothing.
constexpr int kMinBlocksPerSm = 1;

// --- element access ------------------------------------------------------------------------------

__device__ __forceinline__ float load_elem(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

__device__ __forceinline__ void store_elem(void* base, DType dtype, int64_t i, float x) {
  switch (dtype) {
    case DType::kFloat16:
      static_cast<__half*>(base)[i] = __float2half_rn(x);
      break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
      break;
    default:
      static_cast<float*>(base)[i] = x;
  }
}

__device__ __forceinline__ void load_vec(const float* p, float (&x)[kVec]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
}

__device__ __forceinline__ void store_vec(float* p, const float (&x)[kVec]) {
  *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}

// Sum over the `width` lanes of a warp whose lane ids differ in the bits of `first .. width-1`
// multiples of `first` (xor butterfly: every such lane gets the sum).
template <int FIRST, int LIMIT>
__device__ __forceinline__ float lanes_sum(float x) {
#pragma unroll
  for (int o = FIRST; o < LIMIT; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// [K, V] slots: each thread holds kVec column sums of its rows; sum them over the kVT-apart lanes of
// the warp and leave one partial per warp and column in red (read by column_total after a barrier).
template <int kVT>
__device__ __forceinline__ void column_partials(float (&acc)[kVec], float (&red)[kWarps][kBlockV], int warp,
                                                int lane, int lane_v) {
#pragma unroll
  for (int c = 0; c < kVec; ++c) acc[c] = lanes_sum<kVT, kWarpSize>(acc[c]);
  if (lane < kVT) {
#pragma unroll
    for (int c = 0; c < kVec; ++c) red[warp][kVec * lane_v + c] = acc[c];
  }
}

// The sum over warps of column `col`'s partials.
__device__ __forceinline__ float column_total(const float (&red)[kWarps][kBlockV], int col) {
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += red[w][col];
  return total;
}

// --- the thread's state tile ---------------------------------------------------------------------

// Where element group m (kVec consecutive floats) of this thread lies: `row` along the slot's outer
// axis, `col` along the contiguous one, and the K index of its first element.
template <int BK, bool V_FIRST>
struct Tile {
  // [K, V]: threads along V, then along K
  static constexpr int kVT = kBlockV / kVec;
  static constexpr int kKG = kThreads / kVT;
  // [V, K]: lanes along K (a warp at most), chunks of them per thread, then rows of V
  static constexpr int kKT = (BK / kVec) < kWarpSize ? (BK / kVec) : kWarpSize;
  static constexpr int kChunks = BK / kVec / kKT;
  static constexpr int kVG = kThreads / kKT;
  static constexpr int kRowsV = kBlockV / kVG;
  // element groups per thread
  static constexpr int kGroups = V_FIRST ? kRowsV * kChunks : BK / kKG;
  static_assert(V_FIRST ? (kBlockV % kVG == 0 && kWarpSize % kKT == 0) : (BK % kKG == 0), "tile layout");

  int lane_k;  // [K, V]: kg; [V, K]: kt
  int lane_v;  // [K, V]: vt; [V, K]: vg

  __device__ explicit Tile(int tid)
      : lane_k(V_FIRST ? tid % kKT : tid / kVT), lane_v(V_FIRST ? tid / kKT : tid % kVT) {}

  // K index of the group's first element, and its V index relative to the block's first column
  __device__ int k_of(int m) const {
    return V_FIRST ? kVec * (lane_k + kKT * (m % kChunks)) : lane_k + kKG * m;
  }
  __device__ int v_of(int m) const { return V_FIRST ? lane_v + kVG * (m / kChunks) : kVec * lane_v; }
};

// --- the kernel ----------------------------------------------------------------------------------

template <int BK>
struct Shared {
  float q[BK], k[BK], e[BK], d[BK];  // scale * q, k (normalised), b * k, exp(g); zero beyond K
  float z[kBlockV];                  // w * v of the tile
  float u[kBlockV];                  // z - r ([K, V] slots)
  float red[kWarps][kBlockV];        // per-warp partial sums over K ([K, V] slots)
  float norm[kWarps][2];             // per-warp sums of q^2 and k^2
};

template <int BK, bool V_FIRST>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) decode_kernel(const __grid_constant__ Params p) {
  using TileT = Tile<BK, V_FIRST>;
  constexpr int kGroups = TileT::kGroups;
  constexpr int kPerThreadK = (BK + kThreads - 1) / kThreads;
  __shared__ Shared<BK> sm;

  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int64_t tiles = (p.V + kBlockV - 1) / kBlockV;
  int64_t bid = blockIdx.x;
  const int64_t v0 = (bid % tiles) * kBlockV;
  bid /= tiles;
  const int64_t hv = bid % p.HV, n = bid / p.HV;
  const int64_t h = hv / (p.HV / p.H);
  const int64_t K = p.K, V = p.V, KV = K * V;

  // the sequence's tokens [bos, eos) in the flattened [B * T], clamped to the tensor
  int64_t bos = n * p.T, eos = bos + p.T;
  if (p.cu_seqlens.present()) {
    const int64_t a = p.cu_seqlens[n], b = p.cu_seqlens[n + 1];
    bos = a < 0 ? 0 : (a > p.T ? p.T : a);
    eos = b < bos ? bos : (b > p.T ? p.T : b);
  }
  const int64_t slot = read_slot(p, n);
  float* fin = p.final_state ? p.final_state + (n * p.HV + hv) * KV : nullptr;
  const TileT tile(tid);
  // offset of element group m inside the head's [K, V] or [V, K] block; valid when inside K and V
  auto offset = [&](int m) -> int64_t {
    const int64_t kk = tile.k_of(m), vv = v0 + tile.v_of(m);
    return V_FIRST ? vv * K + kk : kk * V + vv;
  };
  auto valid = [&](int m) -> bool { return tile.k_of(m) < K && v0 + tile.v_of(m) < V; };

  if (slot < 0) {  // skipped: zero outputs and final state; no slot is read or written
    for (int64_t row = bos; row < eos; ++row) {
      for (int j = tid; j < kBlockV; j += kThreads) {
        if (v0 + j < V) store_elem(p.out, p.v_dtype, (row * p.HV + hv) * V + v0 + j, 0.f);
      }
    }
    if (fin) {
      const float zero[kVec] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < kGroups; ++m) {
        if (valid(m)) store_vec(fin + offset(m), zero);
      }
    }
    return;
  }

  float s[kGroups][kVec];
  const float* src = p.state ? p.state + slot * p.slot_stride + hv * KV : nullptr;
#pragma unroll
  for (int m = 0; m < kGroups; ++m) {
    if (src && valid(m)) {
      load_vec(src + offset(m), s[m]);
    } else {
#pragma unroll
      for (int c = 0; c < kVec; ++c) s[m][c] = 0.f;
    }
  }

  const bool has_a = p.A_log != nullptr;
  const float a_log = has_a ? p.A_log[hv] : 0.f;
  for (int64_t row = bos; row < eos; ++row) {
    const int64_t head = row * p.HV + hv;  // (token, value head)
    __syncthreads();                        // the previous token's readers of sm are done
    // stage q, k and the gates
    float qx[kPerThreadK], kx[kPerThreadK];
    float2 ss = make_float2(0.f, 0.f);
#pragma unroll
    for (int j = 0; j < kPerThreadK; ++j) {
      const int i = tid + j * kThreads;
      const bool in = i < K;
      qx[j] = in ? load_elem(p.q, p.qk_dtype, (row * p.H + h) * K + i) : 0.f;
      kx[j] = in ? load_elem(p.k, p.qk_dtype, (row * p.H + h) * K + i) : 0.f;
      ss.x += qx[j] * qx[j];
      ss.y += kx[j] * kx[j];
    }
    float q_mul = p.scale, k_mul = 1.f;
    if (p.l2norm) {
      ss.x = lanes_sum<1, kWarpSize>(ss.x);
      ss.y = lanes_sum<1, kWarpSize>(ss.y);
      if (lane == 0) sm.norm[warp][0] = ss.x, sm.norm[warp][1] = ss.y;
      __syncthreads();
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sq += sm.norm[w][0], sk += sm.norm[w][1];
      q_mul *= 1.f / sqrtf(sq + kL2NormEps);
      k_mul = 1.f / sqrtf(sk + kL2NormEps);
    }
    const float b_head = p.b_per_k ? 0.f : beta_value(p.b[head], p.beta_act);
#pragma unroll
    for (int j = 0; j < kPerThreadK; ++j) {
      const int i = tid + j * kThreads;
      if (i >= BK) continue;
      const bool in = i < K;
      float dec = 1.f;
      if (p.g && in) {
        const int64_t gi = p.g_per_k ? head * K + i : head;
        float x = p.g[gi];
        if (p.gate_act != kGateNone) {
          if (p.dt_bias) x += p.dt_bias[p.g_per_k ? hv * K + i : hv];
          x = gate_value(x, has_a, a_log, p.gate_act, p.lower_bound);
        }
        dec = __expf(x);
      }
      const float kn = kx[j] * k_mul;
      const float beta = p.b_per_k ? (in ? beta_value(p.b[head * K + i], p.beta_act) : 0.f) : b_head;
      sm.q[i] = qx[j] * q_mul;
      sm.k[i] = kn;
      sm.e[i] = beta * kn;
      sm.d[i] = in ? dec : 0.f;
    }
    for (int j = tid; j < kBlockV; j += kThreads) {
      const int64_t vv = v0 + j;
      float z = 0.f;
      if (vv < V) {
        const float w = p.w == nullptr ? b_head : (p.w_per_v ? p.w[head * V + vv] : p.w[head]);
        z = w * load_elem(p.v, p.v_dtype, head * V + vv);
      }
      sm.z[j] = z;
    }
    __syncthreads();

    if constexpr (!V_FIRST) {
      // pass 1: decay and r = S^T e over this thread's rows, for its kVec columns
      float acc[kVec] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < kGroups; ++m) {
        const int kk = tile.k_of(m);
        const float dk = sm.d[kk], ek = sm.e[kk];
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          s[m][c] *= dk;
          acc[c] += ek * s[m][c];
        }
      }
      // sum over the kg threads: within the warp (lanes VT apart), then across warps
      column_partials<TileT::kVT>(acc, sm.red, warp, lane, tile.lane_v);
      __syncthreads();
      if (tid < kBlockV) {
        sm.u[tid] = sm.z[tid] - column_total(sm.red, tid);
      }
      __syncthreads();
      // pass 2: rank-1 write and o = S^T q
      float u[kVec];
#pragma unroll
      for (int c = 0; c < kVec; ++c) u[c] = sm.u[kVec * tile.lane_v + c], acc[c] = 0.f;
#pragma unroll
      for (int m = 0; m < kGroups; ++m) {
        const int kk = tile.k_of(m);
        const float kv = sm.k[kk], qv = sm.q[kk];
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          s[m][c] += kv * u[c];
          acc[c] += qv * s[m][c];
        }
      }
      column_partials<TileT::kVT>(acc, sm.red, warp, lane, tile.lane_v);
      __syncthreads();
      if (tid < kBlockV && v0 + tid < V) {
        const float o = column_total(sm.red, tid);
        store_elem(p.out, p.v_dtype, head * V + v0 + tid, o);
      }
    } else {
      constexpr int kRows = TileT::kRowsV, kChunks = TileT::kChunks;
      // pass 1: decay along K and r_v = <S[v, :], e>, summed over the KT lanes of the rows
      float acc[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        acc[j] = 0.f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int m = j * kChunks + c, kk = tile.k_of(m);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            s[m][i] *= sm.d[kk + i];
            acc[j] += sm.e[kk + i] * s[m][i];
          }
        }
        acc[j] = lanes_sum<1, TileT::kKT>(acc[j]);
      }
      // pass 2: S[v, :] += u_v k and o_v = <S[v, :], q>
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int vl = tile.v_of(j * kChunks);
        const float u = sm.z[vl] - acc[j];
        float o = 0.f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int m = j * kChunks + c, kk = tile.k_of(m);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            s[m][i] += u * sm.k[kk + i];
            o += sm.q[kk + i] * s[m][i];
          }
        }
        o = lanes_sum<1, TileT::kKT>(o);
        if (tile.lane_k == 0 && v0 + vl < V) store_elem(p.out, p.v_dtype, head * V + v0 + vl, o);
      }
    }

    // speculative decoding: the state after token t of the sequence to slot state_indices[n, t]
    const int64_t t = row - bos;
    if (p.per_token && t < p.S) {
      const int64_t dst = p.state_indices[n * p.S + t];
      if (dst >= 0 && dst < p.P) {
        float* out_slot = p.state + dst * p.slot_stride + hv * KV;
#pragma unroll
        for (int m = 0; m < kGroups; ++m) {
          if (valid(m)) store_vec(out_slot + offset(m), s[m]);
        }
      }
    }
  }

  if (p.inplace && !p.per_token && p.state) {
    float* out_slot = p.state + slot * p.slot_stride + hv * KV;
#pragma unroll
    for (int m = 0; m < kGroups; ++m) {
      if (valid(m)) store_vec(out_slot + offset(m), s[m]);
    }
  }
  if (fin) {
#pragma unroll
    for (int m = 0; m < kGroups; ++m) {
      if (valid(m)) store_vec(fin + offset(m), s[m]);
    }
  }
}

// Padded K of the instantiation that covers K (FlashAttention's HEADDIM_SWITCH buckets).
int k_bucket(int64_t K) {
  if (K <= 32) return 32;
  if (K <= 64) return 64;
  if (K <= 128) return 128;
  return kMaxK;
}

template <int BK>
cudaError_t launch_bk(const Params& p, int64_t blocks, cudaStream_t stream) {
  if (p.v_first) {
    decode_kernel<BK, true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  } else {
    decode_kernel<BK, false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

bool cuda_supports_k(int64_t K) { return K >= 1 && K <= kMaxK; }

cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (!cuda_supports_k(p.K) || p.K % kVec != 0 || p.V % kVec != 0) return cudaErrorInvalidValue;
  const int64_t tiles = (p.V + kBlockV - 1) / kBlockV;
  const int64_t blocks = p.N * p.HV * tiles;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  switch (k_bucket(p.K)) {
    case 32:
      return launch_bk<32>(p, blocks, stream);
    case 64:
      return launch_bk<64>(p, blocks, stream);
    case 128:
      return launch_bk<128>(p, blocks, stream);
    default:
      return launch_bk<kMaxK>(p, blocks, stream);
  }
}

}  // namespace decode
}  // namespace lamina
