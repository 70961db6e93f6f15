// Tensor (model) parallelism, the layers' side: the group of ranks a layer
// is split over, the autograd ops that move activations in and out of the
// split region, and the vocabulary-parallel loss. The layers split
// themselves in place (Linear::shard, Embedding::shard_vocab, the
// Transformer block's shard, layers/transformer.h); a model's
// shard_tensor_parallel (layers/block_list.h) calls them.
//
// The scheme is Megatron-LM's. A column-parallel Linear holds out/n of the
// output features (rows of W); a row-parallel one in/n of the input
// features (columns of W). The pair column -> row needs no communication in
// between, and the region they form is entered by `copy_to_region` (f:
// identity forward, allreduce of the gradient backward) and left by
// `reduce_from_region` (g: allreduce forward, identity backward): one
// allreduce each way per MLP and per attention. With sequence parallelism
// the activations outside the region are split along the sequence (dim 1):
// f becomes `gather_sequence` (allgather forward, reduce-scatter backward)
// and g `reduce_scatter_sequence` (the reverse).
//
//   auto g = make_comm_group(mesh.comm(Dim::tp));          // parallel/tensor_parallel.h
//   fc1.shard(g, LinearSplit::column);                  // [in] -> [4d / n]
//   fc2.shard(g, LinearSplit::row);                     // [4d / n] -> [d], summed over g
//   Tensor loss = vocab_parallel_cross_entropy(local_logits, targets, v0, *g);
//
// The group is an interface so that layers need no communication library:
// parallel/tensor_parallel.h implements it over a comm::Communicator.
// Every rank of a group runs the same ops in the same order, so their
// collectives pair up.
#pragma once

#include <memory>
#include <string>

#include "core/ops.h"
#include "layers/module.h"

namespace trainer {

// The ranks one layer is split over (CPU tensors).
class TensorParallelGroup {
 public:
  virtual ~TensorParallelGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Megatron-SP: activations outside the split regions hold T / size() of
  // the sequence (parallel.sequence_parallel).
  virtual bool sequence_parallel() const = 0;
  // In place, over the group: the sum (or the maximum) of t on every rank.
  virtual void allreduce(const Tensor& t, bool max = false) = 0;
  // The sum of x over the group, in a new tensor (x is left as it is).
  virtual Tensor sum(const Tensor& x) {
    Tensor out = x.is_contiguous() ? x.clone() : x.contiguous();
    allreduce(out);
    return out;
  }
  // t [k, ...] -> [size() * k, ...], block r from rank r.
  virtual Tensor allgather(const Tensor& t) = 0;
  // t [size() * k, ...] -> [k, ...]: block rank() of the sum over the group.
  virtual Tensor reduce_scatter(const Tensor& t) = 0;
};

// ---- moving activations in and out of the split region (autograd ops) ----
// f: x as is; the gradient summed over the group.
Tensor copy_to_region(const Tensor& x, TensorParallelGroup& g);
// g: x summed over the group; the gradient as is.
Tensor reduce_from_region(const Tensor& x, TensorParallelGroup& g);
// [..., k] -> [..., size * k], rank r's values at [r k, (r + 1) k); the
// gradient: this rank's slice.
Tensor gather_last_dim(const Tensor& x, TensorParallelGroup& g);
// Sequence parallelism, along dim 1 of [B, T, ...]:
// [B, T / n, ...] -> [B, T, ...] (allgather); the gradient reduce-scattered.
Tensor gather_sequence(const Tensor& x, TensorParallelGroup& g);
// [B, T, ...] -> [B, T / n, ...]: this rank's part of the sum over the
// group (reduce-scatter); the gradient allgathered.
Tensor reduce_scatter_sequence(const Tensor& x, TensorParallelGroup& g);
// [B, T, ...] -> [B, T / n, ...]: this rank's part of a tensor every rank
// holds whole; the gradient allgathered.
Tensor split_sequence(const Tensor& x, TensorParallelGroup& g);

// ---- the vocabulary-parallel loss ----
// Cross-entropy of logits [N, V / n] holding vocabulary entries
// [vocab_start, vocab_start + V / n) of V on this rank, against targets [N]
// (global indices), as cross_entropy over the gathered [N, V] would give it,
// without gathering: the row maxima, sums of exponentials, target logits
// (and with label smoothing the row sums) are reduced over the group. Every
// rank gets the same loss; the gradient is this rank's [N, V / n] part.
// vocab > 0: only entries [0, vocab) are the vocabulary, the columns past it
// padding (a table padded to a multiple of n): they are left out of the
// softmax, as cross_entropy over the gathered [N, vocab] would, and get a
// zero gradient.
Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_start, TensorParallelGroup& g,
                                    const CrossEntropyOptions& options = {}, int64_t vocab = 0);
// The rows [vocab_start, vocab_start + weight.size(0)) of an embedding table
// this rank holds, looked up for global indices [...] -> [..., D]; indices
// outside the range give zeros, so the sum over the group (reduce_from_region
// after it) is the whole lookup.
Tensor vocab_parallel_lookup(const Tensor& weight, const Tensor& indices, int64_t vocab_start);

// "1, 2, 4, 8": the group sizes that divide n, for errors about sizes that do not.
std::string divisors_of(int64_t n);

// ---- shards ----
// Rank split.rank's part of the whole tensor `full` (a copy), or the whole
// tensor from every rank's part (parts[r] from rank r), as ParameterSplit
// (layers/module.h) describes them.
Tensor shard_of(const Tensor& full, const ParameterSplit& split);
Tensor unshard(const TensorList& parts, const ParameterSplit& split);
// The shape of the whole tensor of a shard.
Shape full_shape(const Shape& shard, const ParameterSplit& split);
// t [R, ...] followed by zero rows up to [rows, ...] (rows >= R), so a
// vocabulary that does not divide by the group splits (a copy; a deferred t
// gives a deferred result, made when it is materialised).
Tensor zero_padded_rows(const Tensor& t, int64_t rows);

}  // namespace trainer
