// Backward of pointwise (1x1, unpadded, ungrouped) f32 convolutions on
// channels-last images as one sgemm each, for any stride (core/cpu/cpu_conv.cpp
// routes to these; they beat oneDNN 2.6's 1x1 backward kernels).
//
// Such a convolution reads only the pixels (n, oy * sy, ox * sx): with xs
// [M, I] those pixels (M = N*OH*OW), out[M, O] = xs[M, I] w[O, I]^T. So
//   grad_w[O, I]   = grad_out[M, O]^T xs[M, I]
//   grad_xs[M, I]  = grad_out[M, O] w[O, I], grad_x zero at the pixels never read.
// With stride 1, xs is x itself; otherwise a gather (or scatter) copies
// between those pixels and a dense [M, I] buffer.
#pragma once

#include "core/conv_attrs.h"
#include "core/tensor.h"

namespace trainer::cpu {

// Whether a convolution with weights of shape w [O, I, kH, kW] and attrs is
// pointwise, with image (its input or input gradient) and out (its output
// or output gradient) channels-last.
bool pointwise(const Shape& w, const Conv2dAttrs& attrs, const Tensor& image, const Tensor& out);

// grad_x [N, I, H, W] (channels-last, fully written) from grad_out [N, O, OH, OW]
// and weight [O, I, 1, 1], contiguous.
void pointwise_backward_data(const Tensor& grad_out, const Tensor& weight, const Conv2dAttrs& attrs,
                             const Tensor& grad_x);
// grad_weight [O, I, 1, 1] (contiguous) from grad_out and x [N, I, H, W].
void pointwise_backward_weights(const Tensor& grad_out, const Tensor& x, const Conv2dAttrs& attrs,
                                const Tensor& grad_weight);

}  // namespace trainer::cpu
