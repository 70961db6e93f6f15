// f32 convolutions of ResNet-18 and the small CNN, forward, data gradient
// and weight gradient, on oneDNN against the project's own kernels
// (core/cpu/conv_direct_avx2.h; one input channel: conv_single_channel.h),
// both measured in the same run, alternating. --model keeps one model's rows.
// With --isa avx2 oneDNN is capped at AVX2 (DNNL_MAX_CPU_ISA), which is what
// an AVX2-only CPU runs; on an AVX-512 machine without it oneDNN runs its
// brgemm kernels.
//
//   bench_conv [--threads N] [--reps N] [--isa avx2] [--model NAME] [--quick]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/cpu/conv_direct_avx2.h"
#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"
#include "core/ops_conv.h"

using namespace trainer;

namespace {

using Clock = std::chrono::steady_clock;

struct Case {
  const char* model;
  int64_t N, C, H, O, K, stride;
};

// The distinct convolutions with at least 16 input channels: ResNet-18 at
// 224 x 224, batch 16 (bench_train's resnet18_224), at 28 x 28 with the 3x3
// stem, batch 8 (resnet18_small_28), and the small CNN's second conv (batch
// 128); then the small CNN's first, on one channel, where "own" is the
// one-channel kernel (core/cpu/conv_single_channel.h). The small CNN's weight
// gradients include the bias's, as in training.
const Case kCases[] = {
    {"resnet18_224", 16, 64, 56, 64, 3, 1},      {"resnet18_224", 16, 64, 56, 128, 3, 2},
    {"resnet18_224", 16, 128, 28, 128, 3, 1},    {"resnet18_224", 16, 128, 28, 256, 3, 2},
    {"resnet18_224", 16, 256, 14, 256, 3, 1},    {"resnet18_224", 16, 256, 14, 512, 3, 2},
    {"resnet18_224", 16, 512, 7, 512, 3, 1},     {"resnet18_224", 16, 64, 56, 128, 1, 2},
    {"resnet18_small_28", 8, 64, 28, 64, 3, 1},  {"resnet18_small_28", 8, 128, 14, 128, 3, 1},
    {"resnet18_small_28", 8, 256, 7, 256, 3, 1}, {"resnet18_small_28", 8, 512, 4, 512, 3, 1},
    {"small_cnn_28", 128, 32, 14, 64, 3, 1},     {"small_cnn_28", 128, 1, 28, 32, 3, 1},
    {"resnet18_64", 32, 512, 2, 512, 3, 1},
};

// Median seconds of fn over reps runs after one warm-up.
template <typename Fn>
double median_seconds(int reps, Fn fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1, reps = 7;
  bool quick = false;
  std::string only_model;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--model" && i + 1 < argc) {
      only_model = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--isa" && i + 1 < argc && std::string(argv[i + 1]) == "avx2") {
      ++i;
      setenv("DNNL_MAX_CPU_ISA", "AVX2", 1);  // before oneDNN's first use
      cpu::set_max_isa(cpu::Isa::avx2);
    } else {
      std::fprintf(
          stderr,
          "usage: bench_conv [--threads N] [--reps N] [--isa avx2] [--model NAME] [--quick]\n");
      return 2;
    }
  }
  set_num_threads(threads);
  if (quick) reps = 1;
  std::printf(
      "f32 convolution, channels-last, %d thread(s), median of %d runs; GFLOP/s of oneDNN and of "
      "the own kernel, ratio of their speeds\n",
      threads, reps);
  std::printf("%s\n", cpu::describe_machine().c_str());
  std::printf("%-17s %4s %4s %4s %4s %2s %2s | %-22s | %-22s | %-22s\n", "", "", "", "", "", "", "",
              "forward", "data gradient", "weight gradient");
  std::printf("%-17s %4s %4s %4s %4s %2s %2s | %6s %6s %8s | %6s %6s %8s | %6s %6s %8s\n", "model",
              "N", "C", "HW", "O", "k", "s", "oneDNN", "own", "ratio", "oneDNN", "own", "ratio",
              "oneDNN", "own", "ratio");
  Backend& cpu_backend = backend(Device{});
  Generator gen(1);
  double geo[3] = {0, 0, 0};
  int counted[3] = {0, 0, 0};
  int cases = 0;
  for (const Case& c : kCases) {
    if (quick && cases > 0) break;
    if (!only_model.empty() && only_model != c.model) continue;
    ++cases;
    const int64_t pad = c.K / 2, OH = (c.H + 2 * pad - c.K) / c.stride + 1;
    Tensor x = to_channels_last(uniform({c.N, c.C, c.H, c.H}, -1.0, 1.0, gen));
    Tensor w = uniform({c.O, c.C, c.K, c.K}, -1.0, 1.0, gen);
    Tensor y = empty_channels_last({c.N, c.O, OH, OH});
    Tensor gy = to_channels_last(uniform({c.N, c.O, OH, OH}, -1.0, 1.0, gen));
    Tensor gx = empty_channels_last({c.N, c.C, c.H, c.H});
    Tensor gw = empty({c.O, c.C, c.K, c.K});
    // The small CNN's convolutions have a bias; ResNet's (before batch norm) none.
    const Tensor gb = std::string(c.model) == "small_cnn_28" ? empty({c.O}) : Tensor();
    Conv2dAttrs a{.stride = {c.stride, c.stride}, .padding = {pad, pad}};
    const double flops = 2.0 * c.N * OH * OH * c.O * c.C * c.K * c.K;
    // Alternating the two within one shape, so that drift hits both alike;
    // the faster of two rounds' medians.
    double t[3][2];  // [forward, data, weights][oneDNN, own]
    for (auto& pass : t) pass[0] = pass[1] = 1e30;
    for (int round = 0; round < 2; ++round)
      for (int own = 0; own < 2; ++own) {
        cpu::set_direct_conv_use(own ? cpu::DirectConvUse::always : cpu::DirectConvUse::never);
        t[0][own] = std::min(t[0][own], median_seconds(reps, [&] {
                               cpu_backend.conv2d(x, w, Tensor(), a, false, y);
                             }));
        t[1][own] =
            std::min(t[1][own],
                     median_seconds(reps, [&] { cpu_backend.conv2d_backward_data(gy, w, a, gx); }));
        t[2][own] = std::min(t[2][own], median_seconds(reps, [&] {
                               cpu_backend.conv2d_backward_weights(gy, x, a, gw, gb);
                             }));
      }
    cpu::set_direct_conv_use(cpu::DirectConvUse::automatic);
    std::printf("%-17s %4lld %4lld %4lld %4lld %2lld %2lld", c.model, (long long)c.N,
                (long long)c.C, (long long)c.H, (long long)c.O, (long long)c.K,
                (long long)c.stride);
    for (int pass = 0; pass < 3; ++pass) {
      // The own kernel takes data gradients of stride-1 convolutions only.
      const bool own = pass != 1 || c.stride == 1;
      std::printf(" | %6.1f ", flops / t[pass][0] * 1e-9);
      if (own) {
        std::printf("%6.1f %7.2fx", flops / t[pass][1] * 1e-9, t[pass][0] / t[pass][1]);
        geo[pass] += std::log(t[pass][0] / t[pass][1]);
        ++counted[pass];
      } else {
        std::printf("%6s %8s", "-", "-");
      }
    }
    std::printf("\n");
  }
  auto mean = [&](int pass) { return counted[pass] ? std::exp(geo[pass] / counted[pass]) : 1.0; };
  std::printf(
      "geometric mean of own over oneDNN speed: forward %.2fx, data gradient %.2fx, weight "
      "gradient %.2fx\n",
      mean(0), mean(1), mean(2));
  return 0;
}
