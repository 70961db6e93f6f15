// softmax, log_softmax, cross_entropy and dropout: finite-difference
// gradients, closed forms, the CPU fast kernels against the reference ones,
// and dropout's statistics and determinism.
#include <limits>

#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

TEST_CASE("softmax: gradcheck over several dims", "[nn]") {
  Generator gen(1, 12);
  for (int dim : {0, 1, 2, -1}) {
    INFO("dim " << dim);
    Tensor x = rand_f64({3, 4, 5}, gen, -2, 2);
    gradcheck([dim](const TensorList& in) { return softmax(in[0], dim); }, {x});
    gradcheck([dim](const TensorList& in) { return log_softmax(in[0], dim); }, {x});
  }
  // A strided input.
  gradcheck([](const TensorList& in) { return softmax(in[0].t(), 1); }, {rand_f64({5, 3}, gen)});
}

TEST_CASE("softmax: closed form and masked entries", "[nn]") {
  Tensor x = from_vector<float>({0, std::log(2.0f), std::log(5.0f)}, {1, 3});
  require_close(softmax(x, 1), from_vector<float>({0.125f, 0.25f, 0.625f}, {1, 3}), 1e-6, 1e-7);
  require_close(log_softmax(x, 1),
                from_vector<float>({-std::log(8.0f), -std::log(4.0f), std::log(0.625f)}, {1, 3}),
                1e-6, 1e-7);
  // Shift invariance far from 0, and -inf (a masked position) giving exactly 0.
  float inf = std::numeric_limits<float>::infinity();
  Tensor y = from_vector<float>({1000, 1000, -inf, 999}, {2, 2});
  std::vector<float> p = softmax(y, 1).to_vector<float>();
  REQUIRE(p[0] == Approx(0.5f));
  REQUIRE(p[2] == 0.0f);
  REQUIRE(p[3] == 1.0f);
  REQUIRE(log_softmax(y, 1).to_vector<float>()[2] == -inf);
  REQUIRE(softmax(scalar_tensor(3.0), 0).item<float>() == 1.0f);
}

TEST_CASE("softmax: fast kernels match the reference", "[nn]") {
  Generator gen(2, 12);
  const Shape shapes[] = {{1, 1}, {7, 33}, {129, 7}, {3, 33, 5}, {2, 1000}};
  for (const Shape& shape : shapes) {
    for (int dim = 0; dim < int(shape.size()); ++dim) {
      for (bool log : {false, true}) {
        INFO(shape_str(shape) << " dim " << dim << " log " << log);
        auto f = [dim, log](const TensorList& in) {
          return log ? log_softmax(in[0], dim) : softmax(in[0], dim);
        };
        Tensor x = rand_tensor(shape, gen, -8, 8);
        // A row of n: the backward sums n cotangents (0.5..1.5) weighted by
        // probabilities, so the terms that cancel are of size ~2.
        const Reduction row{.length = shape[size_t(dim)], .scale = 2};
        check_fast_vs_reference(f, {x}, row);
        check_fast_vs_reference(f, {non_contiguous(x)}, row);
        // bf16 in and out: each side rounds its result, and the backward reads
        // the rounded forward output.
        check_fast_vs_reference(f, {x.to(DType::bf16)},
                                {.length = shape[size_t(dim)], .scale = 2, .roundings = 2});
      }
    }
  }
  // Large enough to split rows across threads, in both the in-place and the gather path.
  Tensor big = rand_tensor({64, 1031}, gen, -8, 8);
  for (int dim : {0, 1}) {
    const Reduction row{.length = big.size(dim), .scale = 2};
    check_fast_vs_reference([dim](const TensorList& in) { return softmax(in[0], dim); }, {big},
                            row);
    check_fast_vs_reference([dim](const TensorList& in) { return log_softmax(in[0], dim); }, {big},
                            row);
  }
  // Transposed: the softmax dim is strided in x, unit-stride in the output.
  Tensor xt = rand_tensor({33, 7}, gen, -8, 8).t();
  check_fast_vs_reference([](const TensorList& in) { return softmax(in[0], 1); }, {xt},
                          {.length = 33, .scale = 2});
  check_fast_vs_reference([](const TensorList& in) { return log_softmax(in[0], 0); }, {xt},
                          {.length = 33, .scale = 2});
}

namespace {

Tensor targets(const std::vector<int64_t>& t) { return from_vector<int64_t>(t); }

CrossEntropyOptions ce_options(double smoothing, CrossEntropyOptions::Reduction r) {
  CrossEntropyOptions o;
  o.label_smoothing = smoothing;
  o.reduction = r;
  return o;
}

}  // namespace

TEST_CASE("cross_entropy: closed form", "[nn]") {
  // Row 0: uniform over 3 classes, so loss = log 3 for any target and any smoothing.
  // Row 1: p = (1, 2, 3) / 6, target 2: loss = -(1 - eps) log(1/2) - eps/3 sum_c log p_c.
  Tensor logits = from_vector<float>({0, 0, 0, 0, std::log(2.0f), std::log(3.0f)}, {2, 3});
  Tensor t = targets({1, 2});
  double sum_logp = std::log(1.0 / 6) + std::log(2.0 / 6) + std::log(3.0 / 6);
  for (double eps : {0.0, 0.1}) {
    INFO("label_smoothing " << eps);
    double row1 = -(1 - eps) * std::log(0.5) - eps / 3 * sum_logp;
    using R = CrossEntropyOptions::Reduction;
    require_close(cross_entropy(logits, t, ce_options(eps, R::none)),
                  from_vector<float>({float(std::log(3.0)), float(row1)}), 1e-6, 1e-6);
    REQUIRE(cross_entropy(logits, t, ce_options(eps, R::sum)).item<double>() ==
            Approx(std::log(3.0) + row1).epsilon(1e-6));
    REQUIRE(cross_entropy(logits, t, ce_options(eps, R::mean)).item<double>() ==
            Approx((std::log(3.0) + row1) / 2).epsilon(1e-6));
  }
  // An ignored row counts neither in the sum nor in the mean's denominator.
  CrossEntropyOptions o;
  o.ignore_index = 7;
  REQUIRE(cross_entropy(logits, targets({7, 2}), o).item<double>() ==
          Approx(std::log(2.0)).epsilon(1e-6));
}

TEST_CASE("cross_entropy: all rows ignored gives 0, not NaN", "[nn]") {
  Tensor logits = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}).requires_grad_();
  Tensor loss = cross_entropy(logits, targets({-100, -100}));
  REQUIRE(loss.item<float>() == 0.0f);
  loss.backward();
  REQUIRE(logits.grad().to_vector<float>() == std::vector<float>(6, 0.0f));
}

TEST_CASE("cross_entropy: gradcheck", "[nn]") {
  Generator gen(3, 12);
  Tensor t = targets({2, -100, 0, 4, 4});
  using R = CrossEntropyOptions::Reduction;
  for (double eps : {0.0, 0.1}) {
    for (R r : {R::mean, R::sum, R::none}) {
      INFO("label_smoothing " << eps << " reduction " << int(r));
      gradcheck(
          [&](const TensorList& in) { return cross_entropy(in[0], in[1], ce_options(eps, r)); },
          {rand_f64({5, 6}, gen, -3, 3), t});
    }
  }
}

TEST_CASE("cross_entropy: fast kernels match the reference", "[nn]") {
  Generator gen(4, 12);
  using R = CrossEntropyOptions::Reduction;
  // N = 300 with C = 129 splits the rows across threads.
  for (int64_t C : {1, 7, 33, 129}) {
    for (int64_t N : {1, 7, 300}) {
      std::vector<int64_t> t(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) t[size_t(i)] = i % 5 == 3 ? -100 : (i * 31 + 5) % C;
      Tensor target = targets(t);
      for (double eps : {0.0, 0.1}) {
        INFO("N " << N << " C " << C << " label_smoothing " << eps);
        auto f = [&](const TensorList& in) {
          return cross_entropy(in[0], in[1], ce_options(eps, R::none));
        };
        Tensor x = rand_tensor({N, C}, gen, -6, 6);
        // log-sum-exp over a row of C; losses up to ~12.
        const Reduction row{.length = C, .scale = 12};
        check_fast_vs_reference(f, {x, target}, row);
        // Strided logits: rows and classes transposed in memory.
        check_fast_vs_reference(f, {rand_tensor({C, N}, gen, -6, 6).t(), target}, row);
      }
    }
  }
}

TEST_CASE("dropout: identity, zeros and gradient", "[nn]") {
  Generator gen(5, kStreamDropout);
  Tensor x = rand_tensor({4, 33}, gen);
  REQUIRE(dropout(x, 0.5, /*training=*/false, gen).impl() == x.impl());
  REQUIRE(dropout(x, 0.0, /*training=*/true, gen).impl() == x.impl());
  REQUIRE(dropout(x, 1.0, true, gen).to_vector<float>() == std::vector<float>(4 * 33, 0.0f));

  // The gradient is the mask times 1 / (1 - p), the mask being bernoulli(1 - p)
  // drawn from the generator's current state.
  const double p = 0.25;
  Generator replay = gen;
  Tensor mask = bernoulli(x.shape(), 1 - p, replay);
  Tensor xr = x.detach().requires_grad_();
  Tensor y = dropout(xr, p, true, gen);
  REQUIRE(gen.offset() == replay.offset());
  Tensor v = rand_tensor(x.shape(), replay);
  sum(y * v).backward();
  const float scale = float(1.0 / (1.0 - p));
  std::vector<float> m = mask.to_vector<float>(), xv = x.to_vector<float>(),
                     yv = y.to_vector<float>(), vv = v.to_vector<float>(),
                     g = xr.grad().to_vector<float>();
  size_t wrong_y = 0, wrong_grad = 0;
  for (size_t i = 0; i < m.size(); ++i) {
    wrong_y += yv[i] != xv[i] * (m[i] * scale);
    wrong_grad += g[i] != vv[i] * (m[i] * scale);
  }
  REQUIRE(wrong_y == 0);
  REQUIRE(wrong_grad == 0);
}

TEST_CASE("dropout: statistics and determinism", "[nn]") {
  const int64_t n = 100000;
  Tensor x = ones({n});
  for (double p : {0.1, 0.5, 0.9}) {
    INFO("p " << p);
    Generator gen(6, kStreamDropout);
    std::vector<float> y = dropout(x, p, true, gen).to_vector<float>();
    const float scale = float(1.0 / (1.0 - p));
    int64_t kept = 0, other = 0;
    for (float v : y) {
      kept += v == scale;  // kept values scaled exactly
      other += v != scale && v != 0.0f;
    }
    REQUIRE(other == 0);
    // The kept fraction has standard deviation sqrt(p (1 - p) / n) <= 0.0016;
    // 0.01 is more than 6 of them.
    REQUIRE(std::fabs(double(kept) / double(n) - (1 - p)) < 0.01);
    // The same generator state gives the same mask; the advanced one another.
    Generator again(6, kStreamDropout);
    REQUIRE(dropout(x, p, true, again).to_vector<float>() == y);
    REQUIRE(dropout(x, p, true, again).to_vector<float>() != y);
  }
}
