// matmul: forward and backward.
#include "core/autocast.h"
#include "core/ops.h"

namespace trainer {

namespace {

// out[..., M, N] = a[..., M, K] @ b[..., K, N], batch dims broadcast.
// Backward: grad_a = grad @ b^T, grad_b = a^T @ grad, each summed over the
// batch dims its operand was broadcast along.
struct MatmulFn {
  struct Saved {
    Tensor a, b;
  };
  static constexpr const char* name = "matmul";
  static Tensor forward(Saved& s, const Tensor& a, const Tensor& b) {
    CHECK(a.dim() >= 2 && b.dim() >= 2);
    CHECK(a.device() == b.device())
        << "matmul: operands on " << a.device() << " and " << b.device();
    CHECK(a.dtype() == b.dtype()) << "matmul: dtypes " << a.dtype() << " and " << b.dtype()
                                  << " differ";
    CHECK(is_floating(a.dtype())) << "matmul needs floating tensors, got " << a.dtype();
    int64_t M = a.size(-2), K = a.size(-1), N = b.size(-1);
    CHECK_EQ(b.size(-2), K) << "matmul: inner dims of " << a.shape_str() << " and " << b.shape_str()
                            << " differ";
    Shape batch = broadcast_shapes(Shape(a.shape().begin(), a.shape().end() - 2),
                                   Shape(b.shape().begin(), b.shape().end() - 2));
    Shape sa = batch, sb = batch, so = batch;
    sa.insert(sa.end(), {M, K});
    sb.insert(sb.end(), {K, N});
    so.insert(so.end(), {M, N});
    Tensor out = empty(so, a.dtype(), a.device());
    backend(a.device()).matmul(a.expand(sa), b.expand(sb), out);
    s = Saved{a, b};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask& needs) {
    Tensor ga, gb;
    if (needs[0]) ga = sum_to(matmul(g[0], s.b.transpose(-1, -2)), s.a.shape());
    if (needs[1]) gb = sum_to(matmul(s.a.transpose(-1, -2), g[0]), s.b.shape());
    return {ga, gb};
  }
};

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  CHECK(a_in.defined() && b_in.defined()) << "matmul: undefined operand";
  Tensor a = autocast_lower(a_in), b = autocast_lower(b_in);
  CHECK(a.dim() >= 1 && b.dim() >= 1) << "matmul: 0-d operand";
  if (a.dim() == 1 && b.dim() == 1)
    return autograd::apply<MatmulFn>(a.unsqueeze(0), b.unsqueeze(1)).reshape({});
  if (a.dim() == 1) return autograd::apply<MatmulFn>(a.unsqueeze(0), b).squeeze(-2);
  if (b.dim() == 1) return autograd::apply<MatmulFn>(a, b.unsqueeze(1)).squeeze(-1);
  return autograd::apply<MatmulFn>(a, b);
}

}  // namespace trainer
