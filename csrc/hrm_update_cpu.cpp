// HRM gated update, CPU kernels (registered for the CPU dispatch key of lamina_C::hrm_update_*).
//
// Rows are independent: at::parallel_for splits them over threads. Each row is read into a
// thread-local buffer before its output is written, so y may be the same tensor as h, c or gate.
// Low-precision inputs are computed in float32, float64 in float64 (at::opmath_type).
//
// The bias and norm-weight gradients use a two-stage reduction whose order does not depend on the
// number of threads: rows are cut into fixed chunks of kRowsPerChunk, each chunk writes one partial
// row, and the partial rows are summed in chunk order.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

namespace lamina {
namespace {

// Rows per partial sum: fixed (not per thread) so the reduction order is reproducible.
constexpr int64_t kRowsPerChunk = 64;
// Rows per parallel task in the forward (amortises task start-up on narrow rows).
constexpr int64_t kFwdGrainRows = 16;

template <typename acc_t>
inline acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + std::exp(-x));
}

void check_rows(const at::Tensor& h, const at::Tensor& c, const at::Tensor& gate, const c10::optional<at::Tensor>& bias,
                const c10::optional<at::Tensor>& weight) {
  TORCH_CHECK(h.dim() == 2, "hrm_update: h must be [N, D], got ", h.sizes());
  TORCH_CHECK(c.sizes() == h.sizes(), "hrm_update: c must have the shape of h ", h.sizes(), ", got ", c.sizes());
  const int64_t n = h.size(0), d = h.size(1);
  TORCH_CHECK(gate.dim() == 2 && gate.size(0) == n && (gate.size(1) == d || gate.size(1) == 1),
              "hrm_update: gate must be [", n, ", ", d, "] or [", n, ", 1], got ", gate.sizes());
  TORCH_CHECK(c.scalar_type() == h.scalar_type() && gate.scalar_type() == h.scalar_type(),
              "hrm_update: h, c and gate must share a dtype, got ", h.scalar_type(), ", ", c.scalar_type(), ", ",
              gate.scalar_type());
  TORCH_CHECK(h.is_contiguous() && c.is_contiguous() && gate.is_contiguous(),
              "hrm_update: h, c and gate must be contiguous");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == gate.size(1), "hrm_update: bias must be [", gate.size(1),
                "], got ", bias->sizes());
  }
  if (weight) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == d, "hrm_update: weight must be [", d, "], got ",
                weight->sizes());
  }
}

void check_cpu(std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    if (t && t->defined()) {
      TORCH_CHECK(t->device().is_cpu(), "hrm_update (CPU kernel): ", name, " must be a CPU tensor, got ", t->device());
    }
  }
}

// Parameters as contiguous opmath-typed vectors (tiny: [D] or [1]).
at::Tensor param(const c10::optional<at::Tensor>& t, at::ScalarType acc) {
  return t ? t->to(acc).contiguous() : at::Tensor();
}

template <typename scalar_t>
void fwd_rows(const at::Tensor& h, const at::Tensor& c, const at::Tensor& gate, const at::Tensor& bias,
              const at::Tensor& weight, double eps, at::Tensor& y, at::Tensor& rstd) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = h.size(0), d = h.size(1);
  const bool per_channel = gate.size(1) == d;
  const scalar_t* hp = h.data_ptr<scalar_t>();
  const scalar_t* cp = c.data_ptr<scalar_t>();
  const scalar_t* gp = gate.data_ptr<scalar_t>();
  const acc_t* bp = bias.defined() ? bias.data_ptr<acc_t>() : nullptr;
  const acc_t* wp = weight.defined() ? weight.data_ptr<acc_t>() : nullptr;
  acc_t* rp = wp ? rstd.data_ptr<acc_t>() : nullptr;
  scalar_t* yp = y.data_ptr<scalar_t>();
  at::parallel_for(0, n, kFwdGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> mix(d);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t base = row * d;
      const acc_t z_row = per_channel ? acc_t(0) : sigmoid<acc_t>(acc_t(gp[row]) + (bp ? bp[0] : acc_t(0)));
      acc_t sq = 0;
      for (int64_t j = 0; j < d; ++j) {
        const acc_t z = per_channel ? sigmoid<acc_t>(acc_t(gp[base + j]) + (bp ? bp[j] : acc_t(0))) : z_row;
        mix[j] = z * acc_t(hp[base + j]) + (acc_t(1) - z) * acc_t(cp[base + j]);
        sq += mix[j] * mix[j];
      }
      acc_t r = 1;
      if (wp) {
        r = acc_t(1) / std::sqrt(sq / acc_t(d) + acc_t(eps));
        rp[row] = r;
      }
      for (int64_t j = 0; j < d; ++j) {
        yp[base + j] = static_cast<scalar_t>(wp ? mix[j] * r * wp[j] : mix[j]);
      }
    }
  });
}

template <typename scalar_t>
void bwd_rows(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& c, const at::Tensor& gate,
              const at::Tensor& bias, const at::Tensor& weight, const at::Tensor& rstd, at::Tensor& dh, at::Tensor& dc,
              at::Tensor& dg, at::Tensor& dw_part, at::Tensor& db_part) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = h.size(0), d = h.size(1);
  const bool per_channel = gate.size(1) == d;
  const int64_t chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
  const scalar_t* dyp = dy.data_ptr<scalar_t>();
  const scalar_t* hp = h.data_ptr<scalar_t>();
  const scalar_t* cp = c.data_ptr<scalar_t>();
  const scalar_t* gp = gate.data_ptr<scalar_t>();
  const acc_t* bp = bias.defined() ? bias.data_ptr<acc_t>() : nullptr;
  const acc_t* wp = weight.defined() ? weight.data_ptr<acc_t>() : nullptr;
  const acc_t* rp = wp ? rstd.data_ptr<acc_t>() : nullptr;
  scalar_t* dhp = dh.data_ptr<scalar_t>();
  scalar_t* dcp = dc.data_ptr<scalar_t>();
  scalar_t* dgp = dg.data_ptr<scalar_t>();
  acc_t* dwp = wp ? dw_part.data_ptr<acc_t>() : nullptr;
  acc_t* dbp = bp ? db_part.data_ptr<acc_t>() : nullptr;
  const int64_t bd = per_channel ? d : 1;
  at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
    std::vector<acc_t> z(d), mix(d);
    for (int64_t chunk = cbegin; chunk < cend; ++chunk) {
      acc_t* dw_row = dwp ? dwp + chunk * d : nullptr;
      acc_t* db_row = dbp ? dbp + chunk * bd : nullptr;
      if (dw_row) std::fill(dw_row, dw_row + d, acc_t(0));
      if (db_row) std::fill(db_row, db_row + bd, acc_t(0));
      const int64_t row_end = std::min(n, (chunk + 1) * kRowsPerChunk);
      for (int64_t row = chunk * kRowsPerChunk; row < row_end; ++row) {
        const int64_t base = row * d;
        const acc_t z_row = per_channel ? acc_t(0) : sigmoid<acc_t>(acc_t(gp[row]) + (bp ? bp[0] : acc_t(0)));
        const acc_t r = wp ? rp[row] : acc_t(1);
        acc_t dot = 0;
        for (int64_t j = 0; j < d; ++j) {
          z[j] = per_channel ? sigmoid<acc_t>(acc_t(gp[base + j]) + (bp ? bp[j] : acc_t(0))) : z_row;
          mix[j] = z[j] * acc_t(hp[base + j]) + (acc_t(1) - z[j]) * acc_t(cp[base + j]);
          if (wp) dot += acc_t(dyp[base + j]) * wp[j] * mix[j] * r;
        }
        dot /= acc_t(d);
        acc_t dz_row = 0;
        for (int64_t j = 0; j < d; ++j) {
          const acc_t dyj = acc_t(dyp[base + j]);
          acc_t dmix = dyj;
          if (wp) {
            const acc_t yn = mix[j] * r;
            dw_row[j] += dyj * yn;
            dmix = (dyj * wp[j] - yn * dot) * r;
          }
          dhp[base + j] = static_cast<scalar_t>(dmix * z[j]);
          dcp[base + j] = static_cast<scalar_t>(dmix * (acc_t(1) - z[j]));
          const acc_t dz = dmix * (acc_t(hp[base + j]) - acc_t(cp[base + j])) * z[j] * (acc_t(1) - z[j]);
          if (per_channel) {
            dgp[base + j] = static_cast<scalar_t>(dz);
            if (db_row) db_row[j] += dz;
          } else {
            dz_row += dz;
          }
        }
        if (!per_channel) {
          dgp[row] = static_cast<scalar_t>(dz_row);
          if (db_row) db_row[0] += dz_row;
        }
      }
    }
  });
}

// Second stage: [chunks, cols] -> [cols], summed in chunk order, cast to the parameter's dtype.
template <typename acc_t>
at::Tensor sum_chunks(const at::Tensor& part, at::ScalarType out_dtype) {
  const int64_t chunks = part.size(0), cols = part.size(1);
  at::Tensor out = at::zeros({cols}, part.options());
  const acc_t* pp = part.data_ptr<acc_t>();
  acc_t* op = out.data_ptr<acc_t>();
  at::parallel_for(0, cols, 256, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      acc_t s = 0;
      for (int64_t k = 0; k < chunks; ++k) s += pp[k * cols + j];
      op[j] = s;
    }
  });
  return out.to(out_dtype);
}

at::Tensor hrm_update_fwd_cpu(const at::Tensor& h, const at::Tensor& c, const at::Tensor& gate,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& weight,
                              double eps, at::Tensor& y) {
  check_cpu({{"h", &h}, {"c", &c}, {"gate", &gate}, {"y", &y}, {"bias", bias ? &*bias : nullptr},
             {"weight", weight ? &*weight : nullptr}});
  check_rows(h, c, gate, bias, weight);
  TORCH_CHECK(y.sizes() == h.sizes() && y.scalar_type() == h.scalar_type() && y.is_contiguous(),
              "hrm_update: y must be a contiguous ", h.scalar_type(), " tensor of shape ", h.sizes());
  const auto acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor rstd = at::empty({weight ? h.size(0) : 0}, h.options().dtype(acc));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "hrm_update_fwd_cpu", [&] {
    fwd_rows<scalar_t>(h, c, gate, param(bias, acc), param(weight, acc), eps, y, rstd);
  });
  return rstd;
}

std::vector<at::Tensor> hrm_update_bwd_cpu(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& c,
                                           const at::Tensor& gate, const c10::optional<at::Tensor>& bias,
                                           const c10::optional<at::Tensor>& weight,
                                           const c10::optional<at::Tensor>& rstd) {
  check_cpu({{"dy", &dy}, {"h", &h}, {"c", &c}, {"gate", &gate}, {"bias", bias ? &*bias : nullptr},
             {"weight", weight ? &*weight : nullptr}, {"rstd", rstd ? &*rstd : nullptr}});
  check_rows(h, c, gate, bias, weight);
  TORCH_CHECK(dy.sizes() == h.sizes() && dy.scalar_type() == h.scalar_type() && dy.is_contiguous(),
              "hrm_update: dy must be a contiguous ", h.scalar_type(), " tensor of shape ", h.sizes());
  const auto acc = h.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (weight) {
    TORCH_CHECK(rstd && rstd->numel() == h.size(0) && rstd->scalar_type() == acc && rstd->is_contiguous(),
                "hrm_update: rstd [", h.size(0), "] of dtype ", acc, " from the forward is needed when normalising");
  }
  const int64_t n = h.size(0), d = h.size(1);
  const int64_t chunks = (n + kRowsPerChunk - 1) / kRowsPerChunk;
  at::Tensor dh = at::empty_like(h), dc = at::empty_like(c), dg = at::empty_like(gate);
  at::Tensor dw_part = weight ? at::zeros({chunks, d}, h.options().dtype(acc)) : at::Tensor();
  at::Tensor db_part = bias ? at::zeros({chunks, gate.size(1)}, h.options().dtype(acc)) : at::Tensor();
  // absent parameters get empty gradients: the op returns a fixed list of tensors
  at::Tensor dbias = at::empty({0}, h.options()), dweight = at::empty({0}, h.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "hrm_update_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    bwd_rows<scalar_t>(dy, h, c, gate, param(bias, acc), param(weight, acc), weight ? *rstd : at::Tensor(), dh, dc,
                       dg, dw_part, db_part);
    if (bias) dbias = sum_chunks<acc_t>(db_part, bias->scalar_type());
    if (weight) dweight = sum_chunks<acc_t>(dw_part, weight->scalar_type());
  });
  return {dh, dc, dg, dbias, dweight};
}

}  // namespace

TORCH_LIBRARY_IMPL(lamina_C, CPU, m) {
  m.impl("hrm_update_fwd", &hrm_update_fwd_cpu);
  m.impl("hrm_update_bwd", &hrm_update_bwd_cpu);
}

}  // namespace lamina
