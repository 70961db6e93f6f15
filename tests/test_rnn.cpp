// LSTM and GRU: the layer ops against step-by-step loops of core ops (values
// and gradients), finite differences in f64, the CPU fast path against the
// reference kernels, the multi-layer modules (dropout determinism, state
// carried across calls) and a tiny LSTM language model overfitting a batch;
// the AVX2 per-step GEMM (core/cpu/rnn_gemm_avx2.h) against a plain GEMM.
#include "tests/lm_task.h"

#include <cmath>
#include <vector>

#include "core/cpu/isa.h"
#include "core/cpu/rnn_gemm_avx2.h"
#include "core/cpu/threads.h"
#include "core/ops_rnn.h"
#include "layers/rnn.h"
#include "models/lstm_lm.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Gate k (rows [k H, (k + 1) H)) of a [B, G H] pre-activation.
Tensor gate(const Tensor& a, int64_t k, int64_t H) { return a.narrow(1, k * H, H); }

// LSTM with matmul, sigmoid and tanh, one step at a time.
LSTMOutput lstm_loop(const Tensor& x, const Tensor& h0, const Tensor& c0, const Tensor& wih,
                     const Tensor& whh, const Tensor& bih, const Tensor& bhh) {
  int64_t T = x.size(1), H = h0.size(1);
  Tensor h = h0, c = c0;
  TensorList ys;
  for (int64_t t = 0; t < T; ++t) {
    Tensor a = matmul(x.select(1, t), wih.t()) + bih + matmul(h, whh.t()) + bhh;
    Tensor i = sigmoid(gate(a, 0, H)), f = sigmoid(gate(a, 1, H));
    Tensor g = tanh(gate(a, 2, H)), o = sigmoid(gate(a, 3, H));
    c = f * c + i * g;
    h = o * tanh(c);
    ys.push_back(h);
  }
  return {stack(ys, 1), h, c};
}

// GRU as torch.nn.GRU documents it, one step at a time.
GRUOutput gru_loop(const Tensor& x, const Tensor& h0, const Tensor& wih, const Tensor& whh,
                   const Tensor& bih, const Tensor& bhh) {
  int64_t T = x.size(1), H = h0.size(1);
  Tensor h = h0;
  TensorList ys;
  for (int64_t t = 0; t < T; ++t) {
    Tensor gi = matmul(x.select(1, t), wih.t()) + bih;
    Tensor gh = matmul(h, whh.t()) + bhh;
    Tensor r = sigmoid(gate(gi, 0, H) + gate(gh, 0, H));
    Tensor z = sigmoid(gate(gi, 1, H) + gate(gh, 1, H));
    Tensor n = tanh(gate(gi, 2, H) + r * gate(gh, 2, H));
    h = (1.0 - z) * n + z * h;
    ys.push_back(h);
  }
  return {stack(ys, 1), h};
}

Tensor flat(const TensorList& ts) {
  TensorList parts;
  for (const Tensor& t : ts) parts.push_back(t.reshape({-1}));
  return concat(parts, 0);
}

// Inputs x [B, T, I], h0, c0 [B, H], w_ih [G H, I], w_hh [G H, H], b_ih, b_hh.
TensorList lstm_inputs(int64_t B, int64_t T, int64_t I, int64_t H, Generator& gen, DType dt) {
  return {rand_tensor({B, T, I}, gen, -1, 1, dt),  rand_tensor({B, H}, gen, -1, 1, dt),
          rand_tensor({B, H}, gen, -1, 1, dt),     rand_tensor({4 * H, I}, gen, -1, 1, dt),
          rand_tensor({4 * H, H}, gen, -1, 1, dt), rand_tensor({4 * H}, gen, -1, 1, dt),
          rand_tensor({4 * H}, gen, -1, 1, dt)};
}
TensorList gru_inputs(int64_t B, int64_t T, int64_t I, int64_t H, Generator& gen, DType dt) {
  return {rand_tensor({B, T, I}, gen, -1, 1, dt),  rand_tensor({B, H}, gen, -1, 1, dt),
          rand_tensor({3 * H, I}, gen, -1, 1, dt), rand_tensor({3 * H, H}, gen, -1, 1, dt),
          rand_tensor({3 * H}, gen, -1, 1, dt),    rand_tensor({3 * H}, gen, -1, 1, dt)};
}

Tensor lstm_all(const TensorList& in) {
  LSTMOutput o = lstm_layer(in[0], in[1], in[2], in[3], in[4], in[5], in[6]);
  return flat({o.y, o.h, o.c});
}
Tensor gru_all(const TensorList& in) {
  GRUOutput o = gru_layer(in[0], in[1], in[2], in[3], in[4], in[5]);
  return flat({o.y, o.h});
}

// Values and gradients (of every input) of f and g agree.
void require_same_function(const Fn& f, const Fn& g, const TensorList& inputs, double tol) {
  auto run = [&](const Fn& fn, TensorList& grads) {
    TensorList in;
    for (const Tensor& t : inputs) in.push_back(t.detach().requires_grad_());
    Tensor out = fn(in);
    out.backward(probe_like(out));
    for (const Tensor& t : in) grads.push_back(t.grad());
    return out;
  };
  TensorList gf, gg;
  Tensor a = run(f, gf), b = run(g, gg);
  require_close(a, b, tol, tol, "outputs");
  for (size_t k = 0; k < inputs.size(); ++k)
    require_close(gf[k], gg[k], tol, tol, "gradient of input " + std::to_string(k));
}

}  // namespace

// tests/testing.h's rule for a recurrent layer over [B, T, I] with H units:
// the gate GEMMs sum I or H terms, the weight gradients B T rows, and the
// recurrence carries rounding through T steps (counted as roundings).
Reduction recurrent_reduction(int64_t B, int64_t T, int64_t I, int64_t H) {
  const int64_t n = std::max({I, H, B * T});
  return {.length = n, .scale = 2 * std::sqrt(double(n)), .roundings = int(T)};
}

TEST_CASE("lstm_layer matches a step-by-step loop of core ops", "[rnn]") {
  Generator gen(1);
  Fn loop = [](const TensorList& in) {
    LSTMOutput o = lstm_loop(in[0], in[1], in[2], in[3], in[4], in[5], in[6]);
    return flat({o.y, o.h, o.c});
  };
  SECTION("f32, fast path") {
    require_same_function(lstm_all, loop, lstm_inputs(3, 5, 7, 6, gen, DType::f32), 2e-5);
  }
  SECTION("f64, reference kernels") {
    require_same_function(lstm_all, loop, lstm_inputs(2, 4, 3, 5, gen, DType::f64), 1e-12);
  }
}

TEST_CASE("gru_layer matches a step-by-step loop of core ops", "[rnn]") {
  Generator gen(2);
  Fn loop = [](const TensorList& in) {
    GRUOutput o = gru_loop(in[0], in[1], in[2], in[3], in[4], in[5]);
    return flat({o.y, o.h});
  };
  SECTION("f32, fast path") {
    require_same_function(gru_all, loop, gru_inputs(3, 5, 7, 6, gen, DType::f32), 2e-5);
  }
  SECTION("f64, reference kernels") {
    require_same_function(gru_all, loop, gru_inputs(2, 4, 3, 5, gen, DType::f64), 1e-12);
  }
}

TEST_CASE("lstm_layer and gru_layer gradients match finite differences", "[rnn]") {
  Generator gen(3);
  SECTION("lstm") { gradcheck(lstm_all, lstm_inputs(2, 3, 3, 2, gen, DType::f64)); }
  SECTION("gru") { gradcheck(gru_all, gru_inputs(2, 3, 3, 2, gen, DType::f64)); }
  SECTION("lstm without biases") {
    TensorList in = lstm_inputs(2, 3, 2, 3, gen, DType::f64);
    gradcheck(
        [](const TensorList& v) {
          LSTMOutput o = lstm_layer(v[0], v[1], v[2], v[3], v[4], Tensor(), Tensor());
          return flat({o.y, o.h, o.c});
        },
        {in[0], in[1], in[2], in[3], in[4]});
  }
}

TEST_CASE("recurrent fast path matches the reference kernels", "[rnn]") {
  Generator gen(4);
  for (auto [B, T, I, H] : {std::array<int64_t, 4>{1, 1, 1, 1}, {3, 7, 5, 9}, {5, 4, 17, 13}}) {
    INFO("B " << B << " T " << T << " I " << I << " H " << H);
    TensorList l = lstm_inputs(B, T, I, H, gen, DType::f32);
    for (Tensor& t : l) t = non_contiguous(t);
    check_fast_vs_reference(lstm_all, l, recurrent_reduction(B, T, I, H));
    TensorList g = gru_inputs(B, T, I, H, gen, DType::f32);
    for (Tensor& t : g) t = non_contiguous(t);
    check_fast_vs_reference(gru_all, g, recurrent_reduction(B, T, I, H));
  }
  SECTION("only y receives a gradient") {
    TensorList l = lstm_inputs(2, 3, 4, 5, gen, DType::f32);
    check_fast_vs_reference(
        [](const TensorList& in) {
          return lstm_layer(in[0], in[1], in[2], in[3], in[4], in[5], in[6]).y;
        },
        l, recurrent_reduction(2, 3, 4, 5));
  }
}

TEST_CASE("recurrent fast path on several threads matches the reference kernels", "[rnn]") {
  // The step loops split the batch rows among the threads: uneven splits
  // (B 5 on 2 and 3 threads), fewer rows than threads (B 1, 2).
  Generator gen(9);
  int threads = num_threads();
  for (int nt : {2, 3}) {
    set_num_threads(nt);
    for (auto [B, T, I, H] : {std::array<int64_t, 4>{5, 6, 7, 33}, {1, 3, 4, 5}, {2, 4, 3, 17}}) {
      INFO(nt << " threads, B " << B << " T " << T << " I " << I << " H " << H);
      check_fast_vs_reference(lstm_all, lstm_inputs(B, T, I, H, gen, DType::f32),
                              recurrent_reduction(B, T, I, H));
      check_fast_vs_reference(gru_all, gru_inputs(B, T, I, H, gen, DType::f32),
                              recurrent_reduction(B, T, I, H));
    }
    // The workers run one GEMM primitive at once: repeated runs agree exactly.
    TensorList l = lstm_inputs(8, 5, 16, 40, gen, DType::f32);
    require_close(lstm_all(l), lstm_all(l), 0, 0, "repeated lstm_layer");
  }
  set_num_threads(threads);
}

TEST_CASE("AVX2 recurrent GEMM matches a plain GEMM on odd sizes", "[rnn]") {
  // Partial panels (N % 16), every tile height (M 1..6 and uneven splits),
  // padded rows (lda > K, ldc > N), overwrite and accumulate. b is laid out as
  // the forward's W_hh^T: (k, n) at w[n K + k].
  Generator gen(10);
  for (auto [M, K, N] : {std::array<int64_t, 3>{1, 1, 1},
                         {2, 3, 5},
                         {4, 16, 16},
                         {7, 13, 17},
                         {13, 33, 40},
                         {32, 64, 50},
                         {17, 100, 3}}) {
    for (bool accumulate : {false, true}) {
      INFO("M " << M << " K " << K << " N " << N << (accumulate ? " accumulate" : ""));
      const int64_t lda = K + 3, ldc = N + 5;
      Tensor a = rand_tensor({M, lda}, gen), w = rand_tensor({N, K}, gen);
      Tensor c0 = rand_tensor({M, ldc}, gen), c = c0.clone();
      std::vector<float> panels(size_t(cpu::rnn_packed_size(K, N)));
      cpu::pack_rnn_panels(w.data<float>(), K, N, 1, K, panels.data());
      cpu::rnn_gemm_avx2(a.data<float>(), M, K, lda, panels.data(), N, c.data<float>(), ldc,
                         accumulate);
      const float *pa = a.data<float>(), *pw = w.data<float>();
      const float *pc0 = c0.data<float>(), *pc = c.data<float>();
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t n = 0; n < ldc; ++n) {
          INFO("c[" << m << ", " << n << "]");
          if (n >= N) {  // the row padding is left alone
            REQUIRE(pc[m * ldc + n] == pc0[m * ldc + n]);
            continue;
          }
          double expected = accumulate ? pc0[m * ldc + n] : 0.0, magnitude = std::abs(expected);
          for (int64_t k = 0; k < K; ++k) {
            expected += double(pa[m * lda + k]) * pw[n * K + k];
            magnitude += std::abs(double(pa[m * lda + k]) * pw[n * K + k]);
          }
          // One f32 FMA chain: each step rounds once.
          REQUIRE(std::abs(pc[m * ldc + n] - expected) <= double(K + 1) * 0x1p-24 * magnitude);
        }
      }
      // Row by row gives the same bits: a row's result does not depend on
      // how the batch is split among threads.
      Tensor rows = c0.clone();
      for (int64_t m = 0; m < M; ++m)
        cpu::rnn_gemm_avx2(pa + m * lda, 1, K, lda, panels.data(), N, rows.data<float>() + m * ldc,
                           ldc, accumulate);
      require_close(rows, c, 0, 0, "one row at a time");
    }
  }
}

TEST_CASE("recurrent fast path: the AVX2 and oneDNN per-step GEMMs both match the reference",
          "[rnn][isa]") {
  // The per-step GEMM is the AVX2 kernel where the project's loops run AVX2
  // and a oneDNN primitive where they run AVX-512; on a CPU without AVX-512
  // both runs take the AVX2 kernel. H 37: 4H = 148 and 3H = 111 columns end
  // in partial panels; B 7 on 1 and 2 threads: tiles of 7, 4 and 3 rows.
  Generator gen(11);
  const cpu::Isa before = cpu::active_isa();
  const int threads = num_threads();
  const int64_t B = 7, T = 5, I = 19, H = 37;
  TensorList l = lstm_inputs(B, T, I, H, gen, DType::f32);
  TensorList g = gru_inputs(B, T, I, H, gen, DType::f32);
  TensorList outputs;
  for (cpu::Isa isa : {cpu::Isa::avx2, cpu::Isa::avx512}) {
    cpu::set_max_isa(isa);
    for (int nt : {1, 2}) {
      set_num_threads(nt);
      INFO(cpu::isa_name(cpu::active_isa()) << ", " << nt << " threads");
      check_fast_vs_reference(lstm_all, l, recurrent_reduction(B, T, I, H));
      check_fast_vs_reference(gru_all, g, recurrent_reduction(B, T, I, H));
    }
    outputs.push_back(lstm_all(l));
  }
  set_num_threads(threads);
  cpu::set_max_isa(before);
  const Tolerance tol = tolerance(DType::f32, recurrent_reduction(B, T, I, H));
  require_close(outputs[0], outputs[1], tol.rtol, tol.atol, "lstm_layer, AVX2 vs AVX-512 path");
}

TEST_CASE("LSTM and GRU modules: names, init, dropout, batch_first", "[rnn]") {
  Generator gen(5);
  LSTM lstm({.input_size = 3, .hidden_size = 4, .num_layers = 2, .dropout = 0.5, .seed = 9}, gen);
  std::vector<std::string> names;
  for (const NamedTensor& p : lstm.named_parameters()) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"weight_ih_l0", "weight_hh_l0", "bias_ih_l0",
                                          "bias_hh_l0", "weight_ih_l1", "weight_hh_l1",
                                          "bias_ih_l1", "bias_hh_l1"});
  CHECK(lstm.weight_ih[1].shape() == Shape{16, 4});
  CHECK(lstm.named_buffers().empty());
  for (const NamedTensor& p : lstm.named_parameters()) {
    std::vector<float> v = p.tensor.to_vector<float>();
    for (float e : v) REQUIRE(std::fabs(e) <= 0.5f);  // 1 / sqrt(4)
  }

  Tensor x = rand_tensor({2, 6, 3}, gen);
  auto run = [&](uint64_t seed, bool train) {
    Generator g(5);
    LSTM m({.input_size = 3, .hidden_size = 4, .num_layers = 2, .dropout = 0.5, .seed = seed}, g);
    m.train(train);
    return m.forward(x, RNNState{}).first;
  };
  require_close(run(9, true), run(9, true), 0, 0, "same seed, same masks");
  Tensor eval = run(9, false);
  CHECK(max(abs(run(9, true) - eval)).item<float>() > 1e-3f);
  CHECK(max(abs(run(10, true) - run(9, true))).item<float>() > 1e-3f);

  GRU gru({.input_size = 3, .hidden_size = 4, .num_layers = 2, .seed = 1}, gen);
  GRU gru_tb({.input_size = 3, .hidden_size = 4, .num_layers = 2, .batch_first = false}, gen);
  for (size_t k = 0; k < 2; ++k) {
    gru_tb.weight_ih[k].copy_(gru.weight_ih[k]);
    gru_tb.weight_hh[k].copy_(gru.weight_hh[k]);
    gru_tb.bias_ih[k].copy_(gru.bias_ih[k]);
    gru_tb.bias_hh[k].copy_(gru.bias_hh[k]);
  }
  auto [y, s] = gru.forward(x, RNNState{});
  auto [y_tb, s_tb] = gru_tb.forward(x.transpose(0, 1), RNNState{});
  require_close(y_tb.transpose(0, 1), y, 1e-6, 1e-6, "batch_first = false");
  CHECK(s.h.shape() == Shape{2, 2, 4});
  CHECK(!s.c.defined());
}

TEST_CASE("state carried across calls equals one call over both halves", "[rnn]") {
  Generator gen(6);
  int64_t L = 5;
  Tensor x = rand_tensor({3, 2 * L, 4}, gen);
  LSTM lstm({.input_size = 4, .hidden_size = 6, .num_layers = 2}, gen);
  GRU gru({.input_size = 4, .hidden_size = 6, .num_layers = 2}, gen);
  for (RNNBase* m : std::initializer_list<RNNBase*>{&lstm, &gru}) {
    RNNState start;
    if (m == &lstm) start = {rand_tensor({2, 3, 6}, gen), rand_tensor({2, 3, 6}, gen)};
    auto [y, s] = m->forward(x, start);
    auto [y1, s1] = m->forward(x.narrow(1, 0, L), start);
    auto [y2, s2] = m->forward(x.narrow(1, L, L), s1.detach());
    require_close(concat({y1, y2}, 1), y, 1e-5, 1e-6, "y");
    require_close(s2.h, s.h, 1e-5, 1e-6, "h");
    if (s.c.defined()) require_close(s2.c, s.c, 1e-5, 1e-6, "c");
    CHECK(!s1.detach().h.requires_grad());
  }
}

TEST_CASE("LSTM LM: names, weight tying, overfitting a fixed batch", "[rnn]") {
  auto tied = make_lstm_lm({.vocab_size = 12,
                            .embedding_dim = 8,
                            .hidden_size = 8,
                            .num_layers = 2,
                            .tie_weights = true});
  std::vector<std::string> names;
  for (const NamedTensor& p : tied->named_parameters()) names.push_back(p.name);
  CHECK(names.front() == "encoder.weight");
  CHECK(names.back() == "decoder.bias");
  CHECK(names.size() == 1 + 8 + 1);
  CHECK(tied->decoder_weight().impl() == tied->encoder->weight.impl());
  CHECK(!tied->decoder);
  // In the state under both names, as PyTorch's state_dict; a checkpoint
  // with the embedding only (older ones) still loads, a differing copy does not.
  std::map<std::string, Tensor> state;
  for (const NamedTensor& t : tied->state()) state[t.name] = t.tensor;
  REQUIRE(state.count("decoder.weight"));
  CHECK(state.at("decoder.weight").impl() == tied->encoder->weight.impl());
  state.erase("decoder.weight");
  tied->upgrade_loaded_state(state, "old.safetensors");
  REQUIRE(state.count("decoder.weight"));
  CHECK(state.at("decoder.weight").impl() == tied->encoder->weight.impl());
  state["decoder.weight"] = tied->encoder->weight + 1.0;
  CHECK_THROWS_WITH(tied->upgrade_loaded_state(state, "other.safetensors"),
                    Catch::Contains("other.safetensors: decoder.weight differs from "
                                    "encoder.weight") &&
                        Catch::Contains("model.tie_weights: false"));

  int64_t B = 4, T = 10, V = 16;
  auto lm = make_lstm_lm(
      {.vocab_size = V, .embedding_dim = 16, .hidden_size = 32, .num_layers = 2, .seed = 3});
  CHECK(lm->named_parameters().back().name == "decoder.bias");
  auto [x, y] = next_token_task(B, T, V);
  auto [first, last] = fit(lm->named_parameters(), 2e-2, 150, [&] {
    LSTMLMOutput out = lm->forward(x, RNNState{});
    CHECK(out.state.h.shape() == Shape{2, B, 32});
    return cross_entropy(out.logits.reshape({B * T, V}), y.reshape({B * T}));
  });
  INFO("loss " << first << " -> " << last);
  CHECK(std::abs(first - std::log(double(V))) < 0.3);
  CHECK(last < 0.05);
  Tensor stateless = (*lm)(x);
  require_close(stateless, lm->forward(x, RNNState{}).logits, 0, 0, "Module::forward");
}
