// Training-step throughput and peak memory: forward, backward and an SGD
// (momentum) step on synthetic data, for the small CNN at batch 128,
// ResNet-18 at 64x64 and 224x224, and ResNet-50 at 224x224. Each case runs
// in its own child process so its peak resident memory is its own.
//
// When python3 can import torch, bench/bench_train_torch.py measures the
// same models (torchvision's ResNets, channels-last, same batch, same
// threads) in the same run and the table prints both sides and the ratio.
//
//   bench_train                       # all cases, 1 and 2 threads
//   bench_train --threads 2 --steps 5 --case resnet18_64
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/ops.h"
#include "models/registry.h"
#include "optim/optimizer.h"

using namespace trainer;

namespace {

struct Case {
  const char* name;
  const char* model;
  int64_t batch, size, channels, classes;
};

const Case kCases[] = {
    {"small_cnn_28", "small_cnn", 128, 28, 1, 10},
    {"resnet18_64", "resnet18", 32, 64, 3, 1000},
    {"resnet18_224", "resnet18", 16, 224, 3, 1000},
    {"resnet50_224", "resnet50", 16, 224, 3, 1000},
};

// Median seconds per step over `steps` timed steps after 2 warm-up steps.
double run_case(const Case& c, int steps) {
  ModelOptions o;
  o.num_classes = c.classes;
  o.in_channels = c.channels;
  o.image_size = c.size;
  auto model = make_model(c.model, o);
  optim::SGD sgd({optim::ParamGroup{model->named_parameters()}},
                 optim::SGDOptions{0.01, 0.9, 0, false, 1e-4});
  Generator gen(1);
  Tensor images = normal({c.batch, c.size, c.size, c.channels}, 0, 1, gen).permute({0, 3, 1, 2});
  Tensor labels = from_vector(std::vector<int64_t>(size_t(c.batch), 3));
  std::vector<double> times;
  for (int i = 0; i < steps + 2; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss = cross_entropy((*model)(images), labels);
    loss.backward();
    sgd.step();
    sgd.zero_grad();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 2) times.push_back(dt);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Result {
  double samples_per_second = 0;
  double peak_mib = 0;
  bool ok = false;
};

Result measure_in_child(const Case& c, int threads, int steps) {
  int fd[2];
  if (pipe(fd) != 0) return {};
  pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    set_num_threads(threads);
    double s = run_case(c, steps);
    double sps = double(c.batch) / s;
    if (write(fd[1], &sps, sizeof sps) != sizeof sps) _exit(1);
    _exit(0);
  }
  close(fd[1]);
  Result r;
  double sps = 0;
  r.ok = read(fd[0], &sps, sizeof sps) == sizeof sps;
  close(fd[0]);
  int status = 0;
  struct rusage usage {};
  wait4(pid, &status, 0, &usage);
  r.ok = r.ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  r.samples_per_second = sps;
  r.peak_mib = double(usage.ru_maxrss) / 1024.0;
  return r;
}

// Runs bench_train_torch.py for one case; empty result if torch is unavailable.
Result measure_torch(const Case& c, int threads, int steps) {
  std::string cmd = std::string("python3 ") + TRAINER_SOURCE_DIR +
                    "/bench/bench_train_torch.py --model " + c.model + " --batch " +
                    std::to_string(c.batch) + " --size " + std::to_string(c.size) + " --channels " +
                    std::to_string(c.channels) + " --classes " + std::to_string(c.classes) +
                    " --threads " + std::to_string(threads) + " --steps " + std::to_string(steps) +
                    " 2>/dev/null";
  Result r;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    r.ok = std::fscanf(p, "%lf %lf", &r.samples_per_second, &r.peak_mib) == 2;
    r.ok = pclose(p) == 0 && r.ok;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  int steps = 5;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc)
      threads = {std::atoi(argv[++i])};
    else if (a == "--steps" && i + 1 < argc)
      steps = std::atoi(argv[++i]);
    else if (a == "--case" && i + 1 < argc)
      only = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_train [--threads N] [--steps N] [--case NAME]\n");
      return 2;
    }
  }
  std::printf(
      "training step = forward + backward + SGD(momentum) step, synthetic data, median of %d "
      "steps\n",
      steps);
  std::printf("%-14s %5s %3s | %12s %9s | %12s %9s | %7s\n", "case", "batch", "thr", "ours samp/s",
              "peak MiB", "torch samp/s", "peak MiB", "ratio");
  for (const Case& c : kCases) {
    if (!only.empty() && only != c.name) continue;
    for (int t : threads) {
      Result ours = measure_in_child(c, t, steps);
      Result torch = measure_torch(c, t, steps);
      char torch_cols[64] = "           -         -";
      char ratio[16] = "      -";
      if (torch.ok) {
        std::snprintf(torch_cols, sizeof torch_cols, "%12.1f %9.0f", torch.samples_per_second,
                      torch.peak_mib);
        std::snprintf(ratio, sizeof ratio, "%6.2fx",
                      ours.samples_per_second / torch.samples_per_second);
      }
      std::printf("%-14s %5lld %3d | %12.1f %9.0f | %s | %s\n", c.name, (long long)c.batch, t,
                  ours.samples_per_second, ours.peak_mib, torch_cols, ratio);
      std::fflush(stdout);
    }
  }
  return 0;
}
