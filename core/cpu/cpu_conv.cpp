// CPU convolution on oneDNN (pooling: cpu_pool.cpp, batch norm: cpu_batch_norm.cpp).
//
// Images arrive channels-last (core/ops_conv.h) and are described to oneDNN
// as nhwc, which its AVX-512 convolutions run natively; weights stay in
// PyTorch's oihw (goihw with groups) and are reordered to whatever blocked
// format the chosen convolution wants, gradients reordered back. Primitives
// and reorders are built once per (shapes, strides, attributes, thread count)
// and cached; each call binds pointers and runs (docs/architecture.md
// "Set up once, run many"). Where oneDNN has brgemm convolutions
// (AVX-512), stride-1 data gradients run as forward convolutions of the
// flipped weights; strided 1x1 gradients run as sgemm
// (core/cpu/conv_pointwise.h; both faster than oneDNN 2.6's backward
// kernels). Where oneDNN's convolutions are its AVX2 jit ones,
// the forward and weight gradient of 3x3 (and larger) convolutions and the
// data gradient of large stride-1 ones run the project's own kernels
// (core/cpu/conv_direct_avx2.h: 1.1-1.6x oneDNN 2.6's on ResNet-18's
// shapes). One-channel images (a grayscale stem) run the project's own
// loops (core/cpu/conv_single_channel.h), images of at most 4 pixels one
// matmul with a dense matrix of the weights (core/cpu/conv_small_image.h:
// 1.8-2.4x oneDNN 2.6's kernels on ResNet-18's 2 x 2 last stage). bf16 convolutions run
// cpu_conv_bf16.cpp, f16 ones the f32 kernels on converted copies
// (core/cpu/lowp.h); other types run the reference kernels.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>

#include "core/cpu/conv_direct_avx2.h"
#include "core/cpu/conv_pointwise.h"
#include "core/cpu/conv_single_channel.h"
#include "core/cpu/conv_small_image.h"
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
using tag = memory::format_tag;
constexpr memory::data_type kF32 = memory::data_type::f32;

bool fast_dtype(std::initializer_list<const Tensor*> ts) {
  return cpu::all_of_dtype(ts, DType::f32);
}

using cpu::image_md;

// Conv weights [O, I/g, kH, kW] as oneDNN sees them: oihw, or goihw with groups.
memory::dims weight_dims(const Shape& w, int64_t groups) {
  if (groups == 1) return {w[0], w[1], w[2], w[3]};
  return {groups, w[0] / groups, w[1], w[2], w[3]};
}
memory::desc user_weights_md(const Shape& w, int64_t groups) {
  return DNNL_CHECK(
      memory::desc(weight_dims(w, groups), kF32, groups == 1 ? tag::oihw : tag::goihw));
}
memory::desc any_weights_md(const Shape& w, int64_t groups) {
  return DNNL_CHECK(memory::desc(weight_dims(w, groups), kF32, tag::any));
}
using cpu::vector_md;

using cpu::bind;
using cpu::run;
using cpu::scratch;

// The primitive cache (core/cpu/primitive_cache.h).
using cpu::Cache;
using cpu::Key;
using cpu::make_key;

// A reorder from one weights layout to another, or none when they agree.
std::optional<dnnl::reorder> maybe_reorder(const memory::desc& from, const memory::desc& to) {
  if (from == to) return std::nullopt;
  return DNNL_CHECK(dnnl::reorder(
      dnnl::reorder::primitive_desc(cpu::dnnl_engine(), from, cpu::dnnl_engine(), to)));
}

// ---- convolution ----

memory::dims conv_dilation(const Conv2dAttrs& a) {  // oneDNN counts extra gaps: 0 = dense
  return {a.dilation[0] - 1, a.dilation[1] - 1};
}
using cpu::right_padding;

dnnl::convolution_forward::desc conv_forward_desc(const Tensor& x, const Tensor& w, bool bias,
                                                  const Tensor& out, const Conv2dAttrs& a) {
  memory::dims pad_r = right_padding(x.size(2), x.size(3), out.size(2), out.size(3), w.size(2),
                                     w.size(3), a.stride, a.padding, a.dilation);
  memory::desc bias_md = bias ? vector_md(out.size(1)) : memory::desc();
  return DNNL_CHECK(dnnl::convolution_forward::desc(
      dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, image_md(x),
      any_weights_md(w.shape(), a.groups), bias_md, image_md(out), {a.stride[0], a.stride[1]},
      conv_dilation(a), {a.padding[0], a.padding[1]}, pad_r));
}

struct ConvForward {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward prim;
  std::optional<dnnl::reorder> weights_in;  // user oihw -> pd's weights layout
};

struct ConvBackwardData {
  dnnl::convolution_backward_data::primitive_desc pd;
  dnnl::convolution_backward_data prim;
  std::optional<dnnl::reorder> weights_in;
};

struct ConvBackwardWeights {
  dnnl::convolution_backward_weights::primitive_desc pd;
  dnnl::convolution_backward_weights prim;
  std::optional<dnnl::reorder> weights_out;  // pd's weights layout -> user oihw
};

// Weights in the layout a primitive wants: the user buffer itself, or a reordered copy.
memory weights_for(const std::optional<dnnl::reorder>& reorder, const memory::desc& want,
                   const Tensor& w, int64_t groups, Tensor& holder) {
  memory user = bind(user_weights_md(w.shape(), groups), w);
  if (!reorder) return user;
  memory m = scratch(want, holder);
  run(*reorder, {{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, m}});
  return m;
}

// ---- the project's own AVX2 kernel (core/cpu/conv_direct_avx2.h) ----

// The kernel's description of a convolution of `in` (channels-last) into
// `out` with O x C x KH x KW weights, or nullopt where it does not run.
// The own kernels' description of a convolution of `in` into `out` (both
// channels-last, no groups), or nullopt.
std::optional<cpu::DirectConv> own_conv_shape(const Tensor& in, int64_t O, int64_t KH, int64_t KW,
                                              const Tensor& out, const Conv2dAttrs& a,
                                              const Pair& padding) {
  if (cpu::direct_conv_use() == cpu::DirectConvUse::never || a.groups != 1) return std::nullopt;
  if (!is_channels_last(in) || !is_channels_last(out)) return std::nullopt;
  cpu::DirectConv s{.N = in.size(0),
                    .H = in.size(2),
                    .W = in.size(3),
                    .C = in.size(1),
                    .O = O,
                    .KH = KH,
                    .KW = KW,
                    .OH = out.size(2),
                    .OW = out.size(3)};
  for (int d = 0; d < 2; ++d) {
    s.stride[d] = a.stride[d];
    s.padding[d] = padding[d];
    s.dilation[d] = a.dilation[d];
  }
  return s;
}

// The AVX2 kernel's description of the convolution, or nullopt where it does not run.
std::optional<cpu::DirectConv> direct_conv(const Tensor& in, int64_t O, int64_t KH, int64_t KW,
                                           const Tensor& out, const Conv2dAttrs& a,
                                           const Pair& padding, cpu::DirectPass pass) {
  std::optional<cpu::DirectConv> s = own_conv_shape(in, O, KH, KW, out, a, padding);
  if (!s || !cpu::direct_conv_supported(*s)) return std::nullopt;
  if (cpu::direct_conv_use() == cpu::DirectConvUse::automatic &&
      !cpu::direct_conv_automatic(*s, pass))
    return std::nullopt;
  return s;
}

// The one-channel kernels' description (core/cpu/conv_single_channel.h),
// or nullopt where they do not run: the weight gradient wherever it applies,
// the forward where the project's loops run AVX-512 (on AVX2 oneDNN's
// jit:avx2 forward is the faster), or everywhere when the own kernels are
// forced (TRAINER_CONV=direct).
std::optional<cpu::DirectConv> single_channel_conv(const Tensor& x, const Tensor& weight,
                                                   const Tensor& bias, const Tensor& out,
                                                   const Conv2dAttrs& a, cpu::DirectPass pass) {
  if (!weight.is_contiguous() || (bias.defined() && !bias.is_contiguous())) return std::nullopt;
  if (pass == cpu::DirectPass::forward && !cpu::use_avx512() &&
      cpu::direct_conv_use() == cpu::DirectConvUse::automatic)
    return std::nullopt;
  std::optional<cpu::DirectConv> s =
      own_conv_shape(x, weight.size(0), weight.size(2), weight.size(3), out, a, a.padding);
  if (!s || !cpu::single_channel_conv_supported(*s)) return std::nullopt;
  return s;
}

// ---- images of at most 4 pixels as one product (core/cpu/conv_small_image.h) ----

// The product's description of a convolution of `in` into `out` with
// weights shaped like `weight` (contiguous), or nullopt where it does not run.
std::optional<cpu::DirectConv> small_image_conv(const Tensor& in, const Tensor& weight,
                                                const Tensor& out, const Conv2dAttrs& a) {
  if (!weight.is_contiguous()) return std::nullopt;
  std::optional<cpu::DirectConv> s =
      own_conv_shape(in, weight.size(0), weight.size(2), weight.size(3), out, a, a.padding);
  if (!s || !cpu::small_image_conv_supported(*s)) return std::nullopt;
  return s;
}

// A channels-last batch of images [N, C, H, W] as its rows [N, H W C].
Tensor image_rows(const Tensor& x) {
  const int64_t n = x.size(0), row = x.size(1) * x.size(2) * x.size(3);
  return make_view(x, {n, row}, {row, 1}, x.offset());
}

// The dense matrix D [H W C, OH OW O] of the weights.
Tensor small_image_dense(const Tensor& weight, const cpu::DirectConv& s) {
  Tensor dense = empty({s.H * s.W * s.C, s.OH * s.OW * s.O});
  Tensor workspace = empty({s.KH * s.KW * s.C * s.O});
  cpu::small_image_dense_weights(weight.data<float>(), s, workspace.data<float>(),
                                 dense.data<float>());
  return dense;
}

// y[r, o] = max(0, y[r, o] + bias[o]) over rows of `width` (bias may be null).
void add_bias_relu(float* y, int64_t rows, int64_t width, const float* bias, bool relu) {
  if (!bias && !relu) return;
  cpu::parallel_for(rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t o = 0; o < width; ++o) {
        const float v = y[r * width + o] + (bias ? bias[o] : 0.0f);
        y[r * width + o] = relu && v < 0.0f ? 0.0f : v;
      }
  });
}

void run_direct_conv(const cpu::DirectConv& s, const Tensor& in, const float* w,
                     const cpu::WeightStrides& ws, const Tensor& bias, bool relu,
                     const Tensor& out) {
  Tensor panels = empty({cpu::direct_conv_packed_size(s)});
  cpu::pack_direct_conv_weights(w, ws, s, panels.data<float>());
  cpu::direct_conv_avx2(in.data<float>(), panels.data<float>(),
                        bias.defined() ? bias.data<float>() : nullptr, relu, out.data<float>(), s);
}

}  // namespace

void CpuBackend::conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const Conv2dAttrs& a, bool fuse_relu, const Tensor& out) {
  if (cpu::all_of_dtype({&x, &weight, &bias, &out}, DType::bf16) && cpu::use_bf16_kernels())
    return cpu::conv2d_bf16(x, weight, bias, a, fuse_relu, out);
  // f16, and bf16 where oneDNN's bf16 kernels are not used: on the f32 kernels (core/cpu/lowp.h).
  if (cpu::any_half({&x, &weight, &bias, &out}))
    return cpu::run_in_f32({x, weight, bias}, {out}, [&](const TensorList& i, const TensorList& o) {
      conv2d(i[0], i[1], i[2], a, fuse_relu, o[0]);
    });
  if (!fast_dtype({&x, &weight, &bias, &out}))
    return RefBackend::conv2d(x, weight, bias, a, fuse_relu, out);
  if (auto s = single_channel_conv(x, weight, bias, out, a, cpu::DirectPass::forward))
    return cpu::single_channel_conv(x.data<float>(), weight.data<float>(),
                                    bias.defined() ? bias.data<float>() : nullptr, fuse_relu,
                                    out.data<float>(), *s);
  if (auto s = small_image_conv(x, weight, out, a);
      s && (!bias.defined() || bias.is_contiguous())) {
    matmul(image_rows(x), small_image_dense(weight, *s), image_rows(out));
    return add_bias_relu(out.data<float>(), s->N * s->OH * s->OW, s->O,
                         bias.defined() ? bias.data<float>() : nullptr, fuse_relu);
  }
  const int64_t KH = weight.size(2), KW = weight.size(3);
  if (auto s = direct_conv(x, weight.size(0), KH, KW, out, a, a.padding, cpu::DirectPass::forward);
      s && weight.is_contiguous() && (!bias.defined() || bias.is_contiguous()))
    return run_direct_conv(*s, x, weight.data<float>(), {weight.size(1) * KH * KW, KH * KW, KW, 1},
                           bias, fuse_relu, out);
  static Cache<ConvForward> cache;
  Key key = make_key("conv_fwd").add(x).add(weight).add(bias).add(out).add(a).add({fuse_relu});
  const ConvForward& e = cache.get(key, [&] {
    dnnl::primitive_attr attr;
    if (fuse_relu) {
      dnnl::post_ops ops;
      ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
      attr.set_post_ops(ops);
    }
    auto pd = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(
        conv_forward_desc(x, weight, bias.defined(), out, a), attr, cpu::dnnl_engine()));
    return ConvForward{pd, dnnl::convolution_forward(pd),
                       maybe_reorder(user_weights_md(weight.shape(), a.groups), pd.weights_desc())};
  });
  Tensor w_buf;
  std::unordered_map<int, memory> args = {
      {DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
      {DNNL_ARG_WEIGHTS, weights_for(e.weights_in, e.pd.weights_desc(), weight, a.groups, w_buf)},
      {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)}};
  if (bias.defined()) args[DNNL_ARG_BIAS] = bind(e.pd.bias_desc(), bias);
  run(e.prim, args);
}

namespace {

// ---- backward data as a forward convolution ----
//
// With stride 1 and no groups, the data gradient is itself a convolution:
//   grad_x[n, i, y, x] = sum_{o, ky, kx} grad_out[n, o, y - p' + ky * d, ...] * w'[i, o, ky, kx]
// with w'[i, o, ky, kx] = w[o, i, k-1-ky, k-1-kx] (transposed and flipped) and
// padding p' = d * (k - 1) - p on both sides. oneDNN's AVX-512 forward
// kernels (brgemm) run it about twice as fast as its own backward-data kernels
// do. Below AVX-512 both are oneDNN 2.6's jit kernels, and there the
// backward-data ones are the faster: 5-40% per ResNet-18 3x3 convolution on
// a Zen 4 capped at AVX2, one thread (64 channels at 28x28 batch 8: 5.3 ms
// against 7.1; 512 at 4x4: 7.3 against 11.3). The own AVX2 kernel takes the
// larger ones (conv_direct_avx2.h), w' packed straight from w.

bool backward_data_as_forward(const Tensor& weight, const Conv2dAttrs& a) {
  if (a.groups != 1) return false;
  for (int d = 0; d < 2; ++d)
    if (a.stride[d] != 1 || a.padding[d] > a.dilation[d] * (weight.size(2 + d) - 1)) return false;
  return true;
}

// p' of the formula above, per dimension (h, w).
Pair flipped_padding(const Tensor& weight, const Conv2dAttrs& a) {
  return {a.dilation[0] * (weight.size(2) - 1) - a.padding[0],
          a.dilation[1] * (weight.size(3) - 1) - a.padding[1]};
}

// w' of the formula above as a plain [I, O, kH, kW] buffer. Tiles of
// kTile x kTile (o, i) pairs: a tile reads kTile runs of kTile * K
// contiguous floats of w and writes kTile such runs of w', where the plain
// loop nest strided through one side (2% of a ResNet-18 training step in a
// profile).
void transpose_flip_weights(const Tensor& w, Tensor& out) {
  constexpr int64_t kTile = 16;
  const int64_t O = w.size(0), I = w.size(1), K = w.size(2) * w.size(3);
  out = empty({I, O, w.size(2), w.size(3)});
  const float* src = w.data<float>();
  float* dst = out.data<float>();
  const int64_t tiles_i = (I + kTile - 1) / kTile;
#pragma omp parallel for collapse(2)
  for (int64_t o0 = 0; o0 < O; o0 += kTile)
    for (int64_t t = 0; t < tiles_i; ++t) {
      const int64_t i0 = t * kTile, o_end = std::min(O, o0 + kTile),
                    i_end = std::min(I, i0 + kTile);
      for (int64_t o = o0; o < o_end; ++o)
        for (int64_t i = i0; i < i_end; ++i) {
          const float* from = src + (o * I + i) * K;
          float* to = dst + (i * O + o) * K;
          for (int64_t k = 0; k < K; ++k) to[k] = from[K - 1 - k];
        }
    }
}

// The block B when `md` is oneDNN's Acdb<B>a layout of [I, O, KH, KW] f32
// weights (what its AVX-512 and AVX2 forward kernels ask for), else 0.
int64_t acdb_block(const memory::desc& md, const memory::dims& dims) {
  const std::pair<int64_t, tag> layouts[] = {{8, tag::Acdb8a},
                                             {16, tag::Acdb16a},
                                             {32, tag::Acdb32a},
                                             {48, tag::Acdb48a},
                                             {64, tag::Acdb64a}};
  for (const auto& [block, layout] : layouts)
    if (md == memory::desc(dims, kF32, layout)) return block;
  return 0;
}

// w' straight into Acdb<B>a: [I / B][KH KW][O][B], zeros past I. One pass
// over w instead of the flip above and a reorder after it.
void flip_weights_blocked(const Tensor& w, int64_t block, float* dst) {
  const int64_t O = w.size(0), I = w.size(1), K = w.size(2) * w.size(3);
  const int64_t blocks = (I + block - 1) / block;
  const float* src = w.data<float>();
  cpu::parallel_for(blocks * O, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t ib = r / O, o = r % O;
      // The block's B runs of K taps are contiguous in w (in L1 after the
      // first tap); each tap writes B contiguous floats.
      const float* from = src + (o * I + ib * block) * K;
      const int64_t valid = std::min(block, I - ib * block);
      for (int64_t t = 0; t < K; ++t) {
        float* out = dst + ((ib * K + t) * O + o) * block;
        for (int64_t j = 0; j < valid; ++j) out[j] = from[j * K + K - 1 - t];
        for (int64_t j = valid; j < block; ++j) out[j] = 0.0f;
      }
    }
  });
}

struct ConvBackwardDataAsForward {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward prim;
  memory::desc user_weights;  // w' as the buffer holding it describes it
  dnnl::reorder weights_in;   // that -> pd's weights layout
  int64_t block;              // pd's weights are Acdb<block>a (0: another layout)
};

void conv2d_backward_data_as_forward(const Tensor& grad_out, const Tensor& weight,
                                     const Conv2dAttrs& a, const Tensor& grad_x) {
  static Cache<ConvBackwardDataAsForward> cache;
  Key key = make_key("conv_bwd_data_fwd").add(grad_out).add(weight).add(grad_x).add(a);
  bool pointwise = weight.size(2) == 1 && weight.size(3) == 1;
  const ConvBackwardDataAsForward& e = cache.get(key, [&] {
    int64_t O = weight.size(0), I = weight.size(1), KH = weight.size(2), KW = weight.size(3);
    const Pair p = flipped_padding(weight, a);
    const memory::dims pad = {p[0], p[1]};
    auto desc = DNNL_CHECK(dnnl::convolution_forward::desc(
        dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, image_md(grad_out),
        DNNL_CHECK(memory::desc({I, O, KH, KW}, kF32, tag::any)), memory::desc(), image_md(grad_x),
        {1, 1}, conv_dilation(a), pad, pad));
    auto pd = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(desc, cpu::dnnl_engine()));
    // A 1x1 w' is w read transposed (iohw): no copy before the reorder.
    memory::desc user =
        DNNL_CHECK(memory::desc({I, O, KH, KW}, kF32, pointwise ? tag::iohw : tag::oihw));
    return ConvBackwardDataAsForward{
        pd, dnnl::convolution_forward(pd), user,
        DNNL_CHECK(dnnl::reorder(dnnl::reorder::primitive_desc(
            cpu::dnnl_engine(), user, cpu::dnnl_engine(), pd.weights_desc()))),
        pointwise ? 0 : acdb_block(pd.weights_desc(), {I, O, KH, KW})};
  });
  Tensor flipped, w_buf;
  memory w = scratch(e.pd.weights_desc(), w_buf);
  if (e.block > 0 && weight.is_contiguous()) {
    flip_weights_blocked(weight, e.block, static_cast<float*>(w.get_data_handle()));
  } else {
    if (!pointwise) transpose_flip_weights(weight, flipped);
    run(e.weights_in,
        {{DNNL_ARG_FROM, bind(e.user_weights, pointwise ? weight : flipped)}, {DNNL_ARG_TO, w}});
  }
  run(e.prim, {{DNNL_ARG_SRC, bind(e.pd.src_desc(), grad_out)},
               {DNNL_ARG_WEIGHTS, w},
               {DNNL_ARG_DST, bind(e.pd.dst_desc(), grad_x)}});
}

}  // namespace

// Forward: out = conv(x, w) + b. Backward data: grad_x = conv_transpose(grad_out, w).
void CpuBackend::conv2d_backward_data(const Tensor& grad_out, const Tensor& weight,
                                      const Conv2dAttrs& a, const Tensor& grad_x) {
  if (cpu::all_of_dtype({&grad_out, &weight, &grad_x}, DType::bf16) && cpu::use_bf16_kernels())
    return cpu::conv2d_backward_data_bf16(grad_out, weight, a, grad_x);
  if (cpu::any_half({&grad_out, &weight, &grad_x}))
    return cpu::run_in_f32({grad_out, weight}, {grad_x},
                           [&](const TensorList& i, const TensorList& o) {
                             conv2d_backward_data(i[0], i[1], a, o[0]);
                           });
  if (!fast_dtype({&grad_out, &weight, &grad_x}))
    return RefBackend::conv2d_backward_data(grad_out, weight, a, grad_x);
  if (auto s = small_image_conv(grad_x, weight, grad_out, a))
    return matmul(image_rows(grad_out), small_image_dense(weight, *s).t(), image_rows(grad_x));
  if (a.stride != Pair{1, 1} && cpu::pointwise(weight.shape(), a, grad_x, grad_out))
    return cpu::pointwise_backward_data(grad_out, weight, a, grad_x);
  if (backward_data_as_forward(weight, a)) {
    // The forward of w' (above): on the own AVX2 kernel, w' read straight
    // from w, w'(i, o, ky, kx) at w + o I K + i K + (kH-1-ky) kW + (kW-1-kx),
    // K = kH kW; on oneDNN where it has brgemm convolutions.
    const int64_t I = weight.size(1), KH = weight.size(2), KW = weight.size(3);
    if (auto s = direct_conv(grad_out, I, KH, KW, grad_x, a, flipped_padding(weight, a),
                             cpu::DirectPass::data);
        s && weight.is_contiguous())
      return run_direct_conv(*s, grad_out, weight.data<float>() + KH * KW - 1,
                             {KH * KW, I * KH * KW, -KW, -1}, Tensor(), false, grad_x);
    if (cpu::has_brgemm_convolution())
      return conv2d_backward_data_as_forward(grad_out, weight, a, grad_x);
  }
  static Cache<ConvBackwardData> cache;
  Key key = make_key("conv_bwd_data").add(grad_out).add(weight).add(grad_x).add(a);
  const ConvBackwardData& e = cache.get(key, [&] {
    auto hint = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(
        conv_forward_desc(grad_x, weight, false, grad_out, a), cpu::dnnl_engine()));
    memory::dims pad_r =
        right_padding(grad_x.size(2), grad_x.size(3), grad_out.size(2), grad_out.size(3),
                      weight.size(2), weight.size(3), a.stride, a.padding, a.dilation);
    auto desc = DNNL_CHECK(dnnl::convolution_backward_data::desc(
        dnnl::algorithm::convolution_direct, image_md(grad_x),
        any_weights_md(weight.shape(), a.groups), image_md(grad_out), {a.stride[0], a.stride[1]},
        conv_dilation(a), {a.padding[0], a.padding[1]}, pad_r));
    auto pd =
        DNNL_CHECK(dnnl::convolution_backward_data::primitive_desc(desc, cpu::dnnl_engine(), hint));
    return ConvBackwardData{
        pd, dnnl::convolution_backward_data(pd),
        maybe_reorder(user_weights_md(weight.shape(), a.groups), pd.weights_desc())};
  });
  Tensor w_buf;
  run(e.prim,
      {{DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
       {DNNL_ARG_WEIGHTS, weights_for(e.weights_in, e.pd.weights_desc(), weight, a.groups, w_buf)},
       {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)}});
}

// Forward: out = conv(x, w) + b. Backward weights: grad_w = correlate(grad_out, x),
// grad_b = sum of grad_out over N, OH, OW. Pointwise ones without bias run as
// one sgemm straight into the user's [O, I] buffer (no reorder after it).
void CpuBackend::conv2d_backward_weights(const Tensor& grad_out, const Tensor& x,
                                         const Conv2dAttrs& a, const Tensor& grad_weight,
                                         const Tensor& grad_bias) {
  if (cpu::all_of_dtype({&grad_out, &x, &grad_weight, &grad_bias}, DType::bf16) &&
      cpu::use_bf16_kernels())
    return cpu::conv2d_backward_weights_bf16(grad_out, x, a, grad_weight, grad_bias);
  if (cpu::any_half({&grad_out, &x, &grad_weight, &grad_bias}))
    return cpu::run_in_f32({grad_out, x}, {grad_weight, grad_bias},
                           [&](const TensorList& i, const TensorList& o) {
                             conv2d_backward_weights(i[0], i[1], a, o[0], o[1]);
                           });
  if (!fast_dtype({&grad_out, &x, &grad_weight, &grad_bias}))
    return RefBackend::conv2d_backward_weights(grad_out, x, a, grad_weight, grad_bias);
  if (auto s = small_image_conv(x, grad_weight, grad_out, a);
      s && (!grad_bias.defined() || grad_bias.is_contiguous())) {
    Tensor g = empty({s->H * s->W * s->C, s->OH * s->OW * s->O});
    matmul(image_rows(x).t(), image_rows(grad_out), g);
    Tensor workspace = empty({s->KH * s->KW * s->C * s->O});
    cpu::small_image_fold_weights(g.data<float>(), *s, workspace.data<float>(),
                                  grad_weight.data<float>());
    // grad_bias = the sum of grad_out's [N OH OW, O] rows.
    if (grad_bias.defined())
      reduce(ReduceOp::sum,
             make_view(grad_out, {s->N * s->OH * s->OW, s->O}, {s->O, 1}, grad_out.offset()), 1,
             make_view(grad_bias, {1, s->O}, {s->O, 1}, grad_bias.offset()));
    return;
  }
  if (!grad_bias.defined() && cpu::pointwise(grad_weight.shape(), a, x, grad_out))
    return cpu::pointwise_backward_weights(grad_out, x, a, grad_weight);
  if (auto s =
          single_channel_conv(x, grad_weight, grad_bias, grad_out, a, cpu::DirectPass::weights))
    return cpu::single_channel_conv_backward_weights(
        x.data<float>(), grad_out.data<float>(), grad_weight.data<float>(),
        grad_bias.defined() ? grad_bias.data<float>() : nullptr, *s);
  if (auto s = direct_conv(x, grad_weight.size(0), grad_weight.size(2), grad_weight.size(3),
                           grad_out, a, a.padding, cpu::DirectPass::weights);
      s && grad_weight.is_contiguous() && (!grad_bias.defined() || grad_bias.is_contiguous())) {
    Tensor workspace = empty({cpu::direct_conv_weights_workspace(*s)});
    return cpu::direct_conv_backward_weights_avx2(
        x.data<float>(), grad_out.data<float>(), grad_weight.data<float>(),
        grad_bias.defined() ? grad_bias.data<float>() : nullptr, *s, workspace.data<float>());
  }
  static Cache<ConvBackwardWeights> cache;
  Key key =
      make_key("conv_bwd_weights").add(grad_out).add(x).add(grad_weight).add(grad_bias).add(a);
  const ConvBackwardWeights& e = cache.get(key, [&] {
    bool bias = grad_bias.defined();
    auto hint = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(
        conv_forward_desc(x, grad_weight, bias, grad_out, a), cpu::dnnl_engine()));
    memory::dims pad_r =
        right_padding(x.size(2), x.size(3), grad_out.size(2), grad_out.size(3), grad_weight.size(2),
                      grad_weight.size(3), a.stride, a.padding, a.dilation);
    auto desc = DNNL_CHECK(dnnl::convolution_backward_weights::desc(
        dnnl::algorithm::convolution_direct, image_md(x),
        any_weights_md(grad_weight.shape(), a.groups),
        bias ? vector_md(grad_weight.size(0)) : memory::desc(), image_md(grad_out),
        {a.stride[0], a.stride[1]}, conv_dilation(a), {a.padding[0], a.padding[1]}, pad_r));
    auto pd = DNNL_CHECK(
        dnnl::convolution_backward_weights::primitive_desc(desc, cpu::dnnl_engine(), hint));
    return ConvBackwardWeights{
        pd, dnnl::convolution_backward_weights(pd),
        maybe_reorder(pd.diff_weights_desc(), user_weights_md(grad_weight.shape(), a.groups))};
  });
  memory user = bind(user_weights_md(grad_weight.shape(), a.groups), grad_weight);
  Tensor w_buf;
  memory gw = e.weights_out ? scratch(e.pd.diff_weights_desc(), w_buf) : user;
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
                                          {DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
                                          {DNNL_ARG_DIFF_WEIGHTS, gw}};
  if (grad_bias.defined()) args[DNNL_ARG_DIFF_BIAS] = bind(e.pd.diff_bias_desc(), grad_bias);
  run(e.prim, args);
  if (e.weights_out) run(*e.weights_out, {{DNNL_ARG_FROM, gw}, {DNNL_ARG_TO, user}});
}

}  // namespace trainer
