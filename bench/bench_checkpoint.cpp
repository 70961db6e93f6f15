// What a checkpoint costs training: GPT (12 layers x 768 by default,
// context 64, AdamW) trained by `trainer launch` on 1, 2 and 4 ranks (ZeRO-1
// beyond one rank, so each rank writes its own shard), checkpointing every
// 2 steps, once with synchronous writes and once in the background
// (training.async_checkpoint). The figures are the trainer's own report per
// committed checkpoint ("the step waited X ms to write|copy Y MiB", rank
// 0's part): the time the step was blocked, and rank 0's bytes. The write
// bandwidth of a synchronous checkpoint (rank 0's bytes over its blocked
// time, which includes the fsync and the commit) is set against a plain
// sequential write of as many bytes with one fsync to the same directory
// (what `dd conv=fsync` measures).
//
//   bench_checkpoint                         # 1, 2 and 4 ranks
//   bench_checkpoint --ranks 2 --layers 4    # smaller
//   bench_checkpoint --width 384 --keep      # keep the runs' logs
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "bench/programs.h"
#include "core/cpu/isa.h"

using namespace trainer;
namespace fs = std::filesystem;

namespace {

struct Settings {
  std::vector<int> ranks{1, 2, 4};
  int layers = 12, width = 768;
  bool keep = false;
};

// The checkpoints one run committed: blocked ms and MiB of rank 0's part.
struct Report {
  std::vector<double> blocked_ms, mib;
  bool ok = false;
};

Report run_case(const Settings& s, int ranks, bool async, const std::string& work) {
  const std::string out = work + "/run_" + std::to_string(ranks) + (async ? "_async" : "_sync");
  const std::string log = out + ".log";
  std::vector<std::string> argv{
      bench::self_dir() + "/trainer",
      "launch",
      "--nproc-per-node",
      std::to_string(ranks),
      "--",
      "train",
      std::string(TRAINER_SOURCE_DIR) + "/recipes/gpt_kjv.yaml",
      "data.path=" + std::string(TRAINER_SOURCE_DIR) + "/datasets/kjv.txt",
      "output_dir=" + out,
      "model.n_layer=" + std::to_string(s.layers),
      "model.d_model=" + std::to_string(s.width),
      "model.n_head=" + std::to_string(std::max(1, s.width / 64)),
      "model.context=64",
      "data.seq_len=64",
      "data.val_windows=4",
      "training.global_batch=" + std::to_string(ranks),
      "training.steps=6",
      "training.checkpoint_every=2",
      "training.eval_every=0",
      "training.log_every=1",
      "training.threads=1",
      "training.keep_last=2",
      std::string("parallel.zero1=") + (ranks > 1 ? "true" : "false"),
      std::string("training.async_checkpoint=") + (async ? "true" : "false")};
  Report r;
  r.ok = bench::run_logged(argv, log);
  if (!r.ok) {
    std::printf("  %d ranks %s: failed:\n%s", ranks, async ? "async" : "sync",
                bench::tail_of(log, 8).c_str());
    return r;
  }
  const std::regex line("checkpoint: .*the step waited ([0-9.]+) ms to (write|copy) ([0-9.]+) MiB");
  std::ifstream f(log);
  for (std::string l; std::getline(f, l);) {
    std::smatch m;
    if (!std::regex_search(l, m, line)) continue;
    r.blocked_ms.push_back(std::stod(m[1].str()));
    r.mib.push_back(std::stod(m[3].str()));
  }
  if (!s.keep) fs::remove_all(out);
  return r;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// MB/s of one sequential write of `mib` MiB and an fsync, in dir.
double plain_write_mibps(const std::string& dir, double mib) {
  const std::string path = dir + "/plain_write.bin";
  std::vector<char> block(size_t(1) << 20, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return 0;
  for (int64_t k = 0; k < int64_t(std::ceil(mib)); ++k)
    if (::write(fd, block.data(), block.size()) != ssize_t(block.size())) break;
  ::fsync(fd);
  ::close(fd);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fs::remove(path);
  return std::ceil(mib) / s;
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_checkpoint: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--ranks")
      s.ranks = {std::stoi(next())};
    else if (a == "--layers")
      s.layers = std::stoi(next());
    else if (a == "--width")
      s.width = std::stoi(next());
    else if (a == "--keep")
      s.keep = true;
    else {
      std::fprintf(stderr,
                   "usage: bench_checkpoint [--ranks N] [--layers L] [--width W] [--keep]\n");
      std::exit(2);
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings s = parse(argc, argv);
  const std::string work = "/tmp/bench_checkpoint_" + std::to_string(::getpid());
  fs::create_directories(work);
  std::printf("cpu %s\n", cpu::cpu_name(cpu::cpu_features()).c_str());
  std::printf(
      "GPT %d x %d, context 64, AdamW; checkpoint every 2 of 6 steps, one thread per rank; "
      "ZeRO-1 on 2+ ranks; figures of rank 0, median over the run's checkpoints\n",
      s.layers, s.width);
  std::printf("%-6s | %9s | %12s %12s | %8s | %11s %11s %6s\n", "ranks", "MiB/rank", "sync ms",
              "async ms", "async/", "sync MiB/s", "plain MiB/s", "ratio");
  std::printf("%-6s | %9s | %12s %12s | %8s | %11s %11s %6s\n", "", "", "(blocked)", "(blocked)",
              "sync", "per rank", "(+fsync)", "");
  for (int ranks : s.ranks) {
    const Report sync = run_case(s, ranks, false, work);
    const Report async = run_case(s, ranks, true, work);
    if (!sync.ok || !async.ok || sync.blocked_ms.empty() || async.blocked_ms.empty()) continue;
    const double mib = median(sync.mib), sync_ms = median(sync.blocked_ms),
                 async_ms = median(async.blocked_ms);
    const double ours = mib / (sync_ms / 1e3), plain = plain_write_mibps(work, mib);
    std::printf("%-6d | %9.1f | %12.1f %12.1f | %7.1f%% | %11.0f %11.0f %6.2f\n", ranks, mib,
                sync_ms, async_ms, 100 * async_ms / sync_ms, ours, plain, ours / plain);
  }
  if (!s.keep) fs::remove_all(work);
  return 0;
}
