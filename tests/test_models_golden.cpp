// Models against PyTorch: ResNet-18 (torchvision, batch norm in training
// mode), GPT (nanoGPT, tied head, exact and tanh GELU) and the LSTM LM
// (word_language_model, carried state) with fixed weights and inputs give
// the logits, loss, states, batch-norm statistics and parameter gradients
// that scripts/golden_models.py computed with PyTorch (tests/golden_models.h);
// Llama (grouped- and multi-query attention, RoPE unscaled, linear and Llama
// 3 scaled, tied and untied heads) gives Hugging Face LlamaForCausalLM's
// (scripts/golden_llama.py, tests/golden_llama.h). The weight and input
// formulas below are the scripts'.
//
// Tolerances: f32 rounds at 2^-24 = 6e-8, and a sum of K products carries
// an error of about sqrt(K) of those relative to its terms' magnitude (K up
// to 4608 here: 3x3x512), about 4e-6 per layer; every layer adds its
// share. Outputs, states, statistics and the loss: 5e-5 relative plus 5e-6
// of the entry's largest magnitude. Gradients, which pass back through every
// layer (ResNet-18: 20 batch norms over as few as 8 values per channel), 5e-4
// relative plus 1e-4 of the largest. (The values agreed to a fifth of these
// bounds when they were set.)
#include "tests/testing.h"

#include <cmath>

#include "models/gpt.h"
#include "models/lstm_lm.h"
#include "models/registry.h"
#include "tests/golden_llama.h"
#include "tests/golden_models.h"

using namespace trainer;
using namespace trainer::testing;
using golden::GoldenEntry;

namespace {

// uniform(j, i) in [-1, 1): SplitMix64 of (j << 32 | i), its top 24 bits
// scaled (exact in f32). Pseudo-random rather than smooth in i, so that no
// two channels are alike and batch norm never divides by a tiny variance.
double uniform(uint64_t j, uint64_t i) {
  uint64_t z = ((j << 32) | i) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return double(z >> 40) * (2.0 / double(1 << 24)) - 1.0;
}

// Parameter j of named_parameters(), element i: v = uniform(j, i);
// v / sqrt(fan_in) for matrices and kernels, 1 + 0.1 v for one-dim weights
// (norm gains), 0.1 v for the other one-dim tensors (biases).
void set_golden_weights(Module& model) {
  autograd::NoGradGuard no_grad;
  const std::vector<NamedTensor> params = model.named_parameters();
  for (size_t j = 0; j < params.size(); ++j) {
    const Tensor& p = params[j].tensor;
    const bool gain = p.dim() == 1 && params[j].name.size() >= 6 &&
                      params[j].name.compare(params[j].name.size() - 6, 6, "weight") == 0;
    const double fan_in = p.dim() >= 2 ? double(p.numel() / p.size(0)) : 1.0;
    std::vector<float> v(size_t(p.numel()));
    for (size_t i = 0; i < v.size(); ++i) {
      double s = uniform(j, i);
      v[i] = float(p.dim() >= 2 ? s / std::sqrt(fan_in) : gain ? 1.0 + 0.1 * s : 0.1 * s);
    }
    Tensor dst = p;
    dst.copy_(from_vector(v, p.shape()));
  }
}

Tensor formula(const Shape& shape, const std::function<double(double)>& f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(f(double(i)));
  return from_vector(v, shape);
}

Tensor tokens(int64_t B, int64_t T, int64_t V, int64_t mul, int64_t add) {
  std::vector<int64_t> t(size_t(B * T));
  for (size_t i = 0; i < t.size(); ++i) t[i] = (mul * int64_t(i) + add) % V;
  return from_vector(t, {B, T});
}

struct Tolerance {
  double rtol, scale_atol;  // |a - e| <= rtol |e| + scale_atol max|e|
};
constexpr Tolerance kValues{5e-5, 5e-6}, kGradients{5e-4, 1e-4};

// The tensor an entry names: an output, or a parameter's gradient, or a buffer.
Tensor lookup(const std::string& name, const std::map<std::string, Tensor>& outputs,
              const Module& model) {
  if (outputs.count(name)) return outputs.at(name);
  const bool grad = name.rfind("grad:", 0) == 0;
  const std::string tensor = name.substr(name.find(':') + 1);
  for (const NamedTensor& t : model.state())
    if (t.name == tensor) return grad ? t.tensor.grad() : t.tensor;
  FAIL("no tensor " << name);
  return Tensor();
}

void compare(const std::vector<GoldenEntry>& entries, const std::map<std::string, Tensor>& outputs,
             const Module& model) {
  for (const GoldenEntry& e : entries) {
    INFO(e.name);
    Tensor t = lookup(e.name, outputs, model);
    REQUIRE(t.defined());
    std::vector<double> flat = t.to(DType::f64).contiguous().to_vector<double>();
    double largest = 0;
    for (float v : e.values) largest = std::max(largest, double(std::fabs(v)));
    const Tolerance tol = std::string(e.name).rfind("grad:", 0) == 0 ? kGradients : kValues;
    for (size_t k = 0; k < e.values.size(); ++k) {
      const size_t i = k * size_t(e.stride);
      REQUIRE(i < flat.size());
      const double expected = e.values[k];
      INFO("element " << i << ": ours " << flat[i] << ", PyTorch " << expected);
      CHECK(std::fabs(flat[i] - expected) <=
            tol.rtol * std::fabs(expected) + tol.scale_atol * largest);
    }
  }
}

void check_gpt(GeluApprox gelu, const std::vector<GoldenEntry>& golden) {
  const int64_t V = 13, T = 8;
  auto gpt = make_model("gpt", {.dropout = 0.0,
                                .vocab_size = V,
                                .context = T,
                                .n_layer = 2,
                                .n_head = 2,
                                .d_model = 16,
                                .tie_weights = true,
                                .gelu = gelu});
  set_golden_weights(*gpt);
  Tensor logits = (*gpt)(tokens(2, T, V, 7, 3));
  Tensor loss = cross_entropy(logits.reshape({-1, V}), tokens(2, T, V, 5, 1).reshape({-1}));
  loss.backward();
  compare(golden, {{"logits", logits}, {"loss", loss}}, *gpt);
}

struct LlamaCase {
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads;
  bool tied;
  RopeOptions rope;
};

void check_llama(const LlamaCase& c, const std::vector<GoldenEntry>& golden) {
  const int64_t T = 9;
  auto llama = make_model("llama", {.dropout = 0.0,
                                    .vocab_size = c.vocab,
                                    .context = 64,
                                    .n_layer = c.layers,
                                    .n_head = c.heads,
                                    .d_model = c.hidden,
                                    .tie_weights = c.tied,
                                    .intermediate_size = c.intermediate,
                                    .n_kv_head = c.kv_heads,
                                    .rms_norm_eps = 1e-5,
                                    .rope = c.rope});
  set_golden_weights(*llama);
  Tensor logits = (*llama)(tokens(2, T, c.vocab, 7, 3));
  Tensor loss =
      cross_entropy(logits.reshape({-1, c.vocab}), tokens(2, T, c.vocab, 5, 1).reshape({-1}));
  loss.backward();
  compare(golden, {{"logits", logits}, {"loss", loss}}, *llama);
}

}  // namespace

TEST_CASE("golden: Llama matches Hugging Face's LlamaForCausalLM", "[models][golden][llama]") {
  SECTION("grouped-query attention, untied") {
    check_llama({37, 32, 48, 2, 4, 2, false, {}}, golden::kLlamaGQA);
  }
  SECTION("multi-query attention, linear RoPE scaling") {
    check_llama({29, 32, 40, 2, 4, 1, false, {.scaling = "linear", .factor = 2.0}},
                golden::kLlamaMQALinear);
  }
  SECTION("tied head, Llama 3 RoPE scaling") {
    check_llama({31,
                 64,
                 48,
                 2,
                 4,
                 2,
                 true,
                 {.theta = 500000.0,
                  .scaling = "llama3",
                  .factor = 8.0,
                  .low_freq_factor = 1.0,
                  .high_freq_factor = 4.0,
                  .original_max_position = 48}},
                golden::kLlamaTiedLlama3);
  }
}

TEST_CASE("golden: ResNet-18 matches torchvision (batch norm in training mode)",
          "[models][golden]") {
  auto net = make_model("resnet18", {.num_classes = 5, .in_channels = 3});
  set_golden_weights(*net);
  Tensor x = formula({2, 3, 64, 64}, [](double i) { return uniform(1000, uint64_t(i)); });
  Tensor logits = (*net)(x);
  Tensor loss = cross_entropy(logits, from_vector(std::vector<int64_t>{1, 3}, {2}));
  loss.backward();
  compare(golden::kResNet18, {{"logits", logits}, {"loss", loss}}, *net);
}

TEST_CASE("golden: GPT matches nanoGPT with exact and tanh GELU", "[models][golden]") {
  SECTION("exact") { check_gpt(GeluApprox::none, golden::kGPTExact); }
  SECTION("tanh") { check_gpt(GeluApprox::tanh, golden::kGPTTanh); }
}

TEST_CASE("golden: LSTM LM matches PyTorch's word_language_model from a given state",
          "[models][golden]") {
  const int64_t V = 11, T = 6, H = 12, L = 2;
  auto model = make_model("lstm_lm", {.dropout = 0.0,
                                      .vocab_size = V,
                                      .n_layer = L,
                                      .d_model = H,
                                      .hidden = H,
                                      .tie_weights = false});
  auto lm = std::dynamic_pointer_cast<LSTMLM>(model);
  REQUIRE(lm);
  set_golden_weights(*lm);
  RNNState state{formula({L, 2, H}, [](double i) { return 0.5 * std::sin(0.2 * i + 1); }),
                 formula({L, 2, H}, [](double i) { return 0.5 * std::cos(0.3 * i); })};
  LSTMLMOutput out = lm->forward(tokens(2, T, V, 7, 3), state);
  Tensor loss = cross_entropy(out.logits.reshape({-1, V}), tokens(2, T, V, 5, 1).reshape({-1}));
  loss.backward();
  compare(golden::kLSTMLM,
          {{"logits", out.logits}, {"loss", loss}, {"h", out.state.h}, {"c", out.state.c}}, *lm);
}
