// Global-norm gradient clipping, as torch.nn.utils.clip_grad_norm_.
//
//   double norm = clip_grad_norm(parameters(opt.param_groups()), /*max_norm=*/1.0);
//
// total = (sum over every element g of every gradient of |g|^p)^(1/p), or
// max |g| for norm_type = inf. When max_norm / (total + 1e-6) < 1, every
// gradient is multiplied by that factor (the 1e-6 keeps the division finite
// for an all-zero gradient). A non-finite total (inf/nan gradients) gives a
// factor that is not >= 1, which is applied as torch applies it (the
// gradients become nan), unless error_if_nonfinite asks for an Error; with
// fp16 loss scaling, LossScaler skips such steps first.
//
// Parameters without a gradient are ignored. Gradients are f32/f64 tensors
// on any device (GPU ones through the backend's grads_power_sum, one fused
// reduction per device); the norm is accumulated in double over fixed-size
// blocks summed in order, so it does not depend on the thread count.
#pragma once

#include "core/tensor.h"

namespace trainer::optim {

// Returns the total norm of the gradients before clipping.
double clip_grad_norm(const TensorList& params, double max_norm, double norm_type = 2.0,
                      bool error_if_nonfinite = false);

// The total norm alone (no clipping).
double grad_norm(const TensorList& params, double norm_type = 2.0);

// The pieces of grad_norm, for a norm summed over several ranks in one
// fixed order (pipeline stages): sum |g|^p of one parameter's gradient (max
// |g| for p = inf; 0 without a gradient), and the scaling clip_grad_norm
// applies once the total norm is known.
double grad_power_sum(const Tensor& param, double norm_type = 2.0);
void clip_to_norm(const TensorList& params, double max_norm, double total_norm);

}  // namespace trainer::optim
