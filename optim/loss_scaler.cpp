#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "core/autograd.h"
#include "core/backend.h"
#include "core/cpu/loops.h"
#include "core/ops.h"
#include "core/optim_math.h"

namespace trainer::optim {
namespace {

// Elements per task of the unscale loop.
constexpr int64_t kUnscaleBlock = 1 << 16;

void require(bool ok, const char* field, const char* rule, double value) {
  if (!ok) throw Error(cat("loss scaler: ", field, " must be ", rule, ", got ", value));
}

// grad (CPU) *= inv_scale in place; returns whether any element was inf/nan before.
bool unscale_tensor(Tensor grad, double inv_scale) {
  Tensor g = grad.is_contiguous() ? grad : grad.contiguous();
  int64_t n = g.numel();
  int64_t blocks = (n + kUnscaleBlock - 1) / kUnscaleBlock;
  std::vector<char> block_found(size_t(blocks), 0);
  dispatch_floating(g.dtype(), "loss scaler unscale", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    T* p = g.data<T>();
    const A inv = A(inv_scale);
    cpu::parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int non_finite = 0;
        int64_t end = std::min(n, (b + 1) * kUnscaleBlock);
        for (int64_t i = b * kUnscaleBlock; i < end; ++i) {
          A v = load(p[i]);
          non_finite |= !unscale_grad(v, inv);
          p[i] = store_as<T>(v);
        }
        block_found[size_t(b)] = char(non_finite);
      }
    });
  });
  if (g.impl() != grad.impl()) grad.copy_(g);
  return std::any_of(block_found.begin(), block_found.end(), [](char c) { return c != 0; });
}

}  // namespace

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  require(options.init_scale > 0 && std::isfinite(options.init_scale), "init_scale",
          "> 0 and finite", options.init_scale);
  require(options.growth_factor > 1 && std::isfinite(options.growth_factor), "growth_factor",
          "> 1 and finite", options.growth_factor);
  require(options.backoff_factor > 0 && options.backoff_factor < 1, "backoff_factor", "in (0, 1)",
          options.backoff_factor);
  require(options.growth_interval > 0, "growth_interval", "> 0", double(options.growth_interval));
  scale_ = options.enabled ? options.init_scale : 1.0;
}

Tensor LossScaler::scale_loss(const Tensor& loss) const {
  return options_.enabled ? loss * scale_ : loss;
}

bool LossScaler::unscale(Optimizer& optimizer) {
  return unscale(parameters(optimizer.param_groups()));
}

bool LossScaler::unscale(const TensorList& params) {
  if (!options_.enabled || unscaled_) return found_inf_;
  autograd::NoGradGuard no_grad;
  const double inv_scale = 1.0 / scale_;
  bool found = false;
  // Gradients on a GPU: one multi-tensor unscale per device (core/backend.h).
  std::vector<std::pair<Device, TensorList>> on_device;
  for (const Tensor& p : params) {
    Tensor grad = p.grad();
    if (!grad.defined()) continue;
    if (grad.device().is_cpu()) {
      found = unscale_tensor(grad, inv_scale) || found;
      continue;
    }
    CHECK(grad.is_contiguous()) << "loss scaler: a non-contiguous gradient on " << grad.device();
    auto it = std::find_if(on_device.begin(), on_device.end(),
                           [&](const auto& d) { return d.first == grad.device(); });
    if (it == on_device.end()) it = on_device.insert(on_device.end(), {grad.device(), {}});
    it->second.push_back(grad);
  }
  for (const auto& [device, grads] : on_device)
    found = backend(device).unscale_grads(grads, inv_scale) || found;
  unscaled_ = true;
  found_inf_ = found;
  return found_inf_;
}

void LossScaler::set_found_inf(bool found_inf) { found_inf_ = found_inf; }

bool LossScaler::step(Optimizer& optimizer) {
  return step(parameters(optimizer.param_groups()), [&] { optimizer.step(); });
}

bool LossScaler::step(const TensorList& params, const std::function<void()>& optimizer_step) {
  if (unscale(params)) {
    ++skipped_steps_;
    return false;
  }
  optimizer_step();
  return true;
}

void LossScaler::update() {
  if (!options_.enabled) return;
  CHECK(unscaled_) << "LossScaler::update() without unscale() or step() in this iteration";
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    // The scaled loss is f32: keep S where f32 can hold it (as torch does).
    double grown = scale_ * options_.growth_factor;
    if (grown <= double(std::numeric_limits<float>::max())) scale_ = grown;
    growth_tracker_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

std::vector<NamedTensor> LossScaler::state() const {
  return {{"loss_scaler.scale", scalar_tensor(scale_, DType::f64)},
          {"loss_scaler.growth_tracker", scalar_tensor(double(growth_tracker_), DType::i64)},
          {"loss_scaler.skipped_steps", scalar_tensor(double(skipped_steps_), DType::i64)}};
}

void LossScaler::load_state(const std::vector<NamedTensor>& state) {
  const std::map<std::string, DType> expected = {{"loss_scaler.scale", DType::f64},
                                                 {"loss_scaler.growth_tracker", DType::i64},
                                                 {"loss_scaler.skipped_steps", DType::i64}};
  std::map<std::string, Tensor> given;
  for (const NamedTensor& e : state) {
    auto it = expected.find(e.name);
    if (it == expected.end())
      throw Error(cat("loss scaler state: unexpected entry '", e.name, "'"));
    if (!e.tensor.defined() || e.tensor.dim() != 0 || e.tensor.dtype() != it->second)
      throw Error(cat("loss scaler state: entry '", e.name, "' must be a 0-d ", it->second,
                      " tensor, got ",
                      e.tensor.defined() ? cat(e.tensor.dtype(), " ", e.tensor.shape_str())
                                         : std::string("an undefined tensor")));
    if (!given.emplace(e.name, e.tensor).second)
      throw Error(cat("loss scaler state: entry '", e.name, "' appears twice"));
  }
  for (const auto& [name, dtype] : expected)
    if (!given.count(name)) throw Error(cat("loss scaler state: missing entry '", name, "'"));
  double scale = given.at("loss_scaler.scale").item<double>();
  int64_t tracker = given.at("loss_scaler.growth_tracker").item<int64_t>();
  int64_t skipped = given.at("loss_scaler.skipped_steps").item<int64_t>();
  if (!(scale > 0 && std::isfinite(scale)))
    throw Error(cat("loss scaler state: loss_scaler.scale must be > 0 and finite, got ", scale));
  if (tracker < 0 || tracker >= options_.growth_interval)
    throw Error(cat("loss scaler state: loss_scaler.growth_tracker must be in [0, ",
                    options_.growth_interval, "), got ", tracker));
  if (skipped < 0)
    throw Error(cat("loss scaler state: loss_scaler.skipped_steps must be >= 0, got ", skipped));
  scale_ = scale;
  growth_tracker_ = tracker;
  skipped_steps_ = skipped;
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace trainer::optim
