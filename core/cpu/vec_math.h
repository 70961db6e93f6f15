// Scalar math written so the compiler vectorises the loops that call it
// (std::exp is a libm call it keeps scalar without -ffast-math). Shared by
// the CPU kernels (softmax, cross-entropy, attention, GELU).
//
//   for (int64_t i = 0; i < n; ++i) y[i] = cpu::exp_f32(x[i] - mx);   // vectorised
#pragma once

#include <algorithm>
#include <cstdint>

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

}  // namespace trainer::cpu
