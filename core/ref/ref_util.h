// Helpers of the reference kernels: multi-index iteration and element
// access converted to/from double.
#pragma once

#include <vector>

#include "core/tensor.h"

namespace trainer::ref {

// Calls fn(index) for every multi-index of shape, row-major.
template <class Fn>
void for_each_index(const Shape& shape, Fn&& fn) {
  int64_t n = shape_numel(shape);
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    fn(idx);
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// Element offset of a multi-index (in elements, from element 0 of t).
inline int64_t offset_of(const Tensor& t, const std::vector<int64_t>& idx) {
  int64_t off = 0;
  for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t.strides()[d];
  return off;
}

// Reads element at offset (from element 0) as double.
double get(const Tensor& t, int64_t offset);
// Writes v (converted to t's dtype) at offset.
void set(const Tensor& t, int64_t offset, double v);

inline double get(const Tensor& t, const std::vector<int64_t>& idx) {
  return get(t, offset_of(t, idx));
}
inline void set(const Tensor& t, const std::vector<int64_t>& idx, double v) {
  set(t, offset_of(t, idx), v);
}

}  // namespace trainer::ref
