// trainer plan --calibrate: p2p and allreduce between two ranks on this
// host, fitted as alpha-beta links and written as a cluster file.
#include "trainer/plan.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

#include <sys/wait.h>
#include <unistd.h>

#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "trainer/plan_parts.h"
#include "trainer/safetensors.h"

namespace trainer {

// ---- --calibrate: the links between two local ranks ----

namespace {

using Seconds = std::chrono::duration<double>;

// Message sizes of the fit: 256 B (the latency) to 16 MiB (a GPT layer's
// activations to a small model's whole gradient), by factors of 4.
constexpr size_t kCalibrateMinBytes = 256;
constexpr size_t kCalibrateMaxBytes = size_t(16) << 20;
constexpr int kCalibrateRounds = 3;

// About 32 MB moved per size and round, 4 to 1000 repetitions.
int calibrate_repeats(size_t bytes) {
  return int(std::clamp<size_t>((size_t(32) << 20) / bytes, 4, 1000));
}

// Mean seconds of fn() over the repetitions, the slower rank's, best of the rounds.
template <class Fn>
double timed(comm::Communicator& world, size_t bytes, Fn&& fn) {
  fn();
  double best = 1e300;
  for (int round = 0; round < kCalibrateRounds; ++round) {
    comm::barrier(world);
    const int repeats = calibrate_repeats(bytes);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < repeats; ++i) fn();
    double mean = Seconds(std::chrono::steady_clock::now() - start).count() / repeats;
    comm::allreduce(world, &mean, 1, DType::f64, {.op = comm::ReduceOp::max});
    best = std::min(best, mean);
  }
  return best;
}

// t = intercept + slope x bytes, by least squares on the relative error
// (every size counts alike, from the latency-bound to the bandwidth-bound).
std::pair<double, double> fit_alpha_beta(const std::vector<double>& bytes,
                                         const std::vector<double>& seconds) {
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const double w = 1.0 / (seconds[i] * seconds[i]);
    s00 += w, s01 += w * bytes[i], s11 += w * bytes[i] * bytes[i];
    r0 += w * seconds[i], r1 += w * seconds[i] * bytes[i];
  }
  const double det = s00 * s11 - s01 * s01;
  double slope = (s00 * r1 - s01 * r0) / det, intercept = (r0 * s11 - s01 * r1) / det;
  if (!(slope > 0)) slope = seconds.back() / bytes.back();
  return {std::max(intercept, 1e-7), slope};
}

// The link of a fitted line: per message alpha; Gb/s from the slope.
std::string link_yaml(const char* key, double alpha_seconds, double seconds_per_byte) {
  return cat(key, ":\n  alpha_us: ", plan_number(alpha_seconds * 1e6),
             "\n  gbps: ", plan_number(8e-9 / seconds_per_byte), "\n");
}

}  // namespace

// One rank of --calibrate (under `trainer launch --nproc-per-node 2`): p2p
// ping-pong and allreduce over sizes; rank 0 fits and writes the file.
int calibrate_rank(const PlanArgs& args) {
  auto world = comm::init_world(comm::detect_bootstrap());
  if (world->size() != 2) throw Error("trainer plan --calibrate measures 2 ranks");
  const int me = world->rank(), other = 1 - me;
  std::vector<double> sizes, p2p, allreduce;
  for (size_t bytes = kCalibrateMinBytes; bytes <= kCalibrateMaxBytes; bytes *= 4) {
    const int64_t count = int64_t(bytes / 4);
    Tensor mine = full({count}, double(me)), theirs = zeros({count});
    // One message each way per repetition: the one-way time is half.
    const double round_trip = timed(*world, bytes, [&] {
      for (int way = 0; way < 2; ++way) {
        if (way == me)
          world->send(mine, other, {.micro_batch = way}).wait();
        else
          world->recv(theirs, other, {.micro_batch = way}).wait();
      }
    });
    const double reduce = timed(*world, bytes, [&] { comm::allreduce(*world, mine); });
    sizes.push_back(double(bytes));
    p2p.push_back(round_trip / 2);
    allreduce.push_back(reduce);
  }
  if (me != 0) return 0;
  const auto [p2p_alpha, p2p_slope] = fit_alpha_beta(sizes, p2p);
  const auto [ar_intercept, ar_slope] = fit_alpha_beta(sizes, allreduce);
  // A ring over 2 ranks: 2 steps of alpha + (bytes / 2) / bandwidth.
  std::string text =
      cat("# trainer plan --calibrate: 2 ranks on this host, ", plan_number(sizes[0]), " B to ",
          plan_number(sizes.back()), " B\n# bytes  p2p_us  allreduce_us\n");
  for (size_t i = 0; i < sizes.size(); ++i)
    text += cat("#  ", plan_number(sizes[i]), "  ", plan_number(p2p[i] * 1e6), "  ",
                plan_number(allreduce[i] * 1e6), "\n");
  text += "device: cpu\n";
  text += link_yaml("intra", ar_intercept / 2, ar_slope);  // the collectives: tp, dp
  text += link_yaml("p2p", p2p_alpha, p2p_slope);          // pipeline messages
  if (!args.out.empty()) write_file_atomic(args.out, text);
  std::fputs(text.c_str(), stdout);
  if (!args.out.empty()) std::printf("written to %s\n", args.out.c_str());
  return 0;
}

// --calibrate: this binary again as 2 ranks of `trainer launch`.
int calibrate_command(const PlanArgs& args) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> argv{self, "launch", "--nproc-per-node", "2",
                                "--", "plan",   "--calibrate-rank"};
  if (!args.out.empty()) {
    argv.push_back("--out");
    argv.push_back(std::filesystem::absolute(args.out).string());
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> raw;
    for (const std::string& a : argv) raw.push_back(const_cast<char*>(a.c_str()));
    raw.push_back(nullptr);
    execv(raw[0], raw.data());
    _exit(127);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) < 0)
    throw Error("trainer plan --calibrate: cannot start the ranks");
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

}  // namespace trainer
