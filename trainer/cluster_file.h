// Cluster files (`trainer plan --cluster FILE`): a YAML map that describes
// the device and the links the cluster planner scores plans on
// (docs/planner.md):
//
//   device: h100-80gb          # a row of the device table to start from
//   peak_tflops: 989           # bf16 dense peak per GPU
//   memory_gib: 80
//   per_node: 8
//   achievable: 0.5            # fraction of the peak a layer reaches
//   intra: {alpha_us: 3, gbps: 3600}
//   inter: {alpha_us: 8, gbps: 400}
//   p2p: {alpha_us: 4, gbps: 344}   # point-to-point inside a node, when it differs
//
// Every figure is a finite number in a stated range (a step time of 47
// digits comes from a figure of 1e308, not from a cluster); a key given
// twice, a key that is not a plain name, or an unknown key is an Error
// naming the file, the line and the key.
#pragma once

#include <string>

#include "parallel/planner.h"

namespace trainer {

// The ranges of the cluster file's figures, for messages and docs.
struct ClusterFigureRange {
  const char* key;
  double lo, hi;
};
const std::vector<ClusterFigureRange>& cluster_figure_ranges();

// `text` (a cluster file named `name` in messages) applied over `base`.
parallel::ClusterSpec parse_cluster_file(const std::string& text, const std::string& name,
                                         parallel::ClusterSpec base);
// The same, read from `path` (a regular file of at most 16 MiB).
parallel::ClusterSpec load_cluster_file(const std::string& path, parallel::ClusterSpec base);

}  // namespace trainer
