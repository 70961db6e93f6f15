// Activation checkpointing (core/autograd.h checkpoint()): a piece of the
// forward run without keeping its graph, run again in backward.
#include "core/autograd.h"

#include <algorithm>
#include <unordered_set>

#include "core/autocast.h"
#include "core/ops.h"

namespace trainer::autograd {

namespace {

// Sets grad mode in its scope (the recompute records inside a backward).
class GradModeScope {
 public:
  explicit GradModeScope(bool enabled) : previous_(grad_enabled()) { set_grad_enabled(enabled); }
  ~GradModeScope() { set_grad_enabled(previous_); }
  GradModeScope(const GradModeScope&) = delete;
  GradModeScope& operator=(const GradModeScope&) = delete;

 private:
  bool previous_;
};

// Inputs as fn sees them in both runs: fresh leaves where a gradient is
// wanted (needs[i]), the values as they are elsewhere.
TensorList fresh_leaves(const TensorList& inputs, const std::vector<bool>& needs) {
  TensorList leaves;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor leaf = inputs[i].defined() ? inputs[i].detach() : inputs[i];
    if (needs[i]) leaf.requires_grad_();
    leaves.push_back(std::move(leaf));
  }
  return leaves;
}

// The leaves outside `inputs` that a gradient from outputs reaches (the
// parameters fn read), each once, in the order a depth-first walk meets
// them. A node made before first_node is a graph fn did not make: a tensor
// it read that has history of its own, which the checkpoint cannot own.
TensorList parameters_reached(const TensorList& outputs, const TensorList& inputs,
                              uint64_t first_node) {
  std::unordered_set<const TensorImpl*> own;
  for (const Tensor& t : inputs)
    if (t.defined()) own.insert(t.impl());
  TensorList params;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  auto visit = [&](const Edge& e) {
    if (e.node && seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  };
  for (const Tensor& t : outputs)
    if (t.defined() && t.requires_grad()) visit(gradient_edge(t));
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<AccumulateGrad*>(n)) {
      if (!own.count(acc->leaf().impl())) params.push_back(acc->leaf());
      continue;
    }
    CHECK(n->sequence_nr() >= first_node)
        << "checkpoint: the function read a tensor with a graph of its own (through " << n->name()
        << "); pass it as an input";
    for (const Edge& e : n->next_edges()) visit(e);
  }
  return params;
}

// The node of a checkpointed function: its inputs are fn's inputs, then the
// parameters its first run reached; its outputs fn's outputs.
class CheckpointNode final : public Node {
 public:
  explicit CheckpointNode(const CheckpointOptions& options)
      : fn_(options.fn), save_state_(options.save_state), autocast_(autocast_dtype()) {
    if (save_state_) restore_first_run_ = save_state_();
  }
  const char* name() const override { return "checkpoint"; }

  void keep(const TensorList& inputs, std::vector<bool> needs, TensorList params) {
    // Detached handles: the values, without holding their graphs.
    for (const Tensor& t : inputs) inputs_.push_back(t.defined() ? t.detach() : t);
    needs_ = std::move(needs);
    params_ = std::move(params);
  }

  TensorList apply(const TensorList& grad_outputs) override {
    CHECK(fn_) << "checkpoint: backward through a graph whose saved inputs were freed; "
                  "pass retain_graph=true to the first backward";
    // The recompute, from fresh leaves, in the first run's state (grad mode
    // on, the first run's autocast), leaving the state as it found it.
    const TensorList leaves = fresh_leaves(inputs_, needs_);
    TensorList outputs;
    {
      std::function<void()> restore_now = save_state_ ? save_state_() : std::function<void()>();
      if (restore_first_run_) restore_first_run_();
      {
        GradModeScope grad_mode(true);
        AutocastGuard autocast(autocast_.value_or(DType::f32));
        outputs = fn_(leaves);
      }
      if (restore_now) restore_now();
    }
    CHECK_EQ(outputs.size(), size_t(num_outputs()))
        << "checkpoint: the recompute returned another number of tensors";
    TensorList roots, grads;
    for (size_t k = 0; k < outputs.size(); ++k)
      if (k < grad_outputs.size() && grad_outputs[k].defined() && outputs[k].defined() &&
          outputs[k].requires_grad()) {
        roots.push_back(outputs[k]);
        grads.push_back(grad_outputs[k]);
      }
    // The gradients of the leaves and parameters come back instead of accumulating.
    std::vector<Edge> captures;
    for (size_t i = 0; i < leaves.size(); ++i)
      captures.push_back(needs_[i] ? gradient_edge(leaves[i]) : Edge{});
    for (const Tensor& p : params_) captures.push_back(gradient_edge(p));
    if (roots.empty()) return TensorList(captures.size());
    return detail::run_graph(roots, grads, /*retain_graph=*/false, captures);
  }

  void release_saved() override {
    fn_ = {};
    save_state_ = {};
    restore_first_run_ = {};
    inputs_.clear();
    params_.clear();
  }

 private:
  std::function<TensorList(const TensorList&)> fn_;
  std::function<std::function<void()>()> save_state_;
  std::function<void()> restore_first_run_;
  std::optional<DType> autocast_;
  TensorList inputs_, params_;
  std::vector<bool> needs_;
};

}  // namespace

TensorList checkpoint(const CheckpointOptions& options, const TensorList& inputs) {
  CHECK(options.fn) << "checkpoint without a function";
  if (!grad_enabled()) return options.fn(inputs);
  // Made first: it saves the state the first run starts from, and runs
  // (by its sequence number) after every node fn's consumers make.
  auto node = std::make_shared<CheckpointNode>(options);
  std::vector<bool> needs(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    needs[i] = inputs[i].defined() && inputs[i].requires_grad();
  const TensorList leaves = fresh_leaves(inputs, needs);
  // The first run records its graph as a plain one would (the same kernels,
  // so the same bits as the recompute), to find the parameters it reaches;
  // the graph is dropped when this returns.
  const TensorList result = options.fn(leaves);
  TensorList params = parameters_reached(result, leaves, node->sequence_nr() + 1);
  const bool any_output_grad = std::any_of(result.begin(), result.end(), [](const Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  if (!any_output_grad) return result;  // nothing to differentiate: no graph to keep

  TensorList connected = inputs;
  connected.insert(connected.end(), params.begin(), params.end());
  detail::connect(*node, connected);
  node->keep(inputs, std::move(needs), std::move(params));
  node->set_num_outputs(uint32_t(result.size()));
  TensorList outs;
  for (uint32_t i = 0; i < result.size(); ++i) {
    const Tensor& out = result[i];
    if (!out.defined()) {
      outs.push_back(out);
      continue;
    }
    node->set_output_meta(i, out);
    Tensor value = out.detach();
    if (!is_floating(out.dtype())) {
      outs.push_back(value);
      continue;
    }
    Tensor alias = detail::alias_for_output(value);
    AutogradMeta& m = alias.impl()->meta();
    m.grad_fn = node;
    m.output_nr = i;
    m.requires_grad = true;
    outs.push_back(std::move(alias));
  }
  return outs;
}

}  // namespace trainer::autograd
