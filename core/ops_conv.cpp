// Image ops: forward and backward side by side (declarations and the layout
// rules in core/ops_conv.h). Kernels receive channels-last images and write
// channels-last outputs the op allocates.
#include "core/ops_conv.h"

#include "core/autocast.h"

namespace trainer {

using autograd::GradMask;

namespace {

// The [N, H, W, C] view of a channels-last [N, C, H, W] tensor, and back.
// Plain views with no autograd: for kernels' operands and backward formulas.
Tensor nhwc_view(const Tensor& x) {
  const Shape& s = x.strides();
  return make_view(x, {x.size(0), x.size(2), x.size(3), x.size(1)}, {s[0], s[2], s[3], s[1]},
                   x.offset());
}
Tensor nchw_view(const Tensor& y) {
  const Shape& s = y.strides();
  return make_view(y, {y.size(0), y.size(3), y.size(1), y.size(2)}, {s[0], s[3], s[1], s[2]},
                   y.offset());
}

// g * (out > 0): the gradient through a relu fused into the op that produced
// out (both channels-last).
Tensor relu_mask(const Tensor& g, const Tensor& out) {
  Tensor masked = empty_channels_last(g.shape(), g.dtype(), g.device());
  backend(g.device())
      .unary_backward(UnaryOp::relu, nhwc_view(g), nhwc_view(out), nhwc_view(out),
                      nhwc_view(masked));
  return masked;
}

// x as a channels-last operand for a kernel (a copy unless it already is one).
Tensor channels_last_operand(const Tensor& x) {
  if (is_channels_last(x)) return x;
  Tensor out = empty_channels_last(x.shape(), x.dtype(), x.device());
  backend(x.device()).copy(x, out);
  return out;
}

void check_image(const char* op, const Tensor& x) {
  CHECK(x.defined()) << op << ": undefined input";
  CHECK_EQ(x.dim(), 4) << op << " expects an image batch [N, C, H, W], got " << x.shape_str();
  CHECK(is_floating(x.dtype())) << op << " needs a floating tensor, got " << x.dtype();
}

void check_param(const char* op, const char* what, const Tensor& p, const Tensor& x,
                 const Shape& shape) {
  CHECK(p.defined()) << op << ": undefined " << what;
  CHECK(p.shape() == shape) << op << ": " << what << " has shape " << p.shape_str() << ", expected "
                            << shape_str(shape);
  CHECK(p.dtype() == x.dtype()) << op << ": " << what << " is " << p.dtype() << ", input is "
                                << x.dtype();
  CHECK(p.device() == x.device()) << op << ": " << what << " on " << p.device() << ", input on "
                                  << x.device();
}

// A copy of x in channels-last layout (differentiable; the gradient passes through).
struct ToChannelsLastFn {
  struct Saved {};
  static constexpr const char* name = "to_channels_last";
  static Tensor forward(Saved&, const Tensor& x) {
    Tensor out = empty_channels_last(x.shape(), x.dtype(), x.device());
    backend(x.device()).copy(x, out);
    return out;
  }
  static TensorList backward(Saved&, const TensorList& g, const GradMask&) { return {g[0]}; }
};

// out = conv(x, w) + b (then relu when fused), kernel formula in core/backend.h.
// Backward: with g the output gradient (masked by out > 0 when relu was fused),
// grad_x = conv_transpose(g, w), grad_w = correlate(g, x), grad_b = sum of g over N, OH, OW.
struct Conv2dFn {
  struct Saved {
    Tensor x, weight, out;
    Conv2dAttrs attrs;
    bool has_bias = false;
  };
  static constexpr const char* name = "conv2d";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const Conv2dAttrs& a, bool fuse_relu) {
    check_image("conv2d", x);
    CHECK(weight.defined() && weight.dim() == 4)
        << "conv2d: weight must be [O, I/groups, kH, kW], got "
        << (weight.defined() ? weight.shape_str() : "undefined");
    int64_t N = x.size(0), I = x.size(1), O = weight.size(0);
    CHECK(a.groups >= 1 && I % a.groups == 0 && O % a.groups == 0)
        << "conv2d: groups " << a.groups << " must divide input channels " << I
        << " and output channels " << O;
    check_param("conv2d", "weight", weight, x, {O, I / a.groups, weight.size(2), weight.size(3)});
    if (bias.defined()) check_param("conv2d", "bias", bias, x, {O});
    for (int d = 0; d < 2; ++d)
      CHECK(a.stride[d] >= 1 && a.dilation[d] >= 1 && a.padding[d] >= 0)
          << "conv2d: stride and dilation must be >= 1 and padding >= 0";
    int64_t OH = conv_out_size(x.size(2), weight.size(2), a.stride[0], a.padding[0], a.dilation[0]);
    int64_t OW = conv_out_size(x.size(3), weight.size(3), a.stride[1], a.padding[1], a.dilation[1]);
    CHECK(OH >= 1 && OW >= 1) << "conv2d: input " << x.shape_str() << " is smaller than the "
                              << "dilated kernel " << weight.shape_str();
    Tensor xc = channels_last_operand(x);
    Tensor w = weight.contiguous();
    Tensor out = empty_channels_last({N, O, OH, OW}, x.dtype(), x.device());
    backend(x.device()).conv2d(xc, w, bias.defined() ? bias.contiguous() : bias, a, fuse_relu, out);
    s = Saved{xc, w, fuse_relu ? out : Tensor(), a, bias.defined()};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask& needs) {
    Backend& be = backend(s.x.device());
    Tensor go = channels_last_operand(g[0]);
    if (s.out.defined()) go = relu_mask(go, s.out);  // relu' = (out > 0)
    Tensor gx, gw, gb;
    if (needs[0]) {
      gx = empty_channels_last(s.x.shape(), s.x.dtype(), s.x.device());
      be.conv2d_backward_data(go, s.weight, s.attrs, gx);
    }
    if (needs[1] || (needs[2] && s.has_bias)) {
      gw = autograd::grad_buffer(1, s.weight.shape(), s.weight.dtype(), s.weight.device());
      if (s.has_bias)
        gb = autograd::grad_buffer(2, {s.weight.size(0)}, s.weight.dtype(), s.weight.device());
      be.conv2d_backward_weights(go, s.x, s.attrs, gw, gb);
    }
    return {gx, gw, gb};
  }
};

Shape pool_out_shape(const char* op, const Tensor& x, const Pool2dAttrs& a) {
  check_image(op, x);
  for (int d = 0; d < 2; ++d) {
    CHECK(a.kernel[d] >= 1 && a.stride[d] >= 1) << op << ": kernel and stride must be >= 1";
    CHECK(a.padding[d] >= 0 && 2 * a.padding[d] <= a.kernel[d])
        << op << ": padding " << a.padding[d] << " must be at most half the kernel " << a.kernel[d];
  }
  int64_t OH = conv_out_size(x.size(2), a.kernel[0], a.stride[0], a.padding[0]);
  int64_t OW = conv_out_size(x.size(3), a.kernel[1], a.stride[1], a.padding[1]);
  CHECK(OH >= 1 && OW >= 1) << op << ": input " << x.shape_str() << " is smaller than the window";
  return {x.size(0), x.size(1), OH, OW};
}

// out = max over each window. Backward: the gradient goes to the window's arg max.
struct MaxPool2dFn {
  struct Saved {
    Tensor argmax;
    Shape x_shape;
    Pool2dAttrs attrs;
  };
  static constexpr const char* name = "max_pool2d";
  static Tensor forward(Saved& s, const Tensor& x, const Pool2dAttrs& a) {
    Tensor out = empty_channels_last(pool_out_shape("max_pool2d", x, a), x.dtype(), x.device());
    Tensor argmax = backend(x.device()).max_pool2d(channels_last_operand(x), a, out);
    s = Saved{argmax, x.shape(), a};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor gx = empty_channels_last(s.x_shape, g[0].dtype(), g[0].device());
    backend(gx.device()).max_pool2d_backward(channels_last_operand(g[0]), s.argmax, s.attrs, gx);
    return {gx};
  }
};

// out = window sum / divisor. Backward: every window input gets grad_out / divisor.
struct AvgPool2dFn {
  struct Saved {
    Shape x_shape;
    Pool2dAttrs attrs;
  };
  static constexpr const char* name = "avg_pool2d";
  static Tensor forward(Saved& s, const Tensor& x, const Pool2dAttrs& a) {
    Tensor out = empty_channels_last(pool_out_shape("avg_pool2d", x, a), x.dtype(), x.device());
    backend(x.device()).avg_pool2d(channels_last_operand(x), a, out);
    s = Saved{x.shape(), a};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor gx = empty_channels_last(s.x_shape, g[0].dtype(), g[0].device());
    backend(gx.device()).avg_pool2d_backward(channels_last_operand(g[0]), s.attrs, gx);
    return {gx};
  }
};

// out = mean over each adaptive window. Backward: each input gets grad_out / window size.
struct AdaptiveAvgPool2dFn {
  struct Saved {
    Shape x_shape;
  };
  static constexpr const char* name = "adaptive_avg_pool2d";
  static Tensor forward(Saved& s, const Tensor& x, int64_t out_h, int64_t out_w) {
    Tensor out = empty_channels_last({x.size(0), x.size(1), out_h, out_w}, x.dtype(), x.device());
    backend(x.device()).adaptive_avg_pool2d(channels_last_operand(x), out);
    s = Saved{x.shape()};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor gx = empty_channels_last(s.x_shape, g[0].dtype(), g[0].device());
    backend(gx.device()).adaptive_avg_pool2d_backward(channels_last_operand(g[0]), gx);
    return {gx};
  }
};

void check_batch_norm(const char* op, const Tensor& x, const TensorList& per_channel) {
  check_image(op, x);
  for (const Tensor& p : per_channel) check_param(op, "per-channel tensor", p, x, {x.size(1)});
}

// xhat = (x - mean) / sqrt(var + eps) with batch statistics, out = xhat * gamma + beta
// (then relu when fused). Backward (mean and var depend on x): mask the gradient
// by out > 0 when relu was fused (the backend's relu record), then the formula
// in RefBackend::batch_norm_backward.
struct BatchNormTrainFn {
  struct Saved {
    Tensor x, gamma, mean, var, relu_record;
    double eps = 0.0;
  };
  static constexpr const char* name = "batch_norm";
  static TensorList forward(Saved& s, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            double eps, bool fuse_relu) {
    check_batch_norm("batch_norm", x, {gamma, beta});
    CHECK(x.size(0) * x.size(2) * x.size(3) > 1)
        << "batch_norm in training needs more than one value per channel, got " << x.shape_str();
    Tensor xc = channels_last_operand(x);
    Tensor out = empty_channels_last(x.shape(), x.dtype(), x.device());
    Tensor mean = empty({x.size(1)}, x.dtype(), x.device());
    Tensor var = empty({x.size(1)}, x.dtype(), x.device());
    Backend& be = backend(x.device());
    Tensor record;
    if (fuse_relu)
      record = be.batch_norm_relu_forward(xc, gamma, beta, eps, out, mean, var);
    else
      be.batch_norm_forward(xc, gamma, beta, eps, false, out, mean, var);
    s = Saved{xc, gamma, mean, var, record, eps};
    return {out, mean, var};
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor gx = empty_channels_last(s.x.shape(), s.x.dtype(), s.x.device());
    Tensor gg = empty(s.gamma.shape(), s.gamma.dtype(), s.gamma.device());
    Tensor gb = empty(s.gamma.shape(), s.gamma.dtype(), s.gamma.device());
    Tensor go = channels_last_operand(g[0]);
    Backend& be = backend(gx.device());
    if (s.relu_record.defined())
      be.batch_norm_relu_backward(go, s.relu_record, s.x, s.gamma, s.mean, s.var, s.eps, gx, gg,
                                  gb);
    else
      be.batch_norm_backward(go, s.x, s.gamma, s.mean, s.var, s.eps, gx, gg, gb);
    return {gx, gg, gb};
  }
};

// out = (x - running_mean) * invstd * gamma + beta, invstd = 1 / sqrt(running_var + eps).
// Backward (statistics are constants): grad_x = g * gamma * invstd,
// grad_gamma = sum g * (x - running_mean) * invstd, grad_beta = sum g (over N, H, W).
struct BatchNormEvalFn {
  struct Saved {
    Tensor x, gamma, running_mean, running_var;
    double eps = 0.0;
  };
  static constexpr const char* name = "batch_norm_eval";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                        const Tensor& running_mean, const Tensor& running_var, double eps) {
    check_batch_norm("batch_norm_eval", x, {gamma, beta, running_mean, running_var});
    Tensor xc = channels_last_operand(x);
    Tensor out = empty_channels_last(x.shape(), x.dtype(), x.device());
    backend(x.device()).batch_norm_inference(xc, gamma, beta, running_mean, running_var, eps, out);
    // Copies: a later training step updates the running statistics in place.
    s = Saved{xc, gamma, running_mean.clone(), running_var.clone(), eps};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask& needs) {
    Tensor gn = nhwc_view(channels_last_operand(g[0]));  // [N, H, W, C]: C broadcasts last
    Tensor invstd = rsqrt(s.running_var + s.eps);
    Tensor gx, gg, gb;
    if (needs[0]) gx = nchw_view(gn * (s.gamma * invstd));
    if (needs[1]) gg = sum(gn * ((nhwc_view(s.x) - s.running_mean) * invstd), {0, 1, 2});
    if (needs[2]) gb = sum(gn, {0, 1, 2});
    return {gx, gg, gb, Tensor(), Tensor()};
  }
};

}  // namespace

bool is_channels_last(const Tensor& x) {
  if (x.dim() != 4) return false;
  // Dense in the order C, W, H, N (innermost first); size-1 dims match any stride.
  int64_t expected = 1;
  for (int d : {1, 3, 2, 0}) {
    if (x.size(d) == 1) continue;
    if (x.stride(d) != expected) return false;
    expected *= x.size(d);
  }
  return true;
}

Tensor empty_channels_last(const Shape& nchw, DType dtype, Device device) {
  CHECK_EQ(nchw.size(), size_t(4))
      << "empty_channels_last needs [N, C, H, W], got " << shape_str(nchw);
  int64_t N = nchw[0], C = nchw[1], H = nchw[2], W = nchw[3];
  Tensor buf = empty({N, H, W, C}, dtype, device);
  return make_view(buf, nchw, {H * W * C, 1, W * C, C}, 0);
}

Tensor to_channels_last(const Tensor& x) {
  check_image("to_channels_last", x);
  return is_channels_last(x) ? x : autograd::apply<ToChannelsLastFn>(x);
}

Tensor relu_channels_last(const Tensor& x) {
  if (!is_channels_last(x)) return relu(x);
  return relu(x.permute({0, 2, 3, 1})).permute({0, 3, 1, 2});
}

Tensor add_channels_last(const Tensor& a, const Tensor& b) {
  if (!is_channels_last(a) || !is_channels_last(b) || a.shape() != b.shape()) return add(a, b);
  return add(a.permute({0, 2, 3, 1}), b.permute({0, 2, 3, 1})).permute({0, 3, 1, 2});
}

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dAttrs& attrs,
              bool fuse_relu) {
  return autograd::apply<Conv2dFn>(autocast_lower(x), autocast_lower(weight), autocast_lower(bias),
                                   attrs, fuse_relu);
}

Tensor max_pool2d(const Tensor& x, const Pool2dAttrs& attrs) {
  return autograd::apply<MaxPool2dFn>(x, attrs);
}

Tensor avg_pool2d(const Tensor& x, const Pool2dAttrs& attrs) {
  return autograd::apply<AvgPool2dFn>(x, attrs);
}

Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w) {
  check_image("adaptive_avg_pool2d", x);
  CHECK(out_h >= 1 && out_w >= 1) << "adaptive_avg_pool2d: output size " << out_h << "x" << out_w;
  int64_t H = x.size(2), W = x.size(3);
  if (H % out_h == 0 && W % out_w == 0) {
    Pool2dAttrs a{.kernel = {H / out_h, W / out_w}, .stride = {H / out_h, W / out_w}};
    return avg_pool2d(x, a);
  }
  return autograd::apply<AdaptiveAvgPool2dFn>(x, out_h, out_w);
}

BatchNormResult batch_norm_train(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                 double eps, bool fuse_relu) {
  TensorList r = autograd::apply<BatchNormTrainFn>(autocast_fp32(x), autocast_fp32(gamma),
                                                   autocast_fp32(beta), eps, fuse_relu);
  return {r[0], r[1].detach(), r[2].detach()};
}

Tensor batch_norm_eval(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                       const Tensor& running_mean, const Tensor& running_var, double eps) {
  return autograd::apply<BatchNormEvalFn>(autocast_fp32(x), autocast_fp32(gamma),
                                          autocast_fp32(beta), autocast_fp32(running_mean),
                                          autocast_fp32(running_var), eps);
}

Tensor conv2d_bn_eval(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dAttrs& attrs, const Tensor& gamma, const Tensor& beta,
                      const Tensor& running_mean, const Tensor& running_var, double eps,
                      bool fuse_relu) {
  int64_t O = weight.size(0);
  Tensor scale = gamma * rsqrt(running_var + eps);
  Tensor w = weight * scale.reshape({O, 1, 1, 1});
  Tensor b = (bias.defined() ? bias - running_mean : -running_mean) * scale + beta;
  return conv2d(x, w, b, attrs, fuse_relu);
}

}  // namespace trainer
