// Activation checkpointing measured (parallel.recompute, layers/block_list.h):
// GPT (6 layers, d_model 384, 6 heads, context 256, a 73-symbol vocabulary
// as the KJV corpus's, dropout 0.1) trained with AdamW on random tokens at
// batch 8 on one thread, with recompute none and blocks, each in a process of
// its own (forked) so that each peak is its own:
//
//   step ms     median of the timed steps (forward, backward, optimizer)
//   peak RSS    the process's VmHWM after its steps: model, gradients,
//               optimizer state and the step's activations, every buffer
//               the allocator caches included
//   alloc peak  the allocator's peak over a step above what it held before
//               (activations and gradients; the figure --dry-run measures)
//   loss        the last step's: the same bits under both settings
//
// The last line prints blocks/none for each figure.
//
//   bench_recompute                                   # 6 x 384, T 256, batch 8, 5 steps
//   bench_recompute --layers 2 --width 64 --heads 2 --seq 32 --batch 2 --steps 1
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "models/registry.h"
#include "optim/optimizer.h"

using namespace trainer;

namespace {

struct Settings {
  int64_t layers = 6, width = 384, heads = 6, seq = 256, batch = 8;
  int steps = 5, warmup = 1, threads = 1;
};

// What one forked run sends back through its pipe.
struct Result {
  double step_ms = 0, peak_rss_mib = 0, alloc_peak_mib = 0;
  float loss = 0;
  bool ok = false;
};

double vm_hwm_mib() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  return 0;
}

// Tokens [batch, seq] below vocab, from gen.
Tensor random_tokens(const Settings& s, int64_t vocab, Generator& gen) {
  Tensor u = uniform({s.batch, s.seq}, 0.0, double(vocab) - 1e-3, gen);
  std::vector<float> values = u.to_vector<float>();
  std::vector<int64_t> tokens(values.size());
  for (size_t i = 0; i < values.size(); ++i) tokens[i] = int64_t(values[i]);
  return from_vector<int64_t>(tokens, {s.batch, s.seq});
}

// Trains the model warmup + steps steps in this process.
Result train(const Settings& s, bool recompute) {
  set_num_threads(s.threads);
  const int64_t vocab = 73;
  std::shared_ptr<Model> model = make_model("gpt", {.dropout = 0.1,
                                                    .vocab_size = vocab,
                                                    .context = s.seq,
                                                    .n_layer = s.layers,
                                                    .n_head = s.heads,
                                                    .d_model = s.width});
  model->set_recompute(recompute);
  optim::AdamWOptions options;
  options.lr = 1e-3;
  optim::AdamW adamw({optim::ParamGroup{model->named_parameters()}}, options);
  Generator gen(1);
  Allocator& a = allocator(Device{});
  std::vector<double> ms;
  Result r;
  for (int step = 0; step < s.warmup + s.steps; ++step) {
    Tensor tokens = random_tokens(s, vocab, gen), targets = random_tokens(s, vocab, gen);
    const int64_t before = a.stats().current_bytes;
    a.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    Tensor logits = model->forward(tokens);
    Tensor loss = model->output_loss(logits.reshape({s.batch * s.seq, vocab}),
                                     targets.reshape({s.batch * s.seq}));
    logits = Tensor();
    loss.backward();
    adamw.step();
    adamw.zero_grad();
    const double elapsed =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    r.alloc_peak_mib = double(a.stats().peak_bytes - before) / double(1 << 20);
    r.loss = loss.item<float>();
    if (step >= s.warmup) ms.push_back(elapsed);
  }
  std::sort(ms.begin(), ms.end());
  r.step_ms = ms[ms.size() / 2];
  r.peak_rss_mib = vm_hwm_mib();
  r.ok = true;
  return r;
}

// train() in a forked child, its result read back through a pipe.
Result train_forked(const Settings& s, bool recompute) {
  int fd[2];
  if (pipe(fd) != 0) return {};
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    const Result r = train(s, recompute);
    const ssize_t n = write(fd[1], &r, sizeof r);
    _exit(n == ssize_t(sizeof r) ? 0 : 1);
  }
  close(fd[1]);
  Result r;
  const bool got = pid > 0 && read(fd[0], &r, sizeof r) == ssize_t(sizeof r);
  close(fd[0]);
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  if (!got || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return {};
  return r;
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_recompute [--layers N] [--width D] [--heads H] [--seq T] "
               "[--batch B] [--steps N] [--warmup N] [--threads N]\n");
  return 2;
}

bool parse(int argc, char** argv, Settings& s) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return false;
    const long long v = std::atoll(argv[++i]);
    if (v <= 0 && flag != "--warmup") return false;
    if (flag == "--layers")
      s.layers = v;
    else if (flag == "--width")
      s.width = v;
    else if (flag == "--heads")
      s.heads = v;
    else if (flag == "--seq")
      s.seq = v;
    else if (flag == "--batch")
      s.batch = v;
    else if (flag == "--steps")
      s.steps = int(v);
    else if (flag == "--warmup")
      s.warmup = int(std::max(0LL, v));
    else if (flag == "--threads")
      s.threads = int(v);
    else
      return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  if (!parse(argc, argv, s)) return usage();
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf(
      "GPT %lld x %lld, %lld heads, context %lld, batch %lld, AdamW, %d thread(s), "
      "median of %d steps after %d warm-up\n",
      (long long)s.layers, (long long)s.width, (long long)s.heads, (long long)s.seq,
      (long long)s.batch, s.threads, s.steps, s.warmup);
  std::printf("%-5s %-9s | %9s %13s %15s | %12s\n", "model", "recompute", "step ms", "peak RSS MiB",
              "alloc peak MiB", "last loss");
  Result results[2];
  const char* names[2] = {"none", "blocks"};
  for (int k = 0; k < 2; ++k) {
    results[k] = train_forked(s, k == 1);
    if (!results[k].ok) {
      std::fprintf(stderr, "bench_recompute: the %s run failed\n", names[k]);
      return 1;
    }
    const Result& r = results[k];
    std::printf("%-5s %-9s | %9.1f %13.1f %15.1f | %12.6f\n", "gpt", names[k], r.step_ms,
                r.peak_rss_mib, r.alloc_peak_mib, double(r.loss));
  }
  const Result &none = results[0], &blocks = results[1];
  std::printf("blocks/none: step time %.2fx, peak RSS %.2fx, alloc peak %.2fx; loss %s\n",
              blocks.step_ms / none.step_ms, blocks.peak_rss_mib / none.peak_rss_mib,
              blocks.alloc_peak_mib / none.alloc_peak_mib,
              std::memcmp(&none.loss, &blocks.loss, sizeof(float)) == 0 ? "identical" : "DIFFERS");
  return 0;
}
