// Low-precision (bf16, f16) operands on the CPU fast paths (core/autocast.h
// sends matmul, convolution, attention and the recurrent layers here in bf16
// or f16).
//
// bf16 has oneDNN kernels from AVX-512 up (native with AVX512-BF16 or AMX):
// matmul in cpu_linalg.cpp, convolution in cpu_conv_bf16.cpp, used where
// they beat the f32 kernels (with AMX; cpu::use_bf16_kernels()). Below
// AVX-512 (or DNNL_MAX_CPU_ISA) oneDNN 2.6 has none, not even reference
// ones (cpu::has_bf16_kernels() probes), and neither has it f16 CPU kernels;
// the attention and recurrent kernels are written for f32,
// so those run on f32 copies of the operands and round their results back
// (run_in_f32): the f32 kernel's speed plus two conversion passes, instead
// of the reference loops.
//
//   if (cpu::any_half({&q, &k, &v}))
//     return cpu::run_in_f32({q, k, v}, {out}, [&](const TensorList& in, const TensorList& o) {
//       attention_forward(in[0], in[1], in[2], attrs, o[0], lse);
//     });
#pragma once

#include <initializer_list>

#include "core/conv_attrs.h"
#include "core/ops_conv.h"
#include "core/tensor.h"

namespace trainer::cpu {

inline bool is_half(DType t) { return t == DType::bf16 || t == DType::f16; }

// Whether any defined tensor of ts is bf16 or f16.
inline bool any_half(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && is_half(t->dtype())) return true;
  return false;
}

// Whether every defined tensor of ts has dtype t.
inline bool all_of_dtype(std::initializer_list<const Tensor*> ts, DType t) {
  for (const Tensor* x : ts)
    if (x->defined() && x->dtype() != t) return false;
  return true;
}

// An uninitialised f32 tensor shaped like t: channels-last when t is, else contiguous.
inline Tensor f32_buffer_like(const Tensor& t) {
  if (t.dim() == 4 && is_channels_last(t)) return empty_channels_last(t.shape(), DType::f32);
  return empty(t.shape(), DType::f32);
}

// Runs kernel(inputs32, outputs32) where the bf16/f16 tensors of inputs are
// replaced by f32 copies and those of outputs by f32 buffers, then converts
// those buffers into outputs. f32 and undefined tensors pass through as they are.
template <class Kernel>
void run_in_f32(const TensorList& inputs, const TensorList& outputs, Kernel&& kernel) {
  TensorList in32, out32;
  for (const Tensor& t : inputs) {
    if (!t.defined() || !is_half(t.dtype())) {
      in32.push_back(t);
      continue;
    }
    Tensor c = f32_buffer_like(t);
    c.copy_(t);
    in32.push_back(c);
  }
  for (const Tensor& t : outputs)
    out32.push_back(t.defined() && is_half(t.dtype()) ? f32_buffer_like(t) : t);
  kernel(in32, out32);
  for (size_t i = 0; i < outputs.size(); ++i) {
    Tensor out = outputs[i];  // a handle: copy_ writes the caller's tensor
    if (out32[i].impl() != out.impl()) out.copy_(out32[i]);
  }
}

// ---- cpu_conv_bf16.cpp: oneDNN bf16 convolutions, every operand bf16 ----
// The kernels of core/backend.h ("convolution") with x, weight, bias and
// out (or their gradients) all bf16; oneDNN accumulates in f32.
void conv2d_bf16(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dAttrs& a,
                 bool fuse_relu, const Tensor& out);
void conv2d_backward_data_bf16(const Tensor& grad_out, const Tensor& weight, const Conv2dAttrs& a,
                               const Tensor& grad_x);
void conv2d_backward_weights_bf16(const Tensor& grad_out, const Tensor& x, const Conv2dAttrs& a,
                                  const Tensor& grad_weight, const Tensor& grad_bias);

}  // namespace trainer::cpu
