// Reference reductions: accumulate every input element into its output slot
// in double, then finish (mean divides, var uses two passes).
#include <cmath>
#include <limits>

#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

using ref::for_each_index;
using ref::get;
using ref::set;

namespace {

// Row-major slot in out (keepdim layout) of input index i.
int64_t out_slot(const Tensor& x, uint64_t mask, const std::vector<int64_t>& i) {
  int64_t slot = 0;
  for (int d = 0; d < x.dim(); ++d) {
    int64_t size = (mask >> d) & 1 ? 1 : x.shape()[d];
    slot = slot * size + ((mask >> d) & 1 ? 0 : i[d]);
  }
  return slot;
}

int64_t reduced_count(const Tensor& x, uint64_t mask) {
  int64_t n = 1;
  for (int d = 0; d < x.dim(); ++d)
    if ((mask >> d) & 1) n *= x.shape()[d];
  return n;
}

void write_contiguous(const Tensor& out, const std::vector<double>& acc) {
  CHECK(out.is_contiguous());
  for (int64_t s = 0; s < int64_t(acc.size()); ++s) set(out, s, acc[s]);
}

}  // namespace

void RefBackend::reduce(ReduceOp op, const Tensor& x, uint64_t mask, const Tensor& out) {
  double init = op == ReduceOp::max   ? -std::numeric_limits<double>::infinity()
                : op == ReduceOp::min ? std::numeric_limits<double>::infinity()
                                      : 0.0;
  std::vector<double> acc(size_t(out.numel()), init);
  for_each_index(x.shape(), [&](const auto& i) {
    double v = get(x, i);
    double& a = acc[out_slot(x, mask, i)];
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::mean:
        a += v;
        break;
      case ReduceOp::max:
        a = (std::isnan(v) || v > a) ? v : a;
        break;
      case ReduceOp::min:
        a = (std::isnan(v) || v < a) ? v : a;
        break;
    }
  });
  if (op == ReduceOp::mean) {
    double n = double(reduced_count(x, mask));
    for (double& a : acc) a /= n;
  }
  write_contiguous(out, acc);
}

void RefBackend::var(const Tensor& x, uint64_t mask, int64_t correction, const Tensor& out) {
  std::vector<double> mean(size_t(out.numel()), 0.0), m2(size_t(out.numel()), 0.0);
  double n = double(reduced_count(x, mask));
  for_each_index(x.shape(), [&](const auto& i) { mean[out_slot(x, mask, i)] += get(x, i); });
  for (double& m : mean) m /= n;
  for_each_index(x.shape(), [&](const auto& i) {
    int64_t s = out_slot(x, mask, i);
    double d = get(x, i) - mean[s];
    m2[s] += d * d;
  });
  double denom = std::max(n - double(correction), 0.0);
  for (double& v : m2) v = denom > 0 ? v / denom : std::numeric_limits<double>::quiet_NaN();
  write_contiguous(out, m2);
}

void RefBackend::max_dim(const Tensor& x, int dim, const Tensor& values, const Tensor& indices) {
  uint64_t mask = uint64_t(1) << dim;
  std::vector<double> best(size_t(values.numel()), -std::numeric_limits<double>::infinity());
  std::vector<int64_t> arg(size_t(values.numel()), -1);
  for_each_index(x.shape(), [&](const auto& i) {
    double v = get(x, i);
    int64_t s = out_slot(x, mask, i);
    // The first maximum wins; NaN counts as the maximum (as torch.max).
    bool take = arg[s] < 0 || (!std::isnan(best[s]) && (std::isnan(v) || v > best[s]));
    if (take) {
      best[s] = v;
      arg[s] = i[dim];
    }
  });
  write_contiguous(values, best);
  for (int64_t s = 0; s < int64_t(arg.size()); ++s) set(indices, s, double(arg[s]));
}

}  // namespace trainer
