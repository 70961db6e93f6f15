// Autoregressive sampling from a trained language model (GPT, Llama or the
// LSTM LM): feed the prompt, pick the next token from the last position's
// logits, append it, repeat.
//
// The pick: temperature 0 is greedy (the first argmax); otherwise a draw
// from softmax(logits / temperature) over the top_k largest logits (ties
// with the k-th are kept; top_k 0 keeps all). Each token takes one uniform
// number from Generator(seed, kStreamSampling), so a seed gives the same
// text on any machine whose model computes the same logits.
//
// GPT and Llama rerun the last block_size (max_position_embeddings) tokens
// for every new token (the context is cropped to it). The LSTM LM runs the prompt once and then
// one token at a time, carrying its state, so its context is unbounded.
//
//   std::vector<int64_t> ids = sample(*gpt, vocab.encode("In the beginning"),
//                                     {.max_new_tokens = 200, .temperature = 0.8, .top_k = 40});
//   std::cout << vocab.decode(ids);
#pragma once

#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "layers/module.h"

namespace trainer {

class LSTMLM;

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  uint64_t seed = 0;
  // > 0: only tokens [0, vocab_size) are picked, the logits past them left
  // out (a model with more rows than the corpus has symbols:
  // model.vocab_size larger than the data's). 0: every logit.
  int64_t vocab_size = 0;
};

// The next token from one row of logits [V], drawing from gen (advanced by
// one block unless greedy).
int64_t pick_token(const std::vector<float>& logits, const SampleOptions& options, Generator& gen);

// The prompt (at least one token) followed by max_new_tokens sampled tokens.
// The model runs in eval mode without gradients; its mode is restored.
std::vector<int64_t> sample(LSTMLM& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& options);
// GPT, Llama or the above by the model's type; Error for any other model.
std::vector<int64_t> sample(Module& model, const std::vector<int64_t>& prompt,
                            const SampleOptions& options);

}  // namespace trainer
