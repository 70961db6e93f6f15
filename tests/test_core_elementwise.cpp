// Elementwise ops: gradients against finite differences (every unary and
// binary op, broadcasting, the scalar forms, where, clamp, masked_fill), the
// CPU fast kernels against the reference kernels (odd and large sizes,
// strided and stride-0 operands, empty tensors, f32, f64, bf16, f16),
// closed-form values, broadcast shapes, the in-place ops and the typed errors.
#include <limits>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/isa.h"
#include "tests/op_families.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Where each unary op is smooth, and the binary ops: the op table's lists.
using testing::op_table::kBinaryOps;
using testing::op_table::kUnaryRanges;
using testing::op_table::UnaryRange;

// Uniform values in [lo, hi]; with avoid_zero, magnitudes of at least 0.1.
Tensor input(const Shape& shape, Generator& gen, double lo, double hi, bool avoid_zero,
             DType dtype = DType::f64) {
  Tensor x = uniform(shape, lo, hi, gen, DType::f64);
  if (avoid_zero) {
    std::vector<double> v = x.to_vector<double>();
    for (double& e : v) e = e < 0 ? std::min(e, -0.1) : std::max(e, 0.1);
    x = from_vector(v, shape);
  }
  return x.to(dtype);
}

// Operands valid for op: pow needs a positive base, div a divisor away from 0.
std::pair<Tensor, Tensor> binary_inputs(BinaryOp op, const Shape& sa, const Shape& sb,
                                        Generator& gen, DType dtype = DType::f64) {
  Tensor a = op == BinaryOp::pow ? input(sa, gen, 0.3, 2.0, false, dtype)
                                 : input(sa, gen, -2.0, 2.0, false, dtype);
  Tensor b = op == BinaryOp::div ? input(sb, gen, -2.0, 2.0, true, dtype)
                                 : input(sb, gen, -1.5, 1.5, false, dtype);
  return {a, b};
}

// The fast path against the reference (tests/testing.h's rule): elementwise
// ops reduce nothing, but the gradient of a broadcast operand sums over the
// dims it was broadcast along (up to the largest dim, terms up to ~1.5). In
// bf16 and f16 the forward output is rounded, the backward reads it (1 - y^2
// and the like magnify its rounding up to about twice near the saturation of
// tanh and sigmoid) and rounds its own result.
Reduction elementwise(DType t, const Shape& shape) {
  const int64_t n = *std::max_element(shape.begin(), shape.end());
  return {.length = n,
          .scale = 1.5 * std::sqrt(double(n)),
          .roundings = t == DType::bf16 || t == DType::f16 ? 4 : 1};
}

std::string op_label(const char* what, int op, DType dtype) {
  return std::string(what) + " " + std::to_string(op) + " " + std::string(dtype_name(dtype));
}

}  // namespace

TEST_CASE("elementwise: gradients of every unary op", "[elementwise]") {
  Generator gen(101);
  for (const UnaryRange& c : kUnaryRanges) {
    INFO(unary_op_name(c.op));
    Tensor x = input({3, 5}, gen, c.lo, c.hi, c.kink_at_zero);
    gradcheck([&](const TensorList& in) { return unary(c.op, in[0]); }, {x});
    // Through a strided view too.
    gradcheck([&](const TensorList& in) { return unary(c.op, in[0].t()); }, {x});
  }
  // The named entry points reach the same ops.
  Tensor x = input({4}, gen, 0.5, 2.0, false);
  require_close(gelu(x), unary(UnaryOp::gelu_erf, x), 0, 0);
  require_close(gelu(x, GeluApprox::tanh), unary(UnaryOp::gelu_tanh, x), 0, 0);
  require_close(-x, neg(x), 0, 0);
  require_close(rsqrt(x), 1.0 / sqrt(x), 1e-15, 0);
}

TEST_CASE("elementwise: gradients of every binary op with broadcasting", "[elementwise]") {
  Generator gen(102);
  const std::pair<Shape, Shape> shapes[] = {{{3, 1, 4}, {5, 4}}, {{}, {2, 3}},
                                            {{2, 3}, {}},        {{1}, {3, 2}},
                                            {{2, 3}, {2, 3}},    {{4, 1}, {1, 3}}};
  for (BinaryOp op : kBinaryOps) {
    for (const auto& [sa, sb] : shapes) {
      INFO(binary_op_name(op) << " " << shape_str(sa) << " with " << shape_str(sb));
      auto [a, b] = binary_inputs(op, sa, sb, gen);
      gradcheck([&](const TensorList& in) { return binary(op, in[0], in[1]); }, {a, b});
    }
  }
  // Operators are the same ops.
  Tensor a = input({2, 3}, gen, 0.5, 1.5, false), b = input({3}, gen, 0.5, 1.5, false);
  require_close(a + b, add(a, b), 0, 0);
  require_close(a - b, sub(a, b), 0, 0);
  require_close(a * b, mul(a, b), 0, 0);
  require_close(a / b, div(a, b), 0, 0);
  // Ties in maximum/minimum split the gradient evenly.
  Tensor t = from_vector<double>({1.0, 2.0, 3.0}).requires_grad_();
  Tensor u = from_vector<double>({1.0, 5.0, 0.0}).requires_grad_();
  sum(maximum(t, u)).backward();
  REQUIRE(t.grad().to_vector<double>() == std::vector<double>{0.5, 0, 1});
  REQUIRE(u.grad().to_vector<double>() == std::vector<double>{0.5, 1, 0});
}

TEST_CASE("elementwise: gradients of the scalar forms, where, clamp, masked_fill",
          "[elementwise]") {
  Generator gen(103);
  Tensor x = input({3, 4}, gen, 0.3, 2.0, false);
  Tensor y = input({3, 4}, gen, -2.0, 2.0, true);
  for (BinaryOp op : kBinaryOps) {
    for (bool first : {false, true}) {
      INFO(binary_op_name(op) << " scalar_first " << first);
      // s ^ x needs s > 0; x ^ s and s / x need x away from 0.
      double s = op == BinaryOp::pow ? 1.7 : -0.6;
      const Tensor& in = (op == BinaryOp::pow || op == BinaryOp::div) ? x : y;
      gradcheck([&](const TensorList& t) { return binary_scalar(op, t[0], s, first); }, {in});
    }
  }
  gradcheck([](const TensorList& t) { return 2.5 - t[0]; }, {y});
  gradcheck([](const TensorList& t) { return 2.5 / t[0]; }, {y});
  gradcheck([](const TensorList& t) { return pow(t[0], 3.0); }, {y});
  gradcheck([](const TensorList& t) { return pow(t[0], -1.5); }, {x});

  Tensor cond = gt(input({3, 4}, gen, -1, 1, false), zeros({}, DType::f64));
  gradcheck([&](const TensorList& t) { return where(cond, t[0], t[1]); },
            {y, input({4}, gen, -1, 1, false)});
  gradcheck([&](const TensorList& t) { return where(cond.select(0, 1), t[0], t[1]); },
            {input({3, 1}, gen, -1, 1, false), input({}, gen, -1, 1, false)});
  // clamp: values well inside and well outside [lo, hi], none near the edges.
  gradcheck([](const TensorList& t) { return clamp(t[0], -0.05, 0.05); }, {y});
  gradcheck([&](const TensorList& t) { return masked_fill(t[0], cond, -3.0); }, {y});
  gradcheck([&](const TensorList& t) { return masked_fill(t[0], cond.select(0, 0), 7.0); },
            {input({3, 4}, gen, -1, 1, false)});
}

TEST_CASE("elementwise: closed-form values", "[elementwise]") {
  Tensor x = from_vector<double>({-1.0, 0.0, 1.0, 2.0});
  auto v = [](const Tensor& t) { return t.to_vector<double>(); };
  REQUIRE(v(relu(x)) == std::vector<double>{0, 0, 1, 2});
  REQUIRE(v(abs(x)) == std::vector<double>{1, 0, 1, 2});
  REQUIRE(v(sigmoid(x))[1] == 0.5);
  REQUIRE(v(gelu(x))[2] == Approx(0.8413447460685429).epsilon(1e-12));
  REQUIRE(v(gelu(x, GeluApprox::tanh))[2] == Approx(0.8411919906082768).epsilon(1e-12));
  REQUIRE(v(silu(x))[2] == Approx(0.7310585786300049).epsilon(1e-12));
  REQUIRE(v(pow(x, 3.0)) == std::vector<double>{-1, 0, 1, 8});
  REQUIRE(v(binary_scalar(BinaryOp::pow, x, 2.0, true)) == std::vector<double>{0.5, 1, 2, 4});
  REQUIRE(v(3.0 - x) == std::vector<double>{4, 3, 2, 1});
  REQUIRE(v(2.0 / (x + 2.0)) == std::vector<double>{2, 1, 2.0 / 3.0, 0.5});
  REQUIRE(v(clamp(x, -0.5, 1.5)) == std::vector<double>{-0.5, 0, 1, 1.5});
  REQUIRE(v(masked_fill(x, gt(x, zeros({}, DType::f64)), 9.0)) == std::vector<double>{-1, 0, 9, 9});
  REQUIRE(eq(x, from_vector<double>({-1, 1, 1, 0})).to_vector<int32_t>() ==
          std::vector<int32_t>{1, 0, 1, 0});
  REQUIRE(lt(x, zeros({}, DType::f64)).to_vector<int32_t>() == std::vector<int32_t>{1, 0, 0, 0});
  // NaN propagates through maximum and minimum, from either side.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor n = from_vector<double>({nan, 1.0, nan, 3.0});
  for (bool reference : {false, true}) {
    std::optional<ReferenceKernelsGuard> guard;
    if (reference) guard.emplace();
    std::vector<double> mx = v(maximum(n, x)), mn = v(minimum(x, n));
    REQUIRE(std::isnan(mx[0]));
    REQUIRE(std::isnan(mn[2]));
    REQUIRE(mx[1] == 1.0);
    REQUIRE(mn[3] == 2.0);
  }
}

TEST_CASE("elementwise: broadcast_shapes", "[elementwise]") {
  REQUIRE(broadcast_shapes({3, 1, 4}, {5, 4}) == Shape{3, 5, 4});
  REQUIRE(broadcast_shapes({}, {2, 3}) == Shape{2, 3});
  REQUIRE(broadcast_shapes({1}, {3, 2}) == Shape{3, 2});
  REQUIRE(broadcast_shapes({2, 1}, {1, 3}) == Shape{2, 3});
  REQUIRE(broadcast_shapes({0, 1}, {1, 4}) == Shape{0, 4});
  REQUIRE(broadcast_shapes({}, {}) == Shape{});
  REQUIRE((from_vector<float>({1, 2, 3}).reshape({3, 1}) + ones({2})).shape() == Shape{3, 2});
}

TEST_CASE("elementwise: fast kernels match the reference", "[elementwise]") {
  Generator gen(104);
  // Odd sizes, a size-1 dim, and (f32) one large enough for the threaded loops.
  struct Case {
    Shape shape;
    DType dtype;
  };
  const Case cases[] = {{{7, 33}, DType::f32},    {{1, 5, 3}, DType::f64},
                        {{33, 7}, DType::bf16},   {{3, 11, 5}, DType::f16},
                        {{317, 331}, DType::f32}, {{3, 40000}, DType::bf16}};
  for (const Case& c : cases) {
    const Reduction tol = elementwise(c.dtype, c.shape);
    // The reference kernels are slow: large cases check the layouts once per op.
    const bool large = shape_numel(c.shape) >= 100000;
    for (const UnaryRange& u : kUnaryRanges) {
      Tensor x = input(c.shape, gen, u.lo, u.hi, u.kink_at_zero, c.dtype);
      INFO(op_label("unary", int(u.op), c.dtype) << " " << shape_str(c.shape));
      auto f = [&](const TensorList& in) { return unary(u.op, in[0]); };
      check_fast_vs_reference(f, {x}, tol);
      if (large) continue;
      if (c.shape[0] > 1) check_fast_vs_reference(f, {x.transpose(0, 1)}, tol);
      check_fast_vs_reference(f, {non_contiguous(x)}, tol);
    }
    for (BinaryOp op : kBinaryOps) {
      INFO(op_label("binary", int(op), c.dtype) << " " << shape_str(c.shape));
      auto f = [&](const TensorList& in) { return binary(op, in[0], in[1]); };
      auto [a, b] = binary_inputs(op, c.shape, c.shape, gen, c.dtype);
      check_fast_vs_reference(f, {a, b}, tol);
      // Stride-0 operands: a row, a column and a 0-d scalar broadcast.
      Shape row = c.shape, col = c.shape;
      row.front() = 1;
      col.back() = 1;
      auto [r, k] = binary_inputs(op, row, col, gen, c.dtype);
      check_fast_vs_reference(f, {r, k}, tol);
      if (large) continue;
      check_fast_vs_reference(f, {non_contiguous(a), b}, tol);
      check_fast_vs_reference(f, {a, r}, tol);
      check_fast_vs_reference(f, {k, b}, tol);
      auto [s, unused] = binary_inputs(op, {}, {}, gen, c.dtype);
      check_fast_vs_reference(f, {s, b}, tol);
      // x op s and s op x; s / x and s ^ x take the divisor and the positive base.
      for (bool first : {false, true}) {
        double sv = op == BinaryOp::pow ? 1.3 : -0.7;
        check_fast_vs_reference(
            [&](const TensorList& t) { return binary_scalar(op, t[0], sv, first); },
            {op == BinaryOp::div ? b : a}, tol);
      }
    }
    Tensor x = input(c.shape, gen, -2, 2, false, c.dtype);
    Tensor y = input(c.shape, gen, -2, 2, false, c.dtype);
    Tensor cond = gt(x, y);
    check_fast_vs_reference([&](const TensorList& t) { return where(cond, t[0], t[1]); }, {x, y},
                            tol);
    check_fast_vs_reference([&](const TensorList& t) { return where(cond, t[0], t[1]); },
                            {non_contiguous(x), y.select(0, 0)}, tol);
    check_fast_vs_reference([](const TensorList& t) { return clamp(t[0], -0.5, 0.75); }, {x}, tol);
    check_fast_vs_reference([&](const TensorList& t) { return masked_fill(t[0], cond, 2.0); },
                            {non_contiguous(x)}, tol);
    for (auto cmp : {eq, lt, gt}) {
      Tensor fast = cmp(x, y.select(0, 0));
      ReferenceKernelsGuard guard;
      REQUIRE(cmp(x, y.select(0, 0)).to_vector<int32_t>() == fast.to_vector<int32_t>());
    }
  }
}

TEST_CASE("elementwise: stride-0 and empty operands", "[elementwise]") {
  Generator gen(105);
  // A broadcast (stride-0) input to a unary op and to both sides of a binary op.
  Tensor row = input({1, 33}, gen, -1, 1, false, DType::f32);
  Tensor wide = row.expand({5000, 33});
  check_fast_vs_reference([](const TensorList& t) { return tanh(t[0]); }, {wide});
  check_fast_vs_reference([](const TensorList& t) { return t[0] * t[1]; },
                          {wide, input({5000, 1}, gen, -1, 1, false, DType::f32)});
  // Empty tensors: every kernel is a no-op and shapes still broadcast.
  for (DType dtype : {DType::f32, DType::bf16}) {
    Tensor e = zeros({3, 0, 5}, dtype);
    REQUIRE(exp(e).shape() == Shape{3, 0, 5});
    REQUIRE((e + ones({5}, dtype)).shape() == Shape{3, 0, 5});
    REQUIRE((e * 2.0).numel() == 0);
    REQUIRE(where(gt(e, e), e, ones({1}, dtype)).shape() == Shape{3, 0, 5});
    REQUIRE(clamp(e, 0, 1).numel() == 0);
    Tensor g = zeros({0, 4}, DType::f64).requires_grad_();
    sum(sigmoid(g) * 3.0).backward();
    REQUIRE(g.grad().shape() == Shape{0, 4});
  }
}

TEST_CASE("elementwise: in-place add_ and mul_", "[elementwise]") {
  Tensor x = arange(12, DType::f32).reshape({3, 4});
  add_(x, from_vector<float>({1, 2, 3, 4}), 2.5);
  REQUIRE(x.to_vector<float>() ==
          std::vector<float>{2.5, 6, 9.5, 13, 6.5, 10, 13.5, 17, 10.5, 14, 17.5, 21});
  mul_(x, 2.0);
  REQUIRE(x.to_vector<float>()[3] == 26.0f);
  add_(x, x);  // self-aliasing: every element doubles
  REQUIRE(x.to_vector<float>()[3] == 52.0f);
  // Through a strided view: the base storage changes in place.
  Tensor base = zeros({4, 3});
  Tensor view = base.t();
  add_(view, ones({3, 4}));
  mul_(view.select(0, 1), -2.0);  // column 1 of base
  REQUIRE(base.to_vector<float>() == std::vector<float>{1, -2, 1, 1, -2, 1, 1, -2, 1, 1, -2, 1});
  // Large enough for the threaded loop, in bf16 and f64.
  for (DType dtype : {DType::bf16, DType::f64}) {
    Tensor big = full({300, 301}, 1.5, dtype);
    add_(big, full({301}, 0.25, dtype), 2.0);
    mul_(big, 4.0);
    std::vector<double> v = big.to_vector<double>();
    REQUIRE(v.front() == 8.0);
    REQUIRE(v.back() == 8.0);
  }
  // add_ and mul_ are not recorded even on a tensor that requires a gradient.
  Tensor w = ones({2}, DType::f64).requires_grad_();
  mul_(w, 3.0);
  REQUIRE(w.grad_fn() == nullptr);
}

TEST_CASE("elementwise: dtype and backend errors are typed", "[elementwise]") {
  // A floating kernel handed an integer tensor throws trainer::Error.
  Tensor i = arange(5);
  Tensor out = empty({5}, DType::i64);
  REQUIRE_THROWS_AS(cpu_backend().unary(UnaryOp::exp, i, out), Error);
  REQUIRE_THROWS_AS(cpu_backend().clamp(i, 0, 1, out), Error);
  REQUIRE_THROWS_AS(dispatch_floating(DType::u8, "test", [](auto) {}), Error);
#ifndef TRAINER_HAVE_CUDA
  REQUIRE_THROWS_AS(backend(Device{kCUDA, 0}), Error);
#endif
}

TEST_CASE("isa: the cap switches the dual-compiled loops and never raises them", "[isa]") {
  const bool avx512 = cpu::cpu_features().avx512f && cpu::cpu_features().avx512bw &&
                      cpu::cpu_features().avx512vl && cpu::cpu_features().avx512dq;
  const cpu::Isa before = cpu::active_isa();
  cpu::set_max_isa(cpu::Isa::avx2);
  CHECK(cpu::active_isa() == cpu::Isa::avx2);
  CHECK(!cpu::use_avx512());
  cpu::set_max_isa(cpu::Isa::avx512);
  if (!avx512) CHECK(cpu::active_isa() == cpu::Isa::avx2);  // never above the CPU
  cpu::set_max_isa(before);
  CHECK(cpu::active_isa() == before);
  // Every x86-64-v3 machine this build runs on has AVX2 and FMA.
  CHECK(cpu::cpu_features().avx2);
  CHECK(cpu::cpu_features().fma);
  CHECK(!cpu::feature_summary(cpu::cpu_features()).empty());
}

TEST_CASE("isa: the AVX2 and AVX-512 elementwise loops give the same bits", "[isa][elementwise]") {
  // The same per-element math in 8 or 16 lanes: replicas on machines of
  // different generations stay bit-identical. Runs the AVX2 path twice where
  // the CPU has no AVX-512 (the test still checks the switch is harmless).
  Generator gen(106);
  const cpu::Isa before = cpu::active_isa();
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const UnaryRange& u : kUnaryRanges) {
      INFO(op_label("unary", int(u.op), dtype));
      Tensor x = input({3, 1001}, gen, u.lo, u.hi, u.kink_at_zero, dtype).requires_grad_();
      Tensor v = probe_like(unary(u.op, x.detach()));
      auto run = [&](cpu::Isa isa) {
        cpu::set_max_isa(isa);
        Tensor xi = x.detach().requires_grad_();
        Tensor y = unary(u.op, xi);
        y.backward(v);
        return std::pair{y.detach(), xi.grad()};
      };
      auto [y512, g512] = run(cpu::Isa::avx512);
      auto [y2, g2] = run(cpu::Isa::avx2);
      cpu::set_max_isa(before);
      require_close(y2, y512, 0, 0, "forward");
      require_close(g2, g512, 0, 0, "gradient");
    }
    for (BinaryOp op : kBinaryOps) {
      INFO(op_label("binary", int(op), dtype));
      auto [a, b] = binary_inputs(op, {5, 333}, {1, 333}, gen, dtype);
      cpu::set_max_isa(cpu::Isa::avx512);
      Tensor y512 = binary(op, a, b);
      cpu::set_max_isa(cpu::Isa::avx2);
      Tensor y2 = binary(op, a, b);
      cpu::set_max_isa(before);
      require_close(y2, y512, 0, 0, "binary");
    }
  }
}

// op's output and gradient (cotangent 1) at x = i / 1000 for i = lo, lo +
// step, ..., up to hi.
struct Sampled {
  std::vector<float> x, y, g;
};
Sampled sample_with_gradient(UnaryOp op, int lo, int hi, int step) {
  Sampled s;
  for (int i = lo; i <= hi; i += step) s.x.push_back(float(i) / 1000.0f);
  Tensor x = from_vector(s.x).requires_grad_();
  Tensor y = unary(op, x);
  y.backward(ones_like(y));
  s.y = y.to_vector<float>();
  s.g = x.grad().to_vector<float>();
  return s;
}

// The error of got against want in f32 ulps of size; an error at or below
// negligible (results near the end of f32's normal range) counts as none.
double ulps(float got, double want, double size, double negligible) {
  const double error = std::abs(double(got) - want);
  return error <= negligible ? 0.0 : error / size / 0x1p-24;
}

// The vectorised exact GELU (cpu::normal_cdf_f32) over its whole range: far
// tails where 1 + erf cancels and the result underflows, and the non-finite
// inputs, against erfc in double. Its documented
// accuracy is 10 f32 ulps, the gradient's too (against the size of its
// terms; it crosses zero), down to about the smallest normal float.
TEST_CASE("elementwise: exact GELU is accurate from tail to tail", "[elementwise]") {
  const Sampled fast = sample_with_gradient(UnaryOp::gelu_erf, -14000, 14000, 7);
  const std::vector<float>&xs = fast.x, &fast_y = fast.y, &fast_g = fast.g;
  // Exact values in double through erfc (1 + erf would cancel in the left tail).
  // The gradient Phi + x phi crosses zero near x = -0.75: its error is
  // measured against the size of its terms, Phi + |x| phi.
  std::vector<double> exact_y, exact_g, size_g;
  for (float v : xs) {
    const double x = v, cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * 3.14159265358979323846);
    exact_y.push_back(x * cdf);
    exact_g.push_back(cdf + x * pdf);
    size_g.push_back(cdf + std::abs(x) * pdf);
  }
  // Results near the end of f32's normal range (2^-126) flush to zero, so
  // an error below 2^-123 counts as none.
  const double negligible = 0x1p-123;
  double worst_y = 0, worst_g = 0;
  float at_y = 0, at_g = 0;
  for (size_t k = 0; k < xs.size(); ++k) {
    const double e_y = ulps(fast_y[k], exact_y[k], std::abs(exact_y[k]), negligible);
    const double e_g = ulps(fast_g[k], exact_g[k], size_g[k], negligible);
    if (e_y > worst_y) worst_y = e_y, at_y = xs[k];
    if (e_g > worst_g) worst_g = e_g, at_g = xs[k];
  }
  INFO("worst relative error: gelu " << worst_y << " ulps at x = " << at_y << ", gradient "
                                     << worst_g << " ulps at x = " << at_g);
  CHECK(worst_y <= 10);
  CHECK(worst_g <= 10);

  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> y =
      unary(UnaryOp::gelu_erf, from_vector(std::vector<float>{inf, -inf, NAN, 0.0f, -0.0f}))
          .to_vector<float>();
  CHECK(y[0] == inf);
  CHECK(std::isnan(y[1]));  // -inf * Phi(-inf) = -inf * 0, as the reference computes it
  CHECK(std::isnan(y[2]));
  CHECK(y[3] == 0.0f);
  CHECK(y[4] == 0.0f);
}

// The vectorised SiLU (cpu::silu_f32 on cpu::exp_f32) from tail to tail
// against double: x / (1 + e^-x) within 8 f32 ulps, the gradient
// s (1 + x (1 - s)) within 8 ulps of the size of its terms (it crosses zero
// near x = -1.28); the left tail is -0 where e^-x leaves f32's range (below
// about -88.7, where x e^x is under 2^-116: there an error counts as none,
// and libm's expf leaves the reference -0 too), and the non-finite inputs
// give the reference's results.
TEST_CASE("elementwise: SiLU is accurate from tail to tail", "[elementwise]") {
  const Sampled fast = sample_with_gradient(UnaryOp::silu, -100000, 100000, 37);
  const std::vector<float>&xs = fast.x, &fast_y = fast.y, &fast_g = fast.g;
  const double negligible = 0x1p-116;
  double worst_y = 0, worst_g = 0, reference_g = 0;
  float at_y = 0, at_g = 0;
  for (size_t k = 0; k < xs.size(); ++k) {
    const double v = xs[k], s = 1.0 / (1.0 + std::exp(-v));
    // The formula's 1 - s cancels as s nears 1, in the reference's float
    // arithmetic (math::Silu) as much: the gradient is held to it there.
    const double size_g = s * (1.0 + std::abs(v) * (1.0 - s));
    reference_g = std::max(reference_g, ulps(math::Silu{}.grad(xs[k], 0.0f, 1.0f),
                                             s * (1.0 + v * (1.0 - s)), size_g, negligible));
    const double e_y = ulps(fast_y[k], v * s, std::abs(v * s), negligible);
    const double e_g = ulps(fast_g[k], s * (1.0 + v * (1.0 - s)), size_g, negligible);
    if (e_y > worst_y) worst_y = e_y, at_y = xs[k];
    if (e_g > worst_g) worst_g = e_g, at_g = xs[k];
  }
  INFO("worst relative error: silu " << worst_y << " ulps at x = " << at_y << ", gradient "
                                     << worst_g << " ulps at x = " << at_g << " (reference "
                                     << reference_g << ")");
  CHECK(worst_y <= 8);
  CHECK(worst_g <= std::max(8.0, reference_g + 4));

  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> y =
      unary(UnaryOp::silu, from_vector(std::vector<float>{inf, -inf, NAN, 0.0f, -100.0f, 100.0f}))
          .to_vector<float>();
  CHECK(y[0] == inf);
  CHECK(std::isnan(y[1]));  // -inf / (1 + inf), as the reference computes it
  CHECK(std::isnan(y[2]));
  CHECK(y[3] == 0.0f);
  CHECK(y[4] == 0.0f);
  CHECK(std::signbit(y[4]));
  CHECK(y[5] == 100.0f);
}
