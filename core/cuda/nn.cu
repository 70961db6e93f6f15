// Softmax and cross-entropy kernels: one block per row, in acc_t<T>, with
// the per-element formulas of core/nn_math.h.
#include "core/cuda/rows.cuh"
#include "core/elementwise_math.h"
#include "core/nn_math.h"

namespace trainer::cuda {

namespace {

// y = exp(x - max) / sum exp(x - max); log: y = x - max - log sum exp(x - max)
template <class T>
__global__ void __launch_bounds__(kRowThreads) softmax_kernel(Rows<2> r, bool log) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const int64_t n = r.inner.numel;
  for (int64_t s = blockIdx.x; s < r.outer.numel; s += gridDim.x) {
    int64_t off[2];
    element_offsets(r.outer, s, off);
    T* out = operand<T>(r.outer.data, 0) + off[0];
    const T* x = operand<const T>(r.outer.data, 1) + off[1];
    A mx = A(-INFINITY);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t io[2];
      element_offsets(r.inner, i, io);
      A v = load(x[io[1]]);
      mx = v > mx ? v : mx;
    }
    mx = block_reduce(
        mx, [](A a, A b) { return a > b ? a : b; }, A(-INFINITY), shared);
    A z = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t io[2];
      element_offsets(r.inner, i, io);
      z += math::m_exp(load(x[io[1]]) - mx);
    }
    z = block_reduce(z, Sum{}, A(0), shared);
    const A log_z = math::m_log(z);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t io[2];
      element_offsets(r.inner, i, io);
      A v = load(x[io[1]]) - mx;
      out[io[0]] = store_as<T>(log ? v - log_z : math::m_exp(v) / z);
    }
  }
}

// softmax: gx = y (g - sum g y);  log_softmax: gx = g - exp(y) sum g
template <class T>
__global__ void __launch_bounds__(kRowThreads) softmax_backward_kernel(Rows<3> r, bool log) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const int64_t n = r.inner.numel;
  for (int64_t s = blockIdx.x; s < r.outer.numel; s += gridDim.x) {
    int64_t off[3];
    element_offsets(r.outer, s, off);
    T* gx = operand<T>(r.outer.data, 0) + off[0];
    const T* g = operand<const T>(r.outer.data, 1) + off[1];
    const T* y = operand<const T>(r.outer.data, 2) + off[2];
    A dot = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t io[3];
      element_offsets(r.inner, i, io);
      dot += log ? load(g[io[1]]) : load(g[io[1]]) * load(y[io[2]]);
    }
    dot = block_reduce(dot, Sum{}, A(0), shared);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t io[3];
      element_offsets(r.inner, i, io);
      A yv = load(y[io[2]]);
      A e = log ? math::m_exp(yv) : A(0);
      gx[io[0]] = store_as<T>(math::softmax_grad(log, load(g[io[1]]), yv, dot, e));
    }
  }
}

// loss[n] = -sum_c q_c logp[n, c] (0 for ignored rows).
template <class T>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_kernel(Rows<3> r, acc_t<T> eps, int64_t ignore_index, int64_t classes) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  for (int64_t s = blockIdx.x; s < r.outer.numel; s += gridDim.x) {
    int64_t off[3];
    element_offsets(r.outer, s, off);
    const T* logp = operand<const T>(r.outer.data, 1) + off[1];
    const int64_t t = operand<const int64_t>(r.outer.data, 2)[off[2]];
    if (t == ignore_index) {  // uniform across the block
      if (threadIdx.x == 0) operand<T>(r.outer.data, 0)[off[0]] = store_as<T>(A(0));
      continue;
    }
    if (threadIdx.x == 0) check_index(t, classes, "cross_entropy target");
    A sum = 0;
    for (int64_t i = threadIdx.x; i < classes; i += blockDim.x) {
      int64_t io[3];
      element_offsets(r.inner, i, io);
      sum += load(logp[io[1]]);
    }
    sum = block_reduce(sum, Sum{}, A(0), shared);
    if (threadIdx.x == 0) {
      int64_t io[3];
      element_offsets(r.inner, t, io);
      operand<T>(r.outer.data, 0)[off[0]] =
          store_as<T>(math::cross_entropy_loss(load(logp[io[1]]), sum, eps, classes));
    }
  }
}

// grad_logits[n, c] = grad_loss[n] (exp(logp[n, c]) - q_c), 0 for ignored rows.
template <class T>
struct CrossEntropyBackwardBody {
  acc_t<T> eps;
  int64_t ignore_index, classes;
  __device__ void operator()(const Launch<4>& g, int64_t i, const int64_t* off) const {
    using A = acc_t<T>;
    const int64_t t = operand<const int64_t>(g.data, 3)[off[3]];
    A v = 0;
    if (t != ignore_index) {
      const int64_t c = (g.first_index + i) % classes;
      A q = math::smoothed_target(c, t, eps, classes);
      v = load(operand<const T>(g.data, 2)[off[2]]) *
          (math::m_exp(load(operand<const T>(g.data, 1)[off[1]])) - q);
    }
    operand<T>(g.data, 0)[off[0]] = store_as<T>(v);
  }
};

}  // namespace

void launch_softmax(const Rows<2>& r, DType t, bool log, cudaStream_t stream) {
  if (r.outer.numel == 0) return;
  dispatch_floating(t, "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_kernel<T><<<row_blocks(r.outer.numel), row_threads(r.inner.numel), 0, stream>>>(r, log);
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_softmax_backward(const Rows<3>& r, DType t, bool log, cudaStream_t stream) {
  if (r.outer.numel == 0) return;
  dispatch_floating(t, "softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    softmax_backward_kernel<T>
        <<<row_blocks(r.outer.numel), row_threads(r.inner.numel), 0, stream>>>(r, log);
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_cross_entropy(const Rows<3>& r, DType t, double eps, int64_t ignore_index,
                          int64_t classes, cudaStream_t stream) {
  if (r.outer.numel == 0) return;
  dispatch_floating(t, "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cross_entropy_kernel<T><<<row_blocks(r.outer.numel), row_threads(classes), 0, stream>>>(
        r, acc_t<T>(eps), ignore_index, classes);
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_cross_entropy_backward(const Launch<4>& g, DType t, double eps, int64_t ignore_index,
                                   int64_t classes, cudaStream_t stream) {
  dispatch_floating(t, "cross_entropy_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, CrossEntropyBackwardBody<T>{acc_t<T>(eps), ignore_index, classes}, stream);
  });
}

}  // namespace trainer::cuda
