// Kernel-side helpers of the row kernels (kernels.h): block-wide reductions,
// the block size and grid of a row launch, and the device-side index check.
//
//   A total = block_reduce(partial, Sum{}, A(0), shared);   // every thread gets it
#pragma once

#include <math.h>
#include <stdio.h>

#include "core/cuda/elementwise.cuh"
#include "core/cuda/kernels.h"

namespace trainer::cuda {

inline constexpr int kRowThreads = 256;  // at most; a multiple of 32

struct Sum {
  template <class A>
  __device__ A operator()(A a, A b) const {
    return a + b;
  }
};
// NaN wins (and stays), as RefBackend's max and min.
struct Max {
  template <class A>
  __device__ A operator()(A a, A b) const {
    return (isnan(b) || b > a) ? b : a;
  }
};
struct Min {
  template <class A>
  __device__ A operator()(A a, A b) const {
    return (isnan(b) || b < a) ? b : a;
  }
};

// Combines v over the block (blockDim.x a multiple of 32); every thread
// returns the result. shared holds 32 values; identity is combine's neutral
// element. All threads of the block must call it.
template <class A, class Combine>
__device__ A block_reduce(A v, Combine combine, A identity, A* shared) {
  for (int o = 16; o > 0; o /= 2) v = combine(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x / 32) ? shared[lane] : identity;
    for (int o = 16; o > 0; o /= 2) v = combine(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

// Threads for rows of `count` elements: a power of two in [32, kRowThreads].
inline int row_threads(int64_t count) {
  int t = 32;
  while (t < kRowThreads && t < count) t *= 2;
  return t;
}

inline unsigned row_blocks(int64_t rows) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(rows, kMaxBlocks)));
}

// Stops the kernel (and poisons the context) when v is outside [0, size).
__device__ inline void check_index(int64_t v, int64_t size, const char* op) {
  if (v < 0 || v >= size) {
    printf("%s: index %lld is outside [0, %lld)\n", op, static_cast<long long>(v),
           static_cast<long long>(size));
    __trap();
  }
}

}  // namespace trainer::cuda
