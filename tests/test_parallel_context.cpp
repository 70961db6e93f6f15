// Context parallelism on ranks as threads against one process: its attention
// and whole GPT and Llama models. The attention:
// ring and all-to-all attention at cp 2, 3 and 4, with and without causal
// load balancing, multi-head and grouped-query, with attention dropout,
// give this rank's rows of causal_attention on the whole sequence and of its
// gradients. f64 within 1e-12; f32 all-to-all bit for bit (the same sums in
// the same order, on fewer heads), f32 ring within float tolerance (the
// blocks merge in another order). Sequences that do not split are refused
// with an error naming the lengths. The models: each rank runs its tokens
// of the same sequences, the mean of the ranks' losses and gradients (the
// data-parallel average over cp) equals one process's on whole sequences,
// with dropout too (every mask drawn for the whole sequence).
#include <vector>

#include "comm/collectives.h"
#include "core/ops_transformer.h"
#include "layers/context_parallel.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "parallel/context_parallel.h"
#include "tests/comparison.h"
#include "tests/testing.h"
#include "tests/thread_world.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

struct Case {
  int N = 2;
  ContextAttention attention = ContextAttention::ring;
  bool load_balance = true;
  int64_t B = 2, T = 24, NH = 4, KV = 4, HD = 8;
  double dropout = 0.0;
  DType dtype = DType::f64;
};

// The whole sequence's q, k, v (seeded, the same on every rank) and the
// probe cotangent of the output.
struct Inputs {
  Tensor q, k, v, probe;
};

Inputs make_inputs(const Case& c) {
  Generator gen(11);
  Inputs in;
  in.q = rand_tensor({c.B, c.T, c.NH * c.HD}, gen, -2.0, 2.0, c.dtype);
  in.k = rand_tensor({c.B, c.T, c.KV * c.HD}, gen, -2.0, 2.0, c.dtype);
  in.v = rand_tensor({c.B, c.T, c.KV * c.HD}, gen, -2.0, 2.0, c.dtype);
  in.probe = rand_tensor({c.B, c.T, c.NH * c.HD}, gen, -1.0, 1.0, c.dtype);
  return in;
}

// Output and gradients of q, k, v (as f64 vectors).
using Result = std::vector<std::vector<double>>;

Result with_grads(const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& probe,
                  const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& f) {
  Tensor q = q0.detach().contiguous().requires_grad_(),
         k = k0.detach().contiguous().requires_grad_(),
         v = v0.detach().contiguous().requires_grad_();
  Tensor out = f(q, k, v);
  out.backward(probe.contiguous());
  return {out.to_vector<double>(), q.grad().to_vector<double>(), k.grad().to_vector<double>(),
          v.grad().to_vector<double>()};
}

// This rank's rows of the single-process result.
Result reference_rows(const Case& c, const ContextLayout& layout) {
  Inputs in = make_inputs(c);
  Generator gen(5, kStreamDropout);
  Tensor q = in.q.detach().requires_grad_(), k = in.k.detach().requires_grad_(),
         v = in.v.detach().requires_grad_();
  Tensor out = causal_attention(q, k, v, c.NH, c.dropout, c.dropout > 0.0, gen, c.KV);
  out.backward(in.probe);
  Result r;
  for (const Tensor& t : {out.detach(), q.grad(), k.grad(), v.grad()})
    r.push_back(layout.local(t).contiguous().to_vector<double>());
  return r;
}

std::vector<std::pair<Result, Result>> run_case(const Case& c) {
  return run_thread_ranks<std::pair<Result, Result>>(c.N, [&](comm::Communicator& world) {
    auto comm = world.split(0, world.rank());
    auto g = make_context_group(comm, c.attention, c.load_balance);
    const ContextLayout layout = g->layout(c.T);
    Inputs in = make_inputs(c);
    Generator gen(5, kStreamDropout);
    Result cp =
        with_grads(layout.local(in.q), layout.local(in.k), layout.local(in.v),
                   layout.local(in.probe), [&](const Tensor& q, const Tensor& k, const Tensor& v) {
                     return context_parallel_attention(q, k, v, c.NH, c.KV, c.dropout,
                                                       c.dropout > 0.0, gen, *g);
                   });
    return std::make_pair(cp, reference_rows(c, layout));
  });
}

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

void check_case(const Case& c, double tol) {
  const char* names[] = {"out", "grad q", "grad k", "grad v"};
  auto ranks = run_case(c);
  for (size_t r = 0; r < ranks.size(); ++r)
    for (size_t i = 0; i < 4; ++i) {
      INFO("cp " << c.N << (c.attention == ContextAttention::ring ? " ring" : " all_to_all")
                 << (c.load_balance ? " balanced" : "") << " NH " << c.NH << " KV " << c.KV
                 << " dropout " << c.dropout << " rank " << r << " " << names[i]);
      if (tol == 0.0)
        CHECK(ranks[r].first[i] == ranks[r].second[i]);
      else
        CHECK(max_diff(ranks[r].first[i], ranks[r].second[i]) <= tol);
    }
}

}  // namespace

TEST_CASE("context parallelism: ring attention equals one process", "[parallel][context]") {
  for (int N : {2, 3, 4})
    for (bool balance : {true, false}) {
      check_case({.N = N, .load_balance = balance}, 1e-12);
      check_case({.N = N, .load_balance = balance, .NH = 4, .KV = 2, .dropout = 0.25}, 1e-12);
    }
  check_case({.N = 2, .T = 32, .NH = 4, .KV = 1, .dtype = DType::f32}, 2e-5);
}

TEST_CASE("context parallelism: all-to-all attention equals one process, bit for bit in f32",
          "[parallel][context]") {
  for (int N : {2, 4})
    for (bool balance : {true, false}) {
      check_case({.N = N, .attention = ContextAttention::all_to_all, .load_balance = balance},
                 1e-12);
      check_case({.N = N,
                  .attention = ContextAttention::all_to_all,
                  .load_balance = balance,
                  .NH = 8,
                  .KV = 4,
                  .dropout = 0.25,
                  .dtype = DType::f32},
                 0.0);
    }
}

TEST_CASE("context parallelism: layouts and their errors", "[parallel][context]") {
  const ContextLayout l = context_layout(16, 1, 2, true);
  CHECK(l.positions() == std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11});
  const ContextLayout r = context_layout(16, 0, 4, true);
  CHECK(r.positions() == std::vector<int64_t>{0, 1, 14, 15});
  CHECK(context_layout(12, 2, 3, false).positions() == std::vector<int64_t>{8, 9, 10, 11});
  CHECK_THROWS_WITH(context_layout(18, 0, 2, true),
                    Catch::Contains("18 tokens does not split into 4 equal chunks") &&
                        Catch::Contains("multiple of 4"));
  CHECK_THROWS_WITH(context_layout(10, 0, 4, false), Catch::Contains("multiple of 4"));
  auto errors = run_thread_ranks<int>(2, [](comm::Communicator& world) {
    auto g = make_context_group(world.split(0, world.rank()), ContextAttention::all_to_all, false);
    Generator gen(1);
    Tensor q = zeros({1, 4, 24}), kv = zeros({1, 4, 8});
    try {
      context_parallel_attention(q, kv, kv, 3, 1, 0.0, false, gen, *g);
    } catch (const Error& e) {
      return std::string(e.what()).find("3 heads and 1 key/value heads must both be multiples") !=
                     std::string::npos
                 ? 1
                 : 0;
    }
    return 0;
  });
  CHECK(errors == std::vector<int>{1, 1});
}

namespace {

std::shared_ptr<Model> small_model(const std::string& name, double dropout) {
  if (name == "gpt")
    return make_gpt({.vocab_size = 37,
                     .block_size = 32,
                     .n_layer = 2,
                     .n_head = 4,
                     .n_embd = 32,
                     .dropout = dropout,
                     .seed = 3});
  return make_llama({.vocab_size = 37,
                     .hidden_size = 32,
                     .intermediate_size = 48,
                     .num_hidden_layers = 2,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .max_position_embeddings = 32,
                     .rope = {},
                     .attention_dropout = dropout,
                     .seed = 3});
}

// The loss and every parameter's gradient (flattened, in order) of one
// step on tokens [B, T] (this rank's of layout when g is set).
std::vector<std::vector<double>> model_step(const std::string& name, ContextParallelGroup* g,
                                            double dropout) {
  auto model = small_model(name, dropout);
  const int64_t B = 2, T = 32;
  std::vector<int64_t> ids(size_t(B * (T + 1)));
  uint64_t x = 88172645463325252ull;
  for (int64_t& id : ids) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    id = int64_t(x % 37);
  }
  Tensor tokens = from_vector(ids, {B, T + 1});
  Tensor inputs = tokens.narrow(1, 0, T), targets = tokens.narrow(1, 1, T);
  if (g) {
    const ContextLayout layout = g->layout(T);
    inputs = layout.local(inputs).contiguous();
    targets = layout.local(targets).contiguous();
    model->set_context_parallel(std::shared_ptr<ContextParallelGroup>(g, [](auto*) {}));
  }
  Tensor logits = (*model)(inputs);
  Tensor loss = cross_entropy(logits.reshape({-1, 37}), targets.reshape({-1}));
  loss.backward();
  std::vector<std::vector<double>> out{{loss.item<double>()}};
  for (const Tensor& p : model->parameters()) out.push_back(p.grad().to_vector<double>());
  return out;
}

}  // namespace

TEST_CASE("context parallelism: GPT and Llama train as one process at cp 2 and 4",
          "[parallel][context]") {
  struct ModelCase {
    std::string model;
    int N;
    ContextAttention attention;
    double dropout;
  };
  for (const ModelCase& c : {ModelCase{"gpt", 2, ContextAttention::ring, 0.0},
                             ModelCase{"gpt", 4, ContextAttention::all_to_all, 0.1},
                             ModelCase{"llama", 2, ContextAttention::all_to_all, 0.1},
                             ModelCase{"llama", 4, ContextAttention::ring, 0.1}}) {
    INFO(c.model << " cp " << c.N
                 << (c.attention == ContextAttention::ring ? " ring" : " all_to_all") << " dropout "
                 << c.dropout);
    const auto one = model_step(c.model, nullptr, c.dropout);
    auto ranks =
        run_thread_ranks<std::vector<std::vector<double>>>(c.N, [&](comm::Communicator& world) {
          auto g = make_context_group(world.split(0, world.rank()), c.attention, true);
          auto r = model_step(c.model, g.get(), c.dropout);
          // The data-parallel average over the cp ranks.
          for (auto& v : r) {
            Tensor t = from_vector(v, {int64_t(v.size())}).to(DType::f64);
            comm::allreduce(world, t, {.op = comm::ReduceOp::avg});
            v = t.to_vector<double>();
          }
          return r;
        });
    for (const auto& r : ranks) {
      REQUIRE(r.size() == one.size());
      CHECK(std::abs(r[0][0] - one[0][0]) < 1e-5);
      for (size_t i = 1; i < r.size(); ++i) {
        INFO("parameter " << i - 1);
        CHECK(max_diff(r[i], one[i]) < 2e-5);
      }
    }
  }
}
