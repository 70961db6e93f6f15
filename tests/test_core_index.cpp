// Joining, splitting and indexing ops: closed-form values, finite-difference
// gradients in f64, and the CPU fast kernels against the reference kernels on
// odd shapes, non-contiguous inputs and sizes large enough for the threaded paths.
#include <random>

#include "core/cpu/cpu_backend.h"
#include "tests/testing.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Uniform integers in [0, bound) of the given shape and index dtype.
Tensor rand_index(const Shape& shape, int64_t bound, Generator& gen, DType dtype = DType::i64) {
  return uniform(shape, 0.0, double(bound), gen, DType::f64).to(dtype);
}

Tensor index_of(const std::vector<int64_t>& values, DType dtype = DType::i64, Shape shape = {}) {
  return from_vector<int64_t>(values, std::move(shape)).to(dtype);
}

std::vector<double> values_of(const Tensor& t) { return t.to_vector<double>(); }

// Odd sizes in [1, 9] for `rank` dims.
Shape odd_shape(std::mt19937& rng, int rank) {
  Shape s;
  for (int i = 0; i < rank; ++i) s.push_back(1 + 2 * int64_t(rng() % 5));
  return s;
}

}  // namespace

TEST_CASE("concat: values along each dim", "[index]") {
  Tensor a = from_vector<float>({1, 2, 3, 4}, {2, 2});
  Tensor b = from_vector<float>({5, 6}, {1, 2});
  REQUIRE(values_of(concat({a, b}, 0)) == std::vector<double>{1, 2, 3, 4, 5, 6});
  Tensor c = from_vector<float>({7, 8, 9, 10, 11, 12}, {2, 3});
  Tensor ac = concat({a, c}, -1);
  REQUIRE(ac.shape() == Shape{2, 5});
  REQUIRE(values_of(ac) == std::vector<double>{1, 2, 7, 8, 9, 3, 4, 10, 11, 12});
  // An empty piece and a transposed (non-contiguous) piece.
  Tensor e = zeros({2, 0});
  Tensor at = a.t();
  REQUIRE(values_of(concat({e, at, e}, 1)) == std::vector<double>{1, 3, 2, 4});
  // Integer tensors take the same path.
  Tensor i = concat({arange(3), arange(2)}, 0);
  REQUIRE(i.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 0, 1});
}

TEST_CASE("concat: gradient of three inputs along several dims", "[index][grad]") {
  Generator gen(11);
  gradcheck(
      [](const TensorList& in) {
        return concat({in[0], in[1], in[2]}, 0);
      },
      {rand_f64({2, 3, 2}, gen), rand_f64({1, 3, 2}, gen), rand_f64({3, 3, 2}, gen)});
  gradcheck(
      [](const TensorList& in) {
        return concat({in[0], in[1], in[2]}, 1);
      },
      {rand_f64({2, 1, 2}, gen), rand_f64({2, 3, 2}, gen), rand_f64({2, 2, 2}, gen)});
  gradcheck(
      [](const TensorList& in) {
        return concat({in[0], in[1], in[2]}, -1) * 3.0;
      },
      {rand_f64({2, 3, 1}, gen), rand_f64({2, 3, 2}, gen), rand_f64({2, 3, 3}, gen)});
  // The same input twice: its gradient is the sum of both slices.
  gradcheck(
      [](const TensorList& in) {
        return concat({in[0], in[1], in[0]}, 0);
      },
      {rand_f64({2, 3}, gen), rand_f64({1, 3}, gen)});
}

TEST_CASE("stack: values and gradient", "[index][grad]") {
  Tensor a = from_vector<float>({1, 2, 3}), b = from_vector<float>({4, 5, 6});
  Tensor s0 = stack({a, b}, 0);
  REQUIRE(s0.shape() == Shape{2, 3});
  REQUIRE(values_of(s0) == std::vector<double>{1, 2, 3, 4, 5, 6});
  Tensor s1 = stack({a, b}, -1);
  REQUIRE(s1.shape() == Shape{3, 2});
  REQUIRE(values_of(s1) == std::vector<double>{1, 4, 2, 5, 3, 6});
  REQUIRE(stack({scalar_tensor(1.0), scalar_tensor(2.0)}, 0).shape() == Shape{2});

  Generator gen(12);
  for (int dim : {0, 1, 2, -1})
    gradcheck(
        [dim](const TensorList& in) {
          return stack({in[0], in[1], in[2]}, dim);
        },
        {rand_f64({2, 3}, gen), rand_f64({2, 3}, gen), rand_f64({2, 3}, gen)});
}

TEST_CASE("split: views with an uneven last piece", "[index][grad]") {
  Tensor x = arange(21, DType::f32).reshape({7, 3});
  TensorList parts = split(x, 3, 0);
  REQUIRE(parts.size() == 3);
  REQUIRE(parts[0].shape() == Shape{3, 3});
  REQUIRE(parts[2].shape() == Shape{1, 3});
  REQUIRE(parts[2].storage() == x.storage());
  REQUIRE(values_of(parts[2]) == std::vector<double>{18, 19, 20});
  TensorList cols = split(x, 2, 1);
  REQUIRE(cols.size() == 2);
  REQUIRE(values_of(cols[1]) == std::vector<double>{2, 5, 8, 11, 14, 17, 20});
  REQUIRE(split(x, 10, 0).size() == 1);

  Generator gen(13);
  // Gradient flows through pieces 0 and 2 only; rows of piece 1 get zeros.
  gradcheck(
      [](const TensorList& in) {
        TensorList p = split(in[0], 3, 0);
        return concat({p[0] * 2.0, p[2]}, 0);
      },
      {rand_f64({7, 3}, gen)});
  gradcheck([](const TensorList& in) { return tanh(split(in[0], 2, -1).back()); },
            {rand_f64({3, 5}, gen)});
  Tensor w = rand_f64({7, 3}, gen).requires_grad_();
  sum(split(w, 3, 0)[1]).backward();
  std::vector<double> g = values_of(w.grad());
  for (int i = 0; i < 21; ++i) REQUIRE(g[i] == (i >= 9 && i < 18 ? 1.0 : 0.0));
}

TEST_CASE("index_select: values, repeated indices, gradient", "[index][grad]") {
  Tensor x = arange(12, DType::f32).reshape({3, 4});
  for (DType it : {DType::i32, DType::i64}) {
    Tensor rows = index_select(x, 0, index_of({2, 0, 2}, it));
    REQUIRE(values_of(rows) == std::vector<double>{8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11});
    Tensor cols = index_select(x, 1, index_of({3, 3, 1}, it));
    REQUIRE(values_of(cols) == std::vector<double>{3, 3, 1, 7, 7, 5, 11, 11, 9});
  }
  REQUIRE(index_select(x, 0, index_of({})).shape() == Shape{0, 4});

  // Repeated rows sum their gradients.
  Tensor w = zeros({3, 2}, DType::f64).requires_grad_();
  sum(index_select(w, 0, index_of({1, 1, 2, 1}))).backward();
  REQUIRE(values_of(w.grad()) == std::vector<double>{0, 0, 3, 3, 1, 1});

  Generator gen(14);
  Tensor idx0 = index_of({4, 0, 4, 2, 4}), idx1 = index_of({1, 1, 0}, DType::i32);
  gradcheck([&](const TensorList& in) { return index_select(in[0], 0, idx0); },
            {rand_f64({5, 3}, gen)});
  gradcheck([&](const TensorList& in) { return index_select(in[0], 1, idx1); },
            {rand_f64({2, 3, 2}, gen)});
  gradcheck([&](const TensorList& in) { return index_select(in[0].t(), -1, idx1); },
            {rand_f64({3, 4}, gen)});
}

TEST_CASE("gather: values along dim 0 and 1, gradient", "[index][grad]") {
  Tensor x = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor i1 = index_of({2, 0, 1, 1}, DType::i64, {2, 2});
  REQUIRE(values_of(gather(x, 1, i1)) == std::vector<double>{3, 1, 5, 5});
  Tensor i0 = index_of({1, 0, 1}, DType::i32, {1, 3});
  REQUIRE(values_of(gather(x, 0, i0)) == std::vector<double>{4, 2, 6});
  // The loss pattern: one class per row.
  Tensor pick = index_of({2, 0}, DType::i64, {2, 1});
  REQUIRE(values_of(gather(x, -1, pick)) == std::vector<double>{3, 4});

  Generator gen(15);
  Tensor g1 = index_of({3, 3, 0, 1, 2, 3}, DType::i64, {3, 2});
  gradcheck([&](const TensorList& in) { return gather(in[0], 1, g1); }, {rand_f64({3, 4}, gen)});
  Tensor g0 = index_of({2, 0, 2, 2, 1, 0}, DType::i32, {2, 3});
  gradcheck([&](const TensorList& in) { return gather(in[0], 0, g0); }, {rand_f64({3, 4}, gen)});
  Tensor g2 = rand_index({2, 2, 5}, 3, gen);
  gradcheck([&](const TensorList& in) { return gather(in[0], 2, g2); }, {rand_f64({2, 3, 3}, gen)});
}

TEST_CASE("embedding: lookups and scatter-add gradient", "[index][grad]") {
  Tensor weight = arange(8, DType::f32).reshape({4, 2});
  for (DType it : {DType::i32, DType::i64}) {
    Tensor ids = index_of({3, 0, 3, 1, 1, 1}, it, {2, 3});
    Tensor out = embedding(weight, ids);
    REQUIRE(out.shape() == Shape{2, 3, 2});
    REQUIRE(values_of(out) == std::vector<double>{6, 7, 0, 1, 6, 7, 2, 3, 2, 3, 2, 3});
    // d sum(out) / d weight[v] = the number of times v occurs.
    Tensor w = zeros({4, 2}, DType::f64).requires_grad_();
    sum(embedding(w, ids)).backward();
    REQUIRE(values_of(w.grad()) == std::vector<double>{1, 1, 3, 3, 0, 0, 2, 2});
  }
  REQUIRE(embedding(weight, index_of({2}, DType::i64, {1}).reshape({})).shape() == Shape{2});

  Generator gen(16);
  Tensor ids = index_of({1, 4, 1, 1, 0, 4}, DType::i64, {2, 3});
  gradcheck([&](const TensorList& in) { return embedding(in[0], ids); }, {rand_f64({5, 3}, gen)});
  Tensor ids32 = index_of({2, 2, 0}, DType::i32);
  gradcheck([&](const TensorList& in) { return embedding(in[0], ids32); }, {rand_f64({3, 4}, gen)});
}

TEST_CASE("embedding: backward writes into the table's gradient destination", "[index][grad]") {
  // Data parallelism points the table's gradient at its bucket: the
  // scatter-add lands there (stale contents cleared), no dense temporary.
  Tensor ids = index_of({3, 0, 3, 1}, DType::i64, {2, 2});
  Tensor w = zeros({4, 2}, DType::f64).requires_grad_();
  Tensor dest = full({4, 2}, -5.0, DType::f64);
  w.set_grad_destination(dest);
  sum(embedding(w, ids) * 2.0).backward();
  REQUIRE(w.grad().data_ptr() == dest.data_ptr());
  REQUIRE(values_of(dest) == std::vector<double>{2, 2, 2, 2, 0, 0, 4, 4});
  // A second pass accumulates there.
  sum(embedding(w, ids)).backward();
  REQUIRE(values_of(dest) == std::vector<double>{3, 3, 3, 3, 0, 0, 6, 6});
  // Tied (two producers): the sum is copied in, the lookup's part intact.
  w.set_grad(Tensor());
  sum(embedding(w, ids) + embedding(w, ids) * 0.5).backward();
  REQUIRE(w.grad().data_ptr() == dest.data_ptr());
  REQUIRE(values_of(dest) == std::vector<double>{1.5, 1.5, 1.5, 1.5, 0, 0, 3, 3});
}

TEST_CASE("index ops: fast kernels match the reference on odd shapes", "[index]") {
  std::mt19937 rng(17);
  Generator gen(17);
  for (int trial = 0; trial < 6; ++trial) {
    int rank = 1 + trial % 3;
    Shape shape = odd_shape(rng, rank);
    int dim = int(rng() % uint32_t(rank));
    INFO("trial " << trial << " shape " << shape_str(shape) << " dim " << dim);
    Tensor x = rand_tensor(shape, gen);
    Tensor x_nc = non_contiguous(x);

    // concat of a contiguous, a non-contiguous and a transposed-then-copied piece.
    Shape other = shape;
    other[dim] = 1 + 2 * int64_t(rng() % 3);
    Tensor y = non_contiguous(rand_tensor(other, gen));
    check_fast_vs_reference(
        [&](const TensorList& in) {
          return concat({in[0], in[1], in[0]}, dim);
        },
        {x, y}, kExact);

    Tensor idx = rand_index({7}, shape[dim], gen, trial % 2 ? DType::i32 : DType::i64);
    for (const Tensor& in : {x, x_nc})
      check_fast_vs_reference([&](const TensorList& t) { return index_select(t[0], dim, idx); },
                              {in}, kExact);

    Shape ishape = shape;
    for (int d = 0; d < rank; ++d)
      if (d != dim) ishape[d] = 1 + int64_t(rng() % uint64_t(shape[d]));
    ishape[dim] = 1 + int64_t(rng() % 6);
    Tensor gidx = rand_index(ishape, shape[dim], gen, trial % 2 ? DType::i64 : DType::i32);
    for (const Tensor& in : {x, x_nc}) {
      check_fast_vs_reference([&](const TensorList& t) { return gather(t[0], dim, gidx); }, {in},
                              kExact);
      check_fast_vs_reference(
          [&](const TensorList& t) { return gather(t[0], dim, non_contiguous(gidx)); }, {in},
          kExact);
    }
  }
}

TEST_CASE("index ops: threaded fast paths match the reference", "[index]") {
  Generator gen(18);
  // Embedding backward: many repeated ids into a wide table (index_add split
  // across columns), with 2-d i32 ids.
  Tensor table = rand_tensor({37, 515}, gen);
  Tensor ids = rand_index({9, 41}, 37, gen, DType::i32);
  check_fast_vs_reference([&](const TensorList& in) { return embedding(in[0], ids); }, {table},
                          kExact);
  // index_add split over the outer extent (dim 1 of a 3-d tensor).
  Tensor x3 = rand_tensor({45, 13, 61}, gen);
  Tensor idx = rand_index({29}, 13, gen);
  check_fast_vs_reference([&](const TensorList& in) { return index_select(in[0], 1, idx); }, {x3},
                          kExact);
  check_fast_vs_reference([&](const TensorList& in) { return index_select(in[0], 2, idx); }, {x3},
                          kExact);
  // Loss / max-backward pattern: one index per row, many rows.
  Tensor logits = rand_tensor({40001, 7}, gen);
  Tensor target = rand_index({40001, 1}, 7, gen);
  check_fast_vs_reference([&](const TensorList& in) { return gather(in[0], 1, target); }, {logits},
                          kExact);
  // Several indices per line along dim 0 (repeated destinations within a line).
  Tensor wide = rand_tensor({5, 40003}, gen);
  Tensor rows = rand_index({4, 40003}, 5, gen);
  check_fast_vs_reference([&](const TensorList& in) { return gather(in[0], 0, rows); }, {wide},
                          kExact);
  // Concat beyond the copy grain, along an inner dim, one piece non-contiguous.
  Tensor a = rand_tensor({301, 257}, gen), b = non_contiguous(rand_tensor({301, 3}, gen));
  Tensor c = rand_tensor({301, 129}, gen);
  check_fast_vs_reference(
      [&](const TensorList& in) {
        return concat({in[0], in[1], in[2]}, 1);
      },
      {a, b, c}, kExact);
}

TEST_CASE("index ops: bf16 and integer tensors", "[index]") {
  Generator gen(19);
  Tensor table = rand_tensor({11, 33}, gen, -1.0, 1.0, DType::bf16);
  Tensor ids = rand_index({5, 3}, 11, gen);
  check_fast_vs_reference([&](const TensorList& in) { return embedding(in[0], ids); }, {table},
                          kExact);
  Tensor labels = from_vector<int64_t>({10, 11, 12, 13});
  REQUIRE(index_select(labels, 0, index_of({3, 3, 0})).to_vector<int64_t>() ==
          std::vector<int64_t>{13, 13, 10});
  REQUIRE(gather(labels, 0, index_of({1, 2})).to_vector<int64_t>() == std::vector<int64_t>{11, 12});
}

TEST_CASE("index kernels: strided destinations and sources", "[index]") {
  Generator gen(20);
  // index_add into a non-contiguous destination from a non-contiguous source.
  Tensor base = rand_tensor({6, 9}, gen);
  Tensor src = non_contiguous(rand_tensor({6, 5}, gen));
  Tensor idx = index_of({8, 0, 8, 3, 8});
  Tensor fast = non_contiguous(base), ref = non_contiguous(base);
  cpu_backend().index_add(fast, 1, idx, src);
  reference_backend().index_add(ref, 1, idx, src);
  require_close(fast, ref, 0, 0, "index_add");
  // scatter_add into a transposed destination, the source larger than index.
  Tensor dst = rand_tensor({7, 4}, gen).t();
  Tensor big = rand_tensor({4, 6}, gen);
  Tensor where = rand_index({3, 5}, 7, gen, DType::i32);
  Tensor fast_dst = dst.contiguous().t().contiguous().t(), ref_dst = dst.contiguous();
  cpu_backend().scatter_add(fast_dst, 1, where, big);
  reference_backend().scatter_add(ref_dst, 1, where, big);
  REQUIRE(!fast_dst.is_contiguous());
  require_close(fast_dst, ref_dst, 0, 0, "scatter_add");
}
