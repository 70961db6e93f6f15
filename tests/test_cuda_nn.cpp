// The CUDA attention and recurrent kernels (core/cuda/attention.cu,
// core/cuda/rnn.cpp) against the CPU on the same inputs, forward and
// backward, within each dtype's tolerance: causal attention with and
// without dropout (the GPU must draw the CPU's mask), odd T and head dims,
// strided q, k, v, grouped-query heads and the fused qkv form; two-layer
// LSTM and GRU stacks from random initial states, odd sizes, training and
// inference; attention blocks of context parallelism at offsets, merged,
// with their gradients.
// The [cuda-host] cases check on the CPU the shared per-element math the
// attention kernels run (core/attention_math.h).
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "core/attention_math.h"
#include "core/ops_rnn.h"
#include "core/ops_transformer.h"
#include "tests/cuda_testing.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Sums over a row or a sequence: the devices accumulate in other orders.
Tolerance attention_tolerance(DType t) {
  return t == DType::f32   ? Tolerance{1e-4, 1e-4}
         : t == DType::f64 ? Tolerance{1e-10, 1e-10}
                           : tolerance(t);
}

// cuDNN's f32 RNN may run its GEMMs on TF32 tensor cores (10-bit mantissa),
// and f16 keeps its gates in f16, through every step of the recurrence.
Tolerance rnn_tolerance(DType t) {
  switch (t) {
    case DType::f32:
      return {2e-2, 2e-2};
    case DType::f64:
      return {1e-9, 1e-9};
    case DType::bf16:
      return {5e-2, 5e-2};
    default:
      return {2e-2, 2e-2};
  }
}

Tensor flat(const TensorList& ts) {
  TensorList parts;
  for (const Tensor& t : ts) parts.push_back(t.reshape({-1}));
  return concat(parts, 0);
}

// inputs: x [B, T, I], then per layer h0, c0, w_ih, w_hh, b_ih, b_hh (LSTM)
// or h0, w_ih, w_hh, b_ih, b_hh (GRU); each layer reads the previous y.
// Returns y of the last layer and every layer's final state, flattened.
Tensor lstm_stack(const TensorList& in) {
  Tensor x = in[0];
  TensorList states;
  for (size_t p = 1; p + 6 <= in.size(); p += 6) {
    LSTMOutput o = lstm_layer(x, in[p], in[p + 1], in[p + 2], in[p + 3], in[p + 4], in[p + 5]);
    states.insert(states.end(), {o.h, o.c});
    x = o.y;
  }
  states.insert(states.begin(), x);
  return flat(states);
}

Tensor gru_stack(const TensorList& in) {
  Tensor x = in[0];
  TensorList states;
  for (size_t p = 1; p + 5 <= in.size(); p += 5) {
    GRUOutput o = gru_layer(x, in[p], in[p + 1], in[p + 2], in[p + 3], in[p + 4]);
    states.push_back(o.h);
    x = o.y;
  }
  states.insert(states.begin(), x);
  return flat(states);
}

// x and `layers` layers of parameters (G gates; LSTM layers also get c0).
TensorList stack_inputs(int64_t G, int layers, int64_t B, int64_t T, int64_t I, int64_t H,
                        Generator& gen, DType dt) {
  TensorList in = {rand_tensor({B, T, I}, gen, -1, 1, dt)};
  for (int l = 0; l < layers; ++l) {
    const int64_t in_width = l == 0 ? I : H;
    in.push_back(rand_tensor({B, H}, gen, -1, 1, dt));
    if (G == 4) in.push_back(rand_tensor({B, H}, gen, -1, 1, dt));
    in.push_back(rand_tensor({G * H, in_width}, gen, -0.5, 0.5, dt));
    in.push_back(rand_tensor({G * H, H}, gen, -0.5, 0.5, dt));
    in.push_back(rand_tensor({G * H}, gen, -0.5, 0.5, dt));
    in.push_back(rand_tensor({G * H}, gen, -0.5, 0.5, dt));
  }
  return in;
}

}  // namespace

// ---- host side (no GPU needed): the math attention.cu shares with the CPU ----

TEST_CASE("attention dropout multipliers of the shared header are the reference's draw",
          "[cuda-host]") {
  const PhiloxKey key{11, kStreamDropout, 5};
  for (double p : {0.1, 0.5, 0.9}) {
    const double keep = 1.0 - p;
    int kept = 0, mismatches = 0;
    const int n = 4000;
    for (int i = 0; i < n; ++i) {
      const double expected = double(philox_uniform(key, uint64_t(i))) < keep ? 1.0 / keep : 0.0;
      const double actual = math::attention_dropout(key, uint64_t(i), keep, 1.0 / keep);
      mismatches += actual != expected;
      kept += actual != 0.0;
    }
    INFO("p " << p);
    REQUIRE(mismatches == 0);
    REQUIRE(std::abs(double(kept) / n - keep) < 0.05);
  }
  // Element ((b NH + h) T + t) T + s, as core/backend.h states; a block's
  // element ((b NHt + h0 + h) Tt + q0 + t) Tt + k0 + s.
  const math::AttentionDropoutGrid whole{4, 7, 0, 0, 0}, block{6, 50, 2, 20, 9};
  REQUIRE(math::attention_dropout_index(whole, 1, 1, 3, 2) == uint64_t((5 * 7 + 3) * 7 + 2));
  REQUIRE(math::attention_dropout_index(block, 1, 1, 3, 2) ==
          uint64_t(((1 * 6 + 2 + 1) * 50 + 20 + 3) * 50 + 9 + 2));
}

TEST_CASE("attention rows see a prefix of the keys", "[cuda-host]") {
  // k_offset + s <= q_offset + t: the prefix [0, q_offset + t - k_offset + 1) of Tk keys.
  REQUIRE(math::attention_visible_keys(3, 0, 0, 10) == 4);
  REQUIRE(math::attention_visible_keys(3, 20, 0, 10) == 10);  // wholly visible
  REQUIRE(math::attention_visible_keys(3, 0, 20, 10) == 0);   // wholly after
  REQUIRE(math::attention_visible_keys(5, 10, 12, 10) == 4);
}

TEST_CASE("online softmax over key tiles gives the whole row's lse and weighted sum",
          "[cuda-host]") {
  // A causal row t of T scores seen in tiles of 32, as the CUDA kernels see
  // it: out = sum_s softmax(score)_s v_s; keys past t masked (-inf).
  Generator gen(3);
  for (int64_t T : {1, 31, 32, 33, 100}) {
    for (int64_t t : {int64_t(0), T / 2, T - 1}) {
      std::vector<double> score = rand_f64({T}, gen, -8, 8).to_vector<double>();
      std::vector<double> v = rand_f64({T}, gen, -1, 1).to_vector<double>();
      const double inf = std::numeric_limits<double>::infinity();
      math::OnlineSoftmax<float> st{-float(inf), 0.0f};
      float acc = 0.0f;
      for (int64_t s0 = 0; s0 < T; s0 += 32) {
        float tile_max = -float(inf);
        for (int64_t s = s0; s < std::min(T, s0 + 32); ++s)
          if (s <= t) tile_max = std::max(tile_max, float(score[size_t(s)]));
        acc *= st.rescale(tile_max);
        for (int64_t s = s0; s < std::min(T, s0 + 32); ++s) {
          if (s > t) continue;
          float e = std::exp(float(score[size_t(s)]) - st.m);
          st.l += e;
          acc += e * float(v[size_t(s)]);
        }
      }
      double mx = -inf, z = 0.0, out = 0.0;
      for (int64_t s = 0; s <= t; ++s) mx = std::max(mx, score[size_t(s)]);
      for (int64_t s = 0; s <= t; ++s) z += std::exp(score[size_t(s)] - mx);
      for (int64_t s = 0; s <= t; ++s) out += std::exp(score[size_t(s)] - mx) / z * v[size_t(s)];
      INFO("T " << T << " t " << t);
      REQUIRE(std::abs(double(st.m + std::log(st.l)) - (mx + std::log(z))) < 1e-5);
      REQUIRE(std::abs(double(acc / st.l) - out) < 1e-5);
    }
  }
}

TEST_CASE("attention's score gradient is p (dp - delta)", "[cuda-host]") {
  REQUIRE(math::attention_grad_score(0.25, 3.0, 1.0) == 0.5);
  REQUIRE(math::attention_grad_score(0.0f, 3.0f, 1.0f) == 0.0f);
}

// ---- device ----

TEST_CASE("cuda causal attention and its gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(21);
  // (B, T, NH, HD): odd T and head dims, one step, each register width (HD
  // <= 64, <= 128, <= 256) and T across several tiles of 16 and 32 rows.
  const std::array<int64_t, 4> shapes[] = {
      {2, 37, 3, 5}, {1, 70, 2, 72}, {1, 19, 1, 130}, {3, 1, 2, 8}, {1, 33, 4, 64}};
  for (DType dt : kFloating) {
    for (const auto& [B, T, NH, HD] : shapes) {
      for (double p : {0.0, 0.3}) {
        INFO(dt << " B " << B << " T " << T << " NH " << NH << " HD " << HD << " p " << p);
        const int64_t D = NH * HD;
        TensorList in = {rand_tensor({B, T, D}, gen, -1, 1, dt),
                         rand_tensor({B, T, D}, gen, -1, 1, dt),
                         rand_tensor({B, T, D}, gen, -1, 1, dt)};
        const Tolerance tol = attention_tolerance(dt);
        const int64_t heads = NH;
        auto f = [heads, p](const TensorList& x) {
          Generator drop(7, kStreamDropout);  // the same key on both devices
          return causal_attention(x[0], x[1], x[2], heads, p, /*training=*/true, drop);
        };
        check_cuda_vs_cpu(f, in, tol.rtol, tol.atol, /*strided=*/T % 2 == 1, /*backward=*/true,
                          "causal_attention");
      }
    }
  }
}

TEST_CASE("cuda grouped-query attention and its gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(24);
  // (B, T, NH, KV, HD): a key/value head shared by 3, 4 and 4 query heads.
  const std::array<int64_t, 5> shapes[] = {{2, 37, 6, 2, 5}, {1, 70, 4, 1, 72}, {1, 33, 8, 2, 64}};
  for (DType dt : kFloating) {
    for (const auto& [B, T, NH, KV, HD] : shapes) {
      for (double p : {0.0, 0.3}) {
        INFO(dt << " B " << B << " T " << T << " NH " << NH << " KV " << KV << " HD " << HD << " p "
                << p);
        TensorList in = {rand_tensor({B, T, NH * HD}, gen, -1, 1, dt),
                         rand_tensor({B, T, KV * HD}, gen, -1, 1, dt),
                         rand_tensor({B, T, KV * HD}, gen, -1, 1, dt)};
        const Tolerance tol = attention_tolerance(dt);
        const int64_t heads = NH, kv_heads = KV;
        auto f = [heads, kv_heads, p](const TensorList& x) {
          Generator drop(9, kStreamDropout);
          return causal_attention(x[0], x[1], x[2], heads, p, /*training=*/true, drop, kv_heads);
        };
        check_cuda_vs_cpu(f, in, tol.rtol, tol.atol, /*strided=*/T % 2 == 1, /*backward=*/true,
                          "grouped-query causal_attention");
      }
    }
  }
}

TEST_CASE("cuda attention on one fused qkv matches the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(22);
  const int64_t B = 2, T = 45, NH = 3, HD = 24;
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dt);
    TensorList in = {rand_tensor({B, T, 3 * NH * HD}, gen, -1, 1, dt)};
    const Tolerance tol = attention_tolerance(dt);
    auto f = [](const TensorList& x) {
      Generator drop(8, kStreamDropout);
      return causal_attention_qkv(x[0], NH, 0.2, /*training=*/true, drop);
    };
    check_cuda_vs_cpu(f, in, tol.rtol, tol.atol, /*strided=*/false, /*backward=*/true,
                      "causal_attention_qkv");
  }
}

TEST_CASE("cuda attention blocks, their merge and gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(25);
  // (B, T, NH, KV, HD, q0, split): q's rows [q0, T) against the keys [0,
  // split) and [split, T), merged; q's first rows see nothing of the second
  // block when q0 < split (block lse -inf).
  const std::array<int64_t, 7> shapes[] = {
      {2, 45, 3, 3, 5, 20, 30}, {1, 70, 4, 2, 72, 35, 35}, {1, 40, 2, 1, 8, 0, 33}};
  for (DType dt : kFloating) {
    for (const auto& [B, T, NH, KV, HD, q0, split] : shapes) {
      for (double p : {0.0, 0.3}) {
        INFO(dt << " B " << B << " T " << T << " NH " << NH << " KV " << KV << " HD " << HD
                << " q0 " << q0 << " split " << split << " p " << p);
        TensorList in = {rand_tensor({B, T, NH * HD}, gen, -1, 1, dt),
                         rand_tensor({B, T, KV * HD}, gen, -1, 1, dt),
                         rand_tensor({B, T, KV * HD}, gen, -1, 1, dt)};
        const Tolerance tol = attention_tolerance(dt);
        // out, lse and the blocks' gradients with the merged out and lse, flattened.
        auto f = [&, B = B, T = T, NH = NH, KV = KV, HD = HD, q0 = q0,
                  split = split](const TensorList& x) {
          Generator drop(10, kStreamDropout);
          AttentionAttrs attrs =
              attention_block_attrs(B, NH * HD, NH, KV, p, /*training=*/true, drop, T);
          attrs.q_offset = q0;
          const Tensor q = x[0].narrow(1, q0, T - q0);
          const int64_t starts[] = {0, split}, lens[] = {split, T - split};
          AttentionBlockResult acc;
          for (int i = 0; i < 2; ++i) {
            attrs.k_offset = starts[i];
            AttentionBlockResult r = attention_block_forward(
                q, x[1].narrow(1, starts[i], lens[i]), x[2].narrow(1, starts[i], lens[i]), attrs);
            if (i == 0)
              acc = r;
            else
              attention_merge(acc.out, acc.lse, r.out, r.lse);
          }
          const Tensor grad_out = probe_like(acc.out).to(acc.out.device());
          TensorList parts = {acc.out, acc.lse.to(dt)};
          for (int i = 0; i < 2; ++i) {
            attrs.k_offset = starts[i];
            for (const Tensor& g : attention_block_backward(
                     grad_out, q, x[1].narrow(1, starts[i], lens[i]),
                     x[2].narrow(1, starts[i], lens[i]), acc.out, acc.lse, attrs))
              parts.push_back(g);
          }
          return flat(parts);
        };
        check_cuda_vs_cpu(f, in, tol.rtol, tol.atol, /*strided=*/T % 2 == 1, /*backward=*/false,
                          "attention blocks");
      }
    }
  }
}

TEST_CASE("cuda LSTM and GRU stacks (cuDNN) and their gradients match the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(23);
  // (B, T, I, H): odd sizes, one step of one unit, I wider and narrower than H.
  const std::array<int64_t, 4> shapes[] = {{3, 7, 5, 9}, {2, 11, 17, 13}, {1, 1, 1, 1}};
  for (DType dt : kFloating) {
    for (const auto& [B, T, I, H] : shapes) {
      INFO(dt << " B " << B << " T " << T << " I " << I << " H " << H);
      const Tolerance tol = rnn_tolerance(dt);
      for (bool backward : {true, false}) {  // training (reserve space) and inference
        INFO("backward " << backward);
        check_cuda_vs_cpu(lstm_stack, stack_inputs(4, 2, B, T, I, H, gen, dt), tol.rtol, tol.atol,
                          /*strided=*/true, backward, "lstm_layer x2");
        check_cuda_vs_cpu(gru_stack, stack_inputs(3, 2, B, T, I, H, gen, dt), tol.rtol, tol.atol,
                          /*strided=*/true, backward, "gru_layer x2");
      }
    }
  }
}

TEST_CASE("cuda LSTM with only y receiving a gradient matches the CPU", "[cuda]") {
  require_gpu_or_skip();
  Generator gen(24);
  const Tolerance tol = rnn_tolerance(DType::f64);
  auto f = [](const TensorList& in) {
    return lstm_layer(in[0], in[1], in[2], in[3], in[4], in[5], in[6]).y;
  };
  check_cuda_vs_cpu(f, stack_inputs(4, 1, 4, 6, 3, 5, gen, DType::f64), tol.rtol, tol.atol,
                    /*strided=*/false, /*backward=*/true, "lstm_layer y");
}
