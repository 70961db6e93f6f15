// Reference LSTM and GRU layers: step by step, in double, with the matrix
// products written as loops. Forward records nothing; backward recomputes
// the forward's trace and walks it back (backpropagation through time).
#include <cmath>
#include <vector>

#include "core/ref/ref_backend.h"
#include "core/ref/ref_util.h"

namespace trainer {

namespace {

std::vector<double> read(const Tensor& t) {
  std::vector<double> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[size_t(i)] = ref::get(t, i);
  return v;
}

void write(const Tensor& t, const std::vector<double>& v) {
  for (int64_t i = 0; i < t.numel(); ++i) ref::set(t, i, v[size_t(i)]);
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Sizes of one layer: x [B, T, I], hidden width H, G gates.
struct Dims {
  int64_t B, T, I, H, G;
};

Dims dims_of(const Tensor& x, const Tensor& h0, int64_t gates) {
  return {x.size(0), x.size(1), x.size(2), h0.size(1), gates};
}

// out[b][g] = sum_k a[b][k] w[g][k] + bias[g] for one step: a [B, K] at
// a_row(b), w [G H, K].
template <class Row>
void project(const Dims& d, int64_t K, Row a_row, const std::vector<double>& w,
             const std::vector<double>& bias, std::vector<double>& out) {
  int64_t GH = d.G * d.H;
  for (int64_t b = 0; b < d.B; ++b) {
    const double* a = a_row(b);
    for (int64_t g = 0; g < GH; ++g) {
      double s = bias[size_t(g)];
      for (int64_t k = 0; k < K; ++k) s += a[k] * w[size_t(g * K + k)];
      out[size_t(b * GH + g)] = s;
    }
  }
}

// The forward of one layer, kept for the backward. h and c hold steps
// 0..T ([T + 1][B][H], step 0 the initial state); gates [T][B][G H] hold
// the activated gates (GRU: r, z, n, then gh_n in a fourth block).
struct Trace {
  std::vector<double> h, c, gates;
};

// [i f g o] = x_t W_ih^T + h W_hh^T + bias; c' = f c + i g; h' = o tanh(c').
Trace lstm_trace(const Dims& d, const std::vector<double>& x, const std::vector<double>& wih,
                 const std::vector<double>& whh, const std::vector<double>& bias,
                 const std::vector<double>& h0, const std::vector<double>& c0) {
  int64_t B = d.B, T = d.T, I = d.I, H = d.H, BH = B * H;
  Trace tr;
  tr.h.assign(size_t((T + 1) * BH), 0.0);
  tr.c.assign(size_t((T + 1) * BH), 0.0);
  tr.gates.assign(size_t(T * B * 4 * H), 0.0);
  std::copy(h0.begin(), h0.end(), tr.h.begin());
  std::copy(c0.begin(), c0.end(), tr.c.begin());
  std::vector<double> xi(size_t(B * 4 * H)), hh(size_t(B * 4 * H)), zero(size_t(4 * H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    project(
        d, I, [&](int64_t b) { return &x[size_t((b * T + t) * I)]; }, wih, bias, xi);
    project(
        d, H, [&](int64_t b) { return &tr.h[size_t(t * BH + b * H)]; }, whh, zero, hh);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < H; ++j) {
        double a[4];
        for (int k = 0; k < 4; ++k) {
          size_t at = size_t(b * 4 * H + k * H + j);
          a[k] = k == 2 ? std::tanh(xi[at] + hh[at]) : sigmoid(xi[at] + hh[at]);
          tr.gates[size_t(t * B * 4 * H) + at] = a[k];
        }
        double c = a[1] * tr.c[size_t(t * BH + b * H + j)] + a[0] * a[2];
        tr.c[size_t((t + 1) * BH + b * H + j)] = c;
        tr.h[size_t((t + 1) * BH + b * H + j)] = a[3] * std::tanh(c);
      }
    }
  }
  return tr;
}

// gi = x_t W_ih^T + b_ih, gh = h W_hh^T + b_hh; r = sig(gi_r + gh_r),
// z = sig(gi_z + gh_z), n = tanh(gi_n + r gh_n), h' = (1 - z) n + z h.
Trace gru_trace(const Dims& d, const std::vector<double>& x, const std::vector<double>& wih,
                const std::vector<double>& whh, const std::vector<double>& bih,
                const std::vector<double>& bhh, const std::vector<double>& h0) {
  int64_t B = d.B, T = d.T, I = d.I, H = d.H, BH = B * H;
  Trace tr;
  tr.h.assign(size_t((T + 1) * BH), 0.0);
  tr.gates.assign(size_t(T * B * 4 * H), 0.0);
  std::copy(h0.begin(), h0.end(), tr.h.begin());
  std::vector<double> gi(size_t(B * 3 * H)), gh(size_t(B * 3 * H));
  for (int64_t t = 0; t < T; ++t) {
    project(
        d, I, [&](int64_t b) { return &x[size_t((b * T + t) * I)]; }, wih, bih, gi);
    project(
        d, H, [&](int64_t b) { return &tr.h[size_t(t * BH + b * H)]; }, whh, bhh, gh);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < H; ++j) {
        size_t at = size_t(b * 3 * H + j);
        double r = sigmoid(gi[at] + gh[at]);
        double z = sigmoid(gi[at + size_t(H)] + gh[at + size_t(H)]);
        double ghn = gh[at + size_t(2 * H)];
        double n = std::tanh(gi[at + size_t(2 * H)] + r * ghn);
        double* g = &tr.gates[size_t((t * B + b) * 4 * H + j)];
        g[0] = r;
        g[H] = z;
        g[2 * H] = n;
        g[3 * H] = ghn;
        double hp = tr.h[size_t(t * BH + b * H + j)];
        tr.h[size_t((t + 1) * BH + b * H + j)] = (1.0 - z) * n + z * hp;
      }
    }
  }
  return tr;
}

// Accumulates the weight, bias and input gradients of one step from the
// pre-activation gradients dpre [B, G H]: gw_ih += dpre^T x_t,
// gw_hh += dpre_h^T h_{t-1}, gx_t = dpre W_ih, dh_prev += dpre_h W_hh (dpre_h
// is dpre for LSTM and differs in the n block for GRU).
void accumulate_step(const Dims& d, int64_t t, const std::vector<double>& dpre,
                     const std::vector<double>& dpre_h, const std::vector<double>& x,
                     const double* h_prev, const std::vector<double>& wih,
                     const std::vector<double>& whh, std::vector<double>& gwih,
                     std::vector<double>& gwhh, std::vector<double>& gbih,
                     std::vector<double>& gbhh, std::vector<double>& gx,
                     std::vector<double>& dh_prev) {
  int64_t B = d.B, T = d.T, I = d.I, H = d.H, GH = d.G * d.H;
  for (int64_t b = 0; b < B; ++b) {
    const double* xt = &x[size_t((b * T + t) * I)];
    double* gxt = &gx[size_t((b * T + t) * I)];
    for (int64_t g = 0; g < GH; ++g) {
      double di = dpre[size_t(b * GH + g)], dh = dpre_h[size_t(b * GH + g)];
      gbih[size_t(g)] += di;
      gbhh[size_t(g)] += dh;
      for (int64_t i = 0; i < I; ++i) {
        gwih[size_t(g * I + i)] += di * xt[i];
        gxt[i] += di * wih[size_t(g * I + i)];
      }
      for (int64_t k = 0; k < H; ++k) {
        gwhh[size_t(g * H + k)] += dh * h_prev[b * H + k];
        dh_prev[size_t(b * H + k)] += dh * whh[size_t(g * H + k)];
      }
    }
  }
}

}  // namespace

Tensor RefBackend::lstm_forward(const Tensor& x, const Tensor& h0, const Tensor& c0,
                                const Tensor& weight_ih, const Tensor& weight_hh,
                                const Tensor& bias, bool, const Tensor& y, const Tensor& h_n,
                                const Tensor& c_n) {
  Dims d = dims_of(x, h0, 4);
  Trace tr =
      lstm_trace(d, read(x), read(weight_ih), read(weight_hh), read(bias), read(h0), read(c0));
  int64_t BH = d.B * d.H;
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t j = 0; j < d.H; ++j)
        ref::set(y, (b * d.T + t) * d.H + j, tr.h[size_t((t + 1) * BH + b * d.H + j)]);
  for (int64_t k = 0; k < BH; ++k) {
    ref::set(h_n, k, tr.h[size_t(d.T * BH + k)]);
    ref::set(c_n, k, tr.c[size_t(d.T * BH + k)]);
  }
  return Tensor();
}

// Per step, last first, with dh = grad_y_t + dh_next and tc = tanh(c_t):
//   dc = dc_next + dh o (1 - tc^2)
//   di = dc g i (1 - i), df = dc c_{t-1} f (1 - f), dg = dc i (1 - g^2),
//   do = dh tc o (1 - o);  dc_next = dc f;  dh_next = [di df dg do] W_hh
void RefBackend::lstm_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& grad_c_n,
                               const Tensor& x, const Tensor& h0, const Tensor& c0,
                               const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias,
                               const Tensor&, const Tensor&, const Tensor& grad_x,
                               const Tensor& grad_h0, const Tensor& grad_c0,
                               const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                               const Tensor& grad_bias) {
  Dims d = dims_of(x, h0, 4);
  int64_t B = d.B, T = d.T, H = d.H, BH = B * H, GH = 4 * H;
  std::vector<double> xv = read(x), wih = read(weight_ih), whh = read(weight_hh);
  Trace tr = lstm_trace(d, xv, wih, whh, read(bias), read(h0), read(c0));
  std::vector<double> gy = read(grad_y), dh_next = read(grad_h_n), dc_next = read(grad_c_n);
  std::vector<double> gwih(wih.size(), 0.0), gwhh(whh.size(), 0.0), gb(size_t(GH), 0.0);
  std::vector<double> gb_unused(size_t(GH), 0.0), gx(xv.size(), 0.0);
  std::vector<double> dpre(size_t(B * GH));
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < H; ++j) {
        const double* a = &tr.gates[size_t((t * B + b) * GH + j)];
        double i = a[0], f = a[H], g = a[2 * H], o = a[3 * H];
        double c = tr.c[size_t((t + 1) * BH + b * H + j)];
        double cp = tr.c[size_t(t * BH + b * H + j)];
        double tc = std::tanh(c);
        double dh = gy[size_t((b * T + t) * H + j)] + dh_next[size_t(b * H + j)];
        double dc = dc_next[size_t(b * H + j)] + dh * o * (1.0 - tc * tc);
        double* dp = &dpre[size_t(b * GH + j)];
        dp[0] = dc * g * i * (1.0 - i);
        dp[H] = dc * cp * f * (1.0 - f);
        dp[2 * H] = dc * i * (1.0 - g * g);
        dp[3 * H] = dh * tc * o * (1.0 - o);
        dc_next[size_t(b * H + j)] = dc * f;
      }
    }
    std::fill(dh_next.begin(), dh_next.end(), 0.0);
    accumulate_step(d, t, dpre, dpre, xv, &tr.h[size_t(t * BH)], wih, whh, gwih, gwhh, gb,
                    gb_unused, gx, dh_next);
  }
  write(grad_x, gx);
  write(grad_h0, dh_next);
  write(grad_c0, dc_next);
  write(grad_weight_ih, gwih);
  write(grad_weight_hh, gwhh);
  write(grad_bias, gb);
}

Tensor RefBackend::gru_forward(const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                               const Tensor& weight_hh, const Tensor& bias_ih,
                               const Tensor& bias_hh, bool, const Tensor& y, const Tensor& h_n) {
  Dims d = dims_of(x, h0, 3);
  Trace tr = gru_trace(d, read(x), read(weight_ih), read(weight_hh), read(bias_ih), read(bias_hh),
                       read(h0));
  int64_t BH = d.B * d.H;
  for (int64_t t = 0; t < d.T; ++t)
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t j = 0; j < d.H; ++j)
        ref::set(y, (b * d.T + t) * d.H + j, tr.h[size_t((t + 1) * BH + b * d.H + j)]);
  for (int64_t k = 0; k < BH; ++k) ref::set(h_n, k, tr.h[size_t(d.T * BH + k)]);
  return Tensor();
}

// Per step, last first, with dh = grad_y_t + dh_next:
//   dn = dh (1 - z) (1 - n^2),  dz = dh (h_{t-1} - n) z (1 - z),
//   dr = dn gh_n r (1 - r);  d(gi) = [dr dz dn], d(gh) = [dr dz dn r];
//   dh_next = dh z + d(gh) W_hh
void RefBackend::gru_backward(const Tensor& grad_y, const Tensor& grad_h_n, const Tensor& x,
                              const Tensor& h0, const Tensor& weight_ih, const Tensor& weight_hh,
                              const Tensor& bias_ih, const Tensor& bias_hh, const Tensor&,
                              const Tensor&, const Tensor& grad_x, const Tensor& grad_h0,
                              const Tensor& grad_weight_ih, const Tensor& grad_weight_hh,
                              const Tensor& grad_bias_ih, const Tensor& grad_bias_hh) {
  Dims d = dims_of(x, h0, 3);
  int64_t B = d.B, T = d.T, H = d.H, BH = B * H, GH = 3 * H;
  std::vector<double> xv = read(x), wih = read(weight_ih), whh = read(weight_hh);
  Trace tr = gru_trace(d, xv, wih, whh, read(bias_ih), read(bias_hh), read(h0));
  std::vector<double> gy = read(grad_y), dh_next = read(grad_h_n);
  std::vector<double> gwih(wih.size(), 0.0), gwhh(whh.size(), 0.0);
  std::vector<double> gbih(size_t(GH), 0.0), gbhh(size_t(GH), 0.0), gx(xv.size(), 0.0);
  std::vector<double> dgi(size_t(B * GH)), dgh(size_t(B * GH)), dh_direct(static_cast<size_t>(BH));
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < H; ++j) {
        const double* a = &tr.gates[size_t((t * B + b) * 4 * H + j)];
        double r = a[0], z = a[H], n = a[2 * H], ghn = a[3 * H];
        double hp = tr.h[size_t(t * BH + b * H + j)];
        double dh = gy[size_t((b * T + t) * H + j)] + dh_next[size_t(b * H + j)];
        double dn = dh * (1.0 - z) * (1.0 - n * n);
        double dz = dh * (hp - n) * z * (1.0 - z);
        double dr = dn * ghn * r * (1.0 - r);
        size_t at = size_t(b * GH + j);
        dgi[at] = dgh[at] = dr;
        dgi[at + size_t(H)] = dgh[at + size_t(H)] = dz;
        dgi[at + size_t(2 * H)] = dn;
        dgh[at + size_t(2 * H)] = dn * r;
        dh_direct[size_t(b * H + j)] = dh * z;
      }
    }
    dh_next = dh_direct;
    accumulate_step(d, t, dgi, dgh, xv, &tr.h[size_t(t * BH)], wih, whh, gwih, gwhh, gbih, gbhh, gx,
                    dh_next);
  }
  write(grad_x, gx);
  write(grad_h0, dh_next);
  write(grad_weight_ih, gwih);
  write(grad_weight_hh, gwhh);
  write(grad_bias_ih, gbih);
  write(grad_bias_hh, gbhh);
}

}  // namespace trainer
