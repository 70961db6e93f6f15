// Strided loops for the CPU fast paths (the CPU side of a TensorIterator).
//
// for_each_run(shape, {out, a, b}, body) walks N operands that all have
// `shape` (inputs already broadcast: stride 0 where they repeat). Dims that
// are contiguous in every operand are merged, so a contiguous or simply
// broadcast case becomes one long inner run. The element range is split into
// one contiguous chunk per OpenMP thread when it is large enough, and body is
// called per inner run:
//
//   body(char* const* ptrs, const int64_t* strides, int64_t n)
//
// with ptrs[k] the address of the run's first element of operand k and
// strides[k] its inner stride in elements. Bodies write a unit-stride branch
// the compiler vectorises and a strided branch.
#pragma once

#include <omp.h>

#include <array>
#include <cstdint>

#include "core/tensor.h"

namespace trainer::cpu {

inline constexpr int kMaxLoopDims = 16;
// Below this many elements a loop runs on the calling thread.
inline constexpr int64_t kParallelGrain = 32768;

template <size_t N>
struct LoopPlan {
  int ndim = 0;
  int64_t shape[kMaxLoopDims];
  int64_t strides[N][kMaxLoopDims];  // elements
  char* base[N];
  size_t elem_size[N];
};

template <size_t N>
LoopPlan<N> make_loop_plan(const Shape& shape, const std::array<const Tensor*, N>& ops) {
  LoopPlan<N> p;
  CHECK_LE(shape.size(), size_t(kMaxLoopDims)) << "too many dims for a CPU loop";
  for (size_t k = 0; k < N; ++k) {
    CHECK(ops[k]->shape() == shape) << "loop operand " << k << " has shape " << ops[k]->shape_str()
                                    << ", expected " << shape_str(shape);
    p.base[k] = static_cast<char*>(ops[k]->data_ptr());
    p.elem_size[k] = dtype_size(ops[k]->dtype());
  }
  // Keep dims of size > 1, innermost last, merging a dim into the next inner
  // one when every operand steps through them as one.
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = p.ndim > 0;
    for (size_t k = 0; k < N && merge; ++k)
      merge = p.strides[k][p.ndim - 1] == ops[k]->strides()[d] * shape[d];
    if (merge) {
      // The previous (outer) entry steps exactly over dim d: fold them into
      // one entry of shape[prev] * shape[d] with d's stride.
      p.shape[p.ndim - 1] *= shape[d];
      for (size_t k = 0; k < N; ++k) p.strides[k][p.ndim - 1] = ops[k]->strides()[d];
      continue;
    }
    p.shape[p.ndim] = shape[d];
    for (size_t k = 0; k < N; ++k) p.strides[k][p.ndim] = ops[k]->strides()[d];
    ++p.ndim;
  }
  if (p.ndim == 0) {  // a scalar or all-ones shape: one run of one element
    p.ndim = 1;
    p.shape[0] = 1;
    for (size_t k = 0; k < N; ++k) p.strides[k][0] = 1;
  }
  return p;
}

// Runs body over elements [begin, end) of the plan's row-major order.
template <size_t N, class Body>
void run_range(const LoopPlan<N>& p, int64_t begin, int64_t end, Body& body) {
  if (begin >= end) return;
  int64_t idx[kMaxLoopDims];
  int64_t rest = begin;
  for (int d = p.ndim - 1; d >= 0; --d) {
    idx[d] = rest % p.shape[d];
    rest /= p.shape[d];
  }
  const int inner = p.ndim - 1;
  int64_t inner_strides[N];
  for (size_t k = 0; k < N; ++k) inner_strides[k] = p.strides[k][inner];
  int64_t pos = begin;
  while (pos < end) {
    char* ptrs[N];
    for (size_t k = 0; k < N; ++k) {
      int64_t off = 0;
      for (int d = 0; d <= inner; ++d) off += idx[d] * p.strides[k][d];
      ptrs[k] = p.base[k] + off * int64_t(p.elem_size[k]);
    }
    int64_t n = std::min(p.shape[inner] - idx[inner], end - pos);
    body(ptrs, inner_strides, n);
    pos += n;
    idx[inner] += n;
    for (int d = inner; d > 0 && idx[d] >= p.shape[d]; --d) {
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
}

template <size_t N, class Body>
void for_each_run(const Shape& shape, const std::array<const Tensor*, N>& ops, Body body) {
  LoopPlan<N> p = make_loop_plan(shape, ops);
  int64_t numel = shape_numel(shape);
  if (numel == 0) return;
  int threads = omp_get_max_threads();
  if (numel < kParallelGrain || threads == 1 || omp_in_parallel()) {
    run_range(p, 0, numel, body);
    return;
  }
#pragma omp parallel
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Chunk boundaries rounded to 16 elements keep vector loops aligned.
    int64_t chunk = ((numel + nt - 1) / nt + 15) / 16 * 16;
    Body local = body;
    run_range(p, std::min<int64_t>(numel, t * chunk), std::min<int64_t>(numel, (t + 1) * chunk),
              local);
  }
}

// Runs fn(begin, end) over [0, n) split across threads when n is large.
template <class Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  if (n <= grain || omp_get_max_threads() == 1 || omp_in_parallel()) {
    fn(int64_t(0), n);
    return;
  }
#pragma omp parallel
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t chunk = (n + nt - 1) / nt;
    int64_t b = std::min<int64_t>(n, t * chunk), e = std::min<int64_t>(n, (t + 1) * chunk);
    if (b < e) fn(b, e);
  }
}

}  // namespace trainer::cpu
