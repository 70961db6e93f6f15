// The parallel plan: what the parallelize passes did to one rank's share of
// a model, recorded once they have run, in the order they ran (tensor, then
// pipeline, then data parallelism or parameter servers), with the placement
// of every tensor the rank holds. The checkpoint writer and the gradient
// norm read the placements from it (who writes a replicated tensor, which
// rank counts an element), instead of asking each parallelism; the run's
// summary prints its passes. The layout lives in docs/architecture.md.
//
//   ParallelPlan plan{.mesh = mesh, .coord = coord};
//   plan.record("tensor", "tp=2, sequence parallel");
//   plan.place("h.0.attn.c_attn.weight", placement);
//   plan.spread_writers(bytes);                  // replicated tensors over the dp ranks
//   plan.writes("h.0.attn.c_attn.weight")        // this rank writes its piece
//   plan.describe()                              // "tensor (tp=2, ...) -> data (dp=2)"
#pragma once

#include <map>
#include <string>
#include <vector>

#include "parallel/mesh.h"
#include "parallel/placement.h"

namespace trainer::parallel {

struct ParallelPlan {
  struct Pass {
    std::string name;    // "tensor", "pipeline", "data", "parameter servers"
    std::string detail;  // "tp=2, sequence parallel", "stage 1 of 2", "dp=2, zero1"
  };
  MeshShape mesh;
  MeshCoord coord;
  std::vector<Pass> passes;  // in the order they ran
  // The optimizer state is sharded over the data-parallel ranks (ZeRO-1):
  // its pieces are distinct along kDataParallel, each rank's its own.
  bool shards_optimizer = false;
  // Every tensor of the model this rank holds (parameters and buffers), by
  // global name; an optimizer slot is placed as its parameter.
  std::map<std::string, TensorPlacement> placements;
  // A tensor replicated over the data-parallel ranks is written by one of
  // them, its index in the kDataParallel group: spread by bytes over the
  // replicas (spread_writers), so that no rank writes them all. Absent: 0.
  std::map<std::string, int> replica_writer;

  void record(std::string name, std::string detail) {
    passes.push_back({std::move(name), std::move(detail)});
  }
  bool applied(const std::string& name) const;
  void place(const std::string& name, TensorPlacement p) { placements[name] = std::move(p); }
  // The tensor's placement; Error naming it when no pass placed it.
  const TensorPlacement& placement(const std::string& name) const;
  // Whether this rank's piece of the tensor is the copy written to a
  // checkpoint: parallel::writes over every dimension but the data-parallel
  // ones, and there the replica replica_writer names.
  bool writes(const std::string& name) const;
  // The data-parallel index that writes a replicated tensor (replica_writer, or 0).
  int replica_writer_of(const std::string& name) const {
    auto it = replica_writer.find(name);
    return it == replica_writer.end() ? 0 : it->second;
  }
  // Assigns replica_writer for the placed tensors replicated over the
  // data-parallel ranks, largest first, each to the replica with the fewest
  // bytes so far (bytes: each tensor's local size). The same on every
  // replica, which holds the same tensors.
  void spread_writers(const std::map<std::string, int64_t>& bytes);
  // "tensor (tp=2) -> pipeline (stage 1 of 2) -> data (dp=2, zero1)"; "one process".
  std::string describe() const;
};

}  // namespace trainer::parallel
