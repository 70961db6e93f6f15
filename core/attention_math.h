// Per-element steps of the fused attention kernels, written once for host
// and device (docs/architecture.md "Devices"), as core/nn_math.h is for the row
// kernels: the CPU kernels (core/cpu/cpu_attention.cpp) and the CUDA ones
// (core/cuda/attention.cu) draw the same dropout mask and rescale their
// softmax statistics with the same formulas, so the CPU tests check what
// the GPU runs.
//
// Glossary (core/backend.h, section "attention"): B batch, Tq query rows,
// Tk key rows, NH heads, bh = b NH + h, t a query row, s a key column it
// sees (k_offset + s <= q_offset + t; one whole attention: s <= t).
//
//   OnlineSoftmax<float> st;                       // per query row
//   float corr = st.rescale(tile_max);             // before a new tile
//   out_acc = out_acc * corr + sum_s exp(score_s - st.m) v_s;  st.l += sum_s exp(...)
#pragma once

#include <stdint.h>

#include "core/elementwise_math.h"
#include "core/hd.h"
#include "core/rng.h"

namespace trainer::math {

// Where one call's [B, NH, Tq, Tk] block sits in the whole attention's
// [B, NHt, Tt, Tt] dropout draw (AttentionAttrs: NHt = total_heads or NH,
// Tt = seq_len or T, the head offset and the rows' global offsets).
struct AttentionDropoutGrid {
  int64_t total_heads, seq_len, head_offset, q_offset, k_offset;
};

// The Philox element of the dropout draw behind m[b, h, t, s] of a block:
// ((b NHt + h0 + h) Tt + q0 + t) Tt + k0 + s. Consecutive s are consecutive
// elements. One whole attention: ((b NH + h) T + t) T + s.
TRAINER_HD uint64_t attention_dropout_index(const AttentionDropoutGrid& g, int64_t b, int64_t h,
                                            int64_t t, int64_t s) {
  return uint64_t(((b * g.total_heads + g.head_offset + h) * g.seq_len + g.q_offset + t) *
                      g.seq_len +
                  g.k_offset + s);
}

// The last key column query row t may see, k_offset + s <= q_offset + t,
// plus one, clamped to [0, Tk]: the row's keys are the prefix [0, n).
TRAINER_HD int64_t attention_visible_keys(int64_t t, int64_t q_offset, int64_t k_offset,
                                          int64_t Tk) {
  const int64_t n = q_offset + t - k_offset + 1;
  return n < 0 ? 0 : n > Tk ? Tk : n;
}

// Whether a uniform draw of `bits` keeps its element: u < keep in double,
// u the top 24 bits as in philox_uniform (RefBackend compares the same way).
TRAINER_HD bool dropout_keeps(uint32_t bits, double keep) {
  return double(uint_to_unit(bits)) < keep;
}

// The dropout multiplier of element `index` of the draw from key: scale
// (= 1 / keep) where kept, 0 where dropped.
template <class A>
TRAINER_HD A attention_dropout(PhiloxKey key, uint64_t index, double keep, A scale) {
  Philox4x32 r = philox_block(key, index / 4);
  return dropout_keeps(r.v[index % 4], keep) ? scale : A(0);
}

// The softmax statistics of one row seen tile by tile ("online softmax",
// Milakov and Gimelshein 2018): m the running maximum, l the sum of
// exp(score - m) so far; the row's lse is m + log(l) once every tile is in.
template <class A>
struct OnlineSoftmax {
  A m;  // -inf before the first tile
  A l;
  // Moves m to max(m, tile_max) and rescales l to it; returns the factor
  // exp(m_old - m_new) by which anything accumulated against m_old (the
  // output row) must be multiplied. A tile whose scores are all masked
  // (tile_max = -inf) changes nothing.
  TRAINER_HD A rescale(A tile_max) {
    A m_new = tile_max > m ? tile_max : m;
    if (m_new == m) return A(1);
    A corr = m_exp(m - m_new);  // 0 on the first tile: m = -inf
    l *= corr;
    m = m_new;
    return corr;
  }
};

// The gradient of one score (before the scale): with p the probability,
// dp = m (grad_out_t . v_s) and delta_t = grad_out_t . out_t,
// ds = p (dp - delta_t).
template <class A>
TRAINER_HD A attention_grad_score(A p, A dp, A delta) {
  return p * (dp - delta);
}

}  // namespace trainer::math
