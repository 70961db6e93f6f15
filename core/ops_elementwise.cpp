// Elementwise ops: forward and backward side by side.
#include "core/autocast.h"
#include "core/ops.h"
#include "core/ops_conv.h"

namespace trainer {

using autograd::GradMask;

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    CHECK(x == y || x == 1 || y == 1)
        << "shapes " << shape_str(a) << " and " << shape_str(b) << " do not broadcast";
    out[i] = x == 1 ? y : x;
  }
  return out;
}

namespace {

void check_same_device(const char* op, const Tensor& a, const Tensor& b) {
  CHECK(a.device() == b.device()) << op << ": operands on " << a.device() << " and " << b.device();
}

void check_binary_operands(const char* op, const Tensor& a, const Tensor& b) {
  CHECK(a.defined() && b.defined()) << op << ": undefined operand";
  check_same_device(op, a, b);
  CHECK(a.dtype() == b.dtype()) << op << ": dtypes " << a.dtype() << " and " << b.dtype()
                                << " differ; convert one with to()";
}

// Whether the derivative of op reads x (else it reads only y = f(x)).
bool grad_uses_x(UnaryOp op) {
  switch (op) {
    case UnaryOp::exp:
    case UnaryOp::sqrt:
    case UnaryOp::rsqrt:
    case UnaryOp::tanh:
    case UnaryOp::sigmoid:
    case UnaryOp::neg:
      return false;
    default:
      return true;
  }
}
bool grad_uses_y(UnaryOp op) { return !grad_uses_x(op) && op != UnaryOp::neg; }

// y = f(x). Backward: grad_x = grad * f'(x), the derivative in elementwise_math.h.
struct UnaryFn {
  struct Saved {
    UnaryOp op;
    Tensor x, y;
  };
  static constexpr const char* name = "unary";
  static Tensor forward(Saved& s, const Tensor& x, UnaryOp op) {
    CHECK(is_floating(x.dtype())) << unary_op_name(op) << " needs a floating tensor, got "
                                  << x.dtype();
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    backend(x.device()).unary(op, x, out);
    s.op = op;
    if (grad_uses_x(op)) s.x = x;
    if (grad_uses_y(op)) s.y = out;
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_x = empty(g[0].shape(), g[0].dtype(), g[0].device());
    const Tensor& x = s.x.defined() ? s.x : (s.y.defined() ? s.y : g[0]);
    const Tensor& y = s.y.defined() ? s.y : x;
    backend(g[0].device()).unary_backward(s.op, g[0], x, y, grad_x);
    return {grad_x};
  }
};

// out = a op b with broadcasting.
struct BinaryFn {
  struct Saved {
    BinaryOp op;
    Tensor a, b, out;
    Shape a_shape, b_shape;
  };
  static constexpr const char* name = "binary";
  static Tensor forward(Saved& s, const Tensor& a, const Tensor& b, BinaryOp op) {
    check_binary_operands(binary_op_name(op), a, b);
    Shape shape = broadcast_shapes(a.shape(), b.shape());
    // Two channels-last images of one shape (residual sums, gradients meeting
    // at a residual join) give a channels-last result: unit-stride loops, and
    // the image ops downstream take it without a copy.
    bool channels_last =
        a.shape() == b.shape() && !a.is_contiguous() && is_channels_last(a) && is_channels_last(b);
    Tensor out = channels_last ? empty_channels_last(shape, a.dtype(), a.device())
                               : empty(shape, a.dtype(), a.device());
    if (channels_last) {  // kernels loop row-major: hand them the [N, H, W, C] views
      std::vector<int> nhwc = {0, 2, 3, 1};
      backend(a.device()).binary(op, a.permute(nhwc), b.permute(nhwc), out.permute(nhwc));
    } else {
      backend(a.device()).binary(op, a.expand(shape), b.expand(shape), out);
    }
    s.op = op;
    s.a_shape = a.shape();
    s.b_shape = b.shape();
    switch (op) {
      case BinaryOp::add:
      case BinaryOp::sub:
        break;
      case BinaryOp::mul:
      case BinaryOp::maximum:
      case BinaryOp::minimum:
        s.a = a, s.b = b;
        break;
      case BinaryOp::div:
        s.b = b, s.out = out;
        break;
      case BinaryOp::pow:
        s.a = a, s.b = b, s.out = out;
        break;
    }
    return out;
  }
  // add: (g, g)   sub: (g, -g)   mul: (g b, g a)   div: (g / b, -g out / b)
  // pow: (g b a^(b-1), g out log a)   max/min: g to the selected operand, split on ties.
  static TensorList backward(Saved& s, const TensorList& grads, const GradMask& needs) {
    const Tensor& g = grads[0];
    Tensor ga, gb;
    switch (s.op) {
      case BinaryOp::add:
        ga = g, gb = g;
        break;
      case BinaryOp::sub:
        ga = g, gb = needs[1] ? neg(g) : Tensor();
        break;
      case BinaryOp::mul:
        if (needs[0]) ga = g * s.b;
        if (needs[1]) gb = g * s.a;
        break;
      case BinaryOp::div:
        if (needs[0]) ga = g / s.b;
        if (needs[1]) gb = neg(g * s.out / s.b);
        break;
      case BinaryOp::pow:
        if (needs[0]) ga = g * s.b * pow(s.a, s.b - 1.0);
        if (needs[1]) {
          // d/db a^b = a^b log a; 0 where a == 0 (the limit for b > 0).
          Tensor zero = zeros({}, s.a.dtype(), s.a.device());
          gb = masked_fill(g * s.out * log(s.a), eq(s.a, zero), 0.0);
        }
        break;
      case BinaryOp::maximum:
      case BinaryOp::minimum: {
        Tensor a_wins = s.op == BinaryOp::maximum ? gt(s.a, s.b) : lt(s.a, s.b);
        Tensor tie = eq(s.a, s.b);
        Tensor half = g * 0.5;
        Tensor zero = zeros({}, g.dtype(), g.device());
        if (needs[0]) ga = where(a_wins, g, where(tie, half, zero));
        if (needs[1]) gb = where(a_wins, zero, where(tie, half, g));
        break;
      }
    }
    return {ga.defined() ? sum_to(ga, s.a_shape) : ga, gb.defined() ? sum_to(gb, s.b_shape) : gb};
  }
};

// out = x op s (or s op x).
struct BinaryScalarFn {
  struct Saved {
    BinaryOp op;
    double s;
    bool scalar_first;
    Tensor x, out;
  };
  static constexpr const char* name = "binary_scalar";
  static Tensor forward(Saved& sv, const Tensor& x, BinaryOp op, double s, bool scalar_first) {
    CHECK(is_floating(x.dtype())) << binary_op_name(op) << " with a scalar needs a floating tensor";
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    backend(x.device()).binary_scalar(op, x, s, scalar_first, out);
    sv = Saved{op, s, scalar_first, Tensor(), Tensor()};
    if (op == BinaryOp::pow || op == BinaryOp::maximum || op == BinaryOp::minimum ||
        (op == BinaryOp::div && scalar_first))
      sv.x = x;
    if (op == BinaryOp::pow || (op == BinaryOp::div && scalar_first)) sv.out = out;
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& grads, const GradMask&) {
    const Tensor& g = grads[0];
    switch (s.op) {
      case BinaryOp::add:
        return {g};
      case BinaryOp::sub:
        return {s.scalar_first ? neg(g) : g};
      case BinaryOp::mul:
        return {g * s.s};
      case BinaryOp::div:  // d(x/s) = 1/s;  d(s/x) = -s/x^2 = -out/x
        return {s.scalar_first ? neg(g * s.out / s.x) : g * (1.0 / s.s)};
      case BinaryOp::pow:  // d(x^s) = s x^(s-1);  d(s^x) = s^x log s
        return {s.scalar_first ? g * s.out * std::log(s.s) : g * s.s * pow(s.x, s.s - 1.0)};
      case BinaryOp::maximum:
      case BinaryOp::minimum: {
        Tensor sc = full({}, s.s, s.x.dtype(), s.x.device());
        Tensor wins = s.op == BinaryOp::maximum ? gt(s.x, sc) : lt(s.x, sc);
        Tensor zero = zeros({}, g.dtype(), g.device());
        return {where(wins, g, where(eq(s.x, sc), g * 0.5, zero))};
      }
    }
    return {Tensor()};
  }
};

struct WhereFn {
  struct Saved {
    Tensor cond;
    Shape a_shape, b_shape;
  };
  static constexpr const char* name = "where";
  static Tensor forward(Saved& s, const Tensor& cond, const Tensor& a, const Tensor& b) {
    check_binary_operands("where", a, b);
    check_same_device("where", cond, a);
    CHECK(cond.dtype() == DType::boolean) << "where: condition must be bool, got " << cond.dtype();
    Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape()), b.shape());
    Tensor out = empty(shape, a.dtype(), a.device());
    backend(a.device()).where(cond.expand(shape), a.expand(shape), b.expand(shape), out);
    s = Saved{cond, a.shape(), b.shape()};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& grads, const GradMask& needs) {
    const Tensor& g = grads[0];
    Tensor zero = zeros({}, g.dtype(), g.device());
    // Inputs are (cond, a, b); cond gets no gradient.
    Tensor ga = needs[1] ? sum_to(where(s.cond, g, zero), s.a_shape) : Tensor();
    Tensor gb = needs[2] ? sum_to(where(s.cond, zero, g), s.b_shape) : Tensor();
    return {Tensor(), ga, gb};
  }
};

struct ClampFn {
  struct Saved {
    Tensor x;
    double lo, hi;
  };
  static constexpr const char* name = "clamp";
  static Tensor forward(Saved& s, const Tensor& x, double lo, double hi) {
    CHECK(lo <= hi) << "clamp: min " << lo << " > max " << hi;
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    backend(x.device()).clamp(x, lo, hi, out);
    s = Saved{x, lo, hi};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_x = empty(g[0].shape(), g[0].dtype(), g[0].device());
    backend(g[0].device()).clamp_backward(g[0], s.x, s.lo, s.hi, grad_x);
    return {grad_x};
  }
};

Tensor compare(CompareOp op, const Tensor& a, const Tensor& b) {
  check_same_device("compare", a, b);
  Shape shape = broadcast_shapes(a.shape(), b.shape());
  Tensor out = empty(shape, DType::boolean, a.device());
  autograd::NoGradGuard no_grad;
  backend(a.device()).compare(op, a.expand(shape), b.expand(shape), out);
  return out;
}

}  // namespace

Tensor unary(UnaryOp op, const Tensor& x) { return autograd::apply<UnaryFn>(x, op); }
Tensor neg(const Tensor& x) { return unary(UnaryOp::neg, x); }
Tensor exp(const Tensor& x) { return unary(UnaryOp::exp, autocast_fp32(x)); }
Tensor log(const Tensor& x) { return unary(UnaryOp::log, autocast_fp32(x)); }
Tensor sqrt(const Tensor& x) { return unary(UnaryOp::sqrt, x); }
Tensor rsqrt(const Tensor& x) { return unary(UnaryOp::rsqrt, x); }
Tensor abs(const Tensor& x) { return unary(UnaryOp::abs, x); }
Tensor tanh(const Tensor& x) { return unary(UnaryOp::tanh, x); }
Tensor sigmoid(const Tensor& x) { return unary(UnaryOp::sigmoid, x); }
Tensor relu(const Tensor& x) { return unary(UnaryOp::relu, x); }
Tensor silu(const Tensor& x) { return unary(UnaryOp::silu, x); }
Tensor gelu(const Tensor& x, GeluApprox approx) {
  return unary(approx == GeluApprox::tanh ? UnaryOp::gelu_tanh : UnaryOp::gelu_erf, x);
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  Tensor pa = a, pb = b;
  autocast_promote(pa, pb);
  return autograd::apply<BinaryFn>(pa, pb, op);
}
Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::add, a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::sub, a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::mul, a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::div, a, b); }
Tensor pow(const Tensor& a, const Tensor& b) { return binary(BinaryOp::pow, a, b); }
Tensor maximum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::minimum, a, b); }

Tensor binary_scalar(BinaryOp op, const Tensor& x, double s, bool scalar_first) {
  return autograd::apply<BinaryScalarFn>(x, op, s, scalar_first);
}
Tensor add(const Tensor& x, double s) { return binary_scalar(BinaryOp::add, x, s); }
Tensor mul(const Tensor& x, double s) { return binary_scalar(BinaryOp::mul, x, s); }
Tensor pow(const Tensor& x, double exponent) { return binary_scalar(BinaryOp::pow, x, exponent); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Tensor pa = a, pb = b;
  autocast_promote(pa, pb);
  return autograd::apply<WhereFn>(cond, pa, pb);
}
Tensor clamp(const Tensor& x, double lo, double hi) { return autograd::apply<ClampFn>(x, lo, hi); }

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  return where(mask, full({}, value, x.dtype(), x.device()), x);
}

Tensor eq(const Tensor& a, const Tensor& b) { return compare(CompareOp::eq, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return compare(CompareOp::lt, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return compare(CompareOp::gt, a, b); }

void add_(const Tensor& self, const Tensor& other, double alpha) {
  autograd::NoGradGuard no_grad;
  check_binary_operands("add_", self, other);
  Tensor o = alpha == 1.0 ? other : other * alpha;
  backend(self.device()).binary(BinaryOp::add, self, o.expand(self.shape()), self);
}

void mul_(const Tensor& self, double s) {
  autograd::NoGradGuard no_grad;
  backend(self.device()).binary_scalar(BinaryOp::mul, self, s, false, self);
}

}  // namespace trainer
