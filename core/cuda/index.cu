// Indexing kernels on the strided kernel of elementwise.cuh: gather (also
// index_select) reads through an index, scatter-add adds through one with
// atomics, so repeated indices add up (in an unspecified order).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda/rows.cuh"

namespace trainer::cuda {

namespace {

template <class T, class I>
struct GatherBody {
  int64_t x_stride, dim_size;
  __device__ void operator()(const Launch<3>& g, int64_t, const int64_t* off) const {
    int64_t v = int64_t(operand<const I>(g.data, 2)[off[2]]);
    check_index(v, dim_size, "gather");
    operand<T>(g.data, 0)[off[0]] = operand<const T>(g.data, 1)[off[1] + v * x_stride];
  }
};

template <class T>
__device__ void atomic_add(T* dst, T v) {
  if constexpr (std::is_same_v<T, bf16>)
    atomicAdd(reinterpret_cast<__nv_bfloat16*>(dst), __ushort_as_bfloat16(v.bits));
  else if constexpr (std::is_same_v<T, f16>)
    atomicAdd(reinterpret_cast<__half*>(dst), __ushort_as_half(v.bits));
  else if constexpr (std::is_same_v<T, int64_t>)
    atomicAdd(reinterpret_cast<unsigned long long*>(dst), static_cast<unsigned long long>(v));
  else
    atomicAdd(dst, v);
}

template <class T, class I>
struct ScatterAddBody {
  int64_t dst_stride, dim_size;
  __device__ void operator()(const Launch<3>& g, int64_t, const int64_t* off) const {
    int64_t v = int64_t(operand<const I>(g.data, 2)[off[2]]);
    check_index(v, dim_size, "scatter_add");
    atomic_add(operand<T>(g.data, 1) + off[1] + v * dst_stride,
               operand<const T>(g.data, 0)[off[0]]);
  }
};

}  // namespace

void launch_gather(const Launch<3>& g, DType t, DType index_t, int64_t x_stride, int64_t dim_size,
                   cudaStream_t stream) {
  dispatch_all(t, "gather", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_index(index_t, "gather", [&](auto itag) {
      using I = typename decltype(itag)::type;
      run_elementwise(g, GatherBody<T, I>{x_stride, dim_size}, stream);
    });
  });
}

void launch_scatter_add(const Launch<3>& g, DType t, DType index_t, int64_t dst_stride,
                        int64_t dim_size, cudaStream_t stream) {
  auto run = [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_index(index_t, "scatter_add", [&](auto itag) {
      using I = typename decltype(itag)::type;
      run_elementwise(g, ScatterAddBody<T, I>{dst_stride, dim_size}, stream);
    });
  };
  switch (t) {
    case DType::i32:
      return run(TypeTag<int32_t>{});
    case DType::i64:
      return run(TypeTag<int64_t>{});
    default:
      dispatch_floating(t, "scatter_add", run);
  }
}

}  // namespace trainer::cuda
