// The scope of one backend call: checks that every operand lives on the
// same CUDA device, makes that device current (so temporaries are allocated
// there) and names the stream to enqueue on.
//
//   KernelScope scope("relu", {&out, &x});
//   launch_unary(op, g, dtype, scope.stream());
#pragma once

#include <initializer_list>

#include "core/cuda/device.h"
#include "core/cuda/stream.h"
#include "core/tensor.h"

namespace trainer::cuda {

// The device index shared by ops (undefined tensors skipped).
inline int operands_device(const char* op, std::initializer_list<const Tensor*> ops) {
  int index = -1;
  for (const Tensor* t : ops) {
    if (!t->defined()) continue;
    CHECK(t->device().is_cuda()) << op << ": an operand on " << t->device()
                                 << " reached the CUDA backend";
    if (index < 0) index = t->device().index;
    CHECK_EQ(t->device().index, index) << op << ": operands on different GPUs";
  }
  CHECK_GE(index, 0) << op << ": no operand";
  return index;
}

class KernelScope {
 public:
  KernelScope(const char* op, std::initializer_list<const Tensor*> ops)
      : guard_(operands_device(op, ops)), stream_(current_stream()) {}
  cudaStream_t stream() const { return stream_; }

 private:
  DeviceGuard guard_;
  cudaStream_t stream_;
};

}  // namespace trainer::cuda
