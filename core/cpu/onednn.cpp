#include "core/cpu/onednn.h"

#include <oneapi/dnnl/dnnl_debug.h>

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

void dnnl_fail(const char* file, int line, const char* expr, const dnnl::error& e) {
  check_fail(file, line, expr, cat("oneDNN: ", e.what(), " (", dnnl_status2str(e.status), ")"));
}

}  // namespace trainer::cpu
