#include "core/cpu/conv_pointwise.h"

#include <oneapi/dnnl/dnnl.h>

#include <cstring>

#include "core/check.h"
#include "core/ops_conv.h"

namespace trainer::cpu {

namespace {

// C[m, n] = sum_k op(A)[m, k] op(B)[k, n], row-major (dnnl_sgemm).
void sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
           const float* B, int64_t ldb, float* C, int64_t ldc) {
  dnnl_status_t st = dnnl_sgemm(ta, tb, m, n, k, 1.0f, A, lda, B, ldb, 0.0f, C, ldc);
  CHECK(st == dnnl_success) << "dnnl_sgemm for a 1x1 convolution failed: " << st;
}

// Row (n, oy) of the strided pixels: the channels-last address of (n, oy * sy, 0).
const float* pixel_row(const float* image, const Tensor& t, int64_t n, int64_t oy, int64_t sy) {
  return image + (n * t.size(2) + oy * sy) * t.size(3) * t.size(1);
}

// dense[M, C] = image's pixels (n, oy * sy, ox * sx) for the [OH, OW] grid.
void gather_pixels(const Tensor& image, const Pair& stride, int64_t OH, int64_t OW, float* dense) {
  int64_t N = image.size(0), C = image.size(1), sx = stride[1];
  const float* src = image.data<float>();
#pragma omp parallel for
  for (int64_t row = 0; row < N * OH; ++row) {
    const float* in = pixel_row(src, image, row / OH, row % OH, stride[0]);
    float* out = dense + row * OW * C;
    for (int64_t ox = 0; ox < OW; ++ox)
      std::memcpy(out + ox * C, in + ox * sx * C, C * sizeof(float));
  }
}

// image = dense[M, C] at the pixels (n, oy * sy, ox * sx), zero elsewhere.
void scatter_pixels(const float* dense, const Pair& stride, int64_t OH, int64_t OW,
                    const Tensor& image) {
  int64_t N = image.size(0), C = image.size(1), H = image.size(2), W = image.size(3);
  int64_t sy = stride[0], sx = stride[1];
  float* dst = image.data<float>();
#pragma omp parallel for
  for (int64_t row = 0; row < N * H; ++row) {
    int64_t n = row / H, y = row % H;
    float* out = dst + row * W * C;
    if (y % sy != 0 || y / sy >= OH) {
      std::memset(out, 0, W * C * sizeof(float));
      continue;
    }
    const float* in = dense + (n * OH + y / sy) * OW * C;
    for (int64_t x = 0; x < W; ++x) {
      if (x % sx == 0 && x / sx < OW)
        std::memcpy(out + x * C, in + x / sx * C, C * sizeof(float));
      else
        std::memset(out + x * C, 0, C * sizeof(float));
    }
  }
}

}  // namespace

bool pointwise(const Shape& w, const Conv2dAttrs& a, const Tensor& image, const Tensor& out) {
  return w[2] == 1 && w[3] == 1 && a.groups == 1 && a.padding == Pair{0, 0} &&
         is_channels_last(image) && is_channels_last(out);
}

void pointwise_backward_data(const Tensor& grad_out, const Tensor& weight, const Conv2dAttrs& a,
                             const Tensor& grad_x) {
  int64_t OH = grad_out.size(2), OW = grad_out.size(3), O = weight.size(0), I = weight.size(1);
  int64_t M = grad_out.size(0) * OH * OW;
  Tensor dense = empty({M, I});
  sgemm('N', 'N', M, I, O, grad_out.data<float>(), O, weight.data<float>(), I, dense.data<float>(),
        I);
  scatter_pixels(dense.data<float>(), a.stride, OH, OW, grad_x);
}

void pointwise_backward_weights(const Tensor& grad_out, const Tensor& x, const Conv2dAttrs& a,
                                const Tensor& grad_weight) {
  int64_t OH = grad_out.size(2), OW = grad_out.size(3), O = grad_out.size(1), I = x.size(1);
  int64_t M = x.size(0) * OH * OW;
  Tensor dense;
  const float* xs = x.data<float>();
  if (a.stride != Pair{1, 1}) {
    dense = empty({M, I});
    gather_pixels(x, a.stride, OH, OW, dense.data<float>());
    xs = dense.data<float>();
  }
  sgemm('T', 'N', O, I, M, grad_out.data<float>(), O, xs, I, grad_weight.data<float>(), I);
}

}  // namespace trainer::cpu
