#include "parallel/mesh.h"

#include "core/check.h"

namespace trainer::parallel {

const char* mesh_dim_name(MeshDim dim) {
  switch (dim) {
    case MeshDim::dp:
      return "dp";
    case MeshDim::pp:
      return "pp";
    case MeshDim::tp:
      return "tp";
  }
  return "?";
}

MeshCoord mesh_coord(const MeshShape& shape, int rank) {
  CHECK(shape.dp >= 1 && shape.pp >= 1 && shape.tp >= 1) << to_string(shape);
  CHECK(rank >= 0 && rank < shape.size()) << "rank " << rank << " outside " << to_string(shape);
  return MeshCoord{
      .dp = rank / (shape.pp * shape.tp), .pp = rank / shape.tp % shape.pp, .tp = rank % shape.tp};
}

int mesh_rank(const MeshShape& shape, const MeshCoord& c) {
  CHECK(c.dp >= 0 && c.dp < shape.dp && c.pp >= 0 && c.pp < shape.pp && c.tp >= 0 &&
        c.tp < shape.tp)
      << "coordinates (" << c.dp << ", " << c.pp << ", " << c.tp << ") outside "
      << to_string(shape);
  return (c.dp * shape.pp + c.pp) * shape.tp + c.tp;
}

std::vector<int> mesh_group(const MeshShape& shape, int rank, MeshDim dim) {
  const MeshCoord mine = mesh_coord(shape, rank);
  const int n = dim == MeshDim::dp ? shape.dp : dim == MeshDim::pp ? shape.pp : shape.tp;
  std::vector<int> group;
  for (int i = 0; i < n; ++i) {
    MeshCoord c = mine;
    (dim == MeshDim::dp ? c.dp : dim == MeshDim::pp ? c.pp : c.tp) = i;
    group.push_back(mesh_rank(shape, c));
  }
  return group;
}

std::string to_string(const MeshShape& shape) {
  return cat("dp=", shape.dp, ", pp=", shape.pp, ", tp=", shape.tp);
}

Mesh::Mesh(const MeshShape& shape, std::shared_ptr<comm::Communicator> world)
    : shape_(shape), world_(std::move(world)) {
  CHECK(world_) << "a Mesh over no communicator; use Mesh() for a single process";
  CHECK_EQ(shape_.size(), world_->size()) << to_string(shape_);
  rank_ = world_->rank();
  coord_ = mesh_coord(shape_, rank_);
  // A group is the ranks sharing the other two coordinates: that pair,
  // numbered, is its colour; the index along the dimension orders it.
  const MeshCoord c = coord_;
  dp_ = world_->split(c.pp * shape_.tp + c.tp, c.dp);
  pp_ = world_->split(c.dp * shape_.tp + c.tp, c.pp);
  tp_ = world_->split(c.dp * shape_.pp + c.pp, c.tp);
}

const std::shared_ptr<comm::Communicator>& Mesh::comm(MeshDim dim) const {
  return dim == MeshDim::dp ? dp_ : dim == MeshDim::pp ? pp_ : tp_;
}

}  // namespace trainer::parallel
