// Transformer layers: Embedding, LayerNorm, causal self-attention, the MLP and
// the pre-LN block, named as nanoGPT names them so state dicts interoperate:
//
//   ln_1.weight  attn.c_attn.weight [3D, D]  attn.c_proj.weight [D, D]
//   ln_2.weight  mlp.c_fc.weight [4D, D]     mlp.c_proj.weight [D, 4D]
//
//   TransformerOptions o{.d_model = 384, .num_heads = 6, .dropout = 0.1};
//   Block block(o, gen, /*dropout_stream=*/0);
//   Tensor y = block(x);                       // [B, T, D] -> [B, T, D]
//
// Linear layers keep nn.Linear's initialisation; models re-initialise them
// (models/gpt.h does as GPT-2). Dropout masks come from generators
// Generator(seed, dropout_stream(k)), one per dropout site.
#pragma once

#include <memory>

#include "core/ops.h"
#include "core/rng.h"
#include "layers/context_parallel.h"
#include "layers/linear.h"
#include "layers/moe.h"
#include "layers/tensor_parallel.h"

namespace trainer {

struct TransformerOptions {
  int64_t d_model = 384;
  int64_t num_heads = 6;
  double dropout = 0.0;  // attention weights and both residual branches
  bool bias = true;      // in the Linear and LayerNorm layers
  double ln_eps = 1e-5;
  // The MLP's GELU: exact (erf, nn.GELU() as nanoGPT) or GPT-2's tanh form.
  GeluApprox gelu = GeluApprox::none;
  uint64_t seed = 0;  // of the dropout generators
};

// A stream of kStreamDropout's family for dropout site k (distinct per k).
inline uint64_t dropout_stream(uint64_t k) { return uint64_t(kStreamDropout) | (k << 32); }

// Rows of weight [V, D] picked by integer indices [...] -> [..., D];
// weight initialised normal(0, 0.02) as GPT-2 (nn.Embedding uses std 1).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Generator& gen);
  Tensor forward(const Tensor& indices) override;

  // Vocabulary parallelism: keeps rows [rank V/n, (rank + 1) V/n); forward
  // looks up the indices this rank holds and sums the lookups over g (under
  // sequence parallelism reduce-scattered along dim 1 of [B, T] indices).
  void shard_vocab(std::shared_ptr<TensorParallelGroup> g);
  // Zero rows appended up to `rows` (before shard_vocab, so the table
  // divides by the group): indices never pick them.
  void pad_rows(int64_t rows);
  // Sequence parallelism on a replicated table (positions): each rank looks
  // up its part of the sequence, so its gradient is a share the group adds up.
  void mark_sequence_parallel(const TensorParallelGroup& g);
  // The first row this rank holds (0 unless sharded).
  int64_t vocab_start() const { return vocab_start_; }

  Tensor weight;  // [V, D] (this rank's [V/n, D] when sharded)

 private:
  std::shared_ptr<TensorParallelGroup> group_;
  int64_t vocab_start_ = 0;
};

// layer_norm over the last dim; weight ones, bias zeros (none without bias).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, bool bias = true);
  Tensor forward(const Tensor& x) override;
  // Sequence parallelism: this rank normalises its part of the sequence,
  // so its weight and bias gradients are shares the group adds up.
  void mark_sequence_parallel(const TensorParallelGroup& g);

  Tensor weight, bias;  // [D], [D] (bias undefined without bias)

 private:
  double eps_;
};

// x [B, T, D] -> resid_dropout(c_proj(causal_attention(split3(c_attn(x))))).
class CausalSelfAttention : public Module {
 public:
  // Dropout sites dropout_site and dropout_site + 1.
  CausalSelfAttention(const TransformerOptions& o, Generator& gen, uint64_t dropout_site);
  Tensor forward(const Tensor& x) override;
  // Tensor parallelism: this rank runs num_heads / n heads (c_attn split
  // column-wise per q, k and v, c_proj row-wise): one allreduce forward and
  // one backward. num_heads must divide by g's size.
  void shard(std::shared_ptr<TensorParallelGroup> g);
  int64_t local_heads() const { return num_heads_; }
  // Context parallelism: x holds this rank's tokens of g's layout and the
  // attention runs over g (layers/context_parallel.h).
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g) { cp_ = std::move(g); }

  std::shared_ptr<Linear> c_attn, c_proj;
  // attn_dropout holds the attention weights' dropout rate and generator
  // (the fused kernel applies it); resid_dropout is applied as a layer.
  std::shared_ptr<Dropout> attn_dropout, resid_dropout;

 private:
  int64_t num_heads_;
  std::shared_ptr<ContextParallelGroup> cp_;
};

// nanoGPT's MLP (module name "mlp"; the class is named apart from
// models/small.h's MLP): x -> dropout(c_proj(gelu(c_fc(x)))), hidden width 4D,
// GELU exact or tanh as TransformerOptions::gelu says.
class FeedForward : public Module {
 public:
  FeedForward(const TransformerOptions& o, Generator& gen, uint64_t dropout_site);
  Tensor forward(const Tensor& x) override;
  // Tensor parallelism: c_fc column-wise, c_proj row-wise over g.
  void shard(std::shared_ptr<TensorParallelGroup> g);

  std::shared_ptr<Linear> c_fc, c_proj;
  std::shared_ptr<Dropout> dropout;

 private:
  GeluApprox gelu_;
};

// Pre-LN block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Uses dropout
// sites 3 * index .. 3 * index + 2. With `moe` the feed-forward layer is a
// mixture of experts (moe, still named "mlp"; mlp is then null).
class Block : public Module {
 public:
  Block(const TransformerOptions& o, Generator& gen, uint64_t index,
        const MoEOptions* moe = nullptr);
  Tensor forward(const Tensor& x) override;
  // Tensor parallelism over g (Megatron-LM): attention by heads, the MLP by
  // its hidden width; under sequence parallelism x is this rank's
  // [B, T/n, D] part of the sequence and ln_1, ln_2 work on it.
  void shard(std::shared_ptr<TensorParallelGroup> g);

  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<FeedForward> mlp;
  std::shared_ptr<MoEFeedForward> moe;
};

}  // namespace trainer
