// Autoregressive sampling from GPT, Llama and the LSTM LM.
#include "models/sample.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "core/autograd.h"
#include "core/ops.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "models/lstm_lm.h"

namespace trainer {

namespace {

// Eval mode and no gradients for the scope of a sampling call.
class InferenceScope {
 public:
  explicit InferenceScope(Module& model) : model_(model), was_training_(model.is_training()) {
    model_.eval();
  }
  ~InferenceScope() { model_.train(was_training_); }
  InferenceScope(const InferenceScope&) = delete;
  InferenceScope& operator=(const InferenceScope&) = delete;

 private:
  Module& model_;
  bool was_training_;
  autograd::NoGradGuard no_grad_;
};

void check_request(const std::vector<int64_t>& prompt, const SampleOptions& o, int64_t vocab) {
  if (prompt.empty()) throw Error("sampling needs a prompt of at least one token");
  for (int64_t id : prompt)
    if (id < 0 || id >= vocab)
      throw Error(cat("prompt token ", id, " is outside the model's vocabulary of ", vocab));
  if (o.max_new_tokens < 0 || o.temperature < 0 || o.top_k < 0)
    throw Error(cat("sampling: tokens ", o.max_new_tokens, ", temperature ", o.temperature,
                    ", top-k ", o.top_k, " must not be negative"));
}

// The last position's logits of [1, T, V] as a vector of V floats.
std::vector<float> last_row(const Tensor& logits) {
  return logits.select(0, 0).select(0, logits.size(1) - 1).to_vector<float>();
}

}  // namespace

int64_t pick_token(const std::vector<float>& logits, const SampleOptions& o, Generator& gen) {
  CHECK(!logits.empty()) << "pick_token: no logits";
  const int64_t V = int64_t(logits.size());
  if (o.temperature == 0.0)
    return int64_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  // Tokens below the k-th largest logit get no probability.
  float threshold = -std::numeric_limits<float>::infinity();
  if (o.top_k > 0 && o.top_k < V) {
    std::vector<float> sorted = logits;
    std::nth_element(sorted.begin(), sorted.begin() + (o.top_k - 1), sorted.end(),
                     std::greater<float>());
    threshold = sorted[size_t(o.top_k - 1)];
  }
  const double top = double(*std::max_element(logits.begin(), logits.end()));
  std::vector<double> weight(size_t(V), 0.0);
  double total = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (logits[size_t(v)] < threshold) continue;
    weight[size_t(v)] = std::exp((double(logits[size_t(v)]) - top) / o.temperature);
    total += weight[size_t(v)];
  }
  // Inverse CDF of one uniform draw; the last kept token absorbs rounding.
  const double target = double(philox_uniform(gen.next(1), 0)) * total;
  double cumulative = 0;
  int64_t last_kept = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (weight[size_t(v)] == 0.0) continue;
    cumulative += weight[size_t(v)];
    last_kept = v;
    if (target < cumulative) return v;
  }
  return last_kept;
}

namespace {

// The generation loop both models share: next_logits(ids) is the model's
// output [1, T, V] whose last row scores the token after ids.
template <class Model, class NextLogits>
std::vector<int64_t> generate(Model& model, const std::vector<int64_t>& prompt,
                              const SampleOptions& o, NextLogits next_logits) {
  const int64_t vocab = model.options().vocab_size;
  check_request(prompt, o, o.vocab_size > 0 ? std::min(o.vocab_size, vocab) : vocab);
  InferenceScope scope(model);
  Generator gen(o.seed, kStreamSampling);
  std::vector<int64_t> ids = prompt;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    std::vector<float> logits = last_row(next_logits(ids));
    if (o.vocab_size > 0 && o.vocab_size < int64_t(logits.size()))
      logits.resize(size_t(o.vocab_size));
    ids.push_back(pick_token(logits, o, gen));
  }
  return ids;
}

}  // namespace

// A Transformer over at most `block` positions: the last `block` tokens each step.
template <class Transformer>
std::vector<int64_t> sample_windowed(Transformer& model, int64_t block,
                                     const std::vector<int64_t>& prompt, const SampleOptions& o) {
  return generate(model, prompt, o, [&](const std::vector<int64_t>& ids) {
    const int64_t T = std::min<int64_t>(int64_t(ids.size()), block);
    std::vector<int64_t> context(ids.end() - T, ids.end());
    return model(from_vector(context, {1, T}));
  });
}

// The prompt once, then one token at a time from the carried state.
std::vector<int64_t> sample(LSTMLM& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& o) {
  RNNState state;
  return generate(model, prompt, o, [&](const std::vector<int64_t>& ids) {
    const bool first = !state.defined();
    Tensor tokens = first ? from_vector(ids, {1, int64_t(ids.size())})
                          : from_vector(std::vector<int64_t>{ids.back()}, {1, 1});
    LSTMLMOutput out = model.forward(tokens, state);
    state = out.state;
    return out.logits;
  });
}

std::vector<int64_t> sample(Module& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& o) {
  if (auto* gpt = dynamic_cast<GPT*>(&model))
    return sample_windowed(*gpt, gpt->options().block_size, prompt, o);
  if (auto* llama = dynamic_cast<Llama*>(&model))
    return sample_windowed(*llama, llama->options().max_position_embeddings, prompt, o);
  if (auto* lstm = dynamic_cast<LSTMLM*>(&model)) return sample(*lstm, prompt, o);
  throw Error("sampling needs a language model (gpt, llama or lstm_lm)");
}

}  // namespace trainer
