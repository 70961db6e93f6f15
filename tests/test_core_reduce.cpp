// Reductions: gradients against finite differences, the CPU fast kernels
// against the reference kernels (every loop shape: row and column mode, the
// split-over-threads path, odd sizes, strided and broadcast inputs, f32, f64,
// bf16, f16), argmax and sum_to against hand-computed answers, and the
// accuracy of long f32 sums and of var.
#include <omp.h>

#include <limits>
#include <random>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/threads.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

Shape keepdim_shape(const Shape& s, uint64_t mask) {
  Shape k = s;
  for (size_t d = 0; d < s.size(); ++d)
    if ((mask >> d) & 1) k[d] = 1;
  return k;
}

double tolerance(DType t) { return t == DType::f32 ? 1e-5 : (t == DType::f64 ? 1e-10 : 1e-2); }

std::string describe(const char* what, const Tensor& x, const std::vector<int>& dims) {
  std::string s = std::string(what) + " of " + x.shape_str() + " strides " +
                  shape_str(x.strides()) + " " + std::string(dtype_name(x.dtype())) + " dims {";
  for (int d : dims) s += std::to_string(d) + ",";
  return s + "}";
}

// Sets the OpenMP thread count for a scope.
class ThreadCount {
 public:
  explicit ThreadCount(int n) : previous_(num_threads()) { set_num_threads(n); }
  ~ThreadCount() { set_num_threads(previous_); }

 private:
  int previous_;
};

// Every reduction kernel (sum, mean, max, min, var 0/1, max_dim on each
// reduced dim) on the CPU fast path, under each thread count (0: as set),
// against the reference kernel.
void compare_kernels(const Tensor& x, const std::vector<int>& dims,
                     const std::vector<int>& thread_counts = {0}) {
  uint64_t mask = dims_to_mask(dims, x.dim());
  Shape kept = keepdim_shape(x.shape(), mask);
  double tol = tolerance(x.dtype());
  // Runs kernel(backend, outputs...) on both backends and compares all outputs.
  auto compare = [&](const std::string& what, auto kernel, std::vector<Tensor> ref, double rtol) {
    std::vector<Tensor> fast;
    for (const Tensor& t : ref) fast.push_back(empty(t.shape(), t.dtype()));
    kernel(reference_backend(), ref);
    for (int threads : thread_counts) {
      std::optional<ThreadCount> guard;
      if (threads > 0) guard.emplace(threads);
      kernel(cpu_backend(), fast);
      for (size_t k = 0; k < ref.size(); ++k)
        require_close(fast[k], ref[k], rtol, rtol,
                      describe(what.c_str(), x, dims) + " threads " + std::to_string(threads));
    }
  };
  const char* names[] = {"sum", "mean", "max", "min"};
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::mean, ReduceOp::max, ReduceOp::min}) {
    bool extremum = op == ReduceOp::max || op == ReduceOp::min;
    if (extremum && x.numel() == 0) continue;
    compare(
        names[int(op)],
        [&](Backend& b, std::vector<Tensor>& out) { b.reduce(op, x, mask, out[0]); },
        {empty(kept, x.dtype())}, extremum ? 0.0 : tol);
  }
  for (int64_t correction : {0, 1}) {
    compare(
        "var", [&](Backend& b, std::vector<Tensor>& out) { b.var(x, mask, correction, out[0]); },
        {empty(kept, x.dtype())}, tol);
  }
  for (int d = 0; d < x.dim(); ++d) {
    if (!((mask >> d) & 1) || x.shape()[d] == 0) continue;
    Shape k = keepdim_shape(x.shape(), uint64_t(1) << d);
    compare(
        "max_dim " + std::to_string(d),
        [&](Backend& b, std::vector<Tensor>& out) { b.max_dim(x, d, out[0], out[1]); },
        {empty(k, x.dtype()), empty(k, DType::i64)}, 0.0);
  }
}

}  // namespace

TEST_CASE("reduce: gradients of sum, mean, var, max", "[reduce]") {
  Generator gen(11);
  Tensor x = rand_f64({3, 4, 5}, gen);
  for (bool keepdim : {false, true}) {
    for (std::vector<int> dims :
         {std::vector<int>{}, {0}, {-1}, {0, 2}, {1, -1}, {0, 1, 2}, {-3, -2}}) {
      INFO("keepdim " << keepdim << " dims " << dims.size());
      gradcheck([&](const TensorList& in) { return sum(in[0], dims, keepdim); }, {x});
      gradcheck([&](const TensorList& in) { return mean(in[0], dims, keepdim); }, {x});
      gradcheck([&](const TensorList& in) { return var(in[0], dims, 0, keepdim); }, {x});
      gradcheck([&](const TensorList& in) { return var(in[0], dims, 1, keepdim); }, {x});
    }
    for (int dim : {0, 1, 2, -1, -2}) {
      INFO("max dim " << dim << " keepdim " << keepdim);
      gradcheck([&](const TensorList& in) { return max(in[0], dim, keepdim); }, {x});
    }
  }
  gradcheck([](const TensorList& in) { return max(in[0]); }, {x});
  // Through a strided view and inside a larger expression.
  gradcheck([](const TensorList& in) { return sum(in[0].transpose(0, 2), {1}) * in[1]; },
            {x, rand_f64({5, 3}, gen)});
  gradcheck([](const TensorList& in) { return var(in[0] * in[0], {-1}, 1, true) + in[0]; }, {x});
}

TEST_CASE("reduce: fast kernels match the reference on random shapes", "[reduce]") {
  Generator gen(21);
  std::mt19937 pick(5);
  const int64_t sizes[] = {1, 2, 3, 7, 33};
  for (int trial = 0; trial < 60; ++trial) {
    int ndim = 1 + int(pick() % 4);
    Shape shape;
    do {
      shape.clear();
      for (int d = 0; d < ndim; ++d) shape.push_back(sizes[pick() % 5]);
    } while (shape_numel(shape) > 5000);
    std::vector<int> dims;
    for (int d = 0; d < ndim; ++d)
      if (pick() % 2) dims.push_back(pick() % 2 ? d : d - ndim);
    if (dims.empty() && pick() % 2) dims.push_back(-1);
    DType dtype = std::vector<DType>{DType::f32, DType::bf16, DType::f64, DType::f16}[trial % 4];
    Tensor x = rand_tensor(shape, gen, -2.0, 2.0, dtype);
    compare_kernels(x, dims);
    compare_kernels(non_contiguous(x), dims);
    if (ndim >= 2) compare_kernels(x.transpose(0, ndim - 1), dims);
  }
}

TEST_CASE("reduce: every loop shape, including the parallel ones", "[reduce]") {
  Generator gen(31);
  struct Case {
    Shape shape;
    std::vector<int> dims;
  };
  const Case cases[] = {
      {{40001}, {}},           // full reduction: split over threads
      {{1000, 37}, {1}},       // rows: parallel over output slots
      {{3, 20011}, {1}},       // few long rows: each split over threads
      {{5001, 33}, {0}},       // bias gradient: columns, split over threads
      {{37, 1000}, {0}},       // columns: several blocks
      {{3, 300, 601}, {1}},    // columns between kept dims
      {{7, 33, 257}, {0, 2}},  // rows and columns mixed
      {{9, 1001, 5}, {0, 1}},  // short inner kept dim
  };
  for (const Case& c : cases) {
    Tensor x = rand_tensor(c.shape, gen, -3.0, 3.0);
    compare_kernels(x, c.dims, {1, 2});
    if (x.dim() >= 2) compare_kernels(x.transpose(0, 1), c.dims);
  }
  // Strided, bf16 and uneven per-thread chunks (3 threads) on a few of them.
  for (int i : {0, 3, 6}) {
    Tensor x = rand_tensor(cases[i].shape, gen, -3.0, 3.0);
    compare_kernels(x, cases[i].dims, {3});
    compare_kernels(non_contiguous(x), cases[i].dims);
    compare_kernels(x.to(DType::bf16), cases[i].dims);
  }
  // Autograd through the fast kernels versus the reference ones.
  Tensor x = rand_tensor({129, 67}, gen);
  Tensor xt = rand_tensor({67, 129}, gen).t();
  // Up to all 129 x 67 elements summed (var over every dim).
  const Reduction whole{.length = 129 * 67, .scale = 8};
  for (const Tensor& in : {x, xt, non_contiguous(x)}) {
    check_fast_vs_reference([](const TensorList& t) { return sum(t[0], {0}); }, {in}, whole);
    check_fast_vs_reference([](const TensorList& t) { return mean(t[0], {1}, true); }, {in}, whole);
    check_fast_vs_reference([](const TensorList& t) { return var(t[0], {0}); }, {in}, whole);
    check_fast_vs_reference([](const TensorList& t) { return var(t[0], {}, 0); }, {in}, whole);
    check_fast_vs_reference([](const TensorList& t) { return max(t[0], -1); }, {in}, whole);
    check_fast_vs_reference([](const TensorList& t) { return max(t[0], 0, true); }, {in}, whole);
    check_fast_vs_reference([](const TensorList& t) { return max(t[0]); }, {in}, whole);
  }
  Tensor xb = rand_tensor({129, 35}, gen, -1.0, 1.0, DType::bf16);
  // bf16 results of f32 sums; var's gradient goes through two rounded intermediates.
  const Reduction bf16_sum{.length = 129, .scale = 8, .roundings = 3};
  check_fast_vs_reference([](const TensorList& t) { return sum(t[0], {0}); }, {xb}, bf16_sum);
  check_fast_vs_reference([](const TensorList& t) { return var(t[0], {1}); }, {xb}, bf16_sum);
  check_fast_vs_reference([](const TensorList& t) { return max(t[0], 1); }, {xb}, bf16_sum);
}

TEST_CASE("reduce: broadcast, empty and scalar inputs", "[reduce]") {
  Generator gen(41);
  // Stride-0 dims (expand) in the kept and in the reduced dims.
  Tensor row = rand_tensor({1, 37}, gen);
  compare_kernels(row.expand({2001, 37}), {0});
  compare_kernels(row.expand({2001, 37}), {1});
  compare_kernels(rand_tensor({5, 1, 7}, gen).expand({5, 300, 7}), {1, 2});
  // A reduced dim of size 0: sum 0, mean and var NaN (as the reference).
  Tensor e = zeros({3, 0, 4});
  compare_kernels(e, {1});
  REQUIRE(sum(e, {1}).to_vector<float>() == std::vector<float>(12, 0.0f));
  REQUIRE(std::isnan(mean(e, {1}).to_vector<float>()[0]));
  // A kept dim of size 0: an empty result.
  REQUIRE(sum(e, {0}, true).shape() == Shape{1, 0, 4});
  REQUIRE(max(e, 2, true).shape() == Shape{3, 0, 1});
  // A 0-d tensor reduces to itself.
  Tensor s = scalar_tensor(2.5);
  REQUIRE(sum(s).dim() == 0);
  REQUIRE(sum(s).item<double>() == 2.5);
  REQUIRE(max(s).item<double>() == 2.5);
  compare_kernels(s, {});
}

TEST_CASE("reduce: values, keepdim shapes and NaN", "[reduce]") {
  Tensor x = arange(24, DType::f32).reshape({2, 3, 4});
  REQUIRE(sum(x).item<double>() == 276.0);
  REQUIRE(sum(x, {0, 2}).to_vector<float>() == std::vector<float>{60, 92, 124});
  REQUIRE(sum(x, {-1}, true).shape() == Shape{2, 3, 1});
  REQUIRE(mean(x, {1}).to_vector<float>() == std::vector<float>{4, 5, 6, 7, 16, 17, 18, 19});
  REQUIRE(max(x, 1).to_vector<float>() == std::vector<float>{8, 9, 10, 11, 20, 21, 22, 23});
  REQUIRE(max(x).item<double>() == 23.0);
  // var of 0..3 = 1.25 (population), 5/3 (unbiased).
  require_close(var(x, {2}, 0), full({2, 3}, 1.25), 1e-6, 0);
  require_close(var(x, {2}), full({2, 3}, 5.0 / 3.0), 1e-6, 0);
  // A single element: unbiased var is NaN.
  REQUIRE(std::isnan(var(x, {0, 1, 2}, 24).item<double>()));
  // NaN propagates through max, min and sum, in row and column mode.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> v(40 * 20, 1.0f);
  v[5 * 20 + 7] = nan;
  Tensor y = from_vector(v, {40, 20});
  for (const Tensor& t : {y, y.t().contiguous().t()}) {
    std::vector<float> m0 = max(t, 0).to_vector<float>(), m1 = max(t, 1).to_vector<float>();
    REQUIRE(std::isnan(m0[7]));
    REQUIRE(m0[6] == 1.0f);
    REQUIRE(std::isnan(m1[5]));
    REQUIRE(m1[4] == 1.0f);
    REQUIRE(std::isnan(sum(t).item<double>()));
    Tensor mn = empty({1, 20});
    cpu_backend().reduce(ReduceOp::min, t, 1, mn);
    REQUIRE(std::isnan(mn.to_vector<float>()[7]));
    REQUIRE(mn.to_vector<float>()[8] == 1.0f);
  }
}

TEST_CASE("reduce: argmax takes the first maximum", "[reduce]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor x = from_vector<float>({1, 3, 3, 2,              //
                                 5, 5, 5, 5,              //
                                 -inf, -inf, -inf, -inf,  //
                                 0, nan, 7, nan},
                                {4, 4});
  for (bool reference : {false, true}) {
    std::optional<ReferenceKernelsGuard> guard;
    if (reference) guard.emplace();
    INFO("reference " << reference);
    REQUIRE(argmax(x, 1).to_vector<int64_t>() == std::vector<int64_t>{1, 0, 0, 1});
    REQUIRE(argmax(x, 0).to_vector<int64_t>() == std::vector<int64_t>{1, 3, 3, 3});
    REQUIRE(argmax(x, -1, true).shape() == Shape{4, 1});
    REQUIRE(argmax(x.t(), 0).to_vector<int64_t>() == std::vector<int64_t>{1, 0, 0, 1});
    std::vector<float> m = max(x, 1).to_vector<float>();
    REQUIRE(m[0] == 3.0f);
    REQUIRE(m[2] == -inf);
    REQUIRE(std::isnan(m[3]));
  }
  // Long rows (the vectorised path), ties far apart, and a tie split across
  // the per-thread chunks of one long row.
  std::vector<float> v(3 * 40000, 0.0f);
  v[37] = v[80] = 9.0f;                    // row 0: first at 37
  v[40000 + 39999] = 4.0f;                 // row 1: the last element
  v[80000 + 5] = v[80000 + 30000] = 2.0f;  // row 2: 5
  Tensor y = from_vector(v, {3, 40000});
  for (int threads : {1, 2, 3}) {
    ThreadCount guard(threads);
    REQUIRE(argmax(y, 1).to_vector<int64_t>() == std::vector<int64_t>{37, 39999, 5});
    REQUIRE(argmax(y.reshape({-1}), 0).item<int64_t>() == 37);
    REQUIRE(argmax(y.t(), 0).to_vector<int64_t>() == std::vector<int64_t>{37, 39999, 5});
    REQUIRE(argmax(y.reshape({120000, 1}), 0).item<int64_t>() == 37);
  }
  // The gradient of max goes to the first maximum only.
  Tensor z = from_vector<double>({2, 7, 7, 1}).requires_grad_();
  max(z).backward();
  REQUIRE(z.grad().to_vector<double>() == std::vector<double>{0, 1, 0, 0});
}

TEST_CASE("reduce: long f32 sums and var stay accurate", "[reduce]") {
  // 10^7 copies of 0.1f: a float accumulator would be off by ~10%.
  Tensor x = full({10000000}, 0.1);
  const double expected = 1e7 * double(0.1f);
  double got = sum(x).item<double>();
  REQUIRE(std::fabs(got - expected) <= 1e-6 * expected);
  REQUIRE(std::fabs(mean(x).item<double>() - double(0.1f)) <= 1e-6 * 0.1);
  // Columns: the bias-gradient shape.
  Tensor cols = sum(x.reshape({1000000, 10}), {0});
  require_close(cols, full({10}, 1e6 * double(0.1f)), 1e-6, 0, "column sum");
  // A large offset with a small spread: E[x^2] - E[x]^2 in float would lose
  // every digit; two-pass var keeps them.
  Generator gen(51);
  Tensor y = rand_tensor({100000}, gen, -1.0, 1.0) + 10000.0;
  Tensor ref;
  {
    ReferenceKernelsGuard guard;
    ref = var(y);
  }
  require_close(var(y), ref, 1e-5, 0, "var with a large mean");
  REQUIRE(std::fabs(var(y).item<double>() - 1.0 / 3.0) < 0.01);
}

TEST_CASE("reduce: sum_to undoes broadcasting", "[reduce]") {
  Tensor x = arange(24, DType::f64).reshape({2, 3, 4});  // x[i][j][k] = 12 i + 4 j + k
  REQUIRE(sum_to(x, {2, 3, 4}).to_vector<double>() == x.to_vector<double>());
  // Leading dims vanish: sum_i sum_j (12 i + 4 j + k) = 36 + 24 + 6 k.
  REQUIRE(sum_to(x, {4}).to_vector<double>() == std::vector<double>{60, 66, 72, 78});
  REQUIRE(sum_to(x, {1, 4}).shape() == Shape{1, 4});
  REQUIRE(sum_to(x, {1, 4}).to_vector<double>() == std::vector<double>{60, 66, 72, 78});
  // Over i and k: sum_i sum_k (12 i + 4 j + k) = 48 + 32 j + 12.
  REQUIRE(sum_to(x, {3, 1}).to_vector<double>() == std::vector<double>{60, 92, 124});
  // Over j only: sum_j (12 i + 4 j + k) = 36 i + 12 + 3 k.
  REQUIRE(sum_to(x, {2, 1, 4}).to_vector<double>() ==
          std::vector<double>{12, 15, 18, 21, 48, 51, 54, 57});
  REQUIRE(sum_to(x, {}).dim() == 0);
  REQUIRE(sum_to(x, {}).item<double>() == 276.0);
  REQUIRE(sum_to(x, {1}).item<double>() == 276.0);
  // The gradient of a broadcast add reduces the same way.
  Tensor a = zeros({3, 1}, DType::f64).requires_grad_();
  sum(a + x).backward();
  REQUIRE(a.grad().to_vector<double>() == std::vector<double>{8, 8, 8});
}
