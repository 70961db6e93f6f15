#include "parallel/sync_batchnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "comm/collectives.h"
#include "core/autograd.h"
#include "core/cpu/loops.h"
#include "core/ops.h"
#include "parallel/device_staging.h"

namespace trainer::parallel {
namespace {

// Rows ([M, C] channels-last) per block of the per-channel sums: blocks run
// in parallel and are added in order, so the sums do not depend on the
// thread count.
constexpr int64_t kRowsPerBlock = 256;

// out[j] = sum over rows m of the width values row(m, partial) adds to partial[0, width).
template <class RowFn>
std::vector<double> sum_rows(int64_t rows, int64_t width, RowFn&& row) {
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  std::vector<double> partial(size_t(blocks * width), 0.0);
  cpu::parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      double* acc = partial.data() + b * width;
      for (int64_t m = b * kRowsPerBlock; m < std::min(rows, (b + 1) * kRowsPerBlock); ++m)
        row(m, acc);
    }
  });
  std::vector<double> out(size_t(width), 0.0);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < width; ++j) out[size_t(j)] += partial[size_t(b * width + j)];
  return out;
}

// out = (x - mean) * invstd * gamma + beta, with mean and the biased variance
// over the M values per channel of every rank: sum x, sum x^2 and M are
// all-reduced. Backward (mean and var depend on every rank's x):
//   grad_gamma = sum g * xhat,  grad_beta = sum g          (this rank's values)
//   grad_x = gamma * invstd * (g - Sg / M - xhat * Sgx / M)
// with Sg = sum g and Sgx = sum g * xhat all-reduced over the ranks.
struct SyncBatchNormFn {
  struct Saved {
    Tensor x, gamma, mean, invstd;  // x channels-last; mean, invstd [C] f64
    double count = 0;
    comm::Communicator* comm = nullptr;
  };
  static constexpr const char* name = "sync_batch_norm";

  static TensorList forward(Saved& s, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            double eps, comm::Communicator* comm, double* count_out) {
    const int64_t C = x.size(1), M = x.size(0) * x.size(2) * x.size(3);
    Tensor out = empty_channels_last(x.shape(), x.dtype(), x.device());
    Tensor mean = empty({C}, DType::f64), invstd = empty({C}, DType::f64);
    Tensor mean_out = empty({C}, x.dtype()), var_out = empty({C}, x.dtype());
    double count = 0;
    dispatch_f32_f64(x.dtype(), "sync_batch_norm", [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* px = x.data<T>();
      std::vector<double> stats = sum_rows(M, 2 * C, [&](int64_t m, double* acc) {
        const T* row = px + m * C;
        for (int64_t c = 0; c < C; ++c) {
          double v = double(row[c]);
          acc[c] += v;
          acc[C + c] += v * v;
        }
      });
      stats.push_back(double(M));
      comm::allreduce(*comm, stats.data(), stats.size(), DType::f64);
      count = stats.back();
      if (!(count > 1))
        throw Error(
            cat("sync_batch_norm in training needs more than one value per channel over "
                "all ranks, got ",
                count, " (this rank's input ", x.shape_str(), ")"));
      double* pm = mean.data<double>();
      double* pi = invstd.data<double>();
      for (int64_t c = 0; c < C; ++c) {
        double mu = stats[size_t(c)] / count;
        double var = std::max(0.0, stats[size_t(C + c)] / count - mu * mu);
        pm[c] = mu;
        pi[c] = 1.0 / std::sqrt(var + eps);
        mean_out.data<T>()[c] = T(mu);
        var_out.data<T>()[c] = T(var);
      }
      const T* pg = gamma.data<T>();
      const T* pb = beta.data<T>();
      T* po = out.data<T>();
      cpu::parallel_for(M, kRowsPerBlock, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t c = 0; c < C; ++c)
            po[m * C + c] =
                T((double(px[m * C + c]) - pm[c]) * pi[c] * double(pg[c]) + double(pb[c]));
      });
    });
    s = Saved{x, gamma, mean, invstd, count, comm};
    *count_out = count;
    return {out, mean_out, var_out};
  }

  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask& needs) {
    const Tensor& x = s.x;
    const int64_t C = x.size(1), M = x.size(0) * x.size(2) * x.size(3);
    Tensor go = g[0].defined() ? to_channels_last(g[0]) : zeros_like(x);
    Tensor gx, gg = empty({C}, x.dtype()), gb = empty({C}, x.dtype());
    if (needs[0]) gx = empty_channels_last(x.shape(), x.dtype(), x.device());
    const double* pm = s.mean.data<double>();
    const double* pi = s.invstd.data<double>();
    dispatch_f32_f64(x.dtype(), "sync_batch_norm", [&](auto tag) {
      using T = typename decltype(tag)::type;
      const T* px = x.data<T>();
      const T* pg = go.data<T>();
      // Local [sum g, sum g * xhat] per channel.
      std::vector<double> sums = sum_rows(M, 2 * C, [&](int64_t m, double* acc) {
        for (int64_t c = 0; c < C; ++c) {
          double gv = double(pg[m * C + c]);
          acc[c] += gv;
          acc[C + c] += gv * (double(px[m * C + c]) - pm[c]) * pi[c];
        }
      });
      for (int64_t c = 0; c < C; ++c) {
        gb.data<T>()[c] = T(sums[size_t(c)]);
        gg.data<T>()[c] = T(sums[size_t(C + c)]);
      }
      if (!needs[0]) return;
      comm::allreduce(*s.comm, sums.data(), sums.size(), DType::f64);
      const T* pgamma = s.gamma.data<T>();
      T* pgx = gx.data<T>();
      cpu::parallel_for(M, kRowsPerBlock, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t c = 0; c < C; ++c) {
            double xhat = (double(px[m * C + c]) - pm[c]) * pi[c];
            double mean_g = sums[size_t(c)] / s.count, mean_gx = sums[size_t(C + c)] / s.count;
            pgx[m * C + c] =
                T(double(pgamma[c]) * pi[c] * (double(pg[m * C + c]) - mean_g - xhat * mean_gx));
          }
      });
    });
    return {gx, gg, gb};
  }
};

// The same math with device-generic tensor ops (CUDA: its kernels), for x
// on any device: the per-channel sums are computed where x lives, in f64,
// and only the [2C + 1] / [2C] statistics cross to the host for the
// allreduce (allreduce_through_host).
struct SyncBatchNormOpsFn {
  struct Saved {
    Tensor x, gamma, mean, invstd;  // mean, invstd [1, C, 1, 1] f64 on x's device
    double count = 0;
    comm::Communicator* comm = nullptr;
  };
  static constexpr const char* name = "sync_batch_norm";

  // [C] f64 tensors a and b (and a trailing extra value) summed over the ranks, on the host.
  static std::vector<double> allreduce_pair(comm::Communicator& comm, const Tensor& a,
                                            const Tensor& b, const double* extra) {
    const int64_t C = a.numel();
    Tensor host = empty({2 * C + (extra ? 1 : 0)}, DType::f64);
    make_view(host, {C}, {1}, 0).copy_(a);
    make_view(host, {C}, {1}, C).copy_(b);
    if (extra) host.data<double>()[2 * C] = *extra;
    allreduce_through_host(comm, host, {.op = comm::ReduceOp::sum});
    return host.to_vector<double>();
  }

  static TensorList forward(Saved& s, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                            double eps, comm::Communicator* comm, double* count_out) {
    const int64_t C = x.size(1), M = x.size(0) * x.size(2) * x.size(3);
    const Device device = x.device();
    Tensor xd = x.to(DType::f64);
    double local_count = double(M);
    std::vector<double> stats =
        allreduce_pair(*comm, sum(xd, {0, 2, 3}), sum(mul(xd, xd), {0, 2, 3}), &local_count);
    const double count = stats.back();
    if (!(count > 1))
      throw Error(cat(
          "sync_batch_norm in training needs more than one value per channel over all ranks, got ",
          count, " (this rank's input ", x.shape_str(), ")"));
    std::vector<double> mu(static_cast<size_t>(C)), var = mu, inv = mu;
    for (int64_t c = 0; c < C; ++c) {
      mu[size_t(c)] = stats[size_t(c)] / count;
      var[size_t(c)] = std::max(0.0, stats[size_t(C + c)] / count - mu[size_t(c)] * mu[size_t(c)]);
      inv[size_t(c)] = 1.0 / std::sqrt(var[size_t(c)] + eps);
    }
    Tensor mean = from_vector(mu, {1, C, 1, 1}).to(device);
    Tensor invstd = from_vector(inv, {1, C, 1, 1}).to(device);
    Tensor scale = mul(invstd, gamma.to(DType::f64).reshape({1, C, 1, 1}));
    Tensor out = add(mul(sub(xd, mean), scale), beta.to(DType::f64).reshape({1, C, 1, 1}));
    Tensor mean_out = from_vector(mu).to(x.dtype()).to(device);
    Tensor var_out = from_vector(var).to(x.dtype()).to(device);
    s = Saved{x, gamma, mean, invstd, count, comm};
    *count_out = count;
    return {to_channels_last(out.to(x.dtype())), mean_out, var_out};
  }

  static TensorList backward(Saved& s, const TensorList& g, const autograd::GradMask& needs) {
    const Tensor& x = s.x;
    const int64_t C = x.size(1);
    Tensor go = g[0].defined() ? g[0].to(DType::f64) : zeros(x.shape(), DType::f64, x.device());
    Tensor xhat = mul(sub(x.to(DType::f64), s.mean), s.invstd);
    Tensor sg = sum(go, {0, 2, 3}), sgx = sum(mul(go, xhat), {0, 2, 3});
    Tensor gb = sg.to(s.gamma.dtype()), gg = sgx.to(s.gamma.dtype()), gx;
    if (needs[0]) {
      std::vector<double> sums = allreduce_pair(*s.comm, sg, sgx, nullptr);
      std::vector<double> mean_g(static_cast<size_t>(C)), mean_gx = mean_g;
      for (int64_t c = 0; c < C; ++c) {
        mean_g[size_t(c)] = sums[size_t(c)] / s.count;
        mean_gx[size_t(c)] = sums[size_t(C + c)] / s.count;
      }
      Tensor mg = from_vector(mean_g, {1, C, 1, 1}).to(x.device());
      Tensor mgx = from_vector(mean_gx, {1, C, 1, 1}).to(x.device());
      Tensor scale = mul(s.invstd, s.gamma.to(DType::f64).reshape({1, C, 1, 1}));
      gx = to_channels_last(mul(sub(sub(go, mg), mul(xhat, mgx)), scale).to(x.dtype()));
    }
    return {gx, gg, gb};
  }
};

}  // namespace

BatchStatsResult sync_batch_norm_ops(comm::Communicator& comm, const Tensor& x, const Tensor& gamma,
                                     const Tensor& beta, double eps, bool relu) {
  auto floating = [](DType d) {
    return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16;
  };
  CHECK(x.dim() == 4 && floating(x.dtype()))
      << "sync_batch_norm takes a floating [N, C, H, W] tensor, got " << x.shape_str() << " "
      << x.dtype();
  const int64_t C = x.size(1);
  for (const Tensor* t : {&gamma, &beta})
    CHECK(t->dim() == 1 && t->size(0) == C && t->dtype() == gamma.dtype() && floating(t->dtype()) &&
          t->device() == x.device())
        << "sync_batch_norm: per-channel tensor " << t->shape_str() << " " << t->dtype() << " on "
        << t->device() << " for input " << x.shape_str() << " " << x.dtype() << " on "
        << x.device();
  double count = 0;
  TensorList r = autograd::apply<SyncBatchNormOpsFn>(x, gamma, beta, eps, &comm, &count);
  Tensor out = relu ? trainer::relu(r[0]) : r[0];
  return {{out, r[1].detach(), r[2].detach()}, int64_t(std::llround(count))};
}

BatchStatsResult sync_batch_norm(comm::Communicator& comm, const Tensor& x, const Tensor& gamma,
                                 const Tensor& beta, double eps, bool relu) {
  // Device tensors (a GPU): the tensor-op path, whose statistics are staged
  // through host memory for the allreduce.
  if (!x.device().is_cpu()) return sync_batch_norm_ops(comm, x, gamma, beta, eps, relu);
  CHECK(x.dim() == 4) << "sync_batch_norm takes an [N, C, H, W] tensor, got " << x.shape_str();
  const int64_t C = x.size(1);
  for (const Tensor* t : {&gamma, &beta})
    CHECK(t->dim() == 1 && t->size(0) == C && t->dtype() == x.dtype() && t->is_contiguous())
        << "sync_batch_norm: per-channel tensor " << t->shape_str() << " " << t->dtype()
        << " for input " << x.shape_str() << " " << x.dtype();
  double count = 0;
  TensorList r =
      autograd::apply<SyncBatchNormFn>(to_channels_last(x), gamma, beta, eps, &comm, &count);
  Tensor out = relu ? relu_channels_last(r[0]) : r[0];
  return {{out, r[1].detach(), r[2].detach()}, int64_t(std::llround(count))};
}

int convert_sync_batchnorm(Module& model, std::shared_ptr<comm::Communicator> comm, bool by_ops) {
  CHECK(comm) << "convert_sync_batchnorm needs a communicator";
  int converted = 0;
  model.apply([&](Module& m) {
    auto* bn = dynamic_cast<BatchNorm2d*>(&m);
    if (!bn) return;
    bn->set_batch_stats_norm([comm, by_ops](const Tensor& x, const Tensor& gamma,
                                            const Tensor& beta, double eps, bool relu) {
      return by_ops ? sync_batch_norm_ops(*comm, x, gamma, beta, eps, relu)
                    : sync_batch_norm(*comm, x, gamma, beta, eps, relu);
    });
    ++converted;
  });
  return converted;
}

SyncBatchNorm::SyncBatchNorm(int64_t channels, std::shared_ptr<comm::Communicator> comm,
                             const BatchNormOptions& options)
    : BatchNorm2d(channels, options) {
  convert_sync_batchnorm(*this, std::move(comm));
}

}  // namespace trainer::parallel
