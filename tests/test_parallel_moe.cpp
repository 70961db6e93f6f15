// Expert parallelism on ranks as threads against one process: a
// mixture-of-experts layer whose experts are divided over ep 2 and 4 ranks
// (layers/moe.h, parallel/expert_parallel.h) gives, for each rank's
// tokens, the output and input gradient of the whole layer on those
// tokens; each rank's experts get the gradient the whole layer's get over
// every rank's tokens, and the router's summed over the ranks equals it.
// Top-1 and top-2, with dropping and dropless, with the auxiliary and
// z-losses, and with a balancing bias that leaves a rank without rows to
// compute (it still takes part in every exchange).
#include <map>
#include <vector>

#include "layers/moe.h"
#include "parallel/expert_parallel.h"
#include "tests/testing.h"
#include "tests/thread_world.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

struct Case {
  std::string name;
  int ep;
  MoEOptions options;
  std::vector<float> bias;  // expert_bias, or empty
};

struct Result {
  Tensor y, x_grad, router_grad;
  std::map<int64_t, TensorList> experts;  // c_fc and c_proj weight gradients
};

constexpr int64_t kTokens = 12;  // per rank

// Rank r's tokens and probe: rows [r n, (r + 1) n) of the same draw.
std::pair<Tensor, Tensor> tokens_of(const Case& c, int rank) {
  Generator gen(11);
  const Tensor x = randn({c.ep * kTokens, c.options.d_model}, gen);
  const Tensor v = randn({c.ep * kTokens, c.options.d_model}, gen);
  return {x.slice(0, rank * kTokens, (rank + 1) * kTokens).contiguous(),
          v.slice(0, rank * kTokens, (rank + 1) * kTokens).contiguous()};
}

std::shared_ptr<MoEFeedForward> make_layer(const Case& c) {
  Generator gen(3);
  auto m = std::make_shared<MoEFeedForward>(c.options, gen);
  if (!c.bias.empty()) m->expert_bias.copy_(from_vector(c.bias));
  return m;
}

Result run(MoEFeedForward& m, const Tensor& x, const Tensor& v) {
  const Tensor xi = x.detach().requires_grad_();
  Result r;
  r.y = m(xi);
  sum(r.y * v).backward();
  r.y = r.y.detach();
  r.x_grad = xi.grad();
  r.router_grad = m.router->weight.grad();
  for (int64_t e = m.first_expert(); e < m.first_expert() + m.local_experts(); ++e) {
    const ExpertMLP& ex = *m.expert_list[size_t(e)];
    auto grad_or_zeros = [](const Tensor& w) {
      return w.grad().defined() ? w.grad() : zeros(w.shape());
    };
    r.experts[e] = {grad_or_zeros(ex.c_fc->weight), grad_or_zeros(ex.c_proj->weight)};
  }
  return r;
}

void check_case(const Case& c) {
  INFO(c.name << " at ep " << c.ep);
  set_auxiliary_loss_scale(1.0);
  const std::vector<Result> got = run_thread_ranks<Result>(c.ep, [&](comm::Communicator& world) {
    auto m = make_layer(c);
    m->set_expert_parallel(make_expert_group(world.split(0, world.rank())));
    auto [x, v] = tokens_of(c, world.rank());
    return run(*m, x, v);
  });
  // One process: the whole layer on each rank's tokens in turn, the
  // gradients of the weights adding up.
  auto whole = make_layer(c);
  std::vector<Result> want;
  for (int r = 0; r < c.ep; ++r) {
    auto [x, v] = tokens_of(c, r);
    want.push_back(run(*whole, x, v));
  }
  Tensor router_sum;
  for (int r = 0; r < c.ep; ++r) {
    INFO("rank " << r);
    require_close(got[size_t(r)].y, want[size_t(r)].y, 1e-5, 1e-6, "output");
    require_close(got[size_t(r)].x_grad, want[size_t(r)].x_grad, 1e-5, 1e-6, "input gradient");
    router_sum =
        router_sum.defined() ? router_sum + got[size_t(r)].router_grad : got[size_t(r)].router_grad;
    REQUIRE(int64_t(got[size_t(r)].experts.size()) == c.options.experts / c.ep);
    for (const auto& [e, grads] : got[size_t(r)].experts) {
      INFO("expert " << e);
      const TensorList& all = want.back().experts.at(e);  // accumulated over the ranks' runs
      require_close(grads[0], all[0], 1e-5, 1e-6, "c_fc gradient");
      require_close(grads[1], all[1], 1e-5, 1e-6, "c_proj gradient");
    }
  }
  require_close(router_sum, want.back().router_grad, 1e-5, 1e-6, "router gradient summed");
}

}  // namespace

TEST_CASE("expert parallelism: experts over ep ranks give the whole layer's outputs and gradients",
          "[parallel][moe][ep]") {
  const MoEOptions base{.d_model = 8, .hidden = 12, .experts = 4, .top_k = 2, .z_loss_coef = 0.01};
  std::vector<Case> cases;
  for (int ep : {2, 4}) {
    MoEOptions dropless = base;
    dropless.dropless = true;
    cases.push_back({"top-2 dropless", ep, dropless, {}});
    MoEOptions top1 = base;
    top1.top_k = 1, top1.capacity_factor = 1.0;
    cases.push_back({"top-1, capacity 1.0", ep, top1, {}});
  }
  MoEOptions shared = base;
  shared.shared_experts = 1, shared.sigmoid = true, shared.normalize_top_k = true,
  shared.experts = 8;
  cases.push_back({"8 experts, sigmoid, shared expert", 2, shared, {}});
  // Experts 0 and 1 (rank 0's at ep 2) take every token: rank 1 computes nothing.
  MoEOptions steered = base;
  steered.dropless = true, steered.bias_update_rate = 0.01;
  cases.push_back({"a rank that receives no rows", 2, steered, {5.f, 5.f, 0.f, 0.f}});
  for (const Case& c : cases) check_case(c);
}

TEST_CASE("expert parallelism: experts that do not divide over the ranks are an error",
          "[parallel][moe][ep]") {
  const std::vector<std::string> errors =
      run_thread_ranks<std::string>(2, [](comm::Communicator& world) -> std::string {
        Generator gen(1);
        MoEFeedForward m({.d_model = 4, .hidden = 4, .experts = 3, .top_k = 1}, gen);
        try {
          m.set_expert_parallel(make_expert_group(world.split(0, world.rank())));
        } catch (const Error& e) {
          return e.what();
        }
        return "";
      });
  for (const std::string& e : errors)
    CHECK(e.find("model.moe.experts 3 is not divisible by parallel.ep 2") != std::string::npos);
}
