// Checkpoints (trainer/checkpoint.h): the directory of step_<n>/ folders
// (committed atomically, pruned to keep_last), the files of one checkpoint,
// and reading their tensors back (the trainer state: checkpoint_state.cpp;
// ZeRO-1 shards joined whole: checkpoint_optimizer.cpp).
#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "core/check.h"
#include "data/files.h"
#include "trainer/checkpoint_parts.h"
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

}  // namespace

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

std::string CheckpointDir::begin(int64_t step) {
  writing_step_ = step;
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
  write_checkpoint_index(tmp.string());
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

std::optional<std::string> CheckpointDir::pointer_in(const std::string& root,
                                                     const std::string& pointer) {
  fs::path p = fs::path(root) / pointer;
  if (!fs::is_regular_file(status_of(p))) return std::nullopt;
  std::string name = read_file(p.string(), "the checkpoint pointer");
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (parse_step(name) < 0) return std::nullopt;
  std::string dir = (fs::path(root) / name).string();
  return is_complete(dir) ? std::optional<std::string>(dir) : std::nullopt;
}

std::vector<std::string> CheckpointDir::complete_in(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> found;
  checked_fs(root, [&] {
    for (const auto& e : fs::directory_iterator(root)) {
      int64_t s = parse_step(e.path().filename().string());
      if (s >= 0 && is_complete(e.path().string())) found.emplace_back(s, e.path().string());
    }
  });
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, d] : found) out.push_back(d);
  return out;
}

std::optional<std::string> CheckpointDir::latest_in(const std::string& root) {
  if (auto p = pointer_in(root, "latest")) return p;
  std::vector<std::string> all = complete_in(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

void CheckpointDir::prune() {
  std::vector<std::string> all = complete();
  std::optional<std::string> best = pointer_in(root_, "best");
  std::optional<std::string> latest = pointer_in(root_, "latest");
  // Keep the newest keep_last, plus best and latest wherever they are. The
  // others are renamed out of the way at once (no longer step directories)
  // and deleted in the background: deleting a large checkpoint takes a
  // good part of a second that the step would otherwise wait.
  checked_fs(root_, [&] {
    for (int64_t i = 0; i + keep_last_ < int64_t(all.size()); ++i) {
      if ((best && *best == all[i]) || (latest && *latest == all[i])) continue;
      const fs::path trash = all[i] + ".pruned";
      if (fs::exists(trash)) fs::remove_all(trash);
      fs::rename(all[i], trash);
    }
  });
  // Stale temporaries of other steps (a crash mid-write) and what a run
  // stopped while deleting left go too; not the one being written.
  const int64_t writing = writing_step_;
  const std::string being_written = writing >= 0 ? step_name(writing) + ".tmp" : "";
  std::vector<fs::path> doomed;
  checked_fs(root_, [&] {
    for (const auto& e : fs::directory_iterator(root_)) {
      const std::string n = e.path().filename().string();
      if (n == being_written) continue;
      if (e.is_directory() && (n.ends_with(".tmp") || n.ends_with(".pruned")))
        doomed.push_back(e.path());
    }
  });
  if (pruner_.joinable()) pruner_.join();
  pruner_ = std::thread([doomed = std::move(doomed)] {
    for (const fs::path& d : doomed) {
      std::error_code ignored;  // gone already, or not ours to delete: nothing depends on it
      fs::remove_all(d, ignored);
    }
  });
}

CheckpointDir::~CheckpointDir() {
  if (pruner_.joinable()) pruner_.join();
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

// ---- non-finite values ----

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

namespace {

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

// ---- tensors ----

void write_checkpoint_part(const std::string& dir, int rank, const CheckpointPart& part) {
  if (!part.model.empty()) write_pieces(pieces_file(dir, "model", rank), part.model);
  if (!part.optimizer.empty()) write_pieces(pieces_file(dir, "optimizer", rank), part.optimizer);
  if (part.stream_state) write_safetensors(stream_state_file(dir, rank), *part.stream_state);
  if (part.trainer_state) write_trainer_state(dir, *part.trainer_state);
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
  if (has_pieces(dir, "model")) return read_pieces(dir, "model", options);
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