// Module: the base of every layer and model. It owns named parameters
// (trainable leaves), buffers (state saved in checkpoints but not trained,
// e.g. batch-norm running statistics) and submodules, and names them the way
// PyTorch's state_dict does, so checkpoints interoperate:
//
//   layer1.0.conv1.weight   bn1.running_mean   bn1.num_batches_tracked
//
//   class Block : public Module {
//    public:
//     explicit Block(Generator& gen) {
//       conv = register_module("conv", std::make_shared<Conv2d>(Conv2dOptions{3, 8, 3}, gen));
//       bn = register_module("bn", std::make_shared<BatchNorm2d>(8));
//     }
//     Tensor forward(const Tensor& x) override { return relu_channels_last((*bn)((*conv)(x))); }
//     std::shared_ptr<Conv2d> conv;
//     std::shared_ptr<BatchNorm2d> bn;
//   };
//
// Registration order is the order of named_parameters(), as in PyTorch.
// train()/eval() set the mode of the whole tree. Modules are held by
// shared_ptr and are not copyable (a copy would alias the parameters).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace trainer {

// How tensor parallelism (layers/tensor_parallel.h) splits a parameter (or a
// buffer: a channel-split batch norm's running statistics) over a group of
// `size` ranks. sharded: along dim, in `parts` equal pieces (c_attn's q, k
// and v: 3) each cut into size slices; rank r holds slice r of every piece,
// concatenated, and the checkpoint the whole tensor. partial_gradient
// (parameters only): every rank holds the whole tensor, but its gradient is
// this rank's share of the sum (LayerNorm under sequence parallelism): the
// group adds them up.
struct ParameterSplit {
  enum class Kind { sharded, partial_gradient } kind = Kind::sharded;
  int dim = 0;
  int parts = 1;
  int rank = 0;
  int size = 1;
};

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Single-tensor layers and models implement forward; operator() calls it.
  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }

  // Recursive, in registration order, with dotted names. A tensor
  // registered under two names (a tied weight) is listed once, under the
  // first, as torch's named_parameters(); state() lists it under both.
  std::vector<NamedTensor> named_parameters() const;
  std::vector<NamedTensor> named_buffers() const;
  // Parameters and buffers in state_dict order (each module's parameters,
  // its buffers, then its submodules): everything a checkpoint holds.
  std::vector<NamedTensor> state() const;
  TensorList parameters() const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }
  // Elements over all parameters.
  int64_t num_parameters() const;

  // Sets the mode of this module and all its submodules.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Drops every parameter's gradient.
  void zero_grad();

  // The parameters and buffers tensor parallelism split (by global name; the
  // others are replicated: the same values and gradients on every rank of
  // the group). Buffers are listed too so that checkpoints gather them whole
  // (parallel::gather_whole); code after gradients looks parameters up in it.
  std::map<std::string, ParameterSplit> parameter_splits() const;

  // Calls fn on this module and every submodule, parents first (torch's apply).
  void apply(const std::function<void(Module&)>& fn);

  // Before a checkpoint's tensors (read from file) load by name: renames
  // those written under this model's older names to its current ones and
  // checks the copies of a tied tensor agree (throws Error naming the file
  // and both names otherwise). Optimizer files go through it too: their
  // entries are named "<parameter>.<slot>", so a prefix rename covers them.
  // The default keeps the tensors as they are.
  virtual void upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                                    const std::string& file) const;

 protected:
  // Marks t as trainable and records it under name; returns t.
  Tensor register_parameter(const std::string& name, Tensor t);
  Tensor register_buffer(const std::string& name, Tensor t);
  // Puts t in the place of parameter `name` (marked trainable; its old
  // tensor is no longer listed) and records how it was split (tensor
  // parallelism); returns t. The layer updates its own member.
  Tensor replace_parameter(const std::string& name, Tensor t,
                           std::optional<ParameterSplit> split = std::nullopt);
  // The same for buffer `name` (kept untrained); split must be sharded.
  Tensor replace_buffer(const std::string& name, Tensor t,
                        std::optional<ParameterSplit> split = std::nullopt);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }
  // Drops submodule `name` (its tensors are no longer listed); false when absent.
  bool remove_child(const std::string& name);

 private:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  // replace_parameter and replace_buffer over their list of members.
  Tensor replace_member(std::vector<NamedTensor>& members, const char* kind,
                        const std::string& name, Tensor t,
                        const std::optional<ParameterSplit>& split);
  void collect(const std::string& prefix, bool params, bool buffers,
               std::vector<NamedTensor>& out) const;

  std::vector<NamedTensor> params_, buffers_;
  std::map<std::string, ParameterSplit> splits_;  // own parameters and buffers
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  bool training_ = true;
};

// A chain of modules named "0", "1", ... (torch.nn.Sequential).
class Sequential : public Module {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Module>> modules);
  void push_back(std::shared_ptr<Module> m);
  size_t size() const { return children().size(); }
  Module& operator[](size_t i) const { return *children()[i].second; }
  Tensor forward(const Tensor& x) override;
};

// Named submodules without a forward of their own (torch.nn.ModuleDict):
// GPT's "transformer" holding wte, wpe, h and ln_f.
class ModuleDict : public Module {
 public:
  template <class M>
  std::shared_ptr<M> add(const std::string& name, std::shared_ptr<M> m) {
    return register_module(name, std::move(m));
  }
  bool remove(const std::string& name) { return remove_child(name); }
  Tensor forward(const Tensor& x) override;
};

// Parameters split for weight decay: biases and normalisation weights (every
// parameter with at most one dim) go to no_decay, the rest to decay. Recipes
// give no_decay a weight decay of 0.
struct WeightDecaySplit {
  std::vector<NamedTensor> decay, no_decay;
};
WeightDecaySplit split_weight_decay(const Module& m);

// Some of another module's parameters under their names there, as a module
// of their own: a block member for part of a module (layer k of a stacked
// LSTM, whose parameters PyTorch names rnn.weight_ih_l{k} with no module of
// their own). A pipeline stage holding several parts of one module lists
// them under one prefix (parallel/pipeline.h StageModule).
class ModulePart : public Module {
 public:
  explicit ModulePart(const std::vector<NamedTensor>& parameters);
  // A part has no computation of its own: CHECK-fails.
  Tensor forward(const Tensor& x) override;
};

}  // namespace trainer
