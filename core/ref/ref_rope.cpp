// Reference rotary embedding: one pair of one head at a time, in double. The
// angle is the f32 product the interface defines (math::rope_angle); its
// cosine and sine are taken in double.
#include <cmath>

#include "core/nn_math.h"
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {

// out[b, t, head h] = each pair of x[b, t, head h] turned by sign * a[t, i];
// x in any strides, out contiguous.
void rotate(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs, double sign,
            const Tensor& out) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), NH = attrs.num_heads;
  const int64_t HD = W / NH, half = HD / 2;
  const Shape& xs = x.strides();
  for (int64_t t = 0; t < T; ++t) {
    const auto pos = int64_t(ref::get(positions, t * positions.strides()[0]));
    for (int64_t i = 0; i < half; ++i) {
      const double a = math::rope_angle(pos, attrs.inv_freq[size_t(i)]);
      const double c = std::cos(a), s = sign * std::sin(a);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < NH; ++h) {
          const int64_t c0 = h * HD + i, c1 = c0 + half;
          const double x0 = ref::get(x, b * xs[0] + t * xs[1] + c0 * xs[2]);
          const double x1 = ref::get(x, b * xs[0] + t * xs[1] + c1 * xs[2]);
          double y0, y1;
          math::rope_rotate(x0, x1, c, s, y0, y1);
          ref::set(out, (b * T + t) * W + c0, y0);
          ref::set(out, (b * T + t) * W + c1, y1);
        }
    }
  }
}

}  // namespace

void RefBackend::rope_forward(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
                              const Tensor& out) {
  rotate(x, positions, attrs, 1.0, out);
}

// The transpose of the forward's rotation: the turn by -a.
void RefBackend::rope_backward(const Tensor& grad_out, const Tensor& positions,
                               const RopeAttrs& attrs, const Tensor& grad_x) {
  rotate(grad_out, positions, attrs, -1.0, grad_x);
}

}  // namespace trainer
