// Layer norm and RMS norm (one block per row of a contiguous [R, D] input,
// statistics in acc_t<T>) and the elementwise halves of batch norm (the channel
// statistics are reductions: reduce.cu). Per-element formulas from
// core/nn_math.h.
#include "core/cuda/rows.cuh"
#include "core/elementwise_math.h"
#include "core/nn_math.h"

namespace trainer::cuda {

namespace {

// out = (x - mean) rstd w + b, rstd = 1 / sqrt(var + eps) (biased var)
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    layer_norm_forward_kernel(LayerNormPtrs p, int64_t R, int64_t D, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const T* w = static_cast<const T*>(p.weight);
  const T* b = static_cast<const T*>(p.bias);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + r * D;
    T* out = static_cast<T*>(p.out) + r * D;
    A sum = 0;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) sum += load(x[d]);
    const A mean = block_reduce(sum, Sum{}, A(0), shared) / A(D);
    A sq = 0;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      A c = load(x[d]) - mean;
      sq += c * c;
    }
    const A var = block_reduce(sq, Sum{}, A(0), shared) / A(D);
    const A rstd = A(1) / math::m_sqrt(var + eps);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      out[d] = store_as<T>((load(x[d]) - mean) * rstd * load(w[d]) + load(b[d]));
    if (threadIdx.x == 0) {
      static_cast<A*>(p.mean_out)[r] = mean;
      static_cast<A*>(p.rstd_out)[r] = rstd;
    }
  }
}

// gx = rstd (gw - mean_D(gw) - xhat mean_D(gw xhat)) with gw = g w
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    layer_norm_grad_x_kernel(LayerNormPtrs p, int64_t R, int64_t D) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + r * D;
    const T* g = static_cast<const T*>(p.grad_out) + r * D;
    T* gx = static_cast<T*>(p.grad_x) + r * D;
    const A mean = static_cast<const A*>(p.mean)[r], rstd = static_cast<const A*>(p.rstd)[r];
    A s_gw = 0, s_gw_xhat = 0;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      A gw = load(g[d]) * load(w[d]);
      s_gw += gw;
      s_gw_xhat += gw * (load(x[d]) - mean) * rstd;
    }
    const A mean_gw = block_reduce(s_gw, Sum{}, A(0), shared) / A(D);
    const A mean_gw_xhat = block_reduce(s_gw_xhat, Sum{}, A(0), shared) / A(D);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      A xhat = (load(x[d]) - mean) * rstd;
      gx[d] = store_as<T>(
          math::layer_norm_grad_x(rstd, load(g[d]) * load(w[d]), mean_gw, xhat, mean_gw_xhat));
    }
  }
}

// Column sums over part blockIdx.y of the rows: partial_weight[part, d] =
// sum g xhat, partial_bias[part, d] = sum g. Block (32, 8): 32 columns, 8 row lanes.
template <class T>
__global__ void __launch_bounds__(256)
    layer_norm_grad_params_kernel(LayerNormPtrs p, int64_t R, int64_t D, int64_t per) {
  using A = acc_t<T>;
  __shared__ A sw[8][33], sb[8][33];
  const int64_t d = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * per;
  const int64_t end = begin + per < R ? begin + per : R;
  A acc_w = 0, acc_b = 0;
  if (d < D) {
    for (int64_t r = begin + threadIdx.y; r < end; r += 8) {
      A g = load(static_cast<const T*>(p.grad_out)[r * D + d]);
      A xhat = (load(static_cast<const T*>(p.x)[r * D + d]) - static_cast<const A*>(p.mean)[r]) *
               static_cast<const A*>(p.rstd)[r];
      acc_w += g * xhat;
      acc_b += g;
    }
  }
  sw[threadIdx.y][threadIdx.x] = acc_w;
  sb[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    for (int k = 1; k < 8; ++k) acc_w += sw[k][threadIdx.x], acc_b += sb[k][threadIdx.x];
    static_cast<A*>(p.partial_weight)[int64_t(blockIdx.y) * D + d] = acc_w;
    static_cast<A*>(p.partial_bias)[int64_t(blockIdx.y) * D + d] = acc_b;
  }
}

// out = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps)
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    rms_norm_forward_kernel(RmsNormPtrs p, int64_t R, int64_t D, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + r * D;
    T* out = static_cast<T*>(p.out) + r * D;
    A sq = 0;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) sq += load(x[d]) * load(x[d]);
    const A rstd = A(1) / math::m_sqrt(block_reduce(sq, Sum{}, A(0), shared) / A(D) + eps);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      out[d] = store_as<T>(load(x[d]) * rstd * load(w[d]));
    if (threadIdx.x == 0) static_cast<A*>(p.rstd_out)[r] = rstd;
  }
}

// gx = rstd (gw - xhat mean_D(gw xhat)) with gw = g w, xhat = x rstd
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    rms_norm_grad_x_kernel(RmsNormPtrs p, int64_t R, int64_t D) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + r * D;
    const T* g = static_cast<const T*>(p.grad_out) + r * D;
    T* gx = static_cast<T*>(p.grad_x) + r * D;
    const A rstd = static_cast<const A*>(p.rstd)[r];
    A s_gw_xhat = 0;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      s_gw_xhat += load(g[d]) * load(w[d]) * load(x[d]) * rstd;
    const A mean_gw_xhat = block_reduce(s_gw_xhat, Sum{}, A(0), shared) / A(D);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
      gx[d] = store_as<T>(
          math::rms_norm_grad_x(rstd, load(g[d]) * load(w[d]), load(x[d]) * rstd, mean_gw_xhat));
  }
}

// Column sums over part blockIdx.y of the rows: partial_weight[part, d] =
// sum g xhat. Block (32, 8): 32 columns, 8 row lanes.
template <class T>
__global__ void __launch_bounds__(256)
    rms_norm_grad_weight_kernel(RmsNormPtrs p, int64_t R, int64_t D, int64_t per) {
  using A = acc_t<T>;
  __shared__ A sw[8][33];
  const int64_t d = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * per;
  const int64_t end = begin + per < R ? begin + per : R;
  A acc = 0;
  if (d < D) {
    for (int64_t r = begin + threadIdx.y; r < end; r += 8)
      acc += load(static_cast<const T*>(p.grad_out)[r * D + d]) *
             load(static_cast<const T*>(p.x)[r * D + d]) * static_cast<const A*>(p.rstd)[r];
  }
  sw[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    for (int k = 1; k < 8; ++k) acc += sw[k][threadIdx.x];
    static_cast<A*>(p.partial_weight)[int64_t(blockIdx.y) * D + d] = acc;
  }
}

// out = (x - mean) / sqrt(var + eps) * gamma + beta (then relu); statistics in acc_t<T>.
template <class T>
struct BatchNormApplyBody {
  acc_t<T> eps;
  bool relu;
  __device__ void operator()(const Launch<6>& g, int64_t, const int64_t* off) const {
    using A = acc_t<T>;
    A x = load(operand<const T>(g.data, 1)[off[1]]);
    A mean = operand<const A>(g.data, 2)[off[2]], var = operand<const A>(g.data, 3)[off[3]];
    A gamma = operand<const A>(g.data, 4)[off[4]], beta = operand<const A>(g.data, 5)[off[5]];
    A v = (x - mean) / math::m_sqrt(var + eps) * gamma + beta;
    operand<T>(g.data, 0)[off[0]] = store_as<T>(relu && v < A(0) ? A(0) : v);
  }
};

// Operands (grad_x, grad_out, x, mean, invstd, gamma, sum_g, sum_g_xhat).
template <class T>
struct BatchNormBackwardBody {
  acc_t<T> m;
  __device__ void operator()(const Launch<8>& g, int64_t, const int64_t* off) const {
    using A = acc_t<T>;
    A go = load(operand<const T>(g.data, 1)[off[1]]);
    A x = load(operand<const T>(g.data, 2)[off[2]]);
    A mean = operand<const A>(g.data, 3)[off[3]], invstd = operand<const A>(g.data, 4)[off[4]];
    A xhat = (x - mean) * invstd;
    operand<T>(g.data, 0)[off[0]] = store_as<T>(math::batch_norm_grad_x(
        operand<const A>(g.data, 5)[off[5]], invstd, m, go, operand<const A>(g.data, 6)[off[6]],
        xhat, operand<const A>(g.data, 7)[off[7]]));
  }
};

}  // namespace

void launch_layer_norm_forward(const LayerNormPtrs& p, int64_t R, int64_t D, double eps, DType t,
                               cudaStream_t stream) {
  if (R == 0) return;
  dispatch_floating(t, "layer_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    layer_norm_forward_kernel<T>
        <<<row_blocks(R), row_threads(D), 0, stream>>>(p, R, D, acc_t<T>(eps));
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_layer_norm_backward(const LayerNormPtrs& p, int64_t R, int64_t D, int64_t splits,
                                DType t, cudaStream_t stream) {
  if (R == 0) return;
  CHECK(splits >= 1 && splits <= 65535) << "layer_norm_backward: " << splits << " splits";
  dispatch_floating(t, "layer_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    layer_norm_grad_x_kernel<T><<<row_blocks(R), row_threads(D), 0, stream>>>(p, R, D);
    CUDA_CHECK(cudaGetLastError());
    dim3 grid(unsigned((D + 31) / 32), unsigned(splits));
    layer_norm_grad_params_kernel<T>
        <<<grid, dim3(32, 8), 0, stream>>>(p, R, D, (R + splits - 1) / splits);
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_rms_norm_forward(const RmsNormPtrs& p, int64_t R, int64_t D, double eps, DType t,
                             cudaStream_t stream) {
  if (R == 0) return;
  dispatch_floating(t, "rms_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rms_norm_forward_kernel<T>
        <<<row_blocks(R), row_threads(D), 0, stream>>>(p, R, D, acc_t<T>(eps));
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_rms_norm_backward(const RmsNormPtrs& p, int64_t R, int64_t D, int64_t splits, DType t,
                              cudaStream_t stream) {
  if (R == 0) return;
  CHECK(splits >= 1 && splits <= 65535) << "rms_norm_backward: " << splits << " splits";
  dispatch_floating(t, "rms_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rms_norm_grad_x_kernel<T><<<row_blocks(R), row_threads(D), 0, stream>>>(p, R, D);
    CUDA_CHECK(cudaGetLastError());
    dim3 grid(unsigned((D + 31) / 32), unsigned(splits));
    rms_norm_grad_weight_kernel<T>
        <<<grid, dim3(32, 8), 0, stream>>>(p, R, D, (R + splits - 1) / splits);
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_batch_norm_apply(const Launch<6>& g, DType t, double eps, bool relu,
                             cudaStream_t stream) {
  dispatch_floating(t, "batch_norm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, BatchNormApplyBody<T>{acc_t<T>(eps), relu}, stream);
  });
}

void launch_batch_norm_backward(const Launch<8>& g, DType t, double m, cudaStream_t stream) {
  dispatch_floating(t, "batch_norm_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, BatchNormBackwardBody<T>{acc_t<T>(m)}, stream);
  });
}

}  // namespace trainer::cuda
