#include "core/cpu/rnn_gemm_avx2.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "rnn_gemm_avx2.cpp needs AVX2 and FMA (the default build targets x86-64-v3)"
#endif

namespace trainer::cpu {

namespace {

constexpr int64_t kPanel = kRnnPanelWidth;
// Rows of c per tile: 6 x 2 accumulators, 2 loads of b and 1 broadcast of a
// fill 15 of the 16 ymm registers.
constexpr int64_t kMaxTileRows = 6;

// c [MR, cols] (ldc) = (c +) a [MR, K] (lda) panel [K, 16], cols <= 16.
// The loops over rows are unrolled explicitly: left as loops, GCC keeps lo
// and hi in memory and stores all 12 accumulators every k (20 GFLOP/s on a
// Zen 3 core instead of 90).
template <int MR>
void tile(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
          int64_t cols, bool accumulate) {
  __m256 lo[MR], hi[MR];
  // A partial panel (N % 16 columns) goes through a 16-wide copy of c.
  alignas(32) float edge[MR][kPanel];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (!accumulate) {
      lo[r] = hi[r] = _mm256_setzero_ps();
    } else if (cols == kPanel) {
      lo[r] = _mm256_loadu_ps(c + r * ldc);
      hi[r] = _mm256_loadu_ps(c + r * ldc + 8);
    } else {
      for (int64_t j = 0; j < kPanel; ++j) edge[r][j] = j < cols ? c[r * ldc + j] : 0.0f;
      lo[r] = _mm256_load_ps(edge[r]);
      hi[r] = _mm256_load_ps(edge[r] + 8);
    }
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + k);
      lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (cols == kPanel) {
      _mm256_storeu_ps(c + r * ldc, lo[r]);
      _mm256_storeu_ps(c + r * ldc + 8, hi[r]);
    } else {
      _mm256_store_ps(edge[r], lo[r]);
      _mm256_store_ps(edge[r] + 8, hi[r]);
      for (int64_t j = 0; j < cols; ++j) c[r * ldc + j] = edge[r][j];
    }
  }
}

void run_tile(int64_t rows, const float* a, int64_t lda, const float* panel, int64_t K, float* c,
              int64_t ldc, int64_t cols, bool accumulate) {
  switch (rows) {
    case 1:
      return tile<1>(a, lda, panel, K, c, ldc, cols, accumulate);
    case 2:
      return tile<2>(a, lda, panel, K, c, ldc, cols, accumulate);
    case 3:
      return tile<3>(a, lda, panel, K, c, ldc, cols, accumulate);
    case 4:
      return tile<4>(a, lda, panel, K, c, ldc, cols, accumulate);
    case 5:
      return tile<5>(a, lda, panel, K, c, ldc, cols, accumulate);
    default:
      return tile<6>(a, lda, panel, K, c, ldc, cols, accumulate);
  }
}

}  // namespace

int64_t rnn_packed_size(int64_t K, int64_t N) { return (N + kPanel - 1) / kPanel * K * kPanel; }

void pack_rnn_panels(const float* b, int64_t K, int64_t N, int64_t rs, int64_t cs, float* panels) {
  const int64_t n_panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) if (K * N >= 32768 && !omp_in_parallel())
  for (int64_t p = 0; p < n_panels; ++p) {
    float* out = panels + p * K * kPanel;
    for (int64_t j = 0; j < kPanel; ++j) {
      const int64_t n = p * kPanel + j;
      for (int64_t k = 0; k < K; ++k) out[k * kPanel + j] = n < N ? b[k * rs + n * cs] : 0.0f;
    }
  }
}

// Panels outer, row tiles inner: a panel (K x 16 floats, 32 KiB for K 512)
// stays in L1/L2 while every tile of rows walks it. The M rows are split into
// ceil(M / 6) tiles of nearly equal size (32 rows: 5 or 6 each) rather than
// 6s and a thin remainder, which would leave too few independent FMA chains
// to cover the FMA latency.
void rnn_gemm_avx2(const float* a, int64_t M, int64_t K, int64_t lda, const float* panels,
                   int64_t N, float* c, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  const int64_t tiles = (M + kMaxTileRows - 1) / kMaxTileRows;
  for (int64_t p = 0; p * kPanel < N; ++p) {
    const float* panel = panels + p * K * kPanel;
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = M * t / tiles, r1 = M * (t + 1) / tiles;
      run_tile(r1 - r0, a + r0 * lda, lda, panel, K, c + r0 * ldc + p * kPanel, ldc, cols,
               accumulate);
    }
  }
}

}  // namespace trainer::cpu
