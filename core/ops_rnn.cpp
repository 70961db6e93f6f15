// LSTM and GRU layers as autograd ops over the backend's fused recurrent
// kernels (core/backend.h, section "recurrent").
#include "core/ops_rnn.h"

#include "core/autocast.h"

namespace trainer {

using autograd::GradMask;

namespace {

Tensor grad_or_zeros(const Tensor& g, const Tensor& like) {
  return g.defined() ? g.contiguous() : zeros(like.shape(), like.dtype(), like.device());
}

// y, h_n, c_n = LSTM(x, h0, c0) with [i f g o] = x W_ih^T + b_ih + h W_hh^T
// + b_hh. Backward: backpropagation through time in the backend; b_ih and
// b_hh get the same gradient (they enter as their sum).
struct LSTMFn {
  struct Saved {
    Tensor x, h0, c0, weight_ih, weight_hh, bias, y, record;
  };
  static constexpr const char* name = "lstm_layer";
  static TensorList forward(Saved& s, const Tensor& x, const Tensor& h0, const Tensor& c0,
                            const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias_ih,
                            const Tensor& bias_hh, bool training) {
    int64_t B = x.size(0), T = x.size(1), H = h0.size(1);
    Tensor bias = (bias_ih + bias_hh).contiguous();
    Tensor y = empty({B, T, H}, x.dtype(), x.device());
    Tensor h_n = empty_like(h0), c_n = empty_like(c0);
    Tensor record = backend(x.device())
                        .lstm_forward(x, h0, c0, weight_ih, weight_hh, bias, training, y, h_n, c_n);
    if (training) s = Saved{x, h0, c0, weight_ih, weight_hh, bias, y, record};
    return {y, h_n, c_n};
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_x = empty_like(s.x), grad_h0 = empty_like(s.h0), grad_c0 = empty_like(s.c0);
    Tensor grad_wih = empty_like(s.weight_ih), grad_whh = empty_like(s.weight_hh);
    Tensor grad_bias = empty_like(s.bias);
    backend(s.x.device())
        .lstm_backward(grad_or_zeros(g[0], s.y), grad_or_zeros(g[1], s.h0),
                       grad_or_zeros(g[2], s.c0), s.x, s.h0, s.c0, s.weight_ih, s.weight_hh, s.bias,
                       s.y, s.record, grad_x, grad_h0, grad_c0, grad_wih, grad_whh, grad_bias);
    return {grad_x, grad_h0, grad_c0, grad_wih, grad_whh, grad_bias, grad_bias};
  }
};

// y, h_n = GRU(x, h0), gates r, z, n with n = tanh(gi_n + r gh_n).
// Backward: backpropagation through time in the backend.
struct GRUFn {
  struct Saved {
    Tensor x, h0, weight_ih, weight_hh, bias_ih, bias_hh, y, record;
  };
  static constexpr const char* name = "gru_layer";
  static TensorList forward(Saved& s, const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                            const Tensor& weight_hh, const Tensor& bias_ih, const Tensor& bias_hh,
                            bool training) {
    int64_t B = x.size(0), T = x.size(1), H = h0.size(1);
    Tensor y = empty({B, T, H}, x.dtype(), x.device());
    Tensor h_n = empty_like(h0);
    Tensor record =
        backend(x.device())
            .gru_forward(x, h0, weight_ih, weight_hh, bias_ih, bias_hh, training, y, h_n);
    if (training) s = Saved{x, h0, weight_ih, weight_hh, bias_ih, bias_hh, y, record};
    return {y, h_n};
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_x = empty_like(s.x), grad_h0 = empty_like(s.h0);
    Tensor grad_wih = empty_like(s.weight_ih), grad_whh = empty_like(s.weight_hh);
    Tensor grad_bih = empty_like(s.bias_ih), grad_bhh = empty_like(s.bias_hh);
    backend(s.x.device())
        .gru_backward(grad_or_zeros(g[0], s.y), grad_or_zeros(g[1], s.h0), s.x, s.h0, s.weight_ih,
                      s.weight_hh, s.bias_ih, s.bias_hh, s.y, s.record, grad_x, grad_h0, grad_wih,
                      grad_whh, grad_bih, grad_bhh);
    return {grad_x, grad_h0, grad_wih, grad_whh, grad_bih, grad_bhh};
  }
};

// Validates one layer's operands; returns H.
int64_t check_layer(const char* op, int64_t gates, const Tensor& x, const Tensor& h0,
                    const Tensor& weight_ih, const Tensor& weight_hh, const Tensor& bias_ih,
                    const Tensor& bias_hh) {
  CHECK(x.defined() && h0.defined() && weight_ih.defined() && weight_hh.defined())
      << op << ": undefined tensor";
  CHECK(is_floating(x.dtype())) << op << " needs a floating input, got " << x.dtype();
  CHECK(x.dim() == 3 && x.size(0) >= 1 && x.size(1) >= 1)
      << op << ": x " << x.shape_str() << " must be [B, T, I] with B, T >= 1";
  CHECK(h0.dim() == 2 && h0.size(0) == x.size(0) && h0.size(1) >= 1)
      << op << ": h0 " << h0.shape_str() << " must be [B, H] for x " << x.shape_str();
  int64_t H = h0.size(1), I = x.size(2);
  CHECK((weight_ih.shape() == Shape{gates * H, I} && weight_hh.shape() == Shape{gates * H, H}))
      << op << ": weight_ih " << weight_ih.shape_str() << " and weight_hh " << weight_hh.shape_str()
      << " must be [" << gates * H << ", " << I << "] and [" << gates * H << ", " << H << "]";
  for (const Tensor& t : {h0, weight_ih, weight_hh, bias_ih, bias_hh}) {
    if (!t.defined()) continue;
    CHECK(t.dtype() == x.dtype() && t.device() == x.device())
        << op << ": operands mix " << x.dtype() << " on " << x.device() << " with " << t.dtype()
        << " on " << t.device();
  }
  for (const Tensor& b : {bias_ih, bias_hh})
    CHECK(!b.defined() || b.shape() == Shape{gates * H})
        << op << ": bias " << b.shape_str() << " must be [" << gates * H << "]";
  return H;
}

Tensor bias_or_zeros(const Tensor& b, int64_t n, const Tensor& like) {
  return b.defined() ? b.contiguous() : zeros({n}, like.dtype(), like.device());
}

bool records_graph(const TensorList& inputs) {
  if (!autograd::grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

}  // namespace

LSTMOutput lstm_layer(const Tensor& x_in, const Tensor& h0_in, const Tensor& c0_in,
                      const Tensor& weight_ih_in, const Tensor& weight_hh_in,
                      const Tensor& bias_ih_in, const Tensor& bias_hh_in) {
  Tensor x = autocast_lower(x_in), h0 = autocast_lower(h0_in), c0 = autocast_lower(c0_in);
  Tensor weight_ih = autocast_lower(weight_ih_in), weight_hh = autocast_lower(weight_hh_in);
  Tensor bias_ih = autocast_lower(bias_ih_in), bias_hh = autocast_lower(bias_hh_in);
  int64_t H = check_layer("lstm_layer", 4, x, h0, weight_ih, weight_hh, bias_ih, bias_hh);
  CHECK(c0.defined() && c0.shape() == h0.shape() && c0.dtype() == x.dtype() &&
        c0.device() == x.device())
      << "lstm_layer: c0 " << (c0.defined() ? c0.shape_str() : "undefined") << " must match h0 "
      << h0.shape_str();
  bool training = records_graph({x, h0, c0, weight_ih, weight_hh, bias_ih, bias_hh});
  TensorList out = autograd::apply<LSTMFn>(x.contiguous(), h0.contiguous(), c0.contiguous(),
                                           weight_ih.contiguous(), weight_hh.contiguous(),
                                           bias_or_zeros(bias_ih, 4 * H, x),
                                           bias_or_zeros(bias_hh, 4 * H, x), training);
  return {out[0], out[1], out[2]};
}

GRUOutput gru_layer(const Tensor& x_in, const Tensor& h0_in, const Tensor& weight_ih_in,
                    const Tensor& weight_hh_in, const Tensor& bias_ih_in,
                    const Tensor& bias_hh_in) {
  Tensor x = autocast_lower(x_in), h0 = autocast_lower(h0_in);
  Tensor weight_ih = autocast_lower(weight_ih_in), weight_hh = autocast_lower(weight_hh_in);
  Tensor bias_ih = autocast_lower(bias_ih_in), bias_hh = autocast_lower(bias_hh_in);
  int64_t H = check_layer("gru_layer", 3, x, h0, weight_ih, weight_hh, bias_ih, bias_hh);
  bool training = records_graph({x, h0, weight_ih, weight_hh, bias_ih, bias_hh});
  TensorList out = autograd::apply<GRUFn>(x.contiguous(), h0.contiguous(), weight_ih.contiguous(),
                                          weight_hh.contiguous(), bias_or_zeros(bias_ih, 3 * H, x),
                                          bias_or_zeros(bias_hh, 3 * H, x), training);
  return {out[0], out[1]};
}

}  // namespace trainer
