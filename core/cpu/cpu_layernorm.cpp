// CPU layer norm and RMS norm over the last dim of a contiguous [R, D] f32
// input: vectorised loops along a row, OpenMP over rows. Layer norm's
// statistics are two-pass f32 (mean, then centred squares), RMS norm's one
// pass (the mean square); both are saved for the backward, which recomputes
// xhat from them. Layer norm's weight and bias gradients are summed per
// thread, then added up; RMS norm's per fixed block of rows, then added in
// block order (the same bits on any thread count). RMS norm takes bf16 and
// f16 on f32 copies (core/cpu/lowp.h); other dtypes run the reference kernels.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"
#include "core/cpu/lowp.h"

namespace trainer {

namespace {

bool all_f32(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->dtype() != DType::f32) return false;
  return true;
}

// Rows per block of the RMS norm weight gradient's partial sums.
constexpr int64_t kRowsPerBlock = 64;

}  // namespace

// out = (x - mean) rstd w + b, rstd = 1 / sqrt(var + eps) (biased var)
void CpuBackend::layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                    double eps, const Tensor& out, const Tensor& mean,
                                    const Tensor& rstd) {
  if (!all_f32({&x, &weight, &bias, &out, &mean, &rstd}))
    return RefBackend::layer_norm_forward(x, weight, bias, eps, out, mean, rstd);
  int64_t R = x.shape()[0], D = x.shape()[1];
  const float* px = x.data<float>();
  const float* pw = weight.data<float>();
  const float* pb = bias.data<float>();
  float* po = out.data<float>();
  float* pm = mean.data<float>();
  float* pr = rstd.data<float>();
  float inv_d = 1.0f / float(D);
  int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / D);
  cpu::parallel_for(R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = px + r * D;
      float* yr = po + r * D;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += xr[d];
      float m = s * inv_d;
      float v = 0.0f;
#pragma omp simd reduction(+ : v)
      for (int64_t d = 0; d < D; ++d) v += (xr[d] - m) * (xr[d] - m);
      float rs = 1.0f / std::sqrt(v * inv_d + float(eps));
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) yr[d] = (xr[d] - m) * rs * pw[d] + pb[d];
      pm[r] = m;
      pr[r] = rs;
    }
  });
}

// gx = rstd (gw - mean(gw) - xhat mean(gw xhat)) with gw = g w;
// gweight = sum_r g xhat; gbias = sum_r g
void CpuBackend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                     const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                     const Tensor& grad_weight, const Tensor& grad_bias) {
  if (!all_f32({&grad_out, &x, &weight, &mean, &rstd, &grad_x, &grad_weight, &grad_bias}))
    return RefBackend::layer_norm_backward(grad_out, x, weight, mean, rstd, grad_x, grad_weight,
                                           grad_bias);
  int64_t R = x.shape()[0], D = x.shape()[1];
  const float* pg = grad_out.data<float>();
  const float* px = x.data<float>();
  const float* pw = weight.data<float>();
  const float* pm = mean.data<float>();
  const float* pr = rstd.data<float>();
  float* pgx = grad_x.data<float>();
  float* pgw = grad_weight.data<float>();
  float* pgb = grad_bias.data<float>();
  std::fill(pgw, pgw + D, 0.0f);
  std::fill(pgb, pgb + D, 0.0f);
  float inv_d = 1.0f / float(D);
  int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / D);
  cpu::parallel_for(R, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> gw_sum(size_t(D), 0.0f), gb_sum(size_t(D), 0.0f);
    float* sw = gw_sum.data();
    float* sb = gb_sum.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = pg + r * D;
      const float* xr = px + r * D;
      float* gxr = pgx + r * D;
      float m = pm[r], rs = pr[r];
      float a = 0.0f, b = 0.0f;
#pragma omp simd reduction(+ : a, b)
      for (int64_t d = 0; d < D; ++d) {
        float xhat = (xr[d] - m) * rs;
        float gw = gr[d] * pw[d];
        a += gw;
        b += gw * xhat;
        sw[d] += gr[d] * xhat;
        sb[d] += gr[d];
      }
      a *= inv_d;
      b *= inv_d;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) {
        float xhat = (xr[d] - m) * rs;
        gxr[d] = rs * (gr[d] * pw[d] - a - xhat * b);
      }
    }
#pragma omp critical(trainer_layer_norm_backward)
    for (int64_t d = 0; d < D; ++d) {
      pgw[d] += sw[d];
      pgb[d] += sb[d];
    }
  });
}

// out = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps)
void CpuBackend::rms_norm_forward(const Tensor& x, const Tensor& weight, double eps,
                                  const Tensor& out, const Tensor& rstd) {
  if (cpu::any_half({&x, &weight, &out}))
    return cpu::run_in_f32({x, weight}, {out}, [&](const TensorList& i, const TensorList& o) {
      rms_norm_forward(i[0], i[1], eps, o[0], rstd);
    });
  if (!all_f32({&x, &weight, &out, &rstd}))
    return RefBackend::rms_norm_forward(x, weight, eps, out, rstd);
  const int64_t R = x.shape()[0], D = x.shape()[1];
  const float* px = x.data<float>();
  const float* pw = weight.data<float>();
  float* po = out.data<float>();
  float* pr = rstd.data<float>();
  const float inv_d = 1.0f / float(D);
  const int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / D);
  cpu::parallel_for(R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = px + r * D;
      float* yr = po + r * D;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
      const float rs = 1.0f / std::sqrt(ss * inv_d + float(eps));
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) yr[d] = xr[d] * rs * pw[d];
      pr[r] = rs;
    }
  });
}

// gx = rstd (gw - xhat mean(gw xhat)) with gw = g w, xhat = x rstd;
// gweight = sum_r g xhat, per block of kRowsPerBlock rows, then over the blocks in order.
void CpuBackend::rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                   const Tensor& rstd, const Tensor& grad_x,
                                   const Tensor& grad_weight) {
  if (cpu::any_half({&grad_out, &x, &weight, &grad_x, &grad_weight}))
    return cpu::run_in_f32({grad_out, x, weight}, {grad_x, grad_weight},
                           [&](const TensorList& i, const TensorList& o) {
                             rms_norm_backward(i[0], i[1], i[2], rstd, o[0], o[1]);
                           });
  if (!all_f32({&grad_out, &x, &weight, &rstd, &grad_x, &grad_weight}))
    return RefBackend::rms_norm_backward(grad_out, x, weight, rstd, grad_x, grad_weight);
  const int64_t R = x.shape()[0], D = x.shape()[1];
  const int64_t blocks = (R + kRowsPerBlock - 1) / kRowsPerBlock;
  const float* pg = grad_out.data<float>();
  const float* px = x.data<float>();
  const float* pw = weight.data<float>();
  const float* pr = rstd.data<float>();
  float* pgx = grad_x.data<float>();
  std::vector<float> partial(size_t(blocks * D), 0.0f);
  const float inv_d = 1.0f / float(D);
  const int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / (kRowsPerBlock * D));
  cpu::parallel_for(blocks, grain, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t blk = block_begin; blk < block_end; ++blk) {
      float* sw = partial.data() + blk * D;
      for (int64_t r = blk * kRowsPerBlock; r < std::min(R, (blk + 1) * kRowsPerBlock); ++r) {
        const float* gr = pg + r * D;
        const float* xr = px + r * D;
        float* gxr = pgx + r * D;
        const float rs = pr[r];
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t d = 0; d < D; ++d) {
          const float xhat = xr[d] * rs;
          a += gr[d] * pw[d] * xhat;
          sw[d] += gr[d] * xhat;
        }
        a *= inv_d;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) gxr[d] = rs * (gr[d] * pw[d] - xr[d] * rs * a);
      }
    }
  });
  float* pgw = grad_weight.data<float>();
  std::fill(pgw, pgw + D, 0.0f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* sw = partial.data() + blk * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) pgw[d] += sw[d];
  }
}

}  // namespace trainer
