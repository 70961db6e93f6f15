// CPU fast paths for reductions: sum, mean, max, min, var, and max/argmax
// along one dim. Every floating dtype runs the same templates (bf16/f16 load
// as float); results match RefBackend up to summation order.
//
// A ReducePlan drops size-1 dims, merges dims that x steps through as one,
// and picks one of two loop shapes from the dim innermost in memory:
//   row     a reduced dim is (e.g. sum over the last dim): each output slot
//           reduces a unit-stride run, held in kLanes accumulators the
//           compiler vectorises;
//   column  a kept dim is (e.g. sum over dim 0 of [N, C], the bias
//           gradient), or each output reduces only a few elements: a block
//           of up to kColBlock outputs is accumulated one input row at a
//           time, vectorised across the outputs.
// The work is split over independent output groups ("units") when there are
// at least as many as threads; otherwise each unit's reduced range is cut
// into one chunk per thread and the partials are combined in chunk order, so
// a result depends only on the thread count (docs/architecture.md "Determinism").
//
// Sums accumulate in double, so f32 sums do not drift over 10^7 elements;
// var is two-pass (the mean, then the sum of centred squares).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/loops.h"

namespace trainer {

namespace {

// Independent accumulators of a unit-stride run: enough vector registers to
// hide the add latency.
constexpr int kLanes = 16;
// Outputs accumulated together in column mode: 8 KiB of double accumulators
// stay in L1, and a block this wide reads 4 KiB of f32 per input row (256
// measured 2x slower on a [16384, 1000] sum over dim 0: a quarter of each
// row per pass defeats the prefetcher).
constexpr int64_t kColBlock = 1024;

// Row mode pays tens of ns per output slot; below this many reduced elements
// per output the column loop (strided across outputs) is faster, e.g. 5x on
// a sum over the last dim of [2^20, 3].
constexpr int64_t kShortReduction = 32;

// One dim of a plan: its size and its strides in x and in out (elements).
struct Dim {
  int64_t size, xstride, ostride;
};

struct ReducePlan {
  std::vector<Dim> kept;     // output order; in column mode without `cols`
  std::vector<Dim> reduced;  // largest x stride first
  bool column = false;
  Dim cols{1, 0, 0};       // column mode: the kept dim vectorised over
  int64_t n_outer = 1;     // product of kept sizes (without cols)
  int64_t n_red = 1;       // product of reduced sizes
  int64_t red_stride = 0;  // x stride of the innermost reduced dim
};

// Folds each dim into the previous one when both tensors step through the
// pair as one dim.
std::vector<Dim> merge_dims(const std::vector<Dim>& dims) {
  std::vector<Dim> out;
  for (const Dim& d : dims) {
    if (!out.empty() && out.back().xstride == d.xstride * d.size &&
        out.back().ostride == d.ostride * d.size) {
      out.back() = Dim{out.back().size * d.size, d.xstride, d.ostride};
    } else {
      out.push_back(d);
    }
  }
  return out;
}

// x: any strides; mask: the reduced dims; out is contiguous in keepdim layout.
ReducePlan make_plan(const Tensor& x, uint64_t mask) {
  Shape kept_shape = x.shape();
  for (int d = 0; d < x.dim(); ++d)
    if ((mask >> d) & 1) kept_shape[d] = 1;
  Shape ostrides = contiguous_strides(kept_shape);
  ReducePlan p;
  std::vector<Dim> kept, reduced;
  for (int d = 0; d < x.dim(); ++d) {
    if (x.shape()[d] == 1) continue;
    bool is_reduced = (mask >> d) & 1;
    Dim dim{x.shape()[d], x.strides()[d], is_reduced ? 0 : ostrides[d]};
    (is_reduced ? reduced : kept).push_back(dim);
    if (is_reduced) p.n_red *= dim.size;
  }
  // Reduced dims in any order give the same result: walk them largest stride
  // first so a permuted contiguous input merges into one unit-stride run.
  std::stable_sort(reduced.begin(), reduced.end(),
                   [](const Dim& a, const Dim& b) { return a.xstride > b.xstride; });
  p.kept = merge_dims(kept);
  p.reduced = merge_dims(reduced);
  if (!p.reduced.empty()) p.red_stride = p.reduced.back().xstride;
  if (!p.kept.empty()) {
    auto inner = std::min_element(p.kept.begin(), p.kept.end(),
                                  [](const Dim& a, const Dim& b) { return a.xstride < b.xstride; });
    if (p.reduced.empty() || inner->xstride < p.red_stride || p.n_red < kShortReduction) {
      p.column = true;
      p.cols = *inner;
      p.kept.erase(inner);
    }
  }
  p.n_outer = 1;  // without cols
  for (const Dim& d : p.kept) p.n_outer *= d.size;
  return p;
}

// x and out offsets of row-major position pos over dims.
std::pair<int64_t, int64_t> offsets(const std::vector<Dim>& dims, int64_t pos) {
  int64_t xo = 0, oo = 0;
  for (int d = int(dims.size()) - 1; d >= 0; --d) {
    int64_t i = pos % dims[d].size;
    pos /= dims[d].size;
    xo += i * dims[d].xstride;
    oo += i * dims[d].ostride;
  }
  return {xo, oo};
}

// Calls fn(x_offset, n) for the runs along the innermost of dims that cover
// row-major positions [begin, end). No dims: one run of one element.
template <class Fn>
void walk(const std::vector<Dim>& dims, int64_t begin, int64_t end, Fn&& fn) {
  if (begin >= end) return;
  if (dims.empty()) return fn(int64_t(0), int64_t(1));
  if (dims.size() == 1) return fn(begin * dims[0].xstride, end - begin);
  const int64_t inner = dims.back().size;
  for (int64_t pos = begin; pos < end;) {
    int64_t n = std::min(inner - pos % inner, end - pos);
    fn(offsets(dims, pos).first, n);
    pos += n;
  }
}

// Runs `units` independent reductions of n_red positions each.
//   compute(u, begin, end, part): reduces positions [begin, end) of unit u into part;
//   finish(u, parts, count): combines parts[0..count) in order and writes unit u.
// work (elements read) decides whether threads are worth starting.
template <class Partial, class Compute, class Finish>
void run_units(int64_t units, int64_t n_red, int64_t work, Compute&& compute, Finish&& finish) {
  int threads = work < cpu::kParallelGrain || omp_in_parallel() ? 1 : omp_get_max_threads();
  if (units >= threads || n_red < threads) {
    cpu::parallel_for(units, threads == 1 ? units : 0, [&](int64_t b, int64_t e) {
      Partial part;
      for (int64_t u = b; u < e; ++u) {
        compute(u, int64_t(0), n_red, part);
        finish(u, &part, 1);
      }
    });
    return;
  }
  std::vector<Partial> parts(static_cast<size_t>(threads));
  for (int64_t u = 0; u < units; ++u) {
    cpu::parallel_for(threads, 0, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k)
        compute(u, k * n_red / threads, (k + 1) * n_red / threads, parts[size_t(k)]);
    });
    finish(u, parts.data(), threads);
  }
}

// ---- accumulation ops: init, step(acc, value, center), combine ----

struct SumOp {
  using Acc = double;
  static Acc init() { return 0.0; }
  template <class V>
  static Acc step(Acc a, V v, double) {
    return a + double(v);
  }
  static Acc combine(Acc a, Acc b) { return a + b; }
};

// Squared deviations from a per-output center (var's second pass).
struct SqDevOp {
  using Acc = double;
  static Acc init() { return 0.0; }
  template <class V>
  static Acc step(Acc a, V v, double center) {
    double d = double(v) - center;
    return a + d * d;
  }
  static Acc combine(Acc a, Acc b) { return a + b; }
};

// Max (Sign = 1) or min (Sign = -1) in the compute type A; NaN wins.
template <class A, int Sign>
struct ExtremumOp {
  using Acc = A;
  static Acc init() {
    return Sign > 0 ? -std::numeric_limits<A>::infinity() : std::numeric_limits<A>::infinity();
  }
  static Acc step(Acc a, A v, double) {
    bool better = Sign > 0 ? v > a : v < a;
    return (better || v != v) ? v : a;
  }
  static Acc combine(Acc a, Acc b) { return step(a, b, 0.0); }
};

// acc op= p[0], p[stride], ..., p[(n-1) stride].
template <class Op, class T>
typename Op::Acc reduce_run(typename Op::Acc acc, const T* p, int64_t n, int64_t stride,
                            double center) {
  using Acc = typename Op::Acc;
  if (stride != 1 || n < 2 * kLanes) {
    for (int64_t i = 0; i < n; ++i) acc = Op::step(acc, load(p[i * stride]), center);
    return acc;
  }
  Acc lanes[kLanes];
  for (Acc& l : lanes) l = Op::init();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) lanes[l] = Op::step(lanes[l], load(p[i + l]), center);
  }
  for (; i < n; ++i) acc = Op::step(acc, load(p[i]), center);
  for (Acc l : lanes) acc = Op::combine(acc, l);
  return acc;
}

// acc[c] op= p[c stride] for c < n (one input row into a block of outputs).
template <class Op, class T>
void accumulate_row(typename Op::Acc* acc, const double* center, const T* p, int64_t n,
                    int64_t stride) {
  if (stride == 1) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) acc[c] = Op::step(acc[c], load(p[c]), center[c]);
  } else {
    for (int64_t c = 0; c < n; ++c) acc[c] = Op::step(acc[c], load(p[c * stride]), center[c]);
  }
}

// Reduces x over the plan; emit(out_index, acc) writes each result. centers
// (indexed like out) feeds Op's center; null when Op ignores it.
template <class Op, class T, class Emit>
void reduce_plan(const ReducePlan& p, const T* x, const double* centers, Emit&& emit) {
  using Acc = typename Op::Acc;
  if (!p.column) {
    // Row mode: unit u is output slot u (kept dims are out's non-1 dims, in order).
    run_units<Acc>(
        p.n_outer, p.n_red, p.n_outer * p.n_red,
        [&](int64_t u, int64_t begin, int64_t end, Acc& part) {
          const T* base = x + offsets(p.kept, u).first;
          double center = centers ? centers[u] : 0.0;
          part = Op::init();
          walk(p.reduced, begin, end, [&](int64_t xo, int64_t n) {
            part = reduce_run<Op>(part, base + xo, n, p.red_stride, center);
          });
        },
        [&](int64_t u, const Acc* parts, int count) {
          Acc a = parts[0];
          for (int k = 1; k < count; ++k) a = Op::combine(a, parts[k]);
          emit(u, a);
        });
    return;
  }
  // Column mode: unit u is block u % blocks of the cols of outer slot u / blocks.
  struct Block {
    Acc acc[kColBlock];
  };
  const int64_t blocks = (p.cols.size + kColBlock - 1) / kColBlock;
  auto block_of = [&](int64_t u) {
    int64_t c0 = (u % blocks) * kColBlock;
    return std::pair<int64_t, int64_t>{c0, std::min(kColBlock, p.cols.size - c0)};
  };
  run_units<Block>(
      p.n_outer * blocks, p.n_red, p.n_outer * p.cols.size * p.n_red,
      [&](int64_t u, int64_t begin, int64_t end, Block& part) {
        auto [c0, cn] = block_of(u);
        auto [xo, oo] = offsets(p.kept, u / blocks);
        double center[kColBlock];
        for (int64_t c = 0; c < cn; ++c) {
          part.acc[c] = Op::init();
          center[c] = centers ? centers[oo + (c0 + c) * p.cols.ostride] : 0.0;
        }
        const T* base = x + xo + c0 * p.cols.xstride;
        walk(p.reduced, begin, end, [&](int64_t ro, int64_t n) {
          for (int64_t j = 0; j < n; ++j)
            accumulate_row<Op>(part.acc, center, base + ro + j * p.red_stride, cn, p.cols.xstride);
        });
      },
      [&](int64_t u, const Block* parts, int count) {
        auto [c0, cn] = block_of(u);
        int64_t oo = offsets(p.kept, u / blocks).second;
        for (int64_t c = 0; c < cn; ++c) {
          Acc a = parts[0].acc[c];
          for (int k = 1; k < count; ++k) a = Op::combine(a, parts[k].acc[c]);
          emit(oo + (c0 + c) * p.cols.ostride, a);
        }
      });
}

// ---- max along one dim: value and first index ----

template <class A>
struct ArgMax {
  A value;
  int64_t index;
};

// The first maximum wins; a NaN, once seen, stays (as RefBackend::max_dim).
template <class A>
bool takes(A best, A v) {
  return best == best && (v != v || v > best);
}

// Max and its position over positions [begin, end) of p[i * stride].
template <class T>
ArgMax<acc_t<T>> argmax_run(const T* p, int64_t begin, int64_t end, int64_t stride) {
  using A = acc_t<T>;
  if (stride == 1 && end - begin >= kLanes) {
    // Vectorised max first, then the first position holding it.
    A m = reduce_run<ExtremumOp<A, 1>>(ExtremumOp<A, 1>::init(), p + begin, end - begin, 1, 0.0);
    for (int64_t i = begin; i < end; ++i) {
      A v = load(p[i]);
      if (m != m ? v != v : v == m) return {m, i};
    }
  }
  ArgMax<A> best{-std::numeric_limits<A>::infinity(), begin};
  for (int64_t i = begin; i < end; ++i) {
    A v = load(p[i * stride]);
    if (takes(best.value, v)) best = {v, i};
  }
  return best;
}

template <class T>
void max_dim_plan(const ReducePlan& p, const T* x, T* values, int64_t* indices) {
  using A = acc_t<T>;
  using Pair = ArgMax<A>;
  auto combine = [](Pair a, const Pair& b) { return takes(a.value, b.value) ? b : a; };
  if (!p.column) {
    run_units<Pair>(
        p.n_outer, p.n_red, p.n_outer * p.n_red,
        [&](int64_t u, int64_t begin, int64_t end, Pair& part) {
          part = argmax_run(x + offsets(p.kept, u).first, begin, end, p.red_stride);
        },
        [&](int64_t u, const Pair* parts, int count) {
          Pair best = parts[0];
          for (int k = 1; k < count; ++k) best = combine(best, parts[k]);
          values[u] = store_as<T>(best.value);
          indices[u] = best.index;
        });
    return;
  }
  struct Block {
    A value[kColBlock];
    int64_t index[kColBlock];
  };
  const int64_t blocks = (p.cols.size + kColBlock - 1) / kColBlock;
  auto block_of = [&](int64_t u) {
    int64_t c0 = (u % blocks) * kColBlock;
    return std::pair<int64_t, int64_t>{c0, std::min(kColBlock, p.cols.size - c0)};
  };
  const int64_t cs = p.cols.xstride;
  run_units<Block>(
      p.n_outer * blocks, p.n_red, p.n_outer * p.cols.size * p.n_red,
      [&](int64_t u, int64_t begin, int64_t end, Block& part) {
        auto [c0, cn] = block_of(u);
        const T* base = x + offsets(p.kept, u / blocks).first + c0 * cs;
        for (int64_t c = 0; c < cn; ++c) {
          part.value[c] = -std::numeric_limits<A>::infinity();
          part.index[c] = begin;
        }
        for (int64_t r = begin; r < end; ++r) {
          const T* row = base + r * p.red_stride;
          for (int64_t c = 0; c < cn; ++c) {
            A v = load(row[c * cs]);
            bool take = takes(part.value[c], v);
            part.value[c] = take ? v : part.value[c];
            part.index[c] = take ? r : part.index[c];
          }
        }
      },
      [&](int64_t u, const Block* parts, int count) {
        auto [c0, cn] = block_of(u);
        int64_t oo = offsets(p.kept, u / blocks).second;
        for (int64_t c = 0; c < cn; ++c) {
          Pair best{parts[0].value[c], parts[0].index[c]};
          for (int k = 1; k < count; ++k)
            best = combine(best, Pair{parts[k].value[c], parts[k].index[c]});
          int64_t o = oo + (c0 + c) * p.cols.ostride;
          values[o] = store_as<T>(best.value);
          indices[o] = best.index;
        }
      });
}

// The fast paths take same-dtype floating tensors with contiguous outputs.
bool fast_path_applies(const Tensor& x, const Tensor& out) {
  return is_floating(x.dtype()) && out.dtype() == x.dtype() && out.is_contiguous();
}

template <class T>
void store_double(T* out, int64_t i, double v) {
  out[i] = store_as<T>(acc_t<T>(v));
}

}  // namespace

void CpuBackend::reduce(ReduceOp op, const Tensor& x, uint64_t mask, const Tensor& out) {
  if (out.numel() == 0) return;
  if (!fast_path_applies(x, out)) return RefBackend::reduce(op, x, mask, out);
  ReducePlan plan = make_plan(x, mask);
  dispatch_floating(x.dtype(), "reduce", [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* px = static_cast<const T*>(x.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    auto store_acc = [po](int64_t i, A v) { po[i] = store_as<T>(v); };
    switch (op) {
      case ReduceOp::sum:
        reduce_plan<SumOp>(plan, px, nullptr,
                           [po](int64_t i, double v) { store_double(po, i, v); });
        break;
      case ReduceOp::mean: {
        double n = double(plan.n_red);
        reduce_plan<SumOp>(plan, px, nullptr,
                           [po, n](int64_t i, double v) { store_double(po, i, v / n); });
        break;
      }
      case ReduceOp::max:
        reduce_plan<ExtremumOp<A, 1>>(plan, px, nullptr, store_acc);
        break;
      case ReduceOp::min:
        reduce_plan<ExtremumOp<A, -1>>(plan, px, nullptr, store_acc);
        break;
    }
  });
}

void CpuBackend::var(const Tensor& x, uint64_t mask, int64_t correction, const Tensor& out) {
  if (out.numel() == 0) return;
  if (!fast_path_applies(x, out)) return RefBackend::var(x, mask, correction, out);
  ReducePlan plan = make_plan(x, mask);
  const double n = double(plan.n_red);
  const double denom = std::max(n - double(correction), 0.0);
  dispatch_floating(x.dtype(), "var", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* px = static_cast<const T*>(x.data_ptr());
    T* po = static_cast<T*>(out.data_ptr());
    std::vector<double> mean(size_t(out.numel()));
    reduce_plan<SumOp>(plan, px, nullptr, [&](int64_t i, double v) { mean[size_t(i)] = v / n; });
    reduce_plan<SqDevOp>(plan, px, mean.data(), [&](int64_t i, double v) {
      store_double(po, i, denom > 0 ? v / denom : std::numeric_limits<double>::quiet_NaN());
    });
  });
}

void CpuBackend::max_dim(const Tensor& x, int dim, const Tensor& values, const Tensor& indices) {
  if (values.numel() == 0) return;
  if (!fast_path_applies(x, values) || indices.dtype() != DType::i64 || !indices.is_contiguous())
    return RefBackend::max_dim(x, dim, values, indices);
  ReducePlan plan = make_plan(x, uint64_t(1) << dim);
  dispatch_floating(x.dtype(), "max", [&](auto tag) {
    using T = typename decltype(tag)::type;
    max_dim_plan(plan, static_cast<const T*>(x.data_ptr()), static_cast<T*>(values.data_ptr()),
                 indices.data<int64_t>());
  });
}

}  // namespace trainer
