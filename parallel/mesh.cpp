#include "parallel/mesh.h"

#include "core/check.h"

namespace trainer::parallel {

const char* dim_name(Dim dim) {
  switch (dim) {
    case Dim::dp_replicate:
      return "dp_replicate";
    case Dim::dp_shard:
      return "dp_shard";
    case Dim::ep:
      return "ep";
    case Dim::pp:
      return "pp";
    case Dim::cp:
      return "cp";
    case Dim::tp:
      return "tp";
  }
  return "?";
}

std::optional<Dim> dim_from_name(std::string_view name) {
  for (Dim d : kAllDims)
    if (name == dim_name(d)) return d;
  return std::nullopt;
}

std::string to_string(Dims dims) {
  std::string s;
  for (Dim d : kAllDims)
    if (dims.contains(d)) s += cat(s.empty() ? "" : " x ", dim_name(d));
  return s.empty() ? "()" : s;
}

MeshShape::MeshShape(std::initializer_list<std::pair<Dim, int>> sizes) {
  sizes_.fill(1);
  for (const auto& [dim, size] : sizes) set(dim, size);
}

MeshShape& MeshShape::set(Dim dim, int size) {
  CHECK(size >= 1) << dim_name(dim) << " = " << size;
  sizes_[size_t(dim)] = size;
  return *this;
}

int MeshShape::size(Dims dims) const {
  int n = 1;
  for (Dim d : kAllDims)
    if (dims.contains(d)) n *= (*this)[d];
  return n;
}

MeshCoord mesh_coord(const MeshShape& shape, int rank) {
  CHECK(rank >= 0 && rank < shape.size()) << "rank " << rank << " outside " << to_string(shape);
  MeshCoord c;
  for (size_t i = kAllDims.size(); i-- > 0;) {  // innermost first
    const Dim d = kAllDims[i];
    c.set(d, rank % shape[d]);
    rank /= shape[d];
  }
  return c;
}

int group_index(const MeshShape& shape, const MeshCoord& c, Dims dims) {
  int index = 0;
  for (Dim d : kAllDims) {
    if (!dims.contains(d)) continue;
    CHECK(c[d] >= 0 && c[d] < shape[d])
        << dim_name(d) << " index " << c[d] << " outside " << to_string(shape);
    index = index * shape[d] + c[d];
  }
  return index;
}

int mesh_rank(const MeshShape& shape, const MeshCoord& c) {
  return group_index(shape, c, Dims::all());
}

std::vector<int> mesh_group(const MeshShape& shape, int rank, Dims dims) {
  const MeshCoord mine = mesh_coord(shape, rank);
  std::vector<int> group;
  for (int i = 0, n = shape.size(dims); i < n; ++i) {
    // The i-th member: i as a mixed-radix number over dims, innermost last.
    MeshCoord c = mine;
    int rest = i;
    for (size_t k = kAllDims.size(); k-- > 0;) {
      const Dim d = kAllDims[k];
      if (!dims.contains(d)) continue;
      c.set(d, rest % shape[d]);
      rest /= shape[d];
    }
    group.push_back(mesh_rank(shape, c));
  }
  return group;
}

std::string to_string(const MeshShape& shape) {
  const bool hybrid = shape[Dim::dp_replicate] > 1 && shape[Dim::dp_shard] > 1;
  std::string s =
      hybrid ? cat("dp_replicate=", shape[Dim::dp_replicate], ", dp_shard=", shape[Dim::dp_shard])
             : cat("dp=", shape.size(kDataParallel));
  for (Dim d : {Dim::ep, Dim::pp, Dim::cp, Dim::tp})
    if (shape[d] > 1 || d == Dim::pp || d == Dim::tp) s += cat(", ", dim_name(d), "=", shape[d]);
  return s;
}

namespace {

// A group's colour: the rank's indices along the other dimensions, numbered
// (so ranks share it exactly when they differ only along dims).
int group_color(const MeshShape& shape, const MeshCoord& c, Dims dims) {
  return group_index(shape, c, dims.complement());
}

}  // namespace

Mesh::Mesh(const MeshShape& shape, std::shared_ptr<comm::Communicator> world)
    : shape_(shape), world_(std::move(world)) {
  CHECK(world_) << "a Mesh over no communicator; use Mesh() for a single process";
  CHECK_EQ(shape_.size(), world_->size()) << to_string(shape_);
  rank_ = world_->rank();
  coord_ = mesh_coord(shape_, rank_);
  for (Dim d : kAllDims) comm(d);
  comm(kDataParallel);
}

std::shared_ptr<comm::Communicator> Mesh::comm(Dims dims) const {
  if (!world_) return nullptr;
  std::lock_guard<std::mutex> lock(groups_->mutex);
  std::shared_ptr<comm::Communicator>& c = groups_->by_dims[dims.bits()];
  if (!c) c = world_->split(group_color(shape_, coord_, dims), group_index(shape_, coord_, dims));
  return c;
}

}  // namespace trainer::parallel
