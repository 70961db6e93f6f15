// Transformer ops, layers and GPT: layer norm and causal attention against
// finite differences, closed forms and a naive loop reference; causality;
// weight tying; a tiny GPT overfitting a fixed batch.
#include "tests/testing.h"

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "core/ops_transformer.h"
#include "models/gpt.h"
#include "optim/optimizer.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// layer_norm composed of generic ops: the closed form.
Tensor layer_norm_composed(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  Tensor c = x - mean(x, {-1}, true);
  return c * rsqrt(var(x, {-1}, 0, true) + eps) * w + b;
}

// Causal multi-head attention with plain loops over contiguous f64 [B, T, D].
std::vector<double> naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, int64_t B, int64_t T, int64_t D,
                                    int64_t NH) {
  int64_t HD = D / NH;
  std::vector<double> out(size_t(B * T * D), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t c) { return size_t((b * T + t) * D + c); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> s(size_t(t + 1));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (int64_t c = h * HD; c < (h + 1) * HD; ++c) dot += q[at(b, t, c)] * k[at(b, u, c)];
          s[size_t(u)] = dot / std::sqrt(double(HD));
          mx = std::max(mx, s[size_t(u)]);
        }
        double z = 0.0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (int64_t u = 0; u <= t; ++u)
          for (int64_t c = h * HD; c < (h + 1) * HD; ++c)
            out[at(b, t, c)] += s[size_t(u)] / z * v[at(b, u, c)];
      }
  return out;
}

Tensor attention_fn(const TensorList& in, int64_t heads) {
  Generator gen(0, kStreamDropout);
  return causal_attention(in[0], in[1], in[2], heads, 0.0, false, gen);
}

}  // namespace

TEST_CASE("layer_norm gradients match finite differences", "[transformer]") {
  Generator gen(1);
  gradcheck([](const TensorList& in) { return layer_norm(in[0], in[1], in[2], 1e-5); },
            {rand_f64({3, 5}, gen), rand_f64({5}, gen), rand_f64({5}, gen)});
  gradcheck([](const TensorList& in) { return layer_norm(in[0].transpose(0, 1), in[1], in[2]); },
            {rand_f64({4, 2, 3}, gen), rand_f64({3}, gen), rand_f64({3}, gen)});
}

TEST_CASE("layer_norm equals its closed form", "[transformer]") {
  Generator gen(2);
  Tensor x = rand_f64({4, 7}, gen, -3.0, 3.0), w = rand_f64({7}, gen), b = rand_f64({7}, gen);
  require_close(layer_norm(x, w, b, 1e-5), layer_norm_composed(x, w, b, 1e-5), 1e-12, 1e-12,
                "layer_norm");
}

TEST_CASE("layer_norm fast path matches the reference on odd shapes", "[transformer]") {
  Generator gen(3);
  for (Shape shape : {Shape{7, 33}, Shape{2, 3, 65}, Shape{1, 1}, Shape{300, 129}}) {
    int64_t D = shape.back();
    Tensor x = rand_tensor(shape, gen, -2.0, 2.0);
    Tensor w = rand_tensor({D}, gen), b = rand_tensor({D}, gen);
    auto f = [](const TensorList& in) { return layer_norm(in[0], in[1], in[2]); };
    check_fast_vs_reference(f, {x, w, b}, 1e-4, 1e-4);
    check_fast_vs_reference(f, {non_contiguous(x), w, b}, 1e-4, 1e-4);
  }
}

TEST_CASE("causal attention gradients match finite differences", "[transformer]") {
  Generator gen(4);
  for (int64_t heads : {1, 2}) {
    gradcheck([heads](const TensorList& in) { return attention_fn(in, heads); },
              {rand_f64({2, 4, 6}, gen), rand_f64({2, 4, 6}, gen), rand_f64({2, 4, 6}, gen)});
  }
}

TEST_CASE("causal attention matches a naive loop reference", "[transformer]") {
  Generator gen(5);
  int64_t B = 2, T = 5, D = 12, NH = 3;
  // q, k, v as views into one fused [B, T, 3D] projection, as the layer passes them.
  Tensor qkv = rand_f64({B, T, 3 * D}, gen, -2.0, 2.0);
  Tensor q = qkv.narrow(2, 0, D), k = qkv.narrow(2, D, D), v = qkv.narrow(2, 2 * D, D);
  Tensor out = attention_fn({q, k, v}, NH);
  REQUIRE(out.shape() == Shape{B, T, D});
  std::vector<double> expected =
      naive_attention(q.contiguous().to_vector<double>(), k.contiguous().to_vector<double>(),
                      v.contiguous().to_vector<double>(), B, T, D, NH);
  require_close(out, from_vector(expected, {B, T, D}), 1e-12, 1e-12, "attention");
  // The f32 fast kernels agree with the reference ones.
  check_fast_vs_reference([NH](const TensorList& in) { return attention_fn(in, NH); },
                          {q.to(DType::f32), k.to(DType::f32), v.to(DType::f32)}, 1e-4, 1e-5);
}

TEST_CASE("GPT is causal: changing token t never changes earlier outputs", "[transformer]") {
  auto gpt = make_gpt(
      {.vocab_size = 11, .block_size = 9, .n_layer = 2, .n_head = 2, .n_embd = 8, .seed = 7});
  gpt->eval();
  autograd::NoGradGuard no_grad;
  std::vector<int64_t> tokens = {1, 5, 2, 9, 3, 3, 0, 7, 10};
  int64_t T = int64_t(tokens.size());
  Tensor base = (*gpt)(from_vector(tokens, {1, T}));
  REQUIRE(base.shape() == Shape{1, T, 11});
  for (int64_t t : {int64_t(0), int64_t(4), T - 1}) {
    std::vector<int64_t> changed = tokens;
    changed[size_t(t)] = (changed[size_t(t)] + 4) % 11;
    Tensor out = (*gpt)(from_vector(changed, {1, T}));
    if (t > 0) require_close(out.narrow(1, 0, t), base.narrow(1, 0, t), 0.0, 1e-6, "before t");
    double diff = max(abs(out.narrow(1, t, T - t) - base.narrow(1, t, T - t))).item<float>();
    CHECK(diff > 1e-4);
  }
}

TEST_CASE("GPT names its parameters as nanoGPT and ties one tensor", "[transformer]") {
  GPTOptions o{.vocab_size = 13, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8};
  auto tied = make_gpt(o);
  std::set<std::string> names;
  for (const NamedTensor& p : tied->named_parameters()) names.insert(p.name);
  for (const char* n :
       {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight",
        "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.1.ln_2.weight", "h.1.mlp.c_fc.weight",
        "h.1.mlp.c_proj.weight", "ln_f.weight", "ln_f.bias"})
    CHECK(names.count(n) == 1);
  CHECK(names.count("lm_head.weight") == 0);
  CHECK(tied->lm_head_weight().data_ptr() == tied->wte->weight.data_ptr());

  o.tie_weights = false;
  auto untied = make_gpt(o);
  bool has_head = false;
  for (const NamedTensor& p : untied->named_parameters()) has_head |= p.name == "lm_head.weight";
  CHECK(has_head);
  CHECK(untied->lm_head_weight().data_ptr() != untied->wte->weight.data_ptr());
  CHECK(untied->num_parameters() - tied->num_parameters() == 13 * 8);
  // Per block: 2 LayerNorms, c_attn, c_proj, c_fc, c_proj (with biases).
  int64_t D = 8, block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (4 * D * D + 4 * D) +
                         (4 * D * D + D);
  CHECK(tied->num_parameters() == 13 * D + 6 * D + 2 * block + 2 * D);

  // The tied tensor gets both gradients: from the embedding and from the head.
  Tensor tokens = from_vector(std::vector<int64_t>{1, 2, 3, 4}, {1, 4});
  Tensor logits = (*tied)(tokens);
  sum(logits).backward();
  Tensor g = tied->wte->weight.grad();
  REQUIRE(g.defined());
  // Row 0 is never looked up: its gradient comes from the head alone.
  CHECK(max(abs(g.select(0, 0))).item<float>() > 0.0f);
}

TEST_CASE("a tiny GPT overfits a fixed batch", "[transformer]") {
  int64_t B = 4, T = 8, V = 16;
  auto gpt = make_gpt({.vocab_size = V,
                       .block_size = T,
                       .n_layer = 2,
                       .n_head = 2,
                       .n_embd = 32,
                       .dropout = 0.0,
                       .seed = 3});
  Generator gen(11);
  // Distinct first tokens make every next token a function of the prefix.
  std::vector<int64_t> data(size_t(B * (T + 1)));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t <= T; ++t)
      data[size_t(b * (T + 1) + t)] = t == 0 ? b : int64_t((b * 7 + t * t * 3 + 1) % V);
  Tensor all = from_vector(data, {B, T + 1});
  Tensor x = all.narrow(1, 0, T).contiguous(), y = all.narrow(1, 1, T).contiguous();
  optim::AdamW opt({optim::ParamGroup{gpt->named_parameters()}}, {.lr = 1e-2, .weight_decay = 0.0});
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 120; ++step) {
    Tensor loss = cross_entropy((*gpt)(x).reshape({B * T, V}), y.reshape({B * T}));
    if (step == 0) first = loss.item<float>();
    last = loss.item<float>();
    loss.backward();
    opt.step();
    opt.zero_grad();
  }
  INFO("loss " << first << " -> " << last);
  CHECK(std::abs(first - std::log(double(V))) < 0.5);
  CHECK(last < 0.05);
}
