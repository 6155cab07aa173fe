// lamina._C: operator schemas (namespace lamina_C) and the Python module.
//
// Importing lamina._C registers the ops; their CPU implementations live in *_cpu.cpp and their
// CUDA implementations in *_cuda.cpp (compiled only with LAMINA_BUILD_CUDA=1, which defines
// LAMINA_WITH_CUDA). The module attribute WITH_CUDA tells Python which build it is.
#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(lamina_C, m) {
  // HRM gated update (csrc/hrm_update.h): writes y, returns rstd [N] (empty without weight).
  m.def(
      "hrm_update_fwd(Tensor h, Tensor c, Tensor gate, Tensor? bias, Tensor? weight, float eps, Tensor(a!) y) "
      "-> Tensor");
  // Returns [dh, dc, dgate, dbias, dweight]; dbias/dweight are empty when bias/weight are None.
  m.def(
      "hrm_update_bwd(Tensor dy, Tensor h, Tensor c, Tensor gate, Tensor? bias, Tensor? weight, Tensor? rstd) "
      "-> Tensor[]");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lamina C++/CUDA kernels (ops under torch.ops.lamina_C)";
#ifdef LAMINA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
