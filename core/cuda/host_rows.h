// Host side of the launches of kernels.h: operands described as (element 0,
// strides over a common shape), merged into Launch / Rows the way
// for_each_launch does (dims every operand steps through as one become one),
// and the two-stage reduction the batch-norm and layer-norm kernels share.
//
//   Rows<2> r = rows_of(x.shape(), uint64_t(1) << dim, {strided(out), strided(x)});
#pragma once

#include <array>

#include "core/cuda/kernels.h"
#include "core/tensor.h"

namespace trainer::cuda {

// One operand: element 0 and strides (in elements) over the launch's shape,
// stride 0 where it repeats.
struct Strided {
  char* base;
  Shape strides;
};

inline Strided strided(const Tensor& t) { return {static_cast<char*>(t.data_ptr()), t.strides()}; }
// t with dim `dim`'s stride set to 0 (the kernel adds index * stride itself).
inline Strided strided_without(const Tensor& t, int dim) {
  Strided o = strided(t);
  o.strides[size_t(dim)] = 0;
  return o;
}
// A keepdim operand (one value per row of a reduction over mask): stride 0
// in the reduced dims, so they never block the merging of the row's dims.
inline Strided strided_per_row(const Tensor& t, uint64_t mask) {
  Strided o = strided(t);
  for (size_t d = 0; d < o.strides.size(); ++d)
    if ((mask >> d) & 1) o.strides[d] = 0;
  return o;
}
inline Strided strided_as(const Tensor& t, Shape strides) {
  return {static_cast<char*>(t.data_ptr()), std::move(strides)};
}

// Merges the dims of shape that every operand steps through as one; throws
// when more than kMaxDims remain.
template <int N>
Launch<N> plan_launch(const Shape& shape, const std::array<Strided, N>& ops) {
  Launch<N> g;
  g.numel = shape_numel(shape);
  for (int k = 0; k < N; ++k) {
    CHECK_EQ(ops[k].strides.size(), shape.size()) << "launch operand " << k << " rank";
    g.data[k] = ops[k].base;
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = g.ndim > 0;
    for (int k = 0; k < N && merge; ++k)
      merge = g.strides[k][g.ndim - 1] == ops[k].strides[d] * shape[d];
    if (merge) {
      g.sizes[g.ndim - 1] *= shape[d];
      for (int k = 0; k < N; ++k) g.strides[k][g.ndim - 1] = ops[k].strides[d];
      continue;
    }
    CHECK_LT(g.ndim, kMaxDims) << "a CUDA row or index launch takes at most " << kMaxDims
                               << " dims after merging, got shape " << shape_str(shape);
    g.sizes[g.ndim] = shape[d];
    for (int k = 0; k < N; ++k) g.strides[k][g.ndim] = ops[k].strides[d];
    ++g.ndim;
  }
  if (g.ndim == 0) {
    g.ndim = 1;
    g.sizes[0] = 1;
    for (int k = 0; k < N; ++k) g.strides[k][0] = 1;
  }
  g.contiguous = g.ndim == 1;
  for (int k = 0; k < N; ++k) g.contiguous = g.contiguous && g.strides[k][0] == 1;
  return g;
}

// Rows over the dims of `full` whose bit is set in mask (one row per index
// of the other dims, row-major). An operand holding one value per row (a
// keepdim output: strided_per_row) is only addressed by the row's offset.
template <int N>
Rows<N> rows_of(const Shape& full, uint64_t mask, const std::array<Strided, N>& ops) {
  Shape kept = full, red = full;
  std::array<Strided, N> outer = ops, inner = ops;
  for (size_t d = 0; d < full.size(); ++d) {
    bool reduced = (mask >> d) & 1;
    (reduced ? kept : red)[d] = 1;
    for (int k = 0; k < N; ++k) (reduced ? outer : inner)[k].strides[d] = 0;
  }
  return {plan_launch<N>(kept, outer), plan_launch<N>(red, inner)};
}

// Keepdim-layout reduction of x (and y for prod_dev) over the dims in mask
// into out (any floating dtype): sum / max / min of x, (x - center)^2 or
// y (x - center) with center one acc_t value per row (contiguous), times
// scale for sums. Long rows with few outputs run in two stages.
void reduce_rows(ReduceOp op, RowMode mode, const Tensor& x, const Tensor& y, const Tensor& center,
                 uint64_t mask, const Tensor& out, double scale, cudaStream_t stream);

// The dtype kernels accumulate t in: f64 for f64, else f32.
inline DType acc_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace trainer::cuda
