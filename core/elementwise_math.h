// The elementwise math, written once for host and device (docs/architecture.md
// "Devices"): the CPU reference, the CPU fast path and the CUDA kernels all
// call these functors, so the CPU tests check the formulas the GPU runs.
//
// A unary functor has operator()(x) -> y and grad(x, y, g) -> g * dy/dx.
// A binary functor has operator()(a, b). T is float or double (the compute
// type; bf16/f16 compute in float).
//
//   visit_unary(UnaryOp::gelu_tanh, [&](auto f) { y = f(x); dx = f.grad(x, y, g); });
#pragma once

#include <math.h>

#include "core/hd.h"
#include "core/op_kinds.h"

namespace trainer::math {

TRAINER_HD float m_exp(float x) { return expf(x); }
TRAINER_HD double m_exp(double x) { return ::exp(x); }
TRAINER_HD float m_log(float x) { return logf(x); }
TRAINER_HD double m_log(double x) { return ::log(x); }
TRAINER_HD float m_sqrt(float x) { return sqrtf(x); }
TRAINER_HD double m_sqrt(double x) { return ::sqrt(x); }
TRAINER_HD float m_tanh(float x) { return tanhf(x); }
TRAINER_HD double m_tanh(double x) { return ::tanh(x); }
TRAINER_HD float m_erf(float x) { return erff(x); }
TRAINER_HD double m_erf(double x) { return ::erf(x); }
TRAINER_HD float m_erfc(float x) { return erfcf(x); }
TRAINER_HD double m_erfc(double x) { return ::erfc(x); }
TRAINER_HD float m_pow(float a, float b) { return powf(a, b); }
TRAINER_HD double m_pow(double a, double b) { return ::pow(a, b); }
TRAINER_HD float m_abs(float x) { return fabsf(x); }
TRAINER_HD double m_abs(double x) { return ::fabs(x); }

struct Neg {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return -x;
  }
  template <class T>
  TRAINER_HD T grad(T, T, T g) const {
    return -g;
  }
};
struct Exp {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return m_exp(x);
  }
  template <class T>
  TRAINER_HD T grad(T, T y, T g) const {
    return g * y;
  }
};
struct Log {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return m_log(x);
  }
  template <class T>
  TRAINER_HD T grad(T x, T, T g) const {
    return g / x;
  }
};
struct Sqrt {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return m_sqrt(x);
  }
  template <class T>
  TRAINER_HD T grad(T, T y, T g) const {
    return g / (T(2) * y);
  }
};
struct Rsqrt {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return T(1) / m_sqrt(x);
  }
  // d/dx x^-1/2 = -1/2 x^-3/2 = -y^3 / 2
  template <class T>
  TRAINER_HD T grad(T, T y, T g) const {
    return g * T(-0.5) * y * y * y;
  }
};
struct Abs {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return m_abs(x);
  }
  template <class T>
  TRAINER_HD T grad(T x, T, T g) const {
    return x > T(0) ? g : (x < T(0) ? -g : T(0));
  }
};
struct Tanh {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return m_tanh(x);
  }
  template <class T>
  TRAINER_HD T grad(T, T y, T g) const {
    return g * (T(1) - y * y);
  }
};
struct Sigmoid {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return T(1) / (T(1) + m_exp(-x));
  }
  template <class T>
  TRAINER_HD T grad(T, T y, T g) const {
    return g * y * (T(1) - y);
  }
};
struct Relu {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return x > T(0) ? x : T(0);
  }
  template <class T>
  TRAINER_HD T grad(T x, T, T g) const {
    return x > T(0) ? g : T(0);
  }
};
// gelu(x) = x/2 (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi).
struct GeluTanh {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    const T k = T(0.7978845608028654), c = T(0.044715);
    return T(0.5) * x * (T(1) + m_tanh(k * (x + c * x * x * x)));
  }
  template <class T>
  TRAINER_HD T grad(T x, T, T g) const {
    const T k = T(0.7978845608028654), c = T(0.044715);
    T th = m_tanh(k * (x + c * x * x * x));
    T dinner = k * (T(1) + T(3) * c * x * x);
    return g * (T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * dinner);
  }
};
// gelu(x) = x Phi(x) = x/2 (1 + erf(x / sqrt 2)); d/dx = Phi(x) + x phi(x).
struct GeluErf {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    // 1 + erf(z) = erfc(-z): the same value without the cancellation that
    // leaves 1 + erf(z) a few bits (or 0) for z below about -5.
    return T(0.5) * x * m_erfc(x * T(-0.7071067811865476));
  }
  template <class T>
  TRAINER_HD T grad(T x, T, T g) const {
    T cdf = T(0.5) * m_erfc(x * T(-0.7071067811865476));
    T pdf = T(0.3989422804014327) * m_exp(T(-0.5) * x * x);
    return g * (cdf + x * pdf);
  }
};
// silu(x) = x sigmoid(x); d/dx = s (1 + x (1 - s)).
struct Silu {
  template <class T>
  TRAINER_HD T operator()(T x) const {
    return x / (T(1) + m_exp(-x));
  }
  template <class T>
  TRAINER_HD T grad(T x, T, T g) const {
    T s = T(1) / (T(1) + m_exp(-x));
    return g * s * (T(1) + x * (T(1) - s));
  }
};

template <class Fn>
TRAINER_HD decltype(auto) visit_unary(UnaryOp op, Fn&& fn) {
  switch (op) {
    case UnaryOp::neg:
      return fn(Neg{});
    case UnaryOp::exp:
      return fn(Exp{});
    case UnaryOp::log:
      return fn(Log{});
    case UnaryOp::sqrt:
      return fn(Sqrt{});
    case UnaryOp::rsqrt:
      return fn(Rsqrt{});
    case UnaryOp::abs:
      return fn(Abs{});
    case UnaryOp::tanh:
      return fn(Tanh{});
    case UnaryOp::sigmoid:
      return fn(Sigmoid{});
    case UnaryOp::relu:
      return fn(Relu{});
    case UnaryOp::gelu_tanh:
      return fn(GeluTanh{});
    case UnaryOp::gelu_erf:
      return fn(GeluErf{});
    case UnaryOp::silu:
      break;
  }
  return fn(Silu{});
}

struct Add {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return a + b;
  }
};
struct Sub {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return a - b;
  }
};
struct Mul {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return a * b;
  }
};
struct Div {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return a / b;
  }
};
struct Pow {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return m_pow(a, b);
  }
};
struct Maximum {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return (a != a || a > b) ? a : b;
  }
};
struct Minimum {
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return (a != a || a < b) ? a : b;
  }
};

template <class Fn>
TRAINER_HD decltype(auto) visit_binary(BinaryOp op, Fn&& fn) {
  switch (op) {
    case BinaryOp::add:
      return fn(Add{});
    case BinaryOp::sub:
      return fn(Sub{});
    case BinaryOp::mul:
      return fn(Mul{});
    case BinaryOp::div:
      return fn(Div{});
    case BinaryOp::pow:
      return fn(Pow{});
    case BinaryOp::maximum:
      return fn(Maximum{});
    case BinaryOp::minimum:
      break;
  }
  return fn(Minimum{});
}

// Reverses the operands: s op x from x op s.
template <class F>
struct Flipped {
  F f;
  template <class T>
  TRAINER_HD T operator()(T a, T b) const {
    return f(b, a);
  }
};

template <class T>
TRAINER_HD T clamp(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

}  // namespace trainer::math
