// Llama (Meta's Llama 2 / 3 architecture as Hugging Face's LlamaForCausalLM
// builds it): a token embedding, N pre-norm decoder layers (RMSNorm,
// grouped-query attention with rotary positions, SwiGLU MLP; no biases;
// layers/llama.h), a final RMSNorm and the LM head, under Hugging Face's
// state_dict names, so a checkpoint loads into LlamaForCausalLM with
// strict=True and a Hugging Face checkpoint loads here:
//
//   model.embed_tokens.weight [V, D]
//   model.layers.0.self_attn.q_proj.weight ... model.layers.0.mlp.down_proj.weight
//   model.layers.0.input_layernorm.weight  model.layers.0.post_attention_layernorm.weight
//   model.norm.weight [D]  lm_head.weight [V, D]
//
//   auto llama = make_llama({.vocab_size = 2048, .hidden_size = 256,
//                            .intermediate_size = 688, .num_hidden_layers = 4,
//                            .num_attention_heads = 8, .num_key_value_heads = 2});
//   Tensor logits = (*llama)(tokens);    // i64 [B, T] -> [B, T, V]
//
// Options carry Hugging Face's LlamaConfig names. With tie_word_embeddings
// the LM head multiplies by model.embed_tokens.weight itself (listed once by
// named_parameters(), written under both names). Initialisation as
// Hugging Face's from Generator(seed, kStreamInit): Linear and Embedding
// weights normal(0, initializer_range), RMSNorm weights 1.
//
// Blocks (layers/block_list.h): "embed" (tokens -> x), "model.layers.<i>"
// (x -> x), "head" (x -> logits: norm, lm_head).
#pragma once

#include <memory>
#include <vector>

#include "layers/block_list.h"
#include "layers/llama.h"
#include "layers/transformer.h"

namespace trainer {

struct LlamaOptions {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 512;
  int64_t intermediate_size = 1376;
  int64_t num_hidden_layers = 8;
  int64_t num_attention_heads = 8;
  int64_t num_key_value_heads = 8;
  int64_t max_position_embeddings = 2048;  // longest sequence
  double rms_norm_eps = 1e-6;
  RopeOptions rope{};  // rope_theta and rope_scaling
  bool tie_word_embeddings = false;
  double attention_dropout = 0.0;
  double initializer_range = 0.02;
  uint64_t seed = 0;
};

class Llama : public Model {
 public:
  explicit Llama(const LlamaOptions& o);
  const LlamaOptions& options() const { return options_; }
  const Tensor& lm_head_weight() const { return lm_head->weight; }
  // vocab_size, padded under tensor parallelism to a multiple of the group.
  int64_t vocab_rows() const { return vocab_rows_; }
  std::map<std::string, Shape> shapes_at_tensor_parallel(int tp) const override;
  std::string tensor_parallel_note() const override;
  // Tied: lm_head.weight must equal model.embed_tokens.weight (added when
  // absent, as Hugging Face writes tied checkpoints). The vocabulary's
  // padding rows are fitted to this model's tp (models/lm_vocab.h).
  void upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                            const std::string& file) const override;
  // Megatron-LM's split over g: the embedding and the LM head by
  // vocabulary, attention by heads (key/value heads split too, or
  // replicated when there are fewer than ranks), the MLP by its width.
  // Needs num_attention_heads divisible by g's size and
  // num_key_value_heads dividing or divisible by it.
  void shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) override;
  Tensor output_loss(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& options = {}) const override;
  // Every layer's attention over g; the tokens are this rank's of g's
  // layout, rotated at their global positions. With all-to-all attention
  // the query and key/value heads (per tp rank) must divide by g's size.
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g) override;

  std::shared_ptr<ModuleDict> model;  // embed_tokens, layers, norm
  std::shared_ptr<Embedding> embed_tokens;
  std::vector<std::shared_ptr<LlamaDecoderLayer>> layers;
  std::shared_ptr<RMSNorm> norm;
  std::shared_ptr<Linear> lm_head;  // over embed_tokens' weight when tied

 private:
  LlamaOptions options_;
  int64_t vocab_rows_ = 0;
  std::shared_ptr<TensorParallelGroup> tp_;
  std::shared_ptr<ContextParallelGroup> cp_;
};

std::shared_ptr<Llama> make_llama(const LlamaOptions& options = {});

// Meta's rule for the SwiGLU width when a recipe gives none: 8/3 of the
// width rounded up to a multiple of 256 (Llama 2 7B: 4096 -> 11008).
int64_t llama_intermediate_size(int64_t hidden_size);

}  // namespace trainer
