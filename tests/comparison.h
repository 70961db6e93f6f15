// Comparing a kernel's results with the reference's, without a test
// framework (tests/testing.h wraps them in Catch2 checks; the op table's
// coverage tool, tests/op_coverage.cpp, runs without one): the tolerance
// rule, strided inputs, the probe cotangent of the backward passes, and the
// first mismatch.
//
//   const Tolerance tol = tolerance(DType::bf16, {.length = 33, .scale = 8, .roundings = 2});
//   std::string why = mismatch(fast, ref, tol.rtol, tol.atol);  // empty: close
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "core/ops.h"

namespace trainer::testing {

// ---- Tolerances of fast kernels against the reference ----
//
// Every fast-versus-reference comparison derives its tolerance from the
// dtypes and the length of the reductions involved, never from what one CPU
// happened to produce: AVX2, AVX-512 and AMX kernels each sum in their own
// order and vector width, and oneDNN picks different algorithms per ISA.
//
// The rule. A fast kernel accumulates in f32 (or wider). Each addition of a
// sum of n terms rounds by up to u32 = 2^-24 of the partial sum, and those
// errors have random signs, so an element that reduces n terms whose partial
// sums reach `scale` in magnitude carries an error of about
// u32 * sqrt(n) * scale (the worst case, n, is not reached by data with
// random rounding; blocked and vector sums, as oneDNN and our loops do, are
// shorter chains still); we allow 8 times that. Its own rounding to the result's dtype adds one
// unit roundoff u (f32 2^-24, bf16 2^-8, f16 2^-11) on each side, fast and reference, and an
// approximated transcendental (core/cpu/vec_math.h) adds its stated error in units of u32. A result
// computed in a low dtype through a chain of k rounded intermediates (a backward built from several
// bf16 ops) is rounded k times on its way. So, with both terms relative to |expected| and, for
// cancellation, to scale:
//
//   acc  = 8 * u32 * sqrt(n) + approx_ulps * u32
//   rtol = acc + (roundings + 1) u(dtype)       atol = rtol * scale
//
// Reductions name the longest one any output or gradient element goes
// through (matmul [M,K]x[K,N]: max(K, M, N) counting both gradients; a
// convolution: C_in * kH * kW forward, N * H_out * W_out for the weight
// gradient; softmax over a row of n: n), and scale the size its partial sums
// reach (n random terms of size s: about s * sqrt(n)).
//
// Tensor cores. A backend whose f32 products run on TF32 tensor cores
// (CUDA's matmul, convolution and RNN) first rounds both operands to TF32's
// 10-bit mantissa (u_tf32 = 2^-11): every product is off by up to 2 u_tf32,
// with random signs, so the sum by about 2 u_tf32 * scale; allowed 8 times
// too (tf32_tolerance).
struct Reduction {
  int64_t length = 1;       // terms summed into one element (longest of forward and backward)
  double scale = 1.0;       // magnitude the partial sums reach, for the absolute part
  double approx_ulps = 64;  // error of vectorised transcendentals, in f32 units (vec_math.h: <= 64)
  int roundings = 1;        // times a result is rounded to its dtype on the longest path
  bool exact = false;       // copies and gathers: bit for bit
};
inline constexpr Reduction kExact{.exact = true};

struct Tolerance {
  double rtol, atol;
};

inline double unit_roundoff(DType t) {
  switch (t) {
    case DType::bf16:
      return 0x1p-8;
    case DType::f16:
      return 0x1p-11;
    case DType::f64:
      return 0x1p-53;
    default:
      return 0x1p-24;
  }
}

inline Tolerance tolerance(DType dtype, const Reduction& r) {
  if (r.exact) return {0, 0};
  // Fast kernels accumulate f64 in f64 and everything else in f32.
  const double ua = dtype == DType::f64 ? 0x1p-53 : 0x1p-24;
  const double acc =
      8 * ua * std::sqrt(double(std::max<int64_t>(r.length, 1))) + r.approx_ulps * ua;
  const double rtol = acc + (r.roundings + 1) * unit_roundoff(dtype);
  return {rtol, rtol * r.scale};
}

// tolerance() of an f32 result whose products ran on TF32 tensor cores.
inline Tolerance tf32_tolerance(const Reduction& r) {
  const Tolerance f32 = tolerance(DType::f32, r);
  const double rtol = f32.rtol + 8 * 2 * 0x1p-11;
  return {rtol, rtol * r.scale};
}

// The same values as x in a non-contiguous layout (every other element of a
// wider buffer, last dim).
inline Tensor non_contiguous(const Tensor& x) {
  Shape wide = x.shape();
  if (wide.empty()) return x;
  wide.back() *= 2;
  Tensor buf = zeros(wide, x.dtype(), x.device());
  Tensor view = buf.slice(-1, 0, wide.back(), 2);
  view.copy_(x);
  return view;
}

// A fixed pseudo-random cotangent so every output element matters.
inline Tensor probe_like(const Tensor& out, uint64_t seed = 1234) {
  Generator g(seed, 77);
  return uniform(out.shape(), 0.5, 1.5, g, DType::f64).to(out.dtype());
}

// Why actual is not within |actual - expected| <= atol + rtol |expected|
// elementwise (NaN matches NaN, an infinity itself), naming the first
// element off and its values; empty when it is. CPU tensors.
inline std::string mismatch(const Tensor& actual, const Tensor& expected, double rtol,
                            double atol) {
  if (!actual.defined() || !expected.defined())
    return actual.defined() ? "no expected result" : "no result";
  if (actual.shape() != expected.shape())
    return "shape " + actual.shape_str() + ", expected " + expected.shape_str();
  const std::vector<double> a = actual.to_vector<double>(), e = expected.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    const bool both_nan = std::isnan(a[i]) && std::isnan(e[i]);
    const bool both_inf = std::isinf(a[i]) && a[i] == e[i];
    if (both_nan || both_inf) continue;
    if (!(std::fabs(a[i] - e[i]) <= atol + rtol * std::fabs(e[i]))) {
      std::ostringstream msg;
      msg.precision(9);
      msg << "mismatch at flat index " << i << " of shape " << actual.shape_str() << ": actual "
          << a[i] << ", expected " << e[i] << " (|error| " << std::fabs(a[i] - e[i]) << ", allowed "
          << atol + rtol * std::fabs(e[i]) << ")";
      return msg.str();
    }
  }
  return "";
}

}  // namespace trainer::testing
