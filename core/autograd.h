// Define-by-run autograd (docs/architecture.md "Autograd").
//
// Each differentiable op is a struct with a typed Saved, a forward and a
// backward; apply<Op>(args...) runs forward and, when grad mode is on and an
// input requires a gradient, records a node that owns the Saved. backward()
// walks the recorded graph in reverse creation order, sums the gradients
// arriving at each node before running it, and frees each node's Saved once
// it has run (unless retain_graph). The same API defines the built-in ops and
// custom ones (tensor-parallel and communication ops):
//
//   struct ScaleOp {
//     struct Saved { double k; };
//     static constexpr const char* name = "scale";
//     static Tensor forward(Saved& s, const Tensor& x, double k) { s.k = k; return x * k; }
//     static TensorList backward(Saved& s, const TensorList& grad_out, const GradMask&) {
//       return {grad_out[0] * s.k};
//     }
//   };
//   Tensor y = autograd::apply<ScaleOp>(x, 3.0);
//
// Rules for an Op:
//   - forward runs with grad mode off and may return a Tensor or a TensorList;
//   - Saved holds only what backward needs; output tensors may be saved
//     (apply hands the caller a separate handle, so there is no cycle);
//   - backward gets one gradient per output (undefined where an output got
//     none: treat as zeros) and returns one per tensor input, in argument
//     order (TensorList arguments contribute one per element); entries whose
//     GradMask bit is false may be left undefined;
//   - backward runs with grad mode off (no double backward).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/tensor.h"

namespace trainer::autograd {

bool grad_enabled();
void set_grad_enabled(bool enabled);

// Disables recording in its scope (evaluation, optimizer updates).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Which inputs of a node need a gradient.
class GradMask {
 public:
  GradMask() = default;
  explicit GradMask(std::vector<bool> bits) : bits_(std::move(bits)) {}
  bool operator[](size_t i) const { return i < bits_.size() && bits_[i]; }
  size_t size() const { return bits_.size(); }

 private:
  std::vector<bool> bits_;
};

struct Edge {
  std::shared_ptr<class Node> node;  // null: the input needs no gradient
  uint32_t input_nr = 0;
};

class Node {
 public:
  virtual ~Node() = default;
  virtual const char* name() const = 0;
  // Gradients of the inputs from gradients of the outputs.
  virtual TensorList apply(const TensorList& grad_outputs) = 0;
  // As apply, for the inputs mask selects (a subset of needs_input_grad());
  // the split backward runs a node once per half with each half's mask. A
  // node that cannot restrict its work computes every gradient (the engine
  // drops the ones the mask leaves out).
  virtual TensorList apply_masked(const TensorList& grad_outputs, const GradMask&) {
    return apply(grad_outputs);
  }
  // Frees what forward saved.
  virtual void release_saved() {}

  const std::vector<Edge>& next_edges() const { return next_; }
  uint64_t sequence_nr() const { return sequence_nr_; }
  uint32_t num_outputs() const { return num_outputs_; }
  GradMask needs_input_grad() const;

  void set_next_edges(std::vector<Edge> next) { next_ = std::move(next); }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; }
  void set_output_meta(uint32_t i, const Tensor& out);
  // Shape, dtype and device of output i, to make zeros where no gradient arrived.
  Tensor zeros_for_output(uint32_t i) const;

 protected:
  Node();

 private:
  std::vector<Edge> next_;
  uint64_t sequence_nr_;
  uint32_t num_outputs_ = 1;
  struct OutputMeta {
    Shape shape;
    DType dtype;
    Device device;
  };
  std::vector<OutputMeta> output_meta_;
};

// The gradient sink of a leaf: accumulates into grad() and fires its hooks.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor leaf) : leaf_(std::move(leaf)) {}
  const char* name() const override { return "AccumulateGrad"; }
  TensorList apply(const TensorList& grad_outputs) override;
  const Tensor& leaf() const { return leaf_; }

 private:
  Tensor leaf_;
};

// A buffer for the gradient of input i of the node whose backward is
// running, which backward then fills whole: the leaf's grad destination
// (Tensor::set_grad_destination) when the engine offers it for that input
// and it has this shape, dtype and device, else a new empty tensor. The
// engine offers a destination only where the input is a leaf with no
// gradient yet and this node is the only one sending it one, so nothing
// else writes there during the pass.
Tensor grad_buffer(size_t input, const Shape& shape, DType dtype, Device device);

// The edge that carries a gradient into t: its grad_fn, or its leaf's accumulator.
Edge gradient_edge(const Tensor& t);

// Runs the backward pass from roots with the given gradients.
void run_backward(const TensorList& roots, const TensorList& grads, bool retain_graph);

// ---- split backward (zero-bubble pipeline schedules) ----
//
// A pipeline stage's backward in two separately scheduled halves, as ZB-H1
// needs: "I" computes the gradients of the stage's inputs (sent at once to
// the previous stage), "W", run later, the gradients of its weights.
//
//   Tensor x = received_activation.detach().requires_grad_();   // stage input
//   Tensor y = stage(x);
//   SplitBackward split = run_backward_input({y}, {grad_y}, {x});  // I
//   send(split.input_grads[0]);
//   ...                                                          // other I/F steps
//   split.weight_grads.run();                                    // W: parameters' .grad()
//
// Glossary. Input path: the nodes on some path from the roots to an input's
// gradient edge. Input edge: an edge of an input-path node into another
// input-path node; weight edge: any other edge of it, which leads only to
// leaves that are not inputs (parameters) or to nothing.
//
// I runs the input-path nodes, each with its mask restricted to its input
// edges, in the order run_backward would run them. W runs, again in that
// order, every input-path node that has weight edges (with its mask
// restricted to them, on the gradients it received in I) and every node not
// on the input path. Contributions to a node's gradient therefore arrive in
// run_backward's order: I followed by W gives the same bits as run_backward,
// parameters' .grad() and the input gradients alike, also when .grad()
// already holds earlier micro-batches' gradients (I1, I2, W1, W2 accumulates
// as backward1, backward2). Grad destinations are offered and leaves' hooks
// fire in W, as in run_backward. An op whose backward ignores its mask
// computes its weight gradients in I too (then dropped) and its input
// gradients again in W; the results are the same.
//
// Memory: until W runs (or the handle is destroyed), the graph's nodes that
// W will run stay alive with their saved tensors, and so do the output
// gradients each input-path node with weight edges received in I. Input-path
// nodes without weight edges free their saved tensors in I (unless
// retain_graph), W's nodes once W has run them. W reads the roots' grads
// and what arrived from them, which may share memory with the returned input
// gradients: modify neither in place before W has run (receive the next
// micro-batch's gradient into a fresh tensor, send a returned one as is).

// The weight half of a split backward, made by run_backward_input; runs once.
class DeferredWeightGrads {
 public:
  DeferredWeightGrads();
  ~DeferredWeightGrads();
  DeferredWeightGrads(DeferredWeightGrads&&) noexcept;
  DeferredWeightGrads& operator=(DeferredWeightGrads&&) noexcept;
  DeferredWeightGrads(const DeferredWeightGrads&) = delete;
  DeferredWeightGrads& operator=(const DeferredWeightGrads&) = delete;

  // Computes the deferred gradients: accumulates into the parameters'
  // .grad() (or their grad destinations) and fires their hooks.
  void run();
  // Whether W has no node to run (nothing but inputs needed a gradient).
  bool empty() const;

  // What run_backward_input leaves for W (defined in autograd.cpp).
  struct State;
  explicit DeferredWeightGrads(std::unique_ptr<State> state);

 private:
  std::unique_ptr<State> state_;
  bool ran_ = false;
};

struct SplitBackward {
  TensorList input_grads;  // one per input, in inputs' order
  DeferredWeightGrads weight_grads;
};

// The I half: backward from roots with grads, returning the gradients of
// inputs (tensors that require a gradient, typically leaves the pipeline made
// from received activations) and deferring the rest into weight_grads.
// Inputs' gradients are returned, not accumulated into their .grad(), and
// their hooks do not fire. Every input must be reachable from the roots (a
// CHECK fails otherwise: a stage input its outputs do not depend on is a
// partitioning error); one the ops sent no gradient gets zeros. grads are
// as run_backward's (an undefined one sends nothing: no implicit ones for a
// scalar loss); retain_graph keeps every node's saved tensors after W.
SplitBackward run_backward_input(const TensorList& roots, const TensorList& grads,
                                 const TensorList& inputs, bool retain_graph = false);

// ---- activation checkpointing ----
//
// checkpoint(options, inputs) runs options.fn(inputs), keeps its outputs'
// values and only its inputs, and records one node for it; the node's
// backward runs fn again (grad mode on, under the first run's autocast
// dtype) from the inputs as fresh leaves and backpropagates the output
// gradients through that graph, as torch.utils.checkpoint does. The first
// run records its graph like a plain one (the same kernels, so the recompute
// gives the same bits: an LSTM's inference kernel would not) and drops it
// when checkpoint returns, so one function's activations are alive at a
// time. The parameters that graph reaches become inputs of the node: the
// nested pass returns their gradients to the engine instead of accumulating
// them, so they are summed with other contributions (a tied weight) and
// accumulated, hooks firing, as without the checkpoint: the same bits.
//
//   TensorList y = autograd::checkpoint({.fn = block_fn, .save_state = save_generators}, {x});
//
// fn must compute the same outputs when run again from the same inputs; the
// state it reads or changes besides them (dropout generators, batch norm's
// running statistics) is save_state's: called before the first run and again
// right before the recompute, it returns a function that puts that state back
// as it was then. The recompute so draws the first run's dropout masks and
// leaves every generator and buffer as it found it. fn reads no tensor with
// a graph other than its inputs (a CHECK fails otherwise). A split backward
// (run_backward_input) recomputes the function in each half.
struct CheckpointOptions {
  std::function<TensorList(const TensorList&)> fn = {};
  std::function<std::function<void()>()> save_state = {};
};
// Without grad mode: fn(inputs), recording nothing.
TensorList checkpoint(const CheckpointOptions& options, const TensorList& inputs);

// ---- defining ops ----

template <class Op>
class OpNode final : public Node {
 public:
  const char* name() const override { return Op::name; }
  TensorList apply(const TensorList& grad_outputs) override {
    check_saved();
    return Op::backward(saved, grad_outputs, needs_input_grad());
  }
  TensorList apply_masked(const TensorList& grad_outputs, const GradMask& mask) override {
    check_saved();
    return Op::backward(saved, grad_outputs, mask);
  }
  void release_saved() override {
    saved = typename Op::Saved{};
    released_ = true;
  }
  typename Op::Saved saved{};

 private:
  void check_saved() const {
    CHECK(!released_) << Op::name
                      << ": backward through a graph whose saved tensors were freed; "
                         "pass retain_graph=true to the first backward";
  }
  bool released_ = false;
};

namespace detail {
inline void collect_inputs(TensorList&) {}
template <class A, class... Rest>
void collect_inputs(TensorList& out, const A& a, const Rest&... rest) {
  using D = std::decay_t<A>;
  if constexpr (std::is_same_v<D, Tensor>) {
    out.push_back(a);
  } else if constexpr (std::is_same_v<D, TensorList>) {
    out.insert(out.end(), a.begin(), a.end());
  }
  collect_inputs(out, rest...);
}
// A fresh handle on the same data, so Saved may hold forward's result.
Tensor alias_for_output(const Tensor& t);
bool any_requires_grad(const TensorList& inputs);
// run_backward, except that the nodes of captures are not run: the gradient
// each would get is returned (one per capture, undefined where none arrived)
// and no grad destination is offered for them (activation checkpointing).
TensorList run_graph(const TensorList& roots, const TensorList& grads, bool retain_graph,
                     const std::vector<Edge>& captures);
void connect(Node& node, const TensorList& inputs);
}  // namespace detail

template <class Op, class... Args>
auto apply(const Args&... args) {
  using Result = decltype(Op::forward(std::declval<typename Op::Saved&>(), args...));
  static_assert(std::is_same_v<Result, Tensor> || std::is_same_v<Result, TensorList>,
                "Op::forward returns Tensor or TensorList");
  TensorList inputs;
  detail::collect_inputs(inputs, args...);
  if (!grad_enabled() || !detail::any_requires_grad(inputs)) {
    typename Op::Saved unused{};
    return Op::forward(unused, args...);
  }
  auto node = std::make_shared<OpNode<Op>>();
  Result result;
  {
    NoGradGuard no_grad;
    result = Op::forward(node->saved, args...);
  }
  detail::connect(*node, inputs);
  auto wire = [&](const Tensor& out, uint32_t i) {
    node->set_output_meta(i, out);
    if (!is_floating(out.dtype())) return out;  // indices carry no gradient
    Tensor alias = detail::alias_for_output(out);
    AutogradMeta& m = alias.impl()->meta();
    m.grad_fn = node;
    m.output_nr = i;
    m.requires_grad = true;
    return alias;
  };
  if constexpr (std::is_same_v<Result, Tensor>) {
    node->set_num_outputs(1);
    return wire(result, 0);
  } else {
    node->set_num_outputs(uint32_t(result.size()));
    TensorList outs;
    for (uint32_t i = 0; i < result.size(); ++i) outs.push_back(wire(result[i], i));
    return outs;
  }
}

}  // namespace trainer::autograd
