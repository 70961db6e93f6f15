#include "core/cpu/conv_direct_avx2.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/cpu/onednn.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "conv_direct_avx2.cpp needs AVX2 and FMA (the default build targets x86-64-v3)"
#endif

namespace trainer::cpu {

namespace {

constexpr int64_t kPanel = 16;  // outputs per panel: two ymm
constexpr int kMaxRows = 6;     // pairs per tile: 12 accumulators, 2 loads, 1 broadcast
constexpr int64_t kMaxTaps = 64;

// One tile: rows (image, pixel) pairs x 16 outputs of panel. x[r][t] points
// at pair r's input channels for active tap t (or at zeros); woff[t] is that
// tap's offset in the panel. The row loops are unrolled explicitly, as in
// rnn_gemm_avx2.cpp: as loops, GCC keeps the accumulators in memory.
template <int MR>
void tile(const float* const* x, const int64_t* woff, int64_t taps, int64_t C, const float* panel,
          const float* bias16, bool relu, float* const* out, int64_t cols) {
  __m256 lo[MR], hi[MR];
  const __m256 bias_lo = bias16 ? _mm256_loadu_ps(bias16) : _mm256_setzero_ps();
  const __m256 bias_hi = bias16 ? _mm256_loadu_ps(bias16 + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    lo[r] = bias_lo;
    hi[r] = bias_hi;
  }
  for (int64_t t = 0; t < taps; ++t) {
    const float* w = panel + woff[t];
    const float* a[MR];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) a[r] = x[t * MR + r];
#pragma GCC unroll 4
    for (int64_t c = 0; c < C; ++c) {
      const __m256 b0 = _mm256_loadu_ps(w + c * kPanel);
      const __m256 b1 = _mm256_loadu_ps(w + c * kPanel + 8);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m256 av = _mm256_broadcast_ss(a[r] + c);
        lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
        hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
      }
    }
  }
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (relu) {
      lo[r] = _mm256_max_ps(lo[r], zero);
      hi[r] = _mm256_max_ps(hi[r], zero);
    }
    if (cols == kPanel) {
      _mm256_storeu_ps(out[r], lo[r]);
      _mm256_storeu_ps(out[r] + 8, hi[r]);
    } else {  // the last panel of O % 16 outputs
      alignas(32) float edge[kPanel];
      _mm256_store_ps(edge, lo[r]);
      _mm256_store_ps(edge + 8, hi[r]);
      for (int64_t j = 0; j < cols; ++j) out[r][j] = edge[j];
    }
  }
}

using TileFn = void (*)(const float* const*, const int64_t*, int64_t, int64_t, const float*,
                        const float*, bool, float* const*, int64_t);
constexpr TileFn kTiles[kMaxRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>,
                                         tile<4>, tile<5>, tile<6>};

// A tile's rows and the taps at least one of them reads, as the kernel wants them.
struct Tile {
  int rows = 0;
  int64_t taps = 0;
  int64_t first_out[kMaxRows];  // offsets in out of each pair's output pixel
  int64_t woff[kMaxTaps];       // panel offsets of the active taps
  const float* x[kMaxTaps * kMaxRows];
};

DirectConvUse use_from_environment() {
  const char* v = std::getenv("TRAINER_CONV");
  if (v && std::strcmp(v, "direct") == 0) return DirectConvUse::always;
  if (v && std::strcmp(v, "onednn") == 0) return DirectConvUse::never;
  return DirectConvUse::automatic;
}

std::atomic<DirectConvUse>& use_setting() {
  static std::atomic<DirectConvUse> use{use_from_environment()};
  return use;
}

bool onednn_at_avx2() {
  static const bool avx2 = dnnl_isa_name().rfind("avx2", 0) == 0;
  return avx2;
}

}  // namespace

DirectConvUse direct_conv_use() { return use_setting().load(); }
void set_direct_conv_use(DirectConvUse use) { use_setting().store(use); }

bool direct_conv_in_use() {
  const DirectConvUse use = direct_conv_use();
  return use == DirectConvUse::always || (use == DirectConvUse::automatic && onednn_at_avx2());
}

bool direct_conv_automatic(const DirectConv& s, DirectPass pass) {
  if (!onednn_at_avx2() || s.C < 16 || s.KH * s.KW == 1) return false;
  switch (pass) {
    case DirectPass::forward:
      return s.N * s.OH * s.OW >= 512;
    case DirectPass::data:
      return s.N * s.OH * s.OW >= 8192;
    case DirectPass::weights:
      return s.N * s.OH * s.OW >= 512 && s.C * s.O <= 256 * 256;
  }
  return false;
}

bool direct_conv_supported(const DirectConv& s) {
  return s.KH * s.KW <= kMaxTaps && s.N > 0 && s.C > 0 && s.O > 0 && s.OH > 0 && s.OW > 0;
}

int64_t direct_conv_packed_size(const DirectConv& s) {
  return (s.O + kPanel - 1) / kPanel * s.KH * s.KW * s.C * kPanel;
}

// Blocks of 16 outputs x 16 input channels through a local buffer: the
// block is read in the weights' order (per output and channel a run of kH kW)
// and written in the panel's (per tap a run of 256 floats), whatever the
// strides. Walking either side alone strided badly: the flipped weights of a
// data gradient by I kH kW floats per element, the panel by 16 C floats, the
// same cache set each time.
void pack_direct_conv_weights(const float* w, const WeightStrides& ws, const DirectConv& s,
                              float* panels) {
  const int64_t panels_n = (s.O + kPanel - 1) / kPanel, taps = s.KH * s.KW;
  const int64_t c_blocks = (s.C + kPanel - 1) / kPanel, panel_floats = taps * s.C * kPanel;
#pragma omp parallel if (!omp_in_parallel())
  {
    std::vector<float> block(size_t(taps * kPanel * kPanel));  // [t][c][j]
#pragma omp for collapse(2) schedule(static)
    for (int64_t p = 0; p < panels_n; ++p)
      for (int64_t cb = 0; cb < c_blocks; ++cb) {
        const int64_t c0 = cb * kPanel, cn = std::min(s.C - c0, kPanel);
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t o = p * kPanel + j;
          for (int64_t c = 0; c < cn; ++c) {
            const float* from = w + o * ws.o + (c0 + c) * ws.c;
            float* to = block.data() + c * kPanel + j;
            for (int64_t kh = 0; kh < s.KH; ++kh)
              for (int64_t kw = 0; kw < s.KW; ++kw, to += kPanel * kPanel)
                *to = o < s.O ? from[kh * ws.kh + kw * ws.kw] : 0.0f;
          }
        }
        float* to = panels + p * panel_floats + c0 * kPanel;
        for (int64_t t = 0; t < taps; ++t)
          std::copy_n(block.data() + t * kPanel * kPanel, cn * kPanel, to + t * s.C * kPanel);
      }
  }
}

namespace {

// Pairs (image, output pixel) of a work item at the least: the item reads
// its panels of weights once for all of them, so with 128 pairs it does 64
// FLOP per byte of weights (ResNet-18's 512 x 512 3x3 weights are 9.4 MB,
// beyond L2).
constexpr int64_t kMinItemPairs = 128;

// The tiles of the pairs of output row oh and images [n0, n1): pixel-major,
// image-minor, cut into tiles of (nearly) 6, appended to tiles.
void add_tiles(const float* x, const float* zeros, int64_t oh, int64_t n0, int64_t n1,
               const DirectConv& s, std::vector<Tile>& tiles) {
  const int64_t images = n1 - n0, pairs = s.OW * images, taps = s.KH * s.KW;
  const int64_t tiles_n = (pairs + kMaxRows - 1) / kMaxRows;
  const int64_t image = s.H * s.W * s.C, ih0 = oh * s.stride[0] - s.padding[0];
  const size_t first = tiles.size();
  tiles.resize(first + size_t(tiles_n));
  for (int64_t ti = 0; ti < tiles_n; ++ti) {
    Tile& tl = tiles[first + size_t(ti)];
    const int64_t q0 = pairs * ti / tiles_n, q1 = pairs * (ti + 1) / tiles_n;
    tl.rows = int(q1 - q0);
    tl.taps = 0;
    int64_t ow[kMaxRows], n[kMaxRows];
    for (int r = 0; r < tl.rows; ++r) {
      ow[r] = (q0 + r) / images;
      n[r] = n0 + (q0 + r) % images;
      tl.first_out[r] = ((n[r] * s.OH + oh) * s.OW + ow[r]) * s.O;
    }
    for (int64_t t = 0; t < taps; ++t) {
      const int64_t ih = ih0 + (t / s.KW) * s.dilation[0];
      if (ih < 0 || ih >= s.H) continue;
      const float* row[kMaxRows];
      bool any = false;
      for (int r = 0; r < tl.rows; ++r) {
        const int64_t iw = ow[r] * s.stride[1] - s.padding[1] + (t % s.KW) * s.dilation[1];
        const bool valid = iw >= 0 && iw < s.W;
        any = any || valid;
        row[r] = valid ? x + n[r] * image + (ih * s.W + iw) * s.C : zeros;
      }
      if (!any) continue;
      tl.woff[tl.taps] = t * s.C * kPanel;
      std::copy(row, row + tl.rows, tl.x + tl.taps * tl.rows);
      ++tl.taps;
    }
  }
}

}  // namespace

// Rows of work are (output row, chunk of at most 6 images). Consecutive rows
// make a block of at least kMinItemPairs pairs, and a work item is a block
// and a range of panels: the item walks its panels, each over all its tiles,
// so the block's input rows stay in cache. Where blocks are few (small
// images), the panels are split until there are 4 items per thread.
void direct_conv_avx2(const float* x, const float* panels, const float* bias, bool relu, float* out,
                      const DirectConv& s) {
  const int64_t taps = s.KH * s.KW, panels_n = (s.O + kPanel - 1) / kPanel;
  const int64_t chunks = (s.N + kMaxRows - 1) / kMaxRows, rows_n = s.OH * chunks;
  const int64_t row_pairs = s.OW * (s.N / chunks);
  const int64_t rows_per_block = std::max<int64_t>(1, (kMinItemPairs + row_pairs - 1) / row_pairs);
  const int64_t blocks = (rows_n + rows_per_block - 1) / rows_per_block;
  int64_t groups = 1;
  while (blocks * groups < 4 * int64_t(omp_get_max_threads()) && groups * 2 <= panels_n)
    groups *= 2;
  std::vector<float> zeros(size_t(s.C), 0.0f);
  std::vector<float> bias16(size_t(panels_n * kPanel), 0.0f);
  if (bias) std::copy(bias, bias + s.O, bias16.begin());
#pragma omp parallel if (!omp_in_parallel())
  {
    std::vector<Tile> tiles;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < blocks * groups; ++item) {
      const int64_t block = item / groups, group = item % groups;
      tiles.clear();
      const int64_t row_end = std::min(rows_n, (block + 1) * rows_per_block);
      for (int64_t row = block * rows_per_block; row < row_end; ++row) {
        const int64_t oh = row / chunks, chunk = row % chunks;
        add_tiles(x, zeros.data(), oh, s.N * chunk / chunks, s.N * (chunk + 1) / chunks, s, tiles);
      }
      const int64_t p0 = panels_n * group / groups, p1 = panels_n * (group + 1) / groups;
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = panels + p * taps * s.C * kPanel;
        const int64_t cols = std::min(kPanel, s.O - p * kPanel);
        for (const Tile& tl : tiles) {
          float* outs[kMaxRows];
          for (int r = 0; r < tl.rows; ++r) outs[r] = out + tl.first_out[r] + p * kPanel;
          kTiles[tl.rows](tl.x, tl.woff, tl.taps, s.C, panel,
                          bias ? bias16.data() + p * kPanel : nullptr, relu, outs, cols);
        }
      }
    }
  }
}

// ---- weight gradient ----

namespace {

// A run of pairs of one output row whose tap t falls inside the image: count
// pixels, x advancing by stride C and dy by O per pixel.
struct Run {
  int64_t x, dy, count;
};

// acc [MR rows c][16 columns o] (row stride ld) += sum over the runs' pixels
// of x[c0 + r] dy[o0 + j]: per pixel two loads of dy (masked past O), one
// broadcast per row, 12 FMAs. x and dy point at channel c0 and output o0.
template <int MR, bool kFull>
void weight_tile_cols(const Run* runs, int64_t runs_n, const float* x, int64_t x_step,
                      const float* dy, int64_t dy_step, float* acc, int64_t ld, int64_t cols) {
  alignas(32) int32_t lanes[kPanel];
  for (int64_t j = 0; j < kPanel; ++j) lanes[j] = j < cols ? -1 : 0;
  const __m256i mask_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  const __m256i mask_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes + 8));
  auto load = [&](const float* p, __m256i mask) {
    return kFull ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
  };
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    lo[r] = load(acc + r * ld, mask_lo);
    hi[r] = load(acc + r * ld + 8, mask_hi);
  }
  for (int64_t k = 0; k < runs_n; ++k) {
    const float* a = x + runs[k].x;
    const float* b = dy + runs[k].dy;
#pragma GCC unroll 2
    for (int64_t i = 0; i < runs[k].count; ++i) {
      const __m256 b0 = load(b + i * dy_step, mask_lo);
      const __m256 b1 = load(b + i * dy_step + 8, mask_hi);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m256 av = _mm256_broadcast_ss(a + i * x_step + r);
        lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
        hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (kFull) {
      _mm256_storeu_ps(acc + r * ld, lo[r]);
      _mm256_storeu_ps(acc + r * ld + 8, hi[r]);
    } else {
      _mm256_maskstore_ps(acc + r * ld, mask_lo, lo[r]);
      _mm256_maskstore_ps(acc + r * ld + 8, mask_hi, hi[r]);
    }
  }
}

template <int MR>
void weight_tile(const Run* runs, int64_t runs_n, const float* x, int64_t x_step, const float* dy,
                 int64_t dy_step, float* acc, int64_t ld, int64_t cols) {
  if (cols == kPanel)
    weight_tile_cols<MR, true>(runs, runs_n, x, x_step, dy, dy_step, acc, ld, cols);
  else
    weight_tile_cols<MR, false>(runs, runs_n, x, x_step, dy, dy_step, acc, ld, cols);
}

using WeightTileFn = void (*)(const Run*, int64_t, const float*, int64_t, const float*, int64_t,
                              float*, int64_t, int64_t);
constexpr WeightTileFn kWeightTiles[kMaxRows + 1] = {nullptr,        weight_tile<1>, weight_tile<2>,
                                                     weight_tile<3>, weight_tile<4>, weight_tile<5>,
                                                     weight_tile<6>};

// Pixels (pairs) a block of output rows aims at: each block adds its share to
// the thread's whole [taps][C][O] sum once, 96 FLOP per byte of that sum.
constexpr int64_t kBlockPixels = 384;

int weight_threads(const DirectConv& s) {
  return int(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), s.N * s.OH)));
}

// Output rows of a block, and whether a block packs its input channels
// (see below).
int64_t weight_block_rows(const DirectConv& s) { return std::max<int64_t>(1, kBlockPixels / s.OW); }
bool weight_pack_x(const DirectConv& s) { return s.C >= 256; }

// A thread's part of the workspace: its [taps][C][O] sums, its bias sums and,
// when packing, a block's input channels by tiles, [tile][pixel][6].
int64_t weight_part_floats(const DirectConv& s) {
  const int64_t c_tiles = (s.C + kMaxRows - 1) / kMaxRows;
  const int64_t packed = weight_pack_x(s) ? c_tiles * weight_block_rows(s) * s.OW * kMaxRows : 0;
  return s.KH * s.KW * s.C * s.O + s.O + packed;
}

}  // namespace

int64_t direct_conv_weights_workspace(const DirectConv& s) {
  return weight_threads(s) * weight_part_floats(s);
}

// Each thread sums a contiguous range of output rows (n, oh) into its own
// [taps][C][O] part of the workspace, block by block (kBlockPixels): per
// block and tap it lists the runs of pixels whose tap lies inside the image,
// then walks the tiles of 6 channels x 16 outputs over them. The parts are
// then added in thread order and transposed into oihw. Every sum runs over
// its pixels in order: a thread count gives the same bits every time.
void direct_conv_backward_weights_avx2(const float* x, const float* dy, float* grad_w,
                                       float* grad_bias, const DirectConv& s, float* workspace) {
  const int64_t taps = s.KH * s.KW, rows_n = s.N * s.OH;
  const int64_t sum_floats = taps * s.C * s.O, part = weight_part_floats(s);
  const int threads = weight_threads(s);
  const int64_t c_tiles = (s.C + kMaxRows - 1) / kMaxRows;
  const int64_t panels_n = (s.O + kPanel - 1) / kPanel;
  const int64_t rows_per_block = weight_block_rows(s), block_pixels = rows_per_block * s.OW;
  const bool pack_x = weight_pack_x(s);
#pragma omp parallel num_threads(threads) if (!omp_in_parallel())
  {
    std::vector<Run> runs;
    // One part per thread; all of them in turn where the team is smaller.
    for (int t = omp_get_thread_num(); t < threads; t += omp_get_num_threads()) {
      float* sum = workspace + t * part;
      float* bias_sum = sum + sum_floats;
      float* packed = bias_sum + s.O;
      std::fill(sum, sum + sum_floats + s.O, 0.0f);
      const int64_t r0 = rows_n * t / threads, r1 = rows_n * (t + 1) / threads;
      for (int64_t b0 = r0; b0 < r1; b0 += rows_per_block) {
        const int64_t b1 = std::min(r1, b0 + rows_per_block);
        if (grad_bias)
          for (const float* d = dy + b0 * s.OW * s.O; d < dy + b1 * s.OW * s.O; d += s.O)
            for (int64_t o = 0; o < s.O; ++o) bias_sum[o] += d[o];
        for (int64_t tap = 0; tap < taps; ++tap) {
          const int64_t kh = tap / s.KW, kw = tap % s.KW;
          // Output columns whose input column ow s + shift lies in [0, W).
          const int64_t shift = kw * s.dilation[1] - s.padding[1];
          const int64_t ow_lo = shift >= 0 ? 0 : (-shift + s.stride[1] - 1) / s.stride[1];
          const int64_t ow_hi =
              s.W - 1 - shift < 0 ? 0 : std::min(s.OW, (s.W - 1 - shift) / s.stride[1] + 1);
          runs.clear();
          for (int64_t row = b0; row < b1 && ow_lo < ow_hi; ++row) {
            const int64_t n = row / s.OH, oh = row % s.OH;
            const int64_t ih = oh * s.stride[0] - s.padding[0] + kh * s.dilation[0];
            if (ih < 0 || ih >= s.H) continue;
            runs.push_back({((n * s.H + ih) * s.W + ow_lo * s.stride[1] + shift) * s.C,
                            (row * s.OW + ow_lo) * s.O, ow_hi - ow_lo});
          }
          if (runs.empty()) continue;
          // From 256 channels, the runs' input channels packed by tiles,
          // [tile][pixel][6]: a tile then reads its 6 channels of consecutive
          // pixels from one stream instead of one cache line per pixel, 1 KiB
          // and more apart (1.2x at 512 channels, 7 x 7; below 256 channels
          // the copy costs more than it saves).
          if (pack_x)
            for (int64_t pixels = 0; Run & run : runs) {
              const float* from = x + run.x;
              for (int64_t i = 0; i < run.count; ++i, from += s.stride[1] * s.C)
                for (int64_t ct = 0; ct < c_tiles; ++ct) {
                  const int64_t c0 = s.C * ct / c_tiles, c1 = s.C * (ct + 1) / c_tiles;
                  std::copy(from + c0, from + c1,
                            packed + (ct * block_pixels + pixels + i) * kMaxRows);
                }
              run.x = pixels * kMaxRows;
              pixels += run.count;
            }
          float* sum_tap = sum + tap * s.C * s.O;
          for (int64_t p = 0; p < panels_n; ++p) {
            const int64_t cols = std::min(kPanel, s.O - p * kPanel);
            for (int64_t ct = 0; ct < c_tiles; ++ct) {
              const int64_t c0 = s.C * ct / c_tiles, c1 = s.C * (ct + 1) / c_tiles;
              const float* xs = pack_x ? packed + ct * block_pixels * kMaxRows : x + c0;
              kWeightTiles[c1 - c0](runs.data(), int64_t(runs.size()), xs,
                                    pack_x ? kMaxRows : s.stride[1] * s.C, dy + p * kPanel, s.O,
                                    sum_tap + c0 * s.O + p * kPanel, s.O, cols);
            }
          }
        }
      }
    }
  }
  // grad_w[o][c][t] = the parts' sums at [t][c][o], added in thread order;
  // by blocks of 16 outputs, so that both sides are read and written in runs.
  const int64_t o_blocks = (s.O + kPanel - 1) / kPanel;
#pragma omp parallel for collapse(2) schedule(static) if (!omp_in_parallel())
  for (int64_t ob = 0; ob < o_blocks; ++ob)
    for (int64_t c = 0; c < s.C; ++c) {
      const int64_t o0 = ob * kPanel, on = std::min(kPanel, s.O - o0);
      for (int64_t t = 0; t < taps; ++t) {
        float v[kPanel];
        const int64_t at = (t * s.C + c) * s.O + o0;
        for (int64_t j = 0; j < on; ++j) v[j] = workspace[at + j];
        for (int th = 1; th < threads; ++th)
          for (int64_t j = 0; j < on; ++j) v[j] += workspace[th * part + at + j];
        for (int64_t j = 0; j < on; ++j) grad_w[((o0 + j) * s.C + c) * taps + t] = v[j];
      }
    }
  if (grad_bias)
    for (int64_t o = 0; o < s.O; ++o) {
      float v = workspace[sum_floats + o];
      for (int th = 1; th < threads; ++th) v += workspace[th * part + sum_floats + o];
      grad_bias[o] = v;
    }
}

}  // namespace trainer::cpu
