// What a checkpoint costs training, for two models trained by `trainer
// launch` on 1, 2 and 4 ranks (one thread each; ZeRO-1 beyond one rank, so
// each rank writes its own shard), checkpointing every 2 of 6 steps, once
// with synchronous writes and once in the background
// (training.async_checkpoint):
//
//   gpt       GPT, 12 layers x 768 by default, context 64, KJV characters
//             (vocabulary 73), one sequence per rank, AdamW
//   resnet50  ResNet-50, 1000 classes, SGD momentum, recipes/fmnist_cnn.yaml
//             with 4 images of 28 x 28 per rank. Fashion-MNIST has 10
//             classes and the trainer wants model.num_classes to equal the
//             dataset's, so the images are an ImageFolder written here: one
//             random grey image per class, read as 3 channels
//
// The figures are the trainer's own report per committed checkpoint ("the
// step waited X ms to write|copy Y MiB [and Z ms to commit]", rank 0's
// part): the time steps were blocked (a background write's copy plus its
// commit), and rank 0's bytes. The write bandwidth of a synchronous
// checkpoint (rank 0's bytes over its blocked time, which includes the fsync
// and the commit) is set against plain sequential writes of as many bytes
// of random bytes with one fsync to the same directory, one per rank at
// once, buffered and O_DIRECT (what as many `dd conv=fsync` and `dd
// oflag=direct` get side by side), the faster of the two's medians of 3.
//
// When python3 can import torch.distributed.checkpoint,
// bench/bench_checkpoint_torch.py checkpoints the same model and optimizer
// state with PyTorch DCP on as many gloo ranks (DDP beyond one): how long
// dcp.save blocks and how long dcp.async_save blocks before it returns its
// future (rank 0's medians of 3), set against our asynchronous checkpoint.
//
//   bench_checkpoint                                # both cases, 1, 2 and 4 ranks
//   bench_checkpoint --case resnet50 --ranks 2      # one case, one world size
//   bench_checkpoint --case gpt --ranks 2 --layers 4 --no-torch   # smaller, ours only
//   bench_checkpoint --width 384 --keep             # keep the runs' logs
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "bench/programs.h"
#include "core/check.h"
#include "core/cpu/isa.h"

using namespace trainer;
namespace fs = std::filesystem;

namespace {

struct Settings {
  std::vector<std::string> cases{"gpt", "resnet50"};
  std::vector<int> ranks{1, 2, 4};
  int layers = 12, width = 768;  // gpt
  bool keep = false, torch = true;
};

constexpr int kImageBatch = 4;         // resnet50's images per rank and step
constexpr int kClasses = 1000;         // resnet50's (ImageNet's) classes
constexpr int kImageSide = 28;         // Fashion-MNIST's
constexpr char kImages[] = "/images";  // resnet50's ImageFolder, under the work directory

// The checkpoints one run committed: blocked ms and MiB of rank 0's part.
struct Report {
  std::vector<double> blocked_ms, mib;
  bool ok = false;
};

// PyTorch DCP's figures (rank 0's medians) for one case and world size.
struct Dcp {
  double sync_ms = 0, async_ms = 0, mib = 0;
  bool ok = false;
  std::string note;  // the script's summary of its files, or why it failed
};

// The recipe and overrides that make a case's model, data and batch.
std::vector<std::string> case_args(const Settings& s, const std::string& name, int ranks,
                                   const std::string& work) {
  return bench::large_case_args({.name = name,
                                 .layers = s.layers,
                                 .width = s.width,
                                 .sequences = 1,
                                 .images = kImageBatch,
                                 .ranks = ranks,
                                 .images_dir = work + kImages});
}

Report run_case(const Settings& s, const std::string& name, int ranks, bool async,
                const std::string& work) {
  const std::string out = cat(work, "/run_", name, "_", ranks, async ? "_async" : "_sync");
  const std::string log = out + ".log";
  std::vector<std::string> argv{bench::self_dir() + "/trainer", "launch", "--nproc-per-node",
                                std::to_string(ranks),          "--",     "train"};
  for (std::string& a : case_args(s, name, ranks, work)) argv.push_back(std::move(a));
  for (std::string a :
       {"training.steps=6", "training.checkpoint_every=2", "training.eval_every=0",
        "training.log_every=1", "training.threads=1", "training.keep_last=2", "data.workers=1"})
    argv.push_back(a);
  argv.push_back("output_dir=" + out);
  argv.push_back(std::string("parallel.zero1=") + (ranks > 1 ? "true" : "false"));
  argv.push_back(std::string("training.async_checkpoint=") + (async ? "true" : "false"));
  Report r;
  r.ok = bench::run_logged(argv, log);
  if (!r.ok) {
    std::printf("  %s %d ranks %s: failed:\n%s", name.c_str(), ranks, async ? "async" : "sync",
                bench::tail_of(log, 8).c_str());
    return r;
  }
  // A background write's commit blocks the step that commits it, too.
  const std::regex line(
      "checkpoint: .*the step waited ([0-9.]+) ms to (write|copy) ([0-9.]+) MiB"
      "(?: and ([0-9.]+) ms to commit)?");
  std::ifstream f(log);
  for (std::string l; std::getline(f, l);) {
    std::smatch m;
    if (!std::regex_search(l, m, line)) continue;
    r.blocked_ms.push_back(std::stod(m[1].str()) + (m[4].matched ? std::stod(m[4].str()) : 0));
    r.mib.push_back(std::stod(m[3].str()));
  }
  if (!s.keep) fs::remove_all(out);
  return r;
}

bool torch_available() {
  return std::system("python3 -c 'import torch.distributed.checkpoint' >/dev/null 2>&1") == 0;
}

// bench_checkpoint_torch.py on the case's model; its stderr goes to a log in
// work, whose "files:" line becomes the note.
Dcp measure_dcp(const Settings& s, const std::string& name, int ranks, const std::string& work) {
  const std::string log = cat(work, "/dcp_", name, "_", ranks, ".log");
  std::string cmd = cat("python3 ", TRAINER_SOURCE_DIR, "/bench/bench_checkpoint_torch.py",
                        " --model ", name, " --ranks ", ranks, " --dir ", work);
  if (name == "gpt") cmd += cat(" --layers ", s.layers, " --width ", s.width);
  cmd += " 2>" + log;
  std::string last;
  std::fflush(nullptr);  // or the child's output may come before ours
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char l[512];
    while (std::fgets(l, sizeof l, p)) last = l;
    pclose(p);
  }
  Dcp d;
  d.ok = std::sscanf(last.c_str(), "%lf %lf %lf", &d.sync_ms, &d.async_ms, &d.mib) == 3;
  if (!d.ok) d.note = last.rfind("ERR ", 0) == 0 ? "failed: " + last.substr(4) : "failed";
  std::ifstream f(log);
  for (std::string l; d.ok && std::getline(f, l);)
    if (l.rfind("files: ", 0) == 0) d.note = l;
  while (!d.note.empty() && d.note.back() == '\n') d.note.pop_back();
  return d;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// MiB/s per writer of `writers` processes' worth of plain sequential
// writes (threads here), each of `mib` MiB and an fsync, in dir, at once
// (what as many `dd` get side by side, as the ranks write their parts side
// by side); the median of 3 trials, for the disk's speed varies from second
// to second. Buffered (`dd bs=1M conv=fsync`) or, with direct, O_DIRECT in
// 32 MiB blocks (`dd bs=32M oflag=direct conv=fsync`). The bytes are
// random, as a checkpoint's are near enough: this VM's disk writes zeros or
// a repeated block about 20% faster than random data. The trials' files are
// kept until all three are written, as a checkpoint is written while the
// previous ones are kept (training.keep_last): buffered bytes go to pages
// the page cache has to grow by, and where a first touch of memory is slow
// (a VM whose host reclaims the guest's idle memory) that, not the disk,
// sets the buffered speed.
double plain_write_mibps(const std::string& dir, double mib, int writers, bool direct) {
  const size_t block = size_t(direct ? 32 : 1) << 20;
  const size_t per_writer = size_t(std::ceil(mib)) << 20;  // whole MiB: every block 4 KiB-aligned
  const size_t words = per_writer * size_t(writers) / sizeof(uint64_t);
  std::unique_ptr<uint64_t, void (*)(void*)> random(
      static_cast<uint64_t*>(std::aligned_alloc(4096, words * sizeof(uint64_t))), std::free);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < words; ++i) {  // xorshift64
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    random.get()[i] = x;
  }
  auto path_of = [&](int trial, int w) { return cat(dir, "/plain_write", trial, "_", w, ".bin"); };
  auto write_one = [&](int trial, int w) {
    const std::string path = path_of(trial, w);
    const char* bytes = reinterpret_cast<const char*>(random.get()) + size_t(w) * per_writer;
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
    if (fd < 0) return;
    for (size_t done = 0; done < per_writer;) {
      const size_t n = std::min(block, per_writer - done);
      if (::write(fd, bytes + done, n) != ssize_t(n)) break;
      done += n;
    }
    ::fsync(fd);
    ::close(fd);
  };
  std::vector<double> trials;
  for (int trial = 0; trial < 3; ++trial) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int w = 0; w < writers; ++w) threads.emplace_back(write_one, trial, w);
    for (std::thread& t : threads) t.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    trials.push_back(double(per_writer >> 20) / s);
  }
  for (int trial = 0; trial < 3; ++trial)
    for (int w = 0; w < writers; ++w) fs::remove(path_of(trial, w));
  return median(trials);
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_checkpoint [--case gpt|resnet50] [--ranks N] [--layers L] "
               "[--width W] [--no-torch] [--keep]\n");
  std::exit(2);
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
    if (a == "--case") {
      s.cases = {next()};
      if (s.cases[0] != "gpt" && s.cases[0] != "resnet50") usage();
    } else if (a == "--ranks")
      s.ranks = {std::stoi(next())};
    else if (a == "--layers")
      s.layers = std::stoi(next());
    else if (a == "--width")
      s.width = std::stoi(next());
    else if (a == "--no-torch")
      s.torch = false;
    else if (a == "--keep")
      s.keep = true;
    else
      usage();
  }
  return s;
}

void print_header(const Settings& s, const std::string& name, const std::string& torch_state) {
  if (name == "gpt")
    std::printf("\ngpt: GPT %d x %d, context 64, vocabulary 73, one sequence per rank, AdamW\n",
                s.layers, s.width);
  else
    std::printf("\nresnet50: ResNet-50, %d classes, %d images of %d x %d per rank, SGD momentum\n",
                kClasses, kImageBatch, kImageSide, kImageSide);
  std::printf(
      "checkpoint every 2 of 6 steps, one thread per rank, ZeRO-1 on 2+ ranks; figures of "
      "rank 0, median over the run's checkpoints; DCP: %s\n",
      torch_state.c_str());
  std::printf("%-6s | %9s | %12s %12s | %8s | %11s %11s %6s | %9s %9s %9s\n", "ranks", "MiB/rank",
              "sync ms", "async ms", "async/", "sync MiB/s", "plain MiB/s", "ratio", "DCP sync",
              "DCP async", "async/");
  std::printf("%-6s | %9s | %12s %12s | %8s | %11s %11s %6s | %9s %9s %9s\n", "", "", "(blocked)",
              "(blocked)", "sync", "per rank", "(+fsync)", "", "ms", "ms", "DCP async");
}

// One row: our synchronous and asynchronous runs, DCP's when torch is there.
void run_row(const Settings& s, const std::string& name, int ranks, bool torch,
             const std::string& work) {
  const Report sync = run_case(s, name, ranks, false, work);
  const Report async = run_case(s, name, ranks, true, work);
  if (!sync.ok || !async.ok || sync.blocked_ms.empty() || async.blocked_ms.empty()) return;
  const double mib = median(sync.mib), sync_ms = median(sync.blocked_ms),
               async_ms = median(async.blocked_ms);
  // The disk's speed: the faster of plain buffered and O_DIRECT writes.
  const double buffered = plain_write_mibps(work, mib, ranks, false),
               direct = plain_write_mibps(work, mib, ranks, true);
  const double ours = mib / (sync_ms / 1e3), plain = std::max(buffered, direct);
  const Dcp dcp = torch ? measure_dcp(s, name, ranks, work) : Dcp{};
  char dcp_cols[64] = "        -         -         -";
  if (dcp.ok)
    std::snprintf(dcp_cols, sizeof dcp_cols, "%9.1f %9.1f %9.2f", dcp.sync_ms, dcp.async_ms,
                  async_ms / dcp.async_ms);
  std::printf("%-6d | %9.1f | %12.1f %12.1f | %7.1f%% | %11.0f %11.0f %6.2f | %s\n", ranks, mib,
              sync_ms, async_ms, 100 * async_ms / sync_ms, ours, plain, ours / plain, dcp_cols);
  std::printf("       plain writes %d rank%s: buffered %.0f MiB/s, O_DIRECT %.0f MiB/s per rank\n",
              ranks, ranks > 1 ? "s" : "", buffered, direct);
  if (torch)
    std::printf("       DCP %d rank%s: %s\n", ranks, ranks > 1 ? "s" : "", dcp.note.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Settings s = parse(argc, argv);
  const std::string work = "/tmp/bench_checkpoint_" + std::to_string(::getpid());
  fs::create_directories(work);
  const bool torch = s.torch && torch_available();
  const std::string torch_state =
      torch     ? "torch.distributed.checkpoint, gloo, DDP on 2+ ranks, medians of 3"
      : s.torch ? "skipped: python3 cannot import torch.distributed.checkpoint"
                : "off (--no-torch)";
  std::printf("cpu %s\n", cpu::cpu_name(cpu::cpu_features()).c_str());
  for (const std::string& name : s.cases) {
    if (name == "resnet50" && !fs::exists(work + kImages))
      bench::write_class_images(work + kImages, kClasses, kImageSide);
    print_header(s, name, torch_state);
    for (int ranks : s.ranks) run_row(s, name, ranks, torch, work);
  }
  if (!s.keep) fs::remove_all(work);
  return 0;
}
