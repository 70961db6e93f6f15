// Tensor parallelism measured against the other ways of using two cores on
// one model: GPT (6 layers x 384, 6 heads, context 256, batch 8, byte
// vocabulary, AdamW) and a wide MLP (4 residual blocks of Linear(2048, 8192),
// GELU, Linear(8192, 2048); 64 rows; MSE against random targets; SGD), on
// synthetic data, each layout with two cores' worth of compute:
//
//   tp=2     two ranks, one thread each, the model split Megatron-style
//            (layers/tensor_parallel.h): every rank runs the whole batch
//   tp=1     one process, two threads: the whole model and batch
//   dp=2     two ranks, one thread each, half the batch each, DataParallel
//
//   step     median seconds per optimizer step over the timed steps (rank 0)
//   bytes    what rank 0 handed to the tensor-parallel collectives per step,
//            against the analytic count: for GPT without sequence
//            parallelism, 4 allreduces of B x T x d floats per layer (f and
//            g of attention and MLP, forward and backward), 2 more for the
//            vocabulary-parallel embedding and the LM head's input, and the
//            loss's row statistics (N maxima and 3N sums, f64); for the MLP 2
//            allreduces of B x d per block, less the first block's backward
//            one (the data needs no gradient). With sequence parallelism
//            each allreduce becomes an allgather and a reduce-scatter over
//            the same tensor, counted as half an allreduce each (what they
//            move), plus the sums of the gradient shares of the LayerNorms,
//            the row-parallel biases and wpe (allreduces of their size)
//
// When python3 can import torch, bench/bench_tp_torch.py runs the same
// model, batch and optimizer under torch.distributed.tensor.parallel (gloo)
// at tp=2, as DDP at dp=2 and in one process with two threads, and the
// table prints its step time and torch/ours for each layout.
//
// Each case is measured --rounds times (default 3). A round runs every
// layout once, ours and then PyTorch's, so a slow spell of the machine lands
// on both sides of a ratio; a line per round is printed before the case's
// rows. The rows print each side's median step over the rounds and
// torch/ours as the median of the per-round ratios with their range, e.g.
// "1.24x (1.10-1.31)".
//
//   bench_tp                            # both models, every layout, with torch, 3 rounds
//   bench_tp --case mlp --rounds 5      # five rounds; --rounds 1: one run of each side
//   bench_tp --case gpt --steps 5 --warmup 2 --no-torch
//   bench_tp --sequence-parallel        # tp=2 with Megatron-SP
//   bench_tp --layers 2 --width 128 --seq 64   # a smaller GPT (smoke tests)
//
// Rank r runs on the r-th core this process may use (as `trainer launch`
// binds); the ranks are child processes joined with torchrun-style variables.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "comm/bootstrap.h"
#include "comm/collectives.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "layers/linear.h"
#include "models/gpt.h"
#include "parallel/ddp.h"
#include "parallel/tensor_parallel.h"

using namespace trainer;
using namespace trainer::bench;

namespace {

struct Settings {
  std::string only_case;  // empty: both
  int steps = 8;
  int warmup = 3;
  int rounds = 3;
  bool torch = true;
  bool sequence_parallel = false;
  bool bind = allowed_cores().size() >= 2;
  // GPT
  int64_t layers = 6, width = 384, heads = 6, seq = 256, batch = 8, vocab = 256;
  // MLP
  int64_t mlp_width = 2048, mlp_blocks = 4, mlp_rows = 64;
};

enum class Layout { tp2, tp1, dp2 };
const char* layout_name(Layout l) {
  return l == Layout::tp2 ? "tp=2" : l == Layout::tp1 ? "tp=1 (2 threads)" : "dp=2";
}

// The wide MLP: x + fc2(gelu(fc1(x))) per block; split, fc1 column-wise and
// fc2 row-wise.
class WideMLP : public Module {
 public:
  WideMLP(int64_t width, int64_t blocks, Generator& gen) {
    for (int64_t b = 0; b < blocks; ++b) {
      fc1.push_back(
          register_module(cat("fc1_", b), std::make_shared<Linear>(width, 4 * width, gen)));
      fc2.push_back(
          register_module(cat("fc2_", b), std::make_shared<Linear>(4 * width, width, gen)));
    }
  }
  void shard(const std::shared_ptr<TensorParallelGroup>& g) {
    for (auto& l : fc1) l->shard(g, LinearSplit::column);
    for (auto& l : fc2) l->shard(g, LinearSplit::row);
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = x;
    for (size_t b = 0; b < fc1.size(); ++b) y = y + (*fc2[b])(gelu((*fc1[b])(y)));
    return y;
  }
  std::vector<std::shared_ptr<Linear>> fc1, fc2;
};

// Random tokens [rows, seq] below vocab.
Tensor tokens(int64_t rows, int64_t seq, int64_t vocab, Generator& gen) {
  std::vector<float> u = uniform({rows * seq}, 0, 1, gen).to_vector<float>();
  std::vector<int64_t> t(u.size());
  for (size_t i = 0; i < u.size(); ++i) t[i] = std::min<int64_t>(vocab - 1, int64_t(u[i] * vocab));
  return from_vector(t).reshape({rows, seq});
}

struct RankResult {
  double step_seconds = 0;
  double bytes_per_step = 0;
};

RankResult run_rank(const std::string& model_name, Layout layout, const Settings& s,
                    std::shared_ptr<comm::Communicator> world) {
  const int rank = world ? world->rank() : 0;
  const bool gpt = model_name == "gpt";
  std::shared_ptr<Module> model;
  std::shared_ptr<parallel::CommGroup> group;
  if (layout == Layout::tp2) group = parallel::make_comm_group(world, s.sequence_parallel);
  Generator init(0);
  if (gpt) {
    auto m = make_gpt({.vocab_size = s.vocab,
                       .block_size = s.seq,
                       .n_layer = s.layers,
                       .n_head = s.heads,
                       .n_embd = s.width});
    if (group) m->shard_tensor_parallel(group);
    model = m;
  } else {
    auto m = std::make_shared<WideMLP>(s.mlp_width, s.mlp_blocks, init);
    if (group) m->shard(group);
    model = m;
  }
  std::unique_ptr<parallel::DataParallel> dp;
  if (layout == Layout::dp2) dp = std::make_unique<parallel::DataParallel>(model, world);
  std::unique_ptr<optim::Optimizer> opt;
  std::vector<optim::ParamGroup> params{optim::ParamGroup{model->named_parameters()}};
  if (gpt) {
    optim::AdamWOptions o;
    o.betas = {0.9, 0.99};
    o.weight_decay = 0.1;
    opt = std::make_unique<optim::AdamW>(std::move(params), o);
  } else {
    opt = std::make_unique<optim::SGD>(std::move(params), kBenchSgd);
  }
  // The batch: whole on tp ranks, halved under dp (each rank its own half).
  const int64_t rows = gpt ? s.batch : s.mlp_rows;
  const int64_t mine = layout == Layout::dp2 ? rows / 2 : rows;
  Generator gen(uint64_t(layout == Layout::dp2 ? rank : 0) + 7);
  Tensor inputs, targets;
  if (gpt) {
    inputs = tokens(mine, s.seq, s.vocab, gen);
    targets = tokens(mine, s.seq, s.vocab, gen);
  } else {
    inputs = normal({mine, s.mlp_width}, 0, 1, gen);
    targets = normal({mine, s.mlp_width}, 0, 1, gen);
  }
  auto* as_gpt = dynamic_cast<GPT*>(model.get());
  const TensorList shares =
      parallel::parameters_split_as(*model, ParameterSplit::Kind::partial_gradient);
  std::vector<double> times;
  for (int i = 0; i < s.warmup + s.steps; ++i) {
    if (i == s.warmup) {
      if (world) comm::barrier(*world);
      if (group) group->reset_traffic();
    }
    auto t0 = std::chrono::steady_clock::now();
    Tensor loss;
    if (gpt) {
      Tensor logits = (*model)(inputs);
      loss = as_gpt->output_loss(logits.flatten(0, 1), targets.flatten());
    } else {
      Tensor d = (*model)(inputs)-targets;
      loss = mean(d * d);
    }
    loss.backward();
    if (dp) dp->finish();
    if (group && group->sequence_parallel()) parallel::sum_partial_gradients(shares, *group);
    opt->step();
    if (dp)
      dp->zero_grad();
    else
      opt->zero_grad();
    if (i >= s.warmup)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  RankResult r;
  r.step_seconds = median(times);
  if (group) r.bytes_per_step = double(group->traffic().total_bytes()) / double(s.steps);
  return r;
}

// Runs the layout's ranks as child processes; rank 0's result.
bool run_layout(const std::string& model, Layout layout, const Settings& s, RankResult& out) {
  const int processes = layout == Layout::tp1 ? 1 : 2;
  int fd[2];
  if (pipe(fd) != 0) return false;
  const int port = 22000 + int(::getpid() % 20000);
  std::vector<pid_t> pids;
  for (int r = 0; r < processes; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      close(fd[0]);
      if (s.bind && processes > 1) bind_to_core(r);
      set_num_threads(processes == 1 ? 2 : 1);
      std::shared_ptr<comm::Communicator> world;
      if (processes > 1) world = join_bench_world(r, processes, port, "bench_tp");
      const RankResult res = run_rank(model, layout, s, world);
      if (r == 0 && write(fd[1], &res, sizeof res) != sizeof res) _exit(1);
      _exit(0);
    }
    pids.push_back(pid);
  }
  close(fd[1]);
  bool ok = read(fd[0], &out, sizeof out) == sizeof out;
  close(fd[0]);
  return reap_ranks(pids) && ok;
}

// The analytic bytes per step of the tp=2 run (see the header).
double analytic_bytes(const std::string& model, const Settings& s) {
  if (model == "gpt") {
    const double act = double(s.batch * s.seq * s.width) * 4;
    const double rows = double(s.batch * s.seq);
    const double bytes = 4 * double(s.layers) * act + 2 * act + 4 * rows * 8;
    if (!s.sequence_parallel) return bytes;
    // And the gradient shares of what works on the sequence's parts are
    // summed: the LayerNorms, the row-parallel biases and wpe.
    return bytes + double(6 * s.layers * s.width + 2 * s.width + s.seq * s.width) * 4;
  }
  // The first block's input needs no gradient: its f has no backward allreduce.
  return (2 * double(s.mlp_blocks) - 1) * double(s.mlp_rows * s.mlp_width) * 4;
}

// bench_tp_torch.py's median step seconds, or -1 (why in note).
double measure_torch(const std::string& model, Layout layout, const Settings& s,
                     std::string& note) {
  const char* name = layout == Layout::tp2 ? "tp" : layout == Layout::tp1 ? "single" : "dp";
  std::string cmd =
      cat("python3 ", TRAINER_SOURCE_DIR, "/bench/bench_tp_torch.py --model ", model, " --layout ",
          name, " --steps ", s.steps, " --warmup ", s.warmup, s.bind ? " --bind" : "");
  if (model == "gpt")
    cmd += cat(" --layers ", s.layers, " --width ", s.width, " --heads ", s.heads, " --seq ", s.seq,
               " --batch ", s.batch, " --vocab ", s.vocab);
  else
    cmd += cat(" --width ", s.mlp_width, " --layers ", s.mlp_blocks, " --batch ", s.mlp_rows);
  cmd += " 2>/dev/null";
  std::string last;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, p)) last = line;
    pclose(p);
  }
  double seconds = -1, rss = 0;
  if (std::sscanf(last.c_str(), "%lf %lf", &seconds, &rss) == 2 && seconds > 0) return seconds;
  note = last.rfind("ERR ", 0) == 0 ? last.substr(4) : "no result";
  while (!note.empty() && note.back() == '\n') note.pop_back();
  return -1;
}

bool torch_available() {
  return std::system("python3 -c 'import torch.distributed.tensor.parallel' >/dev/null 2>&1") == 0;
}

// A layout of one case over the rounds: ours, and PyTorch's step seconds
// with torch / ours, each round where both ran.
struct LayoutRuns {
  Layout layout;
  std::vector<RankResult> ours;
  std::vector<double> torch_seconds, ratios;
  std::string note;  // why a round of PyTorch's has no figure
};

// One round of model: every layout, ours and then PyTorch's (with torch),
// and a line of what it measured. False when a run of ours failed.
bool run_round(const std::string& model, const Settings& s, bool torch, int round,
               std::vector<LayoutRuns>& layouts) {
  std::string line = cat("  round ", round + 1, ":");
  for (LayoutRuns& l : layouts) {
    RankResult r;
    if (!run_layout(model, l.layout, s, r)) {
      std::printf("%-5s %-17s | failed\n", model.c_str(), layout_name(l.layout));
      return false;
    }
    l.ours.push_back(r);
    char text[96];
    std::snprintf(text, sizeof text, " %s %.1f ms", layout_name(l.layout), 1e3 * r.step_seconds);
    line += text;
    const double t = torch ? measure_torch(model, l.layout, s, l.note) : -1;
    if (t > 0) {
      l.torch_seconds.push_back(t);
      l.ratios.push_back(t / r.step_seconds);
      std::snprintf(text, sizeof text, ", torch %.1f ms (%.2fx)", 1e3 * t, l.ratios.back());
      line += text;
    }
    line += ";";
  }
  line.pop_back();
  if (s.rounds > 1) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  return true;
}

void print_header() {
  std::printf("%-5s %-17s | %10s %12s | %12s %12s %6s | %10s %s\n", "case", "layout", "step ms",
              "items/s", "bytes/step", "analytic", "ratio", "torch ms", "torch/ours (range)");
}

// A layout's row: each side's median step over the rounds, torch/ours the
// median of the rounds' ratios; tp=2's bytes are the same every step, so
// the first round's.
void print_layout(const std::string& model, const Settings& s, const LayoutRuns& l) {
  std::vector<double> steps;
  for (const RankResult& r : l.ours) steps.push_back(r.step_seconds);
  const double step = spread_of(steps).median;
  const double items = model == "gpt" ? double(s.batch * s.seq) : double(s.mlp_rows);
  std::string bytes = "-", analytic = "-", ratio = "-";
  if (l.layout == Layout::tp2) {
    const double a = analytic_bytes(model, s);
    bytes = cat(int64_t(l.ours.front().bytes_per_step));
    analytic = cat(int64_t(a));
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", l.ours.front().bytes_per_step / a);
    ratio = buf;
  }
  std::string torch_ms = "-";
  if (!l.torch_seconds.empty()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", 1e3 * spread_of(l.torch_seconds).median);
    torch_ms = buf;
  } else if (!l.note.empty()) {
    torch_ms = "(" + l.note + ")";
  }
  std::printf("%-5s %-17s | %10.1f %12.0f | %12s %12s %6s | %10s %s\n", model.c_str(),
              layout_name(l.layout), 1e3 * step, items / step, bytes.c_str(), analytic.c_str(),
              ratio.c_str(), torch_ms.c_str(), bench::ratio_text(l.ratios).c_str());
}

int usage() {
  std::fprintf(
      stderr,
      "usage: bench_tp [--case gpt|mlp] [--steps N] [--warmup N] [--rounds N] [--no-torch] "
      "[--sequence-parallel] [--layers N] [--width N] [--heads N] [--seq N] [--batch N] "
      "[--no-bind]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&](int64_t& v) {
      if (i + 1 >= argc) return false;
      v = std::atoll(argv[++i]);
      return v > 0;
    };
    int64_t v = 0;
    if (a == "--case" && i + 1 < argc) {
      s.only_case = argv[++i];
      if (s.only_case != "gpt" && s.only_case != "mlp") return usage();
    } else if (a == "--steps" && next(v)) {
      s.steps = int(v);
    } else if (a == "--warmup" && next(v)) {
      s.warmup = int(v);
    } else if (a == "--rounds" && next(v)) {
      s.rounds = int(v);
    } else if (a == "--no-torch") {
      s.torch = false;
    } else if (a == "--sequence-parallel") {
      s.sequence_parallel = true;
    } else if (a == "--no-bind") {
      s.bind = false;
    } else if (a == "--layers" && next(s.layers)) {
    } else if (a == "--width" && next(s.width)) {
    } else if (a == "--heads" && next(s.heads)) {
    } else if (a == "--seq" && next(s.seq)) {
    } else if (a == "--batch" && next(s.batch)) {
    } else {
      return usage();
    }
  }
  const bool torch = s.torch && torch_available();
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf(
      "bench_tp: %d timed steps after %d warm-up, %d round%s of ours then torch for each layout, "
      "medians (torch/ours: median and range of the rounds' ratios); one thread per rank%s\n",
      s.steps, s.warmup, s.rounds, s.rounds == 1 ? "" : "s",
      s.sequence_parallel ? "; tp=2 with sequence parallelism" : "");
  std::printf(
      "gpt: %lld layers x %lld, %lld heads, %lld x %lld tokens, AdamW; mlp: %lld blocks "
      "of %lld -> %lld -> %lld, %lld rows, SGD\n",
      (long long)s.layers, (long long)s.width, (long long)s.heads, (long long)s.batch,
      (long long)s.seq, (long long)s.mlp_blocks, (long long)s.mlp_width,
      (long long)(4 * s.mlp_width), (long long)s.mlp_width, (long long)s.mlp_rows);
  print_header();
  for (const char* model : {"gpt", "mlp"}) {
    if (!s.only_case.empty() && s.only_case != model) continue;
    std::vector<LayoutRuns> layouts;
    for (Layout l : {Layout::tp2, Layout::tp1, Layout::dp2}) layouts.emplace_back().layout = l;
    for (int k = 0; k < s.rounds; ++k)
      if (!run_round(model, s, torch, k, layouts)) return 1;
    for (const LayoutRuns& l : layouts) print_layout(model, s, l);
    std::fflush(stdout);
  }
  return 0;
}
