// Transformer ops: layer norm and causal scaled dot-product attention, each
// a fused kernel in the backend interface (sections "layer norm" and
// "attention").
//
//   Tensor y = layer_norm(x, weight, bias);                        // [..., D]
//   Tensor a = causal_attention(q, k, v, /*num_heads=*/6, 0.1, training, gen);
//   Tensor a = causal_attention_qkv(qkv, /*num_heads=*/6, 0.1, training, gen);  // qkv [B, T, 3D]
//
// Glossary: B batch, T time, D model width, NH heads, HD = D / NH head width.
#pragma once

#include "core/ops.h"

namespace trainer {

// Normalises x [..., D] over its last dim: (x - mean) / sqrt(var + eps)
// * weight + bias, var biased (torch.nn.functional.layer_norm); weight and
// bias [D]. Any layout (x is made contiguous).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);

// Multi-head causal self-attention on q, k, v [B, T, D] (any strides, e.g.
// views into one fused QKV projection), head h being the columns
// [h * HD, (h + 1) * HD): out[b, t, head h] = sum_{s <= t} a[b, h, t, s] v[b, s, head h]
// with a = dropout(softmax_s(q k^T / sqrt(HD))). Returns [B, T, D], heads
// side by side. Fused: no [B, NH, T, T] tensor is ever stored; the backward
// recomputes the probabilities from q, k and the per-row logsumexp. The
// dropout mask (training, 0 <= dropout_p < 1) is element
// ((b NH + h) T + t) T + s of one bernoulli(1 - dropout_p) draw from gen,
// redrawn in the backward from its counter.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads,
                        double dropout_p, bool training, Generator& gen);

// causal_attention on the thirds of one fused projection qkv [B, T, 3D]
// (q, k, v side by side), the backward writing one [B, T, 3D] gradient.
// Same result and the same dropout mask as causal_attention on the views.
Tensor causal_attention_qkv(const Tensor& qkv, int64_t num_heads, double dropout_p, bool training,
                            Generator& gen);

}  // namespace trainer
