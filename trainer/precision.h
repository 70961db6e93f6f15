// The numeric precision of a training run, recipe key `precision`
// (torch.amp's recipe on our autocast, core/autocast.h):
//   fp32  everything in f32.
//   bf16  forward and loss under AutocastGuard(bf16): matmuls and
//         convolutions in bf16 (AMX on this CPU), losses and norms in f32.
//         bf16 has f32's exponent range, so gradients need no loss scaling.
//   fp16  forward and loss under AutocastGuard(f16), with dynamic loss
//         scaling (optim/loss_scaler.h, options from the recipe's
//         loss_scaler section): the loss is multiplied by S before backward,
//         the gradients by 1/S before the update, and a step whose gradients
//         hold an inf/nan is skipped while S backs off.
// Parameters, their gradients and the optimizer state stay f32 (master
// weights) in every mode. The scaler's state (S, its growth counter, the
// skipped steps) is saved with each checkpoint (loss_scaler.safetensors) so a
// resumed fp16 run continues with the same scale.
//
//   Precision precision(recipe, session.shards_optimizer());
//   { AutocastGuard autocast(precision.autocast_dtype()); loss = session.loss(batch); }
//   precision.scale_loss(loss).backward();
//   bool stepped = precision.step(model.parameters(), [&] { clip(); opt.step(); });
//   precision.update();
#pragma once

#include <functional>
#include <string>

#include "optim/loss_scaler.h"
#include "trainer/metrics.h"
#include "trainer/recipe.h"

namespace trainer {

class Precision {
 public:
  // Throws Error naming the recipe key for a combination it cannot run
  // (fp16 with an optimizer sharded over the ranks: no rank holds every gradient).
  Precision(const Recipe& recipe, bool sharded_optimizer);

  // The AutocastGuard dtype of forward and loss: f32 (autocast off), bf16 or f16.
  DType autocast_dtype() const { return autocast_dtype_; }
  bool scales_loss() const { return scales_loss_; }

  // loss * S (fp16), else loss; recorded by autograd.
  Tensor scale_loss(const Tensor& loss) const;
  // fp16: unscales the gradients of params and runs optimizer_step unless
  // one holds an inf/nan (the step is then skipped and counted); otherwise
  // runs optimizer_step. Returns whether it ran. After the last backward of
  // a step (data parallel: once the gradients are averaged).
  bool step(const TensorList& params, const std::function<void()>& optimizer_step);
  // Adjusts S after the step (backoff or growth); nothing outside fp16.
  void update();
  // A model split over ranks (pipeline stages, tensor parallelism): each
  // rank sees its part of the gradients, so whether any holds an inf/nan is
  // decided by any(found_here) over the ranks, and every rank skips or takes
  // the step and moves S alike.
  void set_found_inf_across(std::function<bool(bool)> any) { any_rank_ = std::move(any); }

  double scale() const { return scaler_.scale(); }
  int64_t skipped_steps() const { return scaler_.skipped_steps(); }
  // For the metrics log: loss_scale and skipped_steps under fp16, none otherwise.
  Scalars scalars() const;

  // fp16: writes the scaler's state to dir/loss_scaler.safetensors (nothing otherwise).
  void save(const std::string& dir) const;
  // fp16: restores it; Error naming the file when it is missing or malformed
  // (a checkpoint written by a run of another precision).
  void load(const std::string& dir);

 private:
  DType autocast_dtype_ = DType::f32;
  bool scales_loss_ = false;
  optim::LossScaler scaler_;
  std::function<bool(bool)> any_rank_;
};

}  // namespace trainer
