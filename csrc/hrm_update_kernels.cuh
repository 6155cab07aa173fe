// HRM gated update, CUDA device code: helpers and kernels (plain CUDA, no torch headers).
//
// Layout: a row of d elements is handled by a group of GROUP threads (one warp for narrow rows,
// the whole block for wide ones). Every access is a 16-byte vector (a Pack of VEC elements) when
// d is a multiple of VEC and the pointers are 16-byte aligned; otherwise the scalar loop kernels
// run. Rows of up to ITEMS packs per thread are held in registers (each input read once); wider
// rows use the loop kernels, whose second pass re-reads the row just read (an L2 hit).
//
// Backward reductions (dbias, dweight) are two-stage and deterministic: each block of a persistent
// grid accumulates its rows into registers, combines its warps through shared memory in a fixed
// order, and writes one partial row; column_sum_kernel then adds the partial rows in order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "hrm_update.h"

namespace lamina {
namespace hrm {
namespace detail {

// 8 warps per block: enough independent 16-byte loads in flight per SM with 2+ resident blocks.
constexpr int kBlockThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kBlockThreads / kWarpSize;
// Bytes of one vector access (LDG.128 / STG.128).
constexpr int kVecBytes = 16;
// Elements per thread and tensor kept in registers: the forward holds h, c, gate and y; the
// backward holds h, c, z, dy and two accumulators, so it keeps half as many.
constexpr int kMaxElemsFwd = 32;
constexpr int kMaxElemsBwd = 16;
// Resident blocks per SM of the persistent backward grid. Two blocks of 256 threads cap the backward
// at 128 registers; the widest layout keeps its bias accumulator in shared memory to stay within it.
constexpr int kBwdBlocksPerSm = 2;
// Widest row (in floats) a warp-per-row backward block combines through shared memory.
constexpr int kMaxWarpRowCols = kMaxElemsBwd * kWarpSize;

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float(pk.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[N]) {
  Pack<T, N> pk;
#pragma unroll
  for (int k = 0; k < N; ++k) pk.v[k] = from_float<T>(in[k]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the GROUP threads that share a row (a warp, or the whole block).
template <int GROUP>
__device__ __forceinline__ float group_sum(float v, float* smem) {
  v = warp_sum(v);
  if constexpr (GROUP == kWarpSize) {
    return v;
  } else {
    static_assert(GROUP == kBlockThreads, "a row is owned by a warp or by the whole block");
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    __syncthreads();  // the previous call's readers are done with smem
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    return warp_sum(lane < kWarps ? smem[lane] : 0.f);
  }
}

// Gate of element k of a pack: per-channel logits (+ bias[col + k]) or the row's gate.
template <int VEC>
__device__ __forceinline__ void gate_pack(const FwdParams& p, bool per_channel, const float (&g)[VEC], int64_t col,
                                          float z_row, float (&z)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    z[k] = per_channel ? sigmoid(g[k] + (p.bias ? p.bias[col + k] : 0.f)) : z_row;
  }
}

template <typename T>
__device__ __forceinline__ float row_gate(const T* gate, const float* bias, int64_t row) {
  return sigmoid(to_float(gate[row]) + (bias ? bias[0] : 0.f));
}

// ------------------------------------------------------------------------------------------------
// Forward

template <typename T, int VEC, int GROUP, int ITEMS>
__global__ void __launch_bounds__(kBlockThreads) fwd_kernel(FwdParams p) {
  __shared__ float smem[kWarps];
  constexpr int kRows = kBlockThreads / GROUP;
  const int t = threadIdx.x % GROUP;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x / GROUP;
  if (row >= p.n) return;  // uniform over the row's group (no barrier is skipped)
  const int64_t base = row * p.d;
  const T* h = static_cast<const T*>(p.h) + base;
  const T* c = static_cast<const T*>(p.c) + base;
  const T* g = static_cast<const T*>(p.gate) + (p.per_channel ? base : 0);
  const float z_row = p.per_channel ? 0.f : row_gate(static_cast<const T*>(p.gate), p.bias, row);
  float y[ITEMS][VEC];
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t col = static_cast<int64_t>(i * GROUP + t) * VEC;
    if (col < p.d) {
      float hv[VEC], cv[VEC], gv[VEC] = {}, z[VEC];
      load_pack<T, VEC>(h + col, hv);
      load_pack<T, VEC>(c + col, cv);
      if (p.per_channel) load_pack<T, VEC>(g + col, gv);
      gate_pack<VEC>(p, p.per_channel, gv, col, z_row, z);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y[i][k] = z[k] * hv[k] + (1.f - z[k]) * cv[k];
        sq += y[i][k] * y[i][k];
      }
    }
  }
  float r = 1.f;
  if (p.weight) {
    r = rsqrtf(group_sum<GROUP>(sq, smem) / static_cast<float>(p.d) + p.eps);
    if (t == 0) p.rstd[row] = r;
  }
  T* out = static_cast<T*>(p.y) + base;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t col = static_cast<int64_t>(i * GROUP + t) * VEC;
    if (col < p.d) {
      if (p.weight) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) y[i][k] *= r * p.weight[col + k];
      }
      store_pack<T, VEC>(out + col, y[i]);
    }
  }
}

// Any width: one row per block; when normalising, a first pass computes rstd.
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads) fwd_loop_kernel(FwdParams p) {
  __shared__ float smem[kWarps];
  const int64_t row = blockIdx.x;
  const int64_t base = row * p.d;
  const T* h = static_cast<const T*>(p.h) + base;
  const T* c = static_cast<const T*>(p.c) + base;
  const T* g = static_cast<const T*>(p.gate) + (p.per_channel ? base : 0);
  T* out = static_cast<T*>(p.y) + base;
  const float z_row = p.per_channel ? 0.f : row_gate(static_cast<const T*>(p.gate), p.bias, row);
  constexpr int64_t kStride = static_cast<int64_t>(kBlockThreads) * VEC;
  float r = 1.f;
  for (int pass = p.weight ? 0 : 1; pass < 2; ++pass) {
    float sq = 0.f;
    for (int64_t col = static_cast<int64_t>(threadIdx.x) * VEC; col < p.d; col += kStride) {
      float hv[VEC], cv[VEC], gv[VEC] = {}, z[VEC], y[VEC];
      load_pack<T, VEC>(h + col, hv);
      load_pack<T, VEC>(c + col, cv);
      if (p.per_channel) load_pack<T, VEC>(g + col, gv);
      gate_pack<VEC>(p, p.per_channel, gv, col, z_row, z);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y[k] = z[k] * hv[k] + (1.f - z[k]) * cv[k];
        sq += y[k] * y[k];
        if (pass == 1 && p.weight) y[k] *= r * p.weight[col + k];
      }
      if (pass == 1) store_pack<T, VEC>(out + col, y);
    }
    if (pass == 0) {
      r = rsqrtf(group_sum<kBlockThreads>(sq, smem) / static_cast<float>(p.d) + p.eps);
      if (threadIdx.x == 0) p.rstd[row] = r;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Backward

// Gradients of one pack given the row statistics; returns dz summed over the pack for per-token gates.
template <int VEC>
struct PackGrad {
  float dh[VEC], dc[VEC], dg[VEC], dw[VEC];
};

template <int VEC>
__device__ __forceinline__ PackGrad<VEC> pack_grad(const float (&hv)[VEC], const float (&cv)[VEC],
                                                   const float (&z)[VEC], const float (&dy)[VEC],
                                                   const float* weight, int64_t col, float r, float dot) {
  PackGrad<VEC> o;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    float dmix = dy[k];
    o.dw[k] = 0.f;
    if (weight) {
      const float yn = (z[k] * hv[k] + (1.f - z[k]) * cv[k]) * r;
      o.dw[k] = dy[k] * yn;
      dmix = (dy[k] * weight[col + k] - yn * dot) * r;
    }
    o.dh[k] = dmix * z[k];
    o.dc[k] = dmix * (1.f - z[k]);
    o.dg[k] = dmix * (hv[k] - cv[k]) * z[k] * (1.f - z[k]);
  }
  return o;
}

template <int VEC>
__device__ __forceinline__ float pack_dot(const float (&hv)[VEC], const float (&cv)[VEC], const float (&z)[VEC],
                                          const float (&dy)[VEC], const float* weight, int64_t col, float r) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < VEC; ++k) s += dy[k] * weight[col + k] * (z[k] * hv[k] + (1.f - z[k]) * cv[k]) * r;
  return s;
}

template <typename T, int VEC>
__device__ __forceinline__ void load_row_pack(const BwdParams& p, int64_t base, int64_t col, float z_row,
                                              float (&hv)[VEC], float (&cv)[VEC], float (&z)[VEC],
                                              float (&dy)[VEC]) {
  load_pack<T, VEC>(static_cast<const T*>(p.h) + base + col, hv);
  load_pack<T, VEC>(static_cast<const T*>(p.c) + base + col, cv);
  load_pack<T, VEC>(static_cast<const T*>(p.dy) + base + col, dy);
  if (p.per_channel) {
    float gv[VEC];
    load_pack<T, VEC>(static_cast<const T*>(p.gate) + base + col, gv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) z[k] = sigmoid(gv[k] + (p.bias ? p.bias[col + k] : 0.f));
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) z[k] = z_row;
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_grads(const BwdParams& p, int64_t base, int64_t col, const PackGrad<VEC>& o) {
  store_pack<T, VEC>(static_cast<T*>(p.dh) + base + col, o.dh);
  store_pack<T, VEC>(static_cast<T*>(p.dc) + base + col, o.dc);
  if (p.per_channel) store_pack<T, VEC>(static_cast<T*>(p.dgate) + base + col, o.dg);
}

// Partial-sum layout in the workspace: [P, d] for dweight, then [P, d or 1] for dbias.
struct Partials {
  float* dw;
  float* db;
};

__device__ __forceinline__ Partials partials(const BwdParams& p, float* ws, int64_t parts) {
  return {ws, ws + (p.weight ? parts * p.d : 0)};
}

template <typename T, int VEC, int GROUP, int ITEMS>
__global__ void __launch_bounds__(kBlockThreads, kBwdBlocksPerSm) bwd_kernel(BwdParams p, float* ws) {
  __shared__ float smem[kWarps];
  constexpr int kRows = kBlockThreads / GROUP;
  static_assert(kRows == 1 || ITEMS * GROUP * VEC <= kMaxWarpRowCols, "row too wide for the warp combine");
  const int sub = threadIdx.x / GROUP, t = threadIdx.x % GROUP;
  const int64_t groups = (p.n + kRows - 1) / kRows;
  // With kMaxElemsBwd elements a thread (block-per-row layout) the registers hold h, c, z, dy and dw;
  // the bias accumulator lives in shared memory, one slot per (element, thread), which only this
  // thread touches (no barrier). In registers it spilled 12-24 bytes under the 128-register cap.
  constexpr bool kDbInSmem = GROUP == kBlockThreads && ITEMS * VEC >= kMaxElemsBwd;
  __shared__ float db_smem[kDbInSmem ? ITEMS * VEC * kBlockThreads : 1];
  const bool want_db = p.bias != nullptr && p.per_channel;
  float acc_dw[ITEMS][VEC] = {};
  float acc_db[kDbInSmem ? 1 : ITEMS][kDbInSmem ? 1 : VEC] = {};
  if constexpr (kDbInSmem) {
#pragma unroll
    for (int e = 0; e < ITEMS * VEC; ++e) db_smem[e * kBlockThreads + threadIdx.x] = 0.f;
  }
  float acc_db_row = 0.f;
  for (int64_t rg = blockIdx.x; rg < groups; rg += gridDim.x) {
    const int64_t row = rg * kRows + sub;
    if (row >= p.n) continue;  // only warp groups reach this: no block barrier below for them
    const int64_t base = row * p.d;
    const float z_row = p.per_channel ? 0.f : row_gate(static_cast<const T*>(p.gate), p.bias, row);
    const float r = p.weight ? p.rstd[row] : 1.f;
    float hv[ITEMS][VEC] = {}, cv[ITEMS][VEC] = {}, z[ITEMS][VEC] = {}, dy[ITEMS][VEC] = {};
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t col = static_cast<int64_t>(i * GROUP + t) * VEC;
      if (col < p.d) {
        load_row_pack<T, VEC>(p, base, col, z_row, hv[i], cv[i], z[i], dy[i]);
        if (p.weight) dot += pack_dot<VEC>(hv[i], cv[i], z[i], dy[i], p.weight, col, r);
      }
    }
    if (p.weight) dot = group_sum<GROUP>(dot, smem) / static_cast<float>(p.d);
    float dz_row = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t col = static_cast<int64_t>(i * GROUP + t) * VEC;
      if (col < p.d) {
        const PackGrad<VEC> o = pack_grad<VEC>(hv[i], cv[i], z[i], dy[i], p.weight, col, r, dot);
        store_grads<T, VEC>(p, base, col, o);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          acc_dw[i][k] += o.dw[k];
          if constexpr (kDbInSmem) {
            if (want_db) db_smem[(i * VEC + k) * kBlockThreads + threadIdx.x] += o.dg[k];
          } else {
            acc_db[i][k] += o.dg[k];
          }
          dz_row += o.dg[k];
        }
      }
    }
    if (!p.per_channel) {
      dz_row = group_sum<GROUP>(dz_row, smem);
      if (t == 0) {
        static_cast<T*>(p.dgate)[row] = from_float<T>(dz_row);
        acc_db_row += dz_row;
      }
    }
  }
  // Combine the kRows row groups of this block in a fixed order, then write one partial row.
  const Partials part = partials(p, ws, gridDim.x);
  __shared__ float cols_smem[kRows > 1 ? kRows * kMaxWarpRowCols : 1];
  for (int which = 0; which < 2; ++which) {
    const bool wanted = which == 0 ? p.weight != nullptr : want_db;
    if (!wanted) continue;
    float* dst = (which == 0 ? part.dw : part.db) + static_cast<int64_t>(blockIdx.x) * p.d;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t col = static_cast<int64_t>(i * GROUP + t) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        float v;
        if constexpr (kDbInSmem) {
          v = which == 0 ? acc_dw[i][k] : db_smem[(i * VEC + k) * kBlockThreads + threadIdx.x];
        } else {
          v = which == 0 ? acc_dw[i][k] : acc_db[i][k];
        }
        if constexpr (kRows == 1) {
          if (col < p.d) dst[col + k] = v;
        } else {
          cols_smem[sub * kMaxWarpRowCols + col + k] = v;
        }
      }
    }
    if constexpr (kRows > 1) {
      __syncthreads();
      for (int64_t col = threadIdx.x; col < p.d; col += kBlockThreads) {
        float s = 0.f;
        for (int r = 0; r < kRows; ++r) s += cols_smem[r * kMaxWarpRowCols + col];
        dst[col] = s;
      }
      __syncthreads();
    }
  }
  if (p.bias && !p.per_channel) {
    float* rows_smem = cols_smem;
    if constexpr (kRows > 1) {
      __syncthreads();
      if (t == 0) rows_smem[sub] = acc_db_row;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.f;
        for (int r = 0; r < kRows; ++r) s += rows_smem[r];
        part.db[blockIdx.x] = s;
      }
    } else {
      if (threadIdx.x == 0) part.db[blockIdx.x] = acc_db_row;
    }
  }
}

// Any width: one row at a time per block. The block's partial row lives in the workspace (zeroed
// by the launcher); each thread updates only its own columns, so no two threads touch one value.
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlockThreads) bwd_loop_kernel(BwdParams p, float* ws) {
  __shared__ float smem[kWarps];
  const Partials part = partials(p, ws, gridDim.x);
  float* dw_row = part.dw + static_cast<int64_t>(blockIdx.x) * p.d;
  float* db_row = part.db + static_cast<int64_t>(blockIdx.x) * (p.per_channel ? p.d : 1);
  constexpr int64_t kStride = static_cast<int64_t>(kBlockThreads) * VEC;
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const int64_t base = row * p.d;
    const float z_row = p.per_channel ? 0.f : row_gate(static_cast<const T*>(p.gate), p.bias, row);
    const float r = p.weight ? p.rstd[row] : 1.f;
    float dot = 0.f;
    if (p.weight) {
      for (int64_t col = static_cast<int64_t>(threadIdx.x) * VEC; col < p.d; col += kStride) {
        float hv[VEC], cv[VEC], z[VEC], dy[VEC];
        load_row_pack<T, VEC>(p, base, col, z_row, hv, cv, z, dy);
        dot += pack_dot<VEC>(hv, cv, z, dy, p.weight, col, r);
      }
      dot = group_sum<kBlockThreads>(dot, smem) / static_cast<float>(p.d);
    }
    float dz_row = 0.f;
    for (int64_t col = static_cast<int64_t>(threadIdx.x) * VEC; col < p.d; col += kStride) {
      float hv[VEC], cv[VEC], z[VEC], dy[VEC];
      load_row_pack<T, VEC>(p, base, col, z_row, hv, cv, z, dy);
      const PackGrad<VEC> o = pack_grad<VEC>(hv, cv, z, dy, p.weight, col, r, dot);
      store_grads<T, VEC>(p, base, col, o);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (p.weight) dw_row[col + k] += o.dw[k];
        if (p.bias && p.per_channel) db_row[col + k] += o.dg[k];
        dz_row += o.dg[k];
      }
    }
    if (!p.per_channel) {
      dz_row = group_sum<kBlockThreads>(dz_row, smem);
      if (threadIdx.x == 0) {
        static_cast<T*>(p.dgate)[row] = from_float<T>(dz_row);
        if (p.bias) db_row[0] += dz_row;
      }
    }
  }
}

// Second stage: out[col] = sum over the P partial rows, in order.
__global__ void __launch_bounds__(kBlockThreads) column_sum_kernel(const float* part, int64_t parts, int64_t d,
                                                                   float* out) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x;
  if (col >= d) return;
  float s = 0.f;
  for (int64_t r = 0; r < parts; ++r) s += part[r * d + col];
  out[col] = s;
}

}  // namespace detail
}  // namespace hrm
}  // namespace lamina
