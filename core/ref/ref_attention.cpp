// Reference causal attention: per (batch, head, query row) loops in double,
// everything recomputed from q, k and v (the backward ignores the forward's
// lse and out, so a wrong statistic in a fast kernel cannot hide here).
// The dropout mask is redrawn element by element from its Philox counter.
// Grouped-query attention: query head h reads the columns of kv head
// h / (NH / KV) of k and v, and their gradients add up over the group.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {

// The operands of one (batch, head): element (t, c) of the head's columns.
struct HeadView {
  const Tensor& t;
  int64_t b, c0;
  double get(int64_t row, int64_t c) const {
    return ref::get(t, b * t.strides()[0] + row * t.strides()[1] + (c0 + c) * t.strides()[2]);
  }
  int64_t offset(int64_t row, int64_t c) const {
    return b * t.strides()[0] + row * t.strides()[1] + (c0 + c) * t.strides()[2];
  }
};

// The dropout multiplier m[b, h, t, s]: 1 / (1 - p) where kept, else 0.
double dropout_multiplier(const AttentionAttrs& a, int64_t row_index, int64_t s) {
  if (a.dropout_p == 0.0) return 1.0;
  double u = double(philox_uniform(a.dropout_key, uint64_t(row_index + s)));
  return u < 1.0 - a.dropout_p ? 1.0 / (1.0 - a.dropout_p) : 0.0;
}

// p[s] = softmax over s <= t of scale q_t . k_s; returns the row's lse.
double softmax_row(const HeadView& q, const HeadView& k, int64_t t, int64_t HD, double scale,
                   std::vector<double>& p) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s <= t; ++s) {
    double dot = 0.0;
    for (int64_t c = 0; c < HD; ++c) dot += q.get(t, c) * k.get(s, c);
    p[size_t(s)] = scale * dot;
    mx = std::max(mx, p[size_t(s)]);
  }
  double z = 0.0;
  for (int64_t s = 0; s <= t; ++s) z += std::exp(p[size_t(s)] - mx);
  for (int64_t s = 0; s <= t; ++s) p[size_t(s)] = std::exp(p[size_t(s)] - mx) / z;
  return mx + std::log(z);
}

}  // namespace

// out[b, t, head h] = sum_{s <= t} softmax_s(scale q_t . k_s) m[t, s] v_s
// (k, v of head h's kv head)
void RefBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttentionAttrs& attrs, const Tensor& out,
                                   const Tensor& lse) {
  int64_t B = q.size(0), T = q.size(1), D = q.size(2), NH = attrs.num_heads, HD = D / NH;
  int64_t group = NH / attrs.kv_heads();
  std::vector<double> p(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t c_kv = h / group * HD;
      HeadView qh{q, b, h * HD}, kh{k, b, c_kv}, vh{v, b, c_kv}, oh{out, b, h * HD};
      for (int64_t t = 0; t < T; ++t) {
        double row_lse = softmax_row(qh, kh, t, HD, attrs.scale, p);
        ref::set(lse, (b * NH + h) * T + t, row_lse);
        int64_t row_index = ((b * NH + h) * T + t) * T;
        for (int64_t c = 0; c < HD; ++c) {
          double acc = 0.0;
          for (int64_t s = 0; s <= t; ++s)
            acc += p[size_t(s)] * dropout_multiplier(attrs, row_index, s) * vh.get(s, c);
          ref::set(out, oh.offset(t, c), acc);
        }
      }
    }
}

namespace {

// Per-head accumulators [T, HD] of the backward and the rows of one query.
struct HeadGrads {
  std::vector<double> q, k, v, p, dp;
  HeadGrads(int64_t T, int64_t HD)
      : q(size_t(T * HD)), k(q.size()), v(q.size()), p(size_t(T)), dp(size_t(T)) {}
};

// Query head h (bh = b NH + h) of the backward: sets g.q to its grad_q and
// adds its terms of grad_k and grad_v (of its kv head kh, vh) to g.k, g.v.
void head_backward(const HeadView& qh, const HeadView& kh, const HeadView& vh, const HeadView& goh,
                   int64_t bh, int64_t T, int64_t HD, const AttentionAttrs& attrs, HeadGrads& g) {
  std::fill(g.q.begin(), g.q.end(), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    softmax_row(qh, kh, t, HD, attrs.scale, g.p);
    int64_t row_index = (bh * T + t) * T;
    double delta = 0.0;
    for (int64_t s = 0; s <= t; ++s) {
      double m = dropout_multiplier(attrs, row_index, s), dot = 0.0;
      for (int64_t c = 0; c < HD; ++c) {
        dot += goh.get(t, c) * vh.get(s, c);
        g.v[size_t(s * HD + c)] += g.p[size_t(s)] * m * goh.get(t, c);
      }
      g.dp[size_t(s)] = m * dot;
      delta += g.p[size_t(s)] * g.dp[size_t(s)];
    }
    for (int64_t s = 0; s <= t; ++s) {
      double ds = attrs.scale * g.p[size_t(s)] * (g.dp[size_t(s)] - delta);
      for (int64_t c = 0; c < HD; ++c) {
        g.q[size_t(t * HD + c)] += ds * kh.get(s, c);
        g.k[size_t(s * HD + c)] += ds * qh.get(t, c);
      }
    }
  }
}

// Writes an accumulator [T, HD] into the head of dst.
void write_head(const HeadView& dst, const std::vector<double>& acc, int64_t T, int64_t HD) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < HD; ++c) ref::set(dst.t, dst.offset(t, c), acc[size_t(t * HD + c)]);
}

}  // namespace

// Forward: out_t = sum_{s <= t} p[t, s] m[t, s] v_s, p = softmax(scale q k^T).
// With dp = m (grad_out_t . v_s) and delta_t = sum_s p dp:
// grad_v_s = sum_t p m grad_out_t, ds = p (dp - delta_t),
// grad_q_t = scale sum_s ds k_s, grad_k_s = scale sum_t ds q_t; a kv head's
// grad_k and grad_v sum over the query heads of its group.
void RefBackend::attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor&, const Tensor&,
                                    const AttentionAttrs& attrs, const Tensor& grad_q,
                                    const Tensor& grad_k, const Tensor& grad_v) {
  int64_t B = q.size(0), T = q.size(1), D = q.size(2), NH = attrs.num_heads, HD = D / NH;
  int64_t KV = attrs.kv_heads(), group = NH / KV;
  HeadGrads g(T, HD);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kvh = 0; kvh < KV; ++kvh) {
      std::fill(g.k.begin(), g.k.end(), 0.0);
      std::fill(g.v.begin(), g.v.end(), 0.0);
      HeadView kh{k, b, kvh * HD}, vh{v, b, kvh * HD};
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        head_backward(HeadView{q, b, h * HD}, kh, vh, HeadView{grad_out, b, h * HD}, b * NH + h, T,
                      HD, attrs, g);
        write_head(HeadView{grad_q, b, h * HD}, g.q, T, HD);
      }
      write_head(HeadView{grad_k, b, kvh * HD}, g.k, T, HD);
      write_head(HeadView{grad_v, b, kvh * HD}, g.v, T, HD);
    }
}

}  // namespace trainer
