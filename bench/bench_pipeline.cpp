// Pipeline parallelism measured against its model: GPT (6 layers, d_model
// 384, 6 heads, character-level KJV) and ResNet-18 (3x3 stem, 28x28x1
// Fashion-MNIST-shaped images) at pp = 2, each schedule run by the trainer
// itself (`trainer launch --nproc-per-node 2 -- train ... --trace`, one
// thread per rank) and read back from its timeline (parallel/trace.h).
//
// Each row is run --rounds times (default 3). A round runs every row once,
// ours and then its peer (PyTorch's, or the LSTM's one-process run), so a
// slow spell of the machine lands on both sides of a ratio. The row's
// figures below are those of its median-step round (the faster of the
// middle two for an even count): one real run, whose F, B and bubble the
// prediction can be checked against, rather than medians of different runs
// that no schedule produced together. Each round is printed as a line
// before the rows.
//
//   step          median interval between consecutive optimizer steps (the
//                 later stage's end), over the steps after the warm-up
//   F, B          each stage's median span of one micro-batch's forward and
//                 backward (zbh1: B = I + W, the split halves' medians)
//   bubble        1 - busy, busy = a stage's compute spans (F, B, I, W,
//                 optimizer) over the timed steps' wall time, mean of stages
//   predicted     simulate() (parallel/pipeline_sim.h) of the same schedule
//                 from the measured F, B and optimizer medians: the step
//                 time and bubble the schedule alone explains; meas/pred
//                 beyond 10% is time the model leaves out (transfers,
//                 per-step work outside the spans) or spans slower than
//                 their median; "of means" is the same from the spans'
//                 means, which keeps the slow ones
//   torch ms      the median of PyTorch's rounds
//   torch/ours    the median of the per-round ratios (torch's step / ours
//                 in the same round) and their range
//   step range    ours' fastest and slowest round (every row has it, with
//                 or without a peer)
//   in flight     peak_in_flight() (parallel/schedule.h): micro-batches whose
//                 activations a stage holds at once (GPipe M, 1F1B P - s);
//                 zbh1 also counted until W, "(W n)": a weight half keeps
//                 what it reads until it runs
//   act MiB       in flight x the dry run's activations per micro-batch
//   peak RSS      each rank's VmHWM, read from /proc while it runs: the
//                 whole process (every rank builds the whole model); ours
//                 of the median-step round, torch's the median of its rounds
//
// The LSTM LM case (lstm) runs a layer per stage as a wavefront: its M
// micro-batches are M time chunks of one batch (parallel.time_chunks,
// schedule wavefront, the only schedule it takes); torch.distributed.pipelining
// has no state carried between micro-batches, so it has no torch column.
// Instead the same batch is timed in one process with 2 threads (the same
// cores, no pipeline) in each round after the wavefront, printed below the
// table with the median ratio and its range.
//
// When python3 can import torch, bench/bench_pipeline_torch.py runs the same
// model shapes, stages, micro-batches and optimizer under
// torch.distributed.pipelining (gloo, ScheduleGPipe / Schedule1F1B, one
// thread per rank) and the table prints its step time and torch/ours. It has
// no ZB-H1, so that row has ours only.
//
//   bench_pipeline                                # every case, gpipe 1f1b zbh1 (lstm: wavefront)
//   bench_pipeline --rounds 5                     # five rounds (default 3); 1: one run of each
//   bench_pipeline --case lstm --micro-batches 8  # the wavefront over 8 time chunks
//   bench_pipeline --case gpt --schedule 1f1b --micro-batches 8 --steps 6
//   bench_pipeline --seq 64 --batch 2 --no-torch  # GPT context, micro-batch size
//   bench_pipeline --keep                         # leave the runs' traces, print where
//
// The trainer binary is the one next to this executable (build both targets).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/programs.h"
#include "core/check.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "parallel/pipeline_sim.h"
#include "parallel/schedule.h"

using namespace trainer;
namespace fs = std::filesystem;

namespace {

constexpr int kStages = 2;
// meas/pred within this is "ok".
constexpr double kPredictionTolerance = 0.10;

struct Settings {
  std::string only_case;
  std::vector<std::string> schedules{"gpipe", "1f1b", "zbh1"};
  int micro_batches = 4;
  int steps = 4;   // timed
  int warmup = 2;  // untimed, before them
  int seq = 128;   // GPT context and window
  int batch = 0;   // samples per micro-batch; 0: the case's own
  int rounds = 3;
  bool torch = true;
  bool keep = false;
  // Set by main: the trainer binary, and the directory the runs write in.
  std::string trainer, work;
};

// A model trained by the trainer from a recipe and key=value overrides.
struct PipelineCase {
  std::string name;  // --case
  std::string recipe;
  int64_t micro_batch;
  std::string describe;                 // printed above the table
  std::vector<std::string> overrides;   // the model and data keys
  std::vector<std::string> torch_args;  // bench_pipeline_torch.py's model arguments
  // The micro-batches are time chunks of one batch of micro_batch windows
  // (the LSTM LM's wavefront), run by that schedule only.
  bool time_chunks = false;
};

// What each stage's actions cost in one run, as the simulator takes them:
// one statistic (median or mean) of each kind of span.
struct StageCosts {
  double forward_ms[kStages] = {}, backward_ms[kStages] = {};
  // zbh1: I / (I + W), mean of the stages after the first. The first stage's
  // I is empty (its input, the data, needs no gradient) and gates nothing;
  // the simulator takes one fraction for every stage.
  double input_fraction = 0;
  double optimizer_ms = 0;  // mean of stages
};

// The figures of one run.
struct Measured {
  double step_ms = 0;
  StageCosts median, mean;
  double bubble = 0;
  double peak_rss_mib[kStages] = {};
};

// What a row's ours is compared with in each round: PyTorch's pipeline, or
// for the wavefront the same batch in one process on both cores.
enum class Peer { none, torch, one_process };

// A (case, schedule) over the rounds.
struct Row {
  std::string schedule;
  Peer peer = Peer::none;
  std::vector<Measured> ours;  // each round whose run succeeded
  // The peer's step ms and peer / ours, each round where both ran.
  std::vector<double> peer_ms, ratios;
  std::vector<double> torch_rss_mib[kStages];  // each torch round's
  std::string peer_note;                       // why a peer's round has no figure
  // The figures printed, from the median-step round (settle()).
  Measured m;
  parallel::SimResult sim, sim_of_means;  // from the medians, from the means
  std::vector<int> in_flight, in_flight_until_w;
};

std::vector<PipelineCase> make_cases(const Settings& s, const std::string& work) {
  const std::string src = TRAINER_SOURCE_DIR;
  const int64_t gpt_batch = s.batch > 0 ? s.batch : 4;
  const int64_t resnet_batch = s.batch > 0 ? s.batch : 8;
  const std::string seq = std::to_string(s.seq);
  PipelineCase gpt{
      "gpt",
      src + "/recipes/gpt_kjv.yaml",
      gpt_batch,
      cat("gpt: GPT 6 layers, d_model 384, 6 heads, context ", s.seq,
          ", char vocabulary 73 (KJV), micro-batch ", gpt_batch, " x ", s.seq,
          " tokens; AdamW, clip 1; stages [embed, h.0-2] [h.3-5, head] (head tied to embed)"),
      {"data.path=" + src + "/datasets/kjv.txt", "model.n_layer=6", "model.d_model=384",
       "model.n_head=6", "model.context=" + seq, "data.seq_len=" + seq, "data.val_windows=4"},
      {"--model", "gpt", "--seq", seq, "--layers", "6", "--width", "384", "--heads", "6", "--vocab",
       "73"}};
  PipelineCase resnet{
      "resnet18_small",
      src + "/recipes/fmnist_cnn.yaml",
      resnet_batch,
      cat("resnet18_small: ResNet-18 with the 3x3 stem, 28x28x1 images (random pixels in "
          "Fashion-MNIST files), micro-batch ",
          resnet_batch, "; SGD Nesterov; stages [stem .. layer2] [layer3 .. fc]"),
      {"model.name=resnet18_small", "model.in_channels=1", "model.num_classes=10",
       "data.name=fashion_mnist", "data.root=" + work + "/fmnist", "data.image_size=28",
       "data.workers=1"},
      {"--model", "resnet18_small", "--size", "28", "--channels", "1", "--classes", "10"}};
  const int64_t lstm_batch = s.batch > 0 ? s.batch : 16;
  PipelineCase lstm{
      "lstm",
      src + "/recipes/lstm_kjv.yaml",
      lstm_batch,
      cat("lstm: LSTM LM 2 layers x 512, embedding 512, char vocabulary 73 (KJV), batch ",
          lstm_batch, " x ", s.seq,
          " tokens cut into M time chunks; AdamW, clip 1; a layer per stage [embed, rnn.0] "
          "[rnn.1, decoder], wavefront"),
      {"data.path=" + src + "/datasets/kjv.txt", "model.n_layer=2", "model.d_model=512",
       "model.hidden=512", "model.tie_weights=false", "data.seq_len=" + seq, "data.val_windows=4"},
      {},
      true};
  std::vector<PipelineCase> out;
  for (const PipelineCase& c : {gpt, resnet, lstm})
    if (s.only_case.empty() || s.only_case == c.name) out.push_back(c);
  return out;
}

// The trainer's arguments for case c under schedule at M micro-batches.
std::vector<std::string> train_args(const PipelineCase& c, const Settings& s,
                                    const std::string& schedule, const std::string& out_dir) {
  std::vector<std::string> a{"train", c.recipe};
  a.insert(a.end(), c.overrides.begin(), c.overrides.end());
  const int total = s.warmup + s.steps;
  const int chunks = c.time_chunks ? s.micro_batches : 1;
  for (std::string kv :
       {cat("parallel.pp=", kStages), cat("parallel.micro_batches=", s.micro_batches / chunks),
        cat("parallel.time_chunks=", chunks), "parallel.schedule=" + schedule,
        cat("training.global_batch=", c.micro_batch * s.micro_batches / chunks),
        cat("training.steps=", total), std::string("training.threads=1"),
        // Evaluation and checkpoints only once, after the last step.
        cat("training.eval_every=", total), cat("training.checkpoint_every=", total),
        cat("training.log_every=", total), "output_dir=" + out_dir})
    a.push_back(kv);
  return a;
}

// Runs argv with stdout and stderr into log; while it runs, the peak RSS
// (VmHWM) of each of its children, by their RANK variable. False when it
// failed.
bool run_logged(const std::vector<std::string>& argv, const std::string& log,
                double peak_rss_mib[kStages]) {
  auto read_file = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  return bench::run_logged(argv, log, [&](pid_t pid) {
    std::istringstream children(read_file(cat("/proc/", pid, "/task/", pid, "/children")));
    for (int child; children >> child;) {
      const std::string env = read_file(cat("/proc/", child, "/environ"));
      const size_t at = env.find(std::string("\0RANK=", 6));
      const std::string status_text = read_file(cat("/proc/", child, "/status"));
      const size_t hwm = status_text.find("VmHWM:");
      if (at == std::string::npos || hwm == std::string::npos) continue;
      const int rank = std::atoi(env.c_str() + at + 6);
      if (rank >= 0 && rank < kStages)
        peak_rss_mib[rank] =
            std::max(peak_rss_mib[rank], std::atof(status_text.c_str() + hwm + 6) / 1024.0);
    }
  });
}

// Each stage's activation MiB per micro-batch, from the dry run's
// "stage k: ... and X MiB of activations per micro-batch".
std::vector<double> dry_run_activations(const PipelineCase& c, const Settings& s,
                                        const std::string& trainer, const std::string& work) {
  std::vector<std::string> argv{trainer};
  for (const std::string& a : train_args(c, s, c.time_chunks ? "wavefront" : "1f1b", work + "/dry"))
    argv.push_back(a);
  argv.push_back("--dry-run");
  const std::string log = work + "/dry.log";
  double unused[kStages] = {};
  std::vector<double> mib(kStages, -1);
  if (!run_logged(argv, log, unused)) return mib;
  std::ifstream f(log);
  for (std::string line; std::getline(f, line);) {
    int stage = -1;
    const size_t at = line.find(" MiB of activations per micro-batch");
    if (std::sscanf(line.c_str(), " stage %d:", &stage) != 1 || at == std::string::npos ||
        stage < 0 || stage >= kStages)
      continue;
    const size_t from = line.rfind(" and ", at);
    // The dry run profiles whole windows; a time chunk holds its share.
    if (from != std::string::npos)
      mib[size_t(stage)] =
          std::atof(line.c_str() + from + 5) / (c.time_chunks ? s.micro_batches : 1);
  }
  return mib;
}

// The median, the mean of the middle two for an even count (a few spans per
// kind: bench_util's median() takes the upper one).
double middle(const std::vector<double>& v) { return bench::spread_of(v).median; }

struct Span {
  std::string name;
  bool compute = false;
  double begin_ms = 0, dur_ms = 0;
};

// The trace's spans of each rank (pid), in time order.
std::vector<std::vector<Span>> read_trace(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error(cat(path, ": no trace written"));
  const nlohmann::json doc = nlohmann::json::parse(f);
  std::vector<std::vector<Span>> ranks(kStages);
  for (const nlohmann::json& e : doc.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    const int rank = e.at("pid").get<int>();
    if (rank < 0 || rank >= kStages) continue;
    ranks[size_t(rank)].push_back({e.at("name").get<std::string>(), e.value("cat", "") == "compute",
                                   e.at("ts").get<double>() * 1e-3,
                                   e.at("dur").get<double>() * 1e-3});
  }
  for (auto& spans : ranks)
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.begin_ms < b.begin_ms; });
  return ranks;
}

// The median step period of a one-process run's trace (pid 0's optimizer
// spans), after the warm-up.
double one_process_step_ms(const std::string& path, const Settings& s) {
  std::ifstream f(path);
  if (!f) throw Error(cat(path, ": no trace written"));
  const nlohmann::json doc = nlohmann::json::parse(f);
  std::vector<double> ends;
  for (const nlohmann::json& e : doc.at("traceEvents"))
    if (e.value("ph", "") == "X" && e.value("name", "") == "optimizer")
      ends.push_back((e.at("ts").get<double>() + e.at("dur").get<double>()) * 1e-3);
  std::sort(ends.begin(), ends.end());
  if (int(ends.size()) != s.warmup + s.steps)
    throw Error(cat(path, ": ", ends.size(), " optimizer steps of ", s.warmup + s.steps));
  std::vector<double> periods;
  for (size_t k = size_t(s.warmup); k < ends.size(); ++k) periods.push_back(ends[k] - ends[k - 1]);
  return middle(periods);
}

// The figures of one run from its trace (rank r runs stage r: dp = 1).
Measured analyse(const std::vector<std::vector<Span>>& ranks, const Settings& s) {
  const int total = s.warmup + s.steps;
  std::vector<std::vector<double>> opt_end(kStages);  // [rank][step]
  for (int r = 0; r < kStages; ++r)
    for (const Span& sp : ranks[size_t(r)])
      if (sp.name == "optimizer") opt_end[size_t(r)].push_back(sp.begin_ms + sp.dur_ms);
  for (int r = 0; r < kStages; ++r)
    if (int(opt_end[size_t(r)].size()) != total)
      throw Error(cat("rank ", r, " traced ", opt_end[size_t(r)].size(), " optimizer steps of ",
                      total, " (a step skipped for a non-finite loss?)"));
  Measured m;
  std::vector<double> periods;
  for (int k = s.warmup; k < total; ++k) {
    auto end_of = [&](int step) {
      return std::max(opt_end[0][size_t(step)], opt_end[1][size_t(step)]);
    };
    periods.push_back(end_of(k) - end_of(k - 1));
  }
  m.step_ms = middle(periods);
  double busy = 0;
  for (int r = 0; r < kStages; ++r) {
    // This rank's timed window: from its optimizer step before the first
    // timed step to its last.
    const double from = opt_end[size_t(r)][size_t(s.warmup - 1)];
    const double to = opt_end[size_t(r)].back();
    std::map<char, std::vector<double>> by_kind;  // 'F', 'B', 'I', 'W', 'o' (optimizer)
    double compute = 0;
    for (const Span& sp : ranks[size_t(r)]) {
      if (!sp.compute || sp.begin_ms < from || sp.begin_ms >= to) continue;
      compute += sp.dur_ms;
      by_kind[sp.name == "optimizer" ? 'o' : sp.name[0]].push_back(sp.dur_ms);
    }
    busy += compute / (to - from);
    auto mean = [](const std::vector<double>& v) {
      double sum = 0;
      for (double x : v) sum += x;
      return sum / double(v.size());
    };
    for (auto [costs, statistic] :
         {std::pair{&m.median, +[](const std::vector<double>& v) { return middle(v); }},
          std::pair{&m.mean, +mean}}) {
      auto of = [&](char kind) { return by_kind[kind].empty() ? 0.0 : statistic(by_kind[kind]); };
      costs->forward_ms[r] = of('F');
      const double i = of('I'), w = of('W');
      costs->backward_ms[r] = by_kind['B'].empty() ? i + w : of('B');
      if (r > 0) costs->input_fraction += (i + w > 0 ? i / (i + w) : 0.5) / (kStages - 1);
      costs->optimizer_ms += of('o') / kStages;
    }
  }
  m.bubble = 1.0 - busy / kStages;
  return m;
}

parallel::SimResult predict(const parallel::Schedule& schedule, const StageCosts& c) {
  parallel::PipelineCosts costs;
  costs.forward.assign(c.forward_ms, c.forward_ms + kStages);
  costs.backward.assign(c.backward_ms, c.backward_ms + kStages);
  costs.backward_input_fraction = c.input_fraction;
  costs.backward_weight_fraction = 1.0 - c.input_fraction;
  costs.optimizer_step = c.optimizer_ms;
  return parallel::simulate(schedule, costs);
}

bool torch_available() {
  return std::system("python3 -c 'import torch.distributed.pipelining' >/dev/null 2>&1") == 0;
}

// One run of bench_pipeline_torch.py: its median step ms and per-rank peak
// RSS; false on failure, why (its last line of output) in note.
bool measure_torch(const PipelineCase& c, const Settings& s, const std::string& schedule,
                   double& ms, double rss_mib[kStages], std::string& note) {
  std::string cmd = cat("python3 ", TRAINER_SOURCE_DIR, "/bench/bench_pipeline_torch.py");
  for (const std::string& a : c.torch_args) cmd += " " + a;
  cmd += cat(" --schedule ", schedule, " --micro-batches ", s.micro_batches, " --batch ",
             c.micro_batch, " --steps ", s.steps, " --warmup ", s.warmup);
  if (allowed_cores().size() >= size_t(kStages)) cmd += " --bind";  // as trainer launch binds
  const std::string log = s.work + "/torch.log";
  cmd += " 2>" + log;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    double seconds = 0;
    const bool got = std::fscanf(p, "%lf %lf %lf", &seconds, &rss_mib[0], &rss_mib[1]) == 3;
    if (pclose(p) == 0 && got) {
      ms = 1e3 * seconds;
      return true;
    }
  }
  std::string last = bench::tail_of(log, 1);
  note = last.empty() ? "no output" : last.substr(4, last.size() - 5);
  return false;
}

// One run of ours: case c under schedule by `trainer launch`, in dir, read
// back from its trace. False (and why printed) when it failed.
bool run_ours(const PipelineCase& c, const Settings& s, const std::string& schedule,
              const std::string& dir, Measured& m) {
  std::vector<std::string> argv{s.trainer, "launch", "--nproc-per-node", cat(kStages), "--"};
  for (const std::string& a : train_args(c, s, schedule, dir)) argv.push_back(a);
  argv.push_back("--trace");
  const std::string log = dir + ".log";
  double rss[kStages] = {};
  if (!run_logged(argv, log, rss)) {
    std::printf("%-15s %-6s: the trainer failed; the end of %s:\n%s", c.name.c_str(),
                schedule.c_str(), log.c_str(), bench::tail_of(log, 8).c_str());
    return false;
  }
  try {
    m = analyse(read_trace(dir + "/trace.json"), s);
  } catch (const std::exception& e) {
    std::printf("%-15s %-6s: %s\n", c.name.c_str(), schedule.c_str(), e.what());
    return false;
  }
  std::copy(rss, rss + kStages, m.peak_rss_mib);
  return true;
}

// The wavefront's peer: the same batch in one process with a thread per
// stage (the same cores, no pipeline), its median step ms. Throws when it
// failed.
double run_one_process(const PipelineCase& c, const Settings& s, const std::string& dir) {
  std::vector<std::string> argv{s.trainer};
  for (std::string a : train_args(c, s, "wavefront", dir)) {
    if (a.rfind("parallel.", 0) == 0) continue;
    argv.push_back(a == "training.threads=1" ? cat("training.threads=", kStages) : a);
  }
  argv.push_back("--trace");
  double unused[kStages] = {};
  if (!run_logged(argv, dir + ".log", unused))
    throw Error(cat("the trainer failed; see ", dir, ".log"));
  return one_process_step_ms(dir + "/trace.json", s);
}

// One round of case c: each row's run of ours, then its peer's, and a line
// of what the round measured. False when a run of ours (or the one-process
// peer) failed; the rows keep the runs that did not.
bool run_round(const PipelineCase& c, const Settings& s, int round, std::vector<Row>& rows) {
  bool ok = true;
  std::string line = cat("  round ", round + 1, ":");
  for (Row& row : rows) {
    const std::string dir = cat(s.work, "/", c.name, "_", row.schedule, "_", round + 1);
    Measured m;
    if (!run_ours(c, s, row.schedule, dir, m)) {
      ok = false;
      line += cat(" ", row.schedule, " failed;");
      continue;
    }
    row.ours.push_back(m);
    double peer_ms = -1, rss[kStages] = {};
    if (row.peer == Peer::torch) {
      if (measure_torch(c, s, row.schedule, peer_ms, rss, row.peer_note))
        for (int r = 0; r < kStages; ++r) row.torch_rss_mib[r].push_back(rss[r]);
    } else if (row.peer == Peer::one_process) {
      try {
        peer_ms = run_one_process(c, s, dir + "_one");
      } catch (const std::exception& e) {
        row.peer_note = e.what();
        ok = false;
      }
    }
    char text[96];
    std::snprintf(text, sizeof text, " %s %.1f ms", row.schedule.c_str(), m.step_ms);
    line += text;
    if (peer_ms > 0) {
      row.peer_ms.push_back(peer_ms);
      row.ratios.push_back(peer_ms / m.step_ms);
      std::snprintf(text, sizeof text, ", %s %.1f ms (%.2f)",
                    row.peer == Peer::torch ? "torch" : "one process", peer_ms, row.ratios.back());
      line += text;
    }
    line += ";";
    // A run's checkpoint and trace are read; only --keep wants them on disk.
    if (!s.keep) {
      fs::remove_all(dir);
      fs::remove_all(dir + "_one");
    }
  }
  line.pop_back();
  if (s.rounds > 1) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  return ok;
}

// The row's printed figures: its median-step round's (the faster of the
// middle two for an even count), and the simulator's prediction from that
// round's spans, so step, F, B, bubble and prediction describe one run.
void settle(Row& row, const Settings& s) {
  std::vector<size_t> order(row.ours.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return row.ours[a].step_ms < row.ours[b].step_ms; });
  row.m = row.ours[order[(order.size() - 1) / 2]];
  const parallel::Schedule table = parallel::make_schedule(row.schedule, kStages, s.micro_batches);
  row.sim = predict(table, row.m.median);
  row.sim_of_means = predict(table, row.m.mean);
  row.in_flight = parallel::peak_in_flight(table);
  row.in_flight_until_w = parallel::peak_in_flight(table, parallel::InFlightUntil::backward_weight);
}

std::string verdict(double ratio) {
  if (std::abs(ratio - 1.0) <= kPredictionTolerance) return "ok";
  char text[32];
  std::snprintf(text, sizeof text, "off by %+.0f%%", 100.0 * (ratio - 1.0));
  return text;
}

// pred: simulate() from the spans' medians; meas/pred its ratio to the
// measured step. from means: the same from the spans' means (noisy spans,
// e.g. a core shared with other work, lift the mean above the median).
void print_header() {
  const char* format =
      "%-15s %-9s %2s | %8s %8s %5s %-11s %8s | %6s %6s | %7s %7s %7s %7s | %8s %-17s | %s\n";
  std::printf(format, "case", "sched", "M", "step ms", "pred ms", "meas/", "", "pred ms", "bubble",
              "pred", "F0 ms", "B0 ms", "F1 ms", "B1 ms", "torch ms", "torch/ours", "step ms");
  std::printf(format, "", "", "", "", "", "pred", "", "of means", "", "", "", "", "", "", "",
              "(range)", "range");
}

void print_row(const PipelineCase& c, const Settings& s, const Row& row) {
  const Measured& m = row.m;
  const double ratio = m.step_ms / row.sim.step_time;
  char torch_ms[24] = "-";
  std::string torch_ratio = "-";
  if (row.peer == Peer::torch && !row.peer_ms.empty()) {
    std::snprintf(torch_ms, sizeof torch_ms, "%.1f", bench::spread_of(row.peer_ms).median);
    torch_ratio = bench::spread_text(row.ratios);
  }
  std::vector<double> steps;
  for (const Measured& round : row.ours) steps.push_back(round.step_ms);
  const bench::Spread step = bench::spread_of(steps);
  char step_range[48] = "-";
  if (steps.size() > 1)
    std::snprintf(step_range, sizeof step_range, "%.1f-%.1f", step.low, step.high);
  std::printf(
      "%-15s %-9s %2d | %8.1f %8.1f %5.2f %-11s %8.1f | %5.1f%% %5.1f%% | %7.1f %7.1f %7.1f "
      "%7.1f | %8s %-17s | %s\n",
      c.name.c_str(), row.schedule.c_str(), s.micro_batches, m.step_ms, row.sim.step_time, ratio,
      verdict(ratio).c_str(), row.sim_of_means.step_time, 100.0 * m.bubble,
      100.0 * row.sim.bubble_fraction(), m.median.forward_ms[0], m.median.backward_ms[0],
      m.median.forward_ms[1], m.median.backward_ms[1], torch_ms, torch_ratio.c_str(), step_range);
}

// Below the wavefront's row: its peer, the same batch in one process.
void print_one_process(const PipelineCase& c, const Row& row) {
  if (row.peer_ms.empty()) return;
  std::printf(
      "  %s in one process, %d threads: %.1f ms per step (median); the wavefront's speed / one "
      "process's: %s\n",
      c.name.c_str(), kStages, bench::spread_of(row.peer_ms).median,
      bench::spread_text(row.ratios).c_str());
}

void print_memory(const PipelineCase& c, const std::vector<Row>& rows,
                  const std::vector<double>& act_mib) {
  const char* format = "%-15s %-9s | %9s %9s | %7s %7s | %8s %8s | %8s %8s\n";
  std::printf(format, "case", "sched", "in flight", "", "act MiB", "", "peak RSS", "MiB", "torch",
              "RSS MiB");
  std::printf(format, "", "", "s0", "s1", "s0", "s1", "s0", "s1", "s0", "s1");
  for (const Row& row : rows) {
    auto figure = [](double v, const char* format) {
      char text[16] = "-";
      if (v >= 0) std::snprintf(text, sizeof text, format, v);
      return std::string(text);
    };
    std::string in_flight[kStages], act[kStages], torch_rss[kStages];
    for (int r = 0; r < kStages; ++r) {
      in_flight[r] = std::to_string(row.in_flight[size_t(r)]);
      if (row.in_flight_until_w[size_t(r)] != row.in_flight[size_t(r)])
        in_flight[r] += cat(" (W ", row.in_flight_until_w[size_t(r)], ")");
      const double mib = act_mib[size_t(r)];
      act[r] = figure(mib >= 0 ? mib * row.in_flight[size_t(r)] : -1.0, "%.1f");
      torch_rss[r] = figure(
          row.torch_rss_mib[r].empty() ? -1.0 : bench::spread_of(row.torch_rss_mib[r]).median,
          "%.0f");
    }
    std::printf("%-15s %-9s | %9s %9s | %7s %7s | %8.0f %8.0f | %8s %8s\n", c.name.c_str(),
                row.schedule.c_str(), in_flight[0].c_str(), in_flight[1].c_str(), act[0].c_str(),
                act[1].c_str(), row.m.peak_rss_mib[0], row.m.peak_rss_mib[1], torch_rss[0].c_str(),
                torch_rss[1].c_str());
  }
}

// Case c's rows: the schedules it takes, each with what it is compared with.
std::vector<Row> rows_of(const PipelineCase& c, const Settings& s) {
  std::vector<Row> rows;
  for (const std::string& schedule : s.schedules) {
    // The wavefront is for time chunks, and time chunks take only it.
    if (c.time_chunks != (schedule == "wavefront")) continue;
    Row row;
    row.schedule = schedule;
    // torch.distributed.pipelining has no ZB-H1 with one stage per rank.
    if (c.time_chunks)
      row.peer = Peer::one_process;
    else if (s.torch && schedule != "zbh1")
      row.peer = Peer::torch;
    rows.push_back(row);
  }
  return rows;
}

// Case c: its rounds (a line each), then a row per schedule from its
// median-step round and what its peer runs said. The rows that ran, for the
// memory table; failed is set when a run failed.
std::vector<Row> measure_case(const PipelineCase& c, const Settings& s, bool& failed) {
  std::vector<Row> rows = rows_of(c, s);
  for (int k = 0; k < s.rounds; ++k)
    if (!run_round(c, s, k, rows)) failed = true;
  std::vector<Row> done;
  for (Row& row : rows) {
    if (row.ours.empty()) continue;
    settle(row, s);
    print_row(c, s, row);
    done.push_back(row);
  }
  for (const Row& row : done) {
    if (row.peer == Peer::one_process) print_one_process(c, row);
    if (!row.peer_note.empty())
      std::printf("  %s %s: %s\n", row.peer == Peer::torch ? "torch" : "one process",
                  row.schedule.c_str(), row.peer_note.c_str());
  }
  std::fflush(stdout);
  return done;
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_pipeline [--case gpt|resnet18_small|lstm] [--schedule NAME[,NAME...]] "
               "[--micro-batches M] [--steps N] [--warmup N] [--rounds N] [--seq T] [--batch N] "
               "[--no-torch] [--keep]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--case" && has_value) {
      s.only_case = argv[++i];
    } else if (a == "--schedule" && has_value) {
      s.schedules.clear();
      std::istringstream names(argv[++i]);
      for (std::string n; std::getline(names, n, ',');) s.schedules.push_back(n);
    } else if (a == "--micro-batches" && has_value) {
      s.micro_batches = std::atoi(argv[++i]);
    } else if (a == "--steps" && has_value) {
      s.steps = std::atoi(argv[++i]);
    } else if (a == "--warmup" && has_value) {
      s.warmup = std::atoi(argv[++i]);
    } else if (a == "--rounds" && has_value) {
      s.rounds = std::atoi(argv[++i]);
    } else if (a == "--seq" && has_value) {
      s.seq = std::atoi(argv[++i]);
    } else if (a == "--batch" && has_value) {
      s.batch = std::atoi(argv[++i]);
    } else if (a == "--no-torch") {
      s.torch = false;
    } else if (a == "--keep") {
      s.keep = true;
    } else {
      return usage();
    }
  }
  if (s.micro_batches < 1 || s.steps < 1 || s.warmup < 1 || s.rounds < 1 || s.seq < 1 ||
      s.batch < 0) {
    std::fprintf(stderr,
                 "bench_pipeline: --micro-batches, --steps, --warmup (the first step's "
                 "period needs a step before it), --rounds and --seq must be at least 1\n");
    return 2;
  }
  for (const std::string& name : s.schedules)
    if (name != "gpipe" && name != "1f1b" && name != "zbh1" && name != "wavefront") {
      std::fprintf(stderr, "bench_pipeline: --schedule %s: gpipe, 1f1b, zbh1 or wavefront\n",
                   name.c_str());
      return 2;
    }

  s.trainer = bench::self_dir() + "/trainer";
  if (access(s.trainer.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "bench_pipeline: no %s; build the trainer target too\n",
                 s.trainer.c_str());
    return 1;
  }
  char work_template[] = "/tmp/bench_pipeline.XXXXXX";
  if (!mkdtemp(work_template)) return 1;
  s.work = work_template;
  const std::string& work = s.work;
  const std::vector<PipelineCase> cases = make_cases(s, work);
  // The LSTM case runs the wavefront whichever schedules were asked for.
  if (std::none_of(s.schedules.begin(), s.schedules.end(),
                   [](const std::string& n) { return n == "wavefront"; }))
    s.schedules.push_back("wavefront");
  if (cases.empty()) return usage();
  bench::write_fake_fashion_mnist(work + "/fmnist", 64 * s.micro_batches * 16, 32);

  std::string torch_state = "off (--no-torch)";
  if (s.torch) {
    s.torch = torch_available();
    torch_state = s.torch ? "torch.distributed.pipelining, gloo, ScheduleGPipe / Schedule1F1B"
                          : "skipped: python3 cannot import torch.distributed.pipelining";
  }
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf(
      "pp=%d under `trainer launch --nproc-per-node %d` (1 thread per rank), %d micro-batches, "
      "median of %d steps after %d warm-up; %d round%s of ours then its peer, each row from its "
      "median-step round, torch/ours = median (range) of the rounds' ratios; predicted = "
      "parallel/pipeline_sim.h from the measured F, B, optimizer (meas/pred within %.0f%%: ok); "
      "torch: %s\n",
      kStages, kStages, s.micro_batches, s.steps, s.warmup, s.rounds, s.rounds == 1 ? "" : "s",
      100 * kPredictionTolerance, torch_state.c_str());
  for (const PipelineCase& c : cases) std::printf("  %s\n", c.describe.c_str());
  std::fflush(stdout);

  std::map<std::string, std::vector<Row>> results;
  print_header();
  bool failed = false;
  for (const PipelineCase& c : cases) results[c.name] = measure_case(c, s, failed);
  // Activation memory: what the schedule keeps in flight, and what the ranks used.
  std::printf(
      "\nactivation memory: in flight = micro-batches held at peak (peak_in_flight), act MiB = "
      "that x the dry run's activations per micro-batch; peak RSS = each rank's VmHWM\n");
  for (const PipelineCase& c : cases) {
    if (results[c.name].empty()) continue;
    print_memory(c, results[c.name], dry_run_activations(c, s, s.trainer, work));
  }
  if (s.keep)
    std::printf("runs, logs and traces in %s\n", work.c_str());
  else
    fs::remove_all(work);
  return failed ? 1 : 0;
}
