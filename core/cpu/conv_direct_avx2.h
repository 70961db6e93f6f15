// The project's own f32 convolution for AVX2 machines: channels-last images,
// no groups, any stride, padding and dilation. core/cpu/cpu_conv.cpp runs it
// where oneDNN's best convolutions are its 2.6 jit:avx2 ones (no brgemm
// convolutions below AVX-512 in the Debian build), for the forward, for
// stride-1 data gradients (a forward of the transposed, flipped weights) and
// for weight gradients (below).
//
// It is a GEMM with the image gathered on the fly (implicit im2col):
//   out[m, o] = bias[o] + sum_{t, c} x[m at tap t, c] * w[o, c, t],
// m an (image, output pixel) pair, t = kh * kW + kw a tap of the kernel.
// The weights are packed once per call into panels of 16 outputs, panel p
// holding w[16 p + j, c, t] at [p][t][c][j] (zero past O). A tile of up to
// 6 pairs x 16 outputs lives in 12 ymm accumulators; per tap and input
// channel it takes two loads of the panel and one broadcast per pair
// (core/cpu/rnn_gemm_avx2.h's micro-kernel, with a row pointer per pair and
// tap). A pair whose tap falls in the padding reads a row of zeros; a tap
// that all pairs of a tile miss is skipped.
//
// Every output element is one FMA chain over the taps in order and, within
// a tap, the input channels in order, starting from the bias: the result does
// not depend on the batch size, the tiling or the number of threads.
//
//   DirectConv s{.N = 16, .H = 56, .W = 56, .C = 64, .O = 64, .KH = 3, .KW = 3, ...};
//   std::vector<float> panels(direct_conv_packed_size(s));
//   pack_direct_conv_weights(w, {C * 9, 9, 3, 1}, s, panels.data());   // oihw
//   direct_conv_avx2(x, panels.data(), bias, /*relu=*/false, out, s);
#pragma once

#include <cstdint>

namespace trainer::cpu {

struct DirectConv {
  int64_t N = 0, H = 0, W = 0, C = 0;  // input [N, H, W, C]
  int64_t O = 0, KH = 0, KW = 0;       // weights: O outputs of C x KH x KW
  int64_t OH = 0, OW = 0;              // output [N, OH, OW, O]
  int64_t stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1};  // (h, w)
};

// Element (o, c, kh, kw) of the weights is at w[o so + c sc + kh skh + kw skw]
// (strides may be negative: a flipped view).
struct WeightStrides {
  int64_t o, c, kh, kw;
};

// Where core/cpu/cpu_conv.cpp runs this kernel. automatic: where oneDNN's
// convolutions are its AVX2 ones, for kernels larger than 1x1 (oneDNN's
// jit_1x1 ones are as fast) that read at least 16 channels (fewer leave the
// broadcasts too short a run of the panel; the 3-channel stem of a ResNet
// stays on oneDNN) and write at least 512 pixels, N OH OW (below that,
// packing the weights costs more than the kernel gains: ResNet-18's
// 512-channel 3x3 at 4 x 4, batch 8, packs 9.4 MB for 0.6 GFLOP); data
// gradients from 8192 pixels (oneDNN's jit:avx2 backward-data kernels are
// within 5% of this one below: bench/bench_conv.cpp); weight gradients where
// C O <= 256 x 256 (the threads' sums of larger weights, 9.4 MB each at 512
// x 512, cost more than the kernel gains on the small images such weights
// see). always: every f32 convolution without groups on channels-last images
// (the tests). never: oneDNN's.
// TRAINER_CONV=direct|onednn in the environment sets always or never for a
// run; set_direct_conv_use() overrides it.
enum class DirectConvUse { automatic, always, never };
DirectConvUse direct_conv_use();
void set_direct_conv_use(DirectConvUse use);
// Whether the kernel runs any convolution here (for `trainer info`).
bool direct_conv_in_use();
// Whether automatic picks this kernel for s, in pass, on this machine.
enum class DirectPass { forward, data, weights };
bool direct_conv_automatic(const DirectConv& s, DirectPass pass);

// Whether the kernel takes this shape (at most 64 taps).
bool direct_conv_supported(const DirectConv& s);

// Floats of the packed weights: ceil(O / 16) panels of KH KW C x 16.
int64_t direct_conv_packed_size(const DirectConv& s);
void pack_direct_conv_weights(const float* w, const WeightStrides& ws, const DirectConv& s,
                              float* panels);

// out [N, OH, OW, O] (contiguous) = conv(x [N, H, W, C] contiguous, packed
// weights) + bias (O floats, or null), then max(0, .) when relu.
void direct_conv_avx2(const float* x, const float* panels, const float* bias, bool relu, float* out,
                      const DirectConv& s);

// The weight gradient, a GEMM over the pairs:
//   grad_w[o, c, t] = sum_m x[m at tap t, c] dy[m, o],   grad_bias[o] = sum_m dy[m, o].
// Tiles of 6 input channels x 16 outputs keep 12 ymm sums while they walk the
// pairs whose tap lies inside the image (per pixel two loads of dy, one
// broadcast of x per channel). Each thread sums its range of output rows;
// the threads' sums are added in thread order at the end.
// Floats of workspace it needs with omp_get_max_threads() threads.
int64_t direct_conv_weights_workspace(const DirectConv& s);
// grad_w [O, C, KH, KW] (contiguous) and grad_bias [O] (or null) from x
// [N, H, W, C] and dy [N, OH, OW, O], both contiguous.
void direct_conv_backward_weights_avx2(const float* x, const float* dy, float* grad_w,
                                       float* grad_bias, const DirectConv& s, float* workspace);

}  // namespace trainer::cpu
