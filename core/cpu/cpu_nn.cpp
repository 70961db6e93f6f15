// CPU softmax, log_softmax and cross-entropy: vectorised loops with OpenMP
// over rows. A row is the run of elements along the softmax dim. Three paths:
//   rows     unit-stride f32 rows in every operand: computed in place;
//   columns  f32, a non-last dim followed by a unit-stride run in every
//            operand ([outer, n, inner]): blocks of columns at once, the
//            max and sums vectorised across the block;
//   gather   anything else (strided views, bf16/f16): each row is gathered
//            into a per-thread f32 buffer, computed and scattered back.
// f64 runs the reference kernels (it exists for gradient checks).
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"
#include "core/cpu/vec_math.h"

namespace trainer {

namespace {

using cpu::exp_f32;

// y = softmax(x) (log: log_softmax) over n contiguous floats; y may be x.
void softmax_row(const float* x, float* y, int64_t n, bool log) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  float z = 0.0f;
  if (log) {
#pragma omp simd reduction(+ : z)
    for (int64_t i = 0; i < n; ++i) z += exp_f32(x[i] - mx);
    float log_z = std::log(z);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mx) - log_z;
    return;
  }
#pragma omp simd reduction(+ : z)
  for (int64_t i = 0; i < n; ++i) {
    float e = exp_f32(x[i] - mx);
    y[i] = e;
    z += e;
  }
  float inv_z = 1.0f / z;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= inv_z;
}

// Backward of softmax_row: y = softmax(x): gx = y (g - sum g y);
// y = log_softmax(x): gx = g - exp(y) sum g. gx may be g.
void softmax_backward_row(const float* g, const float* y, float* gx, int64_t n, bool log) {
  float dot = 0.0f;
  if (log) {
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < n; ++i) dot += g[i];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) gx[i] = g[i] - exp_f32(y[i]) * dot;
    return;
  }
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < n; ++i) dot += g[i] * y[i];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) gx[i] = y[i] * (g[i] - dot);
}

template <class T>
void gather_row(const T* src, int64_t stride, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src[i * stride]);
}
template <class T>
void scatter_row(const float* src, T* dst, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i * stride] = store_as<T>(src[i]);
}

// Calls fn(offsets, buffer) for every row along dim of N operands of one
// shape, rows split across threads: offsets[k] is the element offset of the
// row's first element in operand k, buffer a per-thread scratch of
// buffer_rows * shape[dim] floats.
template <size_t N, class Fn>
void for_each_row(const Shape& shape, int dim, const std::array<const Tensor*, N>& ops,
                  int64_t buffer_rows, Fn&& fn) {
  int64_t n = shape[dim];
  if (shape_numel(shape) == 0) return;
  Shape outer;
  std::vector<std::array<int64_t, N>> outer_strides;
  for (int d = 0; d < int(shape.size()); ++d) {
    if (d == dim) continue;
    outer.push_back(shape[d]);
    std::array<int64_t, N> s;
    for (size_t k = 0; k < N; ++k) s[k] = ops[k]->strides()[d];
    outer_strides.push_back(s);
  }
  int64_t rows = shape_numel(outer);
  int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / n);
  cpu::parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(size_t(buffer_rows * n));
    std::vector<int64_t> idx(outer.size());
    int64_t rest = begin;
    for (size_t d = outer.size(); d-- > 0;) {
      idx[d] = rest % outer[d];
      rest /= outer[d];
    }
    for (int64_t r = begin; r < end; ++r) {
      std::array<int64_t, N> off{};
      for (size_t d = 0; d < outer.size(); ++d)
        for (size_t k = 0; k < N; ++k) off[k] += idx[d] * outer_strides[d][k];
      fn(off, buffer.data());
      for (size_t d = outer.size(); d-- > 0;) {
        if (++idx[d] < outer[d]) break;
        idx[d] = 0;
      }
    }
  });
}

// Columns per block of the column path (its per-column state stays in registers/L1).
constexpr int64_t kColumnBlock = 64;
// Below this many columns the gather path serves as well.
constexpr int64_t kMinColumns = 16;

// Softmax (log: log_softmax) of `width` adjacent columns of an [n, width]
// block: x[i * sx + j] -> y[i * sy + j], reduced over i.
void softmax_columns(const float* x, int64_t sx, float* y, int64_t sy, int64_t n, int64_t width,
                     bool log) {
  float mx[kColumnBlock], z[kColumnBlock];
  std::fill(mx, mx + width, -std::numeric_limits<float>::infinity());
  std::fill(z, z + width, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * sx;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) mx[j] = std::max(mx[j], xi[j]);
  }
  // The branch on log stays outside the vector loops: a conditional store
  // inside one keeps it scalar without AVX-512's masked stores.
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * sx;
    float* yi = y + i * sy;
    if (log) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) z[j] += exp_f32(xi[j] - mx[j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        const float e = exp_f32(xi[j] - mx[j]);
        z[j] += e;
        yi[j] = e;
      }
    }
  }
  for (int64_t j = 0; j < width; ++j) z[j] = log ? std::log(z[j]) : 1.0f / z[j];
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * sx;
    float* yi = y + i * sy;
    if (log) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) yi[j] = (xi[j] - mx[j]) - z[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) yi[j] *= z[j];
    }
  }
}

// Backward of softmax_columns, as softmax_backward_row per column.
void softmax_backward_columns(const float* g, int64_t sg, const float* y, int64_t sy, float* gx,
                              int64_t sgx, int64_t n, int64_t width, bool log) {
  float dot[kColumnBlock];
  std::fill(dot, dot + width, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* gi = g + i * sg;
    const float* yi = y + i * sy;
#pragma omp simd
    for (int64_t j = 0; j < width; ++j) dot[j] += log ? gi[j] : gi[j] * yi[j];
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* gi = g + i * sg;
    const float* yi = y + i * sy;
    float* gxi = gx + i * sgx;
    if (log) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) gxi[j] = gi[j] - exp_f32(yi[j]) * dot[j];
    } else {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) gxi[j] = yi[j] * (gi[j] - dot[j]);
    }
  }
}

// Whether the dims after `dim` of t read as one unit-stride run.
bool inner_contiguous(const Tensor& t, int dim) {
  int64_t expected = 1;
  for (int d = t.dim() - 1; d > dim; --d) {
    if (t.shape()[d] == 1) continue;
    if (t.strides()[d] != expected) return false;
    expected *= t.shape()[d];
  }
  return true;
}

int64_t inner_size(const Shape& shape, int dim) {
  return shape_numel(Shape(shape.begin() + dim + 1, shape.end()));
}

// Calls fn(offsets, width) for every block of up to kColumnBlock columns of
// the [outer, n, inner] view of N operands (inner unit-stride in each),
// blocks split across threads: offsets[k] is the element offset of the
// block's first column at i = 0 in operand k.
template <size_t N, class Fn>
void for_each_column_block(const Shape& shape, int dim, const std::array<const Tensor*, N>& ops,
                           Fn&& fn) {
  int64_t n = shape[dim], inner = inner_size(shape, dim);
  int64_t blocks = (inner + kColumnBlock - 1) / kColumnBlock;
  int64_t tasks = shape_numel(Shape(shape.begin(), shape.begin() + dim)) * blocks;
  int64_t grain = std::max<int64_t>(1, cpu::kParallelGrain / (n * kColumnBlock));
  cpu::parallel_for(tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      int64_t block = task % blocks, rest = task / blocks;
      std::array<int64_t, N> off;
      off.fill(block * kColumnBlock);
      for (int d = dim - 1; d >= 0; --d) {
        int64_t i = rest % shape[d];
        rest /= shape[d];
        for (size_t k = 0; k < N; ++k) off[k] += i * ops[k]->strides()[d];
      }
      fn(off, std::min(kColumnBlock, inner - block * kColumnBlock));
    }
  });
}

// Whether the column path takes softmax along dim of these operands.
template <class T, size_t N>
bool use_columns(int dim, const std::array<const Tensor*, N>& ops) {
  const Tensor& t = *ops[0];
  if (!std::is_same_v<T, float> || dim == t.dim() - 1) return false;
  if (inner_size(t.shape(), dim) < kMinColumns) return false;
  for (const Tensor* op : ops)
    if (!inner_contiguous(*op, dim)) return false;
  return true;
}

bool fast_dtype(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

template <class T>
void softmax_impl(const Tensor& x, int dim, bool log, const Tensor& out) {
  int64_t n = x.shape()[dim], sx = x.strides()[dim], so = out.strides()[dim];
  const T* px = x.data<T>();
  T* po = out.data<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (use_columns<T, 2>(dim, {&x, &out})) {
      return for_each_column_block<2>(
          x.shape(), dim, {&x, &out}, [&](const std::array<int64_t, 2>& off, int64_t width) {
            softmax_columns(px + off[0], sx, po + off[1], so, n, width, log);
          });
    }
  }
  bool in_place = std::is_same_v<T, float> && sx == 1 && so == 1;
  for_each_row<2>(x.shape(), dim, {&x, &out}, 1,
                  [&](const std::array<int64_t, 2>& off, float* buf) {
                    if constexpr (std::is_same_v<T, float>) {
                      if (in_place) return softmax_row(px + off[0], po + off[1], n, log);
                    }
                    gather_row(px + off[0], sx, n, buf);
                    softmax_row(buf, buf, n, log);
                    scatter_row(buf, po + off[1], so, n);
                  });
}

template <class T>
void softmax_backward_impl(const Tensor& grad, const Tensor& y, int dim, bool log,
                           const Tensor& grad_x) {
  int64_t n = y.shape()[dim];
  int64_t sg = grad.strides()[dim], sy = y.strides()[dim], sgx = grad_x.strides()[dim];
  const T* pg = grad.data<T>();
  const T* py = y.data<T>();
  T* pgx = grad_x.data<T>();
  if constexpr (std::is_same_v<T, float>) {
    if (use_columns<T, 3>(dim, {&grad, &y, &grad_x})) {
      return for_each_column_block<3>(y.shape(), dim, {&grad, &y, &grad_x},
                                      [&](const std::array<int64_t, 3>& off, int64_t width) {
                                        softmax_backward_columns(pg + off[0], sg, py + off[1], sy,
                                                                 pgx + off[2], sgx, n, width, log);
                                      });
    }
  }
  bool in_place = std::is_same_v<T, float> && sg == 1 && sy == 1 && sgx == 1;
  for_each_row<3>(y.shape(), dim, {&grad, &y, &grad_x}, 2,
                  [&](const std::array<int64_t, 3>& off, float* buf) {
                    if constexpr (std::is_same_v<T, float>) {
                      if (in_place)
                        return softmax_backward_row(pg + off[0], py + off[1], pgx + off[2], n, log);
                    }
                    float* g = buf;
                    float* yv = buf + n;
                    gather_row(pg + off[0], sg, n, g);
                    gather_row(py + off[1], sy, n, yv);
                    softmax_backward_row(g, yv, g, n, log);
                    scatter_row(g, pgx + off[2], sgx, n);
                  });
}

}  // namespace

// y = exp(x - max) / sum exp(x - max); log: y = x - max - log sum exp(x - max)
void CpuBackend::softmax(const Tensor& x, int dim, bool log, const Tensor& out) {
  if (!fast_dtype(x.dtype()) || out.dtype() != x.dtype())
    return RefBackend::softmax(x, dim, log, out);
  dispatch_floating(x.dtype(), "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, double>) softmax_impl<T>(x, dim, log, out);
  });
}

// softmax: gx = y (g - sum g y);  log_softmax: gx = g - exp(y) sum g
void CpuBackend::softmax_backward(const Tensor& grad, const Tensor& y, int dim, bool log,
                                  const Tensor& grad_x) {
  if (!fast_dtype(y.dtype()) || grad.dtype() != y.dtype() || grad_x.dtype() != y.dtype())
    return RefBackend::softmax_backward(grad, y, dim, log, grad_x);
  dispatch_floating(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, double>) softmax_backward_impl<T>(grad, y, dim, log, grad_x);
  });
}

// Fused per row: logp = log_softmax(logits[n]); loss[n] = -sum_c q_c logp_c
// = -(1 - eps) logp_t - eps / C sum_c logp_c, 0 where target == ignore_index.
void CpuBackend::cross_entropy(const Tensor& logits, const Tensor& target, double eps,
                               int64_t ignore_index, const Tensor& loss, const Tensor& logp) {
  bool f32 = logits.dtype() == DType::f32 && loss.dtype() == DType::f32 &&
             logp.dtype() == DType::f32 && target.dtype() == DType::i64;
  if (!f32 || !loss.is_contiguous() || !logp.is_contiguous())
    return RefBackend::cross_entropy(logits, target, eps, ignore_index, loss, logp);
  int64_t C = logits.shape()[1], sn = logits.strides()[0], sc = logits.strides()[1];
  int64_t st = target.strides()[0];
  const float* px = logits.data<float>();
  const int64_t* pt = target.data<int64_t>();
  float* pl = loss.data<float>();
  float* plogp = logp.data<float>();
  const float keep = float(1.0 - eps), spread = float(eps / double(C));
  int64_t N = logits.shape()[0];
  cpu::parallel_for(N, std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(C, 1)),
                    [&](int64_t begin, int64_t end) {
                      std::vector<float> buffer(sc == 1 ? 0 : size_t(C));
                      for (int64_t n = begin; n < end; ++n) {
                        const float* row = px + n * sn;
                        if (sc != 1) {
                          gather_row(row, sc, C, buffer.data());
                          row = buffer.data();
                        }
                        float* lp = plogp + n * C;
                        softmax_row(row, lp, C, /*log=*/true);
                        int64_t t = pt[n * st];
                        if (t == ignore_index) {
                          pl[n] = 0.0f;
                          continue;
                        }
                        CHECK(t >= 0 && t < C) << "cross_entropy: target " << t << " at row " << n
                                               << " is outside [0, " << C << ")";
                        float sum_lp = 0.0f;
                        if (spread != 0.0f) {
#pragma omp simd reduction(+ : sum_lp)
                          for (int64_t c = 0; c < C; ++c) sum_lp += lp[c];
                        }
                        pl[n] = -(keep * lp[t] + spread * sum_lp);
                      }
                    });
}

// grad_logits[n, c] = grad_loss[n] * (exp(logp[n, c]) - q_c), 0 for ignored rows.
void CpuBackend::cross_entropy_backward(const Tensor& grad_loss, const Tensor& logp,
                                        const Tensor& target, double eps, int64_t ignore_index,
                                        const Tensor& grad_logits) {
  bool f32 = grad_loss.dtype() == DType::f32 && logp.dtype() == DType::f32 &&
             grad_logits.dtype() == DType::f32 && target.dtype() == DType::i64;
  if (!f32 || !logp.is_contiguous() || !grad_logits.is_contiguous())
    return RefBackend::cross_entropy_backward(grad_loss, logp, target, eps, ignore_index,
                                              grad_logits);
  int64_t N = logp.shape()[0], C = logp.shape()[1];
  int64_t st = target.strides()[0], sg = grad_loss.strides()[0];
  const float* plogp = logp.data<float>();
  const float* pgl = grad_loss.data<float>();
  const int64_t* pt = target.data<int64_t>();
  float* pgx = grad_logits.data<float>();
  const float keep = float(1.0 - eps), spread = float(eps / double(C));
  cpu::parallel_for(N, std::max<int64_t>(1, cpu::kParallelGrain / std::max<int64_t>(C, 1)),
                    [&](int64_t begin, int64_t end) {
                      for (int64_t n = begin; n < end; ++n) {
                        float* gx = pgx + n * C;
                        const float* lp = plogp + n * C;
                        int64_t t = pt[n * st];
                        if (t == ignore_index) {
                          std::fill(gx, gx + C, 0.0f);
                          continue;
                        }
                        float g = pgl[n * sg];
#pragma omp simd
                        for (int64_t c = 0; c < C; ++c) gx[c] = g * (exp_f32(lp[c]) - spread);
                        gx[t] -= g * keep;
                      }
                    });
}

}  // namespace trainer
