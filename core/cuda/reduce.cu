// Reduction kernels: sum / max / min of each row (optionally of squared or
// weighted deviations from a per-row center, for var and the batch-norm
// statistics), and max with argmax along one dim. One block per row (or per
// part of a row when the host splits long rows), accumulating in acc_t<T>.
#include "core/cuda/rows.cuh"

namespace trainer::cuda {

namespace {

template <class A>
__device__ A reduce_identity(ReduceOp op) {
  return op == ReduceOp::max ? A(-INFINITY) : op == ReduceOp::min ? A(INFINITY) : A(0);
}

template <class A>
__device__ A reduce_combine(ReduceOp op, A a, A b) {
  return op == ReduceOp::max ? Max{}(a, b) : op == ReduceOp::min ? Min{}(a, b) : a + b;
}

template <class A>
__device__ A block_combine(ReduceOp op, A v, A* shared) {
  A id = reduce_identity<A>(op);
  if (op == ReduceOp::max) return block_reduce(v, Max{}, id, shared);
  if (op == ReduceOp::min) return block_reduce(v, Min{}, id, shared);
  return block_reduce(v, Sum{}, id, shared);
}

template <class T, class O>
__global__ void __launch_bounds__(kRowThreads) reduce_kernel(Rows<3> r, ReduceArgs a) {
  using A = acc_t<T>;
  __shared__ A shared[32];
  const int64_t count = r.inner.numel;
  const int64_t per = (count + a.splits - 1) / a.splits;
  const int64_t begin = int64_t(blockIdx.y) * per;
  const int64_t end = begin + per < count ? begin + per : count;
  const A id = reduce_identity<A>(a.op);
  for (int64_t s = blockIdx.x; s < r.outer.numel; s += gridDim.x) {
    int64_t off[3];
    element_offsets(r.outer, s, off);
    const T* x = operand<const T>(r.outer.data, 1) + off[1];
    const T* y = operand<const T>(r.outer.data, 2) + off[2];
    const A center = a.mode == RowMode::value ? A(0) : static_cast<const A*>(a.center)[s];
    A acc = id;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      int64_t io[3];
      element_offsets(r.inner, i, io);
      A v = load(x[io[1]]);
      if (a.mode == RowMode::sq_dev)
        v = (v - center) * (v - center);
      else if (a.mode == RowMode::prod_dev)
        v = load(y[io[2]]) * (v - center);
      acc = reduce_combine(a.op, acc, v);
    }
    acc = block_combine(a.op, acc, shared);
    if (threadIdx.x != 0) continue;
    if (a.splits > 1)
      reinterpret_cast<A*>(r.outer.data[0])[off[0] * a.splits + blockIdx.y] = acc;
    else
      operand<O>(r.outer.data, 0)[off[0]] =
          store_as<O>(a.op == ReduceOp::sum ? acc * A(a.scale) : acc);
  }
}

// Rows adjacent in memory (x and y have unit stride across rows): block
// (32, 8) covers 32 rows, its 8 lanes of threads stride through part
// blockIdx.y of each row's elements, so a warp reads 32 consecutive values.
// Writes partial[part, row] in acc_t<T>, unscaled.
template <class T>
__global__ void __launch_bounds__(256)
    column_reduce_kernel(Rows<3> r, ReduceArgs a, void* partial) {
  using A = acc_t<T>;
  __shared__ A shared[8][33];
  const int64_t rows = r.outer.numel, count = r.inner.numel;
  const int64_t per = (count + a.splits - 1) / a.splits;
  const int64_t row = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * per;
  const int64_t end = begin + per < count ? begin + per : count;
  A acc = reduce_identity<A>(a.op);
  if (row < rows) {
    int64_t off[3];
    element_offsets(r.outer, row, off);
    const T* x = operand<const T>(r.outer.data, 1) + off[1];
    const T* y = operand<const T>(r.outer.data, 2) + off[2];
    const A center = a.mode == RowMode::value ? A(0) : static_cast<const A*>(a.center)[row];
    for (int64_t i = begin + threadIdx.y; i < end; i += 8) {
      int64_t io[3];
      element_offsets(r.inner, i, io);
      A v = load(x[io[1]]);
      if (a.mode == RowMode::sq_dev)
        v = (v - center) * (v - center);
      else if (a.mode == RowMode::prod_dev)
        v = load(y[io[2]]) * (v - center);
      acc = reduce_combine(a.op, acc, v);
    }
  }
  shared[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && row < rows) {
    for (int k = 1; k < 8; ++k) acc = reduce_combine(a.op, acc, shared[k][threadIdx.x]);
    static_cast<A*>(partial)[int64_t(blockIdx.y) * rows + row] = acc;
  }
}

template <class K>
__device__ bool is_nan(K v) {
  if constexpr (std::is_floating_point_v<K>)
    return isnan(v);
  else
    return false;
}

// Keeps the better of (v, i) and (bv, bi) (index -1: none yet): NaN first,
// then the larger value, then the smaller index.
template <class K>
__device__ void arg_combine(K& v, int64_t& i, K bv, int64_t bi) {
  const bool v_nan = is_nan(v), b_nan = is_nan(bv);
  bool take;
  if (bi < 0)
    take = false;
  else if (i < 0)
    take = true;
  else if (v_nan || b_nan)
    take = b_nan && (!v_nan || bi < i);
  else
    take = bv > v || (bv == v && bi < i);
  if (take) v = bv, i = bi;
}

// Any dtype; compares in K: acc_t<T> for floating types, int64_t otherwise
// (what the warp shuffles move).
template <class T>
__global__ void __launch_bounds__(kRowThreads) max_dim_kernel(Rows<3> r) {
  using K = std::conditional_t<std::is_floating_point_v<acc_t<T>>, acc_t<T>, int64_t>;
  __shared__ K shared_v[32];
  __shared__ int64_t shared_i[32];
  const int64_t count = r.inner.numel;
  for (int64_t s = blockIdx.x; s < r.outer.numel; s += gridDim.x) {
    int64_t off[3];
    element_offsets(r.outer, s, off);
    const T* x = operand<const T>(r.outer.data, 2) + off[2];
    K best = K(0);
    int64_t arg = -1;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      int64_t io[3];
      element_offsets(r.inner, i, io);
      arg_combine(best, arg, K(load(x[io[2]])), i);
    }
    for (int o = 16; o > 0; o /= 2) {
      K ov = __shfl_xor_sync(0xffffffffu, best, o);
      int64_t oi = __shfl_xor_sync(0xffffffffu, arg, o);
      arg_combine(best, arg, ov, oi);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // the previous row's thread 0 is done with shared
    if (lane == 0) shared_v[warp] = best, shared_i[warp] = arg;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < int(blockDim.x / 32); ++w)
        arg_combine(best, arg, shared_v[w], shared_i[w]);
      operand<T>(r.outer.data, 0)[off[0]] = store_converted<T>(best);
      operand<int64_t>(r.outer.data, 1)[off[1]] = arg;
    }
  }
}

}  // namespace

void launch_reduce(const Rows<3>& r, DType t, DType out_t, const ReduceArgs& a,
                   cudaStream_t stream) {
  if (r.outer.numel == 0) return;
  CHECK(a.splits >= 1 && a.splits <= 65535) << "reduce: " << a.splits << " splits";
  dispatch_floating(t, "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_floating(out_t, "reduce", [&](auto otag) {
      using O = typename decltype(otag)::type;
      dim3 grid(row_blocks(r.outer.numel), unsigned(a.splits));
      int threads = row_threads((r.inner.numel + a.splits - 1) / a.splits);
      reduce_kernel<T, O><<<grid, threads, 0, stream>>>(r, a);
      CUDA_CHECK(cudaGetLastError());
    });
  });
}

void launch_column_reduce(const Rows<3>& r, DType t, const ReduceArgs& a, void* partial,
                          cudaStream_t stream) {
  if (r.outer.numel == 0) return;
  CHECK(a.splits >= 1 && a.splits <= 65535) << "reduce: " << a.splits << " splits";
  dispatch_floating(t, "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dim3 grid(unsigned((r.outer.numel + 31) / 32), unsigned(a.splits));
    column_reduce_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(r, a, partial);
    CUDA_CHECK(cudaGetLastError());
  });
}

void launch_max_dim(const Rows<3>& r, DType t, cudaStream_t stream) {
  if (r.outer.numel == 0) return;
  dispatch_all(t, "max_dim", [&](auto tag) {
    using T = typename decltype(tag)::type;
    max_dim_kernel<T><<<row_blocks(r.outer.numel), row_threads(r.inner.numel), 0, stream>>>(r);
    CUDA_CHECK(cudaGetLastError());
  });
}

}  // namespace trainer::cuda
