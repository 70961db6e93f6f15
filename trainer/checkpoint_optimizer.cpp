// The ZeRO-1 shards of a checkpoint's optimizer state (trainer/checkpoint.h):
// each rank's file found and checked against the world that wrote the
// checkpoint, and the shards of every entry joined whole, on any layout.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/check.h"
#include "layers/tensor_parallel.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_parts.h"
#include "trainer/safetensors.h"

namespace fs = std::filesystem;

namespace trainer {

namespace {

// A shard file's tensor-parallel metadata (CheckpointPart::optimizer_metadata).
struct ShardFileTp {
  int rank = 0, size = 1;
  std::map<std::string, std::pair<int, int>> splits;  // param -> (dim, parts)
};

ShardFileTp shard_file_tp(const std::map<std::string, std::string>& metadata,
                          const std::string& path) {
  ShardFileTp tp;
  auto bad = [&](const std::string& key, const std::string& value) {
    return Error(cat(path, ": metadata '", key, "' = '", value,
                     "' is not the tensor-parallel layout of a ZeRO-1 shard; use an earlier "
                     "checkpoint"));
  };
  if (auto it = metadata.find("tp"); it != metadata.end())
    if (std::sscanf(it->second.c_str(), "%d %d", &tp.rank, &tp.size) != 2 || tp.size < 1 ||
        tp.rank < 0 || tp.rank >= tp.size)
      throw bad(it->first, it->second);
  const std::string prefix = "tp_split.";
  for (const auto& [key, value] : metadata) {
    if (key.rfind(prefix, 0) != 0) continue;
    int dim = 0, parts = 0;
    if (std::sscanf(value.c_str(), "%d %d", &dim, &parts) != 2 || dim < 0 || parts < 1)
      throw bad(key, value);
    tp.splits[key.substr(prefix.size())] = {dim, parts};
  }
  return tp;
}

// optimizer.rank<r>.safetensors -> r; -1 for another name, -2 for an
// optimizer.rank<...>.safetensors whose <...> is no rank number.
int shard_file_rank(const std::string& name) {
  const std::string prefix = "optimizer.rank", suffix = ".safetensors";
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) ||
      !name.ends_with(suffix))
    return -1;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  const bool number =
      digits.size() <= 7 && (digits.size() == 1 || digits[0] != '0') &&
      std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  return number ? std::stoi(digits) : -2;
}

}  // namespace

std::map<int, std::string> shard_files(const std::string& dir) {
  std::vector<fs::path> paths;
  checked_fs(dir, [&] {
    for (const auto& e : fs::directory_iterator(dir)) paths.push_back(e.path());
  });
  std::map<int, std::string> files;
  for (const fs::path& p : paths) {
    const int rank = shard_file_rank(p.filename().string());
    if (rank == -2)
      throw Error(cat(p.string(), ": not the name of a rank's ZeRO-1 shard ",
                      "(optimizer.rank<r>.safetensors); remove or rename the file"));
    if (rank >= 0) files[rank] = p.string();
  }
  const std::string state = trainer_state_file(dir);
  if (!fs::is_regular_file(status_of(state))) return files;
  const int world = read_trainer_state(dir).state.layout.world_size();
  for (const auto& [rank, path] : files)
    if (rank >= world)
      throw Error(cat(path, ": a ZeRO-1 shard of rank ", rank,
                      ", but the checkpoint was written by ", world, " rank", world == 1 ? "" : "s",
                      " (", state,
                      "): the file is not part of it; remove it, or use an earlier checkpoint"));
  for (int rank = 0; rank < world; ++rank)
    if (!files.count(rank))
      throw Error(cat(optimizer_file(dir, true, rank), ": missing: each of the ", world,
                      " ranks that wrote the checkpoint (", state,
                      ") saves its ZeRO-1 shard of the optimizer state; use an earlier "
                      "checkpoint"));
  return files;
}

namespace {

// One shard of an entry: elements [begin, end) of its (part's) flat tensor.
struct ShardRange {
  int64_t begin, end;
  std::string file, name;
};

// The shards of one entry's part must hold each element once: a range held
// twice names both files (one is extra or damaged), a range held by none is
// named as a missing file's.
void check_shard_ranges(std::vector<ShardRange> ranges, int64_t numel, const std::string& dir,
                        const std::string& what) {
  std::sort(ranges.begin(), ranges.end(),
            [](const ShardRange& x, const ShardRange& y) { return x.begin < y.begin; });
  int64_t covered = 0;
  for (const ShardRange& r : ranges) covered += r.end - r.begin;
  auto hole = [&](int64_t begin, int64_t end) {
    return Error(cat(dir, ": the ZeRO-1 shards of ", what, " cover ", covered, " of ", numel,
                     " elements: [", begin, ", ", end,
                     ") is in none; is a rank's optimizer file missing?"));
  };
  int64_t pos = 0;
  const ShardRange* previous = nullptr;
  for (const ShardRange& r : ranges) {
    if (r.begin > pos) throw hole(pos, r.begin);
    if (r.begin < pos)  // then previous, the range reaching furthest so far, is set
      throw Error(cat(r.file, ": entry '", r.name, "' holds elements [", r.begin, ", ",
                      std::min(pos, r.end), ") of ", what, ", which entry '", previous->name,
                      "' of ", previous->file, " holds too: a shard file is extra (of another ",
                      "checkpoint or layout) or damaged; remove it, or use an earlier checkpoint"));
    if (r.end > pos) {
      pos = r.end;
      previous = &r;
    }
  }
  if (pos < numel) throw hole(pos, numel);
}

// Per entry, the flat tensor of each tensor-parallel part (one, size 1,
// unless the parameter was split), and the ranges each part received.
struct JoinedEntry {
  ParameterSplit split;  // size 1: not split
  std::vector<Tensor> parts;
  std::vector<std::vector<ShardRange>> ranges;
  Tensor step;  // a step count: the same in every shard
};

// Copies the entries of one rank's shard file (checked as the options ask)
// into their entries' parts in `joined`.
void join_shard_file(const std::string& path, const std::map<std::string, Shape>& shapes,
                     const CheckpointReadOptions& options,
                     std::map<std::string, JoinedEntry>& joined) {
  SafetensorsFile f = read_safetensors(path);
  if (options.refuse_non_finite) require_finite(f.tensors, path);
  const ShardFileTp tp = shard_file_tp(f.metadata, path);
  for (const auto& [name, t] : f.tensors) {
    if (name.rfind("zero1.rank", 0) == 0) continue;  // the shard's layout record
    const size_t open = name.rfind('[');
    long long begin = 0, end = 0;
    if (open == std::string::npos ||
        std::sscanf(name.c_str() + open, "[%lld:%lld]", &begin, &end) != 2 || end < begin ||
        begin < 0)
      throw Error(cat(path, ": entry '", name, "' is not a ZeRO-1 shard (<param>.<slot>[b:e])"));
    const std::string entry = name.substr(0, open);
    const size_t dot = entry.rfind('.');
    const std::string param = dot == std::string::npos ? "" : entry.substr(0, dot);
    auto shape = shapes.find(param);
    if (shape == shapes.end())
      throw Error(cat(path, ": entry '", name, "' is of no parameter of this model"));
    JoinedEntry& j = joined[entry];
    if (t.dim() == 0) {
      j.step = t;
      continue;
    }
    auto split = tp.splits.find(param);
    // A parameter every tp rank holds whole: tp rank 0's shards.
    if (split == tp.splits.end() && tp.rank != 0) continue;
    ParameterSplit s;
    if (split != tp.splits.end()) {
      s = {.kind = ParameterSplit::Kind::sharded,
           .dim = split->second.first,
           .parts = split->second.second,
           .rank = tp.rank,
           .size = tp.size};
      if (size_t(s.dim) >= shape->second.size() ||
          shape->second[size_t(s.dim)] % (int64_t(s.parts) * s.size) != 0)
        throw Error(cat(path, ": entry '", name, "' is split over ", s.size, " ranks on dim ",
                        s.dim, ", which parameter '", param, "' ", shape_str(shape->second),
                        " does not divide into"));
    }
    if (j.parts.empty()) {
      j.split = s;
      j.parts.resize(size_t(s.size));
      j.ranges.resize(size_t(s.size));
    } else if (j.split.size != s.size || j.split.dim != s.dim || j.split.parts != s.parts) {
      throw Error(cat(path, ": entry '", name, "' is split unlike the other ranks' shards of '",
                      entry, "'; use an earlier checkpoint"));
    }
    const int64_t numel = shape_numel(shape->second) / s.size;
    if (end > numel || t.numel() != end - begin)
      throw Error(cat(path, ": entry '", name, "' does not fit parameter '", param, "' of ", numel,
                      " elements", s.size > 1 ? " in each tensor-parallel part" : ""));
    const size_t part = size_t(s.size > 1 ? s.rank : 0);
    Tensor& w = j.parts[part];
    if (!w.defined()) w = zeros({numel}, t.dtype());
    w.narrow(0, begin, end - begin).copy_(t.reshape({-1}));
    j.ranges[part].push_back({begin, end, path, name});
  }
}

}  // namespace

std::map<std::string, Tensor> read_sharded_optimizer_whole(
    const std::string& dir, const std::map<std::string, Shape>& shapes,
    const CheckpointReadOptions& options) {
  std::map<std::string, JoinedEntry> joined;
  const std::map<int, std::string> files = shard_files(dir);
  if (files.empty()) throw Error(cat(dir, ": no optimizer.rank<r>.safetensors (ZeRO-1 shards)"));
  for (const auto& [rank, path] : files) join_shard_file(path, shapes, options, joined);
  std::map<std::string, Tensor> whole;
  for (auto& [entry, j] : joined) {
    if (j.parts.empty()) {
      whole[entry] = j.step;
      continue;
    }
    const Shape& shape = shapes.at(entry.substr(0, entry.rfind('.')));
    Shape part_shape = shape;
    if (j.split.size > 1) part_shape[size_t(j.split.dim)] /= j.split.size;
    TensorList parts;
    for (size_t r = 0; r < j.parts.size(); ++r) {
      check_shard_ranges(
          j.ranges[r], shape_numel(part_shape), dir,
          cat("'", entry, "'", j.split.size > 1 ? cat(" (tensor-parallel part ", r, ")") : ""));
      parts.push_back(j.parts[r].reshape(part_shape));
    }
    whole[entry] = parts.size() == 1 ? parts[0] : unshard(parts, j.split);
  }
  return whole;
}

}  // namespace trainer
