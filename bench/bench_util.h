// Shared by the training benchmarks (bench_train, bench_dp): an image-model
// case on synthetic data, its model and SGD-with-momentum optimizer, and
// the median of step timings. Inline only: every bench/*.cpp is its own
// executable.
#pragma once

#include <sched.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "comm/communicator.h"
#include "core/cpu/threads.h"
#include "models/registry.h"
#include "optim/optimizer.h"

namespace trainer::bench {

// An image classifier on synthetic [batch, channels, size, size] inputs.
struct ImageCase {
  const char* name;
  const char* model;
  int64_t batch, size, channels, classes;
};

inline std::shared_ptr<Module> make_case_model(const ImageCase& c, ModelOptions o = {}) {
  o.num_classes = c.classes;
  o.in_channels = c.channels;
  o.image_size = c.size;
  return make_model(c.model, o);
}

// The benchmarks' optimizer: SGD, lr 0.01, momentum 0.9, weight decay 1e-4.
inline const optim::SGDOptions kBenchSgd{0.01, 0.9, 0, false, 1e-4};

// kBenchSgd over every parameter of model.
inline optim::SGD make_sgd(const Module& model) {
  return optim::SGD({optim::ParamGroup{model.named_parameters()}}, kBenchSgd);
}

// In a benchmark's forked child: runs this process on the r-th core it may use.
inline void bind_to_core(int r) {
  const std::vector<int> cores = allowed_cores();
  if (cores.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cores[size_t(r) % cores.size()], &set);
  sched_setaffinity(0, sizeof set, &set);
}

// Joins forked child r to its siblings as rank r of a world of `size`, over
// a store on port of this host (torchrun-style, as `trainer launch` would
// start them); the job token names the benchmark.
inline std::shared_ptr<comm::Communicator> join_bench_world(int r, int size, int port,
                                                            const char* token) {
  comm::Bootstrap boot;
  boot.launcher = comm::Launcher::torchrun;
  boot.rank = r;
  boot.world_size = size;
  boot.local_rank = r;
  boot.local_world_size = size;
  boot.master_port = port;
  boot.job_token = token;
  boot.log_level = comm::LogLevel::warn;
  return comm::init_world(boot);
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Rounds of a measurement (or their ratios): the median (the mean of the
// middle two for an even count) and the range. values: not empty.
struct Spread {
  double median = 0, low = 0, high = 0;
};

inline Spread spread_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return {0.5 * (values[(n - 1) / 2] + values[n / 2]), values.front(), values.back()};
}

// "1.42 (1.31-1.55)": the median of several rounds' values in format, then
// suffix, and their range; one round's alone as "1.42", none as "-".
inline std::string spread_text(const std::vector<double>& values, const char* format = "%.2f",
                               const char* suffix = "") {
  if (values.empty()) return "-";
  const Spread r = spread_of(values);
  char m[32], low[32], high[32];
  std::snprintf(m, sizeof m, format, r.median);
  std::string text = std::string(m) + suffix;
  if (values.size() == 1) return text;
  std::snprintf(low, sizeof low, format, r.low);
  std::snprintf(high, sizeof high, format, r.high);
  return text + " (" + low + "-" + high + ")";
}

// Rounds' ratios as "1.42x (1.31-1.55)".
inline std::string ratio_text(const std::vector<double>& ratios) {
  return spread_text(ratios, "%.2f", "x");
}

// Median seconds of step() over `steps` timed runs after `warmup` untimed ones.
inline double median_step_seconds(int steps, const std::function<void()>& step, int warmup = 2) {
  std::vector<double> times;
  for (int i = 0; i < warmup + steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= warmup) times.push_back(dt);
  }
  return median(times);
}

// Waits for every forked rank; true when each exited with status 0.
inline bool reap_ranks(const std::vector<pid_t>& pids) {
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

// An option's integer value: argv[i + 1] into v (i moves past it); false
// when there is none or it is below least.
template <class T>
bool next_number(int argc, char** argv, int& i, T& v, int64_t least) {
  if (i + 1 >= argc) return false;
  const long long n = std::atoll(argv[++i]);
  v = T(n);
  return n >= least;
}

// "a,b,c" -> its numbers; false on anything but positive integers.
inline bool parse_numbers(const char* text, std::vector<int64_t>& out) {
  out.clear();
  for (const char* p = text; *p;) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p || v <= 0 || (*end != ',' && *end != '\0')) return false;
    out.push_back(v);
    p = *end == ',' ? end + 1 : end;
  }
  return !out.empty();
}

}  // namespace trainer::bench
