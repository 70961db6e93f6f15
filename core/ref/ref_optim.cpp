// RefBackend's optimizer section (core/backend.h): the fused multi-tensor
// updates as plain single-threaded loops, element by element, computing in
// double with the math of core/optim_math.h and storing back in the
// parameter's dtype (f32 or f64). The oracle of the fast CPU loops
// (core/cpu/cpu_optim.cpp) and of the CUDA kernels.
#include "core/optim_math.h"
#include "core/ref/ref_backend.h"

namespace trainer {
namespace {

// Element i of a contiguous f32 or f64 tensor, read and written as double.
double load_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::f64 ? t.data<double>()[i] : double(t.data<float>()[i]);
}
void store_at(const Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::f64)
    t.data<double>()[i] = v;
  else
    t.data<float>()[i] = float(v);
}

void check_lists(const char* op, const TensorList& params, const TensorList& grads,
                 size_t scalars) {
  CHECK(grads.size() == params.size() && scalars == params.size())
      << op << ": per-tensor lists of the wrong length";
  for (size_t k = 0; k < params.size(); ++k)
    CHECK(params[k].is_contiguous() && grads[k].is_contiguous() &&
          grads[k].numel() == params[k].numel() && grads[k].dtype() == params[k].dtype())
        << op << ": tensor " << k << ": " << params[k].str() << ", grad " << grads[k].str();
}

}  // namespace

void RefBackend::sgd_step(const MultiTensorSgd& a) {
  check_lists("sgd_step", a.params, a.grads, a.lr.size());
  for (size_t k = 0; k < a.params.size(); ++k) {
    const optim::SgdScalars<double> s = optim::sgd_scalars<double>(
        a.lr[k], a.momentum, a.dampening, a.weight_decay[k], a.nesterov, a.step[k] == 1);
    const Tensor& p = a.params[k];
    const Tensor* buf = a.momentum_buffers.empty() ? nullptr : &a.momentum_buffers[k];
    for (int64_t i = 0; i < p.numel(); ++i) {
      double param = load_at(p, i), momentum = buf ? load_at(*buf, i) : 0.0;
      optim::sgd_update(s, param, load_at(a.grads[k], i), momentum);
      store_at(p, i, param);
      if (buf) store_at(*buf, i, momentum);
    }
  }
}

void RefBackend::adamw_step(const MultiTensorAdamW& a) {
  check_lists("adamw_step", a.params, a.grads, a.lr.size());
  for (size_t k = 0; k < a.params.size(); ++k) {
    const optim::AdamWScalars<double> s = optim::adamw_scalars<double>(
        a.lr[k], a.beta1, a.beta2, a.eps, a.weight_decay[k], a.amsgrad, a.step[k]);
    const Tensor& p = a.params[k];
    for (int64_t i = 0; i < p.numel(); ++i) {
      double param = load_at(p, i), m = load_at(a.exp_avg[k], i), v = load_at(a.exp_avg_sq[k], i);
      double vmax = a.amsgrad ? load_at(a.max_exp_avg_sq[k], i) : 0.0;
      optim::adamw_update(s, param, load_at(a.grads[k], i), m, v, vmax);
      store_at(p, i, param);
      store_at(a.exp_avg[k], i, m);
      store_at(a.exp_avg_sq[k], i, v);
      if (a.amsgrad) store_at(a.max_exp_avg_sq[k], i, vmax);
    }
  }
}

}  // namespace trainer
