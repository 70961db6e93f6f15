// The device mesh: how the world's ranks are laid out over data (dp),
// pipeline (pp) and tensor (tp) parallelism, this rank's coordinates, and
// one communicator per dimension (DESIGN.md "Parallel layout").
//
// Numbering: tp innermost (its ranks are neighbours: the fastest links,
// for the traffic of every layer), then pp, then dp outermost:
//   world rank = (dp_index * pp + pp_index) * tp + tp_index
// dp = 2, pp = 2, tp = 2 on 8 ranks:
//   rank  0 1 2 3 4 5 6 7
//   dp    0 0 0 0 1 1 1 1
//   pp    0 0 1 1 0 0 1 1
//   tp    0 1 0 1 0 1 0 1
// The dp group of rank 5 is {1, 5} (same pp and tp), its pp group {5, 7},
// its tp group {4, 5}.
//
//   Mesh mesh({.dp = 2, .pp = 2, .tp = 2}, world);   // collective: splits the world
//   DataParallel dp(model, mesh.dp_comm(), ...);     // replicas synchronise over dp only
//   if (mesh.coord().pp == mesh.shape().pp - 1) ...  // the last pipeline stage
//
// Everything that synchronises replicas (DataParallel, ZeRO-1,
// SyncBatchNorm, sharded evaluation) takes dp_comm(), never the world.
// A single process (no world communicator) has the mesh {1, 1, 1} and no
// communicators.
//
// Glossary: world rank = index in the job; dimension = dp, pp or tp; index
// = a rank's coordinate along one dimension (its rank in that dimension's
// communicator); group = the ranks that differ only along one dimension.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace trainer::parallel {

struct MeshShape {
  int dp = 1;
  int pp = 1;
  int tp = 1;
  int size() const { return dp * pp * tp; }
  bool operator==(const MeshShape&) const = default;
};

// A rank's index along each dimension.
struct MeshCoord {
  int dp = 0;
  int pp = 0;
  int tp = 0;
  bool operator==(const MeshCoord&) const = default;
};

enum class MeshDim { dp, pp, tp };
const char* mesh_dim_name(MeshDim dim);

// The coordinates of a world rank, and back (0 <= rank < shape.size()).
MeshCoord mesh_coord(const MeshShape& shape, int rank);
int mesh_rank(const MeshShape& shape, const MeshCoord& coord);
// The world ranks of rank's group along dim, in the order of their index.
std::vector<int> mesh_group(const MeshShape& shape, int rank, MeshDim dim);
// "dp=2, pp=1, tp=1".
std::string to_string(const MeshShape& shape);

class Mesh {
 public:
  // A single process: the mesh {1, 1, 1}, no communicators.
  Mesh() = default;
  // Splits world into the dp, pp and tp communicators, in that order
  // (collective: every rank of world constructs its Mesh at the same point).
  // shape.size() must equal world->size() (CHECK: callers validate user input).
  Mesh(const MeshShape& shape, std::shared_ptr<comm::Communicator> world);

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  int rank() const { return rank_; }  // world rank
  // Null for a single process.
  const std::shared_ptr<comm::Communicator>& world() const { return world_; }
  const std::shared_ptr<comm::Communicator>& dp_comm() const { return dp_; }
  const std::shared_ptr<comm::Communicator>& pp_comm() const { return pp_; }
  const std::shared_ptr<comm::Communicator>& tp_comm() const { return tp_; }
  const std::shared_ptr<comm::Communicator>& comm(MeshDim dim) const;

 private:
  MeshShape shape_;
  MeshCoord coord_;
  int rank_ = 0;
  std::shared_ptr<comm::Communicator> world_, dp_, pp_, tp_;
};

}  // namespace trainer::parallel
