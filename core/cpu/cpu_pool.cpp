// CPU max and average pooling (images channels-last, as
// core/cpu/cpu_conv.cpp describes them). Max pooling runs the loops below:
// oneDNN 2.6's channels-last max pooling took 7.8 ms per call on a
// 128 x 32 x 28 x 28 batch with its AVX2 kernel (2.1 ms with AVX-512), a
// third of the small CNN's step at AVX2; the loops stream each output
// pixel's channel vector and record the window position of its max as one
// byte (a 4-d u8 tensor shaped like the output). Windows of more than 255
// positions take oneDNN's kernel, whose argmax record is its workspace (a
// 1-d byte tensor). Average pooling runs oneDNN. Other types than f32, and
// adaptive pooling whose windows do not tile the input (the op sends tiling
// ones to avg_pool2d), run the reference kernels.
#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_map>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/isa.h"
#include "core/cpu/loops.h"
#include "core/cpu/lowp.h"
#include "core/cpu/onednn.h"
#include "core/cpu/primitive_cache.h"
#include "core/ops_conv.h"

namespace trainer {

namespace {

using dnnl::memory;
using namespace cpu;  // bind, run, scratch, image_md, right_padding, the primitive cache

bool fast_dtype(std::initializer_list<const Tensor*> ts) { return all_of_dtype(ts, DType::f32); }

dnnl::algorithm pool_algorithm(bool max, const Pool2dAttrs& a) {
  if (max) return dnnl::algorithm::pooling_max;
  return a.count_include_pad ? dnnl::algorithm::pooling_avg_include_padding
                             : dnnl::algorithm::pooling_avg_exclude_padding;
}

dnnl::pooling_forward::primitive_desc pool_forward_pd(bool max, const Tensor& x, const Tensor& out,
                                                      const Pool2dAttrs& a) {
  memory::dims pad_r = right_padding(x.size(2), x.size(3), out.size(2), out.size(3), a.kernel[0],
                                     a.kernel[1], a.stride, a.padding, {1, 1});
  auto desc = DNNL_CHECK(dnnl::pooling_forward::desc(
      dnnl::prop_kind::forward_training, pool_algorithm(max, a), image_md(x), image_md(out),
      {a.stride[0], a.stride[1]}, {a.kernel[0], a.kernel[1]}, {a.padding[0], a.padding[1]}, pad_r));
  return DNNL_CHECK(dnnl::pooling_forward::primitive_desc(desc, cpu::dnnl_engine()));
}

using PoolForward = Primed<dnnl::pooling_forward>;
using PoolBackward = Primed<dnnl::pooling_backward>;

const PoolForward& pool_forward(bool max, const Tensor& x, const Tensor& out,
                                const Pool2dAttrs& a) {
  static Cache<PoolForward> cache;
  Key key = make_key("pool_fwd").add({max}).add(x).add(out).add(a);
  return cache.get(key, [&] {
    auto pd = pool_forward_pd(max, x, out, a);
    return PoolForward{pd, dnnl::pooling_forward(pd)};
  });
}

const PoolBackward& pool_backward(bool max, const Tensor& grad_out, const Tensor& grad_x,
                                  const Pool2dAttrs& a) {
  static Cache<PoolBackward> cache;
  Key key = make_key("pool_bwd").add({max}).add(grad_out).add(grad_x).add(a);
  return cache.get(key, [&] {
    auto hint = pool_forward_pd(max, grad_x, grad_out, a);
    memory::dims pad_r =
        right_padding(grad_x.size(2), grad_x.size(3), grad_out.size(2), grad_out.size(3),
                      a.kernel[0], a.kernel[1], a.stride, a.padding, {1, 1});
    auto desc = DNNL_CHECK(dnnl::pooling_backward::desc(
        pool_algorithm(max, a), image_md(grad_x), image_md(grad_out), {a.stride[0], a.stride[1]},
        {a.kernel[0], a.kernel[1]}, {a.padding[0], a.padding[1]}, pad_r));
    auto pd = DNNL_CHECK(dnnl::pooling_backward::primitive_desc(desc, cpu::dnnl_engine(), hint));
    return PoolBackward{pd, dnnl::pooling_backward(pd)};
  });
}

// One image's geometry for the loops: input H x W, output OH x OW, C
// channels, the window and its placement.
struct PoolGeometry {
  int64_t H, W, C, OH, OW, KH, KW, SH, SW, PH, PW;
};

PoolGeometry geometry_of(const Tensor& x, const Tensor& out, const Pool2dAttrs& a) {
  return {x.size(2),   x.size(3),   x.size(1),   out.size(2),  out.size(3), a.kernel[0],
          a.kernel[1], a.stride[0], a.stride[1], a.padding[0], a.padding[1]};
}

// Calls tap(pos, pixel) for each in-bounds window position of output pixel
// (oy, ox), in order: pos = ky * KW + kx, pixel = iy * W + ix.
template <class Tap>
[[gnu::always_inline]] inline void for_each_tap(const PoolGeometry& g, int64_t oy, int64_t ox,
                                                Tap&& tap) {
  const int64_t y0 = oy * g.SH - g.PH, x0 = ox * g.SW - g.PW;
  for (int64_t ky = 0; ky < g.KH; ++ky) {
    const int64_t iy = y0 + ky;
    if (iy < 0 || iy >= g.H) continue;
    for (int64_t kx = 0; kx < g.KW; ++kx) {
      const int64_t ix = x0 + kx;
      if (ix >= 0 && ix < g.W) tap(uint8_t(ky * g.KW + kx), iy * g.W + ix);
    }
  }
}

// Output row oy of one image: each pixel's channels take the max over the
// in-bounds window positions (the first of equal values; a NaN wins, the
// last NaN last, as the reference kernel), rec the position ky * KW + kx.
[[gnu::always_inline]] inline void max_pool_row(const float* x, float* out, uint8_t* rec,
                                                const PoolGeometry& g, int64_t oy) {
  const int64_t C = g.C;
  for (int64_t ox = 0; ox < g.OW; ++ox) {
    float* o = out + (oy * g.OW + ox) * C;
    uint8_t* r = rec + (oy * g.OW + ox) * C;
    bool first = true;
    for_each_tap(
        g, oy, ox, [&](uint8_t pos, int64_t pixel) __attribute__((always_inline)) {
          const float* v = x + pixel * C;
          if (first) {
            std::memcpy(o, v, size_t(C) * sizeof(float));
            std::memset(r, pos, size_t(C));
            first = false;
            return;
          }
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) {
            const bool take = v[c] > o[c] || v[c] != v[c];
            o[c] = take ? v[c] : o[c];
            r[c] = take ? pos : r[c];
          }
        });
  }
}

// Output row oy's gradients added into the image's grad_x (zeroed first):
// one pass per window position, each adding where the record names it.
[[gnu::always_inline]] inline void max_pool_backward_row(const float* gout, const uint8_t* rec,
                                                         float* gx, const PoolGeometry& g,
                                                         int64_t oy) {
  const int64_t C = g.C;
  for (int64_t ox = 0; ox < g.OW; ++ox) {
    const float* go = gout + (oy * g.OW + ox) * C;
    const uint8_t* r = rec + (oy * g.OW + ox) * C;
    for_each_tap(
        g, oy, ox, [&](uint8_t pos, int64_t pixel) __attribute__((always_inline)) {
          float* d = gx + pixel * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) d[c] += r[c] == pos ? go[c] : 0.0f;
        });
  }
}

// Output rows [oy0, oy1) of one image through Row (max_pool_row or
// max_pool_backward_row), compiled for AVX-512 and for AVX2, the instance
// chosen by use_avx512().
template <auto Row, class... P>
TRAINER_AVX512 void rows_avx512(const PoolGeometry& g, int64_t oy0, int64_t oy1, P... p) {
  for (int64_t oy = oy0; oy < oy1; ++oy) Row(p..., g, oy);
}
template <auto Row, class... P>
void rows_avx2(const PoolGeometry& g, int64_t oy0, int64_t oy1, P... p) {
  for (int64_t oy = oy0; oy < oy1; ++oy) Row(p..., g, oy);
}
template <auto Row, class... P>
void run_rows(const PoolGeometry& g, int64_t oy0, int64_t oy1, P... p) {
  if (use_avx512())
    rows_avx512<Row>(g, oy0, oy1, p...);
  else
    rows_avx2<Row>(g, oy0, oy1, p...);
}

// Whether the loops take this max pooling: f32, channels-last operands, a
// window the one-byte record can number.
bool own_max_pool(const Tensor& x, const Tensor& out, const Pool2dAttrs& a) {
  return fast_dtype({&x, &out}) && is_channels_last(x) && is_channels_last(out) &&
         a.kernel[0] * a.kernel[1] <= 255 && x.numel() > 0 && out.numel() > 0;
}

Tensor max_pool2d_own(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  const PoolGeometry g = geometry_of(x, out, a);
  Tensor rec = empty_channels_last(out.shape(), DType::u8);
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  uint8_t* rp = rec.data<uint8_t>();
  const int64_t N = x.size(0), in_image = g.H * g.W * g.C, out_image = g.OH * g.OW * g.C;
  // Work items: (image, output row); rows write disjoint outputs.
  parallel_for(N * g.OH, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, g.OW * g.C)),
               [&](int64_t b, int64_t e) {
                 for (int64_t i = b; i < e;) {
                   const int64_t n = i / g.OH, oy0 = i % g.OH;
                   const int64_t oy1 = std::min(g.OH, oy0 + (e - i));
                   run_rows<max_pool_row>(g, oy0, oy1, xp + n * in_image, op + n * out_image,
                                          rp + n * out_image);
                   i += oy1 - oy0;
                 }
               });
  return rec;
}

void max_pool2d_backward_own(const Tensor& grad_out, const Tensor& rec, const Pool2dAttrs& a,
                             const Tensor& grad_x) {
  const PoolGeometry g = geometry_of(grad_x, grad_out, a);
  const float* gp = grad_out.data<float>();
  const uint8_t* rp = rec.data<uint8_t>();
  float* xp = grad_x.data<float>();
  const int64_t N = grad_x.size(0), in_image = g.H * g.W * g.C, out_image = g.OH * g.OW * g.C;
  // Windows may overlap (stride < kernel), so each image is one work item.
  parallel_for(N, 1, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      float* gx = xp + n * in_image;
      std::memset(gx, 0, size_t(in_image) * sizeof(float));
      run_rows<max_pool_backward_row>(g, 0, g.OH, gp + n * out_image, rp + n * out_image, gx);
    }
  });
}

}  // namespace

Tensor CpuBackend::max_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  if (!fast_dtype({&x, &out})) return RefBackend::max_pool2d(x, a, out);
  if (own_max_pool(x, out, a)) return max_pool2d_own(x, a, out);
  const PoolForward& e = pool_forward(true, x, out, a);
  Tensor workspace;
  memory ws = scratch(e.pd.workspace_desc(), workspace);
  run(e.prim, {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
               {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)},
               {DNNL_ARG_WORKSPACE, ws}});
  return workspace;
}

// Forward: out = x[argmax of the window]. Backward: grad_x[argmax] += grad_out.
void CpuBackend::max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax,
                                     const Pool2dAttrs& a, const Tensor& grad_x) {
  if (argmax.dtype() == DType::i64)  // the reference forward ran (non-f32 types)
    return RefBackend::max_pool2d_backward(grad_out, argmax, a, grad_x);
  if (argmax.dim() == 4) {  // the loops' record
    CHECK(is_channels_last(grad_out) && is_channels_last(grad_x) &&
          grad_out.dtype() == DType::f32 && grad_x.dtype() == DType::f32)
        << "max_pool2d_backward: channels-last f32 gradients expected with the record of the "
           "channels-last forward, got "
        << grad_out.str() << " and " << grad_x.str();
    return max_pool2d_backward_own(grad_out, argmax, a, grad_x);
  }
  const PoolBackward& e = pool_backward(true, grad_out, grad_x, a);
  run(e.prim, {{DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
               {DNNL_ARG_WORKSPACE, bind(e.pd.workspace_desc(), argmax)},
               {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)}});
}

void CpuBackend::avg_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  if (!fast_dtype({&x, &out})) return RefBackend::avg_pool2d(x, a, out);
  const PoolForward& e = pool_forward(false, x, out, a);
  run(e.prim,
      {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)}, {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)}});
}

// Forward: out = window sum / divisor. Backward: window inputs += grad_out / divisor.
void CpuBackend::avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& a,
                                     const Tensor& grad_x) {
  if (!fast_dtype({&grad_out, &grad_x}))
    return RefBackend::avg_pool2d_backward(grad_out, a, grad_x);
  const PoolBackward& e = pool_backward(false, grad_out, grad_x, a);
  run(e.prim, {{DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
               {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)}});
}

}  // namespace trainer
