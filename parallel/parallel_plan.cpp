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

std::string ParallelPlan::describe() const {
  std::string out;
  for (const Pass& p : passes)
    out += cat(out.empty() ? "" : " -> ", p.name, p.detail.empty() ? "" : cat(" (", p.detail, ")"));
  return out.empty() ? "one process" : out;
}

}  // namespace trainer::parallel
