// Llama-family layers, named as Hugging Face's LlamaForCausalLM names its
// modules so state dicts interoperate:
//
//   input_layernorm.weight [D]            post_attention_layernorm.weight [D]
//   self_attn.q_proj.weight [NH HD, D]    self_attn.k_proj.weight [KV HD, D]
//   self_attn.v_proj.weight [KV HD, D]    self_attn.o_proj.weight [D, NH HD]
//   mlp.gate_proj.weight [I, D]  mlp.up_proj.weight [I, D]  mlp.down_proj.weight [D, I]
//
//   LlamaLayerOptions o{.hidden_size = 512, .intermediate_size = 1376,
//                       .num_heads = 8, .num_kv_heads = 2};
//   LlamaDecoderLayer layer(o, gen, /*index=*/0);
//   Tensor y = layer(x);                         // [B, T, D] -> [B, T, D]
//
// No biases anywhere. Attention is grouped-query (KV key/value heads shared
// by NH / KV query heads each), with rotary position embeddings on q and k
// (core/ops_transformer.h, rotate-half convention) at positions 0 .. T-1.
// The MLP is SwiGLU: down(silu(gate(x)) * up(x)). Linear weights keep
// nn.Linear's initialisation; models/llama.h re-initialises them.
#pragma once

#include <memory>

#include "core/ops_transformer.h"
#include "layers/context_parallel.h"
#include "layers/linear.h"
#include "layers/tensor_parallel.h"

namespace trainer {

struct LlamaLayerOptions {
  int64_t hidden_size = 512;         // D
  int64_t intermediate_size = 1376;  // I
  int64_t num_heads = 8;             // NH (HD = D / NH)
  int64_t num_kv_heads = 8;          // KV, dividing NH
  double rms_norm_eps = 1e-6;
  RopeOptions rope{};
  double attention_dropout = 0.0;  // of the attention weights
  uint64_t seed = 0;               // of the dropout generators
};

// rms_norm over the last dim; weight ones.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  Tensor forward(const Tensor& x) override;
  // Sequence parallelism: this rank normalises its part of the sequence,
  // so its weight gradient is a share the group adds up.
  void mark_sequence_parallel(const TensorParallelGroup& g);

  Tensor weight;  // [D]

 private:
  double eps_;
};

// x [B, T, D] -> o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x)).
class LlamaAttention : public Module {
 public:
  // Dropout site dropout_site (layers/transformer.h's dropout_stream).
  LlamaAttention(const LlamaLayerOptions& o, Generator& gen, uint64_t dropout_site);
  Tensor forward(const Tensor& x) override;
  // Tensor parallelism over g: q_proj column-wise by heads, o_proj
  // row-wise. Key/value heads are split the same way when g's size divides
  // KV; when KV is smaller (g's size a multiple of it) every rank keeps
  // k_proj and v_proj whole and projects only the key/value head its query
  // heads use, as Megatron-LM replicates them: the weights' gradients are
  // then shares the group adds up.
  void shard(std::shared_ptr<TensorParallelGroup> g);
  int64_t local_heads() const { return num_heads_; }
  int64_t local_kv_heads() const { return num_kv_heads_; }
  // Context parallelism: x holds this rank's tokens of g's layout (rotated
  // at their global positions) and the attention runs over g.
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g) { cp_ = std::move(g); }

  std::shared_ptr<Linear> q_proj, k_proj, v_proj, o_proj;
  // Holds the attention weights' dropout rate and generator (the fused
  // kernel applies it).
  std::shared_ptr<Dropout> attn_dropout;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  RopeOptions rope_;
  std::shared_ptr<TensorParallelGroup> replicated_kv_;  // set when KV < tp
  int64_t kv_head_ = 0;                                 // replicated: the head this rank uses
  std::shared_ptr<ContextParallelGroup> cp_;
};

// SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)).
class LlamaMLP : public Module {
 public:
  LlamaMLP(const LlamaLayerOptions& o, Generator& gen);
  Tensor forward(const Tensor& x) override;
  // gate_proj and up_proj column-wise, down_proj row-wise over g.
  void shard(std::shared_ptr<TensorParallelGroup> g);

  std::shared_ptr<Linear> gate_proj, up_proj, down_proj;
};

// Pre-norm: h = x + self_attn(input_layernorm(x)),
// out = h + mlp(post_attention_layernorm(h)).
class LlamaDecoderLayer : public Module {
 public:
  LlamaDecoderLayer(const LlamaLayerOptions& o, Generator& gen, uint64_t index);
  Tensor forward(const Tensor& x) override;
  // Tensor parallelism over g (Megatron-LM); under sequence parallelism x
  // is this rank's [B, T/n, D] part of the sequence and the norms work on it.
  void shard(std::shared_ptr<TensorParallelGroup> g);

  std::shared_ptr<LlamaAttention> self_attn;
  std::shared_ptr<LlamaMLP> mlp;
  std::shared_ptr<RMSNorm> input_layernorm, post_attention_layernorm;
};

}  // namespace trainer
