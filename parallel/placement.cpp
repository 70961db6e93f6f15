#include "parallel/placement.h"

#include "core/check.h"

namespace trainer::parallel {

namespace {

void check_shard(const TensorPlacement& p, Dim d) {
  const Placement& s = p[d];
  if (s.kind != Placement::Kind::shard) return;
  CHECK(s.dim >= 0 && size_t(s.dim) < p.global.size() && s.pieces >= 1)
      << dim_name(d) << " shards dimension " << s.dim << " in " << s.pieces << " pieces of "
      << shape_str(p.global);
}

}  // namespace

Shape local_shape(const TensorPlacement& p, const MeshShape& mesh) {
  Shape local = p.global;
  for (Dim d : kAllDims) {
    const Placement& s = p[d];
    if (s.kind != Placement::Kind::shard) continue;
    check_shard(p, d);
    const int64_t cut = int64_t(s.pieces) * mesh[d];
    int64_t& n = local[size_t(s.dim)];
    if (n % cut != 0)
      throw Error(cat("a tensor of shape ", shape_str(p.global), " sharded over ", dim_name(d),
                      " = ", mesh[d], ": its dimension ", s.dim, " (", n, " here) does not divide",
                      s.pieces > 1 ? cat(" into ", s.pieces, " pieces of ") : std::string(" by "),
                      mesh[d], s.pieces > 1 ? " slices" : ""));
    n /= mesh[d];
  }
  return local;
}

std::vector<Box> local_boxes(const TensorPlacement& p, const MeshShape& mesh,
                             const MeshCoord& coord) {
  local_shape(p, mesh);  // checks divisibility
  std::vector<Box> boxes{{Shape(p.global.size(), 0), p.global}};
  // Outermost first: each shard cuts every box of the ones before it.
  for (Dim d : kAllDims) {
    const Placement& s = p[d];
    if (s.kind != Placement::Kind::shard) continue;
    std::vector<Box> cut;
    for (const Box& b : boxes) {
      const int64_t piece = b.extent[size_t(s.dim)] / s.pieces;
      const int64_t slice = piece / mesh[d];
      for (int k = 0; k < s.pieces; ++k) {
        Box c = b;
        c.offset[size_t(s.dim)] += k * piece + coord[d] * slice;
        c.extent[size_t(s.dim)] = slice;
        cut.push_back(c);
      }
    }
    boxes = std::move(cut);
  }
  return boxes;
}

bool writes(const TensorPlacement& p, const MeshCoord& coord) {
  for (Dim d : kAllDims) {
    // The index that writes along d: any (each holds its own slice), the
    // owner, or the first of the replicas.
    const Placement::Kind kind = p[d].kind;
    if (kind == Placement::Kind::shard) continue;
    if (coord[d] != (kind == Placement::Kind::owned ? p[d].dim : 0)) return false;
  }
  return true;
}

std::string to_string(const TensorPlacement& p) {
  std::string out;
  for (Dim d : kAllDims) {
    const Placement& s = p[d];
    if (s.kind == Placement::Kind::replicate) continue;
    out += cat(out.empty() ? "" : ", ", dim_name(d), ": ");
    if (s.kind == Placement::Kind::partial)
      out += "partial";
    else if (s.kind == Placement::Kind::owned)
      out += cat("owned by ", s.dim);
    else
      out += cat("shard(", s.dim, s.pieces > 1 ? cat(", ", s.pieces, " pieces") : "", ")");
  }
  return out.empty() ? "replicate" : out;
}

TensorPlacement tensor_parallel_placement(const Shape& local, const ParameterSplit* split) {
  TensorPlacement p = TensorPlacement::replicated(local);
  if (!split || split->kind != ParameterSplit::Kind::sharded) return p;
  p.global[size_t(split->dim)] *= split->size;
  return p.with(Dim::tp, Placement::shard(split->dim, split->parts));
}

}  // namespace trainer::parallel
