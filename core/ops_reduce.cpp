// Reductions: forward and backward side by side. Kernels reduce into the
// keepdim layout; the op drops the reduced dims unless keepdim.
#include "core/autocast.h"
#include "core/ops.h"

namespace trainer {

using autograd::GradMask;

uint64_t dims_to_mask(const std::vector<int>& dims, int ndim) {
  CHECK_LE(ndim, 64) << "reductions support up to 64 dims";
  if (dims.empty()) return ndim == 64 ? ~uint64_t(0) : (uint64_t(1) << ndim) - 1;
  uint64_t mask = 0;
  for (int d : dims) {
    int w = d < 0 ? d + ndim : d;
    CHECK(w >= 0 && w < std::max(ndim, 1))
        << "reduction dim " << d << " out of range for " << ndim << " dims";
    CHECK(!((mask >> w) & 1)) << "reduction dim " << d << " repeated";
    if (ndim > 0) mask |= uint64_t(1) << w;
  }
  return mask;
}

namespace {

Shape keepdim_shape(const Shape& s, uint64_t mask) {
  Shape k = s;
  for (size_t d = 0; d < s.size(); ++d)
    if ((mask >> d) & 1) k[d] = 1;
  return k;
}

Shape dropped_shape(const Shape& s, uint64_t mask) {
  Shape k;
  for (size_t d = 0; d < s.size(); ++d)
    if (!((mask >> d) & 1)) k.push_back(s[d]);
  return k;
}

int64_t reduced_count(const Shape& s, uint64_t mask) {
  int64_t n = 1;
  for (size_t d = 0; d < s.size(); ++d)
    if ((mask >> d) & 1) n *= s[d];
  return n;
}

Tensor finish(const Tensor& kept, const Shape& in_shape, uint64_t mask, bool keepdim) {
  return keepdim ? kept : kept.reshape(dropped_shape(in_shape, mask));
}

void check_floating(const char* op, const Tensor& x) {
  CHECK(x.defined()) << op << ": undefined tensor";
  CHECK(is_floating(x.dtype())) << op << " needs a floating tensor, got " << x.dtype();
}

// out = sum (or mean) of x over the masked dims.
// Backward: every input element receives the output's gradient (/ count for mean).
struct SumFn {
  struct Saved {
    Shape in_shape;
    uint64_t mask;
    bool mean;
  };
  static constexpr const char* name = "sum";
  static Tensor forward(Saved& s, const Tensor& x, uint64_t mask, bool keepdim, bool mean) {
    check_floating(mean ? "mean" : "sum", x);
    Tensor kept = empty(keepdim_shape(x.shape(), mask), x.dtype(), x.device());
    backend(x.device()).reduce(mean ? ReduceOp::mean : ReduceOp::sum, x, mask, kept);
    s = Saved{x.shape(), mask, mean};
    return finish(kept, x.shape(), mask, keepdim);
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad = g[0].reshape(keepdim_shape(s.in_shape, s.mask));
    if (s.mean)
      grad = grad * (1.0 / double(std::max<int64_t>(reduced_count(s.in_shape, s.mask), 1)));
    return {grad.expand(s.in_shape)};
  }
};

// var = sum (x - mean)^2 / (n - correction).
// Backward: grad_x = grad * 2 (x - mean) / (n - correction).
struct VarFn {
  struct Saved {
    Tensor x;
    uint64_t mask;
    int64_t correction;
  };
  static constexpr const char* name = "var";
  static Tensor forward(Saved& s, const Tensor& x, uint64_t mask, int64_t correction,
                        bool keepdim) {
    check_floating("var", x);
    Tensor kept = empty(keepdim_shape(x.shape(), mask), x.dtype(), x.device());
    backend(x.device()).var(x, mask, correction, kept);
    s = Saved{x, mask, correction};
    return finish(kept, x.shape(), mask, keepdim);
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Shape kept = keepdim_shape(s.x.shape(), s.mask);
    double denom = double(reduced_count(s.x.shape(), s.mask) - s.correction);
    Tensor m = empty(kept, s.x.dtype(), s.x.device());
    backend(s.x.device()).reduce(ReduceOp::mean, s.x, s.mask, m);
    return {(s.x - m) * g[0].reshape(kept) * (2.0 / denom)};
  }
};

// Max along one dim. Backward: the gradient goes to the (first) arg max.
struct MaxDimFn {
  struct Saved {
    Shape in_shape;
    int dim;
    Tensor indices;  // keepdim layout
  };
  static constexpr const char* name = "max";
  static Tensor forward(Saved& s, const Tensor& x, int dim, bool keepdim) {
    check_floating("max", x);
    int d = x.wrap_dim(dim);
    CHECK(x.shape()[d] > 0) << "max over an empty dim of " << x.shape_str();
    Shape kept = keepdim_shape(x.shape(), uint64_t(1) << d);
    Tensor values = empty(kept, x.dtype(), x.device());
    Tensor indices = empty(kept, DType::i64, x.device());
    backend(x.device()).max_dim(x, d, values, indices);
    s = Saved{x.shape(), d, indices};
    return finish(values, x.shape(), uint64_t(1) << d, keepdim);
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad = zeros(s.in_shape, g[0].dtype(), g[0].device());
    backend(grad.device()).scatter_add(grad, s.dim, s.indices, g[0].reshape(s.indices.shape()));
    return {grad};
  }
};

}  // namespace

Tensor sum(const Tensor& x, std::vector<int> dims, bool keepdim) {
  return autograd::apply<SumFn>(autocast_fp32(x), dims_to_mask(dims, x.dim()), keepdim, false);
}

Tensor mean(const Tensor& x, std::vector<int> dims, bool keepdim) {
  return autograd::apply<SumFn>(autocast_fp32(x), dims_to_mask(dims, x.dim()), keepdim, true);
}

Tensor var(const Tensor& x, std::vector<int> dims, int64_t correction, bool keepdim) {
  return autograd::apply<VarFn>(x, dims_to_mask(dims, x.dim()), correction, keepdim);
}

Tensor max(const Tensor& x, int dim, bool keepdim) {
  return autograd::apply<MaxDimFn>(x, dim, keepdim);
}

Tensor max(const Tensor& x) { return max(x.reshape({-1}), 0); }

Tensor argmax(const Tensor& x, int dim, bool keepdim) {
  CHECK(x.defined()) << "argmax: undefined tensor";
  int d = x.wrap_dim(dim);
  CHECK(x.shape()[d] > 0) << "argmax over an empty dim of " << x.shape_str();
  Shape kept = keepdim_shape(x.shape(), uint64_t(1) << d);
  Tensor values = empty(kept, x.dtype(), x.device());
  Tensor indices = empty(kept, DType::i64, x.device());
  autograd::NoGradGuard no_grad;
  backend(x.device()).max_dim(x, d, values, indices);
  return finish(indices, x.shape(), uint64_t(1) << d, keepdim);
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  CHECK_LE(shape.size(), size_t(x.dim()))
      << "sum_to: " << x.shape_str() << " to " << shape_str(shape);
  size_t lead = size_t(x.dim()) - shape.size();
  std::vector<int> dims;
  for (size_t d = 0; d < size_t(x.dim()); ++d) {
    if (d < lead) {
      dims.push_back(int(d));
    } else if (shape[d - lead] == 1 && x.shape()[d] != 1) {
      dims.push_back(int(d));
    } else {
      CHECK_EQ(shape[d - lead], x.shape()[d])
          << "sum_to: " << x.shape_str() << " to " << shape_str(shape);
    }
  }
  if (dims.empty()) return x.reshape(shape);
  return sum(x, dims, true).reshape(shape);
}

}  // namespace trainer
