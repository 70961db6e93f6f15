// Linear and Dropout.
//
//   Linear fc(512, 10, gen);            // weight [10, 512], bias [10]
//   Tensor logits = fc(features);       // [N, 512] -> [N, 10]
//   Dropout drop(0.5, Generator(seed, kStreamDropout));
#pragma once

#include <memory>

#include "core/rng.h"
#include "layers/context_parallel.h"
#include "layers/module.h"
#include "layers/tensor_parallel.h"

namespace trainer {

// y = x W^T + b over the last dim: [..., in] -> [..., out]; b may be undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);

// How a Linear is split over a tensor-parallel group (layers/tensor_parallel.h).
// column: this rank holds out/n of the output features (rows of weight, and
// bias) and its output stays split; its input enters the region
// (copy_to_region, or gather_sequence under sequence parallelism). row: it
// holds in/n of the input features (columns of weight), the partial
// products are summed over the group (reduce_from_region, or
// reduce_scatter_sequence) and the whole bias added after.
enum class LinearSplit { none, column, row };

// The layer computing linear(x, weight, bias). Initialised as
// nn.Linear: weight kaiming_uniform(a = sqrt(5)) = uniform(+-1/sqrt(in)),
// bias uniform(+-1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias = true);
  // A layer over existing tensors (weight tying: GPT's head over its token
  // embedding); weight [out, in], bias [out] or undefined.
  Linear(Tensor weight, Tensor bias);
  Tensor forward(const Tensor& x) override;

  // Keeps this rank's part of weight and bias (split column or row over g;
  // column with parts = 3 splits each of q, k and v, as c_attn packs them).
  // The whole layer must divide: out (column) or in (row) by parts x size.
  void shard(std::shared_ptr<TensorParallelGroup> g, LinearSplit split, int parts = 1);
  // A column-parallel layer over a weight another layer split (the LM head
  // over the vocabulary-parallel token embedding), recorded as split like it.
  void share_sharded_weight(std::shared_ptr<TensorParallelGroup> g, Tensor weight,
                            const ParameterSplit& split);
  // Zero output features appended up to `features` (rows of weight and
  // bias; before shard, so they divide by the group): an LM head over a
  // padded vocabulary.
  void pad_outputs(int64_t features);
  // A layer every rank of g keeps whole but uses only part of (a key/value
  // head replicated over tensor-parallel ranks): its gradients are shares
  // the group adds up.
  void mark_partial_gradient(const TensorParallelGroup& g);
  LinearSplit split() const { return split_; }

  Tensor weight, bias;  // [out, in], [out] (undefined without bias)

 private:
  std::shared_ptr<TensorParallelGroup> group_;
  LinearSplit split_ = LinearSplit::none;
};

// Zeroes each element with probability p and scales the rest by 1/(1-p) in
// training; the identity in evaluation. The masks come from the module's own
// generator, so a run is reproducible from the seed its owner gives it (and
// resumable: the generator's offset is its whole state).
class Dropout : public Module {
 public:
  Dropout(double p, Generator gen);
  Tensor forward(const Tensor& x) override;
  Generator& generator() { return gen_; }
  double p() const { return p_; }
  // Inside a tensor-parallel region (attention weights of this rank's heads,
  // activations of its part of the sequence) each rank draws its own mask:
  // the trainer keys the stream with stream_rank() (0 outside: the same mask
  // on every rank), as Megatron's RNG tracker does.
  void set_stream_rank(uint64_t r) { stream_rank_ = r; }
  uint64_t stream_rank() const { return stream_rank_; }
  // Context parallelism: x [B, Tl, ...] holds this rank's tokens of g's
  // layout. The mask is drawn for the whole sequence and this rank's rows
  // of it kept, so it is one process's mask whatever the cp size (at cp
  // times the draws). Under sequence parallelism (a stream of the tp
  // rank's own) each cp rank keeps its block of rows of that stream's mask.
  void set_context_parallel(std::shared_ptr<ContextParallelGroup> g) { cp_ = std::move(g); }

 private:
  double p_;
  uint64_t stream_rank_ = 0;
  std::shared_ptr<ContextParallelGroup> cp_;
  Generator gen_;
};

}  // namespace trainer
