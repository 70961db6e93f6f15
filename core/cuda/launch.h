// The boundary between the CUDA backend (C++20, g++) and its kernels (.cu,
// nvcc in C++17): plain structs and launcher declarations, no Tensor.
//
// An elementwise launch walks N operands of one shape (operand 0 is the
// output; inputs already broadcast, stride 0 where they repeat). The backend
// merges dims that are contiguous in every operand (core/cpu/loops.h), so a
// contiguous or simply broadcast case is a single dim; what remains, up to
// kMaxDims dims, travels by value in Launch<N>. A kernel thread turns its
// linear (row-major) index into one element offset per operand with
// element_offsets(), the same function the host tests run.
//
// Launchers enqueue on the given stream and return at once; they throw Error
// (dtype_unsupported) for a dtype they do not take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/hd.h"
#include "core/op_kinds.h"
#include "core/rng.h"

namespace trainer::cuda {

inline constexpr int kMaxDims = 8;

template <int N>
struct Launch {
  char* data[N] = {};       // element 0 of each operand
  int64_t numel = 0;        // elements in this launch
  int64_t first_index = 0;  // row-major index of element 0 in the whole tensor
  bool contiguous = false;  // every operand has unit stride: offset == index
  int ndim = 0;             // 1..kMaxDims
  int64_t sizes[kMaxDims] = {};
  int64_t strides[N][kMaxDims] = {};  // in elements
};

// Element offsets of linear index i (0 <= i < numel) in each operand.
template <int N>
TRAINER_HD void element_offsets(const Launch<N>& g, int64_t i, int64_t (&off)[N]) {
  if (g.contiguous) {
    for (int k = 0; k < N; ++k) off[k] = i;
    return;
  }
  for (int k = 0; k < N; ++k) off[k] = 0;
  // Innermost dims by division; the outermost takes the rest (no division
  // at all for a single merged dim).
  for (int d = g.ndim - 1; d > 0; --d) {
    int64_t size = g.sizes[d];
    int64_t idx = i % size;
    i /= size;
    for (int k = 0; k < N; ++k) off[k] += idx * g.strides[k][d];
  }
  for (int k = 0; k < N; ++k) off[k] += i * g.strides[k][0];
}

// ---- copy.cu ----
// dst = convert(src) for any pair of dtypes (bool: v != 0). Operands (dst, src).
void launch_copy(const Launch<2>& g, DType dst, DType src, cudaStream_t stream);
// Any dtype t. Operand (dst).
void launch_fill(const Launch<1>& g, DType t, double value, cudaStream_t stream);
// Any dtype t. Operands (out, cond (bool), a, b).
void launch_where(const Launch<4>& g, DType t, cudaStream_t stream);

// ---- elementwise.cu ----
// Floating dtypes; every operand of dtype t.
// Operands (out, x).
void launch_unary(UnaryOp op, const Launch<2>& g, DType t, cudaStream_t stream);
// Operands (grad_x, x, y, grad).
void launch_unary_backward(UnaryOp op, const Launch<4>& g, DType t, cudaStream_t stream);
// Operands (out, a, b).
void launch_binary(BinaryOp op, const Launch<3>& g, DType t, cudaStream_t stream);
// Operands (out, a): out = a op s, or s op a when scalar_first.
void launch_binary_scalar(BinaryOp op, const Launch<2>& g, DType t, double s, bool scalar_first,
                          cudaStream_t stream);
// Operands (out, x).
void launch_clamp(const Launch<2>& g, DType t, double lo, double hi, cudaStream_t stream);
// Operands (grad_x, grad, x).
void launch_clamp_backward(const Launch<3>& g, DType t, double lo, double hi, cudaStream_t stream);
// Operands (out (bool), a, b), a and b of any dtype t.
void launch_compare(CompareOp op, const Launch<3>& g, DType t, cudaStream_t stream);

// ---- random.cu ----
// Element with row-major index i of the whole tensor draws counter i
// (core/rng.h), as core/ref/ref_random.cpp. Any dtype. Operand (out).
void launch_uniform(const Launch<1>& g, DType t, double lo, double hi, PhiloxKey key,
                    cudaStream_t stream);
void launch_normal(const Launch<1>& g, DType t, double mean, double std, PhiloxKey key,
                   cudaStream_t stream);
void launch_bernoulli(const Launch<1>& g, DType t, double p, PhiloxKey key, cudaStream_t stream);

}  // namespace trainer::cuda
