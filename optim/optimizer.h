// Optimizers: SGD and AdamW over named parameter groups, with their state as
// a named set of tensors (checkpoints save it, data parallelism shards it).
//
// The update math lives in core/optim_math.h, shared by every backend; this
// file owns the bookkeeping: parameter groups, per-parameter state, the step
// counters, the learning rate the schedule sets each step, and state I/O.
//
//   std::vector<ParamGroup> groups = {{decay_params}, {no_decay_params, 0.0}};
//   SGD opt(groups, {.lr = 0.1, .momentum = 0.9, .nesterov = true, .weight_decay = 5e-4});
//   for (int64_t step = 0; ...; ++step) {
//     opt.set_lr(schedule.lr(step));
//     loss.backward();
//     opt.step();
//     opt.zero_grad();
//   }
//   save(opt.state());  ...  opt.load_state(load());   // resumes bit for bit
//
// Semantics follow torch.optim: a parameter without a gradient is skipped
// (its state and step counter do not advance); zero_grad sets gradients to
// none by default. Parameters and state are contiguous f32 (the model's
// master weights) or f64 (tests), on the CPU or a GPU. Each step updates all
// parameters of a device at once through the multi-tensor interface of
// core/backend.h (MultiTensorSgd, MultiTensorAdamW), dispatched like any op:
// on CUDA one fused launch, on the CPU OpenMP loops (core/cpu/cpu_optim.cpp),
// under ReferenceKernelsGuard the reference loops (core/ref/ref_optim.cpp).
// The step counters stay on the host.
//
// State names: "<param name>.<slot>", slots "step" (0-d i64: the number of
// updates this parameter has received), "momentum_buffer" (SGD with
// momentum), "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (AdamW, the last with
// amsgrad). Every entry exists from construction (buffers start at zero), so
// the set of names depends only on the parameters and the options.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace trainer::optim {

using trainer::NamedTensor;

struct ParamGroup {
  std::vector<NamedTensor> params;
  // Unset: the optimizer's weight_decay. Recipes put biases and norm weights
  // in a group with 0.
  std::optional<double> weight_decay = std::nullopt;
  // This group's lr is lr() * lr_scale.
  double lr_scale = 1;
};

// All parameter tensors of the groups, in order (for clip_grad_norm, loss scaling).
TensorList parameters(const std::vector<ParamGroup>& groups);

// Sets the gradients of the groups' parameters to none (set_to_none) or to zero in place.
void zero_grads(const std::vector<ParamGroup>& groups, bool set_to_none);

// The interface the training loop steps and checkpoints save, whoever
// keeps the state: LocalOptimizer below (SGD, AdamW) keeps every
// parameter's; ZeRO-1 (parallel/zero.h) keeps this rank's shard of it.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One update of every parameter that has a gradient, in place, not recorded by autograd.
  virtual void step() = 0;
  // Drops the gradients (set_to_none) or fills them with zeros.
  virtual void zero_grad(bool set_to_none = true) = 0;
  // Clips the gradients to a global 2-norm of max_norm (optim/clip.h) and
  // returns the norm before clipping.
  virtual double clip_grad_norm(double max_norm) = 0;

  // The base learning rate; the schedule sets it before each step.
  virtual void set_lr(double lr) = 0;
  virtual double lr() const = 0;

  // The parameter groups it updates.
  virtual const std::vector<ParamGroup>& param_groups() const = 0;

  // The state as named tensors that alias the live buffers (save them before
  // the next step, or clone).
  virtual std::vector<NamedTensor> state() const = 0;
  // Copies a state saved by state() into this optimizer's buffers. The names
  // must match exactly and each entry's shape and dtype; otherwise throws
  // Error naming the entry and changes nothing.
  virtual void load_state(const std::vector<NamedTensor>& state) = 0;
  // The bytes of state() in this process (memory estimates).
  int64_t state_bytes() const;

 protected:
  Optimizer() = default;
};

// An optimizer keeping the state of every parameter in this process: the
// groups, per-parameter state, step counters and state I/O; SGD and AdamW
// add their slots and update math.
class LocalOptimizer : public Optimizer {
 public:
  void step() override;
  void zero_grad(bool set_to_none = true) override;
  double clip_grad_norm(double max_norm) override;
  void set_lr(double lr) override;
  double lr() const override { return lr_; }
  const std::vector<ParamGroup>& param_groups() const override { return groups_; }
  std::vector<NamedTensor> state() const override;
  void load_state(const std::vector<NamedTensor>& state) override;

 protected:
  // Per-parameter state: the step counter and the slots named by state_slots().
  struct ParamState {
    Tensor step;                // 0-d i64
    std::vector<Tensor> slots;  // parameter-shaped, in state_slots() order
  };
  // Checks the groups (unique non-empty names, contiguous f32/f64 tensors)
  // and the lr; the derived constructor then calls init_state().
  LocalOptimizer(std::vector<ParamGroup> groups, double lr, double weight_decay, const char* kind);
  void init_state();

  // The names of the per-parameter state tensors, e.g. {"exp_avg", "exp_avg_sq"}.
  virtual std::vector<std::string> state_slots() const = 0;
  // One parameter's update in this step: step is its update count including
  // this one (1 on the first); param, grad and the slots are contiguous, of
  // one dtype, on one device.
  struct Update {
    Tensor param, grad;
    const std::vector<Tensor>* slots;
    int64_t step;
    double lr, weight_decay;
  };
  // Updates parameters of one device and dtype together (one multi-tensor call).
  virtual void update(Device device, const std::vector<Update>& updates) = 0;

  const char* kind_;  // "SGD", "AdamW": prefixes error messages

 private:
  std::vector<ParamGroup> groups_;
  double lr_;
  double weight_decay_;
  std::vector<std::vector<ParamState>> state_;  // [group][param]
};

// torch.optim.SGD: momentum, dampening, Nesterov, coupled (L2) weight decay.
struct SGDOptions {
  double lr = 0.1;
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;  // needs momentum > 0 and dampening == 0
  double weight_decay = 0;
};

class SGD final : public LocalOptimizer {
 public:
  SGD(std::vector<ParamGroup> groups, const SGDOptions& options);
  const SGDOptions& options() const { return options_; }

 private:
  std::vector<std::string> state_slots() const override;
  void update(Device device, const std::vector<Update>& updates) override;
  SGDOptions options_;
};

// torch.optim.AdamW: decoupled weight decay, bias-corrected moments, optional amsgrad.
struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
};

class AdamW final : public LocalOptimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, const AdamWOptions& options);
  const AdamWOptions& options() const { return options_; }

 private:
  std::vector<std::string> state_slots() const override;
  void update(Device device, const std::vector<Update>& updates) override;
  AdamWOptions options_;
};

}  // namespace trainer::optim
