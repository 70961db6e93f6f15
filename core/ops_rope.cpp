// The rotary position embedding (core/ops_transformer.h): its frequencies,
// computed as transformers computes them, and the op, forward and backward
// through the backend's kernels (section "rotary embedding").
#include <cmath>
#include <numbers>

#include "core/backend.h"
#include "core/ops_transformer.h"

namespace trainer {

using autograd::GradMask;

namespace {

// f32 arithmetic rounded after every step, as torch's elementwise kernels
// round it: the volatile round trip keeps the compiler from fusing a product
// into the next sum (a multiply-add rounds once where torch rounds twice).
float rounded(float v) {
  volatile float r = v;
  return r;
}
float f32_mul(float a, float b) { return rounded(a * b); }
float f32_div(float a, float b) { return rounded(a / b); }
float f32_sub(float a, float b) { return rounded(a - b); }
float f32_add(float a, float b) { return rounded(a + b); }

// transformers' _compute_llama3_parameters for one frequency (its tensor
// expressions in f32, `s / t` evaluated as torch does: t.reciprocal() * s).
float llama3_inv_freq(float inv_freq, const RopeOptions& o) {
  const float factor = float(o.factor), low = float(o.low_freq_factor);
  const float context = float(o.original_max_position);
  const float low_freq_wavelen = float(double(o.original_max_position) / o.low_freq_factor);
  const float high_freq_wavelen = float(double(o.original_max_position) / o.high_freq_factor);
  const float wavelen = f32_mul(f32_div(1.0f, inv_freq), float(2 * std::numbers::pi));
  const float scaled = wavelen > low_freq_wavelen ? f32_div(inv_freq, factor) : inv_freq;
  const float smooth = f32_div(f32_sub(f32_mul(f32_div(1.0f, wavelen), context), low),
                               float(o.high_freq_factor - o.low_freq_factor));
  const float smoothed =
      f32_add(f32_div(f32_mul(f32_sub(1.0f, smooth), scaled), factor), f32_mul(smooth, scaled));
  const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
  return medium ? smoothed : scaled;
}

// out = each head's pairs of x turned by the angles (Backend::rope_forward);
// the backward turns the gradient back (Backend::rope_backward).
struct RopeFn {
  struct Saved {
    Tensor positions;
    RopeAttrs attrs;
  };
  static constexpr const char* name = "rotary_embedding";
  static Tensor forward(Saved& s, const Tensor& x, const Tensor& positions,
                        const RopeAttrs& attrs) {
    Tensor out = empty(x.shape(), x.dtype(), x.device());
    if (x.numel() > 0) backend(x.device()).rope_forward(x, positions, attrs, out);
    s = Saved{positions, attrs};
    return out;
  }
  static TensorList backward(Saved& s, const TensorList& g, const GradMask&) {
    Tensor grad_out = g[0].contiguous();
    Tensor grad_x = empty(grad_out.shape(), grad_out.dtype(), grad_out.device());
    if (grad_x.numel() > 0)
      backend(grad_x.device()).rope_backward(grad_out, s.positions, s.attrs, grad_x);
    return {grad_x, Tensor()};
  }
};

}  // namespace

std::vector<float> rope_inv_freq(int64_t head_dim, const RopeOptions& o) {
  CHECK(head_dim >= 2 && head_dim % 2 == 0)
      << "rotary_embedding: head width " << head_dim << " is not even";
  CHECK(o.theta > 0.0) << "rotary_embedding: theta " << o.theta << " is not positive";
  CHECK(o.scaling == "none" || o.scaling == "linear" || o.scaling == "llama3")
      << "rotary_embedding: scaling '" << o.scaling << "' (none, linear or llama3)";
  CHECK(o.scaling == "none" || o.factor > 0.0)
      << "rotary_embedding: factor " << o.factor << " is not positive";
  CHECK(o.scaling != "llama3" ||
        (o.low_freq_factor > 0.0 && o.high_freq_factor > o.low_freq_factor &&
         o.original_max_position > 0))
      << "rotary_embedding: llama3 scaling needs 0 < low_freq_factor (" << o.low_freq_factor
      << ") < high_freq_factor (" << o.high_freq_factor << ") and original_max_position ("
      << o.original_max_position << ") > 0";
  std::vector<float> inv_freq(size_t(head_dim / 2));
  for (int64_t j = 0; j < head_dim / 2; ++j) {
    // 1 / theta^(2j / HD): the exponent an f32 quotient, the power rounded to f32.
    const float exponent = f32_div(float(2 * j), float(head_dim));
    const float power = float(std::pow(double(float(o.theta)), double(exponent)));
    float f = f32_div(1.0f, power);
    if (o.scaling == "linear") f = f32_div(f, float(o.factor));
    if (o.scaling == "llama3") f = llama3_inv_freq(f, o);
    inv_freq[size_t(j)] = f;
  }
  return inv_freq;
}

Tensor rotary_embedding(const Tensor& x_in, int64_t num_heads, const Tensor& positions,
                        const RopeOptions& options) {
  CHECK(x_in.defined() && positions.defined()) << "rotary_embedding: undefined tensor";
  CHECK(x_in.dim() == 3) << "rotary_embedding: x " << x_in.shape_str() << " must be [B, T, NH HD]";
  CHECK(is_floating(x_in.dtype())) << "rotary_embedding: x of dtype " << x_in.dtype();
  const int64_t T = x_in.size(1), W = x_in.size(2);
  CHECK(num_heads >= 1 && W % num_heads == 0)
      << "rotary_embedding: width " << W << " is not a multiple of " << num_heads << " heads";
  CHECK((W / num_heads) % 2 == 0) << "rotary_embedding: head width " << W / num_heads << " (width "
                                  << W << " over " << num_heads << " heads) is not even";
  CHECK(positions.dtype() == DType::i64 && positions.shape() == Shape{T})
      << "rotary_embedding: positions " << positions.shape_str() << " of dtype "
      << positions.dtype() << " must be i64 [" << T << "] for x " << x_in.shape_str();
  CHECK(positions.device() == x_in.device())
      << "rotary_embedding: x on " << x_in.device() << ", positions on " << positions.device();
  const Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
  RopeAttrs attrs{.num_heads = num_heads, .inv_freq = rope_inv_freq(W / num_heads, options)};
  return autograd::apply<RopeFn>(x, positions, attrs);
}

}  // namespace trainer
