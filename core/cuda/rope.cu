// The rotary embedding on CUDA: a thread per pair (b, t, head, i) of the
// output, reading x[i] and x[i + HD/2] of its head (consecutive threads,
// consecutive i: coalesced) and turning them by the angle of (t, i)
// (core/nn_math.h's rope_angle and rope_rotate, as the CPU). The
// frequencies come with the launch and are staged in shared memory. cos and
// sin in acc_t<T> (float, double for f64).
#include <math.h>

#include "core/cuda/elementwise.cuh"
#include "core/cuda/kernels.h"
#include "core/nn_math.h"

namespace trainer::cuda {

namespace {

template <class A>
__device__ void sin_cos(A a, A* s, A* c) {
  if constexpr (std::is_same_v<A, double>)
    sincos(a, s, c);
  else
    sincosf(a, s, c);
}

template <class T>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeArgs a) {
  using A = acc_t<T>;
  __shared__ float inv_freq[kMaxRopePairs];
  const int64_t half = a.HD / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) inv_freq[i] = a.inv_freq[i];
  __syncthreads();
  const int64_t pairs = a.B * a.T * a.NH * half;
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = p % half, row = p / half;  // row = (b T + t) NH + h
    const int64_t h = row % a.NH, bt = row / a.NH, t = bt % a.T, b = bt / a.T;
    const A angle = A(math::rope_angle(a.positions[t * a.pos_stride], inv_freq[i]));
    A s, c;
    sin_cos(angle, &s, &c);
    const T* xh = x + b * a.sb + t * a.st + h * a.HD;
    A y0, y1;
    math::rope_rotate(A(load(xh[i])), A(load(xh[i + half])), c, A(a.sign) * s, y0, y1);
    T* oh = out + row * a.HD;
    oh[i] = store_as<T>(y0);
    oh[i + half] = store_as<T>(y1);
  }
}

}  // namespace

void launch_rope(const RopeArgs& a, DType t, cudaStream_t stream) {
  const int64_t pairs = a.B * a.T * a.NH * (a.HD / 2);
  if (pairs == 0) return;
  CHECK(a.HD % 2 == 0 && a.HD / 2 <= kMaxRopePairs)
      << "rotary_embedding: head width " << a.HD << " (even, at most " << 2 * kMaxRopePairs << ")";
  dispatch_floating(t, "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t blocks = std::min<int64_t>((pairs + kThreads - 1) / kThreads, kMaxBlocks);
    rope_kernel<T><<<unsigned(blocks), kThreads, 0, stream>>>(a);
    CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace trainer::cuda
