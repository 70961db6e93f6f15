// GPT (GPT-2 / nanoGPT architecture): token and learned position embeddings,
// N pre-LN Transformer blocks (layers/transformer.h), a final LayerNorm and
// the LM head, with nanoGPT's parameter names:
//
//   wte.weight [V, D]  wpe.weight [T, D]  h.0.ln_1.weight ... h.0.mlp.c_proj.bias
//   ln_f.weight  ln_f.bias  lm_head.weight [V, D] (absent when tied)
//
//   auto gpt = make_gpt({.vocab_size = 256, .block_size = 256, .n_layer = 6,
//                        .n_head = 6, .n_embd = 384});
//   Tensor logits = (*gpt)(tokens);    // i64 [B, T] -> [B, T, V]
//
// With tie_weights the LM head multiplies by wte.weight itself: one tensor,
// registered once (as wte.weight), so it is counted and updated once.
// Initialisation as GPT-2 from Generator(seed, kStreamInit): Linear and
// Embedding weights normal(0, 0.02), biases 0, the residual projections
// (attn.c_proj, mlp.c_proj) normal(0, 0.02 / sqrt(2 n_layer)).
#pragma once

#include <memory>
#include <vector>

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
  uint64_t seed = 0;
};

class GPT : public Module {
 public:
  explicit GPT(const GPTOptions& o);
  // tokens i64 [B, T], T <= block_size -> logits [B, T, V].
  Tensor forward(const Tensor& tokens) override;
  const GPTOptions& options() const { return options_; }
  // The LM head's weight [V, D] (wte.weight when tied).
  const Tensor& lm_head_weight() const { return head_weight_; }

  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<Dropout> drop;
  std::vector<std::shared_ptr<Block>> h;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Linear> lm_head;  // null when tied

 private:
  GPTOptions options_;
  Tensor head_weight_;
};

std::shared_ptr<GPT> make_gpt(const GPTOptions& options = {});

}  // namespace trainer
