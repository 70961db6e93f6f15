#include "optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/check.h"

namespace trainer::optim {
namespace {

void require(bool ok, const char* field, const char* rule, double value) {
  if (!ok) throw Error(cat("lr schedule: ", field, " must be ", rule, ", got ", value));
}

}  // namespace

double linear_scaled_lr(double base_lr, int64_t global_batch, int64_t reference_batch) {
  require(global_batch > 0, "global_batch", "> 0", double(global_batch));
  require(reference_batch > 0, "reference_batch", "> 0", double(reference_batch));
  return base_lr * double(global_batch) / double(reference_batch);
}

LrSchedule::LrSchedule(const ScheduleOptions& options) : options_(options) {
  ScheduleOptions& o = options_;
  require(o.base_lr >= 0 && std::isfinite(o.base_lr), "base_lr", ">= 0 and finite", o.base_lr);
  require(o.global_batch >= 0, "global_batch", ">= 0", double(o.global_batch));
  peak_ = o.global_batch > 0 ? linear_scaled_lr(o.base_lr, o.global_batch, o.reference_batch)
                             : o.base_lr;
  require(o.warmup >= 0, "warmup", ">= 0", double(o.warmup));
  require(o.warmup_start_factor >= 0 && o.warmup_start_factor <= 1, "warmup_start_factor",
          "in [0, 1]", o.warmup_start_factor);
  switch (o.kind) {
    case ScheduleKind::constant:
      break;
    case ScheduleKind::step:
      require(o.step_size > 0, "step_size", "> 0 for the step schedule", double(o.step_size));
      require(o.gamma > 0 && std::isfinite(o.gamma), "gamma", "> 0 and finite", o.gamma);
      break;
    case ScheduleKind::multistep:
      require(o.gamma > 0 && std::isfinite(o.gamma), "gamma", "> 0 and finite", o.gamma);
      for (size_t i = 0; i < o.milestones.size(); ++i) {
        require(o.milestones[i] >= 0, "each milestone", ">= 0", double(o.milestones[i]));
        if (i > 0 && o.milestones[i] <= o.milestones[i - 1])
          throw Error(cat("lr schedule: milestones must be strictly increasing, got ",
                          o.milestones[i - 1], " then ", o.milestones[i]));
      }
      break;
    case ScheduleKind::cosine:
      require(o.t_max > 0, "t_max", "> 0 for the cosine schedule", double(o.t_max));
      require(o.min_lr >= 0 && o.min_lr <= peak_, "min_lr", "in [0, peak lr]", o.min_lr);
      break;
  }
  if (o.unit == ScheduleUnit::epochs) {
    require(o.steps_per_epoch > 0, "steps_per_epoch", "> 0 when durations are in epochs",
            double(o.steps_per_epoch));
    const int64_t spe = o.steps_per_epoch;
    o.step_size *= spe;
    for (int64_t& m : o.milestones) m *= spe;
    o.t_max *= spe;
    o.warmup *= spe;
    o.unit = ScheduleUnit::steps;
  }
}

double LrSchedule::main_lr(int64_t t) const {
  const ScheduleOptions& o = options_;
  switch (o.kind) {
    case ScheduleKind::constant:
      return peak_;
    case ScheduleKind::step:
      return peak_ * std::pow(o.gamma, double(t / o.step_size));
    case ScheduleKind::multistep: {
      auto passed =
          std::upper_bound(o.milestones.begin(), o.milestones.end(), t) - o.milestones.begin();
      return peak_ * std::pow(o.gamma, double(passed));
    }
    case ScheduleKind::cosine:
      if (t >= o.t_max) return o.min_lr;
      return o.min_lr + (peak_ - o.min_lr) *
                            (1 + std::cos(std::numbers::pi * double(t) / double(o.t_max))) / 2;
  }
  return peak_;
}

double LrSchedule::warmup_factor(int64_t t) const {
  const ScheduleOptions& o = options_;
  if (t >= o.warmup) return 1.0;
  return o.warmup_start_factor + (1.0 - o.warmup_start_factor) * double(t) / double(o.warmup);
}

double LrSchedule::lr(int64_t t) const {
  CHECK_GE(t, 0) << "lr schedule queried at a negative step";
  return main_lr(t) * warmup_factor(t);
}

}  // namespace trainer::optim
