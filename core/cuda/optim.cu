// Multi-tensor optimizer kernels (kernels.h, section optim.cu): SGD and
// AdamW updates, loss-scaler unscaling and the per-chunk partial sums of the
// gradient norm. Each block walks its chunk of one tensor; the per-element
// math is core/optim_math.h, the functions the CPU loops call.
#include "core/cuda/elementwise.cuh"
#include "core/cuda/kernels.h"

namespace trainer::cuda {

namespace {

// Blocks per launch: enough to fill any current GPU; more chunks loop.
constexpr int64_t kMaxChunkBlocks = 4096;

unsigned chunk_blocks(int64_t num_chunks) {
  return unsigned(std::min(num_chunks, kMaxChunkBlocks));
}

// The elements [begin, end) of chunk c of a tensor of numel elements.
struct ChunkRange {
  int64_t begin, end;
};
__device__ ChunkRange chunk_range(const ChunkRef& c, int64_t numel) {
  int64_t begin = int64_t(c.chunk) * kMultiTensorChunk;
  return {begin, numel < begin + kMultiTensorChunk ? numel : begin + kMultiTensorChunk};
}

// The host computes the scalars in double (as optim::sgd_scalars<double>);
// converting each field to T gives exactly optim::sgd_scalars<T>.
template <class T>
__device__ optim::SgdScalars<T> cast_scalars(const optim::SgdScalars<double>& s) {
  return {T(s.lr),           T(s.momentum), T(s.one_minus_dampening),
          T(s.weight_decay), s.nesterov,    s.first_step};
}
template <class T>
__device__ optim::AdamWScalars<T> cast_scalars(const optim::AdamWScalars<double>& s) {
  return {T(s.decay_factor), T(s.one_minus_beta1),       T(s.beta2), T(s.one_minus_beta2),
          T(s.step_size),    T(s.bias_correction2_sqrt), T(s.eps),   s.amsgrad};
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(const SgdTensor* tensors, const ChunkRef* chunks, int64_t num_chunks) {
  for (int64_t b = blockIdx.x; b < num_chunks; b += gridDim.x) {
    const ChunkRef c = chunks[b];
    const SgdTensor& t = tensors[c.tensor];
    const optim::SgdScalars<T> s = cast_scalars<T>(t.s);
    const ChunkRange r = chunk_range(c, t.numel);
    T* p = static_cast<T*>(t.param);
    const T* g = static_cast<const T*>(t.grad);
    T* buf = static_cast<T*>(t.momentum_buffer);
    for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
      T unused = 0;
      optim::sgd_update(s, p[i], g[i], buf ? buf[i] : unused);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const AdamWTensor* tensors, const ChunkRef* chunks, int64_t num_chunks) {
  for (int64_t b = blockIdx.x; b < num_chunks; b += gridDim.x) {
    const ChunkRef c = chunks[b];
    const AdamWTensor& t = tensors[c.tensor];
    const optim::AdamWScalars<T> s = cast_scalars<T>(t.s);
    const ChunkRange r = chunk_range(c, t.numel);
    T* p = static_cast<T*>(t.param);
    const T* g = static_cast<const T*>(t.grad);
    T* m = static_cast<T*>(t.exp_avg);
    T* v = static_cast<T*>(t.exp_avg_sq);
    T* vmax = static_cast<T*>(t.max_exp_avg_sq);
    for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
      T unused = 0;
      optim::adamw_update(s, p[i], g[i], m[i], v[i], vmax ? vmax[i] : unused);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    unscale_kernel(const GradTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                   acc_t<T> inv_scale, int32_t* found_inf) {
  for (int64_t b = blockIdx.x; b < num_chunks; b += gridDim.x) {
    const ChunkRef c = chunks[b];
    const GradTensor& t = tensors[c.tensor];
    const ChunkRange r = chunk_range(c, t.numel);
    T* g = static_cast<T*>(t.grad);
    bool finite = true;
    for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
      acc_t<T> v = load(g[i]);
      finite = optim::unscale_grad(v, inv_scale) && finite;
      g[i] = store_as<T>(v);
    }
    if (!finite) *found_inf = 1;  // every writer stores the same value
  }
}

// NaN-propagating max, as clip.cpp's nan_max.
__device__ double nan_max(double a, double b) { return (a > b || isnan(a)) ? a : b; }

// Block b's partial in a fixed order: per-thread strided sums, then a tree
// over the threads, so the result depends only on the sizes.
template <class T>
__global__ void __launch_bounds__(kThreads)
    power_sum_kernel(const GradTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                     double p, double* partial) {
  __shared__ double lanes[kThreads];
  const bool is_max = isinf(p);
  for (int64_t b = blockIdx.x; b < num_chunks; b += gridDim.x) {
    const ChunkRef c = chunks[b];
    const GradTensor& t = tensors[c.tensor];
    const ChunkRange r = chunk_range(c, t.numel);
    const T* g = static_cast<const T*>(t.grad);
    double acc = 0;
    for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
      double a = fabs(double(load(g[i])));
      if (is_max)
        acc = nan_max(a, acc);
      else
        acc += p == 2.0 ? a * a : (p == 1.0 ? a : pow(a, p));
    }
    lanes[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) {
        double o = lanes[threadIdx.x + half];
        lanes[threadIdx.x] = is_max ? nan_max(lanes[threadIdx.x], o) : lanes[threadIdx.x] + o;
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) partial[b] = lanes[0];
    __syncthreads();  // lanes is reused by the next chunk
  }
}

// Calls fn(TypeTag<T>{}) for the parameter dtypes of the optimizers.
template <class Fn>
void dispatch_param(DType t, const char* op, Fn&& fn) {
  if (t == DType::f32)
    fn(TypeTag<float>{});
  else if (t == DType::f64)
    fn(TypeTag<double>{});
  else
    throw Error(cat(op, ": parameters of dtype ", t, " (the optimizers update f32 or f64)"));
}

}  // namespace

void launch_sgd_step(const SgdTensor* tensors, const ChunkRef* chunks, int64_t num_chunks, DType t,
                     cudaStream_t stream) {
  if (num_chunks == 0) return;
  dispatch_param(t, "sgd_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    sgd_kernel<T><<<chunk_blocks(num_chunks), kThreads, 0, stream>>>(tensors, chunks, num_chunks);
  });
  CUDA_CHECK(cudaGetLastError());
}

void launch_adamw_step(const AdamWTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                       DType t, cudaStream_t stream) {
  if (num_chunks == 0) return;
  dispatch_param(t, "adamw_step", [&](auto tag) {
    using T = typename decltype(tag)::type;
    adamw_kernel<T><<<chunk_blocks(num_chunks), kThreads, 0, stream>>>(tensors, chunks, num_chunks);
  });
  CUDA_CHECK(cudaGetLastError());
}

void launch_unscale_grads(const GradTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                          DType t, double inv_scale, int32_t* found_inf, cudaStream_t stream) {
  if (num_chunks == 0) return;
  dispatch_floating(t, "unscale_grads", [&](auto tag) {
    using T = typename decltype(tag)::type;
    unscale_kernel<T><<<chunk_blocks(num_chunks), kThreads, 0, stream>>>(
        tensors, chunks, num_chunks, acc_t<T>(inv_scale), found_inf);
  });
  CUDA_CHECK(cudaGetLastError());
}

void launch_grad_power_sums(const GradTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                            DType t, double p, double* partial, cudaStream_t stream) {
  if (num_chunks == 0) return;
  dispatch_floating(t, "grads_power_sum", [&](auto tag) {
    using T = typename decltype(tag)::type;
    power_sum_kernel<T><<<chunk_blocks(num_chunks), kThreads, 0, stream>>>(tensors, chunks,
                                                                           num_chunks, p, partial);
  });
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainer::cuda
