// Autoregressive sampling from GPT and the LSTM LM.
#include "models/sample.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "core/autograd.h"
#include "core/ops.h"
#include "models/gpt.h"
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

std::vector<int64_t> sample(GPT& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& o) {
  check_request(prompt, o, model.options().vocab_size);
  InferenceScope scope(model);
  Generator gen(o.seed, kStreamSampling);
  std::vector<int64_t> ids = prompt;
  const int64_t block = model.options().block_size;
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t T = std::min<int64_t>(int64_t(ids.size()), block);
    std::vector<int64_t> context(ids.end() - T, ids.end());
    Tensor logits = model(from_vector(context, {1, T}));  // [1, T, V]
    ids.push_back(pick_token(last_row(logits), o, gen));
  }
  return ids;
}

std::vector<int64_t> sample(LSTMLM& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& o) {
  check_request(prompt, o, model.options().vocab_size);
  InferenceScope scope(model);
  Generator gen(o.seed, kStreamSampling);
  std::vector<int64_t> ids = prompt;
  LSTMLMOutput out = model.forward(from_vector(prompt, {1, int64_t(prompt.size())}), RNNState{});
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    int64_t next = pick_token(last_row(out.logits), o, gen);
    ids.push_back(next);
    if (i + 1 < o.max_new_tokens)
      out = model.forward(from_vector(std::vector<int64_t>{next}, {1, 1}), out.state);
  }
  return ids;
}

std::vector<int64_t> sample(Module& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& o) {
  if (auto* gpt = dynamic_cast<GPT*>(&model)) return sample(*gpt, prompt, o);
  if (auto* lstm = dynamic_cast<LSTMLM*>(&model)) return sample(*lstm, prompt, o);
  throw Error("sampling needs a language model (gpt or lstm_lm)");
}

}  // namespace trainer
