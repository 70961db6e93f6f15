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
//   bench_train                       # all cases, 1 and 2 threads
//   bench_train --threads 2 --steps 5 --case resnet18_64
//   bench_train --case resnet50_224 --skip-torch   # ours only (for profiling)
//   bench_train --precision bf16      # forward + loss under AutocastGuard(bf16) on both
//                                     # sides (torch.autocast("cpu", torch.bfloat16))
//   bench_train --isa avx2            # both sides limited to AVX2, as on a CPU without
//                                     # AVX-512 (oneDNN, MKL, ATen and our own loops)
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/autocast.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"

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

struct Result {
  double samples_per_second = 0;  // tokens per second for token cases
  double peak_mib = 0;
  bool ok = false;
};

// Runs per_second() (samples or tokens per second) in a child process.
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
  r.samples_per_second = sps;
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
    r.ok = std::fscanf(p, "%lf %lf", &r.samples_per_second, &r.peak_mib) == 2;
    r.ok = pclose(p) == 0 && r.ok;
  }
  return r;
}

// One table row: ours, torch's (when measured) and the ratio of throughputs.
void print_row(const char* name, int64_t batch, int threads, const Result& ours,
               const Result& torch) {
  char torch_cols[64] = "           -         -";
  char ratio[16] = "      -";
  if (torch.ok) {
    std::snprintf(torch_cols, sizeof torch_cols, "%12.1f %9.0f", torch.samples_per_second,
                  torch.peak_mib);
    std::snprintf(ratio, sizeof ratio, "%6.2fx",
                  ours.samples_per_second / torch.samples_per_second);
  }
  std::printf("%-17s %5lld %3d | %12.1f %9.0f | %s | %s\n", name, (long long)batch, threads,
              ours.samples_per_second, ours.peak_mib, torch_cols, ratio);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  int steps = 5;
  std::string only;
  bool skip_torch = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc)
      threads = {std::atoi(argv[++i])};
    else if (a == "--steps" && i + 1 < argc)
      steps = std::atoi(argv[++i]);
    else if (a == "--case" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--skip-torch")
      skip_torch = true;
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
    else {
      std::fprintf(stderr,
                   "usage: bench_train [--threads N] [--steps N] [--case NAME] [--skip-torch] "
                   "[--precision fp32|bf16] [--isa avx2]\n");
      return 2;
    }
  }
  std::printf(
      "training step = forward + backward + SGD(momentum) step, synthetic data, median of %d "
      "steps, %s\n",
      steps, g_precision == DType::bf16 ? "bf16 autocast (both sides)" : "fp32");
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf("%-17s %5s %3s | %12s %9s | %12s %9s | %7s\n", "case", "batch", "thr", "ours samp/s",
              "peak MiB", "torch samp/s", "peak MiB", "ratio");
  for (const ImageCase& c : kCases) {
    if (!only.empty() && only != c.name) continue;
    for (int t : threads) {
      Result ours = measure_in_child([&] { return double(c.batch) / run_case(c, steps); }, t);
      Result torch;
      if (!skip_torch)
        torch = measure_torch(std::string("--model ") + c.model + " --batch " +
                                  std::to_string(c.batch) + " --size " + std::to_string(c.size) +
                                  " --channels " + std::to_string(c.channels) + " --classes " +
                                  std::to_string(c.classes),
                              t, steps);
      print_row(c.name, c.batch, t, ours, torch);
    }
  }
  bool header = false;
  for (const LMCase& c : kLMCases) {
    if (!only.empty() && only != c.name) continue;
    if (!header) {
      std::printf("%-17s %5s %3s | %12s %9s | %12s %9s | %7s\n", "case", "batch", "thr",
                  "ours tok/s", "peak MiB", "torch tok/s", "peak MiB", "ratio");
      header = true;
    }
    for (int t : threads) {
      Result ours =
          measure_in_child([&] { return double(c.batch * c.seq) / run_lm_case(c, steps); }, t);
      Result torch;
      if (!skip_torch)
        torch = measure_torch(
            "--model " + std::string(c.name) + " --batch " + std::to_string(c.batch) + " --seq " +
                std::to_string(c.seq) + " --classes " + std::to_string(c.vocab) + " --size " +
                std::to_string(c.width) + " --layers " + std::to_string(c.layers) + " --heads " +
                std::to_string(c.heads) + " --kv-heads " + std::to_string(c.kv_heads) +
                " --intermediate " + std::to_string(c.intermediate),
            t, steps);
      print_row(c.name, c.batch, t, ours, torch);
    }
  }
  return 0;
}
