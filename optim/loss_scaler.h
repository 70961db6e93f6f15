// Dynamic loss scaling for fp16 training (torch.cuda.amp.GradScaler's rules).
//
// The loss is multiplied by a scale S before backward so small fp16
// gradients do not flush to zero; before the update the gradients are
// multiplied by 1/S and checked for inf/nan. A step with a non-finite
// gradient is skipped and S shrinks (backoff); after growth_interval
// consecutive good steps S grows.
//
//   LossScaler scaler;                     // S = 2^16
//   scaler.scale_loss(loss).backward();
//   scaler.unscale(opt);                   // optional: before clip_grad_norm
//   clip_grad_norm(parameters(opt.param_groups()), 1.0);
//   bool stepped = scaler.step(opt);       // opt.step() unless inf/nan was found
//   scaler.update();                       // S for the next iteration
//
// update():  found inf/nan  -> S *= backoff_factor, good-step count = 0
//            otherwise      -> good-step count += 1; at growth_interval,
//                              S *= growth_factor (unless that overflows f32), count = 0
//
// Gradients may be any floating dtype (bf16/f16 are unscaled in f32 and
// rounded back), on the CPU or a GPU (one fused unscale per device through
// the backend's unscale_grads). With disabled options the scaler is the identity
// (S = 1, nothing is checked), so fp32 and fp16 runs share one code path.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "optim/optimizer.h"

namespace trainer::optim {

struct LossScalerOptions {
  bool enabled = true;
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  // Validates the options (Error naming the field and value).
  explicit LossScaler(const LossScalerOptions& options = {});

  // loss * S, recorded by autograd.
  Tensor scale_loss(const Tensor& loss) const;
  // Multiplies every gradient of the optimizer's parameters by 1/S, once per
  // iteration (a second call does nothing), and returns whether any was inf/nan.
  bool unscale(Optimizer& optimizer);
  // As above, over the gradients of params (an optimizer that is not an
  // optim::Optimizer, e.g. the trainer's replicated-or-sharded one).
  bool unscale(const TensorList& params);
  // Replaces the found-inf flag of this iteration, e.g. with its OR over the
  // ranks that each hold a shard of the gradients.
  void set_found_inf(bool found_inf);
  // Unscales if not done yet, then runs optimizer.step() unless an inf/nan
  // was found. Returns whether the step ran.
  bool step(Optimizer& optimizer);
  // As above with params' gradients, running optimizer_step (e.g. clipping,
  // then the update) unless an inf/nan was found.
  bool step(const TensorList& params, const std::function<void()>& optimizer_step);
  // Adjusts S after the iteration's step (see the header comment).
  void update();

  double scale() const { return scale_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  // Consecutive finite steps since S last changed.
  int64_t growth_tracker() const { return growth_tracker_; }

  // "loss_scaler.scale" (0-d f64), "loss_scaler.growth_tracker" and
  // "loss_scaler.skipped_steps" (0-d i64): fresh tensors holding the values.
  std::vector<NamedTensor> state() const;
  // Restores a state from state(); throws Error naming a missing, unexpected
  // or malformed entry and changes nothing.
  void load_state(const std::vector<NamedTensor>& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_steps_ = 0;
  // This iteration: whether unscale() ran and what it found.
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace trainer::optim
