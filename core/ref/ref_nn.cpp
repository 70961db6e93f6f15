// Reference softmax and cross-entropy, in double, one row at a time.
#include <cmath>
#include <limits>

#include "core/nn_math.h"
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {

// Calls fn(index with idx[dim] = 0) for every row along dim.
template <class Fn>
void for_each_row(const Shape& shape, int dim, Fn&& fn) {
  Shape outer = shape;
  outer[dim] = 1;
  ref::for_each_index(outer, fn);
}

}  // namespace

// y = exp(x - max) / sum exp(x - max); log: y = x - max - log sum exp(x - max)
void RefBackend::softmax(const Tensor& x, int dim, bool log, const Tensor& out) {
  int64_t n = x.shape()[dim];
  for_each_row(x.shape(), dim, [&](std::vector<int64_t> i) {
    double mx = -std::numeric_limits<double>::infinity();
    for (i[dim] = 0; i[dim] < n; ++i[dim]) mx = std::max(mx, ref::get(x, i));
    double z = 0.0;
    for (i[dim] = 0; i[dim] < n; ++i[dim]) z += std::exp(ref::get(x, i) - mx);
    for (i[dim] = 0; i[dim] < n; ++i[dim]) {
      double v = ref::get(x, i) - mx;
      ref::set(out, i, log ? v - std::log(z) : std::exp(v) / z);
    }
  });
}

// softmax: gx = y (g - sum g y);  log_softmax: gx = g - exp(y) sum g
void RefBackend::softmax_backward(const Tensor& grad, const Tensor& y, int dim, bool log,
                                  const Tensor& grad_x) {
  int64_t n = y.shape()[dim];
  for_each_row(y.shape(), dim, [&](std::vector<int64_t> i) {
    double dot = 0.0;
    for (i[dim] = 0; i[dim] < n; ++i[dim])
      dot += log ? ref::get(grad, i) : ref::get(grad, i) * ref::get(y, i);
    for (i[dim] = 0; i[dim] < n; ++i[dim]) {
      double g = ref::get(grad, i), yv = ref::get(y, i);
      ref::set(grad_x, i, math::softmax_grad(log, g, yv, dot, std::exp(yv)));
    }
  });
}

void RefBackend::cross_entropy(const Tensor& logits, const Tensor& target, double eps,
                               int64_t ignore_index, const Tensor& loss, const Tensor& logp) {
  softmax(logits, 1, /*log=*/true, logp);
  int64_t N = logits.shape()[0], C = logits.shape()[1];
  for (int64_t n = 0; n < N; ++n) {
    int64_t t = int64_t(ref::get(target, n * target.strides()[0]));
    if (t == ignore_index) {
      ref::set(loss, n, 0.0);
      continue;
    }
    CHECK(t >= 0 && t < C) << "cross_entropy: target " << t << " at row " << n << " is outside [0, "
                           << C << ")";
    double l = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      double q = math::smoothed_target(c, t, eps, C);
      l -= q * ref::get(logp, {n, c});
    }
    ref::set(loss, n, l);
  }
}

void RefBackend::cross_entropy_backward(const Tensor& grad_loss, const Tensor& logp,
                                        const Tensor& target, double eps, int64_t ignore_index,
                                        const Tensor& grad_logits) {
  int64_t N = logp.shape()[0], C = logp.shape()[1];
  for (int64_t n = 0; n < N; ++n) {
    int64_t t = int64_t(ref::get(target, n * target.strides()[0]));
    double g = ref::get(grad_loss, n * grad_loss.strides()[0]);
    for (int64_t c = 0; c < C; ++c) {
      double v = 0.0;
      if (t != ignore_index) {
        double q = math::smoothed_target(c, t, eps, C);
        v = g * (std::exp(ref::get(logp, {n, c})) - q);
      }
      ref::set(grad_logits, {n, c}, v);
    }
  }
}

}  // namespace trainer
