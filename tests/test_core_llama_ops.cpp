// The Llama family's fused ops (core/ops_transformer.h): RMS norm,
// grouped-query causal attention and the rotary embedding. Each against a
// scalar formula written here, its gradients against finite differences, the
// CPU fast kernels against the reference ones over odd shapes and dtypes;
// grouped-query attention against attention on repeated key/value heads;
// their cases in the op table (tests/op_cases.cpp).
#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <vector>

#include "core/autocast.h"
#include "core/ops_transformer.h"
#include "tests/op_cases.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// ---- RMS norm ----

// y = w x / sqrt(mean(x^2) + eps) over the rows of x [R, D], in double.
std::vector<double> rms_norm_formula(const std::vector<double>& x, const std::vector<double>& w,
                                     double eps) {
  const size_t D = w.size();
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / D; ++r) {
    double ms = 0.0;
    for (size_t d = 0; d < D; ++d) ms += x[r * D + d] * x[r * D + d];
    const double rs = 1.0 / std::sqrt(ms / double(D) + eps);
    for (size_t d = 0; d < D; ++d) y[r * D + d] = w[d] * x[r * D + d] * rs;
  }
  return y;
}

// The sums of an RMS norm over x of shape: D terms per row (the mean square,
// the backward's dot product), the rows for the weight gradient.
Reduction rms_norm_reduction(const Shape& shape) {
  const int64_t D = shape.back(), n = std::max<int64_t>(D, shape_numel(shape) / D);
  return {.length = n, .scale = 4 * std::sqrt(double(n))};
}

}  // namespace

TEST_CASE("rms_norm equals its scalar formula", "[llama_ops]") {
  Generator gen(1);
  for (const Shape& shape : {Shape{4, 7}, Shape{2, 3, 33}, Shape{1, 1}, Shape{5, 129}}) {
    INFO(shape_str(shape));
    const int64_t D = shape.back();
    Tensor x = rand_f64(shape, gen, -3.0, 3.0), w = rand_f64({D}, gen, 0.5, 1.5);
    const std::vector<double> y =
        rms_norm_formula(x.to_vector<double>(), w.to_vector<double>(), 1e-5);
    require_close(rms_norm(x, w, 1e-5), from_vector(y, shape), 1e-12, 1e-12, "f64");
    const Tolerance tol = tolerance(DType::f32, rms_norm_reduction(shape));
    require_close(rms_norm(x.to(DType::f32), w.to(DType::f32), 1e-5), from_vector(y, shape),
                  tol.rtol, tol.atol, "f32");
  }
  // A zero row: eps keeps it finite, the output 0.
  Tensor z = rms_norm(zeros({2, 4}), ones({4}));
  REQUIRE(z.to_vector<float>() == std::vector<float>(8, 0.0f));
}

TEST_CASE("rms_norm gradients match finite differences", "[llama_ops]") {
  Generator gen(2);
  gradcheck([](const TensorList& in) { return rms_norm(in[0], in[1], 1e-5); },
            {rand_f64({3, 5}, gen), rand_f64({5}, gen)});
  gradcheck([](const TensorList& in) { return rms_norm(in[0].transpose(0, 1), in[1]); },
            {rand_f64({4, 2, 3}, gen), rand_f64({3}, gen)});
  gradcheck([](const TensorList& in) { return rms_norm(in[0], in[1]); },
            {rand_f64({2, 1}, gen, 0.5, 1.0), rand_f64({1}, gen)});
}

TEST_CASE("rms_norm fast path matches the reference on odd shapes and dtypes", "[llama_ops]") {
  Generator gen(3);
  for (const Shape& shape :
       {Shape{7, 33}, Shape{2, 3, 65}, Shape{1, 1}, Shape{300, 129}, Shape{3, 4099}}) {
    const int64_t D = shape.back();
    for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
      INFO(shape_str(shape) << " " << dtype);
      Tensor x = rand_tensor(shape, gen, -2.0, 2.0, dtype);
      Tensor w = rand_tensor({D}, gen, 0.5, 1.5, dtype);
      auto f = [](const TensorList& in) { return rms_norm(in[0], in[1]); };
      check_fast_vs_reference(f, {x, w}, rms_norm_reduction(shape));
      check_fast_vs_reference(f, {non_contiguous(x), w}, rms_norm_reduction(shape));
    }
  }
}

TEST_CASE("rms_norm checks its operands", "[llama_ops]") {
  CHECK_THAT(check_failure_of([] {
               rms_norm(zeros({2, 4}), ones({5}));
             }),
             Catch::Contains("rms_norm: weight [5] must be [4] for x [2, 4]"));
  CHECK_THAT(check_failure_of([] {
               rms_norm(zeros({2, 4}), ones({4}), -1.0);
             }),
             Catch::Contains("eps -1 is negative"));
}

// ---- grouped-query attention ----

namespace {

Tensor gqa(const TensorList& in, int64_t NH, int64_t KV, double p = 0.0, uint64_t seed = 3) {
  Generator gen(seed, kStreamDropout);
  return causal_attention(in[0], in[1], in[2], NH, p, /*training=*/p > 0.0, gen, KV);
}

// k or v [B, T, KV HD] with each kv head repeated NH / KV times: [B, T, NH HD]
// (Hugging Face's repeat_kv); its backward sums each group's gradients.
Tensor repeat_kv(const Tensor& x, int64_t NH, int64_t KV) {
  const int64_t HD = x.size(2) / KV;
  TensorList heads;
  for (int64_t h = 0; h < NH; ++h) heads.push_back(x.narrow(2, h / (NH / KV) * HD, HD));
  return concat(heads, 2);
}

// Grouped-query causal attention with plain loops over contiguous f64 q [B,
// T, NH HD] and k, v [B, T, KV HD]: query head h reads kv head h / (NH / KV).
std::vector<double> naive_gqa(const std::vector<double>& q, const std::vector<double>& k,
                              const std::vector<double>& v, int64_t B, int64_t T, int64_t NH,
                              int64_t KV, int64_t HD) {
  std::vector<double> out(q.size(), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t g = h / (NH / KV);
        auto qi = [&](int64_t c) { return size_t((b * T + t) * NH * HD + h * HD + c); };
        auto ki = [&](int64_t s, int64_t c) { return size_t((b * T + s) * KV * HD + g * HD + c); };
        std::vector<double> e(size_t(t + 1));
        double mx = -1e300, z = 0.0;
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0.0;
          for (int64_t c = 0; c < HD; ++c) dot += q[qi(c)] * k[ki(s, c)];
          e[size_t(s)] = dot / std::sqrt(double(HD));
          mx = std::max(mx, e[size_t(s)]);
        }
        for (double& x : e) z += (x = std::exp(x - mx));
        for (int64_t s = 0; s <= t; ++s)
          for (int64_t c = 0; c < HD; ++c) out[qi(c)] += e[size_t(s)] / z * v[ki(s, c)];
      }
  return out;
}

struct AttentionShape {
  int64_t B, T, NH, KV, HD;
};

// q, k, v of a shape as views into one fused [B, T, (NH + 2 KV) HD] projection.
TensorList fused_qkv(const AttentionShape& s, Generator& gen, DType dtype) {
  const int64_t Dq = s.NH * s.HD, Dkv = s.KV * s.HD;
  Tensor qkv = rand_tensor({s.B, s.T, Dq + 2 * Dkv}, gen, -2.0, 2.0, dtype);
  return {qkv.narrow(2, 0, Dq), qkv.narrow(2, Dq, Dkv), qkv.narrow(2, Dq + Dkv, Dkv)};
}

// Output and the gradients of q, k, v of f under the probe cotangent.
TensorList run_with_grads(const std::function<Tensor(const TensorList&)>& f, const TensorList& in) {
  TensorList leaves;
  for (const Tensor& t : in) leaves.push_back(t.detach().requires_grad_());
  Tensor out = f(leaves);
  out.backward(probe_like(out));
  return {out.detach(), leaves[0].grad(), leaves[1].grad(), leaves[2].grad()};
}

}  // namespace

TEST_CASE("grouped-query attention equals its scalar formula", "[llama_ops]") {
  Generator gen(10);
  for (const AttentionShape& s : {AttentionShape{2, 7, 4, 2, 3}, AttentionShape{1, 5, 6, 1, 4},
                                  AttentionShape{2, 4, 3, 3, 2}}) {
    INFO("NH " << s.NH << " KV " << s.KV);
    TensorList in = fused_qkv(s, gen, DType::f64);
    std::vector<double> expected =
        naive_gqa(in[0].contiguous().to_vector<double>(), in[1].contiguous().to_vector<double>(),
                  in[2].contiguous().to_vector<double>(), s.B, s.T, s.NH, s.KV, s.HD);
    require_close(gqa(in, s.NH, s.KV), from_vector(expected, {s.B, s.T, s.NH * s.HD}), 1e-12, 1e-12,
                  "f64");
    ReferenceKernelsGuard reference;
    require_close(gqa(in, s.NH, s.KV), from_vector(expected, {s.B, s.T, s.NH * s.HD}), 1e-12, 1e-12,
                  "reference kernels");
  }
}

TEST_CASE("grouped-query attention with KV = NH is the multi-head path, bit for bit",
          "[llama_ops]") {
  Generator gen(11);
  const AttentionShape s{2, 37, 3, 3, 5};
  for (DType dtype : {DType::f32, DType::f64, DType::bf16})
    for (double p : {0.0, 0.2}) {
      INFO(dtype << " dropout " << p);
      TensorList in = fused_qkv(s, gen, dtype);
      TensorList plain = run_with_grads(
          [&](const TensorList& x) {
            Generator g(4, kStreamDropout);
            return causal_attention(x[0], x[1], x[2], s.NH, p, p > 0.0, g);
          },
          in);
      TensorList grouped =
          run_with_grads([&](const TensorList& x) { return gqa(x, 3, 3, p, 4); }, in);
      for (size_t i = 0; i < plain.size(); ++i)
        require_close(grouped[i], plain[i], 0.0, 0.0, cat("output ", i));
    }
}

TEST_CASE("grouped-query attention equals attention on repeated key/value heads", "[llama_ops]") {
  Generator gen(12);
  for (const AttentionShape& s : {AttentionShape{2, 37, 6, 2, 5}, AttentionShape{1, 70, 4, 1, 8},
                                  AttentionShape{2, 5, 4, 2, 3}}) {
    for (DType dtype : {DType::f64, DType::f32})
      for (double p : {0.0, 0.25}) {
        INFO("T " << s.T << " NH " << s.NH << " KV " << s.KV << " " << dtype << " dropout " << p);
        TensorList in = fused_qkv(s, gen, dtype);
        TensorList grouped =
            run_with_grads([&](const TensorList& x) { return gqa(x, s.NH, s.KV, p); }, in);
        TensorList repeated = run_with_grads(
            [&](const TensorList& x) {
              return gqa({x[0], repeat_kv(x[1], s.NH, s.KV), repeat_kv(x[2], s.NH, s.KV)}, s.NH,
                         s.NH, p);
            },
            in);
        // Sums over T keys and the group's NH / KV heads, values up to 2.
        const int64_t n = std::max(s.T, s.HD) * (s.NH / s.KV);
        const Tolerance tol = tolerance(dtype, {.length = n, .scale = 8 * std::sqrt(double(n))});
        const char* what[] = {"forward", "grad q", "grad k", "grad v"};
        for (size_t i = 0; i < 4; ++i)
          require_close(grouped[i], repeated[i], tol.rtol, tol.atol, what[i]);
      }
  }
}

TEST_CASE("grouped-query attention gradients match finite differences", "[llama_ops]") {
  Generator gen(13);
  for (double p : {0.0, 0.3}) {
    const AttentionShape s{2, 4, 4, 2, 3};
    TensorList in = fused_qkv(s, gen, DType::f64);
    gradcheck([p](const TensorList& x) { return gqa(x, 4, 2, p); },
              {in[0].contiguous(), in[1].contiguous(), in[2].contiguous()});
  }
}

TEST_CASE("grouped-query attention fast kernels match the reference ones", "[llama_ops]") {
  Generator gen(14);
  for (const AttentionShape& s : {AttentionShape{2, 37, 6, 2, 5}, AttentionShape{1, 70, 4, 1, 8},
                                  AttentionShape{2, 5, 4, 2, 3}, AttentionShape{1, 1, 2, 1, 4}}) {
    for (DType dtype : {DType::f32, DType::f64, DType::bf16})
      for (double p : {0.0, 0.25}) {
        INFO("T " << s.T << " NH " << s.NH << " KV " << s.KV << " " << dtype << " dropout " << p);
        const int64_t n = std::max(s.T, s.HD) * (s.NH / s.KV);
        check_fast_vs_reference([&](const TensorList& x) { return gqa(x, s.NH, s.KV, p); },
                                fused_qkv(s, gen, dtype),
                                {.length = n, .scale = 8 * std::sqrt(double(n)), .roundings = 2});
      }
  }
}

TEST_CASE("grouped-query attention checks its operands", "[llama_ops]") {
  Tensor q = zeros({2, 5, 24}), k = zeros({2, 5, 8});
  CHECK_THAT(check_failure_of([&] {
               gqa({q, k, k}, 6, 4);
             }),
             Catch::Contains("4 key/value heads do not divide 6 heads"));
  CHECK_THAT(check_failure_of([&] {
               gqa({q, k, k}, 6, 3);
             }),
             Catch::Contains("k and v [2, 5, 8] must be [2, 5, 12] for q [2, 5, 24] with 6 heads "
                             "of 4 and 3 key/value heads"));
  CHECK_THAT(check_failure_of([&] {
               gqa({q, k, zeros({2, 5, 4})}, 6, 2);
             }),
             Catch::Contains("must be [B, T, D], [B, T, KV HD] and [B, T, KV HD]"));
}

// ---- rotary embedding ----

namespace {

// The frequencies by their formulas, in double: 1 / theta^(2j / HD), then
// the scaling (linear: / factor; llama3: / factor at wavelengths above
// original / low_freq_factor, unchanged below original / high_freq_factor,
// interpolated between).
std::vector<double> inv_freq_formula(int64_t HD, const RopeOptions& o) {
  std::vector<double> f;
  for (int64_t j = 0; j < HD / 2; ++j) {
    double inv = 1.0 / std::pow(o.theta, 2.0 * double(j) / double(HD));
    if (o.scaling == "linear") inv /= o.factor;
    if (o.scaling == "llama3") {
      const double wavelen = 2 * M_PI / inv, context = double(o.original_max_position);
      if (wavelen > context / o.low_freq_factor) {
        inv /= o.factor;
      } else if (wavelen >= context / o.high_freq_factor) {
        const double smooth =
            (context / wavelen - o.low_freq_factor) / (o.high_freq_factor - o.low_freq_factor);
        inv = (1 - smooth) * inv / o.factor + smooth * inv;
      }
    }
    f.push_back(inv);
  }
  return f;
}

// out[b, t, h HD + i] for x [B, T, NH HD] (contiguous f64 values) with the
// angles a = f32(f32(pos[t]) * inv_freq[i]): the pairs (i, i + HD/2) turned
// by a, cos and sin in double.
std::vector<double> rope_formula(const std::vector<double>& x, const std::vector<int64_t>& pos,
                                 const std::vector<float>& inv_freq, int64_t B, int64_t NH) {
  const int64_t T = int64_t(pos.size()), half = int64_t(inv_freq.size()), HD = 2 * half;
  std::vector<double> out(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const double a = double(float(pos[size_t(t)]) * inv_freq[size_t(i)]);
          const size_t i0 = size_t(((b * T + t) * NH + h) * HD + i), i1 = i0 + size_t(half);
          out[i0] = x[i0] * std::cos(a) - x[i1] * std::sin(a);
          out[i1] = x[i1] * std::cos(a) + x[i0] * std::sin(a);
        }
  return out;
}

Tensor positions_of(const std::vector<int64_t>& pos) { return from_vector(pos); }

// Float bit patterns printed by transformers (see the test below for how).
std::vector<float> floats(const std::vector<uint32_t>& bits) {
  std::vector<float> f;
  for (uint32_t b : bits) f.push_back(bits_float(b));
  return f;
}

const RopeOptions kLlama3{.theta = 500000.0,
                          .scaling = "llama3",
                          .factor = 8.0,
                          .low_freq_factor = 1.0,
                          .high_freq_factor = 4.0,
                          .original_max_position = 8192};
// Every band of llama3 at HD 16: high frequencies kept, one interpolated, low ones divided.
const RopeOptions kLlama3Small{.theta = 10000.0,
                               .scaling = "llama3",
                               .factor = 32.0,
                               .low_freq_factor = 1.0,
                               .high_freq_factor = 4.0,
                               .original_max_position = 1024};

}  // namespace

TEST_CASE("rope frequencies follow their formulas for every scaling", "[llama_ops]") {
  const RopeOptions linear{.theta = 10000.0, .scaling = "linear", .factor = 4.0};
  for (const auto& [HD, o] :
       std::vector<std::pair<int64_t, RopeOptions>>{{2, RopeOptions{}},
                                                    {64, RopeOptions{}},
                                                    {128, {.theta = 500000.0}},
                                                    {16, linear},
                                                    {128, kLlama3},
                                                    {64, kLlama3},
                                                    {16, kLlama3Small}}) {
    INFO("HD " << HD << " " << o.scaling << " theta " << o.theta);
    const std::vector<float> f = rope_inv_freq(HD, o);
    const std::vector<double> expected = inv_freq_formula(HD, o);
    REQUIRE(f.size() == expected.size());
    for (size_t j = 0; j < f.size(); ++j) {
      INFO("j " << j);
      CHECK(std::fabs(f[j] - expected[j]) <= 4e-7 * expected[j]);  // a few f32 ulps
    }
  }
  // The bands of kLlama3Small: j < 4 kept, j = 4 interpolated, j > 4 divided by 32.
  const std::vector<float> f = rope_inv_freq(16, kLlama3Small);
  const std::vector<float> plain = rope_inv_freq(16, {.theta = 10000.0});
  for (size_t j = 0; j < 4; ++j) CHECK(f[j] == plain[j]);
  CHECK(f[4] < plain[4]);
  CHECK(f[4] > plain[4] / 32);
  for (size_t j = 5; j < 8; ++j) CHECK(f[j] == Approx(plain[j] / 32).epsilon(1e-6));
}

TEST_CASE("rope frequencies are transformers' bit for bit", "[llama_ops]") {
  // Printed with transformers 5.24 / torch 2.15 on CPU: LlamaRotaryEmbedding(config).inv_freq as
  // f32 bit patterns, config = LlamaConfig(head_dim=HD, rope_parameters={"rope_type": ...,
  // "rope_theta": ..., the scaling's fields}).
  // rope_theta 10000, HD 16, linear factor 4.
  CHECK(rope_inv_freq(16, {.theta = 10000.0, .scaling = "linear", .factor = 4.0}) ==
        floats({0x3e800000, 0x3da1e89b, 0x3ccccccd, 0x3c0186e3, 0x3b23d70a, 0x3a4f3e38, 0x3983126f,
                0x38a5cb60}));
  // rope_theta 10000, HD 16, llama3 factor 32, low 1, high 4, original 1024.
  CHECK(rope_inv_freq(16, kLlama3Small) ==
        floats({0x3f800000, 0x3ea1e89b, 0x3dcccccd, 0x3d0186e3, 0x3b19c04c, 0x38cf3e38, 0x3803126f,
                0x3725cb60}));
  // rope_theta 10000, HD 64, default.
  CHECK(rope_inv_freq(64, {}) ==
        floats({0x3f800000, 0x3f3ff911, 0x3f0ff59a, 0x3ed7e89b, 0x3ea1e89b, 0x3e72d423, 0x3e361887,
                0x3e088d77, 0x3dcccccd, 0x3d99940d, 0x3d6655c2, 0x3d2cba15, 0x3d0186e3, 0x3cc2434f,
                0x3c91ad39, 0x3c5a7bf2, 0x3c23d70a, 0x3bf5b9b0, 0x3bb8449c, 0x3b8a2e77, 0x3b4f3e38,
                0x3b1b690d, 0x3ae91528, 0x3aaec98e, 0x3a83126f, 0x3a44948c, 0x3a136a16, 0x39dd1725,
                0x39a5cb60, 0x3978a815, 0x393a7753, 0x390bd472}));
  // rope_theta 500000, HD 128, llama3 factor 8, low 1, high 4, original 8192 (Llama 3.1).
  CHECK(rope_inv_freq(128, kLlama3) ==
        floats({0x3f800000, 0x3f508ac1, 0x3f29e1c6, 0x3f0a6384, 0x3ee177bc, 0x3eb7ab7d, 0x3e959ee3,
                0x3e73c461, 0x3e4693b0, 0x3e21c3a0, 0x3e03c6a0, 0x3dd6b19c, 0x3daee4ad, 0x3d8e7898,
                0x3d681e67, 0x3d3d1684, 0x3d1a08c8, 0x3cfaf53f, 0x3ccc6f49, 0x3ca68939, 0x3c87a9c3,
                0x3c5d06ec, 0x3c340d6d, 0x3c12ac7f, 0x3beef74f, 0x3bc2aa76, 0x3b9e9402, 0x3b812e35,
                0x3b527720, 0x3b0dfd06, 0x3ab3d11d, 0x3a60979e, 0x3a0995d2, 0x39a3f108, 0x393b2dd2,
                0x38c86886, 0x38a3418d, 0x3884fdbf, 0x3858ac81, 0x38308199, 0x380fc8f8, 0x37ea426f,
                0x37bed4f4, 0x379b7475, 0x377d45c3, 0x374e51f5, 0x3728126b, 0x3708ea0f, 0x36df10c4,
                0x36b5b687, 0x369406cb, 0x36712b80, 0x36447610, 0x36200a69, 0x36025f34, 0x35d46808,
                0x35ad07a7, 0x358cf400, 0x3565a54d, 0x353b12c7, 0x351864a7, 0x34f848c2, 0x34ca41b0,
                0x34a4c2ff}));
}

TEST_CASE("rotary embedding equals transformers' apply_rotary_pos_emb", "[llama_ops]") {
  // transformers 5.24 on CPU, f32: LlamaRotaryEmbedding for the kLlama3Small
  // config (hidden_size 32, 2 heads of 16), cos, sin = rotary(q, [[8191, 123456]]),
  // apply_rotary_pos_emb(q, q, cos, sin) with q the x below as [1, 2 heads, 2, 16].
  std::vector<float> x;
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < 32; ++i) x.push_back(float((t * 131 + i * 17) % 97) / 48.0f - 1.0f);
  const std::vector<float> expected = {
      0.503326714,   -0.18048887,  -0.201971501, -0.854025543, 0.672979236,  0.84850651,
      -0.84554714,   -0.561791658, 0.884205043,  -0.642107666, -0.561733305, 0.200428486,
      -0.58944571,   0.256177664,  -0.307427704, 0.226149529,  -0.849081337, 0.250128329,
      0.356440693,   -0.525952041, -0.279562533, 0.861966014,  0.826726079,  -0.92432344,
      -0.0998181403, 0.974022865,  -0.601025224, -0.253152609, 0.785317302,  -0.303453356,
      -0.278942287,  -0.200393289, 0.581650257,  -0.364390969, -0.326896548, -0.0678496659,
      -0.687550604,  -0.408727974, 0.551831603,  -0.862263858, -0.134237573, -0.797966421,
      -0.832758009,  0.883734524,  -0.580289602, 0.446872413,  -0.348228604, 0.492997169,
      0.554738164,   0.144829229,  0.64435786,   0.481598765,  0.872201562,  -0.920074999,
      0.590421379,   -0.626559973, 0.424908012,  -0.565452278, 0.528849065,  0.776615739,
      0.0234341025,  0.219073623,  0.210232556,  -0.0147545338};
  Tensor out =
      rotary_embedding(from_vector(x, {1, 2, 32}), 2, positions_of({8191, 123456}), kLlama3Small);
  // The same f32 angles; cos and sin within an ulp or two of torch's.
  require_close(out, from_vector(expected, {1, 2, 32}), 1e-6, 1e-6, "transformers");
}

TEST_CASE("rotary embedding equals its scalar formula", "[llama_ops]") {
  Generator gen(20);
  const std::vector<int64_t> pos = {17, 3, 250, 9, 4000, 0, 70000};
  for (const auto& [NH, HD] : std::vector<std::pair<int64_t, int64_t>>{{3, 2}, {2, 64}, {1, 128}}) {
    for (const RopeOptions& o : {RopeOptions{}, kLlama3}) {
      INFO("NH " << NH << " HD " << HD << " " << o.scaling);
      const int64_t B = 2, T = int64_t(pos.size());
      Tensor x = rand_f64({B, T, NH * HD}, gen, -2.0, 2.0);
      const std::vector<double> y =
          rope_formula(x.to_vector<double>(), pos, rope_inv_freq(HD, o), B, NH);
      Tensor expected = from_vector(y, {B, T, NH * HD});
      require_close(rotary_embedding(x, NH, positions_of(pos), o), expected, 1e-12, 1e-12, "f64");
      // f32: cos and sin of f32 angles up to 7e4 in f32 (about an ulp each).
      require_close(rotary_embedding(x.to(DType::f32), NH, positions_of(pos), o), expected, 1e-6,
                    1e-6, "f32");
    }
  }
}

TEST_CASE("rotary embedding gradients match finite differences", "[llama_ops]") {
  Generator gen(21);
  const Tensor pos = positions_of({5, 1, 9});
  gradcheck([&](const TensorList& in) { return rotary_embedding(in[0], 2, pos, {}); },
            {rand_f64({2, 3, 8}, gen)});
  gradcheck([&](const TensorList& in) { return rotary_embedding(in[0], 1, pos, kLlama3); },
            {rand_f64({1, 3, 128}, gen)});
  // A view of a fused projection, heads of 2.
  gradcheck(
      [&](const TensorList& in) { return rotary_embedding(in[0].narrow(2, 6, 6), 3, pos, {}); },
      {rand_f64({2, 3, 18}, gen)});
}

TEST_CASE("rotary embedding fast path matches the reference", "[llama_ops]") {
  Generator gen(22);
  // Positions not starting at 0, unsorted, strided (every other element of a buffer).
  auto positions = [](int64_t T) {
    std::vector<int64_t> p;
    for (int64_t t = 0; t < 2 * T; ++t) p.push_back((t * 7919 + 13) % 9001);
    return from_vector(p).slice(0, 0, 2 * T, 2);
  };
  struct Case {
    int64_t B, T, NH, HD;
  };
  for (const Case& c : {Case{2, 5, 3, 2}, Case{1, 1, 2, 64}, Case{2, 7, 2, 128}, Case{3, 33, 5, 6},
                        Case{4, 129, 6, 64}}) {
    for (DType dtype : {DType::f32, DType::f64, DType::bf16})
      for (const RopeOptions& o : {RopeOptions{}, kLlama3}) {
        INFO("B " << c.B << " T " << c.T << " NH " << c.NH << " HD " << c.HD << " " << dtype << " "
                  << o.scaling);
        const int64_t W = c.NH * c.HD;
        Tensor pos = positions(c.T);
        auto f = [&](const TensorList& in) { return rotary_embedding(in[0], c.NH, pos, o); };
        // A view of a fused projection (row stride 3W), and every other element (not unit stride).
        Tensor fused = rand_tensor({c.B, c.T, 3 * W}, gen, -2.0, 2.0, dtype);
        check_fast_vs_reference(f, {fused.narrow(2, W, W)}, {.scale = 2});
        check_fast_vs_reference(f, {non_contiguous(rand_tensor({c.B, c.T, W}, gen, -2, 2, dtype))},
                                {.scale = 2});
      }
  }
}

TEST_CASE("rotary embedding keeps its input's dtype and checks its operands", "[llama_ops]") {
  Generator gen(23);
  Tensor x = rand_tensor({2, 3, 8}, gen);
  {
    AutocastGuard autocast(DType::bf16);
    REQUIRE(rotary_embedding(x, 2, positions_of({0, 1, 2}), {}).dtype() == DType::f32);
    REQUIRE(rotary_embedding(x.to(DType::bf16), 2, positions_of({0, 1, 2}), {}).dtype() ==
            DType::bf16);
  }
  // Position 0 is the identity.
  require_close(rotary_embedding(x, 2, positions_of({0, 0, 0}), {}), x, 0.0, 0.0, "position 0");
  CHECK_THAT(check_failure_of([&] {
               rotary_embedding(zeros({2, 3, 12}), 4, positions_of({0, 1, 2}), {});
             }),
             Catch::Contains("head width 3 (width 12 over 4 heads) is not even"));
  CHECK_THAT(check_failure_of([&] {
               rotary_embedding(x, 2, positions_of({0, 1}), {});
             }),
             Catch::Contains("positions [2] of dtype i64 must be i64 [3] for x [2, 3, 8]"));
  CHECK_THAT(check_failure_of([&] {
               rotary_embedding(x, 2, positions_of({0, 1, 2}), {.scaling = "yarn"});
             }),
             Catch::Contains("scaling 'yarn' (none, linear or llama3)"));
}

TEST_CASE("the op table runs the Llama ops on every backend", "[llama_ops]") {
  const std::vector<std::string> ops = op_names(op_cases());
  for (const char* op : {"rms_norm", "rotary_embedding"}) {
    INFO(op);
    CHECK(std::find(ops.begin(), ops.end(), op) != ops.end());
  }
  CHECK(std::any_of(op_cases().begin(), op_cases().end(), [](const OpCase& c) {
    return c.op == "attention" && c.variant.find("kv heads") != std::string::npos;
  }));
}
