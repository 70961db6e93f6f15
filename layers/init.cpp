#include "layers/init.h"

#include <cmath>

#include "core/ops.h"

namespace trainer {

namespace {

int64_t receptive_field(const Tensor& w) {
  CHECK_GE(w.dim(), 2) << "fan of a tensor with fewer than 2 dims: " << w.shape_str();
  int64_t r = 1;
  for (int d = 2; d < w.dim(); ++d) r *= w.size(d);
  return r;
}

}  // namespace

int64_t fan_in(const Tensor& w) { return w.size(1) * receptive_field(w); }
int64_t fan_out(const Tensor& w) { return w.size(0) * receptive_field(w); }

void uniform_(const Tensor& t, double lo, double hi, Generator& gen) {
  if (is_deferred(t)) {
    // The draw at this offset, made when t is materialised; the generator
    // moves on as if it were made now.
    Generator at = gen;
    gen.next(philox_uniform_blocks(uint64_t(t.numel())));
    defer_fill(t, [at, lo, hi](const Tensor& x) {
      Generator g = at;  // each replay draws the same numbers
      uniform_(x, lo, hi, g);
    });
    return;
  }
  autograd::NoGradGuard no_grad;
  t.detach().copy_(uniform(t.shape(), lo, hi, gen, t.dtype(), t.device()));
}

void normal_(const Tensor& t, double mean, double std, Generator& gen) {
  if (is_deferred(t)) {
    Generator at = gen;
    gen.next(philox_normal_blocks(uint64_t(t.numel())));
    defer_fill(t, [at, mean, std](const Tensor& x) {
      Generator g = at;
      normal_(x, mean, std, g);
    });
    return;
  }
  autograd::NoGradGuard no_grad;
  t.detach().copy_(normal(t.shape(), mean, std, gen, t.dtype(), t.device()));
}

void kaiming_uniform_(const Tensor& t, double a, Generator& gen) {
  double gain = std::sqrt(2.0 / (1.0 + a * a));
  double bound = gain * std::sqrt(3.0 / double(fan_in(t)));
  uniform_(t, -bound, bound, gen);
}

void kaiming_normal_(const Tensor& t, FanMode mode, Generator& gen) {
  int64_t fan = mode == FanMode::fan_in ? fan_in(t) : fan_out(t);
  normal_(t, 0.0, std::sqrt(2.0) / std::sqrt(double(fan)), gen);
}

}  // namespace trainer
