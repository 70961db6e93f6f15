#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/check.h"
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

void fsync_tree(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) fsync_path(e.path().string(), false);
  fsync_path(dir, true);
}

CheckpointDir::CheckpointDir(std::string root, int64_t keep_last)
    : root_(std::move(root)), keep_last_(keep_last) {
  CHECK_GE(keep_last_, 1) << "keep_last";
  std::error_code ec;
  fs::create_directories(root_, ec);
  if (ec) throw Error(cat("cannot create checkpoint directory ", root_, ": ", ec.message()));
}

std::string CheckpointDir::step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

bool CheckpointDir::is_complete(const std::string& dir) {
  return fs::is_directory(dir) && fs::is_regular_file(fs::path(dir) / "trainer_state.json");
}

std::string CheckpointDir::begin(int64_t step) const {
  fs::path tmp = fs::path(root_) / (step_name(step) + ".tmp");
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  return tmp.string();
}

std::string CheckpointDir::commit(int64_t step, bool is_best) {
  std::string name = step_name(step);
  fs::path tmp = fs::path(root_) / (name + ".tmp");
  fs::path final_dir = fs::path(root_) / name;
  CHECK(is_complete(tmp.string())) << "commit of " << tmp << " without a trainer_state.json";
  fsync_tree(tmp.string());
  // Re-saving a step (e.g. after a resume) replaces the old directory.
  if (fs::exists(final_dir)) fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);
  fsync_path(root_, true);
  if (is_best) write_file_atomic((fs::path(root_) / "best").string(), name + "\n");
  write_file_atomic((fs::path(root_) / "latest").string(), name + "\n");
  prune();
  return final_dir.string();
}

std::optional<std::string> CheckpointDir::read_pointer(const std::string& pointer) const {
  fs::path p = fs::path(root_) / pointer;
  if (!fs::is_regular_file(p)) return std::nullopt;
  std::string name = read_file(p.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (parse_step(name) < 0) return std::nullopt;
  std::string dir = (fs::path(root_) / name).string();
  return is_complete(dir) ? std::optional<std::string>(dir) : std::nullopt;
}

std::vector<std::string> CheckpointDir::complete() const {
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& e : fs::directory_iterator(root_)) {
    int64_t s = parse_step(e.path().filename().string());
    if (s >= 0 && is_complete(e.path().string())) found.emplace_back(s, e.path().string());
  }
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
}

}  // namespace trainer
