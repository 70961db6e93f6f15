// The project's own f32 convolution of images with one input channel (a
// grayscale stem: the small CNN's and ResNet's first layer on Fashion-MNIST),
// forward and weight gradient, channels-last outputs. oneDNN 2.6 runs these
// shapes badly: its kernels block over input channels, of which there is
// one. On the small CNN's first layer (batch 128, 28 x 28, 32 outputs, 3x3,
// two threads of a Xeon with AVX-512) its forward ran at 83-90 GFLOP/s and
// its weight gradient with the bias at 44 (bench/bench_conv.cpp).
//
// With one channel a convolution is, per output pixel, a sum over the KH KW
// taps of one input value times a row of O weights: the outputs are the
// vector dimension. The image is copied into a zero-padded buffer first, so
// that no tap tests the border.
//
//   forward   tiles of P pixels x 32 outputs in vector sums, per tap one load
//             of the weights' row and one broadcast per pixel; every output
//             is one FMA chain over the taps in order, from the bias.
//   weights   grad_w[o, t] = sum_m x[m at tap t] dy[m, o], grad_b[o] = sum_m
//             dy[m, o]: per output pixel one load of dy's row and one
//             broadcast per tap, with the taps' sums (up to 9 at a time) in
//             registers. Each band of output rows of an image sums alone;
//             the bands' sums are added in order, so the result does not
//             depend on the number of threads.
//
// Each loop is compiled for AVX-512 and for AVX2, chosen by use_avx512().
//
//   DirectConv s{.N = 128, .H = 28, .W = 28, .C = 1, .O = 32, .KH = 3, .KW = 3, ...};
//   single_channel_conv(x, w, bias, /*relu=*/false, out, s);    // w: [O, 1, KH, KW]
//   single_channel_conv_backward_weights(x, dy, grad_w, grad_b, s);
#pragma once

#include "core/cpu/conv_direct_avx2.h"

namespace trainer::cpu {

// Whether these kernels take s: one input channel, a kernel larger than 1x1.
bool single_channel_conv_supported(const DirectConv& s);

// out [N, OH, OW, O] (contiguous) = conv(x [N, H, W] contiguous, w [O, KH,
// KW] contiguous) + bias (O floats, or null), then max(0, .) when relu.
void single_channel_conv(const float* x, const float* w, const float* bias, bool relu, float* out,
                         const DirectConv& s);

// grad_w [O, KH, KW] and grad_bias [O] (or null), both contiguous, from x
// [N, H, W] and dy [N, OH, OW, O], both contiguous.
void single_channel_conv_backward_weights(const float* x, const float* dy, float* grad_w,
                                          float* grad_bias, const DirectConv& s);

}  // namespace trainer::cpu
