// What a recipe builds before any parallelism splits it: the model, the
// optimizer's parameter groups and the optimizer itself, and the
// learning-rate schedule. Session builds with these; ZeRO-1 and parameter
// servers make their local optimizers with make_optimizer.
#pragma once

#include <memory>
#include <vector>

#include "layers/block_list.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "trainer/recipe.h"

namespace trainer {

// The recipe's model; vocab is the data's vocabulary size (language models).
// Throws Error naming the recipe's file and the model.<key>.
std::shared_ptr<Model> build_model(const Recipe& recipe, int64_t vocab);
// The recipe's parameter groups: one, or with weight decay and without it
// (norm weights and biases) unless optimizer.decay_norm_and_bias.
std::vector<optim::ParamGroup> param_groups(const Recipe& recipe, const Module& model);
// The recipe's optimizer (optimizer.name: SGD or AdamW) over groups.
std::unique_ptr<optim::Optimizer> make_optimizer(const Recipe& recipe,
                                                 std::vector<optim::ParamGroup> groups);
// The tokens of a language model's training window: data.seq_len, or
// model.context when it is 0.
inline int64_t window_tokens(const Recipe& r) {
  return r.data.seq_len > 0 ? r.data.seq_len : r.model.context;
}
// The recipe's learning-rate schedule (schedule.*, epochs counted in steps).
optim::ScheduleOptions lr_schedule_options(const Recipe& recipe, int64_t steps_per_epoch,
                                           int64_t total_steps);

}  // namespace trainer
