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

TensorList detail::run_graph(const TensorList& roots, const TensorList& grads, bool retain_graph,
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

void run_backward(const TensorList& roots, const TensorList& grads, bool retain_graph) {
  detail::run_graph(roots, grads, retain_graph, {});
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

}  // namespace trainer::autograd
