// Names of the elementwise and reduction operations, shared by the op layer,
// every backend and the shared math (nvcc-safe: no standard library).
#pragma once

#include <cstdint>

namespace trainer {

enum class UnaryOp : uint8_t {
  neg,
  exp,
  log,
  sqrt,
  rsqrt,
  abs,
  tanh,
  sigmoid,
  relu,
  gelu_tanh,
  gelu_erf,
  silu
};
enum class BinaryOp : uint8_t { add, sub, mul, div, pow, maximum, minimum };
enum class ReduceOp : uint8_t { sum, mean, max, min };
enum class CompareOp : uint8_t { eq, lt, gt };

const char* unary_op_name(UnaryOp op);
const char* binary_op_name(BinaryOp op);

}  // namespace trainer
