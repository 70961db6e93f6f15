#include "core/cpu/isa.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/cpu/conv_direct_avx2.h"
#include "core/cpu/onednn.h"

namespace trainer::cpu {

namespace {

bool bit(uint32_t reg, int b) { return (reg >> b) & 1u; }

uint64_t xgetbv0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  // The brand string: leaves 0x80000002..4, 16 bytes each.
  char brand[49] = {};
  if (__get_cpuid_max(0x80000000, nullptr) >= 0x80000004) {
    for (unsigned leaf = 0; leaf < 3; ++leaf) {
      __get_cpuid(0x80000002 + leaf, &a, &b, &c, &d);
      std::memcpy(brand + 16 * leaf, &a, 4);
      std::memcpy(brand + 16 * leaf + 4, &b, 4);
      std::memcpy(brand + 16 * leaf + 8, &c, 4);
      std::memcpy(brand + 16 * leaf + 12, &d, 4);
    }
  }
  f.model = brand;
  while (!f.model.empty() && f.model.back() == ' ') f.model.pop_back();
  while (!f.model.empty() && f.model.front() == ' ') f.model.erase(f.model.begin());

  const unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 1) return f;
  __get_cpuid(1, &a, &b, &c, &d);
  // Family and model (with their extended fields): the brand string of a
  // cloud VM is often just "AMD EPYC"; family 25 model 17 says Zen 4.
  const unsigned base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
  f.family = base_family == 0xf ? base_family + ((a >> 20) & 0xff) : base_family;
  f.model_number =
      base_family == 0x6 || base_family == 0xf ? (((a >> 16) & 0xf) << 4) | base_model : base_model;
  const bool osxsave = bit(c, 27), avx = bit(c, 28);
  f.fma = bit(c, 12);
  f.f16c = bit(c, 29);
  // The OS must save the YMM (and for AVX-512 the opmask and ZMM) state.
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  f.os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = avx && os_avx && bit(b, 5);
  f.avx512f = f.os_avx512 && bit(b, 16);
  f.avx512dq = f.os_avx512 && bit(b, 17);
  f.avx512bw = f.os_avx512 && bit(b, 30);
  f.avx512vl = f.os_avx512 && bit(b, 31);
  f.avx512_fp16 = f.os_avx512 && bit(d, 23);
  f.amx_bf16 = bit(d, 22);
  f.amx_tile = bit(d, 24);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  f.avx512_bf16 = f.os_avx512 && bit(a1, 5);
  return f;
}

// The highest level this CPU runs: x86-64-v4 needs AVX-512 F, BW, VL and DQ.
Isa cpu_isa() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq ? Isa::avx512 : Isa::avx2;
}

// TRAINER_MAX_CPU_ISA caps it as DNNL_MAX_CPU_ISA caps oneDNN's (read once).
Isa environment_cap() {
  const char* v = std::getenv("TRAINER_MAX_CPU_ISA");
  if (v != nullptr && (std::strcmp(v, "avx2") == 0 || std::strcmp(v, "AVX2") == 0))
    return Isa::avx2;
  return Isa::avx512;
}

std::atomic<Isa>& active() {
  static std::atomic<Isa> isa{std::min(cpu_isa(), environment_cap())};
  return isa;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

Isa active_isa() { return active().load(std::memory_order_relaxed); }

void set_max_isa(Isa isa) { active().store(std::min(cpu_isa(), std::min(isa, environment_cap()))); }

const char* isa_name(Isa isa) { return isa == Isa::avx512 ? "avx512" : "avx2"; }

std::string feature_summary(const CpuFeatures& f) {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "AVX2");
  add(f.fma, "FMA");
  if (f.avx512f) {
    std::string parts = "F";
    if (f.avx512bw) parts += " BW";
    if (f.avx512vl) parts += " VL";
    if (f.avx512dq) parts += " DQ";
    add(true, ("AVX-512(" + parts + ")").c_str());
  }
  add(f.avx512_bf16, "AVX512-BF16");
  add(f.avx512_fp16, "AVX512-FP16");
  if (f.amx_tile) add(true, f.amx_bf16 ? "AMX(TILE BF16)" : "AMX(TILE)");
  if (!f.avx2) add(true, "(no AVX2)");
  return s;
}

std::string cpu_name(const CpuFeatures& f) {
  return (f.model.empty() ? std::string("unknown CPU") : f.model) + " (family " +
         std::to_string(f.family) + ", model " + std::to_string(f.model_number) + ")";
}

std::string describe_kernel_isas() {
  const KernelIsas k = kernel_isas();
  std::string own_conv;
  if (direct_conv_in_use())
    own_conv =
        "; convolutions larger than 1x1 on 16+ channels own avx2 (direct, "
        "core/cpu/conv_direct_avx2.h)";
  if (direct_conv_use() != DirectConvUse::never)
    own_conv += std::string("; one-channel convolutions own ") +
                (k.loops == Isa::avx512 ? "(forward and weight gradient" : "(weight gradient") +
                ", core/cpu/conv_single_channel.h); convolutions of images of at most 4 "
                "pixels as one matmul (core/cpu/conv_small_image.h)";
  return "oneDNN " + k.onednn +
         " (matmul, convolution, average pooling, batch norm); elementwise and max pooling " +
         isa_name(k.loops) + " (chosen at run time); softmax, layer norm, attention, RNN cells, " +
         "optimizers " + isa_name(k.baseline) + " (the build's target)" + own_conv;
}

std::string describe_machine() {
  const CpuFeatures& f = cpu_features();
  return "cpu " + cpu_name(f) + ": " + feature_summary(f) + "; " + describe_kernel_isas();
}

std::string describe_low_precision(bool f16) {
  if (f16)
    return "f16 matmul and convolution on the f32 kernels, results rounded to f16 "
           "(oneDNN 2.6 has no f16 CPU kernels)";
  if (kernel_isas().bf16_native)
    return "bf16 matmul and convolution on oneDNN's bf16 kernels (f32 accumulation)";
  if (has_bf16_kernels())
    return "bf16 matmul and convolution on the f32 kernels, results rounded to bf16 (faster "
           "here than oneDNN's bf16 kernels, which without AMX issue half as often; "
           "TRAINER_BF16_KERNELS=onednn chooses those)";
  return "bf16 matmul and convolution on the f32 kernels, results rounded to bf16 (oneDNN has "
         "bf16 kernels only from AVX-512 up; this CPU or DNNL_MAX_CPU_ISA is below that)";
}

}  // namespace trainer::cpu
