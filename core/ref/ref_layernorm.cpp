// Reference layer norm and RMS norm, in double, one row of the [R, D] input
// at a time.
#include <cmath>
#include <vector>

#include "core/nn_math.h"
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

// out = (x - mean) rstd w + b, rstd = 1 / sqrt(var + eps) (biased var)
void RefBackend::layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                    double eps, const Tensor& out, const Tensor& mean,
                                    const Tensor& rstd) {
  int64_t R = x.shape()[0], D = x.shape()[1];
  for (int64_t r = 0; r < R; ++r) {
    double m = 0.0;
    for (int64_t d = 0; d < D; ++d) m += ref::get(x, r * D + d);
    m /= double(D);
    double v = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      double c = ref::get(x, r * D + d) - m;
      v += c * c;
    }
    double rs = 1.0 / std::sqrt(v / double(D) + eps);
    for (int64_t d = 0; d < D; ++d) {
      double xhat = (ref::get(x, r * D + d) - m) * rs;
      ref::set(out, r * D + d, xhat * ref::get(weight, d) + ref::get(bias, d));
    }
    ref::set(mean, r, m);
    ref::set(rstd, r, rs);
  }
}

// gx = rstd (gw - mean(gw) - xhat mean(gw xhat)) with gw = g w;
// gweight = sum_r g xhat; gbias = sum_r g
void RefBackend::layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                     const Tensor& mean, const Tensor& rstd, const Tensor& grad_x,
                                     const Tensor& grad_weight, const Tensor& grad_bias) {
  int64_t R = x.shape()[0], D = x.shape()[1];
  std::vector<double> gw_sum(size_t(D), 0.0), gb_sum(size_t(D), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    double m = ref::get(mean, r), rs = ref::get(rstd, r);
    double mean_gw = 0.0, mean_gw_xhat = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      double g = ref::get(grad_out, r * D + d);
      double xhat = (ref::get(x, r * D + d) - m) * rs;
      double gw = g * ref::get(weight, d);
      mean_gw += gw;
      mean_gw_xhat += gw * xhat;
      gw_sum[size_t(d)] += g * xhat;
      gb_sum[size_t(d)] += g;
    }
    mean_gw /= double(D);
    mean_gw_xhat /= double(D);
    for (int64_t d = 0; d < D; ++d) {
      double xhat = (ref::get(x, r * D + d) - m) * rs;
      double gw = ref::get(grad_out, r * D + d) * ref::get(weight, d);
      ref::set(grad_x, r * D + d, math::layer_norm_grad_x(rs, gw, mean_gw, xhat, mean_gw_xhat));
    }
  }
  for (int64_t d = 0; d < D; ++d) {
    ref::set(grad_weight, d, gw_sum[size_t(d)]);
    ref::set(grad_bias, d, gb_sum[size_t(d)]);
  }
}

// out = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps)
void RefBackend::rms_norm_forward(const Tensor& x, const Tensor& weight, double eps,
                                  const Tensor& out, const Tensor& rstd) {
  int64_t R = x.shape()[0], D = x.shape()[1];
  for (int64_t r = 0; r < R; ++r) {
    double ms = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      double v = ref::get(x, r * D + d);
      ms += v * v;
    }
    double rs = 1.0 / std::sqrt(ms / double(D) + eps);
    for (int64_t d = 0; d < D; ++d)
      ref::set(out, r * D + d, ref::get(x, r * D + d) * rs * ref::get(weight, d));
    ref::set(rstd, r, rs);
  }
}

// gx = rstd (gw - xhat mean(gw xhat)) with gw = g w, xhat = x rstd;
// gweight = sum_r g xhat
void RefBackend::rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                                   const Tensor& rstd, const Tensor& grad_x,
                                   const Tensor& grad_weight) {
  int64_t R = x.shape()[0], D = x.shape()[1];
  std::vector<double> gw_sum(size_t(D), 0.0);
  for (int64_t r = 0; r < R; ++r) {
    double rs = ref::get(rstd, r);
    double mean_gw_xhat = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      double g = ref::get(grad_out, r * D + d);
      double xhat = ref::get(x, r * D + d) * rs;
      mean_gw_xhat += g * ref::get(weight, d) * xhat;
      gw_sum[size_t(d)] += g * xhat;
    }
    mean_gw_xhat /= double(D);
    for (int64_t d = 0; d < D; ++d) {
      double xhat = ref::get(x, r * D + d) * rs;
      double gw = ref::get(grad_out, r * D + d) * ref::get(weight, d);
      ref::set(grad_x, r * D + d, math::rms_norm_grad_x(rs, gw, xhat, mean_gw_xhat));
    }
  }
  for (int64_t d = 0; d < D; ++d) ref::set(grad_weight, d, gw_sum[size_t(d)]);
}

}  // namespace trainer
