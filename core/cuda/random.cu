// Random kernels: element with row-major index i draws Philox counter i of
// the key (core/rng.h), exactly as core/ref/ref_random.cpp, so a CUDA draw
// equals the CPU draw for the same generator. The affine maps run in double
// with explicitly rounded operations (__dmul_rn/__dadd_rn): nvcc would
// otherwise fuse them into an FMA and round differently from the host.
#include "core/cuda/elementwise.cuh"

namespace trainer::cuda {

namespace {

// out = lo + (hi - lo) u
template <class T>
struct UniformBody {
  double lo, span;
  PhiloxKey key;
  __device__ void operator()(const Launch<1>& g, int64_t i, const int64_t* off) const {
    double u = double(philox_uniform(key, uint64_t(g.first_index + i)));
    operand<T>(g.data, 0)[off[0]] = store_converted<T>(__dadd_rn(lo, __dmul_rn(span, u)));
  }
};

// out = mean + std z
template <class T>
struct NormalBody {
  double mean, std;
  PhiloxKey key;
  __device__ void operator()(const Launch<1>& g, int64_t i, const int64_t* off) const {
    double z = double(philox_normal(key, uint64_t(g.first_index + i)));
    operand<T>(g.data, 0)[off[0]] = store_converted<T>(__dadd_rn(mean, __dmul_rn(std, z)));
  }
};

// out = 1 if u < p else 0
template <class T>
struct BernoulliBody {
  double p;
  PhiloxKey key;
  __device__ void operator()(const Launch<1>& g, int64_t i, const int64_t* off) const {
    double u = double(philox_uniform(key, uint64_t(g.first_index + i)));
    operand<T>(g.data, 0)[off[0]] = store_converted<T>(u < p ? 1.0 : 0.0);
  }
};

}  // namespace

void launch_uniform(const Launch<1>& g, DType t, double lo, double hi, PhiloxKey key,
                    cudaStream_t stream) {
  dispatch_all(t, "uniform", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, UniformBody<T>{lo, hi - lo, key}, stream);
  });
}

void launch_normal(const Launch<1>& g, DType t, double mean, double std, PhiloxKey key,
                   cudaStream_t stream) {
  dispatch_all(t, "normal", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, NormalBody<T>{mean, std, key}, stream);
  });
}

void launch_bernoulli(const Launch<1>& g, DType t, double p, PhiloxKey key, cudaStream_t stream) {
  dispatch_all(t, "bernoulli", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, BernoulliBody<T>{p, key}, stream);
  });
}

}  // namespace trainer::cuda
