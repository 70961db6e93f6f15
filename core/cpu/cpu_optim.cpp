// CpuBackend's optimizer section (core/backend.h): the fused multi-tensor
// updates, tensor by tensor, each split over the threads, computing in the
// parameter's dtype with the per-element math of core/optim_math.h (the
// functions the CUDA kernels run). Compiled with -fno-math-errno so the
// loops vectorise around sqrt.
#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"
#include "core/optim_math.h"

namespace trainer {
namespace {

// Elements per task of an update loop: below this a parameter updates on one thread.
constexpr int64_t kUpdateGrain = 1 << 15;

// Calls fn(TypeTag<T>{}) for the two dtypes an optimizer updates.
template <class Fn>
void dispatch_param_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::f64)
    fn(TypeTag<double>{});
  else
    fn(TypeTag<float>{});
}

}  // namespace

void CpuBackend::sgd_step(const MultiTensorSgd& a) {
  for (size_t k = 0; k < a.params.size(); ++k) {
    const Tensor& param = a.params[k];
    dispatch_param_dtype(param.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      optim::SgdScalars<T> s = optim::sgd_scalars<T>(a.lr[k], a.momentum, a.dampening,
                                                     a.weight_decay[k], a.nesterov, a.step[k] == 1);
      T* __restrict p = param.data<T>();
      const T* __restrict g = a.grads[k].data<T>();
      T* __restrict buf = a.momentum_buffers.empty() ? nullptr : a.momentum_buffers[k].data<T>();
      cpu::parallel_for(param.numel(), kUpdateGrain, [&](int64_t begin, int64_t end) {
        const optim::SgdScalars<T> sc = s;  // local: the element stores cannot alias it
        if (buf) {
          for (int64_t i = begin; i < end; ++i) optim::sgd_update(sc, p[i], g[i], buf[i]);
        } else {
          for (int64_t i = begin; i < end; ++i) {
            T unused = 0;
            optim::sgd_update(sc, p[i], g[i], unused);
          }
        }
      });
    });
  }
}

void CpuBackend::adamw_step(const MultiTensorAdamW& a) {
  for (size_t k = 0; k < a.params.size(); ++k) {
    const Tensor& param = a.params[k];
    dispatch_param_dtype(param.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      optim::AdamWScalars<T> s = optim::adamw_scalars<T>(a.lr[k], a.beta1, a.beta2, a.eps,
                                                         a.weight_decay[k], a.amsgrad, a.step[k]);
      T* __restrict p = param.data<T>();
      const T* __restrict g = a.grads[k].data<T>();
      T* __restrict m = a.exp_avg[k].data<T>();
      T* __restrict v = a.exp_avg_sq[k].data<T>();
      T* __restrict vmax = a.amsgrad ? a.max_exp_avg_sq[k].data<T>() : nullptr;
      cpu::parallel_for(param.numel(), kUpdateGrain, [&](int64_t begin, int64_t end) {
        const optim::AdamWScalars<T> sc = s;  // local: the element stores cannot alias it
        if (vmax) {
          for (int64_t i = begin; i < end; ++i)
            optim::adamw_update(sc, p[i], g[i], m[i], v[i], vmax[i]);
        } else {
          for (int64_t i = begin; i < end; ++i) {
            T unused = 0;
            optim::adamw_update(sc, p[i], g[i], m[i], v[i], unused);
          }
        }
      });
    });
  }
}

}  // namespace trainer
