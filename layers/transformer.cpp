#include "layers/transformer.h"

#include "core/autograd.h"
#include "core/ops_transformer.h"
#include "layers/init.h"

namespace trainer {

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator& gen) {
  CHECK(num_embeddings >= 1 && dim >= 1)
      << "Embedding: " << num_embeddings << " embeddings of width " << dim;
  weight = register_parameter("weight", empty({num_embeddings, dim}));
  normal_(weight, 0.0, 0.02, gen);
}

Tensor Embedding::forward(const Tensor& indices) {
  if (!group_) return embedding(weight, indices);
  Tensor partial = vocab_parallel_lookup(weight, indices, vocab_start_);
  return group_->sequence_parallel() ? reduce_scatter_sequence(partial, *group_)
                                     : reduce_from_region(partial, *group_);
}

void Embedding::shard_vocab(std::shared_ptr<TensorParallelGroup> g) {
  CHECK(!group_ && weight.size(0) % g->size() == 0)
      << "Embedding::shard_vocab: " << weight.size(0) << " rows over " << g->size() << " ranks";
  const ParameterSplit s{.dim = 0, .rank = g->rank(), .size = g->size()};
  autograd::NoGradGuard no_grad;
  vocab_start_ = weight.size(0) / g->size() * g->rank();
  weight = replace_parameter("weight", shard_of(weight.detach(), s), s);
  group_ = std::move(g);
}

void Embedding::pad_rows(int64_t rows) {
  CHECK(!group_) << "Embedding::pad_rows after shard_vocab";
  if (rows == weight.size(0)) return;
  autograd::NoGradGuard no_grad;
  weight = replace_parameter("weight", zero_padded_rows(weight.detach(), rows));
}

void Embedding::mark_sequence_parallel(const TensorParallelGroup& g) {
  weight = replace_parameter(
      "weight", weight,
      ParameterSplit{
          .kind = ParameterSplit::Kind::partial_gradient, .rank = g.rank(), .size = g.size()});
}

void LayerNorm::mark_sequence_parallel(const TensorParallelGroup& g) {
  const ParameterSplit s{
      .kind = ParameterSplit::Kind::partial_gradient, .rank = g.rank(), .size = g.size()};
  weight = replace_parameter("weight", weight, s);
  if (bias.defined()) bias = replace_parameter("bias", bias, s);
}

LayerNorm::LayerNorm(int64_t dim, double eps, bool with_bias) : eps_(eps) {
  CHECK(dim >= 1) << "LayerNorm: width " << dim;
  weight = register_parameter("weight", ones({dim}));
  if (with_bias) bias = register_parameter("bias", zeros({dim}));
}

Tensor LayerNorm::forward(const Tensor& x) {
  Tensor b = bias.defined() ? bias : zeros(weight.shape(), weight.dtype(), weight.device());
  return layer_norm(x, weight, b, eps_);
}

CausalSelfAttention::CausalSelfAttention(const TransformerOptions& o, Generator& gen,
                                         uint64_t dropout_site)
    : num_heads_(o.num_heads) {
  CHECK(o.num_heads >= 1 && o.d_model % o.num_heads == 0)
      << "CausalSelfAttention: width " << o.d_model << " is not a multiple of " << o.num_heads
      << " heads";
  c_attn =
      register_module("c_attn", std::make_shared<Linear>(o.d_model, 3 * o.d_model, gen, o.bias));
  c_proj = register_module("c_proj", std::make_shared<Linear>(o.d_model, o.d_model, gen, o.bias));
  attn_dropout = register_module(
      "attn_dropout",
      std::make_shared<Dropout>(o.dropout, Generator(o.seed, dropout_stream(dropout_site))));
  resid_dropout = register_module(
      "resid_dropout",
      std::make_shared<Dropout>(o.dropout, Generator(o.seed, dropout_stream(dropout_site + 1))));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  CHECK(x.dim() == 3) << "CausalSelfAttention expects [B, T, D], got " << x.shape_str();
  Tensor qkv = (*c_attn)(x);  // [B, T, 3D]: q, k, v side by side
  const int64_t D = qkv.size(2) / 3;
  Tensor y =
      cp_ ? context_parallel_attention(qkv.narrow(2, 0, D), qkv.narrow(2, D, D),
                                       qkv.narrow(2, 2 * D, D), num_heads_, 0, attn_dropout->p(),
                                       is_training(), attn_dropout->generator(), *cp_)
          : causal_attention_qkv(qkv, num_heads_, attn_dropout->p(), is_training(),
                                 attn_dropout->generator());
  return (*resid_dropout)((*c_proj)(y));
}

void CausalSelfAttention::shard(std::shared_ptr<TensorParallelGroup> g) {
  CHECK(num_heads_ % g->size() == 0)
      << "CausalSelfAttention::shard: " << num_heads_ << " heads over " << g->size() << " ranks";
  c_attn->shard(g, LinearSplit::column, /*parts=*/3);
  c_proj->shard(g, LinearSplit::row);
  num_heads_ /= g->size();
  attn_dropout->set_stream_rank(uint64_t(g->rank()) + 1);
  if (g->sequence_parallel()) resid_dropout->set_stream_rank(uint64_t(g->rank()) + 1);
}

FeedForward::FeedForward(const TransformerOptions& o, Generator& gen, uint64_t dropout_site)
    : gelu_(o.gelu) {
  c_fc = register_module("c_fc", std::make_shared<Linear>(o.d_model, 4 * o.d_model, gen, o.bias));
  c_proj =
      register_module("c_proj", std::make_shared<Linear>(4 * o.d_model, o.d_model, gen, o.bias));
  dropout = register_module(
      "dropout",
      std::make_shared<Dropout>(o.dropout, Generator(o.seed, dropout_stream(dropout_site))));
}

Tensor FeedForward::forward(const Tensor& x) {
  return (*dropout)((*c_proj)(gelu((*c_fc)(x), gelu_)));
}

void FeedForward::shard(std::shared_ptr<TensorParallelGroup> g) {
  c_fc->shard(g, LinearSplit::column);
  c_proj->shard(g, LinearSplit::row);
  if (g->sequence_parallel()) dropout->set_stream_rank(uint64_t(g->rank()) + 1);
}

Block::Block(const TransformerOptions& o, Generator& gen, uint64_t index,
             const MoEOptions* moe_options) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(o.d_model, o.ln_eps, o.bias));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(o, gen, 3 * index));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(o.d_model, o.ln_eps, o.bias));
  if (moe_options)
    moe = register_module("mlp", std::make_shared<MoEFeedForward>(*moe_options, gen));
  else
    mlp = register_module("mlp", std::make_shared<FeedForward>(o, gen, 3 * index + 2));
}

Tensor Block::forward(const Tensor& x) {
  Tensor h = x + (*attn)((*ln_1)(x));
  return h + (moe ? (*moe)((*ln_2)(h)) : (*mlp)((*ln_2)(h)));
}

void Block::shard(std::shared_ptr<TensorParallelGroup> g) {
  if (g->sequence_parallel()) {
    ln_1->mark_sequence_parallel(*g);
    ln_2->mark_sequence_parallel(*g);
  }
  attn->shard(g);
  // The experts stay whole on every rank: each rank routes the same tokens.
  if (mlp) mlp->shard(g);
}

}  // namespace trainer
