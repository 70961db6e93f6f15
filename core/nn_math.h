// Per-element formulas of the softmax, loss, normalisation and pooling
// kernels, written once for host and device (docs/architecture.md "Devices"), as
// core/elementwise_math.h is for the elementwise ops: RefBackend (core/ref)
// and the CUDA kernels (core/cuda) call them, so the CPU gradient checks
// test the formulas the GPU runs. The reductions around
// them (row maxima, sums, channel statistics) belong to each backend; these
// are the steps from the reduced values to one output element, where a sign
// or a factor is easy to get wrong. T is the compute type (float or double).
#pragma once

#include <stdint.h>

#include "core/hd.h"

namespace trainer::math {

// softmax backward from y: gx = y (g - sum_row(g y)); log_softmax from
// y = log p: gx = g - exp(y) sum_row(g). `dot` is the row sum named above.
template <class T>
TRAINER_HD T softmax_grad(bool log, T g, T y, T dot, T exp_y) {
  return log ? g - exp_y * dot : y * (g - dot);
}

// Label-smoothed target probability of class c when the target is t:
// q_c = (1 - eps) [c == t] + eps / C.
template <class T>
TRAINER_HD T smoothed_target(int64_t c, int64_t t, T eps, int64_t classes) {
  return (c == t ? T(1) - eps : T(0)) + eps / T(classes);
}

// Cross-entropy loss of one row from its log-probabilities:
// -sum_c q_c logp_c = -((1 - eps) logp_t + eps / C sum_c logp_c).
template <class T>
TRAINER_HD T cross_entropy_loss(T logp_target, T sum_logp, T eps, int64_t classes) {
  return -((T(1) - eps) * logp_target + eps / T(classes) * sum_logp);
}

// Layer norm backward, one element: with gw = g w,
// gx = rstd (gw - mean_D(gw) - xhat mean_D(gw xhat)).
template <class T>
TRAINER_HD T layer_norm_grad_x(T rstd, T gw, T mean_gw, T xhat, T mean_gw_xhat) {
  return rstd * (gw - mean_gw - xhat * mean_gw_xhat);
}

// RMS norm backward, one element: with gw = g w and xhat = x rstd,
// gx = rstd (gw - xhat mean_D(gw xhat)).
template <class T>
TRAINER_HD T rms_norm_grad_x(T rstd, T gw, T xhat, T mean_gw_xhat) {
  return rstd * (gw - xhat * mean_gw_xhat);
}

// The rotary embedding's angle at position pos for a pair of frequency
// inv_freq: the product rounded to f32, as Hugging Face computes it.
TRAINER_HD float rope_angle(int64_t pos, float inv_freq) { return float(pos) * inv_freq; }

// One pair (x0, x1) = (x[i], x[i + HD/2]) of a head turned by the angle
// whose cosine and sine are c and s (s negated: the backward's turn back):
// (x0 c - x1 s, x1 c + x0 s).
template <class T>
TRAINER_HD void rope_rotate(T x0, T x1, T c, T s, T& y0, T& y1) {
  y0 = x0 * c - x1 * s;
  y1 = x1 * c + x0 * s;
}

// Batch norm backward, one element, over the m = N H W values of a channel:
// gx = gamma invstd / m (m g - sum(g) - xhat sum(g xhat)).
template <class T>
TRAINER_HD T batch_norm_grad_x(T gamma, T invstd, T m, T g, T sum_g, T xhat, T sum_g_xhat) {
  return gamma * invstd / m * (m * g - sum_g - xhat * sum_g_xhat);
}

// PyTorch's avg_pool2d divisor for the window starting at (hs, ws) (may be
// negative: padding) of size (kh, kw) on an h x w image padded by (ph, pw):
// the window clipped to the padded image, or to the image itself when
// padding does not count.
TRAINER_HD int64_t avg_pool_divisor(int64_t hs, int64_t ws, int64_t kh, int64_t kw, int64_t h,
                                    int64_t w, int64_t ph, int64_t pw, bool count_include_pad) {
  int64_t he = hs + kh < h + ph ? hs + kh : h + ph;
  int64_t we = ws + kw < w + pw ? ws + kw : w + pw;
  if (!count_include_pad) {
    hs = hs > 0 ? hs : 0, ws = ws > 0 ? ws : 0;
    he = he < h ? he : h, we = we < w ? we : w;
  }
  return (he - hs) * (we - ws);
}

}  // namespace trainer::math
