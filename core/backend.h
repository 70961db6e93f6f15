// The kernel interface every device implements (docs/architecture.md "Devices").
//
// Ops (core/ops.h) validate, compute output shapes, allocate outputs and
// record autograd; then they dispatch once, through backend(device), to a
// kernel here. Kernels never allocate their outputs and accept strided,
// broadcast (stride-0) inputs; outputs are contiguous unless stated.
//
// Three implementations:
//   RefBackend  (core/ref)  plain single-threaded loops computing in double:
//                           the oracle of the tests and the fallback of every
//                           dispatch. Never goes away.
//   CpuBackend  (core/cpu)  derives from RefBackend and overrides the kernels
//                           it makes fast (oneDNN, vectorised OpenMP loops).
//   CudaBackend (core/cuda) registered when the CUDA backend is built.
//
// A kernel a backend lacks throws UnsupportedOp naming the op and the device,
// like ggml's supports_op: the op table of the tests (tests/op_cases.h) runs
// every case on every registered backend and reports such cases as not
// supported. ReferenceKernelsGuard routes CPU ops to RefBackend so a test can
// run the same op through both paths.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/attention_math.h"
#include "core/conv_attrs.h"
#include "core/op_kinds.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace trainer {

// What the attention kernels need beyond their tensors (section "attention").
// The defaults are one whole causal attention; context parallelism (ring
// attention) runs one block of it per call: q's rows against k's rows at
// other global positions, a subset of the heads, the dropout mask still
// drawn as the whole attention draws it.
struct AttentionAttrs {
  int64_t num_heads = 1;
  int64_t num_kv_heads = 0;  // 0: num_heads
  double scale = 1.0;        // of the scores, usually 1 / sqrt(HD)
  double dropout_p = 0.0;    // of the attention weights; 0: no dropout
  PhiloxKey dropout_key{};   // the mask's draw (used when dropout_p > 0)
  // Global positions of q's row 0 and k's row 0: key s is visible to query t
  // iff k_offset + s <= q_offset + t.
  int64_t q_offset = 0;
  int64_t k_offset = 0;
  // The whole attention the dropout mask belongs to: its sequence length
  // (0: T, the one-block case), the index of this call's query head 0 among
  // its heads, and its number of heads (0: num_heads).
  int64_t seq_len = 0;
  int64_t head_offset = 0;
  int64_t total_heads = 0;
  // The key/value heads KV (dividing num_heads): query head h reads kv head h / (NH / KV).
  int64_t kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  // Where the dropout elements of a call with q of Tq rows sit in the draw.
  math::AttentionDropoutGrid dropout_grid(int64_t Tq) const {
    return {total_heads > 0 ? total_heads : num_heads, seq_len > 0 ? seq_len : Tq, head_offset,
            q_offset, k_offset};
  }
};

// What the rotary embedding kernels need beyond their tensors (section
// "rotary embedding"): the heads side by side in the last dim and the
// frequency of each of a head's HD / 2 pairs, in f32 (core/ops_transformer.h
// computes them from RopeOptions).
struct RopeAttrs {
  int64_t num_heads = 1;
  std::vector<float> inv_freq;  // [HD / 2]
};

// The operands of the fused optimizer updates (section "optimizer"): entry k
// updates params[k] in place from grads[k] and its state slots, all of one
// dtype (f32 or f64) and numel. Scalars are per tensor because parameter
// groups differ in lr and weight decay, and parameters in their step count.
struct MultiTensorSgd {
  TensorList params, grads;
  TensorList momentum_buffers;  // empty when momentum == 0
  std::vector<double> lr, weight_decay;
  std::vector<int64_t> step;  // including this update: 1 starts the momentum buffer
  double momentum = 0, dampening = 0;
  bool nesterov = false;
};
struct MultiTensorAdamW {
  TensorList params, grads, exp_avg, exp_avg_sq;
  TensorList max_exp_avg_sq;  // amsgrad only, else empty
  std::vector<double> lr, weight_decay;
  std::vector<int64_t> step;  // including this update (1 on the first)
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool amsgrad = false;
};

// What a backend throws for a kernel it does not have: "op 'lstm_forward' is
// not available on the cuda backend".
class UnsupportedOp : public Error {
 public:
  using Error::Error;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Devices of this backend's kind the process can use: the CPU one; CUDA
  // the visible GPUs, 0 on a machine without (its tests then skip).
  virtual int device_count() const { return 1; }

  // ---- memory ----
  // dst[i] = convert(src[i]); src already broadcast to dst's shape; any strides.
  virtual void copy(const Tensor& src, const Tensor& dst);
  virtual void fill(const Tensor& dst, double value);
  // Copies between this device and the host (either side may be the CPU).
  virtual void copy_across(const Tensor& src, const Tensor& dst);

  // ---- elementwise (inputs broadcast to out's shape by the caller) ----
  virtual void unary(UnaryOp op, const Tensor& x, const Tensor& out);
  // grad_x = grad * f'(x); y = f(x) is passed for ops whose derivative uses it.
  virtual void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                              const Tensor& grad_x);
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
  // out = a op s (or s op a when scalar_first).
  virtual void binary_scalar(BinaryOp op, const Tensor& a, double s, bool scalar_first,
                             const Tensor& out);
  // out = cond ? a : b (cond boolean).
  virtual void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out);
  // out = min(max(x, lo), hi); grad_x = grad where lo <= x <= hi, else 0.
  virtual void clamp(const Tensor& x, double lo, double hi, const Tensor& out);
  virtual void clamp_backward(const Tensor& grad, const Tensor& x, double lo, double hi,
                              const Tensor& grad_x);
  // out (boolean) = a op b, inputs broadcast to out's shape.
  virtual void compare(CompareOp op, const Tensor& a, const Tensor& b, const Tensor& out);

  // ---- reductions ----
  // Reduces x over the dims whose bit is set in dims_mask into out, whose
  // shape is x's with those dims set to 1 (keepdim layout, contiguous).
  virtual void reduce(ReduceOp op, const Tensor& x, uint64_t dims_mask, const Tensor& out);
  // Variance over dims with a correction (1 = unbiased); out as in reduce.
  virtual void var(const Tensor& x, uint64_t dims_mask, int64_t correction, const Tensor& out);
  // Max (or argmax) along one dim: values and indices (i64), both keepdim layout.
  virtual void max_dim(const Tensor& x, int dim, const Tensor& values, const Tensor& indices);

  // ---- linear algebra ----
  // out[..., M, N] = a[..., M, K] @ b[..., K, N]; batch dims already broadcast
  // (stride 0 allowed); any strides.
  virtual void matmul(const Tensor& a, const Tensor& b, const Tensor& out);

  // ---- softmax and losses ----
  virtual void softmax(const Tensor& x, int dim, bool log, const Tensor& out);
  // grad_x from grad of y = softmax(x) (or log_softmax when log).
  virtual void softmax_backward(const Tensor& grad, const Tensor& y, int dim, bool log,
                                const Tensor& grad_x);
  // logits [N, C], target [N] (i64). loss[n] = -sum_c q_c log p_c with
  // q = (1 - eps) onehot + eps / C; 0 where target == ignore_index.
  // logp [N, C] receives log_softmax(logits) for the backward.
  virtual void cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                             int64_t ignore_index, const Tensor& loss, const Tensor& logp);
  // grad_logits[n, c] = grad_loss[n] * (p_c - q_c), 0 for ignored rows.
  virtual void cross_entropy_backward(const Tensor& grad_loss, const Tensor& logp,
                                      const Tensor& target, double label_smoothing,
                                      int64_t ignore_index, const Tensor& grad_logits);

  // ---- indexing ----
  // out = x.index_select(dim, index): out.size(dim) == index.numel().
  virtual void index_select(const Tensor& x, int dim, const Tensor& index, const Tensor& out);
  // dst.index_select(dim, index) += src (scatter-add; repeated indices add up).
  virtual void index_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src);
  // out[i][j][k] = x[i][index[i][j][k]][k] for dim 1 (torch.gather).
  virtual void gather(const Tensor& x, int dim, const Tensor& index, const Tensor& out);
  // dst[i][index[i][j][k]][k] += src[i][j][k] for dim 1.
  virtual void scatter_add(const Tensor& dst, int dim, const Tensor& index, const Tensor& src);
  // out = concatenation of inputs along dim.
  virtual void concat(const TensorList& inputs, int dim, const Tensor& out);

  // ---- random (counter-based, identical on every device) ----
  virtual void uniform(const Tensor& out, double lo, double hi, PhiloxKey key);
  virtual void normal(const Tensor& out, double mean, double std, PhiloxKey key);
  virtual void bernoulli(const Tensor& out, double p, PhiloxKey key);

  // ---- convolution, pooling, batch norm ----
  // Images are [N, C, H, W] in any strides; the ops pass channels-last ones
  // (NHWC in memory), the layout the fast paths want. Weights keep PyTorch's
  // [O, I/groups, kH, kW], contiguous; per-channel tensors are [C], contiguous.
  //
  // out[n, o, y, x] = bias[o] + sum_{i, ky, kx} w[o, i, ky, kx] *
  //     x[n, g(o) * I/groups + i, y * stride - pad + ky * dilation, (same in x)]
  // with zero padding, then relu when fuse_relu; bias may be undefined.
  virtual void conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                      const Conv2dAttrs& attrs, bool fuse_relu, const Tensor& out);
  virtual void conv2d_backward_data(const Tensor& grad_out, const Tensor& weight,
                                    const Conv2dAttrs& attrs, const Tensor& grad_x);
  // grad_bias may be undefined (no bias).
  virtual void conv2d_backward_weights(const Tensor& grad_out, const Tensor& x,
                                       const Conv2dAttrs& attrs, const Tensor& grad_weight,
                                       const Tensor& grad_bias);
  // out = max over each window (padding never wins). Returns the argmax
  // record the backward routes gradients by, in the backend's own form (the
  // reference: i64 flat indices y * W + x into the input plane, shaped like out).
  virtual Tensor max_pool2d(const Tensor& x, const Pool2dAttrs& attrs, const Tensor& out);
  virtual void max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax,
                                   const Pool2dAttrs& attrs, const Tensor& grad_x);
  virtual void avg_pool2d(const Tensor& x, const Pool2dAttrs& attrs, const Tensor& out);
  virtual void avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& attrs,
                                   const Tensor& grad_x);
  // Output size from out's shape; windows by adaptive_start/adaptive_end.
  virtual void adaptive_avg_pool2d(const Tensor& x, const Tensor& out);
  virtual void adaptive_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x);
  // Training: mean and (biased) var of each channel over N, H, W, and
  // out = (x - mean) / sqrt(var + eps) * gamma + beta, then relu when fuse_relu.
  virtual void batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                  double eps, bool fuse_relu, const Tensor& out, const Tensor& mean,
                                  const Tensor& var);
  // Evaluation: as above with the running statistics.
  virtual void batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                    const Tensor& running_mean, const Tensor& running_var,
                                    double eps, const Tensor& out);
  // Gradients of the training forward (without relu: the op masks grad_out
  // first), given the mean and var it computed.
  virtual void batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& gamma,
                                   const Tensor& mean, const Tensor& var, double eps,
                                   const Tensor& grad_x, const Tensor& grad_gamma,
                                   const Tensor& grad_beta);
  // Training forward with the relu fused (batch_norm_forward with fuse_relu).
  // Returns the record its backward masks the gradient by, in the backend's
  // own form (the default: out itself, the mask being out > 0).
  virtual Tensor batch_norm_relu_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                         double eps, const Tensor& out, const Tensor& mean,
                                         const Tensor& var);
  // Its gradients: grad_out masked by the record, then batch_norm_backward.
  virtual void batch_norm_relu_backward(const Tensor& grad_out, const Tensor& record,
                                        const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                        const Tensor& var, double eps, const Tensor& grad_x,
                                        const Tensor& grad_gamma, const Tensor& grad_beta);

  // ---- layer norm (core/ops_transformer.h) ----
  // x [R, D] contiguous, normalised over D: out = (x - mean) * rstd * weight
  // + bias with rstd = 1 / sqrt(var + eps) (biased var); weight, bias [D]
  // contiguous. mean and rstd [R] receive the statistics for the backward.
  virtual void layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                  double eps, const Tensor& out, const Tensor& mean,
                                  const Tensor& rstd);
  // With xhat = (x - mean) rstd and gw = grad_out * weight:
  // grad_x = rstd (gw - mean_D(gw) - xhat mean_D(gw xhat)),
  // grad_weight = sum_R(grad_out xhat), grad_bias = sum_R(grad_out);
  // grad_out [R, D] contiguous.
  virtual void layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                   const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                   const Tensor& grad_weight, const Tensor& grad_bias);

  // ---- RMS norm (core/ops_transformer.h) ----
  // x [R, D] contiguous, normalised over D: out = x * rstd * weight with
  // rstd = 1 / sqrt(mean_D(x^2) + eps); weight [D] contiguous. rstd [R]
  // receives the statistic for the backward.
  virtual void rms_norm_forward(const Tensor& x, const Tensor& weight, double eps,
                                const Tensor& out, const Tensor& rstd);
  // With xhat = x rstd and gw = grad_out * weight:
  // grad_x = rstd (gw - xhat mean_D(gw xhat)), grad_weight = sum_R(grad_out xhat);
  // grad_out [R, D] contiguous.
  virtual void rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                 const Tensor& rstd, const Tensor& grad_x,
                                 const Tensor& grad_weight);

  // ---- rotary embedding (core/ops_transformer.h) ----
  // x [B, T, NH HD] in any strides with a unit last stride, heads side by
  // side; positions i64 [T] in any stride. Each head's element i < HD / 2
  // pairs with i + HD / 2 and turns by the angle
  //   a[t, i] = f32(f32(positions[t]) * inv_freq[i])
  // (rounded to f32 as Hugging Face computes it, whatever x's dtype):
  //   out[i] = x[i] cos a - x[i + HD/2] sin a,  out[i + HD/2] = x[i + HD/2] cos a + x[i] sin a.
  // out [B, T, NH HD] contiguous.
  virtual void rope_forward(const Tensor& x, const Tensor& positions, const RopeAttrs& attrs,
                            const Tensor& out);
  // The transpose: grad_out turned by -a into grad_x; both contiguous [B, T, NH HD].
  virtual void rope_backward(const Tensor& grad_out, const Tensor& positions,
                             const RopeAttrs& attrs, const Tensor& grad_x);

  // ---- attention (core/ops_transformer.h) ----
  // Causal multi-head attention, flash-attention style: q [B, Tq, D], k, v
  // [B, Tk, KV HD] in any strides (views into one fused QKV projection), head
  // h the columns [h HD, (h + 1) HD) with HD = D / NH; with grouped-query
  // attention (KV = attrs.kv_heads() < NH) query head h reads kv head
  // h / (NH / KV), as Hugging Face's repeat_kv. Key s is visible to query t
  // iff k_offset + s <= q_offset + t (attrs; 0 and Tq = Tk: s <= t). Over the
  // visible s:
  //   lse[b, h, t] = log sum_s exp(scale q_t . k_s)
  //   p[t, s] = exp(scale q_t . k_s - lse[t]),  m[t, s] = keep / (1 - dropout_p)
  //   out[b, t, head h] = sum_s p[t, s] m[t, s] v_s
  // and a row that sees no key gets out 0 and lse -inf. keep[b, h, t, s]
  // (h the query head) is Philox element ((b NHt + h0 + h) Tt + q0 + t) Tt
  // + k0 + s of a bernoulli(1 - dropout_p) draw from dropout_key (core/rng.h;
  // NHt = total_heads or NH, Tt = seq_len or Tq, h0 = head_offset, q0, k0 the
  // offsets), so the backward redraws the forward's mask instead of storing
  // it, and a block of a split attention draws the whole one's elements.
  // out [B, Tq, D] and lse [B, NH, Tq] (f32, f64 for f64) contiguous. The
  // kernels keep no [B, NH, Tq, Tk] tensor: scores live per (batch, head) or
  // per tile.
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const AttentionAttrs& attrs, const Tensor& out, const Tensor& lse);
  // Backward of the above, p recomputed from q, k and lse; with
  // dp = m (grad_out . v_s) and delta_t = grad_out_t . out_t:
  //   grad_v_s = sum_t p m grad_out_t,  ds = p (dp - delta_t),
  //   grad_q_t = scale sum_s ds k_s,   grad_k_s = scale sum_t ds q_t,
  // grad_k and grad_v of a kv head summing over the query heads that read it.
  // out and lse may be the merged ones of q's rows over every key block
  // (attention_merge): p and delta are then the whole attention's, grad_q
  // this block's share of it and grad_k, grad_v the key block's exact
  // gradients. Rows with lse -inf get no gradient.
  // grad_out, out contiguous [B, Tq, D]; grad_q [B, Tq, D], grad_k, grad_v
  // [B, Tk, KV HD] in any strides with a unit last stride (views into one
  // fused gradient).
  virtual void attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& out, const Tensor& lse,
                                  const AttentionAttrs& attrs, const Tensor& grad_q,
                                  const Tensor& grad_k, const Tensor& grad_v);
  // Folds one block's result into a running one, in place, per (b, head h, row t):
  //   lse' = logaddexp(lse, block_lse),
  //   out' = out exp(lse - lse') + block_out exp(block_lse - lse')
  // head h being the columns [h HD, (h + 1) HD) of out. out, block_out
  // [B, Tq, D] contiguous (one floating dtype); lse, block_lse [B, NH, Tq]
  // contiguous (f32, f64 for f64). A side with lse -inf adds nothing (both
  // -inf: the row stays as it is).
  virtual void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                               const Tensor& block_lse);

  // ---- recurrent (core/ops_rnn.h) ----
  // One LSTM layer over x [B, T, I], batch first, gates i, f, g, o:
  //   [i f g o] = x_t weight_ih^T + h_{t-1} weight_hh^T + bias
  //   c_t = sigmoid(f) c_{t-1} + sigmoid(i) tanh(g),  h_t = sigmoid(o) tanh(c_t)
  // h0, c0 [B, H], weight_ih [4H, I], weight_hh [4H, H], bias [4H] (the sum
  // bias_ih + bias_hh), all contiguous. Writes y [B, T, H] (h_t of every
  // step), h_n and c_n [B, H], contiguous. When training, returns what
  // lstm_backward needs beyond its arguments, in the backend's own form
  // (the reference returns nothing: its backward recomputes the forward).
  virtual Tensor lstm_forward(const Tensor& x, const Tensor& h0, const Tensor& c0,
                              const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias,
                              bool training, const Tensor& y, const Tensor& h_n, const Tensor& c_n);
  // Backpropagation through time of the above, last step first, from grad_y
  // [B, T, H] and grad_h_n, grad_c_n [B, H] (contiguous; zeros where no
  // gradient arrived), given the forward's inputs, y and record. grad_bias
  // [4H] is the gradient of bias_ih and of bias_hh alike. Outputs contiguous.
  virtual void lstm_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& grad_c_n,
                             const Tensor& x, const Tensor& h0, const Tensor& c0,
                             const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias,
                             const Tensor& y, const Tensor& record, const Tensor& grad_x,
                             const Tensor& grad_h0, const Tensor& grad_c0,
                             const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                             const Tensor& grad_bias);
  // One GRU layer over x [B, T, I], batch first, gates r, z, n
  // (linear-before-reset, as PyTorch), with gi = x_t weight_ih^T + bias_ih
  // and gh = h_{t-1} weight_hh^T + bias_hh split in thirds:
  //   r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r gh_n)
  //   h_t = (1 - z) n + z h_{t-1}
  // h0 [B, H], weight_ih [3H, I], weight_hh [3H, H], bias_ih, bias_hh [3H],
  // contiguous. Writes y [B, T, H] and h_n [B, H]; returns the record as
  // lstm_forward does.
  virtual Tensor gru_forward(const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                             const Tensor& weight_hh, const Tensor& bias_ih, const Tensor& bias_hh,
                             bool training, const Tensor& y, const Tensor& h_n);
  // Backpropagation through time of the above from grad_y [B, T, H] and
  // grad_h_n [B, H] (contiguous, zeros where none arrived). Outputs contiguous.
  virtual void gru_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& x,
                            const Tensor& h0, const Tensor& weight_ih, const Tensor& weight_hh,
                            const Tensor& bias_ih, const Tensor& bias_hh, const Tensor& y,
                            const Tensor& record, const Tensor& grad_x, const Tensor& grad_h0,
                            const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                            const Tensor& grad_bias_ih, const Tensor& grad_bias_hh);

  // ---- optimizer (optim/optimizer.cpp, clip.cpp, loss_scaler.cpp) ----
  // Fused multi-tensor kernels: one call covers a whole list of tensors (on
  // CUDA one launch over chunks of all of them, as apex's multi_tensor_apply).
  // Tensors contiguous; the update math is core/optim_math.h.
  virtual void sgd_step(const MultiTensorSgd& /*a*/) { unsupported("sgd_step"); }
  virtual void adamw_step(const MultiTensorAdamW& /*a*/) { unsupported("adamw_step"); }
  // grads[k] *= inv_scale in place (any floating dtype); returns whether any
  // element was inf/nan before (torch's _amp_foreach_non_finite_check_and_unscale_).
  virtual bool unscale_grads(const TensorList& /*grads*/, double /*inv_scale*/) {
    unsupported("unscale_grads");
  }
  // The sum over every element of every grad of |g|^p (max |g| for p = inf,
  // NaN-propagating), accumulated in double in an order fixed by the sizes.
  virtual double grads_power_sum(const TensorList& /*grads*/, double /*p*/) {
    unsupported("grads_power_sum");
  }

 protected:
  [[noreturn]] void unsupported(const char* op) const;
};

// The backend of a device (the reference one for CPU under ReferenceKernelsGuard).
Backend& backend(Device device);
void register_backend(DeviceKind kind, Backend* backend);
Backend& reference_backend();
// The device kinds this build has a backend for, the CPU first, whether or
// not a device of the kind is present (Backend::device_count).
std::vector<DeviceKind> registered_device_kinds();

// While alive, CPU ops on this thread run the reference kernels.
class ReferenceKernelsGuard {
 public:
  ReferenceKernelsGuard();
  ~ReferenceKernelsGuard();
  ReferenceKernelsGuard(const ReferenceKernelsGuard&) = delete;
  ReferenceKernelsGuard& operator=(const ReferenceKernelsGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace trainer
