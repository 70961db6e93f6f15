// LSTM language model (PyTorch's word_language_model RNNModel): an embedding,
// dropout, a stacked LSTM (dropout between layers), dropout and a linear
// decoder to the vocabulary, with that model's parameter names:
//
//   encoder.weight [V, E]  rnn.weight_ih_l0 [4H, E] ... rnn.bias_hh_l{L-1} [4H]
//   decoder.weight [V, H] (encoder.weight's tensor when tied)  decoder.bias [V]
//
//   auto lm = make_lstm_lm({.vocab_size = 256, .embedding_dim = 512, .hidden_size = 512,
//                           .num_layers = 2, .dropout = 0.2});
//   RNNState state;                                      // zeros for the first batch
//   LSTMLMOutput out = lm->forward(tokens, state);       // tokens i64 [B, T]
//   Tensor loss = cross_entropy(out.logits.reshape({-1, 256}), targets.reshape({-1}));
//   state = out.state.detach();                          // carried to the next batch
//
// Module::forward(tokens) runs from a zero state and returns the logits only,
// so the model also fits code written for stateless language models. With
// tie_weights (needs embedding_dim == hidden_size) the decoder multiplies by
// encoder.weight itself: one tensor, one parameter, in the state under both
// names as in PyTorch's state_dict (a checkpoint with only encoder.weight
// still loads). Initialisation from
// Generator(seed, kStreamInit): encoder and decoder weights uniform(-0.1, 0.1),
// decoder bias 0 (as word_language_model), LSTM as torch.nn.LSTM.
//
// Blocks (layers/block_list.h): one per LSTM layer, "rnn.0" .. "rnn.{L-1}",
// over model inputs tokens, h0, c0, .., h{L-1}, c{L-1} and outputs logits,
// h0, c0, ..: block k reads x (block 0: the tokens, embedded) and its layer's
// state h{k}, c{k} [B, H], and writes x (the last block: the decoder's
// logits) and its layer's state. Each layer's state stays with the stage
// holding that layer, so a pipeline of L stages runs a layer per rank, and
// with time chunks as its micro-batches (parallel.time_chunks) the layers
// work as a wavefront over the sequence.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "layers/block_list.h"
#include "layers/linear.h"
#include "layers/rnn.h"
#include "layers/transformer.h"

namespace trainer {

struct LSTMLMOptions {
  int64_t vocab_size = 256;
  int64_t embedding_dim = 512;
  int64_t hidden_size = 512;
  int64_t num_layers = 2;
  double dropout = 0.0;  // after the embedding, between LSTM layers, before the decoder
  bool tie_weights = false;
  uint64_t seed = 0;
};

struct LSTMLMOutput {
  Tensor logits;   // [B, T, V]
  RNNState state;  // h and c [num_layers, B, H] after the last step (not detached)
};

class LSTMLM : public Model {
 public:
  explicit LSTMLM(const LSTMLMOptions& o);
  // tokens i64 [B, T] from state (undefined: zeros) -> logits [B, T, V] and
  // the state after the last token.
  LSTMLMOutput forward(const Tensor& tokens, const RNNState& state);
  // tokens i64 [B, T] from a zero state -> logits [B, T, V].
  Tensor forward(const Tensor& tokens) override { return forward(tokens, RNNState{}).logits; }
  const LSTMLMOptions& options() const { return options_; }
  // The decoder's weight [V, H] (encoder.weight when tied).
  const Tensor& decoder_weight() const { return decoder_weight_; }
  void upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                            const std::string& file) const override;

  std::shared_ptr<Embedding> encoder;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<LSTM> rnn;
  std::shared_ptr<Linear> decoder;  // null when tied (then the model owns decoder.bias)

 private:
  LSTMLMOptions options_;
  Tensor decoder_weight_, decoder_bias_;  // [V, H], [V]
};

std::shared_ptr<LSTMLM> make_lstm_lm(const LSTMLMOptions& options = {});

}  // namespace trainer
