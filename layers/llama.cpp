#include "layers/llama.h"

#include "core/autograd.h"
#include "layers/transformer.h"

namespace trainer {

RMSNorm::RMSNorm(int64_t dim, double eps) : eps_(eps) {
  CHECK(dim >= 1) << "RMSNorm: width " << dim;
  weight = register_parameter("weight", ones({dim}));
}

Tensor RMSNorm::forward(const Tensor& x) { return rms_norm(x, weight, eps_); }

void RMSNorm::mark_sequence_parallel(const TensorParallelGroup& g) {
  weight = replace_parameter(
      "weight", weight,
      ParameterSplit{
          .kind = ParameterSplit::Kind::partial_gradient, .rank = g.rank(), .size = g.size()});
}

LlamaAttention::LlamaAttention(const LlamaLayerOptions& o, Generator& gen, uint64_t dropout_site)
    : num_heads_(o.num_heads), num_kv_heads_(o.num_kv_heads), rope_(o.rope) {
  CHECK(o.num_heads >= 1 && o.hidden_size % o.num_heads == 0)
      << "LlamaAttention: width " << o.hidden_size << " is not a multiple of " << o.num_heads
      << " heads";
  CHECK(o.num_kv_heads >= 1 && o.num_heads % o.num_kv_heads == 0)
      << "LlamaAttention: " << o.num_kv_heads << " key/value heads do not divide " << o.num_heads
      << " heads";
  head_dim_ = o.hidden_size / o.num_heads;
  const int64_t D = o.hidden_size, q_width = o.num_heads * head_dim_;
  const int64_t kv_width = o.num_kv_heads * head_dim_;
  q_proj = register_module("q_proj", std::make_shared<Linear>(D, q_width, gen, false));
  k_proj = register_module("k_proj", std::make_shared<Linear>(D, kv_width, gen, false));
  v_proj = register_module("v_proj", std::make_shared<Linear>(D, kv_width, gen, false));
  o_proj = register_module("o_proj", std::make_shared<Linear>(q_width, D, gen, false));
  attn_dropout = register_module(
      "attn_dropout", std::make_shared<Dropout>(o.attention_dropout,
                                                Generator(o.seed, dropout_stream(dropout_site))));
}

Tensor LlamaAttention::forward(const Tensor& x) {
  CHECK(x.dim() == 3) << "LlamaAttention expects [B, T, D], got " << x.shape_str();
  Tensor q = (*q_proj)(x), k, v;  // [B, T, NH HD] (this rank's heads)
  if (replicated_kv_) {
    // Enter the region once for both projections of this rank's key/value head.
    TensorParallelGroup& g = *replicated_kv_;
    const Tensor in = g.sequence_parallel() ? gather_sequence(x, g) : copy_to_region(x, g);
    k = linear(in, k_proj->weight.narrow(0, kv_head_ * head_dim_, head_dim_), Tensor());
    v = linear(in, v_proj->weight.narrow(0, kv_head_ * head_dim_, head_dim_), Tensor());
  } else {
    k = (*k_proj)(x);
    v = (*v_proj)(x);
  }
  const int64_t T = q.size(1);
  const Tensor positions = cp_ ? cp_->layout(T * cp_->size()).positions_tensor(q.device())
                               : arange(T, DType::i64, q.device());
  q = rotary_embedding(q, num_heads_, positions, rope_);
  k = rotary_embedding(k, num_kv_heads_, positions, rope_);
  Tensor y = cp_ ? context_parallel_attention(q, k, v, num_heads_, num_kv_heads_, attn_dropout->p(),
                                              is_training(), attn_dropout->generator(), *cp_)
                 : causal_attention(q, k, v, num_heads_, attn_dropout->p(), is_training(),
                                    attn_dropout->generator(), num_kv_heads_);
  return (*o_proj)(y);
}

void LlamaAttention::shard(std::shared_ptr<TensorParallelGroup> g) {
  const int64_t n = g->size();
  CHECK(num_heads_ % n == 0) << "LlamaAttention::shard: " << num_heads_ << " heads over " << n
                             << " ranks";
  CHECK(num_kv_heads_ % n == 0 || n % num_kv_heads_ == 0)
      << "LlamaAttention::shard: " << num_kv_heads_ << " key/value heads over " << n << " ranks";
  q_proj->shard(g, LinearSplit::column);
  o_proj->shard(g, LinearSplit::row);
  if (num_kv_heads_ % n == 0) {
    k_proj->shard(g, LinearSplit::column);
    v_proj->shard(g, LinearSplit::column);
    num_kv_heads_ /= n;
  } else {
    // Query heads [r NH/n, (r + 1) NH/n) all use key/value head r KV / n.
    kv_head_ = g->rank() * num_kv_heads_ / n;
    k_proj->mark_partial_gradient(*g);
    v_proj->mark_partial_gradient(*g);
    num_kv_heads_ = 1;
    replicated_kv_ = g;
  }
  num_heads_ /= n;
  attn_dropout->set_stream_rank(uint64_t(g->rank()) + 1);
}

LlamaMLP::LlamaMLP(const LlamaLayerOptions& o, Generator& gen) {
  const int64_t D = o.hidden_size, I = o.intermediate_size;
  gate_proj = register_module("gate_proj", std::make_shared<Linear>(D, I, gen, false));
  up_proj = register_module("up_proj", std::make_shared<Linear>(D, I, gen, false));
  down_proj = register_module("down_proj", std::make_shared<Linear>(I, D, gen, false));
}

Tensor LlamaMLP::forward(const Tensor& x) {
  return (*down_proj)(silu((*gate_proj)(x)) * (*up_proj)(x));
}

void LlamaMLP::shard(std::shared_ptr<TensorParallelGroup> g) {
  gate_proj->shard(g, LinearSplit::column);
  up_proj->shard(g, LinearSplit::column);
  down_proj->shard(g, LinearSplit::row);
}

LlamaDecoderLayer::LlamaDecoderLayer(const LlamaLayerOptions& o, Generator& gen, uint64_t index) {
  // Hugging Face's registration order, which is named_parameters() order.
  self_attn = register_module("self_attn", std::make_shared<LlamaAttention>(o, gen, index));
  mlp = register_module("mlp", std::make_shared<LlamaMLP>(o, gen));
  input_layernorm =
      register_module("input_layernorm", std::make_shared<RMSNorm>(o.hidden_size, o.rms_norm_eps));
  post_attention_layernorm = register_module(
      "post_attention_layernorm", std::make_shared<RMSNorm>(o.hidden_size, o.rms_norm_eps));
}

Tensor LlamaDecoderLayer::forward(const Tensor& x) {
  Tensor h = x + (*self_attn)((*input_layernorm)(x));
  return h + (*mlp)((*post_attention_layernorm)(h));
}

void LlamaDecoderLayer::shard(std::shared_ptr<TensorParallelGroup> g) {
  if (g->sequence_parallel()) {
    input_layernorm->mark_sequence_parallel(*g);
    post_attention_layernorm->mark_sequence_parallel(*g);
  }
  self_attn->shard(g);
  mlp->shard(g);
}

}  // namespace trainer
