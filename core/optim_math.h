// The per-element optimizer math, written once for host and device
// (docs/architecture.md "Devices"): the optimizer kernels of every backend
// (core/ref/ref_optim.cpp, core/cpu/cpu_optim.cpp, the CUDA fused multi-tensor
// kernels of core/cuda/optim.cu) and optim/loss_scaler.cpp call these
// functions, so the CPU tests check the formulas the GPU runs.
//
// Each update takes the scalars of one step (computed once on the host, in
// double, then converted to the compute type T) and one element of the
// parameter, its gradient and its state, and updates them in place:
//
//   SgdScalars<float> s = sgd_scalars<float>(lr, momentum, dampening, wd, nesterov, first_step);
//   for (i...) sgd_update(s, p[i], g[i], buf[i]);
//
// T is float or double. No std library beyond <math.h>: this header must
// compile under nvcc.
#pragma once

#include <math.h>
#include <stdint.h>

#include "core/elementwise_math.h"
#include "core/hd.h"

namespace trainer::optim {

// ---- SGD, exactly torch.optim.SGD ----
//   g   = grad + weight_decay * p                      (coupled L2 decay)
//   buf = g                                            on the first step
//   buf = momentum * buf + (1 - dampening) * g         afterwards
//   g   = g + momentum * buf  (nesterov)  or  buf      (when momentum != 0)
//   p   = p - lr * g
template <class T>
struct SgdScalars {
  T lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov;
  bool first_step;  // the momentum buffer starts as a copy of the gradient
};

template <class T>
SgdScalars<T> sgd_scalars(double lr, double momentum, double dampening, double weight_decay,
                          bool nesterov, bool first_step) {
  return {T(lr), T(momentum), T(1.0 - dampening), T(weight_decay), nesterov, first_step};
}

// momentum_buffer is neither read nor written when momentum == 0.
template <class T>
TRAINER_HD void sgd_update(const SgdScalars<T>& s, T& param, T grad, T& momentum_buffer) {
  T g = grad;
  if (s.weight_decay != T(0)) g += s.weight_decay * param;
  if (s.momentum != T(0)) {
    T buf = s.first_step ? g : s.momentum * momentum_buffer + s.one_minus_dampening * g;
    momentum_buffer = buf;
    g = s.nesterov ? g + s.momentum * buf : buf;
  }
  param -= s.lr * g;
}

// ---- AdamW, exactly torch.optim.AdamW (step counts from 1) ----
//   p     = p - lr * weight_decay * p                  (decoupled decay, first)
//   m     = m + (1 - beta1) * (g - m)                  (torch's lerp)
//   v     = beta2 * v + (1 - beta2) * g * g
//   vmax  = max(vmax, v)                               (amsgrad; v below is vmax)
//   denom = sqrt(v) / sqrt(1 - beta2^step) + eps       (eps after the bias correction)
//   p     = p - lr / (1 - beta1^step) * m / denom
template <class T>
struct AdamWScalars {
  T decay_factor;  // 1 - lr * weight_decay
  T one_minus_beta1, beta2, one_minus_beta2;
  T step_size;              // lr / (1 - beta1^step)
  T bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  T eps;
  bool amsgrad;
};

template <class T>
AdamWScalars<T> adamw_scalars(double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool amsgrad, int64_t step) {
  double bias_correction1 = 1.0 - ::pow(beta1, double(step));
  double bias_correction2 = 1.0 - ::pow(beta2, double(step));
  return {T(1.0 - lr * weight_decay),
          T(1.0 - beta1),
          T(beta2),
          T(1.0 - beta2),
          T(lr / bias_correction1),
          T(::sqrt(bias_correction2)),
          T(eps),
          amsgrad};
}

// max_exp_avg_sq is neither read nor written without amsgrad.
template <class T>
TRAINER_HD void adamw_update(const AdamWScalars<T>& s, T& param, T grad, T& exp_avg, T& exp_avg_sq,
                             T& max_exp_avg_sq) {
  param *= s.decay_factor;
  T m = exp_avg + s.one_minus_beta1 * (grad - exp_avg);
  T v = s.beta2 * exp_avg_sq + s.one_minus_beta2 * grad * grad;
  exp_avg = m;
  exp_avg_sq = v;
  if (s.amsgrad) {
    max_exp_avg_sq = math::Maximum{}(v, max_exp_avg_sq);  // NaN-propagating, as torch.maximum
    v = max_exp_avg_sq;
  }
  T denom = math::m_sqrt(v) / s.bias_correction2_sqrt + s.eps;
  param -= s.step_size * m / denom;
}

// ---- loss scaling ----
// True when x is neither infinite nor NaN.
template <class T>
TRAINER_HD bool is_finite(T x) {
  return isfinite(x);
}

// g = g * inv_scale; returns whether the scaled gradient was finite
// (torch's _amp_foreach_non_finite_check_and_unscale_).
template <class T>
TRAINER_HD bool unscale_grad(T& grad, T inv_scale) {
  bool finite = is_finite(grad);
  grad *= inv_scale;
  return finite;
}

}  // namespace trainer::optim
