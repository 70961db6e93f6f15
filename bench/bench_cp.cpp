// Context parallelism measured against one process running the whole
// sequence: a GPT (2 layers x 256, 4 heads, byte vocabulary, batch 1) at
// sequence lengths 1k, 4k and 16k, split over cp 1, 2 and 4 ranks
// (layers/context_parallel.h) with ring or all-to-all attention, causal
// load balancing on. Each rank runs one thread; the step is the forward and
// backward of the model on this rank's tokens with loss = their mean
// cross-entropy (no optimizer, no gradient sum over the ranks: the trainer
// does that with data parallelism, and it does not grow with the sequence).
//
// Every configuration runs once per round (--rounds, default 3), cp 1 and
// its pair first; ratios are taken within a round and their median printed.
//
//   step ms     rank 0's median step over the timed steps, median of rounds
//   vs t1/N     step / (step at cp 1 / N): 1 when N ranks each take 1/N of
//               one process's time; on a machine with fewer cores than N the
//               ranks share cores and it cannot reach 1
//   range       vs t1/N's lowest and highest round
//   vs p1/N     step / (step at cp 1 of a pair / N): the reference run as two
//               independent processes at once, bound to two cores (row
//               "1 pair"), so it meets what N ranks meet on a machine whose
//               cores are all busy (shared caches, memory bandwidth, the
//               VM's neighbours); --no-pair leaves it out
//   wait ms     rank 0's time per step blocked in context-parallel
//               communication: waiting for a ring message the block's
//               attention did not hide, or a whole all-to-all
//   act MiB     the allocator's peak during the step minus what it held
//               before the forward (weights, gradients, tokens): the
//               activations and the backward's transient buffers; the
//               largest of the ranks'
//   vs a1/N     act MiB / (act MiB at cp 1 / N)
//   peak MiB    the allocator's peak (core/allocator.h), the largest of the
//               ranks', as trainer logs memory_peak_mib
//   check       the whole sequence's loss (the mean of the ranks' means)
//               against cp 1's, within 1e-5, and the gradient norm of the
//               ranks' gradients summed against cp 1's, within 1e-4
//               relative; measured on a first, untimed step so a broken
//               forward or backward cannot go unnoticed (exit status 1)
//
// cp 1 always runs: it is the reference of the ratios and the check.
//
//   bench_cp                                     # 1k 4k 16k, cp 1 2 4, ring and all_to_all
//   bench_cp --seq 1024,4096 --cp 2,4 --attention ring --steps 5
//   bench_cp --seq 16384 --attention ring --steps 2 --warmup 0 --rounds 1
//   bench_cp --layers 2 --width 256 --heads 4 --no-load-balance
//   bench_cp --seq 4096 --cp 2 --attention ring --trace cp.json   # cp.json -> cp_seq4096_cp2.json
//
// --trace FILE writes, per ring run at cp > 1, a Chrome trace (parallel/trace.h;
// ui.perfetto.dev) of the timed steps, every rank a process: on its compute
// track "forward" and "backward" with, inside them, "ring block" (the
// layer's work between posting a block's messages and waiting for them:
// the block's attention) and "wait" (blocked on a message); on its comm
// track each received message from its posting to its arrival being
// waited for ("key/value block" forward and backward, "key/value gradient"
// the backward's gradient sums), so the overlap shows as a message beside
// a ring block.
//
// Rank r runs on the r-th core this process may use (as `trainer launch
// --bind-to core` binds); the ranks are child processes joined with
// torchrun-style variables.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "bench/bench_util.h"
#include "comm/collectives.h"
#include "core/allocator.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "models/gpt.h"
#include "parallel/context_parallel.h"
#include "parallel/trace.h"

using namespace trainer;
using namespace trainer::bench;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kLossTolerance = 1e-5;      // absolute
constexpr double kGradNormTolerance = 1e-4;  // relative

struct Settings {
  std::vector<int64_t> seqs{1024, 4096, 16384};
  std::vector<int64_t> cps{1, 2, 4};
  std::vector<ContextAttention> attentions{ContextAttention::ring, ContextAttention::all_to_all};
  int64_t layers = 2, width = 256, heads = 4, vocab = 256;
  int steps = 5, warmup = 1;
  int rounds = 3;  // each configuration once per round, cp 1 first
  bool load_balance = true;
  bool bind = !allowed_cores().empty();
  bool pair = allowed_cores().size() >= 2;  // the "1 pair" reference (vs p1/N)
  std::string trace;                        // empty: none
};

// One measured configuration; cp 1 has no attention of its own.
struct Run {
  int64_t seq = 0;
  int cp = 1;
  ContextAttention attention = ContextAttention::ring;
  int copies = 1;  // independent worlds of cp ranks run at once (2: cp 1's pair)
};

const char* attention_name(const Run& run) {
  if (run.cp == 1) return run.copies > 1 ? "pair" : "-";
  return run.attention == ContextAttention::ring ? "ring" : "all_to_all";
}

// What rank 0 hands the parent through a pipe.
struct RankResult {
  double step_seconds = 0;                      // rank 0's median
  double wait_seconds = 0;                      // rank 0's, per timed step
  double activation_bytes = 0, peak_bytes = 0;  // the largest of the ranks'
  double loss = 0, grad_norm = 0;               // of the whole sequence
};

// The communicator's group, recording on a Timeline what the layers do
// with it (see the header's --trace): a message's span from its posting to
// the end of its wait, the layer's work between the last posting and the
// next wait ("ring block"), and the waits themselves.
class TracedContextGroup final : public ContextParallelGroup {
 public:
  TracedContextGroup(std::shared_ptr<ContextParallelGroup> inner, parallel::Timeline& timeline)
      : inner_(std::move(inner)), timeline_(timeline) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  ContextAttention attention() const override { return inner_->attention(); }
  bool load_balance() const override { return inner_->load_balance(); }

  std::function<void()> send_next(const Tensor& t, int stream) override {
    return traced(inner_->send_next(t, stream), nullptr);
  }
  std::function<void()> recv_prev(const Tensor& t, int stream) override {
    return traced(inner_->recv_prev(t, stream),
                  stream == 0 ? "key/value block" : "key/value gradient");
  }
  Tensor all_to_all(const Tensor& t) override {
    const int64_t begin = parallel::trace_now_us();
    Tensor out = inner_->all_to_all(t);
    const int64_t end = parallel::trace_now_us();
    timeline_.add("all_to_all", parallel::Track::comm, begin, end);
    timeline_.add("wait", parallel::Track::compute, begin, end);
    return out;
  }

 private:
  // wait, recording its spans; message names the received message's span.
  std::function<void()> traced(std::function<void()> wait, const char* message) {
    const int64_t posted = parallel::trace_now_us();
    last_posted_us_ = posted;
    return [this, wait = std::move(wait), message, posted] {
      const int64_t begin = parallel::trace_now_us();
      if (last_posted_us_ >= 0) {
        timeline_.add("ring block", parallel::Track::compute, last_posted_us_, begin);
        last_posted_us_ = -1;
      }
      wait();
      const int64_t end = parallel::trace_now_us();
      timeline_.add("wait", parallel::Track::compute, begin, end);
      if (message) timeline_.add(message, parallel::Track::comm, posted, end);
    };
  }

  std::shared_ptr<ContextParallelGroup> inner_;
  parallel::Timeline& timeline_;
  int64_t last_posted_us_ = -1;  // -1: a wait since the last posting
};

// Random tokens [1, seq] below vocab.
Tensor tokens(int64_t seq, int64_t vocab, Generator& gen) {
  std::vector<float> u = uniform({seq}, 0, 1, gen).to_vector<float>();
  std::vector<int64_t> t(u.size());
  for (size_t i = 0; i < u.size(); ++i) t[i] = std::min<int64_t>(vocab - 1, int64_t(u[i] * vocab));
  return from_vector(t).reshape({1, seq});
}

// The norm of the whole sequence's gradient: each rank's is the gradient of
// its own tokens' mean, so the whole mean's is their sum over the ranks / N.
double whole_gradient_norm(const Module& model, comm::Communicator* world) {
  const double ranks = world ? world->size() : 1;
  double squares = 0;
  for (const NamedTensor& p : model.named_parameters()) {
    Tensor g = p.tensor.grad().contiguous().clone();
    if (world) comm::allreduce(*world, g);
    for (float x : g.to_vector<float>()) squares += double(x) * double(x);
  }
  return std::sqrt(squares) / ranks;
}

std::string trace_path(const std::string& file, const Run& run) {
  const bool json = file.size() > 5 && file.compare(file.size() - 5, 5, ".json") == 0;
  return cat(json ? file.substr(0, file.size() - 5) : file, "_seq", run.seq, "_cp", run.cp,
             ".json");
}

RankResult run_rank(const Run& run, const Settings& s, std::shared_ptr<comm::Communicator> world) {
  const int rank = world ? world->rank() : 0;
  GPTOptions options;
  options.vocab_size = s.vocab;
  options.block_size = run.seq;
  options.n_layer = s.layers;
  options.n_head = s.heads;
  options.n_embd = s.width;
  auto model = make_gpt(options);
  parallel::Timeline timeline(rank);
  timeline.set_recording(false);
  if (world)
    model->set_context_parallel(std::make_shared<TracedContextGroup>(
        make_context_group(world, run.attention, s.load_balance), timeline));
  const ContextLayout layout = context_layout(run.seq, rank, run.cp, s.load_balance);
  Generator gen(7);  // the same whole sequence on every rank and at every cp
  const Tensor inputs = layout.local(tokens(run.seq, s.vocab, gen));
  const Tensor targets = layout.local(tokens(run.seq, s.vocab, gen));
  auto step = [&] {
    Tensor loss;
    {
      parallel::TraceScope forward(&timeline, "forward");
      loss = model->output_loss((*model)(inputs).flatten(0, 1), targets.flatten());
    }
    parallel::TraceScope backward(&timeline, "backward");
    loss.backward();
    return loss;
  };

  // The checked step. Its gradients then stay as each parameter's gradient
  // destination, cleared before every later step, as the trainer's data
  // parallelism keeps them in its buckets: what the allocator holds before
  // a timed step's forward is the weights, their gradients and the tokens,
  // and backward writes the gradients there.
  RankResult r;
  r.loss = double(step().item<float>()) / run.cp;
  if (world) comm::allreduce(*world, &r.loss, 1, DType::f64);
  r.grad_norm = whole_gradient_norm(*model, world.get());
  for (const NamedTensor& p : model->named_parameters())
    p.tensor.set_grad_destination(p.tensor.grad().contiguous());
  const auto timed_step = [&] {
    for (const NamedTensor& p : model->named_parameters()) p.tensor.set_grad(Tensor());
    return step();
  };

  for (int i = 0; i < s.warmup; ++i) timed_step();
  if (world) comm::barrier(*world);
  Allocator& memory = allocator(Device{});
  std::vector<double> times;
  double activation = 0, peak = 0;
  timeline.set_recording(true);
  for (int i = 0; i < s.steps; ++i) {
    const int64_t before = memory.stats().current_bytes;
    memory.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    timed_step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    const int64_t top = memory.stats().peak_bytes;
    activation = std::max(activation, double(top - before));
    peak = std::max(peak, double(top));
  }
  timeline.set_recording(false);
  r.step_seconds = median(times);
  const auto waits = [](const parallel::TraceSpan& span) { return span.name == "wait"; };
  r.wait_seconds = double(parallel::covered_us(timeline.spans(), waits)) / 1e6 / s.steps;
  if (world) {
    double bytes[2] = {activation, peak};
    comm::allreduce(*world, bytes, 2, DType::f64, {.op = comm::ReduceOp::max});
    activation = bytes[0];
    peak = bytes[1];
    if (!s.trace.empty() && run.attention == ContextAttention::ring)
      timeline.write_merged(*world, trace_path(s.trace, run));
    comm::barrier(*world);
  }
  r.activation_bytes = activation;
  r.peak_bytes = peak;
  return r;
}

// Runs the configuration's ranks as child processes; rank 0's result.
bool run_ranks(const Run& run, const Settings& s, int port, RankResult& out) {
  int fd[2];
  if (pipe(fd) != 0) return false;
  std::fflush(nullptr);  // or the children write what this process has buffered
  std::vector<pid_t> pids;
  for (int at = 0; at < run.cp * run.copies; ++at) {
    const int r = at % run.cp;
    const pid_t pid = fork();
    if (pid == 0) {
      close(fd[0]);
      if (s.bind) bind_to_core(at);
      set_num_threads(1);
      try {
        std::shared_ptr<comm::Communicator> world;
        if (run.cp > 1) world = join_bench_world(r, run.cp, port + at / run.cp, "bench_cp");
        const RankResult res = run_rank(run, s, world);
        if (at == 0 && write(fd[1], &res, sizeof res) != sizeof res) _exit(1);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_cp: rank %d: %s\n", r, e.what());
        _exit(1);
      }
      _exit(0);
    }
    pids.push_back(pid);
  }
  close(fd[1]);
  bool ok = read(fd[0], &out, sizeof out) == sizeof out;
  close(fd[0]);
  return reap_ranks(pids) && ok;
}

bool parse_attentions(const std::string& text, std::vector<ContextAttention>& out) {
  out.clear();
  for (size_t at = 0; at <= text.size();) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string name = text.substr(at, comma - at);
    if (name == "ring")
      out.push_back(ContextAttention::ring);
    else if (name == "all_to_all")
      out.push_back(ContextAttention::all_to_all);
    else
      return false;
    at = comma + 1;
  }
  return !out.empty();
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_cp [--seq N,N,..] [--cp N,N,..] [--attention ring,all_to_all] "
               "[--steps N] [--warmup N] [--rounds N] [--layers N] [--width N] [--heads N] "
               "[--no-load-balance] [--no-bind] [--no-pair] [--trace FILE]\n");
  return 2;
}

// The check column: loss difference and "ok", or what failed.
std::string check(const RankResult& got, const RankResult& reference, bool& ok) {
  const double loss_diff = std::abs(got.loss - reference.loss);
  const double norm_diff = std::abs(got.grad_norm - reference.grad_norm) / reference.grad_norm;
  const bool pass = loss_diff <= kLossTolerance && norm_diff <= kGradNormTolerance;
  ok = ok && pass;
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1e %s", loss_diff, pass ? "ok" : "");
  std::string text = buf;
  if (!pass)
    text += cat("FAILED (loss ", got.loss, " vs ", reference.loss, ", gradient norm ",
                got.grad_norm, " vs ", reference.grad_norm, ")");
  return text;
}

// A configuration's rounds against cp 1's and, when not null, the pair's of
// the same rounds: times as medians, each round's ratio taken within the
// round (vs t1/N's range beside it), memory as the largest round's.
void print_row(const Run& run, const std::vector<RankResult>& rounds,
               const std::vector<RankResult>& reference, const std::vector<RankResult>* pair,
               const std::string& check_text) {
  std::vector<double> steps, waits, vs_one, vs_pair;
  double activation = 0, peak = 0, reference_activation = 0;
  for (size_t k = 0; k < rounds.size(); ++k) {
    const RankResult& r = rounds[k];
    steps.push_back(r.step_seconds);
    waits.push_back(r.wait_seconds);
    vs_one.push_back(r.step_seconds * run.cp / reference[k].step_seconds);
    if (pair) vs_pair.push_back(r.step_seconds * run.cp / (*pair)[k].step_seconds);
    activation = std::max(activation, r.activation_bytes);
    peak = std::max(peak, r.peak_bytes);
    reference_activation = std::max(reference_activation, reference[k].activation_bytes);
  }
  const Spread one = spread_of(vs_one);
  char range[32], vs_p[16] = "-";
  std::snprintf(range, sizeof range, "%.2f-%.2f", one.low, one.high);
  if (pair) std::snprintf(vs_p, sizeof vs_p, "%.2f", spread_of(vs_pair).median);
  std::printf("%6lld %3d %-10s | %9.1f %7.2f %9s %7s %8.1f | %8.1f %7.2f %8.1f | %s\n",
              (long long)run.seq, run.cp, attention_name(run), 1e3 * spread_of(steps).median,
              one.median, range, vs_p, 1e3 * spread_of(waits).median, activation / kMiB,
              activation * run.cp / reference_activation, peak / kMiB, check_text.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    auto number = [&](auto& v, int64_t least) { return next_number(argc, argv, i, v, least); };
    if (a == "--seq" && has_value) {
      if (!parse_numbers(argv[++i], s.seqs)) return usage();
    } else if (a == "--cp" && has_value) {
      if (!parse_numbers(argv[++i], s.cps)) return usage();
    } else if (a == "--attention" && has_value) {
      if (!parse_attentions(argv[++i], s.attentions)) return usage();
    } else if (a == "--steps" && number(s.steps, 1)) {
    } else if (a == "--warmup" && number(s.warmup, 0)) {
    } else if (a == "--rounds" && number(s.rounds, 1)) {
    } else if (a == "--layers" && number(s.layers, 1)) {
    } else if (a == "--width" && number(s.width, 1)) {
    } else if (a == "--heads" && number(s.heads, 1)) {
    } else if (a == "--no-load-balance") {
      s.load_balance = false;
    } else if (a == "--no-bind") {
      s.bind = false;
    } else if (a == "--no-pair") {
      s.pair = false;
    } else if (a == "--trace" && has_value) {
      s.trace = argv[++i];
    } else {
      return usage();
    }
  }
  const size_t cores = allowed_cores().size();
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf(
      "bench_cp: GPT %lld layers x %lld, %lld heads, vocabulary %lld, batch 1; forward + "
      "backward, loss = mean cross-entropy; %d timed steps after %d warm-up and 1 checked; %d "
      "round%s, medians; one thread per rank, %s%zu cores; causal load balancing %s\n",
      (long long)s.layers, (long long)s.width, (long long)s.heads, (long long)s.vocab, s.steps,
      s.warmup, s.rounds, s.rounds == 1 ? "" : "s", s.bind ? "ranks bound to " : "", cores,
      s.load_balance ? "on" : "off");
  std::printf("%6s %3s %-10s | %9s %7s %9s %7s %8s | %8s %7s %8s | %s\n", "seq", "cp", "attention",
              "step ms", "vs t1/N", "range", "vs p1/N", "wait ms", "act MiB", "vs a1/N", "peak MiB",
              "check: |loss - cp 1's|");
  // Below the kernel's ephemeral ports (32768 up), where other programs'
  // connections take theirs.
  const int base_port = 20000 + int(::getpid() % 10000);
  int ports = 0;
  bool ok = true;
  for (int64_t seq : s.seqs) {
    // cp 1, its pair, then every cp and attention, in each round.
    std::vector<Run> runs{{seq, 1, ContextAttention::ring}};
    if (s.pair) runs.push_back({seq, 1, ContextAttention::ring, 2});
    for (int64_t cp : s.cps)
      if (cp != 1)
        for (ContextAttention attention : s.attentions) runs.push_back({seq, int(cp), attention});
    std::vector<std::vector<RankResult>> got(runs.size());
    std::vector<bool> failed(runs.size(), false);
    for (int k = 0; k < s.rounds; ++k)
      for (size_t i = 0; i < runs.size(); ++i) {
        RankResult r;
        if (failed[i]) continue;
        if (run_ranks(runs[i], s, base_port + ports++ % 2000, r))
          got[i].push_back(r);
        else
          failed[i] = true;
      }
    if (failed[0]) {
      std::printf("%6lld %3d %-10s | failed\n", (long long)seq, 1, "-");
      return 1;
    }
    const bool paired = s.pair && !failed[1];
    const std::vector<RankResult>* pair = paired ? &got[1] : nullptr;
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& run = runs[i];
      if (failed[i]) {
        std::printf("%6lld %3d %-10s | failed\n", (long long)seq, run.cp, attention_name(run));
        ok = ok && run.copies > 1;  // a missing pair only drops its column
        continue;
      }
      std::string text = "reference";
      if (i > 0)
        for (const RankResult& r : got[i]) {
          text = check(r, got[0][0], ok);
          if (text.find("FAILED") != std::string::npos) break;
        }
      print_row(run, got[i], got[0], run.cp > 1 || run.copies > 1 ? pair : nullptr, text);
      if (!s.trace.empty() && run.cp > 1 && run.attention == ContextAttention::ring)
        std::printf("  trace: %s\n", trace_path(s.trace, run).c_str());
    }
  }
  for (int64_t cp : s.cps)
    if (size_t(cp) > cores && cores > 0) {
      std::printf("cp %lld > %zu cores: ranks share cores, so vs t1/N cannot reach 1\n",
                  (long long)cp, cores);
      break;
    }
  return ok ? 0 : 1;
}
