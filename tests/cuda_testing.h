// Helpers of the CUDA tests: the current GPU, per-dtype tolerances between
// device and host results, and the comparison of an op (forward and
// backward) on CUDA copies of CPU inputs with the same op on the CPU.
// Include after the project headers (it brings in tests/testing.h).
#pragma once

#include <string>

#include "core/cuda/device.h"
#include "tests/testing.h"

namespace trainer::testing {

inline Device gpu() { return Device{kCUDA, cuda::current_device()}; }
inline const Device kHost{};

// Runs f on CPU inputs and on CUDA copies of them (non-contiguous copies when
// strided), forward and, when backward, backward with a fixed cotangent;
// outputs and input gradients must agree.
inline void check_cuda_vs_cpu(const Fn& f, const TensorList& inputs, double rtol, double atol,
                              bool strided, bool backward, const std::string& what) {
  auto run = [&](Device dev, TensorList& grads) {
    TensorList in;
    for (const Tensor& t : inputs) {
      Tensor x = t.to(dev).detach();
      if (strided && x.dim() > 0) x = non_contiguous(x);
      if (backward && is_floating(x.dtype())) x.requires_grad_();
      in.push_back(x);
    }
    Tensor out = f(in);
    if (backward && out.requires_grad()) out.backward(probe_like(out).to(dev));
    for (const Tensor& x : in) grads.push_back(x.requires_grad() ? x.grad() : Tensor());
    return out;
  };
  TensorList cpu_grads, gpu_grads;
  Tensor expected = run(kHost, cpu_grads);
  Tensor actual = run(gpu(), gpu_grads);
  REQUIRE(actual.device() == gpu());
  REQUIRE(actual.dtype() == expected.dtype());
  require_close(actual, expected, rtol, atol, what + " forward");
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (!cpu_grads[k].defined()) continue;
    REQUIRE(gpu_grads[k].defined());
    REQUIRE(gpu_grads[k].device() == gpu());
    require_close(gpu_grads[k], cpu_grads[k], rtol, atol,
                  what + " gradient of input " + std::to_string(k));
  }
}

// Device and host libm differ by an ulp or two; bf16/f16 then round that
// difference to one of their (much larger) ulps.
inline Tolerance tolerance(DType t) {
  switch (t) {
    case DType::f64:
      return {1e-12, 1e-12};
    case DType::bf16:
      return {3e-2, 3e-2};  // a few bf16 ulps: backward chains round per op
    case DType::f16:
      return {5e-3, 5e-3};
    default:
      return {1e-5, 1e-5};
  }
}

inline const DType kFloating[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
inline const DType kAll[] = {DType::f32, DType::f64, DType::bf16, DType::f16,
                             DType::i32, DType::i64, DType::u8,   DType::boolean};

}  // namespace trainer::testing
