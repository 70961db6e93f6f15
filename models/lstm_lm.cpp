#include "models/lstm_lm.h"

#include "core/ops.h"
#include "layers/init.h"

namespace trainer {

namespace {

// The decoder of a tied model: only its bias is its own ("decoder.bias").
class TiedDecoderBias : public Module {
 public:
  explicit TiedDecoderBias(int64_t vocab_size) {
    bias = register_parameter("bias", zeros({vocab_size}));
  }
  Tensor forward(const Tensor& x) override { return x + bias; }
  Tensor bias;
};

}  // namespace

LSTMLM::LSTMLM(const LSTMLMOptions& o) : options_(o) {
  CHECK(o.vocab_size >= 1 && o.embedding_dim >= 1 && o.hidden_size >= 1 && o.num_layers >= 1)
      << "LSTMLM: vocab " << o.vocab_size << ", embedding " << o.embedding_dim << ", hidden "
      << o.hidden_size << ", " << o.num_layers << " layers";
  CHECK(!o.tie_weights || o.embedding_dim == o.hidden_size)
      << "LSTMLM: tie_weights needs embedding_dim (" << o.embedding_dim << ") == hidden_size ("
      << o.hidden_size << ")";
  Generator gen(o.seed, kStreamInit);
  encoder =
      register_module("encoder", std::make_shared<Embedding>(o.vocab_size, o.embedding_dim, gen));
  uniform_(encoder->weight, -0.1, 0.1, gen);
  // Dropout sites 0 .. L-2 are the LSTM's, L this one (used on both sides).
  drop = register_module(
      "drop", std::make_shared<Dropout>(o.dropout,
                                        Generator(o.seed, dropout_stream(uint64_t(o.num_layers)))));
  rnn = register_module("rnn", std::make_shared<LSTM>(RNNOptions{.input_size = o.embedding_dim,
                                                                 .hidden_size = o.hidden_size,
                                                                 .num_layers = o.num_layers,
                                                                 .bias = true,
                                                                 .batch_first = true,
                                                                 .dropout = o.dropout,
                                                                 .seed = o.seed},
                                                      gen));
  if (o.tie_weights) {
    auto tied = register_module("decoder", std::make_shared<TiedDecoderBias>(o.vocab_size));
    decoder_weight_ = encoder->weight;
    decoder_bias_ = tied->bias;
  } else {
    decoder =
        register_module("decoder", std::make_shared<Linear>(o.hidden_size, o.vocab_size, gen));
    uniform_(decoder->weight, -0.1, 0.1, gen);
    backend(decoder->bias.device()).fill(decoder->bias, 0.0);
    decoder_weight_ = decoder->weight;
    decoder_bias_ = decoder->bias;
  }

  std::shared_ptr<Module> decoder_module = children().back().second;
  std::vector<BlockSpec> specs;
  specs.push_back({.name = "embed",
                   .members = {{"encoder", encoder}, {"drop", drop}},
                   .inputs = {"tokens"},
                   .outputs = {"x"},
                   .fn = [this](const TensorList& in) {
                     const Tensor& tokens = in[0];
                     CHECK(tokens.dim() == 2)
                         << "LSTMLM expects tokens [B, T], got " << tokens.shape_str();
                     return TensorList{(*drop)((*encoder)(tokens))};  // [B, T, E]
                   }});
  specs.push_back({.name = "rnn",
                   .members = {{"rnn", rnn}},
                   .inputs = {"x", "h", "c"},
                   .outputs = {"x", "h", "c"},
                   .fn = [this](const TensorList& in) {
                     auto [y, next] = rnn->forward(in[0], RNNState{in[1], in[2]});  // [B, T, H]
                     return TensorList{y, next.h, next.c};
                   }});
  specs.push_back({.name = "head",
                   .members = {{"drop", drop}, {"decoder", decoder_module}},
                   .inputs = {"x"},
                   .outputs = {"logits"},
                   .fn = [this](const TensorList& in) {
                     return TensorList{linear((*drop)(in[0]), decoder_weight_, decoder_bias_)};
                   }});  // [B, T, V]
  set_blocks(BlockList({"tokens", "h", "c"}, {"logits", "h", "c"}, std::move(specs)));
}

LSTMLMOutput LSTMLM::forward(const Tensor& tokens, const RNNState& state) {
  TensorList out = blocks().run({tokens, state.h, state.c});
  return {out[0], RNNState{out[1], out[2]}};
}

std::shared_ptr<LSTMLM> make_lstm_lm(const LSTMLMOptions& options) {
  return std::make_shared<LSTMLM>(options);
}

}  // namespace trainer
