// Learning-rate schedules as pure functions of the optimizer step, so a run
// resumed at step t gets exactly the lr it would have had.
//
//   ScheduleOptions o;
//   o.kind = ScheduleKind::multistep;  o.base_lr = 0.1;  o.global_batch = 1024;  // lr 0.4
//   o.unit = ScheduleUnit::epochs;     o.steps_per_epoch = 1251;
//   o.milestones = {30, 60, 80};       o.warmup = 5;  o.warmup_start_factor = 0.25;
//   LrSchedule schedule(o);
//   for (int64_t step = 0; ...; ++step) { opt.set_lr(schedule.lr(step)); ... }
//
// Glossary: t is the optimizer step counted from 0 (the lr of the first
// update is lr(0)); peak = base_lr, times global_batch / reference_batch when
// the linear scaling rule is on.
//
// Main schedules (clock t from 0):
//   constant   peak
//   step       peak * gamma^floor(t / step_size)
//   multistep  peak * gamma^(number of milestones <= t)       (torch's MultiStepLR)
//   cosine     min_lr + (peak - min_lr) * (1 + cos(pi * t / t_max)) / 2 for t < t_max,
//              then min_lr (the floor; torch's closed form would rise again)
//
// Warmup multiplies the main schedule; both clocks start at step 0:
//   lr(t) = main(t) * f(t),  f(t) = s + (1 - s) * t / warmup for t < warmup, else 1
// with s = warmup_start_factor. This is torch's ChainedScheduler of
// LinearLR(start_factor = s, total_iters = warmup) with the main schedule: lr
// is continuous at the end of warmup and milestones, step_size and t_max keep
// their meaning whether or not there is a warmup (Goyal et al.'s 5 warmup
// epochs then decay at epochs 30, 60, 80; a cosine that ends at t_max).
//
// Durations (step_size, milestones, t_max, warmup) are in `unit`; epochs are
// converted once to steps with steps_per_epoch, so step and multistep
// boundaries fall on the first step of an epoch and the cosine moves every
// step (not once per epoch as a per-epoch torch scheduler would).
#pragma once

#include <cstdint>
#include <vector>

namespace trainer::optim {

enum class ScheduleKind { constant, step, multistep, cosine };
enum class ScheduleUnit { steps, epochs };

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::constant;
  double base_lr = 0.1;
  ScheduleUnit unit = ScheduleUnit::steps;  // of step_size, milestones, t_max and warmup
  int64_t steps_per_epoch = 0;              // needed when unit == epochs

  int64_t step_size = 0;                 // step
  std::vector<int64_t> milestones = {};  // multistep: strictly increasing
  double gamma = 0.1;                    // step, multistep: decay factor
  int64_t t_max = 0;                     // cosine: length of the decay
  double min_lr = 0;                     // cosine: the floor (torch's eta_min), not scaled

  int64_t warmup = 0;                      // 0: no warmup
  double warmup_start_factor = 1.0 / 3.0;  // f(0), in [0, 1] (torch LinearLR's default)

  int64_t global_batch = 0;  // > 0: the linear scaling rule on base_lr
  int64_t reference_batch = 256;
};

// The linear scaling rule (Goyal et al.): base_lr * global_batch / reference_batch.
double linear_scaled_lr(double base_lr, int64_t global_batch, int64_t reference_batch = 256);

class LrSchedule {
 public:
  // Validates the options (Error naming the field and value) and converts
  // epochs to steps.
  explicit LrSchedule(const ScheduleOptions& options);

  // The learning rate of optimizer step t (t >= 0).
  double lr(int64_t t) const;
  // base_lr after the linear scaling rule.
  double peak_lr() const { return peak_; }
  // The options with every duration in steps (unit == steps).
  const ScheduleOptions& resolved() const { return options_; }

 private:
  double main_lr(int64_t t) const;
  double warmup_factor(int64_t t) const;

  ScheduleOptions options_;
  double peak_;
};

}  // namespace trainer::optim
