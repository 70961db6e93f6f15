// CPU fused causal attention (f32), flash-attention style: OpenMP over
// (batch, head); within one, query rows go in tiles of kTileRows, each tile
// against the keys its last row sees (a prefix [0, n) of k: [0, t0 + rows)
// for one whole attention, all of k for a block wholly before q, none for
// one wholly after). A tile's scores live in a per-thread [kTileRows, Tk]
// scratch, so the live memory is threads x tiles, never B x NH x Tq x Tk.
// The products are oneDNN sgemm calls on the strided head views
// (single-threaded inside the parallel region); softmax, the causal mask
// and dropout are vectorised row loops. The backward recomputes
// each tile's probabilities from q, k and the saved lse.
//
// Grouped-query attention: a query head reads its kv head's views of k and
// v; the backward runs OpenMP over (batch, kv head), the query heads of a
// group one after the other on one thread, adding into the kv head's
// gradients (so no two threads write one row, and the sums run in a fixed
// order). With KV = NH that is the plain loop over (batch, head).
//
// Other dtypes, and views whose last stride is not 1, run the reference.
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/attention_math.h"
#include "core/check.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/lowp.h"
#include "core/cpu/vec_math.h"

namespace trainer {

namespace {

// Query rows per tile: small enough that the causal waste inside a tile
// (about kTileRows^2 / 2 scores) stays a small share at T = 256, large
// enough for the sgemm calls to run near peak.
constexpr int64_t kTileRows = 32;

// C [M, N] = alpha op(A) op(B) + beta C, row-major, op = transpose when 'T'.
void sgemm(char ta, char tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  dnnl_status_t st = dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  CHECK(st == dnnl_success) << "dnnl_sgemm(" << M << ", " << N << ", " << K << ") failed with "
                            << int(st);
}

// One head of a [B, T, D] view: row t starts at ptr + t * ld.
struct Head {
  float* ptr;
  int64_t ld;
  Head(const Tensor& x, int64_t b, int64_t c0)
      : ptr(x.data<float>() + b * x.strides()[0] + c0), ld(x.strides()[1]) {}
  float* row(int64_t t) const { return ptr + t * ld; }
};

bool fast_layout(const Tensor& x) {
  return x.dtype() == DType::f32 && x.strides()[2] == 1 && x.strides()[1] >= x.size(2);
}

// m[s] = dropout multiplier (1 / (1 - p) kept, 0 dropped) of Philox
// elements first + s, s in [0, n), as RefBackend and the CUDA kernels draw
// them (core/attention_math.h).
void dropout_row(PhiloxKey key, uint64_t first, int64_t n, double keep, float scale, float* m) {
  for (int64_t s = 0; s < n;) {
    uint64_t i = first + uint64_t(s);
    Philox4x32 r = philox_block(key, i / 4);
    for (uint32_t lane = uint32_t(i % 4); lane < 4 && s < n; ++lane, ++s)
      m[s] = math::dropout_keeps(r.v[lane], keep) ? scale : 0.0f;
  }
}

// row[s] = exp(row[s] - lse) for s < len, 0 for s in [len, n).
void probabilities(float* row, int64_t len, int64_t n, float lse) {
#pragma omp simd
  for (int64_t s = 0; s < len; ++s) row[s] = cpu::exp_f32(row[s] - lse);
  std::fill(row + len, row + n, 0.0f);
}

// row = softmax over [0, len) (0 beyond, up to n); returns the lse (-inf
// for len 0: no key seen).
float softmax_causal(float* row, int64_t len, int64_t n) {
  if (len == 0) {
    std::fill(row, row + n, 0.0f);
    return -std::numeric_limits<float>::infinity();
  }
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t s = 0; s < len; ++s) mx = std::max(mx, row[s]);
  float z = 0.0f;
#pragma omp simd reduction(+ : z)
  for (int64_t s = 0; s < len; ++s) {
    float e = cpu::exp_f32(row[s] - mx);
    row[s] = e;
    z += e;
  }
  float inv_z = 1.0f / z;
#pragma omp simd
  for (int64_t s = 0; s < len; ++s) row[s] *= inv_z;
  std::fill(row + len, row + n, 0.0f);
  return mx + std::log(z);
}

// Per-thread scratch: `planes` tiles of [kTileRows, Tk] floats per thread,
// allocated through the tensor allocator (so its statistics see it).
struct Scratch {
  Tensor buf;
  int64_t per_thread;
  Scratch(int planes, int64_t Tk)
      : buf(empty({int64_t(omp_get_max_threads()), planes, kTileRows, Tk})),
        per_thread(planes * kTileRows * Tk) {}
  float* plane(int p) const {
    return buf.data<float>() + omp_get_thread_num() * per_thread + p * kTileRows * buf.size(3);
  }
};

}  // namespace

void CpuBackend::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttentionAttrs& attrs, const Tensor& out,
                                   const Tensor& lse) {
  if (cpu::any_half({&q, &k, &v, &out}))  // bf16/f16: the f32 kernel on copies (core/cpu/lowp.h)
    return cpu::run_in_f32({q, k, v}, {out}, [&](const TensorList& i, const TensorList& o) {
      attention_forward(i[0], i[1], i[2], attrs, o[0], lse);
    });
  if (!fast_layout(q) || !fast_layout(k) || !fast_layout(v) || !out.is_contiguous() ||
      out.dtype() != DType::f32 || lse.dtype() != DType::f32)
    return RefBackend::attention_forward(q, k, v, attrs, out, lse);
  const int64_t B = q.size(0), Tq = q.size(1), Tk = k.size(1), D = q.size(2);
  const int64_t NH = attrs.num_heads, HD = D / NH, group = NH / attrs.kv_heads();
  if (B * Tq * D == 0) return;
  const int64_t q0 = attrs.q_offset, k0 = attrs.k_offset;
  const float scale = float(attrs.scale);
  const bool drop = attrs.dropout_p > 0.0;
  const double keep = 1.0 - attrs.dropout_p;
  const float drop_scale = drop ? float(1.0 / keep) : 1.0f;
  const math::AttentionDropoutGrid grid = attrs.dropout_grid(Tq);
  Scratch scratch(drop ? 2 : 1, Tk);
  float* lse_all = lse.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * NH; ++bh) {
    const int64_t b = bh / NH, h = bh % NH, c_kv = h / group * HD;
    Head qh(q, b, h * HD), kh(k, b, c_kv), vh(v, b, c_kv), oh(out, b, h * HD);
    float* S = scratch.plane(0);
    float* M = drop ? scratch.plane(1) : nullptr;
    for (int64_t t0 = 0; t0 < Tq; t0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, Tq - t0);
      const int64_t n = math::attention_visible_keys(t0 + rows - 1, q0, k0, Tk);
      if (n == 0) {  // the tile sees no key: out 0, lse -inf
        for (int64_t t = t0; t < t0 + rows; ++t) {
          std::fill(oh.row(t), oh.row(t) + HD, 0.0f);
          lse_all[bh * Tq + t] = -std::numeric_limits<float>::infinity();
        }
        continue;
      }
      // S = scale Q_tile K^T over the keys the tile may see.
      sgemm('N', 'T', rows, n, HD, scale, qh.row(t0), qh.ld, kh.ptr, kh.ld, 0.0f, S, n);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = t0 + i, len = math::attention_visible_keys(t, q0, k0, Tk);
        float* row = S + i * n;
        lse_all[bh * Tq + t] = softmax_causal(row, len, n);
        if (!drop) continue;
        dropout_row(attrs.dropout_key, math::attention_dropout_index(grid, b, h, t, 0), len, keep,
                    drop_scale, M);
#pragma omp simd
        for (int64_t s = 0; s < len; ++s) row[s] *= M[s];
      }
      // O_tile = P_drop V.
      sgemm('N', 'N', rows, HD, n, 1.0f, S, n, vh.ptr, vh.ld, 0.0f, oh.row(t0), oh.ld);
    }
  }
}

namespace {

// The backward's operands of one call.
struct BackwardArgs {
  const Tensor &grad_out, &q, &k, &v, &out, &grad_q;
  const AttentionAttrs& attrs;
  const float* lse_all;
  int64_t Tq, Tk, HD;
  math::AttentionDropoutGrid grid;
};

// Query head h of batch b (bh = b NH + h): writes its grad_q and adds its
// terms of grad_v and grad_k into kv head c_kv's rows (gkh, gvh).
// Per tile, with P = exp(scale Q K^T - lse) recomputed:
// dP_drop = dO V^T, dP = m dP_drop, delta_t = dO_t . O_t,
// dS = P (dP - delta), dV += (P m)^T dO, dQ = scale dS K, dK += scale dS^T Q.
// A row whose lse is -inf (it sees no key of the whole attention) adds nothing.
void backward_head(const BackwardArgs& a, int64_t b, int64_t h, int64_t c_kv,
                   const Scratch& scratch, const Head& gkh, const Head& gvh) {
  const int64_t Tq = a.Tq, Tk = a.Tk, HD = a.HD, bh = b * a.attrs.num_heads + h;
  const int64_t q0 = a.attrs.q_offset, k0 = a.attrs.k_offset;
  const float scale = float(a.attrs.scale);
  const bool drop = a.attrs.dropout_p > 0.0;
  const double keep = 1.0 - a.attrs.dropout_p;
  const float drop_scale = drop ? float(1.0 / keep) : 1.0f;
  Head qh(a.q, b, h * HD), kh(a.k, b, c_kv), vh(a.v, b, c_kv);
  Head oh(a.out, b, h * HD), goh(a.grad_out, b, h * HD), gqh(a.grad_q, b, h * HD);
  float* P = scratch.plane(0);
  float* dP = scratch.plane(1);
  float* Pm = drop ? scratch.plane(2) : P;
  float* M = drop ? scratch.plane(3) : nullptr;
  for (int64_t t0 = 0; t0 < Tq; t0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, Tq - t0);
    const int64_t n = math::attention_visible_keys(t0 + rows - 1, q0, k0, Tk);
    if (n == 0) {  // the tile sees no key
      for (int64_t t = t0; t < t0 + rows; ++t) std::fill(gqh.row(t), gqh.row(t) + HD, 0.0f);
      continue;
    }
    sgemm('N', 'T', rows, n, HD, scale, qh.row(t0), qh.ld, kh.ptr, kh.ld, 0.0f, P, n);
    sgemm('N', 'T', rows, n, HD, 1.0f, goh.row(t0), goh.ld, vh.ptr, vh.ld, 0.0f, dP, n);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = t0 + i;
      const float row_lse = a.lse_all[bh * Tq + t];
      const int64_t len = row_lse == -std::numeric_limits<float>::infinity()
                              ? 0
                              : math::attention_visible_keys(t, q0, k0, Tk);
      float* p = P + i * n;
      float* dp = dP + i * n;
      probabilities(p, len, n, row_lse);
      const float* o = oh.row(t);
      const float* go = goh.row(t);
      float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
      for (int64_t c = 0; c < HD; ++c) delta += go[c] * o[c];
      if (drop) {
        float* pm = Pm + i * n;
        dropout_row(a.attrs.dropout_key, math::attention_dropout_index(a.grid, b, h, t, 0), len,
                    keep, drop_scale, M);
#pragma omp simd
        for (int64_t s = 0; s < len; ++s) {
          pm[s] = p[s] * M[s];
          dp[s] *= M[s];
        }
        std::fill(pm + len, pm + n, 0.0f);
      }
#pragma omp simd
      for (int64_t s = 0; s < len; ++s) dp[s] = math::attention_grad_score(p[s], dp[s], delta);
      std::fill(dp + len, dp + n, 0.0f);
    }
    // dV[0:n] += (P m)^T dO_tile; dQ_tile = scale dS K; dK[0:n] += scale dS^T Q_tile.
    sgemm('T', 'N', n, HD, rows, 1.0f, Pm, n, goh.row(t0), goh.ld, 1.0f, gvh.ptr, gvh.ld);
    sgemm('N', 'N', rows, HD, n, scale, dP, n, kh.ptr, kh.ld, 0.0f, gqh.row(t0), gqh.ld);
    sgemm('T', 'N', n, HD, rows, scale, dP, n, qh.row(t0), qh.ld, 1.0f, gkh.ptr, gkh.ld);
  }
}

}  // namespace

// Forward: O_t = sum_s P[t, s] m[t, s] v_s over the keys t sees,
// P = exp(scale q k^T - lse) (lse possibly the merged one of a split
// attention); the gradients per query head (backward_head), a kv head's grad_k and
// grad_v summed over its group's query heads in order.
void CpuBackend::attention_backward(const Tensor& grad_out, const Tensor& q, const Tensor& k,
                                    const Tensor& v, const Tensor& out, const Tensor& lse,
                                    const AttentionAttrs& attrs, const Tensor& grad_q,
                                    const Tensor& grad_k, const Tensor& grad_v) {
  if (cpu::any_half({&grad_out, &q, &k, &v, &out}))
    return cpu::run_in_f32({grad_out, q, k, v, out}, {grad_q, grad_k, grad_v},
                           [&](const TensorList& i, const TensorList& o) {
                             attention_backward(i[0], i[1], i[2], i[3], i[4], lse, attrs, o[0],
                                                o[1], o[2]);
                           });
  bool fast = fast_layout(q) && fast_layout(k) && fast_layout(v) && fast_layout(grad_q) &&
              fast_layout(grad_k) && fast_layout(grad_v) && grad_out.is_contiguous() &&
              grad_out.dtype() == DType::f32 && out.is_contiguous() && out.dtype() == DType::f32 &&
              lse.dtype() == DType::f32;
  if (!fast)
    return RefBackend::attention_backward(grad_out, q, k, v, out, lse, attrs, grad_q, grad_k,
                                          grad_v);
  const int64_t B = q.size(0), Tq = q.size(1), Tk = k.size(1), D = q.size(2);
  const int64_t NH = attrs.num_heads, HD = D / NH, KV = attrs.kv_heads(), group = NH / KV;
  if (B * Tq * D == 0) return;
  const BackwardArgs args{
      grad_out, q, k, v, out, grad_q, attrs, lse.data<float>(), Tq, Tk, HD, attrs.dropout_grid(Tq)};
  // Planes: P, dP (becomes dS), and with dropout P m and one mask row.
  Scratch scratch(attrs.dropout_p > 0.0 ? 4 : 2, Tk);
#pragma omp parallel for schedule(static)
  for (int64_t bk = 0; bk < B * KV; ++bk) {
    const int64_t b = bk / KV, kvh = bk % KV;
    Head gkh(grad_k, b, kvh * HD), gvh(grad_v, b, kvh * HD);
    for (int64_t t = 0; t < Tk; ++t) {
      std::memset(gkh.row(t), 0, size_t(HD) * sizeof(float));
      std::memset(gvh.row(t), 0, size_t(HD) * sizeof(float));
    }
    for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
      backward_head(args, b, h, kvh * HD, scratch, gkh, gvh);
  }
}

// lse' = logaddexp(lse, block_lse), out' = out exp(lse - lse') + block_out
// exp(block_lse - lse') per (b, h, t), OpenMP over (b, t); a side with lse
// -inf adds nothing. f32 here, other dtypes the reference.
void CpuBackend::attention_merge(const Tensor& out, const Tensor& lse, const Tensor& block_out,
                                 const Tensor& block_lse) {
  if (out.dtype() != DType::f32 || block_out.dtype() != DType::f32 || lse.dtype() != DType::f32 ||
      block_lse.dtype() != DType::f32)
    return RefBackend::attention_merge(out, lse, block_out, block_lse);
  const int64_t B = out.size(0), Tq = out.size(1), D = out.size(2), NH = lse.size(1);
  const int64_t HD = D / NH;
  float* o_all = out.data<float>();
  const float* bo_all = block_out.data<float>();
  float* lse_all = lse.data<float>();
  const float* blse_all = block_lse.data<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * Tq; ++bt) {
    const int64_t b = bt / Tq, t = bt % Tq;
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t row = (b * NH + h) * Tq + t;
      const float l = lse_all[row], bl = blse_all[row];
      if (bl == kNegInf) continue;  // the block adds nothing
      const float mx = std::max(l, bl);
      const float merged = mx + std::log(std::exp(l - mx) + std::exp(bl - mx));
      const float w = std::exp(l - merged), bw = std::exp(bl - merged);
      float* o = o_all + bt * D + h * HD;
      const float* bo = bo_all + bt * D + h * HD;
      if (w > 0.0f) {
#pragma omp simd
        for (int64_t c = 0; c < HD; ++c) o[c] = o[c] * w + bo[c] * bw;
      } else {  // lse -inf: out holds nothing yet
#pragma omp simd
        for (int64_t c = 0; c < HD; ++c) o[c] = bo[c] * bw;
      }
      lse_all[row] = merged;
    }
  }
}

}  // namespace trainer
