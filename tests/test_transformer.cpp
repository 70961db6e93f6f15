// Transformer ops, layers and GPT: layer norm and causal attention against
// finite differences, closed forms and a naive loop reference; the fused
// attention against the composed one it replaced (with and without dropout),
// fast kernels against reference ones, its memory; causality; weight tying;
// a tiny GPT overfitting a fixed batch.
#include "tests/lm_task.h"

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "core/allocator.h"
#include "core/ops_transformer.h"
#include "layers/linear.h"
#include "models/gpt.h"

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

Tensor attention_fn(const TensorList& in, int64_t heads, double p = 0.0) {
  Generator gen(0, kStreamDropout);
  return causal_attention(in[0], in[1], in[2], heads, p, /*training=*/p > 0.0, gen);
}

// The composed attention the fused op replaced: per head matmul, causal
// masked_fill, softmax, the dropout multipliers mult [B, NH, T, T]
// (undefined: none), matmul. It keeps every head's probabilities.
Tensor composed_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t NH,
                          const Tensor& mult = Tensor()) {
  int64_t T = q.size(1), HD = q.size(2) / NH;
  Tensor pos = arange(T, DType::i64);
  Tensor future = gt(pos.reshape({1, T}), pos.reshape({T, 1}));
  TensorList heads;
  for (int64_t h = 0; h < NH; ++h) {
    Tensor qh = q.narrow(2, h * HD, HD) * (1.0 / std::sqrt(double(HD)));
    Tensor scores = matmul(qh, k.narrow(2, h * HD, HD).transpose(1, 2));  // [B, T, T]
    scores = masked_fill(scores, future, -std::numeric_limits<double>::infinity());
    Tensor att = softmax(scores, -1);
    if (mult.defined()) att = att * mult.select(1, h);
    heads.push_back(matmul(att, v.narrow(2, h * HD, HD)));
  }
  return concat(heads, 2);
}

// The multipliers causal_attention draws from a generator in gen's state:
// bernoulli(1 - p) over [B, NH, T, T], scaled by 1 / (1 - p).
Tensor dropout_multipliers(Shape bnht, double p, Generator gen, DType dtype) {
  return bernoulli(bnht, 1.0 - p, gen, dtype) * (1.0 / (1.0 - p));
}

// Output and the gradient of the fused [B, T, 3D] input of f(q, k, v), q,
// k, v being views into it, under the probe cotangent.
struct FusedRun {
  Tensor out, grad_qkv;
};
FusedRun run_on_qkv(const Tensor& qkv_value,
                    const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& f) {
  Tensor qkv = qkv_value.detach().requires_grad_();
  int64_t D = qkv.size(2) / 3;
  Tensor out = f(qkv.narrow(2, 0, D), qkv.narrow(2, D, D), qkv.narrow(2, 2 * D, D));
  out.backward(probe_like(out));
  return {out.detach(), qkv.grad()};
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
    // Sums over a row of D (mean, variance, the backward's two dot
    // products) and, for the weight and bias gradients, over the rows.
    const int64_t n = std::max(D, x.numel() / D);
    const Reduction r{.length = n, .scale = 4 * std::sqrt(double(n))};
    check_fast_vs_reference(f, {x, w, b}, r);
    check_fast_vs_reference(f, {non_contiguous(x), w, b}, r);
  }
}

TEST_CASE("causal attention gradients match finite differences", "[transformer]") {
  Generator gen(4);
  for (int64_t heads : {1, 2}) {
    gradcheck([heads](const TensorList& in) { return attention_fn(in, heads); },
              {rand_f64({2, 4, 6}, gen), rand_f64({2, 4, 6}, gen), rand_f64({2, 4, 6}, gen)});
  }
  // Dropout on, fixed key: the backward must redraw the forward's mask.
  gradcheck([](const TensorList& in) { return attention_fn(in, 2, 0.3); },
            {rand_f64({2, 5, 4}, gen), rand_f64({2, 5, 4}, gen), rand_f64({2, 5, 4}, gen)});
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
}

TEST_CASE("fused attention matches the composed one on odd shapes and views", "[transformer]") {
  Generator gen(6);
  // T = 70 spans three query tiles of the CPU kernel, the last one ragged.
  for (Shape s : {Shape{2, 37, 15, 3}, Shape{1, 70, 8, 2}, Shape{3, 1, 4, 4}, Shape{2, 33, 6, 1}}) {
    int64_t B = s[0], T = s[1], D = s[2], NH = s[3];
    INFO("B " << B << " T " << T << " D " << D << " NH " << NH);
    auto fused = [NH](const Tensor& q, const Tensor& k, const Tensor& v) {
      return attention_fn({q, k, v}, NH);
    };
    auto composed = [NH](const Tensor& q, const Tensor& k, const Tensor& v) {
      return composed_attention(q, k, v, NH);
    };
    for (DType dtype : {DType::f64, DType::f32}) {
      double tol = dtype == DType::f64 ? 1e-11 : 2e-5;
      Tensor qkv = rand_tensor({B, T, 3 * D}, gen, -2.0, 2.0, dtype);
      FusedRun a = run_on_qkv(qkv, fused), b = run_on_qkv(qkv, composed);
      require_close(a.out, b.out, tol, tol, "forward");
      require_close(a.grad_qkv, b.grad_qkv, tol, tol, "gradient");
    }
    // Views whose last stride is not 1 (the CPU kernel's fallback).
    Tensor q = rand_f64({B, D, T}, gen).transpose(1, 2);
    Tensor k = non_contiguous(rand_f64({B, T, D}, gen)), v = rand_f64({B, T, D}, gen);
    require_close(attention_fn({q, k, v}, NH), composed_attention(q, k, v, NH), 1e-11, 1e-11,
                  "strided views");
  }
}

TEST_CASE("attention on one fused qkv equals attention on its views", "[transformer]") {
  Generator gen(13);
  int64_t B = 2, T = 35, D = 12, NH = 3;
  for (DType dtype : {DType::f64, DType::f32}) {
    Tensor value = rand_tensor({B, T, 3 * D}, gen, -1.0, 1.0, dtype);
    FusedRun views = run_on_qkv(value, [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      Generator g(2, kStreamDropout);
      return causal_attention(q, k, v, NH, 0.2, true, g);
    });
    Tensor qkv = value.detach().requires_grad_();
    Generator g(2, kStreamDropout);
    Tensor out = causal_attention_qkv(qkv, NH, 0.2, true, g);
    out.backward(probe_like(out));
    require_close(out, views.out, 0.0, 0.0, "forward");
    require_close(qkv.grad(), views.grad_qkv, 1e-12, 1e-6, "gradient");
  }
  gradcheck(
      [](const TensorList& in) {
        Generator g(5, kStreamDropout);
        return causal_attention_qkv(in[0], 2, 0.3, true, g);
      },
      {rand_f64({2, 5, 12}, gen)});
}

TEST_CASE("fused attention fast kernels match the reference ones", "[transformer]") {
  Generator gen(7);
  for (Shape s : {Shape{2, 37, 15, 3}, Shape{1, 70, 8, 2}, Shape{2, 5, 12, 3}}) {
    int64_t B = s[0], T = s[1], D = s[2], NH = s[3];
    Tensor qkv = rand_tensor({B, T, 3 * D}, gen, -2.0, 2.0);
    TensorList views = {qkv.narrow(2, 0, D), qkv.narrow(2, D, D), qkv.narrow(2, 2 * D, D)};
    for (double p : {0.0, 0.25}) {
      INFO("T " << T << " dropout " << p);
      // Sums over T keys and D / NH head dims, values up to 2 (scores up to ~8).
      const int64_t n = std::max(T, D / NH);
      check_fast_vs_reference([NH, p](const TensorList& in) { return attention_fn(in, NH, p); },
                              views, {.length = n, .scale = 8 * std::sqrt(double(n))});
    }
  }
}

TEST_CASE("attention dropout: one mask per key, the same in forward and backward",
          "[transformer]") {
  Generator gen(8);
  int64_t B = 2, T = 41, D = 12, NH = 3;
  double p = 0.3;
  for (DType dtype : {DType::f64, DType::f32}) {
    double tol = dtype == DType::f64 ? 1e-11 : 2e-5;
    Tensor qkv = rand_tensor({B, T, 3 * D}, gen, -1.0, 1.0, dtype);
    Generator drop_gen(9, kStreamDropout, 5);
    Tensor mult = dropout_multipliers({B, NH, T, T}, p, drop_gen, dtype);
    FusedRun fused = run_on_qkv(qkv, [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      return causal_attention(q, k, v, NH, p, true, drop_gen);
    });
    // The generator advanced by exactly the mask's blocks.
    CHECK(drop_gen.offset() == 5 + philox_uniform_blocks(uint64_t(B * NH * T * T)));
    FusedRun composed = run_on_qkv(qkv, [&](const Tensor& q, const Tensor& k, const Tensor& v) {
      return composed_attention(q, k, v, NH, mult);
    });
    require_close(fused.out, composed.out, tol, tol, "forward with dropout");
    require_close(fused.grad_qkv, composed.grad_qkv, tol, tol, "gradient with dropout");
  }
  // Deterministic per key; another key gives another mask; eval is the identity.
  Tensor qkv = rand_tensor({B, T, 3 * D}, gen);
  TensorList in = {qkv.narrow(2, 0, D), qkv.narrow(2, D, D), qkv.narrow(2, 2 * D, D)};
  Generator g1(3, kStreamDropout), g2(3, kStreamDropout), g3(4, kStreamDropout);
  Tensor a = causal_attention(in[0], in[1], in[2], NH, p, true, g1);
  Tensor b = causal_attention(in[0], in[1], in[2], NH, p, true, g2);
  Tensor c = causal_attention(in[0], in[1], in[2], NH, p, true, g3);
  require_close(a, b, 0.0, 0.0, "same key");
  CHECK(max(abs(a - c)).item<float>() > 1e-3f);
  Tensor e = causal_attention(in[0], in[1], in[2], NH, p, false, g3);
  require_close(e, attention_fn(in, NH), 0.0, 0.0, "evaluation");
}

TEST_CASE("causal attention never looks ahead", "[transformer]") {
  Generator gen(10);
  int64_t B = 2, T = 45, D = 8, NH = 2;
  Tensor q = rand_tensor({B, T, D}, gen), k = rand_tensor({B, T, D}, gen);
  Tensor v = rand_tensor({B, T, D}, gen);
  Tensor base = attention_fn({q, k, v}, NH, 0.2);
  for (int64_t t : {int64_t(0), int64_t(33), T - 1}) {
    Tensor q2 = q.clone(), k2 = k.clone(), v2 = v.clone();
    for (Tensor* x : {&q2, &k2, &v2}) x->narrow(1, t, 1).copy_(rand_tensor({B, 1, D}, gen));
    Tensor out = attention_fn({q2, k2, v2}, NH, 0.2);
    if (t > 0) require_close(out.narrow(1, 0, t), base.narrow(1, 0, t), 0.0, 0.0, "before t");
    CHECK(max(abs(out.narrow(1, t, 1) - base.narrow(1, t, 1))).item<float>() > 1e-4f);
  }
}

TEST_CASE("fused attention never holds B x NH x T^2 scores", "[transformer]") {
  Generator gen(12);
  int64_t B = 2, T = 256, D = 64, NH = 8;
  const int64_t scores_bytes = B * NH * T * T * int64_t(sizeof(float));  // 4 MiB
  Tensor qkv = rand_tensor({B, T, 3 * D}, gen);
  Allocator& a = allocator(Device{});
  // Peak bytes above the starting point over forward and backward.
  auto peak_of = [&](const std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>& f) {
    Tensor leaf = qkv.detach().requires_grad_();
    Tensor probe = probe_like(empty({B, T, D}));
    a.reset_peak();
    int64_t start = a.stats().current_bytes;
    Tensor out = f(leaf.narrow(2, 0, D), leaf.narrow(2, D, D), leaf.narrow(2, 2 * D, D));
    out.backward(probe);
    return a.stats().peak_bytes - start;
  };
  int64_t fused = peak_of([&](const Tensor& q, const Tensor& k, const Tensor& v) {
    Generator g(1, kStreamDropout);
    return causal_attention(q, k, v, NH, 0.1, true, g);
  });
  int64_t composed = peak_of([&](const Tensor& q, const Tensor& k, const Tensor& v) {
    return composed_attention(q, k, v, NH);
  });
  INFO("peak above start: fused " << fused << " B, composed " << composed << " B, scores "
                                  << scores_bytes << " B");
  CHECK(composed > scores_bytes);  // the measurement sees a B x NH x T^2 tensor
  CHECK(fused < scores_bytes / 2);
}

TEST_CASE("linear: gradients, fast kernels and batched rows", "[transformer]") {
  Generator gen(14);
  gradcheck([](const TensorList& in) { return linear(in[0], in[1], in[2]); },
            {rand_f64({2, 3, 5}, gen), rand_f64({4, 5}, gen), rand_f64({4}, gen)});
  gradcheck([](const TensorList& in) { return linear(in[0].transpose(0, 1), in[1], Tensor()); },
            {rand_f64({3, 2, 5}, gen), rand_f64({4, 5}, gen)});
  Tensor x = rand_tensor({3, 7, 33}, gen);
  Tensor w = rand_tensor({17, 33}, gen), b = rand_tensor({17}, gen);
  auto f = [](const TensorList& in) { return linear(in[0], in[1], in[2]); };
  // K = 33 forward, 21 rows for the weight gradient, 17 outputs for the input's.
  const Reduction r{.length = 33, .scale = 1.5 * std::sqrt(33.0)};
  check_fast_vs_reference(f, {x, w, b}, r);
  check_fast_vs_reference(f, {non_contiguous(x), w, b}, r);
  require_close(linear(x, w, b), matmul(x, w.t()) + b, 1e-5, 1e-5, "closed form");
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
  // nanoGPT's state_dict, in its order: the tied head appears under both names.
  std::vector<std::string> expected = {"transformer.wte.weight", "transformer.wpe.weight"};
  for (const char* layer : {"0", "1"})
    for (const char* n :
         {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
          "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"})
      expected.push_back(std::string("transformer.h.") + layer + "." + n);
  for (const char* n : {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"})
    expected.push_back(n);
  std::vector<std::string> state_names, param_names;
  for (const NamedTensor& t : tied->state()) state_names.push_back(t.name);
  for (const NamedTensor& p : tied->named_parameters()) param_names.push_back(p.name);
  CHECK(state_names == expected);
  // Trained once: named_parameters lists the tied tensor under its first name only.
  expected.pop_back();
  CHECK(param_names == expected);
  CHECK(tied->lm_head_weight().data_ptr() == tied->wte->weight.data_ptr());

  o.tie_weights = false;
  auto untied = make_gpt(o);
  std::set<std::string> names;
  for (const NamedTensor& p : untied->named_parameters()) names.insert(p.name);
  CHECK(names.count("lm_head.weight") == 1);
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
  auto [x, y] = next_token_task(B, T, V);
  auto [first, last] = fit(gpt->named_parameters(), 1e-2, 120, [&] {
    return cross_entropy((*gpt)(x).reshape({B * T, V}), y.reshape({B * T}));
  });
  INFO("loss " << first << " -> " << last);
  CHECK(std::abs(first - std::log(double(V))) < 0.5);
  CHECK(last < 0.05);
}
