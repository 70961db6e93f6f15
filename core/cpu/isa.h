// The CPU's instruction sets, and which one the project's own vectorised
// loops use (oneDNN chooses its own: core/cpu/onednn.h dnnl_isa_name()).
//
// The default build targets x86-64-v3 (AVX2, FMA, F16C), so one binary runs
// on every AVX2 machine of a cluster; TRAINER_NATIVE=ON tunes it for the
// build machine instead. The loops that gain from AVX-512 are compiled twice,
// for x86-64-v3 and x86-64-v4, and pick their version at run time through
// use_avx512() (see TRAINER_AVX512 below), the way PyTorch's
// CPU_CAPABILITY and oneDNN's dispatchers work.
//
//   if (cpu::use_avx512()) softmax_rows_avx512(...); else softmax_rows_avx2(...);
//   cpu::set_max_isa(cpu::Isa::avx2);   // tests: run the AVX2 versions here too
//
// The level in force is the highest the CPU (and the OS, XCR0) supports,
// capped by the environment variable TRAINER_MAX_CPU_ISA=avx2|avx512 (read
// once, as oneDNN reads DNNL_MAX_CPU_ISA) and by set_max_isa().
#pragma once

#include <string>

namespace trainer::cpu {

enum class Isa { avx2, avx512 };

struct CpuFeatures {
  std::string model;  // the brand string, e.g. "AMD EPYC 9R14 96-Core Processor"
  unsigned family = 0, model_number = 0;  // cpuid's display family and model
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_fp16 = false;
  bool amx_tile = false, amx_bf16 = false;
  bool os_avx512 = false;  // the OS saves the AVX-512 state (XCR0 opmask and ZMM bits)
};

// Read once with cpuid.
const CpuFeatures& cpu_features();

// The ISA the project's own dual-compiled loops run.
Isa active_isa();
inline bool use_avx512() { return active_isa() == Isa::avx512; }
// Caps the ISA of the project's own loops (never raises it above the CPU's).
void set_max_isa(Isa isa);

const char* isa_name(Isa isa);
// "AMD EPYC (family 25, model 17)": the brand string and cpuid's numbers.
std::string cpu_name(const CpuFeatures& f);
// "AVX2 FMA AVX-512(F BW VL DQ) AVX512-BF16 AMX(TILE BF16)": what the CPU offers that matters here.
std::string feature_summary(const CpuFeatures& f);

// Which instruction sets run each kernel family on this machine now.
struct KernelIsas {
  std::string onednn;  // oneDNN's ISA after DNNL_MAX_CPU_ISA: matmul, convolution, average pooling,
                       // batch norm
  Isa loops;           // the project's loops with a run-time choice (elementwise, max pooling)
  Isa baseline;  // the rest (softmax, layer norm, attention, RNN cells, optimizers): the build's
  bool bf16_native;  // bf16 matmul and convolution run oneDNN's bf16 kernels (use_bf16_kernels)
};
KernelIsas kernel_isas();  // core/cpu/onednn.cpp

// One line for `trainer info` and a run's header: "oneDNN avx512_core_bf16
// (matmul, conv, avg pool, batch norm); elementwise and max pooling avx512 (chosen at run time);
// softmax, ... avx2 (the build's target)".
std::string describe_kernel_isas();
// The line every benchmark table starts with: "cpu <cpu_name>: <features>;
// <describe_kernel_isas>", so that a figure can be tied to the machine.
std::string describe_machine();
// How precision bf16 or f16 runs matmul and convolution here, for a run's header.
std::string describe_low_precision(bool f16);

}  // namespace trainer::cpu

// Marks a function compiled for x86-64-v4 (AVX-512 F/BW/DQ/VL). Only
// self-contained leaf loops take it: raw pointers in, no calls that are not
// inlined, so no AVX-512 code escapes into functions the AVX2 path shares.
// A TRAINER_NATIVE build compiles everything for the build machine already
// (and a target attribute would then lack some of its features): both
// instances are the same code there.
#ifdef TRAINER_NATIVE_BUILD
#define TRAINER_AVX512
#else
#define TRAINER_AVX512 __attribute__((target("arch=x86-64-v4")))
#endif
