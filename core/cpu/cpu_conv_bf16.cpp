// bf16 convolution on oneDNN (AMX / AVX512-BF16 kernels, f32 accumulation),
// the path autocast's bf16 convolutions take (core/cpu/lowp.h). Every operand
// is bf16: images channels-last (nhwc) or any strides, weights PyTorch's
// [O, I/groups, kH, kW] reordered to the layout the primitive picks, bias [O].
// The weight gradient is computed in f32 and converted to bf16 by the reorder
// back to oihw: oneDNN 2.6's AMX backward-weights kernel runs about 6x
// faster with an f32 destination than with a bf16 one. Primitives and
// reorders are built once per (shapes, strides, attributes, thread count)
// and cached.
#include <omp.h>

#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "core/cpu/lowp.h"
#include "core/cpu/onednn.h"
#include "core/cpu/primitive_cache.h"

namespace trainer::cpu {

namespace {

using dnnl::memory;
using tag = memory::format_tag;
constexpr memory::data_type kBF16 = memory::data_type::bf16;
constexpr memory::data_type kF32 = memory::data_type::f32;

// [O, I/g, kH, kW] as oneDNN's oihw, or goihw with groups (format any: the primitive's choice).
memory::desc weights_md(const Shape& w, int64_t groups, bool any, memory::data_type dt = kBF16) {
  memory::dims d = groups == 1 ? memory::dims{w[0], w[1], w[2], w[3]}
                               : memory::dims{groups, w[0] / groups, w[1], w[2], w[3]};
  tag t = any ? tag::any : (groups == 1 ? tag::oihw : tag::goihw);
  return DNNL_CHECK(memory::desc(d, dt, t));
}

// The padding the last window reaches on the bottom/right (floor mode may leave input unread).
memory::dims right_padding(const Tensor& x, const Tensor& out, const Shape& w,
                           const Conv2dAttrs& a) {
  return cpu::right_padding(x.size(2), x.size(3), out.size(2), out.size(3), w[2], w[3], a.stride,
                            a.padding, a.dilation);
}

dnnl::convolution_forward::desc forward_desc(const Tensor& x, const Shape& w, bool bias,
                                             const Tensor& out, const Conv2dAttrs& a) {
  return DNNL_CHECK(dnnl::convolution_forward::desc(
      dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, image_md(x, kBF16),
      weights_md(w, a.groups, true), bias ? vector_md(out.size(1), kBF16) : memory::desc(),
      image_md(out, kBF16), {a.stride[0], a.stride[1]}, {a.dilation[0] - 1, a.dilation[1] - 1},
      {a.padding[0], a.padding[1]}, right_padding(x, out, w, a)));
}

std::optional<dnnl::reorder> maybe_reorder(const memory::desc& from, const memory::desc& to) {
  if (from == to) return std::nullopt;
  return DNNL_CHECK(
      dnnl::reorder(dnnl::reorder::primitive_desc(dnnl_engine(), from, dnnl_engine(), to)));
}

// The user's weights in the layout `want`: the buffer itself, or a reordered copy in holder.
memory weights_in(const std::optional<dnnl::reorder>& reorder, const memory::desc& want,
                  const Tensor& w, int64_t groups, Tensor& holder) {
  memory user = bind(weights_md(w.shape(), groups, false), w);
  if (!reorder) return user;
  holder = empty({int64_t(want.get_size())}, DType::u8);
  memory m = bind(want, holder);
  run(*reorder, {{DNNL_ARG_FROM, user}, {DNNL_ARG_TO, m}});
  return m;
}

struct Forward {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward prim;
  std::optional<dnnl::reorder> weights;  // user oihw -> pd's layout
};
struct BackwardData {
  dnnl::convolution_backward_data::primitive_desc pd;
  dnnl::convolution_backward_data prim;
  std::optional<dnnl::reorder> weights;
};
struct BackwardWeights {
  dnnl::convolution_backward_weights::primitive_desc pd;
  dnnl::convolution_backward_weights prim;
  dnnl::reorder weights;  // pd's f32 layout -> user bf16 oihw
};

}  // namespace

// out = conv(x, w) + b (then relu when fused).
void conv2d_bf16(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dAttrs& a,
                 bool fuse_relu, const Tensor& out) {
  static Cache<Forward> cache;
  const Forward& e = cache.get(
      make_key("bf16_conv_fwd").add(x).add(weight).add(bias).add(out).add(a).add({fuse_relu}), [&] {
        dnnl::primitive_attr attr;
        if (fuse_relu) {
          dnnl::post_ops ops;
          ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
          attr.set_post_ops(ops);
        }
        auto pd = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(
            forward_desc(x, weight.shape(), bias.defined(), out, a), attr, dnnl_engine()));
        return Forward{
            pd, dnnl::convolution_forward(pd),
            maybe_reorder(weights_md(weight.shape(), a.groups, false), pd.weights_desc())};
      });
  Tensor w_buf;
  std::unordered_map<int, memory> args = {
      {DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
      {DNNL_ARG_WEIGHTS, weights_in(e.weights, e.pd.weights_desc(), weight, a.groups, w_buf)},
      {DNNL_ARG_DST, bind(e.pd.dst_desc(), out)}};
  if (bias.defined()) args[DNNL_ARG_BIAS] = bind(e.pd.bias_desc(), bias);
  run(e.prim, args);
}

// Forward: out = conv(x, w) + b. Backward data: grad_x = conv_transpose(grad_out, w).
void conv2d_backward_data_bf16(const Tensor& grad_out, const Tensor& weight, const Conv2dAttrs& a,
                               const Tensor& grad_x) {
  static Cache<BackwardData> cache;
  const BackwardData& e =
      cache.get(make_key("bf16_conv_bwd_data").add(grad_out).add(weight).add(grad_x).add(a), [&] {
        auto hint = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(
            forward_desc(grad_x, weight.shape(), false, grad_out, a), dnnl_engine()));
        auto desc = DNNL_CHECK(dnnl::convolution_backward_data::desc(
            dnnl::algorithm::convolution_direct, image_md(grad_x, kBF16),
            weights_md(weight.shape(), a.groups, true), image_md(grad_out, kBF16),
            {a.stride[0], a.stride[1]}, {a.dilation[0] - 1, a.dilation[1] - 1},
            {a.padding[0], a.padding[1]}, right_padding(grad_x, grad_out, weight.shape(), a)));
        auto pd =
            DNNL_CHECK(dnnl::convolution_backward_data::primitive_desc(desc, dnnl_engine(), hint));
        return BackwardData{
            pd, dnnl::convolution_backward_data(pd),
            maybe_reorder(weights_md(weight.shape(), a.groups, false), pd.weights_desc())};
      });
  Tensor w_buf;
  run(e.prim,
      {{DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
       {DNNL_ARG_WEIGHTS, weights_in(e.weights, e.pd.weights_desc(), weight, a.groups, w_buf)},
       {DNNL_ARG_DIFF_SRC, bind(e.pd.diff_src_desc(), grad_x)}});
}

// Forward: out = conv(x, w) + b. Backward weights: grad_w = correlate(grad_out, x),
// grad_b = sum of grad_out over N, OH, OW (grad_bias may be undefined), both
// accumulated into f32 buffers and rounded to bf16 once.
void conv2d_backward_weights_bf16(const Tensor& grad_out, const Tensor& x, const Conv2dAttrs& a,
                                  const Tensor& grad_weight, const Tensor& grad_bias) {
  static Cache<BackwardWeights> cache;
  const Shape& ws = grad_weight.shape();
  const bool bias = grad_bias.defined();
  const BackwardWeights& e =
      cache.get(make_key("bf16_conv_bwd_weights")
                    .add(grad_out)
                    .add(x)
                    .add(grad_weight)
                    .add(grad_bias)
                    .add(a)
                    .add({bias}),
                [&] {
                  auto hint = DNNL_CHECK(dnnl::convolution_forward::primitive_desc(
                      forward_desc(x, ws, bias, grad_out, a), dnnl_engine()));
                  auto desc = DNNL_CHECK(dnnl::convolution_backward_weights::desc(
                      dnnl::algorithm::convolution_direct, image_md(x, kBF16),
                      weights_md(ws, a.groups, true, kF32),
                      bias ? vector_md(ws[0], kF32) : memory::desc(), image_md(grad_out, kBF16),
                      {a.stride[0], a.stride[1]}, {a.dilation[0] - 1, a.dilation[1] - 1},
                      {a.padding[0], a.padding[1]}, right_padding(x, grad_out, ws, a)));
                  auto pd = DNNL_CHECK(dnnl::convolution_backward_weights::primitive_desc(
                      desc, dnnl_engine(), hint));
                  return BackwardWeights{pd, dnnl::convolution_backward_weights(pd),
                                         DNNL_CHECK(dnnl::reorder(dnnl::reorder::primitive_desc(
                                             dnnl_engine(), pd.diff_weights_desc(), dnnl_engine(),
                                             weights_md(ws, a.groups, false))))};
                });
  Tensor w_buf = empty({int64_t(e.pd.diff_weights_desc().get_size())}, DType::u8);
  memory gw = bind(e.pd.diff_weights_desc(), w_buf);
  Tensor b_buf = bias ? empty({ws[0]}, DType::f32) : Tensor();
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, bind(e.pd.src_desc(), x)},
                                          {DNNL_ARG_DIFF_DST, bind(e.pd.diff_dst_desc(), grad_out)},
                                          {DNNL_ARG_DIFF_WEIGHTS, gw}};
  if (bias) args[DNNL_ARG_DIFF_BIAS] = bind(e.pd.diff_bias_desc(), b_buf);
  run(e.prim, args);
  run(e.weights,
      {{DNNL_ARG_FROM, gw}, {DNNL_ARG_TO, bind(weights_md(ws, a.groups, false), grad_weight)}});
  if (bias) Tensor(grad_bias).copy_(b_buf);
}

}  // namespace trainer::cpu
