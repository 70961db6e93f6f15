// What sharded data parallelism saves and costs, for two models trained by
// `trainer launch` on 1, 2 and 4 ranks (one thread each), under each of
// parallel.shard: none, optimizer (ZeRO-1), gradients (ZeRO-2) and
// parameters (ZeRO-3):
//
//   gpt       GPT, 12 layers x 768 by default, context 64, KJV characters,
//             --sequences per rank, AdamW
//   resnet50  ResNet-50, 1000 classes, 4 images of 28 x 28 per rank, SGD
//             momentum (bench/programs.h large_case_args)
//
// Each run takes --warmup + --steps steps, logging every step; the figures
// are rank 0's, from its metrics.jsonl:
//
//   step ms       median interval between consecutive logged steps after
//                 the warm-up
//   peak MiB      the largest memory_peak_mib of a logged step: the CPU
//                 allocator's peak of tensors plus the regions shared with
//                 the host's other ranks (the buckets of plain data
//                 parallelism), over the training steps (the checkpoint
//                 written after them is left out)
//   resident MiB  resident_peak_mib at the last step: the process's VmHWM
//                 (binary, libraries, data, caches)
//   comm MiB      median comm_mib of the logged steps after the warm-up:
//                 what rank 0's collectives moved per step, counted by the
//                 trainer (comm/traffic.h) in nccl-tests' bus bytes. For
//                 parameter bytes W on N ranks, expect about 2 (N - 1) / N x W
//                 for none, ZeRO-1 and ZeRO-2 (an allreduce, or a
//                 reduce-scatter and an all-gather) and 3 (N - 1) / N x W for
//                 ZeRO-3 (its blocks are gathered for forward and again for
//                 backward), plus the loss's and the norms' small allreduces;
//                 0 on one rank
//
// When python3 can import torch.distributed.fsdp, bench/bench_fsdp_torch.py
// trains the same model shapes on as many gloo ranks under DDP (against
// none), FSDP2 fully_shard with reshard_after_forward=False (against
// gradients) and True (against parameters), printing its median step time,
// peak (VmHWM) and steady resident MiB; the table sets ours against it.
// PyTorch has no ZeRO-1 of its own here, so that row has no torch column.
// FSDP2's gloo backend sends a whole allreduce for each reduce-scatter.
//
//   bench_fsdp                                   # both cases, 1, 2 and 4 ranks
//   bench_fsdp --case gpt --ranks 2 --layers 4   # smaller
//   bench_fsdp --no-torch --keep                 # ours only; keep the runs' logs
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
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
  int layers = 12, width = 768, sequences = 2;  // gpt
  int steps = 4, warmup = 2;
  bool keep = false, torch = true;
};

const char* const kModes[] = {"none", "optimizer", "gradients", "parameters"};
constexpr char kImages[] = "/images";

struct Ours {
  double step_ms = 0, peak_mib = 0, resident_mib = 0;
  double comm_mib = -1;  // negative: not logged
  bool ok = false;
};

struct Torch {
  double step_ms = 0, peak_mib = 0, steady_mib = 0;
  bool ok = false;
  std::string why;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Ours run_ours(const Settings& s, const std::string& name, int ranks, const std::string& mode,
              const std::string& work) {
  const std::string out = cat(work, "/run_", name, "_", ranks, "_", mode);
  std::vector<std::string> argv{bench::self_dir() + "/trainer", "launch", "--nproc-per-node",
                                std::to_string(ranks),          "--",     "train"};
  for (std::string& a : bench::large_case_args({.name = name,
                        .layers = s.layers,
                        .width = s.width,
                        .sequences = s.sequences,
                        .ranks = ranks,
                        .images_dir = work + kImages}))
    argv.push_back(std::move(a));
  for (const std::string& a :
       {cat("training.steps=", s.warmup + s.steps), std::string("training.eval_every=0"),
        std::string("training.log_every=1"), std::string("training.threads=1"),
        std::string("data.workers=1"), "output_dir=" + out, "parallel.shard=" + mode})
    argv.push_back(a);
  Ours r;
  if (!bench::run_logged(argv, out + ".log")) {
    std::printf("  %s %d ranks %s: failed:\n%s", name.c_str(), ranks, mode.c_str(),
                bench::tail_of(out + ".log", 8).c_str());
    return r;
  }
  std::ifstream f(out + "/metrics.jsonl");
  std::vector<double> times, comm;
  for (std::string line; std::getline(f, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("split", "") != "train") continue;
    times.push_back(j.at("time").get<double>());
    r.peak_mib = std::max(r.peak_mib, j.at("memory_peak_mib").get<double>());
    r.resident_mib = j.at("resident_peak_mib").get<double>();
    // Logged by runs of more than one process only.
    if (times.size() > size_t(s.warmup) && j.contains("comm_mib"))
      comm.push_back(j.at("comm_mib").get<double>());
  }
  std::vector<double> periods;
  for (size_t k = size_t(s.warmup); k < times.size(); ++k)
    periods.push_back((times[k] - times[k - 1]) * 1e3);
  r.step_ms = median(periods);
  r.comm_mib = ranks == 1 ? 0 : comm.empty() ? -1 : median(comm);
  r.ok = !periods.empty();
  if (!s.keep) fs::remove_all(out);
  return r;
}

bool torch_available() {
  return std::system("python3 -c 'import torch.distributed.fsdp' >/dev/null 2>&1") == 0;
}

Torch run_torch(const Settings& s, const std::string& name, int ranks, const std::string& mode,
                const std::string& work) {
  const std::map<std::string, std::string> peer{
      {"none", "ddp"}, {"gradients", "zero2"}, {"parameters", "zero3"}};
  Torch t;
  if (!peer.count(mode)) return t;
  const std::string log = cat(work, "/torch_", name, "_", ranks, "_", mode, ".log");
  std::string cmd =
      cat("python3 ", TRAINER_SOURCE_DIR, "/bench/bench_fsdp_torch.py --model ", name, " --ranks ",
          ranks, " --mode ", peer.at(mode), " --steps ", s.steps, " --warmup ", s.warmup);
  if (name == "gpt")
    cmd += cat(" --layers ", s.layers, " --width ", s.width, " --batch ", s.sequences);
  cmd += " 2>" + log;
  std::string last;
  std::fflush(nullptr);
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char l[512];
    while (std::fgets(l, sizeof l, p)) last = l;
    pclose(p);
  }
  double state = 0;
  t.ok = std::sscanf(last.c_str(), "%lf %lf %lf %lf", &t.step_ms, &t.peak_mib, &t.steady_mib,
                     &state) == 4;
  if (!t.ok) t.why = last.rfind("ERR ", 0) == 0 ? last.substr(4) : "failed (" + log + ")";
  return t;
}

// Parameter MiB of a case: the trainer's dry run prints them.
double weights_mib(const Settings& s, const std::string& name, const std::string& work) {
  std::vector<std::string> argv{bench::self_dir() + "/trainer", "train"};
  for (std::string& a : bench::large_case_args({.name = name,
                        .layers = s.layers,
                        .width = s.width,
                        .sequences = s.sequences,
                        .images_dir = work + kImages}))
    argv.push_back(std::move(a));
  argv.push_back("--dry-run");
  const std::string log = work + "/dry_run.log";
  if (!bench::run_logged(argv, log)) return 0;
  std::ifstream f(log);
  for (std::string line; std::getline(f, line);) {
    const size_t at = line.find("memory estimate: parameters ");
    if (at != std::string::npos) return std::atof(line.c_str() + at + 28);
  }
  return 0;
}

void print_header(const Settings& s, const std::string& name, double weights,
                  const std::string& torch_state) {
  if (name == "gpt")
    std::printf(
        "\ngpt: GPT %d x %d, context 64, %d sequences per rank, AdamW; %.1f MiB of "
        "parameters\n",
        s.layers, s.width, s.sequences, weights);
  else
    std::printf(
        "\nresnet50: ResNet-50, 1000 classes, 4 images of 28 x 28 per rank, SGD momentum; "
        "%.1f MiB of parameters\n",
        weights);
  std::printf("rank 0's figures, %d steps after %d of warm-up, one thread per rank; torch: %s\n",
              s.steps, s.warmup, torch_state.c_str());
  std::printf("%-5s %-10s | %9s %9s %9s %8s | %9s %9s %9s | %9s %9s\n", "ranks", "shard", "step ms",
              "peak MiB", "resid MiB", "comm MiB", "torch ms", "peak MiB", "steady", "ms ratio",
              "peak ratio");
}

void run_row(const Settings& s, const std::string& name, int ranks, const std::string& mode,
             bool torch, const std::string& work) {
  const Ours ours = run_ours(s, name, ranks, mode, work);
  if (!ours.ok) return;
  const Torch t = torch ? run_torch(s, name, ranks, mode, work) : Torch{};
  char peer[96] = "        -         -         - |         -         -";
  if (t.ok)
    std::snprintf(peer, sizeof peer, "%9.1f %9.1f %9.1f | %9.2f %9.2f", t.step_ms, t.peak_mib,
                  t.steady_mib, t.step_ms / ours.step_ms, t.peak_mib / ours.resident_mib);
  char comm[16] = "       -";
  if (ours.comm_mib >= 0) std::snprintf(comm, sizeof comm, "%8.1f", ours.comm_mib);
  std::printf("%-5d %-10s | %9.1f %9.1f %9.1f %s | %s\n", ranks, mode.c_str(), ours.step_ms,
              ours.peak_mib, ours.resident_mib, comm, peer);
  if (torch && !t.ok && !t.why.empty()) std::printf("      torch: %s\n", t.why.c_str());
  std::fflush(stdout);
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: bench_fsdp [--case gpt|resnet50] [--ranks N] [--layers L] [--width W] "
               "[--sequences S] [--steps N] [--warmup N] [--no-torch] [--keep]\n");
  std::exit(2);
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int {
      if (i + 1 >= argc) usage();
      return std::atoi(argv[++i]);
    };
    if (a == "--case" && i + 1 < argc) {
      s.cases = {argv[++i]};
      if (s.cases[0] != "gpt" && s.cases[0] != "resnet50") usage();
    } else if (a == "--ranks") {
      s.ranks = {next()};
    } else if (a == "--layers") {
      s.layers = next();
    } else if (a == "--width") {
      s.width = next();
    } else if (a == "--sequences") {
      s.sequences = next();
    } else if (a == "--steps") {
      s.steps = next();
    } else if (a == "--warmup") {
      s.warmup = next();
    } else if (a == "--no-torch") {
      s.torch = false;
    } else if (a == "--keep") {
      s.keep = true;
    } else {
      usage();
    }
  }
  if (s.steps < 1 || s.warmup < 1 || s.ranks[0] < 1 || s.layers < 1 || s.width < 64) usage();
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings s = parse(argc, argv);
  const std::string work = "/tmp/bench_fsdp_" + std::to_string(::getpid());
  fs::create_directories(work);
  const bool torch = s.torch && torch_available();
  const std::string torch_state = torch ? "DDP / FSDP2 fully_shard on gloo"
                                  : s.torch
                                      ? "skipped: python3 cannot import torch.distributed.fsdp"
                                      : "off (--no-torch)";
  std::printf("cpu %s\n", cpu::cpu_name(cpu::cpu_features()).c_str());
  for (const std::string& name : s.cases) {
    if (name == "resnet50" && !fs::exists(work + kImages))
      bench::write_class_images(work + kImages, 1000, 28);
    const double weights = weights_mib(s, name, work);
    print_header(s, name, weights, torch_state);
    for (int ranks : s.ranks)
      for (const char* mode : kModes) run_row(s, name, ranks, mode, torch, work);
  }
  if (!s.keep) fs::remove_all(work);
  return 0;
}
