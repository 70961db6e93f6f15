#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/autograd.h"
#include "core/backend.h"
#include "optim/clip.h"

namespace trainer::optim {
namespace {

void require_option(bool ok, const char* kind, const char* field, const char* rule, double value) {
  if (!ok) throw Error(cat(kind, ": ", field, " must be ", rule, ", got ", value));
}

int64_t read_step(const Tensor& step) { return step.data<int64_t>()[0]; }

}  // namespace

TensorList parameters(const std::vector<ParamGroup>& groups) {
  TensorList out;
  for (const ParamGroup& g : groups)
    for (const NamedTensor& p : g.params) out.push_back(p.tensor);
  return out;
}

void zero_grads(const std::vector<ParamGroup>& groups, bool set_to_none) {
  for (const ParamGroup& g : groups)
    for (const NamedTensor& p : g.params) {
      Tensor grad = p.tensor.grad();
      if (!grad.defined()) continue;
      if (set_to_none)
        p.tensor.set_grad(Tensor());
      else
        grad.zero_();
    }
}

LocalOptimizer::LocalOptimizer(std::vector<ParamGroup> groups, double lr, double weight_decay,
                               const char* kind)
    : kind_(kind), groups_(std::move(groups)), weight_decay_(weight_decay) {
  set_lr(lr);
  require_option(weight_decay >= 0 && std::isfinite(weight_decay), kind_, "weight_decay",
                 ">= 0 and finite", weight_decay);
  std::set<std::string> names;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const ParamGroup& g = groups_[gi];
    std::string where = cat("param group ", gi);
    if (g.weight_decay && !(*g.weight_decay >= 0 && std::isfinite(*g.weight_decay)))
      throw Error(
          cat(kind_, ": ", where, ": weight_decay must be >= 0 and finite, got ", *g.weight_decay));
    if (!(g.lr_scale >= 0 && std::isfinite(g.lr_scale)))
      throw Error(cat(kind_, ": ", where, ": lr_scale must be >= 0 and finite, got ", g.lr_scale));
    for (const NamedTensor& p : g.params) {
      if (p.name.empty()) throw Error(cat(kind_, ": ", where, " has a parameter without a name"));
      if (!names.insert(p.name).second)
        throw Error(cat(kind_, ": parameter '", p.name, "' appears twice in the param groups"));
      const Tensor& t = p.tensor;
      if (!t.defined())
        throw Error(cat(kind_, ": parameter '", p.name, "' is an undefined tensor"));
      if (t.dtype() != DType::f32 && t.dtype() != DType::f64)
        throw Error(cat(kind_, ": parameter '", p.name, "' is ", t.dtype(),
                        "; optimizers update f32 (or f64) master weights"));
      if (!t.is_contiguous())
        throw Error(cat(kind_, ": parameter '", p.name, "' is not contiguous (shape ",
                        t.shape_str(), ", strides ", shape_str(t.strides()), ")"));
    }
  }
}

void LocalOptimizer::init_state() {
  std::vector<std::string> slots = state_slots();
  state_.clear();
  for (const ParamGroup& g : groups_) {
    std::vector<ParamState>& group_state = state_.emplace_back();
    for (const NamedTensor& p : g.params) {
      ParamState s;
      s.step = zeros({}, DType::i64);
      for (size_t k = 0; k < slots.size(); ++k) s.slots.push_back(zeros_like(p.tensor));
      group_state.push_back(std::move(s));
    }
  }
}

void LocalOptimizer::set_lr(double lr) {
  require_option(lr >= 0 && std::isfinite(lr), kind_, "lr", ">= 0 and finite", lr);
  lr_ = lr;
}

void LocalOptimizer::step() {
  autograd::NoGradGuard no_grad;
  // Per device and dtype, in parameter order (one multi-tensor call each).
  std::vector<std::pair<std::pair<Device, DType>, std::vector<Update>>> batches;
  std::vector<ParamState*> stepped;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const ParamGroup& g = groups_[gi];
    double lr = lr_ * g.lr_scale;
    double weight_decay = g.weight_decay.value_or(weight_decay_);
    for (size_t pi = 0; pi < g.params.size(); ++pi) {
      const NamedTensor& p = g.params[pi];
      Tensor grad = p.tensor.grad();
      if (!grad.defined()) continue;
      const Device device = p.tensor.device();
      if (grad.shape() != p.tensor.shape() || grad.dtype() != p.tensor.dtype() ||
          grad.device() != device)
        throw Error(cat(kind_, ": the gradient of '", p.name, "' is ", grad.dtype(), " ",
                        grad.shape_str(), " on ", grad.device(), ", expected ", p.tensor.dtype(),
                        " ", p.tensor.shape_str(), " on ", device));
      ParamState& s = state_[gi][pi];
      const std::pair<Device, DType> key{device, p.tensor.dtype()};
      auto it = std::find_if(batches.begin(), batches.end(),
                             [&](const auto& b) { return b.first == key; });
      if (it == batches.end()) it = batches.insert(batches.end(), {key, {}});
      it->second.push_back({p.tensor, grad.is_contiguous() ? grad : grad.contiguous(), &s.slots,
                            read_step(s.step) + 1, lr, weight_decay});
      stepped.push_back(&s);
    }
  }
  for (const auto& [key, updates] : batches) update(key.first, updates);
  for (ParamState* s : stepped) s->step.data<int64_t>()[0] += 1;
}

void LocalOptimizer::zero_grad(bool set_to_none) { zero_grads(groups_, set_to_none); }

double LocalOptimizer::clip_grad_norm(double max_norm) {
  return optim::clip_grad_norm(parameters(groups_), max_norm);
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const NamedTensor& t : state()) bytes += int64_t(t.tensor.nbytes());
  return bytes;
}

std::vector<NamedTensor> LocalOptimizer::state() const {
  std::vector<std::string> slots = state_slots();
  std::vector<NamedTensor> out;
  for (size_t gi = 0; gi < groups_.size(); ++gi)
    for (size_t pi = 0; pi < groups_[gi].params.size(); ++pi) {
      const std::string& name = groups_[gi].params[pi].name;
      const ParamState& s = state_[gi][pi];
      out.push_back({name + ".step", s.step});
      for (size_t k = 0; k < slots.size(); ++k) out.push_back({name + "." + slots[k], s.slots[k]});
    }
  return out;
}

void LocalOptimizer::load_state(const std::vector<NamedTensor>& state) {
  std::vector<NamedTensor> live = this->state();
  std::map<std::string, const Tensor*> given;
  for (const NamedTensor& e : state)
    if (!given.emplace(e.name, &e.tensor).second)
      throw Error(cat(kind_, " state: entry '", e.name, "' appears twice"));
  std::set<std::string> known;
  for (const NamedTensor& e : live) known.insert(e.name);
  for (const NamedTensor& e : state)
    if (!known.count(e.name))
      throw Error(cat(kind_, " state: unexpected entry '", e.name,
                      "' (no such parameter or slot in this optimizer; was it saved with "
                      "other options or another model?)"));
  // Validate everything before touching a buffer.
  for (const NamedTensor& e : live) {
    auto it = given.find(e.name);
    if (it == given.end()) throw Error(cat(kind_, " state: missing entry '", e.name, "'"));
    const Tensor& t = *it->second;
    if (!t.defined()) throw Error(cat(kind_, " state: entry '", e.name, "' is undefined"));
    if (t.shape() != e.tensor.shape() || t.dtype() != e.tensor.dtype())
      throw Error(cat(kind_, " state: entry '", e.name, "' is ", t.dtype(), " ", t.shape_str(),
                      ", expected ", e.tensor.dtype(), " ", e.tensor.shape_str()));
    if (e.tensor.dim() == 0 && e.tensor.dtype() == DType::i64 && t.item<int64_t>() < 0)
      throw Error(cat(kind_, " state: entry '", e.name, "' is a negative step count (",
                      t.item<int64_t>(), ")"));
  }
  for (NamedTensor& e : live) e.tensor.copy_(*given.at(e.name));
}

// ---- SGD ----

SGD::SGD(std::vector<ParamGroup> groups, const SGDOptions& options)
    : LocalOptimizer(std::move(groups), options.lr, options.weight_decay, "SGD"),
      options_(options) {
  require_option(options.momentum >= 0 && std::isfinite(options.momentum), kind_, "momentum",
                 ">= 0 and finite", options.momentum);
  require_option(std::isfinite(options.dampening), kind_, "dampening", "finite", options.dampening);
  if (options.nesterov && (options.momentum <= 0 || options.dampening != 0))
    throw Error(cat("SGD: nesterov needs momentum > 0 and dampening == 0, got momentum ",
                    options.momentum, ", dampening ", options.dampening));
  init_state();
}

std::vector<std::string> SGD::state_slots() const {
  if (options_.momentum == 0) return {};
  return {"momentum_buffer"};
}

void SGD::update(Device device, const std::vector<Update>& updates) {
  MultiTensorSgd a;
  a.momentum = options_.momentum;
  a.dampening = options_.dampening;
  a.nesterov = options_.nesterov;
  for (const Update& u : updates) {
    a.params.push_back(u.param);
    a.grads.push_back(u.grad);
    if (!u.slots->empty()) a.momentum_buffers.push_back((*u.slots)[0]);
    a.lr.push_back(u.lr);
    a.weight_decay.push_back(u.weight_decay);
    a.step.push_back(u.step);
  }
  backend(device).sgd_step(a);
}

// ---- AdamW ----

AdamW::AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options)
    : LocalOptimizer(std::move(groups), options.lr, options.weight_decay, "AdamW"),
      options_(options) {
  require_option(options.betas.first >= 0 && options.betas.first < 1, kind_, "betas[0]",
                 "in [0, 1)", options.betas.first);
  require_option(options.betas.second >= 0 && options.betas.second < 1, kind_, "betas[1]",
                 "in [0, 1)", options.betas.second);
  require_option(options.eps >= 0 && std::isfinite(options.eps), kind_, "eps", ">= 0 and finite",
                 options.eps);
  init_state();
}

std::vector<std::string> AdamW::state_slots() const {
  if (options_.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}

void AdamW::update(Device device, const std::vector<Update>& updates) {
  MultiTensorAdamW a;
  a.beta1 = options_.betas.first;
  a.beta2 = options_.betas.second;
  a.eps = options_.eps;
  a.amsgrad = options_.amsgrad;
  for (const Update& u : updates) {
    a.params.push_back(u.param);
    a.grads.push_back(u.grad);
    a.exp_avg.push_back((*u.slots)[0]);
    a.exp_avg_sq.push_back((*u.slots)[1]);
    if (options_.amsgrad) a.max_exp_avg_sq.push_back((*u.slots)[2]);
    a.lr.push_back(u.lr);
    a.weight_decay.push_back(u.weight_decay);
    a.step.push_back(u.step);
  }
  backend(device).adamw_step(a);
}

}  // namespace trainer::optim
