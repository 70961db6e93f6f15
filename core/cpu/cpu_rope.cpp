// CPU rotary embedding: the cosine and sine of every (row t, pair i) once
// per call, in a [T, HD / 2] table, then OpenMP over the B T rows, each
// head's pairs a vectorised loop over its two halves. Computed in f32 (f64
// for f64); bf16 and f16 are converted element by element on the way in and
// out. x in any strides with a unit last stride.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"
#include "core/nn_math.h"

namespace trainer {

namespace {

// cos and sign * sin of a[t, i] for t < T, i < half, row-major [T, half].
template <class A>
struct AngleTable {
  std::vector<A> cos, sin;
  AngleTable(const Tensor& positions, const RopeAttrs& attrs, int64_t half, A sign)
      : cos(size_t(positions.size(0) * half)), sin(cos.size()) {
    const int64_t T = positions.size(0), stride = positions.strides()[0];
    const int64_t* pos = positions.data<int64_t>();
    const float* inv_freq = attrs.inv_freq.data();
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(half, 1));
    cpu::parallel_for(T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t i = 0; i < half; ++i) {
          const A a = A(math::rope_angle(pos[t * stride], inv_freq[i]));
          cos[size_t(t * half + i)] = std::cos(a);
          sin[size_t(t * half + i)] = sign * std::sin(a);
        }
    });
  }
};

// out row (b, t) = x row (b, t) with every head's pairs turned by the table's angles.
template <class T, class A>
void rotate_rows(const Tensor& x, const AngleTable<A>& table, int64_t NH, const Tensor& out) {
  const int64_t B = x.size(0), Tn = x.size(1), W = x.size(2), HD = W / NH, half = HD / 2;
  const int64_t sb = x.strides()[0], st = x.strides()[1];
  const T* px = x.data<T>();
  T* po = out.data<T>();
  const int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(W, 1));
  cpu::parallel_for(B * Tn, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / Tn, t = r % Tn;
      const A* c = table.cos.data() + t * half;
      const A* s = table.sin.data() + t * half;
      for (int64_t h = 0; h < NH; ++h) {
        const T* x0 = px + b * sb + t * st + h * HD;
        const T* x1 = x0 + half;
        T* y0 = po + r * W + h * HD;
        T* y1 = y0 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          A a0, a1;
          math::rope_rotate(A(load(x0[i])), A(load(x1[i])), c[i], s[i], a0, a1);
          y0[i] = store_as<T>(a0);
          y1[i] = store_as<T>(a1);
        }
      }
    }
  });
}

// The forward (sign 1) or its transpose (sign -1).
void rotate(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs, double sign,
            const Tensor& out) {
  const int64_t half = x.size(2) / attrs.num_heads / 2;
  if (x.numel() == 0) return;
  dispatch_floating(x.dtype(), "rope", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const AngleTable<A> table(positions, attrs, half, A(sign));
    rotate_rows<T>(x, table, attrs.num_heads, out);
  });
}

bool fast_layout(const Tensor& x, const Tensor& positions, const Tensor& out) {
  return x.strides()[2] == 1 && out.is_contiguous() && out.dtype() == x.dtype() &&
         positions.dtype() == DType::i64;
}

}  // namespace

void CpuBackend::rope_forward(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
                              const Tensor& out) {
  if (!fast_layout(x, positions, out)) return RefBackend::rope_forward(x, positions, attrs, out);
  rotate(x, positions, attrs, 1.0, out);
}

void CpuBackend::rope_backward(const Tensor& grad_out, const Tensor& positions,
                               const RopeAttrs& attrs, const Tensor& grad_x) {
  if (!fast_layout(grad_out, positions, grad_x))
    return RefBackend::rope_backward(grad_out, positions, attrs, grad_x);
  rotate(grad_out, positions, attrs, -1.0, grad_x);
}

}  // namespace trainer
