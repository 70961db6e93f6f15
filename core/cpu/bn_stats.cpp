#include "core/cpu/bn_stats.h"

#include <omp.h>

#include <algorithm>
#include <vector>

namespace trainer::cpu {

namespace {

constexpr int64_t kBlockRows = 64;  // pixels summed in f32 before an f64 add

// Adds the shifted sums of rows [begin, end) of x [M, C] into s1, s2.
void shifted_sums(const float* x, int64_t C, const float* shift, int64_t begin, int64_t end,
                  double* s1, double* s2) {
  std::vector<float> block1(static_cast<size_t>(C)), block2(static_cast<size_t>(C));
  float* __restrict p1 = block1.data();
  float* __restrict p2 = block2.data();
  for (int64_t r0 = begin; r0 < end; r0 += kBlockRows) {
    std::fill(p1, p1 + C, 0.0f);
    std::fill(p2, p2 + C, 0.0f);
    for (int64_t r = r0; r < std::min(r0 + kBlockRows, end); ++r) {
      const float* __restrict row = x + r * C;
      for (int64_t c = 0; c < C; ++c) {
        float d = row[c] - shift[c];
        p1[c] += d;
        p2[c] += d * d;
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      s1[c] += p1[c];
      s2[c] += p2[c];
    }
  }
}

}  // namespace

void channel_mean_var(const Tensor& x, const Tensor& mean, const Tensor& var) {
  int64_t C = x.size(1), M = x.numel() / C;
  const float* data = x.data<float>();
  int threads = M * C < (int64_t(1) << 16) ? 1 : omp_get_max_threads();
  std::vector<double> s1(size_t(threads * C), 0.0), s2(size_t(threads * C), 0.0);
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t chunk = (M + nt - 1) / nt;
    int64_t b = std::min(M, t * chunk), e = std::min(M, b + chunk);
    shifted_sums(data, C, data, b, e, &s1[size_t(t * C)], &s2[size_t(t * C)]);
  }
  float* m = mean.data<float>();
  float* v = var.data<float>();
  for (int64_t c = 0; c < C; ++c) {
    double a = 0.0, b = 0.0;
    for (int t = 0; t < threads; ++t) a += s1[size_t(t * C + c)], b += s2[size_t(t * C + c)];
    double shifted_mean = a / double(M);
    m[c] = float(double(data[c]) + shifted_mean);
    v[c] = float(std::max(0.0, b / double(M) - shifted_mean * shifted_mean));
  }
}

}  // namespace trainer::cpu
