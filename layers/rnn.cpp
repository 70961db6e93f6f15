#include "layers/rnn.h"

#include <cmath>
#include <string>

#include "layers/init.h"
#include "layers/transformer.h"

namespace trainer {

RNNState RNNState::detach() const {
  return {h.defined() ? h.detach() : Tensor(), c.defined() ? c.detach() : Tensor()};
}

RNNBase::RNNBase(const RNNOptions& o, int64_t gates, Generator& gen) : options_(o) {
  CHECK(o.input_size >= 1 && o.hidden_size >= 1 && o.num_layers >= 1)
      << "RNN: input " << o.input_size << ", hidden " << o.hidden_size << ", " << o.num_layers
      << " layers";
  CHECK(o.dropout >= 0.0 && o.dropout < 1.0) << "RNN: dropout " << o.dropout << " outside [0, 1)";
  int64_t H = o.hidden_size;
  double bound = 1.0 / std::sqrt(double(H));
  // torch.nn.LSTM registers per layer weight_ih, weight_hh, bias_ih, bias_hh
  // and draws every parameter in that order.
  for (int64_t k = 0; k < o.num_layers; ++k) {
    std::string l = "_l" + std::to_string(k);
    int64_t in = k == 0 ? o.input_size : H;
    weight_ih.push_back(register_parameter("weight_ih" + l, empty({gates * H, in})));
    weight_hh.push_back(register_parameter("weight_hh" + l, empty({gates * H, H})));
    uniform_(weight_ih.back(), -bound, bound, gen);
    uniform_(weight_hh.back(), -bound, bound, gen);
    if (o.bias) {
      bias_ih.push_back(register_parameter("bias_ih" + l, empty({gates * H})));
      bias_hh.push_back(register_parameter("bias_hh" + l, empty({gates * H})));
      uniform_(bias_ih.back(), -bound, bound, gen);
      uniform_(bias_hh.back(), -bound, bound, gen);
    } else {
      bias_ih.emplace_back();
      bias_hh.emplace_back();
    }
  }
  for (int64_t k = 0; k + 1 < o.num_layers; ++k)
    dropouts_.push_back(register_module(
        "dropout_l" + std::to_string(k),
        std::make_shared<Dropout>(o.dropout, Generator(o.seed, dropout_stream(uint64_t(k))))));
}

void RNNBase::check_input(const Tensor& x, const RNNState& state, bool needs_c) const {
  const RNNOptions& o = options_;
  CHECK(x.dim() == 3 && x.size(2) == o.input_size)
      << "RNN expects x [" << (o.batch_first ? "B, T, " : "T, B, ") << o.input_size << "], got "
      << x.shape_str();
  if (!state.defined()) return;
  Shape want{o.num_layers, x.size(0), o.hidden_size};
  CHECK(state.h.shape() == want) << "RNN: state h " << state.h.shape_str() << ", expected "
                                 << shape_str(want);
  if (needs_c)
    CHECK(state.c.defined() && state.c.shape() == want)
        << "LSTM: state c " << (state.c.defined() ? state.c.shape_str() : "undefined")
        << ", expected " << shape_str(want);
}

Tensor RNNBase::dropout_between(const Tensor& y, size_t layer) { return (*dropouts_[layer])(y); }

std::shared_ptr<ModulePart> RNNBase::layer_part(size_t k) const {
  CHECK_LT(k, weight_ih.size()) << "RNN layer";
  const std::string suffix = "_l" + std::to_string(k);
  std::vector<NamedTensor> mine;
  for (const NamedTensor& p : named_parameters())
    if (p.name.size() > suffix.size() &&
        p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0)
      mine.push_back(p);
  return std::make_shared<ModulePart>(mine);
}

LSTM::LSTM(const RNNOptions& o, Generator& gen) : RNNBase(o, 4, gen) {}

std::pair<Tensor, RNNState> LSTM::forward(const Tensor& input, const RNNState& state) {
  Tensor x = options_.batch_first ? input : input.transpose(0, 1);
  check_input(x, state, /*needs_c=*/true);
  TensorList hs, cs;
  for (size_t k = 0; k < weight_ih.size(); ++k) {
    LSTMOutput out = forward_layer(k, x, state.defined() ? state.h.select(0, int64_t(k)) : Tensor(),
                                   state.defined() ? state.c.select(0, int64_t(k)) : Tensor());
    x = out.y;
    hs.push_back(out.h);
    cs.push_back(out.c);
  }
  Tensor y = options_.batch_first ? x : x.transpose(0, 1);
  return {y, RNNState{stack(hs, 0), stack(cs, 0)}};
}

LSTMOutput LSTM::forward_layer(size_t k, const Tensor& input, const Tensor& h0, const Tensor& c0) {
  CHECK_LT(k, weight_ih.size()) << "LSTM layer";
  Tensor x = k > 0 ? dropout_between(input, k - 1) : input;
  Tensor zero;
  if (!h0.defined() || !c0.defined())
    zero = zeros({x.size(0), options_.hidden_size}, x.dtype(), x.device());
  return lstm_layer(x, h0.defined() ? h0 : zero, c0.defined() ? c0 : zero, weight_ih[k],
                    weight_hh[k], bias_ih[k], bias_hh[k]);
}

GRU::GRU(const RNNOptions& o, Generator& gen) : RNNBase(o, 3, gen) {}

std::pair<Tensor, RNNState> GRU::forward(const Tensor& input, const RNNState& state) {
  Tensor x = options_.batch_first ? input : input.transpose(0, 1);
  check_input(x, state, /*needs_c=*/false);
  int64_t B = x.size(0), H = options_.hidden_size;
  Tensor zero = zeros({B, H}, x.dtype(), x.device());
  TensorList hs;
  for (size_t k = 0; k < weight_ih.size(); ++k) {
    if (k > 0) x = dropout_between(x, k - 1);
    Tensor h0 = state.defined() ? state.h.select(0, int64_t(k)) : zero;
    GRUOutput out = gru_layer(x, h0, weight_ih[k], weight_hh[k], bias_ih[k], bias_hh[k]);
    x = out.y;
    hs.push_back(out.h);
  }
  Tensor y = options_.batch_first ? x : x.transpose(0, 1);
  return {y, RNNState{stack(hs, 0), Tensor()}};
}

}  // namespace trainer
