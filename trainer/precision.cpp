#include "trainer/precision.h"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "data/files.h"
#include "trainer/checkpoint.h"
#include "trainer/safetensors.h"

namespace trainer {

namespace {

optim::LossScalerOptions scaler_options(const Recipe& r) {
  optim::LossScalerOptions o;
  o.enabled = r.precision == "fp16";
  o.init_scale = r.loss_scaler.init_scale;
  o.growth_factor = r.loss_scaler.growth_factor;
  o.backoff_factor = r.loss_scaler.backoff_factor;
  o.growth_interval = r.loss_scaler.growth_interval;
  return o;
}

DType autocast_dtype_of(const Recipe& r) {
  if (r.precision == "bf16") return DType::bf16;
  if (r.precision == "fp16") return DType::f16;
  if (r.precision == "fp32") return DType::f32;
  throw Error(cat(r.source, ": precision '", r.precision, "': expected fp32, bf16 or fp16"));
}

optim::LossScaler make_scaler(const Recipe& r) {
  try {
    return optim::LossScaler(scaler_options(r));
  } catch (const Error& e) {
    throw Error(cat(r.source, ": ", e.what()));
  }
}

}  // namespace

Precision::Precision(const Recipe& recipe, bool sharded_optimizer)
    : autocast_dtype_(autocast_dtype_of(recipe)),
      scales_loss_(recipe.precision == "fp16"),
      scaler_(make_scaler(recipe)) {
  if (scales_loss_ && sharded_optimizer)
    throw Error(cat(recipe.source,
                    ": precision 'fp16' with parallel.zero1 on several ranks: the loss scaler "
                    "checks every gradient, which no rank holds; use precision: bf16 (no "
                    "scaling) or parallel.zero1: false"));
}

Tensor Precision::scale_loss(const Tensor& loss) const { return scaler_.scale_loss(loss); }

bool Precision::step(const TensorList& params, const std::function<void()>& optimizer_step) {
  if (scales_loss_ && any_rank_) scaler_.set_found_inf(any_rank_(scaler_.unscale(params)));
  return scaler_.step(params, optimizer_step);
}

void Precision::update() { scaler_.update(); }

Scalars Precision::scalars() const {
  if (!scales_loss_) return {};
  return {{"loss_scale", scale()}, {"skipped_steps", double(skipped_steps())}};
}

void Precision::save(const std::string& dir) const {
  if (scales_loss_) write_safetensors(loss_scaler_file(dir), scaler_.state());
}

void Precision::load(const std::string& dir) {
  if (!scales_loss_) return;
  const std::string path = loss_scaler_file(dir);
  if (const std::string why = data::not_a_regular_file(path); !why.empty()) {
    if (why == std::strerror(ENOENT))
      throw Error(cat(path,
                      ": missing; the checkpoint was not written by a precision: fp16 run "
                      "(resume it with its own precision)"));
    throw Error(cat(path, ": ", why,
                    "; the loss scaler's state must be a regular file (fix it, or resume an "
                    "earlier checkpoint)"));
  }
  SafetensorsFile f = read_safetensors(path);
  std::vector<NamedTensor> state;
  for (const auto& [name, t] : f.tensors) state.push_back({name, t});
  try {
    scaler_.load_state(state);
  } catch (const Error& e) {
    throw Error(cat(path, ": ", e.what()));
  }
}

}  // namespace trainer
