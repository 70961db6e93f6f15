#include "optim/clip.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/autograd.h"
#include "core/backend.h"
#include "core/cpu/loops.h"
#include "core/ops.h"

namespace trainer::optim {
namespace {

// Elements per partial result: the blocks are combined in order, so the norm
// is the same for every thread count.
constexpr int64_t kNormBlock = 1 << 16;
// Independent accumulators per block, so the compiler vectorises the fold
// without reassociating one long chain of additions.
constexpr int kLanes = 8;

double nan_max(double a, double b) { return (a > b || std::isnan(a)) ? a : b; }

// Folds combine(acc, term(|g_i|)) over the n elements of g, in double.
template <class T, class Term, class Combine>
double fold_abs(const T* g, int64_t n, Term term, Combine combine) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = combine(acc[l], term(std::fabs(double(g[i + l]))));
  for (; i < n; ++i) acc[0] = combine(acc[0], term(std::fabs(double(g[i]))));
  double total = acc[0];
  for (int l = 1; l < kLanes; ++l) total = combine(total, acc[l]);
  return total;
}

// sum |g|^p (or max |g| for p = inf) of one contiguous f32/f64 gradient, in double.
double grad_power_sum_cpu(const Tensor& grad, double p) {
  const bool is_max = std::isinf(p);
  const int64_t n = grad.numel();
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(size_t(blocks), 0.0);
  auto add = [](double a, double b) { return a + b; };
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* g = grad.data<T>();
    cpu::parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T* block = g + b * kNormBlock;
        int64_t len = std::min(n, (b + 1) * kNormBlock) - b * kNormBlock;
        double& out = partial[size_t(b)];
        if (is_max)
          out = fold_abs(
              block, len, [](double a) { return a; }, nan_max);
        else if (p == 2.0)
          out = fold_abs(
              block, len, [](double a) { return a * a; }, add);
        else if (p == 1.0)
          out = fold_abs(
              block, len, [](double a) { return a; }, add);
        else
          out = fold_abs(
              block, len, [p](double a) { return std::pow(a, p); }, add);
      }
    });
  };
  if (grad.dtype() == DType::f64)
    run(TypeTag<double>{});
  else
    run(TypeTag<float>{});
  double total = 0;
  for (double v : partial) total = is_max ? nan_max(v, total) : total + v;
  return total;
}

}  // namespace

double grad_norm(const TensorList& params, double norm_type) {
  if (!(norm_type > 0))
    throw Error(cat("clip_grad_norm: norm_type must be > 0 (or inf), got ", norm_type));
  bool is_max = std::isinf(norm_type);
  double total = 0;
  auto combine = [&](double v) { total = is_max ? nan_max(v, total) : total + v; };
  // Gradients on a GPU: one multi-tensor reduction per device (core/backend.h).
  std::vector<std::pair<Device, TensorList>> on_device;
  for (size_t k = 0; k < params.size(); ++k) {
    Tensor grad = params[k].grad();
    if (!grad.defined()) continue;
    if (grad.dtype() != DType::f32 && grad.dtype() != DType::f64)
      throw Error(cat("clip_grad_norm: the gradient of parameter ", k, " is ", grad.dtype(), " on ",
                      grad.device(), "; expected f32 or f64"));
    Tensor g = grad.is_contiguous() ? grad : grad.contiguous();
    if (g.device().is_cpu()) {
      combine(grad_power_sum_cpu(g, norm_type));
      continue;
    }
    auto it = std::find_if(on_device.begin(), on_device.end(),
                           [&](const auto& d) { return d.first == g.device(); });
    if (it == on_device.end()) it = on_device.insert(on_device.end(), {g.device(), {}});
    it->second.push_back(g);
  }
  for (const auto& [device, grads] : on_device)
    combine(backend(device).grads_power_sum(grads, norm_type));
  if (is_max) return total;
  return norm_type == 2.0 ? std::sqrt(total) : std::pow(total, 1.0 / norm_type);
}

double grad_power_sum(const Tensor& param, double norm_type) {
  Tensor grad = param.grad();
  if (!grad.defined()) return 0;
  if (!grad.device().is_cpu()) return backend(grad.device()).grads_power_sum({grad}, norm_type);
  return grad_power_sum_cpu(grad.is_contiguous() ? grad : grad.contiguous(), norm_type);
}

void clip_to_norm(const TensorList& params, double max_norm, double total) {
  double coef = max_norm / (total + 1e-6);
  if (coef >= 1.0) return;
  autograd::NoGradGuard no_grad;
  for (const Tensor& p : params) {
    Tensor grad = p.grad();
    if (grad.defined()) mul_(grad, coef);
  }
}

double clip_grad_norm(const TensorList& params, double max_norm, double norm_type,
                      bool error_if_nonfinite) {
  if (!(max_norm >= 0)) throw Error(cat("clip_grad_norm: max_norm must be >= 0, got ", max_norm));
  double total = grad_norm(params, norm_type);
  if (error_if_nonfinite && !std::isfinite(total))
    throw Error(cat("clip_grad_norm: the total ", norm_type,
                    "-norm of the gradients is non-finite (", total,
                    "), so they cannot be clipped; check the loss for inf/nan or pass "
                    "error_if_nonfinite = false"));
  double coef = max_norm / (total + 1e-6);
  if (coef >= 1.0) return total;
  autograd::NoGradGuard no_grad;
  for (const Tensor& p : params) {
    Tensor grad = p.grad();
    if (grad.defined()) mul_(grad, coef);
  }
  return total;
}

}  // namespace trainer::optim
