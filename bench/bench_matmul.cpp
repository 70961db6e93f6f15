// f32 matmul throughput through the op layer (oneDNN on CPU): square sizes,
// ResNet-50 convolutions as GEMMs and GPT-2 small's projections, on 1 and 2
// threads, as GFLOP/s and as a fraction of this CPU's fp32 peak.
//
//   bench_matmul            # full table
//   bench_matmul --quick    # fewer repetitions
//
// The peak is cores x clock x FMA units x lanes (16 with AVX-512, 8 with
// AVX2) x 2 flops. The
// clock is measured with a chain of dependent FMAs (4 cycles each on Intel
// cores since Skylake); /proc/cpuinfo's "cpu MHz" is printed beside it. Two
// FMA units per core is the assumption for Xeon (Sapphire Rapids has FMA
// ports 0 and 5); the measured throughput of independent FMAs checks it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/cpu/isa.h"
#include "core/cpu/threads.h"
#include "core/ops.h"

using namespace trainer;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double cpuinfo_mhz() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("cpu MHz", 0) == 0) return std::stod(line.substr(line.find(':') + 1));
  return 0.0;
}

constexpr double kFmaLatencyCycles = 4.0;
constexpr double kFmaUnitsAssumed = 2.0;

// The measurements below, for a vector of W fp32 lanes (GCC's vector
// extension; -ffp-contract makes x * a + b one FMA). Inlined into a wrapper
// compiled for the ISA that has W lanes.
template <int W>
struct VecOf;
template <>
struct VecOf<8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecOf<16> {
  typedef float type __attribute__((vector_size(64)));
};
template <int W>
using Vec = typename VecOf<W>::type;

template <int W>
__attribute__((always_inline)) inline void consume(Vec<W> v) {
  volatile float sink = v[0];
  (void)sink;
}

// Cycles per second from a dependent chain of n FMAs. Runs are short (about
// a millisecond) and the fastest of many counts, so a run that another
// process interrupted does not lower the estimate.
template <int W>
__attribute__((always_inline)) inline double measure_clock_hz() {
  const int64_t n = 500'000;
  double best = 1e30;
  for (int rep = 0; rep < 200; ++rep) {
    Vec<W> x = Vec<W>{} + 1.0f, a = Vec<W>{} + 0.999999f, b = Vec<W>{} + 1e-7f;
    auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i) {
      x = x * a + b;
      __asm__ volatile("" : "+x"(x));  // one FMA per iteration, kept in order
    }
    best = std::min(best, seconds_since(t0));
    consume<W>(x);
  }
  return double(n) * kFmaLatencyCycles / best;
}

// FMAs per second of one core from 12 independent chains (enough to cover
// 2 units x 4 cycles of latency), fastest of many short runs.
template <int W>
__attribute__((always_inline)) inline double measure_fma_per_second() {
  const int64_t n = 100'000;
  double best = 1e30;
  for (int rep = 0; rep < 200; ++rep) {
    Vec<W> acc[12];  // distinct starting values, so no two chains are the same computation
    for (int k = 0; k < 12; ++k) acc[k] = Vec<W>{} + (1.0f + 0.01f * float(k));
    Vec<W> a = Vec<W>{} + 0.999999f, b = Vec<W>{} + 1e-7f;
    auto t0 = Clock::now();
    for (int64_t i = 0; i < n; ++i)
      for (auto& v : acc) {
        v = v * a + b;
        __asm__ volatile("" : "+x"(v));
      }
    best = std::min(best, seconds_since(t0));
    Vec<W> s = acc[0];
    for (int k = 1; k < 12; ++k) s += acc[k];
    consume<W>(s);
  }
  return double(n) * 12 / best;
}

struct Peak {
  int lanes;  // fp32 lanes of the widest vector the kernels use
  double clock_hz, fma_per_second;
};
TRAINER_AVX512 Peak measure_avx512() {
  return {16, measure_clock_hz<16>(), measure_fma_per_second<16>()};
}
Peak measure_avx2() { return {8, measure_clock_hz<8>(), measure_fma_per_second<8>()}; }

struct Case {
  const char* name;
  int64_t M, K, N;
};

// Median seconds of one matmul after warm-up; at least `min_reps` runs and
// about `budget` seconds.
double time_matmul(const Tensor& a, const Tensor& b, int min_reps, double budget) {
  for (int i = 0; i < 2; ++i) matmul(a, b);
  std::vector<double> times;
  auto start = Clock::now();
  while (int(times.size()) < min_reps || seconds_since(start) < budget) {
    auto t0 = Clock::now();
    Tensor c = matmul(a, b);
    times.push_back(seconds_since(t0));
    if (times.size() >= 200) break;
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::printf("%s\n", cpu::describe_machine().c_str());
  // AVX-512 where oneDNN uses it, else AVX2 (DNNL_MAX_CPU_ISA=AVX2 and
  // TRAINER_MAX_CPU_ISA=avx2 model an AVX2-only CPU).
  const bool wide = cpu::use_avx512() && cpu::kernel_isas().onednn.find("avx512") == 0;
  const Peak peak = wide ? measure_avx512() : measure_avx2();
  const double kLanes = peak.lanes;
  double mhz = cpuinfo_mhz();
  double clock = peak.clock_hz;
  double units = peak.fma_per_second / clock;
  double per_core = clock * kFmaUnitsAssumed * kLanes * 2;
  std::printf(
      "clock: %.0f MHz measured (dependent %d-bit FMAs, %g cycles each); "
      "/proc/cpuinfo says %.0f MHz\n",
      clock / 1e6, 32 * peak.lanes, kFmaLatencyCycles, mhz);
  std::printf(
      "FMA units: %g assumed (Xeon ports 0 and 5, Zen 4); measured %.2f %d-bit FMAs/cycle\n",
      kFmaUnitsAssumed, units, 32 * peak.lanes);
  std::printf("fp32 peak per core = %.2f GHz x %g FMA units x %g lanes x 2 = %.1f GFLOP/s\n\n",
              clock / 1e9, kFmaUnitsAssumed, kLanes, per_core / 1e9);

  const std::vector<Case> cases = {
      {"square 256", 256, 256, 256},
      {"square 512", 512, 512, 512},
      {"square 1024", 1024, 1024, 1024},
      {"square 2048", 2048, 2048, 2048},
      {"r50 conv2 3x3 b8", 8 * 56 * 56, 64 * 9, 64},
      {"r50 conv2 1x1 b8", 8 * 56 * 56, 64, 256},
      {"r50 conv3 3x3 b8", 8 * 28 * 28, 128 * 9, 128},
      {"r50 conv4 3x3 b8", 8 * 14 * 14, 256 * 9, 256},
      {"r50 conv5 3x3 b8", 8 * 7 * 7, 512 * 9, 512},
      {"r50 conv5 3x3 b1", 7 * 7, 512 * 9, 512},
      {"gpt2 qkv", 2048, 768, 2304},
      {"gpt2 attn proj", 2048, 768, 768},
      {"gpt2 mlp up", 2048, 768, 3072},
      {"gpt2 mlp down", 2048, 3072, 768},
  };
  autograd::NoGradGuard no_grad;
  Generator gen(0, kStreamDefault);
  std::printf("%-18s %6s %6s %6s %4s %10s %9s %7s\n", "case", "M", "K", "N", "thr", "ms", "GFLOP/s",
              "%peak");
  for (const Case& c : cases) {
    Tensor a = uniform({c.M, c.K}, -1, 1, gen), b = uniform({c.K, c.N}, -1, 1, gen);
    double flops = 2.0 * double(c.M) * double(c.K) * double(c.N);
    for (int threads : {1, 2}) {
      set_num_threads(threads);
      double t = time_matmul(a, b, quick ? 3 : 7, quick ? 0.1 : 0.5);
      double gflops = flops / t / 1e9;
      std::printf("%-18s %6ld %6ld %6ld %4d %10.3f %9.1f %6.1f%%\n", c.name, long(c.M), long(c.K),
                  long(c.N), threads, t * 1e3, gflops, 100.0 * gflops * 1e9 / (per_core * threads));
    }
  }
  return 0;
}
