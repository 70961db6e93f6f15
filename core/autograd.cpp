#include "core/autograd.h"

#include <algorithm>
#include <atomic>
#include <queue>
#include <unordered_map>

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
struct OfferScope {
  explicit OfferScope(const TensorList& destinations) { t_destinations = &destinations; }
  ~OfferScope() { t_destinations = nullptr; }
  OfferScope(const OfferScope&) = delete;
  OfferScope& operator=(const OfferScope&) = delete;
};

struct ReadyOrder {
  // Latest-created node first: reverse of the forward, as PyTorch does, so
  // parameter hooks fire from the last layer to the first.
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return a->sequence_nr() < b->sequence_nr();
  }
};

}  // namespace

void run_backward(const TensorList& roots, const TensorList& grads, bool retain_graph) {
  CHECK_EQ(roots.size(), grads.size());
  NoGradGuard no_grad;
  // Backward ops follow the dtypes forward chose (core/autocast.h).
  AutocastGuard no_autocast(DType::f32);

  // Count, for every node reachable from the roots, the edges that lead into it.
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack;
  std::vector<Edge> root_edges;
  for (const Tensor& r : roots) {
    if (!r.requires_grad())
      throw Error("backward() on a tensor that does not require grad and has no grad_fn");
    root_edges.push_back(gradient_edge(r));
  }
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
    // A node no gradient reached contributes nothing (and fires no hooks).
    bool reached = std::any_of(in.begin(), in.end(), [](const Tensor& g) { return g.defined(); });
    TensorList out;
    if (reached) {
      offer_destinations(*node, dependencies, buffers, destinations);
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
}

}  // namespace trainer::autograd
