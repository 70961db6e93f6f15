#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/rng.h"
#include "data/files.h"
#include "layers/tensor_parallel.h"
#include "trainer/safetensors.h"

namespace fs = std::filesystem;

namespace trainer {

namespace {

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) throw Error(cat("cannot open ", path, " to flush it"));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw Error(cat("cannot flush ", path));
}

// step_00001200 -> 1200; -1 for anything else.
int64_t parse_step(const std::string& name) {
  if (name.size() != 13 || name.rfind("step_", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

// fs::status without its exceptions: absent is file_type::not_found, a
// symlink loop or an unreadable path an Error naming it.
fs::file_status status_of(const fs::path& path) {
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
    throw Error(cat("cannot inspect ", path.string(), ": ", ec.message(),
                    ec == std::errc::too_many_symbolic_link_levels
                        ? " (a symlink loop: fix or remove the link)"
                        : "; fix its permissions or remove it"));
  return st;
}

// Runs f, turning the std::filesystem errors of a checkpoint directory's
// upkeep into an Error naming the path and what to do.
template <class F>
auto checked_fs(const std::string& root, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const fs::filesystem_error& e) {
    throw Error(cat("checkpoints in ", root, ": ", e.what(),
                    "; make sure the checkpoint directory is writable and holds no broken "
                    "links, or choose another output_dir"));
  }
}

}  // namespace

void fsync_tree(const std::string& dir) {
  checked_fs(dir, [&] {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) fsync_path(e.path().string(), false);
  });
  fsync_path(dir, true);
}

CheckpointDir::CheckpointDir(std::string root, int64_t keep_last)
    : root_(std::move(root)), keep_last_(keep_last) {
  CHECK_GE(keep_last_, 1) << "keep_last";
  data::make_directories(root_, "the checkpoint directory (output_dir/checkpoints)");
}

std::string CheckpointDir::step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

bool CheckpointDir::is_complete(const std::string& dir) {
  return fs::is_directory(status_of(dir)) &&
         fs::is_regular_file(status_of(fs::path(dir) / "trainer_state.json"));
}

std::string CheckpointDir::begin(int64_t step) const {
  fs::path tmp = fs::path(root_) / (step_name(step) + ".tmp");
  checked_fs(root_, [&] { fs::remove_all(tmp); });
  data::make_directories(tmp.string(), "a checkpoint's temporary directory");
  return tmp.string();
}

std::string CheckpointDir::commit(int64_t step, bool is_best) {
  std::string name = step_name(step);
  fs::path tmp = fs::path(root_) / (name + ".tmp");
  fs::path final_dir = fs::path(root_) / name;
  CHECK(is_complete(tmp.string())) << "commit of " << tmp << " without a trainer_state.json";
  fsync_tree(tmp.string());
  // Re-saving a step (e.g. after a resume) replaces the old directory.
  checked_fs(root_, [&] {
    if (fs::exists(final_dir)) fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
  });
  fsync_path(root_, true);
  if (is_best) write_file_atomic((fs::path(root_) / "best").string(), name + "\n");
  write_file_atomic((fs::path(root_) / "latest").string(), name + "\n");
  prune();
  return final_dir.string();
}

std::optional<std::string> CheckpointDir::read_pointer(const std::string& pointer) const {
  fs::path p = fs::path(root_) / pointer;
  if (!fs::is_regular_file(status_of(p))) return std::nullopt;
  std::string name = read_file(p.string(), "the checkpoint pointer");
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (parse_step(name) < 0) return std::nullopt;
  std::string dir = (fs::path(root_) / name).string();
  return is_complete(dir) ? std::optional<std::string>(dir) : std::nullopt;
}

std::vector<std::string> CheckpointDir::complete() const {
  std::vector<std::pair<int64_t, std::string>> found;
  checked_fs(root_, [&] {
    for (const auto& e : fs::directory_iterator(root_)) {
      int64_t s = parse_step(e.path().filename().string());
      if (s >= 0 && is_complete(e.path().string())) found.emplace_back(s, e.path().string());
    }
  });
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, d] : found) out.push_back(d);
  return out;
}

std::optional<std::string> CheckpointDir::latest_complete() const {
  if (auto p = read_pointer("latest")) return p;
  std::vector<std::string> all = complete();
  if (all.empty()) return std::nullopt;
  return all.back();
}

void CheckpointDir::prune() const {
  std::vector<std::string> all = complete();
  std::optional<std::string> best = read_pointer("best");
  std::optional<std::string> latest = read_pointer("latest");
  // Keep the newest keep_last, plus best and latest wherever they are.
  checked_fs(root_, [&] {
    for (int64_t i = 0; i + keep_last_ < int64_t(all.size()); ++i) {
      if ((best && *best == all[i]) || (latest && *latest == all[i])) continue;
      fs::remove_all(all[i]);
    }
    // Stale temporaries of other steps (a crash mid-write) go too.
    for (const auto& e : fs::directory_iterator(root_)) {
      std::string n = e.path().filename().string();
      if (n.size() > 4 && n.substr(n.size() - 4) == ".tmp" && e.is_directory())
        fs::remove_all(e.path());
    }
  });
}

// ---- the files of one checkpoint ----

std::string model_file(const std::string& dir) { return dir + "/model.safetensors"; }

std::string model_part_file(const std::string& dir, int part, int parts) {
  CHECK(part >= 0 && part < parts) << "model part " << part << " of " << parts;
  if (parts == 1) return model_file(dir);
  char name[64];
  // Hugging Face's names for a model split over files, numbered from 1.
  std::snprintf(name, sizeof name, "/model-%05d-of-%05d.safetensors", part + 1, parts);
  return dir + name;
}

std::string optimizer_part_file(const std::string& dir, int part, int parts) {
  CHECK(part >= 0 && part < parts) << "optimizer part " << part << " of " << parts;
  char name[64];
  std::snprintf(name, sizeof name, "/optimizer-%05d-of-%05d.safetensors", part + 1, parts);
  return dir + name;
}

std::string optimizer_file(const std::string& dir, bool sharded, int rank) {
  return sharded ? cat(dir, "/optimizer.rank", rank, ".safetensors")
                 : dir + "/optimizer.safetensors";
}

std::string stream_state_file(const std::string& dir, int rank) {
  return cat(dir, "/stream_state.rank", rank, ".safetensors");
}

std::string loss_scaler_file(const std::string& dir) { return dir + "/loss_scaler.safetensors"; }

std::string trainer_state_file(const std::string& dir) { return dir + "/trainer_state.json"; }

// ---- trainer_state.json ----

namespace {
using json = nlohmann::json;

// The fields of trainer_state.json, each checked for its JSON type: an
// Error names the file and the field ("parallel.world_size").
struct StateFields {
  const std::string& path;

  [[noreturn]] void wrong_type(const std::string& field, const json& value,
                               const char* expected) const {
    throw Error(cat(path, ": missing or wrong field '", field, "': it is ", value.type_name(),
                    ", expected ", expected, "; use an earlier checkpoint"));
  }
  // object[key], or nullptr with a fallback when it is absent.
  const json* find(const json& object, const char* key, const std::string& prefix,
                   bool has_fallback) const {
    if (object.contains(key)) return &object[key];
    if (!has_fallback)
      throw Error(cat(path, ": missing or wrong field '", prefix, key,
                      "': it is missing; use an earlier checkpoint"));
    return nullptr;
  }
  int64_t integer(const json& object, const char* key, std::optional<int64_t> fallback = {},
                  const std::string& prefix = "", int64_t at_least_one_up_to = 0) const {
    const json* v = find(object, key, prefix, fallback.has_value());
    if (!v) return *fallback;
    if (!v->is_number_integer()) wrong_type(prefix + key, *v, "an integer");
    const int64_t x = v->get<int64_t>();
    if (at_least_one_up_to > 0 && (x < 1 || x > at_least_one_up_to))
      throw Error(cat(path, ": missing or wrong field '", prefix, key, "': ", x, " is outside [1, ",
                      at_least_one_up_to, "]; use an earlier checkpoint"));
    return x;
  }
  double number(const json& object, const char* key, std::optional<double> fallback = {}) const {
    const json* v = find(object, key, "", fallback.has_value());
    if (!v) return *fallback;
    if (!v->is_number()) wrong_type(key, *v, "a number");
    return v->get<double>();
  }
  bool boolean(const json& object, const char* key, bool fallback,
               const std::string& prefix) const {
    const json* v = find(object, key, prefix, true);
    if (!v) return fallback;
    if (!v->is_boolean()) wrong_type(prefix + key, *v, "true or false");
    return v->get<bool>();
  }
  const json& object(const json& parent, const char* key, const std::string& prefix = "") const {
    const json& v = *find(parent, key, prefix, false);
    if (!v.is_object()) wrong_type(prefix + key, v, "an object");
    return v;
  }
};

}  // namespace

void write_trainer_state(const std::string& dir, const TrainerStateFile& file) {
  const TrainState& s = file.state;
  json j;
  j["format"] = kTrainerStateFormat;
  j["step"] = s.step;
  j["epoch"] = s.epoch;
  j["position"] = s.position;
  j["best_metric"] = s.best_metric;
  j["nonfinite_skipped"] = s.nonfinite_skipped;
  j["lr"] = file.lr;
  j["rng"] = {{"seed", file.seed},
              {"init_stream", uint64_t(kStreamInit)},
              {"dropout", "re-keyed per micro-step from (seed, layer, micro-step, rank)"},
              {"augment", "keyed by (seed, epoch, sample index)"}};
  const ParallelLayout& l = s.layout;
  j["parallel"] = {{"world_size", l.world_size()},
                   {"dp", l.mesh.size(parallel::kDataParallel)},
                   {"pp", l.mesh[parallel::Dim::pp]},
                   {"tp", l.mesh[parallel::Dim::tp]},
                   {"zero1", l.zero1}};
  // dp, pp and tp say it all unless another dimension is in use.
  const parallel::Dims said{parallel::Dim::dp_replicate, parallel::Dim::pp, parallel::Dim::tp};
  if (l.mesh.size(said.complement()) > 1)
    for (parallel::Dim d : parallel::kAllDims)
      j["parallel"]["mesh"][parallel::dim_name(d)] = l.mesh[d];
  for (const auto& [ranks, model] : s.link_models)
    j["link_models"].push_back({{"ranks", ranks},
                                {"alpha_s", model.alpha},
                                {"beta_s_per_byte", model.beta},
                                {"gamma_s_per_byte", model.gamma}});
  if (!file.vocab.empty()) j["vocab"] = file.vocab;
  j["recipe"] = file.recipe_yaml;
  write_file_atomic(trainer_state_file(dir), j.dump(2) + "\n");
}

TrainerStateFile read_trainer_state(const std::string& dir) {
  const std::string path = trainer_state_file(dir);
  return parse_trainer_state(read_file(path, "the trainer state"), path);
}

namespace {

// parallel.mesh (format 2), or the data x pipeline x tensor figures of
// format 1 (written before pipeline and tensor parallelism had keys: all
// data-parallel).
parallel::MeshShape read_mesh(StateFields& fields, const json& p, int64_t world, int64_t max) {
  parallel::MeshShape mesh;
  if (!p.contains("mesh")) {
    mesh.set(parallel::Dim::dp_replicate, int(fields.integer(p, "dp", world, "parallel.", max)));
    mesh.set(parallel::Dim::pp, int(fields.integer(p, "pp", 1, "parallel.", max)));
    mesh.set(parallel::Dim::tp, int(fields.integer(p, "tp", 1, "parallel.", max)));
    return mesh;
  }
  const json& m = fields.object(p, "mesh", "parallel.");
  for (const auto& [key, value] : m.items())
    if (!parallel::dim_from_name(key))
      throw Error(cat(fields.path, ": parallel.mesh names a dimension '", key,
                      "' this build does not know; resume with the trainer that wrote it"));
  for (parallel::Dim d : parallel::kAllDims)
    mesh.set(d, int(fields.integer(m, parallel::dim_name(d), 1, "parallel.mesh.", max)));
  return mesh;
}

}  // namespace

TrainerStateFile parse_trainer_state(const std::string& text, const std::string& path) {
  // A key given twice is refused: which of the two values holds is not known.
  const json j = parse_strict_json(text, [&](const std::string& problem) {
    throw Error(cat(path, ": ", problem, "; the file is damaged: use an earlier checkpoint"));
  });
  if (!j.is_object())
    throw Error(
        cat(path, ": not a JSON object but ", j.type_name(), "; use an earlier checkpoint"));
  StateFields fields{path};
  const int64_t format = fields.integer(j, "format", 1);
  if (format > kTrainerStateFormat)
    throw Error(cat(path, ": format ", format,
                    " was written by a newer trainer (this one reads up to ", kTrainerStateFormat,
                    "); resume with that trainer"));
  if (format < 1)
    throw Error(cat(path, ": format ", format, " is not a version; use an earlier checkpoint"));
  TrainerStateFile file;
  TrainState& s = file.state;
  s.step = fields.integer(j, "step");
  s.epoch = fields.integer(j, "epoch");
  s.position = fields.integer(j, "position");
  s.best_metric = fields.number(j, "best_metric");
  s.nonfinite_skipped = fields.integer(j, "nonfinite_skipped");
  file.lr = fields.number(j, "lr", 0.0);
  if (s.step < 0 || s.epoch < 0 || s.position < 0)
    throw Error(cat(path, ": negative step, epoch or position; use an earlier checkpoint"));
  if (j.contains("parallel")) {
    const json& p = fields.object(j, "parallel");
    // Up to 2^20 ranks per dimension: world_size below cannot overflow.
    constexpr int64_t kMaxRanks = int64_t(1) << 20;
    const int64_t world = fields.integer(p, "world_size", 1, "parallel.", kMaxRanks);
    s.layout.mesh = read_mesh(fields, p, world, kMaxRanks);
    s.layout.zero1 = fields.boolean(p, "zero1", false, "parallel.");
    if (int64_t(s.layout.mesh.size()) != world)
      throw Error(cat(path, ": parallel.world_size ", world, " is not ",
                      p.contains("mesh") ? "the product of parallel.mesh" : "dp x pp x tp", " (",
                      parallel::to_string(s.layout.mesh), "); use an earlier checkpoint"));
  }
  if (j.contains("link_models")) {
    const json& models = j["link_models"];
    const char* expected = "a list of {ranks, alpha_s, beta_s_per_byte, gamma_s_per_byte}";
    if (!models.is_array()) fields.wrong_type("link_models", models, expected);
    for (const json& m : models) {
      if (!m.is_object() || !m.contains("ranks") || !m["ranks"].is_array())
        fields.wrong_type("link_models", m, expected);
      std::vector<int> ranks;
      for (const json& r : m["ranks"]) {
        if (!r.is_number_integer() || r.get<int64_t>() < 0 ||
            r.get<int64_t>() >= s.layout.world_size())
          fields.wrong_type("link_models.ranks", r,
                            cat("ranks below the world size ", s.layout.world_size()).c_str());
        ranks.push_back(int(r.get<int64_t>()));
      }
      comm::LinkModel model{.alpha = fields.number(m, "alpha_s"),
                            .beta = fields.number(m, "beta_s_per_byte"),
                            .gamma = fields.number(m, "gamma_s_per_byte")};
      if (!(model.alpha >= 0 && model.beta >= 0 && model.gamma >= 0))
        throw Error(cat(path, ": link_models: negative cost for ranks ", json(ranks).dump(),
                        "; use an earlier checkpoint"));
      s.link_models[std::move(ranks)] = model;
    }
  }
  if (j.contains("vocab")) {
    const json& vocab = j["vocab"];
    if (!vocab.is_array()) fields.wrong_type("vocab", vocab, "a list of integers");
    for (const json& symbol : vocab) {
      if (!symbol.is_number_integer()) fields.wrong_type("vocab", symbol, "a list of integers");
      file.vocab.push_back(symbol.get<int64_t>());
    }
  }
  if (j.contains("recipe")) {
    if (!j["recipe"].is_string()) fields.wrong_type("recipe", j["recipe"], "a string");
    file.recipe_yaml = j["recipe"].get<std::string>();
  }
  return file;
}

std::string resharding(const ParallelLayout& saved, const ParallelLayout& current) {
  std::string out;
  auto change = [&](const char* what, auto was, auto now) {
    if (was == now) return;
    out += cat(out.empty() ? "" : ", ", what, " ", was, " -> ", now);
  };
  change("dp", saved.mesh.size(parallel::kDataParallel),
         current.mesh.size(parallel::kDataParallel));
  change("pp", saved.mesh[parallel::Dim::pp], current.mesh[parallel::Dim::pp]);
  change("tp", saved.mesh[parallel::Dim::tp], current.mesh[parallel::Dim::tp]);
  change("zero1", saved.zero1 ? "on" : "off", current.zero1 ? "on" : "off");
  return out;
}

// ---- non-finite values ----

namespace {

// The first NaN or Inf of a floating-point tensor (CPU, as loaded) and its
// index, or -1.
std::pair<int64_t, double> first_non_finite(const Tensor& t) {
  if (!is_floating(t.dtype()) || t.numel() == 0) return {-1, 0};
  auto scan = [](const auto* x, int64_t n) -> std::pair<int64_t, double> {
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(double(x[i]))) return {i, double(x[i])};
    return {-1, 0};
  };
  if (t.dtype() == DType::f32) return scan(t.contiguous().data<float>(), t.numel());
  return scan(t.to(DType::f64).contiguous().data<double>(), t.numel());
}

// A file's tensors, checked as the options ask.
std::map<std::string, Tensor> read_tensors(const std::string& path,
                                           const CheckpointReadOptions& options) {
  std::map<std::string, Tensor> tensors = read_safetensors(path).tensors;
  if (options.refuse_non_finite) require_finite(tensors, path);
  return tensors;
}

}  // namespace

void require_finite(const std::map<std::string, Tensor>& tensors, const std::string& file) {
  for (const auto& [name, t] : tensors) {
    const auto [index, value] = first_non_finite(t);
    if (index < 0) continue;
    throw Error(cat(file, ": tensor '", name, "' holds ", value, " at element ", index,
                    " (a non-finite value): the file is poisoned. Use an earlier checkpoint, or "
                    "set training.allow_non_finite=true to load it anyway"));
  }
}

// ---- ZeRO-1 shards ----

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

// The ZeRO-1 shard files of a checkpoint, by rank. When its
// trainer_state.json records the layout that wrote it, they are exactly one
// per rank of that world: a file of a rank beyond it (left by another run,
// or copied in) would be joined into the state or silently ignored, and a
// missing one leaves a hole; either is an Error naming the file.
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

}  // namespace

std::map<std::string, Tensor> read_sharded_optimizer_whole(
    const std::string& dir, const std::map<std::string, Shape>& shapes,
    const CheckpointReadOptions& options) {
  // Per entry, the flat tensor of each tensor-parallel part (one, size 1,
  // unless the parameter was split), and the ranges each part received.
  struct Joined {
    ParameterSplit split;  // size 1: not split
    std::vector<Tensor> parts;
    std::vector<std::vector<ShardRange>> ranges;
    Tensor step;  // a step count: the same in every shard
  };
  std::map<std::string, Joined> joined;
  const std::map<int, std::string> files = shard_files(dir);
  if (files.empty()) throw Error(cat(dir, ": no optimizer.rank<r>.safetensors (ZeRO-1 shards)"));
  for (const auto& [rank, path] : files) {
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
      Joined& j = joined[entry];
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
        throw Error(cat(path, ": entry '", name, "' does not fit parameter '", param, "' of ",
                        numel, " elements", s.size > 1 ? " in each tensor-parallel part" : ""));
      const size_t part = size_t(s.size > 1 ? s.rank : 0);
      Tensor& w = j.parts[part];
      if (!w.defined()) w = zeros({numel}, t.dtype());
      w.narrow(0, begin, end - begin).copy_(t.reshape({-1}));
      j.ranges[part].push_back({begin, end, path, name});
    }
  }
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

// ---- tensors ----

void write_checkpoint_part(const std::string& dir, int rank, const CheckpointPart& part) {
  if (!part.model.empty())
    write_safetensors(model_part_file(dir, part.model_part, part.model_parts), part.model,
                      {{"format", "pt"}});
  if (part.optimizer)
    write_safetensors(part.optimizer_sharded || part.optimizer_parts == 1
                          ? optimizer_file(dir, part.optimizer_sharded, rank)
                          : optimizer_part_file(dir, part.optimizer_part, part.optimizer_parts),
                      *part.optimizer, part.optimizer_metadata);
  if (part.stream_state) write_safetensors(stream_state_file(dir, rank), *part.stream_state);
}

namespace {

// The tensors of `whole`, or of its parts <stem>-0000k-of-0000n.safetensors
// merged; each file checked as the options ask, so an Error names the part
// that holds the tensor.
std::map<std::string, Tensor> read_merged(const std::string& dir, const std::string& whole,
                                          const char* stem, const char* what,
                                          std::string (*part_file)(const std::string&, int, int),
                                          const CheckpointReadOptions& options) {
  if (fs::exists(status_of(whole))) return read_tensors(whole, options);
  int parts = 0;
  const std::string pattern = cat(stem, "-%5d-of-%5d.safetensors");
  checked_fs(dir, [&] {
    for (const auto& e : fs::directory_iterator(dir)) {
      int k = 0, n = 0;
      if (std::sscanf(e.path().filename().c_str(), pattern.c_str(), &k, &n) == 2)
        parts = std::max(parts, n);
    }
  });
  if (parts == 0)
    throw Error(cat(whole, ": no ", what, " file in the checkpoint; use an earlier one"));
  std::map<std::string, Tensor> merged;
  for (int part = 0; part < parts; ++part) {
    const std::string path = part_file(dir, part, parts);
    if (!fs::exists(status_of(path)))
      throw Error(cat(path, ": missing part of the ", what, "; use an earlier checkpoint"));
    for (auto& [name, tensor] : read_tensors(path, options))
      if (!merged.emplace(name, tensor).second)
        throw Error(cat(path, ": tensor '", name, "' is also in another part of the ", what));
  }
  return merged;
}

}  // namespace

std::map<std::string, Tensor> read_model(const std::string& dir,
                                         const CheckpointReadOptions& options) {
  return read_merged(dir, model_file(dir), "model", "model", model_part_file, options);
}

std::vector<NamedTensor> read_optimizer(const std::string& dir, bool sharded, int rank,
                                        const CheckpointReadOptions& options) {
  std::map<std::string, Tensor> tensors;
  if (sharded) {
    const std::map<int, std::string> files = shard_files(dir);
    auto mine = files.find(rank);
    if (mine == files.end())
      throw Error(cat(optimizer_file(dir, true, rank), ": missing: rank ", rank,
                      "'s ZeRO-1 shard of the optimizer state; use an earlier checkpoint"));
    tensors = read_tensors(mine->second, options);
  } else {
    tensors = read_merged(dir, optimizer_file(dir, false, rank), "optimizer", "optimizer state",
                          optimizer_part_file, options);
  }
  std::vector<NamedTensor> state;
  for (const auto& [name, tensor] : tensors) state.push_back({name, tensor});
  return state;
}

std::map<std::string, Tensor> read_stream_state(const std::string& dir, int rank) {
  return read_safetensors(stream_state_file(dir, rank)).tensors;
}

}  // namespace trainer
