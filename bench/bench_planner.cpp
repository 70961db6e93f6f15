// The cluster planner at scale (parallel/planner.h): for GPT models of 1.3B
// to 1T parameters on A100 and H100 clusters of 32 to 3072 GPUs, the plan it
// chooses, the predicted throughput and model FLOP utilisation, the terms of
// the predicted step time, the memory per GPU, and how long planning took.
// Then one point against a published figure: Megatron-LM's 175B on 1024
// A100s (Narayanan et al. 2021, Table 1: 140 TFLOP/s per GPU, 45% of peak,
// counting the recomputed forward), with the planner's prediction for the
// same layout and for its own choice.
//
//
// --local checks the planner against measurements on this machine instead:
// for a GPT (recipes/gpt_kjv.yaml, 4 layers, d_model 256, context 128) and
// ResNet-18 (the 3x3 stem, 28x28x1 images of random pixels in
// Fashion-MNIST files), `trainer plan --device cpu --format tsv` predicts
// every layout of 2 ranks from block times profiled here; then each
// configuration below runs under `trainer launch --nproc-per-node 2 -- train
// ... training.threads=1 --trace`, and its median step (the interval between
// consecutive optimizer steps' ends, the later rank's, after the warm-up) is
// printed beside the prediction, with the error of each, the Spearman rank
// correlation, the median absolute error, and whether the planner's first
// choice among the configurations is within 10% of the fastest measured.
//
//   bench_planner                     # every model, cluster and device
//   bench_planner --quick             # 1.3B and 175B on A100 only
//   bench_planner --local             # 14 configurations of 2 CPU ranks
//   bench_planner --local --quick     # 3 GPT configurations, 1 step each
//   bench_planner --local --keep      # leave the runs, logs and traces, print where
//
// The trainer binary is the one next to this executable (build both targets).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/programs.h"
#include "core/check.h"
#include "core/cpu/isa.h"
#include "parallel/planner.h"

using namespace trainer;
using namespace trainer::parallel;

namespace {

struct GptCase {
  const char* name;
  GptShape shape;
  int64_t global_batch;  // sequences of 2048 tokens, as Narayanan et al. 2021 Table 1
};

// Standard shapes (GPT-3 and Megatron-LM / MT-NLG), vocabulary 50257 padded to 50304.
const std::vector<GptCase>& cases() {
  static const std::vector<GptCase> list = {
      {"1.3B", {.n_layer = 24, .n_head = 16, .d_model = 2048, .context = 2048}, 512},
      {"13B", {.n_layer = 40, .n_head = 40, .d_model = 5120, .context = 2048}, 1024},
      {"175B", {.n_layer = 96, .n_head = 96, .d_model = 12288, .context = 2048}, 1536},
      {"530B", {.n_layer = 105, .n_head = 128, .d_model = 20480, .context = 2048}, 2520},
      {"1T", {.n_layer = 128, .n_head = 160, .d_model = 25600, .context = 2048}, 3072},
  };
  return list;
}

std::string fixed(double value, int digits) {
  char text[48];
  std::snprintf(text, sizeof text, "%.*f", digits, value);
  return text;
}

void print_header() {
  std::printf(
      "%-5s %-9s %5s | %-12s %4s %2s %-14s %-9s %-3s | %8s %9s %5s %6s | %7s %6s %6s %6s "
      "%6s | %6s | %7s\n",
      "model", "device", "GPUs", "dp x pp x tp", "M", "b", "schedule", "recompute", "z1", "step s",
      "tokens/s", "MFU", "TFLOPs", "compute", "bubble", "tp", "pp", "dp", "GiB", "plan ms");
}

void print_plan(const GptCase& gpt, const std::string& device, int gpus, const PlanResult& result,
                double seconds) {
  if (result.ranked.empty()) {
    int64_t rejected = 0;
    for (const Rejection& r : result.rejected) rejected += r.count;
    std::printf("%-5s %-9s %5d | no plan fits (%lld rejected for memory or shape) %33s | %7.1f\n",
                gpt.name, device.c_str(), gpus, static_cast<long long>(rejected), "",
                seconds * 1e3);
    return;
  }
  const Plan& plan = result.ranked[0];
  const StepTerms& t = plan.terms;
  const std::string schedule =
      plan.chunks > 1 ? plan.schedule + " V=" + std::to_string(plan.chunks) : plan.schedule;
  std::printf(
      "%-5s %-9s %5d | %-12s %4d %2lld %-14s %-9s %-3s | %8.2f %9.3g %4.1f%% %6.1f | %7.2f "
      "%6.2f %6.2f %6.2f %6.2f | %6.1f | %7.1f\n",
      gpt.name, device.c_str(), gpus, plan.layout().c_str(), plan.micro_batches,
      static_cast<long long>(plan.micro_batch_size), schedule.c_str(),
      to_string(plan.recompute).c_str(), plan.zero > 0 ? cat("zero", plan.zero).c_str() : "off",
      t.total(), plan.tokens_per_second, 100 * plan.model_flops_utilisation,
      plan.hardware_flops_per_gpu / 1e12, t.compute, t.bubble, t.tp_comm, t.pp_comm, t.dp_exposed,
      plan.memory / (1024.0 * 1024 * 1024), seconds * 1e3);
}

// Megatron-LM's published 175B point against the planner's model of it.
void compare_megatron() {
  const GptCase& gpt = cases()[2];
  const ModelDesc model = gpt_model(gpt.shape);
  PlanRequest request{.cluster = cluster_for("a100-80gb", 128), .global_batch = gpt.global_batch};
  const FlopBlockTimer timer(request.cluster.device);
  // The published layout: t = 8, p = 8, d = 16, micro-batch 1 (96 per
  // replica), with full recomputation; the schedule (interleaved, V = 2) is
  // our assumption.
  Plan published;
  published.dp = 16, published.pp = 8, published.tp = 8;
  published.micro_batches = 96;
  published.micro_batch_size = 1;
  published.schedule = "interleaved";
  published.chunks = 2;
  published.sequence_parallel = false;
  published.recompute = Recompute::blocks;
  std::string why;
  const Plan same = evaluate_plan(model, request, timer, published, &why);
  const PlanResult chosen = plan_cluster(model, request, timer);
  std::printf(
      "\n175B on 1024 A100 (global batch 1536): Narayanan et al. 2021 Table 1 measured "
      "140 TFLOP/s per GPU (45%% of 312), counting the recomputed forward\n");
  std::printf(
      "  predicted for the published layout %s M=96 b=1 (interleaved V=2 "
      "assumed), full recomputation, no SP: %.1f TFLOP/s per GPU (%.0f%% of peak), MFU %.1f%%, "
      "step "
      "%.2f s%s\n",
      same.layout().c_str(), same.hardware_flops_per_gpu / 1e12,
      100 * same.hardware_flops_per_gpu / 312e12, 100 * same.model_flops_utilisation,
      same.terms.total(), why.empty() ? "" : (" (" + why + ")").c_str());
  if (!chosen.ranked.empty()) {
    const Plan& best = chosen.ranked[0];
    std::printf(
        "  the planner's choice %s M=%d %s recompute=%s: %.1f TFLOP/s per GPU counting "
        "recomputation, MFU %.1f%%, step %.2f s\n",
        best.layout().c_str(), best.micro_batches, best.schedule.c_str(),
        to_string(best.recompute).c_str(), best.hardware_flops_per_gpu / 1e12,
        100 * best.model_flops_utilisation, best.terms.total());
  }
}

// ---- --local: predictions against measured runs on this machine ----

namespace fs = std::filesystem;

constexpr int kRanks = 2;
// The planner's first choice counts as right within this of the fastest.
constexpr double kChoiceTolerance = 0.10;

struct LocalSettings {
  bool quick = false;
  bool keep = false;
  int steps = 3;   // timed
  int warmup = 2;  // untimed, before them
};

// A layout of 2 ranks to run and predict.
struct Config {
  int dp = 1, pp = 1, tp = 1, micro_batches = 1;
  std::string schedule = "none";
  std::string label() const {
    std::string out = cat("dp=", dp, " pp=", pp, " tp=", tp, " M=", micro_batches);
    if (pp > 1) out += " " + schedule;
    return out;
  }
};

struct LocalCase {
  std::string name;
  std::string recipe;
  int64_t global_batch;
  std::string describe;
  std::vector<std::string> overrides;
  std::vector<Config> configs;
  bool sequence_parallel = false;  // the planner's tp for Transformers
};

// One ranked plan of `trainer plan --format tsv`.
struct Predicted {
  Config config;
  double step_s = 0, compute_s = 0, bubble_s = 0, tp_s = 0, pp_s = 0, dp_s = 0, optimizer_s = 0;
  std::string stage_starts;  // "-" for one stage
};

struct Outcome {
  std::string model;
  Config config;
  double predicted_ms = -1, measured_ms = -1;
  double runnable = 0;  // mean runnable tasks during the run (2: the ranks alone)
  Predicted terms;
};

std::vector<LocalCase> local_cases(const LocalSettings& s, const std::string& work) {
  const std::string src = TRAINER_SOURCE_DIR;
  auto pipeline = [](int m, const char* schedule) {
    return Config{.pp = 2, .micro_batches = m, .schedule = schedule};
  };
  const std::vector<Config> all = {{.dp = 2},
                                   {.dp = 2, .micro_batches = 2},
                                   pipeline(2, "gpipe"),
                                   pipeline(2, "1f1b"),
                                   pipeline(4, "gpipe"),
                                   pipeline(4, "1f1b"),
                                   {.tp = 2}};
  const std::vector<Config> quick = {{.dp = 2}, pipeline(2, "1f1b"), {.tp = 2}};
  // The KJV text has 73 characters; a vocabulary of 128 lets tp = 2 split it.
  LocalCase gpt{"gpt",
                src + "/recipes/gpt_kjv.yaml",
                8,
                "gpt: GPT 4 layers, d_model 256, 4 heads, context 128, vocabulary 128 (KJV "
                "characters), global batch 8; AdamW",
                {"data.path=" + src + "/datasets/kjv.txt", "model.n_layer=4", "model.d_model=256",
                 "model.n_head=4", "model.context=128", "data.seq_len=128", "model.vocab_size=128",
                 "data.val_windows=4"},
                s.quick ? quick : all,
                true};
  LocalCase resnet{"resnet18_small",
                   src + "/recipes/fmnist_cnn.yaml",
                   16,
                   "resnet18_small: ResNet-18 with the 3x3 stem, 28x28x1 random images, global "
                   "batch 16; SGD",
                   {"model.name=resnet18_small", "model.in_channels=1", "model.num_classes=10",
                    "data.name=fashion_mnist", "data.root=" + work + "/fmnist",
                    "data.image_size=28", "data.workers=1"},
                   all};
  if (s.quick) return {gpt};
  return {gpt, resnet};
}

// The tasks runnable on the machine now (/proc/loadavg's fourth field:
// "running/total"), this process's children and their threads included.
int runnable_tasks() {
  std::ifstream f("/proc/loadavg");
  std::string one, five, fifteen, running;
  f >> one >> five >> fifteen >> running;
  return std::atoi(running.c_str());
}

// Runs argv, stdout and stderr into log; true when it exits 0. While it
// runs, *runnable is the mean count of runnable tasks (sampled every 50 ms):
// about 2 for the 2 ranks alone, more when other work shares the cores.
bool run_logged(const std::vector<std::string>& argv, const std::string& log,
                double* runnable = nullptr) {
  int samples = 0;
  double sum = 0;
  const bool ok = bench::run_logged(argv, log, [&](pid_t) {
    // This process is running while it samples: not counted.
    sum += std::max(0, runnable_tasks() - 1);
    ++samples;
  });
  if (runnable) *runnable = samples > 0 ? sum / samples : 0;
  return ok;
}

// Every ranked plan of 2 CPU ranks, from `trainer plan --format tsv`.
std::vector<Predicted> predict(const LocalCase& c, const std::string& trainer,
                               const std::string& work, double* runnable) {
  std::vector<std::string> argv{trainer, "plan", c.recipe};
  argv.insert(argv.end(), c.overrides.begin(), c.overrides.end());
  for (const std::string& a :
       {cat("training.global_batch=", c.global_batch), std::string("training.threads=1"),
        std::string("--nodes"), std::string("1"), std::string("--per-node"), cat(kRanks),
        std::string("--device"), std::string("cpu"), std::string("--format"), std::string("tsv")})
    argv.push_back(a);
  const std::string log = cat(work, "/", c.name, "_plan.tsv");
  if (!run_logged(argv, log, runnable))
    throw Error(cat("trainer plan failed; the end of ", log, ":\n", bench::tail_of(log, 6)));
  std::vector<Predicted> out;
  std::ifstream f(log);
  for (std::string line; std::getline(f, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    Predicted p;
    int chunks = 1, zero = 0;
    std::string recompute;
    fields >> p.config.dp >> p.config.pp >> p.config.tp >> p.config.micro_batches;
    int64_t b = 0;
    fields >> b >> p.config.schedule >> chunks >> zero >> recompute >> p.step_s >> p.compute_s >>
        p.bubble_s >> p.tp_s >> p.pp_s >> p.dp_s >> p.optimizer_s >> p.stage_starts;
    // The layouts compared are the plain ones (the figures are about dp, pp and tp).
    if (fields && chunks == 1 && zero == 0 && recompute == "none") out.push_back(p);
  }
  return out;
}

// The trainer's arguments for config c (its stage split the planner's).
std::vector<std::string> train_args(const LocalCase& c, const Config& config, const Predicted& plan,
                                    const LocalSettings& s, const std::string& out_dir) {
  std::vector<std::string> a{"train", c.recipe};
  a.insert(a.end(), c.overrides.begin(), c.overrides.end());
  const int total = s.warmup + s.steps;
  for (const std::string& kv :
       {cat("parallel.dp=", config.dp), cat("parallel.pp=", config.pp),
        cat("parallel.tp=", config.tp), cat("training.global_batch=", c.global_batch),
        cat("training.steps=", total), std::string("training.threads=1"),
        cat("training.eval_every=", total), cat("training.checkpoint_every=", total),
        cat("training.log_every=", total), "output_dir=" + out_dir})
    a.push_back(kv);
  if (config.pp > 1) {
    a.push_back(cat("parallel.micro_batches=", config.micro_batches));
    a.push_back("parallel.schedule=" + config.schedule);
    a.push_back("parallel.stages=[" + plan.stage_starts + "]");
  } else {
    a.push_back(cat("training.grad_accum=", config.micro_batches));
  }
  // The planner times tp with sequence parallelism (the same bytes, less memory).
  if (config.tp > 1 && c.sequence_parallel) a.push_back("parallel.sequence_parallel=true");
  return a;
}

double middle(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The median step of a run: the interval between consecutive optimizer
// steps' ends (the later rank's), over the steps after the warm-up.
double measured_step_ms(const std::string& path, const LocalSettings& s) {
  std::ifstream f(path);
  if (!f) throw Error(cat(path, ": no trace written"));
  const nlohmann::json doc = nlohmann::json::parse(f);
  std::vector<std::vector<double>> ends(kRanks);
  for (const nlohmann::json& e : doc.at("traceEvents")) {
    if (e.value("ph", "") != "X" || e.value("name", "") != "optimizer") continue;
    const int rank = e.at("pid").get<int>();
    if (rank < 0 || rank >= kRanks) continue;
    ends[size_t(rank)].push_back((e.at("ts").get<double>() + e.at("dur").get<double>()) * 1e-3);
  }
  const int total = s.warmup + s.steps;
  for (int r = 0; r < kRanks; ++r) {
    std::sort(ends[size_t(r)].begin(), ends[size_t(r)].end());
    if (int(ends[size_t(r)].size()) != total)
      throw Error(cat(path, ": rank ", r, " traced ", ends[size_t(r)].size(),
                      " optimizer steps of ", total));
  }
  std::vector<double> periods;
  for (int k = s.warmup; k < total; ++k) {
    auto end_of = [&](int step) { return std::max(ends[0][size_t(step)], ends[1][size_t(step)]); };
    periods.push_back(end_of(k) - end_of(k - 1));
  }
  return middle(periods);
}

// Ranks 1..n of values, ties sharing their mean rank.
std::vector<double> ranks_of(const std::vector<double>& values) {
  std::vector<size_t> order(values.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
  std::vector<double> rank(values.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && values[order[j + 1]] == values[order[i]]) ++j;
    for (size_t k = i; k <= j; ++k) rank[order[k]] = 0.5 * double(i + j) + 1;
    i = j + 1;
  }
  return rank;
}

// Spearman's rank correlation: Pearson's of the ranks.
double spearman(const std::vector<double>& x, const std::vector<double>& y) {
  const std::vector<double> rx = ranks_of(x), ry = ranks_of(y);
  const double n = double(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += rx[i] / n, my += ry[i] / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0;
}

std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string one, five, fifteen;
  f >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

int run_local(const LocalSettings& s) {
  const std::string trainer = bench::self_dir() + "/trainer";
  if (access(trainer.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "bench_planner: no %s; build the trainer target too\n", trainer.c_str());
    return 1;
  }
  char work_template[] = "/tmp/bench_planner.XXXXXX";
  if (!mkdtemp(work_template)) return 1;
  const std::string work = work_template;
  const std::vector<LocalCase> cases = local_cases(s, work);
  if (!s.quick)
    bench::write_fake_fashion_mnist(work + "/fmnist", 16 * (s.warmup + s.steps) * 4, 32);
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf(
      "%d ranks under `trainer launch --nproc-per-node %d` (1 thread each), median of %d steps "
      "after %d warm-up; predicted by `trainer plan --device cpu` from block times profiled "
      "here; load average %s\n",
      kRanks, kRanks, s.steps, s.warmup, load_average().c_str());
  for (const LocalCase& c : cases) std::printf("  %s\n", c.describe.c_str());
  std::printf(
      "predicted terms in ms; runnable: mean tasks runnable on the machine during the run (the "
      "2 ranks alone: about 2; more: other work shared the cores)\n");
  const char* format = "%-15s %-26s | %9s %9s %7s %8s | %8s %7s %7s %7s %7s %7s\n";
  std::printf(format, "model", "configuration", "pred ms", "meas ms", "error", "runnable",
              "compute", "bubble", "tp", "pp", "dp", "opt");
  std::fflush(stdout);
  std::vector<Outcome> outcomes;
  bool failed = false;
  for (const LocalCase& c : cases) {
    std::vector<Predicted> plans;
    try {
      double runnable = 0;
      plans = predict(c, trainer, work, &runnable);
      std::printf("%-15s %-26s | profiled by trainer plan, %.1f runnable\n", c.name.c_str(), "",
                  runnable);
    } catch (const std::exception& e) {
      std::printf("%-15s %s\n", c.name.c_str(), e.what());
      failed = true;
      continue;
    }
    for (const Config& config : c.configs) {
      Outcome o;
      o.model = c.name;
      o.config = config;
      for (const Predicted& p : plans)
        if (p.config.dp == config.dp && p.config.pp == config.pp && p.config.tp == config.tp &&
            p.config.micro_batches == config.micro_batches && p.config.schedule == config.schedule)
          o.terms = p, o.predicted_ms = p.step_s * 1e3;
      if (o.predicted_ms < 0) {
        std::printf("%-15s %-26s | the planner has no such plan\n", c.name.c_str(),
                    config.label().c_str());
        failed = true;
        continue;
      }
      const std::string out_dir = cat(work, "/", c.name, "_", outcomes.size());
      std::vector<std::string> argv{trainer, "launch", "--nproc-per-node", cat(kRanks), "--"};
      for (const std::string& a : train_args(c, config, o.terms, s, out_dir)) argv.push_back(a);
      argv.push_back("--trace");
      const std::string log = out_dir + ".log";
      try {
        if (!run_logged(argv, log, &o.runnable))
          throw Error(cat("the trainer failed; the end of ", log, ":\n", bench::tail_of(log, 6)));
        o.measured_ms = measured_step_ms(out_dir + "/trace.json", s);
      } catch (const std::exception& e) {
        std::printf("%-15s %-26s | %s\n", c.name.c_str(), config.label().c_str(), e.what());
        failed = true;
        continue;
      }
      const Predicted& t = o.terms;
      std::printf(
          "%-15s %-26s | %9.1f %9.1f %+6.0f%% %8.1f | %8.1f %7.1f %7.1f %7.1f %7.1f %7.1f\n",
          c.name.c_str(), config.label().c_str(), o.predicted_ms, o.measured_ms,
          100 * (o.predicted_ms / o.measured_ms - 1), o.runnable, t.compute_s * 1e3,
          t.bubble_s * 1e3, t.tp_s * 1e3, t.pp_s * 1e3, t.dp_s * 1e3, t.optimizer_s * 1e3);
      std::fflush(stdout);
      outcomes.push_back(o);
    }
  }
  // The bars the planner's predictions are held to: rank correlation >= 0.8,
  // median error <= 15%, first choice within 10% of the fastest (per model:
  // the planner chooses per recipe).
  std::vector<double> predicted, measured, errors;
  for (const Outcome& o : outcomes) {
    predicted.push_back(o.predicted_ms);
    measured.push_back(o.measured_ms);
    errors.push_back(std::fabs(o.predicted_ms / o.measured_ms - 1));
  }
  if (!outcomes.empty()) {
    std::printf("\nSpearman rank correlation %.2f over %zu configurations (bar >= 0.8)\n",
                spearman(predicted, measured), outcomes.size());
    std::printf("median absolute error %.1f%% (bar <= 15%%), largest %.1f%%\n",
                100 * middle(errors), 100 * *std::max_element(errors.begin(), errors.end()));
  }
  for (const LocalCase& c : cases) {
    const Outcome *chosen = nullptr, *fastest = nullptr;
    std::vector<double> p, m;
    for (const Outcome& o : outcomes) {
      if (o.model != c.name) continue;
      if (!chosen || o.predicted_ms < chosen->predicted_ms) chosen = &o;
      if (!fastest || o.measured_ms < fastest->measured_ms) fastest = &o;
      p.push_back(o.predicted_ms);
      m.push_back(o.measured_ms);
    }
    if (!chosen) continue;
    const double over = chosen->measured_ms / fastest->measured_ms - 1;
    std::printf(
        "%s: first choice %s measured %.1f ms, fastest %s %.1f ms: %+.1f%%, %s; rank "
        "correlation %.2f\n",
        c.name.c_str(), chosen->config.label().c_str(), chosen->measured_ms,
        fastest->config.label().c_str(), fastest->measured_ms, 100 * over,
        over <= kChoiceTolerance ? "within 10%" : "NOT within 10%", spearman(p, m));
  }
  if (s.keep)
    std::printf("runs, logs and traces in %s\n", work.c_str());
  else
    fs::remove_all(work);
  return failed ? 1 : 0;
}

int usage() {
  std::fprintf(stderr, "usage: bench_planner [--quick] [--local [--quick] [--keep]]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, local = false;
  LocalSettings settings;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--local") == 0) {
      local = true;
    } else if (std::strcmp(argv[i], "--keep") == 0) {
      settings.keep = true;
    } else {
      return usage();
    }
  }
  if (local) {
    settings.quick = quick;
    if (quick) settings.steps = 1, settings.warmup = 1;
    try {
      return run_local(settings);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_planner: %s\n", e.what());
      return 1;
    }
  }
  const std::vector<std::string> devices = quick
                                               ? std::vector<std::string>{"a100-80gb"}
                                               : std::vector<std::string>{"a100-80gb", "h100-80gb"};
  const std::vector<int> sizes = {32, 128, 512, 1024, 3072};
  std::printf(
      "the planner's choice per GPT model and cluster (times in seconds, T = 2048, "
      "vocabulary 50304; TFLOPs per GPU count recomputation)\n");
  print_header();
  double slowest = 0;
  for (const GptCase& gpt : cases()) {
    if (quick && std::string(gpt.name) != "1.3B" && std::string(gpt.name) != "175B") continue;
    const ModelDesc model = gpt_model(gpt.shape);
    for (const std::string& device : devices)
      for (int gpus : sizes) {
        PlanRequest request{.cluster = cluster_for(device, gpus / 8),
                            .global_batch = gpt.global_batch};
        const FlopBlockTimer timer(request.cluster.device);
        const auto start = std::chrono::steady_clock::now();
        const PlanResult result = plan_cluster(model, request, timer);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        slowest = std::max(slowest, seconds);
        print_plan(gpt, device, gpus, result, seconds);
      }
  }
  std::printf("slowest plan: %s ms\n", fixed(slowest * 1e3, 1).c_str());
  compare_megatron();
  return 0;
}
