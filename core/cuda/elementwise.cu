// Elementwise math kernels: the shared functors of core/elementwise_math.h
// (the same ones the CPU reference and fast paths run) inside the one
// strided kernel of elementwise.cuh. Loads and stores go through
// core/dtype.h, so bf16/f16 compute in float and round to nearest even as on
// the CPU.
#include "core/cuda/elementwise.cuh"
#include "core/elementwise_math.h"

namespace trainer::cuda {

namespace {

// ---- bodies: one element each; operand order as in launch.h ----

template <class T, class F>
struct UnaryBody {
  F f;
  __device__ void operator()(const Launch<2>& g, int64_t, const int64_t* off) const {
    operand<T>(g.data, 0)[off[0]] = store_as<T>(f(load(operand<const T>(g.data, 1)[off[1]])));
  }
};

template <class T, class F>
struct UnaryBackwardBody {
  F f;
  __device__ void operator()(const Launch<4>& g, int64_t, const int64_t* off) const {
    acc_t<T> x = load(operand<const T>(g.data, 1)[off[1]]);
    acc_t<T> y = load(operand<const T>(g.data, 2)[off[2]]);
    acc_t<T> grad = load(operand<const T>(g.data, 3)[off[3]]);
    operand<T>(g.data, 0)[off[0]] = store_as<T>(f.grad(x, y, grad));
  }
};

template <class T, class F>
struct BinaryBody {
  F f;
  __device__ void operator()(const Launch<3>& g, int64_t, const int64_t* off) const {
    acc_t<T> a = load(operand<const T>(g.data, 1)[off[1]]);
    acc_t<T> b = load(operand<const T>(g.data, 2)[off[2]]);
    operand<T>(g.data, 0)[off[0]] = store_as<T>(f(a, b));
  }
};

template <class T, class F>
struct BinaryScalarBody {
  F f;
  acc_t<T> s;
  bool scalar_first;
  __device__ void operator()(const Launch<2>& g, int64_t, const int64_t* off) const {
    acc_t<T> a = load(operand<const T>(g.data, 1)[off[1]]);
    operand<T>(g.data, 0)[off[0]] = store_as<T>(scalar_first ? f(s, a) : f(a, s));
  }
};

template <class T>
struct ClampBody {
  acc_t<T> lo, hi;
  __device__ void operator()(const Launch<2>& g, int64_t, const int64_t* off) const {
    acc_t<T> x = load(operand<const T>(g.data, 1)[off[1]]);
    operand<T>(g.data, 0)[off[0]] = store_as<T>(math::clamp(x, lo, hi));
  }
};

// grad_x = grad where lo <= x <= hi, else 0.
template <class T>
struct ClampBackwardBody {
  acc_t<T> lo, hi;
  __device__ void operator()(const Launch<3>& g, int64_t, const int64_t* off) const {
    acc_t<T> grad = load(operand<const T>(g.data, 1)[off[1]]);
    acc_t<T> x = load(operand<const T>(g.data, 2)[off[2]]);
    operand<T>(g.data, 0)[off[0]] = store_as<T>(x >= lo && x <= hi ? grad : acc_t<T>(0));
  }
};

template <class T>
struct CompareBody {
  CompareOp op;
  __device__ void operator()(const Launch<3>& g, int64_t, const int64_t* off) const {
    acc_t<T> a = load(operand<const T>(g.data, 1)[off[1]]);
    acc_t<T> b = load(operand<const T>(g.data, 2)[off[2]]);
    operand<bool>(g.data, 0)[off[0]] =
        op == CompareOp::eq ? a == b : (op == CompareOp::lt ? a < b : a > b);
  }
};

}  // namespace

// ---- launchers ----

void launch_unary(UnaryOp op, const Launch<2>& g, DType t, cudaStream_t stream) {
  dispatch_floating(t, unary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_unary(op,
                      [&](auto f) { run_elementwise(g, UnaryBody<T, decltype(f)>{f}, stream); });
  });
}

void launch_unary_backward(UnaryOp op, const Launch<4>& g, DType t, cudaStream_t stream) {
  dispatch_floating(t, unary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_unary(
        op, [&](auto f) { run_elementwise(g, UnaryBackwardBody<T, decltype(f)>{f}, stream); });
  });
}

void launch_binary(BinaryOp op, const Launch<3>& g, DType t, cudaStream_t stream) {
  dispatch_floating(t, binary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_binary(op,
                       [&](auto f) { run_elementwise(g, BinaryBody<T, decltype(f)>{f}, stream); });
  });
}

void launch_binary_scalar(BinaryOp op, const Launch<2>& g, DType t, double s, bool scalar_first,
                          cudaStream_t stream) {
  dispatch_floating(t, binary_op_name(op), [&](auto tag) {
    using T = typename decltype(tag)::type;
    math::visit_binary(op, [&](auto f) {
      run_elementwise(g, BinaryScalarBody<T, decltype(f)>{f, acc_t<T>(s), scalar_first}, stream);
    });
  });
}

void launch_clamp(const Launch<2>& g, DType t, double lo, double hi, cudaStream_t stream) {
  dispatch_floating(t, "clamp", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, ClampBody<T>{acc_t<T>(lo), acc_t<T>(hi)}, stream);
  });
}

void launch_clamp_backward(const Launch<3>& g, DType t, double lo, double hi, cudaStream_t stream) {
  dispatch_floating(t, "clamp_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, ClampBackwardBody<T>{acc_t<T>(lo), acc_t<T>(hi)}, stream);
  });
}

void launch_compare(CompareOp op, const Launch<3>& g, DType t, cudaStream_t stream) {
  dispatch_all(t, "compare", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_elementwise(g, CompareBody<T>{op}, stream);
  });
}

}  // namespace trainer::cuda
