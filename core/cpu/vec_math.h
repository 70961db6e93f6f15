// Scalar math written so the compiler vectorises the loops that call it
// (std::exp is a libm call it keeps scalar without -ffast-math). Shared by
// the CPU kernels (softmax, cross-entropy, attention, GELU in both forms,
// SiLU).
//
//   for (int64_t i = 0; i < n; ++i) y[i] = cpu::exp_f32(x[i] - mx);   // vectorised
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/dtype.h"

namespace trainer::cpu {

// exp(x) in a form the compiler vectorises (std::exp is a libm call it keeps
// scalar without -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by
// its degree-6 Taylor polynomial (relative error below 2e-7), 2^n built in the
// exponent bits. 0 below -87.3, where exp leaves f32's normal range; inputs
// are clamped at 88 (callers pass x <= 0: differences from a row maximum).
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds
  constexpr float kMin = -87.3f, kMax = 88.0f;
  float xc = std::min(std::max(x, kMin), kMax);
  float n = (xc * kLog2e + kRound) - kRound;
  float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 +
                                          r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  float two_n = bits_float(uint32_t(int32_t(n) + 127) << 23);
  return x < kMin ? 0.0f : p * two_n;
}

// exp(hi + lo) for an argument carried in two floats, |lo| small beside a
// large |hi|: lo joins the reduced argument r, so the rounding of hi + lo
// (an absolute error of |hi| 2^-24, a relative one in the result) is not
// made. Same polynomial and limits as exp_f32.
inline float exp_sum_f32(float hi, float lo) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
  constexpr float kRound = 12582912.0f;
  constexpr float kMin = -87.3f, kMax = 88.0f;
  float hc = std::min(std::max(hi, kMin), kMax);
  float n = ((hc + lo) * kLog2e + kRound) - kRound;
  float r = ((hc - n * kLn2Hi) + lo) - n * kLn2Lo;
  float p =
      1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 +
                                          r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  float two_n = bits_float(uint32_t(std::min(std::max(int32_t(n) + 127, 1), 254)) << 23);
  return hi + lo < kMin ? 0.0f : p * two_n;
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): absolute error about 2e-7, exact limits
// +-1 (exp_f32 is 0 below -87.3 and finite up to its clamp).
inline float tanh_f32(float x) { return 1.0f - 2.0f / (exp_f32(2.0f * x) + 1.0f); }

// gelu_tanh(x) = x/2 (1 + tanh(k (x + c x^3))) and its gradient g d/dx, as
// math::GeluTanh computes them, with the vectorisable tanh.
inline float gelu_tanh_f32(float x) {
  constexpr float k = 0.7978845608028654f, c = 0.044715f;
  return 0.5f * x * (1.0f + tanh_f32(k * (x + c * x * x * x)));
}
inline float gelu_tanh_grad_f32(float x, float g) {
  constexpr float k = 0.7978845608028654f, c = 0.044715f;
  float th = tanh_f32(k * (x + c * x * x * x));
  float dinner = k * (1.0f + 3.0f * c * x * x);
  return g * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * dinner);
}

// silu(x) = x / (1 + exp(-x)) and its gradient g s (1 + x (1 - s)), s the
// sigmoid, as math::Silu computes them, with the vectorisable exp. Where
// exp(-x) leaves f32's range (x < -88) it is infinite, as libm's would be, so
// the far left tail is -0 and silu(-inf) NaN like the reference's.
inline float silu_exp_f32(float x) {
  return -x > 88.0f ? std::numeric_limits<float>::infinity() : exp_f32(-x);
}
inline float silu_f32(float x) { return x / (1.0f + silu_exp_f32(x)); }
inline float silu_grad_f32(float x, float g) {
  const float s = 1.0f / (1.0f + silu_exp_f32(x));
  return g * s * (1.0f + x * (1.0f - s));
}

// Phi(x) = (1 + erf(x / sqrt 2)) / 2, the normal CDF of GELU's exact form,
// in a form the compiler vectorises (libm's erff is scalar). With a = |x| /
// sqrt 2, erfc(a) comes from Numerical Recipes' erfcc, a Chebyshev fit with a
// relative error below 1.2e-7 for every a >= 0, and Phi(x) = erfc(a) / 2 for
// x < 0 keeps that relative accuracy in the tail where 1 + erf would cancel.
// The roundings of x / sqrt 2 and of a^2 are carried into exp's argument
// (exp_sum_f32), so x Phi(x) is within 10 f32 ulps of the exact value for
// every x (checked against double erfc over [-14, 14]).
inline float normal_cdf_f32(float x) {
  constexpr float kHi = 0.70710677f, kLo = 1.21016175e-08f;  // 1/sqrt(2) = kHi + kLo
  const float z = x * kHi;
  const float z_err = std::fma(x, kHi, -z) + x * kLo;  // z + z_err = x / sqrt(2)
  const float a = std::fabs(z);
  const float a_err = z >= 0.0f ? z_err : -z_err;
  const float t = 1.0f / (1.0f + 0.5f * a);
  const float poly =
      1.00002368f +
      t * (0.37409196f +
           t * (0.09678418f +
                t * (-0.18628806f +
                     t * (0.27886807f +
                          t * (-1.13520398f +
                               t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f)))))));
  const float a2 = a * a;
  const float a2_err = std::fma(a, a, -a2) + 2.0f * a * a_err;         // a2 + a2_err = (x^2) / 2
  float q = t * exp_sum_f32(-a2, (-1.26551223f + t * poly) - a2_err);  // erfc(a)
  q = a < 10.0f ? q : 0.0f;  // erfc(10) is below f32's range; also catches inf and NaN
  return z >= 0.0f ? 1.0f - 0.5f * q : 0.5f * q;
}

// gelu(x) = x Phi(x) and its gradient g (Phi(x) + x phi(x)), phi the normal
// density, as math::GeluErf computes them, with the vectorisable Phi and exp.
inline float gelu_erf_f32(float x) { return x * normal_cdf_f32(x); }
inline float gelu_erf_grad_f32(float x, float g) {
  constexpr float kInvSqrt2Pi = 0.3989422804014327f;
  const float x2 = x * x;
  float pdf = kInvSqrt2Pi * exp_sum_f32(-0.5f * x2, -0.5f * std::fma(x, x, -x2));
  pdf = std::fabs(x) < 14.0f ? pdf : 0.0f;  // exp(-98) is below f32's range
  return g * (normal_cdf_f32(x) + x * pdf);
}

}  // namespace trainer::cpu
