// One-channel convolutions: see core/cpu/conv_single_channel.h.
#include "core/cpu/conv_single_channel.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cpu/isa.h"
#include "core/cpu/loops.h"

namespace trainer::cpu {

namespace {

constexpr int64_t kMaxTaps = 64;
constexpr int64_t kBlock = 32;        // the outputs are padded to a multiple of this
constexpr int kTapGroup = 9;          // weight gradient: tap sums held in registers at once
constexpr int64_t kBandPixels = 256;  // a work item: whole output rows, at least this many pixels

// W floats in one vector, GCC's vector extension: zmm in the AVX-512
// instances, ymm in the AVX2 ones.
template <int W>
struct Lanes {
  typedef float V __attribute__((vector_size(sizeof(float) * W)));
};

// By reference: a 64-byte vector passed by value has no ABI in the AVX2 build.
template <class V>
[[gnu::always_inline]] inline void load(V& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}
template <class V>
[[gnu::always_inline]] inline void store(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// What both passes share: the padded image's shape and where each tap reads
// from an output pixel's corner.
struct Geometry {
  int64_t Hp = 0, Wp = 0, taps = 0, O_pad = 0, band_rows = 0, bands = 0;
  int64_t offset[kMaxTaps] = {};
};

Geometry geometry_of(const DirectConv& s) {
  Geometry g;
  g.Hp = s.H + 2 * s.padding[0];
  g.Wp = s.W + 2 * s.padding[1];
  g.taps = s.KH * s.KW;
  g.O_pad = (s.O + kBlock - 1) / kBlock * kBlock;
  for (int64_t ky = 0; ky < s.KH; ++ky)
    for (int64_t kx = 0; kx < s.KW; ++kx)
      g.offset[ky * s.KW + kx] = ky * s.dilation[0] * g.Wp + kx * s.dilation[1];
  g.band_rows = std::clamp<int64_t>((kBandPixels + s.OW - 1) / s.OW, 1, s.OH);
  g.bands = (s.OH + g.band_rows - 1) / g.band_rows;
  return g;
}

// Image n of x into this thread's zero-padded buffer.
const float* padded_image(const float* x, int64_t n, const DirectConv& s, const Geometry& g) {
  thread_local std::vector<float> buffer;
  buffer.assign(size_t(g.Hp * g.Wp), 0.0f);
  for (int64_t y = 0; y < s.H; ++y)
    std::memcpy(buffer.data() + (y + s.padding[0]) * g.Wp + s.padding[1], x + (n * s.H + y) * s.W,
                size_t(s.W) * sizeof(float));
  return buffer.data();
}

// Walks output pixels in order, giving each one's corner in the padded image
// (the read of tap t is at corner + offset[t]).
struct Cursor {
  int64_t oy, ox;
  Cursor(int64_t m, const DirectConv& s) : oy(m / s.OW), ox(m % s.OW) {}
  [[gnu::always_inline]] const float* next(const float* xp, const DirectConv& s,
                                           const Geometry& g) {
    const float* corner = xp + oy * s.stride[0] * g.Wp + ox * s.stride[1];
    if (++ox == s.OW) {
      ox = 0;
      ++oy;
    }
    return corner;
  }
};

// ---- forward ----

// P output pixels (m, m + 1, ...) x the NV W outputs from ob: every sum starts
// from the bias and takes the taps in order.
template <int W, int NV, int P>
[[gnu::always_inline]] inline void forward_tile(const float* xp, Cursor& at, int64_t m, int64_t ob,
                                                const float* wt, const float* bias, bool relu,
                                                float* out, const DirectConv& s,
                                                const Geometry& g) {
  using V = typename Lanes<W>::V;
  const float* base[P];
  V acc[P][NV];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    base[p] = at.next(xp, s, g);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) load(acc[p][v], bias + ob + v * W);
  }
  for (int64_t t = 0; t < g.taps; ++t) {
    V wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) load(wv[v], wt + t * g.O_pad + ob + v * W);
    const int64_t off = g.offset[t];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const float xv = base[p][off];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[p][v] += xv * wv[v];
    }
  }
  const int64_t cols = std::min<int64_t>(NV * W, s.O - ob);
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    float* o = out + (m + p) * s.O + ob;
    if (relu) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[p][v] = acc[p][v] > V{} ? acc[p][v] : V{};
    }
    if (cols == NV * W) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) store(o + v * W, acc[p][v]);
    } else {  // the last block of O % (NV W) outputs
      float edge[NV * W];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) store(edge + v * W, acc[p][v]);
      std::memcpy(o, edge, size_t(cols) * sizeof(float));
    }
  }
}

// Output pixels [m0, m1) of one image, in tiles of P pixels.
template <int W, int NV, int P>
[[gnu::always_inline]] inline void forward_pixels(const float* xp, int64_t m0, int64_t m1,
                                                  const float* wt, const float* bias, bool relu,
                                                  float* out, const DirectConv& s,
                                                  const Geometry& g) {
  for (int64_t ob = 0; ob < s.O; ob += NV * W) {
    int64_t m = m0;
    Cursor at(m0, s);
    for (; m + P <= m1; m += P) forward_tile<W, NV, P>(xp, at, m, ob, wt, bias, relu, out, s, g);
    for (; m < m1; ++m) forward_tile<W, NV, 1>(xp, at, m, ob, wt, bias, relu, out, s, g);
  }
}

TRAINER_AVX512 void forward_pixels_avx512(const float* xp, int64_t m0, int64_t m1, const float* wt,
                                          const float* bias, bool relu, float* out,
                                          const DirectConv& s, const Geometry& g) {
  forward_pixels<16, 2, 12>(xp, m0, m1, wt, bias, relu, out, s, g);
}
void forward_pixels_avx2(const float* xp, int64_t m0, int64_t m1, const float* wt,
                         const float* bias, bool relu, float* out, const DirectConv& s,
                         const Geometry& g) {
  forward_pixels<8, 2, 6>(xp, m0, m1, wt, bias, relu, out, s, g);
}

// ---- weight gradient ----

// Where a pixel's taps read relative to its corner: any kernel's offsets
// (Geometry::offset), or a 3x3 kernel's rows and columns one dilation apart,
// which the loads' addressing computes from two registers (a load of each
// tap's offset per pixel cost as much as the broadcast it feeds).
struct AnyTaps {
  const int64_t* offset;
  int64_t count;
  [[gnu::always_inline]] const float* at(const float* corner, int t) const {
    return corner + offset[t];
  }
};
struct Taps3x3 {
  int64_t row, col;
  static constexpr int64_t count = 9;
  [[gnu::always_inline]] const float* at(const float* corner, int t) const {
    return corner + (t / 3) * row + (t % 3) * col;
  }
};

// Output pixels [m0, m1) of one image: sums[t][o] += x[m at tap t] dy[m, o]
// for the NV W outputs from ob and taps [t0, t0 + 9), and sums[taps][o] +=
// dy[m, o] with the first group.
template <int W, int NV, class Taps>
[[gnu::always_inline]] inline void weight_sums(const float* xp, const float* dy, int64_t m0,
                                               int64_t m1, int64_t ob, int64_t t0, const Taps& taps,
                                               float* sums, const DirectConv& s,
                                               const Geometry& g) {
  using V = typename Lanes<W>::V;
  V acc[kTapGroup][NV] = {}, bias_acc[NV] = {};
  const int64_t tn = std::min<int64_t>(kTapGroup, taps.count - t0);
  const int64_t cols = std::min<int64_t>(NV * W, s.O - ob);
  Cursor at(m0, s);
  for (int64_t m = m0; m < m1; ++m) {
    V d[NV];
    if (cols == NV * W) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) load(d[v], dy + m * s.O + ob + v * W);
    } else {  // the last block of O % (NV W) outputs, zeros past O
      float edge[NV * W] = {};
      std::memcpy(edge, dy + m * s.O + ob, size_t(cols) * sizeof(float));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) load(d[v], edge + v * W);
    }
    const float* corner = at.next(xp, s, g);
#pragma GCC unroll 9
    for (int t = 0; t < kTapGroup; ++t) {
      if (t >= tn) break;
      const float xv = *taps.at(corner, int(t0) + t);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[t][v] += xv * d[v];
    }
    if (t0 == 0) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) bias_acc[v] += d[v];
    }
  }
#pragma GCC unroll 9
  for (int t = 0; t < kTapGroup; ++t) {
    if (t >= tn) break;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(sums + (t0 + t) * g.O_pad + ob + v * W, acc[t][v]);
  }
  if (t0 == 0) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store(sums + g.taps * g.O_pad + ob + v * W, bias_acc[v]);
  }
}

template <int W, int NV>
[[gnu::always_inline]] inline void weight_band(const float* xp, const float* dy, int64_t m0,
                                               int64_t m1, float* sums, const DirectConv& s,
                                               const Geometry& g) {
  if (s.KH == 3 && s.KW == 3) {
    const Taps3x3 taps{s.dilation[0] * g.Wp, s.dilation[1]};
    for (int64_t ob = 0; ob < s.O; ob += NV * W)
      weight_sums<W, NV>(xp, dy, m0, m1, ob, 0, taps, sums, s, g);
    return;
  }
  const AnyTaps taps{g.offset, g.taps};
  for (int64_t ob = 0; ob < s.O; ob += NV * W)
    for (int64_t t0 = 0; t0 < g.taps; t0 += kTapGroup)
      weight_sums<W, NV>(xp, dy, m0, m1, ob, t0, taps, sums, s, g);
}

TRAINER_AVX512 void weight_band_avx512(const float* xp, const float* dy, int64_t m0, int64_t m1,
                                       float* sums, const DirectConv& s, const Geometry& g) {
  weight_band<16, 2>(xp, dy, m0, m1, sums, s, g);
}
void weight_band_avx2(const float* xp, const float* dy, int64_t m0, int64_t m1, float* sums,
                      const DirectConv& s, const Geometry& g) {
  weight_band<8, 1>(xp, dy, m0, m1, sums, s, g);
}

}  // namespace

bool single_channel_conv_supported(const DirectConv& s) {
  const int64_t taps = s.KH * s.KW;
  return s.C == 1 && taps > 1 && taps <= kMaxTaps && s.N > 0 && s.O > 0 && s.OH > 0 && s.OW > 0;
}

void single_channel_conv(const float* x, const float* w, const float* bias, bool relu, float* out,
                         const DirectConv& s) {
  const Geometry g = geometry_of(s);
  // The weights as [tap][O_pad] rows, the bias padded alike.
  std::vector<float> wt(size_t(g.taps * g.O_pad), 0.0f), b(size_t(g.O_pad), 0.0f);
  for (int64_t o = 0; o < s.O; ++o) {
    for (int64_t t = 0; t < g.taps; ++t) wt[size_t(t * g.O_pad + o)] = w[o * g.taps + t];
    if (bias) b[size_t(o)] = bias[o];
  }
  const bool avx512 = use_avx512();
  parallel_for(s.N * g.bands, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / g.bands, band = i % g.bands;
      const int64_t m0 = band * g.band_rows * s.OW;
      const int64_t m1 = std::min(s.OH, (band + 1) * g.band_rows) * s.OW;
      const float* xp = padded_image(x, n, s, g);
      float* o = out + n * s.OH * s.OW * s.O;
      if (avx512)
        forward_pixels_avx512(xp, m0, m1, wt.data(), b.data(), relu, o, s, g);
      else
        forward_pixels_avx2(xp, m0, m1, wt.data(), b.data(), relu, o, s, g);
    }
  });
}

void single_channel_conv_backward_weights(const float* x, const float* dy, float* grad_w,
                                          float* grad_bias, const DirectConv& s) {
  const Geometry g = geometry_of(s);
  const int64_t items = s.N * g.bands, item_floats = (g.taps + 1) * g.O_pad;
  std::vector<float> sums(size_t(items * item_floats), 0.0f);
  const bool avx512 = use_avx512();
  parallel_for(items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / g.bands, band = i % g.bands;
      const int64_t m0 = band * g.band_rows * s.OW;
      const int64_t m1 = std::min(s.OH, (band + 1) * g.band_rows) * s.OW;
      const float* xp = padded_image(x, n, s, g);
      const float* d = dy + n * s.OH * s.OW * s.O;
      float* out = sums.data() + i * item_floats;
      if (avx512)
        weight_band_avx512(xp, d, m0, m1, out, s, g);
      else
        weight_band_avx2(xp, d, m0, m1, out, s, g);
    }
  });
  // The work items' sums in item order: the same result on any number of threads.
  float* total = sums.data();
  for (int64_t i = 1; i < items; ++i) {
    const float* part = sums.data() + i * item_floats;
#pragma omp simd
    for (int64_t k = 0; k < item_floats; ++k) total[k] += part[k];
  }
  for (int64_t o = 0; o < s.O; ++o) {
    for (int64_t t = 0; t < g.taps; ++t) grad_w[o * g.taps + t] = total[t * g.O_pad + o];
    if (grad_bias) grad_bias[o] = total[g.taps * g.O_pad + o];
  }
}

}  // namespace trainer::cpu
