// The differentiable op set. Every function here validates its arguments,
// allocates a contiguous output, dispatches once to backend(device) and, in
// grad mode, records a node whose Saved struct holds what backward needs
// (autograd.h). Backward formulas live next to their forward, in:
//   ops_elementwise.cpp  unary, binary with broadcasting, where, clamp, masked_fill
//   ops_reduce.cpp       sum, mean, max, argmax, var
//   ops_linalg.cpp       matmul
//   ops_nn.cpp           softmax, log_softmax, cross_entropy, dropout
//   ops_index.cpp        concat, stack, split, index_select, gather, embedding
//   ops_conv.cpp         conv2d, pooling, batch norm, channels-last layout (core/ops_conv.h)
//   tensor.cpp           views, copies, factories
//   random.cpp           uniform, normal, bernoulli, randperm
//
// Broadcasting follows NumPy/PyTorch: shapes align from the right, a size 1
// (or a missing dim) stretches.
//
// Glossary: N batch, C classes/channels, T time, D model width, V vocabulary.
#pragma once

#include <optional>
#include <vector>

#include "core/autograd.h"
#include "core/backend.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace trainer {

// ---- elementwise: unary ----
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
enum class GeluApprox { none, tanh };
Tensor gelu(const Tensor& x, GeluApprox approx = GeluApprox::none);
Tensor silu(const Tensor& x);
Tensor unary(UnaryOp op, const Tensor& x);

// ---- elementwise: binary (broadcasting) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
// With a scalar: x op s, or s op x when scalar_first.
Tensor binary_scalar(BinaryOp op, const Tensor& x, double s, bool scalar_first = false);
Tensor add(const Tensor& x, double s);
Tensor mul(const Tensor& x, double s);
Tensor pow(const Tensor& x, double exponent);

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor clamp(const Tensor& x, double lo, double hi);
// x with value where mask is true (mask broadcasts to x).
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);
// Boolean comparisons (not differentiable).
Tensor eq(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator+(const Tensor& x, double s) { return binary_scalar(BinaryOp::add, x, s); }
inline Tensor operator-(const Tensor& x, double s) { return binary_scalar(BinaryOp::sub, x, s); }
inline Tensor operator*(const Tensor& x, double s) { return binary_scalar(BinaryOp::mul, x, s); }
inline Tensor operator/(const Tensor& x, double s) { return binary_scalar(BinaryOp::div, x, s); }
inline Tensor operator+(double s, const Tensor& x) {
  return binary_scalar(BinaryOp::add, x, s, true);
}
inline Tensor operator-(double s, const Tensor& x) {
  return binary_scalar(BinaryOp::sub, x, s, true);
}
inline Tensor operator*(double s, const Tensor& x) {
  return binary_scalar(BinaryOp::mul, x, s, true);
}
inline Tensor operator/(double s, const Tensor& x) {
  return binary_scalar(BinaryOp::div, x, s, true);
}

// ---- in place, not recorded (optimizers, gradient accumulation) ----
// self += alpha * other (other broadcasts to self).
void add_(const Tensor& self, const Tensor& other, double alpha = 1.0);
void mul_(const Tensor& self, double s);

// ---- reductions over dims (empty dims: all) ----
Tensor sum(const Tensor& x, std::vector<int> dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, std::vector<int> dims = {}, bool keepdim = false);
// Variance with a correction (1: unbiased, as torch.var's default).
Tensor var(const Tensor& x, std::vector<int> dims = {}, int64_t correction = 1,
           bool keepdim = false);
// Max along one dim; the gradient flows to the first maximal element.
Tensor max(const Tensor& x, int dim, bool keepdim = false);
// Max over all elements.
Tensor max(const Tensor& x);
// Index (i64) of the first maximal element along dim.
Tensor argmax(const Tensor& x, int dim, bool keepdim = false);
// Sums a broadcast gradient back to shape (the backward of broadcasting).
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- linear algebra ----
// [..., M, K] @ [..., K, N] -> [..., M, N], batch dims broadcast; 1-d
// operands are promoted as in torch.matmul.
Tensor matmul(const Tensor& a, const Tensor& b);

// ---- softmax, losses, dropout ----
Tensor softmax(const Tensor& x, int dim);
Tensor log_softmax(const Tensor& x, int dim);
struct CrossEntropyOptions {
  double label_smoothing = 0.0;
  int64_t ignore_index = -100;
  enum class Reduction { mean, sum, none } reduction = Reduction::mean;
};
// logits [N, C], target [N] (i64 class indices). Mean over non-ignored rows
// (0, with a zero gradient, when every row is ignored; PyTorch gives NaN).
Tensor cross_entropy(const Tensor& logits, const Tensor& target,
                     const CrossEntropyOptions& options = {});
// Zeroes each element with probability p and scales the rest by 1/(1-p);
// identity when !training or p == 0. Randomness from gen (advanced).
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);

// ---- joining, splitting, indexing ----
Tensor concat(const TensorList& inputs, int dim);
Tensor stack(const TensorList& inputs, int dim);
// Views of x in pieces of split_size along dim (the last may be smaller).
TensorList split(const Tensor& x, int64_t split_size, int dim);
// index: 1-d i32/i64.
Tensor index_select(const Tensor& x, int dim, const Tensor& index);
// torch.gather: index has x's rank; out has index's shape.
Tensor gather(const Tensor& x, int dim, const Tensor& index);
// Zeros with `size` rows along dim, src's row j added at row index[j]
// (repeated indices add up): index_select's adjoint, as
// torch.zeros(...).index_add_(dim, index, src).
Tensor index_add(const Tensor& src, int dim, const Tensor& index, int64_t size);
// weight [V, D], indices of any shape (i32/i64) -> [..., D]. The backward is
// a scatter-add into weight's gradient.
Tensor embedding(const Tensor& weight, const Tensor& indices);

// ---- random ----
Tensor uniform(const Shape& shape, double lo, double hi, Generator& gen, DType dtype = DType::f32,
               Device device = {});
Tensor normal(const Shape& shape, double mean, double std, Generator& gen, DType dtype = DType::f32,
              Device device = {});
// 1 with probability p, else 0, in dtype.
Tensor bernoulli(const Shape& shape, double p, Generator& gen, DType dtype = DType::f32,
                 Device device = {});
// A uniformly random permutation of 0..n-1 (i64, CPU).
Tensor randperm(int64_t n, Generator& gen);
inline Tensor randn(const Shape& shape, Generator& gen) { return normal(shape, 0.0, 1.0, gen); }

// ---- shape helpers ----
Shape broadcast_shapes(const Shape& a, const Shape& b);
// Dims list -> bit mask, wrapping negatives; empty means all.
uint64_t dims_to_mask(const std::vector<int>& dims, int ndim);

}  // namespace trainer
