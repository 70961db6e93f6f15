// Autocast (core/autocast.h): the policy's output dtypes per op, f32
// gradients for f32 parameters that match the fp32 ones within bf16's
// precision, the bf16 and f16 fast paths (oneDNN bf16 convolution, f16 and
// the attention/recurrent kernels on f32 copies) against the reference
// kernels on odd shapes, and a small model trained in bf16 tracking fp32.
#include "tests/testing.h"

#include <cmath>

#include "core/autocast.h"
#include "core/ops_conv.h"
#include "core/ops_rnn.h"
#include "core/ops_transformer.h"
#include "layers/linear.h"
#include "models/small.h"
#include "optim/optimizer.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// ||a - b|| / ||b|| over all elements.
double relative_error(const Tensor& a, const Tensor& b) {
  std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) num += (x[i] - y[i]) * (x[i] - y[i]), den += y[i] * y[i];
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

TEST_CASE("autocast: the guard sets and restores the thread's dtype", "[autocast]") {
  REQUIRE(!autocast_dtype());
  {
    AutocastGuard outer(DType::bf16);
    REQUIRE(autocast_dtype() == DType::bf16);
    {
      AutocastGuard off(DType::f32);
      REQUIRE(!autocast_dtype());
      AutocastGuard inner(DType::f16);
      REQUIRE(autocast_dtype() == DType::f16);
    }
    REQUIRE(autocast_dtype() == DType::bf16);
  }
  REQUIRE(!autocast_dtype());
}

TEST_CASE("autocast: output dtypes per op", "[autocast]") {
  Generator gen(1, 2);
  Tensor x = rand_tensor({3, 5}, gen), w = rand_tensor({4, 5}, gen), b = rand_tensor({4}, gen);
  Tensor img = rand_tensor({2, 3, 6, 7}, gen), k = rand_tensor({4, 3, 3, 3}, gen);
  Tensor seq = rand_tensor({2, 4, 6}, gen), target = from_vector<int64_t>({0, 3, 1});
  Tensor gamma = ones({3}), beta = zeros({3});
  for (DType low : {DType::bf16, DType::f16}) {
    INFO("autocast dtype " << low);
    AutocastGuard autocast(low);
    // Lower precision.
    REQUIRE(matmul(x, w.t()).dtype() == low);
    REQUIRE(linear(x, w, b).dtype() == low);
    REQUIRE(conv2d(img, k, b, {.padding = {1, 1}}).dtype() == low);
    REQUIRE(is_channels_last(conv2d(img, k, b, {.padding = {1, 1}})));
    REQUIRE(causal_attention(seq, seq, seq, 2, 0.0, false, gen).dtype() == low);
    Tensor h0 = zeros({2, 3});
    Tensor w_ih = rand_tensor({12, 6}, gen), w_hh = rand_tensor({12, 3}, gen);
    REQUIRE(lstm_layer(seq, h0, h0, w_ih, w_hh, {}, {}).y.dtype() == low);
    REQUIRE(gru_layer(seq, h0, w_ih.narrow(0, 0, 9), w_hh.narrow(0, 0, 9), {}, {}).y.dtype() ==
            low);
    // f32, from low-precision inputs.
    Tensor xl = x.to(low);
    REQUIRE(softmax(xl, 1).dtype() == DType::f32);
    REQUIRE(log_softmax(xl, 1).dtype() == DType::f32);
    REQUIRE(cross_entropy(linear(x, w, b), target).dtype() == DType::f32);
    REQUIRE(layer_norm(xl, ones({5}), zeros({5})).dtype() == DType::f32);
    REQUIRE(rms_norm(xl, ones({5})).dtype() == DType::f32);
    REQUIRE(batch_norm_train(img.to(low), gamma, beta, 1e-5).out.dtype() == DType::f32);
    REQUIRE(sum(xl).dtype() == DType::f32);
    REQUIRE(mean(xl, {1}).dtype() == DType::f32);
    REQUIRE(exp(xl).dtype() == DType::f32);
    REQUIRE(log(xl).dtype() == DType::f32);
    // Follow the input; promote mixed operands to the wider.
    REQUIRE(relu(xl).dtype() == low);
    REQUIRE(rotary_embedding(seq.to(low), 3, arange(4, DType::i64), {}).dtype() == low);
    REQUIRE(gelu(xl).dtype() == low);
    REQUIRE((xl * 2.0).dtype() == low);
    REQUIRE((xl + x).dtype() == DType::f32);
    REQUIRE((x.to(DType::bf16) + x.to(DType::f16)).dtype() == DType::f32);
    REQUIRE((xl + x.to(DType::f64)).dtype() == DType::f64);
    // f64 is never cast down.
    REQUIRE(matmul(x.to(DType::f64), w.t().to(DType::f64)).dtype() == DType::f64);
  }
  // Off again: the plain dtypes.
  REQUIRE(matmul(x, w.t()).dtype() == DType::f32);
}

TEST_CASE("autocast: f32 parameters get f32 gradients close to the fp32 ones", "[autocast]") {
  Generator gen(3, 4);
  Tensor x = rand_tensor({16, 24}, gen), target = from_vector<int64_t>(std::vector<int64_t>(16, 2));
  for (int64_t i = 0; i < 16; ++i) target.data<int64_t>()[i] = (i * 7) % 10;
  Tensor w1 = rand_tensor({32, 24}, gen, -0.3, 0.3), b1 = rand_tensor({32}, gen, -0.1, 0.1);
  Tensor w2 = rand_tensor({10, 32}, gen, -0.3, 0.3), b2 = rand_tensor({10}, gen, -0.1, 0.1);
  Tensor img = rand_tensor({2, 3, 9, 7}, gen), k = rand_tensor({5, 3, 3, 3}, gen, -0.3, 0.3);
  TensorList params = {w1, b1, w2, b2, k};
  auto run = [&](std::optional<DType> low) {
    TensorList ps;
    for (const Tensor& p : params) ps.push_back(p.detach().clone().requires_grad_());
    Tensor loss;
    {
      AutocastGuard autocast(low.value_or(DType::f32));
      Tensor h = gelu(linear(x, ps[0], ps[1]));
      Tensor conv = conv2d(img, ps[4], {}, {.padding = {1, 1}});
      loss = cross_entropy(linear(h, ps[2], ps[3]), target) + mean(conv * conv);
      // Backward inside the guard still follows forward's dtypes.
      loss.backward();
    }
    REQUIRE(loss.dtype() == DType::f32);
    TensorList grads;
    for (const Tensor& p : ps) {
      REQUIRE(p.grad().defined());
      REQUIRE(p.grad().dtype() == DType::f32);
      grads.push_back(p.grad());
    }
    return grads;
  };
  TensorList ref = run(std::nullopt);
  for (DType low : {DType::bf16, DType::f16}) {
    TensorList got = run(low);
    // bf16 keeps 8 bits, f16 11: a few rounding steps per path.
    double tol = low == DType::bf16 ? 3e-2 : 5e-3;
    for (size_t i = 0; i < ref.size(); ++i) {
      INFO("parameter " << i << " under " << low);
      CHECK(relative_error(got[i], ref[i]) < tol);
    }
  }
}

TEST_CASE("autocast: bf16 and f16 convolution fast paths match the reference", "[autocast]") {
  Generator gen(5, 6);
  struct Case {
    Shape x, w;
    Conv2dAttrs a;
    bool bias, relu;
  };
  std::vector<Case> cases = {{{2, 3, 9, 11}, {5, 3, 3, 3}, {.padding = {1, 1}}, true, false},
                             {{1, 6, 13, 7},
                              {10, 3, 3, 2},
                              {.stride = {2, 1}, .padding = {1, 0}, .groups = 2},
                              true,
                              true},
                             {{3, 5, 10, 10}, {7, 5, 1, 1}, {}, false, false},
                             {{2, 4, 12, 9},
                              {6, 4, 3, 3},
                              {.stride = {2, 2}, .padding = {2, 1}, .dilation = {2, 1}},
                              false,
                              true}};
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const Case& c : cases) {
      INFO("x " << shape_str(c.x) << " w " << shape_str(c.w) << " " << dt);
      Tensor x = rand_tensor(c.x, gen, -1, 1, dt);
      if (c.x[0] != 3) x = to_channels_last(x);  // else row-major: the op copies it
      Tensor w = rand_tensor(c.w, gen, -0.5, 0.5, dt);
      TensorList in = {x, w};
      if (c.bias) in.push_back(rand_tensor({c.w[0]}, gen, -0.5, 0.5, dt));
      Conv2dAttrs a = c.a;
      bool relu = c.relu;
      // Both sides round f32/double sums to the 16-bit type (tests/testing.h's
      // rule); the longest sum is the weight gradient's (N H W) or the
      // forward's (C kH kW); the cotangent is rounded too, and oneDNN's bf16
      // weight gradient is converted once more from its f32 layout.
      const int64_t n = std::max(c.x[0] * c.x[2] * c.x[3], c.w[1] * c.w[2] * c.w[3]);
      check_fast_vs_reference(
          [a, relu](const TensorList& t) {
            return conv2d(t[0], t[1], t.size() > 2 ? t[2] : Tensor(), a, relu);
          },
          in, {.length = n, .scale = std::sqrt(double(n)), .roundings = 3});
    }
  }
}

TEST_CASE("autocast: bf16/f16 matmul, attention and recurrent kernels match the reference",
          "[autocast]") {
  Generator gen(7, 8);
  // tests/testing.h's rule: sums of up to 33 terms (K, or the batch of the
  // broadcast operand's gradient), the result and the cotangent rounded.
  const Reduction lowp_sums{.length = 33, .scale = 6, .roundings = 3};
  // bf16 on oneDNN (AMX): odd shapes, a transposed operand, a broadcast batch.
  check_fast_vs_reference([](const TensorList& t) { return matmul(t[0], t[1].transpose(-1, -2)); },
                          {rand_tensor({2, 3, 7, 33}, gen, -1, 1, DType::bf16),
                           rand_tensor({3, 9, 33}, gen, -1, 1, DType::bf16)},
                          lowp_sums);
  check_fast_vs_reference([](const TensorList& t) { return matmul(t[0], t[1]); },
                          {rand_tensor({3, 7, 33}, gen, -1, 1, DType::f16),
                           non_contiguous(rand_tensor({33, 9}, gen, -1, 1, DType::f16))},
                          lowp_sums);
  for (DType dt : {DType::bf16, DType::f16}) {
    INFO(dt);
    // Attention computes in f32 on copies, rounds its output once, and its
    // backward reads that rounded output (sums over T = 7 keys, head dim 6).
    const Reduction attention{.length = 7, .scale = 3, .roundings = 3};
    // The recurrent layers run T = 5 steps of rounded-input cells whose
    // rounded outputs feed the next step's gates: more roundings compound.
    const Reduction recurrent{.length = 15, .scale = 4, .roundings = 7};
    Tensor qkv = rand_tensor({2, 7, 3 * 6}, gen, -1, 1, dt);
    check_fast_vs_reference(
        [&gen](const TensorList& t) { return causal_attention_qkv(t[0], 3, 0.0, false, gen); },
        {qkv}, attention);
    int64_t B = 3, T = 5, I = 4, H = 3;
    TensorList in = {
        rand_tensor({B, T, I}, gen, -1, 1, dt),      rand_tensor({B, H}, gen, -1, 1, dt),
        rand_tensor({B, H}, gen, -1, 1, dt),         rand_tensor({4 * H, I}, gen, -0.5, 0.5, dt),
        rand_tensor({4 * H, H}, gen, -0.5, 0.5, dt), rand_tensor({4 * H}, gen, -0.5, 0.5, dt)};
    check_fast_vs_reference(
        [](const TensorList& t) {
          LSTMOutput o = lstm_layer(t[0], t[1], t[2], t[3], t[4], t[5], Tensor());
          return o.y + o.c.unsqueeze(1);
        },
        in, recurrent);
    check_fast_vs_reference(
        [H](const TensorList& t) {
          return gru_layer(t[0], t[1], t[3].narrow(0, 0, 3 * H), t[4].narrow(0, 0, 3 * H),
                           t[5].narrow(0, 0, 3 * H), Tensor())
              .y;
        },
        in, recurrent);
  }
}

TEST_CASE("autocast: a small CNN trained in bf16 tracks its fp32 loss", "[autocast]") {
  // Two classes of 8x8 images: a bright top half or a bright bottom half, plus noise.
  Generator gen(9, 10);
  const int64_t N = 32;
  Tensor images = rand_tensor({N, 1, 8, 8}, gen, 0.0, 0.5);
  std::vector<int64_t> labels(N);
  for (int64_t n = 0; n < N; ++n) {
    labels[size_t(n)] = n % 2;
    images.select(0, n)
        .narrow(1, labels[size_t(n)] * 4, 4)
        .copy_(rand_tensor({1, 4, 8}, gen, 0.5, 1.0));
  }
  Tensor target = from_vector<int64_t>(labels);
  auto train = [&](DType precision) {
    SmallCNN model({.in_channels = 1, .num_classes = 2, .image_size = 8, .dropout = 0.0});
    optim::SGD opt({optim::ParamGroup{model.named_parameters()}}, {.lr = 0.05, .momentum = 0.9});
    std::vector<double> losses;
    for (int step = 0; step < 30; ++step) {
      Tensor loss;
      {
        AutocastGuard autocast(precision);
        loss = cross_entropy(model.forward(to_channels_last(images)), target);
      }
      loss.backward();
      opt.step();
      opt.zero_grad();
      losses.push_back(loss.item<double>());
    }
    return losses;
  };
  std::vector<double> fp32 = train(DType::f32), bf16 = train(DType::bf16);
  REQUIRE(fp32.back() < 0.5 * fp32.front());
  REQUIRE(bf16.back() < 0.5 * bf16.front());
  for (size_t i = 0; i < fp32.size(); ++i) {
    INFO("step " << i << ": fp32 " << fp32[i] << ", bf16 " << bf16[i]);
    CHECK(std::fabs(bf16[i] - fp32[i]) < 0.05 + 0.1 * fp32[i]);
  }
}
