#include "trainer/model_setup.h"

#include <cmath>

#include "models/registry.h"

namespace trainer {

namespace {

int64_t epochs_to_steps(double epochs, int64_t steps_per_epoch) {
  return int64_t(std::llround(epochs * double(steps_per_epoch)));
}

MoEOptions moe_options(const ModelRecipe& m) {
  const MoERecipe& e = m.moe;
  return {.d_model = m.d_model,
          .hidden = e.hidden > 0 ? e.hidden : 4 * m.d_model,
          .experts = std::max<int64_t>(e.experts, 1),
          .top_k = e.top_k,
          .sigmoid = e.score == "sigmoid",
          .normalize_top_k = e.normalize_top_k,
          .capacity_factor = e.capacity_factor,
          .dropless = e.dropless,
          .aux_loss_coef = e.aux_loss_coef,
          .z_loss_coef = e.z_loss_coef,
          .shared_experts = e.shared_experts,
          .bias_update_rate = e.bias_update_rate};
}

RopeOptions rope_options(const ModelRecipe& m) {
  return {.theta = m.rope_theta,
          .scaling = m.rope_scaling,
          .factor = m.rope_factor,
          .low_freq_factor = m.rope_low_freq_factor,
          .high_freq_factor = m.rope_high_freq_factor,
          .original_max_position = m.rope_original_max_position_embeddings};
}

}  // namespace

// vocab: the data's vocabulary size (language models).
std::shared_ptr<Model> build_model(const Recipe& r, int64_t vocab) {
  const ModelRecipe& m = r.model;
  if (is_language_model(m.name) && m.vocab_size > 0 && m.vocab_size < vocab)
    throw Error(cat(r.source, ": model.vocab_size ", m.vocab_size, " is smaller than the ", vocab,
                    " symbols of the corpus's vocabulary; use 0 (the corpus's)"));
  if (m.moe.experts > 0 && m.name != "gpt")
    throw Error(cat(r.source, ": model.moe.experts = ", m.moe.experts,
                    " with model.name = ", m.name,
                    ": mixtures of experts are GPT blocks; use model.name=gpt or "
                    "model.moe.experts=0"));
  if (m.moe.experts > 0 && m.moe.top_k > m.moe.experts)
    throw Error(cat(r.source, ": model.moe.top_k = ", m.moe.top_k, " is more than the ",
                    m.moe.experts, " experts (model.moe.experts); use at most ", m.moe.experts));
  try {
    return make_model(m.name, {.num_classes = m.num_classes,
                               .in_channels = m.in_channels,
                               .image_size = r.data.image_size,
                               .zero_init_residual = m.zero_init_residual,
                               .dropout = m.dropout,
                               .vocab_size = m.vocab_size > 0 ? m.vocab_size : vocab,
                               .context = m.context,
                               .n_layer = m.n_layer,
                               .n_head = m.n_head,
                               .d_model = m.d_model,
                               .hidden = m.hidden,
                               .tie_weights = m.tie_weights,
                               .gelu = m.gelu == "tanh" ? GeluApprox::tanh : GeluApprox::none,
                               .intermediate_size = m.intermediate_size,
                               .n_kv_head = m.num_key_value_heads,
                               .rms_norm_eps = m.rms_norm_eps,
                               .rope = rope_options(m),
                               .moe = moe_options(m),
                               .moe_every = m.moe.experts > 0 ? m.moe.every_n_layers : 0,
                               .seed = uint64_t(r.seed)});
  } catch (const Error& e) {
    throw Error(cat(r.source, ": ", e.what()));  // the message names the model.<key>
  }
}

std::vector<optim::ParamGroup> param_groups(const Recipe& r, const Module& model) {
  if (r.optimizer.decay_norm_and_bias) return {optim::ParamGroup{model.named_parameters()}};
  WeightDecaySplit split = split_weight_decay(model);
  return {optim::ParamGroup{split.decay}, optim::ParamGroup{split.no_decay, 0.0}};
}

std::unique_ptr<optim::Optimizer> make_optimizer(const Recipe& r,
                                                 std::vector<optim::ParamGroup> groups) {
  const OptimizerRecipe& o = r.optimizer;
  if (o.name == "sgd")
    return std::make_unique<optim::SGD>(
        std::move(groups),
        optim::SGDOptions{o.lr, o.momentum, o.dampening, o.nesterov, o.weight_decay});
  optim::AdamWOptions a;
  a.lr = o.lr;
  a.betas = {o.beta1, o.beta2};
  a.eps = o.eps;
  a.weight_decay = o.weight_decay;
  return std::make_unique<optim::AdamW>(std::move(groups), a);
}

optim::ScheduleOptions lr_schedule_options(const Recipe& r, int64_t steps_per_epoch,
                                           int64_t total_steps) {
  const OptimizerRecipe& o = r.optimizer;
  const ScheduleRecipe& s = r.schedule;
  optim::ScheduleOptions so_lr;
  so_lr.kind = s.name == "step"        ? optim::ScheduleKind::step
               : s.name == "multistep" ? optim::ScheduleKind::multistep
               : s.name == "cosine"    ? optim::ScheduleKind::cosine
                                       : optim::ScheduleKind::constant;
  so_lr.base_lr = o.lr;
  so_lr.step_size = std::max<int64_t>(1, epochs_to_steps(s.step_size, steps_per_epoch));
  for (double m : s.milestones) so_lr.milestones.push_back(epochs_to_steps(m, steps_per_epoch));
  so_lr.gamma = s.gamma;
  so_lr.t_max = total_steps;
  so_lr.min_lr = s.min_lr;
  so_lr.warmup = s.warmup_steps + epochs_to_steps(s.warmup_epochs, steps_per_epoch);
  if (o.scale_lr) so_lr.global_batch = r.training.global_batch;
  return so_lr;
}

}  // namespace trainer
