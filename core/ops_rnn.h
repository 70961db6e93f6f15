// Recurrent ops: one LSTM layer and one GRU layer over a whole sequence,
// single direction, batch first, with PyTorch's semantics, gate orders and
// parameter shapes (torch.nn.LSTM / torch.nn.GRU, one layer). Forward and
// backward run through the backend's fused kernels (core/backend.h, section
// "recurrent"); every input gets a gradient.
//
//   LSTMOutput o = lstm_layer(x, h0, c0, w_ih, w_hh, b_ih, b_hh);  // o.y [B, T, H]
//   GRUOutput g = gru_layer(x, h0, w_ih, w_hh, b_ih, b_hh);          // g.y [B, T, H]
//
// Glossary: B batch, T time steps, I input width, H hidden width, G gates
// (4 for LSTM, 3 for GRU).
//
// LSTM, gates in the order i, f, g, o (rows [k H, (k + 1) H) of the weights):
//   [i f g o] = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh
//   c_t = sigmoid(f) c_{t-1} + sigmoid(i) tanh(g),  h_t = sigmoid(o) tanh(c_t)
// GRU, gates in the order r, z, n:
//   r = sigmoid(x W_ir^T + b_ir + h W_hr^T + b_hr)
//   z = sigmoid(x W_iz^T + b_iz + h W_hz^T + b_hz)
//   n = tanh(x W_in^T + b_in + r (h W_hn^T + b_hn))
//   h_t = (1 - z) n + z h_{t-1}
#pragma once

#include "core/ops.h"

namespace trainer {

struct LSTMOutput {
  Tensor y;  // [B, T, H]: h_t of every step
  Tensor h;  // [B, H]: h_T
  Tensor c;  // [B, H]: c_T
};

struct GRUOutput {
  Tensor y;  // [B, T, H]
  Tensor h;  // [B, H]: h_T
};

// x [B, T, I], h0 and c0 [B, H], weight_ih [4H, I], weight_hh [4H, H],
// bias_ih and bias_hh [4H] (either may be undefined: no bias). Any strides;
// all tensors of one floating dtype on one device.
LSTMOutput lstm_layer(const Tensor& x, const Tensor& h0, const Tensor& c0, const Tensor& weight_ih,
                      const Tensor& weight_hh, const Tensor& bias_ih, const Tensor& bias_hh);

// x [B, T, I], h0 [B, H], weight_ih [3H, I], weight_hh [3H, H], bias_ih and
// bias_hh [3H] (either may be undefined).
GRUOutput gru_layer(const Tensor& x, const Tensor& h0, const Tensor& weight_ih,
                    const Tensor& weight_hh, const Tensor& bias_ih, const Tensor& bias_hh);

}  // namespace trainer
