// Tensor parallelism over a communicator: the group the split layers
// (layers/tensor_parallel.h) reduce over, built on the mesh's tp
// communicator (ranks on one host: its collectives go over the shared-memory
// channel), and what the trainer does with a split model around the layers:
// adding up the gradient shares of sequence-parallel parameters, and
// checkpoints that hold whole tensors under their global names.
//
//   auto g = make_comm_group(mesh.comm(Dim::tp), recipe.parallel.sequence_parallel);
//   gpt->shard_tensor_parallel(g);
//   ... backward ...
//   TensorList shares = parameters_split_as(*gpt, ParameterSplit::Kind::partial_gradient);
//   sum_partial_gradients(shares, *g);                      // sequence parallelism, per step
//   std::vector<NamedTensor> whole = gather_whole(gpt->state(), *gpt, *g);   // collective
//   take_shards(loaded, *gpt);                               // whole tensors -> this rank's parts
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "layers/module.h"
#include "layers/tensor_parallel.h"

namespace trainer::parallel {

// What a rank's collectives were over, in allreduce-equivalent bytes: an
// allreduce of n bytes counts n whatever its algorithm moves; an allgather
// (of an n-byte output) or a reduce-scatter (of an n-byte input) counts
// n / 2, as each moves half of what an allreduce of n bytes does. So the
// allgather and reduce-scatter sequence parallelism puts in place of an
// allreduce count as much as it.
struct TensorParallelTraffic {
  int64_t allreduce_bytes = 0, allgather_bytes = 0, reduce_scatter_bytes = 0;
  int64_t calls = 0;
  int64_t total_bytes() const { return allreduce_bytes + allgather_bytes + reduce_scatter_bytes; }
};

class CommGroup final : public TensorParallelGroup {
 public:
  CommGroup(std::shared_ptr<comm::Communicator> comm, bool sequence_parallel);
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  bool sequence_parallel() const override { return sequence_parallel_; }
  void allreduce(const Tensor& t, bool max) override;
  Tensor sum(const Tensor& x) override;
  Tensor allgather(const Tensor& t) override;
  Tensor reduce_scatter(const Tensor& t) override;

  comm::Communicator& comm() const { return *comm_; }
  // Whether the collectives run in place over a shared region (below);
  // false before the first one, and on ranks of several hosts.
  bool in_place() const { return region_ != nullptr; }
  const TensorParallelTraffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = {}; }

 private:
  // A buffer of at least `bytes` in this rank's part of the group's shared
  // region (comm/shm_region.h), at the same offset on every rank, so a
  // collective on it runs in place over the shared-memory channel; null
  // when the ranks share no channel (several hosts) or cannot map one. The
  // region grows (collectively: every rank asks for the same sizes in the
  // same order, as they run the same layers) to the largest size asked.
  char* scratch(size_t bytes);

  std::shared_ptr<comm::Communicator> comm_;
  bool sequence_parallel_;
  TensorParallelTraffic traffic_;
  std::shared_ptr<comm::ShmRegion> region_;
  bool no_region_ = false;  // the ranks share no region: ordinary collectives
};

std::shared_ptr<CommGroup> make_comm_group(std::shared_ptr<comm::Communicator> comm,
                                           bool sequence_parallel = false);

// A group of `size` ranks that moves no data (allreduce leaves t, allgather
// repeats it, reduce-scatter keeps block 0): the shapes and memory of
// rank `rank`'s part of a split model, for --dry-run on one process.
std::shared_ptr<TensorParallelGroup> shape_only_group(int rank, int size, bool sequence_parallel);

// The parameters of model split as kind (Module::parameter_splits), in
// named_parameters() order: sharded ones, or partial_gradient ones.
TensorList parameters_split_as(const Module& model, ParameterSplit::Kind kind);

// Sequence parallelism: sums the gradient shares of params (the model's
// partial_gradient parameters) over g in place, so every rank holds the
// whole gradient.
void sum_partial_gradients(const TensorList& params, TensorParallelGroup& g);

// The split of a named entry of model's state or of its optimizer's
// ("<parameter>.<slot>" of the parameter's shape), or null when it is whole
// on every rank.
const ParameterSplit* split_of(const std::map<std::string, ParameterSplit>& splits,
                               const std::map<std::string, Shape>& shapes, const std::string& name,
                               const Shape& shape);

// Checkpoints hold one logical model: the whole tensors of named (this
// rank's parts under global names, in the same order on every rank of g),
// gathered over g where model split them (parameters, their optimizer
// slots, and buffers: Module::parameter_splits lists split buffers too).
// Collective over g.
std::vector<NamedTensor> gather_whole(const std::vector<NamedTensor>& named, const Module& model,
                                      TensorParallelGroup& g);
// The reverse, when loading: every whole tensor in tensors of a parameter
// or buffer model split (or of a parameter's optimizer slots) is replaced
// by this rank's part.
// A tensor of another shape is left alone (the loader reports it).
void take_shards(std::map<std::string, Tensor>& tensors, const Module& model);

}  // namespace trainer::parallel
