// Layer norm (forward and backward through the backend's fused kernels) and
// causal attention composed of matmul, masked_fill, softmax and dropout.
#include "core/ops_transformer.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace trainer {

using autograd::GradMask;

namespace {

// out = (x - mean) rstd w + b over the last dim of x [R, D] (contiguous).
// Backward, with xhat = (x - mean) rstd and gw = g w:
// gx = rstd (gw - mean_D(gw) - xhat mean_D(gw xhat)), gweight = sum_R g xhat,
// gbias = sum_R g.
struct LayerNormFn {
  struct Saved {
    Tensor x, weight, mean, rstd;
  };
  static constexpr const char* name = "layer_norm";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& weight, const Tensor& bias,
                        double eps) {
    DType stat_dtype = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    Tensor mean = empty({x.size(0)}, stat_dtype, x.device());
    Tensor rstd = empty({x.size(0)}, stat_dtype, x.device());
    if (x.numel() > 0)
      backend(x.device()).layer_norm_forward(x, weight, bias, eps, out, mean, rstd);
    s = Saved{x, weight, mean, rstd};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_out = g[0].contiguous();
    Tensor grad_x = empty(s.x.shape(), s.x.dtype(), s.x.device());
    Tensor grad_weight = empty(s.weight.shape(), s.weight.dtype(), s.weight.device());
    Tensor grad_bias = empty(s.weight.shape(), s.weight.dtype(), s.weight.device());
    if (s.x.numel() > 0) {
      backend(s.x.device())
          .layer_norm_backward(grad_out, s.x, s.weight, s.mean, s.rstd, grad_x, grad_weight,
                               grad_bias);
    } else {
      backend(s.x.device()).fill(grad_weight, 0.0);
      backend(s.x.device()).fill(grad_bias, 0.0);
    }
    return {grad_x, grad_weight, grad_bias};
  }
};

}  // namespace

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  CHECK(x.defined() && weight.defined() && bias.defined()) << "layer_norm: undefined tensor";
  CHECK(is_floating(x.dtype())) << "layer_norm needs a floating tensor, got " << x.dtype();
  CHECK(x.dim() >= 1) << "layer_norm needs at least one dim, got " << x.shape_str();
  int64_t D = x.size(-1);
  CHECK(weight.shape() == Shape{D} && bias.shape() == Shape{D})
      << "layer_norm: weight " << weight.shape_str() << " and bias " << bias.shape_str()
      << " must be [" << D << "] for x " << x.shape_str();
  CHECK(weight.device() == x.device() && bias.device() == x.device())
      << "layer_norm: x on " << x.device() << ", weight on " << weight.device() << ", bias on "
      << bias.device();
  CHECK(eps >= 0.0) << "layer_norm: eps " << eps << " is negative";
  Shape shape = x.shape();
  Tensor rows = x.contiguous().reshape({x.numel() / std::max<int64_t>(D, 1), D});
  Tensor out = autograd::apply<LayerNormFn>(rows, weight.contiguous(), bias.contiguous(), eps);
  return out.reshape(shape);
}

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads,
                        double dropout_p, bool training, Generator& gen) {
  CHECK(q.defined() && k.defined() && v.defined()) << "causal_attention: undefined tensor";
  CHECK(q.dim() == 3 && k.shape() == q.shape() && v.shape() == q.shape())
      << "causal_attention: q " << q.shape_str() << ", k " << k.shape_str() << ", v "
      << v.shape_str() << " must all be [B, T, D]";
  int64_t T = q.size(1), D = q.size(2);
  CHECK(num_heads >= 1 && D % num_heads == 0)
      << "causal_attention: width " << D << " is not a multiple of " << num_heads << " heads";
  int64_t HD = D / num_heads;
  // mask[t, s] = s > t: the future a position may not see.
  Tensor pos = arange(T, DType::i64, q.device());
  Tensor future = gt(pos.reshape({1, T}), pos.reshape({T, 1}));
  double scale = 1.0 / std::sqrt(double(HD));
  TensorList heads;
  for (int64_t h = 0; h < num_heads; ++h) {
    Tensor qh = q.narrow(2, h * HD, HD) * scale;  // [B, T, HD]
    Tensor kh = k.narrow(2, h * HD, HD);
    Tensor vh = v.narrow(2, h * HD, HD);
    Tensor scores = matmul(qh, kh.transpose(1, 2));  // [B, T, T]
    scores = masked_fill(scores, future, -std::numeric_limits<double>::infinity());
    Tensor att = dropout(softmax(scores, -1), dropout_p, training, gen);
    heads.push_back(matmul(att, vh));  // [B, T, HD]
  }
  return num_heads == 1 ? heads[0] : concat(heads, 2);
}

}  // namespace trainer
