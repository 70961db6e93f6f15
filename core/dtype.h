// Element types. f32 is the compute type of the model; bf16 and f16 are
// storage types converted to f32 on load (their math is f32); f64 exists for
// the finite-difference gradient checker; i32/i64 hold indices and labels, u8
// images, boolean masks.
//
// bf16 and f16 are 16-bit wrappers with host/device conversions (round to
// nearest even), so a CPU test checks the same bits a CUDA kernel writes.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string_view>

#include "core/hd.h"

namespace trainer {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u8, boolean };

struct bf16 {
  uint16_t bits = 0;
};
struct f16 {
  uint16_t bits = 0;
};

TRAINER_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
TRAINER_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

TRAINER_HD float to_float(bf16 h) { return bits_float(uint32_t(h.bits) << 16); }
TRAINER_HD bf16 to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                               // nearest even
  return bf16{uint16_t(u >> 16)};
}

TRAINER_HD float to_float(f16 h) {
  uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // Subnormal: value = man * 2^-24.
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}
TRAINER_HD f16 to_f16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16{uint16_t(sign | 0x7e00u)};   // nan
  if (abs >= 0x477ff000u) return f16{uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {                                       // subnormal or zero in f16
    // Scale so the f16 subnormal unit (2^-24) becomes 1 and round to nearest even.
    float v = bits_float(abs) * 16777216.0f;
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return f16{uint16_t(sign | m)};
  }
  uint32_t exp = (abs >> 23) - 112u;
  uint32_t man = abs & 0x7fffffu;
  uint32_t out = (exp << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (out & 1u))) ++out;  // may carry into the exponent
  return f16{uint16_t(sign | out)};
}

// The arithmetic type a storage type computes in.
template <class T>
struct AccType {
  using type = T;
};
template <>
struct AccType<bf16> {
  using type = float;
};
template <>
struct AccType<f16> {
  using type = float;
};
template <class T>
using acc_t = typename AccType<T>::type;

template <class T>
TRAINER_HD acc_t<T> load(const T& v) {
  return v;
}
template <>
TRAINER_HD float load(const bf16& v) {
  return to_float(v);
}
template <>
TRAINER_HD float load(const f16& v) {
  return to_float(v);
}
template <class T, class A>
TRAINER_HD T store_as(A v) {
  return static_cast<T>(v);
}
template <>
TRAINER_HD bf16 store_as<bf16, float>(float v) {
  return to_bf16(v);
}
template <>
TRAINER_HD f16 store_as<f16, float>(float v) {
  return to_f16(v);
}
template <>
TRAINER_HD bf16 store_as<bf16, double>(double v) {
  return to_bf16(float(v));
}
template <>
TRAINER_HD f16 store_as<f16, double>(double v) {
  return to_f16(float(v));
}

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
bool is_floating(DType t);
inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::u8;
}
template <>
constexpr DType dtype_of<bool>() {
  return DType::boolean;
}

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with the C++ type of a floating dtype.
//   dispatch_floating(x.dtype(), "relu", [&](auto tag) { using T = typename decltype(tag)::type;
//   ... });
[[noreturn]] void dtype_unsupported(DType t, const char* what);
template <class Fn>
decltype(auto) dispatch_floating(DType t, const char* what, Fn&& fn) {
  switch (t) {
    case DType::f32:
      return fn(TypeTag<float>{});
    case DType::f64:
      return fn(TypeTag<double>{});
    case DType::bf16:
      return fn(TypeTag<bf16>{});
    case DType::f16:
      return fn(TypeTag<f16>{});
    default:
      dtype_unsupported(t, what);
  }
}
// As dispatch_floating, for the two dtypes kernels that accumulate in double
// take (f32, f64); another is an Error naming `what`.
template <class Fn>
decltype(auto) dispatch_f32_f64(DType t, const char* what, Fn&& fn) {
  if (t == DType::f64) return fn(TypeTag<double>{});
  if (t != DType::f32) dtype_unsupported(t, what);
  return fn(TypeTag<float>{});
}
// As dispatch_floating, for every dtype.
template <class Fn>
decltype(auto) dispatch_all(DType t, const char* what, Fn&& fn) {
  switch (t) {
    case DType::f32:
      return fn(TypeTag<float>{});
    case DType::f64:
      return fn(TypeTag<double>{});
    case DType::bf16:
      return fn(TypeTag<bf16>{});
    case DType::f16:
      return fn(TypeTag<f16>{});
    case DType::i32:
      return fn(TypeTag<int32_t>{});
    case DType::i64:
      return fn(TypeTag<int64_t>{});
    case DType::u8:
      return fn(TypeTag<uint8_t>{});
    case DType::boolean:
      return fn(TypeTag<bool>{});
  }
  dtype_unsupported(t, what);
}
// Index types.
template <class Fn>
decltype(auto) dispatch_index(DType t, const char* what, Fn&& fn) {
  switch (t) {
    case DType::i32:
      return fn(TypeTag<int32_t>{});
    case DType::i64:
      return fn(TypeTag<int64_t>{});
    default:
      dtype_unsupported(t, what);
  }
}

}  // namespace trainer
