// Pillow's bilinear resampling; see resample.h.
#include "data/resample.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "core/check.h"

namespace trainer::data {

namespace {

// Fractional bits of the fixed-point weights (Pillow's PRECISION_BITS):
// 8-bit pixels times weights summing to 1 << 22 fit an int32 with room for
// the negative lobes other filters have.
constexpr int kBits = 32 - 8 - 2;

double triangle(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

uint8_t clip8(int32_t v) {
  v >>= kBits;
  return uint8_t(v < 0 ? 0 : v > 255 ? 255 : v);
}

// The weights of `taps` in fixed point, rounded half away from zero.
std::vector<int32_t> fixed_point(const ResampleTaps& taps) {
  std::vector<int32_t> k(taps.weights.size());
  for (size_t i = 0; i < k.size(); ++i) {
    double w = taps.weights[i] * double(1 << kBits);
    k[i] = int32_t(w < 0 ? w - 0.5 : w + 0.5);
  }
  return k;
}

// Output pixel x of one row along x: `channels` sums over its taps.
template <int C>
void resample_pixel(const uint8_t* in, int channels, const ResampleTaps& taps,
                    const std::vector<int32_t>& k, int x, uint8_t* out) {
  if constexpr (C > 0) channels = C;
  const uint8_t* p = in + int64_t(taps.first[size_t(x)]) * channels;
  const int32_t* w = k.data() + int64_t(x) * taps.width;
  int32_t sum[4] = {1 << (kBits - 1), 1 << (kBits - 1), 1 << (kBits - 1), 1 << (kBits - 1)};
  for (int t = 0; t < taps.count[size_t(x)]; ++t, p += channels)
    for (int c = 0; c < channels; ++c) sum[c] += int32_t(p[c]) * w[t];
  for (int c = 0; c < channels; ++c) out[x * channels + c] = clip8(sum[c]);
}

// Resamples each of rows [row0, row0 + dst.rows) of src along x into dst;
// C channels (0: any).
template <int C>
void resample_rows(const cv::Mat& src, int row0, const ResampleTaps& taps,
                   const std::vector<int32_t>& k, cv::Mat& dst) {
  for (int y = 0; y < dst.rows; ++y)
    for (int x = 0; x < dst.cols; ++x)
      resample_pixel<C>(src.ptr<uint8_t>(row0 + y), src.channels(), taps, k, x,
                        dst.ptr<uint8_t>(y));
}

#if defined(__AVX2__)
// resample_rows<3> for 8 output pixels at a time: one 32-bit gather per tap
// brings B, G and R of 8 input pixels (the 4th byte is ignored), weights
// laid out tap-major. Blocks whose taps could read the row's last pixel
// (its 4-byte load would pass the row's end) go to the scalar loop.
void resample_rows_bgr(const cv::Mat& src, int row0, const ResampleTaps& taps,
                       const std::vector<int32_t>& k, cv::Mat& dst) {
  const int width = dst.cols, n_taps = taps.width, in_size = src.cols;
  std::vector<int32_t> tap_major(size_t(n_taps) * size_t(width));
  for (int x = 0; x < width; ++x)
    for (int t = 0; t < n_taps; ++t)
      tap_major[size_t(t) * size_t(width) + size_t(x)] = k[size_t(x) * size_t(n_taps) + size_t(t)];
  // Vector blocks: [0, vector_end) in steps of 8, every tap index (first +
  // t, t < n_taps) at most in_size - 2; the last block also stops short of
  // the output row's end, since each pixel is stored as 4 bytes.
  int vector_end = 0;
  while (vector_end + 8 < width && taps.first[size_t(vector_end) + 7] + n_taps - 1 <= in_size - 2)
    vector_end += 8;
  const __m256i half = _mm256_set1_epi32(1 << (kBits - 1)), bytes = _mm256_set1_epi32(0xFF);
  const __m256i zero = _mm256_setzero_si256(), max8 = _mm256_set1_epi32(255);
  for (int y = 0; y < dst.rows; ++y) {
    const uint8_t* in = src.ptr<uint8_t>(row0 + y);
    uint8_t* out = dst.ptr<uint8_t>(y);
    for (int x = 0; x < vector_end; x += 8) {
      __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&taps.first[size_t(x)]));
      offset = _mm256_add_epi32(offset, _mm256_add_epi32(offset, offset));  // 3 bytes a pixel
      __m256i b = half, g = half, r = half;
      for (int t = 0; t < n_taps; ++t) {
        __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(&tap_major[size_t(t) * size_t(width) + size_t(x)]));
        __m256i v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(in + 3 * t), offset, 1);
        b = _mm256_add_epi32(b, _mm256_mullo_epi32(_mm256_and_si256(v, bytes), w));
        g = _mm256_add_epi32(
            g, _mm256_mullo_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8), bytes), w));
        r = _mm256_add_epi32(
            r, _mm256_mullo_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 16), bytes), w));
      }
      auto clip = [&](__m256i s) {
        return _mm256_min_epi32(_mm256_max_epi32(_mm256_srai_epi32(s, kBits), zero), max8);
      };
      __m256i packed = _mm256_or_si256(
          clip(b), _mm256_or_si256(_mm256_slli_epi32(clip(g), 8), _mm256_slli_epi32(clip(r), 16)));
      alignas(32) uint32_t pixel[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(pixel), packed);
      for (int i = 0; i < 8; ++i) std::memcpy(out + 3 * (x + i), &pixel[i], 4);
    }
    for (int x = vector_end; x < width; ++x) resample_pixel<3>(in, 3, taps, k, x, out);
  }
}
#endif

// Resamples src along y into dst (same width), a whole output line at a
// time so that the inner loop vectorises.
void resample_columns(const cv::Mat& src, const ResampleTaps& taps, const std::vector<int32_t>& k,
                      cv::Mat& dst) {
  const int n = dst.cols * dst.channels();
  std::vector<int32_t> line(static_cast<size_t>(n));
  int32_t* __restrict sum = line.data();
  for (int y = 0; y < dst.rows; ++y) {
    for (int i = 0; i < n; ++i) sum[i] = 1 << (kBits - 1);
    const int32_t* w = k.data() + int64_t(y) * taps.width;
    for (int t = 0; t < taps.count[size_t(y)]; ++t) {
      const uint8_t* __restrict in = src.ptr<uint8_t>(taps.first[size_t(y)] + t);
      const int32_t wt = w[t];
      for (int i = 0; i < n; ++i) sum[i] += int32_t(in[i]) * wt;
    }
    uint8_t* __restrict out = dst.ptr<uint8_t>(y);
    for (int i = 0; i < n; ++i) out[i] = clip8(sum[i]);
  }
}

}  // namespace

ResampleTaps bilinear_taps(int in_size, int out_size) {
  CHECK(in_size > 0 && out_size > 0) << "resample: sizes " << in_size << " -> " << out_size;
  const double scale = double(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter_scale;  // the triangle's support is 1
  ResampleTaps taps;
  taps.width = int(std::ceil(support)) * 2 + 1;
  taps.first.resize(size_t(out_size));
  taps.count.resize(size_t(out_size));
  taps.weights.assign(size_t(out_size) * size_t(taps.width), 0.0);
  for (int i = 0; i < out_size; ++i) {
    const double center = (i + 0.5) * scale;
    const int lo = std::max(int(center - support + 0.5), 0);
    const int hi = std::min(int(center + support + 0.5), in_size);
    double* w = taps.weights.data() + int64_t(i) * taps.width;
    double total = 0;
    for (int x = lo; x < hi; ++x) total += w[x - lo] = triangle((x - center + 0.5) / filter_scale);
    if (total != 0)
      for (int x = lo; x < hi; ++x) w[x - lo] /= total;
    taps.first[size_t(i)] = lo;
    taps.count[size_t(i)] = hi - lo;
  }
  return taps;
}

void resize_bilinear(const cv::Mat& src, cv::Mat& dst, int height, int width) {
  CHECK(src.depth() == CV_8U && src.channels() >= 1 && src.channels() <= 4 && !src.empty())
      << "resize_bilinear: an 8-bit image with 1 to 4 channels, not type " << src.type();
  if (src.rows == height && src.cols == width) {
    src.copyTo(dst);
    return;
  }
  // Along x first, only the rows the pass along y reads (Pillow's order).
  const ResampleTaps vertical = bilinear_taps(src.rows, height);
  cv::Mat across = src;
  int first_row = 0;
  if (src.cols != width) {
    first_row = vertical.first.front();
    const int last_row = vertical.first.back() + vertical.count.back();
    const ResampleTaps horizontal = bilinear_taps(src.cols, width);
    const std::vector<int32_t> k = fixed_point(horizontal);
    across.create(last_row - first_row, width, src.type());
    switch (src.channels()) {
      case 1:
        resample_rows<1>(src, first_row, horizontal, k, across);
        break;
      case 3:
#if defined(__AVX2__)
        resample_rows_bgr(src, first_row, horizontal, k, across);
#else
        resample_rows<3>(src, first_row, horizontal, k, across);
#endif
        break;
      default:
        resample_rows<0>(src, first_row, horizontal, k, across);
    }
  }
  if (src.rows == height) {
    dst = across;
    return;
  }
  ResampleTaps shifted = vertical;
  for (int& f : shifted.first) f -= first_row;
  dst.create(height, width, src.type());
  resample_columns(across, shifted, fixed_point(shifted), dst);
}

}  // namespace trainer::data
