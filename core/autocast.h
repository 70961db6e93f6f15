// Automatic mixed precision (torch.autocast): a thread-local autocast dtype
// and the cast policy the ops apply at their entry points.
//
// While an AutocastGuard(bf16) or AutocastGuard(f16) is alive on a thread,
// every op that runs there casts its floating inputs by its policy before
// computing:
//   lower      matmul, linear, conv2d, causal attention, LSTM, GRU: f32, bf16
//              and f16 inputs (the f32 master weights included) are cast to
//              the autocast dtype and the op computes there (oneDNN
//              accumulates in f32); the output is in the autocast dtype.
//   fp32       softmax, log_softmax, cross_entropy, layer_norm, rms_norm,
//              batch_norm, sum, mean, exp, log: bf16/f16 inputs are cast up to f32.
//   promote    binary ops and where: operands of mixed floating dtypes are
//              cast to the wider (f64 > f32 > bf16, f16; bf16 with f16 -> f32).
//   (others)   run in their input's dtype (relu, gelu, dropout, rotary
//              embedding, views, ...).
// f64 tensors are never cast down (gradient checks keep working). Casts are
// the recorded Tensor::to(), whose backward casts the gradient back, so an
// f32 parameter gets an f32 gradient. The backward pass runs with autocast
// off (autograd::run_backward): its ops follow the dtypes forward chose.
//
//   {
//     AutocastGuard autocast(DType::bf16);
//     Tensor logits = model.forward(x);           // linear/conv outputs in bf16
//     loss = cross_entropy(logits, target);       // computed in f32
//   }
//   loss.backward();                               // f32 parameters get f32 gradients
//
// AutocastGuard(DType::f32) turns autocast off in its scope (fp32 training
// runs through the same code).
#pragma once

#include <optional>

#include "core/tensor.h"

namespace trainer {

// The autocast dtype of this thread (bf16 or f16), or nullopt when autocast is off.
std::optional<DType> autocast_dtype();

// Sets the autocast dtype in its scope: bf16 or f16 turn autocast on, f32 off.
class AutocastGuard {
 public:
  explicit AutocastGuard(DType dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> previous_;
};

// The policies, each the identity when autocast is off or the tensor is
// undefined or not floating.
// "lower": x in the autocast dtype (f32, bf16 and f16 are cast; f64 is not).
Tensor autocast_lower(const Tensor& x);
// "fp32": bf16 and f16 cast up to f32.
Tensor autocast_fp32(const Tensor& x);
// "promote": a and b cast to the wider of their floating dtypes when they differ.
void autocast_promote(Tensor& a, Tensor& b);

}  // namespace trainer
