// The device mesh: how the world's ranks are laid out over the named
// parallel dimensions, this rank's index along each, and one communicator
// per dimension and per flattened group of dimensions
// (docs/architecture.md "Parallelism").
//
// Dimensions, outermost first (the order is fixed here and nowhere else):
//   dp_replicate  data parallel, replicated (DDP; HSDP's replica groups)
//   dp_shard      data parallel, sharded (ZeRO / FSDP's shard groups)
//   ep            expert parallel
//   pp            pipeline parallel
//   cp            context (sequence) parallel
//   tp            tensor parallel, innermost: its ranks are neighbours, on
//                 the fastest links, for the traffic of every layer
// A dimension a run does not use has size 1. A rank's world number is the
// mixed-radix number of its indices in that order; the group of a set of
// dimensions is the ranks that differ only along them, ordered by the same
// mixed-radix number over those dimensions. dp_replicate = 2, pp = 2, tp = 2
// on 8 ranks:
//   rank          0 1 2 3 4 5 6 7
//   dp_replicate  0 0 0 0 1 1 1 1
//   pp            0 0 1 1 0 0 1 1
//   tp            0 1 0 1 0 1 0 1
// The pp group of rank 5 is {5, 7}, its tp group {4, 5}, its data-parallel
// group (kDataParallel = dp_replicate x dp_shard) {1, 5}.
//
//   Mesh mesh(MeshShape{{Dim::dp_replicate, 2}, {Dim::pp, 2}, {Dim::tp, 2}}, world);
//   DataParallel dp(model, mesh.comm(kDataParallel), ...);
//   if (mesh.index(Dim::pp) == mesh.size(Dim::pp) - 1) ...  // the last stage
//
// Everything that synchronises replicas (DataParallel, ZeRO-1,
// SyncBatchNorm, sharded evaluation) takes mesh.comm(kDataParallel), never
// the world. A single process (no world communicator) has the mesh of all
// ones and no communicators.
//
// Glossary: world rank = index in the job; index = a rank's coordinate along
// one dimension; group = the ranks that differ only along a set of
// dimensions; flattened group = a group of more than one dimension, one
// communicator (dp_replicate x dp_shard for gradient averaging).
#pragma once

#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace trainer::parallel {

enum class Dim : int { dp_replicate, dp_shard, ep, pp, cp, tp };
inline constexpr int kDims = 6;
// Every dimension, outermost first.
inline constexpr std::array<Dim, kDims> kAllDims = {Dim::dp_replicate, Dim::dp_shard, Dim::ep,
                                                    Dim::pp,           Dim::cp,       Dim::tp};
const char* dim_name(Dim dim);  // "dp_replicate", ..., "tp"
std::optional<Dim> dim_from_name(std::string_view name);

// A set of dimensions: one of them, or a flattened group.
class Dims {
 public:
  constexpr Dims() = default;
  constexpr Dims(Dim dim) : bits_(bit(dim)) {}  // NOLINT: a dimension is a set of one
  constexpr Dims(std::initializer_list<Dim> dims) {
    for (Dim d : dims) bits_ |= bit(d);
  }
  static constexpr Dims all() {
    Dims d;
    for (Dim dim : kAllDims) d.bits_ |= bit(dim);
    return d;
  }
  constexpr bool contains(Dim dim) const { return (bits_ & bit(dim)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr unsigned bits() const { return bits_; }
  constexpr Dims operator|(Dims other) const { return from_bits(bits_ | other.bits_); }
  // The dimensions not in this set.
  constexpr Dims complement() const { return from_bits(all().bits_ & ~bits_); }
  constexpr bool operator==(const Dims&) const = default;
  constexpr auto operator<=>(const Dims&) const = default;

 private:
  static constexpr unsigned bit(Dim d) { return 1u << unsigned(d); }
  static constexpr Dims from_bits(unsigned bits) {
    Dims d;
    d.bits_ = bits;
    return d;
  }
  unsigned bits_ = 0;
};
// The ranks that hold replicas of one model part: gradients average over it.
inline constexpr Dims kDataParallel{Dim::dp_replicate, Dim::dp_shard};
// The dimensions a training batch is split over: the data-parallel ranks
// and the expert-parallel ranks, which are data-parallel for everything but
// their experts.
inline constexpr Dims kBatchDims{Dim::dp_replicate, Dim::dp_shard, Dim::ep};
// "dp_replicate x dp_shard", "tp".
std::string to_string(Dims dims);

// The size of each dimension (1 where unused).
class MeshShape {
 public:
  MeshShape() { sizes_.fill(1); }
  MeshShape(std::initializer_list<std::pair<Dim, int>> sizes);
  int size(Dims dims) const;  // the product over dims
  int size() const { return size(Dims::all()); }
  int operator[](Dim dim) const { return sizes_[size_t(dim)]; }
  MeshShape& set(Dim dim, int size);
  bool operator==(const MeshShape&) const = default;

 private:
  std::array<int, kDims> sizes_;
};

// A rank's index along each dimension.
class MeshCoord {
 public:
  MeshCoord() { index_.fill(0); }
  int operator[](Dim dim) const { return index_[size_t(dim)]; }
  MeshCoord& set(Dim dim, int index) {
    index_[size_t(dim)] = index;
    return *this;
  }
  bool operator==(const MeshCoord&) const = default;

 private:
  std::array<int, kDims> index_;
};

// The coordinates of a world rank, and back (0 <= rank < shape.size()).
MeshCoord mesh_coord(const MeshShape& shape, int rank);
int mesh_rank(const MeshShape& shape, const MeshCoord& coord);
// A rank's index in the group of dims (the mixed-radix number of its
// indices along them).
int group_index(const MeshShape& shape, const MeshCoord& coord, Dims dims);
// The world ranks of rank's group over dims, in the order of their index.
std::vector<int> mesh_group(const MeshShape& shape, int rank, Dims dims);
// "dp=2, pp=1, tp=1": data parallelism as one figure unless it is hybrid,
// then every other dimension larger than 1 (pp and tp always).
std::string to_string(const MeshShape& shape);

class Mesh {
 public:
  // A single process: every dimension of size 1, no communicators.
  Mesh() = default;
  // Splits world into one communicator per dimension and one for
  // kDataParallel (collective: every rank of world constructs its Mesh at
  // the same point). shape.size() must equal world->size() (CHECK: callers
  // validate user input).
  Mesh(const MeshShape& shape, std::shared_ptr<comm::Communicator> world);

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  int size(Dims dims) const { return shape_.size(dims); }
  int index(Dims dims) const { return group_index(shape_, coord_, dims); }
  int rank() const { return rank_; }  // world rank
  // Null for a single process.
  const std::shared_ptr<comm::Communicator>& world() const { return world_; }
  // The communicator of dims' group (null for a single process). One
  // dimension and kDataParallel exist from construction; another flattened
  // group is made on its first request, which is then collective over the
  // world (every rank asks at the same point), and cached.
  std::shared_ptr<comm::Communicator> comm(Dims dims) const;

 private:
  MeshShape shape_;
  MeshCoord coord_;
  int rank_ = 0;
  std::shared_ptr<comm::Communicator> world_;
  struct Groups {
    std::mutex mutex;
    std::map<unsigned, std::shared_ptr<comm::Communicator>> by_dims;  // by Dims::bits()
  };
  std::shared_ptr<Groups> groups_ = std::make_shared<Groups>();  // shared by copies
};

}  // namespace trainer::parallel
