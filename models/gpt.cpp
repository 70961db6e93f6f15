#include "models/gpt.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/ops.h"
#include "layers/init.h"

namespace trainer {

namespace {

// A container named "h" whose children are the blocks "0", "1", ...
class BlockList : public Module {
 public:
  void add(const std::shared_ptr<Block>& b) {
    register_module(std::to_string(children().size()), b);
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = x;
    for (const auto& [name, m] : children()) y = (*m)(y);
    return y;
  }
};

void init_linear(Linear& l, double std, Generator& gen) {
  normal_(l.weight, 0.0, std, gen);
  if (l.bias.defined()) backend(l.bias.device()).fill(l.bias, 0.0);
}

}  // namespace

GPT::GPT(const GPTOptions& o) : options_(o) {
  CHECK(o.vocab_size >= 1 && o.block_size >= 1 && o.n_layer >= 0 && o.n_head >= 1 &&
        o.n_embd >= 1 && o.n_embd % o.n_head == 0)
      << "GPT: vocab " << o.vocab_size << ", block " << o.block_size << ", " << o.n_layer
      << " layers, " << o.n_head << " heads, width " << o.n_embd;
  Generator gen(o.seed, kStreamInit);
  TransformerOptions t{.d_model = o.n_embd,
                       .num_heads = o.n_head,
                       .dropout = o.dropout,
                       .bias = o.bias,
                       .ln_eps = 1e-5,
                       .seed = o.seed};
  wte = register_module("wte", std::make_shared<Embedding>(o.vocab_size, o.n_embd, gen));
  wpe = register_module("wpe", std::make_shared<Embedding>(o.block_size, o.n_embd, gen));
  drop = register_module("drop", std::make_shared<Dropout>(
                                     o.dropout, Generator(o.seed, dropout_stream(3 * o.n_layer))));
  auto blocks = register_module("h", std::make_shared<BlockList>());
  double proj_std = 0.02 / std::sqrt(2.0 * double(std::max<int64_t>(o.n_layer, 1)));
  for (int64_t i = 0; i < o.n_layer; ++i) {
    auto b = std::make_shared<Block>(t, gen, uint64_t(i));
    init_linear(*b->attn->c_attn, 0.02, gen);
    init_linear(*b->attn->c_proj, proj_std, gen);
    init_linear(*b->mlp->c_fc, 0.02, gen);
    init_linear(*b->mlp->c_proj, proj_std, gen);
    blocks->add(b);
    h.push_back(b);
  }
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(o.n_embd, 1e-5, o.bias));
  if (o.tie_weights) {
    head_weight_ = wte->weight;
  } else {
    lm_head = register_module(
        "lm_head", std::make_shared<Linear>(o.n_embd, o.vocab_size, gen, /*bias=*/false));
    init_linear(*lm_head, 0.02, gen);
    head_weight_ = lm_head->weight;
  }
}

Tensor GPT::forward(const Tensor& tokens) {
  CHECK(tokens.dim() == 2) << "GPT expects tokens [B, T], got " << tokens.shape_str();
  int64_t T = tokens.size(1);
  CHECK(T >= 1 && T <= options_.block_size)
      << "GPT: sequence of " << T << " tokens, block size " << options_.block_size;
  Tensor pos = arange(T, DType::i64, tokens.device());
  Tensor x = (*drop)((*wte)(tokens) + (*wpe)(pos));  // [B, T, D]
  for (const auto& b : h) x = (*b)(x);
  return linear((*ln_f)(x), head_weight_, Tensor());  // [B, T, V]
}

std::shared_ptr<GPT> make_gpt(const GPTOptions& options) { return std::make_shared<GPT>(options); }

}  // namespace trainer
