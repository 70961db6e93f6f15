// Data-movement kernels for every dtype: copy with conversion, fill and
// where, in the strided kernel of elementwise.cuh. Conversions are those of
// the CPU kernels (core/dtype.h; bool is v != 0). Kept apart from the math
// kernels so the two (the copy alone has 64 dtype pairs) compile in parallel.
#include "core/cuda/elementwise.cuh"

namespace trainer::cuda {

namespace {

template <class D, class S>
struct CopyBody {
  __device__ void operator()(const Launch<2>& g, int64_t, const int64_t* off) const {
    operand<D>(g.data, 0)[off[0]] = store_converted<D>(load(operand<const S>(g.data, 1)[off[1]]));
  }
};

template <class T>
struct FillBody {
  T value;
  __device__ void operator()(const Launch<1>& g, int64_t, const int64_t* off) const {
    operand<T>(g.data, 0)[off[0]] = value;
  }
};

template <class T>
struct WhereBody {
  __device__ void operator()(const Launch<4>& g, int64_t, const int64_t* off) const {
    bool c = operand<const bool>(g.data, 1)[off[1]];
    operand<T>(g.data, 0)[off[0]] =
        c ? operand<const T>(g.data, 2)[off[2]] : operand<const T>(g.data, 3)[off[3]];
  }
};

}  // namespace

void launch_copy(const Launch<2>& g, DType dst, DType src, cudaStream_t stream) {
  dispatch_all(dst, "copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_all(src, "copy", [&](auto stag) {
      using S = typename decltype(stag)::type;
      run_elementwise(g, CopyBody<D, S>{}, stream);
    });
  });
}

void launch_fill(const Launch<1>& g, DType t, double value, cudaStream_t stream) {
  dispatch_all(t, "fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, FillBody<T>{store_converted<T>(value)}, stream);
  });
}

void launch_where(const Launch<4>& g, DType t, cudaStream_t stream) {
  dispatch_all(t, "where", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, WhereBody<T>{}, stream);
  });
}

}  // namespace trainer::cuda
