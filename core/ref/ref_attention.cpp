// Reference causal attention: per (batch, head, query row) loops in double.
// The forward computes each row's softmax over the keys it sees from q and
// k; the backward takes p from the lse it is given and delta from out (which
// may be the merged ones of a split attention, core/backend.h). The dropout
// mask is redrawn element by element from its Philox counter. Grouped-query
// attention: query head h reads the columns of kv head h / (NH / KV) of k
// and v, and their gradients add up over the group. attention_merge folds a
// block's out and lse into running ones.
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
double dropout_multiplier(const AttentionAttrs& a, uint64_t element) {
  if (a.dropout_p == 0.0) return 1.0;
  double u = double(philox_uniform(a.dropout_key, element));
  return u < 1.0 - a.dropout_p ? 1.0 / (1.0 - a.dropout_p) : 0.0;
}

// s[j] = scale q_t . k_j for the row's visible keys j < n.
void scores_row(const HeadView& q, const HeadView& k, int64_t t, int64_t n, int64_t HD,
                double scale, std::vector<double>& s) {
  for (int64_t j = 0; j < n; ++j) {
    double dot = 0.0;
    for (int64_t c = 0; c < HD; ++c) dot += q.get(t, c) * k.get(j, c);
    s[size_t(j)] = scale * dot;
  }
}

// p[s] = softmax over the visible s < n (n >= 1) of scale q_t . k_s;
// returns the row's lse.
double softmax_row(const HeadView& q, const HeadView& k, int64_t t, int64_t n, int64_t HD,
                   double scale, std::vector<double>& p) {
  scores_row(q, k, t, n, HD, scale, p);
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t s = 0; s < n; ++s) mx = std::max(mx, p[size_t(s)]);
  double z = 0.0;
  for (int64_t s = 0; s < n; ++s) z += std::exp(p[size_t(s)] - mx);
  for (int64_t s = 0; s < n; ++s) p[size_t(s)] = std::exp(p[size_t(s)] - mx) / z;
  return mx + std::log(z);
}

}  // namespace

// out[b, t, head h] = sum_s softmax_s(scale q_t . k_s) m[t, s] v_s over the
// keys t sees (k, v of head h's kv head); out 0 and lse -inf where it sees none.
void RefBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttentionAttrs& attrs, const Tensor& out,
                                   const Tensor& lse) {
  const int64_t B = q.size(0), Tq = q.size(1), Tk = k.size(1), D = q.size(2);
  const int64_t NH = attrs.num_heads, HD = D / NH, group = NH / attrs.kv_heads();
  const math::AttentionDropoutGrid grid = attrs.dropout_grid(Tq);
  std::vector<double> p(static_cast<size_t>(Tk));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t c_kv = h / group * HD;
      HeadView qh{q, b, h * HD}, kh{k, b, c_kv}, vh{v, b, c_kv}, oh{out, b, h * HD};
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t n = math::attention_visible_keys(t, attrs.q_offset, attrs.k_offset, Tk);
        const double row_lse = n > 0 ? softmax_row(qh, kh, t, n, HD, attrs.scale, p)
                                     : -std::numeric_limits<double>::infinity();
        ref::set(lse, (b * NH + h) * Tq + t, row_lse);
        for (int64_t c = 0; c < HD; ++c) {
          double acc = 0.0;
          for (int64_t s = 0; s < n; ++s)
            acc += p[size_t(s)] *
                   dropout_multiplier(attrs, math::attention_dropout_index(grid, b, h, t, s)) *
                   vh.get(s, c);
          ref::set(out, oh.offset(t, c), acc);
        }
      }
    }
}

namespace {

// Per-head accumulators of the backward: grad_q [Tq, HD], grad_k and grad_v
// [Tk, HD], and the rows of one query.
struct HeadGrads {
  std::vector<double> q, k, v, p, dp;
  HeadGrads(int64_t Tq, int64_t Tk, int64_t HD)
      : q(size_t(Tq * HD)), k(size_t(Tk * HD)), v(k.size()), p(size_t(Tk)), dp(size_t(Tk)) {}
};

// Query head h of batch b: sets g.q to its grad_q and adds its terms of
// grad_k and grad_v (of its kv head kh, vh) to g.k, g.v. p from the given
// lse, delta from the given out.
void head_backward(const HeadView& qh, const HeadView& kh, const HeadView& vh, const HeadView& goh,
                   const HeadView& oh, const Tensor& lse, int64_t b, int64_t h, int64_t Tk,
                   int64_t HD, const AttentionAttrs& attrs, HeadGrads& g) {
  const int64_t Tq = qh.t.size(1);
  const math::AttentionDropoutGrid grid = attrs.dropout_grid(Tq);
  std::fill(g.q.begin(), g.q.end(), 0.0);
  for (int64_t t = 0; t < Tq; ++t) {
    const int64_t n = math::attention_visible_keys(t, attrs.q_offset, attrs.k_offset, Tk);
    const double row_lse = ref::get(lse, (b * attrs.num_heads + h) * Tq + t);
    if (n == 0 || std::isinf(row_lse)) continue;  // no visible key: no gradient
    scores_row(qh, kh, t, n, HD, attrs.scale, g.p);
    double delta = 0.0;
    for (int64_t c = 0; c < HD; ++c) delta += goh.get(t, c) * oh.get(t, c);
    for (int64_t s = 0; s < n; ++s) {
      g.p[size_t(s)] = std::exp(g.p[size_t(s)] - row_lse);
      double m = dropout_multiplier(attrs, math::attention_dropout_index(grid, b, h, t, s));
      double dot = 0.0;
      for (int64_t c = 0; c < HD; ++c) {
        dot += goh.get(t, c) * vh.get(s, c);
        g.v[size_t(s * HD + c)] += g.p[size_t(s)] * m * goh.get(t, c);
      }
      g.dp[size_t(s)] = m * dot;
    }
    for (int64_t s = 0; s < n; ++s) {
      double ds = attrs.scale * g.p[size_t(s)] * (g.dp[size_t(s)] - delta);
      for (int64_t c = 0; c < HD; ++c) {
        g.q[size_t(t * HD + c)] += ds * kh.get(s, c);
        g.k[size_t(s * HD + c)] += ds * qh.get(t, c);
      }
    }
  }
}

// Writes an accumulator [rows, HD] into the head of dst.
void write_head(const HeadView& dst, const std::vector<double>& acc, int64_t rows, int64_t HD) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < HD; ++c) ref::set(dst.t, dst.offset(t, c), acc[size_t(t * HD + c)]);
}

}  // namespace

// Forward: out_t = sum_s p[t, s] m[t, s] v_s over the visible s,
// p = exp(scale q_t . k_s - lse_t). With dp = m (grad_out_t . v_s) and
// delta_t = grad_out_t . out_t: grad_v_s = sum_t p m grad_out_t,
// ds = p (dp - delta_t), grad_q_t = scale sum_s ds k_s,
// grad_k_s = scale sum_t ds q_t; a kv head's grad_k and grad_v sum over the
// query heads of its group.
void RefBackend::attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    const AttentionAttrs& attrs, const Tensor& grad_q,
                                    const Tensor& grad_k, const Tensor& grad_v) {
  const int64_t B = q.size(0), Tq = q.size(1), Tk = k.size(1), D = q.size(2);
  const int64_t NH = attrs.num_heads, HD = D / NH, KV = attrs.kv_heads(), group = NH / KV;
  HeadGrads g(Tq, Tk, HD);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kvh = 0; kvh < KV; ++kvh) {
      std::fill(g.k.begin(), g.k.end(), 0.0);
      std::fill(g.v.begin(), g.v.end(), 0.0);
      HeadView kh{k, b, kvh * HD}, vh{v, b, kvh * HD};
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        head_backward(HeadView{q, b, h * HD}, kh, vh, HeadView{grad_out, b, h * HD},
                      HeadView{out, b, h * HD}, lse, b, h, Tk, HD, attrs, g);
        write_head(HeadView{grad_q, b, h * HD}, g.q, Tq, HD);
      }
      write_head(HeadView{grad_k, b, kvh * HD}, g.k, Tk, HD);
      write_head(HeadView{grad_v, b, kvh * HD}, g.v, Tk, HD);
    }
}

// lse' = logaddexp(lse, block_lse), out' = out exp(lse - lse') + block_out
// exp(block_lse - lse') per (b, h, t); a side with lse -inf adds nothing.
void RefBackend::attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                                 const Tensor& block_lse) {
  const int64_t B = out.size(0), Tq = out.size(1), D = out.size(2), NH = lse.size(1);
  const int64_t HD = D / NH;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t row = (b * NH + h) * Tq + t;
        const double l = ref::get(lse, row), bl = ref::get(block_lse, row);
        if (std::isinf(bl) && bl < 0) continue;  // the block adds nothing
        const double mx = std::max(l, bl);
        const double merged = mx + std::log(std::exp(l - mx) + std::exp(bl - mx));
        const double w = std::exp(l - merged), bw = std::exp(bl - merged);
        for (int64_t c = 0; c < HD; ++c) {
          const int64_t i = (b * Tq + t) * D + h * HD + c;
          const double kept = w > 0.0 ? ref::get(out, i) * w : 0.0;  // lse -inf: out unused
          ref::set(out, i, kept + ref::get(block_out, i) * bw);
        }
        ref::set(lse, row, merged);
      }
}

}  // namespace trainer
