// Data-parallel scaling: training throughput at dp=1 against dp=2 with the
// same per-rank batch and one compute thread per rank, for the small CNN
// (Fashion-MNIST shape, 28x28x1, batch 128) and ResNet-18 at 64x64 (batch 32),
// synthetic data, SGD with momentum.
//
//   scaling efficiency = throughput(dp=2) / (2 x throughput(dp=1))
//   hidden fraction    = allreduce time overlapping backward / allreduce time
//   exposed            = time waiting in DataParallel::finish() / dp=2 step time
//   pair efficiency    = throughput of two independent dp=1 processes run at
//                        once / (2 x throughput(dp=1) alone): the limit that
//                        sharing the machine sets, whatever the communication
//   sync efficiency    = the same two processes joined by a barrier after
//                        every step and nothing else: what running in lock
//                        step costs (each step waits for the slower rank, and
//                        both hit memory-heavy phases at once); dp=2 against
//                        it is what the gradient communication itself costs
// (all from rank 0; hidden and exposed from the timeline's spans, parallel/trace.h).
// On a machine whose cores are all busy, efficiency also drops because the
// second rank's compute has no core of its own; "exposed" isolates what
// communication costs.
//
// The ranks are child processes of this one, joined through the comm layer
// with torchrun-style variables (as `trainer launch` would set them). When
// python3 can import torch, bench/bench_dp_torch.py measures PyTorch DDP
// (gloo backend) the same way and the table prints both.
//
//   bench_dp                                  # both models, overlap on
//   bench_dp --case resnet18_64 --steps 10 --no-overlap --trace /tmp/dp.json
//   bench_dp --low-priority-progress   # DataParallelOptions::low_priority_progress
//   bench_dp --cross-memory            # large allreduces by process_vm_readv
//   bench_dp --no-shared-buckets       # buckets in private memory, copied through staging
//   bench_dp --zero1 --no-torch        # ZeRO-1 (optimizer state sharded) instead of replicated SGD
//   bench_dp --rounds 5                # five alternated rounds, medians (default 3);
//                                      # ours/DDP = median of the per-round ratios (range)
//   bench_dp --batch 64                # per-rank batch for every case (default: the case's)
//   bench_dp --dp2-only                # one dp=2 run, its step's phases (for A/B runs)
//   bench_dp --no-bind                 # ranks free to run on any core
//
// Rank r (ours and PyTorch's alike) runs on the r-th core this process may
// use when there is one per rank, as `trainer launch` binds by default (--bind-to auto);
// --bind forces it, --no-bind leaves the ranks to the scheduler.
//   bench_dp --no-grad-destinations    # gradients copied into the buckets, not written there
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "comm/collectives.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "parallel/ddp.h"
#include "parallel/trace.h"
#include "parallel/zero.h"

using namespace trainer;
using namespace trainer::parallel;
using namespace trainer::bench;

namespace {

const ImageCase kCases[] = {
    {"small_cnn_28", "small_cnn", 128, 28, 1, 10},
    {"resnet18_64", "resnet18", 32, 64, 3, 1000},
};

struct Settings {
  int steps = 10;
  int warmup = 3;
  bool overlap = true;
  bool low_priority_progress = false;
  bool cross_memory = false;   // AllreduceOptions::cross_memory (shm direct path)
  bool shared_buckets = true;  // DataParallelOptions::shared_buckets, ZeroOptions::shared_buffers
  bool zero1 = false;          // ZeRO-1 over DataParallel's buckets (parallel/zero.h)
  bool grad_destinations = true;  // false: gradients are copied into the buckets, as before
  bool bind = allowed_cores().size() >= 2;  // child r on allowed core r (sched_setaffinity)
  bool barrier_only = false;                // joined ranks without DataParallel: a barrier per step
  size_t bucket_mb = 25;
  std::string trace;  // rank 0 of dp=2 writes the merged timeline here
};

// What a rank measures: seconds per step (median), and over the timed steps
// the allreduce time and the part of it inside backward spans.
struct RankResult {
  double step_seconds = 0;
  double comm_seconds = 0;
  double hidden_seconds = 0;
  double backward_seconds = 0;
  double finish_seconds = 0;  // waiting in DataParallel::finish(): communication not hidden
  double forward_seconds = 0, optimizer_seconds = 0;
};

RankResult run_rank(const ImageCase& c, const Settings& s,
                    std::shared_ptr<comm::Communicator> world) {
  std::shared_ptr<Module> model = make_case_model(c, {.dropout = 0});
  optim::SGD sgd = make_sgd(*model);
  const int rank = world ? world->rank() : 0;
  Timeline timeline(rank);
  std::unique_ptr<DataParallel> dp;
  // --zero1: the same SGD sharded over the ranks, each bucket reduce-scattered in backward.
  std::shared_ptr<ZeroOptimizer> zero;
  if (world && !s.barrier_only) {
    DataParallelOptions options;
    options.bucket_bytes = s.bucket_mb << 20;
    options.overlap = s.overlap;
    options.shared_buckets = s.shared_buckets;
    options.low_priority_progress = s.low_priority_progress;
    options.allreduce = {.op = comm::ReduceOp::avg, .cross_memory = s.cross_memory};
    options.timeline = &timeline;
    if (s.zero1) options.reduce = zero_bucket_reduce(&zero);
    dp = std::make_unique<DataParallel>(model, world, options);
    if (!s.grad_destinations)
      for (const Bucket& b : dp->buckets())
        for (const NamedTensor& p : b.params) p.tensor.set_grad_destination(Tensor());
    if (s.zero1) {
      zero = std::make_shared<ZeroOptimizer>(
          world, std::vector<optim::ParamGroup>{optim::ParamGroup{model->named_parameters()}},
          [](std::vector<optim::ParamGroup> groups) {
            return std::make_unique<optim::SGD>(std::move(groups), kBenchSgd);
          },
          [&] {
            ZeroOptions o;
            o.buckets = &dp->buckets();
            o.shared_buffers = s.shared_buckets;
            return o;
          }());
    }
  }
  Generator gen(uint64_t(rank) + 1);
  Tensor images = normal({c.batch, c.size, c.size, c.channels}, 0, 1, gen).permute({0, 3, 1, 2});
  std::vector<int64_t> y(size_t(c.batch));
  for (size_t i = 0; i < y.size(); ++i) y[i] = int64_t(i) % c.classes;
  Tensor labels = from_vector(y);

  std::vector<double> times;
  int64_t timed_from_us = 0;
  for (int i = 0; i < s.warmup + s.steps; ++i) {
    if (i == s.warmup) {
      if (world) comm::barrier(*world);
      timed_from_us = trace_now_us();
    }
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss;
    {
      TraceScope span(&timeline, "forward");
      loss = cross_entropy((*model)(images), labels);
    }
    {
      TraceScope span(&timeline, "backward");
      loss.backward();
    }
    if (dp) dp->finish();
    if (world && s.barrier_only) comm::barrier(*world);
    {
      TraceScope span(&timeline, "optimizer");
      zero ? zero->step() : sgd.step();
    }
    if (zero) zero->zero_grad();
    if (dp)
      dp->zero_grad();
    else
      sgd.zero_grad();
    if (i >= s.warmup)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  RankResult r;
  r.step_seconds = median(times);
  std::vector<TraceSpan> spans;
  for (const TraceSpan& sp : timeline.spans())
    if (sp.begin_us >= timed_from_us) spans.push_back(sp);
  auto is_comm = [](const TraceSpan& sp) { return sp.track == Track::comm; };
  auto named = [](const char* name) {
    return [name](const TraceSpan& sp) { return sp.name == std::string(name); };
  };
  // Seconds per timed step covered by the spans that pass `which`.
  const auto per_step = [&](const auto& which) {
    return double(covered_us(spans, which)) * 1e-6 / double(s.steps);
  };
  r.comm_seconds = per_step(is_comm);
  r.hidden_seconds = double(overlap_us(spans, is_comm, named("backward"))) * 1e-6 / double(s.steps);
  r.forward_seconds = per_step(named("forward"));
  r.backward_seconds = per_step(named("backward"));
  r.finish_seconds = per_step(named("dp finish"));
  r.optimizer_seconds = per_step(named("optimizer"));
  if (world && !s.trace.empty()) timeline.write_merged(*world, s.trace);
  return r;
}

// Runs `processes` copies of case c as child processes, joined as the ranks
// of one data-parallel world or (joined false) as independent dp=1 runs at
// the same time; every process's result, in rank order.
bool run_world(const ImageCase& c, const Settings& s, int processes, bool joined,
               std::vector<RankResult>& out) {
  int fd[2];
  if (pipe(fd) != 0) return false;
  const int port = 21000 + int(::getpid() % 20000);
  std::vector<pid_t> pids;
  for (int r = 0; r < processes; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      close(fd[0]);
      if (s.bind) bind_to_core(r);
      set_num_threads(1);
      std::shared_ptr<comm::Communicator> world;
      if (joined && processes > 1) world = join_bench_world(r, processes, port, "bench_dp");
      const std::pair<int, RankResult> res{r, run_rank(c, s, world)};
      if (write(fd[1], &res, sizeof res) != sizeof res) _exit(1);
      _exit(0);
    }
    pids.push_back(pid);
  }
  close(fd[1]);
  out.assign(size_t(processes), RankResult{});
  bool ok = true;
  for (int i = 0; i < processes && ok; ++i) {
    std::pair<int, RankResult> res;
    ok = read(fd[0], &res, sizeof res) == sizeof res && res.first >= 0 && res.first < processes;
    if (ok) out[size_t(res.first)] = res.second;
  }
  close(fd[0]);
  return reap_ranks(pids) && ok;
}

// bench_dp_torch.py's "efficiency hidden_fraction" for case c; false without torch.
bool measure_torch(const ImageCase& c, const Settings& s, double& efficiency, double& hidden) {
  std::string cmd =
      std::string("python3 ") + TRAINER_SOURCE_DIR + "/bench/bench_dp_torch.py" + " --model " +
      c.model + " --batch " + std::to_string(c.batch) + " --size " + std::to_string(c.size) +
      " --channels " + std::to_string(c.channels) + " --classes " + std::to_string(c.classes) +
      " --steps " + std::to_string(s.steps) + " --warmup " + std::to_string(s.warmup) +
      " --bucket-mb " + std::to_string(s.bucket_mb) + (s.bind ? " --bind" : "") + " 2>/dev/null";
  bool ok = false;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    ok = std::fscanf(p, "%lf %lf", &efficiency, &hidden) == 2;
    ok = pclose(p) == 0 && ok;
  }
  return ok;
}

// One round's figures for a case: dp=1 alone, dp=2, the independent pair and
// (when measured) PyTorch DDP, all within a minute of each other.
struct Round {
  double eff = 0, pair_eff = 0, sync_eff = 0, comm_ms = 0, hidden = 0, exposed = 0;
  double sps1 = 0, sps2 = 0, torch_eff = -1, torch_hidden = 0;
  // dp=1, dp=2, pair rank 0, pair rank 1, synchronised pair rank 0: step and
  // its phases (means over the timed steps)
  static constexpr int kRows = 5;
  double step_ms[kRows] = {}, bwd_ms[kRows] = {}, fwd_ms[kRows] = {}, finish_ms[kRows] = {},
         opt_ms[kRows] = {};
};

bool run_round(const ImageCase& c, const Settings& s, bool torch, Round& r) {
  std::vector<RankResult> ones, twos, pair, synced;
  Settings barrier = s;
  barrier.barrier_only = true;
  barrier.trace.clear();
  if (!run_world(c, s, 1, true, ones) || !run_world(c, s, 2, true, twos) ||
      !run_world(c, s, 2, false, pair) || !run_world(c, barrier, 2, true, synced))
    return false;
  const RankResult &one = ones[0], &two = twos[0];
  r.sps1 = double(c.batch) / one.step_seconds;
  r.sps2 = 2.0 * double(c.batch) / two.step_seconds;
  r.eff = r.sps2 / (2.0 * r.sps1);
  r.pair_eff = (double(c.batch) / pair[0].step_seconds + double(c.batch) / pair[1].step_seconds) /
               (2.0 * r.sps1);
  r.sync_eff = 2.0 * double(c.batch) / synced[0].step_seconds / (2.0 * r.sps1);
  r.comm_ms = 1e3 * two.comm_seconds;
  r.hidden = two.comm_seconds > 0 ? two.hidden_seconds / two.comm_seconds : 0.0;
  r.exposed = two.finish_seconds / two.step_seconds;
  const RankResult* all[Round::kRows] = {&one, &two, &pair[0], &pair[1], &synced[0]};
  for (int i = 0; i < Round::kRows; ++i) {
    r.step_ms[i] = 1e3 * all[i]->step_seconds;
    r.bwd_ms[i] = 1e3 * all[i]->backward_seconds;
    r.fwd_ms[i] = 1e3 * all[i]->forward_seconds;
    r.finish_ms[i] = 1e3 * all[i]->finish_seconds;
    r.opt_ms[i] = 1e3 * all[i]->optimizer_seconds;
  }
  if (torch && !measure_torch(c, s, r.torch_eff, r.torch_hidden)) r.torch_eff = -1;
  return true;
}

// `ours_vs_torch`: our efficiency / DDP's, of one round or over the rounds.
void print_row(const char* label, long long batch, const Round& r,
               const std::string& ours_vs_torch) {
  char torch_cols[48] = "         -       -";
  if (r.torch_eff >= 0)
    std::snprintf(torch_cols, sizeof torch_cols, "%9.1f%% %6.1f%%", 100 * r.torch_eff,
                  100 * r.torch_hidden);
  std::printf(
      "%-13s %5lld | %10.1f %10.1f | %8.1f%% %8.1f %8.1f %6.1f%% %7.1f%% | %8.1f%% %7.1f%% "
      "%8.1f%% %7.1f%% | %s | %s\n",
      label, batch, r.sps1, r.sps2, 100.0 * r.eff, r.comm_ms, r.bwd_ms[1], 100.0 * r.hidden,
      100.0 * r.exposed, 100.0 * r.pair_eff, 100.0 * r.eff / r.pair_eff, 100.0 * r.sync_eff,
      100.0 * r.eff / r.sync_eff, torch_cols, ours_vs_torch.c_str());
}

// Each field's median over the rounds (torch's over the rounds that measured it).
Round median_round(const std::vector<Round>& rounds) {
  auto med = [&](auto field) {
    std::vector<double> v;
    for (const Round& r : rounds)
      if (double x = field(r); x >= 0) v.push_back(x);
    return v.empty() ? -1.0 : median(v);
  };
  Round m;
  m.eff = med([](const Round& r) { return r.eff; });
  m.pair_eff = med([](const Round& r) { return r.pair_eff; });
  m.sync_eff = med([](const Round& r) { return r.sync_eff; });
  m.comm_ms = med([](const Round& r) { return r.comm_ms; });
  m.hidden = med([](const Round& r) { return r.hidden; });
  m.exposed = med([](const Round& r) { return r.exposed; });
  m.sps1 = med([](const Round& r) { return r.sps1; });
  m.sps2 = med([](const Round& r) { return r.sps2; });
  m.torch_eff = med([](const Round& r) { return r.torch_eff; });
  m.torch_hidden = med([](const Round& r) { return r.torch_eff >= 0 ? r.torch_hidden : -1.0; });
  for (int i = 0; i < Round::kRows; ++i) {
    m.step_ms[i] = med([i](const Round& r) { return r.step_ms[i]; });
    m.bwd_ms[i] = med([i](const Round& r) { return r.bwd_ms[i]; });
    m.fwd_ms[i] = med([i](const Round& r) { return r.fwd_ms[i]; });
    m.finish_ms[i] = med([i](const Round& r) { return r.finish_ms[i]; });
    m.opt_ms[i] = med([i](const Round& r) { return r.opt_ms[i]; });
  }
  return m;
}

// Only the dp=2 world, its rank 0's phases: for A/B runs of one setting
// against another, alternated by the caller. False when a rank failed.
bool measure_dp2_only(const ImageCase& c, const Settings& s) {
  std::vector<RankResult> twos;
  if (!run_world(c, s, 2, true, twos)) return false;
  const RankResult& t = twos[0];
  std::printf(
      "%-13s %5lld | dp=2 step %.1f ms: forward %.1f + backward %.1f + finish %.1f + "
      "optimizer %.1f; comm %.1f ms\n",
      c.name, (long long)c.batch, 1e3 * t.step_seconds, 1e3 * t.forward_seconds,
      1e3 * t.backward_seconds, 1e3 * t.finish_seconds, 1e3 * t.optimizer_seconds,
      1e3 * t.comm_seconds);
  std::fflush(stdout);
  return true;
}

// `rounds` rounds of case c, each row printed, then the medians and where a
// dp=2 step's time goes. Rounds alternate the measurements, so a slow spell
// of the machine touches each of them instead of one; the medians are the
// figures, and our efficiency / DDP's is the median of its per-round values,
// with their range. False when a rank failed.
bool measure_case(const ImageCase& c, const Settings& s, bool torch, int rounds) {
  std::vector<Round> all;
  std::vector<double> ratios;  // our efficiency / DDP's, per round that measured both
  for (int k = 0; k < rounds; ++k) {
    Round r;
    if (!run_round(c, s, torch, r)) return false;
    all.push_back(r);
    std::string ratio = "-";
    if (r.torch_eff > 0) {
      ratios.push_back(r.eff / r.torch_eff);
      ratio = bench::ratio_text({ratios.back()});
    }
    if (rounds > 1) print_row(cat("  round ", k + 1).c_str(), (long long)c.batch, r, ratio);
    std::fflush(stdout);
  }
  const Round m = rounds > 1 ? median_round(all) : all[0];
  print_row(c.name, (long long)c.batch, m, bench::ratio_text(ratios));
  // Where a dp=2 step's time goes, against the same code without communication.
  std::printf("  step ms%s: forward + backward + finish + optimizer (step: median step)\n",
              rounds > 1 ? ", medians" : "");
  const char* labels[Round::kRows] = {"dp=1", "dp=2", "pair 0", "pair 1", "sync 0"};
  for (int i = 0; i < Round::kRows; ++i)
    std::printf("    %-7s %6.1f + %6.1f + %5.1f + %5.1f (%6.1f)\n", labels[i], m.fwd_ms[i],
                m.bwd_ms[i], m.finish_ms[i], m.opt_ms[i], m.step_ms[i]);
  std::fflush(stdout);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string only;
  bool torch = true;
  int rounds = 3;
  int batch = 0;  // 0: each case's own
  bool dp2_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc)
      s.steps = std::atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc)
      s.warmup = std::atoi(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc)
      rounds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--case" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--batch" && i + 1 < argc)
      batch = std::atoi(argv[++i]);
    else if (a == "--bucket-mb" && i + 1 < argc)
      s.bucket_mb = size_t(std::atoi(argv[++i]));
    else if (a == "--trace" && i + 1 < argc)
      s.trace = argv[++i];
    else if (a == "--no-overlap")
      s.overlap = false;
    else if (a == "--low-priority-progress")
      s.low_priority_progress = true;
    else if (a == "--cross-memory")
      s.cross_memory = true;
    else if (a == "--no-grad-destinations")
      s.grad_destinations = false;
    else if (a == "--bind")
      s.bind = true;
    else if (a == "--no-bind")
      s.bind = false;
    else if (a == "--zero1")
      s.zero1 = true;
    else if (a == "--no-shared-buckets")
      s.shared_buckets = false;
    else if (a == "--no-torch")
      torch = false;
    else if (a == "--dp2-only")
      dp2_only = true;
    else {
      std::fprintf(
          stderr,
          "usage: bench_dp [--case NAME] [--steps N] [--warmup N] [--rounds N] "
          "[--batch N] [--bucket-mb N] [--bind|--no-bind] [--no-overlap] [--low-priority-progress] "
          "[--cross-memory] [--no-shared-buckets] [--no-grad-destinations] [--zero1] "
          "[--trace FILE] "
          "[--no-torch] [--dp2-only]\n");
      return 2;
    }
  }
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf(
      "dp=1 vs dp=2, 1 thread per rank%s, same per-rank batch, median of %d steps, %d round%s; "
      "overlap %s, buckets of %zu MB%s%s\n",
      s.bind ? " (rank r bound to core r)" : " (unbound)", s.steps, rounds, rounds == 1 ? "" : "s",
      s.overlap ? "on" : "off", s.bucket_mb,
      s.shared_buckets ? " (shared, reduced in place)" : " (private, copied through staging)",
      s.zero1 ? ", ZeRO-1" : "");
  // exposed = the step's wait in finish() (communication not hidden) over the dp=2 step time.
  // pair eff = two independent dp=1 processes at once over 2 x dp=1 alone: the
  // machine's own limit for two ranks; of pair = efficiency / pair eff. sync eff =
  // the pair joined by a barrier per step over 2 x dp=1 alone; of sync = efficiency / sync eff.
  if (!dp2_only)
    std::printf("%-13s %5s | %10s %10s | %9s %8s %8s %7s %8s | %9s %8s %9s %8s | %10s %7s | %s\n",
                "case", "batch", "dp1 samp/s", "dp2 samp/s", "efficiency", "comm ms", "bwd ms",
                "hidden", "exposed", "pair eff", "of pair", "sync eff", "of sync", "torch eff",
                "hidden", "ours/DDP (range)");
  for (ImageCase c : kCases) {
    if (!only.empty() && only != c.name) continue;
    if (batch > 0) c.batch = batch;
    if (!(dp2_only ? measure_dp2_only(c, s) : measure_case(c, s, torch, rounds))) {
      std::printf("%-13s: a rank failed\n", c.name);
      return 1;
    }
  }
  return 0;
}
