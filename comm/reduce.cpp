#include "comm/reduce.h"

#include <algorithm>

namespace trainer::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

void reduce_into(void* dst, const void* src, size_t count, DType dtype, ReduceOp op) {
  dispatch_floating(dtype, "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Never overlapping (reduce.h): without restrict the compiler keeps the loop scalar.
    T* __restrict d = static_cast<T*>(dst);
    const T* __restrict s = static_cast<const T*>(src);
    if (op == ReduceOp::max) {
      for (size_t i = 0; i < count; ++i) d[i] = store_as<T>(std::max(load(d[i]), load(s[i])));
    } else {
      for (size_t i = 0; i < count; ++i) d[i] = store_as<T>(load(d[i]) + load(s[i]));
    }
  });
}

void reduce_pair(void* dst, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  dispatch_floating(dtype, "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // dst may be a or b itself: element i is read before it is written and no
    // element depends on another, which ivdep tells the vectoriser (no
    // overlap checks, no scalar fallback when dst == a).
    T* d = static_cast<T*>(dst);
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
    if (op == ReduceOp::max) {
#pragma GCC ivdep
      for (size_t i = 0; i < count; ++i) d[i] = store_as<T>(std::max(load(x[i]), load(y[i])));
    } else {
#pragma GCC ivdep
      for (size_t i = 0; i < count; ++i) d[i] = store_as<T>(load(x[i]) + load(y[i]));
    }
  });
}

void reduce_pair_to_both(void* d0, void* d1, const void* a, const void* b, size_t count,
                         DType dtype, ReduceOp op, double factor) {
  dispatch_floating(dtype, "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    T* p = static_cast<T*>(d0);
    T* q = static_cast<T*>(d1);
    const T* x = static_cast<const T*>(a);
    const T* y = static_cast<const T*>(b);
    const A f = A(factor);
    if (op == ReduceOp::max) {
#pragma GCC ivdep
      for (size_t i = 0; i < count; ++i)
        p[i] = q[i] = store_as<T>(std::max(load(x[i]), load(y[i])));
    } else if (op == ReduceOp::avg) {
#pragma GCC ivdep
      for (size_t i = 0; i < count; ++i)
        p[i] = q[i] = store_as<T>(load(store_as<T>(load(x[i]) + load(y[i]))) * f);
    } else {
#pragma GCC ivdep
      for (size_t i = 0; i < count; ++i) p[i] = q[i] = store_as<T>(load(x[i]) + load(y[i]));
    }
  });
}

void scale(void* data, size_t count, DType dtype, double factor) {
  dispatch_floating(dtype, "scale", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    T* d = static_cast<T*>(data);
    const A f = A(factor);
    for (size_t i = 0; i < count; ++i) d[i] = store_as<T>(load(d[i]) * f);
  });
}

}  // namespace trainer::comm
