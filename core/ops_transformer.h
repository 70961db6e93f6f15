// Transformer ops: layer norm, RMS norm, the rotary position embedding and
// causal scaled dot-product attention (grouped-query too), each a fused
// kernel in the backend interface (sections "layer norm", "RMS norm",
// "rotary embedding" and "attention"), and the attention blocks context
// parallelism runs (ring attention).
//
//   Tensor y = layer_norm(x, weight, bias);                        // [..., D]
//   Tensor y = rms_norm(x, weight, 1e-6);                          // [..., D]
//   Tensor r = rotary_embedding(q, /*num_heads=*/6, positions, {.theta = 500000.0});
//   Tensor a = causal_attention(q, k, v, /*num_heads=*/6, 0.1, training, gen);
//   Tensor a = causal_attention(q, k, v, 6, 0.0, training, gen, /*num_kv_heads=*/2);
//   Tensor a = causal_attention_qkv(qkv, /*num_heads=*/6, 0.1, training, gen);  // qkv [B, T, 3D]
//
// Glossary: B batch, T time, D model width, NH heads, HD = D / NH head width,
// KV key/value heads (grouped-query attention); Tq, Tk the query and key
// rows of an attention block.
#pragma once

#include <string>
#include <vector>

#include "core/ops.h"

namespace trainer {

// Normalises x [..., D] over its last dim: (x - mean) / sqrt(var + eps)
// * weight + bias, var biased (torch.nn.functional.layer_norm); weight and
// bias [D]. Any layout (x is made contiguous).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);

// Normalises x [..., D] by the root mean square of its last dim and scales
// it: x / sqrt(mean(x^2) + eps) * weight, weight [D] (Hugging Face's
// LlamaRMSNorm). Computed in f32 (f64 for f64 input); under autocast in f32,
// as layer_norm. Any layout (x is made contiguous).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-6);

// The rotary position embedding's frequencies (Hugging Face's rope_type and
// rope_scaling fields).
struct RopeOptions {
  double theta = 10000.0;                // rope_theta
  std::string scaling = "none";          // none | linear | llama3 (HF rope_scaling.rope_type)
  double factor = 1.0;                   // linear and llama3
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  int64_t original_max_position = 8192;  // llama3: original_max_position_embeddings
};

// The frequency of each of a head's HD / 2 pairs, in f32 and rounded step
// by step as transformers computes it: 1 / theta^(2j / HD) (its
// _compute_default_rope_parameters), divided by factor ("linear"), or
// divided by factor below the low-frequency wavelength, kept above the
// high-frequency one and interpolated between ("llama3",
// _compute_llama3_parameters). HD even.
std::vector<float> rope_inv_freq(int64_t head_dim, const RopeOptions& options);

// Rotary position embedding, Hugging Face Llama's convention (rotate_half):
// x [B, T, NH * HD] (heads side by side, any strides with a unit last
// stride, e.g. a view of a fused projection), positions i64 [T] (the global
// position of each row; need not be contiguous or increasing, context
// parallelism passes chunks). Within each head, element i < HD / 2 pairs
// with i + HD / 2 and turns by a = f32(positions[t] * inv_freq[i])
// (rope_inv_freq, the product rounded to f32 as Hugging Face's):
//   out[i] = x[i] cos a - x[i + HD/2] sin a,  out[i + HD/2] = x[i + HD/2] cos a + x[i] sin a.
// Returns a new contiguous [B, T, NH * HD] in x's dtype, computed in f32
// (f64 for f64); autocast leaves it alone. The backward turns the gradient
// back; positions get none. HD must be even.
Tensor rotary_embedding(const Tensor& x, int64_t num_heads, const Tensor& positions,
                        const RopeOptions& options);

// Multi-head causal self-attention on q, k, v [B, T, D] (any strides, e.g.
// views into one fused QKV projection), head h being the columns
// [h * HD, (h + 1) * HD): out[b, t, head h] = sum_{s <= t} a[b, h, t, s] v[b, s, head h]
// with a = dropout(softmax_s(q k^T / sqrt(HD))). Returns [B, T, D], heads
// side by side. Fused: no [B, NH, T, T] tensor is ever stored; the backward
// recomputes the probabilities from q, k and the per-row logsumexp. The
// dropout mask (training, 0 <= dropout_p < 1) is element
// ((b NH + h) T + t) T + s of one bernoulli(1 - dropout_p) draw from gen,
// redrawn in the backward from its counter.
// Grouped-query attention: with num_kv_heads = KV > 0 (dividing NH), k and
// v are [B, T, KV * HD] and query head h reads key/value head h / (NH / KV)
// (Hugging Face's repeat_kv); their gradients sum over the query heads of
// each group. 0: KV = NH.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads,
                        double dropout_p, bool training, Generator& gen, int64_t num_kv_heads = 0);

// causal_attention on the thirds of one fused projection qkv [B, T, 3D]
// (q, k, v side by side), the backward writing one [B, T, 3D] gradient.
// Same result and the same dropout mask as causal_attention on the views.
Tensor causal_attention_qkv(const Tensor& qkv, int64_t num_heads, double dropout_p, bool training,
                            Generator& gen);

// ---- attention blocks (context parallelism: ring attention) ----
// A causal attention split over the sequence runs as blocks: q's rows
// against one block of key/value rows at a time, each at its global offset
// (AttentionAttrs::q_offset, k_offset; key s is visible to query t iff
// k_offset + s <= q_offset + t), the partial results folded together by
// their log-sum-exp. No autograd and no autocast: the caller runs the
// backward itself and passes the dtype it computes in.
//
//   AttentionAttrs attrs = attention_block_attrs(B, D, NH, KV, p, training, gen, T);
//   attrs.q_offset = q_start;
//   AttentionBlockResult acc;
//   for (each key block kb at or before q's rows) {
//     attrs.k_offset = kb.start;
//     AttentionBlockResult r = attention_block_forward(q, kb.k, kb.v, attrs);
//     if (!acc.out.defined()) acc = r; else attention_merge(acc.out, acc.lse, r.out, r.lse);
//   }
//   // backward, per key block, with the merged out and lse:
//   TensorList g = attention_block_backward(grad_out, q, kb.k, kb.v, acc.out, acc.lse, attrs);
//   // grad_q: the sum of g[0] over key blocks; g[1], g[2] kb's grad_k, grad_v.

// out [B, Tq, D] in q's dtype, lse [B, NH, Tq] in f32 (f64 for f64).
struct AttentionBlockResult {
  Tensor out, lse;
};

// Causal attention of q [B, Tq, D] against k, v [B, Tk, KV HD] at the
// offsets of attrs (Backend::attention_forward): a row that sees no key
// gets out 0 and lse -inf. Any strides; with a unit last stride (narrows of
// a fused projection or of the sequence) the CPU runs its fast kernels.
// With dropout the mask elements are those of the whole attention's draw
// (attrs.seq_len, head_offset, total_heads).
AttentionBlockResult attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionAttrs& attrs);

// The gradients of one block: new tensors grad_q [B, Tq, D] and grad_k,
// grad_v [B, Tk, KV HD]. With out and lse the merged ones of q's rows over
// every key block, grad_q is this block's share of q's gradient (the
// shares add up to it) and grad_k, grad_v are the key block's exact
// gradients from q's rows. Rows with lse -inf get none.
TensorList attention_block_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    const AttentionAttrs& attrs);

// Folds a block's result into a running one in place (Backend::attention_merge):
// lse = logaddexp(lse, block_lse), out = out exp(lse_old - lse) + block_out
// exp(block_lse - lse) per (b, head, row). out, block_out [B, Tq, D]
// contiguous of one floating dtype, lse, block_lse [B, NH, Tq] contiguous in
// f32 (f64 for f64). A side with lse -inf adds nothing.
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                     const Tensor& block_lse);

// The attrs causal_attention uses for q [batch, seq_len, width] with
// num_heads heads (scale 1 / sqrt(HD), num_kv_heads resolved: NH for 0),
// the dropout key drawn from gen for the whole batch x total_heads x
// seq_len x seq_len draw when training and dropout_p > 0: the same draw as
// causal_attention's on the whole sequence with total_heads heads (0:
// num_heads), so the same gen state gives the same mask. The caller then
// sets the offsets (and head_offset) of its blocks.
AttentionAttrs attention_block_attrs(int64_t batch, int64_t width, int64_t num_heads,
                                     int64_t num_kv_heads, double dropout_p, bool training,
                                     Generator& gen, int64_t seq_len, int64_t total_heads = 0);

}  // namespace trainer
