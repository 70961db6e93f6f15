// MoEFeedForward (layers/moe.h): routing on the host, experts on row ranges.
#include "layers/moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>

#include "core/autograd.h"

namespace trainer {

namespace {

std::atomic<double> g_aux_scale{1.0};

// y passes through; aux (a scalar) gets auxiliary_loss_scale() as its gradient.
struct AuxiliaryLossFn {
  struct Saved {
    Shape aux_shape;
    DType aux_dtype = DType::f32;
    Device device;
  };
  static constexpr const char* name = "auxiliary_loss";
  static Tensor forward(Saved& s, const Tensor& y, const Tensor& aux) {
    s = Saved{aux.shape(), aux.dtype(), aux.device()};
    return y;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {g[0], full(s.aux_shape, auxiliary_loss_scale(), s.aux_dtype, s.device)};
  }
};

// Rows to the ranks of g as send_counts say; backward sends the
// gradients back by the receive counts.
struct ExpertAllToAllFn {
  struct Saved {
    ExpertParallelGroup* g = nullptr;
    std::vector<int64_t> send, recv;
  };
  static constexpr const char* name = "expert_all_to_all";
  static Tensor forward(Saved& s, const Tensor& x, ExpertParallelGroup* g,
                        std::vector<int64_t> send) {
    s.g = g, s.send = std::move(send);
    return g->all_to_all_v(x.contiguous(), s.send, &s.recv);
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask&) {
    return {s.g->all_to_all_v(g[0].contiguous(), s.recv, nullptr)};
  }
};

Tensor index_tensor(const std::vector<int64_t>& v, Device device) {
  return from_vector(v, {int64_t(v.size())}).to(device);
}

}  // namespace

void set_auxiliary_loss_scale(double scale) { g_aux_scale.store(scale); }
double auxiliary_loss_scale() { return g_aux_scale.load(); }

Tensor with_auxiliary_loss(const Tensor& y, const Tensor& aux) {
  if (!aux.defined()) return y;
  return autograd::apply<AuxiliaryLossFn>(y, aux);
}

MoERouting route_tokens(const std::vector<float>& scores, int64_t n, int64_t experts, int64_t k,
                        const std::vector<float>& bias, int64_t capacity) {
  CHECK(int64_t(scores.size()) == n * experts && k >= 1 && k <= experts)
      << "route_tokens: " << scores.size() << " scores for " << n << " tokens x " << experts
      << " experts, top " << k;
  CHECK(bias.empty() || int64_t(bias.size()) == experts) << "route_tokens: bias of " << bias.size();
  MoERouting r;
  r.choice.resize(size_t(n * k));
  r.chosen.assign(size_t(experts), 0);
  std::vector<int64_t> order(static_cast<size_t>(experts));
  std::vector<float> key(static_cast<size_t>(experts));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < experts; ++e)
      key[size_t(e)] = scores[size_t(t * experts + e)] + (bias.empty() ? 0.f : bias[size_t(e)]);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return key[size_t(a)] > key[size_t(b)] || (key[size_t(a)] == key[size_t(b)] && a < b);
    });
    for (int64_t j = 0; j < k; ++j) {
      r.choice[size_t(t * k + j)] = order[size_t(j)];
      ++r.chosen[size_t(order[size_t(j)])];
    }
  }
  // Capacity: first choices before second ones, each in token order.
  std::vector<char> kept(size_t(n * k), 1);
  if (capacity >= 0) {
    std::vector<int64_t> taken(size_t(experts), 0);
    for (int64_t j = 0; j < k; ++j)
      for (int64_t t = 0; t < n; ++t) {
        const int64_t e = r.choice[size_t(t * k + j)];
        if (taken[size_t(e)] < capacity)
          ++taken[size_t(e)];
        else
          kept[size_t(t * k + j)] = 0, ++r.dropped;
      }
  }
  // Sorted by expert, by token within an expert.
  r.counts.assign(size_t(experts), 0);
  for (int64_t a = 0; a < n * k; ++a)
    if (kept[size_t(a)]) ++r.counts[size_t(r.choice[size_t(a)])];
  std::vector<int64_t> offset(size_t(experts) + 1, 0);
  for (int64_t e = 0; e < experts; ++e)
    offset[size_t(e) + 1] = offset[size_t(e)] + r.counts[size_t(e)];
  r.token.resize(size_t(offset.back()));
  r.slot.resize(size_t(offset.back()));
  for (int64_t a = 0; a < n * k; ++a) {
    if (!kept[size_t(a)]) continue;
    const size_t at = size_t(offset[size_t(r.choice[size_t(a)])]++);
    r.token[at] = a / k;
    r.slot[at] = a;
  }
  return r;
}

ExpertMLP::ExpertMLP(int64_t d_model, int64_t hidden, Generator& gen, bool bias, GeluApprox gelu)
    : gelu_(gelu) {
  c_fc = register_module("c_fc", std::make_shared<Linear>(d_model, hidden, gen, bias));
  c_proj = register_module("c_proj", std::make_shared<Linear>(hidden, d_model, gen, bias));
}

Tensor ExpertMLP::forward(const Tensor& x) { return (*c_proj)(gelu((*c_fc)(x), gelu_)); }

MoEFeedForward::MoEFeedForward(const MoEOptions& o, Generator& gen) : options_(o) {
  CHECK(o.experts >= 1 && o.top_k >= 1 && o.top_k <= o.experts && o.hidden >= 1 &&
        (o.dropless || o.capacity_factor > 0))
      << "MoEFeedForward: " << o.experts << " experts, top " << o.top_k << ", hidden " << o.hidden
      << ", capacity factor " << o.capacity_factor;
  router = register_module("router",
                           std::make_shared<Linear>(o.d_model, o.experts, gen, /*bias=*/false));
  experts = register_module("experts", std::make_shared<ModuleDict>());
  for (int64_t e = 0; e < o.experts; ++e)
    expert_list.push_back(experts->add(
        std::to_string(e), std::make_shared<ExpertMLP>(o.d_model, o.hidden, gen, o.bias, o.gelu)));
  if (o.shared_experts > 0)
    shared = register_module(
        "shared_experts",
        std::make_shared<ExpertMLP>(o.d_model, o.shared_experts * o.hidden, gen, o.bias, o.gelu));
  expert_bias = register_buffer("expert_bias", zeros({o.experts}));
  stats_.load.assign(size_t(o.experts), 0);
}

Tensor MoEFeedForward::forward(const Tensor& x) {
  const MoEOptions& o = options_;
  const int64_t D = x.size(-1), E = o.experts, k = o.top_k;
  CHECK(D == o.d_model) << "MoEFeedForward: input " << x.shape_str() << ", width " << o.d_model;
  const Tensor x2 = x.reshape({-1, D});
  const int64_t N = x2.size(0);
  Tensor logits = (*router)(x2);  // [N, E], in f32 (or f64) whatever autocast computes
  if (logits.dtype() != DType::f64) logits = logits.to(DType::f32);
  const Tensor probs = o.sigmoid ? sigmoid(logits) : softmax(logits, -1);
  const int64_t capacity =
      o.dropless ? -1 : int64_t(std::ceil(o.capacity_factor * double(N) * double(k) / double(E)));
  const MoERouting r = route_tokens(
      probs.detach().to(DType::f32).to(Device()).contiguous().to_vector<float>(), N, E, k,
      o.bias_update_rate > 0 ? expert_bias.to(Device()).to_vector<float>() : std::vector<float>(),
      capacity);
  Tensor gates = gather(probs, 1, index_tensor(r.choice, x.device()).reshape({N, k}));
  if (o.normalize_top_k) gates = gates / sum(gates, {1}, true);
  // Each expert's rows, one GEMM pair each; the results weighted by their
  // gates and added back at their tokens.
  Tensor out;
  const int64_t M = int64_t(r.token.size());
  if (M > 0) {
    const Tensor token = index_tensor(r.token, x.device());
    const Tensor ys = run_experts(index_select(x2, 0, token), r.counts);
    const Tensor w = index_select(gates.reshape({N * k}), 0, index_tensor(r.slot, x.device()));
    out = index_add(ys * w.reshape({M, 1}).to(x.dtype()), 0, token, N);
  } else if (ep_) {
    // No rows from this rank; it still takes part in the exchanges (and
    // their backward, through the empty rows' gradient).
    out = index_add(run_experts(x2.slice(0, 0, 0), r.counts), 0, index_tensor({}, x.device()), N);
  } else {
    out = zeros({N, D}, x.dtype(), x.device());
  }
  if (shared) out = out + (*shared)(x2);
  Tensor aux;
  double aux_value = 0, z_value = 0;
  if (o.aux_loss_coef > 0) {
    // Switch: E sum_e f_e P_e, f_e the share of the N k assignments that
    // chose e, P_e the mean (normalised) score of e.
    std::vector<float> f(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      f[size_t(e)] = float(double(r.chosen[size_t(e)]) / double(N * k));
    const Tensor p = o.sigmoid ? probs / sum(probs, {1}, true) : probs;
    aux = sum(mean(p, {0}) * from_vector(f).to(p.dtype()).to(x.device())) *
          (o.aux_loss_coef * double(E));
    aux_value = aux.item<double>();
  }
  if (o.z_loss_coef > 0) {
    // ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2.
    const Tensor m = max(logits, 1, true).detach();
    const Tensor lse = log(sum(exp(logits - m), {1})) + m.reshape({N});
    const Tensor z = mean(lse * lse) * o.z_loss_coef;
    z_value = z.item<double>();
    aux = aux.defined() ? aux + z : z;
  }
  if (is_training()) {
    for (int64_t e = 0; e < E; ++e) stats_.load[size_t(e)] += r.chosen[size_t(e)];
    stats_.dropped += r.dropped;
    stats_.tokens += N;
    stats_.aux_loss += aux_value;
    stats_.z_loss += z_value;
    ++stats_.forwards;
  }
  if (aux.defined() && autograd::grad_enabled()) out = with_auxiliary_loss(out, aux);
  return out.reshape(x.shape());
}

Tensor MoEFeedForward::run_local_experts(const Tensor& xs, const std::vector<int64_t>& counts) {
  TensorList ys;
  int64_t at = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0)
      ys.push_back((*expert_list[size_t(first_expert()) + e])(xs.slice(0, at, at + counts[e])));
    at += counts[e];
  }
  // No rows: the empty input stands for the output (same shape, in the graph).
  return ys.empty() ? xs : ys.size() == 1 ? ys[0] : concat(ys, 0);
}

Tensor MoEFeedForward::run_experts(const Tensor& xs, const std::vector<int64_t>& counts) {
  if (!ep_) return run_local_experts(xs, counts);
  // counts is in global expert order, so each rank's rows are contiguous.
  const int n = ep_->size();
  const int64_t local = local_experts();
  std::vector<int64_t> send(size_t(n), 0);
  for (size_t e = 0; e < counts.size(); ++e) send[e / size_t(local)] += counts[e];
  // from[s local + e]: rows rank s sends to this rank's expert e.
  const std::vector<int64_t> from = ep_->exchange(counts);
  const Tensor recv = autograd::apply<ExpertAllToAllFn>(xs, ep_.get(), send);  // by source
  // The rows arrive by source, by expert within one: block s local + e
  // starts at start[s local + e]. Expert-major order: perm[i] is the
  // received row at place i.
  std::vector<int64_t> start(from.size()), perm, rows(size_t(local), 0), back(size_t(n), 0);
  for (size_t b = 0, at = 0; b < from.size(); at += size_t(from[b]), ++b) {
    start[b] = int64_t(at);
    rows[b % size_t(local)] += from[b];
    back[b / size_t(local)] += from[b];
  }
  for (int64_t e = 0; e < local; ++e)
    for (int s = 0; s < n; ++s) {
      const size_t b = size_t(s * local + e);
      for (int64_t c = 0; c < from[b]; ++c) perm.push_back(start[b] + c);
    }
  const int64_t R = int64_t(perm.size());
  const Tensor order = index_tensor(perm, xs.device());
  const Tensor ye = run_local_experts(R > 0 ? index_select(recv, 0, order) : recv, rows);
  // Back to the order received (perm is a permutation), then to the senders.
  const Tensor y = R > 0 ? index_add(ye, 0, order, R) : ye;
  return autograd::apply<ExpertAllToAllFn>(y, ep_.get(), back);
}

void MoEFeedForward::set_expert_parallel(std::shared_ptr<ExpertParallelGroup> g) {
  CHECK(!ep_) << "MoEFeedForward::set_expert_parallel: already set";
  const int n = g->size();
  if (options_.experts % n != 0)
    throw Error(cat("model.moe.experts ", options_.experts, " is not divisible by parallel.ep ", n,
                    ": each rank holds the same number of experts"));
  ep_ = std::move(g);
  for (int64_t e = 0; e < options_.experts; ++e) {
    if (e >= first_expert() && e < first_expert() + local_experts()) continue;
    experts->remove(std::to_string(e));
    expert_list[size_t(e)] = nullptr;
  }
}

MoEStats MoEFeedForward::take_stats() {
  MoEStats s = std::move(stats_);
  stats_ = MoEStats{};
  stats_.load.assign(size_t(options_.experts), 0);
  return s;
}

void MoEFeedForward::update_bias(const std::vector<int64_t>& load) {
  const double rate = options_.bias_update_rate;
  if (rate <= 0) return;
  CHECK(int64_t(load.size()) == options_.experts) << "update_bias: load of " << load.size();
  const double mean =
      double(std::accumulate(load.begin(), load.end(), int64_t(0))) / double(options_.experts);
  std::vector<float> b = expert_bias.to(Device()).to_vector<float>();
  for (size_t e = 0; e < b.size(); ++e)
    b[e] += float(rate * (mean > double(load[e]) ? 1.0 : mean < double(load[e]) ? -1.0 : 0.0));
  autograd::NoGradGuard no_grad;
  expert_bias.copy_(from_vector(b).to(expert_bias.device()));
}

}  // namespace trainer
