// The CUDA backend: backend(Device{kCUDA, i}) (core/backend.h), registered
// from a static initialiser when the CUDA build is on.
//
// Every kernel runs on its operands' device (made current for the call) and
// on that device's current stream (stream.h), and returns without waiting;
// results are ordered by the stream. Copies to the host wait for the data.
// Files:
//   cuda_backend.cpp  elementwise and random kernels: Tensor -> Launch<N> (launch.h)
//   transfer.cpp      copy_across: host <-> device through pinned staging buffers
//   copy.cu           copy with dtype conversion, fill, where (every dtype)
//   elementwise.cu    the math kernels, on the functors of core/elementwise_math.h
//   random.cu         Philox draws, identical to the CPU's
//   matmul.cpp        matmul: cuBLASLt (f32 as TF32, bf16, f16), cuBLAS Dgemm (f64)
//   cuda_rows.cpp     reductions, softmax, cross-entropy, indexing, layer norm, RMS norm:
//                     Tensor -> Rows<N> / Launch<N> (host_rows.h, kernels.h)
//   cuda_image.cpp    batch norm and pooling
//   conv.cpp          convolution on cuDNN (algorithm search cached per shape)
//   reduce.cu, nn.cu, index.cu, norm.cu, pool.cu   their kernels
//   attention.cu      fused causal attention, grouped-query too (host side in cuda_backend.cpp)
//   rope.cu           rotary embedding (host side in cuda_backend.cpp)
//   rnn.cpp           LSTM and GRU layers on cuDNN's RNN API
//   cuda_optim.cpp    fused multi-tensor optimizer updates, unscaling, gradient norms (optim.cu)
//
// Allocation: temporaries and outputs are allocated on the current device,
// so code creating CUDA tensors for cuda:i runs with i current
// (cuda::set_device / DeviceGuard); one device per process is the norm.
#pragma once

#include <array>
#include <cstddef>

#include "core/backend.h"
#include "core/cpu/loops.h"
#include "core/cuda/launch.h"

namespace trainer::cuda {

class CudaBackend final : public Backend {
 public:
  const char* name() const override { return "cuda"; }
  int device_count() const override;  // device.h's: the visible GPUs

  // ---- cuda_backend.cpp ----
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
  void uniform(const Tensor& out, double lo, double hi, PhiloxKey key) override;
  void normal(const Tensor& out, double mean, double std, PhiloxKey key) override;
  void bernoulli(const Tensor& out, double p, PhiloxKey key) override;

  // ---- transfer.cpp ----
  void copy_across(const Tensor& src, const Tensor& dst) override;

  // ---- matmul.cpp ----
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out) override;

  // ---- cuda_rows.cpp ----
  void reduce(ReduceOp op, const Tensor& x, uint64_t dims_mask, const Tensor& out) override;
  void var(const Tensor& x, uint64_t dims_mask, int64_t correction, const Tensor& out) override;
  void max_dim(const Tensor& x, int dim, const Tensor& values, const Tensor& indices) override;
  void softmax(const Tensor& x, int dim, bool log, const Tensor& out) override;
  void softmax_backward(const Tensor& grad, const Tensor& y, int dim, bool log,
                        const Tensor& grad_x) override;
  void cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                     int64_t ignore_index, const Tensor& loss, const Tensor& logp) override;
  void cross_entropy_backward(const Tensor& grad_loss, const Tensor& logp, const Tensor& target,
                              double label_smoothing, int64_t ignore_index,
                              const Tensor& grad_logits) override;
  void index_select(const Tensor& x, int dim, const Tensor& index, const Tensor& out) override;
  void index_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) override;
  void gather(const Tensor& x, int dim, const Tensor& index, const Tensor& out) override;
  void scatter_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) override;
  void concat(const TensorList& inputs, int dim, const Tensor& out) override;
  void layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                          const Tensor& out, const Tensor& mean, const Tensor& rstd) override;
  void layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                           const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                           const Tensor& grad_weight, const Tensor& grad_bias) override;
  void rms_norm_forward(const Tensor& x, const Tensor& weight, double eps, const Tensor& out,
                        const Tensor& rstd) override;
  void rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                         const Tensor& rstd, const Tensor& grad_x,
                         const Tensor& grad_weight) override;

  // ---- cuda_image.cpp ----
  Tensor max_pool2d(const Tensor& x, const Pool2dAttrs& attrs, const Tensor& out) override;
  void max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax, const Pool2dAttrs& attrs,
                           const Tensor& grad_x) override;
  void avg_pool2d(const Tensor& x, const Pool2dAttrs& attrs, const Tensor& out) override;
  void avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& attrs,
                           const Tensor& grad_x) override;
  void adaptive_avg_pool2d(const Tensor& x, const Tensor& out) override;
  void adaptive_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x) override;
  void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                          bool fuse_relu, const Tensor& out, const Tensor& mean,
                          const Tensor& var) override;
  void batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            const Tensor& running_mean, const Tensor& running_var, double eps,
                            const Tensor& out) override;
  void batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& gamma,
                           const Tensor& mean, const Tensor& var, double eps, const Tensor& grad_x,
                           const Tensor& grad_gamma, const Tensor& grad_beta) override;

  // ---- cuda_backend.cpp (kernels: rope.cu, attention.cu) ----
  void rope_forward(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
                    const Tensor& out) override;
  void rope_backward(const Tensor& grad_out, const Tensor& positions, const RopeAttrs& attrs,
                     const Tensor& grad_x) override;
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionAttrs& attrs, const Tensor& out,
                         const Tensor& lse) override;
  void attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs,
                          const Tensor& grad_q, const Tensor& grad_k,
                          const Tensor& grad_v) override;
  void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                       const Tensor& block_lse) override;

  // ---- rnn.cpp ----
  Tensor lstm_forward(const Tensor& x, const Tensor& h0, const Tensor& c0, const Tensor& weight_ih,
                      const Tensor& weight_hh, const Tensor& bias, bool training, const Tensor& y,
                      const Tensor& h_n, const Tensor& c_n) override;
  void lstm_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& grad_c_n,
                     const Tensor& x, const Tensor& h0, const Tensor& c0, const Tensor& weight_ih,
                     const Tensor& weight_hh, const Tensor& bias, const Tensor& y,
                     const Tensor& record, const Tensor& grad_x, const Tensor& grad_h0,
                     const Tensor& grad_c0, const Tensor& grad_weight_ih,
                     const Tensor& grad_weight_hh, const Tensor& grad_bias) override;
  Tensor gru_forward(const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                     const Tensor& weight_hh, const Tensor& bias_ih, const Tensor& bias_hh,
                     bool training, const Tensor& y, const Tensor& h_n) override;
  void gru_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& x, const Tensor& h0,
                    const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias_ih,
                    const Tensor& bias_hh, const Tensor& y, const Tensor& record,
                    const Tensor& grad_x, const Tensor& grad_h0, const Tensor& grad_weight_ih,
                    const Tensor& grad_weight_hh, const Tensor& grad_bias_ih,
                    const Tensor& grad_bias_hh) override;

  // ---- cuda_optim.cpp (kernels: optim.cu) ----
  void sgd_step(const MultiTensorSgd& a) override;
  void adamw_step(const MultiTensorAdamW& a) override;
  bool unscale_grads(const TensorList& grads, double inv_scale) override;
  double grads_power_sum(const TensorList& grads, double p) override;

  // ---- conv.cpp ----
  void conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dAttrs& attrs,
              bool fuse_relu, const Tensor& out) override;
  void conv2d_backward_data(const Tensor& grad_out, const Tensor& weight, const Conv2dAttrs& attrs,
                            const Tensor& grad_x) override;
  void conv2d_backward_weights(const Tensor& grad_out, const Tensor& x, const Conv2dAttrs& attrs,
                               const Tensor& grad_weight, const Tensor& grad_bias) override;
};

// Host <-> device copies of pageable memory go through two pinned staging
// buffers of staging_bytes each, alternating so the host copies one chunk
// while the DMA engine moves the other. Pinned host memory is copied
// directly. (An option so tests can force many chunks with small tensors.)
struct TransferOptions {
  size_t staging_bytes = size_t(4) << 20;
};
void set_transfer_options(const TransferOptions& options);
TransferOptions transfer_options();

// Calls fn(launch) for the elementwise launches covering shape: one, unless
// more than kMaxDims dims remain after merging, in which case the outer dims
// are looped on the host. ops[0] is the output; all ops have `shape`.
template <size_t N, class Fn>
void for_each_launch(const Shape& shape, const std::array<const Tensor*, N>& ops, Fn&& fn) {
  const int64_t numel = shape_numel(shape);
  if (numel == 0) return;
  const cpu::LoopPlan<N> p = cpu::make_loop_plan(shape, ops);
  const int outer = std::max(0, p.ndim - kMaxDims);  // dims looped on the host
  Launch<int(N)> g;
  g.ndim = p.ndim - outer;
  g.numel = 1;
  for (int d = 0; d < g.ndim; ++d) {
    g.sizes[d] = p.shape[outer + d];
    g.numel *= g.sizes[d];
    for (size_t k = 0; k < N; ++k) g.strides[k][d] = p.strides[k][outer + d];
  }
  g.contiguous = g.ndim == 1;
  for (size_t k = 0; k < N; ++k) g.contiguous = g.contiguous && g.strides[k][0] == 1;
  int64_t idx[cpu::kMaxLoopDims] = {};  // index over the outer dims
  for (int64_t o = 0; o < numel / g.numel; ++o) {
    for (size_t k = 0; k < N; ++k) {
      int64_t off = 0;
      for (int d = 0; d < outer; ++d) off += idx[d] * p.strides[k][d];
      g.data[k] = p.base[k] + off * int64_t(p.elem_size[k]);
    }
    g.first_index = o * g.numel;
    fn(static_cast<const Launch<int(N)>&>(g));
    for (int d = outer - 1; d >= 0 && ++idx[d] == p.shape[d]; --d) idx[d] = 0;
  }
}

}  // namespace trainer::cuda
