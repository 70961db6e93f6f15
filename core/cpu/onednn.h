// The oneDNN glue the CPU kernels share: one engine and one stream for the
// process, the DNNL_CHECK error wrapper and dtype mapping. Include only from
// the .cpp files that build oneDNN primitives (dnnl.hpp is slow to compile).
//
//   dnnl::matmul::primitive_desc pd = DNNL_CHECK(dnnl::matmul::primitive_desc(desc,
//   cpu::dnnl_engine())); DNNL_CHECK(prim.execute(cpu::dnnl_stream(), args));
//
// oneDNN's C++ API reports failures by throwing dnnl::error; DNNL_CHECK turns
// one into a CHECK failure that prints the failing call, oneDNN's message and
// its status name, then aborts (docs/architecture.md "Errors").
#pragma once

#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <string>
#include <unordered_map>

#include "core/check.h"
#include "core/conv_attrs.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace trainer::cpu {

// The CPU engine and its stream, created on first use.
dnnl::engine& dnnl_engine();
dnnl::stream& dnnl_stream();

// The oneDNN data type of a dtype, or nullopt when oneDNN has none we use.
std::optional<dnnl::memory::data_type> dnnl_dtype(DType t);

// oneDNN memory over a tensor's data (no copy).
dnnl::memory bind(const dnnl::memory::desc& md, const Tensor& t);
// A scratch buffer of md's size from the caching allocator (holder keeps it), bound to md.
dnnl::memory scratch(const dnnl::memory::desc& md, Tensor& holder);
// An image operand of type dt (default f32): plain nhwc when channels-last, else its own strides.
dnnl::memory::desc image_md(const Tensor& t,
                            dnnl::memory::data_type dt = dnnl::memory::data_type::f32);
// n elements of type dt (default f32).
dnnl::memory::desc vector_md(int64_t n, dnnl::memory::data_type dt = dnnl::memory::data_type::f32);
// The right/bottom padding the last window of a convolution or pooling
// actually reaches (floor mode may leave input unread), for oneDNN's padding_r.
dnnl::memory::dims right_padding(int64_t in_h, int64_t in_w, int64_t out_h, int64_t out_w,
                                 int64_t kh, int64_t kw, const Pair& stride, const Pair& pad,
                                 const Pair& dilation);
// Whether oneDNN has bf16 convolution and matmul kernels on this CPU
// (AVX-512 core and up: emulated on AVX-512 F/BW, native with AVX512-BF16 or
// AMX). oneDNN 2.6 has none below AVX-512, not even reference ones, so
// without them bf16 operands run the f32 kernels on converted copies
// (core/cpu/lowp.h). Probed once by creating small primitives, so it honours
// DNNL_MAX_CPU_ISA.
bool has_bf16_kernels();
// Whether bf16 matmul and convolution run oneDNN's bf16 kernels (else the
// f32 kernels on converted copies, results rounded to bf16; f32
// accumulation either way). Without AMX those kernels are slower than the
// f32 ones: AVX512-BF16's dot product issues half as often as FMA and
// AVX-512 F/BW only emulates it (1024^3 products on an Emerald Rapids VM
// without AMX, one thread: 82 GFLOP/s in bf16 against 150 in f32, PyTorch's
// alike), so by default (TRAINER_BF16_KERNELS=auto) they run only where
// oneDNN's ISA has AMX; TRAINER_BF16_KERNELS=onednn uses them wherever
// they exist, =f32 never. Read once; a bad value is an error naming it.
bool use_bf16_kernels();
// oneDNN's instruction set in effect (its own name, e.g. "avx512_core_amx"),
// after DNNL_MAX_CPU_ISA.
std::string dnnl_isa_name();
// Whether oneDNN's f32 convolutions here are its brgemm kernels (AVX-512
// core and up in oneDNN 2.6; below that it runs the older jit ones).
bool has_brgemm_convolution();

// Runs p on the process's stream and waits for it.
void run(const dnnl::primitive& p, const std::unordered_map<int, dnnl::memory>& args);

[[noreturn]] void dnnl_fail(const char* file, int line, const char* expr, const dnnl::error& e);

// Runs fn(), turning a thrown dnnl::error into a CHECK failure naming expr.
template <class Fn>
decltype(auto) dnnl_call(const char* file, int line, const char* expr, Fn&& fn) {
  try {
    return fn();
  } catch (const dnnl::error& e) {
    dnnl_fail(file, line, expr, e);
  }
}

// A primitive descriptor, or nullopt when oneDNN has no implementation for
// these descriptors (dnnl_unimplemented); any other error is a CHECK failure.
template <class PrimitiveDesc, class... Args>
std::optional<PrimitiveDesc> try_primitive_desc(const char* what, Args&&... args) {
  try {
    return PrimitiveDesc(std::forward<Args>(args)...);
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_unimplemented) return std::nullopt;
    dnnl_fail(__FILE__, __LINE__, what, e);
  }
}

}  // namespace trainer::cpu

#define DNNL_CHECK(expr) \
  ::trainer::cpu::dnnl_call(__FILE__, __LINE__, #expr, [&]() -> decltype(auto) { return expr; })
