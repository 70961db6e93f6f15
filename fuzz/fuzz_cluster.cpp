// libFuzzer target: the cluster file of `trainer plan --cluster`
// (trainer/cluster_file.h). Any input is a cluster or a trainer::Error; a
// cluster that parses has every figure finite and inside its stated range.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/check.h"
#include "trainer/cluster_file.h"

namespace {

bool inside(double value, const char* key) {
  for (const trainer::ClusterFigureRange& r : trainer::cluster_figure_ranges())
    if (std::string(r.key) == key) return std::isfinite(value) && value >= r.lo && value <= r.hi;
  std::abort();  // a key without a range
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  trainer::parallel::ClusterSpec cluster;
  try {
    cluster = trainer::parse_cluster_file(text, "fuzz.yaml",
                                          trainer::parallel::cluster_for("a100-80gb", 2));
  } catch (const trainer::Error&) {
    return 0;
  }
  const bool ok =
      inside(cluster.device.peak_tflops, "peak_tflops") &&
      inside(cluster.device.memory_gib, "memory_gib") &&
      inside(cluster.device.achievable, "achievable") && inside(cluster.per_node, "per_node") &&
      inside(cluster.intra.alpha_us, "intra.alpha_us") &&
      inside(cluster.intra.gbps, "intra.gbps") &&
      inside(cluster.inter.alpha_us, "inter.alpha_us") &&
      inside(cluster.inter.gbps, "inter.gbps") &&
      (cluster.intra_p2p.gbps == 0 || (inside(cluster.intra_p2p.gbps, "p2p.gbps") &&
                                       inside(cluster.intra_p2p.alpha_us, "p2p.alpha_us")));
  if (!ok) std::abort();
  return 0;
}
