// Placements: where the pieces of one logical tensor live on the mesh
// (parallel/mesh.h). For each mesh dimension a tensor is replicated (every
// index holds the same values), sharded along one of its dimensions (index
// i holds slice i), or a partial sum (every index holds a share; the
// logical value is their sum) — the idea of PyTorch's DTensor placements,
// written here for the trainer's parameters, gradients and optimizer state
// — or owned by one index (a pipeline stage's parameters: the other stages
// hold none of it, or a copy that is not theirs to write, as the last
// stage's copy of a weight tied to the first stage's embedding).
//
//   // c_attn.weight of GPT under tp = 2: q, k and v each cut in two.
//   TensorPlacement p = TensorPlacement::replicated({1152, 384})
//                           .with(Dim::tp, Placement::shard(0, /*pieces=*/3));
//   local_shape(p, mesh.shape())             // {576, 384}
//   local_boxes(p, mesh.shape(), coord)      // 3 boxes of {192, 384} rows
//   writes(p, coord)                         // dp index 0 only: one copy on disk
//
// A shard with pieces > 1 (a fused tensor: q, k and v, or an LSTM's four
// gates) cuts each of `pieces` equal pieces of the dimension into slices and
// gives index i slice i of every piece, concatenated: the layout tensor
// parallelism gives fused parameters (layers/tensor_parallel.h). Shards over
// several mesh dimensions nest outermost first, as the mesh orders them.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "layers/module.h"
#include "parallel/mesh.h"

namespace trainer::parallel {

struct Placement {
  enum class Kind { replicate, shard, partial, owned };
  Kind kind = Kind::replicate;
  int dim = 0;     // shard: the tensor dimension cut; owned: the owning index
  int pieces = 1;  // shard: equal pieces, each cut over the mesh dimension
  static Placement replicate() { return {}; }
  static Placement shard(int dim, int pieces = 1) { return {Kind::shard, dim, pieces}; }
  static Placement partial() { return {Kind::partial, 0, 1}; }
  static Placement owned(int index) { return {Kind::owned, index, 1}; }
  bool operator==(const Placement&) const = default;
};

struct TensorPlacement {
  Shape global;                          // the logical tensor's shape
  std::array<Placement, kDims> on = {};  // per mesh dimension, in kAllDims order
  static TensorPlacement replicated(Shape global) { return {std::move(global), {}}; }
  TensorPlacement with(Dim d, Placement p) const {
    TensorPlacement t = *this;
    t.on[size_t(d)] = p;
    return t;
  }
  const Placement& operator[](Dim d) const { return on[size_t(d)]; }
  bool operator==(const TensorPlacement&) const = default;
};

// A box of a tensor: offsets and extents per dimension.
struct Box {
  Shape offset, extent;
  bool operator==(const Box&) const = default;
};

// The piece one rank holds: its shape, and the boxes of the logical tensor
// it is made of (one per shard piece, in the order they are concatenated).
// Error when a sharded dimension is not divisible by pieces x mesh size.
Shape local_shape(const TensorPlacement& p, const MeshShape& mesh);
std::vector<Box> local_boxes(const TensorPlacement& p, const MeshShape& mesh,
                             const MeshCoord& coord);
// Whether this rank's piece is the copy written to a checkpoint and counted
// in a norm: the owner along a dimension that owns it, index 0 along every
// other dimension the tensor is not sharded over. Exactly one rank per
// distinct piece (a partial sum is reduced first).
bool writes(const TensorPlacement& p, const MeshCoord& coord);
// "tp: shard(0, 3 pieces)", "replicate" for a placement with no shards.
std::string to_string(const TensorPlacement& p);

// A parameter's placement from what tensor parallelism recorded
// (Module::parameter_splits()): sharded over tp, or replicated (also for a
// parameter whose gradient is a partial sum over tp: its values are the same
// on every rank); replicated over every other dimension. local is this
// rank's part; split null for a parameter tensor parallelism left whole.
TensorPlacement tensor_parallel_placement(const Shape& local, const ParameterSplit* split);

}  // namespace trainer::parallel
