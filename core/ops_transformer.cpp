// Layer norm, RMS norm and causal attention: forward and backward through
// the backend's fused kernels (sections "layer norm", "RMS norm" and
// "attention").
#include "core/ops_transformer.h"

#include <algorithm>
#include <cmath>

#include "core/autocast.h"

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

// out = x rstd w over the last dim of x [R, D] (contiguous). Backward, with
// xhat = x rstd and gw = g w: gx = rstd (gw - xhat mean_D(gw xhat)),
// gweight = sum_R g xhat.
struct RmsNormFn {
  struct Saved {
    Tensor x, weight, rstd;
  };
  static constexpr const char* name = "rms_norm";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& weight, double eps) {
    DType stat_dtype = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    Tensor rstd = empty({x.size(0)}, stat_dtype, x.device());
    if (x.numel() > 0) backend(x.device()).rms_norm_forward(x, weight, eps, out, rstd);
    s = Saved{x, weight, rstd};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_out = g[0].contiguous();
    Tensor grad_x = empty(s.x.shape(), s.x.dtype(), s.x.device());
    Tensor grad_weight = empty(s.weight.shape(), s.weight.dtype(), s.weight.device());
    if (s.x.numel() > 0)
      backend(s.x.device()).rms_norm_backward(grad_out, s.x, s.weight, s.rstd, grad_x, grad_weight);
    else
      backend(s.x.device()).fill(grad_weight, 0.0);
    return {grad_x, grad_weight};
  }
};

// out[b, t, head h] = sum_{s <= t} p[t, s] m[t, s] v_s with
// p = softmax_s(scale q_t . k_s) over s <= t and m the dropout multipliers
// (Backend::attention_forward). Saves q, k, v, out and the row lse; the
// backward recomputes p from them (Backend::attention_backward):
// grad_v = (p m)^T g, ds = p (m (g v^T) - rowsum(g * out)),
// grad_q = scale ds k, grad_k = scale ds^T q.
struct AttentionSaved {
  Tensor q, k, v, out, lse;
  AttentionAttrs attrs;
};

Tensor attention_forward(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionAttrs& attrs) {
  DType stat_dtype = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor out = empty(q.shape(), q.dtype(), q.device());
  Tensor lse = empty({q.size(0), attrs.num_heads, q.size(1)}, stat_dtype, q.device());
  if (q.numel() > 0) backend(q.device()).attention_forward(q, k, v, attrs, out, lse);
  s = AttentionSaved{q, k, v, out, lse, attrs};
  return out;
}

// Writes the gradients into grad_q, grad_k, grad_v (any views with a unit last stride).
void attention_backward(const AttentionSaved& s, const Tensor& grad, const Tensor& grad_q,
                        const Tensor& grad_k, const Tensor& grad_v) {
  if (s.q.numel() == 0) return;
  backend(s.q.device())
      .attention_backward(grad.contiguous(), s.q, s.k, s.v, s.out, s.lse, s.attrs, grad_q, grad_k,
                          grad_v);
}

// q, k, v as three inputs, each with its own gradient (k's and v's [B, T,
// KV HD] under grouped-query attention).
struct CausalAttentionFn {
  using Saved = AttentionSaved;
  static constexpr const char* name = "causal_attention";
  static Tensor forward(Saved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionAttrs& attrs) {
    return attention_forward(s, q, k, v, attrs);
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_q = empty(s.q.shape(), s.q.dtype(), s.q.device());
    Tensor grad_k = empty(s.k.shape(), s.k.dtype(), s.k.device());
    Tensor grad_v = empty(s.v.shape(), s.v.dtype(), s.v.device());
    attention_backward(s, g[0], grad_q, grad_k, grad_v);
    return {grad_q, grad_k, grad_v};
  }
};

// One fused qkv [B, T, 3D] input: the kernel writes the three gradients
// straight into the thirds of one [B, T, 3D] gradient.
struct CausalAttentionQkvFn {
  using Saved = AttentionSaved;
  static constexpr const char* name = "causal_attention_qkv";
  static Tensor forward(Saved& s, const Tensor& qkv, const AttentionAttrs& attrs) {
    int64_t D = qkv.size(2) / 3;
    return attention_forward(s, qkv.narrow(2, 0, D), qkv.narrow(2, D, D), qkv.narrow(2, 2 * D, D),
                             attrs);
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    int64_t B = s.q.size(0), T = s.q.size(1), D = s.q.size(2);
    Tensor grad = empty({B, T, 3 * D}, s.q.dtype(), s.q.device());
    attention_backward(s, g[0], grad.narrow(2, 0, D), grad.narrow(2, D, D),
                       grad.narrow(2, 2 * D, D));
    return {grad};
  }
};

// The attributes of one call (num_kv_heads resolved: NH for 0); draws the
// dropout key when dropout is on.
AttentionAttrs attention_attrs(const Tensor& q, int64_t num_heads, int64_t num_kv_heads,
                               double dropout_p, bool training, Generator& gen) {
  int64_t B = q.size(0), T = q.size(1), D = q.size(2);
  CHECK(num_heads >= 1 && D % num_heads == 0)
      << "causal_attention: width " << D << " is not a multiple of " << num_heads << " heads";
  const int64_t kv_heads = num_kv_heads == 0 ? num_heads : num_kv_heads;
  CHECK(kv_heads >= 1 && num_heads % kv_heads == 0)
      << "causal_attention: " << num_kv_heads << " key/value heads do not divide " << num_heads
      << " heads";
  CHECK(dropout_p >= 0.0 && dropout_p < 1.0)
      << "causal_attention: dropout_p " << dropout_p << " outside [0, 1)";
  AttentionAttrs attrs;
  attrs.num_heads = num_heads;
  attrs.num_kv_heads = kv_heads;
  attrs.scale = 1.0 / std::sqrt(double(D / num_heads));
  if (training && dropout_p > 0.0) {
    attrs.dropout_p = dropout_p;
    attrs.dropout_key = gen.next(philox_uniform_blocks(uint64_t(B * num_heads * T * T)));
  }
  return attrs;
}

}  // namespace

Tensor layer_norm(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in, double eps) {
  CHECK(x_in.defined() && weight_in.defined() && bias_in.defined())
      << "layer_norm: undefined tensor";
  Tensor x = autocast_fp32(x_in), weight = autocast_fp32(weight_in), bias = autocast_fp32(bias_in);
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

Tensor rms_norm(const Tensor& x_in, const Tensor& weight_in, double eps) {
  CHECK(x_in.defined() && weight_in.defined()) << "rms_norm: undefined tensor";
  Tensor x = autocast_fp32(x_in), weight = autocast_fp32(weight_in);
  CHECK(is_floating(x.dtype())) << "rms_norm needs a floating tensor, got " << x.dtype();
  CHECK(x.dim() >= 1) << "rms_norm needs at least one dim, got " << x.shape_str();
  int64_t D = x.size(-1);
  CHECK(weight.shape() == Shape{D}) << "rms_norm: weight " << weight.shape_str() << " must be ["
                                    << D << "] for x " << x.shape_str();
  CHECK(weight.device() == x.device())
      << "rms_norm: x on " << x.device() << ", weight on " << weight.device();
  CHECK(eps >= 0.0) << "rms_norm: eps " << eps << " is negative";
  Shape shape = x.shape();
  Tensor rows = x.contiguous().reshape({x.numel() / std::max<int64_t>(D, 1), D});
  return autograd::apply<RmsNormFn>(rows, weight.contiguous(), eps).reshape(shape);
}

Tensor causal_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                        int64_t num_heads, double dropout_p, bool training, Generator& gen,
                        int64_t num_kv_heads) {
  CHECK(q_in.defined() && k_in.defined() && v_in.defined()) << "causal_attention: undefined tensor";
  Tensor q = autocast_lower(q_in), k = autocast_lower(k_in), v = autocast_lower(v_in);
  CHECK(q.dim() == 3 && k.dim() == 3 && v.shape() == k.shape() && k.size(0) == q.size(0) &&
        k.size(1) == q.size(1))
      << "causal_attention: q " << q.shape_str() << ", k " << k.shape_str() << ", v "
      << v.shape_str() << " must be [B, T, D], [B, T, KV HD] and [B, T, KV HD]";
  CHECK(is_floating(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype())
      << "causal_attention: q, k, v must share a floating dtype, got " << q.dtype() << ", "
      << k.dtype() << ", " << v.dtype();
  CHECK(k.device() == q.device() && v.device() == q.device())
      << "causal_attention: q on " << q.device() << ", k on " << k.device() << ", v on "
      << v.device();
  AttentionAttrs attrs = attention_attrs(q, num_heads, num_kv_heads, dropout_p, training, gen);
  const int64_t kv_width = attrs.num_kv_heads * (q.size(2) / num_heads);
  CHECK(k.size(2) == kv_width) << "causal_attention: k and v " << k.shape_str() << " must be ["
                               << q.size(0) << ", " << q.size(1) << ", " << kv_width << "] for q "
                               << q.shape_str() << " with " << num_heads << " heads of "
                               << q.size(2) / num_heads << " and " << attrs.num_kv_heads
                               << " key/value heads";
  return autograd::apply<CausalAttentionFn>(q, k, v, attrs);
}

Tensor causal_attention_qkv(const Tensor& qkv_in, int64_t num_heads, double dropout_p,
                            bool training, Generator& gen) {
  CHECK(qkv_in.defined()) << "causal_attention_qkv: undefined tensor";
  Tensor qkv = autocast_lower(qkv_in);
  CHECK(qkv.dim() == 3 && qkv.size(2) % 3 == 0)
      << "causal_attention_qkv: qkv " << qkv.shape_str() << " must be [B, T, 3D]";
  CHECK(is_floating(qkv.dtype())) << "causal_attention_qkv: dtype " << qkv.dtype();
  AttentionAttrs attrs =
      attention_attrs(qkv.narrow(2, 0, qkv.size(2) / 3), num_heads, 0, dropout_p, training, gen);
  return autograd::apply<CausalAttentionQkvFn>(qkv, attrs);
}

}  // namespace trainer
