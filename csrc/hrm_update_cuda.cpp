// HRM gated update: torch binding of the CUDA kernels (compiled only with LAMINA_WITH_CUDA).
#ifdef LAMINA_WITH_CUDA

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <initializer_list>
#include <utility>
#include <vector>

#include "hrm_update.h"

namespace lamina {
namespace {

hrm::DType kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return hrm::DType::kFloat32;
    case at::kHalf:
      return hrm::DType::kFloat16;
    case at::kBFloat16:
      return hrm::DType::kBFloat16;
    default:
      break;
  }
  TORCH_CHECK(false, "hrm_update (CUDA kernel): dtype must be float32, float16 or bfloat16, got ", t.scalar_type());
  return hrm::DType::kFloat32;  // not reached
}

void check_cuda(const at::Tensor& ref, std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    if (!t || !t->defined()) continue;
    TORCH_CHECK(t->is_cuda(), "hrm_update (CUDA kernel): ", name, " must be a CUDA tensor, got ", t->device());
    TORCH_CHECK(t->device() == ref.device(), "hrm_update (CUDA kernel): ", name, " is on ", t->device(),
                " but h is on ", ref.device());
  }
}

void check_rows(const at::Tensor& h, const at::Tensor& c, const at::Tensor& gate) {
  TORCH_CHECK(h.dim() == 2, "hrm_update: h must be [N, D], got ", h.sizes());
  TORCH_CHECK(c.sizes() == h.sizes(), "hrm_update: c must have the shape of h ", h.sizes(), ", got ", c.sizes());
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == h.size(0) && (gate.size(1) == h.size(1) || gate.size(1) == 1),
              "hrm_update: gate must be [N, D] or [N, 1], got ", gate.sizes());
  TORCH_CHECK(c.scalar_type() == h.scalar_type() && gate.scalar_type() == h.scalar_type(),
              "hrm_update: h, c and gate must share a dtype");
  TORCH_CHECK(h.is_contiguous() && c.is_contiguous() && gate.is_contiguous(),
              "hrm_update: h, c and gate must be contiguous");
}

at::Tensor as_float(const c10::optional<at::Tensor>& t, int64_t size, const char* name) {
  if (!t) return at::Tensor();
  TORCH_CHECK(t->dim() == 1 && t->size(0) == size, "hrm_update: ", name, " must be [", size, "], got ", t->sizes());
  return t->to(at::kFloat).contiguous();
}

const float* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

at::Tensor hrm_update_fwd_cuda(const at::Tensor& h, const at::Tensor& c, const at::Tensor& gate,
                               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& weight,
                               double eps, at::Tensor& y) {
  check_cuda(h, {{"h", &h}, {"c", &c}, {"gate", &gate}, {"y", &y}, {"bias", bias ? &*bias : nullptr},
                 {"weight", weight ? &*weight : nullptr}});
  check_rows(h, c, gate);
  TORCH_CHECK(y.sizes() == h.sizes() && y.scalar_type() == h.scalar_type() && y.is_contiguous(),
              "hrm_update: y must be a contiguous ", h.scalar_type(), " tensor of shape ", h.sizes());
  const c10::cuda::CUDAGuard guard(h.device());
  const at::Tensor bias_f = as_float(bias, gate.size(1), "bias");
  const at::Tensor weight_f = as_float(weight, h.size(1), "weight");
  at::Tensor rstd = at::empty({weight ? h.size(0) : 0}, h.options().dtype(at::kFloat));
  hrm::FwdParams p{};
  p.h = h.data_ptr();
  p.c = c.data_ptr();
  p.gate = gate.data_ptr();
  p.bias = ptr_or_null(bias_f);
  p.weight = ptr_or_null(weight_f);
  p.y = y.data_ptr();
  p.rstd = weight ? rstd.data_ptr<float>() : nullptr;
  p.n = h.size(0);
  p.d = h.size(1);
  p.per_channel = gate.size(1) == h.size(1);
  p.eps = static_cast<float>(eps);
  p.dtype = kernel_dtype(h);
  const cudaError_t err = hrm::fwd_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "hrm_update forward launch failed: ", cudaGetErrorString(err));
  return rstd;
}

std::vector<at::Tensor> hrm_update_bwd_cuda(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& c,
                                            const at::Tensor& gate, const c10::optional<at::Tensor>& bias,
                                            const c10::optional<at::Tensor>& weight,
                                            const c10::optional<at::Tensor>& rstd) {
  check_cuda(h, {{"dy", &dy}, {"h", &h}, {"c", &c}, {"gate", &gate}, {"bias", bias ? &*bias : nullptr},
                 {"weight", weight ? &*weight : nullptr}, {"rstd", rstd ? &*rstd : nullptr}});
  check_rows(h, c, gate);
  TORCH_CHECK(dy.sizes() == h.sizes() && dy.scalar_type() == h.scalar_type() && dy.is_contiguous(),
              "hrm_update: dy must be a contiguous ", h.scalar_type(), " tensor of shape ", h.sizes());
  if (weight) {
    TORCH_CHECK(rstd && rstd->numel() == h.size(0) && rstd->scalar_type() == at::kFloat && rstd->is_contiguous(),
                "hrm_update: rstd [", h.size(0), "] float32 from the forward is needed when normalising");
  }
  const c10::cuda::CUDAGuard guard(h.device());
  const at::Tensor bias_f = as_float(bias, gate.size(1), "bias");
  const at::Tensor weight_f = as_float(weight, h.size(1), "weight");
  at::Tensor dh = at::empty_like(h), dc = at::empty_like(c), dg = at::empty_like(gate);
  const auto f32 = h.options().dtype(at::kFloat);
  at::Tensor dbias_f = bias ? at::empty({gate.size(1)}, f32) : at::Tensor();
  at::Tensor dweight_f = weight ? at::empty({h.size(1)}, f32) : at::Tensor();
  hrm::BwdParams p{};
  p.dy = dy.data_ptr();
  p.h = h.data_ptr();
  p.c = c.data_ptr();
  p.gate = gate.data_ptr();
  p.bias = ptr_or_null(bias_f);
  p.weight = ptr_or_null(weight_f);
  p.rstd = weight ? rstd->data_ptr<float>() : nullptr;
  p.dh = dh.data_ptr();
  p.dc = dc.data_ptr();
  p.dgate = dg.data_ptr();
  p.dbias = bias ? dbias_f.data_ptr<float>() : nullptr;
  p.dweight = weight ? dweight_f.data_ptr<float>() : nullptr;
  p.n = h.size(0);
  p.d = h.size(1);
  p.per_channel = gate.size(1) == h.size(1);
  p.dtype = kernel_dtype(h);
  int sms = 0;
  const cudaError_t attr = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, h.get_device());
  TORCH_CHECK(attr == cudaSuccess, "hrm_update: cannot read the SM count: ", cudaGetErrorString(attr));
  at::Tensor ws = at::empty({static_cast<int64_t>(hrm::bwd_workspace_floats(p, sms))}, f32);
  const cudaError_t err = hrm::bwd_launch(p, ws.numel() ? ws.data_ptr<float>() : nullptr, sms,
                                          c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "hrm_update backward launch failed: ", cudaGetErrorString(err));
  // absent parameters get empty gradients: the op returns a fixed list of tensors
  at::Tensor dbias = bias ? dbias_f.to(bias->scalar_type()) : at::empty({0}, h.options());
  at::Tensor dweight = weight ? dweight_f.to(weight->scalar_type()) : at::empty({0}, h.options());
  return {dh, dc, dg, dbias, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(lamina_C, CUDA, m) {
  m.impl("hrm_update_fwd", &hrm_update_fwd_cuda);
  m.impl("hrm_update_bwd", &hrm_update_bwd_cuda);
}

}  // namespace lamina

#endif  // LAMINA_WITH_CUDA
