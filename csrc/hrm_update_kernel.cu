// HRM gated update, CUDA launchers (plain CUDA: compiles with `nvcc -c -arch=sm_90` and no torch headers).
//
// Chooses a layout (vector width, threads per row, packs per thread) for a row width and launches
// the kernels of hrm_update_kernels.cuh; the backward then sums its partial rows (second stage).
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "hrm_update.h"
#include "hrm_update_kernels.cuh"

namespace lamina {
namespace hrm {
namespace {

using namespace detail;

// ------------------------------------------------------------------------------------------------
// Launch configuration

struct Layout {
  int vec;    // elements per access (1: scalar loop kernels)
  int group;  // threads per row
  int items;  // packs per thread held in registers; 0: loop kernels
};

bool aligned(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % kVecBytes == 0; }

int elem_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Smallest register layout that covers d, or the loop kernels.
Layout choose_layout(int64_t d, int vec, int max_elems) {
  if (vec == 1 || d % vec != 0) return {1, kBlockThreads, 0};
  const int64_t packs = d / vec;
  const int max_items = max_elems / vec;
  for (int group : {kWarpSize, kBlockThreads}) {
    for (int items : {1, 2, 4}) {
      if (items <= max_items && packs <= static_cast<int64_t>(group) * items) return {vec, group, items};
    }
  }
  return {vec, kBlockThreads, 0};
}

template <typename P>
int vector_width(const P& p, std::initializer_list<const void*> ptrs) {
  const int vec = kVecBytes / elem_bytes(p.dtype);
  for (const void* ptr : ptrs) {
    if (ptr && !aligned(ptr)) return 1;
  }
  return p.d % vec == 0 ? vec : 1;
}

Layout fwd_layout(const FwdParams& p) {
  const int vec = vector_width(p, {p.h, p.c, p.y, p.per_channel ? p.gate : nullptr});
  return choose_layout(p.d, vec, kMaxElemsFwd);
}

Layout bwd_layout(const BwdParams& p) {
  const int vec = vector_width(p, {p.h, p.c, p.dy, p.dh, p.dc, p.per_channel ? p.gate : nullptr,
                                   p.per_channel ? p.dgate : nullptr});
  return choose_layout(p.d, vec, kMaxElemsBwd);
}

int64_t bwd_blocks(const BwdParams& p, const Layout& l, int num_sms) {
  const int rows = l.items == 0 ? 1 : kBlockThreads / l.group;
  const int64_t groups = (p.n + rows - 1) / rows;
  const int64_t cap = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * kBwdBlocksPerSm;
  return groups < cap ? (groups > 0 ? groups : 1) : cap;
}

int64_t fwd_blocks(const FwdParams& p, const Layout& l) {
  const int rows = l.items == 0 ? 1 : kBlockThreads / l.group;
  return (p.n + rows - 1) / rows;
}

// Static switch over the instantiated layouts (FlashAttention's HEADDIM_SWITCH idea).
template <typename T, template <typename, int, int, int> class Launch, typename... Args>
cudaError_t dispatch_layout(const Layout& l, Args&&... args) {
  constexpr int V = kVecBytes / sizeof(T);
  if (l.items == 0) {
    return l.vec == 1 ? Launch<T, 1, kBlockThreads, 0>::run(args...) : Launch<T, V, kBlockThreads, 0>::run(args...);
  }
  if (l.group == kWarpSize) {
    if (l.items == 1) return Launch<T, V, kWarpSize, 1>::run(args...);
    if (l.items == 2) return Launch<T, V, kWarpSize, 2>::run(args...);
    return Launch<T, V, kWarpSize, 4>::run(args...);
  }
  if (l.items == 1) return Launch<T, V, kBlockThreads, 1>::run(args...);
  if (l.items == 2) return Launch<T, V, kBlockThreads, 2>::run(args...);
  return Launch<T, V, kBlockThreads, 4>::run(args...);
}

template <typename T, int VEC, int GROUP, int ITEMS>
struct FwdLaunch {
  static cudaError_t run(const FwdParams& p, int64_t blocks, cudaStream_t stream) {
    if constexpr (ITEMS == 0) {
      fwd_loop_kernel<T, VEC><<<blocks, kBlockThreads, 0, stream>>>(p);
    } else if constexpr (ITEMS * VEC <= kMaxElemsFwd) {
      fwd_kernel<T, VEC, GROUP, ITEMS><<<blocks, kBlockThreads, 0, stream>>>(p);
    } else {
      return cudaErrorInvalidConfiguration;
    }
    return cudaGetLastError();
  }
};

template <typename T, int VEC, int GROUP, int ITEMS>
struct BwdLaunch {
  static cudaError_t run(const BwdParams& p, int64_t blocks, float* ws, cudaStream_t stream) {
    if constexpr (ITEMS == 0) {
      bwd_loop_kernel<T, VEC><<<blocks, kBlockThreads, 0, stream>>>(p, ws);
    } else if constexpr (ITEMS * VEC <= kMaxElemsBwd && (GROUP == kBlockThreads || ITEMS * GROUP * VEC <= kMaxWarpRowCols)) {
      bwd_kernel<T, VEC, GROUP, ITEMS><<<blocks, kBlockThreads, 0, stream>>>(p, ws);
    } else {
      return cudaErrorInvalidConfiguration;
    }
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t fwd_launch(const FwdParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  const Layout l = fwd_layout(p);
  const int64_t blocks = fwd_blocks(p, l);
  switch (p.dtype) {
    case DType::kFloat32:
      return dispatch_layout<float, FwdLaunch>(l, p, blocks, stream);
    case DType::kFloat16:
      return dispatch_layout<__half, FwdLaunch>(l, p, blocks, stream);
    case DType::kBFloat16:
      return dispatch_layout<__nv_bfloat16, FwdLaunch>(l, p, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

size_t bwd_workspace_floats(const BwdParams& p, int num_sms) {
  const int64_t parts = bwd_blocks(p, bwd_layout(p), num_sms);
  const int64_t dw = p.weight ? parts * p.d : 0;
  const int64_t db = p.bias ? parts * (p.per_channel ? p.d : 1) : 0;
  return static_cast<size_t>(dw + db);
}

cudaError_t bwd_launch(const BwdParams& p, float* ws, int num_sms, cudaStream_t stream) {
  const Layout l = bwd_layout(p);
  const int64_t parts = bwd_blocks(p, l, num_sms);
  const size_t ws_floats = bwd_workspace_floats(p, num_sms);
  cudaError_t err = cudaSuccess;
  if (l.items == 0 && ws_floats > 0) {
    err = cudaMemsetAsync(ws, 0, ws_floats * sizeof(float), stream);
    if (err != cudaSuccess) return err;
  }
  if (p.n > 0) {
    switch (p.dtype) {
      case DType::kFloat32:
        err = dispatch_layout<float, BwdLaunch>(l, p, parts, ws, stream);
        break;
      case DType::kFloat16:
        err = dispatch_layout<__half, BwdLaunch>(l, p, parts, ws, stream);
        break;
      case DType::kBFloat16:
        err = dispatch_layout<__nv_bfloat16, BwdLaunch>(l, p, parts, ws, stream);
        break;
    }
  } else if (ws_floats > 0) {
    err = cudaMemsetAsync(ws, 0, ws_floats * sizeof(float), stream);
  }
  if (err != cudaSuccess) return err;
  const int64_t dw_floats = p.weight ? parts * p.d : 0;
  if (p.weight) {
    column_sum_kernel<<<(p.d + kBlockThreads - 1) / kBlockThreads, kBlockThreads, 0, stream>>>(ws, parts, p.d,
                                                                                              p.dweight);
  }
  if (p.bias) {
    const int64_t bd = p.per_channel ? p.d : 1;
    column_sum_kernel<<<(bd + kBlockThreads - 1) / kBlockThreads, kBlockThreads, 0, stream>>>(ws + dw_floats, parts,
                                                                                            bd, p.dbias);
  }
  return cudaGetLastError();
}

}  // namespace hrm
}  // namespace lamina
