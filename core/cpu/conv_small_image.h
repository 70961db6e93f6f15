// Convolutions of images of at most 4 pixels as one matrix product (f32,
// no groups, channels-last). ResNet-18's last stage on 64 x 64 inputs
// convolves 512 channels at 2 x 2: oneDNN 2.6's kernels (and PyTorch's
// 3.x ones) block over output pixels, of which there are 4 per image, and
// ran a 3x3 512 -> 512 convolution of batch 32 in 7.5-8.2 ms per pass on
// two AVX-512 threads, 74-80 GFLOP/s counting the taps that read padding.
//
// With so few pixels every output pixel sees most of the image, so the
// convolution is a product with a dense matrix D [H W C, OH OW O]: the rows
// are (input pixel, channel), the columns (output pixel, output), and
// D[(ih, iw, c), (oh, ow, o)] = w[o, c, kh, kw] where input pixel (ih, iw)
// is tap (kh, kw) of output pixel (oh, ow), 0 where it is none. An image
// channels-last is a row of [N, H W C]:
//
//   forward        y [N, OH OW O] = x [N, H W C] D            (+ bias, relu)
//   data gradient  dx = dy D^T
//   weights        G = x^T dy [H W C, OH OW O]; dw[o, c, kh, kw] = the sum of
//                  G's entries at the (input, output) pixel pairs of tap (kh,
//                  kw), added in the pairs' order; dbias[o] = sum of dy's rows
//
// 3x3 at 2 x 2 with padding 1: every pair is a tap, D has no zero, and the
// product does the 4/9 of the convolution's multiply-adds that do not read
// padding.
//
//   DirectConv s{.N = 32, .H = 2, .W = 2, .C = 512, .O = 512, .KH = 3, .KW = 3, ...};
//   if (small_image_conv_supported(s)) small_image_dense_weights(w, s, workspace, dense);
#pragma once

#include "core/cpu/conv_direct_avx2.h"

namespace trainer::cpu {

// Whether the product takes s: at most 4 input pixels, a kernel larger
// than 1x1 (oneDNN's 1x1 kernels are products already), D at most 16 M
// elements.
bool small_image_conv_supported(const DirectConv& s);

// D (above), [H W C, OH OW O] row-major, from w [O, C, KH, KW] contiguous;
// workspace: KH KW C O floats.
void small_image_dense_weights(const float* w, const DirectConv& s, float* workspace, float* dense);

// grad_w [O, C, KH, KW] (overwritten) from G [H W C, OH OW O] row-major;
// workspace: KH KW C O floats.
void small_image_fold_weights(const float* g, const DirectConv& s, float* workspace, float* grad_w);

}  // namespace trainer::cpu
