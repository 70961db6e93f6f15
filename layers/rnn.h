// Recurrent layers: multi-layer LSTM and GRU (torch.nn.LSTM / torch.nn.GRU,
// single direction) with PyTorch's parameter names and initialisation, so
// state dicts interoperate:
//
//   weight_ih_l0 [G H, I]  weight_hh_l0 [G H, H]  bias_ih_l0 [G H]  bias_hh_l0 [G H]
//   weight_ih_l1 [G H, H]  ...                                      (G = 4 LSTM, 3 GRU)
//
//   LSTM lstm({.input_size = 256, .hidden_size = 512, .num_layers = 2, .dropout = 0.2}, gen);
//   RNNState state;                                  // undefined: zeros
//   for (const Tensor& x : batches) {                // x [B, T, I]
//     auto [y, next] = lstm.forward(x, state);       // y [B, T, H]
//     state = next.detach();                         // truncated BPTT
//   }
//
// Every parameter is initialised uniform(-1/sqrt(H), 1/sqrt(H)) as PyTorch
// does. Dropout (training only) applies to the output of every layer but the
// last: Dropout modules (children dropout_l{k}, without state) drawing from
// Generator(seed, dropout_stream(k)) for layer k, so the trainer can re-key
// them like any other Dropout. Ops in core/ops_rnn.h.
#pragma once

#include <memory>
#include <utility>
#include <vector>

#include "core/ops_rnn.h"
#include "core/rng.h"
#include "layers/linear.h"
#include "layers/module.h"

namespace trainer {

struct RNNOptions {
  int64_t input_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 1;
  bool bias = true;
  bool batch_first = true;  // x [B, T, I]; false: [T, B, I] (torch's default)
  double dropout = 0.0;     // between layers
  uint64_t seed = 0;        // of the dropout generators
};

// The recurrent state between calls, as PyTorch passes it.
struct RNNState {
  Tensor h;  // [num_layers, B, H]
  Tensor c;  // [num_layers, B, H] (LSTM only; undefined for GRU)

  bool defined() const { return h.defined(); }
  // The same values cut from the graph: the state to carry into the next
  // batch under truncated backpropagation through time.
  RNNState detach() const;
};

// Shared by LSTM and GRU: the options, per-layer parameters and dropout.
class RNNBase : public Module {
 public:
  // x [B, T, I] (batch_first) -> y [B, T, H]; state undefined means zeros.
  // The returned state holds the last step of every layer (not detached).
  virtual std::pair<Tensor, RNNState> forward(const Tensor& x, const RNNState& state) = 0;
  // Module API: forward with a zero state, returning y only.
  Tensor forward(const Tensor& x) override { return forward(x, RNNState{}).first; }
  const RNNOptions& options() const { return options_; }

  // Per layer k: weight_ih_l{k}, weight_hh_l{k}, bias_ih_l{k}, bias_hh_l{k}
  // (biases undefined without bias).
  std::vector<Tensor> weight_ih, weight_hh, bias_ih, bias_hh;
  // Layer k's parameters under their names here, as one module (a block
  // member of a model cut into one block per layer).
  std::shared_ptr<ModulePart> layer_part(size_t k) const;

 protected:
  RNNBase(const RNNOptions& o, int64_t gates, Generator& gen);
  // x [B, T, I] (after the batch_first transpose) against the options and state.
  void check_input(const Tensor& x, const RNNState& state, bool needs_c) const;
  // The input of layer k + 1 from the output of layer k.
  Tensor dropout_between(const Tensor& y, size_t layer);

  RNNOptions options_;

 private:
  std::vector<std::shared_ptr<Dropout>> dropouts_;  // after layers 0 .. num_layers - 2
};

class LSTM : public RNNBase {
 public:
  LSTM(const RNNOptions& o, Generator& gen);
  using RNNBase::forward;
  std::pair<Tensor, RNNState> forward(const Tensor& x, const RNNState& state) override;
  // Layer k alone, as forward runs it: x [B, T, I_k] batch-first (after the
  // dropout between layers for k > 0) from h0 and c0 [B, H] (undefined:
  // zeros). forward is this for k = 0 .. num_layers - 1, bit for bit.
  LSTMOutput forward_layer(size_t k, const Tensor& x, const Tensor& h0, const Tensor& c0);
};

class GRU : public RNNBase {
 public:
  GRU(const RNNOptions& o, Generator& gen);
  using RNNBase::forward;
  std::pair<Tensor, RNNState> forward(const Tensor& x, const RNNState& state) override;
};

}  // namespace trainer
