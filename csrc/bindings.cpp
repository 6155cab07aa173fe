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
  // Delta-rule decode step (csrc/delta_decode.h, lamina.ops.delta_decode): writes out, and the state
  // pool (inplace) and final_state when given.
  m.def(
      "delta_decode_step(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor b, Tensor? w, Tensor? A_log, "
      "Tensor? dt_bias, Tensor(a!)? state, Tensor? state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, "
      "Tensor(b!) out, Tensor(c!)? final_state, float scale, float lower_bound, int gate_act, int beta_act, "
      "bool l2norm, bool state_v_first, bool inplace) -> ()");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lamina C++/CUDA kernels (ops under torch.ops.lamina_C)";
#ifdef LAMINA_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
}
