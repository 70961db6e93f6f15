#include "core/cpu/onednn.h"

#include <oneapi/dnnl/dnnl_debug.h>

#include <algorithm>
#include <cstdlib>

#include "core/check.h"
#include "core/cpu/isa.h"
#include "core/ops_conv.h"

namespace trainer::cpu {

dnnl::engine& dnnl_engine() {
  static dnnl::engine engine = DNNL_CHECK(dnnl::engine(dnnl::engine::kind::cpu, 0));
  return engine;
}

// CPU streams execute in order on the calling thread; one serves every caller.
dnnl::stream& dnnl_stream() {
  static dnnl::stream stream = DNNL_CHECK(dnnl::stream(dnnl_engine()));
  return stream;
}

std::optional<dnnl::memory::data_type> dnnl_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return dnnl::memory::data_type::f32;
    case DType::bf16:
      return dnnl::memory::data_type::bf16;
    default:
      return std::nullopt;
  }
}

dnnl::memory bind(const dnnl::memory::desc& md, const Tensor& t) {
  return DNNL_CHECK(dnnl::memory(md, dnnl_engine(), t.data_ptr()));
}

dnnl::memory scratch(const dnnl::memory::desc& md, Tensor& holder) {
  holder = empty({int64_t(md.get_size())}, DType::u8);
  return bind(md, holder);
}

dnnl::memory::desc image_md(const Tensor& t, dnnl::memory::data_type dt) {
  const dnnl::memory::dims d(t.shape().begin(), t.shape().end());
  if (is_channels_last(t))
    return DNNL_CHECK(dnnl::memory::desc(d, dt, dnnl::memory::format_tag::nhwc));
  return DNNL_CHECK(
      dnnl::memory::desc(d, dt, dnnl::memory::dims(t.strides().begin(), t.strides().end())));
}

dnnl::memory::desc vector_md(int64_t n, dnnl::memory::data_type dt) {
  return DNNL_CHECK(dnnl::memory::desc({n}, dt, dnnl::memory::format_tag::x));
}

dnnl::memory::dims right_padding(int64_t in_h, int64_t in_w, int64_t out_h, int64_t out_w,
                                 int64_t kh, int64_t kw, const Pair& stride, const Pair& pad,
                                 const Pair& dilation) {
  auto one = [](int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, int64_t d) {
    return std::max<int64_t>(0, (out - 1) * s + (k - 1) * d + 1 - in - p);
  };
  return {one(in_h, out_h, kh, stride[0], pad[0], dilation[0]),
          one(in_w, out_w, kw, stride[1], pad[1], dilation[1])};
}

bool has_bf16_kernels() {
  static const bool has = [] {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    const dnnl::memory::desc a({4, 8}, dt::bf16, tag::ab), b({8, 4}, dt::bf16, tag::ab),
        c({4, 4}, dt::bf16, tag::ab);
    const bool matmul = try_primitive_desc<dnnl::matmul::primitive_desc>(
                            "bf16 matmul probe", dnnl::matmul::desc(a, b, c), dnnl_engine())
                            .has_value();
    const dnnl::memory::desc x({1, 8, 4, 4}, dt::bf16, tag::nhwc),
        w({8, 8, 3, 3}, dt::bf16, tag::any), y({1, 8, 4, 4}, dt::bf16, tag::nhwc);
    const bool conv =
        try_primitive_desc<dnnl::convolution_forward::primitive_desc>(
            "bf16 convolution probe",
            dnnl::convolution_forward::desc(
                dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x, w,
                dnnl::memory::desc(), y, {1, 1}, {0, 0}, {1, 1}, {1, 1}),
            dnnl_engine())
            .has_value();
    return matmul && conv;
  }();
  return has;
}

bool use_bf16_kernels() {
  static const bool use = [] {
    const char* env = std::getenv("TRAINER_BF16_KERNELS");
    const std::string choice = env && *env ? env : "auto";
    if (choice != "auto" && choice != "onednn" && choice != "f32")
      throw Error(cat("TRAINER_BF16_KERNELS=", choice,
                      ": expected auto (oneDNN's bf16 kernels where it has AMX), onednn or f32"));
    if (choice == "f32" || !has_bf16_kernels()) return false;
    return choice == "onednn" || dnnl_isa_name().rfind("avx512_core_amx", 0) == 0;
  }();
  return use;
}

std::string dnnl_isa_name() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    default:
      return "other";
  }
}

bool has_brgemm_convolution() {
  static const bool has = dnnl_isa_name().rfind("avx512_core", 0) == 0;
  return has;
}

KernelIsas kernel_isas() {
#ifdef __AVX512F__
  const Isa baseline = Isa::avx512;  // TRAINER_NATIVE on an AVX-512 machine
#else
  const Isa baseline = Isa::avx2;
#endif
  return {dnnl_isa_name(), active_isa(), baseline, use_bf16_kernels()};
}

void run(const dnnl::primitive& p, const std::unordered_map<int, dnnl::memory>& args) {
  DNNL_CHECK(p.execute(dnnl_stream(), args));
  DNNL_CHECK(dnnl_stream().wait());
}

void dnnl_fail(const char* file, int line, const char* expr, const dnnl::error& e) {
  check_fail(file, line, expr, cat("oneDNN: ", e.what(), " (", dnnl_status2str(e.status), ")"));
}

}  // namespace trainer::cpu
