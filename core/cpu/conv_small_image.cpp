// Convolutions of small images as one product (core/cpu/conv_small_image.h).
#include "core/cpu/conv_small_image.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cpu/loops.h"

namespace trainer::cpu {

namespace {

// The tap of kernel row (or column) that input position i is for output
// position o along one dimension, or -1.
int64_t tap_of(int64_t i, int64_t o, int64_t stride, int64_t padding, int64_t dilation,
               int64_t taps) {
  const int64_t d = i + padding - o * stride;
  if (d < 0 || d % dilation != 0) return -1;
  const int64_t k = d / dilation;
  return k < taps ? k : -1;
}

// Calls fn(input pixel, output pixel, tap) for every pair that is a tap, in
// a fixed order (output pixels, then input pixels).
template <class Fn>
void for_each_tap(const DirectConv& s, Fn&& fn) {
  for (int64_t oh = 0; oh < s.OH; ++oh)
    for (int64_t ow = 0; ow < s.OW; ++ow)
      for (int64_t ih = 0; ih < s.H; ++ih) {
        const int64_t kh = tap_of(ih, oh, s.stride[0], s.padding[0], s.dilation[0], s.KH);
        if (kh < 0) continue;
        for (int64_t iw = 0; iw < s.W; ++iw) {
          const int64_t kw = tap_of(iw, ow, s.stride[1], s.padding[1], s.dilation[1], s.KW);
          if (kw >= 0) fn(ih * s.W + iw, oh * s.OW + ow, kh * s.KW + kw);
        }
      }
}

// dst[8 x 8 at d, row stride ds] = src[8 x 8 at s, row stride ss] transposed.
inline void transpose8x8(const float* s, int64_t ss, float* d, int64_t ds) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * ss);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + j + 2] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  // r[j] (j < 4) holds, of rows 0-3, column (0, 2, 1, 3)[j] in its low lane and
  // that column + 4 in its high lane; r[j + 4] the same of rows 4-7.
  const int order[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(d + k * ds, _mm256_permute2f128_ps(r[order[k]], r[order[k] + 4], 0x20));
    _mm256_storeu_ps(d + (k + 4) * ds, _mm256_permute2f128_ps(r[order[k]], r[order[k] + 4], 0x31));
  }
}

// dst [cols, rows] = src [rows, cols] transposed: 8 x 8 blocks in vector
// registers, the edges one element at a time.
void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  parallel_for((rows + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = b0 * 8; r0 < std::min(rows, b1 * 8); r0 += 8) {
      const int64_t r1 = std::min(rows, r0 + 8);
      int64_t c0 = 0;
      if (r1 - r0 == 8)
        for (; c0 + 8 <= cols; c0 += 8)
          transpose8x8(src + r0 * cols + c0, cols, dst + c0 * rows + r0, rows);
      for (int64_t c = c0; c < cols; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
    }
  });
}

}  // namespace

bool small_image_conv_supported(const DirectConv& s) {
  const int64_t rows = s.H * s.W * s.C, cols = s.OH * s.OW * s.O;
  return s.H * s.W <= 4 && s.KH * s.KW > 1 && s.OH * s.OW > 0 && rows * cols <= (int64_t(16) << 20);
}

void small_image_dense_weights(const float* w, const DirectConv& s, float* workspace,
                               float* dense) {
  const int64_t cols = s.OH * s.OW * s.O, taps = s.KH * s.KW, pixels = s.OH * s.OW;
  // workspace[c][tap][o] = w[o][c][tap]: w as [O, C KH KW], transposed.
  transpose(w, s.O, s.C * taps, workspace);
  // Each (input pixel, output pixel) block of D: a tap's C x O weights, or zeros.
  std::vector<int64_t> tap(size_t(s.H * s.W * pixels), -1);
  for_each_tap(s, [&](int64_t in, int64_t out, int64_t t) { tap[size_t(in * pixels + out)] = t; });
  parallel_for(s.H * s.W * s.C, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t in = r / s.C, c = r % s.C;
      for (int64_t out = 0; out < pixels; ++out) {
        float* block = dense + r * cols + out * s.O;
        const int64_t t = tap[size_t(in * pixels + out)];
        if (t < 0)
          std::memset(block, 0, sizeof(float) * size_t(s.O));
        else
          std::memcpy(block, workspace + (c * taps + t) * s.O, sizeof(float) * size_t(s.O));
      }
    }
  });
}

void small_image_fold_weights(const float* g, const DirectConv& s, float* workspace,
                              float* grad_w) {
  const int64_t cols = s.OH * s.OW * s.O, taps = s.KH * s.KW;
  // workspace[c][tap][o]: each tap's sum over its pairs, added in their order.
  parallel_for(s.C, 16, [&](int64_t c0, int64_t c1) {
    std::memset(workspace + c0 * taps * s.O, 0, sizeof(float) * size_t((c1 - c0) * taps * s.O));
    for_each_tap(s, [&](int64_t in, int64_t out, int64_t t) {
      for (int64_t c = c0; c < c1; ++c) {
        float* __restrict sum = workspace + (c * taps + t) * s.O;
        const float* __restrict row = g + (in * s.C + c) * cols + out * s.O;
        for (int64_t o = 0; o < s.O; ++o) sum[o] += row[o];
      }
    });
  });
  // grad_w [O, C KH KW] is the sums [C KH KW, O] transposed.
  transpose(workspace, s.C * taps, s.O, grad_w);
}

}  // namespace trainer::cpu
