// The mixture-of-experts layer (layers/moe.h): the routing on hand-worked
// cases, the layer against a token-by-token reference (outputs and every
// gradient) over top-1 and top-2, capacity and dropless, softmax and
// sigmoid scores, shared experts and the balancing bias; the router's
// gradient, auxiliary and z-losses included, against finite differences.
#include "tests/testing.h"

#include <cmath>

#include "core/autograd.h"
#include "layers/moe.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// The reference routing: the top k of each row by repeated arg-max, then
// capacity in order of (choice, token).
std::vector<std::vector<int64_t>> reference_choices(const std::vector<float>& s, int64_t n,
                                                    int64_t e, int64_t k,
                                                    const std::vector<float>& bias) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    std::vector<bool> used(size_t(e), false);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t x = 0; x < e; ++x) {
        const float v = s[size_t(t * e + x)] + (bias.empty() ? 0.f : bias[size_t(x)]);
        if (!used[size_t(x)] &&
            (best < 0 || v > s[size_t(t * e + best)] + (bias.empty() ? 0.f : bias[size_t(best)])))
          best = x;
      }
      used[size_t(best)] = true;
      out[size_t(t)].push_back(best);
    }
  }
  return out;
}

// y[t] = sum over kept choices j of gate_j expert_j(x[t]) (+ shared), one
// token at a time.
Tensor reference_forward(MoEFeedForward& m, const Tensor& x2) {
  const MoEOptions& o = m.options();
  const int64_t N = x2.size(0), E = o.experts, k = o.top_k;
  const Tensor logits = matmul(x2, m.router->weight.t());
  const Tensor probs = o.sigmoid ? sigmoid(logits) : softmax(logits, -1);
  const std::vector<float> host = probs.detach().to(DType::f32).contiguous().to_vector<float>();
  std::vector<float> bias;
  if (o.bias_update_rate > 0) bias = m.expert_bias.to_vector<float>();
  const auto choices = reference_choices(host, N, E, k, bias);
  const int64_t capacity =
      o.dropless ? N * k : int64_t(std::ceil(o.capacity_factor * double(N * k) / double(E)));
  std::vector<int64_t> taken(size_t(E), 0);
  std::vector<std::vector<bool>> kept(static_cast<size_t>(N),
                                      std::vector<bool>(static_cast<size_t>(k)));
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < N; ++t)
      kept[size_t(t)][size_t(j)] = taken[size_t(choices[size_t(t)][size_t(j)])]++ < capacity;
  TensorList rows;
  for (int64_t t = 0; t < N; ++t) {
    const Tensor xt = x2.slice(0, t, t + 1);
    Tensor gsum;
    if (o.normalize_top_k)
      for (int64_t j = 0; j < k; ++j) {
        const Tensor g =
            probs.slice(0, t, t + 1)
                .slice(1, choices[size_t(t)][size_t(j)], choices[size_t(t)][size_t(j)] + 1);
        gsum = gsum.defined() ? gsum + g : g;
      }
    Tensor y = zeros({1, o.d_model}, x2.dtype());
    for (int64_t j = 0; j < k; ++j) {
      if (!kept[size_t(t)][size_t(j)]) continue;
      const int64_t e = choices[size_t(t)][size_t(j)];
      Tensor g = probs.slice(0, t, t + 1).slice(1, e, e + 1);
      if (gsum.defined()) g = g / gsum;
      y = y + (*m.expert_list[size_t(e)])(xt)*g;
    }
    if (m.shared) y = y + (*m.shared)(xt);
    rows.push_back(y);
  }
  return concat(rows, 0);
}

void check_against_reference(const MoEOptions& o, int64_t n, uint64_t seed) {
  Generator gen(seed);
  MoEFeedForward m(o, gen);
  const Tensor x = randn({1, n, o.d_model}, gen);
  const Tensor v = randn({1, n, o.d_model}, gen);
  auto grads = [&](bool reference) {
    m.zero_grad();
    const Tensor xi = x.detach().requires_grad_();
    const Tensor y =
        reference ? reference_forward(m, xi.reshape({n, o.d_model})).reshape(x.shape()) : m(xi);
    sum(y * v).backward();
    TensorList out{y.detach(), xi.grad(), m.router->weight.grad()};
    for (const auto& e : m.expert_list)
      out.push_back(e->c_fc->weight.grad().defined() ? e->c_fc->weight.grad()
                                                     : zeros(e->c_fc->weight.shape()));
    return out;
  };
  set_auxiliary_loss_scale(0.0);  // the auxiliary losses are checked apart
  const TensorList got = grads(false), want = grads(true);
  set_auxiliary_loss_scale(1.0);
  const char* names[] = {"output", "input gradient", "router gradient"};
  for (size_t i = 0; i < got.size(); ++i)
    require_close(got[i], want[i], 1e-5, 1e-6,
                  i < 3 ? names[i] : "expert " + std::to_string(i - 3) + " c_fc gradient");
}

}  // namespace

TEST_CASE("moe routing: top-k by score, ties to the lower expert, capacity by choice then token",
          "[layers][moe]") {
  // 4 tokens x 3 experts.
  const std::vector<float> s{0.5f, 0.3f, 0.2f,  //
                             0.1f, 0.6f, 0.3f,  //
                             0.4f, 0.4f, 0.2f,  //
                             0.7f, 0.1f, 0.2f};
  MoERouting r = route_tokens(s, 4, 3, 1, {}, -1);
  CHECK(r.choice == std::vector<int64_t>{0, 1, 0, 0});
  CHECK(r.counts == std::vector<int64_t>{3, 1, 0});
  CHECK(r.token == std::vector<int64_t>{0, 2, 3, 1});
  CHECK(r.dropped == 0);
  // Capacity 2: token 3's choice of expert 0 is the third, dropped.
  r = route_tokens(s, 4, 3, 1, {}, 2);
  CHECK(r.counts == std::vector<int64_t>{2, 1, 0});
  CHECK(r.chosen == std::vector<int64_t>{3, 1, 0});
  CHECK(r.token == std::vector<int64_t>{0, 2, 1});
  CHECK(r.dropped == 1);
  // Top 2, capacity 2: first choices fill expert 0 (tokens 0, 2) before
  // token 1's second choice (expert 2) and token 3's first (dropped).
  r = route_tokens(s, 4, 3, 2, {}, 2);
  CHECK(r.choice == std::vector<int64_t>{0, 1, 1, 2, 0, 1, 0, 2});
  CHECK(r.counts == std::vector<int64_t>{2, 2, 2});
  CHECK(r.slot == std::vector<int64_t>{0, 4, 1, 2, 3, 7});
  CHECK(r.dropped == 2);  // token 3's first choice, token 2's second (expert 1 full)
  // A bias steers the choice: +1 on expert 2 makes it every token's first.
  r = route_tokens(s, 4, 3, 1, {0.f, 0.f, 1.f}, -1);
  CHECK(r.counts == std::vector<int64_t>{0, 0, 4});
}

TEST_CASE("moe layer: the grouped experts equal a token-by-token reference, values and gradients",
          "[layers][moe]") {
  const MoEOptions base{.d_model = 12, .hidden = 20, .experts = 4, .top_k = 1};
  SECTION("top-1, capacity 1.0 (dropping)") {
    MoEOptions o = base;
    o.capacity_factor = 1.0;
    check_against_reference(o, 24, 1);
  }
  SECTION("top-2, dropless") {
    MoEOptions o = base;
    o.top_k = 2, o.dropless = true;
    check_against_reference(o, 24, 2);
  }
  SECTION("top-2, capacity 1.25, tanh GELU") {
    MoEOptions o = base;
    o.top_k = 2, o.gelu = GeluApprox::tanh;
    check_against_reference(o, 30, 3);
  }
  SECTION("sigmoid scores, normalised top-2, shared experts") {
    MoEOptions o = base;
    o.top_k = 2, o.sigmoid = true, o.normalize_top_k = true, o.shared_experts = 2,
    o.dropless = true;
    check_against_reference(o, 16, 4);
  }
  SECTION("a balancing bias that sends every token to one expert: the others get none") {
    MoEOptions o = base;
    o.dropless = true, o.bias_update_rate = 1e-3;
    Generator gen(5);
    MoEFeedForward m(o, gen);
    m.expert_bias.copy_(from_vector(std::vector<float>{0.f, 0.f, 0.f, 10.f}));
    const Tensor x = randn({2, 5, o.d_model}, gen);
    sum(m(x)).backward();
    CHECK(m.expert_list[3]->c_fc->weight.grad().defined());
    CHECK(!m.expert_list[0]->c_fc->weight.grad().defined());
    const MoEStats s = m.take_stats();
    CHECK(s.load == std::vector<int64_t>{0, 0, 0, 10});
    CHECK(s.tokens == 10);
    check_against_reference(o, 10, 5);
  }
}

TEST_CASE(
    "moe layer: the router's gradient, with the auxiliary and z-losses, is finite differences'",
    "[layers][moe]") {
  for (bool sigmoid_scores : {false, true}) {
    INFO("sigmoid " << sigmoid_scores);
    MoEOptions o{.d_model = 6,
                 .hidden = 8,
                 .experts = 4,
                 .top_k = 2,
                 .sigmoid = sigmoid_scores,
                 .normalize_top_k = sigmoid_scores,
                 .dropless = true,
                 .aux_loss_coef = 0.3,
                 .z_loss_coef = 0.05};
    Generator gen(7);
    MoEFeedForward m(o, gen);
    // In f64: the router and the experts' weights.
    m.router->weight = m.router->weight.detach().to(DType::f64).requires_grad_();
    for (const auto& e : m.expert_list)
      for (Linear* l : {e->c_fc.get(), e->c_proj.get()}) {
        l->weight = l->weight.detach().to(DType::f64).requires_grad_();
        l->bias = l->bias.detach().to(DType::f64).requires_grad_();
      }
    const Tensor x = randn({10, o.d_model}, gen).to(DType::f64);
    const Tensor v = randn({10, o.d_model}, gen).to(DType::f64);
    const double scale = 0.7;  // the auxiliary losses' weight in the loss
    set_auxiliary_loss_scale(scale);
    auto loss = [&] {
      const double main = sum(m(x) * v).item<double>();
      const MoEStats s = m.take_stats();
      return main + scale * (s.aux_loss + s.z_loss);
    };
    m.zero_grad();
    sum(m(x) * v).backward();
    m.take_stats();
    const Tensor analytic = m.router->weight.grad().clone();
    autograd::NoGradGuard no_grad;
    double* w = m.router->weight.data<double>();
    std::vector<double> numeric;
    const double eps = 1e-6;
    for (int64_t i = 0; i < m.router->weight.numel(); ++i) {
      const double keep = w[i];
      w[i] = keep + eps;
      const double plus = loss();
      w[i] = keep - eps;
      const double minus = loss();
      w[i] = keep;
      numeric.push_back((plus - minus) / (2 * eps));
    }
    set_auxiliary_loss_scale(1.0);
    require_close(analytic, from_vector(numeric, m.router->weight.shape()), 1e-5, 1e-7,
                  "router gradient");
  }
}

TEST_CASE("moe layer: the auxiliary-loss-free bias moves toward the mean load", "[layers][moe]") {
  MoEOptions o{.d_model = 4, .hidden = 4, .experts = 4, .top_k = 1, .bias_update_rate = 0.01};
  Generator gen(1);
  MoEFeedForward m(o, gen);
  m.update_bias({10, 2, 4, 0});  // mean 4
  const std::vector<float> b = m.expert_bias.to_vector<float>();
  CHECK(b[0] == Approx(-0.01));
  CHECK(b[1] == Approx(0.01));
  CHECK(b[2] == 0.f);
  CHECK(b[3] == Approx(0.01));
}
