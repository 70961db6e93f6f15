#include "layers/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/autograd.h"
#include "core/cpu/loops.h"

namespace trainer {

namespace {

// [B, T, ...] blocks of the sequence: [n, B, T / n, ...] -> [B, T, ...].
Tensor blocks_to_sequence(const Tensor& blocks, int n, const Shape& local) {
  std::vector<int> order(size_t(blocks.dim()));
  for (int d = 0; d < blocks.dim(); ++d) order[size_t(d)] = d;
  std::swap(order[0], order[1]);  // [B, n, T / n, ...]
  Shape shape = local;
  shape[1] *= n;
  return blocks.permute(order).contiguous().reshape(shape);
}

// [B, T, ...] -> [n, B, T / n, ...] (contiguous): the sequence's blocks first.
Tensor sequence_to_blocks(const Tensor& x, int n) {
  CHECK(x.dim() >= 2 && x.size(1) % n == 0)
      << "sequence parallelism: the sequence of " << x.shape_str() << " does not split over " << n
      << " ranks";
  Shape split = x.shape();
  split[1] /= n;
  split.insert(split.begin() + 1, n);  // [B, n, T / n, ...]
  std::vector<int> order(split.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = int(d);
  std::swap(order[0], order[1]);
  return x.contiguous().reshape(split).permute(order).contiguous();
}

Tensor gather_seq(const Tensor& x, TensorParallelGroup& g) {
  const int n = g.size();
  Tensor all = g.allgather(x.contiguous());  // [n B, T / n, ...]
  Shape blocks = x.shape();
  blocks.insert(blocks.begin(), n);
  return blocks_to_sequence(all.reshape(blocks), n, x.shape());
}

Tensor reduce_scatter_seq(const Tensor& x, TensorParallelGroup& g) {
  const int n = g.size();
  Tensor blocks = sequence_to_blocks(x, n);  // [n, B, T / n, ...]
  Shape flat = blocks.shape();
  flat.erase(flat.begin());
  flat[0] *= n;
  return g.reduce_scatter(blocks.reshape(flat));  // [B, T / n, ...]
}

// x summed over the group, in a copy (never the caller's tensor).
Tensor summed(const Tensor& x, TensorParallelGroup& g) { return g.sum(x); }

// [..., k] -> [..., n k], rank r's values at [r k, (r + 1) k): gathered
// along dim 0 as [n, rows, k], then put side by side.
Tensor gather_last(const Tensor& x, TensorParallelGroup& g) {
  Tensor rows = x.contiguous().reshape({-1, x.size(-1)});
  Tensor all = g.allgather(rows).reshape({g.size(), rows.size(0), x.size(-1)});
  Shape shape = x.shape();
  shape.back() *= g.size();
  return all.permute({1, 0, 2}).contiguous().reshape(shape);
}

// This rank's part of dim `dim` of x (contiguous).
Tensor own_part(const Tensor& x, int dim, TensorParallelGroup& g) {
  CHECK(x.size(dim) % g.size() == 0) << "tensor parallelism: dim " << dim << " of " << x.shape_str()
                                     << " does not split over " << g.size() << " ranks";
  const int64_t k = x.size(dim) / g.size();
  return x.narrow(dim, g.rank() * k, k).contiguous();
}

// The ops that move activations in and out of the split region: forward
// and backward each a function of one tensor and the group (Moves names
// them), as autograd ops.
template <class Moves>
struct RegionFn {
  struct Saved {
    TensorParallelGroup* g = nullptr;
  };
  static constexpr const char* name = Moves::name;
  static Tensor forward(Saved& s, const Tensor& x, TensorParallelGroup* g) {
    s.g = g;
    return Moves::forward(x, *g);
  }
  static TensorList backward(Saved& s, const TensorList& grad, const autograd::GradMask&) {
    return {Moves::backward(grad[0], *s.g)};
  }
};

struct CopyToRegion {
  static constexpr const char* name = "tp_copy_to_region";
  static Tensor forward(const Tensor& x, TensorParallelGroup&) { return x; }
  static Tensor backward(const Tensor& g, TensorParallelGroup& group) { return summed(g, group); }
};
struct ReduceFromRegion {
  static constexpr const char* name = "tp_reduce_from_region";
  static Tensor forward(const Tensor& x, TensorParallelGroup& group) { return summed(x, group); }
  static Tensor backward(const Tensor& g, TensorParallelGroup&) { return g; }
};
struct GatherLastDim {
  static constexpr const char* name = "tp_gather_last_dim";
  static Tensor forward(const Tensor& x, TensorParallelGroup& g) { return gather_last(x, g); }
  static Tensor backward(const Tensor& grad, TensorParallelGroup& g) {
    return own_part(grad, grad.dim() - 1, g);
  }
};
struct GatherSequence {
  static constexpr const char* name = "tp_gather_sequence";
  static Tensor forward(const Tensor& x, TensorParallelGroup& g) { return gather_seq(x, g); }
  static Tensor backward(const Tensor& grad, TensorParallelGroup& g) {
    return reduce_scatter_seq(grad, g);
  }
};
struct ReduceScatterSequence {
  static constexpr const char* name = "tp_reduce_scatter_sequence";
  static Tensor forward(const Tensor& x, TensorParallelGroup& g) {
    return reduce_scatter_seq(x, g);
  }
  static Tensor backward(const Tensor& grad, TensorParallelGroup& g) { return gather_seq(grad, g); }
};
struct SplitSequence {
  static constexpr const char* name = "tp_split_sequence";
  static Tensor forward(const Tensor& x, TensorParallelGroup& g) {
    CHECK(x.dim() >= 2) << "sequence parallelism: " << x.shape_str() << " has no sequence dim";
    return own_part(x, 1, g);
  }
  static Tensor backward(const Tensor& grad, TensorParallelGroup& g) { return gather_seq(grad, g); }
};

// Per row n of logits [N, Vl] (this rank's columns [v0, v0 + Vl) of V; of
// them the first Vv, those below the vocabulary's end, count):
//   m = max_j x (over the group), s = sum_j exp(x - m), t = x[target] (on
//   the rank holding it, else 0), u = sum_j x (label smoothing only), the
//   last three summed over the group in one allreduce; then
//   loss = (1 - eps)(log s + m - t) + eps (log s + m - u / V).
// Backward: grad_x = w (exp(x - lse) - (1 - eps) [j == target] - eps / V),
// w the row's weight (g / rows counted for mean, 0 for an ignored row); 0
// for the padding columns j >= Vv.
struct VocabParallelCrossEntropyFn {
  struct Saved {
    Tensor logits, targets, lse;  // lse [N] f64
    int64_t vocab_start = 0, vocab = 0;
    int64_t counted = 0;
    CrossEntropyOptions options;
  };
  static constexpr const char* name = "vocab_parallel_cross_entropy";

  // The columns of this rank's Vl that are vocabulary (the rest padding).
  static int64_t counted_columns(int64_t vocab_start, int64_t Vl, int64_t vocab) {
    return std::clamp<int64_t>(vocab - vocab_start, 0, Vl);
  }

  static Tensor forward(Saved& s, const Tensor& logits_in, const Tensor& targets_in,
                        int64_t vocab_start, TensorParallelGroup* g, const CrossEntropyOptions& o,
                        int64_t vocab) {
    Tensor logits = logits_in.contiguous();
    Tensor targets = targets_in.contiguous();
    const int64_t N = logits.size(0), Vl = logits.size(1);
    const int64_t V = vocab > 0 ? vocab : Vl * g->size();
    const int64_t Vv = counted_columns(vocab_start, Vl, V);
    const int64_t* tgt = targets.data<int64_t>();
    Tensor maxima = empty({N}, DType::f64);
    Tensor sums = zeros({3, N}, DType::f64);  // s, t, u
    Tensor lse = empty({N}, DType::f64);
    double* m = maxima.data<double>();
    dispatch_f32_f64(logits.dtype(), name, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* x = logits.data<T>();
      cpu::parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          double best = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < Vv; ++j) best = std::max(best, double(x[n * Vl + j]));
          m[n] = best;
        }
      });
      g->allreduce(maxima, /*max=*/true);
      double* st = sums.data<double>();
      cpu::parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* row = x + n * Vl;
          double sum_exp = 0, sum_x = 0;
          for (int64_t j = 0; j < Vv; ++j) {
            sum_exp += std::exp(double(row[j]) - m[n]);
            sum_x += double(row[j]);
          }
          const int64_t local = tgt[n] - vocab_start;
          st[n] = sum_exp;
          st[N + n] = local >= 0 && local < Vv ? double(row[local]) : 0.0;
          st[2 * N + n] = sum_x;
        }
      });
    });
    g->allreduce(sums);
    const double eps = o.label_smoothing;
    const double* st = sums.data<double>();
    double* l = lse.data<double>();
    Tensor per_row = empty({N}, DType::f64);
    double* loss = per_row.data<double>();
    int64_t counted = 0;
    for (int64_t n = 0; n < N; ++n) {
      l[n] = std::log(st[n]) + m[n];
      if (tgt[n] == o.ignore_index) {
        loss[n] = 0;
        continue;
      }
      CHECK(tgt[n] >= 0 && tgt[n] < V)
          << "vocab_parallel_cross_entropy: target " << tgt[n] << " outside [0, " << V << ")";
      ++counted;
      loss[n] = (1 - eps) * (l[n] - st[N + n]) + eps * (l[n] - st[2 * N + n] / double(V));
    }
    s = Saved{logits, targets, lse, vocab_start, V, counted, o};
    using R = CrossEntropyOptions::Reduction;
    if (o.reduction == R::none) return per_row.to(logits.dtype());
    double total = 0;
    for (int64_t n = 0; n < N; ++n) total += loss[n];
    if (o.reduction == R::mean) total = counted > 0 ? total / double(counted) : 0.0;
    return full({}, total, logits.dtype());
  }

  static TensorList backward(Saved& s, const TensorList& grad, const autograd::GradMask&) {
    const Tensor& x_t = s.logits;
    const int64_t N = x_t.size(0), Vl = x_t.size(1);
    using R = CrossEntropyOptions::Reduction;
    Tensor gout = grad[0].to(DType::f64).contiguous();
    std::vector<double> w(static_cast<size_t>(N));
    const int64_t* tgt = s.targets.data<int64_t>();
    for (int64_t n = 0; n < N; ++n) {
      const double gn =
          s.options.reduction == R::none ? gout.data<double>()[n] : gout.data<double>()[0];
      const double scale = s.options.reduction == R::mean && s.counted > 0 ? 1.0 / double(s.counted)
                           : s.options.reduction == R::mean                ? 0.0
                                                                           : 1.0;
      w[size_t(n)] = tgt[n] == s.options.ignore_index ? 0.0 : gn * scale;
    }
    Tensor gx = empty(x_t.shape(), x_t.dtype());
    const double eps = s.options.label_smoothing, uniform = eps / double(s.vocab);
    const int64_t Vv = counted_columns(s.vocab_start, Vl, s.vocab);
    const double* lse = s.lse.data<double>();
    dispatch_f32_f64(x_t.dtype(), name, [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* x = x_t.data<T>();
      T* out = gx.data<T>();
      cpu::parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const double wn = w[size_t(n)];
          const int64_t local = tgt[n] - s.vocab_start;
          for (int64_t j = 0; j < Vv; ++j) {
            double p = std::exp(double(x[n * Vl + j]) - lse[n]) - uniform;
            if (j == local) p -= 1 - eps;
            out[n * Vl + j] = T(wn * p);
          }
          for (int64_t j = Vv; j < Vl; ++j) out[n * Vl + j] = T(0);
        }
      });
    });
    return {gx, Tensor()};
  }
};

}  // namespace

Tensor copy_to_region(const Tensor& x, TensorParallelGroup& g) {
  return autograd::apply<RegionFn<CopyToRegion>>(x, &g);
}

Tensor reduce_from_region(const Tensor& x, TensorParallelGroup& g) {
  return autograd::apply<RegionFn<ReduceFromRegion>>(x, &g);
}

Tensor gather_last_dim(const Tensor& x, TensorParallelGroup& g) {
  return autograd::apply<RegionFn<GatherLastDim>>(x, &g);
}

Tensor gather_sequence(const Tensor& x, TensorParallelGroup& g) {
  return autograd::apply<RegionFn<GatherSequence>>(x, &g);
}

Tensor reduce_scatter_sequence(const Tensor& x, TensorParallelGroup& g) {
  return autograd::apply<RegionFn<ReduceScatterSequence>>(x, &g);
}

Tensor split_sequence(const Tensor& x, TensorParallelGroup& g) {
  return autograd::apply<RegionFn<SplitSequence>>(x, &g);
}

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    int64_t vocab_start, TensorParallelGroup& g,
                                    const CrossEntropyOptions& options, int64_t vocab) {
  if (!logits.device().is_cpu())
    // Reduced in host memory (its [N, V / tp] logits and their gradient
    // cross once each way per step), the result back on the device.
    return vocab_parallel_cross_entropy(logits.to(Device{}), targets.to(Device{}), vocab_start, g,
                                        options, vocab)
        .to(logits.device());
  CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0) &&
        targets.dtype() == DType::i64)
      << "vocab_parallel_cross_entropy: logits " << logits.shape_str() << ", targets "
      << targets.shape_str() << " " << targets.dtype();
  // Low-precision logits (autocast) are reduced in f32, as cross_entropy does.
  const bool lowp = logits.dtype() == DType::bf16 || logits.dtype() == DType::f16;
  CHECK(vocab >= 0 && vocab <= logits.size(1) * g.size())
      << "vocab_parallel_cross_entropy: a vocabulary of " << vocab << " in " << logits.size(1)
      << " x " << g.size() << " columns";
  return autograd::apply<VocabParallelCrossEntropyFn>(
      lowp ? logits.to(DType::f32) : logits, targets.to(Device{}), vocab_start, &g, options, vocab);
}

Tensor vocab_parallel_lookup(const Tensor& weight, const Tensor& indices, int64_t vocab_start) {
  // Indices outside this rank's rows look up row 0 and are masked to zero,
  // which also keeps their gradient out of row 0.
  Tensor idx = indices.to(Device{}).contiguous();
  Tensor local = empty(idx.shape(), DType::i64);
  Tensor mask = empty(idx.shape(), weight.dtype());
  const int64_t rows = weight.size(0);
  const int64_t* in = idx.data<int64_t>();
  int64_t* out = local.data<int64_t>();
  dispatch_floating(weight.dtype(), "vocab_parallel_lookup", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* keep = mask.data<T>();
    for (int64_t i = 0; i < idx.numel(); ++i) {
      const int64_t r = in[i] - vocab_start;
      const bool mine = r >= 0 && r < rows;
      out[i] = mine ? r : 0;
      keep[i] = T(mine ? 1.0f : 0.0f);
    }
  });
  return embedding(weight, local.to(weight.device())) * mask.to(weight.device()).unsqueeze(-1);
}

std::string divisors_of(int64_t n) {
  std::string out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return out;
}

Shape full_shape(const Shape& shard, const ParameterSplit& split) {
  Shape full = shard;
  if (split.kind == ParameterSplit::Kind::sharded) full[size_t(split.dim)] *= split.size;
  return full;
}

Tensor zero_padded_rows(const Tensor& t, int64_t rows) {
  CHECK(t.dim() >= 1 && rows >= t.size(0))
      << "zero_padded_rows: " << t.shape_str() << " to " << rows << " rows";
  Shape shape = t.shape();
  shape[0] = rows;
  if (is_deferred(t))
    return deferred_tensor(shape, t.dtype(), t.device(), [t](const Tensor& out) {
      Tensor whole = out;
      whole.copy_(zero_padded_rows(value_of(t), whole.size(0)));
    });
  autograd::NoGradGuard no_grad;
  Tensor out = zeros(shape, t.dtype(), t.device());
  out.narrow(0, 0, t.size(0)).copy_(t);
  return out;
}

Tensor shard_of(const Tensor& full, const ParameterSplit& split) {
  const bool sharded = split.kind == ParameterSplit::Kind::sharded;
  const int64_t extent = sharded ? full.size(split.dim) : 0;
  CHECK(!sharded || extent % (int64_t(split.parts) * split.size) == 0)
      << "shard_of: dim " << split.dim << " of " << full.shape_str() << " does not split into "
      << split.parts << " x " << split.size;
  if (is_deferred(full)) {
    // Another pipeline stage's weight: its shard, made when it is materialised.
    Shape shape = full.shape();
    if (sharded) shape[size_t(split.dim)] /= split.size;
    return deferred_tensor(shape, full.dtype(), full.device(), [full, split](const Tensor& out) {
      Tensor whole = out;
      whole.copy_(shard_of(value_of(full), split));
    });
  }
  if (!sharded) return full.contiguous().clone();
  const int64_t piece = extent / split.parts, slice = piece / split.size;
  TensorList pieces;
  for (int p = 0; p < split.parts; ++p)
    pieces.push_back(full.narrow(split.dim, p * piece + split.rank * slice, slice));
  return pieces.size() == 1 ? pieces[0].contiguous() : concat(pieces, split.dim).contiguous();
}

Tensor unshard(const TensorList& parts, const ParameterSplit& split) {
  CHECK(int(parts.size()) == split.size)
      << "unshard: " << parts.size() << " parts for a group of " << split.size;
  if (split.kind != ParameterSplit::Kind::sharded) return parts[0];
  const int64_t slice = parts[0].size(split.dim) / split.parts;
  TensorList ordered;
  for (int p = 0; p < split.parts; ++p)
    for (int r = 0; r < split.size; ++r)
      ordered.push_back(parts[size_t(r)].narrow(split.dim, p * slice, slice));
  return concat(ordered, split.dim).contiguous();
}

}  // namespace trainer
