// GPT (GPT-2 / nanoGPT architecture): token and learned position embeddings,
// N pre-LN Transformer blocks (layers/transformer.h), a final LayerNorm and
// the LM head, with nanoGPT's state_dict names, so a checkpoint loads into
// nanoGPT's model.py GPT with strict=True:
//
//   transformer.wte.weight [V, D]  transformer.wpe.weight [T, D]
//   transformer.h.0.ln_1.weight ... transformer.h.0.mlp.c_proj.bias
//   transformer.ln_f.weight  transformer.ln_f.bias  lm_head.weight [V, D]
//
//   auto gpt = make_gpt({.vocab_size = 256, .block_size = 256, .n_layer = 6,
//                        .n_head = 6, .n_embd = 384});
//   Tensor logits = (*gpt)(tokens);    // i64 [B, T] -> [B, T, V]
//
// With tie_weights the LM head multiplies by transformer.wte.weight itself:
// one tensor, trained once (named_parameters() lists it once, as
// wte), written under both names (state(), as nanoGPT's state_dict).
// Checkpoints of older versions of this model (no "transformer." prefix, no
// lm_head.weight when tied) still load: upgrade_loaded_state renames them.
// Initialisation as GPT-2 from Generator(seed, kStreamInit): Linear and
// Embedding weights normal(0, 0.02), biases 0, the residual projections
// (attn.c_proj, mlp.c_proj) normal(0, 0.02 / sqrt(2 n_layer)).
//
// Blocks (layers/block_list.h): "embed" (tokens -> x: wte + wpe, dropout),
// "transformer.h.<i>" (x -> x), "head" (x -> logits: ln_f, lm_head). Tied,
// lm_head.weight in "head" is transformer.wte.weight of "embed".
#pragma once

#include <memory>
#include <vector>

#include "layers/block_list.h"
#include "layers/transformer.h"

namespace trainer {

struct GPTOptions {
  int64_t vocab_size = 256;
  int64_t block_size = 256;  // longest sequence (rows of wpe)
  int64_t n_layer = 6;
  int64_t n_head = 6;
  int64_t n_embd = 384;
  double dropout = 0.0;
  bool bias = true;
  bool tie_weights = true;
  GeluApprox gelu = GeluApprox::none;  // nanoGPT's nn.GELU(): exact
  uint64_t seed = 0;
  // Mixture of experts (layers/moe.h; d_model and gelu taken from above):
  // block i's MLP is one when moe_every > 0 and i % moe_every ==
  // moe_every - 1 (every block at 1, every other from the second at 2).
  MoEOptions moe{};
  int64_t moe_every = 0;  // 0: no mixture of experts
};

class GPT : public Model {
 public:
  explicit GPT(const GPTOptions& o);
  const GPTOptions& options() const { return options_; }
  // The LM head's weight [V, D] (transformer.wte.weight when tied).
  const Tensor& lm_head_weight() const { return lm_head->weight; }
  // The rows of the token embedding and the LM head: vocab_size, padded
  // under tensor parallelism to a multiple of the group (shard_tensor_parallel).
  int64_t vocab_rows() const { return vocab_rows_; }
  // The whole shapes of the vocabulary's tensors (transformer.wte.weight,
  // and lm_head.weight when untied) in this model split over tp ranks:
  // what a checkpoint written at that tp holds.
  std::map<std::string, Shape> shapes_at_tensor_parallel(int tp) const override;
  // The vocabulary's padding under tensor parallelism, when there is one.
  std::string tensor_parallel_note() const override;
  // Renames the older names ("wte.weight", "h.0....") and, tied, checks
  // lm_head.weight equals transformer.wte.weight (or adds it when absent).
  // The vocabulary's padding rows (zero) of a checkpoint written at another
  // tp are dropped and this model's added, in the weights and their
  // optimizer state, so a checkpoint loads at any tp.
  void upgrade_loaded_state(std::map<std::string, Tensor>& tensors,
                            const std::string& file) const override;
  // Megatron-LM's split over g: the token embedding and the LM head by
  // vocabulary (still tied when tie_weights), every block's attention by
  // heads and MLP by hidden width; wpe and the LayerNorms replicated (under
  // sequence parallelism holding T/n of the sequence). The logits are this
  // rank's [B, T, V/n]; output_loss is the vocabulary-parallel
  // cross-entropy. Needs n_head divisible by g's size. A vocabulary that
  // is not (the KJV's 73 characters at tp 2) is padded with zero rows to the
  // next multiple, as Megatron-LM's --make-vocab-size-divisible-by does, but
  // without a draw from the initialisation's stream (the other weights are
  // one process's) and kept out of the loss's softmax: the padding logits
  // are never predicted, their rows get no gradient and stay zero, and
  // training agrees with one process's at vocab_size.
  void shard_tensor_parallel(std::shared_ptr<TensorParallelGroup> g) override;
  Tensor output_loss(const Tensor& logits, const Tensor& targets,
                     const CrossEntropyOptions& options = {}) const override;
  // Every block's attention over g; the tokens are this rank's of g's
  // layout, wpe reads their global positions. With all-to-all attention
  // n_head (per tp rank) must divide by g's size.
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g) override;

  std::shared_ptr<ModuleDict> transformer;  // wte, wpe, drop, h, ln_f
  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<Dropout> drop;
  std::vector<std::shared_ptr<Block>> h;
  // The blocks' mixture-of-experts layers, in order (empty when dense).
  std::vector<std::shared_ptr<MoEFeedForward>> moe_layers() const override;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Linear> lm_head;  // over wte's weight when tied

 private:
  GPTOptions options_;
  int64_t vocab_rows_ = 0;
  std::shared_ptr<TensorParallelGroup> tp_;
  std::shared_ptr<ContextParallelGroup> cp_;
};

std::shared_ptr<GPT> make_gpt(const GPTOptions& options = {});

}  // namespace trainer
