// Batch statistics for the CPU batch norm: the mean and biased variance of
// each channel of a channels-last f32 image in one read of it (oneDNN 2.6's
// batch norm reads the image once for the mean and again for the variance).
//
// Numerics: per channel, values are shifted by the first pixel's value K
// (so the sums see x - K, of the order of the spread rather than of the
// mean), summed in f32 over blocks of 64 pixels and the block sums added in
// f64; var = S2 / M - (S1 / M)^2 with S1, S2 the sums of (x - K) and (x - K)^2.
#pragma once

#include "core/tensor.h"

namespace trainer::cpu {

// x [N, C, H, W] channels-last f32; mean, var [C] contiguous f32.
void channel_mean_var(const Tensor& x, const Tensor& mean, const Tensor& var);

}  // namespace trainer::cpu
