#include "layers/module.h"

#include <algorithm>
#include <set>

namespace trainer {

namespace {

void check_name(const std::string& name, const std::vector<std::string>& taken) {
  CHECK(!name.empty() && name.find('.') == std::string::npos)
      << "module member name '" << name << "' must be non-empty and contain no '.'";
  CHECK(std::find(taken.begin(), taken.end(), name) == taken.end())
      << "module member '" << name << "' registered twice";
}

}  // namespace

Tensor Module::register_parameter(const std::string& name, Tensor t) {
  CHECK(t.defined()) << "parameter '" << name << "' is undefined";
  std::vector<std::string> taken;
  for (const NamedTensor& p : params_) taken.push_back(p.name);
  check_name(name, taken);
  t.requires_grad_();
  params_.push_back({name, t});
  return t;
}

Tensor Module::replace_member(std::vector<NamedTensor>& members, const char* kind,
                              const std::string& name, Tensor t,
                              const std::optional<ParameterSplit>& split) {
  CHECK(t.defined()) << kind << " '" << name << "' is undefined";
  auto it = std::find_if(members.begin(), members.end(),
                         [&](const NamedTensor& m) { return m.name == name; });
  CHECK(it != members.end()) << "no " << kind << " '" << name << "' to replace";
  it->tensor = t;
  if (split)
    splits_[name] = *split;
  else
    splits_.erase(name);
  return t;
}

Tensor Module::replace_parameter(const std::string& name, Tensor t,
                                 std::optional<ParameterSplit> split) {
  if (t.defined()) t.requires_grad_();
  return replace_member(params_, "parameter", name, std::move(t), split);
}

Tensor Module::replace_buffer(const std::string& name, Tensor t,
                              std::optional<ParameterSplit> split) {
  CHECK(!split || split->kind == ParameterSplit::Kind::sharded)
      << "buffer '" << name << "': only a sharded split applies to a buffer";
  return replace_member(buffers_, "buffer", name, std::move(t), split);
}

std::map<std::string, ParameterSplit> Module::parameter_splits() const {
  std::map<std::string, ParameterSplit> out;
  for (const auto& [name, split] : splits_) out.emplace(name, split);
  for (const auto& [prefix, child] : children_)
    for (const auto& [name, split] : child->parameter_splits())
      out.emplace(prefix + "." + name, split);
  return out;
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  CHECK(t.defined()) << "buffer '" << name << "' is undefined";
  std::vector<std::string> taken;
  for (const NamedTensor& b : buffers_) taken.push_back(b.name);
  check_name(name, taken);
  buffers_.push_back({name, t});
  return t;
}

bool Module::remove_child(const std::string& name) {
  auto it = std::find_if(children_.begin(), children_.end(),
                         [&](const auto& c) { return c.first == name; });
  if (it == children_.end()) return false;
  children_.erase(it);
  return true;
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  CHECK(m != nullptr) << "submodule '" << name << "' is null";
  std::vector<std::string> taken;
  for (const auto& c : children_) taken.push_back(c.first);
  check_name(name, taken);
  m->train(training_);
  children_.emplace_back(name, std::move(m));
}

void Module::collect(const std::string& prefix, bool params, bool buffers,
                     std::vector<NamedTensor>& out) const {
  if (params)
    for (const NamedTensor& t : params_) out.push_back({prefix + t.name, t.tensor});
  if (buffers)
    for (const NamedTensor& t : buffers_) out.push_back({prefix + t.name, t.tensor});
  for (const auto& [name, child] : children_)
    child->collect(prefix + name + ".", params, buffers, out);
}

std::vector<NamedTensor> Module::named_parameters() const {
  std::vector<NamedTensor> all, out;
  collect("", true, false, all);
  std::set<const TensorImpl*> seen;
  for (NamedTensor& p : all)
    if (seen.insert(p.tensor.impl()).second) out.push_back(std::move(p));
  return out;
}

std::vector<NamedTensor> Module::named_buffers() const {
  std::vector<NamedTensor> out;
  collect("", false, true, out);
  return out;
}

std::vector<NamedTensor> Module::state() const {
  std::vector<NamedTensor> out;
  collect("", true, true, out);
  return out;
}

TensorList Module::parameters() const {
  TensorList out;
  for (const NamedTensor& p : named_parameters()) out.push_back(p.tensor);
  return out;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const NamedTensor& p : named_parameters()) n += p.tensor.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (const auto& c : children_) c.second->train(on);
}

void Module::zero_grad() {
  for (const NamedTensor& p : named_parameters()) p.tensor.set_grad(Tensor());
}

void Module::apply(const std::function<void(Module&)>& fn) {
  fn(*this);
  for (const auto& c : children_) c.second->apply(fn);
}

void Module::upgrade_loaded_state(std::map<std::string, Tensor>&, const std::string&) const {}

Tensor ModuleDict::forward(const Tensor&) {
  CHECK(false) << "a ModuleDict has no forward; call its members";
  return Tensor();
}

Sequential::Sequential(std::vector<std::shared_ptr<Module>> modules) {
  for (auto& m : modules) push_back(std::move(m));
}

void Sequential::push_back(std::shared_ptr<Module> m) {
  register_module(std::to_string(children().size()), std::move(m));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& c : children()) y = c.second->forward(y);
  return y;
}

WeightDecaySplit split_weight_decay(const Module& m) {
  WeightDecaySplit split;
  for (NamedTensor& p : m.named_parameters())
    (p.tensor.dim() <= 1 ? split.no_decay : split.decay).push_back(std::move(p));
  return split;
}

ModulePart::ModulePart(const std::vector<NamedTensor>& parameters) {
  for (const NamedTensor& p : parameters) register_parameter(p.name, p.tensor);
}

Tensor ModulePart::forward(const Tensor&) {
  CHECK(false) << "a module part holds parameters only; its module computes with them";
  return {};
}

}  // namespace trainer
