#include "trainer/cluster_file.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/check.h"
#include "data/files.h"
#include "trainer/numbers.h"

namespace trainer {

const std::vector<ClusterFigureRange>& cluster_figure_ranges() {
  // Wide enough for any machine of the next decades, narrow enough that the
  // planner's sums stay far from overflow and underflow.
  static const std::vector<ClusterFigureRange> ranges = {
      {"peak_tflops", 1e-3, 1e6},    {"memory_gib", 1e-3, 1e6},     {"per_node", 1, 1024},
      {"achievable", 1e-3, 1},       {"intra.alpha_us", 1e-3, 1e7}, {"intra.gbps", 1e-3, 1e7},
      {"inter.alpha_us", 1e-3, 1e7}, {"inter.gbps", 1e-3, 1e7},     {"p2p.alpha_us", 1e-3, 1e7},
      {"p2p.gbps", 1e-3, 1e7}};
  return ranges;
}

namespace {

struct Entry {
  std::string key;  // "peak_tflops", or "intra.gbps" in a section
  std::string at;   // "file:line" of the key
  YAML::Node value;
};

struct Reader {
  const std::string& name;

  std::string where(const YAML::Node& node) const {
    return node.Mark().line >= 0 ? cat(name, ":", node.Mark().line + 1) : name;
  }

  std::string keys() const {
    std::string list = "device";
    for (const ClusterFigureRange& r : cluster_figure_ranges()) list += cat(", ", r.key);
    return list;
  }

  // A map's keys as plain names, each once; `section` is "" or "intra.".
  std::vector<Entry> entries(const YAML::Node& map, const std::string& section) const {
    std::vector<Entry> out;
    std::map<std::string, std::string> seen;
    for (auto it = map.begin(); it != map.end(); ++it) {
      const std::string at = where(it->first);
      if (!it->first.IsScalar())
        throw Error(cat(at, ": a key of ", section.empty() ? "the cluster file" : section, " is a ",
                        it->first.IsSequence() ? "list" : "map", "; keys are plain names (", keys(),
                        ")"));
      const std::string key = section + it->first.Scalar();
      if (auto [first, fresh] = seen.emplace(key, at); !fresh)
        throw Error(cat(at, ": key '", key, "' is given twice (also at ", first->second,
                        "); keep one of them"));
      // A copy (a Node is a handle): it-> returns a proxy that dies with the
      // statement, so a reference to its second would dangle.
      out.push_back({key, at, YAML::Node(it->second)});
    }
    return out;
  }

  double figure(const YAML::Node& value, const std::string& at, const std::string& key) const {
    const auto range = std::find_if(cluster_figure_ranges().begin(), cluster_figure_ranges().end(),
                                    [&](const ClusterFigureRange& r) { return key == r.key; });
    if (range == cluster_figure_ranges().end())
      throw Error(cat(at, ": unknown key '", key, "'; the keys are ", keys()));
    const std::optional<double> number =
        value.IsScalar() ? parse_finite(value.Scalar()) : std::nullopt;
    if (!number || *number < range->lo || *number > range->hi)
      throw Error(cat(at, ": key '", key, "' expects a finite number in ",
                      range_text(range->lo, range->hi), ", got ",
                      value.IsScalar() ? "'" + value.Scalar() + "'" : "a map or list"));
    return *number;
  }
};

}  // namespace

parallel::ClusterSpec parse_cluster_file(const std::string& text, const std::string& name,
                                         parallel::ClusterSpec base) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(cat(name, ":", e.mark.line + 1, ": YAML syntax error: ", e.msg));
  }
  if (root.IsNull()) return base;
  if (!root.IsMap()) throw Error(cat(name, ": a cluster file is a YAML map of keys"));
  const Reader reader{name};
  const std::vector<Entry> entries = reader.entries(root, "");
  // The device first: the other keys change its figures.
  for (const auto& [key, at, device] : entries) {
    if (key != "device") continue;
    if (!device.IsScalar())
      throw Error(cat(at, ": key 'device' expects a device name, e.g. h100-80gb"));
    const int nodes = base.nodes, per_node = base.per_node;
    // A CPU cluster's figures come from this machine (this_machine_cluster).
    if (device.Scalar() != parallel::kCpuDevice || base.device.name != parallel::kCpuDevice) {
      base = parallel::cluster_for(device.Scalar(), nodes);
      base.per_node = per_node;
    }
  }
  bool named_device = false;
  bool p2p_alpha = false, p2p_gbps = false;  // the p2p figures the file gives
  for (const auto& [key, at, value] : entries) {
    if (key == "device") {
      named_device = true;
    } else if (key == "intra" || key == "inter" || key == "p2p") {
      parallel::LinkSpec& link = key == "intra"   ? base.intra
                                 : key == "inter" ? base.inter
                                                  : base.intra_p2p;
      if (!value.IsMap()) throw Error(cat(at, ": key '", key, "' expects a map {alpha_us, gbps}"));
      for (const auto& [field, field_at, figure] : reader.entries(value, key + ".")) {
        const double number = reader.figure(figure, field_at, field);
        (field == key + ".alpha_us" ? link.alpha_us : link.gbps) = number;
        if (key == "p2p") (field == "p2p.alpha_us" ? p2p_alpha : p2p_gbps) = true;
      }
    } else {
      const double number = reader.figure(value, at, key);
      if (key == "peak_tflops") base.device.peak_tflops = number;
      if (key == "memory_gib") base.device.memory_gib = number;
      if (key == "achievable") base.device.achievable = number;
      if (key == "per_node") {
        if (number != std::floor(number))
          throw Error(
              cat(at, ": key 'per_node' expects a whole number of GPUs, got ", value.Scalar()));
        base.per_node = int(number);
      }
    }
  }
  // A p2p link the file gives in part takes the rest from intra.
  if (p2p_alpha || p2p_gbps) {
    if (!p2p_alpha) base.intra_p2p.alpha_us = base.intra.alpha_us;
    if (!p2p_gbps) base.intra_p2p.gbps = base.intra.gbps;
  }
  if (!named_device) base.device.name += " (cluster file)";
  return base;
}

parallel::ClusterSpec load_cluster_file(const std::string& path, parallel::ClusterSpec base) {
  // Refuses a FIFO, a device or a directory before reading (data/files.h).
  const std::string text = data::read_regular_file(path, "the cluster file (--cluster)", 1 << 24);
  return parse_cluster_file(text, path, base);
}

}  // namespace trainer
