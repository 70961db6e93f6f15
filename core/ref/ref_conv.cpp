// Reference convolution, pooling and batch norm: the oracle of the oneDNN
// paths. Each kernel reads its operands into row-major double arrays
// (whatever their strides), loops over the formula as written in
// core/backend.h and writes the result back; backward kernels scatter along
// the same loops as their forward, so the two read as mirror images.
#include <cmath>
#include <limits>
#include <vector>

#include "core/nn_math.h"
#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {

// All elements of t as doubles, row-major over its shape.
std::vector<double> read_all(const Tensor& t) {
  std::vector<double> v;
  v.reserve(size_t(t.numel()));
  ref::for_each_index(t.shape(),
                      [&](const std::vector<int64_t>& i) { v.push_back(ref::get(t, i)); });
  return v;
}

// Writes row-major values into t (any strides).
void write_all(const Tensor& t, const std::vector<double>& v) {
  size_t k = 0;
  ref::for_each_index(t.shape(), [&](const std::vector<int64_t>& i) { ref::set(t, i, v[k++]); });
}

// Row-major index arithmetic of an [N, C, H, W] array.
struct Dims4 {
  int64_t n, c, h, w;
  explicit Dims4(const Tensor& t) : n(t.size(0)), c(t.size(1)), h(t.size(2)), w(t.size(3)) {}
  int64_t at(int64_t in, int64_t ic, int64_t ih, int64_t iw) const {
    return ((in * c + ic) * h + ih) * w + iw;
  }
  int64_t numel() const { return n * c * h * w; }
  // Channel of row-major element k.
  int64_t channel(int64_t k) const { return (k / (h * w)) % c; }
};

// Calls fn(n, o, oy, ox, i, c, iy, ix, ky, kx) for every in-bounds term of
// the convolution sum: output (n, o, oy, ox) reads input channel c (the i-th
// of o's group) at (iy, ix) with weight tap (ky, kx).
template <class Fn>
void for_each_conv_term(const Dims4& x, const Dims4& out, int64_t kh, int64_t kw,
                        const Conv2dAttrs& a, Fn&& fn) {
  int64_t in_per_group = x.c / a.groups, out_per_group = out.c / a.groups;
  for (int64_t n = 0; n < out.n; ++n)
    for (int64_t o = 0; o < out.c; ++o)
      for (int64_t oy = 0; oy < out.h; ++oy)
        for (int64_t ox = 0; ox < out.w; ++ox)
          for (int64_t i = 0; i < in_per_group; ++i) {
            int64_t c = (o / out_per_group) * in_per_group + i;
            for (int64_t ky = 0; ky < kh; ++ky) {
              int64_t iy = oy * a.stride[0] - a.padding[0] + ky * a.dilation[0];
              if (iy < 0 || iy >= x.h) continue;
              for (int64_t kx = 0; kx < kw; ++kx) {
                int64_t ix = ox * a.stride[1] - a.padding[1] + kx * a.dilation[1];
                if (ix < 0 || ix >= x.w) continue;
                fn(n, o, oy, ox, i, c, iy, ix, ky, kx);
              }
            }
          }
}

int64_t weight_at(const Tensor& w, int64_t o, int64_t i, int64_t ky, int64_t kx) {
  return ((o * w.size(1) + i) * w.size(2) + ky) * w.size(3) + kx;
}

}  // namespace

void RefBackend::conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias,
                        const Conv2dAttrs& a, bool fuse_relu, const Tensor& out) {
  Dims4 dx(x), dout(out);
  std::vector<double> xv = read_all(x), wv = read_all(weight);
  std::vector<double> ov(size_t(dout.numel()), 0.0);
  for_each_conv_term(dx, dout, weight.size(2), weight.size(3), a,
                     [&](int64_t n, int64_t o, int64_t oy, int64_t ox, int64_t i, int64_t c,
                         int64_t iy, int64_t ix, int64_t ky, int64_t kx) {
                       ov[dout.at(n, o, oy, ox)] +=
                           xv[dx.at(n, c, iy, ix)] * wv[weight_at(weight, o, i, ky, kx)];
                     });
  std::vector<double> bv = bias.defined() ? read_all(bias) : std::vector<double>(dout.c, 0.0);
  for (int64_t k = 0; k < dout.numel(); ++k) {
    double v = ov[k] + bv[dout.channel(k)];
    ov[k] = fuse_relu ? std::max(v, 0.0) : v;
  }
  write_all(out, ov);
}

// Forward: out[n, o, oy, ox] += x[n, c, iy, ix] * w[o, i, ky, kx] per term.
// Backward data: grad_x[n, c, iy, ix] += grad_out[n, o, oy, ox] * w[o, i, ky, kx].
void RefBackend::conv2d_backward_data(const Tensor& grad_out, const Tensor& weight,
                                      const Conv2dAttrs& a, const Tensor& grad_x) {
  Dims4 dx(grad_x), dout(grad_out);
  std::vector<double> gv = read_all(grad_out), wv = read_all(weight);
  std::vector<double> gx(size_t(dx.numel()), 0.0);
  for_each_conv_term(dx, dout, weight.size(2), weight.size(3), a,
                     [&](int64_t n, int64_t o, int64_t oy, int64_t ox, int64_t i, int64_t c,
                         int64_t iy, int64_t ix, int64_t ky, int64_t kx) {
                       gx[dx.at(n, c, iy, ix)] +=
                           gv[dout.at(n, o, oy, ox)] * wv[weight_at(weight, o, i, ky, kx)];
                     });
  write_all(grad_x, gx);
}

// Backward weights: grad_w[o, i, ky, kx] += grad_out[n, o, oy, ox] * x[n, c, iy, ix];
// grad_bias[o] = sum over n, oy, ox of grad_out.
void RefBackend::conv2d_backward_weights(const Tensor& grad_out, const Tensor& x,
                                         const Conv2dAttrs& a, const Tensor& grad_weight,
                                         const Tensor& grad_bias) {
  Dims4 dx(x), dout(grad_out);
  std::vector<double> gv = read_all(grad_out), xv = read_all(x);
  std::vector<double> gw(size_t(grad_weight.numel()), 0.0);
  for_each_conv_term(dx, dout, grad_weight.size(2), grad_weight.size(3), a,
                     [&](int64_t n, int64_t o, int64_t oy, int64_t ox, int64_t i, int64_t c,
                         int64_t iy, int64_t ix, int64_t ky, int64_t kx) {
                       gw[weight_at(grad_weight, o, i, ky, kx)] +=
                           gv[dout.at(n, o, oy, ox)] * xv[dx.at(n, c, iy, ix)];
                     });
  write_all(grad_weight, gw);
  if (!grad_bias.defined()) return;
  std::vector<double> gb(size_t(dout.c), 0.0);
  for (int64_t k = 0; k < dout.numel(); ++k) gb[dout.channel(k)] += gv[k];
  write_all(grad_bias, gb);
}

namespace {

// Calls fn(n, c, oy, ox, iy, ix) for every in-bounds input of each pooling window.
template <class Fn>
void for_each_pool_term(const Dims4& x, const Dims4& out, const Pool2dAttrs& a, Fn&& fn) {
  for (int64_t n = 0; n < out.n; ++n)
    for (int64_t c = 0; c < out.c; ++c)
      for (int64_t oy = 0; oy < out.h; ++oy)
        for (int64_t ox = 0; ox < out.w; ++ox)
          for (int64_t ky = 0; ky < a.kernel[0]; ++ky) {
            int64_t iy = oy * a.stride[0] - a.padding[0] + ky;
            if (iy < 0 || iy >= x.h) continue;
            for (int64_t kx = 0; kx < a.kernel[1]; ++kx) {
              int64_t ix = ox * a.stride[1] - a.padding[1] + kx;
              if (ix >= 0 && ix < x.w) fn(n, c, oy, ox, iy, ix);
            }
          }
}

// PyTorch's avg_pool2d divisor: the window clipped to the padded image, or
// to the image itself without count_include_pad.
double avg_pool_divisor(const Dims4& x, const Pool2dAttrs& a, int64_t oy, int64_t ox) {
  return double(math::avg_pool_divisor(oy * a.stride[0] - a.padding[0],
                                       ox * a.stride[1] - a.padding[1], a.kernel[0], a.kernel[1],
                                       x.h, x.w, a.padding[0], a.padding[1], a.count_include_pad));
}

}  // namespace

Tensor RefBackend::max_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  Dims4 dx(x), dout(out);
  std::vector<double> xv = read_all(x);
  std::vector<double> best(size_t(dout.numel()), -std::numeric_limits<double>::infinity());
  std::vector<int64_t> arg(size_t(dout.numel()), -1);
  for_each_pool_term(dx, dout, a,
                     [&](int64_t n, int64_t c, int64_t oy, int64_t ox, int64_t iy, int64_t ix) {
                       int64_t k = dout.at(n, c, oy, ox);
                       double v = xv[dx.at(n, c, iy, ix)];
                       if (arg[k] < 0 || v > best[k] || std::isnan(v)) {
                         best[k] = v;
                         arg[k] = iy * dx.w + ix;
                       }
                     });
  write_all(out, best);
  Tensor argmax = empty(out.shape(), DType::i64, out.device());
  std::copy(arg.begin(), arg.end(), argmax.data<int64_t>());
  return argmax;
}

// Forward: out[n, c, oy, ox] = x[n, c, argmax]. Backward: grad_x[n, c, argmax] += grad_out.
void RefBackend::max_pool2d_backward(const Tensor& grad_out, const Tensor& argmax,
                                     const Pool2dAttrs&, const Tensor& grad_x) {
  CHECK(argmax.dtype() == DType::i64 && argmax.is_contiguous())
      << "max_pool2d_backward: the reference kernel needs the reference forward's indices";
  Dims4 dx(grad_x), dout(grad_out);
  std::vector<double> gv = read_all(grad_out), gx(size_t(dx.numel()), 0.0);
  const int64_t* arg = argmax.data<int64_t>();
  for (int64_t k = 0; k < dout.numel(); ++k) {
    int64_t plane = k / (dout.h * dout.w);  // n * C + c
    gx[plane * dx.h * dx.w + arg[k]] += gv[k];
  }
  write_all(grad_x, gx);
}

void RefBackend::avg_pool2d(const Tensor& x, const Pool2dAttrs& a, const Tensor& out) {
  Dims4 dx(x), dout(out);
  std::vector<double> xv = read_all(x), ov(size_t(dout.numel()), 0.0);
  for_each_pool_term(
      dx, dout, a, [&](int64_t n, int64_t c, int64_t oy, int64_t ox, int64_t iy, int64_t ix) {
        ov[dout.at(n, c, oy, ox)] += xv[dx.at(n, c, iy, ix)] / avg_pool_divisor(dx, a, oy, ox);
      });
  write_all(out, ov);
}

// Forward: out = sum of the window / divisor. Backward: each window input += grad_out / divisor.
void RefBackend::avg_pool2d_backward(const Tensor& grad_out, const Pool2dAttrs& a,
                                     const Tensor& grad_x) {
  Dims4 dx(grad_x), dout(grad_out);
  std::vector<double> gv = read_all(grad_out), gx(size_t(dx.numel()), 0.0);
  for_each_pool_term(
      dx, dout, a, [&](int64_t n, int64_t c, int64_t oy, int64_t ox, int64_t iy, int64_t ix) {
        gx[dx.at(n, c, iy, ix)] += gv[dout.at(n, c, oy, ox)] / avg_pool_divisor(dx, a, oy, ox);
      });
  write_all(grad_x, gx);
}

namespace {

// Calls fn(n, c, oy, ox, iy, ix, count) for every input of each adaptive window.
template <class Fn>
void for_each_adaptive_term(const Dims4& x, const Dims4& out, Fn&& fn) {
  for (int64_t n = 0; n < out.n; ++n)
    for (int64_t c = 0; c < out.c; ++c)
      for (int64_t oy = 0; oy < out.h; ++oy) {
        int64_t hs = adaptive_start(oy, x.h, out.h), he = adaptive_end(oy, x.h, out.h);
        for (int64_t ox = 0; ox < out.w; ++ox) {
          int64_t ws = adaptive_start(ox, x.w, out.w), we = adaptive_end(ox, x.w, out.w);
          double count = double((he - hs) * (we - ws));
          for (int64_t iy = hs; iy < he; ++iy)
            for (int64_t ix = ws; ix < we; ++ix) fn(n, c, oy, ox, iy, ix, count);
        }
      }
}

}  // namespace

void RefBackend::adaptive_avg_pool2d(const Tensor& x, const Tensor& out) {
  Dims4 dx(x), dout(out);
  std::vector<double> xv = read_all(x), ov(size_t(dout.numel()), 0.0);
  for_each_adaptive_term(
      dx, dout,
      [&](int64_t n, int64_t c, int64_t oy, int64_t ox, int64_t iy, int64_t ix, double count) {
        ov[dout.at(n, c, oy, ox)] += xv[dx.at(n, c, iy, ix)] / count;
      });
  write_all(out, ov);
}

// Forward: out = mean of the window. Backward: each window input += grad_out / count.
void RefBackend::adaptive_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x) {
  Dims4 dx(grad_x), dout(grad_out);
  std::vector<double> gv = read_all(grad_out), gx(size_t(dx.numel()), 0.0);
  for_each_adaptive_term(
      dx, dout,
      [&](int64_t n, int64_t c, int64_t oy, int64_t ox, int64_t iy, int64_t ix, double count) {
        gx[dx.at(n, c, iy, ix)] += gv[dout.at(n, c, oy, ox)] / count;
      });
  write_all(grad_x, gx);
}

namespace {

// Per-channel sums over (N, H, W) of a row-major [N, C, H, W] array.
std::vector<double> channel_sums(const Dims4& d, const std::vector<double>& v) {
  std::vector<double> s(size_t(d.c), 0.0);
  for (int64_t k = 0; k < d.numel(); ++k) s[d.channel(k)] += v[k];
  return s;
}

}  // namespace

namespace {

// out = (x - mean) / sqrt(var + eps) * gamma + beta per channel (then relu), in place.
void normalize(const Dims4& d, std::vector<double>& v, const std::vector<double>& mu,
               const std::vector<double>& va, const Tensor& gamma, const Tensor& beta, double eps,
               bool relu) {
  std::vector<double> g = read_all(gamma), b = read_all(beta);
  for (int64_t k = 0; k < d.numel(); ++k) {
    int64_t c = d.channel(k);
    v[k] = (v[k] - mu[c]) / std::sqrt(va[c] + eps) * g[c] + b[c];
    if (relu) v[k] = std::max(v[k], 0.0);
  }
}

}  // namespace

void RefBackend::batch_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                    double eps, bool fuse_relu, const Tensor& out,
                                    const Tensor& mean, const Tensor& var) {
  Dims4 d(x);
  double m = double(d.n * d.h * d.w);
  std::vector<double> xv = read_all(x);
  std::vector<double> mu = channel_sums(d, xv);
  for (double& v : mu) v /= m;
  std::vector<double> sq(xv.size());
  for (int64_t k = 0; k < d.numel(); ++k) sq[k] = std::pow(xv[k] - mu[d.channel(k)], 2);
  std::vector<double> va = channel_sums(d, sq);
  for (double& v : va) v /= m;
  normalize(d, xv, mu, va, gamma, beta, eps, fuse_relu);
  write_all(out, xv);
  write_all(mean, mu);
  write_all(var, va);
}

void RefBackend::batch_norm_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var,
                                      double eps, const Tensor& out) {
  Dims4 d(x);
  std::vector<double> xv = read_all(x);
  normalize(d, xv, read_all(running_mean), read_all(running_var), gamma, beta, eps, false);
  write_all(out, xv);
}

// Forward: xhat = (x - mean) * invstd, out = gamma * xhat + beta, with mean
// and var over the M = N*H*W values of a channel (invstd = 1/sqrt(var + eps)).
// Backward: grad_beta = sum g, grad_gamma = sum g * xhat,
//   grad_x = gamma * invstd / M * (M * g - grad_beta - xhat * grad_gamma).
void RefBackend::batch_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& gamma,
                                     const Tensor& mean, const Tensor& var, double eps,
                                     const Tensor& grad_x, const Tensor& grad_gamma,
                                     const Tensor& grad_beta) {
  Dims4 d(x);
  double m = double(d.n * d.h * d.w);
  std::vector<double> gv = read_all(grad_out), xv = read_all(x), g = read_all(gamma);
  std::vector<double> mu = read_all(mean), invstd = read_all(var);
  for (double& v : invstd) v = 1.0 / std::sqrt(v + eps);
  std::vector<double> xhat(xv.size()), gxhat(xv.size());
  for (int64_t k = 0; k < d.numel(); ++k) {
    int64_t c = d.channel(k);
    xhat[k] = (xv[k] - mu[c]) * invstd[c];
    gxhat[k] = gv[k] * xhat[k];
  }
  std::vector<double> gb = channel_sums(d, gv), gg = channel_sums(d, gxhat);
  for (int64_t k = 0; k < d.numel(); ++k) {
    int64_t c = d.channel(k);
    xv[k] = math::batch_norm_grad_x(g[c], invstd[c], m, gv[k], gb[c], xhat[k], gg[c]);
  }
  write_all(grad_x, xv);
  write_all(grad_gamma, gg);
  write_all(grad_beta, gb);
}

}  // namespace trainer
