#include "models/lstm_lm.h"

#include "core/ops.h"
#include "layers/init.h"
#include "models/tied.h"

namespace trainer {

namespace {

// The decoder of a tied model: the embedding's tensor as "decoder.weight"
// (as in PyTorch's state_dict; a parameter once), its own "decoder.bias".
// Holding the weight lets a pipeline's last stage keep a tied copy.
class TiedDecoder : public Module {
 public:
  TiedDecoder(const Tensor& embedding, int64_t vocab_size) {
    weight = register_parameter("weight", embedding);
    bias = register_parameter("bias", zeros({vocab_size}));
  }
  Tensor forward(const Tensor& x) override { return linear(x, weight, bias); }
  Tensor weight, bias;
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
    auto tied =
        register_module("decoder", std::make_shared<TiedDecoder>(encoder->weight, o.vocab_size));
    decoder_weight_ = encoder->weight;
    decoder_bias_ = tied->bias;
  } else {
    decoder =
        register_module("decoder", std::make_shared<Linear>(o.hidden_size, o.vocab_size, gen));
    uniform_(decoder->weight, -0.1, 0.1, gen);
    decoder->bias.detach().fill_(0.0);
    decoder_weight_ = decoder->weight;
    decoder_bias_ = decoder->bias;
  }

  // One block per LSTM layer, the embedding in the first and the decoder in
  // the last, so that a pipeline of num_layers stages runs a layer per rank.
  std::shared_ptr<Module> decoder_module = children().back().second;
  const size_t L = size_t(o.num_layers);
  std::vector<std::string> model_inputs = {"tokens"}, model_outputs = {"logits"};
  std::vector<BlockSpec> specs;
  for (size_t k = 0; k < L; ++k) {
    const std::string h = cat("h", k), c = cat("c", k);
    model_inputs.insert(model_inputs.end(), {h, c});
    model_outputs.insert(model_outputs.end(), {h, c});
    BlockSpec spec{.name = cat("rnn.", k),
                   .members = {},
                   .inputs = {k == 0 ? "tokens" : "x", h, c},
                   .outputs = {k + 1 == L ? "logits" : "x", h, c},
                   .fn = [this, k, L](const TensorList& in) {
                     Tensor x = in[0];
                     if (k == 0) {
                       CHECK(x.dim() == 2) << "LSTMLM expects tokens [B, T], got " << x.shape_str();
                       x = (*drop)((*encoder)(x));  // [B, T, E]
                     }
                     LSTMOutput out = rnn->forward_layer(k, x, in[1], in[2]);  // [B, T, H]
                     Tensor y = out.y;
                     if (k + 1 == L) y = linear((*drop)(y), decoder_weight_, decoder_bias_);
                     return TensorList{y, out.h, out.c};
                   }};
    if (k == 0) spec.members.insert(spec.members.end(), {{"encoder", encoder}, {"drop", drop}});
    spec.members.push_back({"rnn", rnn->layer_part(k)});
    if (k + 1 == L) {
      if (k > 0) spec.members.push_back({"drop", drop});
      spec.members.push_back({"decoder", decoder_module});
    }
    specs.push_back(std::move(spec));
  }
  set_blocks(BlockList(std::move(model_inputs), std::move(model_outputs), std::move(specs)));
}

LSTMLMOutput LSTMLM::forward(const Tensor& tokens, const RNNState& state) {
  const int64_t L = options_.num_layers;
  TensorList in = {tokens};
  for (int64_t k = 0; k < L; ++k) {
    in.push_back(state.defined() ? state.h.select(0, k) : Tensor());
    in.push_back(state.defined() ? state.c.select(0, k) : Tensor());
  }
  TensorList out = blocks().run(in);
  TensorList hs, cs;
  for (int64_t k = 0; k < L; ++k) {
    hs.push_back(out[size_t(1 + 2 * k)]);
    cs.push_back(out[size_t(2 + 2 * k)]);
  }
  return {out[0], RNNState{stack(hs, 0), stack(cs, 0)}};
}

void LSTMLM::upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                                  const std::string& file) const {
  if (options_.tie_weights)
    upgrade_tied_weight(tensors, "encoder.weight", "decoder.weight", file, "this LSTM LM");
}

std::shared_ptr<LSTMLM> make_lstm_lm(const LSTMLMOptions& options) {
  return std::make_shared<LSTMLM>(options);
}

}  // namespace trainer
