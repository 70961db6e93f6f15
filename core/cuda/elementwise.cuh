// Kernel-side helpers of the .cu files (dtype dispatch is core/dtype.h's)
// and the one grid-stride elementwise kernel every launcher of
// launch.h instantiates with its own body.
//
//   struct Body { __device__ void operator()(const Launch<2>& g, int64_t i, const int64_t* off)
//   const; }; run_elementwise(g, Body{...}, stream);
#pragma once

#include <algorithm>
#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "core/cuda/launch.h"

namespace trainer::cuda {

// Stores v (any arithmetic type) as T the way the CPU kernels do: bool is
// v != 0, bf16/f16 round from float, the rest static_cast.
template <class T, class V>
TRAINER_HD T store_converted(V v) {
  if constexpr (std::is_same_v<T, bool>)
    return v != V(0);
  else
    return store_as<T>(acc_t<T>(v));
}

template <class T>
TRAINER_HD T* operand(char* const* data, int k) {
  return reinterpret_cast<T*>(data[k]);
}

inline constexpr int kThreads = 256;
// Enough blocks to fill any current GPU; larger launches loop (grid stride).
inline constexpr int64_t kMaxBlocks = 65536;

template <int N, class Body>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(Launch<N> g, Body body) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < g.numel; i += step) {
    int64_t off[N];
    element_offsets(g, i, off);
    body(g, i, off);
  }
}

template <int N, class Body>
void run_elementwise(const Launch<N>& g, const Body& body, cudaStream_t stream) {
  if (g.numel == 0) return;
  int64_t blocks = std::min<int64_t>((g.numel + kThreads - 1) / kThreads, kMaxBlocks);
  elementwise_kernel<N, Body><<<unsigned(blocks), kThreads, 0, stream>>>(g, body);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
