// Training-step throughput and peak memory: forward, backward and an SGD
// (momentum) step on synthetic data, for the small CNN at batch 128,
// ResNet-18 at 64x64 and 224x224 (and with the 3x3 stem at 28x28, batch 8:
// bench_pipeline's), and ResNet-50 at 224x224, and in tokens/s
// for the LSTM language model (2 x 512, sequence 128, batch 32, byte
// vocabulary), GPT (6 layers, 384 wide, 6 heads, context 256, batch 8,
// byte vocabulary) and Llama (6 layers, 384 wide, 6 heads sharing 2
// key/value heads, SwiGLU 1024, context 256, batch 8, a 2048-token subword
// vocabulary; PyTorch's side is transformers' LlamaForCausalLM). Each case runs in its own child
// process so its peak resident memory is its own.
//
// When python3 can import torch, bench/bench_train_torch.py measures the
// same models (torchvision's ResNets, channels-last, same batch, same
// threads) in the same run and the table prints both sides and the ratio.
//
// Rounds: single runs on a shared 2-vCPU machine swing by 30%, so each case
// is measured --rounds times (default 3), ours and PyTorch's alternated,
// each in a fresh process; a row gives the medians of both sides and the
// median of the per-round ratios with their range (min-max).
//
// Distance to the limit: before the cases, our own matmul (core/ops.h) is
// timed on large square f32 products (and bf16 ones under --precision bf16)
// at each thread count; the fastest is "peak". Each case's model FLOPs per
// training step are 3 x its forward FLOPs (matmuls and linears,
// convolutions, attention's QK^T and AV in full, LSTM gate GEMMs; the MFU
// convention), counted analytically by the planner's model descriptions
// (parallel/planner.h); a row gives both sides' GFLOP/s and ours as a
// fraction of the peak. --self-check prints the counter against published
// ResNet figures and exits.
//
//   bench_train                       # all cases, 1 and 2 threads, 3 rounds
//   bench_train --threads 2 --steps 5 --case resnet18_64 --rounds 5
//   bench_train --case resnet50_224 --skip-torch --rounds 1   # ours once (for profiling)
//   bench_train --precision bf16      # forward + loss under AutocastGuard(bf16) on both
//                                     # sides (torch.autocast("cpu", torch.bfloat16))
//   bench_train --isa avx2            # both sides limited to AVX2, as on a CPU without
//                                     # AVX-512 (oneDNN, MKL, ATen and our own loops)
//   bench_train --self-check          # the FLOP counter against ResNet-50's 4.1 GMACs
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/autocast.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "parallel/planner.h"

using namespace trainer;
using namespace trainer::bench;

namespace {

// --precision: the autocast dtype of forward and loss (f32: off).
DType g_precision = DType::f32;

const ImageCase kCases[] = {
    {"small_cnn_28", "small_cnn", 128, 28, 1, 10},
    // bench_pipeline's ResNet-18: the 3x3 stem, 28x28 grey images, its micro-batch.
    {"resnet18_small_28", "resnet18_small", 8, 28, 1, 10},
    {"resnet18_64", "resnet18", 32, 64, 3, 1000},
    {"resnet18_224", "resnet18", 16, 224, 3, 1000},
    {"resnet50_224", "resnet50", 16, 224, 3, 1000},
};

// Median seconds per step over `steps` timed steps after 2 warm-up steps.
double run_case(const ImageCase& c, int steps) {
  auto model = make_case_model(c);
  optim::SGD sgd = make_sgd(*model);
  Generator gen(1);
  Tensor images = normal({c.batch, c.size, c.size, c.channels}, 0, 1, gen).permute({0, 3, 1, 2});
  Tensor labels = from_vector(std::vector<int64_t>(size_t(c.batch), 3));
  return median_step_seconds(steps, [&] {
    Tensor loss;
    {
      AutocastGuard autocast(g_precision);
      loss = cross_entropy((*model)(images), labels);
    }
    loss.backward();
    sgd.step();
    sgd.zero_grad();
  });
}

// Token cases: a language model on random tokens, loss over every position.
struct LMCase {
  const char* name;
  int64_t batch, seq, vocab, width, layers;
  int64_t heads;         // GPT and Llama (0 for the LSTM)
  int64_t kv_heads = 0;  // Llama
  int64_t intermediate = 0;
};

const LMCase kLMCases[] = {
    {"lstm_lm", 32, 128, 256, 512, 2, 0},
    {"gpt", 8, 256, 256, 384, 6, 6},
    {"llama", 8, 256, 2048, 384, 6, 6, 2, 1024},
};

std::shared_ptr<Module> make_lm(const LMCase& c) {
  const bool lstm = std::strcmp(c.name, "lstm_lm") == 0;
  const bool llama = std::strcmp(c.name, "llama") == 0;
  return make_model(c.name, {.dropout = 0.0,
                             .vocab_size = c.vocab,
                             .context = c.seq,
                             .n_layer = c.layers,
                             .n_head = lstm ? 1 : c.heads,
                             .d_model = c.width,
                             .hidden = c.width,
                             // The LSTM LM's decoder is its own, as Llama's LM head.
                             .tie_weights = !lstm && !llama,
                             .intermediate_size = c.intermediate,
                             .n_kv_head = c.kv_heads});
}

// Median seconds per training step of a language model (the LSTM from a zero state).
double run_lm_case(const LMCase& c, int steps) {
  auto model = make_lm(c);
  optim::SGD sgd = make_sgd(*model);
  Generator gen(1);
  Tensor tokens = uniform({c.batch, c.seq}, 0, double(c.vocab), gen).to(DType::i64);
  Tensor targets = uniform({c.batch * c.seq}, 0, double(c.vocab), gen).to(DType::i64);
  return median_step_seconds(steps, [&] {
    Tensor loss;
    {
      AutocastGuard autocast(g_precision);
      Tensor logits = (*model)(tokens).reshape({c.batch * c.seq, c.vocab});
      loss = cross_entropy(logits, targets);
    }
    loss.backward();
    sgd.step();
    sgd.zero_grad();
  });
}

// ---- model FLOPs ----

// A case's forward FLOPs per sample (per sequence for a language model), from
// the planner's analytic descriptions of the same architectures.
parallel::ModelDesc describe_model(const ImageCase& c) {
  const std::string model = c.model;
  if (model == "small_cnn") return parallel::small_cnn_model(c.channels, c.size, c.classes);
  // "resnet18", "resnet50", "resnet18_small" (the 3x3 stem without max-pool)
  return parallel::resnet_model({.depth = std::atoi(model.c_str() + std::strlen("resnet")),
                                 .num_classes = c.classes,
                                 .in_channels = c.channels,
                                 .image_size = c.size,
                                 .small = model.ends_with("_small")});
}

parallel::ModelDesc describe_model(const LMCase& c) {
  const std::string model = c.name;
  if (model == "lstm_lm")
    return parallel::lstm_lm_model(c.vocab, c.width, c.width, c.layers, c.seq, false);
  if (model == "llama")
    return parallel::llama_model({.n_layer = c.layers,
                                  .n_head = c.heads,
                                  .n_kv_head = c.kv_heads,
                                  .d_model = c.width,
                                  .intermediate = c.intermediate,
                                  .context = c.seq,
                                  .vocab = c.vocab,
                                  .tie_weights = false});
  return parallel::gpt_model({.n_layer = c.layers,
                              .n_head = c.heads,
                              .d_model = c.width,
                              .context = c.seq,
                              .vocab = c.vocab,
                              .pad_vocab_to = 1,  // the byte vocabulary as it is
                              .tie_weights = true});
}

// Model FLOPs of one training step per sample (per token for a language
// model): forward, and backward at twice the forward.
double step_flops_per_item(const parallel::ModelDesc& model) {
  return 3 * model.forward_flops() / model.tokens_per_sample;
}

// One row of the table: a case with both sides' runs and its FLOPs.
struct Bench {
  const char* name;
  int64_t batch;
  int64_t tokens_per_sample;              // a language model's sequence (its rows in tok/s), else 1
  double flops_per_item;                  // training-step FLOPs per sample or token
  std::function<double(int steps)> ours;  // samples or tokens per second
  std::string torch_args;                 // the case's arguments of bench_train_torch.py
};

std::vector<Bench> all_benches() {
  std::vector<Bench> benches;
  for (const ImageCase& c : kCases)
    benches.push_back({c.name, c.batch, 1, step_flops_per_item(describe_model(c)),
                       [&c](int steps) { return double(c.batch) / run_case(c, steps); },
                       std::string("--model ") + c.model + " --batch " + std::to_string(c.batch) +
                           " --size " + std::to_string(c.size) + " --channels " +
                           std::to_string(c.channels) + " --classes " + std::to_string(c.classes)});
  for (const LMCase& c : kLMCases)
    benches.push_back({c.name, c.batch, c.seq, step_flops_per_item(describe_model(c)),
                       [&c](int steps) { return double(c.batch * c.seq) / run_lm_case(c, steps); },
                       "--model " + std::string(c.name) + " --batch " + std::to_string(c.batch) +
                           " --seq " + std::to_string(c.seq) + " --classes " +
                           std::to_string(c.vocab) + " --size " + std::to_string(c.width) +
                           " --layers " + std::to_string(c.layers) + " --heads " +
                           std::to_string(c.heads) + " --kv-heads " + std::to_string(c.kv_heads) +
                           " --intermediate " + std::to_string(c.intermediate)});
  return benches;
}

// --self-check: the counter against the published forward cost of ResNet-50
// (4.1 GMACs per 224x224 image) and ResNet-18 (1.82), then every case's
// step. False when ResNet-50 is more than 2% off.
bool self_check() {
  const double r50 = parallel::resnet_model({.depth = 50}).forward_flops() / 2e9;
  const double r18 = parallel::resnet_model({.depth = 18}).forward_flops() / 2e9;
  const bool ok = std::abs(r50 / 4.1 - 1) <= 0.02;
  std::printf(
      "flop counter: resnet50 224x224 %.3f GMACs forward per image (published 4.1), resnet18 "
      "%.3f (published 1.82): %s\n",
      r50, r18, ok ? "ok, within 2%" : "NOT within 2%");
  for (const Bench& b : all_benches()) {
    const double per_step = b.flops_per_item * double(b.batch * b.tokens_per_sample);
    std::printf("%-17s %5lld | %9.2f GFLOP per training step (3 x forward)\n", b.name,
                (long long)b.batch, per_step / 1e9);
  }
  return ok;
}

// ---- the peak ----

// Our matmul's best rate here, GFLOP/s: the fastest of 5 runs of each large
// square product (after one untimed run, which creates the primitive), on
// inputs of dtype. Two sizes, since which one runs fastest differs between
// machines and thread counts.
double matmul_peak_gflops(DType dtype) {
  autograd::NoGradGuard no_grad;
  Generator gen(0, kStreamDefault);
  double best = 0;
  for (int64_t n : {1024, 2048}) {
    Tensor a = uniform({n, n}, -1, 1, gen, dtype), b = uniform({n, n}, -1, 1, gen, dtype);
    matmul(a, b);
    for (int rep = 0; rep < 5; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      Tensor c = matmul(a, b);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * double(n) * double(n) * double(n) / s / 1e9);
    }
  }
  return best;
}

// ---- measuring ----

struct Result {
  double per_second = 0;  // samples (tokens, matmul GFLOP) per second
  double peak_mib = 0;
  bool ok = false;
};

// Runs per_second() in a child process at `threads` threads.
Result measure_in_child(const std::function<double()>& per_second, int threads) {
  int fd[2];
  if (pipe(fd) != 0) return {};
  pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    set_num_threads(threads);
    double sps = per_second();
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
  r.per_second = sps;
  r.peak_mib = double(usage.ru_maxrss) / 1024.0;
  return r;
}

// Runs bench_train_torch.py with args; empty result if torch is unavailable.
Result measure_torch(const std::string& args, int threads, int steps) {
  std::string cmd = std::string("python3 ") + TRAINER_SOURCE_DIR + "/bench/bench_train_torch.py " +
                    args + " --threads " + std::to_string(threads) + " --steps " +
                    std::to_string(steps) + " --precision " +
                    (g_precision == DType::bf16 ? "bf16" : "fp32") + " 2>/dev/null";
  Result r;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    r.ok = std::fscanf(p, "%lf %lf", &r.per_second, &r.peak_mib) == 2;
    r.ok = pclose(p) == 0 && r.ok;
  }
  return r;
}

// ---- the table ----

// The medians of one side over its rounds that succeeded (ok = false: none did).
Result median_result(const std::vector<Result>& rounds) {
  std::vector<double> rates, mib;
  for (const Result& r : rounds)
    if (r.ok) {
      rates.push_back(r.per_second);
      mib.push_back(r.peak_mib);
    }
  if (rates.empty()) return {};
  return {spread_of(rates).median, spread_of(mib).median, true};
}

// "1.42x (1.31-1.55)": the median of the per-round ratios and their range
// ("1.42x" alone for one ratio, "-" for none).
std::string ratio_text(const std::vector<double>& ratios) {
  if (ratios.empty()) return "-";
  char text[48];
  const Spread spread = spread_of(ratios);
  if (ratios.size() == 1)
    std::snprintf(text, sizeof text, "%.2fx", spread.median);
  else
    std::snprintf(text, sizeof text, "%.2fx (%.2f-%.2f)", spread.median, spread.low, spread.high);
  return text;
}

// "case batch thr | ours peak-MiB | torch peak-MiB | ratio": what a round's
// line and a case's row share; the ratio padded to `ratio_width`.
void print_sides(const char* label, const char* batch, const char* threads, const Result& ours,
                 const Result& torch, const std::string& ratio, int ratio_width) {
  char torch_cols[64] = "           -         -";
  if (torch.ok)
    std::snprintf(torch_cols, sizeof torch_cols, "%12.1f %9.0f", torch.per_second, torch.peak_mib);
  std::printf("%-17s %5s %3s | %12.1f %9.0f | %s | %-*s", label, batch, threads, ours.per_second,
              ours.peak_mib, torch_cols, ratio_width, ratio.c_str());
}

void print_header(bool tokens) {  // tokens: a language model's table
  const char* unit = tokens ? "tok/s" : "samp/s";
  std::printf("%-17s %5s %3s | %12s %9s | %12s %9s | %-17s | %8s %7s %10s\n", "case", "batch",
              "thr", (std::string("ours ") + unit).c_str(), "peak MiB",
              (std::string("torch ") + unit).c_str(), "peak MiB", "ratio (range)", "GFLOP/s",
              "of peak", "torch GF/s");
}

struct Options {
  std::vector<int> threads = {1, 2};
  int steps = 5;
  int rounds = 3;
  std::string only;  // --case: one case (empty: all)
  bool skip_torch = false;
  bool self_check = false;
};

// The limit the rows are measured against, per thread count: the fastest
// our matmul ran in any measurement so far, in the dtype the cases'
// products run in (f32; bf16 under --precision bf16, as autocast runs them).
// It is measured at start and again in every round, because a measurement
// taken while the machine's neighbours are busy comes out low and noise
// only ever lowers it: the best is the estimate.
struct PeakTracker {
  std::map<int, double> best;
  std::map<int, int> measurements;

  // Measures once more at `threads` (in a child process, as the cases run);
  // returns the best so far.
  double remeasure(int threads) {
    const DType dtype = g_precision == DType::bf16 ? DType::bf16 : DType::f32;
    const Result r = measure_in_child([dtype] { return matmul_peak_gflops(dtype); }, threads);
    ++measurements[threads];
    if (r.ok) best[threads] = std::max(best[threads], r.per_second);
    return best[threads];
  }
};

// The header's peaks, measured before any case: f32, and bf16 under
// --precision bf16.
void measure_start_peaks(const std::vector<int>& threads, PeakTracker& peaks) {
  for (int t : threads) {
    double f32 = 0;
    if (g_precision == DType::bf16)
      f32 = measure_in_child([] { return matmul_peak_gflops(DType::f32); }, t).per_second;
    else
      f32 = peaks.remeasure(t);
    std::printf("peak: matmul f32 %.1f GFLOP/s at %d thread%s", f32, t, t == 1 ? "" : "s");
    if (g_precision == DType::bf16)
      std::printf(", bf16 %.1f GFLOP/s (%s)", peaks.remeasure(t),
                  cpu::kernel_isas().bf16_native ? "oneDNN's bf16 kernels" : "f32 kernels");
    std::printf("\n");
  }
  std::printf(
      "peak = our matmul's fastest of 5 runs of 1024^3 and 2048^3 products, measured again in "
      "every round (the best so far counts); GFLOP/s = 3 x forward model FLOPs (matmuls, "
      "convolutions, attention, LSTM gates) x steps/s; of peak = ours / the %s peak\n",
      g_precision == DType::bf16 ? "bf16" : "f32");
  std::fflush(stdout);
}

// One case at `threads`: --rounds rounds of the peak, ours, then PyTorch's
// (each a fresh process), a line per round when there are several, then the
// row of medians with both sides' GFLOP/s and ours as a fraction of the
// best peak so far. Returns our GFLOP/s.
double run_rounds(const Bench& bench, int threads, const Options& options, PeakTracker& peaks) {
  std::vector<Result> ours, torch;
  std::vector<double> ratios;
  for (int k = 0; k < options.rounds; ++k) {
    peaks.remeasure(threads);
    ours.push_back(measure_in_child([&] { return bench.ours(options.steps); }, threads));
    torch.push_back(options.skip_torch ? Result{}
                                       : measure_torch(bench.torch_args, threads, options.steps));
    const bool pair = ours.back().ok && torch.back().ok;
    if (pair) ratios.push_back(ours.back().per_second / torch.back().per_second);
    if (options.rounds == 1) continue;
    print_sides(("  round " + std::to_string(k + 1)).c_str(), "", "", ours.back(), torch.back(),
                pair ? ratio_text({ratios.back()}) : "-", 0);
    std::printf("\n");
    std::fflush(stdout);
  }
  const Result ours_median = median_result(ours), torch_median = median_result(torch);
  print_sides(bench.name, std::to_string(bench.batch).c_str(), std::to_string(threads).c_str(),
              ours_median, torch_median, ratio_text(ratios), 17);
  const double gflops = ours_median.per_second * bench.flops_per_item / 1e9;
  const double peak = peaks.best[threads];
  char torch_gflops[16] = "-";
  if (torch_median.ok)
    std::snprintf(torch_gflops, sizeof torch_gflops, "%.1f",
                  torch_median.per_second * bench.flops_per_item / 1e9);
  std::printf(" | %8.1f %6.1f%% %10s\n", gflops, peak > 0 ? 100.0 * gflops / peak : 0.0,
              torch_gflops);
  std::fflush(stdout);
  return gflops;
}

// A case's GFLOP/s (ours) at a thread count, for print_run_peaks.
struct CaseRate {
  std::string name;
  int threads;
  double gflops;
};

// After the table: each thread count's best peak over the run, and every
// case's GFLOP/s as a fraction of it (the rows could only use the best so
// far when they were printed).
void print_run_peaks(const std::vector<int>& threads, PeakTracker& peaks,
                     const std::vector<CaseRate>& rates) {
  for (int t : threads) {
    const double peak = peaks.best[t];
    std::printf(
        "peak over the run: matmul %s %.1f GFLOP/s at %d thread%s (best of %d "
        "measurements); of it:",
        g_precision == DType::bf16 ? "bf16" : "f32", peak, t, t == 1 ? "" : "s",
        peaks.measurements[t]);
    for (const CaseRate& rate : rates)
      if (rate.threads == t)
        std::printf(" %s %.1f%%", rate.name.c_str(), peak > 0 ? 100.0 * rate.gflops / peak : 0.0);
    std::printf("\n");
  }
}

// false on an unknown option or a value out of range.
bool parse_options(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    int threads = 0;
    if (a == "--threads" && next_number(argc, argv, i, threads, 1))
      options.threads = {threads};
    else if (a == "--steps" && next_number(argc, argv, i, options.steps, 1)) {
    } else if (a == "--rounds" && next_number(argc, argv, i, options.rounds, 1)) {
    } else if (a == "--case" && i + 1 < argc)
      options.only = argv[++i];
    else if (a == "--skip-torch")
      options.skip_torch = true;
    else if (a == "--self-check")
      options.self_check = true;
    else if (a == "--isa" && i + 1 < argc && std::string(argv[i + 1]) == "avx2") {
      // Before any kernel runs, so oneDNN and the child processes see them:
      // the same caps on both sides (PyTorch: ATen's loops, oneDNN, MKL).
      ++i;
      setenv("DNNL_MAX_CPU_ISA", "AVX2", 1);
      setenv("TRAINER_MAX_CPU_ISA", "avx2", 1);
      setenv("ATEN_CPU_CAPABILITY", "avx2", 1);
      setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2", 1);
      cpu::set_max_isa(cpu::Isa::avx2);
    } else if (a == "--precision" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "bf16" || std::string(argv[i + 1]) == "fp32"))
      g_precision = std::string(argv[++i]) == "bf16" ? DType::bf16 : DType::f32;
    else
      return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) {
    std::fprintf(stderr,
                 "usage: bench_train [--threads N] [--steps N] [--rounds N] [--case NAME] "
                 "[--skip-torch] [--precision fp32|bf16] [--isa avx2] [--self-check]\n");
    return 2;
  }
  if (options.self_check) return self_check() ? 0 : 1;
  std::vector<Bench> benches = all_benches();
  std::erase_if(benches,
                [&](const Bench& b) { return !options.only.empty() && options.only != b.name; });
  if (benches.empty()) {
    std::fprintf(stderr, "bench_train: no case '%s'\n", options.only.c_str());
    return 2;
  }
  std::printf(
      "training step = forward + backward + SGD(momentum) step, synthetic data, median of %d "
      "steps, %s; median of %d round%s%s\n",
      options.steps, g_precision == DType::bf16 ? "bf16 autocast (both sides)" : "fp32",
      options.rounds, options.rounds == 1 ? "" : "s",
      options.skip_torch || options.rounds == 1 ? "" : " (ours and PyTorch alternated)");
  std::printf("%s\n", cpu::describe_machine().c_str());
  PeakTracker peaks;
  measure_start_peaks(options.threads, peaks);
  bool token_header = false;
  std::vector<CaseRate> rates;
  for (size_t i = 0; i < benches.size(); ++i) {
    const bool tokens = benches[i].tokens_per_sample > 1;
    if (i == 0 || (tokens && !token_header)) print_header(tokens);
    token_header = token_header || tokens;
    for (int t : options.threads)
      rates.push_back({benches[i].name, t, run_rounds(benches[i], t, options, peaks)});
  }
  print_run_peaks(options.threads, peaks, rates);
  return 0;
}
