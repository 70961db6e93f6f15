#include "core/autograd.h"

#include <algorithm>
#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "core/autocast.h"
#include "core/ops.h"

namespace trainer::autograd {

namespace {
thread_local bool t_grad_enabled = true;
std::atomic<uint64_t> g_next_sequence_nr{0};
// The grad destinations offered to the backward running on this thread, by input.
thread_local const TensorList* t_destinations = nullptr;
}  // namespace

bool grad_enabled() { return t_grad_enabled; }
void set_grad_enabled(bool enabled) { t_grad_enabled = enabled; }

Node::Node() : sequence_nr_(g_next_sequence_nr.fetch_add(1)) {}

GradMask Node::needs_input_grad() const {
  std::vector<bool> bits(next_.size());
  for (size_t i = 0; i < next_.size(); ++i) bits[i] = next_[i].node != nullptr;
  return GradMask(std::move(bits));
}

void Node::set_output_meta(uint32_t i, const Tensor& out) {
  if (output_meta_.size() <= i) output_meta_.resize(i + 1);
  output_meta_[i] = OutputMeta{out.shape(), out.dtype(), out.device()};
}

Tensor Node::zeros_for_output(uint32_t i) const {
  CHECK_LT(i, output_meta_.size());
  const OutputMeta& m = output_meta_[i];
  return zeros(m.shape, m.dtype, m.device);
}

TensorList AccumulateGrad::apply(const TensorList& grad_outputs) {
  const Tensor& g = grad_outputs[0];
  AutogradMeta& m = leaf_.impl()->meta();
  if (g.defined()) {
    CHECK(g.shape() == leaf_.shape())
        << "gradient of shape " << g.shape_str() << " for a leaf of shape " << leaf_.shape_str();
    if (!m.grad.defined() && m.grad_destination.defined()) {
      // Written there by grad_buffer, or copied.
      if (g.data_ptr() != m.grad_destination.data_ptr()) m.grad_destination.copy_(g);
      m.grad = m.grad_destination;
    } else if (!m.grad.defined()) {
      // Take the gradient when nothing else refers to it; otherwise copy, so
      // later in-place accumulation never writes into another tensor.
      bool sole_owner = g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 &&
                        g.is_contiguous() && g.dtype() == leaf_.dtype();
      m.grad = sole_owner ? g.detach() : g.to(leaf_.dtype()).detach().clone();
    } else {
      add_(m.grad, g);
    }
  }
  for (const GradHook& hook : m.hooks) hook(leaf_);
  return {};
}

Tensor grad_buffer(size_t input, const Shape& shape, DType dtype, Device device) {
  if (t_destinations && input < t_destinations->size()) {
    const Tensor& d = (*t_destinations)[input];
    if (d.defined() && d.shape() == shape && d.dtype() == dtype && d.device() == device) return d;
  }
  return empty(shape, dtype, device);
}

Edge gradient_edge(const Tensor& t) {
  TensorImpl* impl = t.impl();
  if (impl->autograd && impl->autograd->grad_fn)
    return Edge{impl->autograd->grad_fn, impl->autograd->output_nr};
  if (!t.requires_grad()) return Edge{};
  AutogradMeta& m = impl->meta();
  std::shared_ptr<Node> acc = m.grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t);
    m.grad_accumulator = acc;
  }
  return Edge{acc, 0};
}

namespace detail {

Tensor alias_for_output(const Tensor& t) {
  return make_view(t, t.shape(), t.strides(), t.offset());
}

bool any_requires_grad(const TensorList& inputs) {
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void connect(Node& node, const TensorList& inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(t.defined() ? gradient_edge(t) : Edge{});
  node.set_next_edges(std::move(edges));
}

}  // namespace detail

namespace {

// Gradients arriving at one node, summed per output slot.
struct InputBuffer {
  TensorList grads;
  void add(uint32_t slot, const Tensor& g) {
    if (!g.defined()) return;
    if (grads.size() <= slot) grads.resize(slot + 1);
    if (!grads[slot].defined())
      grads[slot] = g;
    else
      grads[slot] = trainer::add(grads[slot], g);
  }
};

// For each input of node: its leaf's grad destination, where the input is a
// leaf that has no gradient and whose only gradient in this pass comes from
// node (one edge into its accumulator, none arrived yet); else undefined.
void offer_destinations(const Node& node, const std::unordered_map<Node*, int>& dependencies,
                        const std::unordered_map<Node*, InputBuffer>& buffers,
                        TensorList& destinations) {
  destinations.clear();
  const std::vector<Edge>& edges = node.next_edges();
  for (size_t i = 0; i < edges.size(); ++i) {
    const auto* acc = dynamic_cast<const AccumulateGrad*>(edges[i].node.get());
    if (!acc) continue;
    const AutogradMeta* m = acc->leaf().impl()->autograd.get();
    if (!m || !m->grad_destination.defined() || m->grad.defined()) continue;
    if (dependencies.at(edges[i].node.get()) != 1 || buffers.count(edges[i].node.get())) continue;
    destinations.resize(edges.size());
    destinations[i] = m->grad_destination;
  }
}

// Makes destinations what grad_buffer sees while a node's backward runs.
// (Nested: a checkpoint's recompute runs a backward inside a node's.)
struct OfferScope {
  explicit OfferScope(const TensorList& destinations) : previous_(t_destinations) {
    t_destinations = &destinations;
  }
  ~OfferScope() { t_destinations = previous_; }
  OfferScope(const OfferScope&) = delete;
  OfferScope& operator=(const OfferScope&) = delete;

 private:
  const TensorList* previous_;
};

struct ReadyOrder {
  // Latest-created node first: reverse of the forward, as PyTorch does, so
  // parameter hooks fire from the last layer to the first.
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

bool is_captured(const Node& node, const std::vector<Edge>& captures) {
  return std::any_of(captures.begin(), captures.end(),
                     [&](const Edge& e) { return e.node.get() == &node; });
}

std::vector<Edge> root_edges_of(const TensorList& roots) {
  std::vector<Edge> root_edges;
  for (const Tensor& r : roots) {
    if (!r.requires_grad())
      throw Error("backward() on a tensor that does not require grad and has no grad_fn");
    root_edges.push_back(gradient_edge(r));
  }
  return root_edges;
}

// For every node reachable from the roots, the number of edges that lead into it.
std::unordered_map<Node*, int> count_dependencies(const std::vector<Edge>& root_edges) {
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack;
  for (const Edge& e : root_edges) {
    if (dependencies.emplace(e.node.get(), 0).second) stack.push_back(e.node.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.node) continue;
      auto [it, inserted] = dependencies.emplace(e.node.get(), 0);
      ++it->second;
      if (inserted) stack.push_back(e.node.get());
    }
  }
  return dependencies;
}

}  // namespace

namespace {

// run_backward, except that the nodes of captures are not run: the gradient
// each would get is returned (one per capture, undefined where none arrived)
// and no grad destination is offered for them.
TensorList run_graph(const TensorList& roots, const TensorList& grads, bool retain_graph,
                     const std::vector<Edge>& captures) {
  CHECK_EQ(roots.size(), grads.size());
  NoGradGuard no_grad;
  // Backward ops follow the dtypes forward chose (core/autocast.h).
  AutocastGuard no_autocast(DType::f32);
  TensorList captured(captures.size());

  std::vector<Edge> root_edges = root_edges_of(roots);
  std::unordered_map<Node*, int> dependencies = count_dependencies(root_edges);

  std::unordered_map<Node*, InputBuffer> buffers;
  TensorList destinations;
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, ReadyOrder> ready;
  for (size_t i = 0; i < roots.size(); ++i) {
    buffers[root_edges[i].node.get()].add(root_edges[i].input_nr, grads[i]);
  }
  for (const Edge& e : root_edges) {
    if (dependencies[e.node.get()] == 0) {
      dependencies[e.node.get()] = -1;  // queued
      ready.push(e.node);
    }
  }

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    TensorList in = std::move(buffers[node.get()].grads);
    buffers.erase(node.get());
    in.resize(node->num_outputs());
    if (is_captured(*node, captures)) {
      for (size_t c = 0; c < captures.size(); ++c)
        if (captures[c].node == node) captured[c] = in[captures[c].input_nr];
      continue;
    }
    // A node no gradient reached contributes nothing (and fires no hooks).
    bool reached = std::any_of(in.begin(), in.end(), [](const Tensor& g) { return g.defined(); });
    TensorList out;
    if (reached) {
      offer_destinations(*node, dependencies, buffers, destinations);
      for (size_t i = 0; i < destinations.size(); ++i)
        if (destinations[i].defined() && is_captured(*node->next_edges()[i].node, captures))
          destinations[i] = Tensor();
      OfferScope offered(destinations);
      out = node->apply(in);
    }
    if (!retain_graph) node->release_saved();

    const std::vector<Edge>& edges = node->next_edges();
    CHECK(out.empty() || out.size() == edges.size())
        << node->name() << " returned " << out.size() << " gradients for " << edges.size()
        << " inputs";
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node) continue;
      if (i < out.size()) buffers[e.node.get()].add(e.input_nr, out[i]);
      if (--dependencies[e.node.get()] == 0) ready.push(e.node);
    }
  }
  return captured;
}

}  // namespace

void run_backward(const TensorList& roots, const TensorList& grads, bool retain_graph) {
  run_graph(roots, grads, retain_graph, {});
}

// ---- split backward ----

namespace {

// The nodes reachable from the roots in the order run_backward runs them
// (its ready queue, without running anything).
std::vector<std::shared_ptr<Node>> backward_order(const std::vector<Edge>& root_edges,
                                                  std::unordered_map<Node*, int> dependencies) {
  std::vector<std::shared_ptr<Node>> order;
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, ReadyOrder> ready;
  for (const Edge& e : root_edges) {
    if (dependencies[e.node.get()] == 0) {
      dependencies[e.node.get()] = -1;  // queued
      ready.push(e.node);
    }
  }
  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    for (const Edge& e : node->next_edges())
      if (e.node && --dependencies[e.node.get()] == 0) ready.push(e.node);
    order.push_back(std::move(node));
  }
  return order;
}

// The nodes on some path from the roots to one of targets (order is
// topological: an edge's node comes after the node that has the edge).
std::unordered_set<Node*> nodes_leading_to(const std::vector<std::shared_ptr<Node>>& order,
                                           std::unordered_set<Node*> targets) {
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (targets.count(it->get())) continue;
    for (const Edge& e : (*it)->next_edges()) {
      if (e.node && targets.count(e.node.get())) {
        targets.insert(it->get());
        break;
      }
    }
  }
  return targets;
}

bool any_defined(const TensorList& grads) {
  return std::any_of(grads.begin(), grads.end(), [](const Tensor& g) { return g.defined(); });
}

void check_gradient_count(const Node& node, const TensorList& out) {
  CHECK(out.empty() || out.size() == node.next_edges().size())
      << node.name() << " returned " << out.size() << " gradients for " << node.next_edges().size()
      << " inputs";
}

// One node W runs: one off the input path, on the gradients W sends it, or
// an input-path node with weight edges, again, on the gradients it got in I.
struct WeightStep {
  std::shared_ptr<Node> node;
  bool on_input_path = false;
  GradMask weight_edges;    // input-path nodes: the edges W follows
  TensorList grad_outputs;  // input-path nodes: what arrived in I
};

}  // namespace

struct DeferredWeightGrads::State {
  std::vector<WeightStep> steps;  // in run_backward's order
  // Gradients already arrived (the roots' own, at nodes off the input path).
  std::unordered_map<Node*, InputBuffer> buffers;
  // Edges not yet followed into each node, as run_backward counts them: W
  // follows every edge into a node off the input path, so grad destinations
  // are offered as run_backward offers them.
  std::unordered_map<Node*, int> dependencies;
  bool retain_graph = false;
};

DeferredWeightGrads::DeferredWeightGrads() = default;
DeferredWeightGrads::DeferredWeightGrads(std::unique_ptr<State> state) : state_(std::move(state)) {}
DeferredWeightGrads::~DeferredWeightGrads() = default;
DeferredWeightGrads::DeferredWeightGrads(DeferredWeightGrads&&) noexcept = default;
DeferredWeightGrads& DeferredWeightGrads::operator=(DeferredWeightGrads&&) noexcept = default;

bool DeferredWeightGrads::empty() const { return !state_ || state_->steps.empty(); }

void DeferredWeightGrads::run() {
  CHECK(!ran_) << "DeferredWeightGrads::run() called twice: the weight half of a split "
                  "backward runs once (its graph is freed after it)";
  CHECK(state_) << "DeferredWeightGrads::run() on a handle that run_backward_input did not "
                   "make (default-constructed or moved from)";
  ran_ = true;
  std::unique_ptr<State> state = std::move(state_);
  NoGradGuard no_grad;
  AutocastGuard no_autocast(DType::f32);

  TensorList destinations;
  for (WeightStep& step : state->steps) {
    std::shared_ptr<Node> node = std::move(step.node);
    TensorList in;
    if (step.on_input_path) {
      in = std::move(step.grad_outputs);
    } else {
      in = std::move(state->buffers[node.get()].grads);
      state->buffers.erase(node.get());
    }
    in.resize(node->num_outputs());
    TensorList out;
    if (any_defined(in)) {
      offer_destinations(*node, state->dependencies, state->buffers, destinations);
      if (step.on_input_path) {
        // Input edges lead to inputs' accumulators, whose gradients I returned.
        for (size_t i = 0; i < destinations.size(); ++i)
          if (!step.weight_edges[i]) destinations[i] = Tensor();
      }
      OfferScope offered(destinations);
      out = step.on_input_path ? node->apply_masked(in, step.weight_edges) : node->apply(in);
    }
    if (!state->retain_graph) node->release_saved();

    check_gradient_count(*node, out);
    const std::vector<Edge>& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node || (step.on_input_path && !step.weight_edges[i])) continue;
      if (i < out.size()) state->buffers[e.node.get()].add(e.input_nr, out[i]);
      --state->dependencies[e.node.get()];
    }
  }
}

SplitBackward run_backward_input(const TensorList& roots, const TensorList& grads,
                                 const TensorList& inputs, bool retain_graph) {
  CHECK_EQ(roots.size(), grads.size());
  NoGradGuard no_grad;
  AutocastGuard no_autocast(DType::f32);

  std::vector<Edge> root_edges = root_edges_of(roots);
  std::unordered_map<Node*, int> dependencies = count_dependencies(root_edges);
  std::vector<std::shared_ptr<Node>> order = backward_order(root_edges, dependencies);

  std::vector<Edge> input_edges;
  std::unordered_set<Node*> input_nodes;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    CHECK(x.defined() && x.requires_grad())
        << "run_backward_input: input " << i << " does not require a gradient";
    Edge e = gradient_edge(x);
    CHECK(dependencies.count(e.node.get()))
        << "run_backward_input: input " << i << " (shape " << x.shape_str()
        << ") is not reachable from the roots: they do not depend on it";
    input_nodes.insert(e.node.get());
    input_edges.push_back(std::move(e));
  }
  const std::unordered_set<Node*> input_path = nodes_leading_to(order, std::move(input_nodes));

  // I: the input-path nodes, each following only its edges into the input
  // path; those that also have weight edges become W steps, as does every
  // other node.
  auto state = std::make_unique<DeferredWeightGrads::State>();
  std::unordered_map<Node*, InputBuffer> buffers;
  for (size_t i = 0; i < roots.size(); ++i)
    buffers[root_edges[i].node.get()].add(root_edges[i].input_nr, grads[i]);
  TensorList input_grads(inputs.size());
  for (std::shared_ptr<Node>& node : order) {
    if (!input_path.count(node.get())) {
      state->steps.push_back(WeightStep{std::move(node), false, {}, {}});
      continue;
    }
    TensorList in = std::move(buffers[node.get()].grads);
    buffers.erase(node.get());
    in.resize(node->num_outputs());
    for (size_t i = 0; i < inputs.size(); ++i)
      if (input_edges[i].node == node) input_grads[i] = in[input_edges[i].input_nr];

    const std::vector<Edge>& edges = node->next_edges();
    std::vector<bool> input_edge(edges.size()), weight_edge(edges.size());
    for (size_t i = 0; i < edges.size(); ++i) {
      if (!edges[i].node) continue;
      if (input_path.count(edges[i].node.get()))
        input_edge[i] = true;
      else
        weight_edge[i] = true;
    }
    const bool has_input_edges =
        std::find(input_edge.begin(), input_edge.end(), true) != input_edge.end();
    const bool has_weight_edges =
        std::find(weight_edge.begin(), weight_edge.end(), true) != weight_edge.end();
    if (has_input_edges && any_defined(in)) {
      // No grad destinations: the only accumulators on the input path are inputs'.
      TensorList out = node->apply_masked(in, GradMask(input_edge));
      check_gradient_count(*node, out);
      for (size_t i = 0; i < out.size(); ++i)
        if (input_edge[i]) buffers[edges[i].node.get()].add(edges[i].input_nr, out[i]);
    }
    if (has_weight_edges)
      state->steps.push_back(
          WeightStep{std::move(node), true, GradMask(std::move(weight_edge)), std::move(in)});
    else if (!retain_graph)
      node->release_saved();
  }

  state->buffers = std::move(buffers);
  state->dependencies = std::move(dependencies);
  state->retain_graph = retain_graph;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    Tensor& g = input_grads[i];
    if (!g.defined())
      g = zeros(x.shape(), x.dtype(), x.device());
    else if (g.dtype() != x.dtype())
      g = g.to(x.dtype());
  }
  return SplitBackward{std::move(input_grads), DeferredWeightGrads(std::move(state))};
}

// ---- activation checkpointing ----

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
    return run_graph(roots, grads, /*retain_graph=*/false, captures);
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
