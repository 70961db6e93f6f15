// Transformer ops: layer norm (a fused kernel in the backend interface,
// section "layer norm") and causal scaled dot-product attention (composed of
// differentiable ops from core/ops.h, one head at a time).
//
//   Tensor y = layer_norm(x, weight, bias);                        // [..., D]
//   Tensor a = causal_attention(q, k, v, /*num_heads=*/6, 0.1, training, gen);
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
// side by side. Heads run one after another, so the scores of one head
// ([B, T, T]) are live at a time beyond what the backward keeps.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, int64_t num_heads,
                        double dropout_p, bool training, Generator& gen);

}  // namespace trainer
