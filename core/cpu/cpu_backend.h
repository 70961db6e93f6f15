// The CPU backend: the fast paths. It derives from RefBackend, so any kernel
// not overridden here (and any dtype a fast path does not take) runs the
// reference loops. Each area lives in its own file:
//   cpu_elementwise.cpp  vectorised OpenMP loops (core/cpu/loops.h)
//   cpu_reduce.cpp       reductions
//   cpu_linalg.cpp       oneDNN matmul, primitives cached per shape
//   cpu_nn.cpp           oneDNN softmax / log_softmax, fused cross-entropy
//   cpu_index.cpp        concat, index_select/add, gather/scatter_add
//   cpu_random.cpp       Philox draws, parallel over counter blocks
#pragma once

#include "core/ref/ref_backend.h"

namespace trainer {

class CpuBackend : public RefBackend {
 public:
  const char* name() const override { return "cpu"; }

  // ---- cpu_elementwise.cpp ----
  void copy(const Tensor& src, const Tensor& dst) override;
  void fill(const Tensor& dst, double value) override;
  void unary(UnaryOp op, const Tensor& x, const Tensor& out) override;
  void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                      const Tensor& grad_x) override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first,
                     const Tensor& out) override;
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) override;
  void clamp(const Tensor& x, double lo, double hi, const Tensor& out) override;
  void clamp_backward(const Tensor& grad, const Tensor& x, double lo, double hi,
                      const Tensor& grad_x) override;
  void compare(CompareOp op, const Tensor& a, const Tensor& b, const Tensor& out) override;

  // ---- cpu_reduce.cpp ----

  // ---- cpu_linalg.cpp ----

  // ---- cpu_nn.cpp ----

  // ---- cpu_index.cpp ----

  // ---- cpu_random.cpp ----
};

Backend& cpu_backend();

// Threads used by CPU kernels (OpenMP and oneDNN).
void set_num_threads(int n);
int num_threads();

}  // namespace trainer
