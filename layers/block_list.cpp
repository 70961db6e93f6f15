#include "layers/block_list.h"

#include <algorithm>
#include <map>
#include <set>

#include "core/autograd.h"
#include "layers/linear.h"

namespace trainer {

namespace {

size_t index_of(const std::vector<std::string>& names, const std::string& name) {
  return size_t(std::find(names.begin(), names.end(), name) - names.begin());
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return index_of(names, name) < names.size();
}

// The tensors of the members of blocks [first, last) under their global
// names, each member's in Module::named_parameters() or (with_buffers)
// Module::state() order. A tensor met twice keeps only its first name unless
// every_name.
std::vector<NamedTensor> collect(const std::vector<BlockSpec>& blocks, size_t first, size_t last,
                                 bool with_buffers, bool every_name) {
  std::vector<NamedTensor> out;
  std::set<const TensorImpl*> seen;
  for (size_t b = first; b < last; ++b)
    for (const BlockMember& m : blocks[b].members)
      for (const NamedTensor& t : with_buffers ? m.module->state() : m.module->named_parameters())
        if (seen.insert(t.tensor.impl()).second || every_name)
          out.push_back({m.prefix + "." + t.name, t.tensor});
  return out;
}

// The state block reads or changes besides its inputs, saved now: the
// generators of the dropout layers under root (the whole model: a block may
// run a layer's dropout without listing it, as the LSTM's layers do), or
// its members' without a root, and its members' buffers (batch norm's
// running statistics). The function returned puts them back.
std::function<void()> save_block_state(const BlockSpec& block, Module* root) {
  std::vector<std::pair<Dropout*, Generator>> generators;
  std::vector<std::pair<Tensor, Tensor>> buffers;  // the buffer, its value now
  auto add_generators = [&](Module& module) {
    if (auto* d = dynamic_cast<Dropout*>(&module)) generators.emplace_back(d, d->generator());
  };
  if (root) root->apply(add_generators);
  for (const BlockMember& m : block.members) {
    if (!root) m.module->apply(add_generators);
    for (const NamedTensor& b : m.module->named_buffers())
      buffers.emplace_back(b.tensor, b.tensor.clone());
  }
  return [generators = std::move(generators), buffers = std::move(buffers)] {
    for (const auto& [dropout, generator] : generators) dropout->generator() = generator;
    autograd::NoGradGuard no_grad;
    for (const auto& [buffer, value] : buffers) {
      Tensor target = buffer;  // a handle on the module's tensor
      target.copy_(value);
    }
  };
}

}  // namespace

BlockList::BlockList(std::vector<std::string> model_inputs, std::vector<std::string> model_outputs,
                     std::vector<BlockSpec> blocks)
    : blocks_(std::move(blocks)) {
  // One slot per distinct name, in order of first appearance.
  std::vector<std::string> names = model_inputs;
  auto slot = [&](const std::string& name) {
    size_t i = index_of(names, name);
    if (i == names.size()) names.push_back(name);
    return i;
  };
  for (const BlockSpec& b : blocks_) {
    CHECK(b.fn) << "block '" << b.name << "' has no function";
    Slots s;
    for (const std::string& n : b.inputs) s.in.push_back(slot(n));
    for (const std::string& n : b.outputs) s.out.push_back(slot(n));
    slots_.push_back(std::move(s));
  }
  num_slots_ = names.size();

  // Liveness, from the end: live before block i = (live after it - what it
  // writes) + what it reads.
  boundaries_.resize(blocks_.size() + 1);
  std::vector<bool> live(num_slots_, false);
  for (const std::string& n : model_outputs) live[slot(n)] = true;
  CHECK(names.size() == num_slots_) << "a model output is never written";
  auto fill = [&](size_t i) {
    for (size_t k = 0; k < num_slots_; ++k)
      if (live[k]) {
        boundaries_[i].names.push_back(names[k]);
        boundaries_[i].slots.push_back(k);
      }
  };
  fill(blocks_.size());
  for (size_t i = blocks_.size(); i-- > 0;) {
    for (size_t k : slots_[i].out) live[k] = false;
    for (size_t k : slots_[i].in) live[k] = true;
    fill(i);
  }
  for (const std::string& n : boundaries_[0].names)
    CHECK(contains(model_inputs, n)) << "'" << n << "' is read before any block writes it";
  // The model's own order for its inputs and outputs.
  boundaries_[0].names = model_inputs;
  boundaries_[0].slots.clear();
  for (const std::string& n : model_inputs) boundaries_[0].slots.push_back(index_of(names, n));
  boundaries_.back().names = model_outputs;
  boundaries_.back().slots.clear();
  for (const std::string& n : model_outputs) boundaries_.back().slots.push_back(index_of(names, n));

  // Tied parameters: one tensor under two global names in different blocks.
  std::map<const TensorImpl*, std::pair<std::string, size_t>> first_name;
  for (size_t b = 0; b < blocks_.size(); ++b)
    for (const NamedTensor& t : collect(blocks_, b, b + 1, false, true)) {
      auto [it, added] = first_name.emplace(t.tensor.impl(), std::make_pair(t.name, b));
      if (!added && it->second.first != t.name)
        tied_.push_back({t.name, it->second.first, b, it->second.second});
    }
}

TensorList BlockList::run(size_t first, size_t last, const TensorList& inputs) const {
  CHECK(first <= last && last <= blocks_.size())
      << "blocks [" << first << ", " << last << ") of " << blocks_.size();
  const Boundary& in = boundaries_[first];
  CHECK(inputs.size() == in.slots.size()) << "blocks from " << first << " take " << in.slots.size()
                                          << " tensors, got " << inputs.size();
  TensorList slots(num_slots_);
  for (size_t k = 0; k < inputs.size(); ++k) slots[in.slots[k]] = inputs[k];
  TensorList block_in;
  for (size_t b = first; b < last; ++b) {
    const Slots& s = slots_[b];
    block_in.clear();
    for (size_t k : s.in) block_in.push_back(slots[k]);
    TensorList block_out = call(0, b, block_in);
    CHECK(block_out.size() == s.out.size())
        << "block '" << blocks_[b].name << "' returned " << block_out.size()
        << " tensors, declares " << s.out.size();
    for (size_t k = 0; k < s.out.size(); ++k) slots[s.out[k]] = std::move(block_out[k]);
  }
  TensorList out;
  for (size_t k : boundaries_[last].slots) out.push_back(slots[k]);
  return out;
}

TensorList BlockList::call(size_t w, size_t b, const TensorList& inputs) const {
  if (w == wrappers_.size()) return blocks_[b].fn(inputs);
  const BlockFn next = [this, w, b](const TensorList& in) { return call(w + 1, b, in); };
  return wrappers_[w].run(blocks_[b], inputs, next);
}

void BlockList::add_wrapper(BlockWrapper wrapper, bool outermost) {
  CHECK(wrapper.run) << "block wrapper '" << wrapper.name << "' without a function";
  for (BlockWrapper& w : wrappers_)
    if (w.name == wrapper.name) {
      w = std::move(wrapper);
      return;
    }
  wrappers_.insert(outermost ? wrappers_.begin() : wrappers_.end(), std::move(wrapper));
}

void BlockList::remove_wrapper(const std::string& name) {
  std::erase_if(wrappers_, [&](const BlockWrapper& w) { return w.name == name; });
}

bool BlockList::has_wrapper(const std::string& name) const {
  return std::any_of(wrappers_.begin(), wrappers_.end(),
                     [&](const BlockWrapper& w) { return w.name == name; });
}

void BlockList::set_recompute(bool on, Module* dropout_root) {
  if (!on) return remove_wrapper("recompute");
  add_wrapper({.name = "recompute",
               .run = [dropout_root](const BlockSpec& block, const TensorList& inputs,
                                     const BlockFn& next) {
                 if (!autograd::grad_enabled()) return next(inputs);
                 return autograd::checkpoint(
                     {.fn = next,
                      .save_state =
                          [&block, dropout_root] { return save_block_state(block, dropout_root); }},
                     inputs);
               }});
}

std::vector<NamedTensor> BlockList::named_parameters(size_t first, size_t last) const {
  return collect(blocks_, first, last, /*with_buffers=*/false, /*every_name=*/false);
}

std::vector<NamedTensor> BlockList::state(size_t first, size_t last) const {
  return collect(blocks_, first, last, /*with_buffers=*/true, /*every_name=*/true);
}

void Model::shard_tensor_parallel(std::shared_ptr<TensorParallelGroup>) {
  throw Error("this model has no tensor-parallel form; use parallel.tp = 1");
}

void Model::set_context_parallel(std::shared_ptr<ContextParallelGroup>) {
  throw Error("this model has no context-parallel form (GPT and Llama have); use parallel.cp = 1");
}

Tensor Model::output_loss(const Tensor& logits, const Tensor& targets,
                          const CrossEntropyOptions& options) const {
  return cross_entropy(logits, targets, options);
}

Tensor Model::forward(const Tensor& x) {
  CHECK(blocks_.boundary(0).size() == 1 && blocks_.boundary(blocks_.size()).size() == 1)
      << "forward(x) of a model with " << blocks_.boundary(0).size() << " inputs and "
      << blocks_.boundary(blocks_.size()).size() << " outputs";
  return blocks_.run({x})[0];
}

}  // namespace trainer
