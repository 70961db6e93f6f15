// The boundary between CudaBackend's row, index, normalisation, pooling,
// rotary embedding and attention kernels (reduce.cu, nn.cu, index.cu,
// norm.cu, pool.cu, rope.cu, attention.cu; nvcc, C++17), the multi-tensor
// optimizer kernels (optim.cu) and their host side (cuda_ops.cpp, conv.cpp):
// plain structs and launchers, as launch.h is for the elementwise kernels.
//
// A row launch reduces or normalises groups of elements ("rows"): Rows<N>
// walks the rows with `outer` (one index per row, element 0 of each operand
// in outer.data) and the elements of one row with `inner` (its data unused:
// element r of row s of operand k is at outer offset(s) + inner offset(r)).
// One thread block handles one row (a grid-stride loop over rows), so a row
// may be long and any strides work; large single rows are split across
// blocks by the host (ReduceArgs::splits) and finished by a second launch.
//
// Kernels computing in acc_t<T> (float for bf16/f16/f32, double for f64)
// write per-row statistics in that type. Out-of-range indices stop the
// kernel with a message (a device-side trap, as PyTorch's device asserts):
// the CUDA context is unusable afterwards.
#pragma once

#include <vector>

#include "core/attention_math.h"
#include "core/cuda/launch.h"
#include "core/optim_math.h"

namespace trainer::cuda {

template <int N>
struct Rows {
  Launch<N> outer;
  Launch<N> inner;
};

// ---- reduce.cu ----
// What a reduction accumulates per element: x, (x - center)^2, or
// y (x - center), with center[row] a contiguous acc_t<T> per row.
enum class RowMode : uint8_t { value, sq_dev, prod_dev };

struct ReduceArgs {
  ReduceOp op = ReduceOp::sum;  // sum, max or min (mean: sum with scale 1 / count)
  RowMode mode = RowMode::value;
  const void* center = nullptr;
  double scale = 1.0;  // the result is acc * scale (sum-like ops only)
  // > 1: the row is split in `splits` parts, block (row, part) writes its
  // partial (not scaled) at operand 0's outer offset * splits + part, in acc_t<T>.
  int64_t splits = 1;
};
// Operands (out, x, y); x and y of dtype t (y = x unless prod_dev), out of
// dtype out_t (any floating dtype; acc_t<T> when splits > 1).
void launch_reduce(const Rows<3>& r, DType t, DType out_t, const ReduceArgs& a,
                   cudaStream_t stream);
// The same for rows adjacent in memory (operands x and y step by one
// element from row to row): writes each part's partial into partial
// [a.splits, rows] (acc_t<T>, unscaled, row-major) for a second launch_reduce.
void launch_column_reduce(const Rows<3>& r, DType t, const ReduceArgs& a, void* partial,
                          cudaStream_t stream);
// Max along a row: operands (values (t), indices (i64), x (t)). The first
// maximum wins; NaN counts as the maximum (the first NaN), as RefBackend.
// Any dtype t.
void launch_max_dim(const Rows<3>& r, DType t, cudaStream_t stream);

// ---- nn.cu ----
// Operands (out, x): softmax (or log_softmax) of each row.
void launch_softmax(const Rows<2>& r, DType t, bool log, cudaStream_t stream);
// Operands (grad_x, grad, y).
void launch_softmax_backward(const Rows<3>& r, DType t, bool log, cudaStream_t stream);
// Rows of logp [N, C]: operands (loss [N] (t), logp (t), target (i64)).
void launch_cross_entropy(const Rows<3>& r, DType t, double eps, int64_t ignore_index,
                          int64_t classes, cudaStream_t stream);
// Elementwise over [N, C] (row-major index / C is the row): operands
// (grad_logits, logp, grad_loss (broadcast along C), target (i64, broadcast)).
void launch_cross_entropy_backward(const Launch<4>& g, DType t, double eps, int64_t ignore_index,
                                   int64_t classes, cudaStream_t stream);

// ---- index.cu ----
// Gather along one dim: operands (out, x with its dim's stride set to 0,
// index (dtype index_t, i32 or i64) broadcast to out's shape);
// out = x[offset + index * x_stride], index in [0, dim_size). Any dtype t.
void launch_gather(const Launch<3>& g, DType t, DType index_t, int64_t x_stride, int64_t dim_size,
                   cudaStream_t stream);
// Scatter-add along one dim with atomics: operands (src, dst with its dim's
// stride set to 0, index); dst[offset + index * dst_stride] += src.
// Floating dtypes, i32 and i64.
void launch_scatter_add(const Launch<3>& g, DType t, DType index_t, int64_t dst_stride,
                        int64_t dim_size, cudaStream_t stream);

// ---- norm.cu ----
// Layer norm over contiguous rows of x [R, D]; weight, bias [D]; mean, rstd
// [R] in acc_t<T>.
struct LayerNormPtrs {
  const void *x, *weight, *bias, *grad_out, *mean, *rstd;
  void *out, *grad_x, *mean_out, *rstd_out;
  void *partial_weight, *partial_bias;  // [splits, D] in acc_t<T>
};
void launch_layer_norm_forward(const LayerNormPtrs& p, int64_t R, int64_t D, double eps, DType t,
                               cudaStream_t stream);
// grad_x, and the per-part column sums of g xhat and g over `splits` parts of the rows.
void launch_layer_norm_backward(const LayerNormPtrs& p, int64_t R, int64_t D, int64_t splits,
                                DType t, cudaStream_t stream);
// RMS norm over contiguous rows of x [R, D]; weight [D]; rstd [R] in acc_t<T>.
struct RmsNormPtrs {
  const void *x, *weight, *grad_out, *rstd;
  void *out, *grad_x, *rstd_out;
  void* partial_weight;  // [splits, D] in acc_t<T>
};
void launch_rms_norm_forward(const RmsNormPtrs& p, int64_t R, int64_t D, double eps, DType t,
                             cudaStream_t stream);
// grad_x, and the per-part column sums of g xhat over `splits` parts of the rows.
void launch_rms_norm_backward(const RmsNormPtrs& p, int64_t R, int64_t D, int64_t splits, DType t,
                              cudaStream_t stream);
// Batch norm, elementwise with per-channel operands broadcast (acc_t<T>):
// operands (out, x, mean, var, gamma, beta); out = (x - mean) / sqrt(var +
// eps) * gamma + beta, then relu when relu.
void launch_batch_norm_apply(const Launch<6>& g, DType t, double eps, bool relu,
                             cudaStream_t stream);
// Operands (grad_x, grad_out, x, mean, invstd, gamma, sum_g, sum_g_xhat):
// math::batch_norm_grad_x over m values per channel.
void launch_batch_norm_backward(const Launch<8>& g, DType t, double m, cudaStream_t stream);

// ---- pool.cu ----
// An [N, C, H, W] operand with element strides (any layout).
struct Image {
  char* data = nullptr;
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t stride[4] = {};
};
struct PoolGeom {
  int64_t kh, kw, sh, sw, ph, pw;
  bool count_include_pad;
};
// argmax (i64, same shape as out) receives y * W + x of each window's maximum.
void launch_max_pool(const Image& out, const Image& x, const Image& argmax, const PoolGeom& p,
                     DType t, cudaStream_t stream);
// Each input element sums the gradients of the windows whose argmax it is.
void launch_max_pool_backward(const Image& grad_x, const Image& grad_out, const Image& argmax,
                              const PoolGeom& p, DType t, cudaStream_t stream);
void launch_avg_pool(const Image& out, const Image& x, const PoolGeom& p, DType t,
                     cudaStream_t stream);
void launch_avg_pool_backward(const Image& grad_x, const Image& grad_out, const PoolGeom& p,
                              DType t, cudaStream_t stream);
void launch_adaptive_avg_pool(const Image& out, const Image& x, DType t, cudaStream_t stream);
void launch_adaptive_avg_pool_backward(const Image& grad_x, const Image& grad_out, DType t,
                                       cudaStream_t stream);

// ---- rope.cu ----
// The rotary embedding of Backend::rope_forward/_backward (core/backend.h,
// section "rotary embedding"): element (b, t, c) of x at x + b sb + t st + c,
// out contiguous [B, T, NH HD]; positions i64 with stride pos_stride; sign 1
// turns by the angles, -1 back. Floating dtypes, HD / 2 <= kMaxRopePairs.
inline constexpr int64_t kMaxRopePairs = 256;
struct RopeArgs {
  const void* x = nullptr;
  void* out = nullptr;
  const int64_t* positions = nullptr;
  int64_t sb = 0, st = 0, pos_stride = 1;
  int64_t B = 0, T = 0, NH = 1, HD = 0;
  float sign = 1.0f;
  float inv_freq[kMaxRopePairs] = {};
};
void launch_rope(const RopeArgs& a, DType t, cudaStream_t stream);

// ---- attention.cu ----
// One [B, T, D] operand of causal attention in element strides: element
// (t, c) of head h of batch b is at data + b sb + t st + (h HD + c) sc.
struct AttentionOperand {
  char* data = nullptr;
  int64_t sb = 0, st = 0, sc = 0;
};
// The operands and attributes of Backend::attention_forward/_backward
// (core/backend.h, section "attention"): q, out, grad_out, grad_q of Tq
// rows, k, v, grad_k, grad_v of Tk rows, key s visible to query t iff
// k_offset + s <= q_offset + t. lse and delta are [B, NH, Tq] contiguous in
// acc_t<T>; delta is the backward's scratch for delta_t = grad_out_t . out_t
// per head. k, v and their gradients have KV heads (dividing NH): query head
// h reads kv head h / (NH / KV).
struct AttentionArgs {
  AttentionOperand q, k, v, out, grad_out, grad_q, grad_k, grad_v;
  void* lse = nullptr;
  void* delta = nullptr;
  int64_t B = 0, Tq = 0, Tk = 0, NH = 1, KV = 1, HD = 0;
  int64_t q_offset = 0, k_offset = 0;
  double scale = 1.0, dropout_p = 0.0;
  PhiloxKey dropout_key{};
  math::AttentionDropoutGrid dropout_grid{};
};
// Writes out and lse from q, k, v. Floating dtypes, HD <= kMaxAttentionHeadDim.
void launch_attention_forward(const AttentionArgs& a, DType t, cudaStream_t stream);
// Writes delta, then grad_q, grad_k, grad_v from grad_out, q, k, v, out and lse.
void launch_attention_backward(const AttentionArgs& a, DType t, cudaStream_t stream);
// Backend::attention_merge: out, block_out [B, Tq, NH HD] contiguous of dtype
// t, lse, block_lse [B, NH, Tq] contiguous in acc_t<T>.
struct AttentionMergeArgs {
  void* out = nullptr;
  const void* block_out = nullptr;
  void* lse = nullptr;
  const void* block_lse = nullptr;
  int64_t B = 0, Tq = 0, NH = 1, HD = 0;
};
void launch_attention_merge(const AttentionMergeArgs& a, DType t, cudaStream_t stream);
inline constexpr int64_t kMaxAttentionHeadDim = 256;

// ---- optim.cu ----
// Multi-tensor launches (apex's multi_tensor_apply): the host lists the
// tensors once, each with its pointers and scalars, and the chunks of
// kMultiTensorChunk elements they split into; one block updates one chunk
// (a grid-stride loop over chunks), so a single launch covers every tensor
// of an optimizer step. Tables (tensors, then chunks) live in device memory.
inline constexpr int64_t kMultiTensorChunk = int64_t(1) << 16;
// Block b handles elements [chunk * kMultiTensorChunk, ...) of tensor `tensor`.
struct ChunkRef {
  int32_t tensor;
  int32_t chunk;
};
// The chunks of tensors of these sizes, tensor by tensor (host side, cuda_optim.cpp).
std::vector<ChunkRef> plan_chunks(const std::vector<int64_t>& numels);
// param, grad and the momentum buffer (nullptr when momentum == 0) of dtype
// t (f32, f64); scalars from optim::sgd_scalars<double>, cast to t.
struct SgdTensor {
  void* param;
  const void* grad;
  void* momentum_buffer;
  int64_t numel;
  optim::SgdScalars<double> s;
};
void launch_sgd_step(const SgdTensor* tensors, const ChunkRef* chunks, int64_t num_chunks, DType t,
                     cudaStream_t stream);
// max_exp_avg_sq is nullptr without amsgrad.
struct AdamWTensor {
  void* param;
  const void* grad;
  void *exp_avg, *exp_avg_sq, *max_exp_avg_sq;
  int64_t numel;
  optim::AdamWScalars<double> s;
};
void launch_adamw_step(const AdamWTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                       DType t, cudaStream_t stream);
struct GradTensor {
  void* grad;
  int64_t numel;
};
// grad *= inv_scale (computed in acc_t<T>; any floating dtype t); *found_inf
// (i32) becomes 1 when an element was inf/nan.
void launch_unscale_grads(const GradTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                          DType t, double inv_scale, int32_t* found_inf, cudaStream_t stream);
// partial[b] (f64) = sum |g|^p over chunk b (max |g| for p = inf).
void launch_grad_power_sums(const GradTensor* tensors, const ChunkRef* chunks, int64_t num_chunks,
                            DType t, double p, double* partial, cudaStream_t stream);

}  // namespace trainer::cuda
