// Reference causal attention: per (batch, head, query row) loops in double,
// everything recomputed from q, k and v (the backward ignores the forward's
// lse and out, so a wrong statistic in a fast kernel cannot hide here).
// The dropout mask is redrawn element by element from its Philox counter.
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
void RefBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttentionAttrs& attrs, const Tensor& out,
                                   const Tensor& lse) {
  int64_t B = q.size(0), T = q.size(1), D = q.size(2), NH = attrs.num_heads, HD = D / NH;
  std::vector<double> p(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      HeadView qh{q, b, h * HD}, kh{k, b, h * HD}, vh{v, b, h * HD}, oh{out, b, h * HD};
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

// Forward: out_t = sum_{s <= t} p[t, s] m[t, s] v_s, p = softmax(scale q k^T).
// With dp = m (grad_out_t . v_s) and delta_t = sum_s p dp:
// grad_v_s = sum_t p m grad_out_t, ds = p (dp - delta_t),
// grad_q_t = scale sum_s ds k_s, grad_k_s = scale sum_t ds q_t.
void RefBackend::attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor&, const Tensor&,
                                    const AttentionAttrs& attrs, const Tensor& grad_q,
                                    const Tensor& grad_k, const Tensor& grad_v) {
  int64_t B = q.size(0), T = q.size(1), D = q.size(2), NH = attrs.num_heads, HD = D / NH;
  std::vector<double> p(static_cast<size_t>(T)), dp(static_cast<size_t>(T));
  // Per-head gradient accumulators [T, HD], written out once per head.
  std::vector<double> gq(size_t(T * HD)), gk(size_t(T * HD)), gv(size_t(T * HD));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      HeadView qh{q, b, h * HD}, kh{k, b, h * HD}, vh{v, b, h * HD}, goh{grad_out, b, h * HD};
      std::fill(gq.begin(), gq.end(), 0.0);
      std::fill(gk.begin(), gk.end(), 0.0);
      std::fill(gv.begin(), gv.end(), 0.0);
      for (int64_t t = 0; t < T; ++t) {
        softmax_row(qh, kh, t, HD, attrs.scale, p);
        int64_t row_index = ((b * NH + h) * T + t) * T;
        double delta = 0.0;
        for (int64_t s = 0; s <= t; ++s) {
          double m = dropout_multiplier(attrs, row_index, s), dot = 0.0;
          for (int64_t c = 0; c < HD; ++c) {
            dot += goh.get(t, c) * vh.get(s, c);
            gv[size_t(s * HD + c)] += p[size_t(s)] * m * goh.get(t, c);
          }
          dp[size_t(s)] = m * dot;
          delta += p[size_t(s)] * dp[size_t(s)];
        }
        for (int64_t s = 0; s <= t; ++s) {
          double ds = attrs.scale * p[size_t(s)] * (dp[size_t(s)] - delta);
          for (int64_t c = 0; c < HD; ++c) {
            gq[size_t(t * HD + c)] += ds * kh.get(s, c);
            gk[size_t(s * HD + c)] += ds * qh.get(t, c);
          }
        }
      }
      HeadView gqh{grad_q, b, h * HD}, gkh{grad_k, b, h * HD}, gvh{grad_v, b, h * HD};
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < HD; ++c) {
          ref::set(grad_q, gqh.offset(t, c), gq[size_t(t * HD + c)]);
          ref::set(grad_k, gkh.offset(t, c), gk[size_t(t * HD + c)]);
          ref::set(grad_v, gvh.offset(t, c), gv[size_t(t * HD + c)]);
        }
    }
}

}  // namespace trainer
