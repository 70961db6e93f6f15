// Image ops: convolution, pooling, batch norm, and the channels-last layout
// they share. Forward and backward of each live in core/ops_conv.cpp; kernels
// in core/ref/ref_conv.cpp (reference) and core/cpu/cpu_conv.cpp (oneDNN).
//
// Layout (docs/architecture.md "Layouts"). An image activation has PyTorch's logical
// shape [N, C, H, W] but is channels-last in memory: strides
// {H*W*C, 1, W*C, C}, a permuted view of an NHWC buffer. Every op here
// returns channels-last outputs and takes any layout (other layouts are
// copied once). Parameters keep PyTorch's shapes, contiguous: conv weight
// [O, I/groups, kH, kW], bias and batch-norm tensors [C].
//
//   Tensor x = to_channels_last(images);                                  // [N, 3, 224, 224]
//   Tensor y = conv2d(x, w, {}, {.stride = {2, 2}, .padding = {3, 3}});    // [N, 64, 112, 112]
//   BatchNormResult bn = batch_norm_train(y, gamma, beta, 1e-5);
//   y = relu_channels_last(bn.out);
//
// Glossary: N batch, C (or I) input channels, O output channels, H/W height
// and width, kH/kW kernel size, M = N*H*W values per channel of a batch norm.
#pragma once

#include "core/conv_attrs.h"
#include "core/ops.h"

namespace trainer {

// ---- channels-last layout ----
// Whether a 4-d tensor is a dense NHWC buffer seen as [N, C, H, W].
bool is_channels_last(const Tensor& x);
// An uninitialised channels-last tensor of logical shape [N, C, H, W].
Tensor empty_channels_last(const Shape& nchw, DType dtype = DType::f32, Device device = {});
// x in channels-last layout: x itself when it already is, else a copy
// (differentiable).
Tensor to_channels_last(const Tensor& x);
// relu(x) and a + b that keep a channels-last layout (the elementwise ops of
// core/ops.h return row-major tensors); other layouts go to the plain ops.
Tensor relu_channels_last(const Tensor& x);
Tensor add_channels_last(const Tensor& a, const Tensor& b);

// ---- convolution ----
// x [N, I, H, W], weight [O, I/groups, kH, kW], bias [O] or undefined ->
// [N, O, OH, OW] with OH = conv_out_size(H, kH, stride, padding, dilation).
// fuse_relu applies relu in the same kernel (oneDNN post-op).
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = {},
              const Conv2dAttrs& attrs = {}, bool fuse_relu = false);

// ---- pooling ----
// [N, C, H, W] -> [N, C, OH, OW]; padding at most half the kernel, as PyTorch.
Tensor max_pool2d(const Tensor& x, const Pool2dAttrs& attrs);
Tensor avg_pool2d(const Tensor& x, const Pool2dAttrs& attrs);
// Mean over PyTorch's adaptive windows -> [N, C, out_h, out_w]. When the
// sizes divide, this is avg_pool2d with kernel = stride = H / out_h.
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w);

// ---- batch norm ----
// Training: normalises each channel by the batch mean and (biased) variance
// over M = N*H*W values, then out = xhat * gamma + beta, and relu(out) with
// fuse_relu (one oneDNN pass). mean and var [C] are returned detached from the
// graph for the running-statistics update (the layer owns it: layers/conv.h).
struct BatchNormResult {
  Tensor out, mean, var;
};
BatchNormResult batch_norm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                 double eps, bool fuse_relu = false);
// Evaluation: the same with the running statistics (no gradient to them).
Tensor batch_norm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, double eps);
// Evaluation-mode conv -> batch norm (-> relu) as one convolution: the batch
// norm is folded into the weights and bias,
//   w' = w * s,  b' = (b - running_mean) * s + beta,  s = gamma / sqrt(running_var + eps),
// and relu runs as the convolution's post-op. Equal to the unfused sequence up
// to rounding, and differentiable (fine-tuning with frozen statistics).
Tensor conv2d_bn_eval(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dAttrs& attrs, const Tensor& gamma, const Tensor& beta,
                      const Tensor& running_mean, const Tensor& running_var, double eps,
                      bool fuse_relu);

}  // namespace trainer
