// Mixture of experts (layers/moe.h) checked against and timed beside a
// PyTorch twin (bench/bench_moe_torch.py, its own implementation of the
// same routing rules), in one run:
//
//   check   three small layers (d 64, hidden 128, 8 experts, 128 tokens,
//           auxiliary loss 0.01, z-loss 0.001, fixed seed): top-1 softmax
//           with capacity 1.25 (assignments dropped), top-2 softmax
//           dropless, and top-2 sigmoid with the gates normalised to sum 1,
//           one shared expert, tanh GELU and capacity 1.0 (second choices
//           dropped too). Each runs forward, loss = sum(y * v) for a probe v
//           (the auxiliary losses reach the router through the layer, scale
//           1), backward; the weights, x, v, y, the routing and every
//           gradient (x, router, each expert's weights and biases, the
//           shared expert's) go to a safetensors file (trainer/safetensors.h),
//           and the twin (one python3 for the three) rebuilds the layer from
//           it in float64, recomputes, and compares the routing, the dropped
//           count, the auxiliary losses, the output and every gradient (max
//           abs and max abs / max |ours|, at most 1e-4; exit status 1 if
//           not). Run once before the timings (--no-check skips it,
//           --check-only stops after it).
//   layer   the MoE layer's forward + backward alone (input gradient
//           included), --tokens tokens (4096) x d 256, hidden 512, 8
//           experts, top-2, capacity 1.25, --threads threads (1); the twin loads the
//           same weights and tokens, so both route the same way
//   gpt     a whole training step of a GPT whose every block's MLP is the
//           mixture of experts (models/gpt.h moe_every 1): 2 layers x 256, 4
//           heads, context 256, byte vocabulary, 8 experts of hidden 512,
//           top-2, gates normalised, capacity 1.25, auxiliary 0.01, z 0.001
//           (recipes/gpt_kjv_moe.yaml's rules), --batch sequences (8) per
//           step, cross-entropy, AdamW; at ep 1, 2 and 4. At ep > 1 the
//           experts divide over the ranks (parallel/expert_parallel.h), each
//           rank takes batch / ep sequences, the dense gradients are
//           averaged over the ranks (one allreduce after backward) and the
//           expert gradients divided by ep, as the trainer does
//           (trainer/expert_parallel_run.cpp); --threads (1) per rank. The twin
//           runs the same model, rules and layout with torch.distributed on
//           gloo (all_to_all_single with uneven splits for the rows, the
//           same single allreduce for the dense gradients).
//
// Timings alternate, ours then the twin's, for --rounds rounds (3) of each
// row; each measurement is the median of --steps timed steps (3) after
// --warmup untimed ones (1), rank 0's, after a barrier. The table gives
// each side's step time and tokens/s (the median over the rounds), our
// share of the top-k assignments dropped by the capacity (rank 0's; the
// twin logs its own to stderr), and the median and range of the rounds'
// ours/torch tokens/s ratios (above 1: ours is faster). A row whose twin
// fails (a gloo without all_to_all_single, say) shows why instead of its
// figures.
//
//   bench_moe                                   # check, layer, gpt at ep 1 2 4, with torch
//   bench_moe --check-only
//   bench_moe --rounds 5 --steps 5 --ep 1,2 --tokens 8192
//   bench_moe --no-torch --no-check --batch 4 --context 32 --tokens 512 --steps 1 --rounds 1
//
// Rank r runs on the r-th core this process may use (with --threads T on
// cores [r T, (r + 1) T)), as `trainer launch` binds; ep ranks are child
// processes joined with torchrun-style variables. Every measurement of ours
// runs in a child process, so the parent never starts the CPU kernels'
// threads it would fork. Without python3 and torch the twin's parts are
// skipped with a line saying so.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "bench/bench_util.h"
#include "comm/collectives.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "layers/moe.h"
#include "models/gpt.h"
#include "optim/optimizer.h"
#include "parallel/expert_parallel.h"
#include "trainer/safetensors.h"

using namespace trainer;
using namespace trainer::bench;

namespace {

struct Settings {
  bool check = true, check_only = false, torch = true;
  bool bind = !allowed_cores().empty();
  int rounds = 3, steps = 3, warmup = 1, threads = 1;
  std::vector<int64_t> eps{1, 2, 4};
  // The layer alone.
  int64_t tokens = 4096, d_model = 256, hidden = 512, experts = 8, top_k = 2;
  // The GPT.
  int64_t layers = 2, heads = 4, context = 256, batch = 8, vocab = 256;
  std::string work;  // a temporary directory for the files the twin reads
};

// The layer's rules shared by the timed layer and the GPT's blocks.
MoEOptions timed_moe(const Settings& s) {
  return {.d_model = s.d_model,
          .hidden = s.hidden,
          .experts = s.experts,
          .top_k = s.top_k,
          .capacity_factor = 1.25,
          .aux_loss_coef = 0.01,
          .z_loss_coef = 0.001};
}

// ---- child processes ----

// Binds this process to cores [first, first + count) of those it may use.
void bind_to_cores(int first, int count) {
  const std::vector<int> cores = allowed_cores();
  if (cores.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int i = 0; i < count; ++i) CPU_SET(cores[size_t(first + i) % cores.size()], &set);
  sched_setaffinity(0, sizeof set, &set);
}

// Runs work on `ranks` child processes (joined as a world when ranks > 1),
// rank r bound to its cores with s.threads threads; rank 0's result.
template <typename Result>
bool run_children(int ranks, const Settings& s, int port,
                  const std::function<Result(std::shared_ptr<comm::Communicator>)>& work,
                  Result& out) {
  static_assert(std::is_trivially_copyable_v<Result>);
  int fd[2];
  if (pipe(fd) != 0) return false;
  std::fflush(nullptr);  // or the children write what this process has buffered
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(fd[0]);
      if (s.bind) bind_to_cores(r * s.threads, s.threads);
      set_num_threads(s.threads);
      try {
        std::shared_ptr<comm::Communicator> world;
        if (ranks > 1) world = join_bench_world(r, ranks, port, "bench_moe");
        const Result res = work(world);
        if (r == 0 && write(fd[1], &res, sizeof res) != sizeof res) _exit(1);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_moe: rank %d: %s\n", r, e.what());
        _exit(1);
      }
      _exit(0);
    }
    if (pid < 0) break;
    pids.push_back(pid);
  }
  close(fd[1]);
  bool ok = int(pids.size()) == ranks && read(fd[0], &out, sizeof out) == sizeof out;
  close(fd[0]);
  return reap_ranks(pids) && ok;
}

// ---- the twin ----

std::string twin_script() { return std::string(TRAINER_SOURCE_DIR) + "/bench/bench_moe_torch.py"; }

bool torch_available() { return std::system("python3 -c 'import torch' >/dev/null 2>&1") == 0; }

// Runs a shell command; its stdout lines and exit status.
int run_command(const std::string& cmd, std::vector<std::string>& lines) {
  std::fflush(nullptr);
  lines.clear();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  char buf[1024];
  std::string line;
  while (std::fgets(buf, sizeof buf, p)) {
    line += buf;
    if (!line.empty() && line.back() == '\n') {
      line.pop_back();
      lines.push_back(line);
      line.clear();
    }
  }
  if (!line.empty()) lines.push_back(line);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The twin's median step seconds (its last stdout line), or -1 with the
// reason in note; its stderr goes to log.
double run_twin(const std::string& args, const std::string& log, std::string& note) {
  std::vector<std::string> lines;
  run_command(cat("python3 ", twin_script(), " ", args, " 2>", log), lines);
  const std::string last = lines.empty() ? "" : lines.back();
  double seconds = -1;
  if (std::sscanf(last.c_str(), "%lf", &seconds) == 1 && seconds > 0) return seconds;
  note = last.rfind("ERR ", 0) == 0 ? last.substr(4) : "no result";
  return -1;
}

// ---- check ----

constexpr int64_t kCheckTokens = 128;

struct CheckCase {
  const char* name;
  MoEOptions options;
};

std::vector<CheckCase> check_cases() {
  const MoEOptions base{.d_model = 64,
                        .hidden = 128,
                        .experts = 8,
                        .top_k = 2,
                        .capacity_factor = 1.25,
                        .aux_loss_coef = 0.01,
                        .z_loss_coef = 0.001};
  MoEOptions top1 = base;
  top1.top_k = 1;
  MoEOptions dropless = base;
  dropless.dropless = true;
  MoEOptions sigmoid = base;
  sigmoid.sigmoid = true, sigmoid.normalize_top_k = true, sigmoid.shared_experts = 1,
  sigmoid.capacity_factor = 1.0, sigmoid.gelu = GeluApprox::tanh;
  return {{"top-1 softmax, capacity 1.25", top1},
          {"top-2 softmax, dropless", dropless},
          {"top-2 sigmoid, normalised, 1 shared, tanh gelu, capacity 1.0", sigmoid}};
}

struct CheckResult {
  int64_t assignments = 0, dropped = 0;
  double aux = 0, z = 0;
};

// Our forward and backward of a case, everything the twin needs in file.
CheckResult run_check_case(const CheckCase& c, const std::string& file) {
  set_auxiliary_loss_scale(1.0);
  const MoEOptions& o = c.options;
  Generator gen(5);
  MoEFeedForward m(o, gen);
  Generator data(9);
  const Tensor x = randn({kCheckTokens, o.d_model}, data);
  const Tensor v = randn({kCheckTokens, o.d_model}, data);
  const Tensor xi = x.detach().requires_grad_();
  const Tensor y = m(xi);
  sum(y * v).backward();
  const MoEStats stats = m.take_stats();
  // The routing, as the layer computed it from its scores.
  Tensor logits = (*m.router)(x).detach();
  const Tensor probs = o.sigmoid ? sigmoid(logits) : softmax(logits, -1);
  const MoERouting r =
      route_tokens(probs.contiguous().to_vector<float>(), kCheckTokens, o.experts, o.top_k, {}, -1);
  std::vector<NamedTensor> out{{"x", x},
                               {"v", v},
                               {"y", y.detach()},
                               {"choice", from_vector(r.choice, {kCheckTokens, o.top_k})},
                               {"grad.x", xi.grad()}};
  for (const NamedTensor& p : m.named_parameters()) {
    out.push_back({"param." + p.name, p.tensor.detach()});
    out.push_back(
        {"grad." + p.name, p.tensor.grad().defined() ? p.tensor.grad() : zeros_like(p.tensor)});
  }
  CheckResult res;
  res.assignments = kCheckTokens * o.top_k;
  res.dropped = stats.dropped;
  res.aux = stats.aux_loss;
  res.z = stats.z_loss;
  auto number = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  write_safetensors(file, out,
                    {{"case", c.name},
                     {"d_model", cat(o.d_model)},
                     {"hidden", cat(o.hidden)},
                     {"experts", cat(o.experts)},
                     {"top_k", cat(o.top_k)},
                     {"sigmoid", o.sigmoid ? "1" : "0"},
                     {"normalize_top_k", o.normalize_top_k ? "1" : "0"},
                     {"capacity_factor", number(o.capacity_factor)},
                     {"dropless", o.dropless ? "1" : "0"},
                     {"aux_loss_coef", number(o.aux_loss_coef)},
                     {"z_loss_coef", number(o.z_loss_coef)},
                     {"shared_experts", cat(o.shared_experts)},
                     {"bias", o.bias ? "1" : "0"},
                     {"gelu", o.gelu == GeluApprox::tanh ? "tanh" : "none"},
                     {"aux_loss", number(res.aux)},
                     {"z_loss", number(res.z)},
                     {"dropped", cat(res.dropped)}});
  return res;
}

// Runs the check cases, then the twin's comparison of them all (one
// python3, when torch is there); false when ours failed or the twin found
// a difference.
bool run_check(const Settings& s, bool torch, int& port) {
  std::printf("check: d 64, hidden 128, 8 experts, %lld tokens, aux 0.01, z 0.001; %s\n",
              (long long)kCheckTokens,
              torch ? "bench_moe_torch.py --check recomputes each in float64 (tolerance 1e-4 of "
                      "the largest |value|)"
                    : "the PyTorch twin check is skipped (no torch), ours only");
  bool ok = true;
  std::string files;
  int index = 0;
  for (const CheckCase& c : check_cases()) {
    const std::string file = cat(s.work, "/check", index++, ".safetensors");
    CheckResult r;
    const bool ran = run_children<CheckResult>(
        1, s, port++, [&](std::shared_ptr<comm::Communicator>) { return run_check_case(c, file); },
        r);
    if (!ran) {
      std::printf("  ours %-60s | failed\n", c.name);
      ok = false;
      continue;
    }
    files += " " + file;
    std::printf("  ours %-60s | %lld of %lld assignments dropped, aux %.6f, z %.6f\n", c.name,
                (long long)r.dropped, (long long)r.assignments, r.aux, r.z);
  }
  if (!torch || files.empty()) return ok;
  std::vector<std::string> lines;
  const int status = run_command(cat("python3 ", twin_script(), " --check", files, " 2>&1"), lines);
  for (const std::string& line : lines) std::printf("  %s\n", line.c_str());
  if (status != 0) {
    std::printf("  FAILED: the twin differs from ours (exit status %d)\n", status);
    ok = false;
  }
  std::fflush(stdout);
  return ok;
}

// ---- timings ----

struct TimeResult {
  double step_seconds = 0;
  double dropped_share = 0;  // of the assignments, over the timed steps (rank 0's)
};

// The layer alone; writes its weights and tokens to file for the twin when
// file is not empty.
TimeResult time_layer(const Settings& s, const std::string& file) {
  set_auxiliary_loss_scale(1.0);
  Generator gen(1);
  MoEFeedForward m(timed_moe(s), gen);
  Generator data(2);
  const Tensor x = randn({s.tokens, s.d_model}, data);
  const Tensor v = randn({s.tokens, s.d_model}, data);
  if (!file.empty()) {
    std::vector<NamedTensor> out{{"x", x}, {"v", v}};
    for (const NamedTensor& p : m.named_parameters()) out.push_back({"param." + p.name, p.tensor});
    const MoEOptions o = timed_moe(s);
    write_safetensors(file, out,
                      {{"d_model", cat(o.d_model)},
                       {"hidden", cat(o.hidden)},
                       {"experts", cat(o.experts)},
                       {"top_k", cat(o.top_k)},
                       {"sigmoid", "0"},
                       {"normalize_top_k", "0"},
                       {"capacity_factor", cat(o.capacity_factor)},
                       {"dropless", "0"},
                       {"aux_loss_coef", cat(o.aux_loss_coef)},
                       {"z_loss_coef", cat(o.z_loss_coef)},
                       {"shared_experts", "0"},
                       {"bias", "1"},
                       {"gelu", "none"}});
  }
  std::vector<double> times;
  for (int i = 0; i < s.warmup + s.steps; ++i) {
    if (i == s.warmup) m.take_stats();
    const auto t0 = std::chrono::steady_clock::now();
    const Tensor xi = x.detach().requires_grad_();
    sum(m(xi) * v).backward();
    m.zero_grad();
    if (i >= s.warmup)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const MoEStats stats = m.take_stats();
  return {median(times), double(stats.dropped) / double(s.tokens * s.top_k * s.steps)};
}

// Random tokens [rows, seq] below vocab.
Tensor tokens(int64_t rows, int64_t seq, int64_t vocab, Generator& gen) {
  std::vector<float> u = uniform({rows * seq}, 0, 1, gen).to_vector<float>();
  std::vector<int64_t> t(u.size());
  for (size_t i = 0; i < u.size(); ++i) t[i] = std::min<int64_t>(vocab - 1, int64_t(u[i] * vocab));
  return from_vector(t).reshape({rows, seq});
}

// A training step of the MoE GPT on this rank (of ep = world's size).
TimeResult time_gpt(const Settings& s, std::shared_ptr<comm::Communicator> world) {
  set_auxiliary_loss_scale(1.0);
  const int ep = world ? world->size() : 1, rank = world ? world->rank() : 0;
  GPTOptions o;
  o.vocab_size = s.vocab, o.block_size = s.context, o.n_layer = s.layers, o.n_head = s.heads,
  o.n_embd = s.d_model;
  o.moe = timed_moe(s);
  o.moe.normalize_top_k = true;
  o.moe_every = 1;
  auto model = make_gpt(o);
  if (world) {
    const std::shared_ptr<ExpertParallelGroup> g = make_expert_group(world);
    for (const auto& l : model->moe_layers()) l->set_expert_parallel(g);
  }
  // The experts' parameters (this rank's) and the dense ones, the router included.
  TensorList dense, expert;
  for (const NamedTensor& p : model->named_parameters())
    (p.name.find(".experts.") != std::string::npos ? expert : dense).push_back(p.tensor);
  optim::AdamWOptions ao;
  ao.betas = {0.9, 0.99};
  ao.weight_decay = 0.1;
  optim::AdamW opt({optim::ParamGroup{model->named_parameters()}}, ao);
  // The global batch; this rank's rows of it.
  Generator gen(7);
  const int64_t rows = s.batch / ep;
  const Tensor inputs =
      tokens(s.batch, s.context, s.vocab, gen).slice(0, rank * rows, (rank + 1) * rows);
  const Tensor targets =
      tokens(s.batch, s.context, s.vocab, gen).slice(0, rank * rows, (rank + 1) * rows);
  const Tensor in = inputs.contiguous(), tg = targets.contiguous();
  std::vector<double> times;
  for (int i = 0; i < s.warmup + s.steps; ++i) {
    if (i == s.warmup) {
      if (world) comm::barrier(*world);
      for (const auto& l : model->moe_layers()) l->take_stats();
    }
    const auto t0 = std::chrono::steady_clock::now();
    Tensor loss = model->output_loss((*model)(in).flatten(0, 1), tg.flatten());
    loss.backward();
    if (world) {
      // Dense gradients averaged over the ranks (data parallelism over ep),
      // the experts' (which already sum every rank's tokens) divided by ep.
      TensorList grads;
      for (const Tensor& p : dense) {
        if (!p.grad().defined()) p.set_grad(zeros_like(p));
        grads.push_back(p.grad().reshape({-1}));
      }
      Tensor flat = concat(grads, 0);
      comm::allreduce(*world, flat, {.op = comm::ReduceOp::avg});
      int64_t at = 0;
      for (const Tensor& p : dense) {
        p.grad().copy_(flat.narrow(0, at, p.numel()).reshape(p.shape()));
        at += p.numel();
      }
      for (const Tensor& p : expert)
        if (p.grad().defined()) p.grad().copy_(p.grad() * (1.0 / ep));
    }
    opt.step();
    opt.zero_grad();
    if (i >= s.warmup)
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  int64_t dropped = 0;
  for (const auto& l : model->moe_layers()) dropped += l->take_stats().dropped;
  const double assignments =
      double(rows * s.context * s.top_k * s.steps * int64_t(model->moe_layers().size()));
  return {median(times), double(dropped) / assignments};
}

// One row's rounds: ours and the twin's tokens/s per round.
struct Rounds {
  std::vector<double> ours, torch, dropped;
  std::string torch_note;  // why the twin has no figure
  bool failed = false;
};

std::string ratio_text(const Rounds& r) {
  if (r.torch.empty() || r.torch.size() != r.ours.size()) return "-";
  std::vector<double> ratios;
  for (size_t i = 0; i < r.ours.size(); ++i) ratios.push_back(r.ours[i] / r.torch[i]);
  const auto [lo, hi] = std::minmax_element(ratios.begin(), ratios.end());
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2fx [%.2f-%.2f]", median(ratios), *lo, *hi);
  return buf;
}

void print_row(const char* what, int ranks, double tokens_per_step, const Rounds& r) {
  if (r.failed) {
    std::printf("%-18s %3d | failed\n", what, ranks);
    std::fflush(stdout);
    return;
  }
  const double ours = median(r.ours);
  std::string torch_ms = "-", torch_tps = "-";
  if (!r.torch.empty()) {
    const double t = median(r.torch);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f", 1e3 * tokens_per_step / t);
    torch_ms = buf;
    std::snprintf(buf, sizeof buf, "%.0f", t);
    torch_tps = buf;
  }
  std::printf("%-18s %3d | %9.1f %10.0f %6.2f%% | %9s %10s | %s%s\n", what, ranks,
              1e3 * tokens_per_step / ours, ours, 100 * median(r.dropped), torch_ms.c_str(),
              torch_tps.c_str(), ratio_text(r).c_str(),
              r.torch_note.empty() ? "" : ("  (torch: " + r.torch_note + ")").c_str());
  std::fflush(stdout);
}

std::string common_twin_args(const Settings& s) {
  return cat(" --steps ", s.steps, " --warmup ", s.warmup, " --threads ", s.threads,
             s.bind ? " --bind" : "");
}

bool run_timings(const Settings& s, bool torch, int& port) {
  std::printf("%-18s %3s | %9s %10s %7s | %9s %10s | %s\n", "case", "ep", "ours ms", "ours tok/s",
              "dropped", "torch ms", "torch tok/s", "ours/torch: median [range] of rounds");
  bool ok = true;
  // The layer alone.
  {
    Rounds r;
    const std::string file = s.work + "/layer.safetensors";
    for (int round = 0; round < s.rounds && !r.failed; ++round) {
      TimeResult t;
      const std::string write = torch && round == 0 ? file : "";
      if (!run_children<TimeResult>(
              1, s, port++,
              [&](std::shared_ptr<comm::Communicator>) { return time_layer(s, write); }, t)) {
        r.failed = true;
        break;
      }
      r.ours.push_back(double(s.tokens) / t.step_seconds);
      r.dropped.push_back(t.dropped_share);
      if (!torch || !r.torch_note.empty()) continue;
      const double seconds = run_twin(cat("--layer ", file, common_twin_args(s)),
                                      s.work + "/twin_layer.log", r.torch_note);
      if (seconds > 0) r.torch.push_back(double(s.tokens) / seconds);
    }
    if (!r.torch_note.empty()) r.torch.clear();
    print_row("layer fwd+bwd", 1, double(s.tokens), r);
    ok = ok && !r.failed;
  }
  // The GPT's training step at each ep.
  const double step_tokens = double(s.batch * s.context);
  for (int64_t ep : s.eps) {
    Rounds r;
    for (int round = 0; round < s.rounds && !r.failed; ++round) {
      TimeResult t;
      if (!run_children<TimeResult>(
              int(ep), s, port++,
              [&](std::shared_ptr<comm::Communicator> world) { return time_gpt(s, world); }, t)) {
        r.failed = true;
        break;
      }
      r.ours.push_back(step_tokens / t.step_seconds);
      r.dropped.push_back(t.dropped_share);
      if (!torch || !r.torch_note.empty()) continue;
      const double seconds =
          run_twin(cat("--gpt --ep ", ep, " --layers ", s.layers, " --width ", s.d_model,
                       " --heads ", s.heads, " --context ", s.context, " --batch ", s.batch,
                       " --vocab ", s.vocab, " --experts ", s.experts, " --top-k ", s.top_k,
                       " --hidden ", s.hidden, common_twin_args(s)),
                   cat(s.work, "/twin_gpt_ep", ep, ".log"), r.torch_note);
      if (seconds > 0) r.torch.push_back(step_tokens / seconds);
    }
    if (!r.torch_note.empty()) r.torch.clear();
    print_row("gpt train step", int(ep), step_tokens, r);
    ok = ok && !r.failed;
  }
  return ok;
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_moe [--check-only | --check] [--no-check] [--no-torch] [--rounds N] "
               "[--steps N] [--warmup N] [--ep N,N,..] [--tokens N] [--threads N] [--batch N] "
               "[--context N] [--no-bind]\n");
  return 2;
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", std::localtime(&now));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    auto number = [&](auto& v, int64_t least) { return next_number(argc, argv, i, v, least); };
    if (a == "--check-only" || a == "--check") {
      s.check_only = true;
    } else if (a == "--no-check") {
      s.check = false;
    } else if (a == "--no-torch") {
      s.torch = false;
    } else if (a == "--no-bind") {
      s.bind = false;
    } else if (a == "--ep" && has_value) {
      if (!parse_numbers(argv[++i], s.eps)) return usage();
    } else if (a == "--rounds" && number(s.rounds, 1)) {
    } else if (a == "--steps" && number(s.steps, 1)) {
    } else if (a == "--warmup" && number(s.warmup, 0)) {
    } else if (a == "--tokens" && number(s.tokens, 1)) {
    } else if (a == "--threads" && number(s.threads, 1)) {
    } else if (a == "--batch" && number(s.batch, 1)) {
    } else if (a == "--context" && number(s.context, 1)) {
    } else {
      return usage();
    }
  }
  for (int64_t ep : s.eps)
    if (s.experts % ep != 0 || s.batch % ep != 0) {
      std::fprintf(stderr, "bench_moe: ep %lld must divide the %lld experts and the batch %lld\n",
                   (long long)ep, (long long)s.experts, (long long)s.batch);
      return 2;
    }
  if (s.check_only) s.check = true;
  const bool torch = s.torch && torch_available();

  char dir[] = "/tmp/bench_moe.XXXXXX";
  if (!mkdtemp(dir)) {
    std::perror("bench_moe: mkdtemp");
    return 1;
  }
  s.work = dir;

  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf("bench_moe %s: %zu cores allowed, %d thread(s) per process%s; %s\n", today().c_str(),
              allowed_cores().size(), s.threads, s.bind ? ", ranks bound to cores" : "",
              torch     ? "PyTorch twin bench/bench_moe_torch.py"
              : s.torch ? "PyTorch not importable by python3: the twin check and timings are "
                          "skipped"
                        : "PyTorch twin off (--no-torch)");
  int port = 24000 + int(::getpid() % 20000);
  bool ok = true;
  if (s.check) ok = run_check(s, torch, port);
  if (!s.check_only) {
    std::printf(
        "layer: %lld tokens x d %lld, %lld experts of hidden %lld, top-%lld, softmax, capacity "
        "1.25, aux 0.01, z 0.001; forward + backward, loss sum(y * v)\n",
        (long long)s.tokens, (long long)s.d_model, (long long)s.experts, (long long)s.hidden,
        (long long)s.top_k);
    std::printf(
        "gpt: %lld layers x %lld, %lld heads, context %lld, vocabulary %lld, batch %lld (%lld "
        "tokens) per step; every MLP %lld experts of hidden %lld, top-%lld normalised, capacity "
        "1.25, aux 0.01, z 0.001; cross-entropy, AdamW; ep ranks split the batch\n",
        (long long)s.layers, (long long)s.d_model, (long long)s.heads, (long long)s.context,
        (long long)s.vocab, (long long)s.batch, (long long)(s.batch * s.context),
        (long long)s.experts, (long long)s.hidden, (long long)s.top_k);
    std::printf(
        "%d round(s), each ours then torch; each the median of %d timed steps after %d "
        "warm-up\n",
        s.rounds, s.steps, s.warmup);
    ok = run_timings(s, torch, port) && ok;
    const size_t cores = allowed_cores().size();
    for (int64_t ep : s.eps)
      if (cores > 0 && size_t(ep * s.threads) > cores) {
        std::printf("ep %lld x %d thread(s) > %zu cores: ranks share cores\n", (long long)ep,
                    s.threads, cores);
        break;
      }
  }
  std::error_code ec;
  std::filesystem::remove_all(s.work, ec);
  return ok ? 0 : 1;
}
