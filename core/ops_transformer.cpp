// Layer norm, RMS norm and causal attention: forward and backward through
// the backend's fused kernels (sections "layer norm", "RMS norm" and
// "attention").
#include "core/ops_transformer.h"

#include <algorithm>
#include <cmath>
#include <limits>

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

// The attributes of attention over [batch, seq_len, width] queries (op
// names the caller in messages); draws the dropout key of the whole
// batch x total_heads x seq_len^2 draw when dropout is on.
AttentionAttrs attention_attrs_of(const char* op, int64_t batch, int64_t width, int64_t num_heads,
                                  int64_t num_kv_heads, double dropout_p, bool training,
                                  Generator& gen, int64_t seq_len, int64_t total_heads) {
  CHECK(num_heads >= 1 && width % num_heads == 0)
      << op << ": width " << width << " is not a multiple of " << num_heads << " heads";
  const int64_t kv_heads = num_kv_heads == 0 ? num_heads : num_kv_heads;
  CHECK(kv_heads >= 1 && num_heads % kv_heads == 0)
      << op << ": " << num_kv_heads << " key/value heads do not divide " << num_heads << " heads";
  CHECK(dropout_p >= 0.0 && dropout_p < 1.0)
      << op << ": dropout_p " << dropout_p << " outside [0, 1)";
  AttentionAttrs attrs;
  attrs.num_heads = num_heads;
  attrs.num_kv_heads = kv_heads;
  attrs.scale = 1.0 / std::sqrt(double(width / num_heads));
  if (training && dropout_p > 0.0) {
    const int64_t heads = total_heads > 0 ? total_heads : num_heads;
    attrs.dropout_p = dropout_p;
    attrs.dropout_key =
        gen.next(philox_uniform_blocks(uint64_t(batch * heads * seq_len * seq_len)));
  }
  return attrs;
}

// The attributes of one causal_attention call on q [B, T, D].
AttentionAttrs attention_attrs(const Tensor& q, int64_t num_heads, int64_t num_kv_heads,
                               double dropout_p, bool training, Generator& gen) {
  return attention_attrs_of("causal_attention", q.size(0), q.size(2), num_heads, num_kv_heads,
                            dropout_p, training, gen, q.size(1), 0);
}

// The checks of a block's q [B, Tq, D], k, v [B, Tk, KV HD] against attrs.
void check_block_operands(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttentionAttrs& attrs) {
  CHECK(q.defined() && k.defined() && v.defined()) << op << ": undefined tensor";
  CHECK(q.dim() == 3 && k.dim() == 3 && v.shape() == k.shape() && k.size(0) == q.size(0))
      << op << ": q " << q.shape_str() << ", k " << k.shape_str() << ", v " << v.shape_str()
      << " must be [B, Tq, D], [B, Tk, KV HD] and [B, Tk, KV HD]";
  CHECK(is_floating(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype())
      << op << ": q, k, v must share a floating dtype, got " << q.dtype() << ", " << k.dtype()
      << ", " << v.dtype();
  CHECK(k.device() == q.device() && v.device() == q.device())
      << op << ": q on " << q.device() << ", k on " << k.device() << ", v on " << v.device();
  const int64_t NH = attrs.num_heads, KV = attrs.kv_heads(), D = q.size(2);
  CHECK(NH >= 1 && D % NH == 0 && NH % KV == 0)
      << op << ": width " << D << ", " << NH << " heads and " << KV
      << " key/value heads: the width must split into the heads and KV divide them";
  CHECK(k.size(2) == KV * (D / NH))
      << op << ": k and v " << k.shape_str() << " must be [" << q.size(0) << ", Tk, "
      << KV * (D / NH) << "] for q " << q.shape_str() << " with " << NH << " heads of " << D / NH
      << " and " << KV << " key/value heads";
  CHECK(attrs.q_offset >= 0 && attrs.k_offset >= 0)
      << op << ": offsets q " << attrs.q_offset << ", k " << attrs.k_offset << " are negative";
  if (attrs.dropout_p <= 0.0) return;
  const int64_t Tq = q.size(1), Tk = k.size(1);
  if (attrs.seq_len == 0)
    CHECK(Tq == Tk && attrs.q_offset == 0 && attrs.k_offset == 0)
        << op << ": with dropout, blocks (q " << Tq << " rows at " << attrs.q_offset << ", k " << Tk
        << " rows at " << attrs.k_offset << ") need attrs.seq_len, the whole sequence";
  else
    CHECK(attrs.q_offset + Tq <= attrs.seq_len && attrs.k_offset + Tk <= attrs.seq_len)
        << op << ": q rows [" << attrs.q_offset << ", " << attrs.q_offset + Tq << ") or k rows ["
        << attrs.k_offset << ", " << attrs.k_offset + Tk << ") outside seq_len " << attrs.seq_len;
  const int64_t heads = attrs.total_heads > 0 ? attrs.total_heads : NH;
  CHECK(attrs.head_offset >= 0 && attrs.head_offset + NH <= heads)
      << op << ": heads [" << attrs.head_offset << ", " << attrs.head_offset + NH
      << ") outside total_heads " << heads;
}

// The checks of a block's out [B, Tq, D] (contiguous, q's dtype) and lse
// [B, NH, Tq] (contiguous, the statistics' dtype) against q.
void check_block_result(const char* op, const char* out_name, const Tensor& out,
                        const char* lse_name, const Tensor& lse, const Tensor& q,
                        int64_t num_heads) {
  CHECK(out.defined() && lse.defined()) << op << ": undefined " << out_name << " or " << lse_name;
  const DType stat = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  CHECK(out.shape() == q.shape() && out.dtype() == q.dtype() && out.is_contiguous())
      << op << ": " << out_name << " " << out.shape_str() << " " << out.dtype()
      << " must be contiguous " << q.shape_str() << " " << q.dtype();
  CHECK(lse.shape() == Shape({q.size(0), num_heads, q.size(1)}) && lse.dtype() == stat &&
        lse.is_contiguous())
      << op << ": " << lse_name << " " << lse.shape_str() << " " << lse.dtype()
      << " must be contiguous [" << q.size(0) << ", " << num_heads << ", " << q.size(1) << "] "
      << stat;
  CHECK(out.device() == q.device() && lse.device() == q.device())
      << op << ": " << out_name << " on " << out.device() << ", " << lse_name << " on "
      << lse.device() << ", q on " << q.device();
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

AttentionAttrs attention_block_attrs(int64_t batch, int64_t width, int64_t num_heads,
                                     int64_t num_kv_heads, double dropout_p, bool training,
                                     Generator& gen, int64_t seq_len, int64_t total_heads) {
  CHECK(batch >= 0 && seq_len >= 0)
      << "attention_block_attrs: batch " << batch << ", seq_len " << seq_len;
  CHECK(total_heads == 0 || total_heads >= num_heads)
      << "attention_block_attrs: total_heads " << total_heads << " below " << num_heads << " heads";
  AttentionAttrs attrs =
      attention_attrs_of("attention_block_attrs", batch, width, num_heads, num_kv_heads, dropout_p,
                         training, gen, seq_len, total_heads);
  attrs.seq_len = seq_len;
  attrs.total_heads = total_heads > 0 ? total_heads : num_heads;
  return attrs;
}

AttentionBlockResult attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionAttrs& attrs) {
  check_block_operands("attention_block_forward", q, k, v, attrs);
  const DType stat = q.dtype() == DType::f64 ? DType::f64 : DType::f32;
  AttentionBlockResult r{empty(q.shape(), q.dtype(), q.device()),
                         empty({q.size(0), attrs.num_heads, q.size(1)}, stat, q.device())};
  if (q.numel() == 0) return r;
  if (k.size(1) == 0) {  // no key at all: every row sees none
    backend(q.device()).fill(r.out, 0.0);
    backend(q.device()).fill(r.lse, -std::numeric_limits<double>::infinity());
    return r;
  }
  backend(q.device()).attention_forward(q, k, v, attrs, r.out, r.lse);
  return r;
}

TensorList attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    const AttentionAttrs& attrs) {
  const char* op = "attention_block_backward";
  check_block_operands(op, q, k, v, attrs);
  check_block_result(op, "out", out, "lse", lse, q, attrs.num_heads);
  CHECK(grad_out.defined() && grad_out.shape() == q.shape() && grad_out.dtype() == q.dtype() &&
        grad_out.device() == q.device())
      << op << ": grad_out " << (grad_out.defined() ? grad_out.shape_str() : "undefined")
      << " must be " << q.shape_str() << " " << q.dtype() << " on " << q.device();
  Tensor grad_q = empty(q.shape(), q.dtype(), q.device());
  Tensor grad_k = empty(k.shape(), k.dtype(), k.device());
  Tensor grad_v = empty(v.shape(), v.dtype(), v.device());
  if (q.numel() == 0 || k.numel() == 0) {  // nothing meets: no gradient
    for (const Tensor& g : {grad_q, grad_k, grad_v}) backend(q.device()).fill(g, 0.0);
    return {grad_q, grad_k, grad_v};
  }
  backend(q.device())
      .attention_backward(grad_out.contiguous(), q, k, v, out, lse, attrs, grad_q, grad_k, grad_v);
  return {grad_q, grad_k, grad_v};
}

void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                     const Tensor& block_lse) {
  const char* op = "attention_merge";
  CHECK(out.defined() && lse.defined()) << op << ": undefined out or lse";
  CHECK(out.dim() == 3 && is_floating(out.dtype()))
      << op << ": out " << out.shape_str() << " " << out.dtype() << " must be floating [B, Tq, D]";
  CHECK(lse.dim() == 3 && lse.size(1) >= 1 && out.size(2) % lse.size(1) == 0)
      << op << ": lse " << lse.shape_str() << " must be [B, NH, Tq] with NH dividing out's width "
      << out.size(2);
  const int64_t num_heads = lse.size(1);
  check_block_result(op, "out", out, "lse", lse, out, num_heads);
  check_block_result(op, "block_out", block_out, "block_lse", block_lse, out, num_heads);
  if (out.numel() == 0) return;
  backend(out.device()).attention_merge(out, lse, block_out, block_lse);
}

}  // namespace trainer
