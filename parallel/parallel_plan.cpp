#include "parallel/parallel_plan.h"

#include <algorithm>

#include "core/check.h"

namespace trainer::parallel {

bool ParallelPlan::applied(const std::string& name) const {
  return std::any_of(passes.begin(), passes.end(), [&](const Pass& p) { return p.name == name; });
}

const TensorPlacement& ParallelPlan::placement(const std::string& name) const {
  auto it = placements.find(name);
  if (it == placements.end())
    throw Error(cat("the parallel plan places no tensor '", name,
                    "': it is not a tensor of this rank's part of the model"));
  return it->second;
}

namespace {

bool replicated_over_data_parallel(const TensorPlacement& p) {
  for (Dim d : kAllDims)
    if (kDataParallel.contains(d) && p[d].kind != Placement::Kind::replicate) return false;
  return true;
}

}  // namespace

bool ParallelPlan::writes(const std::string& name) const {
  const TensorPlacement& p = placement(name);
  auto writer = replica_writer.find(name);
  if (writer == replica_writer.end()) return parallel::writes(p, coord);
  MeshCoord c = coord;
  for (Dim d : kAllDims)
    if (kDataParallel.contains(d)) c.set(d, 0);
  return parallel::writes(p, c) && group_index(mesh, coord, kDataParallel) == writer->second;
}

void ParallelPlan::spread_writers(const std::map<std::string, int64_t>& bytes) {
  replica_writer.clear();
  const int replicas = mesh.size(kDataParallel);
  if (replicas == 1) return;
  std::vector<std::pair<int64_t, std::string>> order;  // largest first, then by name
  for (const auto& [name, p] : placements)
    if (replicated_over_data_parallel(p)) order.push_back({-bytes.at(name), name});
  std::sort(order.begin(), order.end());
  std::vector<int64_t> load(size_t(replicas), 0);
  for (const auto& [negative, name] : order) {
    const size_t least = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    load[least] -= negative;
    replica_writer[name] = int(least);
  }
}

std::string ParallelPlan::describe() const {
  std::string out;
  for (const Pass& p : passes)
    out += cat(out.empty() ? "" : " -> ", p.name, p.detail.empty() ? "" : cat(" (", p.detail, ")"));
  return out.empty() ? "one process" : out;
}

}  // namespace trainer::parallel
