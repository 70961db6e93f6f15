// The CPU backend: the fast paths. It derives from RefBackend, so any kernel
// not overridden here (and any dtype a fast path does not take) runs the
// reference loops (thread count and core placement: core/cpu/threads.h).
// Each area lives in its own file:
//   cpu_elementwise.cpp  vectorised OpenMP loops (core/cpu/loops.h)
//   cpu_reduce.cpp       reductions
//   cpu_linalg.cpp       oneDNN matmul, primitives cached per shape
//   cpu_nn.cpp           softmax / log_softmax (vectorised rows), fused cross-entropy
//   cpu_index.cpp        concat, index_select/add, gather/scatter_add
//   cpu_random.cpp       Philox draws, parallel over counter blocks
//   cpu_conv.cpp         oneDNN convolution, primitives cached per shape (onednn.h helpers)
//   cpu_pool.cpp         oneDNN max / average pooling
//   cpu_batch_norm.cpp   oneDNN batch norm, fused relu
//   cpu_layernorm.cpp    layer norm and RMS norm, vectorised rows with OpenMP over rows
//   cpu_rope.cpp         rotary embedding, vectorised rows with OpenMP over rows
//   cpu_attention.cpp    fused causal attention (grouped-query too), OpenMP over
//                        (batch, kv head), sgemm tiles
//   cpu_rnn.cpp          LSTM / GRU layers
//   cpu_optim.cpp        fused SGD / AdamW updates, OpenMP over elements (core/optim_math.h)
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
  void reduce(ReduceOp op, const Tensor& x, uint64_t dims_mask, const Tensor& out) override;
  void var(const Tensor& x, uint64_t dims_mask, int64_t correction, const Tensor& out) override;
  void max_dim(const Tensor& x, int dim, const Tensor& values, const Tensor& indices) override;

  // ---- cpu_linalg.cpp ----
  void matmul(const Tensor& a, const Tensor& b, const Tensor& out) override;

  // ---- cpu_nn.cpp ----
  void softmax(const Tensor& x, int dim, bool log, const Tensor& out) override;
  void softmax_backward(const Tensor& grad, const Tensor& y, int dim, bool log,
                        const Tensor& grad_x) override;
  void cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                     int64_t ignore_index, const Tensor& loss, const Tensor& logp) override;
  void cross_entropy_backward(const Tensor& grad_loss, const Tensor& logp, const Tensor& target,
                              double label_smoothing, int64_t ignore_index,
                              const Tensor& grad_logits) override;

  // ---- cpu_index.cpp ----
  void index_select(const Tensor& x, int dim, const Tensor& index, const Tensor& out) override;
  void index_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) override;
  void gather(const Tensor& x, int dim, const Tensor& index, const Tensor& out) override;
  void scatter_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src) override;
  void concat(const TensorList& inputs, int dim, const Tensor& out) override;

  // ---- cpu_random.cpp ----
  void uniform(const Tensor& out, double lo, double hi, PhiloxKey key) override;
  void normal(const Tensor& out, double mean, double std, PhiloxKey key) override;
  void bernoulli(const Tensor& out, double p, PhiloxKey key) override;

  // ---- cpu_conv.cpp ----
  void conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dAttrs& attrs,
              bool fuse_relu, const Tensor& out) override;
  void conv2d_backward_data(const Tensor& grad_out, const Tensor& weight, const Conv2dAttrs& attrs,
                            const Tensor& grad_x) override;
  void conv2d_backward_weights(const Tensor& grad_out, const Tensor& x, const Conv2dAttrs& attrs,
                               const Tensor& grad_weight, const Tensor& grad_bias) override;
  Tensor max_pool2d(const Tensor& x, const Pool2dAttrs& attrs, const Tensor& out) override;
  void max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax, const Pool2dAttrs& attrs,
                           const Tensor& grad_x) override;
  void avg_pool2d(const Tensor& x, const Pool2dAttrs& attrs, const Tensor& out) override;
  void avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& attrs,
                           const Tensor& grad_x) override;
  void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                          bool fuse_relu, const Tensor& out, const Tensor& mean,
                          const Tensor& var) override;
  void batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            const Tensor& running_mean, const Tensor& running_var, double eps,
                            const Tensor& out) override;
  void batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& gamma,
                           const Tensor& mean, const Tensor& var, double eps, const Tensor& grad_x,
                           const Tensor& grad_gamma, const Tensor& grad_beta) override;
  Tensor batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                 double eps, const Tensor& out, const Tensor& mean,
                                 const Tensor& var) override;
  void batch_norm_relu_backward(const Tensor& grad_out, const Tensor& record, const Tensor& x,
                                const Tensor& gamma, const Tensor& mean, const Tensor& var,
                                double eps, const Tensor& grad_x, const Tensor& grad_gamma,
                                const Tensor& grad_beta) override;
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

  // ---- cpu_rope.cpp ----
  void rope_forward(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
                    const Tensor& out) override;
  void rope_backward(const Tensor& grad_out, const Tensor& positions, const RopeAttrs& attrs,
                     const Tensor& grad_x) override;

  // ---- cpu_attention.cpp ----
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                         const AttentionAttrs& attrs, const Tensor& out,
                         const Tensor& lse) override;
  void attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& out, const Tensor& lse, const AttentionAttrs& attrs,
                          const Tensor& grad_q, const Tensor& grad_k,
                          const Tensor& grad_v) override;
  void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                       const Tensor& block_lse) override;

  // ---- cpu_rnn.cpp ----
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

  // ---- cpu_optim.cpp ----
  void sgd_step(const MultiTensorSgd& a) override;
  void adamw_step(const MultiTensorAdamW& a) override;
};

Backend& cpu_backend();

}  // namespace trainer
